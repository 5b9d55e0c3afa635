//! Shared plumbing for the two Python APIs: the per-thread last error,
//! logging, and converting outcomes to Python values.

use std::cell::RefCell;

use kvmove_policy::TransferOutcome;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};
use transport_core::{BatchState, Error, RequestStatus};

use crate::errors::to_pyerr;

thread_local! {
    /// The error of the last failed Mooncake-style call on this thread.
    static LAST_ERROR: RefCell<Option<Error>> = const { RefCell::new(None) };
}

/// Remembers `e` as this thread's last error.
pub(crate) fn set_last_error(e: Error) {
    LAST_ERROR.with(|l| *l.borrow_mut() = Some(e));
}

/// This thread's last error as an (unraised) exception instance.
pub(crate) fn last_error(py: Python<'_>) -> Option<PyObject> {
    LAST_ERROR.with(|l| l.borrow().as_ref().map(|e| to_pyerr(py, e).into_value(py).into_any()))
}

/// Logs through Python's `logging` (logger `kvmove`), on the calling
/// thread, outside the data path. Logging failures are ignored.
pub(crate) fn log(py: Python<'_>, level: &str, msg: &str) {
    let _ = py
        .import("logging")
        .and_then(|m| m.call_method1("getLogger", ("kvmove",)))
        .and_then(|l| l.call_method1(level, (msg,)));
}

/// The lower-case name of a batch state.
pub(crate) fn state_name(s: BatchState) -> &'static str {
    match s {
        BatchState::InProgress => "in_progress",
        BatchState::Completed => "completed",
        BatchState::Failed => "failed",
        BatchState::TimedOut => "timed_out",
        BatchState::Cancelled => "cancelled",
    }
}

/// `(state, attempts, requests, [(index, request_state, error_or_None), ...])`:
/// only the requests that did not complete are listed, so a batch that
/// completed costs no Python object per request (`kvmove.Outcome` makes
/// them on first use of `.requests`).
pub(crate) fn outcome_to_py(py: Python<'_>, o: &TransferOutcome) -> PyResult<PyObject> {
    let not_done = PyList::empty(py);
    for (i, r) in o.requests.iter().enumerate() {
        let (state, err) = match r {
            RequestStatus::Completed => continue,
            RequestStatus::Pending => ("pending", py.None()),
            RequestStatus::Failed(e) => ("failed", to_pyerr(py, e).into_value(py).into_any()),
            RequestStatus::TimedOut => ("timed_out", py.None()),
            RequestStatus::Cancelled => ("cancelled", py.None()),
        };
        not_done.append((i, state, err))?;
    }
    Ok(PyTuple::new(
        py,
        [
            state_name(o.state).into_pyobject(py)?.into_any(),
            o.attempts.into_pyobject(py)?.into_any(),
            o.requests.len().into_pyobject(py)?.into_any(),
            not_done.into_any(),
        ],
    )?
    .into_any()
    .unbind())
}
