//! How etcd failures become `transport_core::Error`s.
//!
//! Every error names the operation, the key (where there is one) and the
//! endpoints, so a log line says which etcd and which segment. The kinds:
//!
//! | etcd failure | kind | transient |
//! | --- | --- | --- |
//! | endpoint unreachable, gRPC `Unavailable`, transport error | `ConnectionRefused` | yes |
//! | stream (watch, keep-alive) broken, gRPC `Aborted`/`Cancelled` | `ConnectionReset` | yes |
//! | no answer within the request timeout, gRPC `DeadlineExceeded` | `Timeout` | yes |
//! | bytes under our key that are not a descriptor | `Protocol` | yes |
//! | other I/O | `Io` | yes |
//! | bad endpoint URL or argument | `Config` | no |
//! | authentication or permission refused | `AuthFailed` | no |

use std::fmt;
use std::time::Duration;

use transport_core::{Error, ErrorKind};

/// Where an error happened: the operation, the key and the endpoints.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ctx<'a> {
    pub op: &'static str,
    pub key: &'a str,
    pub endpoint: &'a str,
}

impl Ctx<'_> {
    /// Adds this context to an error.
    pub fn attach(&self, e: Error) -> Error {
        let e = e.with("op", self.op);
        let e = if self.key.is_empty() { e } else { e.with("key", self.key) };
        e.with("endpoint", self.endpoint)
    }

    /// An error of `kind` in this context.
    pub fn error(&self, kind: ErrorKind, message: impl fmt::Display) -> Error {
        self.attach(Error::new(kind, format!("etcd {}: {message}", self.op)))
    }

    /// The request did not finish within `limit`.
    pub fn timed_out(&self, limit: Duration) -> Error {
        self.error(ErrorKind::Timeout, format_args!("no answer within {} ms", limit.as_millis()))
    }

    /// Converts an etcd client error.
    pub fn client(&self, e: etcd_client::Error) -> Error {
        let kind = kind_of(&e);
        // The client error's text follows as the source in `Display`.
        self.error(kind, "request failed").with_source(e)
    }
}

/// The kind an etcd client error maps to (see the module table).
pub(crate) fn kind_of(e: &etcd_client::Error) -> ErrorKind {
    use etcd_client::Error as E;
    match e {
        E::TransportError(_) => ErrorKind::ConnectionRefused,
        E::GRpcStatus(s) => kind_of_status(s.code()),
        E::IoError(io) => Error::from(std::io::Error::new(io.kind(), "")).kind(),
        E::WatchError(_) | E::LeaseKeepAliveError(_) => ErrorKind::ConnectionReset,
        E::Utf8Error(_) => ErrorKind::Protocol,
        E::InvalidArgs(_)
        | E::InvalidUri(_)
        | E::InvalidMetadataValue(_)
        | E::EndpointError(_)
        | E::EndpointsNotManaged => ErrorKind::Config,
        E::ElectError(_) | E::Internal(_) => ErrorKind::Io,
        #[allow(unreachable_patterns)] // `etcd_client::Error` grows with features
        _ => ErrorKind::Io,
    }
}

fn kind_of_status(code: tonic::Code) -> ErrorKind {
    use tonic::Code as C;
    match code {
        C::Unavailable => ErrorKind::ConnectionRefused,
        C::DeadlineExceeded => ErrorKind::Timeout,
        C::Aborted | C::Cancelled => ErrorKind::ConnectionReset,
        C::ResourceExhausted => ErrorKind::ResourceExhausted,
        C::Unauthenticated | C::PermissionDenied => ErrorKind::AuthFailed,
        C::InvalidArgument | C::FailedPrecondition | C::OutOfRange | C::AlreadyExists => ErrorKind::InvalidRequest,
        C::NotFound => ErrorKind::NotFound,
        C::Unimplemented => ErrorKind::Unsupported,
        C::Ok | C::Unknown | C::Internal | C::DataLoss => ErrorKind::Io,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_codes_map_to_kinds() {
        let status = |code| etcd_client::Error::GRpcStatus(tonic::Status::new(code, "x"));
        assert_eq!(kind_of(&status(tonic::Code::Unavailable)), ErrorKind::ConnectionRefused);
        assert_eq!(kind_of(&status(tonic::Code::DeadlineExceeded)), ErrorKind::Timeout);
        assert_eq!(kind_of(&status(tonic::Code::PermissionDenied)), ErrorKind::AuthFailed);
        assert_eq!(kind_of(&status(tonic::Code::InvalidArgument)), ErrorKind::InvalidRequest);
        assert!(kind_of(&status(tonic::Code::Unavailable)).is_transient());
        assert!(!kind_of(&status(tonic::Code::Unauthenticated)).is_transient());
        assert_eq!(kind_of(&etcd_client::Error::WatchError("closed".into())), ErrorKind::ConnectionReset);
        assert_eq!(kind_of(&etcd_client::Error::InvalidArgs("bad".into())), ErrorKind::Config);
        let io = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert_eq!(kind_of(&etcd_client::Error::IoError(io)), ErrorKind::ConnectionRefused);
    }

    #[test]
    fn context_names_op_key_and_endpoint() {
        let ctx = Ctx { op: "get", key: "/kvmove/segments/a", endpoint: "http://127.0.0.1:2379" };
        let e = ctx.timed_out(Duration::from_millis(250));
        assert_eq!(e.kind(), ErrorKind::Timeout);
        assert_eq!(e.context_value("op"), Some("get"));
        assert_eq!(e.context_value("key"), Some("/kvmove/segments/a"));
        assert_eq!(e.context_value("endpoint"), Some("http://127.0.0.1:2379"));
        assert!(e.to_string().contains("no answer within 250 ms"), "{e}");
    }
}
