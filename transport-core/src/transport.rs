//! The trait every backend implements, and the contract it keeps.

use async_trait::async_trait;
use transport_mem::MemoryRegion;

use crate::error::{Error, Result};
use crate::notify::{check_notification, Notification};
use crate::stats::{Capabilities, ResourceStats};
use crate::types::{
    Access, BatchId, BatchStatus, RegionId, SegmentDescriptor, SegmentId, SubmitOptions, TransferRequest,
};

/// A backend that moves bytes between registered local memory and remote
/// segments. Implemented by the TCP, RDMA and mock backends; wrapped by the
/// policy layer (`kvmove_policy::Engine`) that users call; a [`Layer`](crate::Layer)
/// wraps one to change only some methods.
///
/// The contract below is `transport-core/CONTRACT.md`, its one home, in
/// this crate so that it ships with it (`docs/CONTRACT.md` is a link to
/// it, the path everything else cites).
#[doc = include_str!("../CONTRACT.md")]
#[async_trait]
pub trait Transport: Send + Sync + 'static {
    /// Backend kind: `"mock"`, `"tcp"`, `"rdma"`, or a wrapper's name.
    fn backend(&self) -> &str;

    /// What this backend supports.
    fn capabilities(&self) -> Capabilities;

    /// The name peers pass to [`Transport::open_segment`] to reach this
    /// transport's registered memory (for TCP and RDMA: `host:port`).
    fn local_segment_name(&self) -> String;

    /// This transport's own segment descriptor, as a peer that opens
    /// [`Transport::local_segment_name`] would receive it: the current
    /// generation and every region registered with remote access. Used to
    /// publish the segment to a metadata store without a network round trip.
    ///
    /// # Behavior
    /// - After shutdown: `Shutdown`.
    fn local_descriptor(&self) -> Result<SegmentDescriptor>;

    /// Appends `extra` to the `address` of this transport's descriptor as
    /// peers receive it from then on (`transport_rails::Rails` lists its rails
    /// there, so a peer that opens the first rail finds the others). Calling
    /// it again replaces the earlier text. The default is `Unsupported`.
    fn advertise(&self, extra: &str) -> Result<()> {
        let _ = extra;
        Err(Error::new(
            crate::error::ErrorKind::Unsupported,
            format!("backend {} cannot advertise in its descriptor", self.backend()),
        ))
    }

    /// Registers local memory for transfers and, if `access` allows, for
    /// remote access by peers.
    ///
    /// # Behavior
    /// - Overlap with a live registration: `AlreadyRegistered`.
    /// - After shutdown: `Shutdown`.
    /// - The transport keeps a clone of `mem` until unregistered.
    fn register(&self, mem: MemoryRegion, access: Access) -> Result<RegionId>;

    /// Unregisters a region. Requests in flight that use it (locally, or
    /// from peers) fail with `Unregistered`; the call returns once none of
    /// them can touch the memory any more.
    ///
    /// # Behavior
    /// - Unknown or already unregistered handle: `InvalidHandle`.
    async fn unregister(&self, region: RegionId) -> Result<()>;

    /// Opens a remote segment by name: looks up its descriptor and returns a
    /// handle. Endpoints may be built here or lazily on first transfer.
    ///
    /// # Behavior
    /// - Unknown name or unreachable peer: a transient error
    ///   (`ConnectionRefused`, `NotFound` is permanent only when the
    ///   metadata store is authoritative).
    /// - Opening the same name twice gives two independent handles.
    async fn open_segment(&self, name: &str) -> Result<SegmentId>;

    /// Closes a segment handle (rule 3).
    async fn close_segment(&self, segment: SegmentId) -> Result<()>;

    /// The descriptor the handle was opened with (refreshed after a peer
    /// restart is noticed).
    fn segment_descriptor(&self, segment: SegmentId) -> Result<SegmentDescriptor>;

    /// Validates and starts a batch. Validation errors of the whole batch
    /// (empty, oversized, unknown handle) are returned here and start
    /// nothing; per-request errors found later appear in the status.
    ///
    /// # Behavior
    /// - Empty batch or more than `max_batch_len` requests: `InvalidRequest`.
    /// - A request with zero length, out of its local region, or naming an
    ///   unknown region or segment: the whole submit fails with the kind
    ///   (`InvalidRequest`, `OutOfBounds`, `InvalidHandle`) and the failing
    ///   request index in the error context (`request`).
    async fn submit(&self, requests: Vec<TransferRequest>, opts: SubmitOptions) -> Result<BatchId>;

    /// A snapshot of the batch. Never blocks, never panics (rule 6). A
    /// backend may apply answers that have already arrived here, on the
    /// caller's thread and without waiting, so that a caller spinning on
    /// `poll` sees a small transfer complete with no hand-off between
    /// threads (it must be called inside the backend's runtime for that).
    fn poll(&self, batch: BatchId) -> Result<BatchStatus>;

    /// A hint: from `polling(batch, true)` to the matching
    /// `polling(batch, false)` a caller calls [`Transport::poll`] on
    /// `batch` in a loop, so the answers that arrive for it meanwhile are
    /// applied on that caller's thread, and the backend may stop waking
    /// its own threads for them. Each `true` is followed by one `false`
    /// from the same caller, soon (a bounded spin, not a wait). Once no
    /// caller polls, the backend wakes for arrivals as before, the ones
    /// that came meanwhile included: nothing is left unread. Unknown or
    /// terminal batches are ignored. The default does nothing.
    fn polling(&self, batch: BatchId, on: bool) {
        let _ = (batch, on);
    }

    /// Waits until the batch is terminal and returns its final status.
    async fn wait(&self, batch: BatchId) -> Result<BatchStatus>;

    /// Cancels pending requests (they end `Cancelled`; ones that already
    /// completed stay completed) and returns the terminal status once the
    /// batch is quiet. Cancelling a terminal batch returns its status.
    async fn cancel(&self, batch: BatchId) -> Result<BatchStatus>;

    /// Forgets a terminal batch. A batch still in progress is
    /// `InvalidRequest` (cancel it first); an unknown or released id is
    /// `InvalidHandle`.
    fn release(&self, batch: BatchId) -> Result<()>;

    /// Live resource counts (rule 1).
    fn stats(&self) -> ResourceStats;

    /// Sends `msg` to the peer of `segment` (rule 11). Returns once the
    /// message is in the peer's inbox.
    ///
    /// # Behavior
    /// - `msg` longer than [`crate::MAX_NOTIFY_LEN`]: `InvalidRequest`, nothing sent.
    /// - The peer's inbox is full: a transient `Backpressure` (nothing queued;
    ///   try again later).
    /// - Unreachable peer or a connection lost before the peer answered: a
    ///   transient error; the message may or may not have been delivered.
    /// - Per pair of transports, notifications arrive in the order of the
    ///   `notify` calls that returned: one whose call returned `Ok` before
    ///   another call began is taken first from the peer's inbox.
    /// - The notification carries this transport's
    ///   [`Transport::local_segment_name`] as [`Notification::from`].
    async fn notify(&self, segment: SegmentId, msg: Vec<u8>) -> Result<()>;

    /// Takes up to `max` received notifications, oldest first; an empty
    /// vector when there are none. Never blocks.
    ///
    /// # Behavior
    /// - After shutdown: `Shutdown`.
    fn take_notifications(&self, max: usize) -> Result<Vec<Notification>>;

    /// Waits until at least one received notification is queued (then
    /// [`Transport::take_notifications`] returns it).
    ///
    /// # Behavior
    /// - After (or during) shutdown: `Shutdown`.
    async fn wait_notification(&self) -> Result<()>;

    /// Waits for `batch` and, only if every request completed, sends `msg`
    /// to the peer of `segment` (rule 11: a notification attached to a
    /// batch). Returns the batch's final status and the outcome of the
    /// notification: `None` when the batch did not complete (nothing was
    /// sent: a failed batch never notifies success).
    ///
    /// Safe for every backend because a request is reported completed only
    /// once its bytes are in the receiver's memory (rule 5; TCP: acked after
    /// landing; RDMA: the RC completion of the write), and the message is
    /// sent only after that. A backend with a faster path that keeps the
    /// same order may override it.
    async fn notify_after(
        &self,
        batch: BatchId,
        segment: SegmentId,
        msg: Vec<u8>,
    ) -> Result<(BatchStatus, Option<Result<()>>)> {
        notify_when_completed(self, batch, segment, msg).await
    }

    /// Cancels all batches, closes all segments, unregisters all memory and
    /// stops background tasks; returns when all of it is quiet. Later calls
    /// fail with `Shutdown`; a second `shutdown` is `Ok`.
    async fn shutdown(&self) -> Result<()>;
}

/// The default [`Transport::notify_after`], callable by a backend that
/// overrides it for some cases only: waits for `batch` and sends `msg` only
/// if every request completed.
pub async fn notify_when_completed<T: Transport + ?Sized>(
    t: &T,
    batch: BatchId,
    segment: SegmentId,
    msg: Vec<u8>,
) -> Result<(BatchStatus, Option<Result<()>>)> {
    check_notification(&msg)?;
    let status = t.wait(batch).await?;
    if status.state != crate::types::BatchState::Completed {
        return Ok((status, None));
    }
    let sent = t.notify(segment, msg).await.map_err(|e: Error| e.with("batch", batch.0));
    Ok((status, Some(sent)))
}
