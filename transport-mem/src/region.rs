//! A checked view of memory that the engine may read and write.
#![allow(unsafe_code)]

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use crate::device::{DeviceMemory, MemoryKind};
use crate::error::MemError;

/// A contiguous range of memory the engine may copy into and out of.
///
/// Cloning is cheap. A region made from a [`crate::Buffer`] keeps the
/// allocation alive; one made by [`MemoryRegion::from_raw`] relies on its
/// caller's promise instead.
#[derive(Clone)]
pub struct MemoryRegion {
    addr: u64,
    len: usize,
    _owner: Option<Arc<dyn Any + Send + Sync>>,
    /// Device memory: its index and the provider every access goes through
    /// (the host never dereferences `addr`).
    device: Option<(u32, Arc<dyn DeviceMemory>)>,
}

impl MemoryRegion {
    pub(crate) fn from_owner(addr: u64, len: usize, owner: Arc<dyn Any + Send + Sync>) -> Self {
        Self { addr, len, _owner: Some(owner), device: None }
    }

    /// A region over memory the engine does not own, such as a GPU-host
    /// staging buffer or a tensor of an inference engine (`tensor.data_ptr()`).
    ///
    /// # Safety
    ///
    /// From this call until the region is unregistered from every transport
    /// *and* every batch that names it has reached a terminal state (and all
    /// clones of the returned value are dropped), the caller guarantees that:
    ///
    /// * `addr .. addr + len` is valid, allocated memory of this process that
    ///   may be read and written (it is not freed, unmapped or shrunk);
    /// * no Rust reference (`&[u8]`/`&mut [u8]`) to that range is used while a
    ///   transfer touching it is in flight; plain concurrent access from C,
    ///   CUDA or Python is fine and sees unspecified bytes of the range being
    ///   transferred, as with DMA.
    pub unsafe fn from_raw(addr: u64, len: usize) -> Result<Self, MemError> {
        if len == 0 {
            return Err(MemError::ZeroLength);
        }
        if addr == 0 || addr.checked_add(len as u64).is_none() {
            return Err(MemError::BadRange { addr, len: len as u64 });
        }
        Ok(Self { addr, len, _owner: None, device: None })
    }

    /// A region of device memory (a CUDA allocation, a fake device's) at
    /// the device address `addr`. The host never touches it: every access
    /// the engine makes through the region is a copy by `provider`.
    /// [`MemError::NotDeviceMemory`] unless the provider owns the whole
    /// range.
    ///
    /// # Safety
    ///
    /// As for [`MemoryRegion::from_raw`], with device memory: the range
    /// stays allocated on its device (not freed, not reused) until the
    /// region is unregistered everywhere, every batch naming it is terminal
    /// and every clone is dropped.
    pub unsafe fn from_device(provider: Arc<dyn DeviceMemory>, addr: u64, len: usize) -> Result<Self, MemError> {
        if len == 0 {
            return Err(MemError::ZeroLength);
        }
        if addr == 0 || addr.checked_add(len as u64).is_none() {
            return Err(MemError::BadRange { addr, len: len as u64 });
        }
        let Some(d) = provider.device_of(addr, len as u64) else {
            return Err(MemError::NotDeviceMemory { addr, len: len as u64, provider: provider.name().to_string() });
        };
        Ok(Self { addr, len, _owner: None, device: Some((d, provider)) })
    }

    /// The same range taken for host memory, its provider forgotten: what
    /// a backend that ignores memory kinds would do. Test-only (feature
    /// `bugs`, never in a program): it exists so the conformance suite can
    /// prove that it catches such a backend. Only memory of a
    /// [`crate::FakeDevice`] is forgotten, whose pages are mapped
    /// `PROT_NONE`: the first access through the result is stopped by the
    /// kernel (SIGSEGV, the process dies) before a byte moves. Any other
    /// region comes back unchanged.
    #[cfg(feature = "bugs")]
    pub fn forget_device(&self) -> MemoryRegion {
        match &self.device {
            Some((_, p)) if p.name() == "fake" => Self { device: None, ..self.clone() },
            _ => self.clone(),
        }
    }

    /// Where the bytes live.
    pub fn kind(&self) -> MemoryKind {
        self.device.as_ref().map_or(MemoryKind::Host, |(d, _)| MemoryKind::Device(*d))
    }

    /// The provider of a device region (`None` for host memory).
    pub fn provider(&self) -> Option<&Arc<dyn DeviceMemory>> {
        self.device.as_ref().map(|(_, p)| p)
    }

    /// A dma-buf exporting this device region ([`DeviceMemory::export_dmabuf`]);
    /// `Ok(None)` for host memory or where the provider cannot export it.
    pub fn export_dmabuf(&self) -> Result<Option<crate::DmaBuf>, MemError> {
        match &self.device {
            Some((_, p)) => p.export_dmabuf(self.addr, self.len as u64),
            None => Ok(None),
        }
    }

    /// The part `offset .. offset + len` of this region, keeping the same
    /// owner alive: the safe way to register or address a sub-range (guard
    /// bytes around a region, overlapping registrations in tests).
    pub fn sub(&self, offset: usize, len: usize) -> Result<MemoryRegion, MemError> {
        if len == 0 {
            return Err(MemError::ZeroLength);
        }
        self.check(offset as u64, len as u64)?;
        Ok(Self { addr: self.addr + offset as u64, len, _owner: self._owner.clone(), device: self.device.clone() })
    }

    /// Address of the first byte.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: regions have at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Checks that `offset .. offset + len` lies inside the region, without
    /// overflow. Every accessor calls this first.
    pub fn check(&self, offset: u64, len: u64) -> Result<(), MemError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len as u64 => Ok(()),
            _ => Err(MemError::OutOfBounds { offset, len, region_len: self.len as u64 }),
        }
    }

    /// Copies `dst.len()` bytes from `offset` into `dst` (for device
    /// memory: a copy by its provider).
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<(), MemError> {
        self.check(offset as u64, dst.len() as u64)?;
        if let Some((_, p)) = &self.device {
            return p.copy_to_host(self.addr + offset as u64, dst);
        }
        // SAFETY: the range was bounds-checked against `len`, and the region's
        // constructor guarantees `addr .. addr + len` is live memory (owned via
        // `_owner`, or promised by `from_raw`'s caller). `dst` is a distinct
        // Rust allocation, so the ranges cannot overlap.
        unsafe {
            std::ptr::copy_nonoverlapping((self.addr as usize + offset) as *const u8, dst.as_mut_ptr(), dst.len());
        }
        Ok(())
    }

    /// Copies `src` into the region at `offset` (for device memory: a copy
    /// by its provider).
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<(), MemError> {
        self.check(offset as u64, src.len() as u64)?;
        if let Some((_, p)) = &self.device {
            return p.copy_from_host(src, self.addr + offset as u64);
        }
        // SAFETY: bounds checked as in `read_at`; `src` is a Rust slice and
        // therefore not part of the engine-managed range being written, unless
        // the caller broke `from_raw`'s contract by holding a reference to it.
        unsafe {
            std::ptr::copy(src.as_ptr(), (self.addr as usize + offset) as *mut u8, src.len());
        }
        Ok(())
    }

    /// Copies `len` bytes from `src` at `src_offset` into this region at
    /// `dst_offset` (memory-to-memory, as a loopback transfer does). The
    /// ranges may overlap.
    pub fn copy_from(
        &self,
        dst_offset: usize,
        src: &MemoryRegion,
        src_offset: usize,
        len: usize,
    ) -> Result<(), MemError> {
        self.check(dst_offset as u64, len as u64)?;
        src.check(src_offset as u64, len as u64)?;
        match (&self.device, &src.device) {
            (None, None) => {}
            (Some((_, a)), Some((_, b))) if Arc::ptr_eq(a, b) => {
                return a.copy_on_device(self.addr + dst_offset as u64, src.addr + src_offset as u64, len);
            }
            // One copy by the provider straight between host memory and
            // the device (how a staging buffer is filled and drained).
            (Some((_, p)), None) => {
                // SAFETY: `src .. + len` was bounds-checked against a live
                // host region (its constructor's guarantee); the slice
                // lives only for the provider's synchronous copy, and a
                // device range never aliases host memory.
                let from = unsafe { std::slice::from_raw_parts((src.addr as usize + src_offset) as *const u8, len) };
                return p.copy_from_host(from, self.addr + dst_offset as u64);
            }
            (None, Some((_, p))) => {
                // SAFETY: as above, for the host destination: checked,
                // live, and written only by this synchronous copy (the
                // engine does not hand one range to two transfers at once;
                // concurrent writers give unspecified bytes, as with DMA).
                let to = unsafe { std::slice::from_raw_parts_mut((self.addr as usize + dst_offset) as *mut u8, len) };
                return p.copy_to_host(src.addr + src_offset as u64, to);
            }
            _ => {
                // Device memory on one side (or two providers): through the
                // host, in bounded pieces.
                let mut bounce = vec![0u8; len.min(BOUNCE)];
                let mut done = 0;
                while done < len {
                    let n = (len - done).min(BOUNCE);
                    src.read_at(src_offset + done, &mut bounce[..n])?;
                    self.write_at(dst_offset + done, &bounce[..n])?;
                    done += n;
                }
                return Ok(());
            }
        }
        // SAFETY: both ranges were bounds-checked against their live regions;
        // `ptr::copy` allows overlap.
        unsafe {
            std::ptr::copy(
                (src.addr as usize + src_offset) as *const u8,
                (self.addr as usize + dst_offset) as *mut u8,
                len,
            );
        }
        Ok(())
    }

    /// Sets every byte to `byte`. For device memory the copies can fail:
    /// use [`MemoryRegion::write_at`] where that matters.
    pub fn fill(&self, byte: u8) {
        if self.device.is_some() {
            let chunk = vec![byte; self.len.min(BOUNCE)];
            let mut done = 0;
            while done < self.len {
                let n = (self.len - done).min(BOUNCE);
                if self.write_at(done, &chunk[..n]).is_err() {
                    return;
                }
                done += n;
            }
            return;
        }
        // SAFETY: the whole region is live memory by construction.
        unsafe { std::ptr::write_bytes(self.addr as usize as *mut u8, byte, self.len) }
    }

    /// A copy of the whole region (zeros where a device copy failed: use
    /// [`MemoryRegion::read_at`] where that matters).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len];
        // Cannot fail: the range is exactly the region.
        let _ = self.read_at(0, &mut v);
        v
    }

    /// Address range `[addr, addr + len)` contains `[a, a + l)`.
    pub fn contains(&self, a: u64, l: u64) -> bool {
        a >= self.addr && a.checked_add(l).is_some_and(|end| end <= self.addr + self.len as u64)
    }

    /// Whether the two regions share at least one byte.
    pub fn overlaps(&self, other: &MemoryRegion) -> bool {
        self.addr < other.addr + other.len as u64 && other.addr < self.addr + self.len as u64
    }
}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("owned", &self._owner.is_some())
            .field("kind", &self.kind())
            .finish()
    }
}

/// Largest host bounce buffer of a copy between host and device regions.
const BOUNCE: usize = 4 << 20;

#[cfg(test)]
mod tests {
    use crate::Buffer;

    use super::*;

    #[test]
    fn bounds_and_overflow_are_checked() {
        let b = Buffer::new(16).unwrap();
        let r = b.region();
        assert!(r.check(0, 16).is_ok());
        assert!(r.check(1, 16).is_err());
        assert!(r.check(u64::MAX, 2).is_err());
        let mut out = [0u8; 4];
        assert!(r.read_at(14, &mut out).is_err());
        assert!(r.write_at(13, &[1, 2, 3, 4]).is_err());
        assert!(r.to_vec().iter().all(|&x| x == 0), "failed write touched nothing");
    }

    #[test]
    fn raw_rejects_null_and_overflow() {
        // SAFETY: these calls fail validation before any memory is touched.
        unsafe {
            assert!(MemoryRegion::from_raw(0, 8).is_err());
            assert!(MemoryRegion::from_raw(u64::MAX - 2, 8).is_err());
            assert!(MemoryRegion::from_raw(4096, 0).is_err());
        }
    }

    #[test]
    fn overlap() {
        let b = Buffer::new(100).unwrap();
        let r = b.region();
        // SAFETY: sub-ranges of a live buffer that outlives the regions.
        let (a, c) = unsafe {
            (MemoryRegion::from_raw(r.addr() + 10, 10).unwrap(), MemoryRegion::from_raw(r.addr() + 19, 5).unwrap())
        };
        assert!(a.overlaps(&c));
        assert!(r.contains(r.addr() + 90, 10));
        assert!(!r.contains(r.addr() + 91, 10));
    }
}
