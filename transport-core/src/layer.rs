//! [`Layer`]: a transport over another one that changes only what it
//! overrides (like an opendal layer). A layer implements [`Layer::inner`]
//! and the methods it changes; every other method forwards to the inner
//! transport unchanged, and the layer is a [`Transport`] through the
//! blanket impl below. Fault injectors, taps and deliberately broken
//! layers are written this way, so a method added to the trait reaches
//! them without a line of their own.
//!
//! ```
//! use std::sync::atomic::{AtomicU64, Ordering};
//! use std::sync::Arc;
//!
//! use transport_core::{BatchId, Layer, Result, SubmitOptions, TransferRequest, Transport};
//!
//! /// Counts submitted requests; everything else is the inner transport's.
//! struct Counting {
//!     inner: Arc<dyn Transport>,
//!     requests: AtomicU64,
//! }
//!
//! #[async_trait::async_trait]
//! impl Layer for Counting {
//!     fn inner(&self) -> &Arc<dyn Transport> {
//!         &self.inner
//!     }
//!     async fn submit(&self, requests: Vec<TransferRequest>, opts: SubmitOptions) -> Result<BatchId> {
//!         self.requests.fetch_add(requests.len() as u64, Ordering::Relaxed);
//!         self.inner.submit(requests, opts).await
//!     }
//! }
//!
//! fn wrap(inner: Arc<dyn Transport>) -> Arc<dyn Transport> {
//!     Arc::new(Counting { inner, requests: AtomicU64::new(0) })
//! }
//! ```

use std::sync::Arc;

use async_trait::async_trait;
use transport_mem::MemoryRegion;

use crate::error::Result;
use crate::notify::Notification;
use crate::stats::{Capabilities, ResourceStats};
use crate::transport::Transport;
use crate::types::{
    Access, BatchId, BatchStatus, RegionId, SegmentDescriptor, SegmentId, SubmitOptions, TransferRequest,
};

/// A transport that forwards to [`Layer::inner`] every method it does not
/// override. Each method's contract is [`Transport`]'s; a layer that
/// changes one keeps the rest of that contract (a layer that breaks a rule
/// on purpose is the conformance suite's `BrokenLayer`).
///
/// `notify_after` forwards too, to the inner transport's own: a layer that
/// changes `wait` or `notify` and wants `notify_after` to go through its
/// versions overrides it with [`crate::notify_when_completed`]`(self, ..)`.
#[async_trait]
pub trait Layer: Send + Sync + 'static {
    /// The transport this layer wraps.
    fn inner(&self) -> &Arc<dyn Transport>;

    fn backend(&self) -> &str {
        self.inner().backend()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner().capabilities()
    }
    fn local_segment_name(&self) -> String {
        self.inner().local_segment_name()
    }
    fn local_descriptor(&self) -> Result<SegmentDescriptor> {
        self.inner().local_descriptor()
    }
    fn advertise(&self, extra: &str) -> Result<()> {
        self.inner().advertise(extra)
    }
    fn register(&self, mem: MemoryRegion, access: Access) -> Result<RegionId> {
        self.inner().register(mem, access)
    }
    async fn unregister(&self, region: RegionId) -> Result<()> {
        self.inner().unregister(region).await
    }
    async fn open_segment(&self, name: &str) -> Result<SegmentId> {
        self.inner().open_segment(name).await
    }
    async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        self.inner().close_segment(segment).await
    }
    fn segment_descriptor(&self, segment: SegmentId) -> Result<SegmentDescriptor> {
        self.inner().segment_descriptor(segment)
    }
    async fn submit(&self, requests: Vec<TransferRequest>, opts: SubmitOptions) -> Result<BatchId> {
        self.inner().submit(requests, opts).await
    }
    fn poll(&self, batch: BatchId) -> Result<BatchStatus> {
        self.inner().poll(batch)
    }
    async fn wait(&self, batch: BatchId) -> Result<BatchStatus> {
        self.inner().wait(batch).await
    }
    async fn cancel(&self, batch: BatchId) -> Result<BatchStatus> {
        self.inner().cancel(batch).await
    }
    fn release(&self, batch: BatchId) -> Result<()> {
        self.inner().release(batch)
    }
    fn stats(&self) -> ResourceStats {
        self.inner().stats()
    }
    async fn notify(&self, segment: SegmentId, msg: Vec<u8>) -> Result<()> {
        self.inner().notify(segment, msg).await
    }
    fn take_notifications(&self, max: usize) -> Result<Vec<Notification>> {
        self.inner().take_notifications(max)
    }
    async fn wait_notification(&self) -> Result<()> {
        self.inner().wait_notification().await
    }
    async fn notify_after(
        &self,
        batch: BatchId,
        segment: SegmentId,
        msg: Vec<u8>,
    ) -> Result<(BatchStatus, Option<Result<()>>)> {
        self.inner().notify_after(batch, segment, msg).await
    }
    async fn shutdown(&self) -> Result<()> {
        self.inner().shutdown().await
    }
}

#[async_trait]
impl<L: Layer> Transport for L {
    fn backend(&self) -> &str {
        Layer::backend(self)
    }
    fn capabilities(&self) -> Capabilities {
        Layer::capabilities(self)
    }
    fn local_segment_name(&self) -> String {
        Layer::local_segment_name(self)
    }
    fn local_descriptor(&self) -> Result<SegmentDescriptor> {
        Layer::local_descriptor(self)
    }
    fn advertise(&self, extra: &str) -> Result<()> {
        Layer::advertise(self, extra)
    }
    fn register(&self, mem: MemoryRegion, access: Access) -> Result<RegionId> {
        Layer::register(self, mem, access)
    }
    async fn unregister(&self, region: RegionId) -> Result<()> {
        Layer::unregister(self, region).await
    }
    async fn open_segment(&self, name: &str) -> Result<SegmentId> {
        Layer::open_segment(self, name).await
    }
    async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        Layer::close_segment(self, segment).await
    }
    fn segment_descriptor(&self, segment: SegmentId) -> Result<SegmentDescriptor> {
        Layer::segment_descriptor(self, segment)
    }
    async fn submit(&self, requests: Vec<TransferRequest>, opts: SubmitOptions) -> Result<BatchId> {
        Layer::submit(self, requests, opts).await
    }
    fn poll(&self, batch: BatchId) -> Result<BatchStatus> {
        Layer::poll(self, batch)
    }
    async fn wait(&self, batch: BatchId) -> Result<BatchStatus> {
        Layer::wait(self, batch).await
    }
    async fn cancel(&self, batch: BatchId) -> Result<BatchStatus> {
        Layer::cancel(self, batch).await
    }
    fn release(&self, batch: BatchId) -> Result<()> {
        Layer::release(self, batch)
    }
    fn stats(&self) -> ResourceStats {
        Layer::stats(self)
    }
    async fn notify(&self, segment: SegmentId, msg: Vec<u8>) -> Result<()> {
        Layer::notify(self, segment, msg).await
    }
    fn take_notifications(&self, max: usize) -> Result<Vec<Notification>> {
        Layer::take_notifications(self, max)
    }
    async fn wait_notification(&self) -> Result<()> {
        Layer::wait_notification(self).await
    }
    async fn notify_after(
        &self,
        batch: BatchId,
        segment: SegmentId,
        msg: Vec<u8>,
    ) -> Result<(BatchStatus, Option<Result<()>>)> {
        Layer::notify_after(self, batch, segment, msg).await
    }
    async fn shutdown(&self) -> Result<()> {
        Layer::shutdown(self).await
    }
}
