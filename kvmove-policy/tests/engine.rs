//! The policy layer against a scripted backend whose every request outcome
//! the test decides.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use kvmove_policy::*;
use parking_lot::Mutex;
use tokio::sync::Notify;
use transport_core::*;

type Script = dyn Fn(&TransferRequest, u32) -> RequestStatus + Send + Sync;

/// Completes each request as the script says, given how many times that
/// request (by remote address) has been submitted before.
struct Scripted {
    script: Box<Script>,
    seen: Mutex<HashMap<u64, u32>>,
    batches: Mutex<HashMap<u64, BatchStatus>>,
    next: AtomicU64,
    gate: Option<Arc<Notify>>,
    /// How the peer named "flaky" answers opens.
    flaky: Mutex<Flaky>,
    /// How notifications are answered.
    notes: Mutex<Notes>,
}

/// Notifications: the first `busy` answer `Backpressure` (a full inbox),
/// the next `then` (`None`: delivered); `offered` counts them all.
#[derive(Default)]
struct Notes {
    busy: u32,
    then: Option<ErrorKind>,
    offered: u32,
}

/// The peer "flaky": `resets` opens reset in the handshake, then each is
/// refused while `refuse` (by its host, nothing listening, while
/// `host_refuses`), else served; `opens` counts them.
#[derive(Default)]
struct Flaky {
    refuse: bool,
    host_refuses: bool,
    resets: u32,
    opens: u32,
    /// How long each open takes to answer.
    delay: Duration,
}

impl Scripted {
    fn new(script: impl Fn(&TransferRequest, u32) -> RequestStatus + Send + Sync + 'static) -> Arc<Self> {
        Arc::new(Self {
            script: Box::new(script),
            seen: Mutex::default(),
            batches: Mutex::default(),
            next: AtomicU64::new(1),
            gate: None,
            flaky: Mutex::default(),
            notes: Mutex::new(Notes { then: Some(ErrorKind::Unsupported), ..Notes::default() }),
        })
    }

    fn gated(gate: Arc<Notify>) -> Arc<Self> {
        let mut s = Arc::into_inner(Self::new(|_, _| RequestStatus::Completed)).unwrap();
        s.gate = Some(gate);
        Arc::new(s)
    }

    fn submissions(&self, remote_addr: u64) -> u32 {
        self.seen.lock().get(&remote_addr).copied().unwrap_or(0)
    }
}

#[async_trait]
impl Transport for Scripted {
    fn backend(&self) -> &str {
        "scripted"
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities::new(1)
    }
    fn local_segment_name(&self) -> String {
        "me".into()
    }
    fn local_descriptor(&self) -> Result<SegmentDescriptor> {
        Err(Error::new(ErrorKind::Unsupported, "scripted"))
    }
    fn register(&self, _: MemoryRegion, _: Access) -> Result<RegionId> {
        Ok(RegionId(1))
    }
    async fn unregister(&self, _: RegionId) -> Result<()> {
        Ok(())
    }
    async fn open_segment(&self, name: &str) -> Result<SegmentId> {
        if name == "flaky" {
            let delay = self.flaky.lock().delay;
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            let mut f = self.flaky.lock();
            f.opens += 1;
            if f.resets > 0 {
                f.resets -= 1;
                return Err(Error::new(ErrorKind::ConnectionReset, "early eof in the handshake"));
            }
            if f.host_refuses {
                return Err(Error::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused)));
            }
            if f.refuse {
                return Err(Error::new(ErrorKind::ConnectionRefused, "nobody listens"));
            }
            return Ok(SegmentId(9));
        }
        match name.strip_prefix("peer-") {
            Some(n) => Ok(SegmentId(n.parse().map_err(|_| Error::new(ErrorKind::NotFound, "bad name"))?)),
            None => Err(Error::new(ErrorKind::ConnectionRefused, "down")),
        }
    }
    async fn close_segment(&self, _: SegmentId) -> Result<()> {
        Ok(())
    }
    fn segment_descriptor(&self, s: SegmentId) -> Result<SegmentDescriptor> {
        Ok(SegmentDescriptor {
            name: format!("peer-{}", s.0),
            backend: "scripted".into(),
            generation: 1,
            address: String::new(),
            regions: vec![],
        })
    }
    async fn submit(&self, requests: Vec<TransferRequest>, _: SubmitOptions) -> Result<BatchId> {
        let statuses = requests
            .iter()
            .map(|r| {
                let mut seen = self.seen.lock();
                let n = seen.entry(r.remote_addr).or_default();
                *n += 1;
                if self.gate.is_some() {
                    RequestStatus::Pending
                } else {
                    (self.script)(r, *n)
                }
            })
            .collect();
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.batches.lock().insert(id, BatchStatus::from_requests(statuses));
        Ok(BatchId(id))
    }
    fn poll(&self, b: BatchId) -> Result<BatchStatus> {
        self.batches.lock().get(&b.0).cloned().ok_or_else(|| Error::new(ErrorKind::InvalidHandle, "no batch"))
    }
    async fn wait(&self, b: BatchId) -> Result<BatchStatus> {
        if let Some(g) = &self.gate {
            if !self.poll(b)?.is_terminal() {
                g.notified().await;
                let mut m = self.batches.lock();
                let s = m.get_mut(&b.0).ok_or_else(|| Error::new(ErrorKind::InvalidHandle, "no batch"))?;
                *s = BatchStatus::from_requests(vec![RequestStatus::Completed; s.requests.len()]);
            }
        }
        self.poll(b)
    }
    async fn cancel(&self, b: BatchId) -> Result<BatchStatus> {
        let mut m = self.batches.lock();
        let s = m.get_mut(&b.0).ok_or_else(|| Error::new(ErrorKind::InvalidHandle, "no batch"))?;
        let reqs =
            s.requests.iter().map(|r| if r.is_terminal() { r.clone() } else { RequestStatus::Cancelled }).collect();
        *s = BatchStatus::from_requests(reqs);
        Ok(s.clone())
    }
    fn release(&self, b: BatchId) -> Result<()> {
        self.batches.lock().remove(&b.0).map(|_| ()).ok_or_else(|| Error::new(ErrorKind::InvalidHandle, "no batch"))
    }
    fn stats(&self) -> ResourceStats {
        ResourceStats { batches: self.batches.lock().len(), ..ResourceStats::default() }
    }
    async fn shutdown(&self) -> Result<()> {
        Ok(())
    }
    async fn notify(&self, _segment: SegmentId, _msg: Vec<u8>) -> Result<()> {
        let mut n = self.notes.lock();
        n.offered += 1;
        if n.busy > 0 {
            n.busy -= 1;
            return Err(Error::new(ErrorKind::Backpressure, "scripted: the inbox is full"));
        }
        match n.then {
            Some(kind) => Err(Error::new(kind, "scripted notification")),
            None => Ok(()),
        }
    }
    fn take_notifications(&self, _max: usize) -> Result<Vec<transport_core::Notification>> {
        Ok(Vec::new())
    }
    async fn wait_notification(&self) -> Result<()> {
        std::future::pending().await
    }
}

fn fast_policy() -> PolicyConfig {
    let mut p = PolicyConfig::default();
    p.retry.initial_backoff = Duration::from_millis(1);
    p.retry.max_backoff = Duration::from_millis(2);
    p
}

fn reqs(seg: u64, n: u64) -> Vec<TransferRequest> {
    (0..n).map(|i| TransferRequest::write(RegionId(1), 0, SegmentId(seg), 1000 + i, 8)).collect()
}

fn failed(kind: ErrorKind) -> RequestStatus {
    RequestStatus::Failed(Error::new(kind, "scripted"))
}

/// The script where request 1001's first submission is reset and every
/// other submission completes.
fn reset_once_at_1001(r: &TransferRequest, n: u32) -> RequestStatus {
    if r.remote_addr == 1001 && n == 1 {
        failed(ErrorKind::ConnectionReset)
    } else {
        RequestStatus::Completed
    }
}

async fn with_timeout<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(10), f).await.expect("test timed out")
}

#[tokio::test]
async fn only_failed_transient_requests_are_retried() {
    let t = Scripted::new(reset_once_at_1001);
    let e = Engine::new(t.clone(), fast_policy()).unwrap();
    let out = with_timeout(e.transfer(reqs(7, 3))).await.unwrap();
    assert!(out.is_success(), "{out:?}");
    assert_eq!(out.attempts, 2);
    assert_eq!((t.submissions(1000), t.submissions(1001), t.submissions(1002)), (1, 2, 1));
    assert_eq!(t.stats().batches, 0, "engine releases every backend batch");
    assert_eq!(e.active_transfers(), 0);
}

#[tokio::test]
async fn permanent_errors_are_never_retried() {
    let t =
        Scripted::new(
            |r, _| if r.remote_addr == 1000 { failed(ErrorKind::AccessDenied) } else { RequestStatus::Completed },
        );
    let e = Engine::new(t.clone(), fast_policy()).unwrap();
    let out = with_timeout(e.transfer(reqs(7, 2))).await.unwrap();
    assert_eq!(out.state, BatchState::Failed);
    assert_eq!(out.first_error().map(Error::kind), Some(ErrorKind::AccessDenied));
    assert_eq!(out.attempts, 1);
    assert_eq!(t.submissions(1000), 1);
    assert_eq!(out.into_result().unwrap_err().kind(), ErrorKind::AccessDenied);
}

#[tokio::test]
async fn transient_retries_stop_at_the_limit() {
    let t = Scripted::new(|_, _| RequestStatus::TimedOut);
    let mut p = fast_policy();
    p.retry.max_attempts = 3;
    p.breaker.failure_threshold = 100;
    let e = Engine::new(t.clone(), p).unwrap();
    let out = with_timeout(e.transfer(reqs(7, 1))).await.unwrap();
    assert_eq!(out.state, BatchState::TimedOut);
    assert_eq!(out.attempts, 3);
    assert_eq!(t.submissions(1000), 3);
}

#[tokio::test]
async fn breaker_opens_fails_fast_and_closes_after_probe() {
    let healthy = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let h = healthy.clone();
    let t = Scripted::new(move |_, _| {
        if h.load(Ordering::Relaxed) {
            RequestStatus::Completed
        } else {
            failed(ErrorKind::ConnectionRefused)
        }
    });
    let clock = ManualClock::new();
    let mut p = fast_policy();
    p.retry.max_attempts = 1;
    p.breaker = BreakerConfig { failure_threshold: 2, cooldown: Duration::from_secs(5), ..Default::default() };
    let e = Engine::with_clock(t.clone(), p, Arc::new(clock.clone())).unwrap();
    for _ in 0..2 {
        let out = with_timeout(e.transfer(reqs(3, 1))).await.unwrap();
        assert_eq!(out.state, BatchState::Failed);
    }
    assert_eq!(e.breaker_state("peer-3"), BreakerState::Open);
    let err = with_timeout(e.submit(reqs(3, 1))).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::PeerUnavailable);
    assert!(err.is_transient());
    assert_eq!(t.submissions(1000), 2, "fail fast: nothing reached the backend");
    assert_eq!(e.breaker_state("peer-4"), BreakerState::Closed, "other peers unaffected");
    clock.advance(Duration::from_secs(5));
    assert_eq!(e.breaker_state("peer-3"), BreakerState::HalfOpen);
    healthy.store(true, Ordering::Relaxed);
    let out = with_timeout(e.transfer(reqs(3, 1))).await.unwrap();
    assert!(out.is_success());
    assert_eq!(e.breaker_state("peer-3"), BreakerState::Closed);
}

/// Issue 55 item 3: a killed peer is reported as soon as its host says
/// nothing listens. Its connection broke (attempt 1), its host refused
/// the reconnect (attempt 2): over, with two of four attempts spent. A
/// refusal by the peer itself (busy) keeps every attempt.
#[tokio::test]
async fn a_host_refusing_the_reconnect_ends_the_transfer() {
    let t = Scripted::new(|r, n| match (r.remote_addr, n) {
        (1000, 1) => failed(ErrorKind::ConnectionReset),
        (1000 | 1002, _) => RequestStatus::Failed(std::io::Error::from(std::io::ErrorKind::ConnectionRefused).into()),
        _ => failed(ErrorKind::ConnectionRefused),
    });
    let e = Engine::new(t.clone(), fast_policy()).unwrap();
    let out = with_timeout(e.transfer(reqs(3, 1))).await.unwrap();
    assert_eq!(out.state, BatchState::Failed);
    assert!(out.first_error().is_some_and(Error::nothing_listens), "{:?}", out.first_error());
    assert_eq!((out.attempts, t.submissions(1000)), (2, 2));
    // Refused by the host at the first attempt (the peer died between two
    // transfers): one attempt.
    let out =
        with_timeout(e.transfer(vec![TransferRequest::write(RegionId(1), 0, SegmentId(5), 1002, 8)])).await.unwrap();
    assert!(out.first_error().is_some_and(Error::nothing_listens), "{:?}", out.first_error());
    assert_eq!((out.attempts, t.submissions(1002)), (1, 1));
    // The peer's own refusal (busy): every attempt.
    let out =
        with_timeout(e.transfer(vec![TransferRequest::write(RegionId(1), 0, SegmentId(4), 1001, 8)])).await.unwrap();
    assert_eq!((out.state, out.attempts, t.submissions(1001)), (BatchState::Failed, 4, 4));
}

/// Issue 55 item 3: a killed peer is reported as soon as the kernel
/// reports the break. The first attempt's connection broke, so the
/// reconnect goes at once, and its host's refusal ends the transfer: no
/// backoff in between (the default policy's 20 ms). A first attempt that
/// timed out still backs off. Virtual time.
#[tokio::test(start_paused = true)]
async fn a_broken_connection_is_tried_again_at_once() {
    let t = Scripted::new(|r, n| match (r.remote_addr, n) {
        (1000, 1) => failed(ErrorKind::ConnectionReset),
        (1000, _) => RequestStatus::Failed(std::io::Error::from(std::io::ErrorKind::ConnectionRefused).into()),
        (_, 1) => RequestStatus::TimedOut,
        _ => RequestStatus::Completed,
    });
    let e = Engine::new(t.clone(), PolicyConfig::default()).unwrap();
    let start = tokio::time::Instant::now();
    let out = with_timeout(e.transfer(reqs(3, 1))).await.unwrap();
    assert!(out.first_error().is_some_and(Error::nothing_listens), "{:?}", out.first_error());
    assert_eq!(out.attempts, 2);
    assert!(start.elapsed() < Duration::from_millis(1), "the reconnect waited {:?}", start.elapsed());
    let start = tokio::time::Instant::now();
    let out =
        with_timeout(e.transfer(vec![TransferRequest::write(RegionId(1), 0, SegmentId(4), 1001, 8)])).await.unwrap();
    assert!(out.is_success() && out.attempts == 2, "{out:?}");
    assert!(start.elapsed() >= Duration::from_millis(15), "a timeout was retried after {:?}", start.elapsed());
}

#[tokio::test]
async fn open_segment_failures_feed_the_breaker() {
    let t = Scripted::new(|_, _| RequestStatus::Completed);
    let mut p = fast_policy();
    p.breaker.failure_threshold = 2;
    let e = Engine::new(t, p).unwrap();
    for _ in 0..2 {
        assert_eq!(e.open_segment("down").await.unwrap_err().kind(), ErrorKind::ConnectionRefused);
    }
    assert_eq!(e.open_segment("down").await.unwrap_err().kind(), ErrorKind::PeerUnavailable);
    assert!(e.open_segment("peer-1").await.is_ok());
}

/// Issue 55 item 3 (ci48): the probe of a half-open breaker is one
/// connect when the peer refuses (still down: one attempt per cool-down),
/// but a connection reset in the handshake (something listens: the peer
/// is back, still starting) is asked again, so the first call to a
/// restarted peer succeeds. Virtual time: the background prober runs, and
/// the test's own calls are told apart by what they return.
#[tokio::test(start_paused = true)]
async fn a_probe_that_was_reset_asks_again_one_that_was_refused_does_not() {
    let t = Scripted::new(|_, _| RequestStatus::Completed);
    let mut p = fast_policy();
    p.retry.max_attempts = 4;
    p.breaker = BreakerConfig { failure_threshold: 1, cooldown: Duration::from_secs(10), ..Default::default() };
    let e = Engine::new(t.clone(), p).unwrap();
    let open_it = || async {
        // Down: refused four times (the policy's attempts), the breaker opens.
        t.flaky.lock().refuse = true;
        let err = e.open_segment("flaky").await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::ConnectionRefused, "{err}");
        assert_eq!(err.context_value("attempts"), Some("4"), "{err}");
        assert_eq!(e.breaker_state("flaky"), BreakerState::Open);
        assert_eq!(e.open_segment("flaky").await.unwrap_err().kind(), ErrorKind::PeerUnavailable);
        // The cool-down passes (the background prober is refused meanwhile).
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert_eq!(e.breaker_state("flaky"), BreakerState::HalfOpen);
    };

    open_it().await;
    // Back, but its first handshake is cut: the probe asks again.
    {
        let mut f = t.flaky.lock();
        f.refuse = false;
        f.resets = 1;
    }
    let seg = e.open_segment("flaky").await;
    assert!(seg.is_ok(), "the probe's reset was not asked again: {seg:?}");
    assert_eq!(t.flaky.lock().resets, 0, "the probe met the reset");
    assert_eq!(e.breaker_state("flaky"), BreakerState::Closed);

    open_it().await;
    // Still down: the probe is one connect, and says so.
    let before = t.flaky.lock().opens;
    let err = e.open_segment("flaky").await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ConnectionRefused, "{err}");
    assert_eq!(err.context_value("attempts"), None, "{err}");
    assert_eq!(t.flaky.lock().opens - before, 1, "a refused probe is one attempt");
    assert_eq!(e.breaker_state("flaky"), BreakerState::Open);
}

/// An engine whose breaker opens at the first failure (10 s cool-down,
/// probes every 100 ms, `attempts` tries per call) over a scripted
/// backend whose peer "flaky" refuses connections: the breaker is open
/// once this returns.
async fn flaky_down(attempts: u32) -> (Arc<Scripted>, Engine) {
    let t = Scripted::new(|_, _| RequestStatus::Completed);
    let mut p = fast_policy();
    p.retry.max_attempts = attempts;
    p.breaker = BreakerConfig {
        failure_threshold: 1,
        cooldown: Duration::from_secs(10),
        probe_interval: Duration::from_millis(100),
        ..Default::default()
    };
    let e = Engine::new(t.clone(), p).unwrap();
    t.flaky.lock().refuse = true;
    assert_eq!(e.open_segment("flaky").await.unwrap_err().kind(), ErrorKind::ConnectionRefused);
    assert_eq!(e.breaker_state("flaky"), BreakerState::Open);
    (t, e)
}

/// `n` calls that open the peer "flaky" while it is down, `gap` apart in
/// virtual time (slept; advanced by hand under a millisecond, a sleep's
/// timer grain): (failed fast, probed it, probes its host refused). A
/// probe is one connect, and nothing else fails a call.
async fn calls_while_down(e: &Engine, n: u32, gap: Duration) -> (u32, u32, u32) {
    let (mut fast, mut probed, mut by_host) = (0u32, 0u32, 0u32);
    for _ in 0..n {
        let err = e.open_segment("flaky").await.unwrap_err();
        match err.kind() {
            ErrorKind::PeerUnavailable => fast += 1,
            ErrorKind::ConnectionRefused => {
                assert_eq!(err.context_value("attempts"), None, "a refused probe is one connect: {err}");
                probed += 1;
                by_host += u32::from(err.nothing_listens());
            }
            k => panic!("a call to a dead peer failed with {k}: {err}"),
        }
        if gap < Duration::from_millis(1) {
            tokio::time::advance(gap).await;
        } else {
            tokio::time::sleep(gap).await;
        }
    }
    (fast, probed, by_host)
}

/// ci71: a probe that is still out does not hold calls back. The peer
/// counts as tried when a probe failed, not when it started, so a call
/// that comes a probe interval after the last failed probe probes the peer
/// itself, beside a slow probe that is about to find it back, instead of
/// failing fast. Virtual time; the background prober's probes (20, 60,
/// 140, 300, 620, 1260, 2260 ms, all refused or later) stay clear of it.
#[tokio::test(start_paused = true)]
async fn a_call_beside_a_probe_still_out_may_probe() {
    let (t, e) = flaky_down(1).await;
    tokio::time::sleep(Duration::from_millis(2000)).await;
    assert_eq!(e.breaker_state("flaky"), BreakerState::Open);
    {
        let mut f = t.flaky.lock();
        f.refuse = false;
        f.delay = Duration::from_millis(50);
    }
    let e = Arc::new(e);
    let probing = tokio::spawn({
        let e = e.clone();
        async move { e.probe("flaky").await }
    });
    tokio::time::sleep(Duration::from_millis(10)).await;
    let seg = e.open_segment("flaky").await;
    assert!(seg.is_ok(), "a call beside a probe that was out failed: {seg:?}");
    assert!(probing.await.unwrap().is_ok());
    assert_eq!(e.breaker_state("flaky"), BreakerState::Closed);
}

/// Issue 55 item 3: a call to a peer whose breaker is open probes it
/// (one connect) when the peer was last tried at least
/// `breaker.probe_interval` ago, so the first call after a restart
/// succeeds long before the cool-down ends; a dead peer hammered by calls
/// costs at most one call's connect per interval (the background
/// prober's own probes besides). Virtual time.
#[tokio::test(start_paused = true)]
async fn a_call_to_an_open_breaker_probes_once_per_interval() {
    let (t, e) = flaky_down(4).await;

    // Down for a second, called every millisecond.
    let before = t.flaky.lock().opens;
    let (fast, probed, _) = calls_while_down(&e, 1000, Duration::from_millis(1)).await;
    let opens = t.flaky.lock().opens - before;
    // The background prober tried at 20, 60, 140, 300 and 620 ms.
    assert!((1..=11).contains(&probed), "{probed} of 1000 calls probed the dead peer in a second");
    assert!(opens <= probed + 5, "{opens} connects in a second: {probed} probing calls and the prober's 5 at most");
    assert_eq!(fast + probed, 1000);
    assert_eq!(e.breaker_state("flaky"), BreakerState::Open);

    // It restarts (100 ms, nobody calls); the first call after finds it,
    // 8.9 s before the cool-down would have let a probe through.
    tokio::time::sleep(Duration::from_millis(100)).await;
    t.flaky.lock().refuse = false;
    let seg = e.open_segment("flaky").await;
    assert!(seg.is_ok(), "the first call after the restart: {seg:?}");
    assert_eq!(e.breaker_state("flaky"), BreakerState::Closed);
}

/// Issue 55 item 3: a peer whose host refuses (nothing listens: killed,
/// restarting at its address) is probed by a call every
/// `refused_probe_interval` (1 ms), not every `probe_interval`: a dead
/// peer called back to back costs at most one connect a millisecond (a
/// storm of calls still fails fast), and the first call a millisecond
/// after it listens again finds it. Virtual time, advanced by hand (a
/// sleep's timer has a millisecond's grain).
#[tokio::test(start_paused = true)]
async fn a_host_that_refuses_is_probed_every_millisecond() {
    let (t, e) = flaky_down(4).await;
    {
        let mut f = t.flaky.lock();
        f.refuse = false;
        f.host_refuses = true;
    }
    // The breaker opened on a refusal by the peer itself (its connection
    // limit: not the host's): the long interval, until a call's probe or
    // the prober's at 20 ms is refused by the host.
    let before = t.flaky.lock().opens;
    // 100 ms of calls every 100 us (1000 calls).
    let (fast, probed, by_host) = calls_while_down(&e, 1000, Duration::from_micros(100)).await;
    assert_eq!(by_host, probed, "every probe was refused by the peer's host");
    let opens = t.flaky.lock().opens - before;
    // Every millisecond from the prober's refusal at 20 ms: about 80.
    assert!((60..=101).contains(&probed), "{probed} of 1000 calls in 100 ms probed the refusing host");
    assert!(opens <= probed + 3, "{opens} connects in 100 ms: {probed} probing calls and the prober's");
    assert_eq!(fast + probed, 1000);
    assert_eq!(e.breaker_state("flaky"), BreakerState::Open);

    // It listens again; the calls go on every 100 us: one of the first
    // eleven after it finds it (within a millisecond and one call).
    t.flaky.lock().host_refuses = false;
    let mut failed = 0;
    loop {
        match e.open_segment("flaky").await {
            Ok(_) => break,
            Err(err) => assert_eq!(err.kind(), ErrorKind::PeerUnavailable, "{err}"),
        }
        failed += 1;
        assert!(failed <= 10, "{failed} calls failed fast after the peer listened again");
        tokio::time::advance(Duration::from_micros(100)).await;
    }
    assert_eq!(e.breaker_state("flaky"), BreakerState::Closed);
}

/// Issue 55 item 3: opening a segment whose host refuses asks once more
/// after the first backoff (a listener about to come up), but a call to a
/// peer whose host refused its last try too fails at its first refusal:
/// that earlier try was the chance to come up, and a program that opens a
/// session per call (the Mooncake and NIXL stand-ins after a failure)
/// would otherwise wait a backoff at every call to a dead address. A
/// success forgets the refusal. Virtual time.
#[tokio::test(start_paused = true)]
async fn a_host_refusing_again_is_not_asked_twice() {
    let t = Scripted::new(|_, _| RequestStatus::Completed);
    let mut p = PolicyConfig::default();
    p.breaker.failure_threshold = 100;
    let e = Engine::new(t.clone(), p).unwrap();
    t.flaky.lock().host_refuses = true;
    let opens = || t.flaky.lock().opens;
    let call = || async {
        let (before, start) = (opens(), tokio::time::Instant::now());
        let err = e.open_segment("flaky").await.unwrap_err();
        assert!(err.nothing_listens(), "{err}");
        (opens() - before, start.elapsed())
    };
    let (asked, took) = call().await;
    assert_eq!(asked, 2, "the first refusal is asked once more");
    assert!(took >= Duration::from_millis(10), "after the first backoff: {took:?}");
    for _ in 0..3 {
        assert_eq!(call().await, (1, Duration::ZERO), "refused again: one connect, no wait");
    }
    assert_eq!(e.breaker_state("flaky"), BreakerState::Closed);
    // Back, then gone again: asked once more, as at first.
    t.flaky.lock().host_refuses = false;
    e.open_segment("flaky").await.unwrap();
    t.flaky.lock().host_refuses = true;
    assert_eq!(call().await.0, 2);
}

/// Calls that find the probe of a peer's open breaker out wait for its
/// verdict instead of failing fast beside it: right after a restart,
/// eight calls at once (a handoff's writes, layer by layer) all reach the
/// peer once the first, the probe, found it serving (ci56: the others
/// failed "circuit breaker open" and the handoff with them); to a peer
/// still down they fail fast once the probe failed, having cost no
/// connect of their own. Virtual time.
#[tokio::test(start_paused = true)]
async fn calls_beside_a_probe_wait_for_its_verdict() {
    let (t, e) = flaky_down(fast_policy().retry.max_attempts).await;
    t.flaky.lock().delay = Duration::from_millis(5);
    let burst = |e: &Engine| {
        let calls: Vec<_> = (0..8)
            .map(|_| {
                let e = e.clone();
                tokio::spawn(async move { e.open_segment("flaky").await })
            })
            .collect();
        async move {
            let mut out = Vec::new();
            for c in calls {
                out.push(c.await.unwrap());
            }
            out
        }
    };
    // Still down, 450 ms on (the background prober last tried at 300 ms):
    // one call probes, the others wait for it and fail fast after.
    tokio::time::sleep(Duration::from_millis(450)).await;
    let before = t.flaky.lock().opens;
    let got = burst(&e).await;
    let refused = got.iter().filter(|r| r.as_ref().is_err_and(|e| e.kind() == ErrorKind::ConnectionRefused)).count();
    let fast = got.iter().filter(|r| r.as_ref().is_err_and(|e| e.kind() == ErrorKind::PeerUnavailable)).count();
    assert_eq!((refused, fast), (1, 7), "one probe, the rest failed fast after it: {got:?}");
    assert_eq!(t.flaky.lock().opens - before, 1, "the calls beside the probe made no connect of their own");
    // Back: a burst 200 ms later; all eight reach it.
    tokio::time::sleep(Duration::from_millis(100)).await;
    t.flaky.lock().refuse = false;
    let got = burst(&e).await;
    assert!(got.iter().all(Result::is_ok), "every call of the burst after the restart: {got:?}");
    assert_eq!(e.breaker_state("flaky"), BreakerState::Closed);
}

#[tokio::test]
async fn backpressure_try_fails_and_submit_waits_for_room() {
    let gate = Arc::new(Notify::new());
    let t = Scripted::gated(gate.clone());
    let mut p = fast_policy();
    p.backpressure.per_peer_inflight_requests = 1;
    let e = Engine::new(t.clone(), p).unwrap();
    let first = with_timeout(e.try_submit(reqs(1, 1))).await.unwrap();
    let err = with_timeout(e.try_submit(reqs(1, 1))).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Backpressure);
    assert!(err.is_transient());
    assert!(with_timeout(e.try_submit(reqs(2, 1))).await.is_ok(), "other peer has its own budget");
    let e2 = e.clone();
    let waiting = tokio::spawn(async move { e2.submit(reqs(1, 1)).await?.wait().await });
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert!(!waiting.is_finished(), "submit waits while the peer is full");
    gate.notify_waiters();
    assert!(with_timeout(first.wait()).await.unwrap().is_success());
    // The waiter's own batch is gated too; keep releasing until it is done.
    let out = with_timeout(async {
        loop {
            gate.notify_waiters();
            if waiting.is_finished() {
                break waiting.await.unwrap().unwrap();
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert!(out.is_success());
}

#[tokio::test]
async fn cancel_ends_cancelled_and_frees_budget() {
    let gate = Arc::new(Notify::new());
    let t = Scripted::gated(gate);
    let e = Engine::new(t.clone(), fast_policy()).unwrap();
    let tr = with_timeout(e.submit(reqs(1, 4))).await.unwrap();
    assert!(tr.poll().is_none());
    let out = with_timeout(tr.cancel()).await.unwrap();
    assert_eq!(out.state, BatchState::Cancelled);
    assert_eq!(e.inflight(), Usage::default());
    assert_eq!(e.active_transfers(), 0, "counted until the outcome is published, not after");
    assert_eq!(t.stats().batches, 0);
}

/// A waiter that finishes the transfer itself (its first attempt
/// completed) gives everything back as the driver would: budget, the
/// active count, the backend's batch.
#[tokio::test]
async fn a_waiter_finishes_a_completed_first_attempt_and_frees_everything() {
    let t = Scripted::new(|_, _| RequestStatus::Completed);
    let e = Engine::new(t.clone(), fast_policy()).unwrap();
    for _ in 0..3 {
        let out = with_timeout(e.transfer(reqs(1, 4))).await.unwrap();
        assert!(out.is_success());
        assert_eq!(out.attempts, 1);
        assert_eq!(e.inflight(), Usage::default());
        assert_eq!(e.active_transfers(), 0);
        assert_eq!(t.stats().batches, 0, "the batch was released");
    }
}

/// `progress` says whether the first attempt has ended without starting
/// the driver task (nothing releases the batch until the waiter finishes
/// the transfer), and says so only when it has.
#[tokio::test]
async fn progress_reports_the_first_attempt_without_starting_the_driver() {
    let t = Scripted::new(|_, _| RequestStatus::Completed);
    let e = Engine::new(t.clone(), fast_policy()).unwrap();
    let tr = with_timeout(e.submit(reqs(1, 4))).await.unwrap();
    assert!(tr.progress(), "the first attempt completed at submit");
    let probe = tr.probe();
    assert!(probe.completed(), "a probe sees the first attempt completed");
    // A driver task, had one started, would release the batch meanwhile.
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert_eq!(t.stats().batches, 1, "no driver released the batch");
    assert_eq!(e.active_transfers(), 1);
    let out = with_timeout(tr.wait()).await.unwrap();
    assert!(out.is_success());
    assert_eq!(out.attempts, 1);
    assert_eq!((t.stats().batches, e.active_transfers()), (0, 0));
    assert!(!probe.completed(), "the handle is gone: its owner knows");

    let t = Scripted::new(|_, _| failed(ErrorKind::AccessDenied));
    let e = Engine::new(t.clone(), fast_policy()).unwrap();
    let tr = with_timeout(e.submit(reqs(1, 2))).await.unwrap();
    assert!(tr.progress(), "the first attempt failed at submit: it ended");
    assert!(!tr.probe().completed(), "ended, but not completed");
    assert_eq!(with_timeout(tr.wait()).await.unwrap().state, BatchState::Failed);

    let gate = Arc::new(Notify::new());
    let t = Scripted::gated(gate.clone());
    let e = Engine::new(t.clone(), fast_policy()).unwrap();
    let tr = with_timeout(e.submit(reqs(1, 2))).await.unwrap();
    assert!(!tr.progress(), "gated: the first attempt is still running");
    assert!(!tr.probe().completed());
    let waiting = tokio::spawn(tr.wait());
    with_timeout(async {
        while !waiting.is_finished() {
            gate.notify_waiters();
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await;
    assert!(with_timeout(waiting).await.unwrap().unwrap().is_success());
}

/// `try_finish` finishes a first attempt that completed on the caller's
/// thread (batch released and budget given back before it returns, with
/// no driver task), hands one that did not to the driver, and returns the
/// driver's outcome once there is one; `finished` waits for that outcome
/// without taking the handle, so a wait with a limit can give up and wait
/// again.
#[tokio::test]
async fn try_finish_finishes_here_or_hands_over_and_finished_keeps_the_handle() {
    // Completed at submit: finished by the first call (this runtime runs
    // one thread, so a driver task could not have run before it returns).
    let t = Scripted::new(|_, _| RequestStatus::Completed);
    let e = Engine::new(t.clone(), fast_policy()).unwrap();
    let tr = with_timeout(e.submit(reqs(1, 4))).await.unwrap();
    let out = tr.try_finish().expect("the first attempt completed: finished here");
    assert!(out.is_success() && out.attempts == 1, "{out:?}");
    assert_eq!((t.stats().batches, e.active_transfers()), (0, 0), "released and given back already");
    assert_eq!(e.inflight(), Usage::default());
    assert!(tr.try_finish().is_none(), "finished by its caller: nothing more to say");
    drop(tr);

    // A transient failure: the driver retries; `finished` brings its outcome.
    let t = Scripted::new(reset_once_at_1001);
    let e = Engine::new(t.clone(), fast_policy()).unwrap();
    let tr = with_timeout(e.submit(reqs(1, 3))).await.unwrap();
    assert!(tr.try_finish().is_none(), "the first attempt failed: handed to the driver");
    let out = with_timeout(tr.finished()).await.expect("the driver's outcome");
    assert!(out.is_success() && out.attempts == 2, "{out:?}");
    assert_eq!(tr.try_finish().map(|o| o.attempts), Some(2));
    assert_eq!(t.submissions(1001), 2);

    // Running: a `finished` that gives up leaves the handle as it was.
    let gate = Arc::new(Notify::new());
    let t = Scripted::gated(gate.clone());
    let e = Engine::new(t.clone(), fast_policy()).unwrap();
    let tr = with_timeout(e.submit(reqs(1, 2))).await.unwrap();
    assert!(tr.try_finish().is_none(), "gated: still running");
    assert!(tokio::time::timeout(Duration::from_millis(30), tr.finished()).await.is_err());
    assert_eq!(e.active_transfers(), 1, "giving up on `finished` cancels nothing");
    let out = with_timeout(async {
        let f = tr.finished();
        tokio::pin!(f);
        loop {
            gate.notify_waiters();
            tokio::select! {
                o = &mut f => break o,
                _ = tokio::time::sleep(Duration::from_millis(2)) => {}
            }
        }
    })
    .await;
    assert!(out.is_some_and(|o| o.is_success()));
}

/// A wait dropped while the first attempt is in flight (no driver task
/// yet) cancels the transfer like a dropped handle: the driver starts,
/// cancels, and gives budget, count and batch back.
#[tokio::test]
async fn a_wait_dropped_mid_attempt_cancels_and_frees_everything() {
    let gate = Arc::new(Notify::new());
    let t = Scripted::gated(gate);
    let e = Engine::new(t.clone(), fast_policy()).unwrap();
    let tr = with_timeout(e.submit(reqs(1, 4))).await.unwrap();
    assert_eq!(e.active_transfers(), 1);
    assert!(tokio::time::timeout(Duration::from_millis(30), tr.wait()).await.is_err(), "gated: still running");
    let freed = with_timeout(async {
        while e.active_transfers() > 0 || t.stats().batches > 0 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    });
    freed.await;
    assert_eq!(e.inflight(), Usage::default());
}

/// Transfers submitted and never waited for still end on their own when
/// the budget is short: a submit that must wait for room starts them, so
/// the room comes back (no waiter needed, no deadlock).
#[tokio::test]
async fn unwaited_transfers_give_their_budget_back_to_a_waiting_submit() {
    let t = Scripted::new(|_, _| RequestStatus::Completed);
    let mut p = fast_policy();
    p.backpressure.per_peer_inflight_requests = 2;
    let e = Engine::new(t.clone(), p).unwrap();
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(with_timeout(e.submit(reqs(1, 1))).await.unwrap());
    }
    // The peer's budget is full of completed, unwaited transfers.
    let third = with_timeout(e.submit(reqs(1, 1))).await.unwrap();
    assert!(with_timeout(third.wait()).await.unwrap().is_success());
    for h in held {
        let o = with_timeout(h.wait()).await.unwrap();
        assert!(o.is_success(), "finished by its driver, seen by a later wait");
    }
    assert_eq!(e.inflight(), Usage::default());
    assert_eq!(e.active_transfers(), 0);
}

/// Rule 11 through the engine: a notification a busy peer refused (its
/// inbox full, nothing queued) is offered again until it is taken, within
/// `backpressure.notify_patience`; then the busy answer is the caller's.
/// Any other error is returned at once: a notification is never offered
/// twice after an answer that may have queued it.
#[tokio::test]
async fn a_notification_to_a_busy_peer_is_offered_again_within_the_patience() {
    let t = Scripted::new(|_, _| RequestStatus::Completed);
    *t.notes.lock() = Notes { busy: 3, then: None, offered: 0 };
    let e = Engine::new(t.clone(), fast_policy()).unwrap();
    with_timeout(e.notify(SegmentId(1), b"kv ready".to_vec())).await.unwrap();
    assert_eq!(t.notes.lock().offered, 4, "three busy answers, then taken");

    let mut p = fast_policy();
    p.backpressure.notify_patience = Duration::from_millis(30);
    let e = Engine::new(t.clone(), p).unwrap();
    *t.notes.lock() = Notes { busy: u32::MAX, then: None, offered: 0 };
    let started = std::time::Instant::now();
    let err = with_timeout(e.notify(SegmentId(1), b"x".to_vec())).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Backpressure);
    assert!(started.elapsed() < Duration::from_secs(2), "gave up near its patience");
    let offered = t.notes.lock().offered;
    assert!((2..=10).contains(&offered), "offered {offered} times in 30 ms of doubling pauses");

    *t.notes.lock() = Notes { busy: 0, then: Some(ErrorKind::ConnectionReset), offered: 0 };
    let err = with_timeout(e.notify(SegmentId(1), b"x".to_vec())).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ConnectionReset);
    assert_eq!(t.notes.lock().offered, 1, "not offered again after an answer that may have queued it");
}
