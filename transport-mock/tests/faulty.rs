//! The fault-injecting wrapper around a mock transport.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use transport_core::{BatchState, ErrorKind, RequestStatus, ResourceStats, SubmitOptions, Transport};
use transport_mock::{FaultPlan, FaultyTransport, RequestFault, StallFault};

const LEN: usize = 1 << 20;

#[test]
fn injected_failures_are_not_sent_and_counted() {
    run(async {
        let p = Pair::default(LEN).await;
        let plan =
            FaultPlan { requests: vec![RequestFault::index(1, ErrorKind::ConnectionReset, 2)], ..FaultPlan::default() };
        let f = FaultyTransport::new(p.a.clone(), plan).unwrap();
        assert_eq!(f.backend(), "faulty(mock)");
        let reqs = vec![p.write(0, 0, 4096), p.write(4096, 4096, 4096)];
        let snap = p.remote.read();
        let s = run_batch(&*f, reqs.clone(), SubmitOptions::default()).await;
        assert!(s.requests[0].is_completed());
        assert_eq!(s.requests[1].error().unwrap().kind(), ErrorKind::ConnectionReset);
        assert_eq!(&p.remote.read()[4096..8192], &snap[4096..8192], "the failed request was never sent");
        // Resend only the failed one: fails on attempt 2, passes on 3.
        let s = run_batch(&*f, vec![reqs[0], reqs[1]], SubmitOptions::default()).await;
        assert_eq!(s.state, BatchState::Failed);
        let s = run_batch(&*f, vec![reqs[0], reqs[1]], SubmitOptions::default()).await;
        assert_eq!(s.state, BatchState::Completed);
        let r1 = reqs[1];
        assert_eq!(f.submissions_of(r1.segment, r1.remote_addr, r1.len), 1);
        assert_eq!(f.attempts_of(r1.segment, r1.remote_addr, r1.len), 3);
        assert_eq!(f.submissions_of(reqs[0].segment, reqs[0].remote_addr, reqs[0].len), 3);
        // The two reads are not one snapshot: a mock task may end between
        // them, so wait until they agree (the layer holds nothing).
        assert!(settle(|| f.stats() == p.a.stats()).await, "{:?} vs {:?}", f.stats(), p.a.stats());
        // All requests injected: the layer holds the batch itself.
        f.set_fault_plan(FaultPlan {
            requests: vec![RequestFault::next_batch(0, ErrorKind::OutOfBounds)],
            ..FaultPlan::default()
        })
        .unwrap();
        let b = f.submit(vec![reqs[0]], SubmitOptions::default()).await.unwrap();
        assert!(settle(|| f.stats().batches == p.a.stats().batches + 1).await, "{:?} vs {:?}", f.stats(), p.a.stats());
        assert_eq!(f.wait(b).await.unwrap().first_error().unwrap().kind(), ErrorKind::OutOfBounds);
        f.release(b).unwrap();
        assert!(settle(|| f.stats() == p.a.stats()).await, "{:?} vs {:?}", f.stats(), p.a.stats());
        assert_eq!(f.poll(b).unwrap_err().kind(), ErrorKind::InvalidHandle);
    });
}

#[test]
fn opens_fail_and_are_limited() {
    run(async {
        let p = Pair::default(4096).await;
        let f = FaultyTransport::new(
            p.a.clone(),
            FaultPlan { fail_opens: vec![1], segment_limit: Some(2), ..FaultPlan::default() },
        )
        .unwrap();
        assert_eq!(f.open_segment("b").await.unwrap_err().kind(), ErrorKind::HandshakeFailed);
        let s1 = f.open_segment("b").await.unwrap();
        let _s2 = f.open_segment("b").await.unwrap();
        assert_eq!(f.open_segment("b").await.unwrap_err().kind(), ErrorKind::ResourceExhausted);
        f.close_segment(s1).await.unwrap();
        f.open_segment("b").await.unwrap();
    });
}

#[test]
fn stalled_batch_times_out_quietly() {
    run(async {
        let p = Pair::default(LEN).await;
        let plan =
            FaultPlan { stalls: vec![StallFault { when: Default::default(), times: Some(1) }], ..FaultPlan::default() };
        let f = FaultyTransport::new(p.a.clone(), plan).unwrap();
        // p.write(0..) is stalled (first request); the second goes through.
        p.fabric.stall("b", true).unwrap();
        let opts = SubmitOptions::with_timeout(Duration::from_millis(1000));
        let b = f.submit(vec![p.write(0, 0, 4096), p.write(4096, 4096, LEN as u64 - 4096)], opts).await.unwrap();
        assert_eq!(f.poll(b).unwrap().state, BatchState::InProgress);
        let s = f.wait(b).await.unwrap();
        assert_eq!(s.state, BatchState::TimedOut, "{:?}", s.requests);
        let snap = p.remote.read();
        p.fabric.stall("b", false).unwrap();
        quiet(&p.remote, &snap, 200).await;
        f.release(b).unwrap();
        // Without a deadline: held until cancelled.
        f.set_fault_plan(FaultPlan { stalls: vec![StallFault::default()], ..FaultPlan::default() }).unwrap();
        let b = f.submit(vec![p.write(0, 0, 8)], SubmitOptions::default()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(f.poll(b).unwrap().state, BatchState::InProgress);
        assert_eq!(f.cancel(b).await.unwrap().state, BatchState::Cancelled);
        f.release(b).unwrap();
        assert!(settle(|| f.stats() == p.a.stats()).await);
    });
}

#[test]
fn kill_refuses_calls_and_fails_work_in_flight() {
    run(async {
        let p = Pair::default(LEN).await;
        let f = FaultyTransport::new(p.a.clone(), FaultPlan::default()).unwrap();
        p.fabric.stall("b", true).unwrap();
        let b = f.submit(vec![p.write(0, 0, LEN as u64)], SubmitOptions::default()).await.unwrap();
        f.kill().await;
        let s = f.poll(b).unwrap();
        assert!(matches!(&s.requests[0], RequestStatus::Failed(e) if e.kind() == ErrorKind::ConnectionReset));
        assert_eq!(f.wait(b).await.unwrap().state, BatchState::Failed);
        let snap = p.remote.read();
        p.fabric.stall("b", false).unwrap();
        quiet(&p.remote, &snap, 200).await;
        assert_eq!(f.open_segment("b").await.unwrap_err().kind(), ErrorKind::ConnectionRefused);
        let e = f.submit(vec![p.write(0, 0, 8)], SubmitOptions::default()).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ConnectionRefused);
        f.release(b).unwrap();
        f.revive();
        assert_eq!(run_batch(&*f, vec![p.write(0, 0, 8)], SubmitOptions::default()).await.state, BatchState::Completed);
        let t: Arc<dyn Transport> = f.clone();
        t.shutdown().await.unwrap();
        assert_eq!(t.stats(), ResourceStats::default());
        assert_eq!(t.poll(b).unwrap_err().kind(), ErrorKind::Shutdown);
        t.shutdown().await.unwrap();
    });
}
