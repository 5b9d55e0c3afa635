//! A transfer the engine runs: its handle ([`Transfer`]), its outcome,
//! and the driver task that waits for each attempt and retries what
//! failed transiently.

use futures::FutureExt;

use super::*;

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
    pub(super) mode: Arc<parking_lot::Mutex<Mode>>,
}

#[derive(Debug)]
pub(super) enum Mode {
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
    pub(super) fn take_unstarted(&mut self) -> Option<Box<Lazy>> {
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
pub(super) struct Lazy {
    pub(super) driver: Driver,
    pub(super) first: Result<BatchId>,
    pub(super) reservation: Reservation,
    pub(super) active: ActiveGuard,
    pub(super) cancel: watch::Sender<bool>,
    pub(super) span: tracing::Span,
    pub(super) handle: tokio::runtime::Handle,
}

impl fmt::Debug for Lazy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lazy").field("first", &self.first).finish_non_exhaustive()
    }
}

impl Lazy {
    /// Starts the driver task (cancelled at once if `cancel`).
    pub(super) fn start(self, cancel: bool) -> Mode {
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
    pub(super) async fn first_completed(&self) -> bool {
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
    pub(super) fn finish(self) -> TransferOutcome {
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
pub(super) fn give_back(inner: &Inner, reservation: Reservation, active: ActiveGuard) {
    drop(reservation);
    drop(active);
    let used = inner.budget.used();
    inner.metrics.inflight(used.bytes, used.requests);
}

pub(super) fn log_outcome(outcome: &TransferOutcome) {
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
    pub(super) fn driven(
        &self,
        cancel: bool,
    ) -> Option<(watch::Receiver<Option<TransferOutcome>>, watch::Sender<bool>)> {
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

    /// Makes what progress the transport can on the caller's thread, never
    /// waiting, and says whether the first attempt (or the transfer) has
    /// ended: [`Transfer::wait`] then returns without sleeping if it
    /// completed. Unlike [`Transfer::poll`] it never starts the driver
    /// task, so a caller may spin on it for a few microseconds before it
    /// waits: a small transfer whose answer arrives meanwhile completes on
    /// the caller's thread (the transport applies it in its `poll`,
    /// docs/CONTRACT.md rule 6), with no hand-off between threads. Call it
    /// inside the engine's runtime context.
    pub fn progress(&self) -> bool {
        look(&self.mode) != Look::Running
    }

    /// Polls as [`Transfer::progress`] for at most `budget`, giving the
    /// CPU up between polls (`std::thread::yield_now`: on a machine with
    /// few CPUs the threads that answer may need this one), and says
    /// whether the first attempt (or the transfer) ended. Meanwhile the
    /// transport knows a caller polls the first attempt's batch
    /// ([`transport_core::Transport::polling`]), so it may leave the
    /// answers to this thread instead of also waking one of its own. Call
    /// it inside the engine's runtime context.
    pub fn spin(&self, budget: std::time::Duration) -> bool {
        let start = std::time::Instant::now();
        let _polling = first_batch(&self.mode).map(|(transport, batch)| Polling::new(transport, batch));
        loop {
            if self.progress() {
                return true;
            }
            if start.elapsed() >= budget {
                return false;
            }
            std::thread::yield_now();
        }
    }

    /// The outcome if the transfer has ended, after making what progress
    /// the transport can on the caller's thread (as [`Transfer::progress`]);
    /// never blocks. A first attempt that completed is finished here, as
    /// [`Transfer::wait`] would finish it, with no driver task; one that
    /// did not starts the driver (as [`Transfer::poll`] does), whose outcome
    /// a later call returns. `None` while the transfer runs, and once a
    /// waiter finished it. Call it inside the engine's runtime context.
    pub fn try_finish(&self) -> Option<TransferOutcome> {
        match look(&self.mode) {
            Look::Running => None,
            Look::Completed | Look::Ended => {
                let lazy = self.mode.lock().take_unstarted();
                if let Some(lazy) = lazy {
                    if lazy.first_completed().now_or_never() == Some(true) {
                        return Some(lazy.finish());
                    }
                    *self.mode.lock() = lazy.start(false);
                }
                self.poll()
            }
        }
    }

    /// Resolves to the outcome once the transfer has one, without taking
    /// the handle (the driver task is started, as by [`Transfer::poll`]):
    /// for a caller that waits with a limit and keeps the handle if the
    /// limit passes first. `None` once a waiter finished the transfer, or
    /// if the runtime stopped first.
    pub fn finished(&self) -> impl std::future::Future<Output = Option<TransferOutcome>> + Send + 'static {
        let outcome = self.driven(false).map(|(o, _)| o);
        async move {
            let mut outcome = outcome?;
            let seen = match outcome.wait_for(Option::is_some).await {
                Ok(o) => (*o).clone(),
                Err(_) => None,
            };
            seen.or_else(|| outcome.borrow().clone())
        }
    }

    /// A handle that makes the same progress as [`Transfer::progress`]
    /// while another owner (a task waiting for the transfer) holds the
    /// transfer itself.
    pub fn probe(&self) -> Probe {
        Probe { mode: Arc::downgrade(&self.mode) }
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

/// Progress on a transfer from outside its handle: see [`Transfer::probe`].
#[derive(Debug, Clone)]
pub struct Probe {
    mode: std::sync::Weak<parking_lot::Mutex<Mode>>,
}

impl Probe {
    /// Makes what progress the transport can on the caller's thread, never
    /// waiting (as [`Transfer::progress`]), and says whether the transfer
    /// is known to have completed every request: its first attempt did, or
    /// its outcome is a success. `false` while it runs, when it ended
    /// otherwise, or once its handle was dropped or finished by a waiter
    /// (its owner knows then).
    pub fn completed(&self) -> bool {
        let Some(mode) = self.mode.upgrade() else { return false };
        look(&mode) == Look::Completed
    }

    /// [`Probe::completed`] in a loop for at most `budget`, yielding the
    /// CPU between looks, while telling the transport that a caller polls
    /// the first attempt's batch (as [`Transfer::spin`]: its answers are
    /// applied on this thread, no backend thread woken for them). Ends
    /// early, `false`, once the transfer ended otherwise. Call it inside
    /// the engine's runtime context.
    pub fn spin(&self, budget: std::time::Duration) -> bool {
        let Some(mode) = self.mode.upgrade() else { return false };
        let start = std::time::Instant::now();
        let _polling = first_batch(&mode).map(|(transport, batch)| Polling::new(transport, batch));
        loop {
            match look(&mode) {
                Look::Completed => return true,
                Look::Ended => return false,
                Look::Running => {}
            }
            if start.elapsed() >= budget {
                return false;
            }
            std::thread::yield_now();
        }
    }
}

/// A caller polling a batch ([`Transfer::spin`]): says so to the
/// transport, and that it stopped when dropped (also on unwinding).
struct Polling {
    transport: Arc<dyn Transport>,
    batch: BatchId,
}

impl Polling {
    fn new(transport: Arc<dyn Transport>, batch: BatchId) -> Self {
        transport.polling(batch, true);
        Self { transport, batch }
    }
}

impl Drop for Polling {
    fn drop(&mut self) {
        self.transport.polling(self.batch, false);
    }
}

/// What [`look`] found.
#[derive(Debug, PartialEq, Eq)]
enum Look {
    Running,
    /// Every request completed (the first attempt, or the outcome).
    Completed,
    /// Ended otherwise, or finished by a waiter.
    Ended,
}

/// The first attempt's transport and batch while no driver runs it.
fn first_batch(mode: &parking_lot::Mutex<Mode>) -> Option<(Arc<dyn Transport>, BatchId)> {
    match &*mode.lock() {
        Mode::Unstarted(lazy) => match &lazy.first {
            Ok(batch) => Some((lazy.driver.inner.transport.clone(), *batch)),
            Err(_) => None,
        },
        _ => None,
    }
}

/// Polls the first attempt's batch (the transport makes progress on the
/// caller's thread there), or reads the driver's outcome.
fn look(mode: &parking_lot::Mutex<Mode>) -> Look {
    let (transport, batch, n) = {
        let mode = mode.lock();
        match &*mode {
            Mode::Unstarted(lazy) => match &lazy.first {
                Ok(batch) => (lazy.driver.inner.transport.clone(), *batch, lazy.driver.requests.len()),
                Err(_) => return Look::Ended,
            },
            Mode::Driven { outcome, .. } => {
                return match &*outcome.borrow() {
                    None => Look::Running,
                    Some(o) if o.is_success() => Look::Completed,
                    Some(_) => Look::Ended,
                }
            }
            Mode::Done => return Look::Ended,
        }
    };
    match transport.poll(batch) {
        Ok(s) if s.state == BatchState::Completed && s.requests.len() == n => Look::Completed,
        Ok(s) if !s.state.is_terminal() => Look::Running,
        _ => Look::Ended,
    }
}

/// A first attempt taken out of its handle while a waiter waits for it:
/// put back into the handle if the waiter is dropped first.
pub(super) struct Unstarted<'a> {
    pub(super) transfer: &'a Transfer,
    pub(super) lazy: Option<Box<Lazy>>,
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

/// The task that waits for, and retries, one transfer.
pub(super) struct Driver {
    pub(super) inner: Arc<Inner>,
    pub(super) requests: Vec<TransferRequest>,
    pub(super) peer_of: Vec<usize>,
    pub(super) peers: Vec<String>,
    pub(super) cancel: watch::Receiver<bool>,
    /// When the transfer was started (its latency in the metrics).
    pub(super) started: std::time::Instant,
}

impl Driver {
    pub(super) fn cancelled(&self) -> bool {
        *self.cancel.borrow()
    }

    pub(super) async fn cancel_signal(cancel: &mut watch::Receiver<bool>) {
        while !*cancel.borrow_and_update() {
            if cancel.changed().await.is_err() {
                // The handle is gone without cancelling: keep running.
                std::future::pending::<()>().await;
            }
        }
    }

    pub(super) async fn run(mut self, first: Result<BatchId>) -> TransferOutcome {
        let mut retry = Retry::new(self.requests.len(), self.inner.cfg.retry.max_attempts);
        let mut current = first;
        loop {
            let results = self.attempt(current, retry.current().len()).await;
            self.judge_peers(retry.current(), &results);
            if retry.ended(results).is_empty() {
                break;
            }
            if self.cancelled() {
                break;
            }
            let pause = if retry.at_once() {
                std::time::Duration::ZERO
            } else {
                let mut rng = self.inner.rng.lock();
                backoff(&self.inner.cfg.retry, retry.attempts(), &mut *rng)
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
            let chosen: Vec<usize> = retry.chosen().to_vec();
            for idx in chosen {
                if let Err((e, _)) = self.inner.admit(&self.peers[self.peer_of[idx]]) {
                    retry.refuse(idx, e);
                }
            }
            let Some(todo) = retry.start_next() else { break };
            let reqs: Vec<TransferRequest> = todo.iter().map(|&i| self.requests[i]).collect();
            let opts = self.inner.options(&reqs);
            tracing::debug!(attempt = retry.attempts(), requests = reqs.len(), "retrying");
            let submitting = std::time::Instant::now();
            current = self.inner.transport.submit(reqs, opts).await;
            self.inner.metrics.stage(Stage::Submit, submitting.elapsed());
        }
        if self.cancelled() {
            // Work that was waiting for a retry when the caller cancelled.
            retry.cancel();
        }
        let outcome = retry.finish();
        self.inner.metrics.transfer_done(
            &self.requests,
            &self.peer_of,
            &self.peers,
            &outcome.requests,
            outcome.state,
            outcome.attempts,
            self.started.elapsed(),
        );
        outcome
    }

    /// Runs one backend batch to a terminal state and returns one status per
    /// request of `todo`.
    pub(super) async fn attempt(&mut self, batch: Result<BatchId>, n: usize) -> Vec<RequestStatus> {
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
    pub(super) fn judge_peers(&self, todo: &[usize], results: &[RequestStatus]) {
        for (p, v) in verdicts(todo, results, &self.peer_of, self.peers.len()).into_iter().enumerate() {
            if let Some(v) = v {
                self.inner.record(&self.peers[p], v);
            }
        }
    }
}
