//! The transfers of the NIXL-style agent (`kvmove.nixl.nixl_agent`).
//!
//! A NIXL transfer may carry a notification for the remote agent. Here the
//! engine's runtime, not Python, sends it: a task waits for the batch and,
//! only if every request completed (rule 5: the bytes are then in the
//! destination memory, for writes and reads alike), sends the message to
//! the peer through the session driver's plain notifications. The handle's
//! state turns `DONE` only after that send returned (the message is in the
//! peer's inbox), so a notification is never seen before its data, never
//! sent for a failed or cancelled batch, and never depends on Python
//! polling the handle.
//!
//! A caller polling a running transfer makes progress itself: the answers
//! that have arrived are applied on its thread (docs/CONTRACT.md rule 6).
//! A transfer submitted at once and without a notification starts no task
//! until a poll, a wait, a cancel or the handle's drop needs one: the poll
//! that sees it completed runs its task's work on the polling thread and
//! reports `DONE` there, with no hand-off to a runtime thread.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvmove_policy::{Probe, Transfer};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt, PyList, PyTuple};
use tokio::sync::watch;
use transport_core::{check_notification, Error, ErrorKind, Opcode, Result, TransferRequest};

use crate::core::{check_peer_name, Core, RawOp};
use crate::errors::{invalid, to_pyerr};
use crate::handoff::{bounded, timeout_arg};
use crate::words::Word;

/// How a transfer ended.
#[derive(Debug, Clone)]
struct Finished {
    /// Why it did not complete (or its notification could not be sent).
    error: Option<Error>,
    /// From submission to the end (notification included), microseconds.
    xfer_us: u64,
}

#[derive(Debug)]
struct Shared {
    done: watch::Sender<Option<Finished>>,
    started: Instant,
    /// How long the engine took to accept the batch, microseconds (0 until
    /// it did).
    post_us: AtomicU64,
    /// When the caller last polled it running: nanoseconds after `started`
    /// plus one (0: never).
    polled: AtomicU64,
}

impl Shared {
    fn finish(&self, error: Option<Error>) {
        let xfer_us = micros(self.started.elapsed());
        self.done.send_if_modified(|d| {
            if d.is_some() {
                return false;
            }
            *d = Some(Finished { error, xfer_us });
            true
        });
    }
}

/// Ends the transfer as shut down if its task is dropped before it
/// reported (a runtime that stops aborts its tasks), so no handle stays
/// "in progress" forever.
struct Reporter(Arc<Shared>);

impl Drop for Reporter {
    fn drop(&mut self) {
        self.0.finish(Some(Error::new(ErrorKind::Shutdown, "the engine stopped before the transfer finished")));
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// The descriptor pairs of one NIXL transfer handle, handed to Rust once
/// when the handle is made (`make_prepped_xfer`, `initialize_xfer`), so a
/// post costs one call, not a Python loop over descriptors.
#[pyclass(module = "kvmove._native", name = "NixlOps", frozen)]
#[derive(Debug)]
pub(crate) struct NixlOps {
    /// The pairs that move bytes (zero-length descriptors move nothing:
    /// NIXL completes them).
    pub(crate) ops: Vec<RawOp>,
    /// Descriptors given, zero-length ones included.
    count: usize,
}

/// Native-endian `u64`s packed in `b` (numpy's `tobytes()` of a `uint64`
/// array).
fn words(b: &[u8], what: &str) -> Result<Vec<u64>> {
    if !b.len().is_multiple_of(8) {
        return Err(Error::new(
            ErrorKind::InvalidRequest,
            format!("{what}: {} bytes is not a whole number of u64", b.len()),
        ));
    }
    Ok(b.chunks_exact(8).map(|c| u64::from_ne_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]])).collect())
}

#[pymethods]
impl NixlOps {
    /// The pairs of a handle from two descriptor lists, each packed as
    /// rows of native-endian `u64`s `(addr, len, dev_id)`: pair `k` is
    /// local row `local_idx[k]` with remote row `remote_idx[k]` (indices
    /// packed as `u64`s), or without indices local row `k` with remote row
    /// `k`. With a side's region starts and ends (packed as for
    /// [`nixl_uncovered`]), every row of that side's list is checked to lie
    /// inside one region first, the local list before the remote one, so a
    /// handle made from fresh lists costs one call.
    ///
    /// Returns `(pairs, -1, "")`, or nothing, the first row (pair, or
    /// index) that failed and which check: `"local"` or `"remote"` (a row
    /// outside the side's regions), `"local_index"` or `"remote_index"`
    /// (an index not below its list's length; every local index is checked
    /// before the remote ones) or `"length"` (a pair whose two lengths
    /// differ); the caller says so in its terms.
    #[staticmethod]
    #[pyo3(signature = (
        write, local, remote, local_idx=None, remote_idx=None,
        local_starts=None, local_ends=None, remote_starts=None, remote_ends=None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn pairs(
        py: Python<'_>,
        write: bool,
        local: &[u8],
        remote: &[u8],
        local_idx: Option<&[u8]>,
        remote_idx: Option<&[u8]>,
        local_starts: Option<&[u8]>,
        local_ends: Option<&[u8]>,
        remote_starts: Option<&[u8]>,
        remote_ends: Option<&[u8]>,
    ) -> PyResult<(Option<Self>, i64, &'static str)> {
        let r = (|| {
            let (l, r) = (Rows::new(local, "local")?, Rows::new(remote, "remote")?);
            for (what, d, starts, ends) in
                [("local", l, local_starts, local_ends), ("remote", r, remote_starts, remote_ends)]
            {
                let bounds = match (starts, ends) {
                    (Some(s), Some(e)) => Some(Bounds::new(s, e)?),
                    (None, None) => None,
                    _ => return Err(invalid("a side's region starts and ends go together")),
                };
                if let Some(k) = bounds.and_then(|b| b.first_outside(d)) {
                    return Ok(Err((k, what)));
                }
            }
            pair_rows(write, l, r, local_idx, remote_idx)
        })();
        match r {
            Ok(Ok(ops)) => Ok((Some(ops), -1, "")),
            Ok(Err((k, what))) => Ok((None, i64::try_from(k).unwrap_or(i64::MAX), what)),
            Err(e) => Err(to_pyerr(py, &e)),
        }
    }

    fn __len__(&self) -> usize {
        self.count
    }
}

/// Rows `(addr, len, dev_id)` packed in `b` as native-endian `u64`s, read
/// in place.
#[derive(Clone, Copy)]
struct Rows<'a>(&'a [u8]);

impl<'a> Rows<'a> {
    const ROW: usize = 24;

    fn new(b: &'a [u8], what: &str) -> Result<Self> {
        if !b.len().is_multiple_of(Self::ROW) {
            return Err(invalid(format!("{what}: {} bytes is not rows of 3 u64", b.len())));
        }
        Ok(Self(b))
    }

    fn len(self) -> usize {
        self.0.len() / Self::ROW
    }

    /// `(addr, len)` of every row, in order.
    fn iter(self) -> impl Iterator<Item = (u64, u64)> + 'a {
        self.0.chunks_exact(Self::ROW).map(|c| (word_at(c, 0), word_at(c, 8)))
    }

    /// `(addr, len)` of row `i` (below [`Rows::len`]).
    fn get(self, i: usize) -> (u64, u64) {
        self.0.chunks_exact(Self::ROW).nth(i).map_or((0, 0), |c| (word_at(c, 0), word_at(c, 8)))
    }
}

/// The native-endian `u64` at `at` in `c` (0 past its end).
fn word_at(c: &[u8], at: usize) -> u64 {
    c.get(at..at + 8).and_then(|w| <[u8; 8]>::try_from(w).ok()).map_or(0, u64::from_ne_bytes)
}

/// Row numbers: `idx`'s words, each below `n`; `None` without indices
/// (row `k` for pair `k`); `Ok(Err(k))` when word `k` (the first) is not
/// below `n`.
fn picks(idx: Option<&[u8]>, n: usize, what: &str) -> Result<std::result::Result<Option<Vec<usize>>, usize>> {
    let Some(idx) = idx else { return Ok(Ok(None)) };
    let w = words(idx, what)?;
    let mut rows = Vec::with_capacity(w.len());
    for (k, i) in w.into_iter().enumerate() {
        match usize::try_from(i).ok().filter(|&i| i < n) {
            Some(i) => rows.push(i),
            None => return Ok(Err(k)),
        }
    }
    Ok(Ok(Some(rows)))
}

/// [`NixlOps::pairs`]: `Ok(Err((k, what)))` when index `k` of a side's
/// indices is out of range (`"local_index"`, `"remote_index"`; every
/// local index is checked before the remote ones), or pair `k`'s lengths
/// differ (`"length"`).
fn pair_rows(
    write: bool,
    l: Rows<'_>,
    r: Rows<'_>,
    local_idx: Option<&[u8]>,
    remote_idx: Option<&[u8]>,
) -> Result<std::result::Result<NixlOps, (usize, &'static str)>> {
    let li = match picks(local_idx, l.len(), "local")? {
        Ok(p) => p,
        Err(k) => return Ok(Err((k, "local_index"))),
    };
    let ri = match picks(remote_idx, r.len(), "remote")? {
        Ok(p) => p,
        Err(k) => return Ok(Err((k, "remote_index"))),
    };
    let count = |p: &Option<Vec<usize>>, rows: Rows<'_>| p.as_ref().map_or(rows.len(), Vec::len);
    let n = count(&li, l);
    if n != count(&ri, r) {
        return Err(invalid(format!("{n} local descriptors, {} remote descriptors", count(&ri, r))));
    }
    let op = if write { Opcode::Write } else { Opcode::Read };
    let mut ops = Vec::with_capacity(n);
    let mut push = |k: usize, (local_addr, len): (u64, u64), (remote_addr, rlen): (u64, u64)| {
        if len != rlen {
            return Err(k);
        }
        if len != 0 {
            ops.push(RawOp { op, local_addr, remote_addr, len });
        }
        Ok(())
    };
    let pushed = match (&li, &ri) {
        // In order: both lists read straight through.
        (None, None) => l.iter().zip(r.iter()).enumerate().try_for_each(|(k, (a, b))| push(k, a, b)),
        _ => (0..n).try_for_each(|k| {
            let pick = |p: &Option<Vec<usize>>| p.as_ref().map_or(k, |v| v[k]);
            push(k, l.get(pick(&li)), r.get(pick(&ri)))
        }),
    };
    Ok(pushed.map(|()| NixlOps { ops, count: n }).map_err(|k| (k, "length")))
}

/// Registered regions as their sorted starts and their ends.
struct Bounds {
    starts: Vec<u64>,
    ends: Vec<u64>,
}

impl Bounds {
    fn new(starts: &[u8], ends: &[u8]) -> Result<Self> {
        let (starts, ends) = (words(starts, "starts")?, words(ends, "ends")?);
        if starts.len() != ends.len() {
            return Err(invalid("as many region starts as ends are needed"));
        }
        Ok(Self { starts, ends })
    }

    /// The first row `(addr, len, dev_id)` of `d` that is not inside one
    /// region: a row belongs to the last region starting at or before it;
    /// a zero-length row at a region's end is inside; one whose end wraps
    /// around is not.
    fn first_outside(&self, d: Rows<'_>) -> Option<usize> {
        d.iter().position(|(a, n)| {
            let i = self.starts.partition_point(|&st| st <= a);
            i == 0 || a.checked_add(n).is_none_or(|end| end > self.ends[i - 1])
        })
    }
}

/// The first descriptor (rows packed as in [`NixlOps::pairs`]) that is not
/// inside one region ([`Bounds::first_outside`]), or -1. Regions are given
/// by their starts, sorted, and their ends (each packed as `u64`s).
#[pyfunction]
pub(crate) fn nixl_uncovered(py: Python<'_>, starts: &[u8], ends: &[u8], descs: &[u8]) -> PyResult<i64> {
    let r = (|| Ok(Bounds::new(starts, ends)?.first_outside(Rows::new(descs, "descs")?)))();
    match r {
        Ok(Some(k)) => Ok(i64::try_from(k).unwrap_or(i64::MAX)),
        Ok(None) => Ok(-1),
        Err(e) => Err(to_pyerr(py, &e)),
    }
}

/// The NIXL agent's descriptor lists, fast path: a list (or tuple) of
/// `(addr, len, dev_id)` tuples (or lists; `width` 4 allows a fourth item,
/// the registration's meta string) as `3 x N` native-endian `u64`s, row
/// after row. `None` for anything else (an item of another shape, a value
/// that is no non-negative integer below 2^64): the caller's own check then
/// says what is wrong, so the two never disagree on what is accepted.
#[pyfunction]
pub(crate) fn nixl_desc_rows<'py>(descs: &Bound<'py, PyAny>, width: usize) -> Option<Bound<'py, PyBytes>> {
    /// A non-negative integer below 2^64 ([`Word`]: the fast way).
    fn word(v: &Bound<'_, PyAny>) -> Option<u64> {
        v.extract::<Word>().ok().map(|w| w.0)
    }
    fn item(d: &Bound<'_, PyAny>, width: usize) -> Option<[u64; 3]> {
        // A plain tuple (what callers build): its items read in place.
        if let Ok(t) = d.downcast_exact::<PyTuple>() {
            let items = t.as_slice();
            if items.len() != 3 && items.len() != width {
                return None;
            }
            let at = |i: usize| items.get(i).and_then(word);
            return Some([at(0)?, at(1)?, at(2)?]);
        }
        let at = |i: usize| d.get_item(i).ok().and_then(|v| word(&v));
        if !(d.is_instance_of::<PyTuple>() || d.is_instance_of::<PyList>()) {
            return None;
        }
        // len(), as Python's check reads it (a subclass may define it).
        let n = d.len().ok()?;
        if n != 3 && n != width {
            return None;
        }
        Some([at(0)?, at(1)?, at(2)?])
    }
    // The real item count (a subclass's __len__ could claim any size).
    let n = match (descs.downcast::<PyList>(), descs.downcast::<PyTuple>()) {
        (Ok(l), _) => l.len(),
        (_, Ok(t)) => t.len(),
        _ => return None,
    };
    let mut out = Vec::with_capacity(n.checked_mul(24)?);
    let mut push = |d: &Bound<'py, PyAny>| -> Option<()> {
        for v in item(d, width)? {
            out.extend_from_slice(&v.to_ne_bytes());
        }
        Some(())
    };
    // A plain list (what callers build) is read by index, with no
    // iterator object; anything else through its iterator.
    if let Ok(l) = descs.downcast_exact::<PyList>() {
        for d in l.iter() {
            push(&d)?;
        }
    } else {
        for d in descs.try_iter().ok()? {
            push(&d.ok()?)?;
        }
    }
    Some(PyBytes::new(descs.py(), &out))
}

/// The NIXL agent's index lists, fast path: a plain list of plain
/// non-negative `int`s below 2^64 as native-endian `u64` words, for
/// [`NixlOps::pairs`] to check against the prepared lists. `None` for
/// anything else (a negative index, a `bool`, a numpy scalar): the
/// caller's checked path then reads it and says what is wrong.
#[pyfunction]
pub(crate) fn nixl_index_words<'py>(idx: &Bound<'py, PyAny>) -> Option<Bound<'py, PyBytes>> {
    let l = idx.downcast_exact::<PyList>().ok()?;
    let mut out = Vec::with_capacity(l.len().checked_mul(8)?);
    for v in l.iter() {
        let w = v.downcast_exact::<PyInt>().ok()?.extract::<Word>().ok()?;
        out.extend_from_slice(&w.0.to_ne_bytes());
    }
    Some(PyBytes::new(idx.py(), &out))
}

/// One NIXL transfer: running, or finished with an optional error.
#[pyclass(module = "kvmove._native", name = "NixlXfer", frozen)]
pub(crate) struct NixlXfer {
    core: Arc<Core>,
    shared: Arc<Shared>,
    stop: watch::Sender<bool>,
    start_unix_us: u64,
    bytes: u64,
    descs: u64,
    /// Progress on the caller's thread, for a transfer without a
    /// notification that the caller's thread submitted.
    probe: Option<Probe>,
    /// The task that finishes the transfer, until it is started (or run by
    /// a caller's poll that saw the transfer complete).
    task: Mutex<Option<Task>>,
}

/// The future that waits for a transfer, sends its notification and
/// reports its end.
type Task = Pin<Box<dyn Future<Output = ()> + Send>>;

impl std::fmt::Debug for NixlXfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlXfer")
            .field("state", &state_of(&self.finished()))
            .field("bytes", &self.bytes)
            .field("descs", &self.descs)
            .field("task_started", &self.task.lock().is_none())
            .finish_non_exhaustive()
    }
}

impl Drop for NixlXfer {
    /// A handle dropped while its task was not started: the task runs on
    /// (dropping never cancels: `release_xfer_handle` cancels a running
    /// transfer itself first).
    fn drop(&mut self) {
        self.start_task();
    }
}

impl NixlXfer {
    /// Submits `requests` and, with `notify` = `(peer, msg)`, has the
    /// runtime send `msg` to `peer` once every request completed. Returns
    /// at once: the submission starts on the caller's thread, and whatever
    /// it would wait for (room in the in-flight budget, a connection being
    /// rebuilt) is the runtime's, as in NIXL; its refusal ends the transfer
    /// in `"ERR"`. Not to be called from the runtime's own threads. Fails here only
    /// when the message or peer name is invalid or the engine is closed.
    pub(crate) fn start(
        core: &Arc<Core>,
        requests: Vec<TransferRequest>,
        notify: Option<(String, Vec<u8>)>,
    ) -> Result<Self> {
        let sessions = match &notify {
            Some((peer, msg)) => {
                check_peer_name(peer)?;
                check_notification(msg)?;
                Some(core.sessions()?)
            }
            None => None,
        };
        let engine = core.engine()?;
        let bytes = requests.iter().map(|r| r.len).fold(0u64, u64::saturating_add);
        let descs = requests.len() as u64;
        let start_unix_us = SystemTime::now().duration_since(UNIX_EPOCH).map(micros).unwrap_or(0);
        let started = Instant::now();
        let shared = Arc::new(Shared {
            done: watch::channel(None).0,
            started,
            post_us: AtomicU64::new(0),
            polled: AtomicU64::new(0),
        });
        let (stop, stop_rx) = watch::channel(false);
        let reporter = Reporter(shared.clone());
        // The submission starts on the caller's thread (a small batch goes
        // to the wire from here, with no hand-off to a runtime thread);
        // whatever it would wait for (room in the in-flight budget, a
        // connection being built) goes on in the runtime.
        let mut submit: Option<Pin<Box<dyn Future<Output = Result<Transfer>> + Send>>> =
            (!requests.is_empty()).then(|| Box::pin(async move { engine.submit(requests).await }) as _);
        let first = match submit.as_mut() {
            Some(f) => core.block_on(std::future::poll_fn(|cx| Poll::Ready(f.as_mut().poll(cx)))),
            None => Poll::Pending,
        };
        if first.is_ready() {
            shared.post_us.store(micros(started.elapsed()).max(1), Ordering::Relaxed);
        }
        if let Poll::Ready(Err(e)) = &first {
            // Refused at once: the caller's next look says so.
            shared.finish(Some(e.clone()));
        }
        let probe = match (&first, &notify) {
            (Poll::Ready(Ok(t)), None) => Some(t.probe()),
            _ => None,
        };
        let task: Task = Box::pin(async move {
            let stopped = |mut rx: watch::Receiver<bool>| async move {
                if rx.wait_for(|s| *s).await.is_err() {
                    // The handle is gone without a cancel: let it run.
                    std::future::pending::<()>().await;
                }
            };
            // Every descriptor zero bytes: nothing to move, only the
            // notification to send (NIXL completes such a transfer).
            let transfer = match (submit, first) {
                (None, _) => None,
                (Some(_), Poll::Ready(t)) => Some(t),
                (Some(f), Poll::Pending) => Some(tokio::select! {
                    t = f => t,
                    () = stopped(stop_rx.clone()) => {
                        Err(Error::new(ErrorKind::Cancelled, "the transfer was cancelled before the engine accepted it"))
                    }
                }),
            };
            // Accepted here unless the caller's thread saw it accepted.
            let _ = reporter.0.post_us.compare_exchange(
                0,
                micros(started.elapsed()).max(1),
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
            let mut r = match transfer {
                None => Ok(()),
                Some(Ok(t)) => match t.wait_or_cancel(stopped(stop_rx)).await {
                    Ok(o) => o.into_result().map(drop),
                    Err(e) => Err(e),
                },
                Some(Err(e)) => Err(e),
            };
            if let (Ok(()), Some((peer, msg)), Some(s)) = (&r, notify, sessions) {
                // Offered again while the peer's inbox is full, as long
                // as the policy's `notify_patience` (`Engine::notify`).
                r = s.notify(&peer, msg).await.map_err(|e| e.with("while", "sending the transfer's notification"));
            }
            reporter.0.finish(r.err());
        });
        // Submitted from here and nothing to send after it: the caller's
        // polls may finish it (see `progress`), and the task is started
        // only if they do not.
        let task = match probe {
            Some(_) => Some(task),
            None => {
                core.spawn(task);
                None
            }
        };
        Ok(Self { core: core.clone(), shared, stop, start_unix_us, bytes, descs, probe, task: Mutex::new(task) })
    }

    /// Starts the task that finishes the transfer, unless it runs (or ran)
    /// already.
    fn start_task(&self) {
        let task = self.task.lock().take();
        if let Some(task) = task {
            self.core.spawn(task);
        }
    }

    fn finished(&self) -> Option<Finished> {
        self.shared.done.borrow().clone()
    }

    /// How long this poll spins on the caller's thread: a caller polling
    /// a young transfer back to back that it can finish (`may_wait`: the
    /// agent's last post or poll was of it; younger than `policy.wait`'s
    /// `fresh_us`; no task drives it yet) looks until the transfer is that
    /// old or
    /// ended, with the transport told that it polls ([`Probe::spin`], as
    /// `kvmove.Engine`'s calls do): the answer is applied on this thread,
    /// and no engine thread is woken for it (over TCP a thread hop saved,
    /// a third of a 4 KiB write's time on this 2-vCPU machine); any other
    /// poll, not at all.
    fn spin_for(&self, may_wait: bool) -> Duration {
        let age = self.shared.started.elapsed();
        let fresh = self.core.wait_policy().fresh();
        if !may_wait || age >= fresh || self.probe.is_none() || self.task.lock().is_none() {
            return Duration::ZERO;
        }
        let now = u64::try_from(age.as_nanos()).unwrap_or(u64::MAX).saturating_add(1);
        self.shared.polled.store(now, Ordering::Relaxed);
        fresh.saturating_sub(age)
    }

    /// Applies the answers that have arrived, on the caller's thread (GIL
    /// released), and if that completed the transfer, finishes it here:
    /// its task, not started yet, runs on this thread (it finds the
    /// transfer ended, gives its budget back and reports `DONE`), or, if it
    /// runs already, the end is reported at once. Then, for a caller
    /// spinning on this handle (`yield_cpu`), gives the CPU up once: on a
    /// machine with few CPUs the threads that answer it may need this one.
    /// With a `spin`, looks for that long first ([`Probe::spin`]).
    fn progress(&self, py: Python<'_>, yield_cpu: bool, spin: Duration) {
        let Some(probe) = &self.probe else { return };
        py.allow_threads(|| {
            let done = self.core.in_rt(|| if spin.is_zero() { probe.completed() } else { probe.spin(spin) });
            if !done {
                if yield_cpu {
                    std::thread::yield_now();
                }
                return;
            }
            let task = self.task.lock().take();
            match task {
                Some(task) => self.core.block_on(task),
                None => self.shared.finish(None),
            }
        });
    }
}

fn state_of(f: &Option<Finished>) -> &'static str {
    match f {
        None => "PROC",
        Some(Finished { error: None, .. }) => "DONE",
        Some(Finished { error: Some(_), .. }) => "ERR",
    }
}

#[pymethods]
impl NixlXfer {
    /// `"PROC"` while running, `"DONE"` once every request completed and
    /// the notification (if any) is in the peer's inbox, else `"ERR"`.
    fn state(&self) -> &'static str {
        self.start_task();
        state_of(&self.finished())
    }

    /// Whether the transfer ended in an error already (a post refused at
    /// once). Unlike [`NixlXfer::state`] it starts nothing: a post that a
    /// caller's poll may still finish on its own thread is left to it.
    fn refused(&self) -> bool {
        matches!(self.finished(), Some(Finished { error: Some(_), .. }))
    }

    /// [`NixlXfer::state`] for a caller that polls in a loop (the times
    /// are `policy.wait`'s, defaults here): before the transfer is
    /// `fresh_us` (250 us) old, such a poll spins on this thread until then
    /// (`spin_for`); after, a poll that comes within `spinning_gap_us`
    /// (500 us) of its previous one, with `may_wait` (the agent's last poll
    /// or post was of this same transfer), waits (GIL released) up to
    /// `spinner_wait_us` (1 ms) for the end before it answers `"PROC"`, so
    /// a spinning caller sleeps while the engine's threads move the bytes,
    /// and learns the end as soon as it comes. A caller that polls other
    /// transfers in between (a serving engine's step over its pending
    /// handles) or polls further apart never waits.
    fn poll(&self, py: Python<'_>, may_wait: bool) -> &'static str {
        if self.finished().is_none() {
            self.progress(py, may_wait, self.spin_for(may_wait));
        }
        let st = state_of(&self.finished());
        let age = self.shared.started.elapsed();
        let wait = self.core.wait_policy();
        if st == "PROC" && may_wait && age < wait.fresh() && self.probe.is_some() {
            // A caller spinning on it, early: its next poll may finish it.
            return st;
        }
        // Not finished by this caller's spin (soon): the task does it.
        self.start_task();
        if st != "PROC" || !may_wait {
            return st;
        }
        let now = u64::try_from(age.as_nanos()).unwrap_or(u64::MAX).saturating_add(1);
        let last = self.shared.polled.swap(now, Ordering::Relaxed);
        let gap = u64::try_from(wait.spinning_gap().as_nanos()).unwrap_or(u64::MAX);
        if last == 0 || now.saturating_sub(last) >= gap {
            return st;
        }
        let mut rx = self.shared.done.subscribe();
        py.allow_threads(|| {
            // Closed engine: the task ended the transfer or is aborted;
            // the state below says which.
            let _ = bounded(&self.core, Some(wait.spinner_wait()), async move {
                let _ = rx.wait_for(Option::is_some).await;
            });
        });
        // The wait's own time does not count as the caller's gap.
        let after = u64::try_from(self.shared.started.elapsed().as_nanos()).unwrap_or(u64::MAX).saturating_add(1);
        self.shared.polled.store(after, Ordering::Relaxed);
        self.state()
    }

    /// The error of an `"ERR"` transfer (a `kvmove.TransferError`
    /// instance), else None.
    fn error(&self, py: Python<'_>) -> Option<PyObject> {
        let f = self.finished()?;
        f.error.map(|e| to_pyerr(py, &e).into_value(py).into_any())
    }

    /// Waits (GIL released) up to `timeout` seconds (None = no limit) for
    /// the end; returns the state then.
    #[pyo3(signature = (timeout = None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<&'static str> {
        self.start_task();
        let r = py.allow_threads(|| {
            let limit = timeout_arg(timeout)?;
            let mut rx = self.shared.done.subscribe();
            bounded(&self.core, limit, async move {
                let _ = rx.wait_for(Option::is_some).await;
            })
            .map(drop)
        });
        match r {
            Ok(()) => Ok(self.state()),
            // A closed engine ended its transfers: report what they became.
            Err(e) if e.kind() == ErrorKind::Shutdown => Ok(self.state()),
            Err(e) => Err(to_pyerr(py, &e)),
        }
    }

    /// Cancels what has not completed and waits (GIL released) until the
    /// transfer is quiet; returns the final state (`"DONE"` if it had
    /// completed already).
    fn cancel(&self, py: Python<'_>) -> &'static str {
        self.start_task();
        let _ = self.stop.send(true);
        let mut rx = self.shared.done.subscribe();
        let core = &self.core;
        py.allow_threads(|| {
            // A closed engine has ended (or aborted) the task: it reported.
            let _ = bounded(core, None, async move {
                let _ = rx.wait_for(Option::is_some).await;
            });
        });
        self.state()
    }

    /// `(start_time_us_since_epoch, post_duration_us, xfer_duration_us,
    /// total_bytes, descriptor_count)`; the duration so far while running.
    fn telemetry(&self) -> (u64, u64, u64, u64, u64) {
        let xfer_us = match self.finished() {
            Some(f) => f.xfer_us,
            None => micros(self.shared.started.elapsed()),
        };
        (self.start_unix_us, self.shared.post_us.load(Ordering::Relaxed), xfer_us, self.bytes, self.descs)
    }
}
