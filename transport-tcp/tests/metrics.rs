//! Issue 15: the TCP backend's metrics, read back from an in-memory
//! recorder: endpoints built and destroyed, connections served, bytes
//! served by operation.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failure should panic

mod support;

use std::time::Duration;

use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use transport_core::{Access, Buffer, TransferRequest, Transport};

#[test]
fn endpoints_connections_and_served_bytes_are_counted() {
    let recorder = DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(30), async {
                let a = support::node(support::test_config()).await;
                let b = support::node(support::test_config()).await;
                let src = Buffer::from_slice(&[7u8; 65536]).unwrap();
                let dst = Buffer::new(65536).unwrap();
                let l = a.register(src.region(), Access::LOCAL).unwrap();
                b.register(dst.region(), Access::REMOTE_RW).unwrap();
                let seg = a.open_segment(&b.local_segment_name()).await.unwrap();
                let st = support::run(&a, vec![TransferRequest::write(l, 0, seg, dst.addr(), 65536)]).await;
                assert!(st.first_error().is_none(), "{:?}", st.first_error());
                let st = support::run(&a, vec![TransferRequest::read(l, 0, seg, dst.addr(), 4096)]).await;
                assert!(st.first_error().is_none(), "{:?}", st.first_error());
                a.close_segment(seg).await.unwrap();
                a.shutdown().await.unwrap();
                b.shutdown().await.unwrap();
            })
            .await
            .expect("test timed out");
        });
    });
    let mut got = std::collections::HashMap::new();
    for (k, _, _, v) in snap.snapshot().into_vec() {
        if let DebugValue::Counter(n) = v {
            let labels: Vec<String> = k.key().labels().map(|l| format!("{}={}", l.key(), l.value())).collect();
            *got.entry(format!("{}{{{}}}", k.key().name(), labels.join(","))).or_insert(0) += n;
        }
    }
    let live: Vec<f64> = snap
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(k, ..)| k.key().name() == "kvmove_endpoints_live")
        .filter_map(|(.., v)| if let DebugValue::Gauge(g) = v { Some(g.into_inner()) } else { None })
        .collect();
    assert_eq!(live, vec![0.0], "built then destroyed: none live");
    let get = |k: &str| got.get(k).copied().unwrap_or(0);
    assert_eq!(get("kvmove_endpoints_total{backend=tcp,event=built}"), 1, "{got:?}");
    assert_eq!(get("kvmove_endpoints_total{backend=tcp,event=destroyed}"), 1, "{got:?}");
    assert_eq!(get("kvmove_tcp_served_bytes_total{op=write}"), 65536, "{got:?}");
    assert_eq!(get("kvmove_tcp_served_bytes_total{op=read}"), 4096, "{got:?}");
    // One endpoint's lanes (4 by default) were served.
    assert_eq!(get("kvmove_tcp_connections_total{}"), 4, "{got:?}");
}

/// `server_poll_us`: a server connection answering one small write after
/// another polls for the next request and catches it (counted as
/// `caught`); with 0 it never polls. A multi-thread runtime (a
/// current-thread one never polls), so the counters go to a global
/// recorder.
#[test]
fn a_server_polls_for_back_to_back_requests_and_never_when_off() {
    let recorder = DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    recorder.install().expect("the only global recorder of this test binary");
    let polls = || {
        let mut n = std::collections::HashMap::new();
        for (k, _, _, v) in snap.snapshot().into_vec() {
            if let (DebugValue::Counter(c), "kvmove_tcp_server_polls_total") = (v, k.key().name()) {
                for l in k.key().labels() {
                    *n.entry(l.value().to_owned()).or_insert(0u64) += c;
                }
            }
        }
        (n.get("caught").copied().unwrap_or(0), n.get("missed").copied().unwrap_or(0))
    };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let writes = |poll_us: u32| {
        rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(60), async {
                let a = support::node(support::test_config()).await;
                let b = support::node(transport_tcp::TcpConfig {
                    server_poll_us: poll_us,
                    same_host: false,
                    ..support::test_config()
                })
                .await;
                let src = Buffer::from_slice(&[7u8; 4096]).unwrap();
                let dst = Buffer::new(4096).unwrap();
                let l = a.register(src.region(), Access::LOCAL).unwrap();
                b.register(dst.region(), Access::REMOTE_RW).unwrap();
                let seg = a.open_segment(&b.local_segment_name()).await.unwrap();
                for _ in 0..200 {
                    let st = support::run(&a, vec![TransferRequest::write(l, 0, seg, dst.addr(), 4096)]).await;
                    assert!(st.first_error().is_none(), "{:?}", st.first_error());
                }
                assert_eq!(dst.to_vec(), vec![7u8; 4096]);
                a.shutdown().await.unwrap();
                b.shutdown().await.unwrap();
            })
            .await
            .expect("test timed out");
        })
    };
    writes(0);
    assert_eq!(polls(), (0, 0), "off: no connection polls");
    // A window far above a loopback round trip, so a loaded machine still
    // sends the next request within it.
    writes(1000);
    let (caught, missed) = polls();
    assert!(caught >= 10, "{caught} requests caught while polling ({missed} missed) of 200");
}

/// `Engine::probe` (issue 16): a segment name that cannot even be
/// resolved is not a live peer (only the peer's own refusal of the read
/// counts as an answer).
#[test]
fn a_probe_of_a_name_that_cannot_be_opened_fails() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let a = support::node(support::test_config()).await;
        let a: std::sync::Arc<dyn Transport> = std::sync::Arc::new(a);
        let engine = kvmove_policy::Engine::new(a, kvmove_policy::PolicyConfig::default()).unwrap();
        for name in ["not-an-address", "127.0.0.1:notaport"] {
            let e = engine.probe(name).await.expect_err("nothing answered");
            assert!(!e.kind().is_peer_failure(), "{name}: {e}");
        }
        engine.shutdown().await.unwrap();
    });
}
