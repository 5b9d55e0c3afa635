//! An owned, page-aligned, zero-initialised allocation.
#![allow(unsafe_code)]

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::device::DeviceMemory;
use crate::error::MemError;
use crate::pages::PageBuf;
use crate::region::MemoryRegion;

/// Alignment of every [`Buffer`]: one page, so RDMA registration pins whole
/// pages and O_DIRECT-style users are happy.
const ALIGN: usize = 4096;

/// Buffers of this many bytes or more are mappings of their own (zero pages
/// from the kernel, returned to it when freed). From the allocator, a freed
/// staging pool or KV buffer of many MiB stays in the process: glibc raises
/// its mapping threshold after the first large free, and later ones come
/// from heaps it rarely trims (the RDMA suite's two-rail pass, which makes
/// and frees a node's 16 MiB staging pools on every restart, peaked at
/// 1.19 GiB with every buffer from the allocator, 0.83 GiB with this). The
/// same bound as glibc's default threshold.
const MAP_FROM: usize = 128 << 10;

/// Owned memory for transfers. Cheap to clone (a reference count); the
/// allocation is freed when the last clone and the last [`MemoryRegion`]
/// made from it are dropped, so a transport that still holds a region can
/// never write into freed memory.
#[derive(Clone)]
pub struct Buffer {
    inner: Arc<Allocation>,
}

pub(crate) struct Allocation {
    ptr: NonNull<u8>,
    layout: Layout,
    /// The mapping holding the bytes ([`MAP_FROM`] bytes and more), rather
    /// than the allocator: dropped, it goes back to the kernel.
    mapped: Option<PageBuf>,
    /// The provider that pinned the allocation ([`Buffer::pinned`]),
    /// unpinned before it is freed.
    pinned_by: Option<Arc<dyn DeviceMemory>>,
}

// SAFETY: the allocation is plain bytes with no thread affinity; all access
// goes through `MemoryRegion`, which copies with raw pointers and never hands
// out references, so sharing across threads cannot create aliasing `&mut`.
unsafe impl Send for Allocation {}
// SAFETY: as above; `&Allocation` only exposes the address.
unsafe impl Sync for Allocation {}

impl Allocation {
    /// `len` zeroed bytes aligned to a page, not pinned.
    fn new(len: usize) -> Result<Self, MemError> {
        if len == 0 {
            return Err(MemError::ZeroLength);
        }
        let layout = Layout::from_size_align(len, ALIGN).map_err(|_| MemError::AllocFailed { len })?;
        if len >= MAP_FROM {
            let pages = PageBuf::new(len)?;
            let ptr = NonNull::new(pages.as_mut_ptr()).ok_or(MemError::AllocFailed { len })?;
            return Ok(Self { ptr, layout, mapped: Some(pages), pinned_by: None });
        }
        // SAFETY: `layout` has a non-zero size (checked above).
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or(MemError::AllocFailed { len })?;
        Ok(Self { ptr, layout, mapped: None, pinned_by: None })
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        if let Some(p) = self.pinned_by.take() {
            // SAFETY: this provider pinned exactly this allocation in
            // `Buffer::pinned` and nothing unpinned it since; it is freed
            // only below, after this returns. This is the last owner, so
            // no region (hence no copy) of it is left.
            unsafe { p.unpin_host(self.ptr.as_ptr() as u64) };
        }
        if self.mapped.is_some() {
            return; // unmapped when the field drops, after the unpin above
        }
        // SAFETY: `ptr` came from `alloc_zeroed(self.layout)` in `Allocation::new`
        // and is freed exactly once, here, when the last owner drops.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

impl Buffer {
    /// Allocates `len` zeroed bytes aligned to a page.
    ///
    /// Returns [`MemError::ZeroLength`] for `len == 0` and
    /// [`MemError::AllocFailed`] when the allocator refuses (the caller can
    /// retry with less).
    pub fn new(len: usize) -> Result<Self, MemError> {
        Ok(Self { inner: Arc::new(Allocation::new(len)?) })
    }

    /// [`Buffer::new`], pinned for `provider`'s copies
    /// ([`DeviceMemory::pin_host`]) until the last clone and region of it
    /// are gone (unpinned before it is freed): host memory that staged
    /// device copies go through. A provider that does not pin leaves it
    /// unpinned ([`Buffer::is_pinned`]); one that fails to pin gives its
    /// error (the memory is freed).
    pub fn pinned(len: usize, provider: &Arc<dyn DeviceMemory>) -> Result<Self, MemError> {
        let mut a = Allocation::new(len)?;
        // SAFETY: `a` alone owns `ptr .. ptr + len` (just allocated); it
        // is freed only in `Allocation::drop`, which first unpins it once
        // `pinned_by` is set (right below, with nothing in between that
        // can fail).
        if unsafe { provider.pin_host(a.ptr.as_ptr() as u64, len) }? {
            a.pinned_by = Some(provider.clone());
        }
        Ok(Self { inner: Arc::new(a) })
    }

    /// Whether a provider pinned it ([`Buffer::pinned`]).
    pub fn is_pinned(&self) -> bool {
        self.inner.pinned_by.is_some()
    }

    /// Allocates a buffer holding a copy of `bytes`.
    pub fn from_slice(bytes: &[u8]) -> Result<Self, MemError> {
        let buf = Self::new(bytes.len())?;
        buf.region().write_at(0, bytes)?;
        Ok(buf)
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.layout.size()
    }

    /// Always false: a buffer has at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Address of the first byte (for registration and remote addressing).
    pub fn addr(&self) -> u64 {
        self.inner.ptr.as_ptr() as u64
    }

    /// A region covering the whole buffer that keeps the allocation alive.
    pub fn region(&self) -> MemoryRegion {
        MemoryRegion::from_owner(self.addr(), self.len(), self.inner.clone())
    }

    /// Copies `dst.len()` bytes starting at `offset` into `dst`.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<(), MemError> {
        self.region().read_at(offset, dst)
    }

    /// Copies `src` into the buffer at `offset`.
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<(), MemError> {
        self.region().write_at(offset, src)
    }

    /// A copy of the whole buffer.
    pub fn to_vec(&self) -> Vec<u8> {
        self.region().to_vec()
    }

    /// Sets every byte to `byte`.
    pub fn fill(&self, byte: u8) {
        self.region().fill(byte)
    }
}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer").field("addr", &format_args!("{:#x}", self.addr())).field("len", &self.len()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_and_aligned() {
        let b = Buffer::new(10_000).unwrap();
        assert_eq!(b.addr() % ALIGN as u64, 0);
        assert!(b.to_vec().iter().all(|&x| x == 0));
    }

    #[test]
    fn large_buffers_are_mappings_of_their_own() {
        for len in [MAP_FROM - 1, MAP_FROM, (4 << 20) + 123] {
            let b = Buffer::new(len).unwrap();
            assert_eq!(b.inner.mapped.is_some(), len >= MAP_FROM, "{len}");
            assert_eq!(b.len(), len);
            assert_eq!(b.addr() % ALIGN as u64, 0);
            assert!(b.to_vec().iter().all(|&x| x == 0));
            b.write_at(len - 3, b"end").unwrap();
            let r = b.region();
            drop(b);
            assert_eq!(r.to_vec()[len - 3..], *b"end", "a region keeps the mapping");
        }
    }

    #[test]
    fn zero_length_is_an_error() {
        assert!(matches!(Buffer::new(0), Err(MemError::ZeroLength)));
    }

    #[test]
    fn pinned_until_the_last_region_is_gone() {
        let dev = Arc::new(crate::FakeDevice::new(0, 4096).unwrap());
        let provider: Arc<dyn DeviceMemory> = dev.clone();
        let b = Buffer::pinned(10_000, &provider).unwrap();
        assert!(b.is_pinned());
        assert_eq!(dev.pinned(), 1);
        let r = b.region();
        drop(b);
        assert_eq!(dev.pinned(), 1, "unpinned while a region of it lives");
        r.write_at(0, b"still here").unwrap();
        drop(r);
        assert_eq!(dev.pinned(), 0);
        assert!(!Buffer::new(10).unwrap().is_pinned());
    }

    #[test]
    fn region_outlives_buffer() {
        let b = Buffer::from_slice(b"hello").unwrap();
        let r = b.region();
        drop(b);
        assert_eq!(r.to_vec(), b"hello");
    }
}
