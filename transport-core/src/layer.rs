//! [`Layer`]: a transport over another one that changes only what it
//! overrides (like an opendal layer). A layer implements [`Layer::inner`]
//! and the methods it changes; every other method forwards to the inner
//! transport unchanged, and the layer is a [`Transport`] through the
//! blanket impl below. Taps and deliberately broken layers (the
//! conformance suite's `BrokenLayer`, its session taps) are written this
//! way, so a method added to the trait reaches them without a line of
//! their own. The mock's `FaultyTransport` is not a layer: it intercepts
//! nearly every method, and implements the trait itself.
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
    fn polling(&self, batch: BatchId, on: bool) {
        self.inner().polling(batch, on)
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
    fn polling(&self, batch: BatchId, on: bool) {
        Layer::polling(self, batch, on)
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

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::error::{Error, ErrorKind};

    /// A base transport that refuses everything but `notify_after`, whose
    /// own version answers at once and counts its calls.
    #[derive(Default)]
    struct Base {
        notified: AtomicUsize,
    }

    fn no() -> Error {
        Error::new(ErrorKind::Unsupported, "test base")
    }

    #[async_trait]
    impl Transport for Base {
        fn backend(&self) -> &str {
            "base"
        }
        fn capabilities(&self) -> Capabilities {
            Capabilities::new(0)
        }
        fn local_segment_name(&self) -> String {
            "base".into()
        }
        fn local_descriptor(&self) -> Result<SegmentDescriptor> {
            Err(no())
        }
        fn register(&self, _: MemoryRegion, _: Access) -> Result<RegionId> {
            Err(no())
        }
        async fn unregister(&self, _: RegionId) -> Result<()> {
            Err(no())
        }
        async fn open_segment(&self, _: &str) -> Result<SegmentId> {
            Err(no())
        }
        async fn close_segment(&self, _: SegmentId) -> Result<()> {
            Err(no())
        }
        fn segment_descriptor(&self, _: SegmentId) -> Result<SegmentDescriptor> {
            Err(no())
        }
        async fn submit(&self, _: Vec<TransferRequest>, _: SubmitOptions) -> Result<BatchId> {
            Err(no())
        }
        fn poll(&self, _: BatchId) -> Result<BatchStatus> {
            Err(no())
        }
        async fn wait(&self, _: BatchId) -> Result<BatchStatus> {
            Err(no())
        }
        async fn cancel(&self, _: BatchId) -> Result<BatchStatus> {
            Err(no())
        }
        fn release(&self, _: BatchId) -> Result<()> {
            Err(no())
        }
        fn stats(&self) -> ResourceStats {
            ResourceStats::default()
        }
        async fn notify(&self, _: SegmentId, _: Vec<u8>) -> Result<()> {
            Err(no())
        }
        fn take_notifications(&self, _: usize) -> Result<Vec<Notification>> {
            Err(no())
        }
        async fn wait_notification(&self) -> Result<()> {
            Err(no())
        }
        async fn notify_after(
            &self,
            _: BatchId,
            _: SegmentId,
            _: Vec<u8>,
        ) -> Result<(BatchStatus, Option<Result<()>>)> {
            self.notified.fetch_add(1, Ordering::Relaxed);
            Ok((BatchStatus::from_requests(Vec::new()), Some(Ok(()))))
        }
        async fn shutdown(&self) -> Result<()> {
            Ok(())
        }
    }

    struct Plain(Arc<dyn Transport>);

    impl Layer for Plain {
        fn inner(&self) -> &Arc<dyn Transport> {
            &self.0
        }
    }

    #[tokio::test]
    async fn a_layer_forwards_what_it_does_not_override_notify_after_included() {
        let base = Arc::new(Base::default());
        let layered: Arc<dyn Transport> = Arc::new(Plain(Arc::new(Plain(base.clone()))));
        assert_eq!(layered.backend(), "base");
        // The inner transport's own `notify_after`, not the trait's default
        // (which would wait for the batch through `wait`, refused here).
        let (status, sent) = layered.notify_after(BatchId(1), SegmentId(1), b"m".to_vec()).await.unwrap();
        assert!(status.requests.is_empty() && matches!(sent, Some(Ok(()))));
        assert_eq!(base.notified.load(Ordering::Relaxed), 1);
        assert_eq!(
            layered.submit(Vec::new(), SubmitOptions::default()).await.unwrap_err().kind(),
            ErrorKind::Unsupported
        );
        layered.shutdown().await.unwrap();
    }
}
