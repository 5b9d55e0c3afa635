//! The policy layer, written once above every backend (rule 8, and the
//! handoff of rules 12 and 13).
//!
//! Backends report; they do not decide. A backend crate depends on
//! `transport-core` (the contract) and never on this crate, so a backend
//! cannot retry, open a breaker or make a session on its own: the
//! compiler keeps that split.
//!
//! - [`Engine`]: retrying, deadlines, the per-peer circuit breaker,
//!   backpressure and metrics over any [`transport_core::Transport`],
//!   configured by one serde [`PolicyConfig`] and driven by a
//!   [`transport_core::Clock`] that tests can fake.
//! - [`retry`]: the sans-IO retry decision of one transfer (what is
//!   retried, when it is over, what each attempt says about each peer).
//! - [`session`]: the sans-IO session table and its wire format;
//!   [`Sessions`] is its driver (receiver-granted admission, one final
//!   state on both sides).
//!
//! The state machines perform no I/O (the drivers only call the
//! `Transport`); the crate contains no `unsafe`.
#![forbid(unsafe_code)]

mod backoff;
mod breaker;
mod budget;
mod config;
mod engine;
mod metrics;
pub mod retry;
pub mod session;
mod sessions;

pub use backoff::backoff;
pub use breaker::{Admit, Breaker, BreakerState};
pub use budget::{Budget, Charge, Reservation, Usage};
pub use config::{BackpressureConfig, BreakerConfig, DeadlineConfig, PolicyConfig, RetryConfig, WaitConfig};
pub use engine::{Engine, Probe, Transfer};
pub use metrics::{describe_metrics, MAX_PEER_LABELS, OTHER_PEER};
pub use retry::TransferOutcome;
pub use sessions::Sessions;
