//! The RDMA backend's write benchmark: two transports in this process on
//! one device (like perftest's two processes on one device), KV-cache-like
//! batches of equal pages (two batches in flight for bandwidth).
//!
//!   rdma_bench bw  <page-bytes> <seconds>   # prints MiB/s (RDMA_BENCH_STAGED=1: the source
//!                                           # is fake-device memory staged through host buffers)
//!   rdma_bench lat <page-bytes> <iterations> # prints p50/p99 of one write, submit to completed
//!   rdma_bench pingpong <bytes> <iterations> # ib_write_lat's method: half a write ping-pong
//!   rdma_bench first <bytes> <iterations>   # a fresh initiator's open + first write, p50,
//!                                           # beside a plain TCP round trip on loopback
//!   rdma_bench notify <bytes> <rounds>      # rule 11: a batch's completion on the sender
//!                                           # vs the receiver seeing its attached notification
//!   rdma_bench railbw <page-bytes> <seconds> <rails>
//!                                           # multi-rail: a sender `Rails` over devices 0..r-1,
//!                                           # a receiver `Rails` over r..2r-1; prints MiB/s and
//!                                           # the bytes each path moved
//!
//! scripts/rdma-bench.sh runs it beside ib_write_bw / ib_write_lat and
//! prints the ratios (RAILS_BENCH=1: railbw beside r concurrent
//! ib_write_bw pairs). Device: RDMA_TEST_DEVICE, else the first one;
//! railbw takes RDMA_TEST_DEVICES (space separated), else every device.

use std::sync::Arc;
use std::time::{Duration, Instant};

use transport_core::{Access, BatchId, BatchState, Buffer, SubmitOptions, TransferRequest, Transport};
use transport_rails::Rails;
use transport_rails::RailsConfig;
use transport_rdma::{rdma_devices, RdmaConfig, RdmaTransport};

type BoxErr = Box<dyn std::error::Error + Send + Sync>;

fn usage() -> ! {
    eprintln!(
        "usage: rdma_bench bw|lat|pingpong|notify|first <page-bytes> <seconds|iterations|rounds>\n       \
         rdma_bench railbw <page-bytes> <seconds> <rails>"
    );
    std::process::exit(2)
}

/// Waits for and releases a finished batch, failing on its error.
async fn reap<T: Transport + ?Sized>(t: &T, b: Option<BatchId>) -> Result<(), BoxErr> {
    let Some(b) = b else { return Ok(()) };
    let st = t.wait(b).await?;
    t.release(b)?;
    match st.first_error() {
        Some(e) => Err(e.clone().into()),
        None => Ok(()),
    }
}

/// Spins until the last byte of `inbox` is `want`, as ib_write_lat does
/// (a tight loop over the memory), yielding to the runtime now and then.
async fn arrival(inbox: &Buffer, want: u8) -> Result<(), BoxErr> {
    let mut last = [0u8; 1];
    let at = inbox.len() - 1;
    let region = inbox.region();
    let start = Instant::now();
    loop {
        for _ in 0..4096 {
            // The NIC writes this memory: read it afresh every time.
            std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
            region.read_at(at, &mut last)?;
            if last[0] == want {
                return Ok(());
            }
            std::hint::spin_loop();
        }
        if start.elapsed() > Duration::from_secs(10) {
            return Err("ping-pong: no arrival in 10 s".into());
        }
        tokio::task::yield_now().await;
    }
}

/// Times intervals as perftest does, with the CPU's time-stamp counter:
/// no system call inside the timed path (in a VM whose clock source is
/// not the TSC, each clock read is a system call of about 2 us, and two of
/// them fell inside every timed interval). Ticks become microseconds at
/// the rate measured against the clock over the stopwatch's whole life.
/// Without a TSC (not x86-64) it ticks in nanoseconds of the clock.
#[derive(Clone, Copy)]
struct Stopwatch {
    c0: u64,
    i0: Instant,
}

impl Stopwatch {
    fn new() -> Self {
        Self { c0: transport_rdma::cycles(), i0: Instant::now() }
    }

    fn now(&self) -> u64 {
        match transport_rdma::cycles() {
            0 => self.i0.elapsed().as_nanos() as u64,
            c => c,
        }
    }

    /// Ticks per microsecond, measured now.
    fn per_us(&self) -> f64 {
        let us = self.i0.elapsed().as_secs_f64() * 1e6;
        match transport_rdma::cycles() {
            0 => 1e3,
            c => c.wrapping_sub(self.c0) as f64 / us.max(1.0),
        }
    }
}

/// Per iteration, [`Stopwatch`] stamps at each step of one side of
/// [`pingpong`] (PINGPONG_TRACE=1 prints where the time goes).
type Stamps = Vec<[u64; 4]>;

fn trace_report(a: &Stamps, b: &Stamps, per_us: f64) {
    // A: [start, submit returned, reply seen, reaped]; B: [seen, submit returned, reaped, -].
    let us = |d: i128| d as f64 / per_us;
    let med = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    let n = a.len().min(b.len());
    let d = |f: &dyn Fn(usize) -> i128| med((0..n).map(|i| us(f(i))).collect());
    println!(
        "trace (median us): A submit {:.1} | A start -> B sees {:.1} | B sees -> B submit returned {:.1} | \
         B sees -> A sees {:.1} | B submit returned -> B reaped {:.1} | A sees -> A reaped {:.1} | \
         A reaped -> A next start {:.1} | B reaped -> next arrival at B {:.1}",
        d(&|i| a[i][1] as i128 - a[i][0] as i128),
        d(&|i| b[i][0] as i128 - a[i][0] as i128),
        d(&|i| b[i][1] as i128 - b[i][0] as i128),
        d(&|i| a[i][2] as i128 - b[i][0] as i128),
        d(&|i| b[i][2] as i128 - b[i][1] as i128),
        d(&|i| a[i][3] as i128 - a[i][2] as i128),
        d(&|i| if i + 1 < n { a[i + 1][0] as i128 - a[i][3] as i128 } else { 0 }),
        d(&|i| if i + 1 < n { b[i + 1][0] as i128 - b[i][2] as i128 } else { 0 }),
    );
}

/// ib_write_lat's measurement with our API: A writes `size` bytes into B's
/// inbox (the last byte carries the iteration), B sees it in its memory
/// and writes back, A sees that. Latency = half of A's round trip; each
/// side reaps its previous write's completion after the timed path. Like
/// perftest's two processes, each side runs alone on its own thread (a
/// current-thread runtime each), so neither waits for the other's CPU.
fn pingpong(cfg: RdmaConfig, size: u64, n: u64) -> Result<Vec<f64>, BoxErr> {
    use std::sync::mpsc::channel;
    // Names and inbox addresses cross between the two sides over channels.
    let (to_a, from_b) = channel();
    let (to_b, from_a) = channel();
    let cfg_b = cfg.clone();
    // One stopwatch for both sides, so their stamps compare.
    let sw = Stopwatch::new();
    let responder = std::thread::spawn(move || pingpong_side(cfg_b, size, n, (to_a, from_a), false, sw));
    let (ticks, a) = pingpong_side(cfg, size, n, (to_b, from_b), true, sw)?;
    let (_, b) = responder.join().map_err(|_| "responder thread panicked")??;
    let per_us = sw.per_us();
    if std::env::var("PINGPONG_TRACE").is_ok_and(|v| v == "1") {
        trace_report(&a, &b, per_us);
    }
    Ok(ticks.into_iter().map(|t| t as f64 / per_us / 2.0).collect())
}

type Introduction = (String, u64);

/// One side of [`pingpong`] on its own current-thread runtime. The side
/// that `starts` writes first and times each round trip (returned in
/// stopwatch ticks, warm-up excluded); the other answers.
fn pingpong_side(
    cfg: RdmaConfig,
    size: u64,
    n: u64,
    (tell, hear): (std::sync::mpsc::Sender<Introduction>, std::sync::mpsc::Receiver<Introduction>),
    starts: bool,
    sw: Stopwatch,
) -> Result<(Vec<u64>, Stamps), BoxErr> {
    const WARMUP: u64 = 20;
    tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async move {
        let t = RdmaTransport::new(cfg).await?;
        let inbox = Buffer::new(size as usize)?;
        t.register(inbox.region(), Access::REMOTE_RW)?;
        let outbox = Buffer::new(size as usize)?;
        let out = t.register(outbox.region(), Access::LOCAL)?;
        tell.send((t.local_segment_name(), inbox.addr()))?;
        let (peer, peer_inbox) = hear.recv()?;
        let seg = t.open_segment(&peer).await?;
        let w = TransferRequest::write(out, 0, seg, peer_inbox, size);
        let mut lat = Vec::with_capacity(n as usize);
        let mut stamps: Stamps = Vec::with_capacity((n + WARMUP) as usize);
        let mut prev = None;
        for i in 1..=n + WARMUP {
            let mut st = [0u64; 4];
            let t0 = sw.now();
            if !starts {
                arrival(&inbox, i as u8).await?;
            }
            st[0] = sw.now();
            outbox.write_at(outbox.len() - 1, &[i as u8])?;
            let id = t.submit(vec![w], SubmitOptions::default()).await?;
            st[1] = sw.now();
            if starts {
                arrival(&inbox, i as u8).await?;
                st[2] = sw.now();
                if i > WARMUP {
                    lat.push(sw.now().wrapping_sub(t0));
                }
            }
            reap(&t, prev.replace(id)).await?;
            st[if starts { 3 } else { 2 }] = sw.now();
            if i > WARMUP {
                stamps.push(st);
            }
        }
        reap(&t, prev).await?;
        t.shutdown().await?;
        Ok((lat, stamps))
    })
}

/// Rule 11's cost, as transport-tcp's bench measures it: per round, one
/// plain `size`-byte write batch timed from submit to completed on the
/// sender, then the same batch with a notification attached
/// (`notify_after`) timed from submit to the receiver seeing it
/// (`wait_notification` + `take_notifications` on a task of its own);
/// interleaved, so both see the same moment. The first tenth of the
/// rounds (endpoint and notification channel set-up) is left out.
/// Returns (completed p50, p99, seen p50, p99) in microseconds.
async fn notify_delay(
    client: &RdmaTransport,
    server: &std::sync::Arc<RdmaTransport>,
    lid: transport_core::RegionId,
    seg: transport_core::SegmentId,
    remote: u64,
    size: u64,
    rounds: u64,
) -> Result<(f64, f64, f64, f64), BoxErr> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Instant>();
    let receiver = server.clone();
    let recv = tokio::spawn(async move {
        while receiver.wait_notification().await.is_ok() {
            let Ok(ns) = receiver.take_notifications(16) else { return };
            for _ in ns {
                let _ = tx.send(Instant::now());
            }
        }
    });
    let one = vec![TransferRequest::write(lid, 0, seg, remote, size)];
    let rounds = rounds.max(2);
    let (mut done, mut seen) = (Vec::new(), Vec::new());
    for i in 0..rounds {
        let t0 = Instant::now();
        let b = client.submit(one.clone(), SubmitOptions::default()).await?;
        let st = client.wait(b).await?;
        let completed = t0.elapsed().as_secs_f64() * 1e6;
        client.release(b)?;
        if let Some(e) = st.first_error() {
            return Err(e.clone().into());
        }
        let t1 = Instant::now();
        let b = client.submit(one.clone(), SubmitOptions::default()).await?;
        let (st, sent) = client.notify_after(b, seg, b"landed".to_vec()).await?;
        client.release(b)?;
        if st.state != BatchState::Completed {
            return Err(format!("notify: batch ended {:?}", st.state).into());
        }
        sent.ok_or("notify: completed, yet nothing sent")??;
        let at = tokio::time::timeout(Duration::from_secs(30), rx.recv())
            .await
            .map_err(|_| "notify: not seen by the receiver in 30 s")?
            .ok_or("notify: receiver task ended")?;
        if i >= rounds / 10 {
            done.push(completed);
            seen.push(at.saturating_duration_since(t1).as_secs_f64() * 1e6);
        }
    }
    recv.abort();
    let _ = recv.await;
    Ok((pct(&mut done, 0.5), pct(&mut done, 0.99), pct(&mut seen, 0.5), pct(&mut seen, 0.99)))
}

fn pct(lat: &mut [f64], p: f64) -> f64 {
    lat.sort_by(f64::total_cmp);
    lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)]
}

/// Batches in flight in `railbw`, each over its own part of the buffers.
const RAIL_DEPTH: u64 = 4;

/// The byte `railbw` writes at offset `off` of the source (and expects
/// there in the destination): not constant within a page, different
/// from page to page.
fn pattern(off: u64) -> u8 {
    ((off >> 3).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8 ^ off as u8
}

/// One side of `railbw`: a `Rails` over `devices`, one `RdmaTransport`
/// each, RailsConfig defaults.
async fn rails_over(devices: &[String]) -> Result<Arc<Rails>, BoxErr> {
    let mut rails: Vec<Arc<dyn Transport>> = Vec::with_capacity(devices.len());
    for d in devices {
        let cfg = RdmaConfig { device: Some(d.clone()), listen: "127.0.0.1:0".into(), ..RdmaConfig::default() };
        rails.push(Arc::new(RdmaTransport::new(cfg).await.map_err(|e| format!("railbw: device {d}: {e}"))?));
    }
    Ok(Rails::new(rails, None, RailsConfig::default())?)
}

/// Multi-rail write bandwidth: a sender `Rails` over the first `r`
/// devices, a receiver `Rails` over the next `r` (rail i of the sender
/// pairs with rail i of the receiver, so each path crosses the bridge
/// between two devices, as the i-th ib_write_bw pair does). RAIL_DEPTH
/// batches of `size`-byte writes stay in flight for `secs` seconds, each
/// over its own quarter of a 64 MiB (or `size` x 16) buffer. Prints the
/// rate, the bytes each path moved in the timed part, and the outcome of
/// comparing the whole destination with the source afterwards.
async fn rail_bw(size: u64, secs: u64, r: usize) -> Result<(), BoxErr> {
    let devices: Vec<String> = match std::env::var("RDMA_TEST_DEVICES") {
        Ok(s) if !s.trim().is_empty() => s.split_whitespace().map(String::from).collect(),
        _ => rdma_devices()?,
    };
    if r == 0 || devices.len() < 2 * r {
        return Err(format!("railbw: {r} rails per side need {} devices, have {devices:?}", 2 * r).into());
    }
    let sender = rails_over(&devices[..r]).await?;
    let receiver = rails_over(&devices[r..2 * r]).await?;
    let per_batch = ((64u64 << 20) / size / RAIL_DEPTH).max(4);
    let total = per_batch * RAIL_DEPTH * size;
    let src = Buffer::from_slice(&(0..total).map(pattern).collect::<Vec<u8>>())?;
    let dst = Buffer::new(total as usize)?;
    let lid = sender.register(src.region(), Access::LOCAL)?;
    receiver.register(dst.region(), Access::REMOTE_RW)?;
    let seg = sender.open_segment(&receiver.local_segment_name()).await?;
    let batches: Vec<Vec<TransferRequest>> = (0..RAIL_DEPTH)
        .map(|k| {
            (k * per_batch..(k + 1) * per_batch)
                .map(|i| TransferRequest::write(lid, i * size, seg, dst.addr() + i * size, size))
                .collect()
        })
        .collect();
    // Warm up: builds every path's endpoint and fills the destination once.
    let mut warm = Vec::new();
    for b in &batches {
        warm.push(sender.submit(b.clone(), SubmitOptions::default()).await?);
    }
    for b in warm {
        reap(&*sender, Some(b)).await?;
    }
    let before: Vec<u64> = sender.paths(seg)?.iter().map(|p| p.bytes).collect();
    // Nothing is in flight: clear the destination, so what is verified at
    // the end is what the timed batches wrote (every part gets at least
    // one: the first RAIL_DEPTH batches cover the whole buffer).
    dst.fill(0);
    let start = Instant::now();
    let mut bytes = 0u64;
    let mut inflight = std::collections::VecDeque::new();
    let mut next = 0usize;
    loop {
        let running = start.elapsed() < Duration::from_secs(secs);
        if running {
            let b = sender.submit(batches[next].clone(), SubmitOptions::default()).await?;
            inflight.push_back(b);
            next = (next + 1) % batches.len();
        }
        if (inflight.len() as u64) < RAIL_DEPTH && running {
            continue;
        }
        let Some(b) = inflight.pop_front() else { break };
        reap(&*sender, Some(b)).await?;
        bytes += per_batch * size;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let paths: Vec<String> = sender
        .paths(seg)?
        .iter()
        .zip(before.iter().chain(std::iter::repeat(&0)))
        .map(|(p, b0)| {
            let (a, b) = (
                p.rail.map_or("tcp".into(), |i| devices[i].clone()),
                p.peer_rail.map_or("tcp".into(), |i| devices[r + i].clone()),
            );
            let extra = if p.failures > 0 || p.pauses > 0 {
                format!("(failures={},pauses={})", p.failures, p.pauses)
            } else {
                String::new()
            };
            format!("{a}>{b}:{}{extra}", p.bytes.saturating_sub(*b0))
        })
        .collect();
    let mut bad = None;
    let (mut got, mut want) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    for at in (0..total).step_by(1 << 20) {
        let n = (total - at).min(1 << 20) as usize;
        dst.read_at(at as usize, &mut got[..n])?;
        src.read_at(at as usize, &mut want[..n])?;
        if let Some(i) = (0..n).find(|&i| got[i] != want[i]) {
            bad = Some(at + i as u64);
            break;
        }
    }
    println!(
        "ours rails_bw size={size} rails={r} MiB/s={:.2} secs={elapsed:.1} paths={} verified={}",
        bytes as f64 / elapsed / (1u64 << 20) as f64,
        paths.join(","),
        if bad.is_none() { "ok" } else { "BAD" }
    );
    sender.shutdown().await?;
    receiver.shutdown().await?;
    match bad {
        Some(at) => Err(format!("railbw: destination differs from the source at byte {at}").into()),
        None => Ok(()),
    }
}

/// `first`: what a peer's first transfer costs. Per iteration a fresh
/// initiator transport opens the target's segment (the side channel's
/// handshake, descriptor, QP group) and writes `size` bytes once; prints
/// the p50 of open + write, beside the p50 round trip of a plain TCP
/// ping-pong on loopback measured in the same run (the side channel's
/// unit of cost).
async fn first_transfer(size: u64, n: u64) -> Result<(), BoxErr> {
    use std::io::{Read, Write};
    let cfg = RdmaConfig { device: std::env::var("RDMA_TEST_DEVICE").ok(), ..RdmaConfig::default() };
    let server = RdmaTransport::new(cfg.clone()).await?;
    let remote = Buffer::new(size.max(4096) as usize)?.region();
    server.register(remote.clone(), Access::REMOTE_RW)?;
    let name = server.local_segment_name();
    let mut took = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let client = RdmaTransport::new(cfg.clone()).await?;
        let src = Buffer::new(size.max(1) as usize)?;
        let lid = client.register(src.region(), Access::LOCAL)?;
        let t0 = Instant::now();
        let seg = client.open_segment(&name).await?;
        let b = client
            .submit(vec![TransferRequest::write(lid, 0, seg, remote.addr(), size)], SubmitOptions::default())
            .await?;
        reap(&client, Some(b)).await?;
        took.push(t0.elapsed().as_secs_f64() * 1e6);
        client.shutdown().await?;
    }
    server.shutdown().await?;
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let at = listener.local_addr()?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let mut b = [0u8; 1];
        while s.read(&mut b)? == 1 {
            s.write_all(&b)?;
        }
        Ok(())
    });
    let mut s = std::net::TcpStream::connect(at)?;
    s.set_nodelay(true)?;
    let mut rtt = Vec::with_capacity(200);
    let mut b = [7u8; 1];
    for _ in 0..200 {
        let t0 = Instant::now();
        s.write_all(&b)?;
        s.read_exact(&mut b)?;
        rtt.push(t0.elapsed().as_secs_f64() * 1e6);
    }
    drop(s);
    let _ = echo.join();
    let (f50, r50) = (pct(&mut took, 0.5), pct(&mut rtt, 0.5));
    println!("ours first_transfer size={size} n={n} p50_us={f50:.0} tcp_rtt_p50_us={r50:.1}");
    Ok(())
}

fn main() -> Result<(), BoxErr> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() == 5 && args[1] == "railbw" {
        let size: u64 = args[2].parse().ok().filter(|&s| s > 0).unwrap_or_else(|| usage());
        let secs: u64 = args[3].parse().ok().filter(|&s| s > 0).unwrap_or_else(|| usage());
        let rails: usize = args[4].parse().unwrap_or_else(|_| usage());
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
        return rt.block_on(rail_bw(size, secs, rails));
    }
    if args.len() != 4 {
        usage();
    }
    let size: u64 = args[2].parse().unwrap_or_else(|_| usage());
    let n: u64 = args[3].parse().unwrap_or_else(|_| usage());
    if args[1] == "first" {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
        return rt.block_on(first_transfer(size, n.max(1)));
    }
    if args[1] == "pingpong" {
        let cfg = RdmaConfig { device: std::env::var("RDMA_TEST_DEVICE").ok(), ..RdmaConfig::default() };
        let mut lat = pingpong(cfg, size.max(1), n.max(1))?;
        let (p50, p99) = (pct(&mut lat, 0.5), pct(&mut lat, 0.99));
        println!("ours write_pingpong size={size} p50_us={p50:.1} p99_us={p99:.1}");
        return Ok(());
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        let cfg = RdmaConfig { device: std::env::var("RDMA_TEST_DEVICE").ok(), ..RdmaConfig::default() };
        let server = std::sync::Arc::new(RdmaTransport::new(cfg.clone()).await?);
        let client = RdmaTransport::new(cfg).await?;
        let total = (32u64 << 20).max(size * 16);
        let mode = std::env::var("RDMA_BENCH_STAGED").unwrap_or_default();
        let remote = if mode == "2" {
            let dev = Arc::new(transport_core::FakeDevice::new(1, total as usize)?);
            transport_core::FakeDevice::region(&dev, total as usize)?
        } else {
            Buffer::new(total as usize)?.region()
        };
        server.register(remote.clone(), Access::REMOTE_RW)?;
        // RDMA_BENCH_STAGED=1: the source is device memory of a fake
        // device, staged through pinned host buffers (no GPUDirect); =2:
        // the target's memory too (staged through its buffers).
        let staged = mode == "1" || mode == "2";
        let local = if staged {
            let dev = Arc::new(transport_core::FakeDevice::new(0, total as usize)?);
            transport_core::FakeDevice::region(&dev, total as usize)?
        } else {
            Buffer::new(total as usize)?.region()
        };
        local.fill(0x5a);
        let lid = client.register(local, Access::LOCAL)?;
        let source = match mode.as_str() {
            "1" => "staged-to-host",
            "2" => "staged-to-staged",
            _ => "host",
        };
        let seg = client.open_segment(&server.local_segment_name()).await?;
        let pages = total / size;
        let batch: Vec<TransferRequest> =
            (0..pages).map(|i| TransferRequest::write(lid, i * size, seg, remote.addr() + i * size, size)).collect();
        // Warm up: builds the endpoint.
        let b = client.submit(batch.clone(), SubmitOptions::default()).await?;
        let st = client.wait(b).await?;
        client.release(b)?;
        if let Some(e) = st.first_error() {
            return Err(e.clone().into());
        }
        match args[1].as_str() {
            "bw" => {
                // Two batches in flight, as a serving engine moving one
                // layer while it queues the next: the QPs never run dry
                // between batches (ib_write_bw keeps its queue full too).
                let start = Instant::now();
                let mut bytes = 0u64;
                let mut inflight = std::collections::VecDeque::new();
                loop {
                    let running = start.elapsed() < Duration::from_secs(n);
                    if running {
                        inflight.push_back(client.submit(batch.clone(), SubmitOptions::default()).await?);
                    }
                    if inflight.len() < 2 && running {
                        continue;
                    }
                    let Some(b) = inflight.pop_front() else { break };
                    reap(&client, Some(b)).await?;
                    bytes += total;
                }
                let secs = start.elapsed().as_secs_f64();
                let rate = bytes as f64 / secs / (1u64 << 20) as f64;
                println!("ours write_bw size={size} source={source} MiB/s={rate:.2}");
            }
            "lat" => {
                let one = vec![TransferRequest::write(lid, 0, seg, remote.addr(), size)];
                let mut lat = Vec::with_capacity(n as usize);
                let sw = Stopwatch::new();
                for i in 0..n + 20 {
                    let t0 = sw.now();
                    let b = client.submit(one.clone(), SubmitOptions::default()).await?;
                    let st = client.wait(b).await?;
                    let dt = sw.now().wrapping_sub(t0);
                    client.release(b)?;
                    if let Some(e) = st.first_error() {
                        return Err(e.clone().into());
                    }
                    if i >= 20 {
                        lat.push(dt);
                    }
                }
                let per_us = sw.per_us();
                let mut lat: Vec<f64> = lat.into_iter().map(|ticks| ticks as f64 / per_us).collect();
                let (p50, p99) = (pct(&mut lat, 0.5), pct(&mut lat, 0.99));
                println!("ours write_lat size={size} p50_us={p50:.1} p99_us={p99:.1}");
            }
            "notify" => {
                let (c50, c99, n50, n99) = notify_delay(&client, &server, lid, seg, remote.addr(), size, n).await?;
                println!(
                    "ours notify size={size} completed_p50_us={c50:.1} completed_p99_us={c99:.1} \
                     seen_p50_us={n50:.1} seen_p99_us={n99:.1} ratio_p50={:.2}",
                    n50 / c50
                );
            }
            _ => usage(),
        }
        client.shutdown().await?;
        server.shutdown().await?;
        Ok::<_, BoxErr>(())
    })
}
