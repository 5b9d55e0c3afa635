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
//! one is evicted and its sockets closed; if all are busy the caller waits up
//! to `connect_timeout`, then gets `ResourceExhausted`), reclaimed by a
//! reaper task after `idle_timeout`, and destroyed at once when any lane
//! fails (rule 2); the next transfer builds a new one.
//!
//! # Protocol
//!
//! Frames are a fixed 48-byte header (magic, type, status, payload length,
//! request id, address, length, generation, a header check) and a payload
//! of at most `max_frame` bytes (see `proto.rs` for the layout). A lane
//! opens with HELLO (protocol version, client nonce) → CHALLENGE (server
//! generation, auth flag, server nonce) → AUTH (client proof, if a secret is
//! set) → READY (server proof). Then DESC_REQ/DESC_RESP fetch the
//! descriptor, WRITE (header + payload) is answered by WRITE_ACK only after
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
//! # Terminal means quiet, for TCP
//!
//! A request is reported terminal only when every one of its slices has
//! ended: answered by the peer, skipped before it touched memory, or failed
//! after the lane tasks that carried it were aborted *and joined* and their
//! sockets closed. Copies into and out of local memory happen under a
//! per-batch gate that `cancel`, timeouts, `close_segment`, `unregister` and
//! `shutdown` take exclusively before ending requests. So, once a batch is
//! reported terminal:
//!
//! - its **local** buffers are neither read (WRITE sources) nor written (READ
//!   destinations) by this transport again;
//! - for **WRITEs that did not complete**, the peer applies no byte that
//!   reaches its process after its connection was reset: ending a batch
//!   with slices on the wire resets (RST, `SO_LINGER 0`) every lane of the
//!   endpoints carrying them, and the server checks the connection for a
//!   reset before applying each received chunk (128 KiB) of a WRITE, so
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
//! # Threat model
//!
//! The serving side is a security boundary: any host that can reach the
//! listener can send it bytes.
//!
//! - **Assets**: this process's memory. Peers may only touch regions
//!   registered with remote access, within their bounds, in the direction
//!   the registration allows; nothing else is reachable, ever.
//! - **Untrusted input**: every byte from a socket. Each frame header is
//!   validated (magic, header check, known type and status, per-type length
//!   rules, payload <= `max_frame`) before anything is allocated or done;
//!   every WRITE/READ range is checked against the live registrations
//!   (`addr + len` without overflow, wholly inside one region, access
//!   flags, current generation) before a byte moves, and copies go through
//!   `MemoryRegion`'s bounds-checked methods under the region's gate, so an
//!   unregister in progress cannot race a copy. A malformed, truncated,
//!   oversized or unexpected frame closes that connection (logged with
//!   `tracing`) and never affects other connections or crashes the server.
//! - **Resource exhaustion**: memory per connection is bounded (a staging
//!   chunk of 128 KiB plus an output buffer of 256 KiB + one frame);
//!   connections are capped by `max_connections`; a handshake must finish
//!   within `connect_timeout`.
//! - **Authentication** (optional): with `secret` set, a peer must prove it
//!   holds the shared secret before any request is served, by an
//!   HMAC-SHA256 challenge-response over fresh nonces from both sides
//!   (replay of a recorded handshake fails); the server proves it too, so a
//!   client never sends data to an impostor. A peer without the secret is
//!   refused with `AuthFailed`.
//! - **Not covered**: confidentiality and integrity of payload bytes on the
//!   wire (no encryption or MAC per frame; use a private network, IPsec or
//!   WireGuard where that matters; payload integrity relies on TCP's
//!   checksum, headers carry their own check); without a secret, anyone who
//!   can connect may read and write the exposed regions; denial of service
//!   by a peer that is allowed to connect (it can saturate the link);
//!   a peer that holds the secret is fully trusted within the exposed
//!   regions.
#![forbid(unsafe_code)]

mod auth;
mod batch;
mod config;
mod conn;
mod driver;
mod endpoint;
mod lane;
mod pool;
mod proto;
mod regions;
mod server;
mod transport;

pub use config::TcpConfig;
pub use transport::TcpTransport;

/// The frame codec, exposed for fuzzing and tests: arbitrary bytes fed to
/// [`wire::FrameDecoder`] are refused or decoded, never panic, and use
/// bounded memory.
pub mod wire {
    pub use crate::proto::{
        decode_regions, encode_regions, FrameDecoder, FrameType, Header, ProtoError, Status, WireRegion, HEADER_LEN,
        NONCE_LEN, VERSION,
    };
}
