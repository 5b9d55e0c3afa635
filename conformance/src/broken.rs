//! Deliberately broken transports, to prove the suite fails them (a suite
//! no broken backend fails is decoration). The mock's own switches
//! (`transport_mock::MockBugs`, behind transport-mock's test-only `bugs`
//! feature, through `MockTransport::with_bugs`) break the backend itself;
//! this module adds
//! a broken *layer* that any backend can be wrapped in through
//! [`crate::Harness::wrap`].

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use parking_lot::Mutex;
use transport_core::{
    notify_when_completed, BatchId, BatchStatus, Layer, RequestStatus, Result, SegmentId, SubmitOptions,
    TransferRequest, Transport,
};

/// What a [`BrokenLayer`] breaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerBug {
    /// Retries *permanent* failures on its own (breaking rule 8: permanent
    /// errors are never retried, and backends do not retry at all). It
    /// resubmits a refused batch, and inside `wait` resubmits every request
    /// that failed permanently, up to twice more.
    RetriesPermanent,
    /// `notify` reports a session's failure notices (cancel, expiry,
    /// failure: [`kvmove_policy::session::is_failure_notice`]) delivered
    /// but drops them, so the peer never learns (breaking rule 13).
    DropsFailureNotices,
    /// Keeps a record of every segment it opened (the peer's name, in a
    /// map of "connections") and forgets to remove it at `close_segment`;
    /// `stats()` is the inner backend's, so every count still returns
    /// (the shape of the endpoint leak in the field reports). Breaks
    /// rule 1.
    HidesLeak,
}

/// A layer over any backend that breaks one rule ([`LayerBug`]) and
/// forwards everything else unchanged.
pub struct BrokenLayer {
    inner: Arc<dyn Transport>,
    bug: LayerBug,
    extra: u32,
    batches: Mutex<HashMap<BatchId, (Vec<TransferRequest>, SubmitOptions)>>,
    /// [`LayerBug::HidesLeak`]'s "connections", never pruned.
    connections: Mutex<HashMap<SegmentId, String>>,
}

impl fmt::Debug for BrokenLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BrokenLayer").field("inner", &self.inner.backend()).field("bug", &self.bug).finish()
    }
}

impl BrokenLayer {
    /// Wraps `inner`, adding `bug`.
    pub fn wrap(inner: Arc<dyn Transport>, bug: LayerBug) -> Arc<dyn Transport> {
        Arc::new(Self { inner, bug, extra: 2, batches: Mutex::default(), connections: Mutex::default() })
    }

    /// [`LayerBug::RetriesPermanent`] over `inner`.
    pub fn retries_permanent(inner: Arc<dyn Transport>) -> Arc<dyn Transport> {
        Self::wrap(inner, LayerBug::RetriesPermanent)
    }

    /// [`LayerBug::HidesLeak`] over `inner`.
    pub fn hides_leak(inner: Arc<dyn Transport>) -> Arc<dyn Transport> {
        Self::wrap(inner, LayerBug::HidesLeak)
    }

    /// [`LayerBug::DropsFailureNotices`] over `inner`.
    pub fn drops_failure_notices(inner: Arc<dyn Transport>) -> Arc<dyn Transport> {
        Self::wrap(inner, LayerBug::DropsFailureNotices)
    }

    fn permanent(s: &RequestStatus) -> bool {
        matches!(s, RequestStatus::Failed(e) if !e.is_transient())
    }
}

#[async_trait]
impl Layer for BrokenLayer {
    fn inner(&self) -> &Arc<dyn Transport> {
        &self.inner
    }

    async fn open_segment(&self, name: &str) -> Result<SegmentId> {
        let seg = self.inner.open_segment(name).await?;
        if self.bug == LayerBug::HidesLeak {
            // The bug: recorded here, never removed (close_segment is the
            // inner one's).
            self.connections.lock().insert(seg, format!("connection to {name}"));
        }
        Ok(seg)
    }

    async fn submit(&self, requests: Vec<TransferRequest>, opts: SubmitOptions) -> Result<BatchId> {
        if self.bug != LayerBug::RetriesPermanent {
            return self.inner.submit(requests, opts).await;
        }
        let mut tries = 0;
        loop {
            match self.inner.submit(requests.clone(), opts).await {
                Ok(b) => {
                    self.batches.lock().insert(b, (requests, opts));
                    return Ok(b);
                }
                // The bug: a permanent refusal is tried again.
                Err(e) if !e.is_transient() && tries < self.extra => tries += 1,
                Err(e) => return Err(e),
            }
        }
    }

    async fn wait(&self, batch: BatchId) -> Result<BatchStatus> {
        let mut status = self.inner.wait(batch).await?;
        let Some((reqs, opts)) = self.batches.lock().get(&batch).cloned() else { return Ok(status) };
        for _ in 0..self.extra {
            let bad: Vec<usize> =
                (0..status.requests.len()).filter(|&i| Self::permanent(&status.requests[i])).collect();
            if bad.is_empty() {
                break;
            }
            let again: Vec<TransferRequest> = bad.iter().filter_map(|&i| reqs.get(i).copied()).collect();
            if let Ok(b) = self.inner.submit(again, opts).await {
                if let Ok(s) = self.inner.wait(b).await {
                    for (k, &i) in bad.iter().enumerate() {
                        if let Some(r) = s.requests.get(k) {
                            status.requests[i] = r.clone();
                        }
                    }
                }
                let _ = self.inner.release(b);
            }
        }
        Ok(BatchStatus::from_requests(status.requests))
    }

    async fn notify(&self, segment: SegmentId, msg: Vec<u8>) -> Result<()> {
        if self.bug == LayerBug::DropsFailureNotices && kvmove_policy::session::is_failure_notice(&msg) {
            // The bug: reported delivered, never sent.
            return Ok(());
        }
        self.inner.notify(segment, msg).await
    }

    /// Through this layer's `wait` and `notify` (so a dropped notice stays
    /// dropped when it rides on a batch).
    async fn notify_after(
        &self,
        batch: BatchId,
        segment: SegmentId,
        msg: Vec<u8>,
    ) -> Result<(BatchStatus, Option<Result<()>>)> {
        notify_when_completed(self, batch, segment, msg).await
    }

    fn release(&self, batch: BatchId) -> Result<()> {
        self.inner.release(batch)?;
        self.batches.lock().remove(&batch);
        Ok(())
    }
}
