//! The TCP backend moving CUDA device memory through the real CUDA provider
//! over the CUDA driver double (each test in a child process whose
//! `libcuda.so.1` is the double; `KVMOVE_CUDA_TESTS=gpu` runs it on a GPU):
//! device to device, host to device and device to host writes and reads,
//! byte-exact, unstaged and through pinned staging buffers; a driver
//! failure in a copy ends the request with a transient error (rule 7 of
//! docs/CONTRACT.md) and the next transfer works; nothing the provider took
//! is held once the transports and regions are gone.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use kvmove_cuda_double::{under_double, Double, Driver};
use transport_core::{
    Access, BatchState, Buffer, DeviceMemory, MemoryRegion, SubmitOptions, TransferRequest, Transport,
};
use transport_mem::CudaDevices;
use transport_tcp::{TcpConfig, TcpTransport};

const LEN: usize = 4 << 20;

fn pattern(n: usize, k: usize) -> Vec<u8> {
    (0..n).map(|i| (i * k + i / 4093 + 1) as u8).collect()
}

/// `reqs` submitted on `t` (deadline 60 s) to their end: its state and
/// first error. A batch that outlives its deadline by 30 s fails the test.
async fn run(t: &TcpTransport, reqs: Vec<TransferRequest>) -> (BatchState, Option<transport_core::Error>) {
    let id = t.submit(reqs, SubmitOptions::with_timeout(Duration::from_secs(60))).await.unwrap();
    let s = tokio::time::timeout(Duration::from_secs(90), t.wait(id))
        .await
        .expect("the batch ended within 30 s of its deadline")
        .unwrap();
    t.release(id).unwrap();
    (s.state, s.first_error().cloned())
}

async fn ok(t: &TcpTransport, reqs: Vec<TransferRequest>) {
    let (state, e) = run(t, reqs).await;
    assert_eq!(state, BatchState::Completed, "{e:?}");
}

async fn moves_cuda_memory(driver: Driver, staging: usize) {
    let cuda = Arc::new(CudaDevices::open().unwrap().expect("a CUDA device"));
    let second = u32::from(cuda.count() > 1);
    let (x, y) = (cuda.alloc(0, LEN).unwrap(), cuda.alloc(second, LEN).unwrap());
    let bytes = pattern(LEN, 7);
    cuda.copy_from_host(&bytes, x.addr()).unwrap();
    let provider: Arc<dyn DeviceMemory> = cuda.clone();
    // SAFETY: `x` and `y` stay allocated until the end of this function,
    // after the transports shut down and the regions are dropped.
    let (rx, ry) = unsafe {
        (
            MemoryRegion::from_device(provider.clone(), x.addr(), LEN).unwrap(),
            MemoryRegion::from_device(provider, y.addr(), LEN).unwrap(),
        )
    };
    // Every byte through the sockets (no same-host copies, which device
    // memory never takes anyway).
    let cfg = TcpConfig { staging_buffers: staging, same_host: false, ..TcpConfig::default() };
    let (a, b) = (TcpTransport::new(cfg.clone()).await.unwrap(), TcpTransport::new(cfg).await.unwrap());
    let host_a = Buffer::new(LEN).unwrap();
    let host_b = Buffer::new(LEN).unwrap();
    let lx = a.register(rx.clone(), Access::LOCAL).unwrap();
    let lh = a.register(host_a.region(), Access::LOCAL).unwrap();
    let ry_id = b.register(ry.clone(), Access::REMOTE_RW).unwrap();
    let rh_id = b.register(host_b.region(), Access::REMOTE_RW).unwrap();
    let seg = a.open_segment(&b.local_segment_name()).await.unwrap();
    let n = LEN as u64;

    // Device to device, in four requests.
    let reqs = (0..4).map(|k| TransferRequest::write(lx, k * n / 4, seg, y.addr() + k * n / 4, n / 4)).collect();
    ok(&a, reqs).await;
    assert!(ry.to_vec() == bytes, "device to device write (staging {staging})");
    // Host to device, at an offset.
    let host = pattern(LEN / 2, 3);
    host_a.write_at(0, &host).unwrap();
    ok(&a, vec![TransferRequest::write(lh, 0, seg, y.addr() + 4096, n / 2)]).await;
    let got = ry.to_vec();
    assert!(got[4096..4096 + LEN / 2] == host[..], "host to device write (staging {staging})");
    assert!(got[..4096] == bytes[..4096], "bytes before the range kept");
    // Device to host.
    ok(&a, vec![TransferRequest::write(lx, 8, seg, host_b.addr(), n / 2)]).await;
    let mut hb = vec![0u8; LEN / 2];
    host_b.read_at(0, &mut hb).unwrap();
    assert!(hb[..] == bytes[8..8 + LEN / 2], "device to host write (staging {staging})");
    // Reads: device to device and device to host.
    let want = ry.to_vec();
    ok(&a, vec![TransferRequest::read(lx, 0, seg, y.addr() + n / 2, n / 2)]).await;
    assert!(rx.to_vec()[..LEN / 2] == want[LEN / 2..], "device to device read (staging {staging})");
    ok(&a, vec![TransferRequest::read(lh, 0, seg, y.addr(), n / 4)]).await;
    let mut ha = vec![0u8; LEN / 4];
    host_a.read_at(0, &mut ha).unwrap();
    assert!(ha[..] == want[..LEN / 4], "device to host read (staging {staging})");

    if driver == Driver::Double {
        // A driver failure in the target's copy, then in the initiator's:
        // the request fails, transiently; the next write works.
        let d = Double::get();
        for call in ["cuMemcpyHtoDAsync_v2", "cuMemcpyDtoHAsync_v2"] {
            d.fail(call, 700, 1); // CUDA_ERROR_ILLEGAL_ADDRESS
            let (state, e) = run(&a, vec![TransferRequest::write(lx, 0, seg, y.addr(), 4096)]).await;
            assert_eq!(state, BatchState::Failed, "a failed {call}");
            let e = e.expect("an error");
            assert!(e.is_transient(), "a failed {call} must be transient (rule 7): {e}");
            ok(&a, vec![TransferRequest::write(lx, 0, seg, y.addr(), n)]).await;
            assert!(ry.to_vec() == rx.to_vec(), "the write after a failed {call}");
        }
    }

    a.close_segment(seg).await.unwrap();
    a.unregister(lx).await.unwrap();
    a.unregister(lh).await.unwrap();
    b.unregister(ry_id).await.unwrap();
    b.unregister(rh_id).await.unwrap();
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
    drop((a, b, rx, ry, x, y));
    if driver == Driver::Double {
        let d = Double::get();
        assert_eq!(d.live("host_registrations"), 0, "staging buffers unpinned");
        assert_eq!(d.live("allocations"), 0);
        drop(cuda);
        assert_eq!(d.live("streams"), 0);
        assert_eq!(d.live("contexts"), 0);
    }
}

fn block_on(f: impl std::future::Future<Output = ()>) {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap().block_on(f);
}

#[test]
fn tcp_moves_cuda_memory() {
    let Some(driver) = under_double("tcp_moves_cuda_memory", &[]) else { return };
    block_on(moves_cuda_memory(driver, 0));
}

#[test]
fn tcp_moves_cuda_memory_through_pinned_staging_buffers() {
    let Some(driver) = under_double("tcp_moves_cuda_memory_through_pinned_staging_buffers", &[]) else { return };
    block_on(moves_cuda_memory(driver, 4));
}
