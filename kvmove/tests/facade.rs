//! The facade: configs parse (or fail with a located error), every
//! compiled-in backend builds, and one program runs unchanged over the mock
//! and TCP by changing only the config.
#![cfg(feature = "tcp")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use kvmove::{Access, BackendKind, Buffer, EngineConfig, ErrorKind, MetadataKind, TransferRequest};

const LIMIT: Duration = Duration::from_secs(30);

#[test]
fn empty_config_is_all_defaults() {
    let c = EngineConfig::from_toml_str("").unwrap();
    assert_eq!(c.backend.kind, BackendKind::Tcp);
    assert_eq!(c.metadata.kind, MetadataKind::P2p);
    assert_eq!(c.policy, kvmove::PolicyConfig::default());
}

#[test]
fn full_config_parses_and_round_trips() {
    let text = r#"
[backend]
kind = "mock"
[backend.tcp]
lanes = 2
listen = "127.0.0.1:0"
[backend.mock]
latency_ms = 1
[backend.rdma]
device = "rxe0"
[policy.retry]
max_attempts = 2
[metadata]
kind = "in-process"
[metadata.etcd]
endpoints = ["http://127.0.0.1:2379"]
"#;
    let c = EngineConfig::from_toml_str(text).unwrap();
    assert_eq!(c.backend.kind, BackendKind::Mock);
    assert_eq!(c.backend.tcp.lanes, 2);
    assert_eq!(c.policy.retry.max_attempts, 2);
    assert_eq!(c.metadata.kind, MetadataKind::InProcess);
    let again = EngineConfig::from_toml_str(&c.to_toml().unwrap()).unwrap();
    assert_eq!(again.to_toml().unwrap(), c.to_toml().unwrap());
}

#[test]
fn unknown_key_names_file_line_table_and_key() {
    let text = "[backend]\nkind = \"tcp\"\n\n[backend.tcp]\nlane = 4\n";
    let e = EngineConfig::from_toml_named(text, "node.toml").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    let s = e.to_string();
    assert!(s.starts_with("node.toml:5:1: in [backend.tcp]:"), "{s}");
    assert!(s.contains("`lane`"), "{s}");
    assert!(!s.contains('\n'), "one line: {s}");
}

#[test]
fn wrong_type_and_bad_enum_are_located() {
    let e = EngineConfig::from_toml_named("[policy.retry]\nmax_attempts = \"four\"\n", "a.toml").unwrap_err();
    assert!(e.to_string().starts_with("a.toml:2:"), "{e}");
    let e = EngineConfig::from_toml_named("[backend]\nkind = \"infiniband\"\n", "b.toml").unwrap_err();
    let s = e.to_string();
    assert!(s.starts_with("b.toml:2:") && s.contains("infiniband"), "{s}");
    let e = EngineConfig::from_toml_named("[backend\nkind = 1\n", "c.toml").unwrap_err();
    assert!(e.to_string().starts_with("c.toml:1:"), "{e}");
}

#[test]
fn invalid_values_name_the_field_and_line() {
    let e = EngineConfig::from_toml_named("[policy.retry]\n\nmax_attempts = 0\n", "p.toml").unwrap_err();
    let s = e.to_string();
    assert!(s.starts_with("p.toml:3: policy.retry.max_attempts"), "{s}");
    let e = EngineConfig::from_toml_named("[backend.tcp]\nlanes = 0\n", "t.toml").unwrap_err();
    let s = e.to_string();
    assert!(s.starts_with("t.toml:2: backend.tcp.lanes"), "{s}");
}

#[test]
fn missing_file_is_named() {
    let e = EngineConfig::from_file("/nonexistent/kvmove.toml").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(e.to_string().contains("/nonexistent/kvmove.toml"), "{e}");
}

#[tokio::test]
async fn a_backend_that_is_not_built_in_says_which_feature() {
    let c = EngineConfig::from_toml_str("[backend]\nkind = \"rdma\"\n[backend.rdma]\ndevice = \"mlx5_0\"\n").unwrap();
    if BackendKind::Rdma.is_built_in() {
        return;
    }
    let e = kvmove::build(&c).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(e.to_string().contains("backend 'rdma' is not built in; rebuild with --features rdma"), "{e}");
}

/// The program: two engines from one config, a write and a read back,
/// verified byte for byte. Nothing in it names a backend.
async fn program(config: &str) -> String {
    let cfg = EngineConfig::from_toml_str(config).unwrap();
    let target = kvmove::build(&cfg).await.unwrap();
    let initiator = kvmove::build(&cfg).await.unwrap();
    let remote = Buffer::new(1 << 20).unwrap();
    target.register(remote.region(), Access::REMOTE_RW).unwrap();
    let src = Buffer::from_slice(&(0..(256 << 10)).map(|i| (i * 7 % 251) as u8).collect::<Vec<_>>()).unwrap();
    let back = Buffer::new(256 << 10).unwrap();
    let src_id = initiator.register(src.region(), Access::LOCAL).unwrap();
    let back_id = initiator.register(back.region(), Access::LOCAL).unwrap();
    let seg = initiator.open_segment(&target.local_segment_name()).await.unwrap();
    let base = initiator.segment_descriptor(seg).unwrap().regions[0].addr;
    let writes =
        (0..4).map(|i| TransferRequest::write(src_id, i * (64 << 10), seg, base + (3 - i) * (64 << 10), 64 << 10));
    initiator.transfer(writes.collect()).await.unwrap().into_result().unwrap();
    let reads =
        (0..4).map(|i| TransferRequest::read(back_id, i * (64 << 10), seg, base + (3 - i) * (64 << 10), 64 << 10));
    initiator.transfer(reads.collect()).await.unwrap().into_result().unwrap();
    assert_eq!(back.to_vec(), src.to_vec());
    assert_eq!(remote.to_vec()[..64 << 10], src.to_vec()[192 << 10..]);
    initiator.close_segment(seg).await.unwrap();
    initiator.shutdown().await.unwrap();
    target.shutdown().await.unwrap();
    initiator.backend().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_program_over_tcp_and_mock() {
    let tcp = "[backend]\nkind = \"tcp\"\n[backend.tcp]\nlisten = \"127.0.0.1:0\"\n";
    assert_eq!(tokio::time::timeout(LIMIT, program(tcp)).await.unwrap(), "tcp");
    #[cfg(feature = "mock")]
    {
        let mock = "[backend]\nkind = \"mock\"\n";
        assert_eq!(tokio::time::timeout(LIMIT, program(mock)).await.unwrap(), "mock");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_built_in_backend_builds() {
    for kind in BackendKind::ALL.into_iter().filter(|k| k.is_built_in() && *k != BackendKind::Rdma) {
        let cfg = EngineConfig::from_toml_str(&format!("[backend]\nkind = \"{kind}\"\n")).unwrap();
        let t = tokio::time::timeout(LIMIT, kvmove::build_transport(&cfg)).await.unwrap().unwrap();
        assert_eq!(t.backend(), kind.as_str());
        t.shutdown().await.unwrap();
    }
}

#[tokio::test]
async fn in_process_metadata_is_shared_by_the_process() {
    let cfg = EngineConfig::from_toml_str("[metadata]\nkind = \"in-process\"\n").unwrap();
    let a = kvmove::build_metadata(&cfg.metadata).await.unwrap().unwrap();
    let b = kvmove::build_metadata(&cfg.metadata).await.unwrap().unwrap();
    let desc = kvmove::SegmentDescriptor {
        name: "facade-test".into(),
        backend: "tcp".into(),
        generation: 1,
        address: "127.0.0.1:1".into(),
        regions: vec![],
    };
    a.put(desc.clone()).await.unwrap();
    assert_eq!(b.get("facade-test").await.unwrap(), Some(desc));
    let p2p = EngineConfig::default();
    assert!(kvmove::build_metadata(&p2p.metadata).await.unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_and_resolve_by_name_refuse_a_stale_generation() {
    let cfg = EngineConfig::from_toml_str("[backend]\nkind = \"tcp\"\n[metadata]\nkind = \"in-process\"\n").unwrap();
    let target = kvmove::build(&cfg).await.unwrap();
    let initiator = kvmove::build(&cfg.sibling()).await.unwrap();
    let store = kvmove::build_metadata(&cfg.metadata).await.unwrap().unwrap();
    let buf = Buffer::new(4096).unwrap();
    target.register(buf.region(), Access::REMOTE_RW).unwrap();
    let published = kvmove::publish(&target, store.as_ref(), "decode-0").await.unwrap();
    assert_eq!(published.address, target.local_segment_name());
    let (seg, served) = kvmove::resolve(&initiator, store.as_ref(), "decode-0").await.unwrap();
    assert_eq!(served.generation, published.generation);
    assert_eq!(served.regions.len(), 1);
    initiator.close_segment(seg).await.unwrap();

    let mut stale = published.clone();
    stale.generation = stale.generation.wrapping_add(1);
    store.put(stale).await.unwrap();
    let e = kvmove::resolve(&initiator, store.as_ref(), "decode-0").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PeerRestarted, "{e}");
    assert_eq!(initiator.stats().segments, 0, "the stale handle was closed");
    let e = kvmove::resolve(&initiator, store.as_ref(), "nobody").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound);
    store.remove("decode-0").await.unwrap();
    initiator.shutdown().await.unwrap();
    target.shutdown().await.unwrap();
}

/// Metadata stores refuse a descriptor whose generation is smaller than
/// the stored one, so every restart of a peer (a new transport under the
/// same name) must come with a larger generation: a restarted engine
/// publishes again under its name, every time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_peer_publishes_again_under_its_name() {
    let cfg = EngineConfig::from_toml_str("[backend]\nkind = \"tcp\"\n[metadata]\nkind = \"in-process\"\n").unwrap();
    let store = kvmove::build_metadata(&cfg.metadata).await.unwrap().unwrap();
    let mut last = 0;
    for restart in 0..8 {
        let engine = kvmove::build(&cfg).await.unwrap();
        let desc = kvmove::publish(&engine, store.as_ref(), "restarting-decode")
            .await
            .unwrap_or_else(|e| panic!("restart {restart}: {e}"));
        assert!(desc.generation > last, "restart {restart}: generation {} after {last}", desc.generation);
        last = desc.generation;
        engine.shutdown().await.unwrap();
    }
    store.remove("restarting-decode").await.unwrap();
}

/// `own_descriptor` is what a peer opening the transport sees (generation,
/// remote regions only), answered by `Transport::local_descriptor` without
/// opening a segment or building an endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn own_descriptor_is_the_peer_view_without_the_network() {
    for kind in BackendKind::ALL.into_iter().filter(|k| k.is_built_in() && *k != BackendKind::Rdma) {
        let cfg = EngineConfig::from_toml_str(&format!("[backend]\nkind = \"{kind}\"\n")).unwrap();
        let t = tokio::time::timeout(LIMIT, kvmove::build_transport(&cfg)).await.unwrap().unwrap();
        let (remote, local) = (Buffer::new(4096).unwrap(), Buffer::new(4096).unwrap());
        t.register(remote.region(), Access::REMOTE_RW).unwrap();
        t.register(local.region(), Access::LOCAL).unwrap();
        let own = kvmove::own_descriptor(&t).await.unwrap();
        assert_eq!(own, t.local_descriptor().unwrap(), "{kind}: own_descriptor is local_descriptor");
        let s = t.stats();
        assert_eq!((s.segments, s.endpoints), (0, 0), "{kind}: no segment opened, no endpoint built: {s:?}");
        let seg = t.open_segment(&t.local_segment_name()).await.unwrap();
        let seen = t.segment_descriptor(seg).unwrap();
        t.close_segment(seg).await.unwrap();
        assert_eq!(own.generation, seen.generation, "{kind}");
        assert_eq!(own.regions, seen.regions, "{kind}");
        assert_eq!(own.regions.len(), 1, "{kind}: only the remotely accessible region");
        t.shutdown().await.unwrap();
    }
}
