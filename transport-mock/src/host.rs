//! The state of one mock host, shared by its transport handle and its
//! tasks: regions, segments, endpoints, batches, tasks and the fault plan;
//! submit's validation; and the teardown that kill, shutdown and drop
//! share. The host knows the fabric only through its event channel.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::runtime::Handle;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use transport_core::lifecycle::{validate_batch, BatchLimits, BatchTable, DeadlineQueue, EndReason, TaskSet};
use transport_core::{
    BatchId, Error, ErrorKind, Inbox, RegionId, ResourceStats, Result, SegmentDescriptor, SegmentId, TransferRequest,
};

use crate::batch::{Batch, Planned};
use crate::bugs::MockBugs;
use crate::config::MockConfig;
use crate::endpoint::{EndpointUse, Endpoints, Link, Reach, SharedEndpoints};
use crate::plan::FaultState;
use crate::region::{RegionState, RegionTable};
use crate::segment::SegmentEntry;
use crate::wake::{Clock, Events};

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
    pub bugs: MockBugs,
    pub events: Events,
    pub clock: Clock,
    life: Mutex<Life>,
    stalled: AtomicBool,
    pub regions: Mutex<RegionTable>,
    pub segments: Mutex<HashMap<SegmentId, Arc<SegmentEntry>>>,
    pub endpoints: Arc<SharedEndpoints>,
    pub batches: Mutex<BatchTable<Arc<Batch>>>,
    /// The deadlines of its batches, due on [`HostShared::clock`]: one
    /// timer (`transport::deadline_timer`) expires each when it comes.
    pub deadlines: Mutex<DeadlineQueue<BatchId>>,
    /// Woken when an earlier deadline enters the queue.
    pub earlier: Arc<Notify>,
    pub faults: Mutex<FaultState>,
    /// Notifications received from peers (rule 11), bounded.
    pub inbox: Inbox,
    /// Text appended to the descriptor's address (`Transport::advertise`).
    pub advertised: Mutex<String>,
    tasks: TaskSet,
    /// Handles of the spawned tasks, to abort them; `None` once torn down.
    handles: Mutex<Option<Vec<JoinHandle<()>>>>,
    next_id: AtomicU64,
    runtime: Handle,
}

impl HostShared {
    pub fn new(
        name: String,
        generation: u64,
        config: MockConfig,
        bugs: MockBugs,
        events: Events,
        runtime: Handle,
    ) -> Self {
        let faults = Mutex::new(FaultState::new(config.fault_plan.clone()));
        let clock = Clock::start();
        let endpoints = SharedEndpoints::new(Endpoints::new(config.max_endpoints), clock);
        let inbox = Inbox::new(config.inbox_capacity);
        Self {
            name,
            generation,
            config,
            bugs,
            events,
            clock,
            life: Mutex::new(Life::Live),
            stalled: AtomicBool::new(false),
            regions: Mutex::default(),
            segments: Mutex::default(),
            endpoints,
            batches: Mutex::default(),
            deadlines: Mutex::new(DeadlineQueue::new()),
            earlier: Arc::new(Notify::new()),
            faults,
            inbox,
            advertised: Mutex::default(),
            tasks: TaskSet::new(),
            handles: Mutex::new(Some(Vec::new())),
            next_id: AtomicU64::new(1),
            runtime,
        }
    }

    /// Enters `batch` (id `id`) in the deadline queue if it has a deadline;
    /// wakes the timer if it is now the first due.
    pub fn enter_deadline(&self, id: BatchId, batch: &Batch) {
        let Some(at) = batch.deadline() else { return };
        let (key, earliest) = self.deadlines.lock().add(at, id);
        let _ = batch.deadline_key.set(key);
        if earliest {
            self.earlier.notify_one();
        }
    }

    /// The caller releases batch `id` (terminal only): it leaves the table
    /// and the deadline queue.
    pub fn release_batch(&self, id: BatchId) -> Result<()> {
        let now = self.clock.now();
        let b = self.batches.lock().release(id, |b| b.is_terminal(now))?;
        if let Some(&key) = b.deadline_key.get() {
            self.deadlines.lock().remove(key);
        }
        Ok(())
    }

    pub fn life(&self) -> Life {
        *self.life.lock()
    }

    /// `Shutdown` unless the host is live.
    pub fn check_live(&self) -> Result<()> {
        match self.life() {
            Life::Live => Ok(()),
            Life::Killed => Err(Error::new(ErrorKind::Shutdown, "this mock host was killed").with("host", &self.name)),
            Life::Shut => Err(Error::shut_down().with("host", &self.name)),
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

    /// Spawns a task owned by the host, counted in its [`TaskSet`] (rule
    /// 1); `Shutdown` once torn down.
    pub fn spawn(&self, fut: impl Future<Output = ()> + Send + 'static) -> Result<()> {
        let mut handles = self.handles.lock();
        let Some(list) = handles.as_mut() else {
            return Err(self.check_live().err().unwrap_or_else(Error::shut_down));
        };
        list.retain(|h| !h.is_finished());
        list.push(self.tasks.spawn_on(&self.runtime, fut));
        Ok(())
    }

    /// The descriptor peers get when they open this host.
    pub fn descriptor(&self) -> SegmentDescriptor {
        SegmentDescriptor {
            name: self.name.clone(),
            backend: "mock".into(),
            generation: self.generation,
            address: match self.advertised.lock().as_str() {
                "" => format!("mock://{}", self.name),
                extra => format!("mock://{} {extra}", self.name),
            },
            regions: self.regions.lock().infos(),
        }
    }

    /// Submit's validation, in one place ([`validate_batch`]): the whole
    /// batch is checked (size, shape, local handles and bounds, segment
    /// handles) before anything starts; errors name the request index.
    pub fn plan(&self, requests: &[TransferRequest]) -> Result<Vec<Planned>> {
        let limits =
            BatchLimits { max_batch_len: self.config.max_batch_len, max_request_len: self.config.max_request_len };
        let regions = self.regions.lock();
        let segments = self.segments.lock();
        let locals = validate_batch(
            requests,
            limits,
            |id| regions.get(id).map(|e| (e.clone(), e.mem.len() as u64)),
            |s| segments.contains_key(&s),
        )?;
        requests
            .iter()
            .zip(locals)
            .enumerate()
            .map(|(i, (r, local))| {
                let segment = segments
                    .get(&r.segment)
                    .cloned()
                    .ok_or_else(|| Error::unknown_segment(r.segment).with("request", i))?;
                Ok(Planned { req: *r, local, segment })
            })
            .collect()
    }

    pub fn stats(&self) -> ResourceStats {
        // One lock at a time: a copy holds a batch lock and then takes a
        // region table lock, so no table lock may be held here while the
        // batches are counted.
        let endpoints = self.endpoints.lock().held();
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
            tasks: self.tasks.count(),
            notifications: self.inbox.len(),
            // Device memory is copied straight by its provider: no staging.
            staging_bytes: 0,
        }
    }

    fn all_batches(&self) -> Vec<Arc<Batch>> {
        self.batches.lock().iter().map(|(_, b)| b.clone()).collect()
    }

    /// Rule 3: ends this host's live requests to `segment` as cancelled
    /// (quiet on return: see [`Batch`]).
    pub fn cancel_segment(&self, segment: SegmentId) {
        for b in self.all_batches() {
            b.end_where(&EndReason::Cancelled, |p| p.segment.id == segment);
        }
    }

    /// Rule 9: fails this host's live requests that use the local region `id`.
    pub fn fail_local_users(&self, id: RegionId) {
        let reason = EndReason::Failed(Error::region_unregistered(id));
        for b in self.all_batches() {
            b.end_where(&reason, |p| p.local.id == id);
        }
    }

    /// Rule 9: fails this host's live requests toward `peer` that touch
    /// `[addr, addr + len)` (the peer unregistered that memory).
    pub fn fail_remote_users(&self, peer: &str, addr: u64, len: u64) {
        let err = Error::new(ErrorKind::Unregistered, "the peer unregistered the target memory").with("segment", peer);
        let reason = EndReason::Failed(err);
        for b in self.all_batches() {
            b.end_where(&reason, |p| {
                let end = p.req.remote_addr.saturating_add(p.req.len);
                p.segment.name == peer && p.req.remote_addr < addr.saturating_add(len) && addr < end
            });
        }
    }

    /// Rule 4: an endpoint to `peer` for one request (see
    /// [`Endpoints::acquire`]). `Ok(None)`: every slot is busy; wait.
    pub fn acquire_endpoint(&self, peer: &str, generation: u64) -> Result<Option<EndpointUse>> {
        let now = self.clock.now();
        let reach =
            self.endpoints.lock().acquire(peer, generation, now, |held| self.faults.lock().on_handshake(peer, held))?;
        Ok(match reach {
            Reach::Use(link) => Some(EndpointUse::new(link, &self.endpoints)),
            Reach::Wait => None,
        })
    }

    /// Rule 2: an endpoint failed; destroy it, unless a bug keeps it.
    pub fn endpoint_failed(&self, link: &Link) {
        link.break_it();
        if self.bugs.cache_broken_endpoint {
            // The bug: the pool is never told, so the broken link stays
            // cached and is handed out again.
            return;
        }
        self.endpoints.lock().failed(link.id, self.bugs.leak_endpoint_on_failure);
        self.events.bump();
    }

    /// The live link to `peer`, if any.
    pub fn link_to(&self, peer: &str) -> Option<Arc<Link>> {
        self.endpoints.lock().link_to(peer)
    }

    /// Rule 4: reclaims idle endpoints (the reaper's tick).
    pub fn reap(&self) {
        let n = self.endpoints.lock().reap(self.clock.now(), self.config.idle_timeout);
        if n > 0 {
            tracing::debug!(host = %self.name, reclaimed = n, "idle endpoints reclaimed");
            self.events.bump();
        }
    }

    /// Stops everything: later calls fail, tasks are aborted, live
    /// requests end (cancelled on shutdown, failed on a kill), regions are
    /// retired (waiting for copies in progress), counts drop to zero.
    /// Returns the aborted tasks for the caller to await (`None` if the
    /// host was already down).
    pub fn teardown(&self, how: Life) -> Option<Vec<JoinHandle<()>>> {
        {
            let mut life = self.life.lock();
            if *life != Life::Live {
                return None;
            }
            *life = how;
        }
        let handles = self.handles.lock().take();
        for h in handles.iter().flatten() {
            h.abort();
        }
        let end = match how {
            Life::Killed => EndReason::Failed(
                Error::new(ErrorKind::ConnectionReset, "the mock host was killed").with("host", &self.name),
            ),
            _ => EndReason::Cancelled,
        };
        let batches = self.batches.lock().drain();
        *self.deadlines.lock() = DeadlineQueue::new();
        for (_, b) in &batches {
            b.end_where(&end, |_| true);
        }
        let regions = self.regions.lock().drain();
        for r in &regions {
            r.retire(RegionState::HostGone);
        }
        self.segments.lock().clear();
        self.endpoints.lock().clear();
        self.inbox.close();
        self.stalled.store(false, Ordering::SeqCst);
        self.events.bump();
        tracing::debug!(host = %self.name, ?how, "mock host torn down");
        handles
    }

    /// Waits (bounded) until every task of the host ended.
    pub async fn tasks_idle(&self) -> bool {
        self.tasks.wait_idle(std::time::Duration::from_secs(5)).await
    }
}
