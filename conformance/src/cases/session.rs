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
use kvmove_policy::session::{Grant, Role, SessionCounts, SessionKey, SessionLimits, SessionState, MAX_GRANT_RANGES};
use kvmove_policy::{Engine, PolicyConfig, RetryConfig, Sessions, TransferOutcome};
use parking_lot::Mutex;
use tokio::task::JoinHandle;
use transport_core::{
    Access, ErrorKind, Layer, Notification, RegionId, ResourceStats, Result as TResult, SegmentId, TransferRequest,
    Transport, MAX_NOTIFY_LEN,
};

use crate::ctx::{bounded, expect_permanent, expect_quiet, open, settle, Ctx, SETTLE, WAIT_LIMIT};
use crate::ensure;
use crate::guard::{first_difference, pattern, Guarded};
use crate::harness::{Node, NodeOptions};
use crate::outcome::{CaseError, CaseResult};

/// Heartbeat period of the session engines under test.
const HEARTBEAT: Duration = Duration::from_millis(100);
/// A peer silent this long fails its sessions. Two seconds: in the
/// soft-RoCE VM a QP bring-up can hold a runtime worker for about a second,
/// and a live peer's answers must not look like silence.
const LIVENESS: Duration = Duration::from_millis(2000);
/// What a timed end may take beyond its timer (scheduling, delivery).
const SLACK: Duration = Duration::from_secs(1);
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
    match tokio::time::timeout(within, s.wait(key)).await {
        Ok(Ok(st)) => Ok(st),
        Ok(Err(e)) => Err(CaseError::Fail(format!("{what}: waiting for the final state failed: {e}"))),
        Err(_) => Err(CaseError::Fail(format!(
            "{what}: no final state within {within:?}, still {} (rule 13: both ends reach a final state)",
            state_now(s, key)
        ))),
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
    let ok = settle(WAIT_LIMIT, || done.load(Ordering::SeqCst) >= n || ended(&writers)).await;
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
    Err(CaseError::Fail(format!("the sender's writes did not run: {n} completed within {WAIT_LIMIT:?} ({how:?})")))
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

// ---------------------------------------------------------------------------
// landed_on_both_sides

const LAYER: u64 = 256 << 10;
const LAYERS: u64 = 8;

/// Grant of two ranges with a gap, eight layers of 256 KiB (each one
/// `write` call of several requests, each with its own bytes), finish: both
/// sides `Landed`, every byte in the receiver's memory the moment its state
/// turns `Landed` (gaps and canaries unchanged), states only forward, and
/// the counts back to baseline after release.
pub async fn landed_on_both_sides(cx: Ctx) -> CaseResult {
    let half = LAYERS / 2 * LAYER;
    let gap = 128 << 10;
    let duo = Arc::new(Duo::new(&cx, (2 * half + 2 * gap) as usize).await?);
    fill_layers(&duo.p.mem, LAYER)?;
    let id = 42;
    let (ks, kr) = (duo.ks(id), duo.kr(id));
    duo.expect_no_sessions("before the session")?;
    let base = (duo.p.s.counts(), duo.d.s.counts());

    duo.p.s.expect(&duo.dn, id)?;
    let ws = watch(&duo.p.s, &ks, "the sender");
    let ranges = [(gap, half), (2 * gap + half, half)];
    let g = duo.grant(id, &ranges, LONG).await?;
    let wr = watch(&duo.d.s, &kr, "the receiver");
    let got = duo.wait_grant(id).await?;
    ensure!(got == g, "the sender got the grant {got:?}, the receiver granted {g:?}");

    // Layer k: sender bytes [k * LAYER, ...) to the k-th slot of the ranges.
    let parts: Vec<Part> = (0..LAYERS)
        .map(|k| {
            let (off, i) = if k < LAYERS / 2 { (ranges[0].0, k) } else { (ranges[1].0, k - LAYERS / 2) };
            part(k * LAYER, off + i * LAYER, LAYER)
        })
        .collect();
    let before = duo.d.mem.snapshot();
    let want = duo.model(&before, &parts);
    // The receiver looks at its memory the moment its state turns final.
    let d2 = duo.clone();
    let landing = tokio::spawn(async move {
        let st = ends(&d2.d.s, &d2.kr(id), ENDS_WITHIN + LONG, "the receiver").await;
        (st, d2.d.mem.snapshot())
    });
    for (k, p) in parts.iter().enumerate() {
        duo.write_ok(id, &[*p], &format!("layer {k}")).await?;
        let st = duo.p.s.state(&ks);
        ensure!(
            matches!(st, Some(SessionState::Transferring)),
            "after layer {k} the sender's state is {}, expected transferring",
            state_now(&duo.p.s, &ks)
        );
    }
    duo.finish(id)?;
    let (st, now) = bounded("the receiver's landing", landing)
        .await?
        .map_err(|e| CaseError::Fail(format!("the receiver's watcher panicked: {e}")))?;
    expect_state(&st?, "landed", "the receiver")?;
    expect_bytes(
        &duo.d.mem,
        &now,
        &want,
        "when the receiver's state turned landed (rule 13: landed means every byte)",
    )?;
    duo.both_end(id, "landed", ENDS_WITHIN, "a granted, written and finished session").await?;
    let (seen_p, seen_r) = (ws.end().await?, wr.end().await?);
    ensure!(
        seen_p.last() == Some(&"landed") && seen_r.last() == Some(&"landed"),
        "the sender went through {seen_p:?}, the receiver through {seen_r:?}"
    );
    duo.d.mem.expect(&want, "after both sides landed")?;

    duo.release(id)?;
    duo.expect_no_sessions("after release")?;
    let now = (duo.p.s.counts(), duo.d.s.counts());
    ensure!(
        now.0.open == base.0.open && now.1.open == base.1.open,
        "open sessions {now:?} after release, {base:?} before"
    );
    duo.expect_inboxes_empty("after release").await
}

// ---------------------------------------------------------------------------
// no_grant_no_send

/// Without a grant a write is refused and no byte of the receiver changes
/// (no session at all, then a session waiting for its grant). A sender
/// waiting for a live but busy receiver stays `Waiting` for three liveness
/// timeouts (nothing fails, nothing is sent); then the grant comes and the
/// session lands.
pub async fn no_grant_no_send(cx: Ctx) -> CaseResult {
    let len = 1 << 20;
    let duo = Duo::new(&cx, len).await?;
    let id = 5;
    let (ks, kr) = (duo.ks(id), duo.kr(id));
    let before = duo.d.mem.snapshot();
    let all = [part(0, 0, len as u64)];

    let r = duo.write(id, &all).await?;
    expect_permanent(r, &[ErrorKind::InvalidHandle, ErrorKind::InvalidRequest], "a write for an unknown session")?;
    duo.p.s.expect(&duo.dn, id)?;
    let r = duo.write(id, &all).await?;
    expect_permanent(r, &[ErrorKind::InvalidRequest], "a write for a session waiting for its grant (rule 12)")?;
    duo.d.mem.expect(&before, "after refused writes without a grant (rule 12: nothing is sent)")?;

    // Live but busy: the receiver grants nothing for a while.
    let waited = 3 * LIVENESS;
    let end = Instant::now() + waited;
    while Instant::now() < end {
        let st = duo.p.s.state(&ks);
        ensure!(
            matches!(st, Some(SessionState::Waiting)),
            "a sender waiting for a live receiver's grant became {} (rule 12: nothing times out without a grant)",
            state_now(&duo.p.s, &ks)
        );
        ensure!(duo.d.s.state(&kr).is_none(), "the receiver knows a session it never granted");
        duo.d.mem.expect(&before, "while the sender waits for a grant (rule 12: nothing is sent)")?;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    duo.grant(id, &[(0, len as u64)], LONG).await?;
    duo.wait_grant(id).await?;
    duo.write_ok(id, &all, "the write after the grant").await?;
    duo.finish(id)?;
    duo.both_end(id, "landed", ENDS_WITHIN, &format!("after {waited:?} waiting for the grant")).await?;
    duo.d.mem.expect(&duo.model(&before, &all), "the landed session")?;
    duo.release(id)
}

// ---------------------------------------------------------------------------
// write_outside_grant_refused

/// A grant of two ranges with a gap; writes partly or wholly outside them,
/// across the gap, past the receiver's memory, with `addr + len`
/// overflowing, and a batch with one good and one bad request: each is
/// refused with a permanent `OutOfBounds` before a byte moves (the
/// receiver's memory, canaries included, unchanged, also a while later),
/// and the session stays open and lands afterwards.
pub async fn write_outside_grant_refused(cx: Ctx) -> CaseResult {
    let len: u64 = 1 << 20;
    let duo = Duo::new(&cx, len as usize).await?;
    let id = 9;
    let ks = duo.ks(id);
    let (a0, b0, gl) = (128 << 10, 384 << 10, 128 << 10);
    duo.p.s.expect(&duo.dn, id)?;
    duo.grant(id, &[(a0, gl), (b0, gl)], LONG).await?;
    duo.wait_grant(id).await?;
    let before = duo.d.mem.snapshot();
    let seg = duo.seg().await?;
    let base = duo.d.mem.addr();
    let w = |loff: u64, addr: u64, n: u64| TransferRequest::write(duo.p.region, loff, seg, addr, n);

    let cases: Vec<(&str, Vec<TransferRequest>)> = vec![
        ("a write starting one byte before the grant", vec![w(0, base + a0 - 1, 4096)]),
        ("a write ending one byte past a granted range", vec![w(0, base + a0 + gl - 4095, 4096)]),
        ("a write across the gap between two granted ranges", vec![w(0, base + a0, b0 + 4096 - a0)]),
        ("a write wholly before the grant", vec![w(0, base, 4096)]),
        ("a write wholly after the grant", vec![w(0, base + b0 + gl, 4096)]),
        ("a write past the receiver's memory", vec![w(0, base + len + 4096, 4096)]),
        ("a write whose addr + len overflows", vec![w(0, u64::MAX - 100, 4096)]),
        ("a write from a granted address whose len overflows", vec![w(0, base + a0, u64::MAX - (base + a0) + 1)]),
        (
            "a batch with a good request then one past the grant",
            vec![w(0, base + a0, 4096), w(0, base + b0 + gl - 100, 4096)],
        ),
    ];
    for (what, reqs) in cases {
        let mixed = reqs.len() > 1;
        let r = bounded("Sessions::write", duo.p.s.write(&duo.dn, id, reqs)).await?;
        let e = expect_permanent(r, &[ErrorKind::OutOfBounds], &format!("{what} (rule 12)"))?;
        if mixed {
            ensure!(
                e.context_value("request") == Some("1"),
                "{what}: the error {e} does not name the failing request (index 1)"
            );
        }
        duo.d.mem.expect(&before, &format!("{what}: refused (rule 12: before a byte moves)"))?;
        let st = duo.p.s.state(&ks);
        ensure!(
            st.as_ref().is_some_and(|s| !s.is_final()),
            "{what}: the refused write ended the session ({})",
            state_now(&duo.p.s, &ks)
        );
    }
    expect_quiet(&duo.d.mem, &before, QUIET, "after writes outside the grant were refused (rule 12)").await?;

    let parts = [part(0, a0, gl), part(gl, b0, gl)];
    duo.write_ok(id, &parts, "the granted write after the refused ones").await?;
    duo.finish(id)?;
    duo.both_end(id, "landed", ENDS_WITHIN, "the session after refused writes").await?;
    duo.d.mem.expect(&duo.model(&before, &parts), "the landed session")?;
    duo.release(id)
}

// ---------------------------------------------------------------------------
// deadline_starts_at_grant

/// The deadline of the first session (its write and finish must fit in it
/// on a loaded machine).
const D1: Duration = Duration::from_millis(3000);
/// The deadline of the stalled session.
const D2: Duration = Duration::from_millis(200);
/// How long the stall lasts: past `D2`, well within [`LIVENESS`].
const STALL_FOR: Duration = Duration::from_millis(450);

/// A sender waits longer than the grant's deadline *before* the grant, then gets
/// the grant and still lands (the deadline starts at the grant). A second
/// session: traffic to the receiver stalled right after its grant, for
/// longer than its deadline (not longer than the liveness timeout), then
/// resumed: both sides end `Expired`, and the receiver's memory is quiet
/// once its state is final.
pub async fn deadline_starts_at_grant(cx: Ctx) -> CaseResult {
    let len = 1 << 20;
    let duo = Arc::new(Duo::new(&cx, len).await?);
    // The path is set up before the first session (a plain write), so its
    // deadline times the session, not a first connection.
    let seg = duo.seg().await?;
    let warm = TransferRequest::write(duo.p.region, 0, seg, duo.d.mem.addr(), 8);
    let warmed = bounded("the warm-up write", duo.p.s.engine().transfer(vec![warm])).await?;
    ensure!(warmed.as_ref().is_ok_and(|o| o.is_success()), "the warm-up write failed: {warmed:?}");
    let before = duo.d.mem.snapshot();
    let all = [part(0, 0, len as u64)];

    let id = 1;
    duo.p.s.expect(&duo.dn, id)?;
    let before_grant = D1 + Duration::from_secs(1);
    tokio::time::sleep(before_grant).await;
    let ks = duo.ks(id);
    ensure!(
        matches!(duo.p.s.state(&ks), Some(SessionState::Waiting)),
        "a sender waiting {before_grant:?} for a grant is {} (rule 12: no deadline before the grant)",
        state_now(&duo.p.s, &ks)
    );
    duo.grant(id, &[(0, len as u64)], D1).await?;
    duo.wait_grant(id).await?;
    duo.write_ok(id, &all, &format!("a write right after a grant with a {D1:?} deadline (rule 12)")).await?;
    duo.finish(id)?;
    duo.both_end(id, "landed", D1 + SLACK, &format!("a session granted after the sender waited {before_grant:?}"))
        .await?;
    duo.d.mem.expect(&duo.model(&before, &all), "the landed session")?;
    duo.release(id)?;

    // A stall past the deadline after the grant.
    let id = 2;
    duo.p.s.expect(&duo.dn, id)?;
    duo.grant(id, &[(0, len as u64)], D2).await?;
    duo.wait_grant(id).await?;
    cx.stall(&duo.d.node, true).await?;
    let stalled_at = Instant::now();
    let d2 = duo.clone();
    let writer = tokio::spawn(async move { d2.write(id, &[part(len as u64 / 2, 0, len as u64 / 2)]).await });
    tokio::time::sleep(STALL_FOR.saturating_sub(stalled_at.elapsed())).await;
    cx.stall(&duo.d.node, false).await?;
    let r = duo
        .both_end(
            id,
            "expired",
            LIVENESS + SLACK,
            &format!("a session stalled for {STALL_FOR:?} right after a grant with a {D2:?} deadline (rule 12)"),
        )
        .await;
    let snap = duo.d.mem.snapshot();
    r?;
    expect_quiet(&duo.d.mem, &snap, QUIET, "the receiver's memory once its session expired (rule 13)").await?;
    let wrote = bounded("the stalled write", writer)
        .await?
        .map_err(|e| CaseError::Fail(format!("the stalled writer panicked: {e}")))??;
    if let Ok(o) = &wrote {
        ensure!(!o.is_success(), "a write stalled past the session's deadline completed");
    }
    duo.release(id)
}

// ---------------------------------------------------------------------------
// receiver_cancels_mid_transfer

/// A sender rewrites a 2 MiB grant again and again; after three writes the
/// receiver cancels: both sides `Cancelled` (bounded), and from the moment
/// the receiver's state is final no byte of its memory changes.
pub async fn receiver_cancels_mid_transfer(cx: Ctx) -> CaseResult {
    let duo = Arc::new(Duo::new(&cx, 2 * AREA as usize).await?);
    let id = 3;
    let (ks, kr) = (duo.ks(id), duo.kr(id));
    duo.p.s.expect(&duo.dn, id)?;
    duo.grant(id, &[(0, AREA)], LONG).await?;
    duo.wait_grant(id).await?;
    let (ws, wr) = (watch(&duo.p.s, &ks, "the sender"), watch(&duo.d.s, &kr, "the receiver"));
    let writer = start_stream(&duo, id, 3).await?;

    let st = match tokio::time::timeout(ENDS_WITHIN, duo.d.s.cancel(&kr)).await {
        Ok(r) => r.map_err(|e| CaseError::Fail(format!("the receiver's cancel failed: {e}")))?,
        Err(_) => {
            return Err(CaseError::Fail(format!(
                "the receiver's cancel mid-transfer did not end within {ENDS_WITHIN:?}: the receiver is {}, the \
                 sender {} (rule 13: both ends reach the same final state; the sender never confirmed)",
                state_now(&duo.d.s, &kr),
                state_now(&duo.p.s, &ks)
            )))
        }
    };
    // Final on the receiver: nothing of the session may land any more.
    let snap = duo.d.mem.snapshot();
    expect_state(&st, "cancelled", "the receiver's cancel")?;
    expect_quiet(&duo.d.mem, &snap, QUIET, "the receiver's memory after its state turned cancelled (rule 13)").await?;
    duo.both_end(id, "cancelled", ENDS_WITHIN, "a session the receiver cancelled mid-transfer").await?;
    expect_stopped(writer).await?;
    ws.end().await?;
    wr.end().await?;
    duo.release(id)?;
    duo.expect_no_sessions("after release")
}

// ---------------------------------------------------------------------------
// sender_cancels

/// The sender cancels mid-transfer: both sides `Cancelled`, the receiver's
/// memory quiet once final. A sender cancels before any grant (final at
/// once); the grant arrives later: the receiver ends `Cancelled` too, and
/// the sender's state does not move.
pub async fn sender_cancels(cx: Ctx) -> CaseResult {
    let duo = Arc::new(Duo::new(&cx, 2 * AREA as usize).await?);
    let id = 4;
    let (ks, kr) = (duo.ks(id), duo.kr(id));
    duo.p.s.expect(&duo.dn, id)?;
    duo.grant(id, &[(0, AREA)], LONG).await?;
    duo.wait_grant(id).await?;
    let (ws, wr) = (watch(&duo.p.s, &ks, "the sender"), watch(&duo.d.s, &kr, "the receiver"));
    let writer = start_stream(&duo, id, 3).await?;
    let st = match tokio::time::timeout(ENDS_WITHIN, duo.p.s.cancel(&ks)).await {
        Ok(r) => r.map_err(|e| CaseError::Fail(format!("the sender's cancel failed: {e}")))?,
        Err(_) => {
            return Err(CaseError::Fail(format!(
                "the sender's cancel mid-transfer did not end within {ENDS_WITHIN:?}: the sender is {}, the \
                 receiver {} (rule 13: both ends reach the same final state)",
                state_now(&duo.p.s, &ks),
                state_now(&duo.d.s, &kr)
            )))
        }
    };
    expect_state(&st, "cancelled", "the sender's cancel")?;
    let rs = ends(&duo.d.s, &kr, ENDS_WITHIN, "the receiver after the sender cancelled").await?;
    let snap = duo.d.mem.snapshot();
    expect_state(&rs, "cancelled", "the receiver after the sender cancelled (rule 13: both ends agree)")?;
    expect_quiet(&duo.d.mem, &snap, QUIET, "the receiver's memory after its state turned cancelled (rule 13)").await?;
    expect_stopped(writer).await?;
    ws.end().await?;
    wr.end().await?;
    duo.release(id)?;

    // Cancelled before the grant; the grant comes later.
    let id = 14;
    let (ks, kr) = (duo.ks(id), duo.kr(id));
    duo.p.s.expect(&duo.dn, id)?;
    let st = bounded("cancel", duo.p.s.cancel(&ks)).await??;
    expect_state(&st, "cancelled", "a sender's cancel before any grant")?;
    let ws = watch(&duo.p.s, &ks, "the sender cancelled before the grant");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let before = duo.d.mem.snapshot();
    duo.grant(id, &[(0, AREA)], LONG).await?;
    let rs = ends(&duo.d.s, &kr, ENDS_WITHIN, "a receiver granting a session its sender had cancelled").await?;
    expect_state(&rs, "cancelled", "a receiver granting a session its sender had cancelled (rule 13)")?;
    let r = bounded("wait_grant", duo.p.s.wait_grant(&duo.dn, id)).await?;
    ensure!(r.is_err(), "wait_grant of a cancelled session returned a grant: {r:?}");
    ensure!(
        matches!(duo.p.s.state(&ks), Some(SessionState::Cancelled)),
        "a late grant moved the cancelled sender to {} (rule 13)",
        state_now(&duo.p.s, &ks)
    );
    duo.d.mem.expect(&before, "a grant to a cancelled sender (nothing may be written)")?;
    ws.end().await?;
    duo.release(id)?;
    duo.expect_no_sessions("after release")
}

// ---------------------------------------------------------------------------
// peer_killed

/// Rounds of "the sender dies right after finish".
const FINISH_ROUNDS: u64 = 2;

/// A fresh pair whose receiver granted `[0, AREA)` for `id` to a sender
/// that has the grant.
async fn granted_duo(cx: &Ctx, id: u64) -> Result<Arc<Duo>, CaseError> {
    let duo = Arc::new(Duo::new(cx, 2 * AREA as usize).await?);
    duo.p.s.expect(&duo.dn, id)?;
    duo.grant(id, &[(0, AREA)], LONG).await?;
    duo.wait_grant(id).await?;
    Ok(duo)
}

/// Kills with the harness's hook: a receiver before the grant, a receiver
/// mid-transfer, a sender mid-transfer (the survivor ends `Failed`, with a
/// transient error, within the liveness timeout plus a margin), and a
/// sender right after `finish` (the receiver ends `Landed` with every byte,
/// or `Failed`; if the dead sender saw `Landed`, so did the receiver).
pub async fn peer_killed(cx: Ctx) -> CaseResult {
    let within = LIVENESS + SLACK;

    // The receiver dies before it grants.
    let duo = Duo::new(&cx, 64 << 10).await?;
    let id = 1;
    let ks = duo.ks(id);
    duo.p.s.expect(&duo.dn, id)?;
    tokio::time::sleep(4 * HEARTBEAT).await;
    ensure!(
        matches!(duo.p.s.state(&ks), Some(SessionState::Waiting)),
        "a sender waiting for a live receiver is {}",
        state_now(&duo.p.s, &ks)
    );
    cx.kill(&duo.d.node).await?;
    let st = ends(&duo.p.s, &ks, within, "a sender waiting for a grant from a killed receiver").await?;
    expect_peer_failure(&st, "a sender waiting for a grant from a killed receiver")?;

    // The receiver dies mid-transfer.
    let id = 2;
    let duo = granted_duo(&cx, id).await?;
    let writer = start_stream(&duo, id, 2).await?;
    cx.kill(&duo.d.node).await?;
    let st = ends(&duo.p.s, &duo.ks(id), within, "a sender whose receiver was killed mid-transfer").await?;
    expect_peer_failure(&st, "a sender whose receiver was killed mid-transfer")?;
    expect_stopped(writer).await?;

    // The sender dies mid-transfer.
    let id = 3;
    let duo = granted_duo(&cx, id).await?;
    let writer = start_stream(&duo, id, 2).await?;
    cx.kill(&duo.p.node).await?;
    let kr = duo.kr(id);
    let st = ends(&duo.d.s, &kr, within, "a receiver whose sender was killed mid-transfer").await?;
    let snap = duo.d.mem.snapshot();
    expect_peer_failure(&st, "a receiver whose sender was killed mid-transfer")?;
    expect_quiet(&duo.d.mem, &snap, QUIET, "the receiver's memory once its session failed").await?;
    expect_stopped(writer).await?;

    // The sender dies right after finish, before the receiver may have
    // seen it.
    for round in 0..FINISH_ROUNDS {
        let id = 10 + round;
        let duo = granted_duo(&cx, id).await?;
        let before = duo.d.mem.snapshot();
        let all = [part(0, 0, AREA)];
        duo.write_ok(id, &all, "the write before finish").await?;
        duo.finish(id)?;
        cx.kill(&duo.p.node).await?;
        let what = format!("round {round}: a receiver whose sender died right after finish");
        let rs = ends(&duo.d.s, &duo.kr(id), within, &what).await?;
        let snap = duo.d.mem.snapshot();
        match &rs {
            SessionState::Landed => expect_bytes(&duo.d.mem, &snap, &duo.model(&before, &all), &what)?,
            st => expect_peer_failure(st, &what)?,
        }
        expect_quiet(&duo.d.mem, &snap, QUIET, &format!("{what}: its memory once final")).await?;
        // The dead sender's own table ends too (it hears nothing more).
        let ps = ends(&duo.p.s, &duo.ks(id), within, &format!("{what}: the dead sender's table")).await?;
        ensure!(
            !(ps.name() == "landed" && rs.name() != "landed"),
            "{what}: the sender saw landed, the receiver ended {} (rule 13)",
            describe(&rs)
        );
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// frozen_side

/// A freeze past the liveness timeout: the peer gives the frozen side up.
const FREEZE: Duration = Duration::from_millis(3000);
/// A freeze the frozen side notices (a quarter of the liveness timeout or
/// more) and its peer forgives (under the liveness timeout).
const BRIEF: Duration = Duration::from_millis(1000);
/// Bytes of the frozen sessions.
const FROZEN_LEN: u64 = 256 << 10;

fn is_unknown(st: &SessionState) -> bool {
    matches!(st, SessionState::Failed(e) if e.kind() == ErrorKind::OutcomeUnknown)
}

/// Holds one side's session engine for `d` (`Sessions::hold`: no tick, no
/// message read, nothing sent; a stopped or starved process), then
/// releases it.
async fn freeze(s: &Sessions, d: Duration) {
    s.hold(true);
    tokio::time::sleep(d).await;
    s.hold(false);
}

/// A fresh pair with session `id` granted over `[0, FROZEN_LEN)` and the
/// grant at the sender.
async fn frozen_duo(cx: &Ctx, id: u64) -> Result<Duo, CaseError> {
    let duo = Duo::new(cx, FROZEN_LEN as usize).await?;
    duo.p.s.expect(&duo.dn, id)?;
    duo.grant(id, &[(0, FROZEN_LEN)], LONG).await?;
    duo.wait_grant(id).await?;
    Ok(duo)
}

/// Both final within `within`; never `landed` on one side only, except
/// `landed` against the sender's `outcome_unknown`. Returns both states.
async fn agree(duo: &Duo, id: u64, within: Duration, what: &str) -> Result<(SessionState, SessionState), CaseError> {
    let (wp, wd) = (format!("{what}: the sender"), format!("{what}: the receiver"));
    let (ks, kr) = (duo.ks(id), duo.kr(id));
    let (a, b) = tokio::join!(ends(&duo.p.s, &ks, within, &wp), ends(&duo.d.s, &kr, within, &wd));
    let (a, b) = (a?, b?);
    let landed = (a.name() == "landed", b.name() == "landed");
    ensure!(
        landed.0 == landed.1 || (landed.1 && is_unknown(&a)),
        "{what}: the sender ended {}, the receiver {} (rule 13: landed is never contradicted)",
        describe(&a),
        describe(&b)
    );
    Ok((a, b))
}

/// Rule 13 under pauses: one side's session engine is frozen (held: it
/// neither ticks, reads nor sends, as a stopped process) and resumed:
/// - the receiver across the sender's finish, past the liveness timeout:
///   the sender ends `outcome_unknown`; the resumed receiver asks before it
///   lands and fails (never `landed` alone);
/// - the receiver across the finish, briefly: both `landed`, every byte;
/// - the sender as the receiver's answer to its finish comes, past the
///   liveness timeout: the resumed sender reads the answer before it
///   judges the receiver: both `landed`;
/// - the sender mid-transfer, past the liveness timeout: the receiver fails
///   the session on the silence; the resumed sender asks before it writes
///   again, and nothing more reaches the receiver's memory once final;
/// - the receiver before its grant, and the sender before the grant came:
///   both end failed, and nothing is written.
pub async fn frozen_side(cx: Ctx) -> CaseResult {
    let within = FREEZE + LIVENESS + ENDS_WITHIN;
    let all = [part(0, 0, FROZEN_LEN)];

    // The receiver frozen across the finish, long and briefly.
    for (id, d) in [(1, FREEZE), (2, BRIEF)] {
        let what = format!("the receiver frozen for {d:?} across the finish");
        let duo = frozen_duo(&cx, id).await?;
        let before = duo.d.mem.snapshot();
        duo.write_ok(id, &all, &what).await?;
        duo.d.s.hold(true);
        duo.finish(id)?;
        tokio::time::sleep(d).await;
        duo.d.s.hold(false);
        let (a, b) = agree(&duo, id, within, &what).await?;
        if d > LIVENESS {
            ensure!(is_unknown(&a), "{what}: the sender ended {}, expected outcome_unknown", describe(&a));
            ensure!(
                b.name() == "failed",
                "{what}: the receiver ended {}, expected failed (the sender had given up: never landed alone)",
                describe(&b)
            );
        } else {
            ensure!(a == b && b.name() == "landed", "{what}: {} / {}", describe(&a), describe(&b));
            let now = duo.d.mem.snapshot();
            expect_bytes(&duo.d.mem, &now, &duo.model(&before, &all), &what)?;
        }
    }

    // The sender frozen as the receiver's answer comes (once the receiver
    // landed: the FINISH is out; the END is on its way or waiting unread).
    let (id, what) = (3, "the sender frozen as the receiver's answer comes");
    let duo = frozen_duo(&cx, id).await?;
    duo.write_ok(id, &all, what).await?;
    duo.finish(id)?;
    let kr = duo.kr(id);
    let landed = settle(ENDS_WITHIN, || duo.d.s.state(&kr).is_some_and(|s| s.is_final())).await;
    freeze(&duo.p.s, FREEZE).await;
    ensure!(landed, "{what}: the receiver did not end within {ENDS_WITHIN:?}: {}", state_now(&duo.d.s, &kr));
    let (a, b) = agree(&duo, id, within, what).await?;
    ensure!(a == b && a.name() == "landed", "{what}: {} / {}", describe(&a), describe(&b));

    // The sender frozen mid-transfer (between two writes).
    let (id, what) = (4, "the sender frozen mid-transfer");
    let duo = frozen_duo(&cx, id).await?;
    let half = FROZEN_LEN / 2;
    duo.write_ok(id, &[part(0, 0, half)], what).await?;
    duo.p.s.hold(true);
    let rs = ends(&duo.d.s, &duo.kr(id), within, &format!("{what}: the receiver")).await;
    duo.p.s.hold(false);
    let rs = rs?;
    expect_peer_failure(&rs, &format!("{what}: the receiver (its sender went silent)"))?;
    let snap = duo.d.mem.snapshot();
    let second = duo.write(id, &[part(half, half, half)]).await?;
    ensure!(
        !second.as_ref().is_ok_and(TransferOutcome::is_success),
        "{what}: the resumed sender's write completed toward a receiver that had ended the session"
    );
    expect_quiet(&duo.d.mem, &snap, QUIET, &format!("{what}: the receiver's memory once final")).await?;
    let (a, _) = agree(&duo, id, within, what).await?;
    ensure!(a.name() == "failed", "{what}: the resumed sender ended {}, expected failed", describe(&a));

    // The receiver frozen before its grant: the waiting sender gives up.
    let (id, what) = (5, "the receiver frozen before its grant");
    let duo = Duo::new(&cx, FROZEN_LEN as usize).await?;
    let before = duo.d.mem.snapshot();
    duo.p.s.expect(&duo.dn, id)?;
    freeze(&duo.d.s, FREEZE).await;
    let a = ends(&duo.p.s, &duo.ks(id), within, &format!("{what}: the sender")).await?;
    expect_peer_failure(&a, &format!("{what}: the waiting sender"))?;
    duo.grant(id, &all.map(|p| (p.roff, p.len)), LONG).await?;
    let (_, b) = agree(&duo, id, within, what).await?;
    ensure!(b.name() == "failed", "{what}: the late grant ended {}, expected failed", describe(&b));
    duo.d.mem.expect(&before, &format!("{what}: the receiver's memory"))?;

    // The sender frozen while its grant came: the receiver gives up; the
    // resumed sender has the grant but asks before it writes.
    let (id, what) = (6, "the sender frozen while its grant came");
    let duo = Duo::new(&cx, FROZEN_LEN as usize).await?;
    let before = duo.d.mem.snapshot();
    duo.p.s.expect(&duo.dn, id)?;
    duo.p.s.hold(true);
    duo.grant(id, &[(0, FROZEN_LEN)], LONG).await?;
    let rs = ends(&duo.d.s, &duo.kr(id), within, &format!("{what}: the receiver")).await;
    duo.p.s.hold(false);
    expect_peer_failure(&rs?, &format!("{what}: the receiver (its sender went silent)"))?;
    if let Ok(g) = bounded("wait_grant", duo.p.s.wait_grant(&duo.dn, id)).await? {
        ensure!(g.expected == FROZEN_LEN, "{what}: the sender got the grant {g:?}");
        let w = duo.write(id, &all).await?;
        ensure!(
            !w.as_ref().is_ok_and(TransferOutcome::is_success),
            "{what}: the resumed sender's write completed toward a receiver that had ended the session"
        );
    }
    let (a, _) = agree(&duo, id, within, what).await?;
    ensure!(a.name() == "failed", "{what}: the resumed sender ended {}, expected failed", describe(&a));
    duo.d.mem.expect(&before, &format!("{what}: the receiver's memory"))?;
    Ok(())
}

// ---------------------------------------------------------------------------
// connection_cut

/// Sixteen layers of 256 KiB, each one `write`; connections toward the
/// receiver are cut as layers 3 and 11 start, toward the sender as layer 7
/// starts (real endpoint resets), and the next layer starts only once that
/// cut is over, so every cut lands inside the transfer:
/// the policy's retry carries every write through, and the session lands
/// on both sides with every byte. Each cut is shorter than the liveness
/// timeout, so neither side may give the session up; the grant's deadline
/// covers the cuts themselves (a loaded soft-RoCE VM takes up to seconds
/// to take a link down and up).
pub async fn connection_cut(cx: Ctx) -> CaseResult {
    let layers: u64 = 16;
    let len = layers * LAYER;
    let duo = Arc::new(Duo::new(&cx, len as usize).await?);
    fill_layers(&duo.p.mem, LAYER)?;
    let id = 6;
    duo.p.s.expect(&duo.dn, id)?;
    duo.grant(id, &[(0, len)], CUTS_DEADLINE).await?;
    duo.wait_grant(id).await?;
    let before = duo.d.mem.snapshot();
    let parts: Vec<Part> = (0..layers).map(|k| part(k * LAYER, k * LAYER, LAYER)).collect();
    let want = duo.model(&before, &parts);

    // The writer says which layer it starts; the cut follows at once,
    // while that layer's write runs, and the writer waits for it to end
    // before it starts the next layer.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let (cut_done, mut cuts_done) = tokio::sync::mpsc::unbounded_channel::<usize>();
    let (d2, parts2) = (duo.clone(), parts.clone());
    let writer = tokio::spawn(async move {
        for (k, p) in parts2.iter().enumerate() {
            let _ = tx.send(k);
            d2.write_ok(id, &[*p], &format!("layer {k} around cuts (rule 13: one transient failure fails nothing)"))
                .await?;
            if cut_at(k) {
                bounded("the cut during this layer", cuts_done.recv()).await?;
            }
        }
        Ok::<(), CaseError>(())
    });
    while let Some(k) = bounded("the next layer", rx.recv()).await? {
        if cut_at(k) {
            let node = if k == 7 { &duo.p.node } else { &duo.d.node };
            cx.cut(node).await?;
            let _ = cut_done.send(k);
        }
    }
    bounded("the writes around the cuts", writer)
        .await?
        .map_err(|e| CaseError::Fail(format!("the writer panicked: {e}")))??;
    duo.finish(id)?;
    duo.both_end(id, "landed", ENDS_WITHIN, "a session whose connections were cut mid-transfer").await?;
    duo.d.mem.expect(&want, "the landed session after cuts")?;
    duo.release(id)
}

/// The grant deadline of `connection_cut`: its three cuts, each up to ten
/// seconds in a soft-RoCE VM next to busy loops (a node's links go down
/// and up, and their ports follow), and the writes between them.
const CUTS_DEADLINE: Duration = Duration::from_secs(45);

/// Whether `connection_cut` cuts a link as layer `k` starts.
fn cut_at(k: usize) -> bool {
    matches!(k, 3 | 7 | 11)
}

// ---------------------------------------------------------------------------
// duplicate_and_forged_messages_ignored

fn verdict(outcome: Outcome, kind: ErrorKind) -> Verdict {
    Verdict { outcome, kind, reason: "forged".into() }
}

fn msg(epoch: u64, id: u64, body: Body) -> Vec<u8> {
    Message { epoch, id, body }.encode()
}

/// Well-formed session messages a third node cannot use: invalid grants,
/// and every message that refers to a session it does not have.
fn forged(id: u64, epoch: u64, expected: u64) -> Vec<Vec<u8>> {
    let g = |ranges: Vec<(u64, u64)>, expected: u64, deadline: Duration| Grant { ranges, expected, deadline };
    let second = Duration::from_secs(1);
    [
        Body::Grant(g(vec![], 1, second)),
        Body::Grant(g(vec![(1 << 20, 4096)], 0, second)),
        Body::Grant(g(vec![(1 << 20, 4096)], 8192, second)),
        Body::Grant(g(vec![(1 << 20, 4096)], 4096, Duration::ZERO)),
        Body::Grant(g(vec![(1 << 20, 0)], 1, second)),
        Body::End(verdict(Outcome::Landed, ErrorKind::Internal)),
        Body::End(verdict(Outcome::Cancelled, ErrorKind::Cancelled)),
        Body::End(verdict(Outcome::Failed, ErrorKind::PeerRestarted)),
        Body::End(verdict(Outcome::Expired, ErrorKind::Timeout)),
        Body::Finish { bytes: expected },
        Body::Cancel(verdict(Outcome::Cancelled, ErrorKind::Cancelled)),
        Body::Refuse(verdict(Outcome::Failed, ErrorKind::ResourceExhausted)),
        Body::Quiet,
    ]
    .into_iter()
    .map(|b| msg(epoch, id, b))
    .collect()
}

/// Malformed messages that carry the session magic (each one at least a
/// header long, so it is taken for a session message).
fn garbage(id: u64, epoch: u64) -> Vec<Vec<u8>> {
    let end = msg(epoch, id, Body::End(verdict(Outcome::Cancelled, ErrorKind::Cancelled)));
    let mut out = Vec::new();
    out.push(end[..end.len() - 1].to_vec());
    let mut longer = end.clone();
    longer.push(0);
    out.push(longer);
    for (at, v) in [(4, 2u8), (4, 0), (5, 0), (5, 99), (22, 0), (22, 9)] {
        let mut b = end.clone();
        b[at] = v;
        out.push(b);
    }
    // Reason length past the end; reason not UTF-8.
    let mut b = end.clone();
    b[24..26].copy_from_slice(&500u16.to_le_bytes());
    out.push(b);
    let mut b = msg(
        epoch,
        id,
        Body::End(Verdict { outcome: Outcome::Cancelled, kind: ErrorKind::Cancelled, reason: "ab".into() }),
    );
    let n = b.len();
    b[n - 2..].copy_from_slice(&[0xff, 0xfe]);
    out.push(b);
    // A grant claiming more ranges than fit; a grant whose range overflows.
    let mut b = msg(epoch, id, Body::Grant(Grant { ranges: vec![], expected: 1, deadline: Duration::from_secs(1) }));
    let n = b.len();
    b[n - 2..].copy_from_slice(&((MAX_GRANT_RANGES + 1) as u16).to_le_bytes());
    out.push(b);
    out.push(msg(
        epoch,
        id,
        Body::Grant(Grant { ranges: vec![(u64::MAX, 2)], expected: 2, deadline: Duration::from_secs(1) }),
    ));
    // A heartbeat with a bad flag; a header alone; magic and noise.
    let mut b = msg(epoch, 0, Body::Heartbeat { reply: true });
    let n = b.len();
    b[n - 1] = 2;
    out.push(b);
    out.push(msg(epoch, id, Body::Quiet)[..22].iter().copied().chain([3u8]).collect());
    let mut noise = MAGIC.to_vec();
    noise.extend(pattern(id ^ epoch, MAX_NOTIFY_LEN - MAGIC.len()));
    out.push(noise);
    out
}

/// Sends `msg` on `t`, retrying (bounded) while the peer's inbox pushes
/// back.
async fn push(t: &Arc<dyn Transport>, seg: SegmentId, msg: Vec<u8>) -> CaseResult {
    for _ in 0..2000 {
        match bounded("notify", t.notify(seg, msg.clone())).await? {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == ErrorKind::Backpressure => tokio::time::sleep(Duration::from_millis(5)).await,
            Err(e) => return Err(CaseError::Fail(format!("notify of a forged message failed: {e}"))),
        }
    }
    Err(CaseError::Fail("the victim's inbox stayed full".into()))
}

type Slot = Arc<Mutex<Option<Arc<Tap>>>>;

/// A layer that keeps a copy of every notification its transport hands
/// out (what the session engine above it reads), so a case can replay a
/// peer's real messages and learn its epoch. Everything else passes
/// through.
struct Tap {
    inner: Arc<dyn Transport>,
    seen: Mutex<Vec<Notification>>,
}

impl std::fmt::Debug for Tap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tap").field("seen", &self.seen.lock().len()).finish()
    }
}

impl Tap {
    fn slot() -> Slot {
        Arc::new(Mutex::new(None))
    }

    fn install(slot: &Slot, inner: Arc<dyn Transport>) -> Arc<dyn Transport> {
        let tap = Arc::new(Self { inner, seen: Mutex::default() });
        *slot.lock() = Some(tap.clone());
        tap
    }

    fn take(slot: &Slot) -> Result<Arc<Self>, CaseError> {
        slot.lock().take().ok_or_else(|| CaseError::Fail("the tap layer was not installed".into()))
    }

    /// The session messages received from `from` so far, in order.
    fn from(&self, from: &str) -> Vec<Vec<u8>> {
        self.seen.lock().iter().filter(|n| n.from == from && decode(&n.msg).is_some()).map(|n| n.msg.clone()).collect()
    }

    /// The epoch of `from`'s session engine, from its messages seen here.
    fn epoch(&self, from: &str) -> Option<u64> {
        self.from(from).iter().find_map(|m| decode(m)).map(|m| m.epoch)
    }
}

#[async_trait]
impl Layer for Tap {
    fn inner(&self) -> &Arc<dyn Transport> {
        &self.inner
    }
    fn take_notifications(&self, max: usize) -> TResult<Vec<Notification>> {
        let got = self.inner.take_notifications(max)?;
        self.seen.lock().extend(got.iter().cloned());
        Ok(got)
    }
}

fn ignored(s: &Sessions) -> u64 {
    s.counts().ignored
}

/// A third node `x` sends forged session messages to both sides, with the
/// real session's id and others and any epoch (from `x`, so of no session
/// of its): invalid grants, END, FINISH, CANCEL, REFUSE and QUIET, and
/// malformed bytes, before the grant, during the transfer and after
/// landing. The real peers' own transports replay every session message
/// they exchanged (duplicates, true epochs, learned through a tap layer)
/// mid-transfer and after landing, plus late END / CANCEL / REFUSE / FINISH
/// with other outcomes after landing. Nothing crashes, no state moves
/// backwards (watched throughout), the session lands on both sides with
/// every byte, `counts().ignored` grows on both by at least what `x` sent,
/// `x` opens no session, a plain notification from `x` still arrives, and a
/// second session lands afterwards.
pub async fn duplicate_and_forged_messages_ignored(cx: Ctx) -> CaseResult {
    let half = 512 << 10;
    let (duo, tap_p, tap_d) = Duo::tapped(&cx, 2 * half as usize).await?;
    let x = cx.node(&NodeOptions::default()).await?;
    let (to_p, to_d) = (open(&x, &duo.pn).await?, open(&x, &duo.dn).await?);
    let p_to_d = open(&duo.p.node, &duo.dn).await?;
    let d_to_p = open(&duo.d.node, &duo.pn).await?;
    let x_keys = |id: u64| {
        [SessionKey::new(x.name.clone(), id, Role::Sender), SessionKey::new(x.name.clone(), id, Role::Receiver)]
    };

    let id = 77;
    let (ks, kr) = (duo.ks(id), duo.kr(id));
    let base = (ignored(&duo.p.s), ignored(&duo.d.s));
    let mut sent = 0u64;
    let storm = |epochs: &[u64], sent: &mut u64| {
        let mut v = Vec::new();
        for &epoch in epochs {
            for i in [id, id + 1, 0] {
                v.extend(forged(i, epoch, half));
            }
            v.extend(garbage(id, epoch));
        }
        *sent += v.len() as u64;
        v
    };
    let xt = x.transport.clone();
    let flood = |msgs: Vec<Vec<u8>>| {
        let xt = xt.clone();
        async move {
            for m in msgs {
                push(&xt, to_p, m.clone()).await?;
                push(&xt, to_d, m).await?;
            }
            Ok::<(), CaseError>(())
        }
    };
    let replay = |what: &'static str| {
        let (tap_p, tap_d) = (tap_p.clone(), tap_d.clone());
        let (pt, dt, pn, dn) = (duo.p.t().clone(), duo.d.t().clone(), duo.pn.clone(), duo.dn.clone());
        async move {
            let (to_p, to_d) = (tap_p.from(&dn), tap_d.from(&pn));
            ensure!(!to_p.is_empty() && !to_d.is_empty(), "{what}: the peers exchanged no session message to replay");
            for m in to_p {
                push(&dt, d_to_p, m).await?;
            }
            for m in to_d {
                push(&pt, p_to_d, m).await?;
            }
            Ok::<(), CaseError>(())
        }
    };

    // Before the grant.
    duo.p.s.expect(&duo.dn, id)?;
    let ws = watch(&duo.p.s, &ks, "the sender");
    flood(storm(&[0, u64::MAX, rand::random()], &mut sent)).await?;
    tokio::time::sleep(4 * HEARTBEAT).await;
    ensure!(
        matches!(duo.p.s.state(&ks), Some(SessionState::Waiting)),
        "forged messages moved a waiting sender to {}",
        state_now(&duo.p.s, &ks)
    );
    ensure!(duo.d.s.state(&kr).is_none(), "forged messages made the receiver open session {id}");

    // During the transfer.
    let g = duo.grant(id, &[(0, half), (half, half)], LONG).await?;
    let wr = watch(&duo.d.s, &kr, "the receiver");
    duo.wait_grant(id).await?;
    let before = duo.d.mem.snapshot();
    let parts = [part(0, 0, half), part(half, half, half)];
    let want = duo.model(&before, &parts);
    duo.write_ok(id, &parts[..1], "the first half").await?;
    let learned = settle(ENDS_WITHIN, || tap_p.epoch(&duo.dn).is_some() && tap_d.epoch(&duo.pn).is_some()).await;
    ensure!(learned, "no session message between the peers was seen (a heartbeat or the grant)");
    let (ep, ed) = (tap_d.epoch(&duo.pn).unwrap_or(0), tap_p.epoch(&duo.dn).unwrap_or(0));
    flood(storm(&[ep, ed, 1], &mut sent)).await?;
    replay("mid-transfer").await?;
    push(duo.p.t(), p_to_d, msg(ep, id, Body::Quiet)).await?;
    tokio::time::sleep(4 * HEARTBEAT).await;
    ensure!(
        matches!(duo.p.s.state(&ks), Some(SessionState::Transferring)),
        "forged or duplicate messages moved a transferring sender to {}",
        state_now(&duo.p.s, &ks)
    );
    ensure!(
        matches!(duo.d.s.state(&kr), Some(SessionState::Granted)),
        "forged or duplicate messages moved a receiver mid-transfer to {}",
        state_now(&duo.d.s, &kr)
    );
    duo.write_ok(id, &parts[1..], "the second half").await?;
    duo.finish(id)?;
    duo.both_end(id, "landed", ENDS_WITHIN, "a session under forged and duplicate messages").await?;
    duo.d.mem.expect(&want, "the landed session")?;

    // After landing: forged; every real message again; late ones.
    flood(storm(&[ep, ed], &mut sent)).await?;
    replay("after landing").await?;
    let late_to_p = [
        Body::Grant(g.clone()),
        Body::End(verdict(Outcome::Cancelled, ErrorKind::Cancelled)),
        Body::End(verdict(Outcome::Expired, ErrorKind::Timeout)),
        Body::End(verdict(Outcome::Failed, ErrorKind::PeerUnavailable)),
    ];
    for b in late_to_p {
        push(duo.d.t(), d_to_p, msg(ed, id, b)).await?;
    }
    let late_to_d = [
        Body::Finish { bytes: 1 },
        Body::Quiet,
        Body::Cancel(verdict(Outcome::Cancelled, ErrorKind::Cancelled)),
        Body::Refuse(verdict(Outcome::Cancelled, ErrorKind::Cancelled)),
    ];
    for b in late_to_d {
        push(duo.p.t(), p_to_d, msg(ep, id, b)).await?;
    }
    let plain = b"a plain notification, not a session message".to_vec();
    push(&xt, to_d, plain.clone()).await?;

    let want_ignored = (base.0 + sent, base.1 + sent);
    let grew = settle(ENDS_WITHIN, || ignored(&duo.p.s) >= want_ignored.0 && ignored(&duo.d.s) >= want_ignored.1).await;
    ensure!(
        grew,
        "counts().ignored is {} on the sender and {} on the receiver after {sent} forged or malformed messages to \
         each (from {} and {})",
        ignored(&duo.p.s),
        ignored(&duo.d.s),
        base.0,
        base.1
    );
    tokio::time::sleep(4 * HEARTBEAT).await;
    for (who, s, k) in [("sender", &duo.p.s, &ks), ("receiver", &duo.d.s, &kr)] {
        ensure!(
            matches!(s.state(k), Some(SessionState::Landed)),
            "late, duplicate or forged messages moved the landed {who} to {} (rule 13)",
            state_now(s, k)
        );
    }
    duo.d.mem.expect(&want, "the landed session after late messages")?;
    bounded("a plain notification", duo.d.s.wait_notification()).await??;
    let got = duo.d.s.take_notifications(16);
    ensure!(
        got.len() == 1 && got[0].msg == plain && got[0].from == x.name,
        "the receiver's plain inbox holds {} notification(s) after forged traffic; expected the one plain message",
        got.len()
    );
    let (seen_p, seen_r) = (ws.end().await?, wr.end().await?);
    ensure!(
        seen_p.last() == Some(&"landed") && seen_r.last() == Some(&"landed"),
        "states seen: {seen_p:?}, {seen_r:?}"
    );

    // Both engines still work.
    let id2 = id + 1000;
    duo.p.s.expect(&duo.dn, id2)?;
    duo.grant(id2, &[(0, half)], LONG).await?;
    duo.wait_grant(id2).await?;
    duo.write_ok(id2, &[part(half, 0, half)], "a session after the forgery").await?;
    duo.finish(id2)?;
    duo.both_end(id2, "landed", ENDS_WITHIN, "a session after the forgery").await?;
    duo.release(id)?;
    duo.release(id2)?;
    for k in x_keys(id).iter().chain(&x_keys(id + 1)).chain(&x_keys(0)) {
        ensure!(
            duo.p.s.state(k).is_none() && duo.d.s.state(k).is_none(),
            "forged messages from {} opened a session {k:?}",
            x.name
        );
    }
    duo.expect_no_sessions("after release")
}

// ---------------------------------------------------------------------------
// counts_return_after_teardown

const SESSIONS: u64 = 50;
const SLOT: u64 = 64 << 10;

/// The transport counts sessions may change while they run.
fn session_stats(s: &ResourceStats) -> (usize, usize, usize, usize) {
    (s.segments, s.batches, s.inflight, s.notifications)
}

async fn expect_session_stats(t: &Arc<dyn Transport>, base: &ResourceStats, segments: bool, what: &str) -> CaseResult {
    let want = |s: &ResourceStats| {
        let (a, b) = (session_stats(s), session_stats(base));
        (!segments || a.0 == b.0) && a.1 == b.1 && a.2 == b.2 && a.3 == b.3
    };
    let ok = settle(SETTLE, || want(&t.stats())).await;
    ensure!(
        ok,
        "{what}: (segments, batches, inflight, notifications) = {:?}, {:?} before the sessions (rule 13: counts \
         return to baseline)",
        session_stats(&t.stats()),
        session_stats(base)
    );
    Ok(())
}

/// Fifty sessions granted, written and finished concurrently, all landed
/// with their bytes; fifteen cancelled (by the sender before its grant, by
/// the receiver after it, by the sender mid-way). After release: no open or
/// lingering session and no tracked peer on either side, transport
/// batches, requests in flight and notifications at their baseline; after
/// `Sessions::shutdown`, segments too.
pub async fn counts_return_after_teardown(cx: Ctx) -> CaseResult {
    let slots = SESSIONS + 15;
    let duo = Duo::new(&cx, (slots * SLOT) as usize).await?;
    let zero = SessionCounts::default();
    ensure!(duo.p.s.counts() == zero && duo.d.s.counts() == zero, "new session engines count {:?}", duo.p.s.counts());
    let before = duo.d.mem.snapshot();

    let ids: Vec<u64> = (0..SESSIONS).collect();
    for &id in &ids {
        duo.p.s.expect(&duo.dn, id)?;
        duo.grant(id, &[(id * SLOT, SLOT)], LONG).await?;
    }
    let c = duo.p.s.counts();
    ensure!(c.open == SESSIONS as usize && c.peers == 1, "with {SESSIONS} sessions the sender counts {c:?}");
    let runs = ids.iter().map(|&id| {
        let duo = &duo;
        async move {
            duo.wait_grant(id).await?;
            duo.write_ok(id, &[part(id * SLOT, id * SLOT, SLOT)], &format!("session {id}")).await?;
            duo.finish(id)?;
            duo.both_end(id, "landed", ENDS_WITHIN, &format!("session {id} of {SESSIONS}")).await
        }
    });
    for r in join_all(runs).await {
        r?;
    }
    let parts: Vec<Part> = ids.iter().map(|&id| part(id * SLOT, id * SLOT, SLOT)).collect();
    duo.d.mem.expect(&duo.model(&before, &parts), &format!("{SESSIONS} landed sessions"))?;

    let mut cancelled = Vec::new();
    for k in 0..5 {
        // The sender cancels before its grant; the grant comes later.
        let id = SESSIONS + k;
        duo.p.s.expect(&duo.dn, id)?;
        bounded("cancel", duo.p.s.cancel(&duo.ks(id))).await??;
        duo.grant(id, &[(id * SLOT, SLOT)], LONG).await?;
        cancelled.push(id);
        // The receiver cancels after its grant.
        let id = SESSIONS + 5 + k;
        duo.p.s.expect(&duo.dn, id)?;
        duo.grant(id, &[(id * SLOT, SLOT)], LONG).await?;
        duo.wait_grant(id).await?;
        bounded("cancel", duo.d.s.cancel(&duo.kr(id))).await??;
        cancelled.push(id);
        // The sender cancels after a write.
        let id = SESSIONS + 10 + k;
        duo.p.s.expect(&duo.dn, id)?;
        duo.grant(id, &[(id * SLOT, SLOT)], LONG).await?;
        duo.wait_grant(id).await?;
        duo.write_ok(id, &[part(id * SLOT, id * SLOT, SLOT / 2)], &format!("session {id}")).await?;
        bounded("cancel", duo.p.s.cancel(&duo.ks(id))).await??;
        cancelled.push(id);
    }
    for &id in &cancelled {
        duo.both_end(id, "cancelled", ENDS_WITHIN, &format!("cancelled session {id}")).await?;
    }
    for id in ids.iter().chain(&cancelled) {
        duo.release(*id)?;
    }
    duo.expect_no_sessions(&format!("after releasing {} sessions", SESSIONS + 15))?;
    duo.expect_inboxes_empty("after release").await?;
    for (who, side) in [("sender", &duo.p), ("receiver", &duo.d)] {
        expect_session_stats(side.t(), &side.base, false, &format!("the {who}'s transport after release")).await?;
        let n = side.s.engine().active_transfers();
        ensure!(n == 0, "the {who}'s engine still has {n} transfer(s) after every session ended");
    }

    for side in [&duo.p, &duo.d] {
        bounded("Sessions::shutdown", side.s.shutdown()).await?;
    }
    for (who, side) in [("sender", &duo.p), ("receiver", &duo.d)] {
        let what = format!("the {who}'s transport after Sessions::shutdown");
        // The peer's last words (a heartbeat's answer, an END) may land after
        // this side stopped reading: the transport keeps them as it keeps any
        // notification nobody took. They are taken here; every one must be a
        // session message (no plain notification was sent).
        let t = side.t();
        let mut strays = Vec::new();
        settle(SETTLE, || {
            strays.extend(t.take_notifications(64).unwrap_or_default());
            t.stats().notifications == 0
        })
        .await;
        // Last words only: a few, each a heartbeat (one sent while the last
        // sessions were open may still be on its way) or a message that
        // ends an exchange (END, QUIET, CONFIRM, REFUSE), never one that
        // starts a new exchange (GRANT, FINISH, CANCEL, CHECK).
        ensure!(strays.len() <= 8, "{what}: {} notifications arrived after it (a sender kept going?)", strays.len());
        for n in &strays {
            let parts = unbundle(&n.msg).unwrap_or_default();
            let bodies: Vec<Option<Body>> = parts.iter().map(|p| decode(p).map(|m| m.body)).collect();
            let last_words = !bodies.is_empty()
                && bodies.iter().all(|b| {
                    matches!(
                        b,
                        Some(
                            Body::Heartbeat { .. }
                                | Body::End(_)
                                | Body::Quiet
                                | Body::Confirm { .. }
                                | Body::Refuse(_)
                        )
                    )
                });
            ensure!(last_words, "{what}: a notification other than a session's last words was left: {bodies:?}");
        }
        expect_session_stats(t, &side.base, true, &what).await?;
    }
    Ok(())
}
