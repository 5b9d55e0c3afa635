//! The check that memory registered from Python is host memory this
//! process can read.
//!
//! The serving engines' connectors register their KV cache by address
//! (`tensor.data_ptr()`), and by default that cache is on the GPU. Device
//! memory is found first by its provider (`devmem.rs`); an address no
//! provider claims is taken for host memory, and if it is not (a GPU
//! address with no provider in this process) the TCP backend copying it
//! would crash the process. So such a registration first asks the kernel to read the first and the last byte of the range (two
//! one-byte `process_vm_readv` calls on this process, which answer
//! `EFAULT` instead of faulting), and refuses a range it cannot read.
//! Where that call is not allowed (`ENOSYS`, or `EPERM` under some
//! seccomp profiles) a one-byte `write` from the address into a fresh pipe
//! answers the same question.
//!
//! This is a guard against the common mistake, not a proof: the bytes in
//! between, and whether the memory is writable, are the caller's contract.

use std::io;

use transport_core::{Error, ErrorKind, Result};

/// Refuses `addr .. addr + len` unless this process can read its first and
/// last byte. Null addresses, zero lengths and wrapping ranges pass (the
/// registration's own checks refuse them with their own errors).
pub(crate) fn check_readable(addr: u64, len: u64) -> Result<()> {
    if addr == 0 {
        return Ok(());
    }
    let Some(last) = len.checked_sub(1).and_then(|n| addr.checked_add(n)) else {
        return Ok(());
    };
    let probes: &[u64] = if last == addr { &[addr] } else { &[addr, last] };
    for &a in probes {
        let answer = usize::try_from(a).map_err(|_| io::Error::from_raw_os_error(libc::EFAULT)).and_then(readable);
        let err = match answer {
            Ok(true) => continue,
            Ok(false) => Error::new(
                ErrorKind::Unsupported,
                format!("{a:#x} is not host memory this process can read (GPU memory?)"),
            ),
            Err(e) => {
                Error::new(ErrorKind::Io, format!("cannot check that {a:#x} is host memory this process can read: {e}"))
            }
        };
        return Err(err.with("addr", format_args!("{addr:#x}")).with("len", len));
    }
    Ok(())
}

/// Whether this process can read the byte at `addr`: `Ok(false)` for an
/// address the kernel refuses (`EFAULT`), `Err` when neither way of asking
/// works here.
fn readable(addr: usize) -> io::Result<bool> {
    match vm_readable(addr) {
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOSYS | libc::EPERM)) => pipe_readable(addr),
        r => r,
    }
}

/// `EFAULT` means "not readable"; anything else is an error.
fn efault_is_false(e: io::Error) -> io::Result<bool> {
    if e.raw_os_error() == Some(libc::EFAULT) {
        Ok(false)
    } else {
        Err(e)
    }
}

/// One byte through `process_vm_readv` from this process to itself.
#[cfg(target_os = "linux")]
fn vm_readable(addr: usize) -> io::Result<bool> {
    let pid = libc::pid_t::try_from(std::process::id()).map_err(|_| io::Error::from_raw_os_error(libc::ENOSYS))?;
    let mut byte = 0u8;
    let local = libc::iovec { iov_base: std::ptr::from_mut(&mut byte).cast(), iov_len: 1 };
    let remote = libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: 1 };
    // SAFETY: the kernel writes at most one byte, into `byte`, which lives
    // across the call; `remote` is never dereferenced by this process: the
    // kernel reads through it with fault checking and answers EFAULT for an
    // address that is unmapped or not readable.
    let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
    match n {
        1 => Ok(true),
        // A short read of a one-byte range: nothing readable there.
        0 => Ok(false),
        _ => efault_is_false(io::Error::last_os_error()),
    }
}

#[cfg(not(target_os = "linux"))]
fn vm_readable(_addr: usize) -> io::Result<bool> {
    Err(io::Error::from_raw_os_error(libc::ENOSYS))
}

/// One byte written from `addr` into a fresh pipe (the kernel copies it
/// with fault checking: `EFAULT` for an unreadable address).
fn pipe_readable(addr: usize) -> io::Result<bool> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: `pipe` writes two file descriptors into `fds`, which is two
    // `c_int`s long.
    if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just created by `pipe` and are owned
    // here only; the `OwnedFd`s close them on every return path.
    let (_rx, tx) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: `write` reads one byte at `addr` inside the kernel, which
    // checks the access and answers EFAULT instead of faulting; this
    // process never dereferences `addr`. The pipe is empty, so a one-byte
    // write does not block.
    let n = unsafe { libc::write(tx.as_raw_fd(), addr as *const libc::c_void, 1) };
    match n {
        1 => Ok(true),
        _ => efault_is_false(io::Error::last_os_error()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An anonymous mapping of `len` bytes with protection `prot`.
    struct Map(usize, usize);

    impl Map {
        fn new(len: usize, prot: libc::c_int) -> Self {
            // SAFETY: a fresh anonymous private mapping; no existing memory
            // is touched.
            let p =
                unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) };
            assert_ne!(p, libc::MAP_FAILED);
            Self(p as usize, len)
        }
    }

    impl Drop for Map {
        fn drop(&mut self) {
            // SAFETY: unmaps exactly the mapping `new` made.
            unsafe { libc::munmap(self.0 as *mut libc::c_void, self.1) };
        }
    }

    #[test]
    fn readable_memory_passes_both_ways() {
        let v = vec![7u8; 4096];
        let a = v.as_ptr() as usize;
        assert!(vm_readable(a).unwrap());
        assert!(pipe_readable(a).unwrap());
        assert!(pipe_readable(a + 4095).unwrap());
        check_readable(a as u64, 4096).unwrap();
        check_readable(a as u64, 1).unwrap();
    }

    #[test]
    fn unreadable_memory_is_refused_both_ways() {
        let m = Map::new(8192, libc::PROT_NONE);
        assert!(!vm_readable(m.0).unwrap());
        assert!(!pipe_readable(m.0).unwrap());
        let e = check_readable(m.0 as u64, 8192).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported);
        assert!(e.to_string().contains("not host memory this process can read"), "{e}");
        // Unmapped addresses: the first pages (below mmap_min_addr) and the
        // kernel's half of the address space.
        for gone in [0x1000usize, 0xffff_8000_0000_0000] {
            assert!(!vm_readable(gone).unwrap());
            assert!(!pipe_readable(gone).unwrap());
            assert_eq!(check_readable(gone as u64, 16).unwrap_err().kind(), ErrorKind::Unsupported);
        }
    }

    #[test]
    fn the_last_byte_is_checked_too() {
        let m = Map::new(8192, libc::PROT_READ | libc::PROT_WRITE);
        // SAFETY: the second page of the mapping made above.
        let rc = unsafe { libc::mprotect((m.0 + 4096) as *mut libc::c_void, 4096, libc::PROT_NONE) };
        assert_eq!(rc, 0);
        check_readable(m.0 as u64, 4096).unwrap();
        let e = check_readable(m.0 as u64, 4097).unwrap_err();
        assert!(e.to_string().contains(&format!("{:#x}", m.0 + 4096)), "{e}");
    }
}
