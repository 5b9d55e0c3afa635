//! Fabric faults (kill, cut, stall, restart), endpoint bounds, and the
//! seeded fault plan.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::*;
use transport_core::{Access, BatchState, ErrorKind, SubmitOptions, TransferRequest, Transport};
use transport_mock::{FaultPlan, KillAfter, MockConfig, MockFabric, MockTransport, RequestFault};

const LEN: usize = 64 << 10;

async fn one(p: &Pair, req: TransferRequest) -> transport_core::BatchStatus {
    run_batch(&*p.a, vec![req], SubmitOptions::with_timeout(Duration::from_secs(5))).await
}

#[test]
fn kill_fails_transiently_frees_the_endpoint_and_restart_is_noticed() {
    run(async {
        let p = Pair::default(LEN).await;
        assert_eq!(one(&p, p.write(0, 0, 4096)).await.state, BatchState::Completed);
        let gen1 = p.a.segment_descriptor(p.seg).unwrap().generation;
        assert_eq!(p.a.stats().endpoints, 1);
        p.fabric.kill("b").unwrap();
        assert_eq!(p.b.stats().regions, 0);
        assert_eq!(p.b.poll(transport_core::BatchId(1)).unwrap_err().kind(), ErrorKind::Shutdown);
        let e = one(&p, p.write(0, 0, 4096)).await.first_error().cloned().unwrap();
        assert_eq!(e.kind(), ErrorKind::ConnectionReset, "{e}");
        assert_eq!(p.a.stats().endpoints, 0, "the broken endpoint is destroyed");
        let e = one(&p, p.write(0, 0, 4096)).await.first_error().cloned().unwrap();
        assert_eq!(e.kind(), ErrorKind::ConnectionRefused);
        assert_eq!(p.a.open_segment("b").await.unwrap_err().kind(), ErrorKind::ConnectionRefused);
        assert_eq!(p.a.open_segment("nobody").await.unwrap_err().kind(), ErrorKind::ConnectionRefused);
        // Restart: new generation; the old handle fails once, then works.
        let b2 = MockTransport::new(&p.fabric, MockConfig::named("b")).unwrap();
        assert!(b2.generation() > gen1);
        assert!(MockTransport::new(&p.fabric, MockConfig::named("b")).is_err(), "a live name is taken");
        let mem = Mem::new(LEN, 7);
        b2.register(mem.region(), Access::REMOTE_RW).unwrap();
        let old_snapshot = p.remote.read();
        let fresh = TransferRequest::write(p.lid, 0, p.seg, mem.addr(), 4096);
        let e = one(&p, fresh).await.first_error().cloned().unwrap();
        assert_eq!(e.kind(), ErrorKind::PeerRestarted);
        assert!(e.is_transient());
        assert_eq!(p.a.segment_descriptor(p.seg).unwrap().generation, b2.generation());
        let stale = one(&p, p.write(0, 0, 4096)).await;
        assert_ne!(stale.state, BatchState::Completed);
        assert_eq!(p.remote.read(), old_snapshot, "the dead host's memory is never touched");
        assert_eq!(one(&p, fresh).await.state, BatchState::Completed);
        assert_eq!(&mem.read()[..4096], &p.local.read()[..4096]);
    });
}

#[test]
fn cut_breaks_the_endpoint_once_and_the_next_transfer_rebuilds() {
    run(async {
        let p = Pair::default(LEN).await;
        for _ in 0..3 {
            assert_eq!(one(&p, p.write(0, 0, 4096)).await.state, BatchState::Completed);
            p.fabric.cut("b").unwrap();
            let e = one(&p, p.write(0, 0, 4096)).await.first_error().cloned().unwrap();
            assert_eq!(e.kind(), ErrorKind::ConnectionReset);
            assert_eq!(p.a.stats().endpoints, 0);
            assert_eq!(one(&p, p.write(0, 0, 4096)).await.state, BatchState::Completed);
            assert_eq!(p.a.stats().endpoints, 1);
        }
        assert_eq!(p.fabric.cut("nobody").unwrap_err().kind(), ErrorKind::NotFound);
    });
}

#[test]
fn stall_holds_copies_until_resumed() {
    run(async {
        let p = Pair::default(LEN).await;
        p.fabric.stall("b", true).unwrap();
        let b = p.a.submit(vec![p.write(0, 0, 4096)], SubmitOptions::default()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(p.a.poll(b).unwrap().state, BatchState::InProgress);
        p.fabric.stall("b", false).unwrap();
        assert_eq!(p.a.wait(b).await.unwrap().state, BatchState::Completed);
    });
}

#[test]
fn endpoints_are_bounded_and_reclaimed_when_idle() {
    run(async {
        let fabric = MockFabric::new();
        let cfg = MockConfig { max_endpoints: 2, idle_timeout: Duration::from_millis(150), ..MockConfig::named("a") };
        let a = MockTransport::new(&fabric, cfg).unwrap();
        assert_eq!(a.capabilities().max_endpoints, 2);
        let local = Mem::new(LEN, 1);
        let lid = a.register(local.region(), Access::LOCAL).unwrap();
        let mut peers = Vec::new();
        for i in 0..5 {
            let name = format!("p{i}");
            let t = host(&fabric, &name);
            let m = Mem::new(LEN, 10 + i as u8);
            t.register(m.region(), Access::REMOTE_RW).unwrap();
            let seg = a.open_segment(&name).await.unwrap();
            peers.push((t, m, seg));
        }
        for _ in 0..2 {
            for (_, m, seg) in &peers {
                let s = run_batch(
                    &*a,
                    vec![TransferRequest::write(lid, 0, *seg, m.addr(), 4096)],
                    SubmitOptions::default(),
                )
                .await;
                assert_eq!(s.state, BatchState::Completed);
                assert!(a.stats().endpoints <= 2);
            }
        }
        let mut tasks = Vec::new();
        for (_, m, seg) in &peers {
            let (a, seg, addr) = (a.clone(), *seg, m.addr());
            tasks.push(tokio::spawn(async move {
                for k in 0..5u64 {
                    let r = TransferRequest::write(lid, k * 4096, seg, addr + k * 4096, 4096);
                    assert_eq!(run_batch(&*a, vec![r], SubmitOptions::default()).await.state, BatchState::Completed);
                    assert!(a.stats().endpoints <= 2);
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert!(settle(|| a.stats().endpoints == 0).await, "idle endpoints must be reaped: {:?}", a.stats());
    });
}

async fn random_outcomes(seed: u64) -> Vec<bool> {
    let fabric = MockFabric::new();
    let cfg = MockConfig { fault_plan: FaultPlan::random(seed, 0.3), ..MockConfig::named("a") };
    let a = MockTransport::new(&fabric, cfg).unwrap();
    let b = host(&fabric, "b");
    let (l, r) = (Mem::new(LEN, 1), Mem::new(LEN, 2));
    let lid = a.register(l.region(), Access::LOCAL).unwrap();
    b.register(r.region(), Access::REMOTE_RW).unwrap();
    let seg = a.open_segment("b").await.unwrap();
    let mut out = Vec::new();
    for i in 0..40u64 {
        let s =
            run_batch(&*a, vec![TransferRequest::write(lid, i, seg, r.addr() + i, 8)], SubmitOptions::default()).await;
        if let Some(e) = s.first_error() {
            assert!(e.is_transient());
        }
        out.push(s.state == BatchState::Completed);
    }
    out
}

#[test]
fn random_fault_plan_is_reproducible_from_its_seed() {
    run(async {
        let x = random_outcomes(42).await;
        assert_eq!(x, random_outcomes(42).await);
        assert_ne!(x, random_outcomes(43).await);
        assert!(x.iter().any(|c| !c) && x.iter().any(|c| *c));
    });
}

#[test]
fn scripted_faults() {
    run(async {
        let p = Pair::default(LEN).await;
        // Handshake failure on the first endpoint, then it works.
        p.a.set_fault_plan(FaultPlan { fail_handshakes: vec![1], fail_opens: vec![1], ..FaultPlan::default() })
            .unwrap();
        assert_eq!(p.a.open_segment("b").await.unwrap_err().kind(), ErrorKind::HandshakeFailed);
        let e = one(&p, p.write(0, 0, 8)).await.first_error().cloned().unwrap();
        assert_eq!(e.kind(), ErrorKind::HandshakeFailed);
        assert_eq!(p.a.stats().endpoints, 0);
        assert_eq!(one(&p, p.write(0, 0, 8)).await.state, BatchState::Completed);
        // Nth request fails with a chosen kind, touching nothing.
        p.a.set_fault_plan(FaultPlan {
            requests: vec![RequestFault::nth(2, ErrorKind::AccessDenied)],
            ..FaultPlan::default()
        })
        .unwrap();
        let snap = p.remote.read();
        p.local.write(0, &pattern(50, 16));
        let s = run_batch(&*p.a, vec![p.write(100, 100, 8), p.write(0, 0, 16)], SubmitOptions::default()).await;
        assert!(s.requests[0].is_completed());
        assert_eq!(s.requests[1].error().unwrap().kind(), ErrorKind::AccessDenied);
        assert_eq!(&p.remote.read()[..16], &snap[..16]);
        // Endpoint reset after the first request, mid-batch.
        p.a.set_fault_plan(FaultPlan { reset_endpoint_after: vec![1], ..FaultPlan::default() }).unwrap();
        let s = run_batch(&*p.a, vec![p.write(0, 0, 8), p.write(8, 8, 8)], SubmitOptions::default()).await;
        assert!(s.requests[0].is_completed());
        assert_eq!(s.requests[1].error().unwrap().kind(), ErrorKind::ConnectionReset);
        // Resource limit refuses new endpoints like the field's QP failure.
        p.a.set_fault_plan(FaultPlan { endpoint_limit: Some(0), ..FaultPlan::default() }).unwrap();
        let e = one(&p, p.write(0, 0, 8)).await.first_error().cloned().unwrap();
        assert_eq!(e.kind(), ErrorKind::ResourceExhausted);
        assert!(e.message().contains("Failed to create QP: Cannot allocate memory"));
        // A stalled request ends TimedOut at its deadline, quiet.
        p.a.set_fault_plan(FaultPlan { stalls: vec![Default::default()], ..FaultPlan::default() }).unwrap();
        let s = run_batch(&*p.a, vec![p.write(0, 0, 8)], SubmitOptions::with_timeout(Duration::from_millis(100))).await;
        assert_eq!(s.state, BatchState::TimedOut);
        // Kill a host after N requests.
        p.a.set_fault_plan(FaultPlan {
            kill_after: Some(KillAfter { host: Some("b".into()), requests: 1 }),
            ..FaultPlan::default()
        })
        .unwrap();
        assert_eq!(one(&p, p.write(0, 0, 8)).await.state, BatchState::Completed);
        assert!(p.fabric.generation("b").is_none(), "b was killed");
        assert!(one(&p, p.write(0, 0, 8)).await.first_error().unwrap().is_transient());
    });
}
