//! Regressions in the endpoint and request lifecycle: callers that stop
//! waiting mid-connect, peers that answer too early or stall mid-answer,
//! lanes that die as they start.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failure should panic

mod support;

use support::run;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use support::fake_peer::{self, FakePeer, Script};
use support::proxy::FaultProxy;
use support::{eventually, node, test_config};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch};
use transport_core::{Access, BatchState, Buffer, ErrorKind, SubmitOptions, TransferRequest, Transport};
use transport_tcp::wire::{FrameType, Header, Status};
use transport_tcp::TcpConfig;

const LIMIT: Duration = Duration::from_secs(30);

/// A caller that stops waiting while its endpoint is being built (the
/// peer accepts TCP but never answers the handshake) gives the slot back:
/// the pool returns to its baseline and a later transfer to the same name
/// builds a new endpoint instead of waiting forever on the abandoned one.
/// A dropped submit's batch (its id never reached the caller) is cancelled
/// and removed from the table (rule 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_build_gives_its_slot_back() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let (a, b) = (node(test_config()).await, node(test_config()).await);
        let proxy = FaultProxy::start("127.0.0.1:0".parse().unwrap(), b.local_addr()).await.unwrap();
        let name = proxy.addr.to_string();
        let (src, dst) = (Buffer::new(1 << 16).unwrap(), Buffer::new(1 << 16).unwrap());
        let l = a.register(src.region(), Access::LOCAL).unwrap();
        b.register(dst.region(), Access::REMOTE_RW).unwrap();

        // open_segment dropped mid-handshake.
        proxy.blackhole(true);
        assert!(tokio::time::timeout(Duration::from_millis(200), a.open_segment(&name)).await.is_err());
        assert!(eventually(|| a.stats().endpoints == 0).await, "slot freed: {:?}", a.stats());
        proxy.cut();
        proxy.blackhole(false);
        let seg = tokio::time::timeout(Duration::from_secs(10), a.open_segment(&name))
            .await
            .expect("open_segment after a dropped build does not hang")
            .unwrap();
        let w = TransferRequest::write(l, 0, seg, dst.addr(), 1 << 16);
        assert_eq!(run(&a, vec![w]).await.state, BatchState::Completed);

        // submit dropped while it rebuilds the endpoint.
        proxy.blackhole(true);
        proxy.cut();
        assert!(eventually(|| a.stats().endpoints == 0).await, "cut endpoint destroyed: {:?}", a.stats());
        assert!(tokio::time::timeout(Duration::from_millis(200), a.submit(vec![w], SubmitOptions::default()))
            .await
            .is_err());
        assert!(eventually(|| a.stats().endpoints == 0 && a.stats().endpoint_lanes == 0).await, "{:?}", a.stats());
        // Its batch, whose id nobody received, is cancelled and forgotten.
        assert!(eventually(|| a.stats().batches == 0 && a.stats().inflight == 0).await, "{:?}", a.stats());
        proxy.cut();
        proxy.blackhole(false);
        let s = tokio::time::timeout(Duration::from_secs(10), run(&a, vec![w]))
            .await
            .expect("submit after a dropped build does not hang");
        assert_eq!(s.state, BatchState::Completed, "{:?}", s.first_error());
        assert_eq!(a.stats().endpoints, 1);
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

/// A peer that answers a WRITE before it has received the payload (here:
/// an error status as soon as the header arrives) must not end the slice
/// while the writer is still copying the caller's buffer: once the batch is
/// reported terminal, nothing reads that buffer any more (rule 5).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_early_write_ack_does_not_end_a_slice_still_being_sent() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let len: usize = 64 << 20;
        let (go_tx, go_rx) = watch::channel(false);
        let (seen_tx, mut seen_rx) = mpsc::unbounded_channel::<u64>();
        let script: Script = Arc::new(move |mut s: TcpStream| {
            let (mut go, seen) = (go_rx.clone(), seen_tx.clone());
            Box::pin(async move {
                let Some(h) = fake_peer::next_request(&mut s).await else { return };
                if h.ty != FrameType::Write {
                    return;
                }
                let mut ack = Header::new(FrameType::WriteAck);
                ack.id = h.id;
                ack.status = Status::AccessDenied;
                if s.write_all(&ack.encode()).await.is_err() {
                    return;
                }
                // Read nothing more until the caller has seen the batch end
                // and scribbled over its buffer; then look for the scribble.
                let _ = go.wait_for(|g| *g).await;
                let (mut total, mut scribbled) = (0u64, 0u64);
                let mut buf = vec![0u8; 1 << 20];
                while total < u64::from(h.payload_len) {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            scribbled += buf[..n].iter().filter(|&&b| b == 0xFF).count() as u64;
                            total += n as u64;
                        }
                    }
                }
                let _ = seen.send(scribbled);
            })
        });
        let peer = FakePeer::start(script).await;
        let cfg = TcpConfig { slice_size: len, max_frame: len, ..test_config() };
        let a = node(cfg).await;
        let src = Buffer::from_slice(&vec![0x11u8; len]).unwrap();
        let l = a.register(src.region(), Access::LOCAL).unwrap();
        let seg = a.open_segment(&peer.name()).await.unwrap();
        let w = TransferRequest::write(l, 0, seg, fake_peer::REGION.addr, len as u64);
        let b = a.submit(vec![w], SubmitOptions::default()).await.unwrap();
        let s = tokio::time::timeout(LIMIT, a.wait(b)).await.expect("batch ends").unwrap();
        assert_eq!(s.state, BatchState::Failed);
        // The early answer is refused as a protocol error (the endpoint is
        // reset); its status is never taken as the slice's outcome.
        let e = s.first_error().expect("an error");
        assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
        // Terminal: the buffer is the caller's again.
        src.fill(0xFF);
        go_tx.send_replace(true);
        let scribbled = tokio::time::timeout(LIMIT, seen_rx.recv()).await.expect("peer done").unwrap();
        assert_eq!(scribbled, 0, "bytes of the buffer were read after the batch was reported terminal");
        a.release(b).unwrap();
        a.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

/// A peer that sends the header of a READ answer and part of its payload,
/// then nothing: the deadline and cancel() still end the batch (the
/// endpoint carrying the half-read slice is reset).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_answer_stalled_mid_payload_still_times_out_and_cancels() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let script: Script = Arc::new(|mut s: TcpStream| {
            Box::pin(async move {
                while let Some(h) = fake_peer::next_request(&mut s).await {
                    if h.ty != FrameType::Read {
                        return;
                    }
                    let mut r = Header::new(FrameType::ReadResp);
                    r.id = h.id;
                    r.len = h.len;
                    r.payload_len = h.len as u32;
                    let half = vec![0x22u8; (h.len / 2) as usize];
                    if s.write_all(&r.encode()).await.is_err() || s.write_all(&half).await.is_err() {
                        return;
                    }
                }
            })
        });
        let peer = FakePeer::start(script).await;
        let a = node(test_config()).await;
        let dst = Buffer::new(64 << 10).unwrap();
        let l = a.register(dst.region(), Access::LOCAL).unwrap();
        let seg = a.open_segment(&peer.name()).await.unwrap();
        let r = TransferRequest::read(l, 0, seg, fake_peer::REGION.addr, 64 << 10);

        let b = a.submit(vec![r], SubmitOptions::with_timeout(Duration::from_millis(300))).await.unwrap();
        let s = tokio::time::timeout(Duration::from_secs(10), a.wait(b)).await.expect("the deadline ends the batch");
        assert_eq!(s.unwrap().state, BatchState::TimedOut);
        a.release(b).unwrap();

        let b = a.submit(vec![r], SubmitOptions::default()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let s = tokio::time::timeout(Duration::from_secs(10), a.cancel(b)).await.expect("cancel returns");
        assert_eq!(s.unwrap().state, BatchState::Cancelled);
        a.release(b).unwrap();
        assert!(eventually(|| a.stats().inflight == 0 && a.stats().endpoint_lanes == 0).await, "{:?}", a.stats());
        a.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

/// Lanes that the peer closes as soon as they are up: the reader of one
/// may run the endpoint's teardown while the build is still starting the
/// others; every lane task is still aborted and joined (none is left
/// waiting forever with its socket open).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lanes_closed_as_they_start_leave_no_task_behind() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let lanes = test_config().lanes;
        let count = Arc::new(AtomicUsize::new(0));
        let script: Script = Arc::new(move |mut s: TcpStream| {
            let k = count.fetch_add(1, Ordering::Relaxed);
            Box::pin(async move {
                // Lane 0 of each build asks for the descriptor first.
                if k.is_multiple_of(lanes) {
                    let _ = fake_peer::answer_desc(&mut s).await;
                }
                drop(s);
            })
        });
        let peer = FakePeer::start(script).await;
        let a = node(test_config()).await;
        let baseline = a.stats().tasks;
        for _ in 0..200 {
            if let Ok(seg) = a.open_segment(&peer.name()).await {
                a.close_segment(seg).await.unwrap();
            }
            assert!(
                eventually(|| a.stats().endpoints == 0 && a.stats().tasks == baseline).await,
                "lane tasks left behind: {:?}",
                a.stats()
            );
        }
        assert_eq!(a.stats().endpoint_lanes, 0);
        a.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

/// close_segment returns only once every endpoint to the peer is gone,
/// also one another caller is still building (rule 3: close is real).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_segment_waits_for_an_endpoint_being_built() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let (a, b) = (Arc::new(node(test_config()).await), node(test_config()).await);
        let proxy = FaultProxy::start("127.0.0.1:0".parse().unwrap(), b.local_addr()).await.unwrap();
        let (src, dst) = (Buffer::new(1 << 16).unwrap(), Buffer::new(1 << 16).unwrap());
        let l = a.register(src.region(), Access::LOCAL).unwrap();
        b.register(dst.region(), Access::REMOTE_RW).unwrap();
        let seg = a.open_segment(&proxy.addr.to_string()).await.unwrap();
        let w = TransferRequest::write(l, 0, seg, dst.addr(), 1 << 16);
        assert_eq!(run(&a, vec![w]).await.state, BatchState::Completed);
        // The endpoint is lost; a submit rebuilds it into a blackhole.
        proxy.blackhole(true);
        proxy.cut();
        assert!(eventually(|| a.stats().endpoints == 0).await, "{:?}", a.stats());
        let submitter = {
            let a = a.clone();
            tokio::spawn(async move { a.submit(vec![w], SubmitOptions::default()).await })
        };
        assert!(eventually(|| a.stats().endpoints == 1).await, "a build is under way: {:?}", a.stats());
        a.close_segment(seg).await.unwrap();
        assert_eq!(a.stats().endpoints, 0, "close_segment returned before the endpoint was gone");
        let _ = submitter.await.unwrap();
        proxy.blackhole(false);
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}
