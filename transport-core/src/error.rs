//! The one public error type: a kind that says what to do, plus context.

use std::fmt;
use std::sync::Arc;

/// What went wrong, phrased as what the caller should do about it.
///
/// Transient kinds ([`ErrorKind::is_transient`]) may succeed when retried
/// (after backoff, on a new endpoint); permanent kinds are the caller's
/// mistake or a final decision and are never retried by the policy layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum ErrorKind {
    // ---- transient: the peer or the network; retry may help ----
    /// The peer refused the connection or is not listening (peer down).
    ConnectionRefused,
    /// An established endpoint broke (reset, cut, link down, QP error).
    ConnectionReset,
    /// The connection handshake failed or was answered wrongly.
    HandshakeFailed,
    /// The transport retried at its level (RDMA retry count) and gave up.
    RetryExceeded,
    /// The peer restarted: its segment generation changed, old addresses
    /// and keys are stale. The next transfer re-reads the descriptor.
    PeerRestarted,
    /// The in-flight budget is full; wait or retry later.
    Backpressure,
    /// The circuit breaker for this peer is open: it failed repeatedly and
    /// is not tried again until its cool-down ends or a probe succeeds.
    PeerUnavailable,
    /// A local or remote resource limit refused a new endpoint (for RDMA:
    /// `ibv_create_qp` returned ENOMEM). Freeing endpoints may help.
    ResourceExhausted,
    /// The transfer's deadline passed before it completed.
    Timeout,
    /// A peer sent bytes that do not parse (corruption, version skew). The
    /// connection was closed; a new one may work.
    Protocol,
    /// Another I/O error from the operating system.
    Io,

    // ---- permanent: the caller's request is wrong; do not retry ----
    /// The access lies outside the region (including `addr + len` overflow).
    OutOfBounds,
    /// The memory is not registered (or was unregistered).
    Unregistered,
    /// The remote region does not allow this access (read or write).
    AccessDenied,
    /// The handle (region, segment, batch) is unknown, closed or released.
    InvalidHandle,
    /// The request is malformed: zero length, empty or oversized batch,
    /// releasing a batch still in progress, ...
    InvalidRequest,
    /// The memory overlaps a region that is already registered.
    AlreadyRegistered,
    /// The batch was cancelled by the caller.
    Cancelled,
    /// The transport was shut down; nothing more can be done with it.
    Shutdown,
    /// The backend cannot do this (e.g. RDMA READ on a device without it).
    Unsupported,
    /// The configuration is invalid (names the field and the reason).
    Config,
    /// The peer's peer authentication failed (wrong or missing secret).
    AuthFailed,
    /// No segment is known under this name.
    NotFound,
    /// The outcome is not known to this side: a session's sender finished
    /// (every byte written, FINISH sent) and then lost its receiver before
    /// the receiver's answer came. The receiver may have landed the
    /// session or not; its state decides. Not transient: writing the same
    /// bytes again may land them twice.
    OutcomeUnknown,
    /// A bug: a state the code believed impossible. Please report it.
    Internal,
}

/// One row per kind, in the enum's order: everything the project says
/// about a kind, said once.
#[derive(Debug)]
struct Row {
    kind: ErrorKind,
    /// Short, stable, lower-case: logs, metrics labels, Python's `.kind`.
    name: &'static str,
    /// Retrying the same request later may succeed.
    transient: bool,
    /// Counts toward the peer's circuit breaker.
    peer_failure: bool,
    /// A cached segment handle toward the peer is stale after it.
    reopen: bool,
    /// On the wire (the session messages carry kinds); stable across
    /// versions. 0 is `Internal`, which an unknown code also reads as.
    code: u8,
}

/// Every kind, once. Transient kinds are the peer's or the network's;
/// of those, backpressure, an open breaker and a refused resource are
/// local and do not count toward a breaker. The permanent kinds are the
/// caller's mistake or a final decision.
// One row a line, a table to read down its columns.
#[rustfmt::skip]
const TABLE: [Row; 25] = {
    use ErrorKind::*;
    [
        Row { kind: ConnectionRefused, name: "connection_refused", transient: true, peer_failure: true, reopen: true, code: 1 },
        Row { kind: ConnectionReset, name: "connection_reset", transient: true, peer_failure: true, reopen: true, code: 2 },
        Row { kind: HandshakeFailed, name: "handshake_failed", transient: true, peer_failure: true, reopen: true, code: 3 },
        Row { kind: RetryExceeded, name: "retry_exceeded", transient: true, peer_failure: true, reopen: false, code: 4 },
        Row { kind: PeerRestarted, name: "peer_restarted", transient: true, peer_failure: true, reopen: true, code: 5 },
        Row { kind: Backpressure, name: "backpressure", transient: true, peer_failure: false, reopen: false, code: 6 },
        Row { kind: PeerUnavailable, name: "peer_unavailable", transient: true, peer_failure: false, reopen: false, code: 7 },
        Row { kind: ResourceExhausted, name: "resource_exhausted", transient: true, peer_failure: false, reopen: false, code: 8 },
        Row { kind: Timeout, name: "timeout", transient: true, peer_failure: true, reopen: false, code: 9 },
        Row { kind: Protocol, name: "protocol", transient: true, peer_failure: true, reopen: true, code: 10 },
        Row { kind: Io, name: "io", transient: true, peer_failure: true, reopen: false, code: 11 },
        Row { kind: OutOfBounds, name: "out_of_bounds", transient: false, peer_failure: false, reopen: false, code: 12 },
        Row { kind: Unregistered, name: "unregistered", transient: false, peer_failure: false, reopen: false, code: 13 },
        Row { kind: AccessDenied, name: "access_denied", transient: false, peer_failure: false, reopen: false, code: 14 },
        Row { kind: InvalidHandle, name: "invalid_handle", transient: false, peer_failure: false, reopen: true, code: 15 },
        Row { kind: InvalidRequest, name: "invalid_request", transient: false, peer_failure: false, reopen: false, code: 16 },
        Row { kind: AlreadyRegistered, name: "already_registered", transient: false, peer_failure: false, reopen: false, code: 17 },
        Row { kind: Cancelled, name: "cancelled", transient: false, peer_failure: false, reopen: false, code: 18 },
        Row { kind: Shutdown, name: "shutdown", transient: false, peer_failure: false, reopen: false, code: 19 },
        Row { kind: Unsupported, name: "unsupported", transient: false, peer_failure: false, reopen: false, code: 20 },
        Row { kind: Config, name: "config", transient: false, peer_failure: false, reopen: false, code: 21 },
        Row { kind: AuthFailed, name: "auth_failed", transient: false, peer_failure: false, reopen: false, code: 22 },
        Row { kind: NotFound, name: "not_found", transient: false, peer_failure: false, reopen: true, code: 23 },
        Row { kind: OutcomeUnknown, name: "outcome_unknown", transient: false, peer_failure: false, reopen: false, code: 24 },
        Row { kind: Internal, name: "internal", transient: false, peer_failure: false, reopen: false, code: 0 },
    ]
};

impl ErrorKind {
    /// Every kind, in declaration order.
    pub const ALL: [ErrorKind; 25] = {
        let mut all = [ErrorKind::Internal; 25];
        let mut i = 0;
        while i < TABLE.len() {
            all[i] = TABLE[i].kind;
            i += 1;
        }
        all
    };

    fn row(self) -> &'static Row {
        // TABLE is in declaration order (a test checks it), so the
        // discriminant is the index.
        match TABLE.get(self as usize) {
            Some(r) if r.kind == self => r,
            _ => &TABLE[TABLE.len() - 1],
        }
    }

    /// Whether retrying the same request later may succeed.
    pub fn is_transient(self) -> bool {
        self.row().transient
    }

    /// Whether this failure says the peer (or the path to it) is unhealthy,
    /// so it counts toward that peer's circuit breaker. Backpressure and
    /// breaker-open errors are local and do not count.
    pub fn is_peer_failure(self) -> bool {
        self.row().peer_failure
    }

    /// Whether a cached segment handle toward the peer is stale after
    /// this failure, so a program that keeps handles by peer (the Python
    /// APIs, the connectors) closes it and opens the peer again before its
    /// next call: the peer may have restarted behind a refused, reset or
    /// garbled connection (a new process has new addresses and keys), the
    /// handle was closed, or the name resolves to nothing now. A timeout,
    /// an open breaker or backpressure leave the handle as it is (the same
    /// peer, slow or busy: a restart shows as `PeerRestarted` on the next
    /// call).
    pub fn reopens_segment(self) -> bool {
        self.row().reopen
    }

    /// A short, stable, lower-case name (for logs, metrics and Python).
    pub fn as_str(self) -> &'static str {
        self.row().name
    }

    /// The kind named `name` ([`ErrorKind::as_str`]'s inverse).
    pub fn from_name(name: &str) -> Option<ErrorKind> {
        TABLE.iter().find(|r| r.name == name).map(|r| r.kind)
    }

    /// The kind's stable code on the wire.
    pub fn code(self) -> u8 {
        self.row().code
    }

    /// The kind with wire code `code`; an unknown code (a newer peer's
    /// kind) is `Internal`.
    pub fn from_code(code: u8) -> ErrorKind {
        TABLE.iter().find(|r| r.code == code).map_or(ErrorKind::Internal, |r| r.kind)
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The public error: a kind, a message, context (which peer, which
/// request), and an optional source. Cheap to clone, so a batch status can
/// carry it per request.
#[derive(Clone)]
pub struct Error {
    kind: ErrorKind,
    message: String,
    context: Vec<(&'static str, String)>,
    source: Option<Arc<dyn std::error::Error + Send + Sync>>,
    /// See [`Error::nothing_listens`].
    nothing_listens: bool,
}

impl Error {
    /// A new error of `kind` with a human message.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self { kind, message: message.into(), context: Vec::new(), source: None, nothing_listens: false }
    }

    /// Adds a key/value of context (`peer`, `segment`, `request`, ...).
    pub fn with(mut self, key: &'static str, value: impl fmt::Display) -> Self {
        self.context.push((key, value.to_string()));
        self
    }

    /// Attaches the underlying cause.
    pub fn with_source(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Arc::new(source));
        self
    }

    /// The kind.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// Whether retrying may succeed (see [`ErrorKind::is_transient`]).
    pub fn is_transient(&self) -> bool {
        self.kind.is_transient()
    }

    /// The message without context.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The context pairs, in the order they were added.
    pub fn context(&self) -> &[(&'static str, String)] {
        &self.context
    }

    /// Looks up one context value.
    pub fn context_value(&self, key: &str) -> Option<&str> {
        self.context.iter().find(|(k, _)| *k == key).map(|(_, v)| v.as_str())
    }

    /// Whether the peer's host refused the connection itself
    /// (`ECONNREFUSED`, a `ConnectionRefused` made from the OS error):
    /// the host answers and nothing listens on the port, so the peer is
    /// down now (killed, or not started yet). False for a peer's own
    /// refusal (busy at its connection limit), a connect that timed out,
    /// and an error rebuilt from another's message. The policy engine
    /// does not retry a transfer's request refused so, and asks once more
    /// when opening a segment, so a dead peer is reported as soon as the
    /// kernel knows.
    pub fn nothing_listens(&self) -> bool {
        self.nothing_listens
    }
}

/// Constructors for the errors every backend returns in the same words, so
/// a caller sees one message and one kind whichever backend it runs on.
impl Error {
    /// `Shutdown`: the transport was shut down (rule 1; later calls fail).
    pub fn shut_down() -> Self {
        Error::new(ErrorKind::Shutdown, "the transport was shut down")
    }

    /// `InvalidHandle`: the batch id is unknown or was released.
    pub fn unknown_batch(batch: crate::BatchId) -> Self {
        Error::new(ErrorKind::InvalidHandle, "unknown or released batch").with("batch", batch)
    }

    /// `InvalidRequest`: `release` of a batch that is not terminal yet.
    pub fn batch_in_progress(batch: crate::BatchId) -> Self {
        Error::new(ErrorKind::InvalidRequest, "the batch is in progress; cancel it first").with("batch", batch)
    }

    /// `InvalidHandle`: the region id is unknown or was unregistered.
    pub fn unknown_region(region: crate::RegionId) -> Self {
        Error::new(ErrorKind::InvalidHandle, "unknown or unregistered region").with("region", region)
    }

    /// `InvalidHandle`: the segment id is unknown or was closed.
    pub fn unknown_segment(segment: crate::SegmentId) -> Self {
        Error::new(ErrorKind::InvalidHandle, "unknown or closed segment").with("segment", segment)
    }

    /// `Unregistered`: a request's local region was unregistered while it
    /// was in flight (rule 9).
    pub fn region_unregistered(region: crate::RegionId) -> Self {
        Error::new(ErrorKind::Unregistered, "the local region was unregistered with the request in flight")
            .with("region", region)
    }

    /// `ResourceExhausted`: the endpoint bound is reached and no endpoint
    /// could be evicted in time (rule 4).
    pub fn endpoints_exhausted(peer: impl fmt::Display, max_endpoints: usize) -> Self {
        Error::new(ErrorKind::ResourceExhausted, "every endpoint is busy and the endpoint bound is reached")
            .with("peer", peer)
            .with("max_endpoints", max_endpoints)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.message)?;
        if !self.context.is_empty() {
            f.write_str(" (")?;
            for (i, (k, v)) in self.context.iter().enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                write!(f, "{k}: {v}")?;
            }
            f.write_str(")")?;
        }
        write!(f, " [{}, {}]", self.kind, if self.is_transient() { "transient" } else { "permanent" })?;
        if let Some(s) = &self.source {
            write!(f, ": {s}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_ref().map(|s| s.as_ref() as &(dyn std::error::Error + 'static))
    }
}

impl From<transport_mem::MemError> for Error {
    fn from(e: transport_mem::MemError) -> Self {
        use transport_mem::MemError::*;
        let kind = match &e {
            OutOfBounds { .. } | BadRange { .. } => ErrorKind::OutOfBounds,
            ZeroLength | NotDeviceMemory { .. } => ErrorKind::InvalidRequest,
            AllocFailed { .. } => ErrorKind::ResourceExhausted,
            DeviceCopy { .. } | ProcessCopy { .. } => ErrorKind::Io,
        };
        Error::new(kind, e.to_string())
    }
}

impl From<std::io::Error> for Error {
    /// Maps OS errors to kinds: refused and reset are transient peer
    /// failures; the rest is [`ErrorKind::Io`].
    fn from(e: std::io::Error) -> Self {
        use std::io::ErrorKind as K;
        let kind = match e.kind() {
            K::ConnectionRefused => ErrorKind::ConnectionRefused,
            K::ConnectionReset | K::ConnectionAborted | K::BrokenPipe | K::UnexpectedEof | K::NotConnected => {
                ErrorKind::ConnectionReset
            }
            K::TimedOut => ErrorKind::Timeout,
            K::OutOfMemory => ErrorKind::ResourceExhausted,
            _ => ErrorKind::Io,
        };
        Error { nothing_listens: e.kind() == K::ConnectionRefused, ..Error::new(kind, e.to_string()) }
    }
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_hosts_own_refusal_says_nothing_listens() {
        let refused = Error::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused)).with("peer", "p");
        assert_eq!(refused.kind(), ErrorKind::ConnectionRefused);
        assert!(refused.nothing_listens() && refused.clone().nothing_listens());
        assert!(!Error::new(ErrorKind::ConnectionRefused, "the peer is busy").nothing_listens());
        assert!(!Error::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset)).nothing_listens());
    }

    #[test]
    fn classification_matches_design() {
        for k in [
            ErrorKind::ConnectionRefused,
            ErrorKind::ConnectionReset,
            ErrorKind::HandshakeFailed,
            ErrorKind::RetryExceeded,
            ErrorKind::PeerRestarted,
            ErrorKind::Backpressure,
        ] {
            assert!(k.is_transient(), "{k}");
        }
        for k in [
            ErrorKind::OutOfBounds,
            ErrorKind::Unregistered,
            ErrorKind::AccessDenied,
            ErrorKind::InvalidHandle,
            ErrorKind::InvalidRequest,
        ] {
            assert!(!k.is_transient(), "{k}");
        }
        assert!(!ErrorKind::Backpressure.is_peer_failure());
    }

    /// A handle is reopened only for a failure of the connection that may
    /// hide a restart (a peer failure) or a handle or name that is gone;
    /// the same peer slow, busy or refusing a request keeps its handle.
    #[test]
    fn what_makes_a_segment_handle_stale() {
        use ErrorKind::*;
        for k in ErrorKind::ALL {
            if k.reopens_segment() {
                assert!(k.is_peer_failure() || matches!(k, InvalidHandle | NotFound), "{k}");
            }
        }
        for k in [ConnectionRefused, ConnectionReset, HandshakeFailed, PeerRestarted, Protocol, InvalidHandle, NotFound]
        {
            assert!(k.reopens_segment(), "{k}");
        }
        for k in [Timeout, RetryExceeded, Io, PeerUnavailable, Backpressure, OutOfBounds, AccessDenied, Shutdown] {
            assert!(!k.reopens_segment(), "{k}");
        }
    }

    #[test]
    fn display_has_context_and_kind() {
        let e = Error::new(ErrorKind::OutOfBounds, "write past region end")
            .with("peer", "10.0.0.1:7000")
            .with("request", 3);
        let s = e.to_string();
        assert!(s.contains("peer: 10.0.0.1:7000") && s.contains("request: 3") && s.contains("permanent"), "{s}");
        assert_eq!(e.context_value("request"), Some("3"));
    }

    #[test]
    fn the_table_round_trips_every_kind_and_keeps_the_wire_codes() {
        let mut names = std::collections::HashSet::new();
        let mut codes = std::collections::HashSet::new();
        for (i, k) in ErrorKind::ALL.into_iter().enumerate() {
            assert_eq!(k as usize, i, "TABLE is in declaration order");
            assert_eq!(ErrorKind::from_name(k.as_str()), Some(k));
            assert_eq!(ErrorKind::from_code(k.code()), k);
            assert!(names.insert(k.as_str()) && codes.insert(k.code()), "{k} is in the table once");
            assert!(!k.is_peer_failure() || k.is_transient(), "{k}: a peer failure is transient");
        }
        assert_eq!(ErrorKind::from_name("no_such_kind"), None);
        assert_eq!(ErrorKind::from_code(200), ErrorKind::Internal, "a newer peer's kind");
        // Codes that peers already speak (session messages, version 1).
        let fixed = [
            (ErrorKind::Internal, 0),
            (ErrorKind::ConnectionRefused, 1),
            (ErrorKind::Timeout, 9),
            (ErrorKind::Io, 11),
            (ErrorKind::OutOfBounds, 12),
            (ErrorKind::Cancelled, 18),
            (ErrorKind::OutcomeUnknown, 24),
        ];
        for (k, code) in fixed {
            assert_eq!(k.code(), code, "{k}");
        }
    }
}
