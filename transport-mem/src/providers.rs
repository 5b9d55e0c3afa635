//! The device-memory providers this process knows, so memory given by
//! address alone (Mooncake's `register_memory(addr, len)`, a NIXL `"VRAM"`
//! descriptor, `tensor.data_ptr()`) can be told apart: device memory of an
//! installed provider, or host memory.
//!
//! Providers are asked in the order they were installed; the first that
//! claims the whole range ([`DeviceMemory::device_of`]) owns it. With the
//! `cuda` feature, the first lookup after the application loaded the CUDA
//! driver installs [`crate::CudaDevices`] where a device is present (once
//! per process); tests install [`crate::FakeDevice`]s.

use std::sync::{Arc, OnceLock, RwLock};

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
    cuda_once();
    let all = PROVIDERS.read().unwrap_or_else(|e| e.into_inner());
    all.iter().find_map(|p| p.device_of(addr, len).map(|d| (p.clone(), d)))
}

/// Why the CUDA provider is not installed although a driver is present
/// (`cuInit` failed, say); `None` when it is installed, when there is no
/// driver, or in a build without the `cuda` feature.
pub fn cuda_problem() -> Option<&'static str> {
    CUDA.get().and_then(|r| r.as_ref().err()).map(String::as_str)
}

static CUDA: OnceLock<Result<(), String>> = OnceLock::new();

/// Starts CUDA once per process (with the `cuda` feature), and only once
/// the driver library is loaded (by the application's CUDA runtime, torch
/// say): before that no device memory can exist, and a process that moves
/// host memory only never starts the driver or makes a context.
fn cuda_once() {
    #[cfg(feature = "cuda")]
    if CUDA.get().is_none() && crate::cuda::driver_loaded() {
        CUDA.get_or_init(|| match crate::cuda::CudaDevices::open() {
            Ok(Some(d)) => {
                install(Arc::new(d));
                Ok(())
            }
            Ok(None) => Ok(()),
            Err(e) => Err(e.to_string()),
        });
    }
}

/// Names of the installed providers, in the order they are asked.
pub fn names() -> Vec<String> {
    cuda_once();
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
        let host = [0u8; 64];
        assert!(find(host.as_ptr() as u64, 64).is_none(), "host memory is no provider's");
        assert!(find(xa, 1 << 20).is_none(), "a range running off the device is not claimed");
        uninstall(&pa);
        uninstall(&pb);
        assert!(find(xa, 4096).is_none());
        assert!(find(xb, 4096).is_none());
    }
}
