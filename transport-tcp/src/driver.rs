//! The transport's shared state and the I/O it does for the lifecycle
//! core: building, evicting and reclaiming endpoints as the
//! [`EndpointPool`](transport_core::EndpointPool) decides, and making ended
//! requests quiet (resetting the endpoints that carry their slices).

use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::task::JoinHandle;
use transport_core::lifecycle::{reach, BatchTable, EndReason, EndpointId, Reached};
use transport_core::{
    Access, BatchId, Error, ErrorKind, Inbox, RegionInfo, Result, SegmentDescriptor, SegmentId, TransferRequest,
};

use crate::batch::Batch;
use crate::config::TcpConfig;
use crate::deadlines::Deadlines;
use crate::endpoint::{Endpoint, EndpointSlots, EndpointUse, Env};
use crate::lane;
use crate::proto::WireRegion;
use crate::regions::RegionTable;
use crate::server::Server;

/// How often a draining batch is checked for its answers (see
/// [`Inner::quiet`]).
const DRAIN_POLL: Duration = Duration::from_millis(2);
/// The most `drain_timeout`s one drain waits in all, however steadily the
/// target answers.
const DRAIN_ROUNDS: u32 = 8;

/// An open segment handle.
#[derive(Debug)]
pub(crate) struct SegmentEntry {
    pub name: String,
    pub addr: SocketAddr,
    pub desc: SegmentDescriptor,
}

/// Everything a transport owns, shared with its background tasks.
#[derive(Debug)]
pub(crate) struct Inner {
    pub cfg: Arc<TcpConfig>,
    pub local_name: String,
    pub generation: u64,
    pub env: Arc<Env>,
    pub regions: Arc<RegionTable>,
    pub server: Arc<Server>,
    /// Received notifications (rule 11), also the server's.
    pub inbox: Arc<Inbox>,
    pub slots: Arc<EndpointSlots>,
    pub segments: Mutex<HashMap<SegmentId, SegmentEntry>>,
    pub batches: Mutex<BatchTable<Arc<Batch>>>,
    /// Deadlines of live batches, kept by one timer task.
    pub deadlines: Arc<Deadlines<Batch>>,
    pub background: Mutex<Vec<JoinHandle<()>>>,
    pub next_handle: AtomicU64,
    pub shut: AtomicBool,
}

/// Resolves a segment name (`host:port`).
pub(crate) fn resolve(name: &str) -> Result<SocketAddr> {
    name.to_socket_addrs()
        .map_err(|e| {
            Error::new(ErrorKind::NotFound, format!("cannot resolve segment name: {e}")).with("segment", name)
        })?
        .next()
        .ok_or_else(|| Error::new(ErrorKind::NotFound, "segment name resolves to no address").with("segment", name))
}

/// The descriptor of a peer as a client sees it.
pub(crate) fn descriptor(name: &str, addr: SocketAddr, generation: u64, regions: &[WireRegion]) -> SegmentDescriptor {
    SegmentDescriptor {
        name: name.to_owned(),
        backend: "tcp".into(),
        generation,
        address: addr.to_string(),
        regions: regions
            .iter()
            .map(|r| RegionInfo {
                addr: r.addr,
                len: r.len,
                access: Access { remote_read: r.read, remote_write: r.write },
                key: 0,
            })
            .collect(),
    }
}

/// Reclaims idle endpoints on a timer (rule 4).
pub(crate) async fn reaper(inner: Weak<Inner>) {
    loop {
        let tick = match inner.upgrade() {
            Some(i) => (i.cfg.idle_timeout / 4).clamp(Duration::from_millis(10), Duration::from_secs(1)),
            None => return,
        };
        tokio::time::sleep(tick).await;
        let Some(i) = inner.upgrade() else { return };
        i.regions.tidy();
        for ep in i.slots.reap(i.cfg.idle_timeout) {
            tracing::debug!(peer = %ep.name, "reclaiming idle endpoint");
            ep.destroy(Error::new(ErrorKind::ConnectionReset, "idle endpoint reclaimed")).await;
        }
    }
}

/// Reports the build of `id` failed unless disarmed: held from
/// [`Reached::Build`] until the pool hears the outcome, so a build whose
/// caller stopped waiting gives its slot back (the sockets it had opened
/// are closed as the connect future is dropped; no lane task exists yet).
struct BuildGuard<'a> {
    slots: &'a EndpointSlots,
    id: Option<EndpointId>,
}

impl BuildGuard<'_> {
    fn disarm(mut self) {
        self.id = None;
    }
}

impl Drop for BuildGuard<'_> {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            self.slots.build_failed(id);
        }
    }
}

impl Inner {
    pub fn check_open(&self) -> Result<()> {
        if self.shut.load(Ordering::Acquire) {
            Err(Error::shut_down())
        } else {
            Ok(())
        }
    }

    pub fn handle(&self) -> u64 {
        self.next_handle.fetch_add(1, Ordering::Relaxed)
    }

    /// A live endpoint to `name` and one counted use of it, built if
    /// needed, within the bound (rule 4). At the bound an idle endpoint is
    /// evicted (destroyed before its slot is reused); if none can be, the
    /// caller waits up to `connect_timeout`, then gets `ResourceExhausted`.
    pub async fn endpoint(&self, name: &str, addr: SocketAddr) -> Result<(Arc<Endpoint>, EndpointUse)> {
        let key = name.to_owned();
        loop {
            let reached = reach(
                name,
                self.cfg.max_endpoints,
                self.cfg.connect_timeout,
                || {
                    self.check_open()?;
                    Ok(self.slots.acquire(&key))
                },
                |ep: Arc<Endpoint>| async move {
                    tracing::debug!(peer = %ep.name, "evicting endpoint at the bound");
                    ep.destroy(Error::new(ErrorKind::ConnectionReset, "endpoint evicted")).await;
                },
                || self.slots.changed(Duration::from_millis(5)),
            )
            .await?;
            let id = match reached {
                Reached::Use(ep) => {
                    let using = ep.new_use();
                    return Ok((ep, using));
                }
                Reached::Build(id) => id,
            };
            // From here until the pool hears `built` or `build_failed`, a
            // dropped caller (a timeout around submit, a select!, an aborted
            // task) must not leave the slot reserved: the guard reports the
            // build failed.
            let guard = BuildGuard { slots: &self.slots, id: Some(id) };
            let ep = lane::connect(id, name, addr, &self.env, Arc::downgrade(&self.slots)).await?;
            guard.disarm();
            // No await between connect returning and `built`: the endpoint
            // is either handed to the pool or destroyed below (its teardown
            // frees the slot).
            let using = ep.new_use();
            if !self.slots.built(id, &ep) || self.check_open().is_err() {
                drop(using);
                ep.destroy(Error::shut_down()).await;
                self.check_open()?;
                continue;
            }
            return Ok((ep, using));
        }
    }

    /// Checks that `ep` (to the peer of `segment`) is the generation the
    /// handle's descriptor has. A new generation means the peer restarted:
    /// the handle's descriptor is refreshed (the stale one is never used
    /// again) and this use fails with the transient `PeerRestarted`. A
    /// handle closed meanwhile is `Cancelled`.
    pub fn check_generation(&self, segment: SegmentId, name: &str, ep: &Endpoint) -> Result<()> {
        let mut segs = self.segments.lock();
        match segs.get_mut(&segment) {
            None => Err(Error::new(ErrorKind::Cancelled, "segment closed during the call")),
            Some(s) if s.desc.generation != ep.generation => {
                let old = s.desc.generation;
                s.desc = descriptor(name, ep.addr, ep.generation, &ep.regions);
                Err(Error::new(ErrorKind::PeerRestarted, "the peer restarted; its descriptor was refreshed")
                    .with("peer", name)
                    .with("old_generation", old)
                    .with("generation", ep.generation))
            }
            Some(_) => Ok(()),
        }
    }

    /// Ends the live requests of `batch` that `pick` selects, then makes
    /// the batch quiet (see [`Inner::quiet`]).
    pub async fn end_requests(
        &self,
        batch: &Arc<Batch>,
        reason: EndReason,
        pick: impl FnMut(&TransferRequest) -> bool,
    ) {
        let _ = batch.end(&reason, pick);
        self.quiet(batch).await;
    }

    /// Makes the ended requests of `batch` quiet: if none is live its
    /// queued work is dropped; the started slices of ended requests get
    /// `drain_timeout` to be answered; every endpoint that still carries one
    /// then is destroyed (its sockets reset), so nothing of theirs is read,
    /// written or applied afterwards and the ledger can report them.
    pub async fn quiet(&self, batch: &Arc<Batch>) {
        if batch.is_terminal() {
            return;
        }
        let eps = self.slots.built_where(|e| batch.peers.contains(&e.name));
        if !batch.any_live() {
            for ep in &eps {
                ep.unqueue(batch);
            }
        }
        if batch.on_wire() == 0 {
            return;
        }
        // Drain first: the target answers a slice only once its bytes are
        // applied (into device memory: once the provider's copy finished),
        // so the slices that answer within `drain_timeout` end with no copy
        // left running at the target, and their endpoints live on. A reset
        // alone stops the socket, not a copy the target already started.
        // `drain_timeout` is how long the target may stay silent: every
        // answer starts it again (a target working through a queue of slow
        // device copies is drained, not reset under its last copy), up to
        // `DRAIN_ROUNDS` of them in all (a peer answering just slower than
        // that is reset all the same).
        let start = tokio::time::Instant::now();
        let cap = start + self.cfg.drain_timeout.saturating_mul(DRAIN_ROUNDS);
        let mut until = start + self.cfg.drain_timeout;
        let mut left = usize::MAX;
        loop {
            let now = tokio::time::Instant::now();
            let carried: usize = eps.iter().map(|ep| ep.ended_carried(batch)).sum();
            if carried == 0 || now >= until {
                break;
            }
            if carried < left {
                left = carried;
                until = (now + self.cfg.drain_timeout).min(cap);
            }
            tokio::time::sleep(DRAIN_POLL).await;
        }
        // Every reset is started before any is awaited, so a caller that
        // stops waiting leaves none undone (and they proceed together).
        let doomed: Vec<Arc<Endpoint>> = eps.into_iter().filter(|ep| ep.carries_ended(batch)).collect();
        let err = |ep: &Endpoint| {
            Error::new(ErrorKind::ConnectionReset, "endpoint reset to end a batch").with("peer", &ep.name)
        };
        for ep in &doomed {
            ep.begin_destroy(err(ep));
        }
        for ep in &doomed {
            ep.destroy(err(ep)).await;
        }
    }

    /// Retires every endpoint to `name` and returns once all of them are
    /// destroyed: built ones are destroyed here (or by the destroyer
    /// already at work), one being built is destroyed by its builder (or
    /// freed if its caller went away); bounded by how long a build can
    /// take.
    pub async fn retire_peer(&self, name: &str, err: Error) {
        let (eps, ids) = self.slots.retire_key_all(&name.to_owned());
        for ep in &eps {
            ep.begin_destroy(err.clone());
        }
        for ep in &eps {
            ep.destroy(err.clone()).await;
        }
        let lanes = u32::try_from(self.cfg.lanes).unwrap_or(u32::MAX).saturating_add(1);
        let bound = self.cfg.connect_timeout.saturating_mul(lanes.saturating_mul(2));
        let give_up = tokio::time::Instant::now() + bound;
        while !self.slots.all_gone(&ids) && tokio::time::Instant::now() < give_up {
            self.slots.changed(Duration::from_millis(5)).await;
        }
    }

    pub fn batch(&self, id: BatchId) -> Result<Arc<Batch>> {
        self.batches.lock().get(id).cloned()
    }

    /// Every batch not yet terminal.
    pub fn running(&self) -> Vec<Arc<Batch>> {
        self.batches.lock().iter().map(|(_, b)| b).filter(|b| !b.is_terminal()).cloned().collect()
    }
}

/// Held by `submit` from the moment its batch is in the table until the id
/// is returned. If the submit future is dropped in between (a caller's
/// timeout while an endpoint is being built), nobody can cancel or release
/// the batch: the guard cancels it, makes it quiet and removes it from the
/// table once terminal (rules 1 and 5), in a counted task.
#[derive(Debug)]
pub(crate) struct AbandonedSubmit {
    inner: Weak<Inner>,
    id: BatchId,
    batch: Arc<Batch>,
    armed: bool,
}

impl AbandonedSubmit {
    pub fn new(inner: Weak<Inner>, id: BatchId, batch: Arc<Batch>) -> Self {
        Self { inner, id, batch, armed: true }
    }

    /// The submit returned the id: the caller owns the batch now.
    pub fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for AbandonedSubmit {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Some(inner) = self.inner.upgrade() else { return };
        let (weak, id, batch) = (self.inner.clone(), self.id, self.batch.clone());
        if tokio::runtime::Handle::try_current().is_err() {
            // No runtime to quiet it on: end what can be ended; the table
            // goes with the transport.
            batch.end(&EndReason::Cancelled, |_| true);
            return;
        }
        inner.env.tasks.spawn(async move {
            if let Some(inner) = weak.upgrade() {
                inner.end_requests(&batch, EndReason::Cancelled, |_| true).await;
            }
            batch.wait_terminal().await;
            if let Some(inner) = weak.upgrade() {
                inner.batches.lock().remove(id);
            }
        });
    }
}

/// The transport's timer: sleeps until the earliest deadline (or until an
/// earlier one is entered) and expires what is due, each batch quieted in
/// a task of its own so one slow quiet never delays another deadline.
/// Ends with the transport.
pub(crate) async fn timer(weak: Weak<Inner>) {
    loop {
        let Some(inner) = weak.upgrade() else { return };
        let deadlines = inner.deadlines.clone();
        let earlier = deadlines.earlier.notified();
        tokio::pin!(earlier);
        earlier.as_mut().enable();
        let (due, next) = deadlines.due(inner.slots.now());
        for (at, batch) in due {
            let w = weak.clone();
            inner.env.tasks.spawn(async move {
                let Some(i) = w.upgrade() else { return };
                batch.expire(i.slots.now().max(at));
                i.quiet(&batch).await;
            });
        }
        let epoch = inner.slots.epoch();
        drop(inner);
        epoch.sleep_until_or(next, earlier).await;
    }
}
