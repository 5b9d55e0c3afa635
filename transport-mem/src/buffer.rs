//! An owned, page-aligned, zero-initialised allocation.
#![allow(unsafe_code)]

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::MemError;
use crate::region::MemoryRegion;

/// Alignment of every [`Buffer`]: one page, so RDMA registration pins whole
/// pages and O_DIRECT-style users are happy.
const ALIGN: usize = 4096;

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
}

// SAFETY: the allocation is plain bytes with no thread affinity; all access
// goes through `MemoryRegion`, which copies with raw pointers and never hands
// out references, so sharing across threads cannot create aliasing `&mut`.
unsafe impl Send for Allocation {}
// SAFETY: as above; `&Allocation` only exposes the address.
unsafe impl Sync for Allocation {}

impl Drop for Allocation {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `alloc_zeroed(self.layout)` in `Buffer::new`
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
        if len == 0 {
            return Err(MemError::ZeroLength);
        }
        let layout = Layout::from_size_align(len, ALIGN).map_err(|_| MemError::AllocFailed { len })?;
        // SAFETY: `layout` has a non-zero size (checked above).
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or(MemError::AllocFailed { len })?;
        Ok(Self { inner: Arc::new(Allocation { ptr, layout }) })
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
    fn zero_length_is_an_error() {
        assert!(matches!(Buffer::new(0), Err(MemError::ZeroLength)));
    }

    #[test]
    fn region_outlives_buffer() {
        let b = Buffer::from_slice(b"hello").unwrap();
        let r = b.region();
        drop(b);
        assert_eq!(r.to_vec(), b"hello");
    }
}
