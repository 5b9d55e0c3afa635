//! The RDMA backend of the transfer engine, on `rdma-sys` (libibverbs).
//!
//! # Design
//!
//! One [`RdmaTransport`] opens one device port (chosen by
//! [`RdmaConfig::device`], `port`, `gid_index`), allocates one protection
//! domain and one completion queue, and runs four background tasks: a CQ
//! poller woken by the completion channel, a reaper (idle endpoints, flush
//! deadlines), the TCP side-channel listener and the async-event handler
//! (fed by a small thread that reads and acknowledges the device's async
//! events at once, so destroying a QP never waits on an unread event).
//!
//! * **Memory**: `register` pins the region with `ibv_reg_mr`; access flags
//!   follow [`transport_core::Access`] (local write always, remote read /
//!   write as asked). The rkey travels in the segment descriptor.
//! * **Segments**: the name is the peer's side-channel `host:port`; opening
//!   fetches the descriptor (generation + regions with rkeys) from the peer.
//! * **Endpoints**: built lazily on the first transfer to a segment handle:
//!   `qps_per_endpoint` RC QPs, connected by exchanging QPN, PSN, GID, LID
//!   and MTU over TCP (MTU = min of both ports' active MTU); the socket
//!   stays open for the endpoint's life and its close destroys the peer's
//!   half. The store is bounded by `max_endpoints` (LRU idle eviction), and
//!   idle endpoints are reclaimed on a timer.
//! * **Transfers**: requests are cut into slices of `slice_size`, posted as
//!   signaled RDMA WRITE / READ round-robin over the endpoint's QPs, at most
//!   `max_outstanding_per_qp` per QP; the rest wait in a queue.
//! * **Failure**: a completion error, a failed post or an async event for
//!   one of its QPs (`IBV_EVENT_QP_FATAL`, `..._REQ_ERR`, `..._ACCESS_ERR`)
//!   breaks the endpoint (QPs to ERROR, destroyed once flushed) and the
//!   next transfer builds a new one. `IBV_EVENT_PORT_ERR` (link down)
//!   breaks every endpoint and peer QP group on the port and refuses new
//!   ones with a transient "link down" error until the port is active
//!   again; `IBV_EVENT_DEVICE_FATAL` ends the transport's work for good. Work-request ids are never reused, so a late completion finds
//!   nothing to touch. Cancel, timeout, `close_segment` and `unregister`
//!   flush the QPs carrying affected work and report terminal only when it
//!   is quiet.
//! * **Latency**: `wait` polls the CQ itself for up to `busy_poll_us`
//!   before it sleeps on the completion event, so a small transfer is seen
//!   at polling latency instead of after two thread wakeups.
//! * **Unsafe**: all of it is in the private `verbs` module, each verb
//!   called through one checked helper that names the verb and the errno.
//!
//! Transfers from and to this process (two transports, or loopback through
//! one device) work like remote ones, which is how the tests run on a
//! single soft-RoCE device.

mod config;
mod error;
mod server;
mod state;
mod transport;
mod verbs;
mod wire;

pub use config::RdmaConfig;
pub use error::VerbsError;
pub use transport::{rdma_devices, RdmaTransport};
