//! Scratch memory mapped straight from the kernel and unmapped on drop.
#![allow(unsafe_code)]

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::Arc;

use crate::device::DeviceMemory;
use crate::error::MemError;

/// A private anonymous mapping of `len` bytes, zero-filled by the kernel
/// and handed back to it (`munmap`) when dropped, whatever the process's
/// allocator does with its own free lists.
///
/// For large scratch buffers whose memory must really be returned once a
/// burst of work is over: a server's per-connection staging and output
/// buffers. (glibc's malloc raises its mmap threshold after the first
/// large free, after which buffers of that size come from arenas that
/// fragment and keep their pages resident.) Creating one is a system call
/// and page faults on first touch, so keep them in a pool.
pub struct PageBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a `PageBuf` uniquely owns its mapping (like `Box<[u8]>`): no other
// handle to the memory exists, so moving it to another thread is sound.
unsafe impl Send for PageBuf {}
// SAFETY: `&PageBuf` only gives `&[u8]`; shared reads of plain bytes from
// several threads are sound.
unsafe impl Sync for PageBuf {}

impl PageBuf {
    /// Maps `len` zeroed bytes (rounded up to whole pages by the kernel;
    /// the buffer exposes exactly `len`). [`MemError::ZeroLength`] for
    /// `len == 0`, [`MemError::AllocFailed`] when the kernel refuses.
    pub fn new(len: usize) -> Result<Self, MemError> {
        if len == 0 {
            return Err(MemError::ZeroLength);
        }
        // SAFETY: a fresh private anonymous mapping at an address the kernel
        // chooses; no existing memory is touched. The result is checked
        // against MAP_FAILED before use.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(MemError::AllocFailed { len });
        }
        let ptr = NonNull::new(p.cast::<u8>()).ok_or(MemError::AllocFailed { len })?;
        Ok(Self { ptr, len })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a buffer has at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The first byte's address (valid while `self` lives; for owners
    /// that hand out raw regions of it, as [`crate::Buffer`] does).
    pub(crate) fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Deref for PageBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr .. ptr + len` is a live mapping this value owns,
        // readable and initialised (zero-filled by the kernel, then only
        // written through `deref_mut`); the borrow of `self` keeps it
        // mapped for the slice's lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for PageBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes this the only
        // reference to the mapping while the slice lives.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for PageBuf {
    fn drop(&mut self) {
        // SAFETY: the mapping came from `mmap(len)` in `new`, is owned by
        // this value alone and is unmapped exactly once, here; no slice
        // into it can outlive `self`.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

impl fmt::Debug for PageBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PageBuf")
            .field("addr", &format_args!("{:#x}", self.ptr.as_ptr() as usize))
            .field("len", &self.len)
            .finish()
    }
}

/// A [`PageBuf`] pinned for a device provider's copies
/// ([`DeviceMemory::pin_host`]) while it lives, and unpinned before its
/// pages are unmapped: a staging buffer between a socket and device memory.
pub struct PinnedBuf {
    buf: PageBuf,
    /// The provider that pinned it (`None`: not pinned).
    pinned_by: Option<Arc<dyn DeviceMemory>>,
}

impl PinnedBuf {
    /// Maps `len` zeroed bytes and pins them through `provider` (when
    /// given). A provider that does not pin leaves the buffer unpinned;
    /// one that fails to pin gives its error (the pages are unmapped).
    pub fn new(len: usize, provider: Option<&Arc<dyn DeviceMemory>>) -> Result<Self, MemError> {
        let buf = PageBuf::new(len)?;
        let Some(p) = provider else { return Ok(Self { buf, pinned_by: None }) };
        let addr = buf.ptr.as_ptr() as u64;
        // SAFETY: `addr .. addr + len` is the mapping `buf` owns; it stays
        // mapped until `drop` has unpinned it (the field is dropped after
        // `Drop::drop` runs).
        let pinned = unsafe { p.pin_host(addr, len) }?;
        Ok(Self { buf, pinned_by: pinned.then(|| p.clone()) })
    }

    /// Whether a provider pinned it.
    pub fn pinned(&self) -> bool {
        self.pinned_by.is_some()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Whether it has no byte.
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
}

impl Deref for PinnedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf
    }
}

impl DerefMut for PinnedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.buf
    }
}

impl fmt::Debug for PinnedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedBuf").field("len", &self.buf.len()).field("pinned", &self.pinned()).finish()
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        if let Some(p) = self.pinned_by.take() {
            // SAFETY: this provider pinned exactly this mapping in `new`
            // and nothing unpinned it since; the pages are unmapped only
            // after this (when `buf` drops), and no copy can still use
            // them (copies borrow the buffer, so none outlives it).
            unsafe { p.unpin_host(self.buf.ptr.as_ptr() as u64) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_writable_and_exact_length() {
        let mut b = PageBuf::new(10_000).unwrap();
        assert_eq!(b.len(), 10_000);
        assert!(b.iter().all(|&x| x == 0));
        b[9_999] = 7;
        b[..4].copy_from_slice(b"abcd");
        assert_eq!(&b[..4], b"abcd");
        assert_eq!(b[9_999], 7);
    }

    #[test]
    fn zero_length_is_an_error() {
        assert!(matches!(PageBuf::new(0), Err(MemError::ZeroLength)));
    }

    #[test]
    fn moves_across_threads() {
        let mut b = PageBuf::new(4096).unwrap();
        b[0] = 1;
        let b = std::thread::spawn(move || {
            let mut b = b;
            b[1] = 2;
            b
        })
        .join()
        .unwrap();
        assert_eq!(&b[..2], &[1, 2]);
    }
}
