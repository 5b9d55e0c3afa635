//! The RDMA backend of the transfer engine, on `rdma-sys` (libibverbs).
//!
//! # Design
//!
//! One [`RdmaTransport`] opens one device port (chosen by
//! [`RdmaConfig::device`], `port`, `gid_index`), allocates one protection
//! domain and one completion queue, and runs five background tasks: a CQ
//! poller woken by the completion channel, a reaper (idle endpoints, flush
//! deadlines), the batch deadline timer (one for every batch, over the
//! core's `DeadlineQueue`), the TCP side-channel listener and the
//! async-event handler
//! (fed by a small thread that reads and acknowledges the device's async
//! events at once, so destroying a QP never waits on an unread event).
//!
//! * **Memory**: `register` pins the region with `ibv_reg_mr`; access flags
//!   follow [`transport_core::Access`] (local write always, remote read /
//!   write as asked). The rkey travels in the segment descriptor. Device
//!   (GPU) memory is registered for GPUDirect where the stack allows it
//!   (`ibv_reg_dmabuf_mr` on the provider's dma-buf, else `ibv_reg_mr` on
//!   the device address) and otherwise staged through pinned host buffers
//!   on both sides ([`RdmaConfig::staging_buffers`]; the private `staging`
//!   module says how).
//! * **Side channel** (version 2): every connection to the listener opens
//!   with a handshake (`greet`: version, nonces, and with
//!   [`RdmaConfig::secret`] an HMAC-SHA256 proof of the shared secret from
//!   each side, `transport_control::auth`), counted from its accept by
//!   `transport_control::admission` (handshake quotas `max_handshaking`,
//!   `max_handshaking_per_ip`; the handshake that proved least gives way);
//!   nothing else (descriptor, QP group, notification, staging lease) is
//!   answered before it. Without a secret only this host is answered
//!   (protected mode) unless [`RdmaConfig::insecure`]. A version-1 peer's
//!   first request is answered an error naming the version. The threat
//!   model is `docs/THREAT_MODEL.md` at the repository's root.
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
//!   again; `IBV_EVENT_DEVICE_FATAL` ends the transport's work for good.
//!   Work-request ids are never reused, so a late completion finds
//!   nothing to touch. Cancel, timeout, `close_segment` and `unregister`
//!   flush the QPs carrying affected work and report terminal only when it
//!   is quiet.
//! * **Notifications** (rule 11): a segment handle's first `notify` opens
//!   a *notification channel* to the peer's side-channel listener: a TCP
//!   connection that holds no QPs, so notifications need neither an
//!   endpoint place nor an active RDMA link (a session's messages keep
//!   flowing while a link is cut and QPs are rebuilt). Each message is
//!   `wire::Request::Notify` (the sender's segment name, the message as
//!   hex; lines bounded by `MAX_NOTE_LINE`); the channel's carrier task is
//!   its one reader and writer and hands back the peer's answers in order.
//!   The peer checks the message (`check_received`), offers it to its
//!   bounded inbox (`inbox_capacity`) and answers `notify_ack`, or `busy`
//!   (the sender's transient `Backpressure`); anything malformed is answered
//!   with an error and the channel is closed. The sender waits for the
//!   answer at most `handshake_timeout_ms`. A failed channel is dropped at
//!   once and the next notification opens a new one; `close_segment`,
//!   `shutdown` and the idle reaper close it; peers may hold at most
//!   `max_passive` of them, those of one address `max_passive_per_ip`
//!   (QP groups have the same two bounds).
//! * **Latency**: `wait` polls the CQ itself for up to `busy_poll_us`
//!   before it sleeps on the completion event, so a small transfer is seen
//!   at polling latency instead of after two thread wakeups. The path from
//!   `submit` to `ibv_post_send` takes one lock and reads no clock, and a
//!   completion already in the CQ ends `wait` without a clock read or a
//!   yield (see the README's RDMA numbers for where the time goes).
//! * **Unsafe**: all of it is in the private `verbs` module, `verbs.rs`
//!   and `verbs/qp.rs` (`grep -rn unsafe src/` finds no other file but
//!   these docs), each block with a `// SAFETY:`
//!   reason and each verb called through one checked helper that names the
//!   verb and the errno. The rest of the crate sees safe owners only: a
//!   `Registration` owns an MR together with the memory it covers (the
//!   memory is freed only after `ibv_dereg_mr` succeeded, leaked if it
//!   failed), and `Qp::post` bounds-checks the local range against the
//!   `Registration` it is given and pins that MR in the QP until the QP is
//!   destroyed, so no posted work request ever outlives its registration.
//!
//! # The contract, and where it is kept
//!
//! The backend is a driver over `transport_core::lifecycle`: per-request
//! status in a `BatchLedger` per batch (units are work requests), the
//! endpoint bound in an `EndpointPool<SegmentId>`, background work counted
//! in a `TaskSet`, validation by `validate_batch`.
//!
//! | rule | kept by |
//! |---|---|
//! | 1 every resource is counted | `stats` (endpoints and QPs in `State::endpoints`, posted work in `State::wrs`, tasks in `Inner::tasks`: fixed tasks (among them the one deadline timer over `State::deadlines`, a `lifecycle::DeadlineQueue`), the event thread, watcher / notification-carrier / peer tasks as `lifecycle::OwnedTask`, uncounted as their owner lets go) |
//! | 2 failure frees | `State::break_endpoint` (QPs to ERROR, `EndpointPool::broken`: never handed out again), `State::after_work` / `State::reap` (destroyed once flushed or after `flush_timeout_ms`), `Inner::on_async_event` (QP, port, CQ, device events) |
//! | 3 close is real | `close_segment` (`State::end_requests`, `EndpointPool::retire_key`, `State::break_endpoint`, then `Inner::settle` until its endpoints are destroyed; the handle's notification channel goes with it) |
//! | 4 bounded endpoints | `Inner::endpoint` (the core's `lifecycle::reach` over `EndpointPool::acquire`: LRU eviction of idle endpoints, bounded wait, `endpoints_exhausted`), `State::reap` (`EndpointPool::reap`), `Inner::with_state` (a place is freed only after its QPs are destroyed) |
//! | 5 terminal means quiet | `BatchLedger` via `State::pump` (`start` before each post), `State::on_completion` (`unit_done`, in CQ order under `Inner::cq_lock`), `State::end_requests` (`end_where`, then reset the endpoints carrying decided work), `State::destroy_endpoint_now` (records lost units in the `Graveyard`), `Inner::with_state` (`State::after_destroy`: `units_lost` only after `ibv_destroy_qp`), `Inner::stop_batch` |
//! | 9 memory is guarded | `Inner::check` (`validate_batch`; remote range, access and rkey against the descriptor), `Qp::post` (local range against its `Registration`), `register` (overlap), `unregister` (`end_requests`, the region parked in `State::retiring`, idle endpoints pinning it destroyed, `settle` until nothing of the region is on the wire, then `ibv_dereg_mr` once no QP pins it) |
//! | 11 notifications | `Inner::notify` (`notes.rs`: size checked before anything is sent; `Ok` only once the peer answered that it queued the message), `server::notes` (bounded decoding, `Inbox::offer`: full is `busy`, nothing queued past `inbox_capacity`; malformed closes the channel), `carry` (the channel's one reader: answers in order; a failed channel is dropped, never reused), `notify_after` (the trait's: sent only after the batch completed). Why that is safe: a batch is `Completed` only when every work request of it has a successful completion, and the completion of an RDMA WRITE on an RC QP is generated only once the responder has acknowledged the data, which it does once the data is placed in its memory; the notification is written to the channel only after that, so when the receiver takes it every byte of the batch is already there. Per pair of transports the order of `notify` calls that returned is kept, as `Ok` comes back only after the peer queued the message |
//!
//! # Modules
//!
//! `transport` (the trait, thin) -> `submit` (validation, batches,
//! deadlines) -> `endpoint` (pool, builds, side-channel watchers) ->
//! `handshake` (the one QP bring-up, also used by `server`) -> `greet` (the
//! side channel's handshake, both sides) ; `notes`
//! (notification channels) ; `background` (CQ poller and draining, reaper,
//! async events) ; `work` (the data path over the ledger) ; `staging`
//! (device memory) -> `state` (shared state, `Inner::with_state`) ->
//! leaves: `ids`, `stage` (the staging path's data), `counters`, `verbs`
//! (all unsafe), `wire`, `config`, `error`. Imports only point that way
//! (no module cycle: `scripts/check-layers` checks it).
//!
//! # Several devices
//!
//! [`open_devices`] takes [`RdmaConfig::devices`] (a list, or `["all"]`)
//! and builds one transport per device; the `kvmove` facade drives them as
//! rails with `transport_rails::Rails` (a layer over any backend):
//! slices spread over the paths to a peer's rails by what each moves, a
//! failed rail's slices reposted on the others once that rail's work is
//! quiet, failing paths paused with backoff, and (with
//! [`RdmaConfig::tcp_fallback`] and a TCP transport) a fallback while
//! every rail is down. Rail 0's descriptor lists the others
//! (`Transport::advertise`).
//!
//! Transfers from and to this process (two transports, or loopback through
//! one device) work like remote ones, which is how the tests run on a
//! single soft-RoCE device.

mod background;
mod config;
mod counters;
mod endpoint;
mod error;
mod greet;
mod handshake;
mod ids;
mod notes;
mod rails;
mod server;
mod stage;
mod staging;
mod state;
mod submit;
mod transport;
mod verbs;
mod wire;
mod work;

/// The backend's name (`Transport::backend`, descriptors' `backend`).
const BACKEND: &str = "rdma";

pub use config::RdmaConfig;
pub use counters::describe_metrics;
pub use error::VerbsError;
pub use rails::{open_devices, rail_devices};
pub use transport::{rdma_devices, RdmaTransport};
pub use verbs::cycles;
