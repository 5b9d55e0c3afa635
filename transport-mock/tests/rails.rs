//! `transport_rails::Rails` over mock hosts: a rail lost in the middle of a
//! batch costs no error, every rail lost moves over the fallback, and
//! without a fallback it is a transient error.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use transport_core::ErrorKind;
use transport_core::{Access, BatchState, SubmitOptions, TransferRequest, Transport};
use transport_mock::{FaultPlan, FaultyTransport, MockConfig, MockFabric, MockTransport, RequestFault};
use transport_rails::PathState;
use transport_rails::Rails;
use transport_rails::RailsConfig;

const LEN: usize = 8 << 20;
const REQ: u64 = 256 << 10;

fn cfg() -> RailsConfig {
    RailsConfig {
        slice_size: 64 << 10,
        chunk_bytes: 128 << 10,
        pause_ms: 200,
        max_pause_ms: 400,
        ..RailsConfig::default()
    }
}

fn host(fabric: &MockFabric, name: &str) -> Arc<dyn Transport> {
    // Every request takes a while, so a batch is still moving when a rail goes.
    MockTransport::new(
        fabric,
        MockConfig { name: Some(name.into()), latency: Duration::from_millis(5), ..MockConfig::default() },
    )
    .unwrap()
}

fn node(fabric: &MockFabric, name: &str, fallback: bool) -> Arc<Rails> {
    let rails = vec![host(fabric, &format!("{name}.r0")), host(fabric, &format!("{name}.r1"))];
    let fb = fallback.then(|| host(fabric, &format!("{name}.tcp")));
    Rails::new(rails, fb, cfg()).unwrap()
}

struct Pair {
    a: Arc<Rails>,
    b: Arc<Rails>,
    src: Mem,
    dst: Mem,
    reqs: Vec<TransferRequest>,
    seg: transport_core::SegmentId,
}

async fn pair(fabric: &MockFabric, fallback: bool) -> Pair {
    pair_with(fabric, node(fabric, "a", fallback), fallback).await
}

/// `a` (built by the test) writing the whole of a fresh buffer into node
/// "b", in `REQ`-sized requests.
async fn pair_with(fabric: &MockFabric, a: Arc<Rails>, fallback: bool) -> Pair {
    let b = node(fabric, "b", fallback);
    let src = Mem::new(LEN, 1);
    let dst = Mem::new(LEN, 2);
    let local = a.register(src.region(), Access::LOCAL).unwrap();
    b.register(dst.region(), Access::REMOTE_RW).unwrap();
    let seg = a.open_segment(&b.local_segment_name()).await.unwrap();
    let reqs =
        (0..LEN as u64 / REQ).map(|i| TransferRequest::write(local, i * REQ, seg, dst.addr() + i * REQ, REQ)).collect();
    Pair { a, b, src, dst, reqs, seg }
}

#[test]
fn a_rail_lost_mid_batch_costs_no_error() {
    run(async {
        let fabric = MockFabric::new();
        let p = pair(&fabric, false).await;
        assert_eq!(p.a.paths(p.seg).unwrap().len(), 2, "two rails each, paired by index");
        let id = p.a.submit(p.reqs.clone(), SubmitOptions::with_timeout(Duration::from_secs(15))).await.unwrap();
        // Rail 1 has moved part of its share when it goes.
        assert!(settle(|| p.a.paths(p.seg).unwrap()[1].bytes > 0).await);
        fabric.kill("b.r1").unwrap();
        assert!(!p.a.poll(id).unwrap().is_terminal(), "the batch must still be moving when the rail goes");
        let st = p.a.wait(id).await.unwrap();
        assert_eq!(st.state, BatchState::Completed, "{:?}", st.first_error());
        assert_eq!(p.dst.read(), p.src.read(), "every byte, through the failover");
        assert!(p.dst.canaries_intact());
        let paths = p.a.paths(p.seg).unwrap();
        assert!(paths[1].failures > 0, "{paths:?}");
        assert_eq!(paths[0].bytes + paths[1].bytes, LEN as u64, "{paths:?}");
        assert!(paths[1].bytes > 0, "rail 1 moved its share until it went: {paths:?}");
        p.a.release(id).unwrap();
        assert_eq!(p.a.stats().batches, 0);
    });
}

#[test]
fn the_fallback_carries_the_batch_while_every_rail_is_down() {
    run(async {
        let fabric = MockFabric::new();
        let p = pair(&fabric, true).await;
        assert_eq!(p.a.paths(p.seg).unwrap().len(), 3, "two rails and the fallback");
        fabric.kill("b.r0").unwrap();
        fabric.kill("b.r1").unwrap();
        let st =
            p.a.wait(p.a.submit(p.reqs.clone(), SubmitOptions::with_timeout(Duration::from_secs(15))).await.unwrap())
                .await
                .unwrap();
        assert_eq!(st.state, BatchState::Completed, "{:?}", st.first_error());
        assert_eq!(p.dst.read(), p.src.read());
        let paths = p.a.paths(p.seg).unwrap();
        assert!(paths[2].fallback && paths[2].bytes > 0, "{paths:?}");
        assert_eq!(paths.iter().map(|p| p.bytes).sum::<u64>(), LEN as u64, "{paths:?}");
        drop(p.b);
    });
}

#[test]
fn without_a_fallback_every_rail_down_is_a_transient_error() {
    run(async {
        let fabric = MockFabric::new();
        let p = pair(&fabric, false).await;
        fabric.kill("b.r0").unwrap();
        fabric.kill("b.r1").unwrap();
        let st = p.a.wait(p.a.submit(p.reqs.clone(), SubmitOptions::default()).await.unwrap()).await.unwrap();
        assert_eq!(st.state, BatchState::Failed);
        let e = st.first_error().unwrap();
        assert!(e.is_transient(), "{e}");
        assert!(p.dst.canaries_intact());
    });
}

/// A rail that fails every request is paused while the other carries the
/// batches; once it works again, its probe after the pause takes it back,
/// even though the other rail was up all along.
#[test]
fn a_paused_rail_is_probed_and_taken_back_while_the_other_carries_on() {
    run(async {
        let fabric = MockFabric::new();
        let flaky = FaultyTransport::wrap(host(&fabric, "a.r1"));
        let a = Rails::new(vec![host(&fabric, "a.r0"), flaky.clone()], None, cfg()).unwrap();
        let p = pair_with(&fabric, a, false).await;
        let (a, src, dst, seg, reqs) = (&p.a, &p.src, &p.dst, p.seg, p.reqs.clone());
        let every = RequestFault { when: Default::default(), kind: ErrorKind::ConnectionReset, times: None };
        flaky.set_fault_plan(FaultPlan { requests: vec![every], ..FaultPlan::default() }).unwrap();
        let st = a.wait(a.submit(reqs.clone(), SubmitOptions::default()).await.unwrap()).await.unwrap();
        assert_eq!(st.state, BatchState::Completed, "{:?}", st.first_error());
        assert_eq!(dst.read(), src.read());
        let paths = a.paths(seg).unwrap();
        // Paused, or already past its pause when the batch over rail 0
        // took longer than it (a loaded machine: ci70): taken out either way.
        assert!(matches!(paths[1].state, PathState::Paused | PathState::Probation) && paths[1].pauses > 0, "{paths:?}");
        assert_eq!(paths[1].bytes, 0, "{paths:?}");
        flaky.set_fault_plan(FaultPlan::default()).unwrap();
        // Past its pause (200 ms, doubled after every failed probe, at most 400 ms).
        assert!(settle(|| a.paths(seg).unwrap()[1].state == PathState::Probation).await);
        let st = a.wait(a.submit(reqs, SubmitOptions::default()).await.unwrap()).await.unwrap();
        assert_eq!(st.state, BatchState::Completed, "{:?}", st.first_error());
        let paths = a.paths(seg).unwrap();
        assert_eq!(paths[1].state, PathState::Up, "the probe took it back: {paths:?}");
        assert!(paths[1].bytes > 0, "{paths:?}");
    });
}

/// Slices follow what each path moves: a rail ten times slower than the
/// other is handed a small share of the batch, not half of it.
#[test]
fn a_slow_rail_gets_a_small_share() {
    run(async {
        let fabric = MockFabric::new();
        let rail = |name: &str, ms: u64| -> Arc<dyn Transport> {
            MockTransport::new(
                &fabric,
                MockConfig { name: Some(name.into()), latency: Duration::from_millis(ms), ..MockConfig::default() },
            )
            .unwrap()
        };
        let a = Rails::new(vec![rail("a.r0", 2), rail("a.r1", 20)], None, cfg()).unwrap();
        let p = pair_with(&fabric, a, false).await;
        let (a, src, dst, seg, reqs) = (&p.a, &p.src, &p.dst, p.seg, p.reqs.clone());
        let st = a.wait(a.submit(reqs, SubmitOptions::default()).await.unwrap()).await.unwrap();
        assert_eq!(st.state, BatchState::Completed, "{:?}", st.first_error());
        assert_eq!(dst.read(), src.read());
        let paths = a.paths(seg).unwrap();
        assert!(paths[1].bytes > 0, "the slow rail still carries some: {paths:?}");
        assert!(paths[0].bytes > 3 * paths[1].bytes, "the fast rail carries most: {paths:?}");
        eprintln!("fast rail {} bytes, slow rail {} bytes", paths[0].bytes, paths[1].bytes);
    });
}

/// A rail that cancels its work by itself mid-batch (what a TCP rail's
/// shutdown does) fails over like a failed link: the batch completes.
#[test]
fn a_rail_that_cancels_its_work_by_itself_fails_over() {
    run(async {
        let fabric = MockFabric::new();
        let flaky = FaultyTransport::wrap(host(&fabric, "a.r1"));
        let a = Rails::new(vec![host(&fabric, "a.r0"), flaky.clone()], None, cfg()).unwrap();
        let p = pair_with(&fabric, a, false).await;
        let (a, src, dst, seg, reqs) = (&p.a, &p.src, &p.dst, p.seg, p.reqs.clone());
        let id = a.submit(reqs, SubmitOptions::default()).await.unwrap();
        assert!(settle(|| a.paths(seg).unwrap()[1].bytes > 0).await);
        flaky.cancel_inner_batches().await;
        let st = a.wait(id).await.unwrap();
        assert_eq!(st.state, BatchState::Completed, "{:?}", st.first_error());
        assert_eq!(dst.read(), src.read());
        assert!(a.paths(seg).unwrap()[1].failures > 0);
    });
}

/// A rail that keeps no deadline: it submits every batch without a
/// timeout, so only the rails' own timer can end a batch at its deadline.
struct KeepsNoDeadline(Arc<dyn Transport>);

#[async_trait::async_trait]
impl transport_core::Layer for KeepsNoDeadline {
    fn inner(&self) -> &Arc<dyn Transport> {
        &self.0
    }
    async fn submit(
        &self,
        requests: Vec<TransferRequest>,
        _opts: SubmitOptions,
    ) -> transport_core::Result<transport_core::BatchId> {
        self.0.submit(requests, SubmitOptions::default()).await
    }
}

/// Rule 5 through the rails' one deadline timer: over rails that enforce
/// no deadline, a stalled batch still ends `TimedOut` at its deadline (the
/// timer wakes its driver, which cancels what is on the rails), and the
/// memory is quiet after.
#[test]
fn the_rails_keep_the_deadline_when_their_rails_keep_none() {
    run(async {
        let fabric = MockFabric::new();
        let deaf = |name: &str| -> Arc<dyn Transport> { Arc::new(KeepsNoDeadline(host(&fabric, name))) };
        let a = Rails::new(vec![deaf("a.r0"), deaf("a.r1")], None, cfg()).unwrap();
        let p = pair_with(&fabric, a, false).await;
        for r in ["b.r0", "b.r1"] {
            fabric.stall(r, true).unwrap();
        }
        let start = std::time::Instant::now();
        let id = p.a.submit(p.reqs.clone(), SubmitOptions::with_timeout(Duration::from_millis(300))).await.unwrap();
        let s = tokio::time::timeout(Duration::from_secs(10), p.a.wait(id))
            .await
            .expect("a stalled batch over rails without deadlines never ended: the rails' timer did not fire")
            .unwrap();
        assert_eq!(s.state, BatchState::TimedOut, "{:?}", s.requests);
        assert!(start.elapsed() < Duration::from_secs(5), "ended after {:?}", start.elapsed());
        let before = p.dst.read();
        for r in ["b.r0", "b.r1"] {
            fabric.stall(r, false).unwrap();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(p.dst.read() == before, "memory of a timed-out batch changed after the stall ended");
        p.a.release(id).unwrap();
    });
}

/// A directory that stands for `/proc`: `self/maps` and `self/numa_maps`
/// placing the memory at `addr .. addr + len` on NUMA node `node`.
struct FakeProc(std::path::PathBuf);

impl FakeProc {
    fn new(tag: &str, addr: u64, len: u64, node: u32) -> FakeProc {
        let dir = std::env::temp_dir().join(format!("kvmove-proc-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        transport_rails::topology::fabricate::proc_placing(&dir, addr, len, node).unwrap();
        FakeProc(dir)
    }
}

impl Drop for FakeProc {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// With a topology (rail 0's NIC on node 0, rail 1's on node 1), a region
/// on node 1 moves over rail 1 only; a region whose node is unknown is
/// striped over both; with rail 1 lost, the node-1 region moves over rail
/// 0, and no batch fails for it.
#[test]
fn a_region_keeps_to_the_rail_nearest_its_memory_and_fails_over_to_the_other() {
    use transport_rails::topology::{Place, Sysfs, Topology};
    run(async {
        let fabric = MockFabric::new();
        let near_node1 = Mem::new(LEN, 1);
        let proc = FakeProc::new("near", near_node1.addr(), LEN as u64, 1);
        let places = vec![Place { pci: Vec::new(), numa: Some(0) }, Place { pci: Vec::new(), numa: Some(1) }];
        let topo = Topology::of_places(Sysfs::new("/nonexistent"), places).with_proc_root(&proc.0);
        let rails = vec![host(&fabric, "a.r0"), host(&fabric, "a.r1")];
        let a = Rails::placed(rails, None, cfg(), Some(topo)).unwrap();
        let b = node(&fabric, "b", false);
        let dst = Mem::new(LEN, 2);
        b.register(dst.region(), Access::REMOTE_RW).unwrap();
        let seg = a.open_segment(&b.local_segment_name()).await.unwrap();
        let write_all = |local, src: &Mem| {
            let reqs: Vec<TransferRequest> = (0..LEN as u64 / REQ)
                .map(|i| TransferRequest::write(local, i * REQ, seg, dst.addr() + i * REQ, REQ))
                .collect();
            let a = a.clone();
            let expect = src.read();
            async move {
                let st = a.wait(a.submit(reqs, SubmitOptions::default()).await.unwrap()).await.unwrap();
                assert_eq!(st.state, BatchState::Completed, "{:?}", st.first_error());
                expect
            }
        };

        let near = a.register(near_node1.region(), Access::LOCAL).unwrap();
        let expect = write_all(near, &near_node1).await;
        assert_eq!(dst.read(), expect);
        let paths = a.paths(seg).unwrap();
        assert_eq!((paths[0].bytes, paths[1].bytes), (0, LEN as u64), "node 1's region over rail 1 only: {paths:?}");

        // Not in the fake maps: its node is unknown, so every rail serves it.
        let unknown = Mem::new(LEN, 3);
        let anywhere = a.register(unknown.region(), Access::LOCAL).unwrap();
        let expect = write_all(anywhere, &unknown).await;
        assert_eq!(dst.read(), expect);
        let striped = a.paths(seg).unwrap();
        assert!(striped[0].bytes > 0 && striped[1].bytes > paths[1].bytes, "striped over both: {striped:?}");

        // Rail 1 lost: node 1's region moves over rail 0.
        fabric.kill("b.r1").unwrap();
        let expect = write_all(near, &near_node1).await;
        assert_eq!(dst.read(), expect, "every byte over the farther rail");
        assert!(dst.canaries_intact());
        let after = a.paths(seg).unwrap();
        assert!(after[0].bytes > striped[0].bytes, "rail 0 carried it: {after:?}");
        assert!(after[1].failures > 0 || after[1].state != PathState::Up, "rail 1 is down: {after:?}");
    });
}

/// Issue 52 item 3: a rail of the peer that cannot be reached when the
/// peer is opened (here: killed before) is not one of its paths, so no
/// batch waits on it or fails on it; it is logged once, however often the
/// peer is opened, and counted in `kvmove_rail_events_total{event=
/// "unreachable"}` (once) and `kvmove_rail_paths_unreachable` (the
/// paths, now).
#[test]
fn a_rail_without_a_route_is_not_used_and_is_reported_once() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let recorder = DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(20), async {
                let fabric = MockFabric::new();
                let a = node(&fabric, "a", false);
                let b = node(&fabric, "b", false);
                let (src, dst) = (Mem::new(LEN, 1), Mem::new(LEN, 2));
                let local = a.register(src.region(), Access::LOCAL).unwrap();
                b.register(dst.region(), Access::REMOTE_RW).unwrap();
                fabric.kill("b.r1").unwrap();
                let mut segs = Vec::new();
                for _ in 0..3 {
                    segs.push(a.open_segment(&b.local_segment_name()).await.unwrap());
                }
                let seg = segs[0];
                let paths = a.paths(seg).unwrap();
                assert_eq!(paths.len(), 1, "only rail 0 reaches the peer: {paths:?}");
                let reqs: Vec<_> = (0..LEN as u64 / REQ)
                    .map(|i| TransferRequest::write(local, i * REQ, seg, dst.addr() + i * REQ, REQ))
                    .collect();
                let id = a.submit(reqs, SubmitOptions::with_timeout(Duration::from_secs(15))).await.unwrap();
                let st = a.wait(id).await.unwrap();
                assert_eq!(st.state, BatchState::Completed, "{:?}", st.first_error());
                assert_eq!(dst.read(), src.read());
                assert_eq!(a.paths(seg).unwrap()[0].failures, 0, "nothing failed over");
                a.release(id).unwrap();
                for s in segs {
                    a.close_segment(s).await.unwrap();
                }
            })
            .await
            .expect("test timed out");
        });
    });
    let (mut events, mut gauge) = (None, None);
    for (k, _, _, v) in snap.snapshot().into_vec() {
        match (k.key().name(), v) {
            ("kvmove_rail_events_total", DebugValue::Counter(n))
                if k.key().labels().any(|l| l.key() == "event" && l.value() == "unreachable") =>
            {
                events = Some(n)
            }
            ("kvmove_rail_paths_unreachable", DebugValue::Gauge(g)) => gauge = Some(g.into_inner()),
            _ => {}
        }
    }
    assert_eq!(events, Some(1), "opened three times, reported once");
    assert_eq!(gauge, Some(1.0), "one path unusable");
}

/// Issue 52, the peer's side: each side's rails have a topology (rail 0's
/// NIC on node 0, rail 1's on node 1) and every local rail is paired with
/// every peer rail. A source on node 0 written into a destination the peer
/// holds on node 1 moves over rail 0 to the peer's rail 1 only, as the
/// peer's descriptor says; a destination the peer registers after it was
/// opened is learned when a batch first names it; one the peer does not
/// place is reached from rail 0 over both of the peer's rails.
#[test]
fn bytes_go_from_the_rail_near_the_source_to_the_peer_rail_near_the_destination() {
    use std::collections::BTreeMap;
    use transport_rails::topology::{Place, Sysfs, Topology};
    use transport_rails::Pairing;
    run(async {
        let fabric = MockFabric::new();
        let (src, dst, late, unplaced) = (Mem::new(LEN, 1), Mem::new(LEN, 2), Mem::new(LEN, 3), Mem::new(LEN, 4));
        let proc_a = FakeProc::new("a-src", src.addr(), LEN as u64, 0);
        let proc_b = FakeProc::new("b-dst", dst.addr(), LEN as u64, 1);
        let all = RailsConfig { pairing: Pairing::All, ..cfg() };
        let placed = |tag: &str, proc: &FakeProc| {
            let places = vec![Place { pci: Vec::new(), numa: Some(0) }, Place { pci: Vec::new(), numa: Some(1) }];
            let topo = Topology::of_places(Sysfs::new("/nonexistent"), places).with_proc_root(&proc.0);
            let rails = vec![host(&fabric, &format!("{tag}.r0")), host(&fabric, &format!("{tag}.r1"))];
            Rails::placed(rails, None, all.clone(), Some(topo)).unwrap()
        };
        let a = placed("a", &proc_a);
        let b = placed("b", &proc_b);
        let local = a.register(src.region(), Access::LOCAL).unwrap();
        b.register(dst.region(), Access::REMOTE_RW).unwrap();
        let seg = a.open_segment(&b.local_segment_name()).await.unwrap();
        let by_path = || -> BTreeMap<(usize, usize), u64> {
            a.paths(seg).unwrap().into_iter().map(|p| ((p.rail.unwrap(), p.peer_rail.unwrap()), p.bytes)).collect()
        };
        let write_into = |to: &Mem| {
            let reqs: Vec<TransferRequest> = (0..LEN as u64 / REQ)
                .map(|i| TransferRequest::write(local, i * REQ, seg, to.addr() + i * REQ, REQ))
                .collect();
            let (a, before) = (a.clone(), by_path());
            async move {
                let st = a.wait(a.submit(reqs, SubmitOptions::default()).await.unwrap()).await.unwrap();
                assert_eq!(st.state, BatchState::Completed, "{:?}", st.first_error());
                let after: BTreeMap<(usize, usize), u64> = a
                    .paths(seg)
                    .unwrap()
                    .into_iter()
                    .map(|p| ((p.rail.unwrap(), p.peer_rail.unwrap()), p.bytes))
                    .collect();
                after.into_iter().map(|(k, v)| (k, v - before[&k])).filter(|&(_, v)| v > 0).collect::<Vec<_>>()
            }
        };
        assert_eq!(by_path().len(), 4, "every rail paired with every peer rail");

        let moved = write_into(&dst).await;
        assert_eq!(dst.read(), src.read());
        assert_eq!(moved, vec![((0, 1), LEN as u64)], "rail 0 to the peer's rail 1 only");

        // Registered on the peer after it was opened, also on node 1: the
        // batch that first names it reads the peer's descriptor again.
        transport_rails::topology::fabricate::proc_placing(&proc_b.0, late.addr(), LEN as u64, 1).unwrap();
        b.register(late.region(), Access::REMOTE_RW).unwrap();
        let moved = write_into(&late).await;
        assert_eq!(late.read(), src.read());
        assert_eq!(moved, vec![((0, 1), LEN as u64)], "learned with the region: rail 0 to the peer's rail 1");

        // Not placed by the peer (not in its fake /proc): both peer rails.
        b.register(unplaced.region(), Access::REMOTE_RW).unwrap();
        let moved = write_into(&unplaced).await;
        assert_eq!(unplaced.read(), src.read());
        let rails: Vec<(usize, usize)> = moved.iter().map(|m| m.0).collect();
        assert_eq!(rails, vec![(0, 0), (0, 1)], "from rail 0 over both of the peer's rails: {moved:?}");
        assert!(dst.canaries_intact() && late.canaries_intact() && unplaced.canaries_intact());
    });
}
