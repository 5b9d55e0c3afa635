//! The contract of the transfer engine: one trait every backend implements,
//! the types it speaks, the error it returns, and the sans-IO machinery
//! backends share to keep it. This is what a backend author reads.
//!
//! # Design
//!
//! Serving engines register large memory regions once and then push batches
//! of `(local region + offset, remote segment + address, length)` requests,
//! polling them to completion. The [`Transport`] trait is that small
//! primitive surface. The contract every backend keeps (thirteen numbered
//! rules) lives in `docs/CONTRACT.md` and is shown on [`Transport`]; the
//! `conformance` crate checks it against every backend, and [`lifecycle`]
//! holds the sans-IO state machines backends share to keep it.
//!
//! Backends report; they do not decide. Retrying, deadlines, the per-peer
//! circuit breaker, backpressure and the handoff sessions (rules 8, 12 and
//! 13) live once in the `kvmove-policy` crate above every backend
//! (`kvmove_policy::Engine`, `kvmove_policy::Sessions`). A backend crate
//! depends on this crate and never on that one, so the compiler keeps the
//! split (`scripts/check-layers` checks the dependency graph). The
//! notifications sessions ride on (rule 11, a bounded [`Inbox`] on every
//! backend) are part of the contract and live here.
//!
//! A new backend starts from `transport-core/examples/skeleton.rs`: every
//! method it writes, with the rules each keeps and the lifecycle machine
//! that helps, and nothing else.
//!
//! This crate cannot name the policy layer (it does not depend on it, and a
//! backend that depends only on it cannot either):
//!
//! ```compile_fail
//! use kvmove_policy::Engine;
//! ```
//!
//! The state machines perform no I/O; the crate contains no `unsafe`.
//! Memory enters the engine through `transport-mem` ([`Buffer`],
//! [`MemoryRegion`]).
#![forbid(unsafe_code)]

mod clock;
mod error;
mod layer;
pub mod lifecycle;
mod metadata;
mod notify;
pub mod serde_ms;
mod stats;
mod transport;
mod types;

pub use clock::{Clock, Epoch, ManualClock, SystemClock};
pub use error::{Error, ErrorKind, Result};
pub use layer::Layer;
pub use metadata::{InProcessStore, MetadataStore};
pub use notify::{
    check_notification, check_received, inbox_full, Inbox, Notification, Refused, DEFAULT_INBOX, MAX_NOTIFY_FROM,
    MAX_NOTIFY_LEN,
};
pub use stats::{describe_endpoint_metrics, Capabilities, ResourceStats};
pub use transport::{notify_when_completed, Transport};
pub use transport_mem::{Buffer, DeviceMemory, FakeDevice, MemError, MemoryKind, MemoryRegion};
pub use types::{
    fresh_generation, Access, BatchId, BatchState, BatchStatus, Opcode, RegionId, RegionInfo, RequestStatus,
    SegmentDescriptor, SegmentId, SubmitOptions, TransferRequest,
};
