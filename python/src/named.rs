//! Named notifications, the one framing both the Mooncake API
//! (`TransferNotify`) and the NIXL API (`send_notif`, and a transfer's
//! notification) put on a plain rule-11 notification: `"\0KVN"`, the
//! name's length (u16 little-endian), the name, the message. The whole
//! thing is one notification, so it fits in `MAX_NOTIFY_LEN` bytes.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use transport_core::{Result, MAX_NOTIFY_LEN};

use crate::errors::invalid;

/// First bytes of a named notification.
pub(crate) const MAGIC: [u8; 4] = *b"\0KVN";
/// Bytes before the name: the magic and the name's length.
const HEADER: usize = MAGIC.len() + 2;

/// The wire message of `msg` named `name`; `InvalidRequest` when it does
/// not fit in one notification (the error says how much room there was).
pub(crate) fn encode(name: &[u8], msg: &[u8]) -> Result<Vec<u8>> {
    let len = u16::try_from(name.len()).map_err(|_| invalid("notification name too long"))?;
    let total = HEADER.saturating_add(name.len()).saturating_add(msg.len());
    if total > MAX_NOTIFY_LEN {
        let room = MAX_NOTIFY_LEN.saturating_sub(HEADER + name.len());
        return Err(invalid(format!("notification message of {} bytes is too long: at most {room} bytes", msg.len()))
            .with("len", total)
            .with("max", MAX_NOTIFY_LEN));
    }
    let mut v = Vec::with_capacity(total);
    v.extend_from_slice(&MAGIC);
    v.extend_from_slice(&len.to_le_bytes());
    v.extend_from_slice(name);
    v.extend_from_slice(msg);
    Ok(v)
}

/// The name and message of a named notification; `None` for anything else
/// (a plain notification, or one whose name runs past its end).
pub(crate) fn decode(wire: &[u8]) -> Option<(&[u8], &[u8])> {
    let rest = wire.strip_prefix(&MAGIC)?;
    let (len, rest) = rest.split_first_chunk::<2>()?;
    let len = usize::from(u16::from_le_bytes(*len));
    (rest.len() >= len).then(|| rest.split_at(len))
}

/// `named_notification(name, msg) -> bytes`: [`encode`] for Python (the
/// NIXL API); `ValueError` saying the room left when it does not fit.
#[pyfunction]
pub(crate) fn named_notification<'py>(py: Python<'py>, name: &str, msg: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
    let wire = encode(name.as_bytes(), msg).map_err(|e| PyValueError::new_err(e.message().to_owned()))?;
    Ok(PyBytes::new(py, &wire))
}

/// `read_named_notification(wire) -> (name, msg) | None`: [`decode`] for
/// Python; `None` also when the name is not UTF-8.
#[pyfunction]
pub(crate) fn read_named_notification<'py>(py: Python<'py>, wire: &[u8]) -> Option<(String, Bound<'py, PyBytes>)> {
    let (name, msg) = decode(wire)?;
    let name = std::str::from_utf8(name).ok()?.to_owned();
    Some((name, PyBytes::new(py, msg)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_the_bound() {
        let wire = encode(b"req-7", b"kv ready").unwrap();
        assert!(wire.starts_with(&MAGIC));
        assert_eq!(decode(&wire), Some((&b"req-7"[..], &b"kv ready"[..])));
        assert_eq!(decode(&encode(b"", b"").unwrap()), Some((&b""[..], &b""[..])));
        let fits = vec![b'x'; MAX_NOTIFY_LEN - HEADER - 1];
        assert_eq!(encode(b"n", &fits).unwrap().len(), MAX_NOTIFY_LEN);
        let e = encode(b"n", &[fits.as_slice(), b"y"].concat()).unwrap_err();
        assert!(e.message().contains(&format!("at most {} bytes", fits.len())), "{e}");
        assert!(encode(&vec![b'n'; 70_000], b"").is_err());
    }

    #[test]
    fn anything_else_is_not_named() {
        assert_eq!(decode(b"hello"), None);
        let mut short = MAGIC.to_vec();
        short.extend_from_slice(&100u16.to_le_bytes());
        short.extend_from_slice(b"short");
        assert_eq!(decode(&short), None, "a name past the end");
        assert_eq!(decode(&MAGIC[..3]), None);
    }
}
