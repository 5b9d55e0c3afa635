//! What a case body gets: the harness, node bookkeeping, guarded memory,
//! and helpers that turn a hang or a wrong answer into a clear failure.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use transport_core::{
    Access, BatchStatus, Error, ErrorKind, RegionId, ResourceStats, SegmentId, SubmitOptions, TransferRequest,
    Transport,
};

use crate::guard::Guarded;
use crate::harness::{Harness, Node, NodeOptions};
use crate::outcome::{CaseError, CaseResult};
use crate::timeline::{wait_limit, WAIT_ENV};

/// Longest a single `wait`, `cancel`, `close` or `shutdown` may take in a
/// case before it counts as hanging, by default; `CONFORMANCE_WAIT_S`
/// changes it ([`wait_limit`] is what the suite uses).
pub const WAIT_LIMIT: Duration = Duration::from_secs(20);

/// How long resource counts may take to settle back to a baseline (for
/// backends that free asynchronously).
pub const SETTLE: Duration = Duration::from_secs(3);

/// Fails the case with a formatted message unless the condition holds.
#[macro_export]
macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err($crate::CaseError::Fail(format!($($fmt)+)));
        }
    };
}

/// Where a case's guarded memory lives (docs/CONTRACT.md, rule 9: memory
/// kinds). The suite runs its data, deadline, lifecycle, failure, poll and
/// session cases once more with device memory (of [`crate::devices`]: fake
/// devices whose memory the host cannot touch, by default), on one or both
/// ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryMode {
    /// Host memory on both ends.
    Host,
    /// Device memory on both ends.
    DeviceToDevice,
    /// The initiator's memory on the host, the target's on a device.
    HostToDevice,
    /// The initiator's memory on a device, the target's on the host.
    DeviceToHost,
}

impl MemoryMode {
    /// The device modes, in the order the suite rotates through them.
    pub const DEVICE: [MemoryMode; 3] =
        [MemoryMode::DeviceToDevice, MemoryMode::HostToDevice, MemoryMode::DeviceToHost];

    /// `host`, `d2d`, `h2d`, `d2h`.
    pub fn name(self) -> &'static str {
        match self {
            MemoryMode::Host => "host",
            MemoryMode::DeviceToDevice => "d2d",
            MemoryMode::HostToDevice => "h2d",
            MemoryMode::DeviceToHost => "d2h",
        }
    }

    /// Whether any memory is on a device.
    pub fn is_device(self) -> bool {
        self != MemoryMode::Host
    }

    /// Whether the initiator's memory is on a device.
    pub fn local_on_device(self) -> bool {
        matches!(self, MemoryMode::DeviceToDevice | MemoryMode::DeviceToHost)
    }

    /// Whether the target's memory (what peers reach) is on a device.
    pub fn remote_on_device(self) -> bool {
        matches!(self, MemoryMode::DeviceToDevice | MemoryMode::HostToDevice)
    }
}

/// The context of one running case. Cheap to clone.
#[derive(Clone)]
pub struct Ctx {
    inner: Arc<Inner>,
}

// Field order is drop order: nodes and harness go before the memory that
// their transports may still reference.
struct Inner {
    case: String,
    memory: MemoryMode,
    harness: Arc<dyn Harness>,
    nodes: Mutex<Vec<Node>>,
    /// Nodes the case stalled and has not resumed: the cleanup resumes
    /// them, so a case that fails mid-stall leaves no fault behind for the
    /// cases after it (a harness whose stall is a real link fault, netem
    /// on a device, shares it with them).
    stalled: Mutex<Vec<Node>>,
    keep: Mutex<Vec<Guarded>>,
}

impl fmt::Debug for Ctx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ctx").field("case", &self.inner.case).field("backend", &self.inner.harness.backend()).finish()
    }
}

impl Ctx {
    pub(crate) fn new(harness: Arc<dyn Harness>, case: String, memory: MemoryMode) -> Self {
        Self {
            inner: Arc::new(Inner {
                case,
                memory,
                harness,
                nodes: Mutex::default(),
                stalled: Mutex::default(),
                keep: Mutex::default(),
            }),
        }
    }

    /// Where this run's guarded memory lives.
    pub fn memory(&self) -> MemoryMode {
        self.inner.memory
    }

    /// In a device run, skips the case on a backend that does not move
    /// device memory (it must refuse it at registration instead, which
    /// `memory::device_regions` checks).
    fn check_device_memory(&self, node: &Node) -> CaseResult {
        let caps = node.transport.capabilities();
        if self.inner.memory.is_device() && !caps.device_memory {
            return Err(CaseError::Skip(format!(
                "{} moves no device memory (capabilities().device_memory is false): memory::device_regions checks \
                 that it refuses it",
                node.transport.backend()
            )));
        }
        if self.inner.memory.remote_on_device() && !caps.device_memory_remote {
            return Err(CaseError::Skip(format!(
                "{} lets no peer reach its device memory (capabilities().device_memory_remote is false): \
                 memory::device_regions checks that it refuses it with remote access",
                node.transport.backend()
            )));
        }
        Ok(())
    }

    /// The case id (`group::name`).
    pub fn case(&self) -> &str {
        &self.inner.case
    }

    /// The harness under test.
    pub fn harness(&self) -> &dyn Harness {
        self.inner.harness.as_ref()
    }

    /// A new node, wrapped by [`Harness::wrap`] and shut down after the case.
    pub async fn node(&self, opts: &NodeOptions) -> Result<Node, CaseError> {
        self.node_layered(opts, |t| t).await
    }

    /// A new node with `layer` put between the backend and the harness's
    /// wrapper (the suite's own fault injector goes here, so a broken
    /// wrapper above it is seen).
    pub async fn node_layered(
        &self,
        opts: &NodeOptions,
        layer: impl FnOnce(Arc<dyn Transport>) -> Arc<dyn Transport>,
    ) -> Result<Node, CaseError> {
        let raw = bounded("creating a node", self.inner.harness.node(opts))
            .await?
            .map_err(|e| CaseError::Fail(format!("the harness could not create a node: {e}")))?;
        let node = Node { transport: self.inner.harness.wrap(layer(raw.transport)), ..raw };
        self.inner.nodes.lock().push(node.clone());
        self.check_device_memory(&node)?;
        Ok(node)
    }

    /// A new node whose notification inbox holds at most `capacity`
    /// notifications (see [`Harness::node_with_inbox`]), wrapped and shut
    /// down after the case like [`Ctx::node`]; skips the case if the
    /// harness cannot make one.
    pub async fn node_with_inbox(&self, opts: &NodeOptions, capacity: usize) -> Result<Node, CaseError> {
        let raw = bounded("creating a node with a small inbox", self.inner.harness.node_with_inbox(opts, capacity))
            .await?
            .map_err(|e| CaseError::Fail(format!("the harness could not create a node with a small inbox: {e}")))?
            .ok_or_else(|| CaseError::Skip("the harness cannot make a node with a given inbox capacity".into()))?;
        let node = Node { transport: self.inner.harness.wrap(raw.transport), ..raw };
        self.inner.nodes.lock().push(node.clone());
        self.check_device_memory(&node)?;
        Ok(node)
    }

    /// Restarts a killed node under the same name (new generation).
    pub async fn restart(&self, node: &Node, opts: &NodeOptions) -> Result<Node, CaseError> {
        let raw = bounded("restarting a node", self.inner.harness.restart(node, opts))
            .await?
            .map_err(|e| CaseError::Fail(format!("the harness could not restart {}: {e}", node.name)))?;
        let node = Node { transport: self.inner.harness.wrap(raw.transport), ..raw };
        self.inner.nodes.lock().push(node.clone());
        self.check_device_memory(&node)?;
        Ok(node)
    }

    /// Stops tracking `node` (a case that drops it on purpose).
    pub fn forget(&self, node: &Node) {
        self.inner.nodes.lock().retain(|n| !Arc::ptr_eq(&n.transport, &node.transport));
    }

    /// Crashes `node`; skips the case if the harness cannot. Checks what
    /// [`Harness::kill`] promises and the suite can see from outside: a
    /// call on the killed node fails (a node that still answers would keep
    /// sending, and the case would fail later for a reason it cannot name).
    pub async fn kill(&self, node: &Node) -> CaseResult {
        match bounded("kill", self.inner.harness.kill(node)).await? {
            Ok(true) => {}
            Ok(false) => return Err(CaseError::Skip("the harness cannot kill a peer".into())),
            Err(e) => return Err(CaseError::Fail(format!("kill failed: {e}"))),
        }
        match bounded("open_segment on a killed node", node.transport.open_segment(&node.name)).await? {
            Err(_) => Ok(()),
            Ok(seg) => {
                let _ = node.transport.close_segment(seg).await;
                Err(CaseError::Fail(format!(
                    "the harness's kill left {} working: open_segment on it succeeded after kill returned. \
                     Harness::kill must crash the node (every call on it fails, nothing it started reaches a peer, \
                     connections to it break): see its docs",
                    node.name
                )))
            }
        }
    }

    /// Cuts connections toward `node`; skips the case if the harness cannot.
    pub async fn cut(&self, node: &Node) -> CaseResult {
        match bounded("cut", self.inner.harness.cut(node)).await? {
            Ok(true) => Ok(()),
            Ok(false) => Err(CaseError::Skip("the harness cannot cut connections".into())),
            Err(e) => Err(CaseError::Fail(format!("cut failed: {e}"))),
        }
    }

    /// Stalls or resumes traffic toward `node`; skips if the harness cannot.
    pub async fn stall(&self, node: &Node, on: bool) -> CaseResult {
        if on {
            self.inner.stalled.lock().push(node.clone());
        }
        match bounded("stall", self.inner.harness.stall(node, on)).await? {
            Ok(true) => {
                if !on {
                    self.inner.stalled.lock().retain(|n| n.name != node.name);
                }
                Ok(())
            }
            Ok(false) => Err(CaseError::Skip("the harness cannot stall traffic".into())),
            Err(e) => Err(CaseError::Fail(format!("stall({on}) failed: {e}"))),
        }
    }

    /// Memory with canaries, kept alive until the case's runtime is gone.
    /// This one is the target's memory (what peers write and read): on a
    /// device (of [`crate::devices`]) in the [`MemoryMode`]s that put the target's memory
    /// there.
    pub fn guarded(&self, len: usize, seed: u64) -> Result<Guarded, CaseError> {
        self.keep(self.inner.memory.remote_on_device(), len, seed, 1)
    }

    /// Memory with canaries for the initiator's side of a transfer: on a
    /// device (of [`crate::devices`]) in the [`MemoryMode`]s that put the initiator's memory
    /// there.
    pub fn guarded_local(&self, len: usize, seed: u64) -> Result<Guarded, CaseError> {
        self.keep(self.inner.memory.local_on_device(), len, seed, 0)
    }

    /// Memory with canaries on a fresh device (of [`crate::devices`]) with index `index`,
    /// whatever the run's [`MemoryMode`] (for the cases about device
    /// memory itself); its device is [`Guarded::device`].
    pub fn guarded_on_device(&self, len: usize, seed: u64, index: u32) -> Result<Guarded, CaseError> {
        self.keep(true, len, seed, index)
    }

    fn keep(&self, device: bool, len: usize, seed: u64, index: u32) -> Result<Guarded, CaseError> {
        let g = if device { Guarded::on_device(len, seed, index)? } else { Guarded::new(len, seed)? };
        self.inner.keep.lock().push(g.clone());
        Ok(g)
    }

    /// The harness's OS resource counts, if it has a probe.
    pub fn os_probe(&self) -> Option<Vec<(String, u64)>> {
        self.inner.harness.os_probe()
    }

    /// Waits (bounded) until no OS count is above `baseline` (a leak
    /// oracle: counts may drop below a baseline taken while something
    /// was still closing, never stay above it).
    pub async fn expect_os(&self, baseline: &Option<Vec<(String, u64)>>, what: &str) -> CaseResult {
        let Some(base) = baseline else { return Ok(()) };
        let within = |now: &Option<Vec<(String, u64)>>| {
            now.as_ref().is_some_and(|now| {
                now.iter().all(|(k, v)| match base.iter().find(|(bk, _)| bk == k) {
                    Some((_, bv)) => v <= bv,
                    None => true,
                })
            })
        };
        let mut now = self.os_probe();
        let end = Instant::now() + SETTLE;
        while !within(&now) && Instant::now() < end {
            tokio::time::sleep(Duration::from_millis(50)).await;
            now = self.os_probe();
        }
        ensure!(within(&now), "{what}: OS resources {now:?} stay above the baseline {base:?} (rule 1)");
        Ok(())
    }

    /// Two nodes `a` and `b`: `a` has a local region, `b` a remotely
    /// readable and writable one, and `a` has opened `b`'s segment.
    pub async fn pair(&self, len: usize) -> Result<Pair, CaseError> {
        self.pair_with(len, &NodeOptions::default()).await
    }

    /// [`Ctx::pair`] with node options.
    pub async fn pair_with(&self, len: usize, opts: &NodeOptions) -> Result<Pair, CaseError> {
        let a = self.node(opts).await?;
        let b = self.node(opts).await?;
        self.pair_between(a, b, len).await
    }

    /// [`Ctx::pair`] over two existing nodes.
    pub async fn pair_between(&self, a: Node, b: Node, len: usize) -> Result<Pair, CaseError> {
        let local = self.guarded_local(len, 1)?;
        let remote = self.guarded(len, 2)?;
        let local_id = a.transport.register(local.region(), Access::LOCAL)?;
        let remote_id = b.transport.register(remote.region(), Access::REMOTE_RW)?;
        let seg = open(&a, &b.name).await?;
        Ok(Pair { a, b, seg, local, local_id, remote, remote_id })
    }

    /// Shuts every tracked node down (bounded per node).
    pub(crate) async fn cleanup(&self) {
        // First lift what the case left stalled (it failed or timed out
        // between the two calls), while the nodes are still up.
        let stalled: Vec<Node> = std::mem::take(&mut *self.inner.stalled.lock());
        for n in stalled {
            let _ = tokio::time::timeout(Duration::from_secs(5), self.inner.harness.stall(&n, false)).await;
        }
        let nodes: Vec<Node> = std::mem::take(&mut *self.inner.nodes.lock());
        for n in nodes {
            let _ = tokio::time::timeout(Duration::from_secs(5), n.transport.shutdown()).await;
        }
    }
}

/// A local node `a` and a peer `b` with one region each (see [`Ctx::pair`]).
#[derive(Debug, Clone)]
pub struct Pair {
    pub a: Node,
    pub b: Node,
    /// `a`'s handle to `b`'s segment.
    pub seg: SegmentId,
    /// `a`'s local region (filled with `pattern(1)`).
    pub local: Guarded,
    pub local_id: RegionId,
    /// `b`'s remote read/write region (filled with `pattern(2)`).
    pub remote: Guarded,
    pub remote_id: RegionId,
}

impl Pair {
    /// `a`'s transport.
    pub fn t(&self) -> &Arc<dyn Transport> {
        &self.a.transport
    }

    /// A write of `len` bytes from `local[loff..]` to `remote[roff..]`.
    pub fn write(&self, loff: u64, roff: u64, len: u64) -> TransferRequest {
        TransferRequest::write(self.local_id, loff, self.seg, self.remote.addr() + roff, len)
    }

    /// A read of `len` bytes from `remote[roff..]` into `local[loff..]`.
    pub fn read(&self, loff: u64, roff: u64, len: u64) -> TransferRequest {
        TransferRequest::read(self.local_id, loff, self.seg, self.remote.addr() + roff, len)
    }

    /// Checks both regions' canaries.
    pub fn canaries_intact(&self) -> CaseResult {
        self.local.canaries_intact()?;
        self.remote.canaries_intact()
    }
}

/// Runs `fut` with the hang limit ([`wait_limit`]: [`WAIT_LIMIT`] unless
/// `CONFORMANCE_WAIT_S` says otherwise); a timeout is a failure naming
/// `what`, the limit and when in the case it started.
pub async fn bounded<T>(what: &str, fut: impl Future<Output = T>) -> Result<T, CaseError> {
    let from = Instant::now();
    let limit = wait_limit();
    tokio::time::timeout(limit, fut).await.map_err(|_| CaseError::Fail(format!("{what} {}", hung(limit, from))))
}

/// "did not return within {limit} (called {t} into the case)".
fn hung(limit: Duration, from: Instant) -> String {
    let mut s = format!("did not return within {limit:?} (the hang limit; {WAIT_ENV} sets it)");
    if let Some(t) = crate::timeline::into_case(from) {
        s.push_str(&format!(", called {t:.3?} into the case"));
    }
    s
}

/// Waits for `batch` on `t`, bounded by the hang limit. A hang is a
/// failure that says what the case asked for (`deadline`: the timeout the
/// batch was submitted with, `None` for none) and what `poll` says of the
/// batch when the limit ran out; a terminal status is recorded, so a later
/// byte mismatch can say how long before it the batch ended.
pub async fn wait_batch(
    t: &dyn Transport,
    batch: transport_core::BatchId,
    deadline: Option<Duration>,
    what: &str,
) -> Result<transport_core::Result<BatchStatus>, CaseError> {
    wait_batch_within(t, batch, deadline, what, wait_limit()).await
}

/// [`wait_batch`] with a hang limit of the caller's.
async fn wait_batch_within(
    t: &dyn Transport,
    batch: transport_core::BatchId,
    deadline: Option<Duration>,
    what: &str,
    limit: Duration,
) -> Result<transport_core::Result<BatchStatus>, CaseError> {
    let from = Instant::now();
    match tokio::time::timeout(limit, t.wait(batch)).await {
        Ok(r) => {
            if let Ok(s) = &r {
                crate::timeline::saw(batch, s);
            }
            Ok(r)
        }
        Err(_) => {
            let deadline = match deadline {
                Some(d) => format!("submitted with a deadline of {d:?}"),
                None => "submitted with no deadline of its own".to_string(),
            };
            let now = match t.poll(batch) {
                Ok(s) => crate::timeline::describe(&s),
                Err(e) => format!("poll failed: {e}"),
            };
            Err(CaseError::Fail(format!(
                "{what}: wait({batch}) {}; the batch was {deadline}; poll says {now}",
                hung(limit, from)
            )))
        }
    }
}

/// Opens `name` from `node`; failure is a case failure.
pub async fn open(node: &Node, name: &str) -> Result<SegmentId, CaseError> {
    bounded("open_segment", node.transport.open_segment(name))
        .await?
        .map_err(|e| CaseError::Fail(format!("open_segment({name}) failed: {e}")))
}

/// Submits, waits (bounded) and releases a batch. `Ok(Err(e))` when the
/// submit itself was refused; a hang, a wait error or a release error is a
/// case failure.
pub async fn run_batch(
    t: &Arc<dyn Transport>,
    reqs: Vec<TransferRequest>,
    opts: SubmitOptions,
) -> Result<Result<BatchStatus, Error>, CaseError> {
    let opts_timeout = opts.timeout;
    let batch = match bounded("submit", t.submit(reqs, opts)).await? {
        Ok(b) => b,
        Err(e) => return Ok(Err(e)),
    };
    let status = wait_batch(t.as_ref(), batch, opts_timeout, "wait")
        .await?
        .map_err(|e| CaseError::Fail(format!("wait({batch}) failed: {e}")))?;
    ensure!(status.is_terminal(), "wait({batch}) returned a non-terminal status {:?}", status.state);
    t.release(batch).map_err(|e| CaseError::Fail(format!("release of terminal {batch} failed: {e}")))?;
    Ok(Ok(status))
}

/// Runs a batch that must complete.
pub async fn complete(t: &Arc<dyn Transport>, reqs: Vec<TransferRequest>) -> Result<BatchStatus, CaseError> {
    match run_batch(t, reqs, SubmitOptions::default()).await? {
        Err(e) => Err(CaseError::Fail(format!("submit failed: {e}"))),
        Ok(s) if s.state == transport_core::BatchState::Completed => Ok(s),
        Ok(s) => Err(CaseError::Fail(format!(
            "batch ended {:?} instead of completed (first error: {:?})",
            s.state,
            s.first_error().map(ToString::to_string)
        ))),
    }
}

/// Runs a batch until it completes, resubmitting it (at most `attempts`
/// times in all) while it fails with a transient error, as a user over
/// the engine would. A permanent error or running out of attempts fails.
pub async fn complete_retrying(
    t: &Arc<dyn Transport>,
    reqs: Vec<TransferRequest>,
    attempts: u32,
) -> Result<BatchStatus, CaseError> {
    let mut last = String::new();
    for _ in 0..attempts {
        let (state, err) = match run_batch(t, reqs.clone(), SubmitOptions::default()).await? {
            Err(e) => (transport_core::BatchState::Failed, Some(e)),
            Ok(s) if s.state == transport_core::BatchState::Completed => return Ok(s),
            Ok(s) => (s.state, s.first_error().cloned()),
        };
        match err {
            Some(e) if !e.is_transient() => {
                return Err(CaseError::Fail(format!("batch failed with a permanent error: {e}")))
            }
            e => last = format!("{state:?} {:?}", e.map(|e| e.to_string())),
        }
    }
    Err(CaseError::Fail(format!("batch did not complete in {attempts} attempts; last: {last}")))
}

/// Requires an error of one of `kinds` that is permanent (rule 7).
pub fn expect_permanent<T: fmt::Debug>(
    r: Result<T, Error>,
    kinds: &[ErrorKind],
    what: &str,
) -> Result<Error, CaseError> {
    let e = expect_kind(r, kinds, what)?;
    ensure!(!e.is_transient(), "{what}: error {e} must be permanent (rule 7)");
    Ok(e)
}

/// Requires an error of one of `kinds`.
pub fn expect_kind<T: fmt::Debug>(r: Result<T, Error>, kinds: &[ErrorKind], what: &str) -> Result<Error, CaseError> {
    match r {
        Ok(v) => Err(CaseError::Fail(format!("{what}: expected an error of kind {kinds:?}, got Ok({v:?})"))),
        Err(e) if kinds.contains(&e.kind()) => Ok(e),
        Err(e) => Err(CaseError::Fail(format!("{what}: expected an error of kind {kinds:?}, got {e}"))),
    }
}

/// Polls `f` every 20 ms until it holds or `limit` passes.
pub async fn settle(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + limit;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits (bounded) until `t.stats()` equals `baseline` (rule 1).
pub async fn expect_stats(t: &Arc<dyn Transport>, baseline: ResourceStats, what: &str) -> CaseResult {
    let ok = settle(SETTLE, || t.stats() == baseline).await;
    ensure!(ok, "{what}: resources {:?} did not return to {baseline:?} (rule 1)", t.stats());
    Ok(())
}

/// Watches `mem` for `dur`: it must keep the bytes of `snapshot`.
pub async fn expect_quiet(mem: &Guarded, snapshot: &[u8], dur: Duration, what: &str) -> CaseResult {
    let end = Instant::now() + dur;
    loop {
        mem.expect(snapshot, what)?;
        if Instant::now() >= end {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Runs a batch that must fail, and returns its error, whether the submit
/// refused it or a request failed later.
pub async fn batch_error(t: &Arc<dyn Transport>, reqs: Vec<TransferRequest>) -> Result<Error, CaseError> {
    match run_batch(t, reqs, SubmitOptions::default()).await? {
        Err(e) => Ok(e),
        Ok(s) => s
            .first_error()
            .cloned()
            .ok_or_else(|| CaseError::Fail(format!("a batch that must fail ended {:?} without an error", s.state))),
    }
}

/// Requires `e` to be of one of `kinds` and permanent.
pub fn permanent_kind(e: &Error, kinds: &[ErrorKind], what: &str) -> CaseResult {
    ensure!(kinds.contains(&e.kind()), "{what}: expected an error of kind {kinds:?}, got {e}");
    ensure!(!e.is_transient(), "{what}: error {e} must be permanent (rule 7)");
    Ok(())
}

#[cfg(all(test, feature = "self-test"))]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure

    use super::*;
    use crate::mock::MockHarness;

    /// A hang says what the batch was submitted with, what `poll` says of
    /// it when the limit ran out, and when in the case the wait began.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_hang_says_the_deadline_and_the_last_status() {
        let h = MockHarness::new();
        let cx = Ctx::new(Arc::new(h.clone()), "test::hang".into(), MemoryMode::Host);
        crate::timeline::scope(async {
            let p = cx.pair(4096).await.unwrap();
            h.stall(&p.b, true).await.unwrap();
            let t = p.t();
            let b = t.submit(vec![p.write(0, 0, 4096), p.write(0, 0, 1)], SubmitOptions::default()).await.unwrap();
            let err = wait_batch_within(t.as_ref(), b, None, "wait on a stalled batch", Duration::from_millis(200))
                .await
                .expect_err("a stalled batch with no deadline hangs");
            let CaseError::Fail(msg) = err else { panic!("a hang is a failure: {err:?}") };
            eprintln!("the hang message: {msg}");
            for part in [
                "wait on a stalled batch: wait(",
                "did not return within 200ms",
                "CONFORMANCE_WAIT_S",
                "into the case",
                "submitted with no deadline of its own",
                "poll says InProgress: 2 requests, 0 completed, 2 not ended",
            ] {
                assert!(msg.contains(part), "{part:?} missing from: {msg}");
            }
            h.stall(&p.b, false).await.unwrap();
            let s = wait_batch_within(t.as_ref(), b, None, "wait", Duration::from_secs(10)).await.unwrap().unwrap();
            assert_eq!(s.state, transport_core::BatchState::Completed);
        })
        .await;
        cx.cleanup().await;
    }
}

#[cfg(all(test, feature = "self-test"))]
mod stall_cleanup {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::mock::MockHarness;
    use async_trait::async_trait;

    /// The mock, with every stall call written down.
    struct Recording {
        mock: MockHarness,
        stalls: Arc<Mutex<Vec<(String, bool)>>>,
    }

    #[async_trait]
    impl Harness for Recording {
        fn backend(&self) -> &str {
            "recording"
        }
        async fn node(&self, opts: &NodeOptions) -> transport_core::Result<Node> {
            self.mock.node(opts).await
        }
        async fn kill(&self, node: &Node) -> transport_core::Result<bool> {
            self.mock.kill(node).await
        }
        async fn restart(&self, node: &Node, opts: &NodeOptions) -> transport_core::Result<Node> {
            self.mock.restart(node, opts).await
        }
        async fn cut(&self, to: &Node) -> transport_core::Result<bool> {
            self.mock.cut(to).await
        }
        async fn stall(&self, to: &Node, on: bool) -> transport_core::Result<bool> {
            self.stalls.lock().push((to.name.clone(), on));
            self.mock.stall(to, on).await
        }
        fn os_probe(&self) -> Option<Vec<(String, u64)>> {
            None
        }
    }

    /// A case that fails between stalling a node and resuming it (ci34: a
    /// cancel that hung under a netem stall) must not leave the stall on
    /// for the cases after it: the cleanup resumes it, and only it.
    #[test]
    fn cleanup_resumes_what_a_failed_case_left_stalled() {
        let stalls = Arc::new(Mutex::new(Vec::new()));
        let harness = Arc::new(Recording { mock: MockHarness::new(), stalls: stalls.clone() });
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let cx = Ctx::new(harness, "test".into(), MemoryMode::Host);
            let o = NodeOptions::default();
            let (a, b, c) = (cx.node(&o).await.unwrap(), cx.node(&o).await.unwrap(), cx.node(&o).await.unwrap());
            cx.stall(&a, true).await.unwrap();
            cx.stall(&a, false).await.unwrap();
            cx.stall(&b, true).await.unwrap();
            cx.stall(&c, true).await.unwrap();
            cx.stall(&c, false).await.unwrap();
            // The case "fails" here, with b still stalled.
            let before = stalls.lock().len();
            cx.cleanup().await;
            let after: Vec<(String, bool)> = stalls.lock()[before..].to_vec();
            assert_eq!(after, vec![(b.name.clone(), false)], "the cleanup resumes b, and nothing else");
        });
    }
}
