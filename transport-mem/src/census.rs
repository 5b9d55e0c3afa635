//! A census of the process's heap that does not ask the code being
//! counted: [`CountingAlloc`], a global allocator over the system's that
//! counts live allocations and bytes.
//!
//! The conformance suite installs it in its test binaries
//! (`conformance::conformance_main!`, `conformance::census_allocator!`)
//! to find leaks a backend does not count in its own `stats()`: a
//! connection map that keeps one entry per closed segment grows the live
//! allocations by one (or more) each cycle, whatever `stats()` says.
//! Without it installed, [`census`] is `None` and the suite says it cannot
//! take one.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicI64, Ordering};

/// Live allocations and bytes, process-wide, counted by [`CountingAlloc`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Census {
    /// Allocations made and not yet freed.
    pub allocations: i64,
    /// Their bytes (as requested).
    pub bytes: i64,
}

static LIVE: AtomicI64 = AtomicI64::new(0);
static BYTES: AtomicI64 = AtomicI64::new(0);

/// The system allocator, counting. Install it with
/// `#[global_allocator] static A: CountingAlloc = CountingAlloc;`; the
/// counts are two relaxed atomic additions per call.
#[derive(Debug, Default, Clone, Copy)]
pub struct CountingAlloc;

impl CountingAlloc {
    fn took(size: usize) {
        LIVE.fetch_add(1, Ordering::Relaxed);
        BYTES.fetch_add(i64::try_from(size).unwrap_or(i64::MAX), Ordering::Relaxed);
    }

    fn gave(size: usize) {
        LIVE.fetch_sub(1, Ordering::Relaxed);
        BYTES.fetch_sub(i64::try_from(size).unwrap_or(i64::MAX), Ordering::Relaxed);
    }
}

// SAFETY: every call is forwarded unchanged to `System`, which upholds
// `GlobalAlloc`'s contract; the counting around it touches only atomics
// (it never allocates, so it cannot recurse into the allocator).
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's `layout` contract is passed on as is.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            Self::took(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            Self::took(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator (so from `System`) with
        // `layout`, as the caller guarantees.
        unsafe { System.dealloc(ptr, layout) };
        Self::gave(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's guarantees for `ptr`, `layout` and
        // `new_size` are `System.realloc`'s.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            // Still one allocation; only its bytes change.
            let (old, new) = (i64::try_from(layout.size()), i64::try_from(new_size));
            BYTES.fetch_add(new.unwrap_or(i64::MAX).saturating_sub(old.unwrap_or(i64::MAX)), Ordering::Relaxed);
        }
        p
    }
}

/// The live heap now, or `None` when [`CountingAlloc`] is not the global
/// allocator of this process: an allocation of our own must move the
/// count (tried a few times: other threads allocate and free meanwhile).
pub fn census() -> Option<Census> {
    let installed = (0..4).any(|_| {
        let before = LIVE.load(Ordering::SeqCst);
        let probe = std::hint::black_box(Box::new(0u64));
        let during = LIVE.load(Ordering::SeqCst);
        drop(probe);
        during != before
    });
    installed.then(|| Census { allocations: LIVE.load(Ordering::Relaxed), bytes: BYTES.load(Ordering::Relaxed) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_what_goes_through_it_and_knows_it_is_not_installed() {
        // This crate's test binary keeps the system allocator.
        assert_eq!(census(), None);
        let a = CountingAlloc;
        let layout = Layout::from_size_align(64, 8).unwrap_or_else(|_| Layout::new::<u64>());
        let (live, bytes) = (LIVE.load(Ordering::Relaxed), BYTES.load(Ordering::Relaxed));
        // SAFETY: a non-zero layout; the pointer is freed below with it.
        let p = unsafe { a.alloc(layout) };
        assert!(!p.is_null());
        assert_eq!(LIVE.load(Ordering::Relaxed), live + 1);
        assert_eq!(BYTES.load(Ordering::Relaxed), bytes + 64);
        // SAFETY: `p` came from `a.alloc(layout)`.
        let q = unsafe { a.realloc(p, layout, 256) };
        assert!(!q.is_null());
        assert_eq!(LIVE.load(Ordering::Relaxed), live + 1);
        assert_eq!(BYTES.load(Ordering::Relaxed), bytes + 256);
        let grown = Layout::from_size_align(256, 8).unwrap_or(layout);
        // SAFETY: `q` came from the realloc above, now of 256 bytes.
        unsafe { a.dealloc(q, grown) };
        assert_eq!(LIVE.load(Ordering::Relaxed), live);
        assert_eq!(BYTES.load(Ordering::Relaxed), bytes);
    }
}
