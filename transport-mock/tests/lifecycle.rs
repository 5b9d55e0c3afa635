//! Terminal means quiet, counts return, close is real, shutdown and drop.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use transport_core::{Access, BatchState, ErrorKind, RequestStatus, ResourceStats, SubmitOptions, Transport};
use transport_mock::MockConfig;

const LEN: usize = 1 << 20;
/// The tasks a live mock host always runs: the idle-endpoint reaper and
/// the deadline timer.
const FIXED_TASKS: usize = 2;

#[test]
fn deadline_ends_stalled_work_quietly() {
    run(async {
        let p = Pair::default(LEN).await;
        p.fabric.stall("b", true).unwrap();
        let start = Instant::now();
        let opts = SubmitOptions::with_timeout(Duration::from_millis(200));
        let b = p.a.submit(vec![p.write(0, 0, LEN as u64), p.write(0, 0, 1)], opts).await.unwrap();
        let s = p.a.wait(b).await.unwrap();
        assert_eq!(s.state, BatchState::TimedOut);
        assert!(start.elapsed() < Duration::from_secs(1));
        assert!(s.requests.iter().all(|r| matches!(r, RequestStatus::TimedOut)));
        let snap = p.remote.read();
        p.local.write(0, &pattern(9, LEN));
        p.fabric.stall("b", false).unwrap();
        quiet(&p.remote, &snap, 200).await;
        assert_eq!(p.a.poll(b).unwrap().state, BatchState::TimedOut, "sticky");
        p.a.release(b).unwrap();
        assert!(settle(|| p.a.stats().tasks == FIXED_TASKS && p.a.stats().inflight == 0).await, "{:?}", p.a.stats());
    });
}

#[test]
fn cancel_with_latency_is_quiet_and_sticky() {
    run(async {
        let a = MockConfig { latency: Duration::from_millis(1000), ..MockConfig::named("a") };
        let p = Pair::new(LEN, a, MockConfig::named("b")).await;
        let b =
            p.a.submit(vec![p.write(0, 0, 4096), p.write(4096, 4096, 4096)], SubmitOptions::default()).await.unwrap();
        assert_eq!(p.a.poll(b).unwrap().state, BatchState::InProgress);
        assert_eq!(p.a.release(b).unwrap_err().kind(), ErrorKind::InvalidRequest);
        let s = p.a.cancel(b).await.unwrap();
        assert_eq!(s.state, BatchState::Cancelled);
        let snap = p.remote.read();
        quiet(&p.remote, &snap, 500).await;
        assert_eq!(p.a.wait(b).await.unwrap().state, BatchState::Cancelled);
        assert_eq!(p.a.cancel(b).await.unwrap().state, BatchState::Cancelled);
        p.a.release(b).unwrap();
        assert_eq!(p.a.poll(b).unwrap_err().kind(), ErrorKind::InvalidHandle);
        assert_eq!(p.a.release(b).unwrap_err().kind(), ErrorKind::InvalidHandle);
    });
}

#[test]
fn counts_return_after_close_unregister_release_shutdown() {
    run(async {
        let p = Pair::default(LEN).await;
        let base = p.a.stats();
        assert_eq!(base, ResourceStats { segments: 1, regions: 1, tasks: FIXED_TASKS, ..ResourceStats::default() });
        let seg = p.a.open_segment("b").await.unwrap();
        let req = transport_core::TransferRequest { segment: seg, ..p.write(0, 0, 4096) };
        let b = p.a.submit(vec![req], SubmitOptions::default()).await.unwrap();
        assert_eq!(p.a.stats().batches, 1);
        p.a.wait(b).await.unwrap();
        p.a.release(b).unwrap();
        assert_eq!(p.a.stats().endpoints, 1);
        assert_eq!(p.a.stats().endpoint_lanes, 1);
        // Another handle to the same peer keeps the endpoint; the last close frees it.
        p.a.close_segment(seg).await.unwrap();
        assert_eq!(p.a.stats().endpoints, 1);
        assert!(settle(|| p.a.stats() == ResourceStats { endpoints: 1, endpoint_lanes: 1, ..base }).await);
        p.a.close_segment(p.seg).await.unwrap();
        assert!(settle(|| p.a.stats() == ResourceStats { segments: 0, ..base }).await, "{:?}", p.a.stats());
        assert_eq!(p.a.close_segment(p.seg).await.unwrap_err().kind(), ErrorKind::InvalidHandle);
        assert_eq!(p.a.segment_descriptor(p.seg).unwrap_err().kind(), ErrorKind::InvalidHandle);
        let e = p.a.submit(vec![p.write(0, 0, 8)], SubmitOptions::default()).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidHandle);
        p.a.unregister(p.lid).await.unwrap();
        p.a.shutdown().await.unwrap();
        assert_eq!(p.a.stats(), ResourceStats::default());
        assert_eq!(p.a.open_segment("b").await.unwrap_err().kind(), ErrorKind::Shutdown);
        assert_eq!(p.a.register(p.local.region(), Access::LOCAL).unwrap_err().kind(), ErrorKind::Shutdown);
        p.a.shutdown().await.unwrap();
    });
}

#[test]
fn close_and_shutdown_end_work_in_flight() {
    run(async {
        let p = Pair::default(LEN).await;
        p.fabric.stall("b", true).unwrap();
        let b = p.a.submit(vec![p.write(0, 0, LEN as u64)], SubmitOptions::default()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert_eq!(p.a.stats().inflight, 1);
        p.a.close_segment(p.seg).await.unwrap();
        assert_eq!(p.a.poll(b).unwrap().state, BatchState::Cancelled);
        let snap = p.remote.read();
        p.fabric.stall("b", false).unwrap();
        quiet(&p.remote, &snap, 200).await;
        p.a.release(b).unwrap();
        assert!(settle(|| p.a.stats().endpoints == 0 && p.a.stats().tasks == FIXED_TASKS).await, "{:?}", p.a.stats());

        let seg = p.a.open_segment("b").await.unwrap();
        p.fabric.stall("b", true).unwrap();
        let req = transport_core::TransferRequest { segment: seg, ..p.write(0, 0, LEN as u64) };
        p.a.submit(vec![req], SubmitOptions::default()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(30)).await;
        p.a.shutdown().await.unwrap();
        assert_eq!(p.a.stats(), ResourceStats::default());
        p.fabric.stall("b", false).unwrap();
        quiet(&p.remote, &snap, 200).await;
    });
}

#[test]
fn unregister_in_flight_fails_requests_and_returns_quiet() {
    run(async {
        let p = Pair::default(LEN).await;
        p.fabric.stall("b", true).unwrap();
        let b = p.a.submit(vec![p.write(0, 0, LEN as u64)], SubmitOptions::default()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(30)).await;
        p.b.unregister(p.rid).await.unwrap();
        let s = p.a.wait(b).await.unwrap();
        assert_eq!(s.first_error().unwrap().kind(), ErrorKind::Unregistered);
        let snap = p.remote.read();
        p.fabric.stall("b", false).unwrap();
        quiet(&p.remote, &snap, 200).await;
        // Local side.
        let rid = p.b.register(p.remote.region(), Access::REMOTE_RW).unwrap();
        let _ = rid;
        p.fabric.stall("b", true).unwrap();
        let b = p.a.submit(vec![p.write(0, 0, LEN as u64)], SubmitOptions::default()).await.unwrap();
        p.a.unregister(p.lid).await.unwrap();
        let s = p.a.wait(b).await.unwrap();
        assert_eq!(s.first_error().unwrap().kind(), ErrorKind::Unregistered);
    });
}

#[test]
fn drop_with_work_in_flight_frees_the_transport() {
    run(async {
        let p = Pair::default(LEN).await;
        p.fabric.stall("b", true).unwrap();
        p.a.submit(vec![p.write(0, 0, LEN as u64)], SubmitOptions::default()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(30)).await;
        let t: Arc<dyn Transport> = p.a.clone();
        let weak = Arc::downgrade(&t);
        drop(t);
        let Pair { a, fabric, remote, .. } = p;
        drop(a);
        assert!(settle(|| weak.upgrade().is_none()).await, "a task keeps the transport alive");
        let snap = remote.read();
        fabric.stall("b", false).unwrap();
        quiet(&remote, &snap, 200).await;
        // The name is free again: a restart.
        let again = transport_mock::MockTransport::new(&fabric, MockConfig::named("a")).unwrap();
        assert_eq!(again.local_segment_name(), "a");
    });
}

#[test]
fn drop_outside_the_runtime_does_not_panic() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let p = rt.block_on(async {
        let p = Pair::default(4096).await;
        p.fabric.stall("b", true).unwrap();
        p.a.submit(vec![p.write(0, 0, 4096)], SubmitOptions::default()).await.unwrap();
        p
    });
    drop(rt);
    drop(p);
}

#[test]
fn new_outside_a_runtime_is_a_config_error() {
    let f = transport_mock::MockFabric::new();
    let e = transport_mock::MockTransport::new(&f, MockConfig::default()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
}

/// `local_descriptor` is what a peer opening the host receives (same
/// generation, the remotely accessible regions), through the fault layer
/// too; after shutdown it is `Shutdown`.
#[test]
fn local_descriptor_is_what_peers_open() {
    run(async {
        let p = Pair::default(LEN).await;
        let own = p.b.local_descriptor().unwrap();
        assert_eq!(own, p.a.segment_descriptor(p.seg).unwrap());
        assert_eq!((own.generation, own.regions.len()), (p.b.generation(), 1));
        assert!(p.a.local_descriptor().unwrap().regions.is_empty(), "a's region is local only");
        let faulty = transport_mock::FaultyTransport::wrap(p.b.clone());
        assert_eq!(faulty.local_descriptor().unwrap(), own);
        p.b.shutdown().await.unwrap();
        assert_eq!(p.b.local_descriptor().unwrap_err().kind(), ErrorKind::Shutdown);
    });
}

/// The idle reaper and the LRU eviction of the endpoint pool free their
/// slots: a bound of one serves two peers in turn, and an idle endpoint is
/// reclaimed.
#[test]
fn pool_evicts_and_reaps() {
    run(async {
        let a = MockConfig { max_endpoints: 1, idle_timeout: Duration::from_millis(50), ..MockConfig::named("a") };
        let p = Pair::new(LEN, a, MockConfig::named("b")).await;
        let c = host(&p.fabric, "c");
        let remote = Mem::new(4096, 3);
        c.register(remote.region(), Access::REMOTE_RW).unwrap();
        let seg_c = p.a.open_segment("c").await.unwrap();
        for _ in 0..3 {
            assert_eq!(
                run_batch(&*p.a, vec![p.write(0, 0, 4096)], SubmitOptions::default()).await.state,
                BatchState::Completed
            );
            let to_c = transport_core::TransferRequest::write(p.lid, 0, seg_c, remote.addr(), 4096);
            assert_eq!(run_batch(&*p.a, vec![to_c], SubmitOptions::default()).await.state, BatchState::Completed);
            assert_eq!(p.a.stats().endpoints, 1, "the bound holds");
        }
        assert!(settle(|| p.a.stats().endpoints == 0).await, "idle endpoint reclaimed: {:?}", p.a.stats());
    });
}

/// Rule 6: a caller's huge timeout is no panic, directly or through the
/// fault layer.
#[test]
fn huge_timeout_does_not_panic() {
    run(async {
        let p = Pair::default(LEN).await;
        let opts = SubmitOptions::with_timeout(Duration::MAX);
        assert_eq!(run_batch(&*p.a, vec![p.write(0, 0, 4096)], opts).await.state, BatchState::Completed);
        let faulty = transport_mock::FaultyTransport::wrap(p.a.clone());
        assert_eq!(run_batch(&*faulty, vec![p.write(0, 0, 4096)], opts).await.state, BatchState::Completed);
        p.fabric.stall("b", true).unwrap();
        let b = p.a.submit(vec![p.write(0, 0, 4096)], opts).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(p.a.cancel(b).await.unwrap().state, BatchState::Cancelled);
    });
}
