//! Device memory over TCP (a benchmark, not a test): 64 MiB writes
//! host-to-host against device-to-device, both ends on fake devices
//! (`FakeDevice`: the provider copies through its own mapping, as a GPU
//! runtime copies over PCIe), alternated in rounds in one run on loopback.
//! Both go through the sockets (`same_host = false`: the two transports
//! share this process, where host memory would otherwise move by
//! same-host copies, a path device memory never takes). Prints each round
//! and the ratio of the medians.
//!
//! `cargo run --release -p transport-tcp --example device_bench [ROUNDS] [--slow[=US]] [--staging=N] [--read]`
//!
//! `--read` measures 64 MiB reads instead (the initiator reads the
//! target's memory into its own).
//!
//! `--staging=N` moves device memory through N staging buffers
//! (`TcpConfig::staging_buffers`; default 0, off).
//!
//! With `--slow` each fake device copy takes at least US microseconds
//! (default 100): TCP copies device memory in chunks of at most 256 KiB,
//! so 100 us a copy is about 2.6 GB/s, a copy that costs about as much as
//! the loopback wire. It shows how much of the copy time the pipelining
//! hides (without overlap the device->device rate would be about half).
//!
//! With `--cuda` (built with `--features cuda`, on a machine with an
//! NVIDIA GPU) the device memory is real GPU memory (`cuMemAlloc`, two
//! devices where there are two), and the provider's own copy bandwidth
//! (64 MiB device to host and host to device) is printed next to it.
#![allow(clippy::unwrap_used, clippy::expect_used)] // benchmark code: a failure should panic

use std::sync::Arc;
use std::time::{Duration, Instant};

use transport_core::{Access, BatchState, Buffer, FakeDevice, MemoryRegion, SubmitOptions, TransferRequest, Transport};
use transport_tcp::{TcpConfig, TcpTransport};

const LEN: usize = 64 << 20;
const PART: u64 = 16 << 20;

/// `a` writes its `local` into `b`'s `remote` (or, with `read`, reads
/// `b`'s `remote` into its `local`) for 2 s: Gbit/s.
async fn gbps(a: &TcpTransport, b: &TcpTransport, local: MemoryRegion, remote: MemoryRegion, read: bool) -> f64 {
    let l = a.register(local, Access::LOCAL).unwrap();
    let r = b.register(remote.clone(), Access::REMOTE_RW).unwrap();
    let seg = a.open_segment(&b.local_segment_name()).await.unwrap();
    let op = if read { TransferRequest::read } else { TransferRequest::write };
    let reqs: Vec<TransferRequest> =
        (0..LEN as u64 / PART).map(|k| op(l, k * PART, seg, remote.addr() + k * PART, PART)).collect();
    let run = |reqs: Vec<TransferRequest>| async move {
        let id = a.submit(reqs, SubmitOptions::default()).await.unwrap();
        let s = a.wait(id).await.unwrap();
        assert_eq!(s.state, BatchState::Completed, "{:?}", s.first_error());
        a.release(id).unwrap();
    };
    run(reqs.clone()).await; // warm up
    let start = Instant::now();
    let mut bytes = 0u64;
    while start.elapsed() < Duration::from_secs(2) {
        run(reqs.clone()).await;
        bytes += LEN as u64;
    }
    let g = bytes as f64 * 8.0 / start.elapsed().as_secs_f64() / 1e9;
    a.close_segment(seg).await.unwrap();
    a.unregister(l).await.unwrap();
    b.unregister(r).await.unwrap();
    g
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|x, y| x.total_cmp(y));
    v[v.len() / 2]
}

/// Two device regions of `LEN` bytes: on fake devices, or (`--cuda`) on
/// GPUs, with whatever keeps the GPU memory allocated.
type Keep = Box<dyn std::any::Any>;

fn fake_regions() -> (MemoryRegion, MemoryRegion, &'static str, Keep, Vec<Arc<FakeDevice>>) {
    let (da, db) = (Arc::new(FakeDevice::new(0, LEN).unwrap()), Arc::new(FakeDevice::new(1, LEN).unwrap()));
    let (ra, rb) = (FakeDevice::region(&da, LEN).unwrap(), FakeDevice::region(&db, LEN).unwrap());
    (ra, rb, "fake devices", Box::new(()), vec![da, db])
}

#[cfg(feature = "cuda")]
fn cuda_regions() -> (MemoryRegion, MemoryRegion, &'static str, Keep) {
    use transport_core::DeviceMemory;
    let cuda = Arc::new(transport_mem::CudaDevices::open().unwrap().expect("--cuda: no CUDA driver or no GPU here"));
    let second = u32::from(cuda.count() > 1);
    let (x, y) = (cuda.alloc(0, LEN).unwrap(), cuda.alloc(second, LEN).unwrap());
    let provider: Arc<dyn DeviceMemory> = cuda.clone();
    // SAFETY: `x` and `y` stay allocated in `Keep` until after the
    // transports shut down at the end of `main`.
    let (rx, ry) = unsafe {
        (
            MemoryRegion::from_device(provider.clone(), x.addr(), LEN).unwrap(),
            MemoryRegion::from_device(provider, y.addr(), LEN).unwrap(),
        )
    };
    let mut host = vec![0u8; LEN];
    for (what, f) in [("device to host", true), ("host to device", false)] {
        let start = Instant::now();
        for _ in 0..8 {
            if f {
                cuda.copy_to_host(x.addr(), &mut host).unwrap();
            } else {
                cuda.copy_from_host(&host, x.addr()).unwrap();
            }
        }
        let g = 8.0 * LEN as f64 * 8.0 / start.elapsed().as_secs_f64() / 1e9;
        println!("CUDA provider copies, 64 MiB {what} (pageable host memory): {g:.2} Gbit/s");
    }
    let what = if second == 1 { "GPUs 0 and 1" } else { "GPU 0" };
    (rx, ry, what, Box::new((x, y, cuda)))
}

#[cfg(not(feature = "cuda"))]
fn cuda_regions() -> (MemoryRegion, MemoryRegion, &'static str, Keep) {
    panic!("--cuda needs a build with `--features cuda`");
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // `--staging=N`: device memory through N staging buffers (default 0,
    // off: copied by the socket tasks into and out of their own buffers).
    let staging = args.iter().find_map(|a| a.strip_prefix("--staging=")?.parse().ok()).unwrap_or(0);
    // Every byte through the sockets: both transports run in this one
    // process, where host memory would otherwise go by same-host copies
    // (`same_host`), which device memory never takes.
    let cfg = TcpConfig { staging_buffers: staging, same_host: false, ..TcpConfig::default() };
    let use_cuda = args.iter().any(|a| a == "--cuda");
    let read = args.iter().any(|a| a == "--read");
    let rounds: usize =
        args.iter().find(|a| !a.starts_with("--")).and_then(|s| s.parse().ok()).unwrap_or(5).clamp(1, 50);
    let (a, b) = (TcpTransport::new(cfg.clone()).await.unwrap(), TcpTransport::new(cfg.clone()).await.unwrap());
    let (hs, hd) = (Buffer::new(LEN).unwrap(), Buffer::new(LEN).unwrap());
    hs.fill(7);
    let slow: Option<u64> = args.iter().find_map(|a| {
        let rest = a.strip_prefix("--slow")?;
        Some(rest.strip_prefix('=').and_then(|us| us.parse().ok()).unwrap_or(100))
    });
    let (ds, dd, mut devices, keep, fakes) = if use_cuda {
        let (x, y, what, keep) = cuda_regions();
        (x, y, what.to_string(), keep, Vec::new())
    } else {
        let (x, y, what, keep, fakes) = fake_regions();
        (x, y, what.to_string(), keep, fakes)
    };
    ds.write_at(0, &vec![7u8; LEN]).unwrap();
    if let Some(us) = slow {
        for d in &fakes {
            d.delay_copies(Duration::from_micros(us));
        }
        devices = format!("{devices}, each copy >= {us} us");
    }
    devices = format!("{devices}, staging_buffers {staging}");
    let (mut host, mut dev) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        // Either way the bytes go from `hs` / `ds` into `hd` / `dd`.
        let (h, d) = if read {
            (gbps(&a, &b, hd.region(), hs.region(), true).await, gbps(&a, &b, dd.clone(), ds.clone(), true).await)
        } else {
            (gbps(&a, &b, hs.region(), hd.region(), false).await, gbps(&a, &b, ds.clone(), dd.clone(), false).await)
        };
        println!("round {round}: host->host {h:.2} Gbit/s, device->device {d:.2} Gbit/s");
        host.push(h);
        dev.push(d);
    }
    for d in &fakes {
        d.delay_copies(Duration::ZERO);
    }
    assert!(dd.to_vec() == vec![7u8; LEN], "the device bytes differ");
    let (h, d) = (median(host), median(dev));
    println!(
        "64 MiB {} over TCP on loopback, median of {rounds} rounds: host->host {h:.2} Gbit/s ({:.2} GB/s), device->device ({devices}) {d:.2} Gbit/s ({:.2} GB/s), ratio {:.2}",
        if read { "reads" } else { "writes" },
        h / 8.0,
        d / 8.0,
        d / h
    );
    assert_eq!(a.same_host_bytes(), 0, "host memory went by same-host copies, not through the sockets");
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
    drop((ds, dd, keep));
}
