//! Test support shared by the integration tests: the fault proxy, fd
//! counting, node construction.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

pub mod fake_peer;
pub mod harness;
pub mod proxy;
pub mod raw;

use std::time::Duration;

use transport_core::{BatchStatus, SubmitOptions, TransferRequest, Transport};
use transport_tcp::{TcpConfig, TcpTransport};

/// Submits `reqs`, waits (at most 30 s) for the batch to end, releases it
/// and returns its final status.
pub async fn run(t: &TcpTransport, reqs: Vec<TransferRequest>) -> BatchStatus {
    let b = t.submit(reqs, SubmitOptions::default()).await.unwrap();
    let s = tokio::time::timeout(Duration::from_secs(30), t.wait(b)).await.expect("batch finishes").unwrap();
    t.release(b).unwrap();
    s
}

/// Open file descriptors of this process.
pub fn open_fds() -> u64 {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count() as u64).unwrap_or(0)
}

/// A loopback config with short timeouts for tests.
pub fn test_config() -> TcpConfig {
    TcpConfig { connect_timeout: Duration::from_secs(2), ..TcpConfig::default() }
}

/// A transport on 127.0.0.1:0.
pub async fn node(cfg: TcpConfig) -> TcpTransport {
    TcpTransport::new(cfg).await.expect("transport starts")
}

/// Sockets this process holds whose local or remote port is in `ports`
/// (the kernel's view: inodes of /proc/self/fd matched in /proc/net/tcp*).
/// Scoped to a set of ports so tests running in parallel in one process do
/// not disturb each other's counts.
pub fn sockets_on(ports: &[u16]) -> u64 {
    let mut inodes = std::collections::HashSet::new();
    if let Ok(d) = std::fs::read_dir("/proc/self/fd") {
        for e in d.flatten() {
            if let Ok(l) = std::fs::read_link(e.path()) {
                let l = l.to_string_lossy().to_string();
                if let Some(n) = l.strip_prefix("socket:[").and_then(|x| x.strip_suffix(']')) {
                    inodes.insert(n.to_owned());
                }
            }
        }
    }
    let mut count = 0;
    for f in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(f) else { continue };
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            // State 07 (CLOSE) is a socket already reset whose owner is
            // about to drop it: not a live resource.
            if cols.len() < 10 || !inodes.contains(cols[9]) || cols[3] == "07" {
                continue;
            }
            let port = |c: &str| c.rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok());
            let (lp, rp) = (port(cols[1]), port(cols[2]));
            if lp.is_some_and(|p| ports.contains(&p)) || rp.is_some_and(|p| ports.contains(&p)) {
                count += 1;
            }
        }
    }
    count
}
