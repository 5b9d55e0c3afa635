//! The state of one mock host, shared by its transport handle and its
//! tasks: regions, segments, endpoints, batches, tasks and the fault plan;
//! and the teardown that kill, shutdown and drop share.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use tokio::runtime::Handle;
use tokio::task::JoinSet;
use transport_core::{BatchId, Error, ErrorKind, RequestStatus, ResourceStats, Result, SegmentDescriptor, SegmentId};

use crate::batch::Batch;
use crate::config::MockConfig;
use crate::endpoint::{Endpoint, EndpointCache, EndpointUse};
use crate::fabric::FabricInner;
use crate::plan::FaultState;
use crate::region::{RegionState, RegionTable};
use crate::segment::SegmentEntry;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Life {
    Live,
    /// Crashed by the fabric.
    Killed,
    /// Shut down or dropped.
    Shut,
}

pub(crate) struct HostShared {
    pub name: String,
    pub generation: u64,
    pub config: MockConfig,
    pub fabric: Arc<FabricInner>,
    life: Mutex<Life>,
    stalled: AtomicBool,
    pub regions: Mutex<RegionTable>,
    pub segments: Mutex<HashMap<SegmentId, Arc<SegmentEntry>>>,
    pub endpoints: Mutex<EndpointCache>,
    pub batches: Mutex<HashMap<BatchId, Arc<Batch>>>,
    pub faults: Mutex<FaultState>,
    tasks: Mutex<Option<JoinSet<()>>>,
    task_count: Arc<AtomicUsize>,
    next_id: AtomicU64,
    runtime: Handle,
}

/// Decrements the task count when a task's future is dropped (finished or
/// aborted).
struct TaskGuard(Arc<AtomicUsize>);

impl Drop for TaskGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl HostShared {
    pub fn new(name: String, generation: u64, config: MockConfig, fabric: Arc<FabricInner>, runtime: Handle) -> Self {
        let faults = Mutex::new(FaultState::new(config.fault_plan.clone()));
        Self {
            name,
            generation,
            config,
            fabric,
            life: Mutex::new(Life::Live),
            stalled: AtomicBool::new(false),
            regions: Mutex::default(),
            segments: Mutex::default(),
            endpoints: Mutex::default(),
            batches: Mutex::default(),
            faults,
            tasks: Mutex::new(Some(JoinSet::new())),
            task_count: Arc::new(AtomicUsize::new(0)),
            next_id: AtomicU64::new(1),
            runtime,
        }
    }

    pub fn life(&self) -> Life {
        *self.life.lock()
    }

    /// `Shutdown` unless the host is live.
    pub fn check_live(&self) -> Result<()> {
        match self.life() {
            Life::Live => Ok(()),
            Life::Killed => Err(Error::new(ErrorKind::Shutdown, "this mock host was killed").with("host", &self.name)),
            Life::Shut => Err(Error::new(ErrorKind::Shutdown, "the transport was shut down").with("host", &self.name)),
        }
    }

    pub fn stalled(&self) -> bool {
        self.stalled.load(Ordering::SeqCst)
    }

    pub fn set_stalled(&self, on: bool) {
        self.stalled.store(on, Ordering::SeqCst);
    }

    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Spawns a counted task owned by the host; `Shutdown` once torn down.
    pub fn spawn(&self, fut: impl Future<Output = ()> + Send + 'static) -> Result<()> {
        let mut tasks = self.tasks.lock();
        let set = tasks.as_mut().ok_or_else(|| self.check_live().err().unwrap_or_else(shut))?;
        while set.try_join_next().is_some() {}
        self.task_count.fetch_add(1, Ordering::SeqCst);
        let guard = TaskGuard(self.task_count.clone());
        set.spawn_on(
            async move {
                let _guard = guard;
                fut.await
            },
            &self.runtime,
        );
        Ok(())
    }

    /// The descriptor peers get when they open this host.
    pub fn descriptor(&self) -> SegmentDescriptor {
        SegmentDescriptor {
            name: self.name.clone(),
            backend: "mock".into(),
            generation: self.generation,
            address: format!("mock://{}", self.name),
            regions: self.regions.lock().infos(),
        }
    }

    pub fn stats(&self) -> ResourceStats {
        // One lock at a time: a copy holds a batch lock and then takes a
        // region table lock, so no table lock may be held here while the
        // batches are counted.
        let endpoints = self.endpoints.lock().count();
        let segments = self.segments.lock().len();
        let regions = self.regions.lock().len();
        let batches = self.all_batches();
        let inflight = batches.iter().map(|b| b.pending()).sum();
        ResourceStats {
            endpoints,
            endpoint_lanes: endpoints * self.config.lanes_per_endpoint,
            segments,
            regions,
            batches: batches.len(),
            inflight,
            tasks: self.task_count.load(Ordering::SeqCst),
        }
    }

    fn all_batches(&self) -> Vec<Arc<Batch>> {
        self.batches.lock().values().cloned().collect()
    }

    /// Ends this host's pending requests to `segment` as cancelled.
    pub fn cancel_segment(&self, segment: SegmentId) {
        for b in self.all_batches() {
            b.end_pending(|p| p.segment.id == segment, &RequestStatus::Cancelled);
        }
    }

    /// Fails this host's pending requests that use the local region `id`.
    pub fn fail_local_users(&self, id: transport_core::RegionId) {
        let err = Error::new(ErrorKind::Unregistered, "the local region was unregistered").with("region", id);
        for b in self.all_batches() {
            b.end_pending(|p| p.local.id == id, &RequestStatus::Failed(err.clone()));
        }
    }

    /// Fails this host's pending requests toward `peer` that touch
    /// `[addr, addr + len)` (the peer unregistered that memory).
    pub fn fail_remote_users(&self, peer: &str, addr: u64, len: u64) {
        let err = Error::new(ErrorKind::Unregistered, "the peer unregistered the target memory").with("segment", peer);
        for b in self.all_batches() {
            b.end_pending(
                |p| {
                    let end = p.req.remote_addr.saturating_add(p.req.len);
                    p.segment.name == peer && p.req.remote_addr < addr.saturating_add(len) && addr < end
                },
                &RequestStatus::Failed(err.clone()),
            );
        }
    }

    /// Takes an endpoint to `peer` for one request: the cached one, or a new
    /// one (evicting the least recently used idle endpoint at the bound).
    /// `Ok(None)`: every endpoint is busy at the bound; wait for an event.
    pub fn acquire_endpoint(&self, peer: &HostShared) -> Result<Option<EndpointUse>> {
        let mut cache = self.endpoints.lock();
        if let Some(ep) = cache.get(&peer.name) {
            return Ok(Some(cache.use_of(&ep)));
        }
        if cache.count() >= self.config.max_endpoints && !cache.evict_lru_idle() {
            if cache.has_live() {
                return Ok(None);
            }
            // Only leaked endpoints hold the slots: nothing will free them.
            return Err(Error::new(ErrorKind::ResourceExhausted, "Failed to create QP: Cannot allocate memory")
                .with("peer", &peer.name)
                .with("live_endpoints", cache.count()));
        }
        if let Some(e) = self.faults.lock().on_handshake(&peer.name, cache.count()) {
            return Err(e);
        }
        let ep = Arc::new(Endpoint::new(self.next_id(), peer.name.clone(), peer.generation));
        tracing::debug!(host = %self.name, peer = %peer.name, id = ep.id, "endpoint created");
        Ok(Some(cache.insert(ep)))
    }

    /// An endpoint failed: destroy it (rule 2), unless a bug keeps it.
    pub fn endpoint_failed(&self, ep: &Arc<Endpoint>) {
        ep.break_it();
        if self.config.bugs.cache_broken_endpoint {
            return;
        }
        self.endpoints.lock().remove(ep, self.config.bugs.leak_endpoint_on_failure);
    }

    /// Whether an endpoint to `peer` is cached.
    pub fn has_endpoint(&self, peer: &str) -> Option<Arc<Endpoint>> {
        self.endpoints.lock().get(peer)
    }

    /// Reclaims idle endpoints (the reaper's tick).
    pub fn reap(&self) {
        let n = self.endpoints.lock().reap(Instant::now(), self.config.idle_timeout);
        if n > 0 {
            tracing::debug!(host = %self.name, reclaimed = n, "idle endpoints reclaimed");
            self.fabric.bump();
        }
    }

    /// Stops everything: later calls fail, tasks are aborted, pending
    /// requests end (cancelled on shutdown, failed on a kill), regions are
    /// retired (waiting for copies in progress), counts drop to zero.
    /// Returns the aborted tasks for the caller to await (`None` if the
    /// host was already down).
    pub fn teardown(&self, how: Life) -> Option<JoinSet<()>> {
        {
            let mut life = self.life.lock();
            if *life != Life::Live {
                return None;
            }
            *life = how;
        }
        let mut tasks = self.tasks.lock().take();
        if let Some(t) = tasks.as_mut() {
            t.abort_all();
        }
        let end = match how {
            Life::Killed => RequestStatus::Failed(
                Error::new(ErrorKind::ConnectionReset, "the mock host was killed").with("host", &self.name),
            ),
            _ => RequestStatus::Cancelled,
        };
        let batches: Vec<Arc<Batch>> = self.batches.lock().drain().map(|(_, b)| b).collect();
        for b in &batches {
            b.end_pending(|_| true, &end);
        }
        let regions = self.regions.lock().drain();
        for r in &regions {
            r.retire(RegionState::HostGone);
        }
        self.segments.lock().clear();
        self.endpoints.lock().clear();
        self.stalled.store(false, Ordering::SeqCst);
        self.fabric.bump();
        tracing::debug!(host = %self.name, ?how, "mock host torn down");
        tasks
    }
}

fn shut() -> Error {
    Error::new(ErrorKind::Shutdown, "the transport was shut down")
}
