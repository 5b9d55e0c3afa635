//! Engine errors as Python exceptions.
//!
//! Every [`transport_core::Error`] becomes a `kvmove.TransferError`, raised
//! as its subclass `TransientError` (retrying later may help) or
//! `PermanentError` (the request is wrong; do not retry). The exception
//! carries `.kind` (the stable lower-case `ErrorKind` name, e.g.
//! `"connection_refused"`), `.is_transient`, `.message` and `.context` (a
//! dict: peer, request index, ...).

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use transport_core::{Error, ErrorKind};

create_exception!(
    _native,
    TransferError,
    PyException,
    "A transfer-engine error: `.kind`, `.is_transient`, `.message`, `.context`."
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

/// Registers the exception classes on the module.
pub(crate) fn add_to_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("TransferError", py.get_type::<TransferError>())?;
    m.add("TransientError", py.get_type::<TransientError>())?;
    m.add("PermanentError", py.get_type::<PermanentError>())?;
    Ok(())
}
