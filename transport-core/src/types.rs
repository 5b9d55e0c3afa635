//! Handles, requests and statuses shared by every backend.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::Error;

macro_rules! handle {
    ($(#[$m:meta])* $name:ident, $prefix:literal) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        pub struct $name(pub u64);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "#{}"), self.0)
            }
        }
    };
}

handle!(
    /// A registered local memory region. Never reused within a transport,
    /// so a stale handle is always detected.
    RegionId,
    "region"
);
handle!(
    /// An opened remote segment. Never reused within a transport.
    SegmentId,
    "segment"
);
handle!(
    /// A submitted batch. Never reused within a transport.
    BatchId,
    "batch"
);

/// Who may touch a registered region from the other side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct Access {
    /// Peers may RDMA-READ (or TCP-read) this region.
    pub remote_read: bool,
    /// Peers may write into this region.
    pub remote_write: bool,
}

impl Access {
    /// Only this process may use the region (as a source or sink of its own
    /// transfers).
    pub const LOCAL: Access = Access { remote_read: false, remote_write: false };
    /// Peers may read it.
    pub const REMOTE_READ: Access = Access { remote_read: true, remote_write: false };
    /// Peers may write it.
    pub const REMOTE_WRITE: Access = Access { remote_read: false, remote_write: true };
    /// Peers may read and write it.
    pub const REMOTE_RW: Access = Access { remote_read: true, remote_write: true };

    /// Whether peers may reach the region at all (it belongs in the
    /// segment descriptor).
    pub fn is_remote(self) -> bool {
        self.remote_read || self.remote_write
    }

    /// Whether a remote peer may perform `op` against a region with this access.
    pub fn allows(self, op: Opcode) -> bool {
        match op {
            Opcode::Read => self.remote_read,
            Opcode::Write => self.remote_write,
        }
    }
}

/// Direction of a transfer, seen from the initiator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Opcode {
    /// Remote memory into local memory.
    Read,
    /// Local memory into remote memory.
    Write,
}

/// One transfer: `len` bytes between a local region at `local_offset` and the
/// remote segment's memory at absolute address `remote_addr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TransferRequest {
    pub op: Opcode,
    pub local: RegionId,
    pub local_offset: u64,
    pub segment: SegmentId,
    pub remote_addr: u64,
    pub len: u64,
}

impl TransferRequest {
    /// A write of `len` bytes from `local[local_offset..]` to `remote_addr`.
    pub fn write(local: RegionId, local_offset: u64, segment: SegmentId, remote_addr: u64, len: u64) -> Self {
        Self { op: Opcode::Write, local, local_offset, segment, remote_addr, len }
    }

    /// A read of `len` bytes from `remote_addr` into `local[local_offset..]`.
    pub fn read(local: RegionId, local_offset: u64, segment: SegmentId, remote_addr: u64, len: u64) -> Self {
        Self { op: Opcode::Read, local, local_offset, segment, remote_addr, len }
    }
}

/// Options for one submitted batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SubmitOptions {
    /// The batch must reach a terminal state within this time of submit;
    /// requests still pending then end as [`RequestStatus::TimedOut`], and
    /// the transport stops touching their buffers before reporting it.
    /// `None` means no deadline at this level.
    pub timeout: Option<Duration>,
    /// Every request must be served by the peer's process itself: no
    /// shortcut that moves the bytes without it (a same-host direct write
    /// or read, which a stopped or hung peer does not notice). For probes
    /// of liveness, whose success must mean the peer answered. Default
    /// false; backends without such shortcuts have nothing to do.
    pub round_trip: bool,
}

impl SubmitOptions {
    /// Options with a deadline.
    pub fn with_timeout(timeout: Duration) -> Self {
        Self { timeout: Some(timeout), round_trip: false }
    }

    /// These options, with every request served by the peer itself
    /// ([`SubmitOptions::round_trip`]).
    pub fn round_trip(self) -> Self {
        Self { round_trip: true, ..self }
    }
}

/// The state of one request of a batch. Every state except `Pending` is
/// terminal and sticky: once reported, it never changes.
#[derive(Debug, Clone)]
pub enum RequestStatus {
    /// Not finished yet.
    Pending,
    /// All bytes are in place at the destination.
    Completed,
    /// Failed; the error says whether retrying may help.
    Failed(Error),
    /// The batch's deadline passed first.
    TimedOut,
    /// Cancelled by the caller (or by `close_segment` / `shutdown`).
    Cancelled,
}

impl RequestStatus {
    /// Whether the state is terminal.
    pub fn is_terminal(&self) -> bool {
        !matches!(self, RequestStatus::Pending)
    }

    /// Whether it completed.
    pub fn is_completed(&self) -> bool {
        matches!(self, RequestStatus::Completed)
    }

    /// The error, if it failed.
    pub fn error(&self) -> Option<&Error> {
        match self {
            RequestStatus::Failed(e) => Some(e),
            _ => None,
        }
    }
}

/// The state of a whole batch, derived from its requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BatchState {
    /// Some request is still pending.
    InProgress,
    /// Every request completed.
    Completed,
    /// At least one request failed (others may have completed).
    Failed,
    /// No request failed, at least one timed out.
    TimedOut,
    /// No request failed or timed out, at least one was cancelled.
    Cancelled,
}

impl BatchState {
    /// Whether the state is terminal (everything but `InProgress`).
    pub fn is_terminal(self) -> bool {
        self != BatchState::InProgress
    }

    /// The batch state implied by its request states: in progress while any
    /// request is pending; otherwise failed > timed out > cancelled >
    /// completed, so the most actionable outcome wins.
    pub fn summarize(requests: &[RequestStatus]) -> BatchState {
        let (mut failed, mut timed_out, mut cancelled) = (false, false, false);
        for r in requests {
            match r {
                RequestStatus::Pending => return BatchState::InProgress,
                RequestStatus::Completed => {}
                RequestStatus::Failed(_) => failed = true,
                RequestStatus::TimedOut => timed_out = true,
                RequestStatus::Cancelled => cancelled = true,
            }
        }
        if failed {
            BatchState::Failed
        } else if timed_out {
            BatchState::TimedOut
        } else if cancelled {
            BatchState::Cancelled
        } else {
            BatchState::Completed
        }
    }
}

/// A snapshot of a batch: its state and one status per request, in the
/// order the requests were submitted.
#[derive(Debug, Clone)]
pub struct BatchStatus {
    pub state: BatchState,
    pub requests: Vec<RequestStatus>,
}

impl BatchStatus {
    /// Builds a status whose state is derived from `requests`.
    pub fn from_requests(requests: Vec<RequestStatus>) -> Self {
        Self { state: BatchState::summarize(&requests), requests }
    }

    /// Whether the batch is terminal.
    pub fn is_terminal(&self) -> bool {
        self.state.is_terminal()
    }

    /// The first request error, if any failed.
    pub fn first_error(&self) -> Option<&Error> {
        self.requests.iter().find_map(RequestStatus::error)
    }

    /// Indices of requests that did not complete (failed, timed out, cancelled).
    pub fn unfinished(&self) -> Vec<usize> {
        self.requests.iter().enumerate().filter(|(_, r)| !r.is_completed()).map(|(i, _)| i).collect()
    }

    /// Number of completed requests.
    pub fn completed(&self) -> usize {
        self.requests.iter().filter(|r| r.is_completed()).count()
    }
}

/// One registered region as a peer sees it in a segment descriptor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionInfo {
    /// Address in the owner's address space; requests name addresses inside it.
    pub addr: u64,
    pub len: u64,
    pub access: Access,
    /// Backend key (RDMA rkey; 0 where unused).
    pub key: u64,
}

/// A generation for a peer starting now: the microseconds since the Unix
/// epoch in the high bits, 12 random bits below, never 0. A peer that
/// restarts gets a larger one than before (on a machine whose clock does
/// not go back), which metadata stores rely on ("a reader never sees a
/// descriptor with a smaller generation after a larger one was put"), and
/// two peers starting in the same microsecond still differ.
pub fn fresh_generation() -> u64 {
    let micros = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX >> 12));
    (((micros & (u64::MAX >> 12)) << 12) | (rand::random::<u64>() & 0xfff)).max(1)
}

/// How to reach a peer and what it exposes. The `generation` changes every
/// time the peer starts (and whenever its keys change), so a descriptor from
/// before a restart is recognised and never used.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentDescriptor {
    /// The segment name (for TCP and RDMA: the peer's `host:port`).
    pub name: String,
    /// Backend kind that serves it (`mock`, `tcp`, `rdma`).
    pub backend: String,
    /// Changes on every restart of the peer.
    pub generation: u64,
    /// Backend-specific address (socket address, GID, ...).
    pub address: String,
    /// Regions the peer exposes to remote access.
    pub regions: Vec<RegionInfo>,
}

impl SegmentDescriptor {
    /// The region that wholly contains `addr .. addr + len`, if any.
    pub fn region_for(&self, addr: u64, len: u64) -> Option<&RegionInfo> {
        let end = addr.checked_add(len)?;
        self.regions.iter().find(|r| addr >= r.addr && end <= r.addr.saturating_add(r.len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn summarize_precedence() {
        use RequestStatus::*;
        let e = Error::new(ErrorKind::ConnectionReset, "x");
        assert_eq!(BatchState::summarize(&[Completed, Pending]), BatchState::InProgress);
        assert_eq!(BatchState::summarize(&[Completed, Completed]), BatchState::Completed);
        assert_eq!(BatchState::summarize(&[Cancelled, TimedOut, Failed(e)]), BatchState::Failed);
        assert_eq!(BatchState::summarize(&[Cancelled, TimedOut]), BatchState::TimedOut);
        assert_eq!(BatchState::summarize(&[Completed, Cancelled]), BatchState::Cancelled);
        assert_eq!(BatchState::summarize(&[]), BatchState::Completed);
    }

    #[test]
    fn region_lookup_checks_overflow() {
        let d = SegmentDescriptor {
            name: "n".into(),
            backend: "mock".into(),
            generation: 1,
            address: String::new(),
            regions: vec![RegionInfo { addr: 4096, len: 4096, access: Access::REMOTE_RW, key: 0 }],
        };
        assert!(d.region_for(4096, 4096).is_some());
        assert!(d.region_for(4097, 4096).is_none());
        assert!(d.region_for(u64::MAX, 2).is_none());
    }
}
