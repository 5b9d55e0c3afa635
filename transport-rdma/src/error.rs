//! The backend's private errors and their mapping to the public kinds.

use transport_core::{Error, ErrorKind};

/// A verb that failed, with the errno it reported.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{verb} failed: {} (errno {errno})", describe(*.errno))]
pub struct VerbsError {
    /// The verb's C name (`ibv_create_qp`).
    pub verb: &'static str,
    /// The errno (`ENOMEM` = 12, ...).
    pub errno: i32,
}

fn describe(errno: i32) -> String {
    let s = std::io::Error::from_raw_os_error(errno).to_string();
    match s.find(" (os error") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}

impl VerbsError {
    pub(crate) fn new(verb: &'static str, errno: i32) -> Self {
        Self { verb, errno }
    }

    /// The failure of `verb` from the thread's errno (EIO if errno is 0).
    pub(crate) fn last(verb: &'static str) -> Self {
        let errno = std::io::Error::last_os_error().raw_os_error().filter(|&e| e != 0).unwrap_or(libc::EIO);
        Self { verb, errno }
    }

    /// The public kind: ENOMEM and friends are resource exhaustion
    /// (transient: freeing endpoints may help), EOPNOTSUPP is unsupported,
    /// EACCES/EPERM access denied, EINVAL an internal error (we passed bad
    /// attributes), the rest I/O.
    pub fn kind(&self) -> ErrorKind {
        match self.errno {
            libc::ENOMEM | libc::ENOSPC | libc::EAGAIN | libc::EMFILE | libc::ENFILE => ErrorKind::ResourceExhausted,
            libc::EOPNOTSUPP | libc::ENOSYS => ErrorKind::Unsupported,
            libc::EACCES | libc::EPERM => ErrorKind::AccessDenied,
            libc::EINVAL => ErrorKind::Internal,
            _ => ErrorKind::Io,
        }
    }
}

impl From<VerbsError> for Error {
    fn from(e: VerbsError) -> Self {
        Error::new(e.kind(), e.to_string()).with("verb", e.verb)
    }
}

/// Why the transport could not be set up or an operation failed, before it
/// becomes a public [`Error`].
#[derive(Debug, thiserror::Error)]
pub(crate) enum RdmaError {
    #[error("no RDMA device found (is rdma_rxe loaded, or the NIC driver? see `rdma link`)")]
    NoDevice,
    #[error("RDMA device {want:?} not found (devices: {have:?})")]
    DeviceNotFound { want: String, have: Vec<String> },
    #[error("port {port} of {device} is not active (state {state})")]
    PortDown { device: String, port: u8, state: u32 },
    #[error("{device} port {port} has no GID at index {gid_index}")]
    NoGid { device: String, port: u8, gid_index: u8 },
    #[error(transparent)]
    Verbs(#[from] VerbsError),
}

impl From<RdmaError> for Error {
    fn from(e: RdmaError) -> Self {
        match e {
            RdmaError::Verbs(v) => v.into(),
            RdmaError::NoDevice | RdmaError::DeviceNotFound { .. } | RdmaError::NoGid { .. } => {
                Error::new(ErrorKind::Config, e.to_string())
            }
            RdmaError::PortDown { .. } => Error::new(ErrorKind::ConnectionReset, e.to_string()),
        }
    }
}

/// Maps a failed work completion to a public error. Transport-level
/// failures (retries exhausted, flushed by a QP error, remote operation
/// errors) are transient; remote access and protection errors are
/// permanent `AccessDenied`.
pub(crate) fn completion_error(status: u32, vendor_err: u32) -> Error {
    use rdma_sys::ibv_wc_status as S;
    let (kind, what) = match status {
        S::IBV_WC_RETRY_EXC_ERR => (ErrorKind::RetryExceeded, "transport retry counter exceeded"),
        S::IBV_WC_RNR_RETRY_EXC_ERR => (ErrorKind::RetryExceeded, "receiver-not-ready retry counter exceeded"),
        S::IBV_WC_RESP_TIMEOUT_ERR => (ErrorKind::RetryExceeded, "response timeout"),
        S::IBV_WC_REM_ACCESS_ERR => (ErrorKind::AccessDenied, "remote access error (bad rkey, bounds or access)"),
        S::IBV_WC_LOC_PROT_ERR => (ErrorKind::AccessDenied, "local protection error"),
        S::IBV_WC_LOC_ACCESS_ERR => (ErrorKind::AccessDenied, "local access error"),
        S::IBV_WC_REM_INV_REQ_ERR => (ErrorKind::AccessDenied, "remote invalid request"),
        S::IBV_WC_WR_FLUSH_ERR => (ErrorKind::ConnectionReset, "work request flushed (the queue pair broke)"),
        S::IBV_WC_REM_OP_ERR => (ErrorKind::ConnectionReset, "remote operation error"),
        S::IBV_WC_REM_ABORT_ERR => (ErrorKind::ConnectionReset, "remote aborted"),
        S::IBV_WC_FATAL_ERR => (ErrorKind::ConnectionReset, "fatal device error"),
        S::IBV_WC_LOC_QP_OP_ERR => (
            ErrorKind::ConnectionReset,
            "local QP operation error (it could not send: link down or no route to the peer)",
        ),
        S::IBV_WC_LOC_LEN_ERR => (ErrorKind::Protocol, "local length error (a work request exceeded a limit)"),
        _ => (ErrorKind::ConnectionReset, "work completion error"),
    };
    Error::new(kind, what).with("wc_status", status).with("vendor_err", vendor_err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verbs_error_names_verb_and_errno() {
        let e = VerbsError::new("ibv_create_qp", libc::ENOMEM);
        assert_eq!(e.to_string(), "ibv_create_qp failed: Cannot allocate memory (errno 12)");
        let pe: Error = e.into();
        assert_eq!(pe.kind(), ErrorKind::ResourceExhausted);
        assert!(pe.is_transient());
    }

    #[test]
    fn completion_errors_classified() {
        use rdma_sys::ibv_wc_status as S;
        assert_eq!(completion_error(S::IBV_WC_RETRY_EXC_ERR, 0).kind(), ErrorKind::RetryExceeded);
        assert_eq!(completion_error(S::IBV_WC_WR_FLUSH_ERR, 0).kind(), ErrorKind::ConnectionReset);
        assert_eq!(completion_error(S::IBV_WC_REM_ACCESS_ERR, 0).kind(), ErrorKind::AccessDenied);
        assert!(!completion_error(S::IBV_WC_REM_ACCESS_ERR, 0).is_transient());
        assert!(completion_error(99, 0).is_transient());
        let e = completion_error(S::IBV_WC_LOC_QP_OP_ERR, 0);
        assert!(e.is_transient() && e.message().contains("link down"), "{e}");
    }
}
