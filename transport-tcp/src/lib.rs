//! The TCP backend of the transfer engine: [`TcpTransport`] implements
//! [`transport_core::Transport`] over tokio sockets, configured by one serde
//! [`TcpConfig`].
//!
//! # Design
//!
//! Every transport listens on `TcpConfig::listen` and serves the memory it
//! registered as remotely accessible; its segment name is the bound
//! `host:port`. Metadata is peer-to-peer: `open_segment("host:port")`
//! connects to the peer and fetches its descriptor (regions and a
//! *generation* that changes on every start) from the peer itself.
//!
//! An **endpoint** is the pool of `lanes` TCP connections to one peer
//! (never one connection per transfer). Requests are cut into slices of at
//! most `slice_size` bytes that the lanes pull from the endpoint's queue and
//! pipeline (up to `window` outstanding per lane; small frames are
//! coalesced into one `write`). Endpoints are counted (`stats().endpoints`,
//! `stats().endpoint_lanes` = sockets), bounded by `max_endpoints` (an idle
//! one is evicted and its sockets closed before its slot is reused; if all
//! are busy the caller waits up to `connect_timeout`, then gets
//! `ResourceExhausted`), reclaimed by a
//! reaper task after `idle_timeout`, and destroyed at once when any lane
//! fails (rule 2); the next transfer builds a new one.
//!
//! # Protocol
//!
//! Frames are a fixed 48-byte header (magic, type, status, payload length,
//! request id, address, length, generation, a header check) and a payload
//! of at most `max_frame` bytes (see `proto.rs` for the layout). A lane
//! opens with HELLO (protocol version, client nonce) → CHALLENGE (server
//! generation, auth flag, server nonce and, when the client asked for it,
//! the server's proof) → AUTH (client proof, if a secret is set) → READY
//! (server proof). A client that has checked the server's early proof (or
//! has no secret) sends its first request (the first lane's DESC_REQ)
//! right behind its AUTH, so the handshake costs one round trip before it,
//! not two. DESC_REQ/DESC_RESP fetch the descriptor, WRITE (header + payload) is answered by WRITE_ACK only after
//! the bytes are in the peer's memory (a write is complete only when
//! acknowledged), and READ is answered by READ_RESP whose payload is copied
//! into the destination region through a bounded buffer. Request ids are
//! unique per transport and never reused, and every WRITE/READ carries the
//! generation the client's descriptor has, so neither a late answer nor a
//! stale descriptor can ever touch the wrong memory. When a rebuilt
//! endpoint sees a new generation (the peer restarted), requests to the
//! handle fail with the transient `PeerRestarted` and the handle's
//! descriptor is refreshed.
//!
//! NOTIFY (rule 11) carries a notification: the sender's segment name and
//! a message of at most `MAX_NOTIFY_LEN` bytes, with the generation of the
//! receiver the sender's descriptor has. The receiver offers it to its
//! bounded inbox (`inbox_capacity`) and answers NOTIFY_ACK: `Ok` once it is
//! queued, `Busy` when the inbox is full (the sender's `notify` fails with
//! a transient `Backpressure`). `notify` sends it on a lane of the peer's
//! endpoint (taken before any queued slice) and returns only once answered,
//! so notifications whose calls returned are taken in that order.
//!
//! # Terminal means quiet, for TCP
//!
//! Each batch keeps a `BatchLedger` (units = slices). A lane asks it to
//! start a slice before the slice touches memory; a request that was ended
//! (cancelled, timed out, failed, its region unregistered) is not live and
//! none of its slices starts again. The ledger reports a request terminal
//! only when none of its started slices is on the wire: each has been
//! answered by the peer, or failed after the lane tasks that carried it
//! were aborted *and joined* and their sockets closed. `cancel`, timeouts,
//! `close_segment`, `unregister` and `shutdown` end requests in the ledger,
//! then reset the endpoints that carry their started slices. So, once a
//! batch is
//! reported terminal:
//!
//! - its **local** buffers are neither read (WRITE sources) nor written (READ
//!   destinations) by this transport again;
//! - for **WRITEs that did not complete**, the peer applies no byte that
//!   reaches its process after its connection was reset: ending a batch
//!   with slices on the wire resets (RST, `SO_LINGER 0`) every lane of the
//!   endpoints carrying them, and before applying a WRITE's bytes the
//!   server checks the connection for a reset whenever it read from the
//!   socket since its last check (at least once per 128 KiB chunk), so
//!   bytes queued behind a stalled or dead path are dropped with the
//!   connection. Bytes the peer process had already read before the reset
//!   reached it may have been applied (for TCP, delivered bytes cannot be
//!   recalled): at most the slices in flight at that moment, i.e. `lanes x
//!   window` slices per endpoint, and only while the path delivered.
//!   Such a request is reported cancelled, timed out or failed, never
//!   completed, and its destination range holds unspecified bytes.
//!
//! Resetting an endpoint to end one batch fails the other batches' slices
//! on it with the transient `ConnectionReset`; the policy layer retries them.
//!
//! # Same-host copies
//!
//! Between two processes of one host (`TcpConfig::same_host`, default on)
//! a lane carries requests and answers but not the bytes: the server copies
//! a WRITE's bytes from the client's source into its region, the client
//! copies a READ's bytes from the server's region into its destination
//! (`process_vm_readv`; `samehost.rs` says how each side verifies the other
//! process). Each side writes only its own memory, after its own checks,
//! except for *direct writes* (`TcpConfig::direct_writes`): a small WRITE
//! (at most 64 requests and 1 MiB per submit, each request one slice of
//! host memory) is copied by the submitting thread straight into the
//! server's memory (one kernel copy), with no frame and no answer, where
//! the server granted that range in the connection's window
//! (`transport_mem::window`; the server closes a range and waits for
//! writes that saw it open before `unregister` returns). Such a request is
//! complete when `submit` returns. The server's served-bytes metrics count
//! direct writes as the clients report them, at most a second late.
//! *Direct reads* (`TcpConfig::direct_reads`) are their mirror: a small
//! READ is copied by the submitting thread straight out of the server's
//! memory where the window holds the range open for reads, fenced by
//! `unregister` the same way (so, unlike a READ through the lanes, none
//! copies after `unregister` returned).
//! The rules above hold with one difference for WRITE sources: the peer's
//! copy reads them until it answers. Ending a request waits for those
//! answers while the peer keeps answering (`drain_timeout` of silence
//! ends the wait), so normally the source is no longer
//! read once the request is terminal; a peer that stalls longer (a frozen
//! process) and then resumes may still read the source of a WRITE already
//! reported failed, which only changes that failed write's destination
//! bytes (unspecified either way). Local READ destinations are written only
//! by this process's lane reader, under the ledger, as without copies. On
//! the serving side, a READ is checked against the live regions when it
//! arrives and the client copies after the answer, so a READ that races an
//! `unregister` of its source may copy bytes of that range after the
//! unregister returned (without copies it would have failed
//! `Unregistered`); only reading, and only by a process that could read all
//! of this one anyway (see the threat model).
//!
//! # The contract, and where this crate keeps it
//!
//! The lifecycle is decided by `transport_core::lifecycle` (sans-IO); this
//! crate is the driver that does the I/O those machines ask for.
//!
//! | rule | kept here by |
//! |---|---|
//! | 1 every resource is counted | `TcpTransport::stats` (endpoints: the pool's slots held, `Slots::counts`; sockets: `Env::lanes`; in flight: each `Batch`'s ledger `on_wire`; tasks: the one `TaskSet` every spawn goes through, `Env::tasks`; notifications: `Inbox::len`); `TcpTransport::shutdown` waits until tasks and slots are zero |
//! | 2 failure frees | `Endpoint::broke` → `Endpoint::begin_destroy` (the pool retires it: never handed out again) → `Endpoint::teardown` (lane tasks aborted and joined, sockets reset, slices failed, then `Slots::destroyed` frees the slot) |
//! | 3 close is real | `TcpTransport::close_segment` → `Inner::end_requests` (cancel, quiet) → `Inner::retire_peer` (every endpoint to the peer destroyed, also one being built or already dying); the handle is gone from `segments` first |
//! | 4 bounded endpoints | `Inner::endpoint` runs `transport_core::lifecycle::reach` over `Slots::acquire` (use, build in a reserved slot, evict the LRU idle one and wait for its destruction, or wait up to `connect_timeout`, then `Error::endpoints_exhausted`); `driver::reaper` (`Slots::reap`); uses counted by `transport_core::lifecycle::EndpointUse` held by queued work and every slice on the wire |
//! | 5 terminal means quiet | `Batch` (the ledger: sticky, terminal only when no slice is on the wire); `lane::stage` (`Batch::start` before a slice touches memory, under the lane's lock); `rx::reader` (a slice stays in its lane's pending map until its answer's last copy, and an answer to a WRITE still streaming is refused, so a slice ends only after its last copy, or after its tasks were joined); `Inner::quiet` (resets endpoints carrying started slices of ended requests); `driver::timer` over `deadlines::Deadlines` (the core's `DeadlineQueue`: `Batch::expire`, then `Inner::quiet`) |
//! | 6 poll never panics | `TcpTransport::poll` reads the ledger; every frame maps to a status or an error (`conn::status_err`, `rx::reader`); no unchecked arithmetic on peer values |
//! | 9 memory is guarded | `TcpTransport::submit` (`validate_batch`); the server side `RegionTable::remote` and `Region::with_live`; `TcpTransport::unregister` (`Region::kill`, then `Error::region_unregistered` and quiet) |
//! | 11 notifications | `TcpTransport::notify` (`check_notification`, `proto::encode_notify`, `Inner::endpoint`, `Inner::check_generation`, `Endpoint::enqueue_note`; the answer awaited at most `NOTIFY_TIMEOUT`); `lane::stage_note` and `rx::reader` (NOTIFY out, NOTIFY_ACK to the caller; a destroyed endpoint answers its notes with its error, `Endpoint::teardown`); the server side `Server::deliver` (`proto::decode_notify`, `check_received`, `Inbox::offer`: `Ok`, `Busy` when full); `take_notifications` / `wait_notification` read the inbox, which `shutdown` closes; `notify_after` is the trait's (a write completes only once acknowledged after landing) |
//!
//! # Threat model
//!
//! The engine's threat model, this backend's part included, is stated once
//! in `docs/THREAT_MODEL.md` at the root of the repository.
#![forbid(unsafe_code)]

mod applying;
mod batch;
mod bufs;
mod busypoll;
mod config;
mod conn;
mod deadlines;
mod driver;
mod endpoint;
mod hush;
mod lane;
mod pool;
mod proto;
mod regions;
mod requests;
mod rx;
mod samehost;
mod server;
mod staging;
mod transport;

pub use config::TcpConfig;
pub use server::{IDLE_CONNECTION_BOUND, SERVED_CONNECTION_BOUND, SERVER_POOL_BOUND};
pub use transport::{TcpTransport, NOTIFY_TIMEOUT};

/// The server's request machine driven in process, for the fuzzer
/// (`fuzz/fuzz_targets/requests.rs`) and the tests: not an API.
#[doc(hidden)]
pub use requests::fuzzing;

/// The frame codec, exposed for fuzzing and tests: arbitrary bytes fed to
/// [`wire::FrameDecoder`] are refused or decoded, never panic, and use
/// bounded memory.
pub mod wire {
    pub use crate::proto::{
        decode_notify, decode_regions, encode_notify, encode_regions, FrameDecoder, FrameType, Header, ProtoError,
        Status, WireRegion, EARLY_PROOF, HEADER_LEN, MAX_NOTIFY_PAYLOAD, NONCE_LEN, PROOF_LEN, PULL_WRITES, SAME_HOST,
        VERSION,
    };
}

/// Describes the TCP backend's metrics (and the endpoint metrics every
/// backend emits) to the installed recorder. Call once after installing it.
pub fn describe_metrics() {
    use metrics::describe_counter;
    transport_core::describe_endpoint_metrics();
    describe_counter!("kvmove_tcp_served_bytes_total", "Bytes this engine's TCP server served to peers, by operation.");
    describe_counter!("kvmove_tcp_connections_total", "Connections the TCP server accepted.");
    describe_counter!(
        "kvmove_tcp_connections_refused_total",
        "Connections the TCP server refused or evicted, by reason."
    );
    describe_counter!(
        "kvmove_tcp_same_host_bytes_total",
        "Of the bytes this engine's TCP server served, those moved by same-host copies (process to process, \
         not through the socket), by operation."
    );
    describe_counter!(
        "kvmove_tcp_direct_write_bytes_total",
        "Bytes this engine wrote straight into same-host peers' memory (direct writes, no round trip)."
    );
    describe_counter!(
        "kvmove_tcp_direct_read_bytes_total",
        "Bytes this engine read straight out of same-host peers' memory (direct reads, no round trip)."
    );
    describe_counter!(
        "kvmove_tcp_lanes_total",
        "TCP lanes this engine connected, by path: same_host (bytes moved by same-host copies) or socket."
    );
    describe_counter!(
        "kvmove_tcp_server_polls_total",
        "Times a server connection polled its socket for the next request instead of sleeping \
         (server_poll_us), by result: caught (the request came within the window) or missed."
    );
}
