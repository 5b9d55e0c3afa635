//! The contract of the transfer engine: one trait every backend implements,
//! the types it speaks, the error it returns, and the policy layer users
//! call on top of any backend.
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
//! The handoff between both ends (rules 11 to 13): notifications with a
//! bounded [`Inbox`] on every backend, and sessions written once above the
//! backends: the sans-IO [`session::SessionTable`] and its driver
//! [`Sessions`] (receiver-granted admission, one final state on both sides).
//!
//! Backends report; they do not decide. Retrying, deadlines, the per-peer
//! circuit breaker and backpressure live once in [`Engine`], configured by
//! one serde [`PolicyConfig`] and driven by a [`Clock`] that tests can fake.
//!
//! The state machines perform no I/O (the drivers, [`Engine`] and
//! [`Sessions`], only call the [`Transport`]); the crate contains no `unsafe`. Memory enters the
//! engine through `transport-mem` ([`Buffer`], [`MemoryRegion`]).
#![forbid(unsafe_code)]

mod clock;
mod error;
pub mod lifecycle;
mod metadata;
mod notify;
mod policy;
pub mod serde_ms;
pub mod session;
mod stats;
mod transport;
mod types;

pub use clock::{Clock, ManualClock, SystemClock};
pub use error::{Error, ErrorKind, Result};
pub use metadata::{InProcessStore, MetadataStore};
pub use notify::{
    check_notification, check_received, inbox_full, Inbox, Notification, Refused, DEFAULT_INBOX, MAX_NOTIFY_FROM,
    MAX_NOTIFY_LEN,
};
pub use policy::metrics::{MAX_PEER_LABELS, OTHER_PEER};
pub use policy::{
    backoff, Admit, BackpressureConfig, Breaker, BreakerConfig, BreakerState, Budget, Charge, DeadlineConfig, Engine,
    PathStatus, PolicyConfig, Rails, Reservation, RetryConfig, Sessions, Transfer, TransferOutcome, Usage,
};
pub use stats::{Capabilities, ResourceStats};
pub use transport::{notify_when_completed, Transport};
pub use transport_mem::{Buffer, DeviceMemory, FakeDevice, MemError, MemoryKind, MemoryRegion};
pub use types::{
    fresh_generation, Access, BatchId, BatchState, BatchStatus, Opcode, RegionId, RegionInfo, RequestStatus,
    SegmentDescriptor, SegmentId, SubmitOptions, TransferRequest,
};
