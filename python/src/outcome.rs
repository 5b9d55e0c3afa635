//! Shared plumbing for the two Python APIs: the per-thread last error,
//! logging, and converting outcomes to Python values.

use std::cell::RefCell;

use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};
use transport_core::{BatchState, Error, RequestStatus, TransferOutcome};

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

/// `(state, attempts, [(request_state, error_or_None), ...])`.
pub(crate) fn outcome_to_py(py: Python<'_>, o: &TransferOutcome) -> PyResult<PyObject> {
    let reqs = PyList::empty(py);
    for r in &o.requests {
        let item = match r {
            RequestStatus::Pending => ("pending", py.None()),
            RequestStatus::Completed => ("completed", py.None()),
            RequestStatus::Failed(e) => ("failed", to_pyerr(py, e).into_value(py).into_any()),
            RequestStatus::TimedOut => ("timed_out", py.None()),
            RequestStatus::Cancelled => ("cancelled", py.None()),
        };
        reqs.append(item)?;
    }
    Ok(PyTuple::new(
        py,
        [state_name(o.state).into_pyobject(py)?.into_any(), o.attempts.into_pyobject(py)?.into_any(), reqs.into_any()],
    )?
    .into_any()
    .unbind())
}
