//! `MockTransport`: one host on a [`MockFabric`], implementing the
//! [`Transport`] contract with real memory copies.

use std::fmt;
use std::sync::{Arc, Weak};
use std::time::Duration;

use async_trait::async_trait;
use tokio::runtime::Handle;
use transport_core::{
    check_notification, Access, BatchId, BatchStatus, Capabilities, Error, ErrorKind, MemoryRegion, Notification,
    RegionId, ResourceStats, Result, SegmentDescriptor, SegmentId, SubmitOptions, TransferRequest, Transport,
};

use crate::batch::Batch;
use crate::bugs::MockBugs;
use crate::config::MockConfig;
use crate::fabric::MockFabric;
use crate::host::{HostShared, Life};
use crate::plan::{FaultPlan, FaultState};
use crate::region::{RegionEntry, RegionState};
use crate::segment::SegmentEntry;
use crate::worker::run_batch;

/// One mock host: registered memory that peers on the same
/// [`MockFabric`] reach by its segment name, and the initiator of
/// transfers to them. See the crate doc for the design.
///
/// Dropping the last handle tears the host down like
/// [`Transport::shutdown`] (without waiting): its tasks are aborted and no
/// task keeps it alive.
pub struct MockTransport {
    host: Arc<HostShared>,
    fabric: MockFabric,
}

impl fmt::Debug for MockTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MockTransport")
            .field("name", &self.host.name)
            .field("generation", &self.host.generation)
            .field("stats", &self.host.stats())
            .finish()
    }
}

impl MockTransport {
    /// Starts a host on `fabric`. Must be called inside a tokio runtime (it
    /// spawns the idle-endpoint reaper). Reusing the name of a killed or
    /// shut-down host is its restart, with a new generation; the name of a
    /// live host is a `Config` error.
    pub fn new(fabric: &MockFabric, config: MockConfig) -> Result<Arc<Self>> {
        Self::start(fabric, config, MockBugs::default())
    }

    /// [`MockTransport::new`] with deliberate bugs switched on. Test-only:
    /// behind the `bugs` cargo feature, never reachable from a config.
    #[cfg(feature = "bugs")]
    pub fn with_bugs(fabric: &MockFabric, config: MockConfig, bugs: MockBugs) -> Result<Arc<Self>> {
        Self::start(fabric, config, bugs)
    }

    fn start(fabric: &MockFabric, config: MockConfig, bugs: MockBugs) -> Result<Arc<Self>> {
        config.validate()?;
        let runtime = Handle::try_current().map_err(|e| {
            Error::new(ErrorKind::Config, "MockTransport::new must run inside a tokio runtime").with_source(e)
        })?;
        let inner = fabric.inner.clone();
        let name = config.name.clone().unwrap_or_else(|| inner.auto_name());
        let generation = inner.next_generation();
        let host = Arc::new(HostShared::new(name, generation, config, bugs, inner.events.clone(), runtime));
        inner.add(&host)?;
        let weak = Arc::downgrade(&host);
        let tick = (host.config.idle_timeout / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
        host.spawn(reaper(weak.clone(), tick))?;
        host.spawn(deadline_timer(weak))?;
        tracing::debug!(name = %host.name, generation = host.generation, "mock host started");
        Ok(Arc::new(Self { host, fabric: fabric.clone() }))
    }

    /// The fabric this host lives on.
    pub fn fabric(&self) -> &MockFabric {
        &self.fabric
    }

    /// This host's generation (new on every start).
    pub fn generation(&self) -> u64 {
        self.host.generation
    }

    /// The configuration it was started with.
    pub fn config(&self) -> &MockConfig {
        &self.host.config
    }

    /// Replaces the fault plan; its counters and RNG start over.
    pub fn set_fault_plan(&self, plan: FaultPlan) -> Result<()> {
        plan.validate()?;
        *self.host.faults.lock() = FaultState::new(plan);
        Ok(())
    }

    /// The current fault plan.
    pub fn fault_plan(&self) -> FaultPlan {
        self.host.faults.lock().plan().clone()
    }

    fn batch(&self, id: BatchId) -> Result<Arc<Batch>> {
        self.host.check_live()?;
        self.host.batches.lock().get(id).cloned()
    }

    fn segment(&self, id: SegmentId) -> Result<Arc<SegmentEntry>> {
        self.host.segments.lock().get(&id).cloned().ok_or_else(|| Error::unknown_segment(id))
    }
}

/// Reclaims idle endpoints every `tick` while the host lives.
async fn reaper(host: Weak<HostShared>, tick: Duration) {
    loop {
        tokio::time::sleep(tick).await;
        let Some(h) = host.upgrade() else { return };
        if h.life() != Life::Live {
            return;
        }
        h.reap();
    }
}

/// The host's one deadline timer (rule 5): sleeps until the next deadline
/// in its queue (or until an earlier one is entered), expires every batch
/// whose deadline came, and wakes every waiter and worker.
async fn deadline_timer(host: Weak<HostShared>) {
    loop {
        let Some(h) = host.upgrade() else { return };
        if h.life() != Life::Live {
            return;
        }
        let signal = h.earlier.clone();
        let earlier = signal.notified();
        tokio::pin!(earlier);
        earlier.as_mut().enable();
        let now = h.clock.now();
        let (due, next) = {
            let mut q = h.deadlines.lock();
            (q.due(now), q.arm())
        };
        if !due.is_empty() {
            let batches: Vec<Arc<Batch>> = {
                let t = h.batches.lock();
                due.iter().filter_map(|(_, id)| t.get(*id).ok().cloned()).collect()
            };
            for b in batches {
                b.expire(now);
            }
            h.events.bump();
        }
        let clock = h.clock;
        drop(h);
        clock.sleep_until_or(next, earlier).await;
    }
}

impl Drop for MockTransport {
    fn drop(&mut self) {
        // Aborts the tasks (dropping the set) and frees everything.
        drop(self.host.teardown(Life::Shut));
    }
}

#[async_trait]
impl Transport for MockTransport {
    fn backend(&self) -> &str {
        "mock"
    }

    fn capabilities(&self) -> Capabilities {
        let c = &self.host.config;
        let mut caps = Capabilities::new(c.max_endpoints);
        caps.max_batch_len = c.max_batch_len;
        caps.max_request_len = c.max_request_len;
        caps.lanes_per_endpoint = c.lanes_per_endpoint;
        // Device regions are read and written through their provider.
        caps.device_memory = true;
        caps.device_memory_remote = true;
        caps
    }

    fn local_segment_name(&self) -> String {
        self.host.name.clone()
    }

    fn local_descriptor(&self) -> Result<SegmentDescriptor> {
        self.host.check_live()?;
        Ok(self.host.descriptor())
    }

    fn advertise(&self, extra: &str) -> Result<()> {
        self.host.check_live()?;
        *self.host.advertised.lock() = extra.to_string();
        Ok(())
    }

    fn register(&self, mem: MemoryRegion, access: Access) -> Result<RegionId> {
        self.host.check_live()?;
        // The deliberate bug: device memory taken for host memory, so the
        // copies touch it directly (a fake device's faults at once).
        #[cfg(feature = "bugs")]
        let mem = if self.host.bugs.forget_device_memory { mem.forget_device() } else { mem };
        let id = RegionId(self.host.next_id());
        let entry = Arc::new(RegionEntry { id, mem, access, state: parking_lot::RwLock::new(RegionState::Live) });
        self.host.regions.lock().insert(entry)?;
        Ok(id)
    }

    /// Rule 9: the region is retired under its write lock (so no copy is
    /// running on return), then every live request using it fails, here
    /// and on the peers that target it.
    async fn unregister(&self, region: RegionId) -> Result<()> {
        self.host.check_live()?;
        let entry = self.host.regions.lock().remove(region).ok_or_else(|| Error::unknown_region(region))?;
        entry.retire(RegionState::Unregistered);
        self.host.fail_local_users(region);
        let (addr, len) = (entry.mem.addr(), entry.mem.len() as u64);
        for h in self.fabric.inner.live_hosts() {
            h.fail_remote_users(&self.host.name, addr, len);
        }
        self.fabric.inner.bump();
        Ok(())
    }

    async fn open_segment(&self, name: &str) -> Result<SegmentId> {
        self.host.check_live()?;
        let open_now = self.host.segments.lock().len();
        if let Some(e) = self.host.faults.lock().on_open(name, open_now) {
            return Err(e);
        }
        let peer = self.fabric.inner.live_host(name).ok_or_else(|| {
            Error::new(ErrorKind::ConnectionRefused, "no live mock host has this name").with("segment", name)
        })?;
        let id = SegmentId(self.host.next_id());
        self.host.segments.lock().insert(id, Arc::new(SegmentEntry::new(id, peer.descriptor())));
        Ok(id)
    }

    /// Rule 3: the handle goes, its live requests end cancelled (quiet on
    /// return), and the endpoint to the peer is destroyed when no other
    /// open handle names the peer.
    async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        self.host.check_live()?;
        if self.host.bugs.noop_close_segment {
            // The bug: nothing is closed, the handle keeps working.
            return self.segment(segment).map(|_| ());
        }
        let entry = self.host.segments.lock().remove(&segment).ok_or_else(|| Error::unknown_segment(segment))?;
        self.host.cancel_segment(segment);
        let shared = self.host.segments.lock().values().any(|s| s.name == entry.name);
        if !shared {
            self.host.endpoints.lock().close_peer(&entry.name);
        }
        self.fabric.inner.bump();
        Ok(())
    }

    fn segment_descriptor(&self, segment: SegmentId) -> Result<SegmentDescriptor> {
        self.host.check_live()?;
        Ok(self.segment(segment)?.descriptor())
    }

    async fn submit(&self, requests: Vec<TransferRequest>, opts: SubmitOptions) -> Result<BatchId> {
        self.host.check_live()?;
        let planned = self.host.plan(&requests)?;
        // `None` also past what the clock holds: never.
        let deadline = opts.timeout.and_then(|t| self.host.clock.after(t));
        let batch = Arc::new(Batch::new(planned, deadline));
        let id = self.host.batches.lock().insert(batch.clone());
        self.host.enter_deadline(id, &batch);
        if let Err(e) = self.host.spawn(run_batch(self.fabric.inner.clone(), self.host.clone(), batch.clone())) {
            self.host.batches.lock().remove(id);
            if let Some(&key) = batch.deadline_key.get() {
                self.host.deadlines.lock().remove(key);
            }
            return Err(e);
        }
        Ok(id)
    }

    fn poll(&self, batch: BatchId) -> Result<BatchStatus> {
        Ok(self.batch(batch)?.status(self.host.clock.now()))
    }

    async fn wait(&self, batch: BatchId) -> Result<BatchStatus> {
        let mut events = self.host.events.subscribe();
        loop {
            events.borrow_and_update();
            let b = self.batch(batch)?;
            let status = b.status(self.host.clock.now());
            if status.is_terminal() {
                return Ok(status);
            }
            // The deadline timer wakes every waiter when a deadline comes.
            if events.changed().await.is_err() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }

    /// Rule 5: live requests end cancelled under the batch lock, so the
    /// batch is quiet when this returns.
    async fn cancel(&self, batch: BatchId) -> Result<BatchStatus> {
        let status = self.batch(batch)?.cancel(self.host.clock.now());
        self.fabric.inner.bump();
        Ok(status)
    }

    fn release(&self, batch: BatchId) -> Result<()> {
        self.host.check_live()?;
        self.host.release_batch(batch)
    }

    fn stats(&self) -> ResourceStats {
        self.host.stats()
    }

    /// Rule 11: offered straight to the live peer's inbox (a killed peer is
    /// `ConnectionRefused`); waits while either host is stalled, as copies
    /// do. Order per pair follows from one synchronous offer per call.
    async fn notify(&self, segment: SegmentId, msg: Vec<u8>) -> Result<()> {
        self.host.check_live()?;
        check_notification(&msg)?;
        let name = self.segment(segment)?.name.clone();
        let mut events = self.host.events.subscribe();
        loop {
            events.borrow_and_update();
            self.host.check_live()?;
            let peer = self.fabric.inner.live_host(&name).ok_or_else(|| {
                Error::new(ErrorKind::ConnectionRefused, "no live mock host has this name").with("segment", &name)
            })?;
            if !peer.stalled() && !self.host.stalled() {
                let n = Notification { from: self.host.name.clone(), msg };
                return peer.inbox.offer(n).map_err(|r| r.into_error().with("segment", &name));
            }
            if events.changed().await.is_err() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }

    fn take_notifications(&self, max: usize) -> Result<Vec<Notification>> {
        self.host.check_live()?;
        Ok(self.host.inbox.take(max))
    }

    async fn wait_notification(&self) -> Result<()> {
        self.host.check_live()?;
        self.host.inbox.wait().await
    }

    async fn notify_after(
        &self,
        batch: BatchId,
        segment: SegmentId,
        msg: Vec<u8>,
    ) -> Result<(BatchStatus, Option<Result<()>>)> {
        if self.host.bugs.notify_before_landing {
            // The bug: the message goes out first, while the copies run.
            check_notification(&msg)?;
            let sent = self.notify(segment, msg).await;
            let status = self.wait(batch).await?;
            return Ok((status, Some(sent)));
        }
        transport_core::notify_when_completed(self, batch, segment, msg).await
    }

    async fn shutdown(&self) -> Result<()> {
        if let Some(handles) = self.host.teardown(Life::Shut) {
            for h in handles {
                let _ = h.await;
            }
            self.host.tasks_idle().await;
        }
        Ok(())
    }
}
