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
use transport_core::Transport;
use transport_core::{Access, BatchId, BatchState, RegionId, RequestStatus, SegmentId, SubmitOptions, TransferRequest};
use transport_core::{Clock, SystemClock};
use transport_core::{Error, ErrorKind, Result};

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
///   if it succeeds. Meanwhile a background prober asks the peer
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
}

/// The background prober's first wait after a breaker opens.
const PROBER_FIRST: Duration = Duration::from_millis(20);
/// Probes a background prober makes before it leaves the breaker to its
/// cool-down (about 20 s at the default 2 s cool-down).
const PROBER_TRIES: u32 = 40;
/// The longest wait between a background prober's probes.
const PROBER_MAX_WAIT: Duration = Duration::from_secs(1);

/// The prober's longest wait for a breaker with `cooldown`: a quarter of
/// it, at most [`PROBER_MAX_WAIT`], so a peer that comes back is found
/// within a fraction of the cool-down however long it was away.
fn prober_cap(cooldown: Duration) -> Duration {
    (cooldown / 4).clamp(PROBER_FIRST, PROBER_MAX_WAIT)
}
/// Longest a probe's read may take.
const PROBE_READ_TIMEOUT: Duration = Duration::from_secs(2);

impl fmt::Debug for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Engine")
            .field("backend", &self.inner.transport.backend())
            .field("active_transfers", &self.active_transfers())
            .finish()
    }
}

/// The final report of a transfer.
#[derive(Debug, Clone)]
pub struct TransferOutcome {
    /// The overall state, derived from `requests` as for a batch.
    pub state: BatchState,
    /// One final status per submitted request, in submission order.
    pub requests: Vec<RequestStatus>,
    /// Backend submissions made (1 when nothing was retried).
    pub attempts: u32,
}

impl TransferOutcome {
    /// Whether every request completed.
    pub fn is_success(&self) -> bool {
        self.state == BatchState::Completed
    }

    /// The first request error, if any failed.
    pub fn first_error(&self) -> Option<&Error> {
        self.requests.iter().find_map(RequestStatus::error)
    }

    /// `Ok(self)` when every request completed, else the most useful error:
    /// the first failure, or a `Timeout` / `Cancelled` error.
    pub fn into_result(self) -> Result<Self> {
        match self.state {
            BatchState::Completed => Ok(self),
            BatchState::Failed => Err(self
                .first_error()
                .cloned()
                .unwrap_or_else(|| Error::new(ErrorKind::Internal, "failed transfer without an error"))),
            BatchState::TimedOut => Err(Error::new(ErrorKind::Timeout, "transfer deadline passed")
                .with("attempts", self.attempts)
                .with("completed", self.requests.iter().filter(|r| r.is_completed()).count())),
            BatchState::Cancelled => Err(Error::new(ErrorKind::Cancelled, "transfer was cancelled")),
            BatchState::InProgress => Err(Error::new(ErrorKind::Internal, "outcome reported while in progress")),
        }
    }
}

/// A transfer in flight. Its requests are driven (waited for, retried)
/// by a background task; this handle observes and controls it. Until that
/// task is needed, [`Transfer::wait`] waits for the first attempt itself:
/// a transfer whose first attempt completes is finished by its waiter
/// with no task and no hand-off (the common case, and most of a small
/// transfer's cost otherwise). Anything else (a failed request to retry,
/// a cancel, [`Transfer::poll`], a dropped handle or wait) starts the task,
/// which takes over where the waiter stopped.
///
/// Dropping the handle cancels the transfer: memory a dropped transfer used
/// is quiet once [`Engine::active_transfers`] no longer counts it.
#[derive(Debug)]
pub struct Transfer {
    mode: Arc<parking_lot::Mutex<Mode>>,
}

#[derive(Debug)]
enum Mode {
    /// The first attempt is in flight and no task drives it yet.
    Unstarted(Box<Lazy>),
    /// The driver task runs (or ran); its outcome comes here.
    Driven { outcome: watch::Receiver<Option<TransferOutcome>>, cancel: watch::Sender<bool> },
    /// Finished by its waiter.
    Done,
}

impl Mode {
    /// Takes the unstarted first attempt out (leaving `Done` in its place
    /// until the caller puts what it makes of it back); `None`, and nothing
    /// changed, in any other mode.
    fn take_unstarted(&mut self) -> Option<Box<Lazy>> {
        if !matches!(self, Mode::Unstarted(_)) {
            return None;
        }
        match std::mem::replace(self, Mode::Done) {
            Mode::Unstarted(lazy) => Some(lazy),
            _ => None,
        }
    }
}

/// Everything the driver task needs, before it is started.
struct Lazy {
    driver: Driver,
    first: Result<BatchId>,
    reservation: Reservation,
    active: ActiveGuard,
    cancel: watch::Sender<bool>,
    span: tracing::Span,
    handle: tokio::runtime::Handle,
}

impl fmt::Debug for Lazy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lazy").field("first", &self.first).finish_non_exhaustive()
    }
}

impl Lazy {
    /// Starts the driver task (cancelled at once if `cancel`).
    fn start(self, cancel: bool) -> Mode {
        let Lazy { driver, first, reservation, active, cancel: cancel_tx, span, handle } = self;
        if cancel {
            let _ = cancel_tx.send(true);
        }
        let (out_tx, out_rx) = watch::channel(None);
        handle.spawn(tracing::Instrument::instrument(
            async move {
                let inner = driver.inner.clone();
                let outcome = driver.run(first).await;
                log_outcome(&outcome);
                // Budget and the task count are given back before the outcome
                // is published, so a caller who saw the outcome sees them freed.
                give_back(&inner, reservation, active);
                let _ = out_tx.send(Some(outcome));
            },
            span,
        ));
        Mode::Driven { outcome: out_rx, cancel: cancel_tx }
    }

    /// Waits for the first attempt's batch (cancel-safe: nothing changes
    /// until it returns). `true` if every request completed: the transfer
    /// is then finished by [`Lazy::finish`].
    async fn first_completed(&self) -> bool {
        let Ok(batch) = &self.first else { return false };
        let waiting = std::time::Instant::now();
        let done = match self.driver.inner.transport.wait(*batch).await {
            Ok(s) => s.state == BatchState::Completed && s.requests.len() == self.driver.requests.len(),
            Err(_) => false,
        };
        // Otherwise the driver takes over and records it.
        if done {
            self.driver.inner.metrics.stage(Stage::Complete, waiting.elapsed());
        }
        done
    }

    /// Finishes a transfer whose first attempt completed every request:
    /// what the driver would do, without it.
    fn finish(self) -> TransferOutcome {
        let Lazy { driver, first, reservation, active, span, .. } = self;
        let inner = &driver.inner;
        if let Ok(batch) = first {
            if let Err(e) = inner.transport.release(batch) {
                tracing::debug!(%batch, error = %e, "release after terminal status failed");
            }
        }
        let n = driver.requests.len();
        let status = vec![RequestStatus::Completed; n];
        let all: Vec<usize> = (0..n).collect();
        driver.judge_peers(&all, &status);
        inner.metrics.transfer_done(
            &driver.requests,
            &driver.peer_of,
            &driver.peers,
            &status,
            BatchState::Completed,
            1,
            driver.started.elapsed(),
        );
        let outcome = TransferOutcome { state: BatchState::Completed, requests: status, attempts: 1 };
        span.in_scope(|| log_outcome(&outcome));
        give_back(inner, reservation, active);
        outcome
    }
}

/// Gives a finished transfer's budget and its place in the active count
/// back, and updates the in-flight gauges.
fn give_back(inner: &Inner, reservation: Reservation, active: ActiveGuard) {
    drop(reservation);
    drop(active);
    let used = inner.budget.used();
    inner.metrics.inflight(used.bytes, used.requests);
}

fn log_outcome(outcome: &TransferOutcome) {
    match outcome.first_error() {
        None if outcome.is_success() => {
            tracing::debug!(state = ?outcome.state, attempts = outcome.attempts, "transfer ended")
        }
        e => tracing::warn!(
            state = ?outcome.state,
            attempts = outcome.attempts,
            error = e.map(ToString::to_string),
            "transfer ended"
        ),
    }
}

impl Transfer {
    /// The driver task's outcome channel and cancel switch, the task
    /// started first if it was not (cancelled at once if `cancel`). `None`
    /// once finished by a waiter (the handle was consumed then).
    fn driven(&self, cancel: bool) -> Option<(watch::Receiver<Option<TransferOutcome>>, watch::Sender<bool>)> {
        let mut mode = self.mode.lock();
        if let Some(lazy) = mode.take_unstarted() {
            *mode = lazy.start(cancel);
        }
        match &*mode {
            Mode::Driven { outcome, cancel: c } => {
                if cancel {
                    let _ = c.send(true);
                }
                Some((outcome.clone(), c.clone()))
            }
            _ => None,
        }
    }

    /// The outcome if the transfer has finished; never blocks. (Polling
    /// hands the transfer to its driver task.)
    pub fn poll(&self) -> Option<TransferOutcome> {
        let (outcome, _) = self.driven(false)?;
        let o = outcome.borrow().clone();
        o
    }

    /// Waits for the final outcome. Every request is terminal and quiet
    /// when this returns.
    pub async fn wait(self) -> Result<TransferOutcome> {
        self.wait_or_cancel(std::future::pending()).await
    }

    /// Waits for the final outcome; if `stop` completes first, cancels
    /// what has not completed and waits until the transfer is quiet.
    pub async fn wait_or_cancel(self, stop: impl std::future::Future<Output = ()>) -> Result<TransferOutcome> {
        tokio::pin!(stop);
        let mut stopped = false;
        // The first attempt, waited for here while nothing else drives it.
        let lazy = self.mode.lock().take_unstarted();
        if let Some(lazy) = lazy {
            // Put back at once if this future is dropped while waiting (the
            // handle's drop then starts the driver, cancelled).
            let mut guard = Unstarted { transfer: &self, lazy: Some(lazy) };
            let completed = match guard.lazy.as_deref() {
                Some(l) => tokio::select! {
                    c = l.first_completed() => c,
                    _ = &mut stop => { stopped = true; false }
                },
                None => false,
            };
            let lazy = guard.lazy.take();
            drop(guard);
            if let Some(lazy) = lazy {
                if completed {
                    return Ok(lazy.finish());
                }
                *self.mode.lock() = lazy.start(stopped);
            }
        }
        let Some((mut outcome, cancel)) = self.driven(false) else {
            return Err(Error::new(ErrorKind::Internal, "the transfer was already waited for"));
        };
        loop {
            if let Some(o) = outcome.borrow_and_update().clone() {
                return Ok(o);
            }
            tokio::select! {
                r = outcome.changed() => {
                    if r.is_err() {
                        // The driver ended without reporting: only if its
                        // task was aborted by a runtime shutdown.
                        return outcome.borrow().clone().ok_or_else(|| {
                            Error::new(ErrorKind::Shutdown, "the runtime stopped before the transfer finished")
                        });
                    }
                }
                _ = &mut stop, if !stopped => {
                    stopped = true;
                    let _ = cancel.send(true);
                }
            }
        }
    }

    /// Cancels what has not completed and waits until the transfer is quiet.
    pub async fn cancel(self) -> Result<TransferOutcome> {
        let _ = self.driven(true);
        self.wait().await
    }
}

/// A first attempt taken out of its handle while a waiter waits for it:
/// put back into the handle if the waiter is dropped first.
struct Unstarted<'a> {
    transfer: &'a Transfer,
    lazy: Option<Box<Lazy>>,
}

impl Drop for Unstarted<'_> {
    fn drop(&mut self) {
        if let Some(lazy) = self.lazy.take() {
            *self.transfer.mode.lock() = Mode::Unstarted(lazy);
        }
    }
}

impl Drop for Transfer {
    fn drop(&mut self) {
        let mode = std::mem::replace(&mut *self.mode.lock(), Mode::Done);
        match mode {
            // Nobody waits: the driver cancels it and gives everything back.
            Mode::Unstarted(lazy) => drop(lazy.start(true)),
            Mode::Driven { outcome, cancel } => {
                if outcome.borrow().is_none() {
                    let _ = cancel.send(true);
                }
            }
            Mode::Done => {}
        }
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

    /// The backend underneath.
    pub fn transport(&self) -> &Arc<dyn Transport> {
        &self.inner.transport
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
    /// within `deadline.base`; the one call counts once toward the breaker.
    /// The error of the last try says how many were made, over how long.
    /// A failure that took its time (a handshake that timed out) is not
    /// retried here: the caller already waited for it.
    pub async fn open_segment(&self, name: &str) -> Result<SegmentId> {
        let admit = self.inner.admit(name)?;
        let started = self.inner.clock.now();
        let budget = self.inner.cfg.deadline.base;
        let mut attempt = 1u32;
        let result = loop {
            let result = self.inner.transport.open_segment(name).await;
            let again = match &result {
                Err(e) => {
                    matches!(e.kind(), ErrorKind::ConnectionRefused | ErrorKind::ConnectionReset)
                        && admit != Admit::Probe
                        && attempt < self.inner.cfg.retry.max_attempts
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
            Ok(_) => self.inner.record(name, Verdict::Healthy),
            Err(e) if e.kind().is_peer_failure() => self.inner.record(name, Verdict::Failed),
            Err(_) if admit == Admit::Probe => self.inner.record(name, Verdict::Unknown),
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
            if let Err(e) = inner.admit(peer) {
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

/// What one attempt said about a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Healthy,
    Failed,
    Unknown,
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

    fn admit(&self, peer: &str) -> Result<Admit> {
        let now = self.clock.now();
        let mut breakers = self.breakers.lock();
        match breakers.entry(peer.to_owned()).or_default().admit(now) {
            Admit::No { retry_after } => Err(Error::new(
                ErrorKind::PeerUnavailable,
                "peer failed repeatedly; its circuit breaker is open and fails fast until a probe succeeds",
            )
            .with("peer", peer)
            .with("retry_after_ms", retry_after.as_millis())),
            a => Ok(a),
        }
    }

    fn record(self: &Arc<Self>, peer: &str, verdict: Verdict) {
        let now = self.clock.now();
        let (before, after) = {
            let mut breakers = self.breakers.lock();
            let b = breakers.entry(peer.to_owned()).or_default();
            let before = b.state(now);
            match verdict {
                Verdict::Healthy => b.on_success(),
                Verdict::Failed => b.on_failure(now, &self.cfg.breaker),
                Verdict::Unknown => b.on_abandoned_probe(),
            }
            (before, b.state(now))
        };
        self.metrics.breaker(peer, before, after);
        let opened = after == BreakerState::Open;
        if opened {
            self.start_prober(peer);
        }
    }

    /// Whether `peer`'s breaker is closed now (peers never seen: yes).
    fn breaker_closed(&self, peer: &str) -> bool {
        let now = self.clock.now();
        self.breakers.lock().get(peer).is_none_or(|b| b.state(now) == BreakerState::Closed)
    }

    /// Starts the background prober of `peer` unless one runs (or there
    /// is no runtime to run it on).
    fn start_prober(self: &Arc<Self>, peer: &str) {
        let Ok(handle) = tokio::runtime::Handle::try_current() else { return };
        if !self.probers.lock().insert(peer.to_owned()) {
            return;
        }
        // Holds the engine weakly: a dropped engine's prober ends at its
        // next wake-up instead of keeping the transport alive.
        let (weak, peer) = (Arc::downgrade(self), peer.to_owned());
        handle.spawn(async move {
            let mut wait = PROBER_FIRST;
            for _ in 0..PROBER_TRIES {
                tokio::time::sleep(wait).await;
                let Some(me) = weak.upgrade() else { return };
                if me.breaker_closed(&peer) {
                    break;
                }
                match me.probe(&peer).await {
                    Ok(()) => break,
                    Err(e) if e.kind() == ErrorKind::Shutdown => break,
                    Err(_) => {}
                }
                wait = (wait * 2).min(prober_cap(me.cfg.breaker.cooldown));
            }
            if let Some(me) = weak.upgrade() {
                me.probers.lock().remove(&peer);
            }
        });
    }

    /// See [`Engine::probe`].
    async fn probe(self: &Arc<Self>, name: &str) -> Result<()> {
        let t = &self.transport;
        let result = match t.open_segment(name).await {
            Ok(seg) => {
                let r = self.read_one(seg).await;
                let _ = t.close_segment(seg).await;
                // The peer's refusal of the read (a range or access it does
                // not allow, memory it just unregistered) is an answer from
                // it, so it is alive. Only the read's errors count so: an
                // open that failed says nothing of the kind.
                match r {
                    Err(e)
                        if matches!(
                            e.kind(),
                            ErrorKind::OutOfBounds | ErrorKind::AccessDenied | ErrorKind::Unregistered
                        ) =>
                    {
                        Ok(())
                    }
                    r => r,
                }
            }
            Err(e) => Err(e),
        };
        match &result {
            Ok(()) => self.record(name, Verdict::Healthy),
            Err(e) if e.kind().is_peer_failure() => {
                if self.breaker_closed(name) {
                    self.record(name, Verdict::Failed);
                }
            }
            Err(_) => {}
        }
        result.map_err(|e| e.with("peer", name).with("probe", true))
    }

    /// Reads one byte of the first readable region of `seg` (or the first
    /// region) into a scratch buffer registered for the time of the read;
    /// `Ok` without a read when the peer exposes nothing (the open was the
    /// round trip).
    async fn read_one(&self, seg: SegmentId) -> Result<()> {
        let t = &self.transport;
        let desc = t.segment_descriptor(seg)?;
        let Some(r) = desc.regions.iter().find(|r| r.access.remote_read).or(desc.regions.first()) else {
            return Ok(());
        };
        let buf = Buffer::new(64).map_err(|e| Error::new(ErrorKind::Internal, e.to_string()))?;
        let local = t.register(buf.region(), Access::LOCAL)?;
        let read = async {
            let b = t
                .submit(
                    vec![TransferRequest::read(local, 0, seg, r.addr, 1)],
                    SubmitOptions::with_timeout(PROBE_READ_TIMEOUT),
                )
                .await?;
            let st = t.wait(b).await;
            let _ = t.release(b);
            let st = st?;
            match (st.state, st.first_error()) {
                (BatchState::Completed, _) => Ok(()),
                (_, Some(e)) => Err(e.clone()),
                (BatchState::TimedOut, None) => Err(Error::new(
                    ErrorKind::Timeout,
                    format!("the peer did not answer a probe within {} ms", PROBE_READ_TIMEOUT.as_millis()),
                )),
                (state, None) => Err(Error::new(ErrorKind::Cancelled, format!("the probe's read ended {state:?}"))),
            }
        }
        .await;
        let _ = t.unregister(local).await;
        read
    }

    fn abandon_probes(self: &Arc<Self>, peers: &[String]) {
        for p in peers {
            self.record(p, Verdict::Unknown);
        }
    }
}

/// The task that waits for, and retries, one transfer.
struct Driver {
    inner: Arc<Inner>,
    requests: Vec<TransferRequest>,
    peer_of: Vec<usize>,
    peers: Vec<String>,
    cancel: watch::Receiver<bool>,
    /// When the transfer was started (its latency in the metrics).
    started: std::time::Instant,
}

impl Driver {
    fn cancelled(&self) -> bool {
        *self.cancel.borrow()
    }

    async fn cancel_signal(cancel: &mut watch::Receiver<bool>) {
        while !*cancel.borrow_and_update() {
            if cancel.changed().await.is_err() {
                // The handle is gone without cancelling: keep running.
                std::future::pending::<()>().await;
            }
        }
    }

    async fn run(mut self, first: Result<BatchId>) -> TransferOutcome {
        let max_attempts = self.inner.cfg.retry.max_attempts;
        let mut status: Vec<RequestStatus> = vec![RequestStatus::Pending; self.requests.len()];
        let mut todo: Vec<usize> = (0..self.requests.len()).collect();
        let mut attempts = 1u32;
        let mut current = first;
        loop {
            let results = self.attempt(current, todo.len()).await;
            self.judge_peers(&todo, &results);
            let mut retry = Vec::new();
            for (&idx, st) in todo.iter().zip(results) {
                let retryable = match &st {
                    RequestStatus::Failed(e) => e.is_transient() && e.kind() != ErrorKind::PeerUnavailable,
                    RequestStatus::TimedOut => true,
                    _ => false,
                };
                if retryable && attempts < max_attempts {
                    retry.push(idx);
                }
                status[idx] = st;
            }
            if retry.is_empty() {
                break;
            }
            if self.cancelled() {
                break;
            }
            let pause = {
                let mut rng = self.inner.rng.lock();
                backoff(&self.inner.cfg.retry, attempts, &mut *rng)
            };
            let sleep = self.inner.clock.sleep(pause);
            let stopped = tokio::select! {
                _ = sleep => false,
                _ = Self::cancel_signal(&mut self.cancel) => true,
            };
            if stopped {
                break;
            }
            // Requests to peers whose breaker opened meanwhile fail fast.
            retry.retain(|&idx| match self.inner.admit(&self.peers[self.peer_of[idx]]) {
                Ok(_) => true,
                Err(e) => {
                    status[idx] = RequestStatus::Failed(e);
                    false
                }
            });
            if retry.is_empty() {
                break;
            }
            todo = retry;
            attempts += 1;
            let reqs: Vec<TransferRequest> = todo.iter().map(|&i| self.requests[i]).collect();
            let opts = self.inner.options(&reqs);
            tracing::debug!(attempt = attempts, requests = todo.len(), "retrying");
            let submitting = std::time::Instant::now();
            current = self.inner.transport.submit(reqs, opts).await;
            self.inner.metrics.stage(Stage::Submit, submitting.elapsed());
        }
        if self.cancelled() {
            // Work that was waiting for a retry when the caller cancelled.
            for s in status.iter_mut() {
                if !s.is_completed() && !matches!(s, RequestStatus::Failed(e) if !e.is_transient()) {
                    *s = RequestStatus::Cancelled;
                }
            }
        }
        let state = BatchState::summarize(&status);
        self.inner.metrics.transfer_done(
            &self.requests,
            &self.peer_of,
            &self.peers,
            &status,
            state,
            attempts,
            self.started.elapsed(),
        );
        TransferOutcome { state, requests: status, attempts }
    }

    /// Runs one backend batch to a terminal state and returns one status per
    /// request of `todo`.
    async fn attempt(&mut self, batch: Result<BatchId>, n: usize) -> Vec<RequestStatus> {
        let batch = match batch {
            Ok(b) => b,
            Err(e) => return vec![RequestStatus::Failed(e); n],
        };
        let t = self.inner.transport.clone();
        let waiting = std::time::Instant::now();
        let result = tokio::select! {
            r = t.wait(batch) => r,
            _ = Self::cancel_signal(&mut self.cancel) => t.cancel(batch).await,
        };
        self.inner.metrics.stage(Stage::Complete, waiting.elapsed());
        if let Err(e) = t.release(batch) {
            tracing::debug!(%batch, error = %e, "release after terminal status failed");
        }
        match result {
            Ok(s) if s.requests.len() == n && s.is_terminal() => s.requests,
            Ok(s) => {
                let e = Error::new(
                    ErrorKind::Internal,
                    format!("backend reported {} statuses in state {:?} for {n} requests", s.requests.len(), s.state),
                )
                .with("backend", t.backend());
                vec![RequestStatus::Failed(e); n]
            }
            Err(e) => vec![RequestStatus::Failed(e); n],
        }
    }

    /// Feeds each peer's breaker with what this attempt said about it.
    fn judge_peers(&self, todo: &[usize], results: &[RequestStatus]) {
        let mut verdicts: Vec<Option<Verdict>> = vec![None; self.peers.len()];
        for (&idx, st) in todo.iter().zip(results) {
            let v = match st {
                RequestStatus::Completed => Verdict::Healthy,
                RequestStatus::TimedOut => Verdict::Failed,
                RequestStatus::Failed(e) if e.kind().is_peer_failure() => Verdict::Failed,
                _ => Verdict::Unknown,
            };
            let slot = &mut verdicts[self.peer_of[idx]];
            *slot = Some(match (*slot, v) {
                (Some(Verdict::Failed), _) | (_, Verdict::Failed) => Verdict::Failed,
                (Some(Verdict::Healthy), _) | (_, Verdict::Healthy) => Verdict::Healthy,
                _ => Verdict::Unknown,
            });
        }
        for (p, v) in verdicts.into_iter().enumerate() {
            if let Some(v) = v {
                self.inner.record(&self.peers[p], v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prober_waits_at_most_a_quarter_of_the_cool_down_and_one_second() {
        assert_eq!(prober_cap(Duration::from_secs(2)), Duration::from_millis(500));
        assert_eq!(prober_cap(Duration::from_secs(60)), PROBER_MAX_WAIT);
        assert_eq!(prober_cap(Duration::from_millis(10)), PROBER_FIRST);
        assert_eq!(prober_cap(Duration::ZERO), PROBER_FIRST);
    }
}
