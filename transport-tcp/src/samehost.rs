//! Same-host copies (CMA) instead of socket payloads, when both ends of a
//! lane are processes of this host that may read each other's memory.
//!
//! A lane always carries the protocol (requests, answers, notifications,
//! the generation, the slice ledger); only where the bytes travel changes.
//! Each side copies *into its own memory*, from the other process, with
//! `process_vm_readv` (one kernel copy, no socket buffer):
//!
//! - a WRITE carries the address of its source bytes in the client instead
//!   of the bytes; the server checks the destination against its exposed
//!   regions as for any WRITE, pulls the bytes from the client into it and
//!   only then answers WRITE_ACK;
//! - a READ asks for an answer without payload; the server checks the
//!   source range as for any READ and answers READ_RESP `Ok` without the
//!   bytes; the client pulls them from the server into its destination.
//!
//! So every region is still checked by its owner (rule 9), and the kernel
//! is the only one writing across processes. Through the lanes a peer
//! never writes into this process's memory; the one exception is a direct
//! write (`TcpConfig::direct_writes`), which a client makes only into the
//! ranges this server's window for its connection holds open
//! (`transport_mem::window`, `RegionTable::add_window`). A direct read
//! (`TcpConfig::direct_reads`) copies out of the ranges the window holds
//! open for reads, without asking the server first.
//!
//! **Who the peer is.** A process that claims a pid is believed only after
//! two checks, both at the handshake: (1) the kernel's socket table of this
//! network namespace has the peer's end of this very connection, and the
//! claimed process holds that socket (a link in `/proc/<pid>/fd`, readable
//! only for processes this one may inspect); (2) a read of the claimed
//! process's memory at the address it named returns the nonce it sent in
//! this handshake (so CMA is permitted, both ways of the kernel's policy).
//! A client that names another process's pid fails (1): it cannot make this
//! server copy from a process it does not control. Anything that fails
//! either check makes the lane a plain TCP lane, logged.

use std::net::{IpAddr, SocketAddr};

use tokio::net::TcpStream;

use crate::proto::{Header, SAME_HOST};

/// What a lane may do without socket payloads.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct SameHost {
    /// The server pulls WRITE bytes from this process.
    pub writes: bool,
    /// The server's pid, verified: READ bytes are pulled from it.
    pub read_from: Option<u32>,
}

/// The process at the other end of `s`, if its HELLO or CHALLENGE `h`
/// offered same-host copies (its pid and the address of its `nonce`) and
/// it passes both checks: it holds the other end of this socket, and its
/// memory has `nonce` at that address. A refusal is logged, saying which
/// of this side's copies (`what`) go through the socket instead.
pub(crate) fn peer_process(s: &TcpStream, h: &Header, nonce: &[u8], what: &str) -> Option<u32> {
    if h.flags & SAME_HOST == 0 {
        return None;
    }
    let (pid, mine, theirs) = (u32::try_from(h.addr).ok()?, s.local_addr().ok()?, s.peer_addr().ok()?);
    let ok = may_be_local(theirs, mine) && holds_socket(pid, theirs, mine) && probe(pid, h.len, nonce);
    if !ok {
        tracing::info!(peer = %theirs, pid, "the peer's same-host offer did not pass the checks: {what} go through the socket");
    }
    ok.then_some(pid)
}

/// Whether a connection between `peer` and `sock` may have both ends on
/// this host: a cheap filter before the socket table is read.
fn may_be_local(peer: SocketAddr, sock: SocketAddr) -> bool {
    let (p, s) = (peer.ip().to_canonical(), sock.ip().to_canonical());
    p.is_loopback() || p == s
}

/// Whether process `pid` holds the socket whose local address is `sock`
/// and whose peer is `peer`, in this network namespace.
fn holds_socket(pid: u32, sock: SocketAddr, peer: SocketAddr) -> bool {
    let Some(inode) = socket_inode(sock, peer) else { return false };
    let want = format!("socket:[{inode}]");
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return false };
    dir.flatten().any(|e| std::fs::read_link(e.path()).is_ok_and(|l| l.as_os_str() == want.as_str()))
}

/// The inode of the TCP socket bound to `sock` and connected to `peer`:
/// the kernel's exact lookup, or where it does not offer one, this
/// namespace's socket table (read only up to [`MAX_TABLE`] bytes, so a
/// flood of connections cannot make every handshake read it all).
fn socket_inode(sock: SocketAddr, peer: SocketAddr) -> Option<u64> {
    match transport_mem::cma::tcp_socket_inode(sock, peer) {
        Ok(found) => found,
        Err(_) => socket_inode_from_table(sock, peer),
    }
}

/// Bytes of `/proc/net/tcp{,6}` read at most.
const MAX_TABLE: u64 = 1 << 20;

fn socket_inode_from_table(sock: SocketAddr, peer: SocketAddr) -> Option<u64> {
    let canon = |a: SocketAddr| SocketAddr::new(a.ip().to_canonical(), a.port());
    let (sock, peer) = (canon(sock), canon(peer));
    for table in ["/proc/self/net/tcp", "/proc/self/net/tcp6"] {
        let Ok(f) = std::fs::File::open(table) else { continue };
        let mut text = String::new();
        if std::io::Read::read_to_string(&mut std::io::Read::take(f, MAX_TABLE), &mut text).is_err() {
            continue;
        }
        // A line cut by the bound is not read.
        let whole = text.rfind('\n').map_or("", |end| &text[..end]);
        for line in whole.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            let (Some(l), Some(r), Some(ino)) = (f.get(1), f.get(2), f.get(9)) else { continue };
            if parse_addr(l).map(canon) == Some(sock) && parse_addr(r).map(canon) == Some(peer) {
                return ino.parse().ok().filter(|&i| i != 0);
            }
        }
    }
    None
}

/// Parses `/proc/net/tcp{,6}`'s `ADDR:PORT`: the address as 32-bit words
/// printed in the kernel's byte order, the port as a number.
fn parse_addr(s: &str) -> Option<SocketAddr> {
    let (a, p) = s.split_once(':')?;
    let port = u16::from_str_radix(p, 16).ok()?;
    let word = |i: usize| u32::from_str_radix(a.get(i * 8..i * 8 + 8)?, 16).ok().map(u32::to_ne_bytes);
    let ip = match a.len() {
        8 => IpAddr::from(word(0)?),
        32 => {
            let mut b = [0u8; 16];
            for i in 0..4 {
                b[i * 4..i * 4 + 4].copy_from_slice(&word(i)?);
            }
            IpAddr::from(b)
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

/// Reads `want.len()` bytes at `addr` in process `pid` and compares them:
/// proves that the kernel lets this process read that one's memory and
/// that the process is the one that sent `want`.
fn probe(pid: u32, addr: u64, want: &[u8]) -> bool {
    let mut got = vec![0u8; want.len()];
    transport_mem::cma::read_process(pid, addr, &mut got).is_ok() && got == want
}

/// This process's id, as the peer's `process_vm_readv` names it.
pub(crate) fn my_pid() -> u32 {
    std::process::id()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_addresses_parse_in_the_kernels_byte_order() {
        let v4 = parse_addr("0100007F:1F90").unwrap();
        assert_eq!(v4, "127.0.0.1:8080".parse().unwrap());
        let v6 = parse_addr("00000000000000000000000001000000:0050").unwrap();
        assert_eq!(v6, "[::1]:80".parse().unwrap());
        let mapped = parse_addr("0000000000000000FFFF00000100007F:0050").unwrap();
        let (a, b) = ("127.0.0.1:1".parse().unwrap(), "127.0.0.1:2".parse().unwrap());
        assert_eq!(socket_inode_from_table(a, b), None);
        assert_eq!(mapped.ip().to_canonical(), "127.0.0.1".parse::<IpAddr>().unwrap());
        assert_eq!(parse_addr("0100007F"), None);
        assert_eq!(parse_addr("01007F:0050"), None);
        assert_eq!(parse_addr("zz00007F:0050"), None);
    }

    #[test]
    fn this_process_is_found_holding_its_socket_and_another_is_not() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        let (cl, sl) = (c.local_addr().unwrap(), s.local_addr().unwrap());
        // From the server's side: the client's end is (cl, sl).
        assert!(holds_socket(my_pid(), cl, sl));
        assert!(holds_socket(my_pid(), sl, cl));
        // pid 1 (init) does not hold it; a swapped pair names no socket.
        assert!(!holds_socket(1, cl, sl));
        assert!(!holds_socket(my_pid(), cl, "127.0.0.1:9".parse().unwrap()));
        drop(c);
        let nonce = [7u8; 32];
        assert!(probe(my_pid(), nonce.as_ptr() as u64, &nonce));
        assert!(!probe(my_pid(), nonce.as_ptr() as u64, &[8u8; 32]));
    }
}
