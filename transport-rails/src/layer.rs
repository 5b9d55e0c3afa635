//! [`Rails`]: several transports of one kind, one per NIC ("rails"), as
//! one [`Transport`], with an optional TCP fallback. The sans-IO parts
//! (path health, pairing, the advertised rail list) are in
//! [`crate::paths`]; what a batch does under the lock is in `schedule`,
//! its task in `drive`, the shared state in `state`; this is the
//! `Transport` they make.
//!
//! * **Names**: the transport's name is its first rail's. The first rail
//!   advertises every rail (and the fallback) in its descriptor's address
//!   ([`RailList`], through [`Transport::advertise`]), so a peer that opens
//!   the name finds the others, and a single-rail peer interoperates.
//!   A transport's rails listen on one host: a peer's advertised rails are
//!   reached on the host it was opened by, at the advertised ports, so a
//!   descriptor cannot point us at another machine.
//! * **Segments**: opening a name opens a *control* handle on rail 0 (the
//!   descriptor, notifications) and one handle per *path*: a local rail
//!   paired with one of the peer's rails ([`crate::Pairing`]);
//!   with a fallback on both sides, one more path over it.
//! * **Memory**: `register` registers the memory on every rail (each has
//!   its own keys); all or nothing.
//! * **Batches**: requests are cut into slices ([`RailsConfig::slice_size`])
//!   and a driver task per batch hands them out as sub-batches of
//!   [`RailsConfig::chunk_bytes`], at most `subs_per_path` per path at a
//!   time, each to the path with the fewest bytes in flight: a path that
//!   moves faster finishes sooner and is handed more.
//! * **Failover**: a sub-batch that fails with a transient peer failure
//!   (link down, QP error, reset) gives its unfinished slices back. The
//!   rail reported that sub-batch terminal, which means quiet (rule 5:
//!   its QPs are flushed or destroyed), so nothing is reposted while an
//!   old work request can still touch the memory. They are reposted on
//!   the other paths, and the batch completes without an error while one
//!   path lives and the deadline allows. Failures count toward the path's
//!   [`PathHealth`]: paused with backoff, taken back after a successful
//!   probe. A paused path sends nothing, so it rebuilds nothing.
//! * **Fallback**: while no RDMA path is up, slices go over the fallback
//!   (reported in [`Rails::paths`], the `kvmove_rail_events_total` metric
//!   and the log); as soon as a path is back from its pause, it carries a
//!   probe, and on success everything moves back to it. Without a
//!   fallback, a batch whose every path is paused fails with a transient
//!   error.
//! * **Endpoints**: each rail keeps its own bound, so the kernel's QP count
//!   stays within `rails x max_endpoints x qps_per_endpoint` through every
//!   failover ([`Transport::capabilities`] reports the sum).
//! * **Notifications** go over rail 0's control handle only, so the
//!   per-pair order holds and `from` is this transport's name; received
//!   ones are taken from every rail.
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use transport_core::Epoch;

use async_trait::async_trait;
use parking_lot::Mutex;
use serde::Serialize;
use tokio::sync::Notify;
use transport_mem::MemoryRegion;

use transport_core::lifecycle::{
    validate_batch, BatchLedger, BatchTable, DeadlineQueue, EndReason, OwnedTask, TaskSet,
};
use transport_core::{
    Access, BatchId, BatchStatus, Capabilities, Error, ErrorKind, Notification, RegionId, ResourceStats, Result,
    SegmentDescriptor, SegmentId, SubmitOptions, TransferRequest, Transport,
};

use crate::drive::*;
use crate::paths::{pair, NearList, Pairing, PathHealth, PathState, RailList, RailsConfig, Reachability, MAX_RAILS};
use crate::state::*;
use crate::topology::Topology;

mod open;
use open::undo_registrations;

/// Several transports (one per NIC) as one, with failover and an optional
/// fallback. See the module docs.
pub struct Rails {
    inner: Arc<Inner>,
}

/// One path of an open segment, as [`Rails::paths`] reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PathStatus {
    /// The local rail (index into the rails given to [`Rails::new`]);
    /// `None` for the fallback.
    pub rail: Option<usize>,
    /// The peer's rail; `None` for the fallback.
    pub peer_rail: Option<usize>,
    /// Whether this is the TCP fallback path.
    pub fallback: bool,
    pub state: PathState,
    /// Bytes completed over this path.
    pub bytes: u64,
    /// Sub-batches that failed on it.
    pub failures: u64,
    /// Times it was paused.
    pub pauses: u64,
}

impl Rails {
    /// Rails over `rails` (one transport per NIC, rail 0 first; its name
    /// becomes this transport's) and an optional `fallback` used while
    /// every rail to a peer is down. Rail 0 must support
    /// [`Transport::advertise`] when there is more than one rail or a
    /// fallback. Must be called inside a tokio runtime.
    pub fn new(
        rails: Vec<Arc<dyn Transport>>,
        fallback: Option<Arc<dyn Transport>>,
        cfg: RailsConfig,
    ) -> Result<Arc<Self>> {
        Self::placed(rails, fallback, cfg, None)
    }

    /// [`Rails::new`], and with a `topology` (one place per rail) each
    /// registered region's bytes go over the rails nearest its memory
    /// ([`crate::topology::nearest`]): striped over them when several are
    /// equally near, over the others (then the fallback) only while no
    /// path of the near ones is up (paused, or on probation after a
    /// pause). The place of each region is looked up once, at `register`,
    /// after the rails registered it (host memory:
    /// [`crate::topology::host_node`], the kernel's answer for 64 of its
    /// pages).
    pub fn placed(
        rails: Vec<Arc<dyn Transport>>,
        fallback: Option<Arc<dyn Transport>>,
        cfg: RailsConfig,
        topology: Option<Topology>,
    ) -> Result<Arc<Self>> {
        cfg.validate()?;
        if rails.is_empty() || rails.len() > MAX_RAILS {
            return Err(Error::new(ErrorKind::Config, format!("rails: 1 to {MAX_RAILS} rails, not {}", rails.len())));
        }
        if let Some(t) = &topology {
            if t.rails().len() != rails.len() {
                let why = format!("rails: a topology of {} rails for {} rails", t.rails().len(), rails.len());
                return Err(Error::new(ErrorKind::Config, why));
            }
        }
        let list = RailList {
            rails: rails.iter().map(|t| t.local_segment_name()).collect(),
            tcp: fallback.as_ref().map(|t| t.local_segment_name()),
        };
        let name = list.rails[0].clone();
        let list = if rails.len() > 1 || fallback.is_some() {
            rails[0].advertise(&list.format()).map_err(|e| e.with("rails", "rail 0 must advertise the others"))?;
            Some(list)
        } else {
            None
        };
        let n = rails.len();
        let mut all = rails;
        all.extend(fallback);
        let max_batch = all.iter().map(|t| t.capabilities().max_batch_len.max(1)).collect();
        let inner = Arc::new(Inner {
            all,
            rails: n,
            cfg,
            name,
            epoch: Epoch::start(),
            max_batch,
            topology,
            list,
            near_capped: std::sync::atomic::AtomicBool::new(false),
            state: Mutex::new(State {
                shutdown: false,
                regions: BTreeMap::new(),
                segments: HashMap::new(),
                batches: BatchTable::new(),
                deadlines: DeadlineQueue::new(),
                next_region: 0,
                next_segment: 0,
            }),
            tasks: TaskSet::new(),
            settled: Notify::new(),
            earlier: Arc::new(Notify::new()),
            timer: Mutex::new(None),
            reach: Mutex::new(Reachability::default()),
        });
        let timer = OwnedTask::spawn(&inner.tasks, crate::drive::timer(Arc::downgrade(&inner)));
        *inner.timer.lock() = Some(timer);
        Ok(Arc::new(Self { inner }))
    }

    /// The paths of an open segment: their state and what they moved.
    pub fn paths(&self, segment: SegmentId) -> Result<Vec<PathStatus>> {
        let now = self.inner.now();
        let st = self.inner.state.lock();
        let s = st.segments.get(&segment).ok_or_else(|| Error::unknown_segment(segment))?;
        Ok(s.paths
            .iter()
            .map(|p| PathStatus {
                rail: (!p.fallback).then_some(p.k),
                peer_rail: p.peer,
                fallback: p.fallback,
                state: p.health.state(now),
                bytes: p.bytes,
                failures: p.failures,
                pauses: p.health.pauses(),
            })
            .collect())
    }

    /// The rails (then the fallback) this transport drives.
    pub fn transports(&self) -> &[Arc<dyn Transport>] {
        &self.inner.all
    }
}

/// With a topology, rail 0's descriptor lists the rails nearest each
/// region peers may reach ([`NearList`]), so a peer sends its bytes over
/// the paths that end there. Called under the state lock after every
/// change, so the list advertised last is the current one.
fn advertise_near(inner: &Inner, st: &State) {
    let (Some(list), Some(_)) = (&inner.list, &inner.topology) else { return };
    let every = u32::try_from(inner.rails).ok().and_then(|n| 1u32.checked_shl(n)).map_or(u32::MAX, |b| b - 1);
    let ranges = st
        .regions
        .values()
        .filter(|r| r.remote && r.near & every != every)
        .map(|r| (r.addr, r.len, r.near & every))
        .collect();
    let (near, over) = NearList::new(ranges);
    if over > 0 && !inner.near_capped.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::warn!(
            left_out = over,
            "rails: more regions keep to some rails than the descriptor lists; peers send to the rest over every rail"
        );
    }
    if let Err(e) = inner.all[0].advertise(&format!("{}{}", list.format(), near.format())) {
        tracing::warn!(error = %e, "rails: rail 0 could not advertise the rails nearest each region");
    }
}

impl std::fmt::Debug for Rails {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rails").field("name", &self.inner.name).field("rails", &self.inner.rails).finish()
    }
}

impl Drop for Rails {
    fn drop(&mut self) {
        // Drivers hold the inner state; stopping them lets the rails drop
        // (and free their work) with it.
        let mut st = self.inner.state.lock();
        for (_, b) in st.batches.iter_mut() {
            if let Some(d) = b.driver.take() {
                d.abort();
            }
        }
    }
}

#[async_trait]
impl Transport for Rails {
    fn backend(&self) -> &str {
        self.inner.all[0].backend()
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.caps()
    }

    fn local_segment_name(&self) -> String {
        self.inner.name.clone()
    }

    fn local_descriptor(&self) -> Result<SegmentDescriptor> {
        if self.inner.state.lock().shutdown {
            return Err(Error::shut_down());
        }
        self.inner.all[0].local_descriptor()
    }

    fn register(&self, mem: MemoryRegion, access: Access) -> Result<RegionId> {
        let inner = &self.inner;
        {
            let st = inner.state.lock();
            if st.shutdown {
                return Err(Error::shut_down());
            }
        }
        let mut ids = Vec::with_capacity(inner.all.len());
        for (k, t) in inner.all.iter().enumerate() {
            match t.register(mem.clone(), access) {
                Ok(id) => ids.push(id),
                Err(e) => {
                    // All or nothing: give back what was registered (no
                    // transfer can use it yet, so this ends at once).
                    undo_registrations(inner, ids);
                    return Err(e.with("rail", k));
                }
            }
        }
        // The rails nearest the memory, as a mask of rail indexes (every
        // rail without a topology). Looked up once the rails registered it:
        // a backend that pins the pages has made them resident, so the
        // kernel can say where they are.
        let chosen = inner.topology.as_ref().map(|t| t.near(&mem));
        let near = chosen.as_ref().map_or(u32::MAX, |(_, rails)| {
            rails.iter().fold(0u32, |m, &k| m | 1u32.checked_shl(k as u32).unwrap_or(0))
        });
        let mut st = inner.state.lock();
        if st.shutdown {
            drop(st);
            undo_registrations(inner, ids);
            return Err(Error::shut_down());
        }
        st.next_region += 1;
        let id = RegionId(st.next_region);
        let (addr, remote) = (mem.addr(), access.is_remote());
        st.regions.insert(id, Region { ids, addr, len: mem.len() as u64, near, remote });
        advertise_near(inner, &st);
        drop(st);
        if let Some((place, rails)) = chosen {
            let names: Vec<&str> =
                rails.iter().filter_map(|&k| inner.topology.as_ref()?.names().get(k)).map(String::as_str).collect();
            tracing::info!(region = id.0, memory = %mem.kind(), %place, rails = ?names, "rails: the region's bytes go over the rails nearest its memory");
        }
        Ok(id)
    }

    async fn unregister(&self, region: RegionId) -> Result<()> {
        let inner = &self.inner;
        let ids = {
            let mut st = inner.state.lock();
            if st.shutdown {
                return Err(Error::shut_down());
            }
            let r = st.regions.remove(&region).ok_or_else(|| Error::unknown_region(region))?;
            if r.remote {
                advertise_near(inner, &st);
            }
            let why = EndReason::Failed(Error::region_unregistered(region));
            for (_, b) in st.batches.iter_mut() {
                let targets = &b.targets;
                let (_, p) = b.ledger.end_where(&why, |i| targets.get(i).is_some_and(|t| t.1 == region));
                if p.batch_terminal {
                    b.done.notify_waiters();
                }
            }
            r.ids
        };
        let results =
            futures::future::join_all(ids.iter().enumerate().map(|(k, &rid)| inner.all[k].unregister(rid))).await;
        inner
            .settle(|st| {
                st.batches.iter().all(|(_, b)| {
                    b.targets.iter().enumerate().all(|(i, t)| t.1 != region || b.ledger.on_wire_of(i) == 0)
                })
            })
            .await;
        results.into_iter().collect::<Result<Vec<()>>>().map(|_| ())
    }

    async fn open_segment(&self, name: &str) -> Result<SegmentId> {
        let inner = &self.inner;
        if inner.state.lock().shutdown {
            return Err(Error::shut_down());
        }
        let rail0 = &inner.all[0];
        let control = rail0.open_segment(name).await?;
        match self.open_paths(name, control).await {
            Ok((paths, peer_near, peer_address)) => {
                let refused = {
                    let mut st = inner.state.lock();
                    if st.shutdown {
                        Some(paths)
                    } else {
                        st.next_segment += 1;
                        let id = SegmentId(st.next_segment);
                        st.segments.insert(
                            id,
                            Seg {
                                name: name.to_string(),
                                control,
                                paths,
                                closing: false,
                                refreshing: false,
                                peer_near,
                                peer_address,
                            },
                        );
                        return Ok(id);
                    }
                };
                if let Some(paths) = refused {
                    self.close_handles(control, &paths).await;
                }
                Err(Error::shut_down())
            }
            Err(e) => {
                let _ = rail0.close_segment(control).await;
                Err(e)
            }
        }
    }

    async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        let inner = &self.inner;
        let (control, handles) = {
            let mut st = inner.state.lock();
            if st.shutdown {
                return Err(Error::shut_down());
            }
            let s =
                st.segments.get_mut(&segment).filter(|s| !s.closing).ok_or_else(|| Error::unknown_segment(segment))?;
            s.closing = true;
            let out = (s.control, s.paths.iter().map(|p| (p.k, p.seg)).collect::<Vec<_>>());
            for (_, b) in st.batches.iter_mut() {
                let targets = &b.targets;
                let (_, p) =
                    b.ledger.end_where(&EndReason::Cancelled, |i| targets.get(i).is_some_and(|t| t.0 == segment));
                if p.batch_terminal {
                    b.done.notify_waiters();
                }
            }
            out
        };
        let closes = handles.iter().map(|&(k, seg)| inner.all[k].close_segment(seg));
        let _ = futures::future::join_all(closes).await;
        let _ = inner.all[0].close_segment(control).await;
        inner
            .settle(|st| {
                st.batches.iter().all(|(_, b)| {
                    b.targets.iter().enumerate().all(|(i, t)| t.0 != segment || b.ledger.on_wire_of(i) == 0)
                })
            })
            .await;
        inner.state.lock().segments.remove(&segment);
        Ok(())
    }

    /// The peer's rail 0 descriptor, from the control handle: opened again
    /// whenever a path saw the peer restart (`Inner::refresh_control`), so
    /// it shows the new generation once a transfer failed for it (rule 2)
    /// whichever rail carried that transfer.
    fn segment_descriptor(&self, segment: SegmentId) -> Result<SegmentDescriptor> {
        let control = {
            let st = self.inner.state.lock();
            let s = st.segments.get(&segment).filter(|s| !s.closing).ok_or_else(|| Error::unknown_segment(segment))?;
            s.control
        };
        self.inner.all[0].segment_descriptor(control)
    }

    async fn submit(&self, requests: Vec<TransferRequest>, opts: SubmitOptions) -> Result<BatchId> {
        let inner = &self.inner;
        let controls = {
            let st = inner.state.lock();
            if st.shutdown {
                return Err(Error::shut_down());
            }
            validate_batch(
                &requests,
                inner.limits(),
                |id| st.regions.get(&id).map(|r| ((), r.len)),
                |s| st.segments.get(&s).is_some_and(|s| !s.closing),
            )?;
            let mut controls: HashMap<SegmentId, (SegmentId, String)> = HashMap::new();
            for r in &requests {
                if let Some(s) = st.segments.get(&r.segment) {
                    controls.entry(r.segment).or_insert_with(|| (s.control, s.name.clone()));
                }
            }
            controls
        };
        let descs = self.check_remote(&requests, &controls).await?;
        self.learn_near(&descs)?;
        let slice = inner.cfg.slice_size;
        let units: Vec<u64> = requests.iter().map(|r| r.len.div_ceil(slice)).collect();
        // One entry per request: slices are cut as they are handed out, so
        // the queue stays small whatever the request sizes.
        let queue: VecDeque<Slice> =
            requests.iter().enumerate().map(|(i, r)| Slice { req: i, off: 0, len: r.len, tries: 0 }).collect();
        // `None` also past what the clock holds: never.
        let deadline = opts.timeout.and_then(|t| inner.epoch.after(t));
        let wake = Arc::new(Notify::new());
        let mut st = inner.state.lock();
        if st.shutdown {
            return Err(Error::shut_down());
        }
        // Closed or unregistered while the remote ranges were checked.
        for (i, r) in requests.iter().enumerate() {
            if !st.regions.contains_key(&r.local) {
                return Err(Error::unknown_region(r.local).with("request", i));
            }
            if st.segments.get(&r.segment).is_none_or(|s| s.closing) {
                return Err(Error::unknown_segment(r.segment).with("request", i));
            }
        }
        let targets = requests.iter().map(|r| (r.segment, r.local)).collect();
        let id = st.batches.insert(Batch {
            ledger: BatchLedger::new(units, deadline),
            targets,
            wake: wake.clone(),
            done: Arc::new(Notify::new()),
            stop: false,
            driver: None,
            deadline: None,
        });
        if let Some(at) = deadline {
            let (key, earliest) = st.deadlines.add(at, id);
            if let Ok(b) = st.batches.get_mut(id) {
                b.deadline = Some(key);
            }
            if earliest {
                inner.earlier.notify_one();
            }
        }
        let driver = inner.tasks.spawn(drive(inner.clone(), id, requests, queue, wake, opts.round_trip));
        if let Ok(b) = st.batches.get_mut(id) {
            b.driver = Some(driver);
        }
        Ok(id)
    }

    fn poll(&self, batch: BatchId) -> Result<BatchStatus> {
        self.inner.state.lock().batches.get(batch).map(|b| b.ledger.status())
    }

    async fn wait(&self, batch: BatchId) -> Result<BatchStatus> {
        loop {
            let done = {
                let st = self.inner.state.lock();
                let b = st.batches.get(batch)?;
                if b.ledger.is_terminal() {
                    return Ok(b.ledger.status());
                }
                b.done.clone()
            };
            let n = done.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            {
                let st = self.inner.state.lock();
                let b = st.batches.get(batch)?;
                if b.ledger.is_terminal() {
                    return Ok(b.ledger.status());
                }
            }
            let _ = tokio::time::timeout(NAP, n).await;
        }
    }

    async fn cancel(&self, batch: BatchId) -> Result<BatchStatus> {
        {
            let mut st = self.inner.state.lock();
            let b = st.batches.get_mut(batch)?;
            if !b.ledger.is_terminal() {
                b.stop = true;
                let p = b.ledger.end_where(&EndReason::Cancelled, |_| true).1;
                if p.batch_terminal {
                    b.done.notify_waiters();
                }
                b.wake.notify_one();
            }
        }
        self.wait(batch).await
    }

    fn release(&self, batch: BatchId) -> Result<()> {
        let b = {
            let mut st = self.inner.state.lock();
            let b = st.batches.release(batch, |b| b.ledger.is_terminal())?;
            if let Some(key) = b.deadline {
                st.deadlines.remove(key);
            }
            b
        };
        drop(b); // its driver has ended or is about to (the batch is terminal)
        Ok(())
    }

    fn stats(&self) -> ResourceStats {
        let mut s = ResourceStats::default();
        for t in &self.inner.all {
            let r = t.stats();
            s.endpoints += r.endpoints;
            s.endpoint_lanes += r.endpoint_lanes;
            s.inflight += r.inflight;
            s.tasks += r.tasks;
            s.notifications += r.notifications;
            s.staging_bytes = s.staging_bytes.saturating_add(r.staging_bytes);
        }
        let st = self.inner.state.lock();
        s.segments = st.segments.len();
        s.regions = st.regions.len();
        s.batches = st.batches.len();
        s.tasks += self.inner.tasks.count();
        s
    }

    async fn notify(&self, segment: SegmentId, msg: Vec<u8>) -> Result<()> {
        let control = {
            let st = self.inner.state.lock();
            if st.shutdown {
                return Err(Error::shut_down());
            }
            st.segments
                .get(&segment)
                .filter(|s| !s.closing)
                .map(|s| s.control)
                .ok_or_else(|| Error::unknown_segment(segment))?
        };
        self.inner.all[0].notify(control, msg).await
    }

    fn take_notifications(&self, max: usize) -> Result<Vec<Notification>> {
        if self.inner.state.lock().shutdown {
            return Err(Error::shut_down());
        }
        let mut out = Vec::new();
        for t in &self.inner.all {
            if out.len() >= max {
                break;
            }
            out.extend(t.take_notifications(max - out.len())?);
        }
        Ok(out)
    }

    async fn wait_notification(&self) -> Result<()> {
        if self.inner.state.lock().shutdown {
            return Err(Error::shut_down());
        }
        let waits = self.inner.all.iter().map(|t| t.wait_notification());
        futures::future::select_all(waits).await.0
    }

    async fn shutdown(&self) -> Result<()> {
        let inner = &self.inner;
        let drivers = {
            let mut st = inner.state.lock();
            if st.shutdown {
                return Ok(());
            }
            st.shutdown = true;
            st.deadlines = DeadlineQueue::new();
            let mut drivers = Vec::new();
            for (_, b) in st.batches.iter_mut() {
                b.stop = true;
                let _ = b.ledger.end_where(&EndReason::Cancelled, |_| true);
                b.wake.notify_one();
                drivers.extend(b.driver.take());
            }
            drivers
        };
        // The timer ends here (aborted, uncounted at once).
        drop(inner.timer.lock().take());
        let results = futures::future::join_all(inner.all.iter().map(|t| t.shutdown())).await;
        for d in drivers {
            if tokio::time::timeout(SETTLE_LIMIT, d).await.is_err() {
                tracing::warn!("rails: a batch driver did not end within {SETTLE_LIMIT:?} of shutdown");
            }
        }
        {
            let mut st = inner.state.lock();
            let batches = st.batches.drain();
            for (_, b) in &batches {
                b.done.notify_waiters();
            }
            st.segments.clear();
            st.regions.clear();
        }
        results.into_iter().collect::<Result<Vec<()>>>().map(|_| ())
    }

    fn advertise(&self, extra: &str) -> Result<()> {
        let _ = extra;
        Err(Error::new(ErrorKind::Unsupported, "rails advertise their own rail list"))
    }
}
