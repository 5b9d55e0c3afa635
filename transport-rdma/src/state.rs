//! The transport's shared state: [`Inner`] (configuration, the one mutex
//! over [`State`], the counted background work) and the bookkeeping types
//! behind that mutex: regions, segments, endpoints (QP groups), batches and
//! posted work requests.
//!
//! Everything under the mutex is synchronous and never blocks (verbs calls
//! made under the lock are `ibv_post_send` and `ibv_modify_qp`, which
//! return at once). Objects that must be destroyed go to a [`Graveyard`],
//! which [`Inner::with_state`] empties after releasing the lock: the one
//! place where "lock, act, release, destroy" is written. Work that was
//! still posted on a destroyed QP is settled there too, only after the
//! destroy ([`State::after_destroy`]), so a batch never turns terminal
//! while a QP that may touch its memory exists.
//!
//! Ids are newtypes with counters of their own, never reused within a
//! transport: endpoints are the [`EndpointPool`]'s [`EndpointId`]s,
//! batches the [`BatchTable`]'s, work requests [`WrId`]s, peer QP groups
//! [`PeerGroupId`]s. A completion whose [`WrId`] is no longer in
//! [`State::wrs`] (its endpoint was destroyed) is ignored, so a late
//! completion never touches a request that has moved on.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use transport_core::lifecycle::{
    BatchLedger, BatchTable, DeadlineKey, DeadlineQueue, EndpointId, EndpointPool, IdBuildHasher, IdMap, Progress,
    TaskSet,
};
use transport_core::Epoch;
use transport_core::{
    Access, BatchId, Error, ErrorKind, Inbox, RegionId, RegionInfo, Result, SegmentDescriptor, SegmentId,
    TransferRequest,
};

use crate::config::RdmaConfig;
pub(crate) use crate::ids::{PeerGroupId, Slice, WrId, WrIds};
use crate::verbs::{CompChannel, Completion, Context, Cq, Pd, PortInfo, Qp, Registration};

/// The device objects shared by everything: released (in this order: CQ,
/// channel, PD, context, by the `Arc` chain) when the last user drops them.
#[derive(Debug)]
pub(crate) struct Verbs {
    pub cq: Arc<Cq>,
    pub chan: Arc<CompChannel>,
    pub pd: Arc<Pd>,
    pub ctx: Arc<Context>,
    pub port: PortInfo,
}

#[derive(Debug)]
pub(crate) struct LocalRegion {
    /// The MR; `None` for device memory staged through host buffers (the
    /// NIC never reaches it).
    pub reg: Option<Registration>,
    pub mem: transport_mem::MemoryRegion,
    pub access: Access,
    pub path: crate::stage::MemPath,
}

#[derive(Debug)]
pub(crate) struct Segment {
    pub desc: SegmentDescriptor,
    /// Serialises endpoint builds for this handle.
    pub connect_lock: Arc<tokio::sync::Mutex<()>>,
    /// The notification channel to the peer, once a notification was sent
    /// (dropping it closes the channel).
    pub notes: Option<NoteChannel>,
    /// Serialises opening the notification channel.
    pub notes_lock: Arc<tokio::sync::Mutex<()>>,
    /// The side channel that read `desc`, for the first endpoint to
    /// connect over (taken by it; dropped with the handle). Set and taken
    /// only through [`State::keep_spare`] and [`State::take_spare`].
    spare: Option<crate::wire::Spare>,
}

impl Segment {
    pub(crate) fn new(desc: SegmentDescriptor) -> Self {
        Self { desc, connect_lock: Arc::default(), notes: None, notes_lock: Arc::default(), spare: None }
    }
}

/// Side-channel connections kept for first endpoints (`wire::Spare`) at
/// once: each holds one of the peer's connection places for up to half
/// `handshake_timeout_ms`, so a program opening handles by the hundred
/// keeps only the first few.
pub(crate) const MAX_SPARES: usize = 16;

/// A segment handle's notification channel (rule 11): a side-channel
/// connection that holds no QPs, owned by its carrier task.
#[derive(Debug)]
pub(crate) struct NoteChannel {
    /// Tells this channel from its successors.
    pub id: u64,
    /// Notifications for the carrier to send.
    pub side: tokio::sync::mpsc::Sender<crate::wire::Ask>,
    /// The carrier: dropping it (close, shutdown, idle) closes the channel.
    pub carrier: Option<Task>,
    /// Last time a notification was handed to it (idle reclaim).
    pub last_used: Instant,
    /// Notifications handed to it and not yet answered: not idle while any.
    pub inflight: Arc<std::sync::atomic::AtomicUsize>,
}

impl NoteChannel {
    /// Unused for `idle` with nothing in flight at `now`.
    pub(crate) fn idle(&self, now: Instant, idle: Duration) -> bool {
        self.inflight.load(std::sync::atomic::Ordering::SeqCst) == 0 && now.duration_since(self.last_used) >= idle
    }
}

/// Deadline, watcher and peer tasks: counted while their owner holds them.
pub(crate) type Task = transport_core::lifecycle::OwnedTask;

#[derive(Debug)]
pub(crate) struct QpSlot {
    pub qp: Qp,
    pub outstanding: usize,
}

/// A QP group toward one opened segment. Its place under `max_endpoints`
/// is held in [`State::pool`] until its QPs are destroyed.
#[derive(Debug)]
pub(crate) struct Endpoint {
    pub segment: SegmentId,
    // Field order is drop order: QPs first, then the watcher (aborting it
    // closes the side channel, which makes the peer destroy its half).
    pub qps: Vec<QpSlot>,
    pub pending: VecDeque<Slice>,
    /// Slices of staged device memory to write, copied into their staging
    /// buffer (the `u32`) and waiting for room on a QP: posted first.
    pub ready: VecDeque<(Slice, u32)>,
    /// Copies between device memory and a staging buffer running for
    /// slices of this endpoint (a started unit each).
    pub copying: usize,
    /// Staging drivers running slices of remote staged memory on it.
    pub drivers: usize,
    pub next_qp: usize,
    /// Whether it holds a use in the pool because it has work (queued or
    /// posted); given back when it goes idle, so the pool's LRU eviction
    /// and idle reclaim only ever pick idle endpoints.
    pub busy: bool,
    /// When its QPs were created (async events read before that are not about it).
    pub created: Instant,
    /// Set when the endpoint broke (QPs moved to ERROR): it is never used
    /// again and is destroyed once its posted work has flushed.
    pub broken_at: Option<Instant>,
    /// Watches the side channel: the peer closing it (crash, shutdown)
    /// breaks the endpoint at once instead of after the QP retry timeout.
    pub watcher: Option<Task>,
}

impl Endpoint {
    pub(crate) fn outstanding(&self) -> usize {
        self.qps.iter().map(|q| q.outstanding).sum()
    }

    pub(crate) fn idle(&self) -> bool {
        self.pending.is_empty()
            && self.ready.is_empty()
            && self.copying == 0
            && self.drivers == 0
            && self.outstanding() == 0
    }
}

/// Where a posted work request is.
#[derive(Debug)]
pub(crate) struct WrRef {
    pub ep: EndpointId,
    pub qp: usize,
    pub slice: Slice,
    /// The staging buffer it reads or writes, for staged device memory.
    pub slot: Option<u32>,
    /// Posted by a staging driver, which owns its ledger unit: the outcome
    /// goes here instead.
    pub waiter: Option<tokio::sync::oneshot::Sender<Result<()>>>,
}

/// A request as validated at submit: the spec and the remote key.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Target {
    pub spec: TransferRequest,
    /// `None`: the remote range is staged device memory, reached through
    /// the peer's staging buffers (see `crate::staging`).
    pub rkey: Option<u32>,
}

#[derive(Debug)]
pub(crate) struct Batch {
    /// Per-request status; units are work requests (slices).
    pub ledger: BatchLedger,
    pub targets: Vec<Target>,
    /// Wakes sleeping `wait`s; made by the first one that sleeps (a batch
    /// finished while its waiter spun never needs one).
    pub notify: Option<Arc<Notify>>,
    /// Its place in [`State::deadlines`], if it has a timeout.
    pub deadline: Option<DeadlineKey>,
    /// Its `submit` was dropped before returning the id: nobody can
    /// release it, so it is removed once terminal ([`State::reap`]).
    pub orphaned: bool,
}

impl Batch {
    /// A new batch: no deadline yet, not orphaned.
    pub(crate) fn new(ledger: BatchLedger, targets: Vec<Target>) -> Self {
        Self { ledger, targets, notify: None, deadline: None, orphaned: false }
    }

    /// Wakes the batch's sleeping `wait`s if `p` (what a ledger call
    /// returned) made it terminal.
    pub(crate) fn wake(&self, p: Progress) {
        if p.batch_terminal {
            if let Some(n) = &self.notify {
                n.notify_waiters();
            }
        }
    }
}

/// The QPs peers hold into us, alive while their side channel is open.
#[derive(Debug)]
pub(crate) struct PassiveConn {
    pub qps: Vec<Qp>,
    /// When its QPs were created (async events read before that are not about it).
    pub created: Instant,
    /// The address its side-channel connection came from
    /// (`max_passive_per_ip`).
    pub ip: std::net::IpAddr,
}

/// Work requests of one request that were posted on a QP now in the
/// graveyard: `n` ledger units of request `req` of `batch`, lost once that
/// QP is destroyed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Lost {
    pub batch: BatchId,
    pub req: usize,
    pub n: u64,
}

/// Things to destroy after the lock is released (see [`Inner::with_state`]).
/// Field order is drop order: QPs (ours, then peers') before the regions
/// their work may reach.
#[derive(Debug, Default)]
pub(crate) struct Graveyard {
    pub endpoints: Vec<(EndpointId, Endpoint)>,
    pub passive: Vec<PassiveConn>,
    pub regions: Vec<Registration>,
    /// Orphaned batches removed.
    pub batches: Vec<Batch>,
    /// Units posted on the QPs of `endpoints`: settled (the batch may turn
    /// terminal) only after those QPs are destroyed (rule 5).
    pub lost: Vec<Lost>,
    /// Staging buffers that work posted on the QPs of `endpoints` used:
    /// free again only after those QPs are destroyed.
    pub slots: Vec<u32>,
    /// Copies between device memory and staging buffers to run once the
    /// lock is released.
    pub copies: Vec<crate::stage::StageCopy>,
    /// Staging drivers to start once the lock is released.
    pub drives: Vec<crate::stage::Drive>,
    /// Drivers' work requests lost with the QPs of `endpoints`: told so
    /// once those are destroyed.
    pub waiters: Vec<tokio::sync::oneshot::Sender<Result<()>>>,
}

impl Graveyard {
    pub(crate) fn is_empty(&self) -> bool {
        self.endpoints.is_empty()
            && self.regions.is_empty()
            && self.passive.is_empty()
            && self.batches.is_empty()
            && self.lost.is_empty()
            && self.slots.is_empty()
            && self.copies.is_empty()
            && self.drives.is_empty()
            && self.waiters.is_empty()
    }

    /// Counts one unit of `(batch, req)` lost with a destroyed QP.
    pub(crate) fn lose(&mut self, batch: BatchId, req: usize) {
        match self.lost.iter_mut().find(|l| l.batch == batch && l.req == req) {
            Some(l) => l.n += 1,
            None => self.lost.push(Lost { batch, req, n: 1 }),
        }
    }
}

impl Drop for Graveyard {
    fn drop(&mut self) {
        for (_, ep) in &self.endpoints {
            for q in &ep.qps {
                // Already in ERROR for broken ones; harmless otherwise.
                let _ = q.qp.set_error();
            }
        }
        for p in &self.passive {
            for q in &p.qps {
                let _ = q.set_error();
            }
        }
    }
}

/// Knobs the bookkeeping needs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub max_outstanding_per_qp: usize,
    pub flush_timeout: Duration,
    pub idle_timeout: Duration,
}

#[derive(Debug)]
pub(crate) struct State {
    pub shutdown: bool,
    /// Set on IBV_EVENT_DEVICE_FATAL: the device is gone for good.
    pub device_failed: bool,
    pub verbs: Option<Arc<Verbs>>,
    pub regions: BTreeMap<RegionId, LocalRegion>,
    pub segments: IdMap<SegmentId, Segment>,
    /// The handles that keep a side channel (at most [`MAX_SPARES`]), so
    /// that neither counting nor reaping them walks every handle.
    spared: Vec<SegmentId>,
    /// The bound on endpoints, LRU eviction and idle reclaim; a place is
    /// freed only when [`Inner::with_state`] reports the QPs destroyed.
    pub pool: EndpointPool<SegmentId, IdBuildHasher>,
    /// Endpoints whose QPs exist (live, or broken and flushing).
    pub endpoints: IdMap<EndpointId, Endpoint>,
    pub batches: BatchTable<Batch>,
    /// Deadlines of live batches (one timer, `submit::timer`, drains it);
    /// a batch leaves it when it leaves the table.
    pub deadlines: DeadlineQueue<BatchId>,
    pub wrs: IdMap<WrId, WrRef>,
    pub wr_ids: WrIds,
    pub passive: HashMap<PeerGroupId, PassiveConn>,
    pub passive_tasks: HashMap<PeerGroupId, Task>,
    /// Peer groups being built: places under `max_passive` already taken,
    /// in all and per address.
    pub passive_building: usize,
    pub building_by_ip: HashMap<std::net::IpAddr, usize>,
    /// Notification channels peers hold into us (at most `max_passive`),
    /// in all and per address (at most `max_passive_per_ip`).
    pub passive_notes: usize,
    pub notes_by_ip: HashMap<std::net::IpAddr, usize>,
    /// Unregistered regions whose MR a QP still pins (work was posted on it
    /// through a QP not yet destroyed): dropped here, never by a caller's
    /// future, once no QP holds them ([`State::prune_retiring`]).
    pub retiring: Vec<Registration>,
    /// Pinned host buffers for staged device memory, while any staged
    /// region is registered.
    pub staging: Option<crate::stage::Staging>,
    /// Pinned host buffers peers reach (RDMA) for this side's staged
    /// regions with remote access, and who holds which.
    pub remote_staging: Option<crate::stage::Staging>,
    pub leases: HashMap<u32, crate::stage::Lease>,
    /// Running staging drivers, by id (aborted with the transport).
    pub drivers: HashMap<u64, Task>,
    pub next_driver: u64,
    /// The pool's clock starts here.
    pub epoch: Epoch,
    next_region: u64,
    next_segment: u64,
    next_peer: u64,
    next_note: u64,
}

impl State {
    /// Keeps `spare` on handle `seg` for its first endpoint, in place of
    /// the one it kept; dropped (closed) if the handle is gone or
    /// [`MAX_SPARES`] handles keep one already.
    pub(crate) fn keep_spare(&mut self, seg: SegmentId, spare: crate::wire::Spare) {
        let room = self.spared.len() < MAX_SPARES;
        let Some(s) = self.segments.get_mut(&seg) else { return };
        if s.spare.is_some() {
            s.spare = Some(spare);
        } else if room {
            s.spare = Some(spare);
            self.spared.push(seg);
        }
    }

    /// Takes the side channel handle `seg` keeps, if any.
    pub(crate) fn take_spare(&mut self, seg: SegmentId) -> Option<crate::wire::Spare> {
        let spare = self.segments.get_mut(&seg)?.spare.take();
        if spare.is_some() {
            self.spared.retain(|&id| id != seg);
        }
        spare
    }

    /// Closes kept side channels the peer no longer waits on (older than
    /// half of `limit`, the handshake timeout), and forgets handles closed
    /// since they kept one.
    pub(crate) fn reap_spares(&mut self, limit: std::time::Duration) {
        let segments = &mut self.segments;
        self.spared.retain(|id| match segments.get_mut(id) {
            Some(s) if s.spare.as_ref().is_some_and(|sp| sp.fresh(limit)) => true,
            Some(s) => {
                s.spare = None;
                false
            }
            None => false,
        });
    }

    /// How many handles keep a side channel.
    #[cfg(test)]
    pub(crate) fn spares(&self) -> usize {
        self.spared.len()
    }

    pub(crate) fn new(verbs: Arc<Verbs>, max_endpoints: usize, epoch: Epoch) -> Self {
        Self::with_verbs(Some(verbs), max_endpoints, epoch)
    }

    fn with_verbs(verbs: Option<Arc<Verbs>>, max_endpoints: usize, epoch: Epoch) -> Self {
        Self {
            shutdown: false,
            device_failed: false,
            verbs,
            regions: BTreeMap::new(),
            segments: IdMap::default(),
            spared: Vec::new(),
            pool: EndpointPool::with_hasher(max_endpoints),
            endpoints: IdMap::default(),
            batches: BatchTable::new(),
            deadlines: DeadlineQueue::new(),
            wrs: IdMap::default(),
            wr_ids: WrIds::default(),
            passive: HashMap::new(),
            passive_tasks: HashMap::new(),
            passive_building: 0,
            building_by_ip: HashMap::new(),
            passive_notes: 0,
            notes_by_ip: HashMap::new(),
            retiring: Vec::new(),
            staging: None,
            remote_staging: None,
            leases: HashMap::new(),
            drivers: HashMap::new(),
            next_driver: 0,
            epoch,
            next_region: 0,
            next_segment: 0,
            next_peer: 0,
            next_note: 0,
        }
    }

    /// Moves terminal orphaned batches (their `submit` was dropped) to the
    /// graveyard.
    pub(crate) fn remove_orphans(&mut self, grave: &mut Graveyard) {
        let done: Vec<BatchId> =
            self.batches.iter().filter(|(_, b)| b.orphaned && b.ledger.is_terminal()).map(|(id, _)| *id).collect();
        for id in done {
            grave.batches.extend(self.remove_batch(id));
        }
    }

    /// The caller releases batch `id` (terminal only): it leaves the table
    /// and its deadline leaves the queue.
    pub(crate) fn release_batch(&mut self, id: BatchId) -> Result<Batch> {
        let b = self.batches.release(id, |b| b.ledger.is_terminal())?;
        if let Some(key) = b.deadline {
            self.deadlines.remove(key);
        }
        Ok(b)
    }

    /// Takes batch `id` out of the table and its deadline out of the queue.
    pub(crate) fn remove_batch(&mut self, id: BatchId) -> Option<Batch> {
        let b = self.batches.remove(id)?;
        if let Some(key) = b.deadline {
            self.deadlines.remove(key);
        }
        Some(b)
    }

    /// Moves the retiring regions no QP pins any more to the graveyard
    /// (deregistered there, outside the lock).
    pub(crate) fn prune_retiring(&mut self, grave: &mut Graveyard) {
        if self.retiring.iter().any(|r| !r.pinned()) {
            let (free, pinned) = std::mem::take(&mut self.retiring).into_iter().partition(|r| !r.pinned());
            self.retiring = pinned;
            grave.regions.extend::<Vec<Registration>>(free);
        }
    }

    /// After the QPs of the endpoints `dead` were destroyed: their places
    /// go back to the pool, and the work that was posted on them (`lost`)
    /// ends now, when nothing can touch its memory any more.
    pub(crate) fn after_destroy(&mut self, dead: &[EndpointId], lost: &[Lost]) {
        for &id in dead {
            self.pool.destroyed(id);
        }
        crate::counters::endpoint_event("destroyed", dead.len() as u64);
        if lost.is_empty() {
            return;
        }
        let err = Error::new(ErrorKind::ConnectionReset, "endpoint destroyed with work in flight");
        for l in lost {
            if let Ok(b) = self.batches.get_mut(l.batch) {
                let p = b.ledger.units_lost(l.req, l.n, &err);
                b.wake(p);
            }
        }
    }

    /// Now on the pool's clock.
    pub(crate) fn now(&self) -> Duration {
        self.epoch.now()
    }

    pub(crate) fn new_region_id(&mut self) -> RegionId {
        self.next_region += 1;
        RegionId(self.next_region)
    }

    pub(crate) fn new_segment_id(&mut self) -> SegmentId {
        self.next_segment += 1;
        SegmentId(self.next_segment)
    }

    pub(crate) fn new_note_id(&mut self) -> u64 {
        self.next_note += 1;
        self.next_note
    }

    pub(crate) fn new_peer_id(&mut self) -> PeerGroupId {
        self.next_peer += 1;
        PeerGroupId(self.next_peer)
    }

    /// The descriptor peers see: regions with any remote access.
    pub(crate) fn descriptor(&self, name: &str, generation: u64, address: &str) -> SegmentDescriptor {
        SegmentDescriptor {
            name: name.to_string(),
            backend: crate::BACKEND.into(),
            generation,
            address: address.to_string(),
            regions: self
                .regions
                .values()
                .filter(|r| r.access.is_remote())
                .map(|r| RegionInfo {
                    addr: r.mem.addr(),
                    len: r.mem.len() as u64,
                    access: r.access,
                    // Staged regions have no MR: peers reach them through
                    // the staging buffers.
                    key: r.reg.as_ref().map_or(crate::stage::STAGED_KEY, |reg| u64::from(reg.rkey())),
                })
                .collect(),
        }
    }
}

impl Drop for State {
    /// Dropped without `shutdown`: QPs (ours, then peers') are destroyed
    /// before the regions, so no work request is left posted on a region
    /// being deregistered (each QP also pins the regions it posted on, so
    /// this order is what releases the MRs now rather than memory safety).
    fn drop(&mut self) {
        self.endpoints.clear();
        self.passive_tasks.clear();
        self.passive.clear();
        self.retiring.clear();
        self.regions.clear();
        self.staging = None;
        self.remote_staging = None;
    }
}

/// Everything the transport's handle, its background tasks and its side
/// channel share.
pub(crate) struct Inner {
    pub cfg: RdmaConfig,
    pub lim: Limits,
    pub name: String,
    pub generation: u64,
    /// The device, port and GID, then what `advertise` added.
    pub address: Mutex<String>,
    pub base_address: String,
    pub device: String,
    pub state: Mutex<State>,
    /// Every background task and thread, counted (`stats().tasks`).
    pub tasks: TaskSet,
    /// The tasks that run for the transport's whole life.
    pub fixed: Mutex<Vec<JoinHandle<()>>>,
    /// An earlier deadline entered `State::deadlines` (the timer re-arms).
    pub earlier_deadline: Arc<Notify>,
    /// Held across polling the CQ and applying what was polled; it holds
    /// the buffer the completions are polled into (no allocation per poll).
    pub cq_lock: Mutex<Vec<Completion>>,
    /// Stops the async-event thread.
    pub events_stop: Arc<AtomicBool>,
    pub events_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Notifications received from peers (rule 11): bounded by
    /// `inbox_capacity`, filled by the side-channel servers, closed by
    /// `shutdown`.
    pub inbox: Inbox,
    pub me: Weak<Inner>,
    /// Graveyards with QPs being destroyed on the blocking pool
    /// ([`Inner::with_state`]); `settle` waits for them.
    pub burying: AtomicUsize,
    /// Side-channel connections counted by phase and address (who may
    /// start a handshake, who gives way).
    pub admission: Arc<Mutex<transport_control::admission::Counts>>,
    /// Whom the side channel answers (protected mode without a secret).
    pub exposure: transport_control::access::Exposure,
    /// Refused side-channel connections being answered (bounded).
    pub refusing: AtomicUsize,
}

/// A graveyard buried off the runtime ([`Inner::with_state`]) when dropped.
struct Burial {
    inner: Weak<Inner>,
    grave: Option<Graveyard>,
}

impl Drop for Burial {
    fn drop(&mut self) {
        let Some(grave) = self.grave.take() else { return };
        match self.inner.upgrade() {
            Some(inner) => {
                inner.bury(grave);
                inner.burying.fetch_sub(1, Ordering::SeqCst);
            }
            None => drop(grave),
        }
    }
}

impl Inner {
    /// Runs `f` under the state lock with a graveyard, then (lock released)
    /// destroys what `f` put in it and gives the pool back the places of
    /// the endpoints destroyed: a place is free only once its QPs are gone,
    /// so the kernel's QP count never exceeds the bound.
    ///
    /// `ibv_destroy_qp` blocks its thread (tens of ms in the soft-RoCE VM),
    /// so inside a runtime a graveyard holding QPs is buried on the
    /// blocking pool, never on a worker (see `handshake` for why); the
    /// places come back once it is done, and [`Inner::settle`] waits for
    /// it. Memory registrations alone are deregistered here, before the
    /// caller goes on (`unregister` returns only once they are).
    pub(crate) fn with_state<R>(&self, f: impl FnOnce(&mut State, &mut Graveyard) -> R) -> R {
        let mut grave = Graveyard::default();
        let out = f(&mut self.state.lock(), &mut grave);
        if grave.is_empty() {
            return out;
        }
        let qps = !grave.endpoints.is_empty() || !grave.passive.is_empty();
        match tokio::runtime::Handle::try_current() {
            Ok(rt) if qps => {
                self.burying.fetch_add(1, Ordering::SeqCst);
                let burial = Burial { inner: self.weak(), grave: Some(grave) };
                // Run, or dropped unrun by a runtime shutting down: either
                // way the burial's drop does the work.
                drop(rt.spawn_blocking(move || drop(burial)));
            }
            _ => self.bury(grave),
        }
        out
    }

    /// Destroys what `grave` holds, then gives the pool back the places of
    /// its endpoints and settles the work they lost.
    fn bury(&self, mut grave: Graveyard) {
        let dead: Vec<EndpointId> = grave.endpoints.iter().map(|(id, _)| *id).collect();
        let lost = std::mem::take(&mut grave.lost);
        let slots = std::mem::take(&mut grave.slots);
        let copies = std::mem::take(&mut grave.copies);
        let drives = std::mem::take(&mut grave.drives);
        let waiters = std::mem::take(&mut grave.waiters);
        drop(grave); // ibv_destroy_qp, ibv_dereg_mr: outside the lock
        let lost_wr = Error::new(ErrorKind::ConnectionReset, "endpoint destroyed with work in flight");
        for w in waiters {
            let _ = w.send(Err(lost_wr.clone()));
        }
        if !dead.is_empty() || !lost.is_empty() || !slots.is_empty() {
            self.with_state(|st, g| {
                st.after_destroy(&dead, &lost);
                st.free_slots(slots, &self.lim, g);
            });
        }
        for c in copies {
            self.run_copy(c);
        }
        for d in drives {
            self.start_drive(d);
        }
    }

    pub(crate) fn weak(&self) -> Weak<Inner> {
        self.me.clone()
    }

    pub(crate) fn descriptor(&self) -> SegmentDescriptor {
        let address = self.address.lock().clone();
        self.state.lock().descriptor(&self.name, self.generation, &address)
    }

    pub(crate) fn verbs(&self) -> Result<Arc<Verbs>> {
        self.state.lock().verbs.clone().ok_or_else(Error::shut_down)
    }

    /// Refuses new QPs once the device has failed, or while the port is
    /// not active (asked of the device itself: one query per endpoint
    /// build, never on the data path, and no cached flag to go stale).
    pub(crate) fn link_usable(&self) -> Result<()> {
        let (failed, v) = {
            let st = self.state.lock();
            (st.device_failed, st.verbs.clone())
        };
        if failed {
            return Err(device_failed(&self.device));
        }
        match v.ok_or_else(Error::shut_down)?.ctx.port_active(self.cfg.port) {
            Ok(true) => Ok(()),
            _ => Err(link_down(&self.device, self.cfg.port)),
        }
    }
}

pub(crate) fn link_down(dev: &str, port: u8) -> Error {
    Error::new(
        ErrorKind::ConnectionReset,
        format!("link down: port {port} of {dev} is not active (IBV_EVENT_PORT_ERR); retry when it is back"),
    )
}

pub(crate) fn device_failed(dev: &str) -> Error {
    Error::new(
        ErrorKind::Shutdown,
        format!("RDMA device {dev} failed (IBV_EVENT_DEVICE_FATAL); recreate the transport"),
    )
}

#[cfg(test)]
mod tests;
