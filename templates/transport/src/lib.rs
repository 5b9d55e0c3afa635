//! An in-process transport: the smallest complete backend of kvmove, to
//! copy when you write your own (`docs/WRITING_A_TRANSPORT.md` in the
//! kvmove repository says what to read first).
//!
//! Every node lives in this process and reaches the others through a
//! [`Fabric`] (what the network is to a real backend): a transfer is one
//! memory copy, done by the submitting call. A real backend puts the copy
//! on a wire and reports it from its completion path; the bookkeeping
//! around it stays the same, and that is what this file shows:
//!
//! - `validate_batch` checks a batch before anything moves (rule 9);
//! - a `BatchLedger` per batch holds its one sticky terminal state, and a
//!   request is copied only between `start` and `unit_done`, so a batch
//!   reported terminal has nothing left on the wire (rule 5);
//! - a `BatchTable` hands out the batch ids and forgets released ones;
//! - an `Inbox` bounds the notifications a node holds (rule 11);
//! - every count of [`Transport::stats`] comes from the tables themselves
//!   (rule 1), and `shutdown` empties them.
//!
//! What it does not write: retries, deadlines across attempts, circuit
//! breakers, backpressure (kvmove's policy engine does those for every
//! backend), sessions, rails. `tests/conformance.rs` runs the whole
//! conformance suite on it.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, Weak};
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::{Mutex, MutexGuard, RwLock};
use transport_core::lifecycle::{validate_batch, BatchLedger, BatchLimits, BatchTable, EndReason};
use transport_core::{
    check_notification, fresh_generation, Access, BatchId, BatchStatus, Capabilities, Epoch, Error, ErrorKind, Inbox,
    MemoryRegion, Notification, Opcode, RegionId, RegionInfo, ResourceStats, Result, SegmentDescriptor, SegmentId,
    SubmitOptions, TransferRequest, Transport,
};

/// What one node is started with.
#[derive(Debug, Clone)]
pub struct Config {
    /// The segment name peers open; `None` picks `inproc-<n>`.
    pub name: Option<String>,
    /// Most notifications held until taken (rule 11).
    pub inbox_capacity: usize,
    /// Announced in [`Capabilities::max_endpoints`]. A transfer here needs
    /// no connection, so none is ever held.
    pub max_endpoints: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self { name: None, inbox_capacity: 1024, max_endpoints: 8 }
    }
}

/// The nodes of one process by name. Cloning shares it.
#[derive(Debug, Clone, Default)]
pub struct Fabric {
    inner: Arc<Mutex<FabricInner>>,
}

#[derive(Debug, Default)]
struct FabricInner {
    /// Weak: a node lives as long as its handles do, not as long as the
    /// fabric. Shutdown and drop take the entry out.
    nodes: HashMap<String, Weak<Node>>,
    named: u64,
}

impl Fabric {
    /// An empty fabric.
    pub fn new() -> Self {
        Self::default()
    }

    /// The running node called `name`.
    fn find(&self, name: &str) -> Option<Arc<Node>> {
        self.inner.lock().nodes.get(name).and_then(Weak::upgrade).filter(|n| n.is_live())
    }

    /// Enters a node under its name; a running node of that name is a
    /// `Config` error (a stopped one is replaced: a restart).
    fn join(&self, name: Option<String>, make: impl FnOnce(String) -> Arc<Node>) -> Result<Arc<Node>> {
        let mut inner = self.inner.lock();
        let name = match name {
            Some(n) => n,
            None => {
                inner.named = inner.named.saturating_add(1);
                format!("inproc-{}", inner.named)
            }
        };
        if inner.nodes.get(&name).and_then(Weak::upgrade).is_some_and(|n| n.is_live()) {
            return Err(Error::new(ErrorKind::Config, "a running node already has this name").with("name", name));
        }
        let node = make(name.clone());
        inner.nodes.insert(name, Arc::downgrade(&node));
        Ok(node)
    }

    /// Takes `node`'s entry out (if it is still this node's).
    fn leave(&self, node: &Node) {
        let mut inner = self.inner.lock();
        let mine = inner.nodes.get(&node.name).is_some_and(|w| std::ptr::eq(w.as_ptr(), node));
        if mine {
            inner.nodes.remove(&node.name);
        }
    }
}

/// A registered region. Copies hold `live`'s read lock while bytes move;
/// unregister and shutdown take its write lock, so once they have it no
/// copy runs and none starts (rules 3 and 9).
#[derive(Debug)]
struct Region {
    mem: MemoryRegion,
    access: Access,
    live: RwLock<bool>,
}

impl Region {
    fn retire(&self) {
        *self.live.write() = false;
    }
}

/// What one node holds; everything `stats()` counts lives here.
#[derive(Debug, Default)]
struct State {
    shut: bool,
    next_id: u64,
    regions: HashMap<RegionId, Arc<Region>>,
    /// The same regions by start address, for a peer's lookups.
    by_addr: BTreeMap<u64, Arc<Region>>,
    /// Each open segment with the descriptor it was opened with.
    segments: HashMap<SegmentId, SegmentDescriptor>,
    batches: BatchTable<BatchLedger>,
}

impl State {
    fn next_id(&mut self) -> u64 {
        self.next_id = self.next_id.saturating_add(1);
        self.next_id
    }
}

#[derive(Debug)]
struct Node {
    name: String,
    generation: u64,
    caps: Capabilities,
    /// The node's clock: deadlines are durations since its start.
    epoch: Epoch,
    inbox: Inbox,
    state: Mutex<State>,
}

impl Node {
    fn is_live(&self) -> bool {
        !self.state.lock().shut
    }

    fn now(&self) -> Duration {
        self.epoch.now()
    }

    /// The state of a running node; `Shutdown` after shutdown.
    fn live(&self) -> Result<MutexGuard<'_, State>> {
        let st = self.state.lock();
        if st.shut {
            return Err(Error::shut_down());
        }
        Ok(st)
    }

    /// `Shutdown` after shutdown.
    fn check_live(&self) -> Result<()> {
        self.live().map(drop)
    }

    /// The region that wholly holds `[addr, addr + len)`, as a peer names
    /// it; anything else is `OutOfBounds`.
    fn find_remote(&self, addr: u64, len: u64) -> Result<Arc<Region>> {
        let outside = || {
            Error::new(ErrorKind::OutOfBounds, "the remote range is not inside one registered region")
                .with("remote_addr", format_args!("{addr:#x}"))
                .with("len", len)
        };
        let st = self.state.lock();
        if st.shut {
            return Err(Error::new(ErrorKind::ConnectionReset, "the peer shut down").with("segment", &self.name));
        }
        let (_, r) = st.by_addr.range(..=addr).next_back().ok_or_else(outside)?;
        if r.mem.contains(addr, len) {
            Ok(r.clone())
        } else {
            Err(outside())
        }
    }

    fn descriptor(&self, st: &State) -> SegmentDescriptor {
        let regions = st
            .by_addr
            .values()
            .filter(|r| r.access.is_remote())
            .map(|r| RegionInfo { addr: r.mem.addr(), len: r.mem.len() as u64, access: r.access, key: 0 })
            .collect();
        SegmentDescriptor {
            name: self.name.clone(),
            backend: BACKEND.into(),
            generation: self.generation,
            address: self.name.clone(),
            regions,
        }
    }

    /// Stops the node: every later call fails with `Shutdown`, peers see
    /// it gone, every count returns to zero. `false` if it had stopped.
    fn stop(&self) -> bool {
        let (regions, batches) = {
            let mut st = self.state.lock();
            if st.shut {
                return false;
            }
            st.shut = true;
            st.by_addr.clear();
            st.segments.clear();
            let regions: Vec<_> = st.regions.drain().map(|(_, r)| r).collect();
            (regions, st.batches.drain())
        };
        // Outside the state lock: a copy that holds a region's read lock
        // may be looking this node up as its peer.
        for r in &regions {
            r.retire();
        }
        drop(batches);
        self.inbox.close();
        true
    }
}

const BACKEND: &str = "inproc";

/// One node of a [`Fabric`]: registered memory its peers reach by its
/// segment name, and the initiator of transfers to them.
pub struct InProcTransport {
    node: Arc<Node>,
    fabric: Fabric,
}

impl fmt::Debug for InProcTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InProcTransport").field("name", &self.node.name).finish_non_exhaustive()
    }
}

impl InProcTransport {
    /// Starts a node on `fabric`. Reusing the name of a stopped node is its
    /// restart (a new generation: peers holding its old descriptor get
    /// `PeerRestarted`).
    pub fn new(fabric: &Fabric, config: Config) -> Result<Arc<Self>> {
        if config.inbox_capacity == 0 {
            return Err(Error::new(ErrorKind::Config, "inbox_capacity must be at least 1"));
        }
        let mut caps = Capabilities::new(config.max_endpoints);
        // Device regions are copied through their provider
        // (`MemoryRegion::copy_from`), never through a host pointer.
        caps.device_memory = true;
        caps.device_memory_remote = true;
        let node = fabric.join(config.name, |name| {
            Arc::new(Node {
                name,
                generation: fresh_generation(),
                caps,
                epoch: Epoch::start(),
                inbox: Inbox::new(config.inbox_capacity),
                state: Mutex::new(State::default()),
            })
        })?;
        Ok(Arc::new(Self { node, fabric: fabric.clone() }))
    }

    /// Stops the node as a crash would (the conformance harness's `kill`):
    /// every call fails, peers see it gone. No task runs here, so nothing
    /// it started can still reach a peer.
    pub fn kill(&self) {
        if self.node.stop() {
            self.fabric.leave(&self.node);
        }
    }

    /// Request `req`'s bytes, moved at once: the one unit of its ledger.
    fn copy(&self, req: &TransferRequest, local: &Region, peer: &SegmentDescriptor) -> Result<()> {
        let node = self.fabric.find(&peer.name).ok_or_else(|| {
            Error::new(ErrorKind::ConnectionRefused, "no running node has this name").with("segment", &peer.name)
        })?;
        if node.generation != peer.generation {
            // Rule 2: the request fails (its addresses were the old
            // peer's), and the handle takes the new descriptor, so the
            // caller's next batch, with addresses from it, goes through.
            let fresh = node.descriptor(&node.state.lock());
            let generation = fresh.generation;
            if let Some(d) = self.node.state.lock().segments.get_mut(&req.segment) {
                *d = fresh;
            }
            return Err(Error::new(ErrorKind::PeerRestarted, "the peer restarted since the segment was opened")
                .with("segment", &peer.name)
                .with("generation", generation));
        }
        let remote = node.find_remote(req.remote_addr, req.len)?;
        if !remote.access.allows(req.op) {
            return Err(Error::new(
                ErrorKind::AccessDenied,
                format!("the peer's region does not allow remote {:?}", req.op),
            )
            .with("remote_addr", format_args!("{:#x}", req.remote_addr)));
        }
        // Both regions stay registered while the bytes move.
        let local_live = local.live.read_recursive();
        if !*local_live {
            return Err(Error::region_unregistered(req.local));
        }
        let remote_live = remote.live.read_recursive();
        if !*remote_live {
            return Err(Error::new(ErrorKind::Unregistered, "the peer unregistered the target memory"));
        }
        let too_big = || Error::new(ErrorKind::OutOfBounds, "the range does not fit this machine's address space");
        let remote_offset = req.remote_addr.checked_sub(remote.mem.addr()).ok_or_else(too_big)?;
        let remote_offset = usize::try_from(remote_offset).map_err(|_| too_big())?;
        let local_offset = usize::try_from(req.local_offset).map_err(|_| too_big())?;
        let len = usize::try_from(req.len).map_err(|_| too_big())?;
        match req.op {
            Opcode::Write => remote.mem.copy_from(remote_offset, &local.mem, local_offset, len)?,
            Opcode::Read => local.mem.copy_from(local_offset, &remote.mem, remote_offset, len)?,
        }
        Ok(())
    }

    fn with_batch<T>(&self, id: BatchId, f: impl FnOnce(&mut BatchLedger) -> T) -> Result<T> {
        let mut st = self.node.live()?;
        let ledger = st.batches.get_mut(id)?;
        let _ = ledger.expire(self.node.now());
        Ok(f(ledger))
    }
}

impl Drop for InProcTransport {
    fn drop(&mut self) {
        self.kill();
    }
}

#[async_trait]
impl Transport for InProcTransport {
    fn backend(&self) -> &str {
        BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        self.node.caps.clone()
    }

    fn local_segment_name(&self) -> String {
        self.node.name.clone()
    }

    fn local_descriptor(&self) -> Result<SegmentDescriptor> {
        let st = self.node.live()?;
        Ok(self.node.descriptor(&st))
    }

    /// Rule 9: overlap with a registered region is `AlreadyRegistered`.
    fn register(&self, mem: MemoryRegion, access: Access) -> Result<RegionId> {
        let mut st = self.node.live()?;
        let (start, len) = (mem.addr(), mem.len() as u64);
        if let Some((_, prev)) = st.by_addr.range(..start.saturating_add(len)).next_back() {
            if prev.mem.overlaps(&mem) {
                return Err(Error::new(ErrorKind::AlreadyRegistered, "the memory overlaps a registered region")
                    .with("addr", format_args!("{start:#x}"))
                    .with("len", len));
            }
        }
        let id = RegionId(st.next_id());
        let region = Arc::new(Region { mem, access, live: RwLock::new(true) });
        st.by_addr.insert(start, region.clone());
        st.regions.insert(id, region);
        Ok(id)
    }

    /// Rules 3 and 9: once this returns, no copy touches the region.
    async fn unregister(&self, region: RegionId) -> Result<()> {
        let entry = {
            let mut st = self.node.live()?;
            let entry = st.regions.remove(&region).ok_or_else(|| Error::unknown_region(region))?;
            st.by_addr.remove(&entry.mem.addr());
            entry
        };
        entry.retire();
        Ok(())
    }

    /// Rule 7: a name no running node has is refused (transient: it may
    /// be starting).
    async fn open_segment(&self, name: &str) -> Result<SegmentId> {
        self.node.check_live()?;
        let peer = self.fabric.find(name).ok_or_else(|| {
            Error::new(ErrorKind::ConnectionRefused, "no running node has this name").with("segment", name)
        })?;
        let descriptor = peer.descriptor(&peer.state.lock());
        let mut st = self.node.live()?;
        let id = SegmentId(st.next_id());
        st.segments.insert(id, descriptor);
        Ok(id)
    }

    /// Rule 3: there is no endpoint to close; the handle goes.
    async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        let mut st = self.node.live()?;
        st.segments.remove(&segment).map(drop).ok_or_else(|| Error::unknown_segment(segment))
    }

    fn segment_descriptor(&self, segment: SegmentId) -> Result<SegmentDescriptor> {
        let st = self.node.live()?;
        st.segments.get(&segment).cloned().ok_or_else(|| Error::unknown_segment(segment))
    }

    /// Validates the batch, then copies each request as its ledger allows
    /// (rule 5: past the deadline, what is left ends `TimedOut`).
    async fn submit(&self, requests: Vec<TransferRequest>, opts: SubmitOptions) -> Result<BatchId> {
        let (locals, peers) = {
            let st = self.node.live()?;
            let locals = validate_batch(
                &requests,
                BatchLimits::from(&self.node.caps),
                |id| st.regions.get(&id).map(|r| (r.clone(), r.mem.len() as u64)),
                |seg| st.segments.contains_key(&seg),
            )?;
            let peers = requests
                .iter()
                .map(|r| st.segments.get(&r.segment).cloned().ok_or_else(|| Error::unknown_segment(r.segment)))
                .collect::<Result<Vec<_>>>()?;
            (locals, peers)
        };
        // `None` also past what the clock holds: never.
        let deadline = opts.timeout.and_then(|t| self.node.epoch.after(t));
        let mut ledger = BatchLedger::new(requests.iter().map(|_| 1), deadline);
        for (i, (req, (local, peer))) in requests.iter().zip(locals.iter().zip(&peers)).enumerate() {
            let _ = ledger.expire(self.node.now());
            if ledger.start(i) {
                let result = self.copy(req, local, peer).map_err(|e| e.with("request", i));
                let _ = ledger.unit_done(i, result);
            }
        }
        Ok(self.node.live()?.batches.insert(ledger))
    }

    /// Rule 6: a lookup under a lock held for no I/O.
    fn poll(&self, batch: BatchId) -> Result<BatchStatus> {
        self.with_batch(batch, |l| l.status())
    }

    /// Every batch here is terminal when `submit` returns; a backend with
    /// a wire waits for its completion path (or the deadline) here.
    async fn wait(&self, batch: BatchId) -> Result<BatchStatus> {
        self.with_batch(batch, |l| l.status())
    }

    async fn cancel(&self, batch: BatchId) -> Result<BatchStatus> {
        self.with_batch(batch, |l| {
            let _ = l.end_where(&EndReason::Cancelled, |_| true);
            l.status()
        })
    }

    fn release(&self, batch: BatchId) -> Result<()> {
        let mut st = self.node.live()?;
        st.batches.release(batch, BatchLedger::is_terminal).map(drop)
    }

    /// Rule 1: each count is the size of the table that holds it.
    fn stats(&self) -> ResourceStats {
        let st = self.node.state.lock();
        ResourceStats {
            segments: st.segments.len(),
            regions: st.regions.len(),
            batches: st.batches.len(),
            inflight: st.batches.iter().map(|(_, l)| l.pending()).sum(),
            notifications: self.node.inbox.len(),
            ..ResourceStats::default()
        }
    }

    /// Rule 11: `Ok` once the peer's inbox holds it; a full inbox is
    /// refused (transient), never waited on.
    async fn notify(&self, segment: SegmentId, msg: Vec<u8>) -> Result<()> {
        check_notification(&msg)?;
        let peer = self.segment_descriptor(segment)?.name;
        let node = self.fabric.find(&peer).ok_or_else(|| {
            Error::new(ErrorKind::ConnectionRefused, "no running node has this name").with("segment", &peer)
        })?;
        let note = Notification { from: self.node.name.clone(), msg };
        node.inbox.offer(note).map_err(|refused| refused.into_error().with("segment", &peer))
    }

    fn take_notifications(&self, max: usize) -> Result<Vec<Notification>> {
        self.node.check_live()?;
        Ok(self.node.inbox.take(max))
    }

    async fn wait_notification(&self) -> Result<()> {
        self.node.check_live()?;
        self.node.inbox.wait().await
    }

    /// Rules 1 and 3: nothing runs here after it returns; a second call
    /// is `Ok`.
    async fn shutdown(&self) -> Result<()> {
        self.kill();
        Ok(())
    }
}
