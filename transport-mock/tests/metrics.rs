//! Issue 15: the engine's metrics (through the `metrics` facade), read
//! back from an in-memory recorder: the counts match the transfers run,
//! and peer labels stay bounded however many peers there are.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failure should panic

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{host, Mem};
use kvmove_policy::{Engine, PolicyConfig, MAX_PEER_LABELS, OTHER_PEER};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use metrics_util::MetricKind;
use transport_core::{Access, TransferRequest, Transport};
use transport_mock::MockFabric;

/// Runs `f` on a current-thread runtime with `recorder` installed for this
/// thread (the engine's tasks run on it too).
fn recorded<F: std::future::Future<Output = ()>>(recorder: &DebuggingRecorder, f: F) {
    metrics::with_local_recorder(recorder, || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move { tokio::time::timeout(Duration::from_secs(30), f).await.expect("test timed out") });
    });
}

/// Every series of `name` as (labels, value).
fn series(snap: &Snapshotter, name: &str) -> Vec<(Vec<(String, String)>, DebugValue)> {
    snap.snapshot()
        .into_vec()
        .into_iter()
        .filter(|(k, _, _, _)| k.key().name() == name)
        .map(|(k, _, _, v)| {
            let labels = k.key().labels().map(|l| (l.key().to_owned(), l.value().to_owned())).collect();
            (labels, v)
        })
        .collect()
}

fn label<'a>(labels: &'a [(String, String)], key: &str) -> &'a str {
    labels.iter().find(|(k, _)| k == key).map_or("", |(_, v)| v.as_str())
}

fn counter_sum(snap: &Snapshotter, name: &str, want: &[(&str, &str)]) -> u64 {
    series(snap, name)
        .into_iter()
        .filter(|(l, _)| want.iter().all(|(k, v)| label(l, k) == *v))
        .map(|(_, v)| match v {
            DebugValue::Counter(n) => n,
            other => panic!("{name} is not a counter: {other:?}"),
        })
        .sum()
}

#[test]
fn transfers_are_counted_by_op_peer_and_state() {
    let recorder = DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    recorded(&recorder, async {
        let fabric = MockFabric::new();
        let a = host(&fabric, "a");
        let b = host(&fabric, "b");
        let local = Mem::new(1 << 20, 1);
        let remote = Mem::new(1 << 20, 2);
        let lid = a.register(local.region(), Access::LOCAL).unwrap();
        b.register(remote.region(), Access::REMOTE_RW).unwrap();
        let engine = Engine::new(a.clone() as Arc<dyn Transport>, PolicyConfig::default()).unwrap();
        let peer = b.local_segment_name();
        let seg = engine.open_segment(&peer).await.unwrap();
        // Three transfers: 16 writes of 4 KiB, 8 reads of 8 KiB, and one
        // write outside the peer's memory (fails, permanently).
        let writes: Vec<_> =
            (0..16).map(|i| TransferRequest::write(lid, i * 4096, seg, remote.addr() + i * 4096, 4096)).collect();
        assert!(engine.transfer(writes).await.unwrap().is_success());
        let reads: Vec<_> =
            (0..8).map(|i| TransferRequest::read(lid, i * 8192, seg, remote.addr() + i * 8192, 8192)).collect();
        assert!(engine.transfer(reads).await.unwrap().is_success());
        let bad = TransferRequest::write(lid, 0, seg, remote.addr() + (2 << 20), 4096);
        assert!(!engine.transfer(vec![bad]).await.unwrap().is_success());
        engine.shutdown().await.unwrap();
        // Histograms first: a snapshot drains them.
        let latencies: usize = series(&snap, "kvmove_transfer_seconds")
            .into_iter()
            .map(|(_, v)| match v {
                DebugValue::Histogram(h) => h.len(),
                other => panic!("not a histogram: {other:?}"),
            })
            .sum();
        assert_eq!(latencies, 3, "one latency per transfer");
        let peer = peer.as_str();
        assert_eq!(counter_sum(&snap, "kvmove_bytes_total", &[("op", "write"), ("peer", peer)]), 16 * 4096);
        assert_eq!(counter_sum(&snap, "kvmove_bytes_total", &[("op", "read"), ("peer", peer)]), 8 * 8192);
        assert_eq!(counter_sum(&snap, "kvmove_requests_total", &[("op", "write"), ("state", "completed")]), 16);
        assert_eq!(counter_sum(&snap, "kvmove_requests_total", &[("op", "write"), ("state", "failed")]), 1);
        assert_eq!(counter_sum(&snap, "kvmove_transfers_total", &[("state", "completed")]), 2);
        assert_eq!(counter_sum(&snap, "kvmove_transfers_total", &[("state", "failed")]), 1);
        assert_eq!(counter_sum(&snap, "kvmove_errors_total", &[]), 1);
        let kinds: Vec<MetricKind> = snap
            .snapshot()
            .into_vec()
            .into_iter()
            .filter(|(k, ..)| k.key().name() == "kvmove_inflight_bytes")
            .map(|(k, ..)| k.kind())
            .collect();
        assert_eq!(kinds, vec![MetricKind::Gauge]);
    });
}

#[test]
fn peer_labels_stay_bounded() {
    let recorder = DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    let peers = MAX_PEER_LABELS + 6;
    recorded(&recorder, async move {
        let fabric = MockFabric::new();
        let a = host(&fabric, "a");
        let local = Mem::new(4096, 1);
        let lid = a.register(local.region(), Access::LOCAL).unwrap();
        let engine = Engine::new(a.clone() as Arc<dyn Transport>, PolicyConfig::default()).unwrap();
        let mut keep = Vec::new();
        for i in 0..peers {
            let b = host(&fabric, &format!("peer-{i}"));
            let remote = Mem::new(4096, 2);
            b.register(remote.region(), Access::REMOTE_RW).unwrap();
            let seg = engine.open_segment(&b.local_segment_name()).await.unwrap();
            let out = engine.transfer(vec![TransferRequest::write(lid, 0, seg, remote.addr(), 4096)]).await.unwrap();
            assert!(out.is_success());
            keep.push((b, remote));
        }
        engine.shutdown().await.unwrap();
    });
    let bytes = series(&snap, "kvmove_bytes_total");
    let mut labels: Vec<&str> = bytes.iter().map(|(l, _)| label(l, "peer")).collect();
    labels.sort_unstable();
    labels.dedup();
    assert_eq!(labels.len(), MAX_PEER_LABELS + 1, "one label per named peer, one for the rest");
    let other: Vec<_> =
        bytes.iter().filter(|(l, _)| label(l, "peer") == OTHER_PEER && label(l, "op") == "write").collect();
    assert_eq!(other.len(), 1);
    assert!(matches!(other[0].1, DebugValue::Counter(n) if n == 6 * 4096), "{:?}", other[0].1);
    assert_eq!(counter_sum(&snap, "kvmove_bytes_total", &[]), peers as u64 * 4096, "every byte counted");
}

/// Sessions (rules 12, 13) feed the metrics: each side's session once, by
/// role and final state, its time to landed, the sender's grant wait; and
/// plain notifications sent and received.
#[test]
fn sessions_and_notifications_are_counted() {
    use kvmove_policy::session::{Grant, Role, SessionKey, SessionLimits, SessionState};
    use kvmove_policy::Sessions;

    let recorder = DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    recorded(&recorder, async {
        let fabric = MockFabric::new();
        let start = |name: &str| {
            let t = host(&fabric, name);
            let mem = Mem::new(1 << 16, 3);
            let region = t.register(mem.region(), Access::REMOTE_RW).unwrap();
            let engine = Engine::new(t.clone() as Arc<dyn Transport>, PolicyConfig::default()).unwrap();
            (Sessions::start(engine, SessionLimits::default()).unwrap(), mem, region)
        };
        let (p, pmem, pregion) = start("p");
        let (d, dmem, _) = start("d");
        let _ = pmem;
        p.expect("d", 1).unwrap();
        let grant = Grant { ranges: vec![(dmem.addr(), 4096)], expected: 4096, deadline: Duration::from_secs(10) };
        d.grant("p", 1, grant).await.unwrap();
        p.wait_grant("d", 1).await.unwrap();
        let seg = p.segment("d").await.unwrap();
        let w = TransferRequest::write(pregion, 0, seg, dmem.addr(), 4096);
        p.write("d", 1, vec![w]).await.unwrap().into_result().unwrap();
        p.finish("d", 1).unwrap();
        assert_eq!(d.wait(&SessionKey::new("p", 1, Role::Receiver)).await.unwrap(), SessionState::Landed);
        assert_eq!(p.wait(&SessionKey::new("d", 1, Role::Sender)).await.unwrap(), SessionState::Landed);
        p.notify("d", b"hello".to_vec()).await.unwrap();
        let mut got = Vec::new();
        while got.is_empty() {
            d.wait_notification().await.unwrap();
            got = d.take_notifications(16);
        }
        assert_eq!(got.len(), 1);
        p.shutdown().await;
        d.shutdown().await;
    });
    // One snapshot for the histograms (a snapshot drains them).
    let samples =
        |all: &[(String, usize)], name: &str| -> usize { all.iter().filter(|(n, _)| n == name).map(|(_, c)| c).sum() };
    let hists: Vec<(String, usize)> = snap
        .snapshot()
        .into_vec()
        .into_iter()
        .filter_map(|(k, _, _, v)| match v {
            DebugValue::Histogram(h) => Some((k.key().name().to_owned(), h.len())),
            _ => None,
        })
        .collect();
    assert_eq!(samples(&hists, "kvmove_session_grant_wait_seconds"), 1, "one grant wait, the sender's");
    assert_eq!(samples(&hists, "kvmove_session_landed_seconds"), 2, "one time to landed per side");
    assert_eq!(counter_sum(&snap, "kvmove_sessions_total", &[("role", "sender"), ("state", "landed")]), 1);
    assert_eq!(counter_sum(&snap, "kvmove_sessions_total", &[("role", "receiver"), ("state", "landed")]), 1);
    assert_eq!(counter_sum(&snap, "kvmove_sessions_total", &[]), 2, "each side once");
    assert_eq!(counter_sum(&snap, "kvmove_notifications_total", &[("dir", "sent")]), 1);
    assert_eq!(counter_sum(&snap, "kvmove_notifications_total", &[("dir", "received")]), 1);
}
