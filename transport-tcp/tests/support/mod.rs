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

/// Waits (at most 10 s) until `f` holds; returns whether it did.
pub async fn eventually(mut f: impl FnMut() -> bool) -> bool {
    for _ in 0..2000 {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    f()
}

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

/// Stops process `pid` (SIGSTOP) and returns once every one of its threads
/// is stopped: `kill` only queues the signal, and a thread already running
/// goes on until it next enters the kernel, long enough to answer a
/// request sent right after (seen: 1 in 6 runs on a 2-core machine).
/// Panics if it is not stopped within 10 s.
pub fn stop(pid: u32) {
    // SAFETY: (test) signals a child process this test started.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGSTOP) }, 0, "SIGSTOP {pid}");
    let stopped = || {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return false };
        tasks.flatten().all(|t| {
            // The state is the field after the command's closing paren.
            std::fs::read_to_string(t.path().join("stat")).is_ok_and(|s| {
                s.rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().next())
                    .is_some_and(|st| st == "T" || st == "t")
            })
        })
    };
    let t0 = std::time::Instant::now();
    while !stopped() {
        assert!(t0.elapsed() < Duration::from_secs(10), "process {pid} did not stop within 10 s of SIGSTOP");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Resumes process `pid` (SIGCONT).
pub fn resume(pid: u32) {
    // SAFETY: (test) signals a child process this test started.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGCONT) }, 0, "SIGCONT {pid}");
}

/// A loopback config with short timeouts for tests.
pub fn test_config() -> TcpConfig {
    TcpConfig { connect_timeout: Duration::from_secs(2), ..TcpConfig::default() }
}

/// Starts the `tcp-peer` process serving `len` bytes on `listen`, with
/// same-host copies on or off, as user and group `as_user` if given; the
/// child, its segment name and its region's address (the region starts as
/// the bytes `i % 251`).
pub fn tcp_peer(listen: &str, len: usize, same_host: bool, as_user: Option<u32>) -> (std::process::Child, String, u64) {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_tcp-peer"));
    if let Some(id) = as_user {
        use std::os::unix::process::CommandExt;
        cmd.uid(id).gid(id);
    }
    cmd.args([listen, &len.to_string(), if same_host { "on" } else { "off" }]);
    start_peer(cmd)
}

/// Starts `cmd` (that runs `tcp-peer`, maybe through a wrapper such as
/// `ip netns exec`): the child, its segment name and its region's
/// address, from the line it prints once it serves.
pub fn start_peer(mut cmd: std::process::Command) -> (std::process::Child, String, u64) {
    use std::io::BufRead;
    let mut child =
        cmd.stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped()).spawn().expect("tcp-peer starts");
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let mut it = line.split_whitespace();
    let name = it.next().expect("tcp-peer printed its name").to_owned();
    let addr = it.next().expect("tcp-peer printed its region").parse().unwrap();
    (child, name, addr)
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
