//! The session driver: [`Sessions`] runs the sans-IO
//! [`crate::session::SessionTable`] over an [`Engine`], with the backend's
//! notifications as its control channel (rules 11 to 13).
//!
//! It owns the transport's inbox while it runs: session messages go to the
//! table, other notifications to its own bounded inbox
//! ([`Sessions::take_notifications`]). Three kinds of task do the I/O: one
//! reads the transport's inbox, one runs the table's timer, and one per peer
//! (while it has messages queued) delivers that peer's messages in order,
//! retrying transient failures for up to the liveness timeout.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::engine::{offer_within, Engine};
use super::retry::TransferOutcome;
use crate::session::{
    is_session_message, Action, Grant, Role, SessionCounts, SessionKey, SessionLimits, SessionState, SessionTable,
};
use transport_core::Clock;
use transport_core::{check_notification, Inbox, Notification, DEFAULT_INBOX};
use transport_core::{Error, ErrorKind, Result};
use transport_core::{Opcode, SegmentId, TransferRequest};

mod tasks;
use tasks::{read_loop, send_loop, tick_loop};

/// [`Sessions::notify_repeatable`]'s first pause, and its longest.
const REPEAT_FIRST_PAUSE: Duration = Duration::from_millis(2);
const REPEAT_MAX_PAUSE: Duration = Duration::from_millis(200);

/// Messages queued toward one peer before older heartbeats are dropped.
const MAX_QUEUED: usize = 4096;
/// Notifications taken from the transport per wake-up.
const TAKE_BATCH: usize = 256;
/// A session message whose delivery took this long, or a timer tick this
/// late, is logged (debug): the trace of a liveness timeout.
const SLOW_DELIVERY: Duration = Duration::from_millis(250);

/// The session engine of one process: both roles (sender and receiver) of
/// every session, over one [`Engine`]. Cheap to clone; clones share state.
/// Dropping the last clone (or [`Sessions::shutdown`]) stops its tasks.
///
/// # Example
///
/// ```no_run
/// # async fn demo(prefill: kvmove_policy::Sessions, decode: kvmove_policy::Sessions,
/// #               region: transport_core::RegionId, dst_addr: u64) -> transport_core::Result<()> {
/// use std::time::Duration;
/// use kvmove_policy::session::Grant;
/// use transport_core::TransferRequest;
///
/// let room = 42; // the request's id, known to both sides
/// // Decode, once it has memory for the request:
/// let grant = Grant { ranges: vec![(dst_addr, 1 << 20)], expected: 1 << 20, deadline: Duration::from_secs(30) };
/// decode.grant(&prefill.name(), room, grant).await?;
///
/// // Prefill: wait for the grant, write (checked against it), finish.
/// let decode_name = decode.name();
/// prefill.expect(&decode_name, room)?;
/// let grant = prefill.wait_grant(&decode_name, room).await?;
/// let seg = prefill.segment(&decode_name).await?;
/// let (addr, len) = grant.ranges[0];
/// prefill.write(&decode_name, room, vec![TransferRequest::write(region, 0, seg, addr, len)]).await?;
/// prefill.finish(&decode_name, room)?;
/// let key = kvmove_policy::session::SessionKey::new(decode_name, room, kvmove_policy::session::Role::Sender);
/// assert!(matches!(prefill.wait(&key).await?, kvmove_policy::session::SessionState::Landed));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Sessions {
    inner: Arc<Inner>,
    _owner: Arc<Owner>,
}

struct Inner {
    engine: Engine,
    /// Where the per-peer send tasks run (calls may come from outside it).
    rt: tokio::runtime::Handle,
    clock: Arc<dyn Clock>,
    table: Mutex<SessionTable>,
    /// Wakes everything (shutdown).
    changed: watch::Sender<u64>,
    /// Set while the driver is held ([`Sessions::hold`]).
    held: watch::Sender<bool>,
    /// Wakes the waiters of one session.
    waiters: Mutex<HashMap<SessionKey, watch::Sender<u64>>>,
    plain: Inbox,
    /// Held while the transport's inbox is read and applied
    /// ([`tasks::read_inbox`]): one reader at a time.
    reading: Mutex<()>,
    peers: Mutex<HashMap<String, PeerLink>>,
    writes: Mutex<HashMap<SessionKey, watch::Sender<bool>>>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    dropped_plain: std::sync::atomic::AtomicU64,
    /// Set by shutdown: waits answer `Shutdown`.
    closed: std::sync::atomic::AtomicBool,
    /// Sessions not yet final, for the metrics: when this side first saw
    /// each, and when a sender's grant came (counted once when final).
    seen: Mutex<HashMap<SessionKey, (Instant, Option<Instant>)>>,
}

#[derive(Default)]
struct PeerLink {
    segment: Option<SegmentId>,
    queue: VecDeque<Vec<u8>>,
    sending: bool,
    /// Callers between taking the segment and finishing with it (a
    /// notification or a write in progress): the segment is not closed
    /// under them.
    users: usize,
    /// When the segment was last given back (clock time): it is closed
    /// only once unused for [`SEGMENT_IDLE`].
    last_used: Duration,
}

/// A peer's segment with no session, no queued message and no user is
/// closed once unused this long (not at once: plain notifications to a
/// peer would otherwise reopen it, and its connections, every time).
const SEGMENT_IDLE: Duration = Duration::from_secs(10);

/// The segment toward `peer`, held open while this lives (see
/// [`PeerLink::users`]).
struct SegmentUse<'a> {
    inner: &'a Inner,
    peer: &'a str,
    id: SegmentId,
}

impl Drop for SegmentUse<'_> {
    fn drop(&mut self) {
        let now = self.inner.clock.now();
        if let Some(link) = self.inner.peers.lock().get_mut(self.peer) {
            link.users = link.users.saturating_sub(1);
            link.last_used = now;
        }
    }
}

/// Stops the tasks when the last user handle goes.
struct Owner(Arc<Inner>);

impl Drop for Owner {
    fn drop(&mut self) {
        self.0.stop_tasks();
    }
}

impl fmt::Debug for Sessions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sessions").field("counts", &self.counts()).finish()
    }
}

impl Sessions {
    /// Starts the session engine over `engine` (inside a tokio runtime). It
    /// takes over the transport's notification inbox.
    pub fn start(engine: Engine, limits: SessionLimits) -> Result<Self> {
        let rt = tokio::runtime::Handle::try_current()
            .map_err(|_| Error::new(ErrorKind::Internal, "Sessions must start inside a tokio runtime"))?;
        if limits.heartbeat_interval.is_zero() || limits.liveness_timeout <= limits.heartbeat_interval {
            return Err(Error::new(
                ErrorKind::Config,
                "sessions: heartbeat_interval must be positive and below liveness_timeout",
            ));
        }
        if limits.max_sessions == 0 || limits.max_sessions_per_peer == 0 {
            return Err(Error::new(ErrorKind::Config, "sessions: max_sessions* must be at least 1"));
        }
        let epoch = loop {
            let e: u64 = rand::random();
            if e != 0 {
                break e;
            }
        };
        let tick = (limits.heartbeat_interval / 2).clamp(Duration::from_millis(5), Duration::from_millis(100));
        let inner = Arc::new(Inner {
            clock: engine.clock(),
            engine,
            rt: rt.clone(),
            table: Mutex::new(SessionTable::new(limits, epoch)),
            changed: watch::channel(0).0,
            held: watch::channel(false).0,
            waiters: Mutex::default(),
            plain: Inbox::new(DEFAULT_INBOX),
            reading: Mutex::new(()),
            peers: Mutex::default(),
            writes: Mutex::default(),
            tasks: Mutex::default(),
            dropped_plain: std::sync::atomic::AtomicU64::new(0),
            closed: std::sync::atomic::AtomicBool::new(false),
            seen: Mutex::default(),
        });
        let weak = Arc::downgrade(&inner);
        let reader = rt.spawn(read_loop(weak.clone()));
        let timer = rt.spawn(tick_loop(weak, tick));
        inner.tasks.lock().extend([reader, timer]);
        Ok(Self { inner: inner.clone(), _owner: Arc::new(Owner(inner)) })
    }

    /// Holds (`true`) or releases (`false`) this engine's session driver
    /// as a stopped or starved process is held: its timer does not tick,
    /// received messages wait unread in the transport's inbox, and nothing
    /// is sent, heartbeats included, until it is released; calls still run.
    /// For fault tests: the conformance suite freezes one side of a session
    /// with it (rule 13, pauses), where a real freeze (SIGSTOP) would stop
    /// the whole process.
    pub fn hold(&self, on: bool) {
        self.inner.held.send_replace(on);
        // A read of the inbox under way as the hold began (its task past
        // the gate) ends before this returns; later reads see the hold
        // and leave the messages unread. Without it a message arriving
        // just after the hold could still be applied (a FINISH landed by
        // a side the test believes frozen).
        drop(self.inner.reading.lock());
    }

    /// This engine's segment name (what peers use as `peer`).
    pub fn name(&self) -> String {
        self.inner.engine.transport().local_segment_name()
    }

    /// The engine underneath.
    pub fn engine(&self) -> &Engine {
        &self.inner.engine
    }

    /// Session counts (open, lingering, tracked peers, ignored messages).
    pub fn counts(&self) -> SessionCounts {
        self.inner.table.lock().counts()
    }

    /// How often this engine's timer found it had not run for a quarter
    /// of the liveness timeout or more (a stopped or starved process): a
    /// pause. Silence during a pause is not counted against its peers
    /// (docs/CONTRACT.md, rule 13), so a peer silent only as long as this
    /// side paused is not given up on.
    pub fn pauses(&self) -> u64 {
        self.inner.table.lock().pauses()
    }

    /// The segment handle this engine uses toward `peer` (opened on first
    /// use, shared by control messages and writes; do not close it). The
    /// engine closes it once `peer` has no session, no message queued and
    /// no notification or write in progress, and it has been unused for 10 s.
    pub async fn segment(&self, peer: &str) -> Result<SegmentId> {
        self.inner.segment(peer).await
    }

    // ---- sender ----

    /// Sender: expect a grant from `peer` for `id`. The session waits in
    /// `Waiting` with no deadline (nothing is sent, nothing can time out)
    /// while the peer is alive; it fails only if the peer dies.
    pub fn expect(&self, peer: &str, id: u64) -> Result<()> {
        let now = self.inner.clock.now();
        let r = self.inner.table.lock().expect(peer, id, now);
        self.inner.pump();
        r
    }

    /// Sender: waits until `peer` granted `id` and returns the grant; an
    /// error with the final state if the session ended first. Expects the
    /// grant first ([`Sessions::expect`]) if nothing did yet.
    pub async fn wait_grant(&self, peer: &str, id: u64) -> Result<Grant> {
        let key = SessionKey::new(peer, id, Role::Sender);
        if self.state(&key).is_none() {
            self.expect(peer, id)?;
        }
        let mut rx = self.inner.watch(&key);
        let mut all = self.inner.changed.subscribe();
        loop {
            rx.borrow_and_update();
            self.inner.check_open()?;
            {
                let t = self.inner.table.lock();
                match t.state(&key) {
                    Some(st) if st.is_final() => return Err(ended(&key, &st)),
                    Some(SessionState::Waiting) => {}
                    Some(_) => {
                        if let Some(g) = t.grant(&key) {
                            return Ok(g);
                        }
                    }
                    None => return Err(unknown(&key)),
                }
            }
            tokio::select! {
                r = rx.changed() => if r.is_err() { return Err(Error::shut_down()) },
                r = all.changed() => if r.is_err() { return Err(Error::shut_down()) },
            }
        }
    }

    /// Sender: grants received and not yet used, oldest first.
    pub fn grants(&self) -> Vec<(SessionKey, Grant)> {
        self.inner.table.lock().grants()
    }

    /// Sender: writes `requests` for the session (all `Write`s to
    /// [`Sessions::segment`]`(peer)`), through the engine's policy (retry,
    /// breaker, budgets). Refused before a byte moves if a range falls
    /// outside the grant, there is no grant, or the session is not open.
    /// Bounded by the session's deadline; stopped if the session ends. If
    /// the policy gives up, the session fails on both sides.
    pub async fn write(&self, peer: &str, id: u64, requests: Vec<TransferRequest>) -> Result<TransferOutcome> {
        // The engine's transfer spans nest in this one: a session's story is
        // one search for its peer and id.
        let span = tracing::info_span!("session", peer, id, role = "sender");
        tracing::Instrument::instrument(self.write_in_span(peer, id, requests), span).await
    }

    async fn write_in_span(&self, peer: &str, id: u64, requests: Vec<TransferRequest>) -> Result<TransferOutcome> {
        let key = SessionKey::new(peer, id, Role::Sender);
        let used = self.inner.use_segment(peer).await?;
        let seg = used.id;
        let mut ranges = Vec::with_capacity(requests.len());
        for (i, r) in requests.iter().enumerate() {
            if r.op != Opcode::Write || r.segment != seg {
                return Err(Error::new(
                    ErrorKind::InvalidRequest,
                    "session writes must be Write requests to Sessions::segment(peer)",
                )
                .with("request", i));
            }
            ranges.push((r.remote_addr, r.len));
        }
        if requests.is_empty() {
            return Err(Error::new(ErrorKind::InvalidRequest, "empty write"));
        }
        self.confirmed(&key).await?;
        // One stop signal per session, shared by its concurrent writes; taken
        // before the write is counted, so a stop sent once it is counted
        // reaches it.
        let mut stop_rx =
            self.inner.writes.lock().entry(key.clone()).or_insert_with(|| watch::channel(false).0).subscribe();
        let now = self.inner.clock.now();
        let left = self.inner.table.lock().begin_write(&key, &ranges, now)?;
        let stopped = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let outcome = match self.inner.engine.submit(requests).await {
            Ok(t) => {
                let sleep = self.inner.clock.sleep(left);
                let flag = stopped.clone();
                let stop = async move {
                    tokio::select! {
                        _ = sleep => {}
                        _ = stop_rx.wait_for(|s| *s) => {}
                    }
                    flag.store(true, std::sync::atomic::Ordering::SeqCst);
                };
                t.wait_or_cancel(stop).await
            }
            Err(e) => Err(e),
        };
        let stopped = stopped.load(std::sync::atomic::Ordering::SeqCst);
        let bytes: u64 = match &outcome {
            Ok(o) => o.requests.iter().zip(ranges.iter()).filter(|(s, _)| s.is_completed()).map(|(_, r)| r.1).sum(),
            Err(_) => 0,
        };
        let now = self.inner.clock.now();
        {
            let mut t = self.inner.table.lock();
            t.end_write(&key, bytes, now);
            let failed = match &outcome {
                Ok(o) if o.is_success() => None,
                Ok(o) => Some(o.clone().into_result().err().unwrap_or_else(|| {
                    Error::new(ErrorKind::Internal, "a write that did not succeed reported no error")
                })),
                Err(e) => Some(e.clone()),
            };
            match failed {
                // Stopped by the session's deadline or its end: the
                // receiver decides the outcome (END), not this write.
                Some(_) if stopped => {}
                // The policy gave up: the session fails on both sides
                // (unless it already ends).
                Some(e) => {
                    let _ = t.cancel(&key, Some(e), now);
                }
                None => {}
            }
            if !matches!(t.state(&key), Some(SessionState::Transferring)) {
                self.inner.writes.lock().remove(&key);
            }
        }
        self.inner.pump();
        outcome
    }

    /// Sender: returns once the session may be written. After a pause of
    /// this side with the session open, the receiver may have taken the
    /// silence for death and ended it: the session is confirmed with the
    /// receiver first (one round trip; see
    /// [`SessionTable::confirm_before_write`]), and ends `failed` if the
    /// receiver has ended it or does not answer.
    async fn confirmed(&self, key: &SessionKey) -> Result<()> {
        let mut rx = self.inner.watch(key);
        loop {
            rx.borrow_and_update();
            self.inner.check_open()?;
            let now = self.inner.clock.now();
            let wait = self.inner.table.lock().confirm_before_write(key, now)?;
            self.inner.pump();
            if !wait {
                return Ok(());
            }
            if rx.changed().await.is_err() {
                return Err(Error::shut_down());
            }
        }
    }

    /// Sender: every write of the session completed; tell the receiver,
    /// which decides `Landed` (or `Failed` when the bytes do not match).
    /// Await the outcome with [`Sessions::wait`].
    pub fn finish(&self, peer: &str, id: u64) -> Result<()> {
        let key = SessionKey::new(peer, id, Role::Sender);
        let r = self.inner.table.lock().finish(&key);
        self.inner.pump();
        r
    }

    // ---- receiver ----

    /// Receiver: admits `peer` to write `grant.ranges` for `id`; the
    /// deadline starts now. The grant is delivered in the background
    /// (retried while the peer is alive).
    pub async fn grant(&self, peer: &str, id: u64, grant: Grant) -> Result<()> {
        // Open the segment first, so a peer that cannot be reached is an
        // error here rather than a grant that never arrives.
        self.inner.segment(peer).await?;
        let now = self.inner.clock.now();
        let r = self.inner.table.lock().grant_to(peer, id, grant, now);
        self.inner.pump();
        r
    }

    // ---- both ----

    /// The session's state now; `None` if unknown (never made, or released).
    pub fn state(&self, key: &SessionKey) -> Option<SessionState> {
        self.inner.table.lock().state(key)
    }

    /// Waits for the session's final state.
    pub async fn wait(&self, key: &SessionKey) -> Result<SessionState> {
        let mut rx = self.inner.watch(key);
        let mut all = self.inner.changed.subscribe();
        loop {
            rx.borrow_and_update();
            self.inner.check_open()?;
            match self.inner.table.lock().state(key) {
                Some(st) if st.is_final() => return Ok(st),
                Some(_) => {}
                None => return Err(unknown(key)),
            }
            tokio::select! {
                r = rx.changed() => if r.is_err() { return Err(Error::shut_down()) },
                r = all.changed() => if r.is_err() { return Err(Error::shut_down()) },
            }
        }
    }

    /// Cancels the session (either side) and waits for its final state,
    /// which both sides agree on: `Cancelled`, or the outcome the receiver
    /// had already decided.
    pub async fn cancel(&self, key: &SessionKey) -> Result<SessionState> {
        let now = self.inner.clock.now();
        self.inner.table.lock().cancel(key, None, now)?;
        self.inner.pump();
        self.wait(key).await
    }

    /// Forgets a final session (final sessions are also forgotten after
    /// `linger`).
    pub fn release(&self, key: &SessionKey) -> Result<()> {
        let r = self.inner.table.lock().release(key);
        self.inner.writes.lock().remove(key);
        if let Some(tx) = self.inner.waiters.lock().remove(key) {
            tx.send_modify(|v| *v = v.wrapping_add(1));
        }
        r
    }

    // ---- plain notifications ----

    /// Sends a plain notification to `peer` (not a session message),
    /// offered again while its inbox is full ([`crate::Engine::notify`]).
    pub async fn notify(&self, peer: &str, msg: Vec<u8>) -> Result<()> {
        check_notification(&msg)?;
        if is_session_message(&msg) {
            return Err(Error::new(
                ErrorKind::InvalidRequest,
                "a plain notification may not start with the session magic",
            ));
        }
        let seg = self.inner.use_segment(peer).await?;
        self.inner.engine.notify(seg.id, msg).await?;
        metrics::counter!("kvmove_notifications_total", "dir" => "sent").increment(1);
        Ok(())
    }

    /// [`Sessions::notify`] for a message its peer may take twice without
    /// harm (an ask it dedupes, a hello): offered again while it fails with
    /// a transient error (the peer not up yet, a connection reset, a full
    /// inbox), 2 ms apart and twice as long each time (at most 200 ms),
    /// for up to `backpressure.notify_patience`; then, or on a permanent
    /// error, the error is returned. Offered again after a timeout, a
    /// message may arrive twice: plain [`Sessions::notify`] never sends one
    /// twice.
    pub async fn notify_repeatable(&self, peer: &str, msg: Vec<u8>) -> Result<()> {
        let patience = self.inner.engine.config().backpressure.notify_patience;
        let pauses = (REPEAT_FIRST_PAUSE, REPEAT_MAX_PAUSE);
        offer_within(&*self.inner.clock, patience, pauses, Error::is_transient, || self.notify(peer, msg.clone())).await
    }

    /// Takes up to `max` plain notifications received (not session
    /// messages), oldest first.
    pub fn take_notifications(&self, max: usize) -> Vec<Notification> {
        let got = self.inner.plain.take(max);
        if !got.is_empty() {
            metrics::counter!("kvmove_notifications_total", "dir" => "received").increment(got.len() as u64);
        }
        got
    }

    /// Waits until a plain notification is queued.
    pub async fn wait_notification(&self) -> Result<()> {
        self.inner.plain.wait().await
    }

    /// Plain notifications dropped because [`Sessions::take_notifications`]
    /// was not called and its inbox was full.
    pub fn dropped_notifications(&self) -> u64 {
        self.inner.dropped_plain.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Stops the session engine's tasks and closes its segments. Open
    /// sessions are not ended here (peers see this side go silent and fail
    /// them after their liveness timeout); cancel them first for a clean end.
    pub async fn shutdown(&self) {
        self.inner.closed.store(true, std::sync::atomic::Ordering::SeqCst);
        let handles: Vec<JoinHandle<()>> = std::mem::take(&mut *self.inner.tasks.lock());
        for h in &handles {
            h.abort();
        }
        for h in handles {
            let _ = h.await;
        }
        self.inner.plain.close();
        let segs: Vec<SegmentId> = self.inner.peers.lock().drain().filter_map(|(_, p)| p.segment).collect();
        for s in segs {
            let _ = self.inner.engine.transport().close_segment(s).await;
        }
        self.inner.changed.send_modify(|v| *v = v.wrapping_add(1));
    }
}

fn unknown(key: &SessionKey) -> Error {
    Error::new(ErrorKind::InvalidHandle, "unknown session").with("peer", &key.peer).with("id", key.id)
}

fn ended(key: &SessionKey, st: &SessionState) -> Error {
    let e = match st {
        SessionState::Failed(e) => e.clone(),
        SessionState::Expired => Error::new(ErrorKind::Timeout, "the session expired"),
        _ => Error::new(ErrorKind::Cancelled, format!("the session ended {}", st.name())),
    };
    e.with("peer", &key.peer).with("id", key.id)
}

impl Inner {
    /// A receiver woken when `key` changes.
    fn watch(&self, key: &SessionKey) -> watch::Receiver<u64> {
        self.waiters.lock().entry(key.clone()).or_insert_with(|| watch::channel(0).0).subscribe()
    }

    /// Waits while the driver is held ([`Sessions::hold`]); false once the
    /// engine is gone.
    fn running(&self) -> impl std::future::Future<Output = bool> {
        let mut gate = self.held.subscribe();
        async move { gate.wait_for(|held| !held).await.is_ok() }
    }

    fn check_open(&self) -> Result<()> {
        if self.closed.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(Error::shut_down());
        }
        Ok(())
    }

    fn stop_tasks(&self) {
        self.closed.store(true, std::sync::atomic::Ordering::SeqCst);
        for h in self.tasks.lock().drain(..) {
            h.abort();
        }
        self.plain.close();
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }

    async fn segment(&self, peer: &str) -> Result<SegmentId> {
        Ok(self.use_segment(peer).await?.id)
    }

    /// The segment toward `peer` (opened on first use), held open until
    /// the returned use is dropped.
    async fn use_segment<'a>(&'a self, peer: &'a str) -> Result<SegmentUse<'a>> {
        let held = |link: &mut PeerLink, id| {
            link.users += 1;
            SegmentUse { inner: self, peer, id }
        };
        if let Some(link) = self.peers.lock().get_mut(peer) {
            if let Some(s) = link.segment {
                return Ok(held(link, s));
            }
        }
        let seg = self.engine.transport().open_segment(peer).await?;
        let (theirs, used) = {
            let mut peers = self.peers.lock();
            let link = peers.entry(peer.to_string()).or_default();
            let theirs = link.segment.is_some();
            let id = *link.segment.get_or_insert(seg);
            (theirs, held(link, id))
        };
        if theirs {
            // Another task opened it meanwhile: keep theirs.
            let _ = self.engine.transport().close_segment(seg).await;
        }
        Ok(used)
    }

    /// Feeds the metrics with sessions whose state changed: a sender's
    /// grant wait when its grant comes, and each session once when final,
    /// by role and state, with its time to landed.
    fn observe(&self, changed: &[SessionKey], states: Vec<Option<SessionState>>) {
        let now = Instant::now();
        let mut seen = self.seen.lock();
        for (k, st) in changed.iter().zip(states) {
            let role = match k.role {
                Role::Sender => "sender",
                Role::Receiver => "receiver",
            };
            match st {
                None => {
                    seen.remove(k);
                }
                Some(st) if st.is_final() => {
                    let Some((first, _)) = seen.remove(k) else { continue };
                    let name = match st {
                        SessionState::Landed => "landed",
                        SessionState::Failed(_) => "failed",
                        SessionState::Cancelled => "cancelled",
                        SessionState::Expired => "expired",
                        _ => "other",
                    };
                    metrics::counter!("kvmove_sessions_total", "role" => role, "state" => name).increment(1);
                    if name == "landed" {
                        tracing::debug!(peer = %k.peer, id = k.id, role, state = name, "session ended");
                    } else {
                        tracing::warn!(peer = %k.peer, id = k.id, role, state = ?st, "session ended");
                    }
                    if name == "landed" {
                        metrics::histogram!("kvmove_session_landed_seconds", "role" => role)
                            .record(now.duration_since(first).as_secs_f64());
                    }
                }
                Some(st) => {
                    let entry = seen.entry(k.clone()).or_insert((now, None));
                    if k.role == Role::Sender && entry.1.is_none() && !matches!(st, SessionState::Waiting) {
                        entry.1 = Some(now);
                        metrics::histogram!("kvmove_session_grant_wait_seconds")
                            .record(now.duration_since(entry.0).as_secs_f64());
                    }
                }
            }
        }
    }

    /// Moves the table's decisions out: messages to the per-peer queues,
    /// actions to the writes, and wakes every waiter.
    fn pump(self: &Arc<Self>) {
        let (out, actions, changed, states) = {
            let mut t = self.table.lock();
            let (out, actions, changed) = (t.drain_outgoing(), t.drain_actions(), t.drain_changed());
            let states: Vec<Option<SessionState>> = changed.iter().map(|k| t.state(k)).collect();
            (out, actions, changed, states)
        };
        if !changed.is_empty() {
            self.observe(&changed, states);
        }
        if !changed.is_empty() {
            let waiters = self.waiters.lock();
            for k in &changed {
                if let Some(tx) = waiters.get(k) {
                    tx.send_modify(|v| *v = v.wrapping_add(1));
                }
            }
        }
        for a in actions {
            match a {
                Action::StopWrites(key) => {
                    if let Some(tx) = self.writes.lock().get(&key) {
                        let _ = tx.send(true);
                    }
                }
            }
        }
        let mut start = Vec::new();
        {
            let mut peers = self.peers.lock();
            for (peer, msg) in out {
                let link = peers.entry(peer.clone()).or_default();
                if link.queue.len() >= MAX_QUEUED {
                    // Heartbeats (id 0) are the ones that may go.
                    link.queue.retain(|m| crate::session::wire::decode(m).is_none_or(|d| d.id != 0));
                    if link.queue.len() >= MAX_QUEUED {
                        continue;
                    }
                }
                link.queue.push_back(msg);
                if !link.sending {
                    link.sending = true;
                    start.push(peer);
                }
            }
        }
        for peer in start {
            let h = self.rt.spawn(send_loop(self.clone(), peer));
            let mut tasks = self.tasks.lock();
            tasks.retain(|t| !t.is_finished());
            tasks.push(h);
        }
    }
}
