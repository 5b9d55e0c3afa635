//! Scratch memory mapped straight from the kernel and unmapped on drop.
#![allow(unsafe_code)]

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

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
