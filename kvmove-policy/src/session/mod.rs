//! Sessions (rules 12 and 13): the handoff of one request's KV between a
//! sender (prefill) and a receiver (decode), with notifications as the
//! control channel. This module is sans-IO: the message codec ([`wire`])
//! and the state table; the driver that does the I/O is
//! `crate::Sessions`, next to the policy layer.

pub mod wire;

mod asks;
pub use asks::{Ask, Asked, GrantPool, RecentAsks, RECENT_ASKS};

pub use wire::{
    bundle, grant_messages, is_failure_notice, is_session_message, unbundle, Grant, Outcome, Verdict,
    GRANT_RANGES_PER_MESSAGE, MAX_GRANT_RANGES,
};
mod table;
mod types;

pub use table::{check_grant, GrantBounds, SessionTable, MAX_STRANGERS};
pub use types::{Action, Outgoing, Role, SessionCounts, SessionKey, SessionLimits, SessionState};
