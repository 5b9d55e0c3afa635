//! `Engine::probe` (issue 16): a peer's refusal of the probe's read proves
//! it alive; a peer that cannot be opened does not.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failure should panic

mod common;

use std::sync::Arc;

use common::{host, run, Mem};
use kvmove_policy::{Engine, PolicyConfig};
use transport_core::{Access, Transport};
use transport_mock::MockFabric;

#[test]
fn a_refused_read_is_an_answer_an_unknown_peer_is_not() {
    run(async {
        let fabric = MockFabric::new();
        let a = host(&fabric, "a");
        let b = host(&fabric, "b");
        // b exposes only memory peers may write, not read.
        let mem = Mem::new(4096, 1);
        b.register(mem.region(), Access::REMOTE_WRITE).unwrap();
        let engine = Engine::new(a.clone() as Arc<dyn Transport>, PolicyConfig::default()).unwrap();
        engine.probe(&b.local_segment_name()).await.expect("a denied read is an answer: b is alive");
        for name in ["no-such-peer", ""] {
            let e = engine.probe(name).await.expect_err("a peer that cannot be opened is not alive");
            assert!(e.is_transient(), "{name:?}: {e}");
        }
        engine.shutdown().await.unwrap();
    });
}

/// Rule 3 for the probe's own resources: every probe opens a segment and
/// registers a scratch buffer, and closes and unregisters both, whether the
/// peer answered or could not be opened; many probes leave the transport's
/// counts where they were.
#[test]
fn probes_give_back_what_they_open() {
    run(async {
        let fabric = MockFabric::new();
        let a = host(&fabric, "a");
        let b = host(&fabric, "b");
        let mem = Mem::new(4096, 1);
        b.register(mem.region(), Access::REMOTE_RW).unwrap();
        let engine = Engine::new(a.clone() as Arc<dyn Transport>, PolicyConfig::default()).unwrap();
        let before = a.stats();
        for _ in 0..100 {
            engine.probe(&b.local_segment_name()).await.expect("b is alive");
            engine.probe("no-such-peer").await.expect_err("not alive");
        }
        let after = a.stats();
        assert_eq!(
            (after.segments, after.regions, after.batches, after.inflight),
            (before.segments, before.regions, before.batches, before.inflight),
            "segments, regions, batches and bytes in flight back at their counts before the probes"
        );
        assert!(after.endpoints <= 1, "at most the one endpoint to b is kept for reuse: {}", after.endpoints);
        engine.shutdown().await.unwrap();
    });
}
