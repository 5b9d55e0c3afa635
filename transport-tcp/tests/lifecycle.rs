//! Regressions in the endpoint and request lifecycle: callers that stop
//! waiting mid-connect, peers that answer too early or stall mid-answer,
//! lanes that die as they start.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failure should panic

mod support;

use std::time::Duration;

use support::proxy::FaultProxy;
use support::{node, test_config};
use transport_core::{Access, BatchState, Buffer, SubmitOptions, TransferRequest, Transport};
use transport_tcp::TcpTransport;

const LIMIT: Duration = Duration::from_secs(30);

async fn run(t: &TcpTransport, reqs: Vec<TransferRequest>) -> transport_core::BatchStatus {
    let b = t.submit(reqs, SubmitOptions::default()).await.unwrap();
    let s = tokio::time::timeout(LIMIT, t.wait(b)).await.expect("batch finishes").unwrap();
    t.release(b).unwrap();
    s
}

/// Waits (bounded) until `f` holds; returns whether it did.
async fn eventually(mut f: impl FnMut() -> bool) -> bool {
    for _ in 0..250 {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    f()
}

/// A caller that stops waiting while its endpoint is being built (the
/// peer accepts TCP but never answers the handshake) gives the slot back:
/// the pool returns to its baseline and a later transfer to the same name
/// builds a new endpoint instead of waiting forever on the abandoned one.
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
