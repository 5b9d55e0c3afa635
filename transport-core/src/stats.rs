//! Capabilities and live resource counts.

use serde::{Deserialize, Serialize};

/// What a backend can do. Conformance cases choose themselves by these
/// flags; a case a backend cannot run is reported as skipped, never passed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Capabilities {
    /// Supports [`crate::Opcode::Read`].
    pub read: bool,
    /// Supports [`crate::Opcode::Write`].
    pub write: bool,
    /// Largest number of requests in one batch; more is `InvalidRequest`.
    pub max_batch_len: usize,
    /// Largest single request in bytes; more is `InvalidRequest`.
    pub max_request_len: u64,
    /// Configured bound on live endpoints (rule 4).
    pub max_endpoints: usize,
    /// Endpoints per peer connection (QPs per endpoint, TCP lanes).
    pub lanes_per_endpoint: usize,
    /// Registers and moves device (GPU) memory
    /// ([`crate::MemoryKind::Device`]); a backend without it refuses a
    /// device region at registration with `Unsupported`, never at the
    /// first transfer.
    pub device_memory: bool,
    /// Peers may read and write device memory this backend registered with
    /// remote access. A backend with `device_memory` and without this
    /// moves device memory only on the initiator's side of a transfer:
    /// it refuses a device region with remote access at registration
    /// (`Unsupported`), unless its NIC can reach that region directly
    /// (RDMA: GPUDirect), which only registration can tell.
    pub device_memory_remote: bool,
}

impl Capabilities {
    /// Safe defaults for a backend that supports reads and writes.
    pub fn new(max_endpoints: usize) -> Self {
        Self {
            read: true,
            write: true,
            max_batch_len: 1 << 20,
            max_request_len: 1 << 32,
            max_endpoints,
            lanes_per_endpoint: 1,
            device_memory: false,
            device_memory_remote: false,
        }
    }
}

/// Live resources held by a transport right now (rule 1: every resource is
/// counted). After `close_segment`, `unregister`, `release` and `shutdown`
/// the counts return to where they were before the matching open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ResourceStats {
    /// Connections to peers (RDMA: QP groups; TCP: lane pools), each counted
    /// once however many lanes it has.
    pub endpoints: usize,
    /// Individual OS or NIC objects behind the endpoints (QPs, sockets).
    pub endpoint_lanes: usize,
    /// Open segment handles.
    pub segments: usize,
    /// Registered local regions.
    pub regions: usize,
    /// Batches not yet released (in progress or terminal).
    pub batches: usize,
    /// Requests or slices handed to the wire and not yet terminal.
    pub inflight: usize,
    /// Background tasks owned by the transport (pollers, reapers, servers).
    pub tasks: usize,
    /// Received notifications waiting in the inbox (rule 11: bounded).
    pub notifications: usize,
    /// Host memory held to stage device memory (pinned buffers a device
    /// region's bytes pass through), bounded by the backend's
    /// configuration; freed when no registered region needs it.
    pub staging_bytes: u64,
}

/// Describes the endpoint metrics every backend emits
/// (`kvmove_endpoints_total`, `kvmove_endpoints_live`) to the installed
/// recorder; each backend's `describe_metrics` calls it.
pub fn describe_endpoint_metrics() {
    metrics::describe_counter!(
        "kvmove_endpoints_total",
        "Endpoint (connection) events of a backend, by backend and event."
    );
    metrics::describe_gauge!("kvmove_endpoints_live", "Endpoints (connections) a backend holds now.");
}
