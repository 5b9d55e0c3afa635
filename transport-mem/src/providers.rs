//! The device-memory providers this process knows, so memory given by
//! address alone (Mooncake's `register_memory(addr, len)`, a NIXL `"VRAM"`
//! descriptor, `tensor.data_ptr()`) can be told apart: device memory of an
//! installed provider, or host memory.
//!
//! Providers are asked in the order they were installed; the first that
//! claims the whole range ([`DeviceMemory::device_of`]) owns it. A CUDA
//! provider is installed by whoever finds a driver and a device (the
//! Python bindings at import, with their `cuda` feature); tests install
//! [`crate::FakeDevice`]s.

use std::sync::{Arc, RwLock};

use crate::device::DeviceMemory;

static PROVIDERS: RwLock<Vec<Arc<dyn DeviceMemory>>> = RwLock::new(Vec::new());

/// Adds `provider` to the process-wide list (once: installing the same
/// provider again does nothing).
pub fn install(provider: Arc<dyn DeviceMemory>) {
    let mut all = PROVIDERS.write().unwrap_or_else(|e| e.into_inner());
    if !all.iter().any(|p| Arc::ptr_eq(p, &provider)) {
        all.push(provider);
    }
}

/// Removes `provider` from the list; regions made from it keep working
/// (each holds its provider), new registrations no longer find it.
pub fn uninstall(provider: &Arc<dyn DeviceMemory>) {
    PROVIDERS.write().unwrap_or_else(|e| e.into_inner()).retain(|p| !Arc::ptr_eq(p, provider));
}

/// The installed provider that owns all of `addr .. addr + len`, and the
/// index of the device holding it; `None` for memory no provider claims
/// (host memory, or an address that is nobody's).
pub fn find(addr: u64, len: u64) -> Option<(Arc<dyn DeviceMemory>, u32)> {
    let all = PROVIDERS.read().unwrap_or_else(|e| e.into_inner());
    all.iter().find_map(|p| p.device_of(addr, len).map(|d| (p.clone(), d)))
}

/// Names of the installed providers, in the order they are asked.
pub fn names() -> Vec<String> {
    PROVIDERS.read().unwrap_or_else(|e| e.into_inner()).iter().map(|p| p.name().to_owned()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::FakeDevice;

    #[test]
    fn installed_fake_devices_claim_their_own_memory_only() {
        let a = Arc::new(FakeDevice::new(3, 1 << 16).unwrap());
        let b = Arc::new(FakeDevice::new(4, 1 << 16).unwrap());
        let (pa, pb): (Arc<dyn DeviceMemory>, Arc<dyn DeviceMemory>) = (a.clone(), b.clone());
        let (xa, xb) = (a.alloc(4096).unwrap(), b.alloc(4096).unwrap());
        assert!(find(xa, 4096).is_none(), "nothing installed yet claims it");
        install(pa.clone());
        install(pa.clone());
        install(pb.clone());
        let (p, d) = find(xa, 4096).unwrap();
        assert!(Arc::ptr_eq(&p, &pa));
        assert_eq!(d, 3);
        assert_eq!(find(xb + 8, 64).map(|(_, d)| d), Some(4));
        let host = vec![0u8; 64];
        assert!(find(host.as_ptr() as u64, 64).is_none(), "host memory is no provider's");
        assert!(find(xa, 1 << 20).is_none(), "a range running off the device is not claimed");
        uninstall(&pa);
        uninstall(&pb);
        assert!(find(xa, 4096).is_none());
        assert!(find(xb, 4096).is_none());
    }
}
