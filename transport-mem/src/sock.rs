//! A socket option the transports need and no safe crate offers:
//! `SO_RCVLOWAT` (how many bytes a TCP socket must hold before the kernel
//! wakes a reactor waiting for it to be readable).
//!
//! The TCP backend raises it on a connection whose bytes a thread reads by
//! polling (so the kernel does not also wake a sleeping runtime thread for
//! every answer), and lowers it to 1 before anything waits on the runtime
//! for that connection again. A non-blocking read returns whatever the
//! socket holds at any setting; only wake-ups (and `poll`/`epoll`
//! readiness) follow the mark. On Linux, lowering the mark wakes a waiter
//! at once if the bytes already there meet it (`tcp_set_rcvlowat`).
#![allow(unsafe_code)]

use std::os::fd::{AsRawFd, BorrowedFd};

/// Sets `SO_RCVLOWAT` on `fd` to `bytes` (at least 1; the kernel caps it
/// at half the socket's receive buffer limit).
pub fn set_recv_lowat(fd: BorrowedFd<'_>, bytes: u32) -> std::io::Result<()> {
    let v = libc::c_int::try_from(bytes.max(1)).unwrap_or(libc::c_int::MAX);
    // SAFETY: `fd` is an open descriptor for the duration of the call (a
    // borrow of its owner); the option value points at a live `c_int` whose
    // size is passed along, and the kernel only reads it.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            std::ptr::from_ref(&v).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::fd::AsFd;

    /// Below the mark a socket does not report readable, yet a
    /// non-blocking read returns what it holds; lowered again, it reports
    /// readable at once.
    #[test]
    fn the_mark_gates_readiness_not_reads() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut s, _) = l.accept().unwrap();
        s.set_nonblocking(true).unwrap();
        let readable = |s: &std::net::TcpStream| {
            let mut p = libc::pollfd { fd: s.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd, no wait.
            let n = unsafe { libc::poll(&mut p, 1, 0) };
            n == 1 && p.revents & libc::POLLIN != 0
        };
        set_recv_lowat(s.as_fd(), 32 << 10).unwrap();
        c.write_all(b"hello").unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(!readable(&s), "5 bytes are below the mark");
        set_recv_lowat(s.as_fd(), 1).unwrap();
        assert!(readable(&s), "at the mark of 1 the bytes there count");
        set_recv_lowat(s.as_fd(), 32 << 10).unwrap();
        let mut b = [0u8; 16];
        assert_eq!(s.read(&mut b).unwrap(), 5, "a non-blocking read ignores the mark");
        assert_eq!(&b[..5], b"hello");
        drop(c);
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(readable(&s), "the peer's close is reported whatever the mark");
    }
}
