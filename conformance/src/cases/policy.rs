//! Policy is shared (rule 8): the [`Engine`] over this backend retries
//! only failed transient requests, never permanent ones, enforces
//! deadlines, and runs a circuit breaker that recovers. Faults come from
//! `transport_mock::FaultyTransport` put directly above the backend (below
//! any [`crate::Harness::wrap`] layer), whose counts see every
//! resubmission, including any a broken wrapper makes on its own.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmove_policy::{BreakerState, Engine, PolicyConfig, RetryConfig};
use transport_core::{Access, BatchState, ErrorKind, ManualClock, SegmentId, TransferRequest, Transport};
use transport_mock::{FaultPlan, FaultyTransport, RequestFault, RequestMatch};

use crate::ctx::{bounded, expect_quiet, open, Ctx, Pair};
use crate::ensure;
use crate::guard::{pattern, Guarded};
use crate::harness::NodeOptions;
use crate::outcome::{CaseError, CaseResult};

const LEN: usize = 256 << 10;

/// Which requests a fault hits.
#[derive(Debug, Clone, Copy)]
enum Target {
    All,
    Addr(u64),
}

/// The suite's handle on the fault injector under test.
struct Faults(Arc<FaultyTransport>);

impl Faults {
    /// Installs exactly these faults: `(target, kind, times)`, `u32::MAX`
    /// meaning every matching request.
    fn set(&self, rules: &[(Target, ErrorKind, u32)]) -> CaseResult {
        let requests = rules
            .iter()
            .map(|&(target, kind, times)| RequestFault {
                when: match target {
                    Target::All => RequestMatch::default(),
                    Target::Addr(a) => RequestMatch { remote_addr: Some(a), ..RequestMatch::default() },
                },
                kind,
                times: (times != u32::MAX).then_some(times),
            })
            .collect();
        self.0.set_fault_plan(FaultPlan { requests, ..FaultPlan::none() })?;
        Ok(())
    }

    fn clear(&self) -> CaseResult {
        self.set(&[])
    }

    /// How many times `r` was submitted to the injector.
    fn seen(&self, r: &TransferRequest) -> u32 {
        self.0.attempts_of(r.segment, r.remote_addr, r.len)
    }
}

/// A pair whose `a` transport is `harness.wrap(FaultyTransport(backend))`.
async fn faulty_pair(cx: &Ctx) -> Result<(Pair, Faults), CaseError> {
    let slot = Arc::new(parking_lot::Mutex::new(None));
    let s2 = slot.clone();
    let a = cx
        .node_layered(&NodeOptions::default(), move |t| {
            let f = FaultyTransport::wrap(t);
            *s2.lock() = Some(f.clone());
            f as Arc<dyn Transport>
        })
        .await?;
    let layer = slot.lock().take().ok_or("the fault injector was not installed")?;
    let b = cx.node(&NodeOptions::default()).await?;
    Ok((cx.pair_between(a, b, LEN).await?, Faults(layer)))
}

fn fast_retry(max_attempts: u32) -> PolicyConfig {
    let mut cfg = PolicyConfig {
        retry: RetryConfig {
            max_attempts,
            initial_backoff: Duration::from_millis(1),
            max_backoff: Duration::from_millis(10),
            ..RetryConfig::default()
        },
        ..PolicyConfig::default()
    };
    cfg.breaker.failure_threshold = 1000;
    cfg
}

fn landed(p: &Pair, reqs: &[TransferRequest]) -> CaseResult {
    let local = p.local.snapshot();
    let mut want = p.remote.snapshot();
    for r in reqs {
        let (l, m, n) = (r.local_offset as usize, (r.remote_addr - p.remote.addr()) as usize, r.len as usize);
        want[m..m + n].copy_from_slice(&local[l..l + n]);
    }
    p.remote.expect(&want, "data written through the engine")
}

/// A request failing transiently twice is retried and completes on the
/// third attempt; the other request is sent once.
pub async fn transient_failures_are_retried(cx: Ctx) -> CaseResult {
    let (p, f) = faulty_pair(&cx).await?;
    let engine = Engine::new(p.t().clone(), fast_retry(4))?;
    let (x, y) = (p.write(0, 0, 4096), p.write(4096, 4096, 4096));
    f.set(&[(Target::Addr(x.remote_addr), ErrorKind::ConnectionReset, 2)])?;
    let out = bounded("engine transfer", engine.transfer(vec![x, y])).await??;
    ensure!(out.is_success(), "transfer ended {:?}: {:?}", out.state, out.first_error().map(ToString::to_string));
    ensure!(out.attempts == 3, "expected 3 attempts, got {}", out.attempts);
    ensure!(
        f.seen(&x) == 3 && f.seen(&y) == 1,
        "submissions: failing request {}, healthy one {} (want 3 and 1)",
        f.seen(&x),
        f.seen(&y)
    );
    landed(&p, &[x, y])
}

/// A request that always fails transiently is tried exactly
/// `max_attempts` times and ends failed with its transient error.
pub async fn retries_stop_at_the_limit(cx: Ctx) -> CaseResult {
    let (p, f) = faulty_pair(&cx).await?;
    let engine = Engine::new(p.t().clone(), fast_retry(3))?;
    let x = p.write(0, 0, 4096);
    f.set(&[(Target::Addr(x.remote_addr), ErrorKind::ConnectionReset, u32::MAX)])?;
    let out = bounded("engine transfer", engine.transfer(vec![x])).await??;
    ensure!(out.state == BatchState::Failed, "transfer ended {:?}", out.state);
    let e = out.first_error().ok_or("failed without an error")?;
    ensure!(e.kind() == ErrorKind::ConnectionReset && e.is_transient(), "final error {e}");
    ensure!(f.seen(&x) == 3 && out.attempts == 3, "sent {} times in {} attempts, limit 3", f.seen(&x), out.attempts);
    Ok(())
}

/// Permanent errors are never retried, whether injected
/// (`AccessDenied`) or produced by the backend (remote out of bounds):
/// the request reaches the backend exactly once.
pub async fn permanent_errors_not_retried(cx: Ctx) -> CaseResult {
    let (p, f) = faulty_pair(&cx).await?;
    let engine = Engine::new(p.t().clone(), fast_retry(4))?;
    let x = p.write(0, 0, 4096);
    f.set(&[(Target::Addr(x.remote_addr), ErrorKind::AccessDenied, u32::MAX)])?;
    let out = bounded("engine transfer", engine.transfer(vec![x])).await??;
    ensure!(out.state == BatchState::Failed, "transfer ended {:?}", out.state);
    ensure!(out.first_error().map(|e| e.kind()) == Some(ErrorKind::AccessDenied), "error {:?}", out.first_error());
    ensure!(f.seen(&x) == 1, "a permanently failing request was submitted {} times (rule 8)", f.seen(&x));
    f.clear()?;
    let oob = p.write(0, LEN as u64 - 8, 16);
    let r = bounded("engine transfer", engine.transfer(vec![oob])).await?;
    let kind = match r {
        Err(e) => e.kind(),
        Ok(o) => o.first_error().map(|e| e.kind()).ok_or(format!("out-of-bounds transfer ended {:?}", o.state))?,
    };
    ensure!(kind == ErrorKind::OutOfBounds, "out-of-bounds transfer failed with {kind}");
    ensure!(
        f.seen(&oob) == 1,
        "a request the backend refused as out of bounds was submitted {} times (rule 8)",
        f.seen(&oob)
    );
    Ok(())
}

/// Of four requests, the two that fail once are resent; the two that
/// completed are sent exactly once.
pub async fn only_failed_requests_resent(cx: Ctx) -> CaseResult {
    let (p, f) = faulty_pair(&cx).await?;
    let engine = Engine::new(p.t().clone(), fast_retry(4))?;
    let reqs: Vec<TransferRequest> = (0..4u64).map(|i| p.write(i * 8192, i * 8192, 8192)).collect();
    f.set(&[
        (Target::Addr(reqs[1].remote_addr), ErrorKind::ConnectionReset, 1),
        (Target::Addr(reqs[3].remote_addr), ErrorKind::RetryExceeded, 1),
    ])?;
    let out = bounded("engine transfer", engine.transfer(reqs.clone())).await??;
    ensure!(out.is_success(), "transfer ended {:?}", out.state);
    let counts: Vec<u32> = reqs.iter().map(|r| f.seen(r)).collect();
    ensure!(counts == [1, 2, 1, 2], "submissions per request {counts:?}, want [1, 2, 1, 2] (rule 8)");
    landed(&p, &reqs)
}

/// The breaker opens after `failure_threshold` failed transfers, then
/// fails fast (`PeerUnavailable`, nothing sent, `open_segment` too),
/// half-opens after the cool-down, re-opens when the probe fails, and
/// closes when a probe succeeds (manual clock).
pub async fn breaker_opens_and_recovers(cx: Ctx) -> CaseResult {
    let (p, f) = faulty_pair(&cx).await?;
    let clock = ManualClock::new();
    let mut cfg = fast_retry(1);
    cfg.breaker.failure_threshold = 3;
    cfg.breaker.cooldown = Duration::from_secs(10);
    let engine = Engine::with_clock(p.t().clone(), cfg, Arc::new(clock.clone()))?;
    let peer = p.t().segment_descriptor(p.seg)?.name;
    let x = p.write(0, 0, 4096);
    f.set(&[(Target::All, ErrorKind::ConnectionRefused, u32::MAX)])?;
    for i in 0..3 {
        ensure!(engine.breaker_state(&peer) == BreakerState::Closed, "breaker opened after {i} failures, threshold 3");
        let out = bounded("engine transfer", engine.transfer(vec![x])).await??;
        ensure!(out.state == BatchState::Failed, "transfer to a failing peer ended {:?}", out.state);
    }
    ensure!(
        engine.breaker_state(&peer) == BreakerState::Open,
        "breaker is {:?} after 3 failures",
        engine.breaker_state(&peer)
    );
    let sent = f.seen(&x);
    let start = Instant::now();
    let fast = bounded("engine transfer", engine.transfer(vec![x])).await?;
    let kind = match fast {
        Err(e) => e.kind(),
        Ok(o) => o.first_error().map(|e| e.kind()).unwrap_or(ErrorKind::Internal),
    };
    ensure!(kind == ErrorKind::PeerUnavailable, "with the breaker open, a transfer failed with {kind}");
    ensure!(start.elapsed() < Duration::from_secs(1), "failing fast took {:?}", start.elapsed());
    ensure!(f.seen(&x) == sent, "with the breaker open, a request still reached the backend");
    let o = bounded("engine open", engine.open_segment(&peer)).await?;
    ensure!(
        o.as_ref().err().map(|e| e.kind()) == Some(ErrorKind::PeerUnavailable),
        "open with the breaker open: {o:?}"
    );
    clock.advance(Duration::from_secs(10));
    ensure!(
        engine.breaker_state(&peer) == BreakerState::HalfOpen,
        "breaker is {:?} after the cool-down",
        engine.breaker_state(&peer)
    );
    let probe = bounded("engine transfer", engine.transfer(vec![x])).await??;
    ensure!(probe.state == BatchState::Failed, "failing probe ended {:?}", probe.state);
    ensure!(
        engine.breaker_state(&peer) == BreakerState::Open,
        "breaker is {:?} after a failed probe",
        engine.breaker_state(&peer)
    );
    clock.advance(Duration::from_secs(10));
    f.clear()?;
    let ok = bounded("engine transfer", engine.transfer(vec![x])).await??;
    ensure!(ok.is_success(), "the successful probe ended {:?}", ok.state);
    ensure!(
        engine.breaker_state(&peer) == BreakerState::Closed,
        "breaker is {:?} after a successful probe",
        engine.breaker_state(&peer)
    );
    landed(&p, &[x])
}

/// The deadline from `DeadlineConfig` reaches the backend: a stalled
/// transfer through the engine ends `TimedOut` within the deadline plus a
/// margin, and its memory is quiet afterwards.
pub async fn deadline_from_config(cx: Ctx) -> CaseResult {
    let p = cx.pair(LEN).await?;
    let mut cfg = fast_retry(1);
    cfg.deadline.base = Duration::from_millis(300);
    cfg.deadline.per_mib = Duration::ZERO;
    let engine = Engine::new(p.t().clone(), cfg)?;
    cx.stall(&p.b, true).await?;
    let start = Instant::now();
    let out = bounded("engine transfer", engine.transfer(vec![p.write(0, 0, LEN as u64)])).await??;
    let took = start.elapsed();
    ensure!(out.state == BatchState::TimedOut, "a stalled transfer ended {:?}", out.state);
    ensure!(took < Duration::from_millis(2300), "deadline 300 ms enforced after {took:?}");
    let remote = p.remote.snapshot();
    p.local.write(0, &pattern(70, LEN))?;
    cx.stall(&p.b, false).await?;
    expect_quiet(&p.remote, &remote, Duration::from_millis(300), "memory after the engine reported a timeout").await
}

/// A second peer keeps working while the first one's breaker is open: the
/// breaker is per peer, never global.
pub async fn breaker_is_per_peer(cx: Ctx) -> CaseResult {
    let (p, f) = faulty_pair(&cx).await?;
    let c = cx.node(&NodeOptions::default()).await?;
    let mem = cx.guarded(LEN, 30)?;
    c.transport.register(mem.region(), Access::REMOTE_RW)?;
    let seg_c = open(&p.a, &c.name).await?;
    let mut cfg = fast_retry(1);
    cfg.breaker.failure_threshold = 2;
    cfg.breaker.cooldown = Duration::from_secs(3600);
    let engine = Engine::new(p.t().clone(), cfg)?;
    let x = p.write(0, 0, 4096);
    f.set(&[(Target::Addr(x.remote_addr), ErrorKind::ConnectionReset, u32::MAX)])?;
    for _ in 0..2 {
        bounded("engine transfer", engine.transfer(vec![x])).await??;
    }
    let peer_b = p.t().segment_descriptor(p.seg)?.name;
    ensure!(
        engine.breaker_state(&peer_b) == BreakerState::Open,
        "breaker of the failing peer is {:?}",
        engine.breaker_state(&peer_b)
    );
    let y = TransferRequest::write(p.local_id, 0, seg_c, mem.addr(), 4096);
    let out = bounded("engine transfer", engine.transfer(vec![y])).await??;
    ensure!(out.is_success(), "a healthy peer failed while another's breaker was open: {:?}", out.state);
    Ok(())
}

/// A pair whose peer `b` is killed, and an engine (threshold 2, the
/// given cool-down) whose breaker for it opened after failed transfers;
/// with the peer's name.
async fn killed_peer_with_open_breaker(
    cx: &Ctx,
    opts: &NodeOptions,
    cooldown: Duration,
) -> Result<(Pair, Engine, String), CaseError> {
    let p = cx.pair_with(LEN, opts).await?;
    let mut cfg = fast_retry(1);
    cfg.breaker.failure_threshold = 2;
    cfg.breaker.cooldown = cooldown;
    cfg.deadline.base = Duration::from_secs(2);
    let engine = Engine::new(p.t().clone(), cfg)?;
    let peer = p.b.name.clone();
    cx.kill(&p.b).await?;
    let x = p.write(0, 0, 4096);
    let mut tries = 0;
    while engine.breaker_state(&peer) == BreakerState::Closed {
        ensure!(tries < 5, "the breaker did not open after {tries} failed transfers, threshold 2");
        let r = bounded("engine transfer", engine.transfer(vec![x])).await?;
        ensure!(!matches!(&r, Ok(o) if o.is_success()), "a transfer to a killed peer completed");
        tries += 1;
    }
    Ok((p, engine, peer))
}

/// After a restarted peer was reached through `seg`: its breaker is
/// closed and a 4 KiB write into `mem` (its fresh memory) completes.
async fn closed_and_serving(engine: &Engine, peer: &str, p: &Pair, seg: SegmentId, mem: &Guarded) -> CaseResult {
    ensure!(
        engine.breaker_state(peer) == BreakerState::Closed,
        "breaker is {:?} once the restarted peer was reached",
        engine.breaker_state(peer)
    );
    let out =
        bounded("engine transfer", engine.transfer(vec![TransferRequest::write(p.local_id, 0, seg, mem.addr(), 4096)]))
            .await??;
    ensure!(out.is_success(), "transfer to the restarted peer ended {:?}", out.state);
    Ok(())
}

/// With real faults: the peer is killed, transfers through the engine
/// fail until its breaker opens; the peer restarts; after the (short,
/// real) cool-down the next open is the probe, it succeeds, the breaker
/// closes and transfers to the restarted peer complete. Never a permanent
/// blacklist.
pub async fn breaker_recovers_after_peer_restart(cx: Ctx) -> CaseResult {
    let opts = NodeOptions::default();
    let (p, engine, peer) = killed_peer_with_open_breaker(&cx, &opts, Duration::from_millis(300)).await?;
    let b2 = cx.restart(&p.b, &opts).await?;
    let mem = cx.guarded(LEN, 31)?;
    b2.transport.register(mem.region(), Access::REMOTE_RW)?;
    let start = Instant::now();
    let seg = loop {
        match bounded("engine open", engine.open_segment(&peer)).await? {
            Ok(seg) => break seg,
            Err(e) => ensure!(
                e.is_transient() && start.elapsed() < Duration::from_secs(5),
                "opening the restarted peer through the engine: {e} after {:?}",
                start.elapsed()
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    closed_and_serving(&engine, &peer, &p, seg, &mem).await
}

/// With real faults: the peer is killed and the breaker opens (cool-down
/// 60 s); calls meanwhile fail fast (`PeerUnavailable`, except a call's
/// probe once per probe interval: `refused_probe_interval` when the host
/// refused the last try, as a killed TCP peer's does, else
/// `probe_interval`; refused, one attempt): a burst of calls back to back
/// costs at most one connect per interval, never one per call. The peer
/// restarts on its address; the first call made two probe intervals later
/// reaches it (its own probe, or the background prober's before it), long
/// before the cool-down would have let one through.
pub async fn first_call_after_restart_reaches_the_peer(cx: Ctx) -> CaseResult {
    let opts = NodeOptions::default();
    let (p, engine, peer) = killed_peer_with_open_breaker(&cx, &opts, Duration::from_secs(60)).await?;
    let breaker = PolicyConfig::default().breaker;
    let (interval, shortest) = (breaker.probe_interval, breaker.refused_probe_interval);
    // Down: a burst of calls, all refused, at most one probe per interval.
    let (mut fast, mut refused) = (0u32, 0u32);
    let burst = Instant::now();
    for _ in 0..200 {
        match bounded("engine open", engine.open_segment(&peer)).await? {
            Ok(_) => return Err(CaseError::Fail("opening a killed peer through the engine succeeded".into())),
            Err(e) if e.kind() == ErrorKind::PeerUnavailable => fast += 1,
            Err(e) => {
                ensure!(e.is_transient(), "a call to a killed peer failed with a permanent {e}");
                ensure!(e.context_value("attempts").is_none(), "a call's probe of a killed peer asked again: {e}");
                refused += 1;
            }
        }
    }
    let took = burst.elapsed();
    let most = took.as_micros() / shortest.as_micros().max(1) + 2;
    ensure!(
        u128::from(refused) <= most,
        "{refused} of 200 calls to the killed peer in {took:?} probed it ({fast} failed fast): more than one per \
         {shortest:?}"
    );
    let b2 = cx.restart(&p.b, &opts).await?;
    let mem = cx.guarded(LEN, 38)?;
    b2.transport.register(mem.region(), Access::REMOTE_RW)?;
    tokio::time::sleep(interval * 2).await;
    let seg = bounded("engine open", engine.open_segment(&peer)).await?.map_err(|e| {
        CaseError::Fail(format!(
            "the first call {:?} after the peer restarted (probe interval {interval:?}, cool-down 60 s): {e}",
            interval * 2
        ))
    })?;
    closed_and_serving(&engine, &peer, &p, seg, &mem).await
}

/// With real faults: the peer is killed and the breaker opens (cool-down
/// 60 s, so only a probe can close it in time); the peer restarts. With no
/// call from the user, the engine's background prober asks the peer and
/// closes the breaker within seconds, and the next open and transfer go
/// through. [`Engine::probe`] of the live peer is `Ok`.
pub async fn prober_closes_breaker_when_peer_returns(cx: Ctx) -> CaseResult {
    let opts = NodeOptions::default();
    let (p, engine, peer) = killed_peer_with_open_breaker(&cx, &opts, Duration::from_secs(60)).await?;
    ensure!(engine.active_probers() == 1, "{} background probers after the breaker opened", engine.active_probers());
    let b2 = cx.restart(&p.b, &opts).await?;
    let mem = cx.guarded(LEN, 37)?;
    b2.transport.register(mem.region(), Access::REMOTE_RW)?;
    let start = Instant::now();
    while engine.breaker_state(&peer) != BreakerState::Closed {
        ensure!(
            start.elapsed() < Duration::from_secs(15),
            "the breaker is still {:?} {:?} after the peer came back (cool-down 60 s): nothing probed it",
            engine.breaker_state(&peer),
            start.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let seg = bounded("engine open", engine.open_segment(&peer)).await??;
    let out =
        bounded("engine transfer", engine.transfer(vec![TransferRequest::write(p.local_id, 0, seg, mem.addr(), 4096)]))
            .await??;
    ensure!(out.is_success(), "transfer to the restarted peer ended {:?}", out.state);
    bounded("engine probe", engine.probe(&peer)).await??;
    let settle = Instant::now();
    while engine.active_probers() != 0 {
        ensure!(settle.elapsed() < Duration::from_secs(5), "the prober did not end once its breaker closed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}
