//! Mooncake's `TransferNotify` (a `name` and a `msg`) and the arguments
//! that carry one, on the wire as a named notification ([`crate::named`]).

use kvmove_policy::session::is_session_message;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString};
use transport_core::{Notification, Result};

use crate::named;

/// Mooncake's `TransferNotify`: a `name` and a `msg`, sent to the target of
/// a transfer once every byte of it has landed, and returned by the
/// target's `get_notifies()`.
#[pyclass(module = "kvmove._native", name = "TransferNotify", eq)]
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct TransferNotify {
    /// The name the sender chose (e.g. a request id).
    #[pyo3(get, set)]
    name: String,
    /// The message text.
    #[pyo3(get, set)]
    msg: String,
}

#[pymethods]
impl TransferNotify {
    #[new]
    #[pyo3(signature = (name = None, msg = None))]
    fn py_new(name: Option<&Bound<'_, PyAny>>, msg: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        Ok(Self { name: text_arg("name", name)?, msg: text_arg("msg", msg)? })
    }

    fn __repr__(&self) -> String {
        format!("TransferNotify(name={:?}, msg={:?})", self.name, self.msg)
    }
}

/// A `str`, or `bytes` holding UTF-8 (as pybind11's `std::string`).
fn text_arg(what: &str, v: Option<&Bound<'_, PyAny>>) -> PyResult<String> {
    let Some(v) = v else { return Ok(String::new()) };
    if let Ok(s) = v.downcast::<PyString>() {
        return Ok(s.to_str()?.to_owned());
    }
    if let Ok(b) = v.downcast::<PyBytes>() {
        return String::from_utf8(b.as_bytes().to_vec())
            .map_err(|_| PyTypeError::new_err(format!("TransferNotify.{what}: bytes are not UTF-8")));
    }
    Err(PyTypeError::new_err(format!("TransferNotify.{what} must be str or bytes")))
}

impl TransferNotify {
    /// The notification's wire message (a named notification,
    /// [`crate::named`]); `InvalidRequest` when it does not fit.
    pub(super) fn encode(&self) -> Result<Vec<u8>> {
        named::encode(self.name.as_bytes(), self.msg.as_bytes())
    }

    /// A received notification as Mooncake shows it. One not sent by a
    /// Mooncake-style `notify` (a plain `kvmove.Engine.notify`) shows the
    /// sender's session id as its name. Session control messages are not
    /// notifications: `None`.
    pub(super) fn decode(n: Notification) -> Option<Self> {
        if is_session_message(&n.msg) {
            return None;
        }
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        if let Some((name, msg)) = named::decode(&n.msg) {
            return Some(Self { name: text(name), msg: text(msg) });
        }
        Some(Self { name: n.from, msg: text(&n.msg) })
    }
}

/// The `notify` argument: a `TransferNotify`, or any object with `name` and
/// `msg` attributes (Mooncake's own class), or None.
pub(super) fn notify_arg(notify: Option<&Bound<'_, PyAny>>) -> PyResult<Option<TransferNotify>> {
    let Some(n) = notify else { return Ok(None) };
    if n.is_none() {
        return Ok(None);
    }
    if let Ok(t) = n.extract::<TransferNotify>() {
        return Ok(Some(t));
    }
    match (n.getattr("name"), n.getattr("msg")) {
        (Ok(name), Ok(msg)) => {
            Ok(Some(TransferNotify { name: text_arg("name", Some(&name))?, msg: text_arg("msg", Some(&msg))? }))
        }
        _ => Err(PyTypeError::new_err("notify must be a TransferNotify (with .name and .msg) or None")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use transport_core::ErrorKind;
    use transport_core::MAX_NOTIFY_LEN;

    fn received(msg: Vec<u8>) -> Notification {
        Notification { from: "10.0.0.1:7000".into(), msg }
    }

    #[test]
    fn notify_round_trip() {
        let n = TransferNotify { name: "req-7".into(), msg: "kv ready".into() };
        let wire = n.encode().unwrap();
        assert!(wire.starts_with(&named::MAGIC));
        assert_eq!(TransferNotify::decode(received(wire)), Some(n));
        let empty = TransferNotify::default();
        assert_eq!(TransferNotify::decode(received(empty.encode().unwrap())), Some(empty));
    }

    #[test]
    fn notify_size_is_checked_before_sending() {
        let n = TransferNotify { name: "n".into(), msg: "x".repeat(MAX_NOTIFY_LEN) };
        assert_eq!(n.encode().unwrap_err().kind(), ErrorKind::InvalidRequest);
        let n = TransferNotify { name: "n".into(), msg: "x".repeat(MAX_NOTIFY_LEN - 7) };
        assert_eq!(n.encode().unwrap().len(), MAX_NOTIFY_LEN);
    }

    #[test]
    fn plain_and_truncated_messages_show_the_sender() {
        let plain = TransferNotify::decode(received(b"hello".to_vec())).unwrap();
        assert_eq!((plain.name.as_str(), plain.msg.as_str()), ("10.0.0.1:7000", "hello"));
        // A name length past the end: not a Mooncake notify, shown as is.
        let mut bad = named::MAGIC.to_vec();
        bad.extend_from_slice(&100u16.to_le_bytes());
        bad.extend_from_slice(b"short");
        assert_eq!(TransferNotify::decode(received(bad)).unwrap().name, "10.0.0.1:7000");
        // Session control messages are not notifications.
        let mut session = kvmove_policy::session::wire::MAGIC.to_vec();
        session.resize(22, 0); // a whole session header
        assert_eq!(TransferNotify::decode(received(session)), None);
    }
}
