//! Each `MockBugs` switch really breaks the mock (so the conformance suite
//! has something to catch), and the healthy mock does not have the bug.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::*;
use transport_core::{BatchState, ErrorKind, SubmitOptions, Transport};
use transport_mock::{MockBugs, MockConfig, MockFabric, MockTransport};

const LEN: usize = 64 << 10;

async fn pair(bugs: MockBugs) -> Pair {
    let fabric = MockFabric::new();
    let a = MockTransport::with_bugs(&fabric, MockConfig { max_endpoints: 2, ..MockConfig::named("a") }, bugs).unwrap();
    let b = MockTransport::new(&fabric, MockConfig::named("b")).unwrap();
    Pair::of(LEN, fabric, a, b).await
}

async fn one(p: &Pair) -> transport_core::BatchStatus {
    run_batch(&*p.a, vec![p.write(0, 0, 4096)], SubmitOptions::default()).await
}

#[test]
fn leak_endpoint_on_failure() {
    run(async {
        for leak in [false, true] {
            let p = pair(MockBugs { leak_endpoint_on_failure: leak, ..MockBugs::default() }).await;
            // Two failures fill the bound of two with leaked endpoints.
            for _ in 0..2 {
                assert_eq!(one(&p).await.state, BatchState::Completed);
                p.fabric.cut("b").unwrap();
                assert_eq!(one(&p).await.first_error().unwrap().kind(), ErrorKind::ConnectionReset);
            }
            let s = one(&p).await;
            if leak {
                assert_eq!(p.a.stats().endpoints, 2, "leaked endpoints stay counted");
                let e = s.first_error().unwrap();
                assert_eq!(e.kind(), ErrorKind::ResourceExhausted, "{e}");
                assert!(e.message().contains("Cannot allocate memory"));
            } else {
                assert_eq!(s.state, BatchState::Completed);
                assert_eq!(p.a.stats().endpoints, 1);
            }
        }
    });
}

#[test]
fn cache_broken_endpoint() {
    run(async {
        for bug in [false, true] {
            let p = pair(MockBugs { cache_broken_endpoint: bug, ..MockBugs::default() }).await;
            assert_eq!(one(&p).await.state, BatchState::Completed);
            p.fabric.cut("b").unwrap();
            assert_eq!(one(&p).await.state, BatchState::Failed);
            let next = one(&p).await.state;
            assert_eq!(next == BatchState::Failed, bug, "after a cut the next transfer {next:?}");
        }
    });
}

#[test]
fn write_after_timeout() {
    run(async {
        for bug in [false, true] {
            let p = pair(MockBugs { write_after_timeout: bug, ..MockBugs::default() }).await;
            p.fabric.stall("b", true).unwrap();
            let opts = SubmitOptions::with_timeout(Duration::from_millis(100));
            let b = p.a.submit(vec![p.write(0, 0, LEN as u64)], opts).await.unwrap();
            assert_eq!(p.a.wait(b).await.unwrap().state, BatchState::TimedOut);
            let snap = p.remote.read();
            p.fabric.stall("b", false).unwrap();
            let changed = settle(|| p.remote.read() != snap).await;
            assert_eq!(changed, bug, "memory written after the reported timeout");
        }
    });
}

#[test]
fn noop_close_segment() {
    run(async {
        for bug in [false, true] {
            let p = pair(MockBugs { noop_close_segment: bug, ..MockBugs::default() }).await;
            assert_eq!(one(&p).await.state, BatchState::Completed);
            p.a.close_segment(p.seg).await.unwrap();
            let s = p.a.stats();
            assert_eq!((s.segments, s.endpoints), if bug { (1, 1) } else { (0, 0) });
            let again = p.a.submit(vec![p.write(0, 0, 8)], SubmitOptions::default()).await;
            assert_eq!(again.is_ok(), bug, "the closed handle keeps working only with the bug");
            let twice = p.a.close_segment(p.seg).await;
            assert_eq!(twice.is_ok(), bug);
        }
    });
}
