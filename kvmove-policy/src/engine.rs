//! The policy layer users call: retry, deadlines, circuit breaker and
//! backpressure over any [`Transport`].

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use rand::rngs::SmallRng;
use rand::SeedableRng;
use tokio::sync::watch;
use transport_mem::{Buffer, MemoryRegion};

use super::backoff::backoff;
use super::breaker::{Admit, Breaker, BreakerState};
use super::budget::{Budget, Charge, Reservation, Usage};
use super::config::PolicyConfig;
use super::metrics::{EngineMetrics, Stage};
use super::retry::{verdicts, PeerVerdict, Retry, TransferOutcome};
use transport_core::Transport;
use transport_core::{Access, BatchId, BatchState, RegionId, RequestStatus, SegmentId, SubmitOptions, TransferRequest};
use transport_core::{Capabilities, Notification, ResourceStats, SegmentDescriptor};
use transport_core::{Clock, SystemClock};
use transport_core::{Error, ErrorKind, Result};

mod prober;
mod transfer;

/// [`Engine::notify`]'s first pause after a busy answer, and its longest.
const NOTIFY_FIRST_PAUSE: Duration = Duration::from_millis(1);
const NOTIFY_MAX_PAUSE: Duration = Duration::from_millis(50);

/// Calls `offer` until it succeeds, fails with an error `again` does not
/// take, or the next try would come `patience` after the first; between
/// tries it pauses `pauses.0`, twice as long each time, at most
/// `pauses.1`. What offering a notification again means, for
/// [`Engine::notify`] and [`crate::Sessions::notify_repeatable`].
pub(crate) async fn offer_within<F, Fut>(
    clock: &dyn Clock,
    patience: Duration,
    pauses: (Duration, Duration),
    again: impl Fn(&Error) -> bool,
    mut offer: F,
) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    let started = clock.now();
    let mut pause = pauses.0;
    loop {
        match offer().await {
            Err(e) if again(&e) && clock.now().saturating_sub(started).saturating_add(pause) < patience => {
                clock.sleep(pause).await;
                pause = (pause * 2).min(pauses.1);
            }
            r => return r,
        }
    }
}

use transfer::{Driver, Lazy, Mode};
pub use transfer::{Probe, Transfer};

/// The user-facing engine: one backend plus the shared policy.
///
/// - **Retry**: requests that fail with a transient error (or time out) are
///   resubmitted, alone, after an exponential backoff with jitter, up to
///   `retry.max_attempts` attempts. Completed requests are never resent;
///   permanent errors are never retried.
/// - **Deadlines**: each attempt gets `deadline.base + deadline.per_mib x MiB`,
///   enforced by the backend (which keeps "terminal means quiet").
/// - **Circuit breaker** per peer (segment name): after
///   `breaker.failure_threshold` consecutive failed attempts, work to the
///   peer fails fast with `PeerUnavailable`; after `breaker.cooldown` one
///   probe (the next open or transfer) goes through and closes the breaker
///   if it succeeds. Before that, one call goes through as the probe (one
///   connect) when the peer was last tried `breaker.probe_interval` ago or
///   more (default 100 ms; `breaker.refused_probe_interval`, 1 ms, when
///   its host refused that try: nothing listens there, and a refused
///   connect costs no timeout), so the first call after a peer restarted
///   succeeds, and a dead peer costs one call's attempt per interval; its
///   failure leaves the cool-down as it was. Meanwhile a background
///   prober asks the peer
///   ([`Engine::probe`]) 20 ms after the breaker opened, then at doubling
///   intervals up to a quarter of the cool-down, at most 1 s (at most
///   `PROBER_TRIES` times), and
///   closes the breaker as soon as the peer answers: work to a peer that
///   came back flows again within about one probe interval, not one
///   cool-down.
/// - **Backpressure**: bytes and requests in flight are bounded per peer and
///   in total. [`Engine::try_submit`] fails with a transient `Backpressure`
///   error when full; [`Engine::submit`] waits for room.
/// - **Metrics** (through the `metrics` facade; a no-op until the program
///   installs a recorder, e.g. `kvmove target --metrics ADDR`):
///   `kvmove_bytes_total{op,peer}` (bytes of completed requests),
///   `kvmove_requests_total{op,peer,state}`, `kvmove_transfers_total{state}`,
///   `kvmove_retries_total`, `kvmove_errors_total{kind}`,
///   `kvmove_breaker_transitions_total{peer,to}`, `kvmove_breaker_open{peer}`,
///   `kvmove_inflight_bytes`, `kvmove_inflight_requests`, and the histograms
///   `kvmove_transfer_seconds{state}` (start to outcome) and
///   `kvmove_stage_seconds{stage}`: `budget` (queued for the in-flight
///   budget), `submit` (handing a batch to the backend), `complete` (on the
///   wire until every request is terminal). [`crate::Sessions`] adds
///   `kvmove_sessions_total{role,state}` (each session once, when final),
///   `kvmove_session_landed_seconds{role}`, `kvmove_session_grant_wait_seconds`
///   and `kvmove_notifications_total{dir}`, runs each sender's write in a
///   span `session{peer, id, role}` (the transfer spans nest in it) and
///   logs each session's end. Each transfer runs in a
///   tracing span `transfer{id, peers, requests}`; its end is logged there
///   (debug when it completed, warn with the first error otherwise). Peer
///   labels are bounded ([`crate::MAX_PEER_LABELS`]; the
///   rest are `peer="other"`).
///
/// Cheap to clone; clones share state.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

struct Inner {
    transport: Arc<dyn Transport>,
    cfg: PolicyConfig,
    clock: Arc<dyn Clock>,
    breakers: Mutex<HashMap<String, Breaker>>,
    budget: Arc<Budget>,
    active: AtomicUsize,
    rng: Mutex<SmallRng>,
    /// Peers with a background prober running (one each; counted).
    probers: Mutex<HashSet<String>>,
    /// Metric handles (peer labels bounded).
    metrics: EngineMetrics,
    /// The next transfer's id (its tracing span's `id`).
    next_transfer: AtomicU64,
    /// Transfers whose driver task is not started (see [`Transfer`]):
    /// started when the budget is short, since what they hold is given
    /// back only once someone finishes them.
    unstarted: Mutex<Vec<std::sync::Weak<parking_lot::Mutex<Mode>>>>,
    /// Signalled whenever a breaker learns a verdict (a probe's included),
    /// for calls waiting on a probe in flight ([`Inner::admit_waiting`]).
    verdicts: tokio::sync::Notify,
}

impl fmt::Debug for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Engine")
            .field("backend", &self.inner.transport.backend())
            .field("active_transfers", &self.active_transfers())
            .finish()
    }
}

impl Engine {
    /// An engine over `transport` with the real clock.
    pub fn new(transport: Arc<dyn Transport>, cfg: PolicyConfig) -> Result<Self> {
        Self::with_clock(transport, cfg, Arc::new(SystemClock::new()))
    }

    /// An engine with a given clock (a [`transport_core::ManualClock`] in tests).
    pub fn with_clock(transport: Arc<dyn Transport>, cfg: PolicyConfig, clock: Arc<dyn Clock>) -> Result<Self> {
        cfg.validate()?;
        let budget = Budget::new(cfg.backpressure.clone());
        Ok(Self {
            inner: Arc::new(Inner {
                transport,
                cfg,
                clock,
                breakers: Mutex::new(HashMap::new()),
                budget,
                active: AtomicUsize::new(0),
                rng: Mutex::new(SmallRng::from_entropy()),
                probers: Mutex::new(HashSet::new()),
                metrics: EngineMetrics::default(),
                next_transfer: AtomicU64::new(1),
                unstarted: Mutex::new(Vec::new()),
                verdicts: tokio::sync::Notify::new(),
            }),
        })
    }

    /// Starts the session engine (rules 12 and 13: receiver-granted
    /// handoffs with one final state on both sides) over this engine; see
    /// [`crate::Sessions`]. It takes over the transport's notification
    /// inbox. Start one per engine.
    pub fn sessions(&self, limits: crate::session::SessionLimits) -> Result<crate::Sessions> {
        crate::Sessions::start(self.clone(), limits)
    }

    /// The clock the engine runs on.
    pub fn clock(&self) -> Arc<dyn Clock> {
        self.inner.clock.clone()
    }

    /// The backend underneath: for this crate's session driver only. A
    /// program goes through the engine's own methods (one door: every call
    /// meets the policy).
    pub(crate) fn transport(&self) -> &Arc<dyn Transport> {
        &self.inner.transport
    }

    /// The backend's name (`tcp`, `rdma`, `mock`, ...).
    pub fn backend(&self) -> &str {
        self.inner.transport.backend()
    }

    /// What the backend can do (see [`Transport::capabilities`]).
    pub fn capabilities(&self) -> Capabilities {
        self.inner.transport.capabilities()
    }

    /// The name peers open this engine by (`host:port` for TCP and RDMA).
    pub fn local_segment_name(&self) -> String {
        self.inner.transport.local_segment_name()
    }

    /// This engine's own descriptor, as peers get it (see
    /// [`Transport::local_descriptor`]).
    pub fn local_descriptor(&self) -> Result<SegmentDescriptor> {
        self.inner.transport.local_descriptor()
    }

    /// The descriptor an open segment was opened with (see
    /// [`Transport::segment_descriptor`]).
    pub fn segment_descriptor(&self, segment: SegmentId) -> Result<SegmentDescriptor> {
        self.inner.transport.segment_descriptor(segment)
    }

    /// The backend's resource counts (rule 1: they return to zero).
    pub fn stats(&self) -> ResourceStats {
        self.inner.transport.stats()
    }

    /// Takes up to `max` received notifications (rule 11; see
    /// [`Transport::take_notifications`]). Not for an engine whose
    /// [`Engine::sessions`] run: those take the inbox and hand plain
    /// notifications out themselves ([`crate::Sessions::take_notifications`]).
    pub fn take_notifications(&self, max: usize) -> Result<Vec<Notification>> {
        self.inner.transport.take_notifications(max)
    }

    /// Waits until a notification may be waiting (see
    /// [`Transport::wait_notification`]).
    pub async fn wait_notification(&self) -> Result<()> {
        self.inner.transport.wait_notification().await
    }

    /// The policy in force.
    pub fn config(&self) -> &PolicyConfig {
        &self.inner.cfg
    }

    /// Registers memory (see [`Transport::register`]).
    pub fn register(&self, mem: MemoryRegion, access: Access) -> Result<RegionId> {
        self.inner.transport.register(mem, access)
    }

    /// Unregisters memory (see [`Transport::unregister`]).
    pub async fn unregister(&self, region: RegionId) -> Result<()> {
        self.inner.transport.unregister(region).await
    }

    /// Opens a peer's segment, through its breaker: fails fast with
    /// `PeerUnavailable` while the breaker is open; a failure to reach the
    /// peer counts toward it, success closes it.
    ///
    /// A peer that refuses or resets the connection at once (`Busy` at its
    /// connection limit, a listener not up yet, a handshake slot taken by a
    /// flood) is asked again (rule 8: transient failures are retried), with
    /// the retry policy's backoff, up to `retry.max_attempts` tries and
    /// within `deadline.base` (a refusal by the peer's host, nothing
    /// listening there, only once more, for a listener about to come up,
    /// and not at all when the host refused the peer's last try as well:
    /// [`Error::nothing_listens`]; a transfer's is not retried); the
    /// one call counts once toward the breaker.
    /// The error of the last try says how many were made, over how long.
    /// A failure that took its time (a handshake that timed out) is not
    /// retried here: the caller already waited for it.
    ///
    /// The probe of an open breaker (after the cool-down, or a call's
    /// probe once per `breaker.probe_interval`) is one connect when nobody
    /// answers (refused: the peer is still down, and a dead peer costs
    /// one attempt per interval), but a connection the peer reset in its
    /// handshake is asked again like any other: something listens there,
    /// so the peer is back (a server restarted at the same address, still
    /// starting up under load, closed the first handshake; the call
    /// failed though the peer was serving, ci48).
    pub async fn open_segment(&self, name: &str) -> Result<SegmentId> {
        let admit = self.inner.admit_waiting(name).await?;
        let started = self.inner.clock.now();
        let budget = self.inner.cfg.deadline.base;
        let mut attempt = 1u32;
        let result = loop {
            let result = self.inner.transport.open_segment(name).await;
            let again = match &result {
                Err(e) => {
                    let answered = match e.kind() {
                        ErrorKind::ConnectionReset => true,
                        // Its host said nothing listens: asked once more
                        // (a listener about to come up), not every attempt,
                        // and not when its host refused the peer's last try
                        // too (that try was the chance to come up: a call
                        // to a dead address fails at its first refusal).
                        ErrorKind::ConnectionRefused if e.nothing_listens() => {
                            admit != Admit::Probe && attempt == 1 && !self.inner.last_refused(name)
                        }
                        ErrorKind::ConnectionRefused => admit != Admit::Probe,
                        _ => false,
                    };
                    answered && attempt < self.inner.cfg.retry.max_attempts
                }
                Ok(_) => false,
            };
            if !again {
                break result;
            }
            let pause = {
                let mut rng = self.inner.rng.lock();
                backoff(&self.inner.cfg.retry, attempt, &mut *rng)
            };
            if self.inner.clock.now().saturating_sub(started).saturating_add(pause) > budget {
                break result;
            }
            self.inner.clock.sleep(pause).await;
            attempt += 1;
        };
        match &result {
            Ok(_) => self.inner.record(name, PeerVerdict::Healthy),
            Err(e) if e.kind().is_peer_failure() => self.inner.record(name, PeerVerdict::failed(e)),
            Err(_) if admit == Admit::Probe => self.inner.record(name, PeerVerdict::Unknown),
            Err(_) => {}
        }
        let took = self.inner.clock.now().saturating_sub(started);
        result.map_err(|e| {
            let e = if e.context_value("peer").is_some() { e } else { e.with("peer", name) };
            if attempt > 1 {
                e.with("attempts", attempt).with("over_ms", took.as_millis())
            } else {
                e
            }
        })
    }

    /// Closes a segment (see [`Transport::close_segment`]).
    pub async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        self.inner.transport.close_segment(segment).await
    }

    /// Sends notification `msg` to the peer of `segment` (rule 11; see
    /// [`Transport::notify`]). A peer whose inbox is full answers
    /// `Backpressure` and queues nothing, so the notification is offered
    /// again, after 1 ms and then twice as long each time (at most 50 ms),
    /// for up to `backpressure.notify_patience`; then, or on any other
    /// error, the error is returned (a notification is never sent twice).
    pub async fn notify(&self, segment: SegmentId, msg: Vec<u8>) -> Result<()> {
        let patience = self.inner.cfg.backpressure.notify_patience;
        let busy = |e: &Error| e.kind() == ErrorKind::Backpressure;
        let pauses = (NOTIFY_FIRST_PAUSE, NOTIFY_MAX_PAUSE);
        offer_within(&*self.inner.clock, patience, pauses, busy, || self.inner.transport.notify(segment, msg.clone()))
            .await
    }

    /// Asks the peer `name` whether it is there: opens its segment and
    /// reads one byte of the first region it exposes (a real round trip
    /// on every backend; the peer refusing the read as out of bounds,
    /// denied or unregistered also proves it alive), then closes the
    /// handle. Not held back by an open
    /// breaker: this is how a breaker learns that its peer came back.
    /// `Ok` closes the peer's breaker. A failure that says the peer is
    /// unreachable counts toward the breaker only while it is closed (a
    /// failed probe of an open breaker does not extend its cool-down).
    pub async fn probe(&self, name: &str) -> Result<()> {
        self.inner.probe(name).await
    }

    /// Background probers running (one per peer whose breaker opened
    /// recently; rule 1: counted). Each ends when its peer's breaker
    /// closes, after `PROBER_TRIES` probes, or at shutdown.
    pub fn active_probers(&self) -> usize {
        self.inner.probers.lock().len()
    }

    /// The breaker state of a peer (closed for peers never seen).
    pub fn breaker_state(&self, peer: &str) -> BreakerState {
        let now = self.inner.clock.now();
        self.inner.breakers.lock().get(peer).map_or(BreakerState::Closed, |b| b.state(now))
    }

    /// Bytes and requests in flight through this engine.
    pub fn inflight(&self) -> Usage {
        self.inner.budget.used()
    }

    /// Transfers whose driver task is still running (rule 1: counted).
    pub fn active_transfers(&self) -> usize {
        self.inner.active.load(Ordering::Acquire)
    }

    /// Starts a transfer if the in-flight budget has room now; otherwise a
    /// transient `Backpressure` error and nothing is started.
    pub async fn try_submit(&self, requests: Vec<TransferRequest>) -> Result<Transfer> {
        let plan = self.inner.plan(&requests)?;
        let reservation = match self.inner.budget.try_reserve(plan.charge.clone()) {
            Ok(r) => r,
            Err(e) => {
                // What unstarted transfers hold comes back once they run.
                self.inner.start_unstarted();
                return Err(e);
            }
        };
        self.start(requests, plan, reservation).await
    }

    /// Starts a transfer, waiting for room in the in-flight budget first.
    pub async fn submit(&self, requests: Vec<TransferRequest>) -> Result<Transfer> {
        let plan = self.inner.plan(&requests)?;
        let queued = std::time::Instant::now();
        let reservation = match self.inner.budget.try_reserve(plan.charge.clone()) {
            Ok(r) => r,
            Err(_) => {
                // What unstarted transfers hold comes back once they run.
                self.inner.start_unstarted();
                self.inner.budget.reserve(plan.charge.clone()).await
            }
        };
        self.inner.metrics.stage(Stage::Budget, queued.elapsed());
        self.start(requests, plan, reservation).await
    }

    /// Submits and waits; the outcome says per request what happened.
    pub async fn transfer(&self, requests: Vec<TransferRequest>) -> Result<TransferOutcome> {
        self.submit(requests).await?.wait().await
    }

    /// Shuts the backend down (see [`Transport::shutdown`]); running
    /// transfers end failed or cancelled.
    pub async fn shutdown(&self) -> Result<()> {
        self.inner.transport.shutdown().await
    }

    async fn start(&self, requests: Vec<TransferRequest>, plan: Plan, reservation: Reservation) -> Result<Transfer> {
        let handle = tokio::runtime::Handle::try_current()
            .map_err(|_| Error::new(ErrorKind::Internal, "Engine must be used inside a tokio runtime"))?;
        let inner = &self.inner;
        // Breakers are checked after the budget wait, so a long wait cannot
        // let work through to a peer that failed meanwhile.
        for peer in &plan.peers {
            if let Err(e) = inner.admit_waiting(peer).await {
                inner.abandon_probes(&plan.peers);
                return Err(e);
            }
        }
        let submitting = std::time::Instant::now();
        let first = inner.transport.submit(requests.clone(), inner.options(&requests)).await;
        inner.metrics.stage(Stage::Submit, submitting.elapsed());
        if let Err(e) = &first {
            if !e.is_transient() {
                inner.abandon_probes(&plan.peers);
                return Err(e.clone());
            }
        }
        let (cancel_tx, cancel_rx) = watch::channel(false);
        inner.active.fetch_add(1, Ordering::AcqRel);
        let active = ActiveGuard(inner.clone());
        let driver = Driver {
            inner: inner.clone(),
            requests,
            peer_of: plan.peer_of,
            peers: plan.peers,
            cancel: cancel_rx,
            started: std::time::Instant::now(),
        };
        let used = inner.budget.used();
        inner.metrics.inflight(used.bytes, used.requests);
        let id = inner.next_transfer.fetch_add(1, Ordering::Relaxed);
        let span = tracing::info_span!("transfer", id, peers = ?driver.peers, requests = driver.requests.len());
        let lazy = Lazy { driver, first, reservation, active, cancel: cancel_tx, span, handle };
        let mode = Arc::new(parking_lot::Mutex::new(Mode::Unstarted(Box::new(lazy))));
        inner.remember_unstarted(&mode);
        Ok(Transfer { mode })
    }
}

struct ActiveGuard(Arc<Inner>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Per-transfer facts computed once at submit.
struct Plan {
    peers: Vec<String>,
    peer_of: Vec<usize>,
    charge: Charge,
}

impl Inner {
    /// Registers a transfer whose driver is not started yet.
    fn remember_unstarted(&self, mode: &Arc<parking_lot::Mutex<Mode>>) {
        let mut list = self.unstarted.lock();
        // Finished and dropped handles leave dead entries: pruned whenever
        // the list doubled since the last pruning, so it stays within twice
        // the handles alive.
        if list.len() >= 64 && list.len().is_power_of_two() {
            list.retain(|w| w.strong_count() > 0);
        }
        list.push(Arc::downgrade(mode));
    }

    /// Starts the driver task of every transfer that has none (its waiter,
    /// if any, keeps waiting for the outcome).
    fn start_unstarted(&self) {
        let list = std::mem::take(&mut *self.unstarted.lock());
        for w in list {
            let Some(mode) = w.upgrade() else { continue };
            let mut m = mode.lock();
            if let Some(lazy) = m.take_unstarted() {
                *m = lazy.start(false);
            }
        }
    }

    fn plan(&self, requests: &[TransferRequest]) -> Result<Plan> {
        let mut by_segment: HashMap<SegmentId, usize> = HashMap::new();
        let mut peers: Vec<String> = Vec::new();
        let mut peer_of = Vec::with_capacity(requests.len());
        let mut charge = Charge::default();
        for (i, r) in requests.iter().enumerate() {
            let p = match by_segment.get(&r.segment) {
                Some(&p) => p,
                None => {
                    let name = self.transport.segment_descriptor(r.segment).map_err(|e| e.with("request", i))?.name;
                    let p = match peers.iter().position(|n| *n == name) {
                        Some(p) => p,
                        None => {
                            peers.push(name);
                            peers.len() - 1
                        }
                    };
                    by_segment.insert(r.segment, p);
                    p
                }
            };
            peer_of.push(p);
            charge.add(&peers[p], r.len);
        }
        Ok(Plan { peers, peer_of, charge })
    }

    fn options(&self, requests: &[TransferRequest]) -> SubmitOptions {
        let bytes = requests.iter().map(|r| r.len).fold(0u64, u64::saturating_add);
        SubmitOptions::with_timeout(self.cfg.deadline.for_bytes(bytes))
    }

    /// Whether work may go to `peer` now; with the refusal, whether it
    /// is only because the peer's probe is out (its verdict not in yet).
    fn admit(&self, peer: &str) -> std::result::Result<Admit, (Error, bool)> {
        let now = self.clock.now();
        let mut breakers = self.breakers.lock();
        let b = breakers.entry(peer.to_owned()).or_default();
        match b.admit(now, &self.cfg.breaker) {
            Admit::No { retry_after } => Err((
                Error::new(
                    ErrorKind::PeerUnavailable,
                    "peer failed repeatedly; its circuit breaker is open and fails fast until a probe succeeds",
                )
                .with("peer", peer)
                .with("retry_after_ms", retry_after.as_millis()),
                b.probing(),
            )),
            a => Ok(a),
        }
    }

    /// As [`Inner::admit`], except that a call finding the peer's probe
    /// out waits for its verdict (at most `deadline.base`) and asks again:
    /// several calls to a peer that came back (a handoff's writes, layer
    /// by layer, right after a restart) all go once the first one, the
    /// probe, found it serving, instead of failing fast beside it. A
    /// probe that fails leaves the breaker open and they fail fast then.
    async fn admit_waiting(&self, peer: &str) -> Result<Admit> {
        // The common answer without touching the notifier (every submit
        // passes here).
        match self.admit(peer) {
            Ok(a) => return Ok(a),
            Err((e, false)) => return Err(e),
            Err((_, true)) => {}
        }
        let started = self.clock.now();
        let limit = self.cfg.deadline.base;
        loop {
            // Registered before the breaker is read, so no verdict between
            // the two is missed.
            let verdict = self.verdicts.notified();
            tokio::pin!(verdict);
            verdict.as_mut().enable();
            match self.admit(peer) {
                Ok(a) => return Ok(a),
                Err((e, false)) => return Err(e),
                Err((e, true)) => {
                    let waited = self.clock.now().saturating_sub(started);
                    let Some(left) = limit.checked_sub(waited).filter(|l| !l.is_zero()) else {
                        return Err(e.with("waited_for_probe_ms", waited.as_millis()));
                    };
                    tokio::select! {
                        () = &mut verdict => {}
                        () = self.clock.sleep(left) => {}
                    }
                }
            }
        }
    }

    fn record(self: &Arc<Self>, peer: &str, verdict: PeerVerdict) {
        let now = self.clock.now();
        let (before, after, probed) = {
            let mut breakers = self.breakers.lock();
            let b = breakers.entry(peer.to_owned()).or_default();
            let (before, probed) = (b.state(now), b.probing());
            match verdict {
                PeerVerdict::Healthy => b.on_success(),
                PeerVerdict::Failed => b.on_failure(now, &self.cfg.breaker, false),
                PeerVerdict::Refused => b.on_failure(now, &self.cfg.breaker, true),
                PeerVerdict::Unknown => b.on_abandoned_probe(now),
            }
            (before, b.state(now), probed)
        };
        // Calls wait only on a probe out (`admit_waiting`): its verdict is
        // what they wait for.
        if probed {
            self.verdicts.notify_waiters();
        }
        self.metrics.breaker(peer, before, after);
        // (A call's probe that failed leaves it open: no transition, and
        // the prober started when it opened.)
        let opened = before != BreakerState::Open && after == BreakerState::Open;
        if opened {
            self.start_prober(peer);
        }
    }

    /// Whether the last try of `peer` was refused by its host (nothing
    /// listened there), as its breaker recorded it.
    fn last_refused(&self, peer: &str) -> bool {
        self.breakers.lock().get(peer).is_some_and(Breaker::refused)
    }

    /// Whether `peer`'s breaker is closed now (peers never seen: yes).
    fn breaker_closed(&self, peer: &str) -> bool {
        let now = self.clock.now();
        self.breakers.lock().get(peer).is_none_or(|b| b.state(now) == BreakerState::Closed)
    }
}
