//! Handoff sessions (rules 12, 13) and plain notifications (rule 11) for the
//! Pythonic API, over the engine's [`kvmove_policy::Sessions`] driver
//! (started on first use, once per engine; see [`Core::sessions`]).
//!
//! `NativeHandoff` is one side of one session (the receiver that granted,
//! or the sender that expects the grant); `NativeSessionWrite` is one write
//! of a sender, running in the engine's runtime so several layers can be in
//! flight at once. `kvmove/_engine.py` wraps them as `ReceiveSession`,
//! `SendSession` and `SessionWrite`.

use std::sync::Arc;
use std::time::Duration;

use kvmove_policy::session::{Grant, GrantBounds, Role, SessionKey, SessionState};
use kvmove_policy::{Sessions, TransferOutcome};
use parking_lot::Mutex;
use pyo3::prelude::*;
use tokio::sync::watch;
use transport_core::{Error, ErrorKind, Result};

use crate::core::{Core, RawOp};
use crate::errors::{invalid, to_pyerr};
use crate::outcome::outcome_to_py;

/// A grant as Python sees it: `(ranges, expected, deadline_seconds)`.
pub(crate) type GrantTuple = (Vec<(u64, u64)>, u64, f64);

/// `(state, error_or_None)`.
type StateTuple = (&'static str, Option<PyObject>);

pub(crate) fn grant_tuple(g: &Grant) -> GrantTuple {
    (g.ranges.clone(), g.expected, g.deadline.as_secs_f64())
}

/// A timeout in seconds: None = no limit.
pub(crate) fn timeout_arg(timeout: Option<f64>) -> Result<Option<Duration>> {
    match timeout {
        None => Ok(None),
        Some(t) if t >= 0.0 && t.is_finite() => Ok(Some(Duration::from_secs_f64(t))),
        Some(_) => Err(invalid("timeout must be a finite number of seconds >= 0")),
    }
}

/// Runs `f` on the engine's runtime, for at most `limit`: `None` when the
/// time ran out first; `Shutdown` if the engine is (or gets) closed.
pub(crate) fn bounded<F: std::future::Future>(core: &Core, limit: Option<Duration>, f: F) -> Result<Option<F::Output>> {
    core.live()?;
    let closed = core.until_closed();
    core.block_on(async move {
        let run = async move {
            match limit {
                Some(d) => tokio::time::timeout(d, f).await.ok(),
                None => Some(f.await),
            }
        };
        tokio::select! {
            biased;
            r = run => Ok(r),
            () = closed => Err(Error::new(ErrorKind::Shutdown, "the engine was closed")),
        }
    })
}

/// The error that explains a final state, if any: the failure, the expiry
/// (a transient `timeout`) or the cancellation.
fn state_error(st: &SessionState) -> Option<Error> {
    match st {
        SessionState::Failed(e) => Some(e.clone()),
        SessionState::Expired => {
            Some(Error::new(ErrorKind::Timeout, "the session's deadline passed before the sender finished"))
        }
        SessionState::Cancelled => Some(Error::new(ErrorKind::Cancelled, "the session was cancelled")),
        _ => None,
    }
}

fn state_tuple(py: Python<'_>, st: Option<&SessionState>) -> StateTuple {
    match st {
        None => ("released", None),
        Some(st) => (st.name(), state_error(st).map(|e| to_pyerr(py, &e).into_value(py).into_any())),
    }
}

/// One side of one handoff session.
#[pyclass(module = "kvmove._native", name = "NativeHandoff", frozen)]
pub(crate) struct NativeHandoff {
    core: Arc<Core>,
    sessions: Sessions,
    key: SessionKey,
    /// The grant (receiver: the one it gave; sender: once seen).
    grant: Mutex<Option<Grant>>,
}

impl NativeHandoff {
    /// Receiver: grants `peer` the ranges for `id` (the deadline starts now).
    pub(crate) fn receive(core: &Arc<Core>, peer: &str, id: u64, grant: Grant) -> Result<Self> {
        crate::core::check_peer_name(peer)?;
        let sessions = core.sessions()?;
        core.block_on(sessions.grant(peer, id, grant.clone()))?;
        Ok(Self {
            core: core.clone(),
            sessions,
            key: SessionKey::new(peer, id, Role::Receiver),
            grant: Mutex::new(Some(grant)),
        })
    }

    /// Sender: expects a grant from `peer` for `id`.
    pub(crate) fn send(core: &Arc<Core>, peer: &str, id: u64) -> Result<Self> {
        crate::core::check_peer_name(peer)?;
        let sessions = core.sessions()?;
        core.in_rt(|| sessions.expect(peer, id))?;
        Ok(Self { core: core.clone(), sessions, key: SessionKey::new(peer, id, Role::Sender), grant: Mutex::new(None) })
    }

    fn sender_only(&self, what: &str) -> Result<()> {
        if self.key.role != Role::Sender {
            return Err(invalid(format!("{what} is for the sending side of a session")));
        }
        Ok(())
    }

    /// The grant if this side has it now; never blocks.
    fn grant_now(&self) -> Result<Option<Grant>> {
        if let Some(g) = &*self.grant.lock() {
            return Ok(Some(g.clone()));
        }
        if self.sessions.state(&self.key).is_none() {
            // Released (asking `wait_grant` would expect it afresh).
            return Ok(None);
        }
        // `wait_grant` answers at once when the table holds the grant (or
        // the session ended); a zero timeout only stops it from waiting.
        match bounded(&self.core, Some(Duration::ZERO), self.sessions.wait_grant(&self.key.peer, self.key.id))? {
            Some(Ok(g)) => {
                *self.grant.lock() = Some(g.clone());
                Ok(Some(g))
            }
            Some(Err(e)) => Err(e),
            None => Ok(None),
        }
    }
}

/// Every range inside the granted memory: the session table's own check
/// (it makes it again before a byte moves), done here so the call that
/// starts a write raises at once.
fn check_inside(grant: &Grant, ranges: &[(u64, u64)]) -> Result<()> {
    GrantBounds::new(&grant.ranges).check(ranges)
}

#[pymethods]
impl NativeHandoff {
    /// The peer's session id (`host:port`).
    #[getter]
    fn peer(&self) -> String {
        self.key.peer.clone()
    }

    /// The session id both sides agreed on.
    #[getter]
    fn id(&self) -> u64 {
        self.key.id
    }

    /// `"sender"` or `"receiver"`.
    #[getter]
    fn role(&self) -> &'static str {
        match self.key.role {
            Role::Sender => "sender",
            Role::Receiver => "receiver",
        }
    }

    /// The grant `(ranges, expected, deadline_seconds)` if this side has
    /// it; never blocks.
    fn grant(&self) -> Option<GrantTuple> {
        // An error means the session ended before a grant came: none.
        self.grant_now().ok().flatten().as_ref().map(grant_tuple)
    }

    /// `(state, error)` now; never blocks. `"released"` once forgotten.
    fn state(&self, py: Python<'_>) -> StateTuple {
        state_tuple(py, self.sessions.state(&self.key).as_ref())
    }

    /// Waits (GIL released) up to `timeout` seconds (None = no limit) for
    /// the final state; `(state, error)`, or None if still open.
    #[pyo3(signature = (timeout = None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<StateTuple>> {
        let limit = timeout_arg(timeout).map_err(|e| to_pyerr(py, &e))?;
        if let Some(st) = self.sessions.state(&self.key).filter(SessionState::is_final) {
            // Also after the engine closed.
            return Ok(Some(state_tuple(py, Some(&st))));
        }
        let r = py.allow_threads(|| bounded(&self.core, limit, self.sessions.wait(&self.key)));
        match r.and_then(Option::transpose) {
            Ok(None) => Ok(None),
            Ok(Some(st)) => Ok(Some(state_tuple(py, Some(&st)))),
            Err(e) => Err(to_pyerr(py, &e)),
        }
    }

    /// Sender: waits up to `timeout` seconds for the grant; returns it, or
    /// None if it has not come yet. Raises the session's error if it ended
    /// first.
    #[pyo3(signature = (timeout = None))]
    fn wait_grant(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<GrantTuple>> {
        let r = (|| {
            self.sender_only("wait_grant")?;
            let limit = timeout_arg(timeout)?;
            let got =
                py.allow_threads(|| bounded(&self.core, limit, self.sessions.wait_grant(&self.key.peer, self.key.id)));
            match got?.transpose()? {
                None => Ok(None),
                Some(g) => {
                    *self.grant.lock() = Some(g.clone());
                    Ok(Some(grant_tuple(&g)))
                }
            }
        })();
        r.map_err(|e| to_pyerr(py, &e))
    }

    /// Sender: starts writing `ops` (`(local_addr, remote_addr, length)`)
    /// into the peer's granted ranges. Raises before a byte moves when there
    /// is no grant yet, a range falls outside it, or a local address is not
    /// registered. The write runs through the engine's policy and is
    /// bounded by the session's deadline.
    fn write(&self, py: Python<'_>, ops: Vec<(u64, u64, u64)>) -> PyResult<NativeSessionWrite> {
        let r = (|| {
            self.sender_only("write")?;
            if ops.is_empty() {
                return Err(invalid("empty write"));
            }
            let grant =
                self.grant_now()?.ok_or_else(|| invalid("no grant yet: nothing may be sent (wait_grant first)"))?;
            // The table checks again when the write starts (a session may
            // end meanwhile); this makes a write to an ended one raise here.
            match self.sessions.state(&self.key) {
                Some(SessionState::Granted | SessionState::Transferring) => {}
                st => {
                    return Err(invalid("the session is no longer open for writes")
                        .with("state", st.as_ref().map_or("released", SessionState::name)))
                }
            }
            let ranges: Vec<(u64, u64)> = ops.iter().map(|&(_, r, n)| (r, n)).collect();
            check_inside(&grant, &ranges)?;
            let raw: Vec<RawOp> = ops
                .iter()
                .map(|&(local_addr, remote_addr, len)| RawOp {
                    op: transport_core::Opcode::Write,
                    local_addr,
                    remote_addr,
                    len,
                })
                .collect();
            py.allow_threads(|| {
                let seg = self.core.block_on(self.sessions.segment(&self.key.peer))?;
                let reqs = self.core.requests(seg, &raw)?;
                // The task owns the sender: if it is dropped unfinished (the
                // engine closed), waiters see the channel closed.
                let (tx, rx) = watch::channel(None);
                let sessions = self.sessions.clone();
                let (peer, id) = (self.key.peer.clone(), self.key.id);
                self.core.spawn(async move {
                    let r = sessions.write(&peer, id, reqs).await;
                    tx.send_replace(Some(r));
                });
                Ok(NativeSessionWrite { core: self.core.clone(), result: rx })
            })
        })();
        r.map_err(|e| to_pyerr(py, &e))
    }

    /// Sender: every write completed; the receiver decides the outcome
    /// (`landed` when the bytes match what it expects). Await it with
    /// `wait`.
    fn finish(&self, py: Python<'_>) -> PyResult<()> {
        let r = self
            .sender_only("finish")
            .and_then(|()| self.core.in_rt(|| self.sessions.finish(&self.key.peer, self.key.id)));
        r.map_err(|e| to_pyerr(py, &e))
    }

    /// Cancels the session (either side) and waits for the final state
    /// both sides agree on: `cancelled`, or the outcome the receiver had
    /// already decided. Returns `(state, error)`.
    fn cancel(&self, py: Python<'_>) -> PyResult<StateTuple> {
        let r = py.allow_threads(|| {
            bounded(&self.core, None, self.sessions.cancel(&self.key))
                .and_then(|r| r.unwrap_or_else(|| Err(Error::shut_down())))
        });
        match r {
            Ok(st) => Ok(state_tuple(py, Some(&st))),
            Err(e) => Err(to_pyerr(py, &e)),
        }
    }

    /// Forgets a final session (final sessions are also forgotten after a
    /// minute). Raises while it is open.
    fn release(&self, py: Python<'_>) -> PyResult<()> {
        self.core.in_rt(|| self.sessions.release(&self.key)).map_err(|e| to_pyerr(py, &e))
    }
}

/// One write of a sending session, running in the engine's runtime.
#[pyclass(module = "kvmove._native", name = "NativeSessionWrite", frozen)]
pub(crate) struct NativeSessionWrite {
    core: Arc<Core>,
    result: watch::Receiver<Option<Result<TransferOutcome>>>,
}

impl NativeSessionWrite {
    fn to_py(py: Python<'_>, r: &Result<TransferOutcome>) -> PyResult<PyObject> {
        match r {
            Ok(o) => outcome_to_py(py, o),
            Err(e) => Err(to_pyerr(py, e)),
        }
    }
}

#[pymethods]
impl NativeSessionWrite {
    /// Whether the write is finished.
    #[getter]
    fn done(&self) -> bool {
        self.result.borrow().is_some()
    }

    /// The outcome tuple if finished, else None; raises if the write was
    /// refused. Never blocks.
    fn poll(&self, py: Python<'_>) -> PyResult<Option<PyObject>> {
        let r = self.result.borrow().clone();
        r.map(|r| Self::to_py(py, &r)).transpose()
    }

    /// Waits up to `timeout` seconds (None = no limit); the outcome tuple,
    /// or None if still running. Raises if the write was refused.
    #[pyo3(signature = (timeout = None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<PyObject>> {
        let limit = timeout_arg(timeout).map_err(|e| to_pyerr(py, &e))?;
        if let Some(r) = self.result.borrow().clone() {
            // Also after the engine closed.
            return Self::to_py(py, &r).map(Some);
        }
        let mut rx = self.result.clone();
        let got = py.allow_threads(|| {
            bounded(&self.core, limit, async move { rx.wait_for(|v| v.is_some()).await.map(|v| v.clone()) })
        });
        match got {
            Ok(None) => Ok(None),
            Ok(Some(Ok(Some(r)))) => Self::to_py(py, &r).map(Some),
            Ok(Some(_)) => Err(to_pyerr(py, &Error::shut_down())),
            Err(e) => Err(to_pyerr(py, &e)),
        }
    }
}
