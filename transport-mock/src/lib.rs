//! An honest in-process transport backend, and fault injection for any
//! backend.
//!
//! # What it is
//!
//! [`MockTransport`] implements [`transport_core::Transport`] with real
//! memory copies ([`transport_core::MemoryRegion::copy_from`]) between
//! hosts that live in one process on a [`MockFabric`]. It keeps the same
//! contract as the TCP and RDMA backends (the rules of `docs/CONTRACT.md`), so
//! the conformance suite runs against it unchanged, and it adds what real
//! hardware makes hard: deterministic faults.
//!
//! ```ignore
//! let fabric = MockFabric::new();
//! let a = MockTransport::new(&fabric, MockConfig::named("a"))?;
//! let b = MockTransport::new(&fabric, MockConfig::named("b"))?;
//! let seg = a.open_segment("b").await?;
//! fabric.cut("b")?; // every endpoint toward b breaks
//! ```
//!
//! # Design
//!
//! The mock is a thin driver over the lifecycle core
//! ([`transport_core::lifecycle`]); it keeps only what is mock-specific:
//! the in-process fabric, the memory copies, the fault plan and
//! kill/cut/stall.
//!
//! - **Hosts and generations.** Each `MockTransport` is a host registered
//!   in the fabric under its segment name, with a generation that is new on
//!   every start. Creating a transport with the name of a killed or shut
//!   down host is its restart. `open_segment` looks the host up (unknown or
//!   dead: transient `ConnectionRefused`) and snapshots its descriptor
//!   (the remotely accessible regions, `key` = region id).
//! - **Lazy endpoints** in an `EndpointPool<String>` keyed by peer name,
//!   with time as a `Duration` since the host started. An endpoint (a
//!   simulated link recording the peer's generation) is built on the first
//!   transfer to the peer and shared by every handle to it. The pool
//!   decides the bound, LRU eviction of idle endpoints and idle reclaim (a
//!   reaper task); the mock destroys what the pool retires at once and
//!   reports it `destroyed`. A request that finds its endpoint broken (cut,
//!   peer killed, plan reset) fails with `ConnectionReset` and reports it
//!   `broken`. Only the initiator counts endpoints.
//! - **Batches.** `submit` validates the whole batch once
//!   (`validate_batch`: size, zero length, handles, local bounds,
//!   `addr + len` overflow; the error names the `request` index), keeps
//!   it in a `BatchTable` and spawns one task (counted in a `TaskSet`)
//!   that runs the requests in order. Remote checks happen when a request
//!   runs, against the peer's live region table: outside one region is
//!   `OutOfBounds`, a forbidden direction `AccessDenied`, retired memory
//!   `Unregistered` (all permanent); a peer whose generation changed fails
//!   the request with transient `PeerRestarted` and refreshes the handle's
//!   descriptor.
//! - **Terminal means quiet.** Each batch keeps a `BatchLedger` (one unit
//!   per request: its copy) behind its lock. The copy runs under that lock
//!   between `start(i)` (refused unless the request is live) and
//!   `unit_done`, holding the regions' read locks. So cancel, deadlines
//!   (applied by `expire(now)` on every read, and by the host's one
//!   deadline timer when they come), `close_segment` and
//!   `shutdown` are quiet as soon as they decide the request, and
//!   `unregister` and a kill (which take the region's write lock) return
//!   only when no copy touches the memory.
//! - **Waiting** (latency, stalls, a free endpoint slot, `wait`) listens to
//!   one fabric-wide event channel; the deadline timer bumps it when a
//!   deadline comes.
//! - **Counts** ([`transport_core::ResourceStats`]) come from the pool,
//!   the tables, the ledgers and the `TaskSet`. Shutdown aborts the tasks
//!   and awaits them; dropping the transport aborts them, and no task holds
//!   the transport itself.
//!
//! # Which functions keep which rule
//!
//! | rule | kept in this crate by |
//! |---|---|
//! | 1 every resource is counted | `HostShared::stats` (pool `held`, ledgers' `pending`, `TaskSet::count`), `HostShared::spawn`, `HostShared::teardown` |
//! | 2 failure frees | `HostShared::endpoint_failed` -> `Endpoints::failed` (`broken` then `destroyed`); the worker's `step` checks the link before every copy |
//! | 3 close is real | `MockTransport::close_segment` (`HostShared::cancel_segment`, `Endpoints::close_peer`) |
//! | 4 bounded endpoints | `Endpoints::acquire` (bound, LRU eviction, waits while all are busy: a step of the worker, which cannot await, so not the core's async `reach`), uses counted by the core's `lifecycle::EndpointUse`, `Endpoints::reap` via the reaper task |
//! | 5 terminal means quiet | `Batch::run_unit` (copy under the batch lock after `ledger.start`), `Batch::cancel`, `Batch::status` (deadline via `expire`); the host's one deadline timer (`transport::deadline_timer` over a `lifecycle::DeadlineQueue`) expires a batch when its deadline comes and wakes its waiters |
//! | 6 poll never panics | `MockTransport::poll` (ledger snapshot; no unwrap on anything a peer, timer or caller controls) |
//! | 9 memory is guarded | `HostShared::plan` (`validate_batch`), `move_bytes` (remote region, access, retired memory), `MockTransport::unregister` (`RegionEntry::retire`, `fail_local_users`, `fail_remote_users`) |
//!
//! //! # Faults
//!
//! - Real faults on the fabric: [`MockFabric::kill`], [`MockFabric::cut`],
//!   [`MockFabric::stall`], and restart by a new transport of the same name.
//! - A seeded, scriptable [`FaultPlan`] (in [`MockConfig`] or set at runtime
//!   with [`MockTransport::set_fault_plan`]): failed handshakes and opens,
//!   failed requests by count, index, segment, address, direction or
//!   attempt, endpoint resets mid-batch, stalls past the deadline, resource
//!   limits ("Failed to create QP: Cannot allocate memory"), killing a host
//!   after N requests, and random transient failures from a `SmallRng`.
//! - [`FaultyTransport`] applies a plan at the API boundary of *any*
//!   transport (TCP, RDMA), and counts how often each request was passed on.
//! - `MockBugs` (test-only, behind the `bugs` cargo feature, through
//!   `MockTransport::with_bugs`; never in [`MockConfig`]): deliberately
//!   broken behaviours (leaking or caching broken endpoints, writing after
//!   a timeout, a no-op close) that prove the conformance suite can fail.
#![forbid(unsafe_code)]

mod batch;
mod bugs;
mod config;
mod endpoint;
mod fabric;
mod faulty;
mod host;
mod plan;
mod region;
mod segment;
mod transport;
mod wake;
mod worker;

#[cfg(feature = "bugs")]
pub use bugs::{MockBugs, LATE_LANDING};
pub use config::MockConfig;
pub use fabric::MockFabric;
pub use faulty::FaultyTransport;
pub use plan::{FaultPlan, KillAfter, RandomFaults, RequestFault, RequestMatch, StallFault};
pub use transport::MockTransport;
