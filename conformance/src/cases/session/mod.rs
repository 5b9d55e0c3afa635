//! Sessions (rules 12 and 13), driven by `kvmove_policy::Sessions` over an
//! `Engine` on this backend, between a sender ("prefill", writes the KV) and
//! a receiver ("decode", owns the memory and grants):
//!
//! - Rule 12, admission is the receiver's: nothing is sent without a grant, and
//!   nothing on the data path times out while a sender waits for one; the
//!   deadline starts at the grant; a write outside the grant is refused
//!   before a byte moves.
//! - Rule 13, both ends agree: each side's state only moves forward, both reach
//!   the same final state (landed, failed, cancelled, expired) within the
//!   deadline or the liveness timeout whatever the faults, late, duplicate
//!   or forged messages change nothing, and session and inbox counts
//!   return to their baseline after teardown.
//!
//! The session engine runs with short timers ([`HEARTBEAT`], [`LIVENESS`])
//! so that failures are seen within a case; every wait is bounded.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::future::join_all;
use kvmove_policy::session::wire::{decode, unbundle, Body, Message, Outcome, Verdict, MAGIC};
use kvmove_policy::session::{
    Grant, Role, SessionCounts, SessionKey, SessionLimits, SessionState, GRANT_RANGES_PER_MESSAGE,
};
use kvmove_policy::{Engine, PolicyConfig, RetryConfig, Sessions, TransferOutcome};
use parking_lot::Mutex;
use tokio::task::JoinHandle;
use transport_core::{
    Access, ErrorKind, Layer, Notification, RegionId, ResourceStats, Result as TResult, SegmentId, TransferRequest,
    Transport, MAX_NOTIFY_LEN,
};

use crate::ctx::{bounded, expect_permanent, expect_quiet, open, settle, Ctx, SETTLE};
use crate::ensure;
use crate::guard::{first_difference, pattern, Guarded};
use crate::harness::{Node, NodeOptions};
use crate::outcome::{CaseError, CaseResult};
use crate::timeline::wait_limit;

/// Heartbeat period of the session engines under test.
const HEARTBEAT: Duration = Duration::from_millis(100);
/// A peer silent this long fails its sessions. Three seconds (30
/// heartbeats): the soft-RoCE VM emulates its CPUs, and there a live
/// peer's messages once went unheard for 2.2 s, the session timer itself
/// running up to 0.2 s late (`session::sender_cancels` failed so once in
/// CI and once in 220 runs next to two busy loops); a live peer's answers
/// must not look like silence.
const LIVENESS: Duration = Duration::from_millis(3000);
/// What a timed end may take beyond its timer (scheduling, delivery), on
/// a machine of the default wait limit; see [`slack`]. 2 s: at a load of 8
/// on 2 cores (the CI job's steps side by side) a sender whose receiver
/// was killed mid-transfer ended 1.54 s past its liveness timer
/// (tcp_pull::device_d2h::session::peer_killed); a missing liveness check
/// never ends at all, so the margin does not hide one.
const SLACK: Duration = Duration::from_secs(2);

/// What a timed end may take beyond its timer here: [`SLACK`], or a
/// twentieth of the harness's wait limit where that was raised for a slow
/// machine (`CONFORMANCE_WAIT_S`). In the VM,
/// beside the vLLM servers, a sender whose receiver was killed mid-transfer
/// once had no final state 1 s past its liveness timer (ci43,
/// rdma_rails2::device_d2h::session::peer_killed).
fn slack() -> Duration {
    SLACK.max(wait_limit() / 20)
}
/// How long a session with no fault in its way may take to end once its
/// end was decided (a cancel, a finish, a resumed stall).
const ENDS_WITHIN: Duration = Duration::from_secs(3);
/// A deadline no case reaches unless it means to.
const LONG: Duration = Duration::from_secs(20);
/// How long memory is watched to be sure nothing more lands.
const QUIET: Duration = Duration::from_millis(300);
/// Largest request the cases build (smaller if the backend says so).
const CHUNK: u64 = 128 << 10;
/// The area a streaming sender rewrites again and again.
const AREA: u64 = 2 << 20;
/// Writes of a streaming sender, at most.
const MAX_WRITES: u64 = 20_000;

fn limits() -> SessionLimits {
    SessionLimits { heartbeat_interval: HEARTBEAT, liveness_timeout: LIVENESS, ..SessionLimits::default() }
}

/// Fast retries for about 4 s in all (an RDMA link cut in the soft-RoCE
/// VM takes about a second to come back) and a breaker that does not open
/// within a case: the policy carries writes through transient failures.
fn policy() -> PolicyConfig {
    let mut cfg = PolicyConfig {
        retry: RetryConfig {
            max_attempts: 40,
            initial_backoff: Duration::from_millis(2),
            max_backoff: Duration::from_millis(100),
            ..RetryConfig::default()
        },
        ..PolicyConfig::default()
    };
    cfg.breaker.failure_threshold = 1000;
    cfg
}

/// One side: a node, its session engine, and one registered region.
struct Side {
    node: Node,
    s: Sessions,
    mem: Guarded,
    region: RegionId,
    /// The transport's counts before its session engine started.
    base: ResourceStats,
}

impl Side {
    fn t(&self) -> &Arc<dyn Transport> {
        &self.node.transport
    }
}

async fn side(cx: &Ctx, len: usize, seed: u64, access: Access) -> Result<Side, CaseError> {
    let node = cx.node(&NodeOptions::default()).await?;
    side_on(cx, node, len, seed, access)
}

/// A side on `node`: its region registered, then its session engine.
fn side_on(cx: &Ctx, node: Node, len: usize, seed: u64, access: Access) -> Result<Side, CaseError> {
    // The sender registers for local use only, the receiver for peers.
    let mem = if access == Access::LOCAL { cx.guarded_local(len, seed)? } else { cx.guarded(len, seed)? };
    let region = node.transport.register(mem.region(), access)?;
    let base = node.transport.stats();
    let engine = Engine::new(node.transport.clone(), policy())?;
    let s = Sessions::start(engine, limits())
        .map_err(|e| CaseError::Fail(format!("Sessions::start over this backend failed: {e}")))?;
    Ok(Side { node, s, mem, region, base })
}

/// A write of `len` bytes from the sender's `loff` to the receiver's
/// `roff` (offsets into the two regions).
#[derive(Debug, Clone, Copy)]
struct Part {
    loff: u64,
    roff: u64,
    len: u64,
}

const fn part(loff: u64, roff: u64, len: u64) -> Part {
    Part { loff, roff, len }
}

/// A sender `p` ("prefill") with a local region and a receiver `d`
/// ("decode") with a remotely writable one, each with its session engine.
struct Duo {
    p: Side,
    d: Side,
    /// Their names as peers (`Sessions::name`).
    pn: String,
    dn: String,
}

impl Duo {
    async fn new(cx: &Ctx, len: usize) -> Result<Self, CaseError> {
        let p = side(cx, len, 11, Access::LOCAL).await?;
        let d = side(cx, len, 12, Access::REMOTE_RW).await?;
        let (pn, dn) = (p.s.name(), d.s.name());
        Ok(Self { p, d, pn, dn })
    }

    /// [`Duo::new`] with a [`Tap`] under each side's session engine.
    async fn tapped(cx: &Ctx, len: usize) -> Result<(Self, Arc<Tap>, Arc<Tap>), CaseError> {
        let opts = NodeOptions::default();
        let (tp, td) = (Tap::slot(), Tap::slot());
        let (a, b) = (tp.clone(), td.clone());
        let np = cx.node_layered(&opts, move |t| Tap::install(&a, t)).await?;
        let nd = cx.node_layered(&opts, move |t| Tap::install(&b, t)).await?;
        let p = side_on(cx, np, len, 11, Access::LOCAL)?;
        let d = side_on(cx, nd, len, 12, Access::REMOTE_RW)?;
        let (pn, dn) = (p.s.name(), d.s.name());
        let taps = (Tap::take(&tp)?, Tap::take(&td)?);
        Ok((Self { p, d, pn, dn }, taps.0, taps.1))
    }

    /// The sender's key of session `id`.
    fn ks(&self, id: u64) -> SessionKey {
        SessionKey::new(self.dn.clone(), id, Role::Sender)
    }

    /// The receiver's key of session `id`.
    fn kr(&self, id: u64) -> SessionKey {
        SessionKey::new(self.pn.clone(), id, Role::Receiver)
    }

    /// A grant of `(offset, len)` ranges of the receiver's region, expecting
    /// all of their bytes.
    fn grant_of(&self, ranges: &[(u64, u64)], deadline: Duration) -> Grant {
        let base = self.d.mem.addr();
        Grant {
            ranges: ranges.iter().map(|&(o, l)| (base + o, l)).collect(),
            expected: ranges.iter().map(|r| r.1).sum(),
            deadline,
        }
    }

    /// The receiver grants `ranges` for `id`.
    async fn grant(&self, id: u64, ranges: &[(u64, u64)], deadline: Duration) -> Result<Grant, CaseError> {
        let g = self.grant_of(ranges, deadline);
        bounded("grant", self.d.s.grant(&self.pn, id, g.clone()))
            .await?
            .map_err(|e| CaseError::Fail(format!("the receiver's grant of session {id} failed: {e}")))?;
        Ok(g)
    }

    /// The sender waits (bounded) for the grant of `id`.
    async fn wait_grant(&self, id: u64) -> Result<Grant, CaseError> {
        bounded("wait_grant", self.p.s.wait_grant(&self.dn, id))
            .await?
            .map_err(|e| CaseError::Fail(format!("the sender's wait_grant of session {id} failed: {e}")))
    }

    /// The segment the sender's session engine uses toward the receiver.
    async fn seg(&self) -> Result<SegmentId, CaseError> {
        bounded("Sessions::segment", self.p.s.segment(&self.dn))
            .await?
            .map_err(|e| CaseError::Fail(format!("Sessions::segment toward the receiver failed: {e}")))
    }

    /// Requests for `parts` over `seg`, cut into pieces the backend takes.
    fn requests(&self, seg: SegmentId, parts: &[Part]) -> Vec<TransferRequest> {
        let chunk = CHUNK.min(self.p.t().capabilities().max_request_len).max(1);
        let base = self.d.mem.addr();
        let mut out = Vec::new();
        for p in parts {
            let mut at = 0;
            while at < p.len {
                let n = chunk.min(p.len - at);
                out.push(TransferRequest::write(self.p.region, p.loff + at, seg, base + p.roff + at, n));
                at += n;
            }
        }
        out
    }

    /// The sender writes `parts` for session `id` (over the segment its
    /// session engine uses now); `Ok(Err(e))` when no segment could be had
    /// (a dead peer) or the session engine refused or failed the write.
    async fn write(&self, id: u64, parts: &[Part]) -> Result<TResult<TransferOutcome>, CaseError> {
        let seg = match bounded("Sessions::segment", self.p.s.segment(&self.dn)).await? {
            Ok(seg) => seg,
            Err(e) => return Ok(Err(e)),
        };
        let reqs = self.requests(seg, parts);
        bounded("Sessions::write", self.p.s.write(&self.dn, id, reqs)).await
    }

    /// A write that must complete.
    async fn write_ok(&self, id: u64, parts: &[Part], what: &str) -> CaseResult {
        match self.write(id, parts).await? {
            Ok(o) if o.is_success() => Ok(()),
            Ok(o) => Err(CaseError::Fail(format!(
                "{what}: the write ended {:?} after {} attempt(s): {:?}",
                o.state,
                o.attempts,
                o.first_error().map(ToString::to_string)
            ))),
            Err(e) => Err(CaseError::Fail(format!("{what}: the write was refused: {e}"))),
        }
    }

    /// The sender finishes `id`.
    fn finish(&self, id: u64) -> CaseResult {
        self.p.s.finish(&self.dn, id).map_err(|e| CaseError::Fail(format!("finish of session {id} failed: {e}")))
    }

    /// The receiver's bytes once `parts` landed on `before`.
    fn model(&self, before: &[u8], parts: &[Part]) -> Vec<u8> {
        let src = self.p.mem.snapshot();
        let mut want = before.to_vec();
        for p in parts {
            let (l, r, n) = (p.loff as usize, p.roff as usize, p.len as usize);
            want[r..r + n].copy_from_slice(&src[l..l + n]);
        }
        want
    }

    /// Both sides end (bounded) in the same state, named `want`.
    async fn both_end(&self, id: u64, want: &str, within: Duration, what: &str) -> CaseResult {
        let (ks, kr) = (self.ks(id), self.kr(id));
        let (wp, wd) = (format!("{what}: the sender"), format!("{what}: the receiver"));
        let (a, b) = tokio::join!(ends(&self.p.s, &ks, within, &wp), ends(&self.d.s, &kr, within, &wd));
        let (a, b) = (a?, b?);
        ensure!(
            a == b,
            "{what}: the sender ended {}, the receiver {} (rule 13: both ends reach the same final state)",
            describe(&a),
            describe(&b)
        );
        expect_state(&a, want, what)
    }

    /// Both sides forget session `id`.
    fn release(&self, id: u64) -> CaseResult {
        self.p.s.release(&self.ks(id)).map_err(|e| CaseError::Fail(format!("sender release of {id}: {e}")))?;
        self.d.s.release(&self.kr(id)).map_err(|e| CaseError::Fail(format!("receiver release of {id}: {e}")))
    }

    /// No open and no lingering session on either side, no peer tracked.
    fn expect_no_sessions(&self, what: &str) -> CaseResult {
        for (who, s) in [("sender", &self.p.s), ("receiver", &self.d.s)] {
            let c = s.counts();
            ensure!(
                c.open == 0 && c.lingering == 0 && c.peers == 0,
                "{what}: the {who}'s session engine still counts {c:?} (rule 13: counts return to baseline)"
            );
        }
        Ok(())
    }

    /// Every received notification was taken from both transports.
    async fn expect_inboxes_empty(&self, what: &str) -> CaseResult {
        for (who, t) in [("sender", self.p.t()), ("receiver", self.d.t())] {
            let ok = settle(SETTLE, || t.stats().notifications == 0).await;
            ensure!(
                ok,
                "{what}: the {who}'s transport holds {} notification(s) (rule 13: inbox counts return to baseline)",
                t.stats().notifications
            );
        }
        Ok(())
    }
}

fn describe(st: &SessionState) -> String {
    match st {
        SessionState::Failed(e) => format!("failed ({e})"),
        st => st.name().to_owned(),
    }
}

fn state_now(s: &Sessions, key: &SessionKey) -> String {
    s.state(key).map_or_else(|| "unknown".to_owned(), |st| describe(&st))
}

/// Waits (bounded by `within`) for the final state of `key`.
async fn ends(s: &Sessions, key: &SessionKey, within: Duration, what: &str) -> Result<SessionState, CaseError> {
    let began = Instant::now();
    match tokio::time::timeout(within, s.wait(key)).await {
        Ok(Ok(st)) => Ok(st),
        Ok(Err(e)) => Err(CaseError::Fail(format!("{what}: waiting for the final state failed: {e}"))),
        Err(_) => {
            let then = state_now(s, key);
            // The case fails either way; how late the end was (if it came
            // within as long again) tells a slow machine from a hang.
            let later = match tokio::time::timeout(within, s.wait(key)).await {
                Ok(Ok(st)) => format!("; it ended {} {:?} after the wait began", describe(&st), began.elapsed()),
                Ok(Err(e)) => format!("; waiting on, it failed: {e}"),
                Err(_) => format!("; still {} {:?} after the wait began", state_now(s, key), began.elapsed()),
            };
            Err(CaseError::Fail(format!(
                "{what}: no final state within {within:?}, still {then} (rule 13: both ends reach a final state){later}"
            )))
        }
    }
}

fn expect_state(st: &SessionState, want: &str, what: &str) -> CaseResult {
    ensure!(st.name() == want, "{what}: ended {}, expected {want}", describe(st));
    Ok(())
}

/// A final `Failed` with a transient error (a peer died: worth retrying).
fn expect_peer_failure(st: &SessionState, what: &str) -> CaseResult {
    match st {
        SessionState::Failed(e) if e.is_transient() => Ok(()),
        SessionState::Failed(e) => Err(CaseError::Fail(format!("{what}: failed with {e}, which must be transient"))),
        st => Err(CaseError::Fail(format!("{what}: ended {}, expected failed (the peer died)", describe(st)))),
    }
}

fn rank(st: &SessionState) -> u8 {
    match st {
        SessionState::Waiting => 0,
        SessionState::Granted => 1,
        SessionState::Transferring => 2,
        _ => 3,
    }
}

/// Watches one side's state of a session every 2 ms: it must only move
/// forward, a final state must never change, and the session must not be
/// forgotten before it is released.
struct Watch {
    stop: Arc<AtomicBool>,
    task: JoinHandle<Result<Vec<&'static str>, CaseError>>,
}

fn watch(s: &Sessions, key: &SessionKey, what: &str) -> Watch {
    let (s, key, what) = (s.clone(), key.clone(), what.to_owned());
    let stop = Arc::new(AtomicBool::new(false));
    let halt = stop.clone();
    let task = tokio::spawn(async move {
        let mut seen: Vec<&'static str> = Vec::new();
        let mut last: Option<SessionState> = None;
        loop {
            let done = halt.load(Ordering::SeqCst);
            match (s.state(&key), &last) {
                (None, Some(l)) => {
                    return Err(CaseError::Fail(format!(
                        "{what}: the session was forgotten while {} (before its release)",
                        describe(l)
                    )))
                }
                (None, None) => {}
                (Some(st), l) => {
                    if let Some(l) = l {
                        ensure!(
                            !(l.is_final() && st != *l),
                            "{what}: a final state changed: {} -> {} (rule 13)",
                            describe(l),
                            describe(&st)
                        );
                        ensure!(
                            rank(&st) >= rank(l),
                            "{what}: the state went backwards: {} -> {} (rule 13)",
                            describe(l),
                            describe(&st)
                        );
                    }
                    if seen.last() != Some(&st.name()) {
                        seen.push(st.name());
                    }
                    last = Some(st);
                }
            }
            if done {
                return Ok(seen);
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    });
    Watch { stop, task }
}

impl Watch {
    /// Stops watching; the states seen, in order.
    async fn end(self) -> Result<Vec<&'static str>, CaseError> {
        self.stop.store(true, Ordering::SeqCst);
        bounded("a state watcher", self.task).await?.map_err(|e| CaseError::Fail(format!("a watcher panicked: {e}")))?
    }
}

/// Fills the sender's region with a distinct pattern per `layer` bytes.
fn fill_layers(mem: &Guarded, layer: u64) -> CaseResult {
    let n = mem.len() as u64 / layer;
    for k in 0..n {
        mem.write((k * layer) as usize, &pattern(100 + k, layer as usize))?;
    }
    Ok(())
}

/// Requires the receiver's region to equal `want`, naming the first
/// difference.
fn expect_bytes(mem: &Guarded, now: &[u8], want: &[u8], what: &str) -> CaseResult {
    mem.canaries_intact()?;
    if let Some(i) = first_difference(now, want) {
        return Err(CaseError::Fail(format!(
            "{what}: byte {i} of the receiver's region is {:#04x}, expected {:#04x}",
            now.get(i).copied().unwrap_or(0),
            want.get(i).copied().unwrap_or(0)
        )));
    }
    Ok(())
}

/// Concurrent writers of a streaming sender, each on its own part of the
/// area (so one write of the session is almost always in flight).
const WRITERS: u64 = 2;

/// One writer of a streaming sender: rewrites the receiver's
/// `[roff, roff + len)` again and again, from the two halves of the
/// sender's region in turn (distinct bytes), until a write is refused or
/// does not complete; counts completed writes in `done`. Returns how it
/// stopped.
async fn stream(duo: Arc<Duo>, id: u64, roff: u64, len: u64, done: Arc<AtomicU64>) -> Result<String, CaseError> {
    for k in 0..MAX_WRITES {
        let loff = (k % 2) * AREA + roff;
        match duo.write(id, &[part(loff, roff, len)]).await? {
            Ok(o) if o.is_success() => {
                done.fetch_add(1, Ordering::SeqCst);
            }
            Ok(o) => return Ok(format!("write {k} ended {:?}", o.state)),
            Err(e) => return Ok(format!("write {k} was refused ({e})")),
        }
    }
    Ok(format!("all {MAX_WRITES} writes completed"))
}

/// A streaming sender on a session granted `[0, AREA)`: [`WRITERS`] tasks.
struct Streams(Vec<JoinHandle<Result<String, CaseError>>>);

/// Starts a streaming sender on session `id` (granted `[0, AREA)`) and
/// waits until `n` of its writes completed.
async fn start_stream(duo: &Arc<Duo>, id: u64, n: u64) -> Result<Streams, CaseError> {
    let done = Arc::new(AtomicU64::new(0));
    let each = AREA / WRITERS;
    let writers: Vec<_> =
        (0..WRITERS).map(|j| tokio::spawn(stream(duo.clone(), id, j * each, each, done.clone()))).collect();
    let ended = |w: &[JoinHandle<Result<String, CaseError>>]| w.iter().any(JoinHandle::is_finished);
    // Bounded generously: the first writes may include building the path
    // (a QP bring-up takes about a second in the soft-RoCE VM).
    let ok = settle(wait_limit(), || done.load(Ordering::SeqCst) >= n || ended(&writers)).await;
    if ok && !ended(&writers) {
        return Ok(Streams(writers));
    }
    let n = done.load(Ordering::SeqCst);
    let how = if ok {
        join_stream(Streams(writers)).await.map(|h| h.join("; "))
    } else {
        writers.iter().for_each(JoinHandle::abort);
        Err(CaseError::Fail("still writing".into()))
    };
    Err(CaseError::Fail(format!("the sender's writes did not run: {n} completed within {:?} ({how:?})", wait_limit())))
}

/// Joins a streaming sender (bounded); how each writer stopped.
async fn join_stream(writers: Streams) -> Result<Vec<String>, CaseError> {
    let mut how = Vec::new();
    for w in writers.0 {
        how.push(
            bounded("the sender's writes", w)
                .await?
                .map_err(|e| CaseError::Fail(format!("a writer panicked: {e}")))??,
        );
    }
    Ok(how)
}

/// Requires every writer of a streaming sender to have been stopped by the
/// session's end.
async fn expect_stopped(writers: Streams) -> CaseResult {
    let how = join_stream(writers).await?;
    ensure!(!how.iter().any(|h| h.starts_with("all ")), "the sender never stopped writing: {}", how.join("; "));
    Ok(())
}

/// The layers most cases write: eight of 256 KiB.
const LAYER: u64 = 256 << 10;
const LAYERS: u64 = 8;

mod admission;
mod agreement;
mod forged;
mod teardown;

pub use admission::*;
pub use agreement::*;
pub use forged::*;
pub use teardown::*;

use forged::Tap;
