//! The RDMA backend's write benchmark: two transports in this process on
//! one device (like perftest's two processes on one device), KV-cache-like
//! batches of equal pages.
//!
//!   rdma_bench bw  <page-bytes> <seconds>   # prints MiB/s
//!   rdma_bench lat <page-bytes> <iterations> # prints p50/p99 of one write, submit to completed
//!
//! scripts/rdma-bench.sh runs it beside ib_write_bw / ib_write_lat and
//! prints the ratios. Device: RDMA_TEST_DEVICE, else the first one.

use std::time::{Duration, Instant};

use transport_core::{Access, Buffer, SubmitOptions, TransferRequest, Transport};
use transport_rdma::{RdmaConfig, RdmaTransport};

fn usage() -> ! {
    eprintln!("usage: rdma_bench bw|lat <page-bytes> <seconds|iterations>");
    std::process::exit(2)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 4 {
        usage();
    }
    let size: u64 = args[2].parse().unwrap_or_else(|_| usage());
    let n: u64 = args[3].parse().unwrap_or_else(|_| usage());
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        let cfg = RdmaConfig { device: std::env::var("RDMA_TEST_DEVICE").ok(), ..RdmaConfig::default() };
        let server = RdmaTransport::new(cfg.clone()).await?;
        let client = RdmaTransport::new(cfg).await?;
        let total = (32u64 << 20).max(size * 16);
        let remote = Buffer::new(total as usize)?;
        server.register(remote.region(), Access::REMOTE_RW)?;
        let local = Buffer::new(total as usize)?;
        local.fill(0x5a);
        let lid = client.register(local.region(), Access::LOCAL)?;
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
                let start = Instant::now();
                let mut bytes = 0u64;
                while start.elapsed() < Duration::from_secs(n) {
                    let b = client.submit(batch.clone(), SubmitOptions::default()).await?;
                    let st = client.wait(b).await?;
                    client.release(b)?;
                    if let Some(e) = st.first_error() {
                        return Err(e.clone().into());
                    }
                    bytes += total;
                }
                let secs = start.elapsed().as_secs_f64();
                println!("ours write_bw size={size} MiB/s={:.2}", bytes as f64 / secs / (1u64 << 20) as f64);
            }
            "lat" => {
                let one = vec![TransferRequest::write(lid, 0, seg, remote.addr(), size)];
                let mut lat = Vec::with_capacity(n as usize);
                for i in 0..n + 20 {
                    let t0 = Instant::now();
                    let b = client.submit(one.clone(), SubmitOptions::default()).await?;
                    let st = client.wait(b).await?;
                    let dt = t0.elapsed();
                    client.release(b)?;
                    if let Some(e) = st.first_error() {
                        return Err(e.clone().into());
                    }
                    if i >= 20 {
                        lat.push(dt.as_secs_f64() * 1e6);
                    }
                }
                lat.sort_by(f64::total_cmp);
                let pct = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)];
                println!("ours write_lat size={size} p50_us={:.1} p99_us={:.1}", pct(0.5), pct(0.99));
            }
            _ => usage(),
        }
        client.shutdown().await?;
        server.shutdown().await?;
        Ok::<_, Box<dyn std::error::Error>>(())
    })
}
