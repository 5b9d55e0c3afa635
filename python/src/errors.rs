//! Engine errors as Python exceptions.
//!
//! Every [`transport_core::Error`] becomes a `kvmove.TransferError`, raised
//! as its subclass `TransientError` (retrying later may help) or
//! `PermanentError` (the request is wrong; do not retry). The exception
//! carries `.kind` (the stable lower-case `ErrorKind` name, e.g.
//! `"connection_refused"`), `.is_transient`, `.is_peer_failure` (the
//! failure says the peer is down or unreachable: what a circuit breaker
//! counts), `.reopens_segment` (a handle kept for the peer is stale: close
//! it and open the peer again), `.message` and `.context` (a dict: peer,
//! request index, ...).
//! These come from `ErrorKind`'s one table; Python restates none of it:
//! `error_kinds()` gives the table, `make_error(kind, message)` builds the
//! exception for an error raised on the Python side.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use transport_core::{Error, ErrorKind};

create_exception!(
    _native,
    TransferError,
    PyException,
    "A transfer-engine error: `.kind`, `.is_transient`, `.is_peer_failure`, `.reopens_segment`, `.message`, \
     `.context`."
);
create_exception!(_native, TransientError, TransferError, "A transfer error that may succeed when retried.");
create_exception!(_native, PermanentError, TransferError, "A transfer error that retrying will not fix.");

/// Converts an engine error into the matching Python exception.
pub(crate) fn to_pyerr(py: Python<'_>, e: &Error) -> PyErr {
    let msg = e.to_string();
    let err = if e.is_transient() { TransientError::new_err(msg) } else { PermanentError::new_err(msg) };
    let value = err.value(py);
    // Setting attributes on a fresh exception instance cannot fail short of
    // memory exhaustion; the exception is still raised if it does.
    let _ = value.setattr("kind", e.kind().as_str());
    let _ = value.setattr("is_transient", e.is_transient());
    let _ = value.setattr("is_peer_failure", e.kind().is_peer_failure());
    let _ = value.setattr("reopens_segment", e.kind().reopens_segment());
    let _ = value.setattr("message", e.message());
    let ctx = PyDict::new(py);
    for (k, v) in e.context() {
        let _ = ctx.set_item(*k, v);
    }
    let _ = value.setattr("context", ctx);
    err
}

/// Shorthand for a permanent `InvalidRequest` error.
pub(crate) fn invalid(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidRequest, msg)
}

/// The exception for a new error of `kind` (its `ErrorKind` name, as in
/// `.kind`) with `message`: the class, `.is_transient`,
/// `.is_peer_failure` and `.reopens_segment` follow the kind, as for
/// errors the engine raises.
#[pyfunction]
fn make_error(py: Python<'_>, kind: &str, message: &str) -> PyResult<PyObject> {
    let kind = ErrorKind::from_name(kind)
        .ok_or_else(|| pyo3::exceptions::PyValueError::new_err(format!("unknown error kind {kind:?}")))?;
    Ok(to_pyerr(py, &Error::new(kind, message)).into_value(py).into_any())
}

/// Every error kind: `{name: {"transient": bool, "peer_failure": bool,
/// "reopens_segment": bool}}`.
#[pyfunction]
fn error_kinds(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let out = PyDict::new(py);
    for k in ErrorKind::ALL {
        let row = PyDict::new(py);
        row.set_item("transient", k.is_transient())?;
        row.set_item("peer_failure", k.is_peer_failure())?;
        row.set_item("reopens_segment", k.reopens_segment())?;
        out.set_item(k.as_str(), row)?;
    }
    Ok(out)
}

/// Registers the exception classes on the module.
pub(crate) fn add_to_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("TransferError", py.get_type::<TransferError>())?;
    m.add("TransientError", py.get_type::<TransientError>())?;
    m.add("PermanentError", py.get_type::<PermanentError>())?;
    m.add_function(wrap_pyfunction!(make_error, m)?)?;
    m.add_function(wrap_pyfunction!(error_kinds, m)?)?;
    Ok(())
}
