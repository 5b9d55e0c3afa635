//! The TCP backend's benchmark (a benchmark, not a test): bandwidth of
//! writes and reads with 1 MiB and 64 KiB slices, 4 KiB write latency next
//! to a plain 4 KiB TCP ping-pong measured in the same run, time per
//! request for batches of 1, 64, 4096 and 262144 requests of 2 KiB, the
//! time until the receiver sees a notification attached to 4 KiB and 1 MiB
//! batches next to submit-to-completed (rule 11), and the
//! peak RSS of the 262144-request batch, all through the sockets
//! (same-host copies off). Loopback only; every loop is
//! bounded. Run with `cargo bench -p transport-tcp` (or `bench.sh`, which
//! adds iperf3 and the ratios).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test and benchmark code: a failure should panic

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use transport_core::{Access, BatchState, Buffer, RegionId, SegmentId, SubmitOptions, TransferRequest, Transport};
use transport_tcp::{TcpConfig, TcpTransport};

fn rss_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with(field)).and_then(|l| l.split_whitespace().nth(1)?.parse().ok()))
        .unwrap_or(0)
}

/// The configuration measured: the socket path (both ends are this one
/// process, where same-host copies would otherwise carry the bytes; they
/// are measured between processes by `python/bench/peers.py`).
/// `TCP_BENCH_POLL_US` sets `server_poll_us` (to compare with it off).
fn sockets() -> TcpConfig {
    let d = TcpConfig::default();
    let server_poll_us = std::env::var("TCP_BENCH_POLL_US").map_or(d.server_poll_us, |v| v.parse().expect("a number"));
    TcpConfig { same_host: false, server_poll_us, ..d }
}

async fn batch(t: &TcpTransport, reqs: Vec<TransferRequest>) {
    let b = t.submit(reqs, SubmitOptions::default()).await.expect("submit");
    let s = t.wait(b).await.expect("wait");
    assert_eq!(s.state, BatchState::Completed, "{:?}", s.first_error());
    t.release(b).expect("release");
}

/// iperf3 single stream on loopback for `secs`, in Gbit/s, if iperf3 is
/// installed. Run right next to each of our measurements, so both see the
/// same machine load.
fn iperf3(secs: u32) -> Option<f64> {
    use std::process::{Command, Stdio};
    let port = "5299";
    let mut srv = Command::new("iperf3")
        .args(["-s", "-1", "-p", port])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    std::thread::sleep(Duration::from_millis(300));
    let out = Command::new("iperf3")
        .args(["-c", "127.0.0.1", "-p", port, "-t", &secs.to_string(), "-J"])
        .stderr(Stdio::null())
        .output();
    let _ = srv.kill();
    let _ = srv.wait();
    let v: serde_json::Value = serde_json::from_slice(&out.ok()?.stdout).ok()?;
    Some(v["end"]["sum_received"]["bits_per_second"].as_f64()? / 1e9)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

async fn bandwidth(slice: usize, read: bool) -> f64 {
    let cfg = TcpConfig { slice_size: slice, max_frame: slice.max(1 << 20), ..sockets() };
    let (a, b) = (TcpTransport::new(cfg.clone()).await.unwrap(), TcpTransport::new(cfg).await.unwrap());
    let len = 64 << 20;
    let (src, dst) = (Buffer::new(len).unwrap(), Buffer::new(len).unwrap());
    src.fill(7);
    let l = a.register(src.region(), Access::LOCAL).unwrap();
    b.register(dst.region(), Access::REMOTE_RW).unwrap();
    let seg = a.open_segment(&b.local_segment_name()).await.unwrap();
    let req = |k: u64| {
        let o = (k % 4) * (16 << 20);
        if read {
            TransferRequest::read(l, o, seg, dst.addr() + o, 16 << 20)
        } else {
            TransferRequest::write(l, o, seg, dst.addr() + o, 16 << 20)
        }
    };
    batch(&a, (0..4).map(req).collect()).await; // warm up
    let start = Instant::now();
    let mut bytes = 0u64;
    while start.elapsed() < Duration::from_secs(2) {
        batch(&a, (0..8).map(req).collect()).await;
        bytes += 8 * (16 << 20);
    }
    let gbps = bytes as f64 * 8.0 / start.elapsed().as_secs_f64() / 1e9;
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
    gbps
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p) as usize]
}

/// `n` one-request 4 KiB writes from `local` to `addr` of `seg`, one at a
/// time; the microseconds each took, past the first `warm`.
async fn timed_writes(t: &TcpTransport, local: RegionId, seg: SegmentId, addr: u64, n: usize, warm: usize) -> Vec<f64> {
    let mut v = Vec::new();
    for i in 0..n {
        let t0 = Instant::now();
        batch(t, vec![TransferRequest::write(local, 0, seg, addr, 4096)]).await;
        if i >= warm {
            v.push(t0.elapsed().as_secs_f64() * 1e6);
        }
    }
    v
}

async fn latency() -> (f64, f64) {
    let (a, b) = (TcpTransport::new(sockets()).await.unwrap(), TcpTransport::new(sockets()).await.unwrap());
    let (src, dst) = (Buffer::new(4096).unwrap(), Buffer::new(4096).unwrap());
    let l = a.register(src.region(), Access::LOCAL).unwrap();
    b.register(dst.region(), Access::REMOTE_RW).unwrap();
    let seg = a.open_segment(&b.local_segment_name()).await.unwrap();
    let mut v = timed_writes(&a, l, seg, dst.addr(), 3000, 200).await;
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
    (pct(&mut v, 0.5), pct(&mut v, 0.99))
}

/// Same-host single ops (issue 55): two transports of this process with
/// same-host copies on (the lanes pull the bytes with `process_vm_readv`;
/// small ops go straight through the peer's window when `direct`): p50
/// and p99 in microseconds of `n` one-request 4 KiB reads, then writes.
async fn same_host_ops(direct: bool, n: usize) -> [(f64, f64); 2] {
    let cfg = TcpConfig { same_host: true, direct_reads: direct, direct_writes: direct, ..TcpConfig::default() };
    let (a, b) = (TcpTransport::new(cfg.clone()).await.unwrap(), TcpTransport::new(cfg).await.unwrap());
    let (mine, theirs) = (Buffer::new(4096).unwrap(), Buffer::new(4096).unwrap());
    let l = a.register(mine.region(), Access::LOCAL).unwrap();
    b.register(theirs.region(), Access::REMOTE_RW).unwrap();
    let seg = a.open_segment(&b.local_segment_name()).await.unwrap();
    let mut out = [(0.0, 0.0); 2];
    for (k, read) in [true, false].into_iter().enumerate() {
        let mut v = Vec::new();
        for i in 0..n + 200 {
            let r = if read {
                TransferRequest::read(l, 0, seg, theirs.addr(), 4096)
            } else {
                TransferRequest::write(l, 0, seg, theirs.addr(), 4096)
            };
            let t0 = Instant::now();
            batch(&a, vec![r]).await;
            if i >= 200 {
                v.push(t0.elapsed().as_secs_f64() * 1e6);
            }
        }
        out[k] = (pct(&mut v, 0.5), pct(&mut v, 0.99));
    }
    assert_eq!(a.direct_read_bytes() > 0, direct, "direct reads taken exactly when on");
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
    out
}

/// The floor of a same-host 4 KiB op: one kernel copy of 4 KiB through
/// `/proc/self/mem` (what a direct read makes), p50 and p99 in
/// microseconds over `n`.
fn kernel_copy(n: usize) -> (f64, f64) {
    use std::os::unix::fs::FileExt;
    let mem = std::fs::File::open("/proc/self/mem").expect("/proc/self/mem");
    let src = vec![7u8; 4096];
    let mut dst = vec![0u8; 4096];
    let mut v = Vec::new();
    for i in 0..n + 200 {
        let t0 = Instant::now();
        let got = mem.read_at(&mut dst, src.as_ptr() as u64).expect("a read of this process");
        if i >= 200 {
            v.push(t0.elapsed().as_secs_f64() * 1e6);
        }
        assert_eq!(got, 4096);
    }
    assert!(dst == src);
    (pct(&mut v, 0.5), pct(&mut v, 0.99))
}

/// As [`latency`], through the `Engine` policy layer (budget, breaker,
/// deadline, retry driver): submit to the outcome.
async fn latency_engine() -> (f64, f64) {
    use kvmove_policy::{Engine, PolicyConfig};
    use std::sync::Arc;
    let (a, b) = (Arc::new(TcpTransport::new(sockets()).await.unwrap()), TcpTransport::new(sockets()).await.unwrap());
    let (src, dst) = (Buffer::new(4096).unwrap(), Buffer::new(4096).unwrap());
    let l = a.register(src.region(), Access::LOCAL).unwrap();
    b.register(dst.region(), Access::REMOTE_RW).unwrap();
    let seg = a.open_segment(&b.local_segment_name()).await.unwrap();
    let engine = Engine::new(a.clone(), PolicyConfig::default()).unwrap();
    let mut v = Vec::new();
    for i in 0..3000 {
        let t0 = Instant::now();
        let o = engine.transfer(vec![TransferRequest::write(l, 0, seg, dst.addr(), 4096)]).await.unwrap();
        assert!(o.is_success(), "{:?}", o.first_error());
        if i >= 200 {
            v.push(t0.elapsed().as_secs_f64() * 1e6);
        }
    }
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
    (pct(&mut v, 0.5), pct(&mut v, 0.99))
}

/// The guest's idle setting, printed with the results: with the haltpoll
/// cpuidle driver and `guest_halt_poll_ns` 0, every idle vCPU halts and
/// waking it costs tens of microseconds, so a ping-pong on a quiet machine
/// is several times slower than on a busy one (where no vCPU halts).
fn idle_state() -> String {
    let read = |p: &str| std::fs::read_to_string(p).map(|s| s.trim().to_string()).ok();
    let driver = read("/sys/devices/system/cpu/cpuidle/current_driver").unwrap_or_else(|| "unknown".into());
    match read("/sys/module/haltpoll/parameters/guest_halt_poll_ns") {
        Some(ns) => format!("cpuidle {driver}, guest_halt_poll_ns {ns}"),
        None => format!("cpuidle {driver}"),
    }
}

/// Records this run's ping-pong p50 (with the idle setting) under the
/// target directory and warns when it is more than 2x away from the
/// median of the earlier runs with the same setting: a reference that
/// moves that much makes every ratio to it meaningless.
fn check_reference(p50: f64) {
    let dir = std::env::var("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let file = dir.join("bench-history-tcp-pingpong.txt");
    let idle = idle_state();
    let old: Vec<f64> = std::fs::read_to_string(&file)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_once('\t'))
        .filter(|(_, setting)| *setting == idle)
        .filter_map(|(v, _)| v.parse().ok())
        .collect();
    let n = old.len();
    if n > 0 {
        let usual = median(old);
        if p50 > 2.0 * usual || p50 < usual / 2.0 {
            println!(
                "# WARNING: the ping-pong reference ({p50:.1} us) is more than 2x from its usual {usual:.1} us \
                 on this machine ({n} earlier runs, {idle}): ratios of this run are not comparable"
            );
        } else {
            println!("# reference: ping-pong p50 {p50:.1} us, usual {usual:.1} us ({n} earlier runs)");
        }
    }
    use std::io::Write;
    if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(&file) {
        let _ = writeln!(f, "{p50:.2}\t{idle}");
    }
}

/// Rule 11's cost: for batches of `size` bytes, submit-to-completed on the
/// sender next to submit-to-the-receiver-seeing-the-attached-notification
/// (`notify_after`), interleaved in one run. Returns (completed p50, p99,
/// notified p50, p99) in microseconds.
async fn notify_delay(size: usize, rounds: usize) -> (f64, f64, f64, f64) {
    use std::sync::Arc;
    let (a, b) = (TcpTransport::new(sockets()).await.unwrap(), Arc::new(TcpTransport::new(sockets()).await.unwrap()));
    let (src, dst) = (Buffer::new(size).unwrap(), Buffer::new(size).unwrap());
    let l = a.register(src.region(), Access::LOCAL).unwrap();
    b.register(dst.region(), Access::REMOTE_RW).unwrap();
    let seg = a.open_segment(&b.local_segment_name()).await.unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Instant>();
    let b2 = b.clone();
    let recv = tokio::spawn(async move {
        while b2.wait_notification().await.is_ok() {
            let Ok(ns) = b2.take_notifications(16) else { return };
            for _ in ns {
                let _ = tx.send(Instant::now());
            }
        }
    });
    let (mut done, mut seen) = (Vec::new(), Vec::new());
    let req = || vec![TransferRequest::write(l, 0, seg, dst.addr(), size as u64)];
    for i in 0..rounds {
        let t0 = Instant::now();
        batch(&a, req()).await;
        let completed = t0.elapsed().as_secs_f64() * 1e6;
        let t1 = Instant::now();
        let id = a.submit(req(), SubmitOptions::default()).await.unwrap();
        let (st, sent) = a.notify_after(id, seg, b"landed".to_vec()).await.unwrap();
        assert_eq!(st.state, BatchState::Completed);
        sent.expect("completed, so sent").unwrap();
        a.release(id).unwrap();
        let at = rx.recv().await.unwrap();
        if i >= rounds / 10 {
            done.push(completed);
            seen.push(at.saturating_duration_since(t1).as_secs_f64() * 1e6);
        }
    }
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
    let _ = recv.await;
    (pct(&mut done, 0.5), pct(&mut done, 0.99), pct(&mut seen, 0.5), pct(&mut seen, 0.99))
}

/// Plain TCP: 4 KiB out, an 8-byte answer back, on one connection.
async fn ping_pong() -> (f64, f64) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let srv = tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        s.set_nodelay(true).unwrap();
        let mut buf = vec![0u8; 4096];
        while s.read_exact(&mut buf).await.is_ok() {
            if s.write_all(&[1u8; 8]).await.is_err() {
                break;
            }
        }
    });
    let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
    c.set_nodelay(true).unwrap();
    let (out, mut back) = (vec![3u8; 4096], [0u8; 8]);
    let mut v = Vec::new();
    for i in 0..3000 {
        let t0 = Instant::now();
        c.write_all(&out).await.unwrap();
        c.read_exact(&mut back).await.unwrap();
        if i >= 200 {
            v.push(t0.elapsed().as_secs_f64() * 1e6);
        }
    }
    drop(c);
    let _ = srv.await;
    (pct(&mut v, 0.5), pct(&mut v, 0.99))
}

/// Issue 49: what the shared-secret handshake costs the first transfer.
/// Rounds alternate between both ends without a secret and both with
/// one; each round makes a fresh pair and times `open_segment` and the
/// first 4 KiB write (connect, handshake, descriptor, write), then 200
/// more writes on the same handle (one round trip each, the last 100
/// kept). Medians of `rounds` rounds each: (first without, first with,
/// steady write p50 with), microseconds.
async fn first_transfer(rounds: usize) -> (f64, f64, f64) {
    let (mut plain, mut secret, mut steady) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..2 * rounds {
        let with = i % 2 == 1;
        let cfg = || TcpConfig { secret: with.then(|| "bench-secret".into()), ..sockets() };
        let (a, b) = (TcpTransport::new(cfg()).await.unwrap(), TcpTransport::new(cfg()).await.unwrap());
        let (src, dst) = (Buffer::new(4096).unwrap(), Buffer::new(4096).unwrap());
        let l = a.register(src.region(), Access::LOCAL).unwrap();
        b.register(dst.region(), Access::REMOTE_RW).unwrap();
        let t0 = Instant::now();
        let seg = a.open_segment(&b.local_segment_name()).await.unwrap();
        batch(&a, vec![TransferRequest::write(l, 0, seg, dst.addr(), 4096)]).await;
        let first = t0.elapsed().as_secs_f64() * 1e6;
        if with {
            secret.push(first);
            steady.push(pct(&mut timed_writes(&a, l, seg, dst.addr(), 200, 100).await, 0.5));
        } else {
            plain.push(first);
        }
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
    }
    (median(plain), median(secret), median(steady))
}

async fn per_request(n: usize) -> (f64, u64) {
    let (a, b) = (TcpTransport::new(sockets()).await.unwrap(), TcpTransport::new(sockets()).await.unwrap());
    let len = n * 2048;
    let (src, dst) = (Buffer::new(len).unwrap(), Buffer::new(len).unwrap());
    let l = a.register(src.region(), Access::LOCAL).unwrap();
    b.register(dst.region(), Access::REMOTE_RW).unwrap();
    let seg = a.open_segment(&b.local_segment_name()).await.unwrap();
    let reqs: Vec<_> =
        (0..n as u64).map(|k| TransferRequest::write(l, k * 2048, seg, dst.addr() + k * 2048, 2048)).collect();
    batch(&a, reqs.clone()).await;
    let rounds = (262_144 / n).clamp(3, 2000);
    let start = Instant::now();
    let mut done = 0;
    while done < rounds && start.elapsed() < Duration::from_secs(5) {
        batch(&a, reqs.clone()).await;
        done += 1;
    }
    let us = start.elapsed().as_secs_f64() * 1e6 / (done * n) as f64;
    let hwm = rss_kib("VmHWM:");
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
    (us, hwm)
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --all-targets` does not,
    // and then this is not a test: run nothing.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        println!(
            "# transport-tcp benchmark (loopback, {} CPUs)",
            std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)
        );
        // TCP_BENCH_ONLY=notify runs the notification part alone,
        // TCP_BENCH_ONLY=latency the ping-pong and the 4 KiB write latency,
        // TCP_BENCH_ONLY=first the secret's cost to the first transfer,
        // TCP_BENCH_ONLY=samehost same-host 4 KiB reads and writes.
        let only = std::env::var("TCP_BENCH_ONLY").unwrap_or_default();
        let only_notify = only == "notify";
        // TCP_BENCH_ONLY=pingpong or =write: one of them alone, 3000
        // round trips (for `perf stat`: context switches per request).
        println!(
            "# {} (load average {})",
            idle_state(),
            std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim()
        );
        if only == "pingpong" || only == "write" || only == "engine" {
            let (p50, p99) = match only.as_str() {
                "pingpong" => ping_pong().await,
                "write" => latency().await,
                _ => latency_engine().await,
            };
            println!("{only} p50 {p50:.1} p99 {p99:.1}");
            return;
        }
        if only == "first" {
            // TCP_BENCH_ONLY=first: the handshake's cost to the first
            // transfer, next to one round trip (issue 49).
            for _ in 0..2 {
                let (q50, _) = ping_pong().await;
                let (plain, secret, steady) = first_transfer(100).await;
                println!(
                    "first transfer p50: no secret {plain:.1} us, secret {secret:.1} us, difference {:.1} us; \
                     one round trip: a 4 KiB write {steady:.1} us, plain TCP ping-pong {q50:.1} us \
                     (difference / write {:.2})",
                    secret - plain,
                    (secret - plain) / steady
                );
            }
            return;
        }
        if only == "samehost" {
            // TCP_BENCH_ONLY=samehost: same-host 4 KiB reads and writes,
            // direct (through the peer's window) and through the lanes,
            // next to the kernel copy they make; alternated, 3 rounds.
            for _ in 0..3 {
                let (k50, k99) = kernel_copy(3000);
                let [(dr50, dr99), (dw50, dw99)] = same_host_ops(true, 3000).await;
                let [(lr50, lr99), (lw50, lw99)] = same_host_ops(false, 3000).await;
                println!(
                    "kernel copy 4 KiB p50 {k50:.2} p99 {k99:.2} | direct: read p50 {dr50:.1} p99 {dr99:.1}, \
                     write p50 {dw50:.1} p99 {dw99:.1} | lanes: read p50 {lr50:.1} p99 {lr99:.1}, \
                     write p50 {lw50:.1} p99 {lw99:.1} | direct read / lanes read {:.2}, direct read / direct write {:.2}",
                    dr50 / lr50,
                    dr50 / dw50
                );
            }
            return;
        }
        if only == "latency" {
            for _ in 0..3 {
                let (q50, q99) = ping_pong().await;
                check_reference(q50);
                let (p50, p99) = latency().await;
                let (e50, e99) = latency_engine().await;
                println!(
                    "pingpong p50 {q50:.1} p99 {q99:.1} | write p50 {p50:.1} p99 {p99:.1} ({:.2}x, {:.2}x) \
                     | engine p50 {e50:.1} p99 {e99:.1} ({:.2}x, {:.2}x)",
                    p50 / q50,
                    p99 / q99,
                    e50 / q50,
                    e99 / q99
                );
            }
            return;
        }
        // Each measurement right after an iperf3 run of the same length;
        // three rounds, medians reported (the machine may be shared).
        let bw_cases: &[(usize, &str)] = if only_notify { &[] } else { &[(1 << 20, "1MiB"), (64 << 10, "64KiB")] };
        for &(slice, name) in bw_cases {
            for read in [false, true] {
                let dir = if read { "read" } else { "write" };
                let (mut ours, mut refs, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
                for _ in 0..3 {
                    let reference = iperf3(2);
                    let g = bandwidth(slice, read).await;
                    ours.push(g);
                    if let Some(r) = reference {
                        refs.push(r);
                        ratios.push(g / r);
                    }
                }
                println!("bw_{dir}_{name}_gbps {:.2}", median(ours));
                if !ratios.is_empty() {
                    println!("iperf3_next_to_{dir}_{name}_gbps {:.2}", median(refs));
                    println!("bw_{dir}_{name}_ratio_to_iperf3 {:.2}", median(ratios));
                }
            }
        }
        let (q50, q99) = ping_pong().await;
        check_reference(q50);
        println!("pingpong_4KiB_p50_us {q50:.1}\npingpong_4KiB_p99_us {q99:.1}");
        if !only_notify {
            let (p50, p99) = latency().await;
            println!("lat_write_4KiB_p50_us {p50:.1}\nlat_write_4KiB_p99_us {p99:.1}");
            println!("lat_ratio_p50 {:.2}\nlat_ratio_p99 {:.2}", p50 / q50, p99 / q99);
            let (e50, e99) = latency_engine().await;
            println!("lat_engine_write_4KiB_p50_us {e50:.1}\nlat_engine_write_4KiB_p99_us {e99:.1}");
            println!("lat_engine_ratio_p50 {:.2}\nlat_engine_ratio_p99 {:.2}", e50 / q50, e99 / q99);
        }
        for (name, size, rounds) in [("4KiB", 4096, 2000), ("1MiB", 1 << 20, 300)] {
            let (c50, c99, n50, n99) = notify_delay(size, rounds).await;
            println!("notify_{name}_completed_p50_us {c50:.1}\nnotify_{name}_completed_p99_us {c99:.1}");
            println!("notify_{name}_seen_by_receiver_p50_us {n50:.1}\nnotify_{name}_seen_by_receiver_p99_us {n99:.1}");
            println!("notify_{name}_ratio_p50 {:.2}", n50 / c50);
        }
        if only_notify {
            return;
        }
        let base = rss_kib("VmRSS:");
        println!("rss_before_batches_kib {base}");
        for n in [1usize, 64, 4096, 262_144] {
            let (us, hwm) = per_request(n).await;
            println!("batch_{n}_us_per_req {us:.3}");
            if n == 262_144 {
                println!("peak_rss_262144x2KiB_kib {hwm} (buffers alone: {} KiB)", 2 * 262_144 * 2);
            }
        }
    });
}
