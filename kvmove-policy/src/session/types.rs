//! What callers of the session table see: the roles, keys, states,
//! limits, the actions the table asks its driver to take, and its counts.

use std::time::Duration;

use super::wire::{Outcome, Verdict};
use transport_core::Error;

/// Which side of a session this engine is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Writes the KV (prefill).
    Sender,
    /// Owns the memory and grants (decode).
    Receiver,
}

/// A session, as one side names it: the peer's segment name, the
/// application's id (e.g. the request's bootstrap room) and this side's role.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SessionKey {
    pub peer: String,
    pub id: u64,
    pub role: Role,
}

impl SessionKey {
    pub fn new(peer: impl Into<String>, id: u64, role: Role) -> Self {
        Self { peer: peer.into(), id, role }
    }
}

/// One side's state of a session. Monotone: it only moves down this list,
/// and a final state never changes.
#[derive(Debug, Clone)]
pub enum SessionState {
    /// Sender: expecting a grant. Receiver: not used.
    Waiting,
    /// The grant exists; nothing written yet (the receiver stays here until
    /// the end: it does not see one-sided writes).
    Granted,
    /// Sender: writes started.
    Transferring,
    /// Every byte of every write is in the receiver's memory. Final.
    Landed,
    /// The session failed; the error says why and whether retrying may
    /// help. Final.
    Failed(Error),
    /// A side cancelled. Final.
    Cancelled,
    /// The deadline passed before the sender finished. Final.
    Expired,
}

impl SessionState {
    /// Whether the state is final.
    pub fn is_final(&self) -> bool {
        matches!(self, Self::Landed | Self::Failed(_) | Self::Cancelled | Self::Expired)
    }

    /// A short name: `waiting`, `granted`, `transferring`, `landed`,
    /// `failed`, `cancelled`, `expired`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Waiting => "waiting",
            Self::Granted => "granted",
            Self::Transferring => "transferring",
            Self::Landed => "landed",
            Self::Failed(_) => "failed",
            Self::Cancelled => "cancelled",
            Self::Expired => "expired",
        }
    }

    pub(super) fn rank(&self) -> u8 {
        match self {
            Self::Waiting => 0,
            Self::Granted => 1,
            Self::Transferring => 2,
            _ => 3,
        }
    }

    pub(super) fn from_verdict(v: &Verdict) -> Self {
        match v.outcome {
            Outcome::Landed => Self::Landed,
            Outcome::Cancelled => Self::Cancelled,
            Outcome::Expired => Self::Expired,
            Outcome::Failed => Self::Failed(Error::new(v.kind, v.reason.clone())),
        }
    }
}

impl PartialEq for SessionState {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Failed(a), Self::Failed(b)) => a.kind() == b.kind(),
            _ => self.name() == other.name(),
        }
    }
}

/// Bounds and timers of the session table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionLimits {
    /// Open (not final) sessions, both roles together.
    pub max_sessions: usize,
    /// Open sessions with one peer.
    pub max_sessions_per_peer: usize,
    /// Heartbeat period toward peers with open sessions.
    pub heartbeat_interval: Duration,
    /// A peer silent this long fails its open sessions.
    pub liveness_timeout: Duration,
    /// Final sessions are kept this long for polling and for answering
    /// duplicates, unless released earlier.
    pub linger: Duration,
    /// Final sessions kept at most (the oldest go first).
    pub max_lingering: usize,
    /// Grants held that no local sender expects yet (a receiver may grant
    /// before its sender starts; each takes a place in the table until the
    /// sender claims it with `expect` or its deadline ends it), in all. A
    /// grant over this bound is refused (the receiver frees its memory),
    /// so peers that grant what nobody asked for cannot fill the table.
    pub max_unclaimed: usize,
    /// The same, per peer.
    pub max_unclaimed_per_peer: usize,
}

impl Default for SessionLimits {
    fn default() -> Self {
        Self {
            max_sessions: 4096,
            max_sessions_per_peer: 1024,
            heartbeat_interval: Duration::from_millis(500),
            liveness_timeout: Duration::from_secs(5),
            linger: Duration::from_secs(60),
            max_lingering: 16384,
            max_unclaimed: 1024,
            max_unclaimed_per_peer: 256,
        }
    }
}

/// What the driver must do besides sending messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Sender: cancel the session's writes in flight; report each with
    /// [`SessionTable::end_write`](crate::session::SessionTable::end_write).
    StopWrites(SessionKey),
}

/// A message to send: `(peer, bytes)`, in order.
pub type Outgoing = (String, Vec<u8>);

/// Counts for `stats`-like reporting and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SessionCounts {
    /// Sessions not yet final.
    pub open: usize,
    /// Final sessions kept for polling.
    pub lingering: usize,
    /// Peers tracked for liveness.
    pub peers: usize,
    /// Messages ignored (malformed, unknown session, stale epoch, ...).
    pub ignored: u64,
}
