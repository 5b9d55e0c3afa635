//! The contract's machinery, written once and sans-IO: every backend is a
//! driver over these state machines. They take events and the time and
//! return decisions; the driver does the I/O (sockets, verbs, memory
//! copies) and reports back.
//!
//! | rule (see [`crate::Transport`]) | kept here by |
//! |---|---|
//! | 1 every resource is counted | [`BatchLedger::on_wire`], [`EndpointPool::counts`], [`TaskSet`] |
//! | 2 failure frees | [`EndpointPool::broken`] (never handed out again), [`EndpointPool::destroyed`] |
//! | 4 bounded endpoints | [`EndpointPool::acquire`] (bound, LRU eviction), [`reach`] (the acquire loop, its wait bounded), [`EndpointUse`] (a counted use), [`EndpointPool::reap`] (idle reclaim) |
//! | 5 terminal means quiet | [`BatchLedger`] (sticky status, reported only when no unit is on the wire), [`DeadlineQueue`] (one timer per driver expires what is due) |
//! | submit's validation, 9 (local checks) | [`validate_batch`] |
//! | a layer's reposting (rails: `transport-rails`) | [`BatchLedger::unit_back`] |
//!
//! Backends keep the rest of rules 3 and 9 (closing and unregistering make
//! their work quiet through these machines) and all of 6 and 7 in their I/O.

mod acquire;
mod deadlines;
mod ids;
mod ledger;
mod pool;
mod table;
mod tasks;
mod validate;

pub use acquire::{reach, EndpointUse, Found, GaveUp, Reached, ReleaseUse};
pub use deadlines::{DeadlineKey, DeadlineQueue};
pub use ids::{IdBuildHasher, IdHasher, IdMap};
pub use ledger::{BatchLedger, EndReason, Progress};
pub use pool::{Acquire, EndpointId, EndpointPool, EndpointState, PoolCounts};
pub use table::BatchTable;
pub use tasks::{OwnedTask, TaskGuard, TaskSet};
pub use validate::{validate_batch, BatchLimits};
