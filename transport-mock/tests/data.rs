//! Bytes land exactly; bad input is refused and touches nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use transport_core::{Access, BatchState, ErrorKind, RegionId, SegmentId, SubmitOptions, TransferRequest, Transport};
use transport_mock::MockConfig;

#[test]
fn write_and_read_are_byte_exact() {
    run(async {
        let p = Pair::default(64 << 10).await;
        let s = run_batch(&*p.a, vec![p.write(1, 3, 1000), p.write(5000, 9000, 1)], SubmitOptions::default()).await;
        assert_eq!(s.state, BatchState::Completed);
        let (l, mut want) = (pattern(1, 64 << 10), pattern(2, 64 << 10));
        want[3..1003].copy_from_slice(&l[1..1001]);
        want[9000] = l[5000];
        assert_eq!(p.remote.read(), want);
        p.remote.write(100, b"hello");
        let s = run_batch(&*p.a, vec![p.read(7, 100, 5)], SubmitOptions::default()).await;
        assert_eq!(s.state, BatchState::Completed);
        assert_eq!(&p.local.read()[7..12], b"hello");
        assert!(p.local.canaries_intact() && p.remote.canaries_intact());
    });
}

#[test]
fn whole_submit_errors_name_the_request_and_start_nothing() {
    run(async {
        let p = Pair::default(8192).await;
        let (l, r) = (p.local.read(), p.remote.read());
        let t: &dyn Transport = &*p.a;
        let e = t.submit(vec![p.write(0, 0, 8), p.write(8190, 0, 8)], SubmitOptions::default()).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::OutOfBounds);
        assert_eq!(e.context_value("request"), Some("1"));
        let e = t.submit(vec![p.write(0, 0, 0)], SubmitOptions::default()).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidRequest);
        assert_eq!(t.submit(vec![], SubmitOptions::default()).await.unwrap_err().kind(), ErrorKind::InvalidRequest);
        let max = t.capabilities().max_batch_len;
        let big = vec![p.write(0, 0, 1); max + 1];
        assert_eq!(t.submit(big, SubmitOptions::default()).await.unwrap_err().kind(), ErrorKind::InvalidRequest);
        let bad_region = TransferRequest::write(RegionId(9999), 0, p.seg, p.remote.addr(), 8);
        assert_eq!(
            t.submit(vec![bad_region], SubmitOptions::default()).await.unwrap_err().kind(),
            ErrorKind::InvalidHandle
        );
        let bad_seg = TransferRequest::write(p.lid, 0, SegmentId(9999), p.remote.addr(), 8);
        assert_eq!(
            t.submit(vec![bad_seg], SubmitOptions::default()).await.unwrap_err().kind(),
            ErrorKind::InvalidHandle
        );
        let e = t.submit(vec![p.write(u64::MAX - 2, 0, 8)], SubmitOptions::default()).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::OutOfBounds);
        assert_eq!(t.stats().batches, 0);
        assert_eq!(p.local.read(), l);
        assert_eq!(p.remote.read(), r);
        assert!(p.local.canaries_intact() && p.remote.canaries_intact());
    });
}

#[test]
fn remote_checks_fail_the_request_permanently() {
    run(async {
        let p = Pair::default(8192).await;
        let r = p.remote.read();
        let cases = [
            (p.write(0, 8190, 8), ErrorKind::OutOfBounds),
            (TransferRequest::write(p.lid, 0, p.seg, p.remote.addr() - 8, 16), ErrorKind::OutOfBounds),
        ];
        let over = TransferRequest::write(p.lid, 0, p.seg, u64::MAX - 4, 8);
        let e = p.a.submit(vec![over], SubmitOptions::default()).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::OutOfBounds, "addr + len overflow is refused at submit");
        for (req, kind) in cases {
            let s = run_batch(&*p.a, vec![req], SubmitOptions::default()).await;
            let e = s.first_error().expect("must fail");
            assert_eq!(e.kind(), kind, "{e}");
            assert!(!e.is_transient());
        }
        // Access flags of the peer's regions.
        let ro = Mem::new(4096, 3);
        let wo = Mem::new(4096, 4);
        let lo = Mem::new(4096, 5);
        p.b.register(ro.region(), Access::REMOTE_READ).unwrap();
        p.b.register(wo.region(), Access::REMOTE_WRITE).unwrap();
        p.b.register(lo.region(), Access::LOCAL).unwrap();
        let ro_before = ro.read();
        let w = TransferRequest::write(p.lid, 0, p.seg, ro.addr(), 16);
        let e = run_batch(&*p.a, vec![w], SubmitOptions::default()).await;
        assert_eq!(e.first_error().unwrap().kind(), ErrorKind::AccessDenied);
        assert_eq!(ro.read(), ro_before);
        let rd = TransferRequest::read(p.lid, 0, p.seg, wo.addr(), 16);
        assert_eq!(
            run_batch(&*p.a, vec![rd], SubmitOptions::default()).await.first_error().unwrap().kind(),
            ErrorKind::AccessDenied
        );
        let lw = TransferRequest::write(p.lid, 0, p.seg, lo.addr(), 16);
        assert_eq!(
            run_batch(&*p.a, vec![lw], SubmitOptions::default()).await.first_error().unwrap().kind(),
            ErrorKind::AccessDenied
        );
        assert_eq!(p.remote.read(), r);
        assert!(p.remote.canaries_intact() && ro.canaries_intact());
        // Only remotely accessible regions are in the descriptor.
        let d = p.a.segment_descriptor(p.seg).unwrap();
        assert_eq!(d.backend, "mock");
        let fresh = p.a.open_segment("b").await.unwrap();
        let d2 = p.a.segment_descriptor(fresh).unwrap();
        assert_eq!(d2.regions.len(), 3, "{d:?}");
        assert!(d2.region_for(lo.addr(), 1).is_none());
    });
}

#[test]
fn registration_rules() {
    run(async {
        let f = transport_mock::MockFabric::new();
        let t = transport_mock::MockTransport::new(&f, MockConfig::default()).unwrap();
        assert!(t.local_segment_name().starts_with("mock-"));
        let m = Mem::new(8192, 1);
        let id = t.register(m.region(), Access::REMOTE_RW).unwrap();
        assert_eq!(t.register(m.region(), Access::LOCAL).unwrap_err().kind(), ErrorKind::AlreadyRegistered);
        t.unregister(id).await.unwrap();
        assert_eq!(t.unregister(id).await.unwrap_err().kind(), ErrorKind::InvalidHandle);
        assert_eq!(t.unregister(RegionId(777)).await.unwrap_err().kind(), ErrorKind::InvalidHandle);
        t.register(m.region(), Access::LOCAL).unwrap();
        assert_eq!(t.stats().regions, 1);
    });
}

#[test]
fn concurrent_batches_land_exact() {
    run(async {
        let p = std::sync::Arc::new(Pair::default(1 << 20).await);
        let mut tasks = Vec::new();
        for k in 0..16u64 {
            let p = p.clone();
            tasks.push(tokio::spawn(async move {
                for round in 0..4u64 {
                    let off = k * 65536 + round * 16384;
                    let s = run_batch(&*p.a, vec![p.write(off, off, 16384)], SubmitOptions::default()).await;
                    assert_eq!(s.state, BatchState::Completed);
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(p.remote.read(), p.local.read());
    });
}

#[test]
fn large_batches_of_small_pages_complete() {
    run(async {
        let p = Pair::default(1 << 20).await;
        let reqs: Vec<_> = (0..20_000u64).map(|i| p.write(i * 48, i * 48 + 7, 48)).collect();
        let start = std::time::Instant::now();
        let s = run_batch(&*p.a, reqs, SubmitOptions::default()).await;
        assert_eq!(s.state, BatchState::Completed);
        assert!(start.elapsed() < std::time::Duration::from_secs(10), "took {:?}", start.elapsed());
        assert_eq!(&p.remote.read()[7..7 + 48 * 20_000], &p.local.read()[..48 * 20_000]);
        assert!(p.remote.canaries_intact());
    });
}

#[test]
fn loopback_to_its_own_segment_works() {
    run(async {
        let f = transport_mock::MockFabric::new();
        let t = host(&f, "solo");
        let (src, dst) = (Mem::new(8192, 1), Mem::new(8192, 2));
        let sid = t.register(src.region(), Access::LOCAL).unwrap();
        t.register(dst.region(), Access::REMOTE_RW).unwrap();
        let seg = t.open_segment("solo").await.unwrap();
        let stats = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let poller = {
            let (t, stats) = (t.clone(), stats.clone());
            tokio::spawn(async move {
                while stats.load(std::sync::atomic::Ordering::Relaxed) {
                    let _ = t.stats();
                    tokio::task::yield_now().await;
                }
            })
        };
        for _ in 0..50 {
            let s =
                run_batch(&*t, vec![TransferRequest::write(sid, 0, seg, dst.addr(), 8192)], SubmitOptions::default())
                    .await;
            assert_eq!(s.state, BatchState::Completed);
        }
        stats.store(false, std::sync::atomic::Ordering::Relaxed);
        poller.await.unwrap();
        assert_eq!(dst.read(), src.read());
    });
}
