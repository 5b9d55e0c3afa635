//! Copies between two processes of one host without a socket: Linux
//! cross-memory attach (`process_vm_readv`), one kernel copy from the other
//! process's memory into ours.
//!
//! The kernel allows it when the caller may trace the other process
//! (`PTRACE_MODE_ATTACH_REALCREDS`: same user and the other process
//! dumpable, or `CAP_SYS_PTRACE`; Yama's `ptrace_scope` may restrict it
//! further). Only reads are offered here: every byte a process receives
//! this way it copies itself, into memory it checked. The one way a peer
//! writes into this process is a direct write through a window this
//! process granted and can close ([`crate::window`]).
#![allow(unsafe_code)]

use crate::error::MemError;
use crate::region::MemoryRegion;

/// Bytes a device region's pull passes through host memory at a time.
const BOUNCE: usize = 1 << 20;

/// Copies `len` bytes at `remote` in process `pid` to `local` in this
/// process, looping over partial copies.
///
/// # Safety
///
/// `local .. local + len` is memory of this process that may be written
/// for the duration of the call.
unsafe fn pull(pid: u32, remote: u64, local: *mut u8, len: usize) -> std::io::Result<()> {
    let pid = libc::pid_t::try_from(pid).map_err(|_| std::io::Error::from_raw_os_error(libc::ESRCH))?;
    let mut done = 0usize;
    while done < len {
        let Some(from) = remote.checked_add(done as u64) else {
            return Err(std::io::Error::from_raw_os_error(libc::EFAULT));
        };
        // SAFETY: `done < len`: the pointer stays inside the range the
        // caller vouched for.
        let at = unsafe { local.add(done) };
        let lv = libc::iovec { iov_base: at.cast(), iov_len: len - done };
        let rv = libc::iovec { iov_base: from as usize as *mut libc::c_void, iov_len: len - done };
        // SAFETY: the local iovec covers writable memory of this process
        // (the caller's promise); the remote one is only read, in another
        // process, and the kernel checks it (EFAULT), never this process.
        let n = unsafe { libc::process_vm_readv(pid, &lv, 1, &rv, 1, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(std::io::Error::from_raw_os_error(libc::EFAULT));
        }
        done += n as usize;
    }
    Ok(())
}

/// Copies `dst.len()` bytes at address `remote` of process `pid` into
/// `dst`.
pub fn read_process(pid: u32, remote: u64, dst: &mut [u8]) -> std::io::Result<()> {
    // SAFETY: `dst` is a live, exclusively borrowed Rust slice.
    unsafe { pull(pid, remote, dst.as_mut_ptr(), dst.len()) }
}

impl MemoryRegion {
    /// Copies `len` bytes at address `remote` of process `pid` into this
    /// region at `offset` (for device memory: through a host buffer, then
    /// by its provider). The range is checked first.
    pub fn pull_at(&self, offset: usize, len: usize, pid: u32, remote: u64) -> Result<(), MemError> {
        self.check(offset as u64, len as u64)?;
        let failed = |e: std::io::Error| MemError::ProcessCopy { pid, why: e.to_string() };
        if self.provider().is_some() {
            let mut bounce = vec![0u8; len.min(BOUNCE)];
            let mut done = 0usize;
            while done < len {
                let n = (len - done).min(BOUNCE);
                read_process(pid, remote.saturating_add(done as u64), &mut bounce[..n]).map_err(failed)?;
                self.write_at(offset + done, &bounce[..n])?;
                done += n;
            }
            return Ok(());
        }
        // SAFETY: the range was bounds-checked against this live host
        // region (its constructor's guarantee); the kernel writes it as a
        // DMA engine would (concurrent readers see unspecified bytes, as
        // `from_raw` states).
        unsafe { pull(pid, remote, (self.addr() as usize + offset) as *mut u8, len) }.map_err(failed)
    }
}

/// Ranges one `process_vm_readv` call takes at most (the kernel's
/// `UIO_MAXIOV` for either side).
pub const PULL_MANY_MAX: usize = 1024;

impl MemoryRegion {
    /// Several same-host copies into this region, one kernel call for all
    /// of them where it can: entry `k` copies `len` bytes at address
    /// `remote` of process `pid` to `offset`, and its result goes to
    /// `out[k]` (`out` is cleared first). Each range is checked as
    /// [`MemoryRegion::pull_at`] checks it; if the combined call copies
    /// less than all (a source the kernel refuses), every entry is copied
    /// again on its own, so each gets its own result. Device memory, or
    /// more than [`PULL_MANY_MAX`] entries: one [`MemoryRegion::pull_at`]
    /// per entry.
    pub fn pull_many(&self, pid: u32, entries: &[(usize, usize, u64)], out: &mut Vec<Result<(), MemError>>) {
        out.clear();
        out.extend(entries.iter().map(|&(offset, len, _)| self.check(offset as u64, len as u64)));
        let one_by_one = |out: &mut Vec<Result<(), MemError>>| {
            for (r, &(offset, len, remote)) in out.iter_mut().zip(entries) {
                if r.is_ok() {
                    *r = self.pull_at(offset, len, pid, remote);
                }
            }
        };
        if self.provider().is_some() || entries.len() > PULL_MANY_MAX {
            return one_by_one(out);
        }
        let Ok(id) = libc::pid_t::try_from(pid) else { return one_by_one(out) };
        let mut local = Vec::with_capacity(entries.len());
        let mut remote = Vec::with_capacity(entries.len());
        let mut total = 0usize;
        for (r, &(offset, len, from)) in out.iter().zip(entries) {
            if r.is_err() || len == 0 {
                continue;
            }
            local.push(libc::iovec { iov_base: (self.addr() as usize + offset) as *mut libc::c_void, iov_len: len });
            remote.push(libc::iovec { iov_base: from as usize as *mut libc::c_void, iov_len: len });
            total = total.saturating_add(len);
        }
        if local.is_empty() {
            return;
        }
        // SAFETY: every local iovec is a range of this live host region that
        // `check` bounded (the constructor's guarantee, as in `pull_at`);
        // the kernel writes them as a DMA engine would. The remote iovecs
        // are only read, in the other process, and checked by the kernel.
        // At most PULL_MANY_MAX of each (the kernel's limit).
        let n = unsafe {
            libc::process_vm_readv(id, local.as_ptr(), local.len() as _, remote.as_ptr(), remote.len() as _, 0)
        };
        if usize::try_from(n).ok() != Some(total) {
            one_by_one(out);
        }
    }
}

/// The inode of the TCP socket of this network namespace whose own
/// address is `sock` and whose peer is `peer`, looked up by the kernel
/// (`sock_diag`, an exact lookup, not a dump of every socket). `Ok(None)`
/// when there is no such socket; `Err` when the kernel does not answer
/// such lookups here (no `tcp_diag`), so the caller may look elsewhere.
///
/// With the holder's process id this names who is at the other end of a
/// loopback connection: the same-host copy path believes a peer's claimed
/// process only if that process holds this inode (see transport-tcp's
/// `samehost.rs`).
pub fn tcp_socket_inode(sock: std::net::SocketAddr, peer: std::net::SocketAddr) -> std::io::Result<Option<u64>> {
    use std::net::{IpAddr, Ipv6Addr};
    let canon = |ip: IpAddr| ip.to_canonical();
    let (sip, pip) = (canon(sock.ip()), canon(peer.ip()));
    // A v4 connection is looked up as AF_INET, then (a dual-stack socket)
    // as AF_INET6 with mapped addresses.
    let mut tries: Vec<(u8, [u8; 16], [u8; 16])> = Vec::with_capacity(2);
    let v6 = |ip: IpAddr| match ip {
        IpAddr::V4(a) => a.to_ipv6_mapped().octets(),
        IpAddr::V6(a) => a.octets(),
    };
    if let (IpAddr::V4(a), IpAddr::V4(b)) = (sip, pip) {
        let (mut x, mut y) = ([0u8; 16], [0u8; 16]);
        x[..4].copy_from_slice(&a.octets());
        y[..4].copy_from_slice(&b.octets());
        tries.push((libc::AF_INET as u8, x, y));
    }
    let (x, y) = (v6(sip), v6(pip));
    if x != Ipv6Addr::UNSPECIFIED.octets() {
        tries.push((libc::AF_INET6 as u8, x, y));
    }
    for (family, src, dst) in tries {
        if let Some(inode) = diag_lookup(family, (src, sock.port()), (dst, peer.port()))? {
            return Ok(Some(inode));
        }
    }
    Ok(None)
}

/// One `SOCK_DIAG_BY_FAMILY` request for the socket `src` -> `dst`.
fn diag_lookup(family: u8, src: ([u8; 16], u16), dst: ([u8; 16], u16)) -> std::io::Result<Option<u64>> {
    const SOCK_DIAG_BY_FAMILY: u16 = 20;
    const NLMSG_ERROR: u16 = 2;
    // nlmsghdr (16) + inet_diag_req_v2 (8 + inet_diag_sockid 48).
    let mut req = [0u8; 72];
    req[0..4].copy_from_slice(&72u32.to_ne_bytes());
    req[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    req[6..8].copy_from_slice(&(libc::NLM_F_REQUEST as u16).to_ne_bytes());
    req[8..12].copy_from_slice(&1u32.to_ne_bytes());
    req[16] = family;
    req[17] = libc::IPPROTO_TCP as u8;
    req[20..24].copy_from_slice(&u32::MAX.to_ne_bytes()); // every state
    req[24..26].copy_from_slice(&src.1.to_be_bytes());
    req[26..28].copy_from_slice(&dst.1.to_be_bytes());
    req[28..44].copy_from_slice(&src.0);
    req[44..60].copy_from_slice(&dst.0);
    // idiag_if 0; the cookie INET_DIAG_NOCOOKIE (all ones).
    req[64..72].copy_from_slice(&[0xff; 8]);
    // SAFETY: plain socket(2); the descriptor is owned below.
    let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, libc::NETLINK_SOCK_DIAG) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and is owned by nothing else.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
    // SAFETY: a zeroed sockaddr_nl is the kernel's address (pid 0).
    let mut kernel: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    kernel.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    // SAFETY: `req` and `kernel` are live for the call, with their sizes.
    let sent = unsafe {
        libc::sendto(
            raw,
            req.as_ptr().cast(),
            req.len(),
            0,
            (&kernel as *const libc::sockaddr_nl).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if sent < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut buf = [0u8; 8192];
    // SAFETY: a zeroed sockaddr_nl, filled in by recvfrom.
    let mut from: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    let mut from_len = std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t;
    // SAFETY: `buf`, `from` and `from_len` are writable for their sizes. A
    // blocking receive: the kernel answers an exact lookup at once.
    let n = unsafe {
        libc::recvfrom(
            raw,
            buf.as_mut_ptr().cast(),
            buf.len(),
            0,
            (&mut from as *mut libc::sockaddr_nl).cast(),
            &mut from_len,
        )
    };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if from.nl_pid != 0 {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "a sock_diag answer not from the kernel"));
    }
    let got = &buf[..n as usize];
    let u16_at = |at: usize| got.get(at..at + 2).map(|b| u16::from_ne_bytes([b[0], b[1]]));
    let u32_at = |at: usize| got.get(at..at + 4).map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
    match u16_at(4) {
        Some(SOCK_DIAG_BY_FAMILY) => {
            // inet_diag_msg after the header: 4 bytes, the sockid (48),
            // expires, rqueue, wqueue, uid, then the inode.
            Ok(u32_at(16 + 4 + 48 + 16).map(u64::from).filter(|&i| i != 0))
        }
        Some(NLMSG_ERROR) => {
            let errno = u32_at(16).map_or(0, |e| e as i32);
            if errno == -libc::ENOENT {
                Ok(None)
            } else {
                Err(std::io::Error::from_raw_os_error(-errno))
            }
        }
        _ => Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "unexpected sock_diag answer")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Buffer;

    #[test]
    fn a_pull_from_this_process_copies_and_a_bad_address_is_an_error() {
        let src = Buffer::from_slice(&(0..=255u8).cycle().take(10_000).collect::<Vec<_>>()).unwrap();
        let dst = Buffer::new(10_000).unwrap();
        let me = std::process::id();
        dst.region().pull_at(100, 5000, me, src.addr() + 7).unwrap();
        assert_eq!(dst.to_vec()[100..5100], src.to_vec()[7..5007]);
        assert_eq!(dst.to_vec()[..100], [0u8; 100]);
        // Outside the destination: refused before any copy.
        assert!(matches!(dst.region().pull_at(9000, 5000, me, src.addr()), Err(MemError::OutOfBounds { .. })));
        // An address the other process does not map: the kernel refuses.
        let e = dst.region().pull_at(0, 16, me, 8).unwrap_err();
        assert!(matches!(e, MemError::ProcessCopy { .. }), "{e}");
        let mut b = [0u8; 4];
        read_process(me, src.addr() + 1, &mut b).unwrap();
        assert_eq!(b, [1, 2, 3, 4]);
    }

    #[test]
    fn many_pulls_in_one_call_each_with_its_own_result() {
        let src = Buffer::from_slice(&(0..=250u8).cycle().take(20_000).collect::<Vec<_>>()).unwrap();
        let s = src.addr();
        let me = std::process::id();
        let mut out = Vec::new();
        // Scattered, out of order, one empty: all copied by one call.
        let dst = Buffer::new(20_000).unwrap();
        let all = [(8192, 4096, s), (0, 100, s + 9000), (5000, 0, s), (100, 3000, s + 17_000)];
        dst.region().pull_many(me, &all, &mut out);
        assert!(out.iter().all(Result::is_ok), "{out:?}");
        let (d, v) = (dst.to_vec(), src.to_vec());
        assert_eq!((&d[8192..12288], &d[0..100], &d[100..3100]), (&v[..4096], &v[9000..9100], &v[17_000..]));
        assert!(d[3100..8192].iter().chain(&d[12288..]).all(|&b| b == 0), "nothing else written");
        // A range outside the region and a source the kernel refuses: those
        // two fail, each with its own error; the others land.
        let dst = Buffer::new(20_000).unwrap();
        let mixed = [(0, 4096, s), (19_000, 4096, s), (4096, 16, 8), (8192, 4096, s + 4096)];
        dst.region().pull_many(me, &mixed, &mut out);
        assert!(out[0].is_ok() && out[3].is_ok(), "{out:?}");
        assert!(matches!(out[1], Err(MemError::OutOfBounds { .. })), "{out:?}");
        assert!(matches!(out[2], Err(MemError::ProcessCopy { .. })), "{out:?}");
        let d = dst.to_vec();
        assert_eq!((&d[..4096], &d[8192..12288]), (&v[..4096], &v[4096..8192]));
        assert!(d[4096..8192].iter().all(|&b| b == 0));
    }

    #[test]
    fn the_kernel_names_both_ends_of_a_loopback_connection() {
        for host in ["127.0.0.1:0", "[::1]:0"] {
            let l = std::net::TcpListener::bind(host).unwrap();
            let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
            let (s, _) = l.accept().unwrap();
            let (cl, sl) = (c.local_addr().unwrap(), s.local_addr().unwrap());
            let ci = tcp_socket_inode(cl, sl).unwrap().expect("the client's end");
            let si = tcp_socket_inode(sl, cl).unwrap().expect("the server's end");
            assert_ne!(ci, si);
            use std::os::unix::fs::MetadataExt;
            let fd_inode = |fd: i32| std::fs::metadata(format!("/proc/self/fd/{fd}")).unwrap().ino();
            use std::os::fd::AsRawFd;
            assert_eq!(ci, fd_inode(c.as_raw_fd()));
            assert_eq!(si, fd_inode(s.as_raw_fd()));
            let port = l.local_addr().unwrap().port();
            let nowhere: std::net::SocketAddr =
                if host.starts_with('[') { "[::1]:9" } else { "127.0.0.1:9" }.parse().unwrap();
            assert_eq!(tcp_socket_inode(cl, nowhere).unwrap(), None, "{port}");
        }
    }
}
