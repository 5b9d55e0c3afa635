//! The session flow of `bench`, `target` and `initiator` with `--sessions
//! true`: every transfer unit of a pass is one session (rules 12 and 13,
//! `kvmove_policy::Sessions`).
//!
//! - A **unit** is the whole plan of a layer pass (written layer by layer,
//!   one write per layer) or one request of the per-request pass. Its
//!   session id names the unit ([`unit_id`]), so the target derives what to
//!   grant from its own copy of the plan and trusts nothing else the
//!   initiator sends.
//! - The **initiator** (sender) `expect`s the session, asks the target for
//!   a grant (in `bench` through a channel to the target side in the same
//!   process; in `initiator` mode with the plain notification
//!   `kvmove/1 grant <id>`, asked again every [`REASK`] until granted),
//!   waits for the grant, writes through `Sessions::write` (each write
//!   checked against the grant before a byte moves), finishes, and waits
//!   for Landed.
//! - The **target** (receiver) grants the unit's range: a request's own
//!   range, or for a whole plan the one range covering it (the target owns
//!   all of it, and one range keeps its grant to one message), with the
//!   unit's bytes as the expected count, and records when it saw the
//!   session land.
//!
//! Before its first pass, an initiator checks with `kvmove/1 hello <fp>`
//! that the target runs sessions over the same plan ([`fingerprint`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvmove::{Engine, Error, ErrorKind, SegmentId, TransferRequest};
use kvmove_policy::session::{Grant, RecentAsks, Role, SessionKey, SessionLimits, SessionState};
use kvmove_policy::Sessions;
use tokio::sync::mpsc;
use xxhash_rust::xxh3::Xxh3;

use crate::plan::Plan;

/// Bits of a session id that name the unit within its pass: 0 is the
/// whole plan, `1 + i` the plan's request `i` (at most 2^24 requests).
const UNIT_BITS: u32 = 25;
const UNIT_MASK: u64 = (1 << UNIT_BITS) - 1;

/// How long an initiator waits for a grant before asking again (a lost
/// ask; the target grants an id once).
pub const REASK: Duration = Duration::from_secs(2);

/// How long an initiator waits for the target's answer to its hello.
pub const HELLO_WAIT: Duration = Duration::from_secs(10);

/// Deadline of a grant past the compute of every layer: the session
/// expires (both sides agree) if the initiator has not finished by then.
pub const DEADLINE_SLACK: Duration = Duration::from_secs(600);

/// Ids of sessions a target granted, kept to refuse a second grant for
/// the same id (an ask repeated after the session ended).
pub(crate) const RECENT: usize = 1 << 16;

/// Prefix of the plain notifications of the flow.
const PREFIX: &str = "kvmove/1 ";

/// A unit of a pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// The whole plan, written layer by layer (the layer passes).
    Plan,
    /// Request `i` of the plan, in `Plan::requests` order (per-request).
    Request(usize),
}

/// The session id of `unit` in the pass numbered `serial` (from 1; never
/// 0, which the session protocol keeps for heartbeats).
pub fn unit_id(serial: u64, unit: Unit) -> u64 {
    let u = match unit {
        Unit::Plan => 0,
        Unit::Request(i) => (i as u64 + 1) & UNIT_MASK,
    };
    (serial.max(1) << UNIT_BITS) | u
}

fn unit_of(id: u64) -> Unit {
    match id & UNIT_MASK {
        0 => Unit::Plan,
        u => Unit::Request((u - 1) as usize),
    }
}

/// A hash of what the target grants from: the destination of every
/// request, in order, and the sizes. Both sides of `target`/`initiator`
/// must have the same.
pub fn fingerprint(plan: &Plan) -> u64 {
    let mut h = Xxh3::new();
    h.update(&plan.buffer_len.to_le_bytes());
    h.update(&plan.total_bytes.to_le_bytes());
    for r in plan.requests() {
        h.update(&r.remote_off.to_le_bytes());
        h.update(&r.len.to_le_bytes());
    }
    h.digest()
}

/// Session table bounds for `concurrency` units in flight.
pub fn limits(concurrency: usize) -> SessionLimits {
    let d = SessionLimits::default();
    let room = concurrency.saturating_mul(2).saturating_add(64);
    SessionLimits {
        max_sessions: d.max_sessions.max(room),
        max_sessions_per_peer: d.max_sessions_per_peer.max(room),
        max_unclaimed: d.max_unclaimed.max(room),
        max_unclaimed_per_peer: d.max_unclaimed_per_peer.max(room),
        ..d
    }
}

/// The grant deadline for a plan whose layers take `compute` in all.
pub fn deadline(compute: Duration) -> Duration {
    DEADLINE_SLACK.saturating_add(compute)
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Sends a plain notification of the flow (asks and hellos, which the
/// other side takes twice without harm), offered again while the peer is
/// not up or busy, within the policy's patience
/// ([`Sessions::notify_repeatable`]).
pub(crate) async fn notify(sess: &Sessions, peer: &str, msg: String) -> kvmove::Result<()> {
    sess.notify_repeatable(peer, msg.into_bytes()).await
}

/// A plain message of the flow.
#[derive(Debug, PartialEq, Eq)]
enum Msg {
    Hello(u64),
    HelloOk,
    HelloRefused(u64),
    /// The initiator asks for unit `id` (the target answers with a grant,
    /// rule 12). On the wire `ask`; a target also takes `grant`, the word
    /// earlier builds sent for it.
    Ask(u64),
}

fn parse(msg: &[u8]) -> Option<Msg> {
    let text = std::str::from_utf8(msg).ok()?.strip_prefix(PREFIX)?;
    let (verb, arg) = text.split_once(' ').unwrap_or((text, ""));
    let hex = || u64::from_str_radix(arg, 16).ok();
    match verb {
        "hello" => hex().map(Msg::Hello),
        "hello-ok" => Some(Msg::HelloOk),
        "hello-refused" => hex().map(Msg::HelloRefused),
        "ask" | "grant" => arg.parse().ok().map(Msg::Ask),
        _ => None,
    }
}

fn encode(m: &Msg) -> String {
    match m {
        Msg::Hello(fp) => format!("{PREFIX}hello {fp:016x}"),
        Msg::HelloOk => format!("{PREFIX}hello-ok"),
        Msg::HelloRefused(fp) => format!("{PREFIX}hello-refused {fp:016x}"),
        Msg::Ask(id) => format!("{PREFIX}ask {id}"),
    }
}

// ---------------------------------------------------------------- receiver

/// What the target grants from: every request's range and the plan's
/// covering range, as offsets into its buffer at `base`.
struct Units {
    requests: Vec<(u64, u64)>,
    cover: (u64, u64),
    total: u64,
}

impl Units {
    fn of(plan: &Plan) -> Units {
        let requests: Vec<(u64, u64)> = plan.requests().map(|r| (r.remote_off, r.len)).collect();
        let lo = requests.iter().map(|r| r.0).min().unwrap_or(0);
        let hi = requests.iter().map(|r| r.0 + r.1).max().unwrap_or(0);
        Units { requests, cover: (lo, hi - lo), total: plan.total_bytes }
    }

    /// The range and expected bytes of the unit `id` names.
    fn grant(&self, id: u64) -> Option<((u64, u64), u64)> {
        match unit_of(id) {
            Unit::Plan => Some((self.cover, self.total)),
            Unit::Request(i) => self.requests.get(i).map(|&r| (r, r.1)),
        }
    }
}

/// What a target saw of its sessions.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ReceiverCounts {
    pub granted: u64,
    pub landed: u64,
    /// Ended otherwise (failed, cancelled, expired), by state.
    pub not_landed: u64,
    /// Asks for an id that names no unit of this plan, or granted already.
    pub ignored_asks: u64,
}

#[derive(Default)]
struct Book {
    counts: ReceiverCounts,
    /// Grant to Landed, as the target saw them (at most `RECENT` kept).
    grant_to_landed: Vec<Duration>,
    /// When the target saw each session land, by id (bench: read by the
    /// initiator for the notification delay).
    landed_at: HashMap<u64, Instant>,
    /// Asks granted already (a repeated ask is ignored).
    recent: RecentAsks,
}

struct ReceiverInner {
    sess: Sessions,
    units: Units,
    base: u64,
    deadline: Duration,
    fingerprint: u64,
    /// Keep `landed_at` (bench, where the initiator reads it).
    record: bool,
    book: Mutex<Book>,
}

/// The target's side: grants units of its plan and watches them land.
pub struct Receiver {
    inner: Arc<ReceiverInner>,
    asks: mpsc::UnboundedSender<(String, u64)>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Receiver {
    /// Starts granting the units of `plan`, in memory at `base` of this
    /// engine. `listen`: take asks (and hellos) from plain notifications
    /// (`kvmove target`); otherwise only [`Receiver::asks`] (bench), and
    /// every landing time is kept for the initiator to read.
    pub fn start(
        engine: &Engine,
        plan: &Plan,
        base: u64,
        deadline: Duration,
        concurrency: usize,
        listen: bool,
    ) -> kvmove::Result<Receiver> {
        let sess = Sessions::start(engine.clone(), limits(concurrency))?;
        let inner = Arc::new(ReceiverInner {
            sess,
            units: Units::of(plan),
            base,
            deadline,
            fingerprint: fingerprint(plan),
            record: !listen,
            book: Mutex::default(),
        });
        let (tx, rx) = mpsc::unbounded_channel();
        let mut tasks = vec![tokio::spawn(grant_loop(inner.clone(), rx))];
        if listen {
            tasks.push(tokio::spawn(listen_loop(inner.clone(), tx.clone())));
        }
        Ok(Receiver { inner, asks: tx, tasks })
    }

    /// The channel an in-process initiator asks through: `(its name, id)`.
    pub fn asks(&self) -> mpsc::UnboundedSender<(String, u64)> {
        self.asks.clone()
    }

    /// This side's segment name (the peer name initiators use).
    pub fn name(&self) -> String {
        self.inner.sess.name()
    }

    /// Counts and grant-to-landed times so far.
    pub fn counts(&self) -> (ReceiverCounts, Vec<Duration>) {
        let b = lock(&self.inner.book);
        (b.counts.clone(), b.grant_to_landed.clone())
    }

    /// Takes the times the sessions `ids` were seen landed, waiting up to
    /// `wait` for the last watchers to record theirs.
    pub async fn landed_at(&self, ids: &[u64], wait: Duration) -> Vec<Option<Instant>> {
        let until = Instant::now() + wait;
        loop {
            let done = {
                let b = lock(&self.inner.book);
                ids.iter().all(|id| b.landed_at.contains_key(id))
            };
            if done || Instant::now() >= until {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let mut b = lock(&self.inner.book);
        ids.iter().map(|id| b.landed_at.remove(id)).collect()
    }

    /// Stops granting and the session engine.
    pub async fn shutdown(self) {
        for t in &self.tasks {
            t.abort();
        }
        self.inner.sess.shutdown().await;
    }
}

async fn grant_loop(inner: Arc<ReceiverInner>, mut rx: mpsc::UnboundedReceiver<(String, u64)>) {
    while let Some((peer, id)) = rx.recv().await {
        let key = SessionKey::new(peer.clone(), id, Role::Receiver);
        let known = inner.sess.state(&key).is_some() || lock(&inner.book).recent.contains(&(peer.clone(), id));
        let Some(((off, len), expected)) = inner.units.grant(id).filter(|_| !known) else {
            lock(&inner.book).counts.ignored_asks += 1;
            tracing::debug!(peer = %peer, id, "ask ignored: no such unit, or granted already");
            continue;
        };
        let grant = Grant { ranges: vec![(inner.base + off, len)], expected, deadline: inner.deadline };
        let granted_at = Instant::now();
        if let Err(e) = inner.sess.grant(&peer, id, grant).await {
            // The initiator asks again after REASK.
            tracing::warn!(peer = %peer, id, error = %e, "cannot grant");
            continue;
        }
        {
            let mut b = lock(&inner.book);
            b.counts.granted += 1;
            b.recent.insert((peer, id));
        }
        let inner = inner.clone();
        tokio::spawn(async move {
            let st = inner.sess.wait(&key).await;
            let at = Instant::now();
            let mut b = lock(&inner.book);
            match st {
                Ok(SessionState::Landed) => {
                    b.counts.landed += 1;
                    if b.grant_to_landed.len() < RECENT {
                        b.grant_to_landed.push(at.saturating_duration_since(granted_at));
                    }
                    if inner.record {
                        b.landed_at.insert(id, at);
                    }
                }
                Ok(other) => {
                    b.counts.not_landed += 1;
                    tracing::warn!(peer = %key.peer, id, state = other.name(), "session did not land");
                }
                // Shutting down.
                Err(_) => return,
            }
            drop(b);
            let _ = inner.sess.release(&key);
        });
    }
}

/// `kvmove target`: asks and hellos arrive as plain notifications.
async fn listen_loop(inner: Arc<ReceiverInner>, asks: mpsc::UnboundedSender<(String, u64)>) {
    loop {
        if inner.sess.wait_notification().await.is_err() {
            return;
        }
        for n in inner.sess.take_notifications(256) {
            match parse(&n.msg) {
                Some(Msg::Ask(id)) => {
                    let _ = asks.send((n.from, id));
                }
                Some(Msg::Hello(fp)) => {
                    let reply =
                        if fp == inner.fingerprint { Msg::HelloOk } else { Msg::HelloRefused(inner.fingerprint) };
                    let inner = inner.clone();
                    tokio::spawn(async move {
                        if let Err(e) = notify(&inner.sess, &n.from, encode(&reply)).await {
                            tracing::warn!(peer = %n.from, error = %e, "cannot answer a session hello");
                        }
                    });
                }
                _ => tracing::debug!(peer = %n.from, len = n.msg.len(), "notification ignored"),
            }
        }
    }
}

// ------------------------------------------------------------------ sender

/// One unit's session on the initiator, while it runs. A task waits for
/// the grant from the start (asking again every [`REASK`]), so the grant
/// wait is measured when the grant comes, not when the writes need it.
#[derive(Debug)]
pub struct Open {
    pub id: u64,
    started: Instant,
    waiter: Option<tokio::task::JoinHandle<kvmove::Result<Instant>>>,
    granted: Option<Instant>,
}

impl Drop for Open {
    fn drop(&mut self) {
        if let Some(w) = &self.waiter {
            w.abort();
        }
    }
}

/// What one unit's session measured on the initiator.
#[derive(Debug, Clone, Copy)]
pub struct UnitTimes {
    pub id: u64,
    /// Start (expect and ask) to the grant.
    pub grant_wait: Duration,
    /// Start to Landed, as the initiator learnt it.
    pub time_to_landed: Duration,
    /// Finish to Landed on the initiator (FINISH and END: a round trip).
    pub finish_to_landed: Duration,
    pub finished_at: Instant,
    pub landed_at: Instant,
}

#[derive(Clone)]
enum Ask {
    /// Bench: the target side in this process.
    Local(mpsc::UnboundedSender<(String, u64)>),
    /// `initiator`: a plain notification to the target.
    Notify,
}

/// How the initiator asks its target for grants.
#[derive(Clone)]
struct Asker {
    sess: Sessions,
    peer: String,
    me: String,
    how: Ask,
}

impl Asker {
    async fn ask(&self, id: u64) -> kvmove::Result<()> {
        match &self.how {
            Ask::Local(tx) => tx
                .send((self.me.clone(), id))
                .map_err(|_| Error::new(ErrorKind::Internal, "the target side stopped granting")),
            Ask::Notify => notify(&self.sess, &self.peer, encode(&Msg::Ask(id))).await,
        }
    }

    /// Waits for the grant of `id`, asking again every [`REASK`].
    async fn grant(self, id: u64) -> kvmove::Result<Instant> {
        loop {
            match tokio::time::timeout(REASK, self.sess.wait_grant(&self.peer, id)).await {
                Ok(Ok(_)) => return Ok(Instant::now()),
                Ok(Err(e)) => return Err(e),
                Err(_) => self.ask(id).await?,
            }
        }
    }
}

/// The initiator's side: one session per unit toward `peer`.
pub struct Sender {
    sess: Sessions,
    peer: String,
    asker: Asker,
    serial: AtomicU64,
}

impl Sender {
    fn new(sess: Sessions, peer: String, how: Ask) -> Sender {
        let asker = Asker { sess: sess.clone(), peer: peer.clone(), me: sess.name(), how };
        Sender { sess, peer, asker, serial: AtomicU64::new(0) }
    }

    /// Bench: asks go to the target side in this process.
    pub fn local(
        engine: &Engine,
        peer: String,
        asks: mpsc::UnboundedSender<(String, u64)>,
        concurrency: usize,
    ) -> kvmove::Result<Sender> {
        let sess = Sessions::start(engine.clone(), limits(concurrency))?;
        Ok(Sender::new(sess, peer, Ask::Local(asks)))
    }

    /// `initiator`: checks that the target at `peer` runs sessions over a
    /// plan with the same fingerprint, then asks by notification.
    pub async fn remote(engine: &Engine, peer: String, plan: &Plan, concurrency: usize) -> kvmove::Result<Sender> {
        let sess = Sessions::start(engine.clone(), limits(concurrency))?;
        let me = sess.name();
        let fp = fingerprint(plan);
        let hello = async {
            notify(&sess, &peer, encode(&Msg::Hello(fp))).await?;
            loop {
                sess.wait_notification().await?;
                for n in sess.take_notifications(256) {
                    match parse(&n.msg) {
                        Some(Msg::HelloOk) => return Ok(()),
                        Some(Msg::HelloRefused(theirs)) => {
                            return Err(Error::new(
                                ErrorKind::Config,
                                format!(
                                    "the target at {peer} runs sessions over another workload (plan {theirs:016x}, \
                                     this one {fp:016x}); start both sides with the same --model, --tokens, \
                                     --page-size, --layers, --bytes-per-token, --fragmentation and --seed"
                                ),
                            ));
                        }
                        _ => {}
                    }
                }
            }
        };
        let r: kvmove::Result<()> = match tokio::time::timeout(HELLO_WAIT, hello).await {
            Ok(r) => r,
            Err(_) => Err(Error::new(
                ErrorKind::Config,
                format!(
                    "the target at {peer} did not answer the session handshake within {} s; start it with \
                     `kvmove target --sessions true`, and let it reach this initiator at {me} (--listen)",
                    HELLO_WAIT.as_secs()
                ),
            )),
        };
        if let Err(e) = r {
            sess.shutdown().await;
            return Err(e);
        }
        Ok(Sender::new(sess, peer, Ask::Notify))
    }

    /// A new pass number (ids of its units are new).
    pub fn next_pass(&self) -> u64 {
        self.serial.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Opens the session `id` and asks the target to grant it. `early`:
    /// the writes start later (a layer pass), so a task waits for the
    /// grant meanwhile and its wait is measured when it comes; otherwise
    /// [`Sender::granted`] waits itself, at once.
    pub async fn open(&self, id: u64, early: bool) -> kvmove::Result<Open> {
        let started = Instant::now();
        self.sess.expect(&self.peer, id).map_err(|e| e.with("session", id))?;
        self.asker.ask(id).await.map_err(|e| e.with("session", id))?;
        let waiter = early.then(|| tokio::spawn(self.asker.clone().grant(id)));
        Ok(Open { id, started, waiter, granted: None })
    }

    /// Whether the unit's grant was taken already ([`Sender::granted`]).
    pub fn is_granted(o: &Open) -> bool {
        o.granted.is_some()
    }

    /// Waits for the grant and returns the segment session writes go to.
    pub async fn granted(&self, o: &mut Open) -> kvmove::Result<SegmentId> {
        let at = match o.waiter.take() {
            Some(w) => match w.await {
                Ok(r) => r,
                Err(e) => return Err(Error::new(ErrorKind::Internal, format!("the grant waiter stopped: {e}"))),
            },
            None => self.asker.clone().grant(o.id).await,
        };
        o.granted = Some(at.map_err(|e| e.with("session", o.id))?);
        self.sess.segment(&self.peer).await
    }

    /// Writes `batch` for the session `id` (checked against its grant).
    pub async fn write(&self, id: u64, batch: Vec<TransferRequest>) -> kvmove::Result<()> {
        self.sess
            .write(&self.peer, id, batch)
            .await
            .and_then(|o| o.into_result())
            .map_err(|e| e.with("session", id))?;
        Ok(())
    }

    /// Every write of the unit completed: finishes and waits for Landed.
    pub async fn land(&self, o: Open) -> kvmove::Result<UnitTimes> {
        let key = SessionKey::new(self.peer.clone(), o.id, Role::Sender);
        self.sess.finish(&self.peer, o.id).map_err(|e| e.with("session", o.id))?;
        let finished_at = Instant::now();
        let st = self.sess.wait(&key).await.map_err(|e| e.with("session", o.id))?;
        let landed_at = Instant::now();
        let _ = self.sess.release(&key);
        if st != SessionState::Landed {
            let why = match &st {
                SessionState::Failed(e) => format!(": {e}"),
                _ => String::new(),
            };
            return Err(Error::new(ErrorKind::Internal, format!("the session ended {}{why}", st.name()))
                .with("session", o.id)
                .with("peer", &self.peer));
        }
        let granted = o.granted.unwrap_or(o.started);
        Ok(UnitTimes {
            id: o.id,
            grant_wait: granted.saturating_duration_since(o.started),
            time_to_landed: landed_at.saturating_duration_since(o.started),
            finish_to_landed: landed_at.saturating_duration_since(finished_at),
            finished_at,
            landed_at,
        })
    }

    /// Stops the session engine.
    pub async fn shutdown(&self) {
        self.sess.shutdown().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_name_their_unit() {
        for (serial, unit) in [(1, Unit::Plan), (1, Unit::Request(0)), (77, Unit::Request((1 << 24) - 1))] {
            let id = unit_id(serial, unit);
            assert_ne!(id, 0);
            assert_eq!(unit_of(id), unit);
            assert_eq!(id >> UNIT_BITS, serial);
        }
        assert_ne!(unit_id(1, Unit::Request(3)), unit_id(2, Unit::Request(3)));
    }

    #[test]
    fn messages_round_trip_and_junk_is_ignored() {
        for m in [Msg::Hello(0xdead_beef), Msg::HelloOk, Msg::HelloRefused(7), Msg::Ask(1 << 40)] {
            assert_eq!(parse(encode(&m).as_bytes()), Some(m));
        }
        assert_eq!(parse(format!("{PREFIX}grant 5").as_bytes()), Some(Msg::Ask(5)), "an earlier build's ask");
        for junk in [&b"kvmove/1 grant x"[..], b"kvmove/2 grant 1", b"grant 1", b"\xff\xfe", b""] {
            assert_eq!(parse(junk), None);
        }
    }
}
