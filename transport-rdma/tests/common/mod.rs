//! Shared helpers of the RDMA tests: device detection, transports on the
//! test device, and the kernel's own resource counts (`rdma resource`).
#![allow(dead_code)]

use std::io::Write;
use std::process::Command;
use std::time::{Duration, Instant};

use transport_core::{BatchStatus, Buffer, Transport};
use transport_rdma::{rdma_devices, RdmaConfig, RdmaTransport};

/// Whether the RDMA tests can run. Without a device they are skipped (with
/// a loud line; the caller reports them ignored), unless RDMA_REQUIRED=1
/// (set by scripts/rdma-tests.sh and the VM), where a missing device panics.
pub fn device_or_skip(test: &str) -> bool {
    let devs = rdma_devices().unwrap_or_default();
    if !devs.is_empty() {
        return true;
    }
    if std::env::var("RDMA_REQUIRED").as_deref() == Ok("1") || std::env::var("RXE_VM").as_deref() == Ok("1") {
        panic!("{test}: RDMA_REQUIRED=1 but no RDMA device was found");
    }
    eprintln!("SKIPPED {test}: no RDMA device (run scripts/rdma-tests.sh for the soft-RoCE VM)");
    false
}

/// A device whose link the tests may fault: the device, its netdev and
/// the netdev's bridge port.
#[derive(Debug, Clone)]
pub struct Link {
    pub device: String,
    pub netdev: String,
    pub bridge_port: String,
}

/// Devices whose links the tests may fault, from RDMA_TEST_FAULT_LINKS
/// ("rxe0:rv0:rvb0 ..."), which only the soft-RoCE VM sets (a real NIC is
/// never taken down).
///
/// Their static neighbours are saved here, before any test takes a link
/// down (see [`ip_link`]).
pub fn fault_links() -> Vec<Link> {
    let v = std::env::var("RDMA_TEST_FAULT_LINKS").unwrap_or_default();
    let links: Vec<Link> = v
        .split_whitespace()
        .filter_map(|l| {
            let mut it = l.split(':');
            let (d, n, b) = (it.next()?, it.next()?, it.next()?);
            Some(Link { device: d.into(), netdev: n.into(), bridge_port: b.into() })
        })
        .collect();
    for l in &links {
        save_neighbours(&l.netdev);
    }
    links
}

/// Saves `netdev`'s permanent neighbours unless they already are (a query
/// is a process spawn: slow in the VM, so not on a test's timed path).
fn save_neighbours(netdev: &str) {
    let mut saved = SAVED_NEIGHBOURS.lock().unwrap_or_else(|p| p.into_inner());
    if saved.iter().any(|(n, _)| n == netdev) {
        return;
    }
    let now = permanent_neighbours(netdev);
    if !now.is_empty() {
        saved.push((netdev.to_string(), now));
    }
}

/// A netdev and its permanent neighbours (`(address, MAC)`).
type Neighbours = (String, Vec<(String, String)>);

/// Neighbour entries saved by [`fault_links`] or [`ip_link`]'s first `down`
/// of a netdev, put back by its `up`.
static SAVED_NEIGHBOURS: std::sync::Mutex<Vec<Neighbours>> = std::sync::Mutex::new(Vec::new());

/// The permanent IPv6 neighbours of `netdev` (`(address, MAC)`).
fn permanent_neighbours(netdev: &str) -> Vec<(String, String)> {
    let out = Command::new("ip").args(["-6", "neigh", "show", "dev", netdev, "nud", "permanent"]).output();
    let text = out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            let at = w.iter().position(|x| *x == "lladdr")?;
            Some((w.first()?.to_string(), w.get(at + 1)?.to_string()))
        })
        .collect()
}

/// Takes `netdev` down or up (`ip link set`). Taking a netdev down makes
/// the kernel flush every neighbour entry on it, the permanent ones the
/// soft-RoCE VM sets up included (scripts/rxe-vm); without them every QP
/// brought up toward a peer afterwards waits about a second in the
/// kernel's address resolution (`rdma_addr_find_l2_eth_by_grh` times out
/// and retries), which made later timing-sensitive cases fail. So `down`
/// saves them and `up` puts them back, as a lab network's static
/// configuration would be. (They are saved once per netdev, by
/// [`fault_links`] or the first `down`.)
pub fn ip_link(netdev: &str, up: bool) -> Result<(), String> {
    let state = if up { "up" } else { "down" };
    if !up {
        save_neighbours(netdev);
    }
    // One `ip` process for the link and its neighbours (`ip -batch`): in
    // the soft-RoCE VM beside busy loops every process start costs
    // seconds of emulation, and a cut (down, then up with a neighbour
    // command each) took 10 to 14 s, most of it starting `ip`.
    let mut script = format!("link set {netdev} {state}\n");
    if up {
        let saved = SAVED_NEIGHBOURS.lock().unwrap_or_else(|p| p.into_inner());
        for (addr, mac) in saved.iter().filter(|(n, _)| n == netdev).flat_map(|(_, v)| v) {
            script.push_str(&format!("neigh replace {addr} lladdr {mac} dev {netdev} nud permanent\n"));
        }
    }
    batch("ip", &[], &script)
}

/// Runs `script` (one command a line) through `tool -batch -` (`ip`,
/// `tc`) in one process, `opts` before `-batch` (`-force`: go on past a
/// failed line); its failure carries the script and the tool's words. In
/// the soft-RoCE VM beside busy loops a process start costs seconds, so
/// the fault tooling starts one per change, not one per command.
pub fn batch(tool: &str, opts: &[&str], script: &str) -> Result<(), String> {
    use std::process::Stdio;
    let what = format!("{tool} -batch ({})", script.trim_end().replace('\n', "; "));
    let mut child = Command::new(tool)
        .args(opts)
        .args(["-batch", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{what}: {e}"))?;
    let wrote = child.stdin.take().map(|mut i| i.write_all(script.as_bytes()));
    let out = child.wait_with_output().map_err(|e| format!("{what}: {e}"))?;
    if !out.status.success() || !matches!(wrote, Some(Ok(()))) {
        return Err(format!("`{what}` failed: {}", String::from_utf8_lossy(&out.stderr).trim()));
    }
    Ok(())
}

/// Whether `device`'s port 1 is in `state` ("ACTIVE", "DOWN").
pub fn port_is(device: &str, state: &str) -> bool {
    std::fs::read_to_string(format!("/sys/class/infiniband/{device}/ports/1/state")).is_ok_and(|s| s.contains(state))
}

/// Brings links back up however a test ends.
pub struct LinksUp(pub Vec<String>);

impl Drop for LinksUp {
    fn drop(&mut self) {
        for n in &self.0 {
            let _ = ip_link(n, true);
        }
    }
}

/// A config on the test device (RDMA_TEST_DEVICE, else the first one).
pub fn config() -> RdmaConfig {
    RdmaConfig {
        device: std::env::var("RDMA_TEST_DEVICE").ok(),
        flush_timeout_ms: 2_000,
        ack_timeout: 12,
        retry_count: 3,
        ..Default::default()
    }
}

pub async fn transport(cfg: RdmaConfig) -> RdmaTransport {
    RdmaTransport::new(cfg).await.expect("RDMA transport")
}

pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8).collect()
}

pub fn buffer_with(len: usize, seed: u8) -> Buffer {
    Buffer::from_slice(&pattern(len, seed)).expect("buffer")
}

/// Waits for a batch with a generous bound (the VM is slow).
pub async fn wait(t: &dyn Transport, b: transport_core::BatchId) -> BatchStatus {
    tokio::time::timeout(Duration::from_secs(60), t.wait(b)).await.expect("batch did not settle in 60 s").expect("wait")
}

/// Whether the task id the kernel recorded for an RDMA object belongs to
/// process `pid`. The kernel records the creating *thread* (tokio workers
/// create QPs), so the id is a TID: ours if it is a thread of `pid`, or
/// if it is gone (a thread of ours that ended; counting it keeps the leak
/// check conservative). Threads of other live processes are not ours.
fn tid_is_ours(tid: u64, pid: u32) -> bool {
    if tid == u64::from(pid) || std::path::Path::new(&format!("/proc/{pid}/task/{tid}")).exists() {
        return true;
    }
    match std::fs::read_to_string(format!("/proc/{tid}/status")) {
        Ok(s) => s
            .lines()
            .find_map(|l| l.strip_prefix("Tgid:"))
            .and_then(|v| v.trim().parse::<u32>().ok())
            .is_some_and(|tgid| tgid == pid),
        Err(_) => true,
    }
}

/// The kernel's count of RDMA objects of `kind` (`qp`, `cq`, `pd`, `mr`)
/// owned by process `pid`, from `rdma -j resource show <kind>`.
pub fn kernel_count(kind: &str, pid: u32) -> u64 {
    count_where(kind, |tid| tid_is_ours(tid, pid))
}

/// Like [`kernel_count`], but only objects created by a live thread of
/// this process: exact for tests whose threads all outlive the count
/// (the churn test, where killed peers' objects, whose creators are gone,
/// may linger in the kernel's table for a moment).
pub fn my_live_qps() -> u64 {
    let pid = std::process::id();
    count_where("qp", |tid| std::path::Path::new(&format!("/proc/{pid}/task/{tid}")).exists())
}

fn count_where(kind: &str, ours: impl Fn(u64) -> bool) -> u64 {
    let out = Command::new("rdma").args(["-j", "resource", "show", kind]).output().expect("run `rdma` (iproute2)");
    assert!(out.status.success(), "rdma resource show {kind}: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(text.trim()).unwrap_or(serde_json::Value::Array(vec![]));
    let arr = v.as_array().cloned().unwrap_or_default();
    // One object per (device, id): a dump that races with changes can
    // list an object twice (seen: a QP once in RESET, once in INIT).
    let mut seen = std::collections::HashSet::new();
    arr.iter()
        .filter(|e| e.get("pid").and_then(|p| p.as_u64()).is_some_and(&ours))
        .filter(|e| {
            let id = ["lqpn", "cqn", "mrn", "pdn"].iter().find_map(|k| e.get(*k)).map(ToString::to_string);
            seen.insert((e.get("ifname").map(ToString::to_string), id.unwrap_or_else(|| e.to_string())))
        })
        .count() as u64
}

/// The kernel's QP table as `rdma resource show qp` prints it, with this
/// process's thread ids (for failure messages).
pub fn qp_table() -> String {
    let out = Command::new("rdma").args(["resource", "show", "qp"]).output().map(|o| o.stdout).unwrap_or_default();
    let tids: Vec<String> = std::fs::read_dir("/proc/self/task")
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    format!("{}(our threads: {})", String::from_utf8_lossy(&out), tids.join(" "))
}

pub fn my_qps() -> u64 {
    kernel_count("qp", std::process::id())
}

/// All four kernel counts of this process.
pub fn my_counts() -> [(String, u64); 4] {
    let pid = std::process::id();
    ["qp", "cq", "mr", "pd"].map(|k| (k.to_string(), kernel_count(k, pid)))
}

/// Polls `f` until it is true or `limit` passes; returns the last value.
pub async fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    loop {
        if f() {
            return true;
        }
        if start.elapsed() > limit {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Runs the side channel's handshake (version 2) on a fresh raw
/// connection to `addr`, as a peer written against the protocol (not this
/// crate) would, proving `secret` (an empty proof without one); stops at the
/// first answer that is not the next step: every answer read, and the
/// connection once the server said `ready`.
pub async fn greet(
    addr: &str,
    secret: Option<&str>,
) -> (Option<tokio::io::BufReader<tokio::net::TcpStream>>, Vec<serde_json::Value>) {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    use transport_control::auth::{self, Role};
    let mut s = tokio::io::BufReader::new(tokio::net::TcpStream::connect(addr).await.expect("connect"));
    let mut answers = Vec::new();
    let hex = |b: &[u8]| b.iter().map(|b| format!("{b:02x}")).collect::<String>();
    let cn = auth::nonce();
    let hello = format!("{{\"op\":\"hello\",\"version\":2,\"nonce\":\"{}\"}}\n", hex(&cn));
    s.get_mut().write_all(hello.as_bytes()).await.expect("send hello");
    let mut line = String::new();
    if s.read_line(&mut line).await.unwrap_or(0) == 0 {
        return (None, answers);
    }
    let c: serde_json::Value = serde_json::from_str(&line).expect("a JSON answer to hello");
    answers.push(c.clone());
    if c["result"] != "challenge" {
        return (None, answers);
    }
    let sn: Vec<u8> = (0..auth::NONCE_LEN)
        .map(|i| u8::from_str_radix(&c["nonce"].as_str().expect("nonce")[2 * i..2 * i + 2], 16).expect("hex"))
        .collect();
    let proof = secret.map(|k| hex(&auth::prove(auth::RDMA, k.as_bytes(), Role::Client, &cn, &sn))).unwrap_or_default();
    s.get_mut().write_all(format!("{{\"op\":\"auth\",\"proof\":\"{proof}\"}}\n").as_bytes()).await.expect("send auth");
    line.clear();
    if s.read_line(&mut line).await.unwrap_or(0) == 0 {
        return (None, answers);
    }
    let r: serde_json::Value = serde_json::from_str(&line).expect("a JSON answer to auth");
    answers.push(r.clone());
    ((r["result"] == "ready").then_some(s), answers)
}

/// [`greet`] that must end `ready`: the connection.
pub async fn greeted(addr: &str, secret: Option<&str>) -> tokio::io::BufReader<tokio::net::TcpStream> {
    match greet(addr, secret).await {
        (Some(s), _) => s,
        (None, answers) => panic!("the side channel's handshake did not end ready: {answers:?}"),
    }
}
