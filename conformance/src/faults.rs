//! The suite's own fault layer: a [`Transport`] around any backend that
//! fails chosen requests without sending them and counts, per request, how
//! often it was submitted. The policy cases put it directly above the
//! backend (below any [`crate::Harness::wrap`] layer), so a wrapper that
//! retries on its own is seen in the counts.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use parking_lot::Mutex;
use transport_core::{
    Access, BatchId, BatchStatus, Capabilities, Error, ErrorKind, MemoryRegion, RegionId, RequestStatus, ResourceStats,
    Result, SegmentDescriptor, SegmentId, SubmitOptions, TransferRequest, Transport,
};

/// Which requests a rule fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// Every request.
    All,
    /// Requests to this remote address.
    Addr(u64),
}

#[derive(Debug)]
struct Rule {
    target: Target,
    kind: ErrorKind,
    remaining: u32,
}

#[derive(Debug)]
enum Slot {
    Injected(Error),
    Inner(usize),
}

#[derive(Debug)]
struct Entry {
    inner: Option<BatchId>,
    slots: Vec<Slot>,
}

/// A fault-injecting, counting layer (see the module doc).
pub struct FaultLayer {
    inner: Arc<dyn Transport>,
    rules: Mutex<Vec<Rule>>,
    seen: Mutex<HashMap<TransferRequest, u32>>,
    batches: Mutex<HashMap<u64, Entry>>,
    next: AtomicU64,
}

impl fmt::Debug for FaultLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultLayer").field("inner", &self.inner.backend()).field("rules", &*self.rules.lock()).finish()
    }
}

impl FaultLayer {
    /// A layer with no faults around `inner`.
    pub fn new(inner: Arc<dyn Transport>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            rules: Mutex::default(),
            seen: Mutex::default(),
            batches: Mutex::default(),
            next: AtomicU64::new(1),
        })
    }

    /// Fails the next `times` requests matching `target` with `kind`
    /// (`u32::MAX`: always), without passing them on.
    pub fn fail(&self, target: Target, kind: ErrorKind, times: u32) {
        self.rules.lock().push(Rule { target, kind, remaining: times });
    }

    /// Removes every rule.
    pub fn clear(&self) {
        self.rules.lock().clear();
    }

    /// How many times `req` was submitted to this layer.
    pub fn seen(&self, req: &TransferRequest) -> u32 {
        self.seen.lock().get(req).copied().unwrap_or(0)
    }

    /// Requests submitted to this layer in total.
    pub fn seen_total(&self) -> u32 {
        self.seen.lock().values().sum()
    }

    fn injected(&self, req: &TransferRequest) -> Option<Error> {
        let mut rules = self.rules.lock();
        let rule = rules
            .iter_mut()
            .find(|r| r.remaining > 0 && (r.target == Target::All || r.target == Target::Addr(req.remote_addr)))?;
        if rule.remaining != u32::MAX {
            rule.remaining -= 1;
        }
        Some(Error::new(rule.kind, "fault injected by the conformance suite").with("remote_addr", req.remote_addr))
    }

    fn merge(slots: &[Slot], inner: Option<&BatchStatus>) -> Result<BatchStatus> {
        let mut out = Vec::with_capacity(slots.len());
        for s in slots {
            out.push(match s {
                Slot::Injected(e) => RequestStatus::Failed(e.clone()),
                Slot::Inner(i) => inner
                    .and_then(|st| st.requests.get(*i).cloned())
                    .ok_or_else(|| Error::new(ErrorKind::Internal, "inner status has too few requests"))?,
            });
        }
        Ok(BatchStatus::from_requests(out))
    }

    fn lookup(&self, b: BatchId) -> Result<Option<BatchId>> {
        self.batches
            .lock()
            .get(&b.0)
            .map(|e| e.inner)
            .ok_or_else(|| Error::new(ErrorKind::InvalidHandle, "unknown batch").with("batch", b))
    }

    fn finish(&self, b: BatchId, inner: Option<BatchStatus>) -> Result<BatchStatus> {
        let batches = self.batches.lock();
        let e =
            batches.get(&b.0).ok_or_else(|| Error::new(ErrorKind::InvalidHandle, "unknown batch").with("batch", b))?;
        Self::merge(&e.slots, inner.as_ref())
    }
}

#[async_trait]
impl Transport for FaultLayer {
    fn backend(&self) -> &str {
        self.inner.backend()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn local_segment_name(&self) -> String {
        self.inner.local_segment_name()
    }
    fn register(&self, mem: MemoryRegion, access: Access) -> Result<RegionId> {
        self.inner.register(mem, access)
    }
    async fn unregister(&self, region: RegionId) -> Result<()> {
        self.inner.unregister(region).await
    }
    async fn open_segment(&self, name: &str) -> Result<SegmentId> {
        self.inner.open_segment(name).await
    }
    async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        self.inner.close_segment(segment).await
    }
    fn segment_descriptor(&self, segment: SegmentId) -> Result<SegmentDescriptor> {
        self.inner.segment_descriptor(segment)
    }
    async fn submit(&self, requests: Vec<TransferRequest>, opts: SubmitOptions) -> Result<BatchId> {
        {
            let mut seen = self.seen.lock();
            for r in &requests {
                *seen.entry(*r).or_default() += 1;
            }
        }
        if requests.is_empty() {
            return self.inner.submit(requests, opts).await;
        }
        let mut slots = Vec::with_capacity(requests.len());
        let mut pass = Vec::new();
        for r in &requests {
            match self.injected(r) {
                Some(e) => slots.push(Slot::Injected(e)),
                None => {
                    slots.push(Slot::Inner(pass.len()));
                    pass.push(*r);
                }
            }
        }
        let inner = if pass.is_empty() { None } else { Some(self.inner.submit(pass, opts).await?) };
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.batches.lock().insert(id, Entry { inner, slots });
        Ok(BatchId(id))
    }
    fn poll(&self, batch: BatchId) -> Result<BatchStatus> {
        let inner = match self.lookup(batch)? {
            Some(ib) => Some(self.inner.poll(ib)?),
            None => None,
        };
        self.finish(batch, inner)
    }
    async fn wait(&self, batch: BatchId) -> Result<BatchStatus> {
        let inner = match self.lookup(batch)? {
            Some(ib) => Some(self.inner.wait(ib).await?),
            None => None,
        };
        self.finish(batch, inner)
    }
    async fn cancel(&self, batch: BatchId) -> Result<BatchStatus> {
        let inner = match self.lookup(batch)? {
            Some(ib) => Some(self.inner.cancel(ib).await?),
            None => None,
        };
        self.finish(batch, inner)
    }
    fn release(&self, batch: BatchId) -> Result<()> {
        if let Some(ib) = self.lookup(batch)? {
            self.inner.release(ib)?;
        }
        self.batches.lock().remove(&batch.0);
        Ok(())
    }
    fn stats(&self) -> ResourceStats {
        let mut s = self.inner.stats();
        s.batches += self.batches.lock().values().filter(|e| e.inner.is_none()).count();
        s
    }
    async fn shutdown(&self) -> Result<()> {
        let r = self.inner.shutdown().await;
        self.batches.lock().clear();
        r
    }
}
