//! An honest in-process transport backend, and fault injection for any
//! backend.
//!
//! # What it is
//!
//! [`MockTransport`] implements [`transport_core::Transport`] with real
//! memory copies ([`transport_core::MemoryRegion::copy_from`]) between
//! hosts that live in one process on a [`MockFabric`]. It keeps the same
//! contract as the TCP and RDMA backends (the ten rules on the trait), so
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
//! - **Hosts and generations.** Each `MockTransport` is a host registered
//!   in the fabric under its segment name, with a generation that is new on
//!   every start. Creating a transport with the name of a killed or shut
//!   down host is its restart. `open_segment` looks the host up (unknown or
//!   dead: transient `ConnectionRefused`) and snapshots its descriptor
//!   (the remotely accessible regions, `key` = region id).
//! - **Lazy endpoints.** An endpoint (this host → a peer) is built on the
//!   first transfer to the peer, not at open, and shared by every handle to
//!   that peer. It records the peer's generation. At most
//!   `max_endpoints` exist: a new one evicts (destroys) the least recently
//!   used idle one, or waits while all are busy. A reaper task destroys
//!   endpoints idle for `idle_timeout`. A request that finds its endpoint
//!   broken (cut, peer killed, plan reset) fails with `ConnectionReset` and
//!   destroys it; `close_segment` destroys it when no other open handle
//!   names the peer. Only the initiator counts endpoints (the passive side
//!   holds nothing). One lane per endpoint unless configured.
//! - **Batches.** `submit` validates the whole batch (size, zero length,
//!   handles, local bounds, `addr + len` overflow; the error names the
//!   `request` index) and spawns one task that runs the requests in order.
//!   Remote checks happen when a request runs, against the peer's live
//!   region table: outside one region is `OutOfBounds`, a forbidden
//!   direction `AccessDenied`, retired memory `Unregistered` (all
//!   permanent); a peer whose generation changed fails the request with
//!   transient `PeerRestarted` and refreshes the handle's descriptor.
//! - **Terminal means quiet.** A request's status changes only under its
//!   batch's lock, and the copy runs under that lock after checking the
//!   request is still pending, holding the regions' read locks. So cancel,
//!   deadlines (enforced by the task and by every `poll`/`wait`),
//!   `close_segment` and `shutdown` are quiet as soon as they mark the
//!   request, and `unregister` and a kill (which take the region's write
//!   lock) return only when no copy touches the memory.
//! - **Waiting** (latency, stalls, a free endpoint slot, `wait`) listens to
//!   one fabric-wide event channel, bounded by the batch deadline.
//! - **Counts** ([`transport_core::ResourceStats`]) are read from the live
//!   tables; tasks (the reaper and running batch tasks) are counted by a
//!   guard inside each task. Shutdown aborts and awaits them; dropping the
//!   transport aborts them, and no task holds the transport itself.
//!
//! # Faults
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
//! - [`MockBugs`]: deliberately broken behaviours (leaking or caching
//!   broken endpoints, writing after a timeout, a no-op close) that prove
//!   the conformance suite can fail.
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
pub use bugs::MockBugs;
pub use config::MockConfig;
pub use fabric::MockFabric;
pub use faulty::FaultyTransport;
pub use plan::{FaultPlan, KillAfter, RandomFaults, RequestFault, RequestMatch, StallFault};
pub use transport::MockTransport;
