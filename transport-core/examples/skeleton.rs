//! The skeleton of a backend: the smallest `Transport` that compiles
//! against `transport-core`, and nothing else. Every method a backend
//! writes is here, with the rules of `docs/CONTRACT.md` it keeps and the
//! sans-IO machine in `transport_core::lifecycle` that keeps most of each
//! rule for it. Every body refuses with `Unsupported`: copy the file,
//! fill the bodies in, and run the conformance suite on it
//! (`conformance::conformance_main!`; `docs/WRITING_A_TRANSPORT.md`).
//!
//! What a backend does *not* write: retries, deadlines above one attempt,
//! circuit breakers, backpressure (`kvmove-policy`'s `Engine`), sessions
//! (`kvmove_policy::Sessions`), several NICs as one (`transport-rails`).
//! Its crate cannot even name `kvmove_policy` (`scripts/check-layers`).
//!
//! `cargo run -p transport-core --example skeleton` prints what it refuses.

use std::sync::Arc;

use async_trait::async_trait;
use transport_core::{
    Access, BatchId, BatchStatus, Capabilities, Error, ErrorKind, MemoryRegion, Notification, RegionId, ResourceStats,
    Result, SegmentDescriptor, SegmentId, SubmitOptions, TransferRequest, Transport,
};

/// A backend with nothing behind it yet.
#[derive(Debug, Default)]
struct Skeleton;

fn todo(what: &str) -> Error {
    Error::new(ErrorKind::Unsupported, format!("skeleton backend: {what} is not written yet"))
}

#[async_trait]
impl Transport for Skeleton {
    /// The name in logs, metrics and errors.
    fn backend(&self) -> &str {
        "skeleton"
    }

    /// What it supports: batch and request bounds (rule 4 for endpoints),
    /// read/write, device memory (rule 9, memory kinds).
    fn capabilities(&self) -> Capabilities {
        // `Capabilities::new(max_endpoints)`, then the fields that differ.
        let mut c = Capabilities::new(0);
        (c.read, c.write) = (false, false);
        c
    }

    /// The name peers open (TCP and RDMA: the listening `host:port`).
    fn local_segment_name(&self) -> String {
        "skeleton:0".into()
    }

    /// Its own descriptor (generation: `transport_core::fresh_generation`
    /// at start; regions registered with remote access).
    fn local_descriptor(&self) -> Result<SegmentDescriptor> {
        Err(todo("local_descriptor"))
    }

    /// Rule 9: checked local memory in, a `RegionId` out; overlap is
    /// `AlreadyRegistered`.
    fn register(&self, _mem: MemoryRegion, _access: Access) -> Result<RegionId> {
        Err(todo("register"))
    }

    /// Rules 3 and 9: requests in flight on the region fail with
    /// `Unregistered` and are quiet before this returns.
    async fn unregister(&self, _region: RegionId) -> Result<()> {
        Err(todo("unregister"))
    }

    /// Reach a peer by name: fetch its descriptor (rule 7: refusals are
    /// transient, unknown names `NotFound`).
    async fn open_segment(&self, _name: &str) -> Result<SegmentId> {
        Err(todo("open_segment"))
    }

    /// Rule 3: its endpoints are closed and counted down before `Ok`
    /// (`lifecycle::EndpointPool::retire_key`).
    async fn close_segment(&self, _segment: SegmentId) -> Result<()> {
        Err(todo("close_segment"))
    }

    /// The descriptor an open segment was opened with.
    fn segment_descriptor(&self, _segment: SegmentId) -> Result<SegmentDescriptor> {
        Err(todo("segment_descriptor"))
    }

    /// Validate (`lifecycle::validate_batch`), count (`lifecycle::BatchTable`,
    /// `lifecycle::BatchLedger`: rule 5, terminal only when nothing is on
    /// the wire), send; enter its deadline in a `lifecycle::DeadlineQueue`.
    async fn submit(&self, _requests: Vec<TransferRequest>, _opts: SubmitOptions) -> Result<BatchId> {
        Err(todo("submit"))
    }

    /// Rule 6: never panics, never blocks; unknown ids are `InvalidHandle`.
    fn poll(&self, _batch: BatchId) -> Result<BatchStatus> {
        Err(todo("poll"))
    }

    /// Until the batch is terminal (rule 5).
    async fn wait(&self, _batch: BatchId) -> Result<BatchStatus> {
        Err(todo("wait"))
    }

    /// Ends the live requests as `Cancelled`; returns once quiet.
    async fn cancel(&self, _batch: BatchId) -> Result<BatchStatus> {
        Err(todo("cancel"))
    }

    /// Forgets a terminal batch (in progress: `InvalidRequest`).
    fn release(&self, _batch: BatchId) -> Result<()> {
        Err(todo("release"))
    }

    /// Rule 1: every resource counted, back to its baseline after close,
    /// unregister, release, shutdown.
    fn stats(&self) -> ResourceStats {
        ResourceStats::default()
    }

    /// Rule 11: `Ok` only once the peer queued it, in order per pair,
    /// bounded by the peer's `transport_core::Inbox`.
    async fn notify(&self, _segment: SegmentId, _msg: Vec<u8>) -> Result<()> {
        Err(todo("notify"))
    }

    /// Rule 11: what peers sent, from this transport's `Inbox`.
    fn take_notifications(&self, _max: usize) -> Result<Vec<Notification>> {
        Err(todo("take_notifications"))
    }

    /// Until a notification is queued (or shutdown).
    async fn wait_notification(&self) -> Result<()> {
        Err(todo("wait_notification"))
    }

    /// Rules 1 and 3 for everything: quiet, then `Shutdown` for every
    /// later call; a second call is `Ok`.
    async fn shutdown(&self) -> Result<()> {
        Err(todo("shutdown"))
    }

    // Provided by the trait, overridable: `advertise` (an address suffix
    // peers see; `Unsupported` by default) and `notify_after` (a
    // notification only once every byte of a batch landed; the default,
    // `transport_core::notify_when_completed`, is right for every backend
    // whose `Completed` means landed).
}

fn main() {
    let t: Arc<dyn Transport> = Arc::new(Skeleton);
    let mem = transport_core::Buffer::new(64).map(|b| b.region());
    match mem.map_err(Error::from).and_then(|m| t.register(m, Access::LOCAL)) {
        Ok(_) => println!("registered"),
        Err(e) => println!("{}: {e}", t.backend()),
    }
}
