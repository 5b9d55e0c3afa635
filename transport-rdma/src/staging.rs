//! Device (GPU) memory: GPUDirect where the stack allows it, staging
//! through pinned host buffers where it does not.
//!
//! `register` tries, in order: a dma-buf exported by the region's provider
//! registered with `ibv_reg_dmabuf_mr` ([`MemPath::DmaBuf`]); plain
//! `ibv_reg_mr` on the device address, which a peer-memory module
//! (`nvidia_peermem`) makes work ([`MemPath::PeerMemory`]); otherwise the
//! region is *staged* ([`MemPath::Staged`]): it gets no MR, and each slice
//! of a transfer passes through one of [`RdmaConfig::staging_buffers`]
//! pinned host buffers registered once: device to buffer (the provider's
//! copy) then RDMA WRITE from the buffer; RDMA READ into the buffer then
//! buffer to device. Slices of several requests and endpoints are in
//! different phases at once, so copies overlap the wire.
//!
//! A staged region with remote access is in the descriptor with the key
//! [`STAGED_KEY`] (no rkey). An initiator's requests into it go to a
//! *driver* (one task per batch and segment, [`WINDOW`] slices at a time)
//! instead of the endpoint's queue: for each slice it leases one of the
//! target's pinned staging buffers over the notification channel
//! (`stage`; for a read the target first copies the range into it),
//! moves the slice by RDMA into or out of that buffer (from or to its own
//! memory, itself staged if it is device memory), and gives the buffer back
//! (`unstage`; for a write the target copies the buffer into its device
//! memory first). Leases belong to the channel: its close frees them, and
//! the target checks every range against its staged regions and their
//! access. By default a lease is answered with the key of the pool's
//! registration ([`Reach::Pool`]: it reaches the whole pool). With
//! `staging_windows` each lease is answered with the key of a memory
//! window of its own, bound to the leased bytes only and only the way
//! leased, and deallocated when the lease ends, before a committing copy
//! (the pool's own registration is local: [`Reach::Windows`]); a device
//! without windows then falls back to the pool's registration (logged).
//! The slice's ledger unit ends only after the last answer.
//!
//! Copies run on the blocking pool, never under the state lock; each is a
//! started ledger unit from before it begins until its slice is done, so a
//! request that ends (cancel, deadline, unregister) becomes terminal only
//! after its copies are over (rule 5: terminal means quiet). A failed copy
//! ends its request with the transient `Io` error of the provider. A
//! staging buffer is free again when the work request that used it has
//! completed or its QP is destroyed, and after the copy that drains it.
//! The buffers are allocated with the first staged region and freed with
//! the last (counted in `stats().staging_bytes`).
//!
//! [`RdmaConfig::staging_buffers`]: crate::RdmaConfig::staging_buffers

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;
use transport_core::lifecycle::{EndReason, EndpointId};
use transport_core::{
    Access, Error, ErrorKind, MemError, MemoryRegion, Opcode, RegionId, Result, SegmentId, TransferRequest,
};

pub(crate) use crate::counters::count_path;
pub(crate) use crate::stage::{no_staging, CopyDir, Drive, Lease, MemPath, Reach, StageCopy, Staging, STAGED_KEY};
use crate::state::{Graveyard, Inner, Limits, PeerGroupId, Slice, State, WrRef};
use crate::verbs::{Binder, Pd, Registration, Window, WorkRequest};
use crate::wire::{Reply, Request};

/// Staged slices a driver has in flight at once.
const WINDOW: usize = 4;
/// Longest pause between asking a busy peer for a staging buffer again.
const BUSY_BACKOFF_MAX: Duration = Duration::from_millis(20);

impl State {
    /// Buffers free again; endpoints waiting for one post now.
    pub(crate) fn free_slots(&mut self, slots: Vec<u32>, lim: &Limits, grave: &mut Graveyard) {
        if slots.is_empty() {
            return;
        }
        if let Some(s) = self.staging.as_mut() {
            s.free.extend(slots);
        }
        self.pump_waiting(lim, grave);
        self.release_staging();
    }

    /// Offers free buffers to the endpoints that ran out of them.
    pub(crate) fn pump_waiting(&mut self, lim: &Limits, grave: &mut Graveyard) {
        let waiting = match self.staging.as_mut() {
            Some(s) if !s.free.is_empty() && !s.waiting.is_empty() => std::mem::take(&mut s.waiting),
            _ => return,
        };
        for ep in waiting {
            self.after_work(ep, lim, grave);
        }
    }

    /// A copy ended with `result`: a filled buffer is queued for its WRITE,
    /// a drained one is free and its slice done; a failure, or a request or
    /// endpoint that ended meanwhile, gives the buffer back at once.
    pub(crate) fn after_copy(&mut self, c: StageCopy, result: Result<()>, lim: &Limits, grave: &mut Graveyard) {
        let live_ep = match self.endpoints.get_mut(&c.ep) {
            Some(ep) => {
                ep.copying = ep.copying.saturating_sub(1);
                ep.broken_at.is_none()
            }
            None => false,
        };
        let req_live = self.batches.get(c.slice.batch).is_ok_and(|b| b.ledger.is_live(c.slice.req));
        let outcome = match (c.dir, result) {
            (_, Err(e)) => Some(Err(e)),
            (CopyDir::FromBuffer, Ok(())) => Some(Ok(())),
            (CopyDir::ToBuffer, Ok(())) if live_ep && req_live => {
                if let Some(ep) = self.endpoints.get_mut(&c.ep) {
                    ep.ready.push_back((c.slice, c.slot));
                }
                None
            }
            (CopyDir::ToBuffer, Ok(())) if req_live => {
                Some(Err(Error::new(ErrorKind::ConnectionReset, "endpoint broke while a slice was staged")))
            }
            // Ended meanwhile: the slice goes nowhere.
            (CopyDir::ToBuffer, Ok(())) => {
                if let Ok(b) = self.batches.get_mut(c.slice.batch) {
                    let p = b.ledger.unit_back(c.slice.req);
                    b.wake(p);
                }
                self.free_slots(vec![c.slot], lim, grave);
                self.after_work(c.ep, lim, grave);
                return;
            }
        };
        if let Some(result) = outcome {
            if let Ok(b) = self.batches.get_mut(c.slice.batch) {
                let p = b.ledger.unit_done(c.slice.req, result);
                b.wake(p);
            }
            self.free_slots(vec![c.slot], lim, grave);
        }
        self.after_work(c.ep, lim, grave);
    }

    /// Fails the staged writes waiting on endpoint `ep_id` (it broke or
    /// goes): their buffers were never posted, so they are free at once.
    pub(crate) fn drop_ready(&mut self, ep_id: EndpointId, why: &Error) {
        let Some(ep) = self.endpoints.get_mut(&ep_id) else { return };
        let ready: Vec<(Slice, u32)> = ep.ready.drain(..).collect();
        let mut slots = Vec::with_capacity(ready.len());
        for (s, slot) in ready {
            if let Ok(b) = self.batches.get_mut(s.batch) {
                let p = b.ledger.unit_done(s.req, Err(why.clone()));
                b.wake(p);
            }
            slots.push(slot);
        }
        if let Some(st) = self.staging.as_mut() {
            st.free.extend(slots);
        }
        self.release_staging();
    }

    /// Whether any registered region is staged.
    fn any_staged(&self) -> bool {
        self.regions.values().any(|r| r.path == MemPath::Staged)
    }

    /// Frees the staging buffers once no staged region is left and every
    /// buffer is back (a copy or work request of an ended request may
    /// still hold one: its index must never land in a newer pool). The QPs
    /// that posted on them keep the registration until they are destroyed.
    pub(crate) fn release_staging(&mut self) {
        let staged = self.any_staged();
        if !staged && self.staging.as_ref().is_some_and(Staging::all_back) {
            if let Some(s) = self.staging.take() {
                self.retiring.extend(s.into_registrations());
            }
        }
        let exposed = self.regions.values().any(|r| r.path == MemPath::Staged && r.access.is_remote());
        if !exposed && self.leases.is_empty() && self.remote_staging.as_ref().is_some_and(Staging::all_back) {
            if let Some(s) = self.remote_staging.take() {
                self.retiring.extend(s.into_registrations());
            }
        }
    }

    /// Whether a copy between a peer's leased buffer and `region`'s memory
    /// is running (unregister waits for none).
    pub(crate) fn staging_into(&self, mem: &MemoryRegion) -> bool {
        self.leases.values().any(|l| l.copying && mem.contains(l.addr, u64::from(l.len)))
    }
}

/// How device memory `mem` is registered: GPUDirect (dma-buf, then by
/// address) or staged; a staged region with remote access is refused.
pub(crate) fn register_device(
    pd: &Arc<Pd>,
    mem: &MemoryRegion,
    access: Access,
) -> Result<(Option<Registration>, MemPath)> {
    let (read, write) = (access.remote_read, access.remote_write);
    let mut why = Vec::new();
    match mem.export_dmabuf() {
        Ok(Some(buf)) => match Registration::new_dmabuf(pd, mem.clone(), &buf, read, write) {
            Ok(reg) => return Ok((Some(reg), MemPath::DmaBuf)),
            Err(e) => why.push(e.to_string()),
        },
        Ok(None) => why.push("the provider exports no dma-buf".to_string()),
        Err(e) => why.push(format!("dma-buf export: {e}")),
    }
    match Registration::new(pd, mem.clone(), read, write) {
        Ok(reg) => return Ok((Some(reg), MemPath::PeerMemory)),
        Err(e) => why.push(format!("{e} (no peer-memory module)")),
    }
    let why = why.join("; ");
    tracing::info!(kind = %mem.kind(), len = mem.len(), why = %why, "rdma: device memory staged through host buffers");
    Ok((None, MemPath::Staged))
}

impl Inner {
    /// The staging buffers, made with the first staged region (and the
    /// pool peers reach, with the first one they may reach), pinned for
    /// that region's provider.
    pub(crate) fn ensure_staging(&self, st: &mut State, pd: &Arc<Pd>, mem: &MemoryRegion, remote: bool) -> Result<()> {
        let (slots, len, provider) = (self.cfg.staging_buffers, self.cfg.slice_size, mem.provider());
        if st.staging.is_none() {
            st.staging = Some(Staging::new(pd, slots, len, Reach::Local, provider)?);
        }
        if remote && st.remote_staging.is_none() {
            let reach = self.remote_reach(st);
            st.remote_staging = Some(Staging::new(pd, slots, len, reach, provider)?);
        }
        Ok(())
    }

    /// How peers reach the pool they lease from: with `staging_windows`,
    /// through a memory window per lease where the device has them, else
    /// through the pool's one registration (logged where windows were
    /// asked for: a lease's key then reaches the whole pool).
    fn remote_reach(&self, st: &State) -> Reach {
        if !self.cfg.staging_windows {
            return Reach::Pool;
        }
        let Some(v) = st.verbs.as_ref() else { return Reach::Pool };
        match Window::new(&v.pd).and_then(|_| Binder::new(&v.ctx, &v.pd, &v.port, self.timing())) {
            Ok(b) => Reach::Windows(Arc::new(parking_lot::Mutex::new(b))),
            Err(e) => {
                tracing::warn!(
                    error = %e,
                    "rdma: no memory windows on this device: peers reach the staging buffers through one \
                     registration (the key of a lease reaches every buffer of the pool while it lives)"
                );
                Reach::Pool
            }
        }
    }

    /// Runs `c` on the blocking pool (inline without a runtime), then
    /// applies its outcome.
    pub(crate) fn run_copy(&self, c: StageCopy) {
        let weak = self.weak();
        let work = move || {
            let result = c.run();
            if let Some(inner) = weak.upgrade() {
                inner.with_state(|st, g| st.after_copy(c, result, &inner.lim, g));
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn_blocking(work)),
            Err(_) => work(),
        }
    }
}

/// What a driver's work request moves locally.
#[derive(Debug, Clone, Copy)]
enum Local {
    /// This side's staging buffer.
    Slot(u32),
    /// A registered region, at an offset.
    Region(RegionId, u64),
}

fn stage_failed(e: &Error) -> Reply {
    match Reply::bounded_error(e) {
        Reply::Error { message } => Reply::StageFailed { kind: e.kind().as_str().to_string(), message },
        other => other,
    }
}

/// The error a peer's `stage_failed` stands for.
fn peer_stage_error(kind: &str, message: &str) -> Error {
    let kind = match kind {
        "io" => ErrorKind::Io,
        "out_of_bounds" => ErrorKind::OutOfBounds,
        "access_denied" => ErrorKind::AccessDenied,
        "unregistered" => ErrorKind::Unregistered,
        "invalid_request" => ErrorKind::InvalidRequest,
        _ => ErrorKind::Protocol,
    };
    Error::new(kind, format!("the peer's staging: {message}"))
}

fn ended() -> Error {
    Error::new(ErrorKind::Cancelled, "the request ended while its slice was staged")
}

/// Runs a copy on the blocking pool.
async fn off_runtime(f: impl FnOnce() -> std::result::Result<(), MemError> + Send + 'static) -> Result<()> {
    blocking(move || f().map_err(Error::from)).await
}

/// How long one step of a staged slice (the lease, the work request, the
/// unstage) may take before it is logged: each is bounded otherwise
/// (`handshake_timeout_ms`, the QP's retries), so one past this is a peer
/// or a QP that stopped answering without failing.
const STEP_LOGGED_AFTER: Duration = Duration::from_secs(10);

/// Runs `f`, step `what` of slice `s`, logging at warn if it takes longer
/// than [`STEP_LOGGED_AFTER`] (and again when it ends).
async fn watched<T>(what: &str, s: Slice, f: impl std::future::Future<Output = T>) -> T {
    let mut f = std::pin::pin!(f);
    let from = std::time::Instant::now();
    match tokio::time::timeout(STEP_LOGGED_AFTER, &mut f).await {
        Ok(v) => v,
        Err(_) => {
            tracing::warn!(slice = ?s, step = what, "rdma: a staged slice's step has taken 10 s");
            let v = f.await;
            tracing::warn!(slice = ?s, step = what, took_ms = from.elapsed().as_millis() as u64, "rdma: the slow staged step ended");
            v
        }
    }
}

/// Runs `f` (copies, binds, deallocations) on the blocking pool.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r,
        Err(_) => Err(Error::new(ErrorKind::Internal, "a staging copy did not finish")),
    }
}

/// Takes a remote staging buffer for `chan`: `Ok(None)` when none is free.
fn lease(st: &mut State, chan: PeerGroupId, write: bool, addr: u64, len: u32) -> Result<Option<Leased>> {
    if len == 0 {
        return Err(Error::new(ErrorKind::InvalidRequest, "an empty staging request"));
    }
    let r =
        st.regions.values().find(|r| r.path == MemPath::Staged && r.mem.contains(addr, u64::from(len))).ok_or_else(
            || Error::new(ErrorKind::OutOfBounds, format!("{len} bytes at {addr:#x} are in no staged region")),
        )?;
    if !(if write { r.access.remote_write } else { r.access.remote_read }) {
        return Err(Error::new(ErrorKind::AccessDenied, "the staged region does not allow this"));
    }
    let device = r.mem.clone();
    let at = usize::try_from(addr - r.mem.addr()).map_err(|_| Error::new(ErrorKind::OutOfBounds, "offset"))?;
    let held = st.leases.values().filter(|l| l.chan == chan).count();
    let pool = st.remote_staging.as_mut().ok_or_else(no_staging)?;
    if len > pool.slot_len {
        return Err(Error::new(
            ErrorKind::InvalidRequest,
            format!("{len} bytes exceed a staging buffer ({}): the peer's slice_size is larger", pool.slot_len),
        ));
    }
    // One channel holds at most its share of the pool, so a peer (even
    // one with the secret) that leases without giving back cannot take
    // every buffer from the others: past it, `busy`, as for an empty pool.
    if held >= leases_per_channel(pool.slots) {
        return Ok(None);
    }
    let Some(slot) = pool.free.pop() else { return Ok(None) };
    let buffer = match pool.slot_mem(slot, len) {
        Ok(b) => b,
        Err(e) => {
            pool.free.push(slot);
            return Err(e);
        }
    };
    let addr_of = pool.reg.mem().addr() + pool.offset(slot);
    let (rkey, window) = match (&pool.reach, pool.windows.get(slot as usize)) {
        (Reach::Windows(b), Some(reg)) => (0, Some((b.clone(), reg.share()))),
        (Reach::Windows(_), None) => {
            pool.free.push(slot);
            return Err(Error::new(ErrorKind::Internal, format!("staging buffer {slot} has no registration")));
        }
        (Reach::Pool | Reach::Local, _) => (pool.reg.rkey(), None),
    };
    // Busy (the channel's close leaves it to `stage`) until filled for a
    // read and its window bound.
    let copying = !write || window.is_some();
    st.leases.insert(slot, Lease { chan, write, addr, len, copying, window: None });
    Ok(Some(Leased { slot, buffer, device, at, addr: addr_of, rkey, window }))
}

/// The most remote staging buffers one notification channel may hold at
/// once: half the pool (rounded up; the whole of a pool of one), so one
/// channel that never gives leases back leaves the rest to the others.
/// With the default pool (16) a lone peer still has [`WINDOW`] slices in
/// flight for two drivers; a third staged batch to the same target at
/// once waits (`busy`, retried) for one of theirs.
pub(crate) fn leases_per_channel(slots: u32) -> usize {
    (slots as usize).div_ceil(2).max(1)
}

/// A remote staging buffer just leased.
struct Leased {
    slot: u32,
    buffer: MemoryRegion,
    device: MemoryRegion,
    at: usize,
    addr: u64,
    /// The pool's key ([`Reach::Pool`]); with windows, the window's.
    rkey: u32,
    /// What the lease's window is bound with: the binder and the
    /// buffer's registration ([`Reach::Windows`]).
    window: Option<(Arc<parking_lot::Mutex<Binder>>, Registration)>,
}

impl State {
    /// Gives remote staging buffer `slot` back. Returns the lease's
    /// window, for the caller to drop once the state lock is released
    /// (`ibv_dealloc_mw`: from then on its key reaches nothing).
    #[must_use = "the lease's window is deallocated when dropped, outside the lock"]
    fn end_lease(&mut self, slot: u32) -> Option<Window> {
        let window = self.leases.remove(&slot).and_then(|l| {
            if let Some(p) = self.remote_staging.as_mut() {
                p.free.push(slot);
            }
            l.window
        });
        self.release_staging();
        window
    }

    /// Posts a driver's work request on endpoint `ep` if a QP has room
    /// (`Ok(None)` if none has): its outcome comes on the receiver.
    #[allow(clippy::too_many_arguments)]
    fn post_for_driver(
        &mut self,
        ep_id: EndpointId,
        s: Slice,
        local: Local,
        remote_addr: u64,
        rkey: u32,
        read: bool,
        lim: &Limits,
        grave: &mut Graveyard,
    ) -> Result<Option<oneshot::Receiver<Result<()>>>> {
        // Rule 5: nothing is posted for a request that ended (cancel,
        // deadline, unregister) while its slice waited for the peer's
        // lease. Checked under the state lock that `State::end_requests`
        // takes, which breaks the endpoints of what is already posted: the
        // slice's work is either posted before the end (and flushed by
        // it) or never. Without this check, a lease answered just after a
        // cancel could put a WRITE on a stalled link that nothing flushed,
        // the cancel waiting on it until the QP's retries ran out, and its
        // bytes could land after the cancel (the likely cause of
        // rdma_rails2::device_h2d::deadline::cancel_in_flight_ends passing
        // 40 s in ci22, ci34 and ci37).
        if !self.batches.get(s.batch).is_ok_and(|b| b.ledger.is_live(s.req)) {
            return Err(ended());
        }
        let ep = self
            .endpoints
            .get_mut(&ep_id)
            .filter(|e| e.broken_at.is_none())
            .ok_or_else(|| Error::new(ErrorKind::ConnectionReset, "the endpoint broke while a slice was staged"))?;
        let n = ep.qps.len();
        let Some(qi) =
            (0..n).map(|k| (ep.next_qp + k) % n).find(|&i| ep.qps[i].outstanding < lim.max_outstanding_per_qp)
        else {
            return Ok(None);
        };
        let (reg, local_offset) = match local {
            Local::Slot(slot) => {
                let st = self.staging.as_ref().ok_or_else(no_staging)?;
                (&st.reg, st.offset(slot))
            }
            Local::Region(id, off) => {
                let r = self.regions.get(&id).ok_or_else(|| Error::region_unregistered(id))?;
                (r.reg.as_ref().ok_or_else(no_staging)?, off)
            }
        };
        let wr_id = self.wr_ids.next();
        let wr = WorkRequest { wr_id: wr_id.0, read, local_offset, len: s.len, remote_addr, rkey };
        ep.next_qp = (qi + 1) % n;
        let q = &mut ep.qps[qi];
        match q.qp.post(reg, &wr) {
            Ok(()) => {
                q.outstanding += 1;
                let (tx, rx) = oneshot::channel();
                self.wrs.insert(wr_id, WrRef { ep: ep_id, qp: qi, slice: s, slot: None, waiter: Some(tx) });
                Ok(Some(rx))
            }
            Err(e) => {
                let e: Error = e.into();
                let e = Error::new(ErrorKind::ConnectionReset, e.message().to_string());
                self.break_endpoint(ep_id, e.clone(), grave);
                Err(e)
            }
        }
    }
}

impl Inner {
    /// Serves a peer's `stage`: leases a buffer for `addr .. addr + len`
    /// of a staged region (for a read, filled from the device first).
    pub(crate) async fn stage(&self, chan: PeerGroupId, write: bool, addr: u64, len: u32) -> Reply {
        let taken = {
            let mut g = self.state.lock();
            lease(&mut g, chan, write, addr, len)
        };
        let l = match taken {
            Ok(Some(l)) => l,
            Ok(None) => return Reply::Busy,
            Err(e) => return stage_failed(&e),
        };
        if write && l.window.is_none() {
            return Reply::Staged { slot: l.slot, addr: l.addr, rkey: l.rkey };
        }
        // For a read, the range into the buffer; then the lease's window,
        // bound only to the leased bytes and only the way leased.
        let (buffer, device, at, bind) = (l.buffer, l.device, l.at, l.window);
        let made = blocking(move || {
            if !write {
                buffer.copy_from(0, &device, at, len as usize)?;
            }
            match bind {
                Some((binder, reg)) => Ok(Some(binder.lock().window(&reg, 0, len, write)?)),
                None => Ok(None),
            }
        })
        .await;
        let mut st = self.state.lock();
        let window = match made {
            Ok(w) => w,
            Err(e) => {
                let gone = st.end_lease(l.slot);
                drop(st);
                drop(gone);
                return stage_failed(&e);
            }
        };
        let rkey = window.as_ref().map_or(l.rkey, Window::rkey);
        match st.leases.get_mut(&l.slot) {
            Some(lease) => {
                lease.copying = false;
                lease.window = window;
                Reply::Staged { slot: l.slot, addr: l.addr, rkey }
            }
            // Ended meanwhile (shutdown): the window goes.
            None => {
                drop(st);
                drop(window);
                stage_failed(&Error::shut_down())
            }
        }
    }

    /// Serves a peer's `unstage`: copies a written buffer into its range
    /// first if `commit`, then frees it. A slot this channel does not hold
    /// is a protocol error (the channel closes).
    pub(crate) async fn unstage(&self, chan: PeerGroupId, slot: u32, commit: bool) -> Result<Reply> {
        // The lease's window goes first, before any copy: once it is
        // deallocated the peer no longer reaches the buffer, so what is
        // committed is what the buffer held when `unstage` came.
        let (job, window) = {
            let mut g = self.state.lock();
            let st = &mut *g;
            let l = st.leases.get_mut(&slot).filter(|l| l.chan == chan && !l.copying).ok_or_else(|| {
                Error::new(ErrorKind::Protocol, format!("staging buffer {slot} is not held by this channel"))
            })?;
            let window = l.window.take();
            let job = if commit && l.write {
                let (addr, len) = (l.addr, l.len);
                let region =
                    st.regions.values().find(|r| r.path == MemPath::Staged && r.mem.contains(addr, u64::from(len)));
                let buffer = st.remote_staging.as_ref().ok_or_else(no_staging).and_then(|p| p.slot_mem(slot, len));
                match (region, buffer) {
                    (Some(r), Ok(buffer)) => {
                        l.copying = true;
                        let at = usize::try_from(addr - r.mem.addr()).unwrap_or(usize::MAX);
                        Ok(Some((buffer, r.mem.clone(), at, len)))
                    }
                    (None, _) => Err(Error::new(ErrorKind::Unregistered, "the staged region went")),
                    (_, Err(e)) => Err(e),
                }
            } else {
                Ok(None)
            };
            match job {
                Ok(job) => (job, window),
                Err(e) => {
                    let gone = st.end_lease(slot);
                    drop(g);
                    drop((window, gone));
                    return Ok(stage_failed(&e));
                }
            }
        };
        let copied = match (job, window) {
            (None, None) => Ok(()),
            (job, window) => {
                blocking(move || {
                    drop(window);
                    match job {
                        Some((buffer, device, at, len)) => Ok(device.copy_from(at, &buffer, 0, len as usize)?),
                        None => Ok(()),
                    }
                })
                .await
            }
        };
        let gone = self.state.lock().end_lease(slot);
        drop(gone);
        Ok(match copied {
            Ok(()) => Reply::Unstaged,
            Err(e) => stage_failed(&e),
        })
    }

    /// The channel `chan` closed: its buffers come back (one with a copy
    /// still running stays out: the copy's task was aborted with the
    /// channel's, at shutdown).
    pub(crate) fn drop_leases(&self, chan: PeerGroupId) {
        let gone: Vec<Window> = {
            let mut st = self.state.lock();
            let mine: Vec<u32> =
                st.leases.iter().filter(|(_, l)| l.chan == chan && !l.copying).map(|(slot, _)| *slot).collect();
            mine.into_iter().filter_map(|slot| st.end_lease(slot)).collect()
        };
        drop(gone); // ibv_dealloc_mw, off the lock
    }

    /// Starts driver `d` (counted among the transport's tasks).
    pub(crate) fn start_drive(&self, d: Drive) {
        let Some(me) = self.weak().upgrade() else { return };
        if tokio::runtime::Handle::try_current().is_err() {
            // No runtime (the transport is being dropped): the slices fail.
            me.with_state(|st, g| {
                for s in &d.slices {
                    st.end_request(s.batch, s.req, EndReason::Failed(Error::shut_down()));
                }
                if let Some(e) = st.endpoints.get_mut(&d.ep) {
                    e.drivers = e.drivers.saturating_sub(1);
                }
                st.after_work(d.ep, &me.lim, g);
            });
            return;
        }
        // Spawned and recorded under the lock: the driver's last step,
        // which takes its record out, waits for it.
        let mut st = self.state.lock();
        st.next_driver += 1;
        let id = st.next_driver;
        let task = crate::state::Task::spawn(&self.tasks, me.drive(id, d));
        st.drivers.insert(id, task);
    }

    /// Runs the slices of `d`, [`WINDOW`] at a time, then lets its
    /// endpoint go idle. It holds the state alive: the transport's drop
    /// aborts it (`State::drivers`).
    async fn drive(self: Arc<Self>, id: u64, d: Drive) {
        let mut set = tokio::task::JoinSet::new();
        let mut next = d.slices.into_iter();
        loop {
            while set.len() < WINDOW {
                let Some(s) = next.next() else { break };
                set.spawn(self.clone().staged_slice(d.seg, d.ep, s));
            }
            if set.join_next().await.is_none() {
                break;
            }
        }
        self.with_state(|st, g| {
            if let Some(e) = st.endpoints.get_mut(&d.ep) {
                e.drivers = e.drivers.saturating_sub(1);
            }
            st.after_work(d.ep, &self.lim, g);
            if let Some(me) = st.drivers.remove(&id) {
                me.ending();
            }
        });
    }

    /// Whether slice `s`'s request may still start work.
    fn live(&self, s: Slice) -> bool {
        self.state.lock().batches.get(s.batch).is_ok_and(|b| b.ledger.is_live(s.req))
    }

    /// One slice into (or out of) the peer's staged memory: its ledger
    /// unit is started here and ends only once every step is over.
    async fn staged_slice(self: Arc<Self>, seg: SegmentId, ep: EndpointId, s: Slice) {
        let started = self.with_state(|st, _| {
            let b = st.batches.get_mut(s.batch).ok()?;
            let t = *b.targets.get(s.req)?;
            if !b.ledger.start(s.req) {
                return None;
            }
            Some((t.spec, st.regions.get(&t.spec.local).map(|r| (r.reg.is_none(), r.mem.clone()))))
        });
        let Some((spec, local)) = started else { return };
        let result = match local {
            None => Err(Error::region_unregistered(spec.local)),
            Some((staged_local, mem)) => self.staged_io(seg, ep, s, &spec, staged_local, mem).await,
        };
        self.with_state(|st, _| {
            if let Ok(b) = st.batches.get_mut(s.batch) {
                let p = b.ledger.unit_done(s.req, result);
                b.wake(p);
            }
        });
    }

    async fn staged_io(
        &self,
        seg: SegmentId,
        ep: EndpointId,
        s: Slice,
        spec: &TransferRequest,
        staged_local: bool,
        mem: MemoryRegion,
    ) -> Result<()> {
        // No overflow: submit checked both ranges.
        let local_off = spec.local_offset + s.offset;
        let local_slot = if staged_local { Some(self.local_slot(s).await?) } else { None };
        let local = match local_slot {
            Some(slot) => Local::Slot(slot),
            None => Local::Region(spec.local, local_off),
        };
        let r = self.staged_steps(seg, ep, s, spec, local, &mem, local_off).await;
        if let Some(slot) = local_slot {
            self.with_state(|st, g| st.free_slots(vec![slot], &self.lim, g));
        }
        r
    }

    #[allow(clippy::too_many_arguments)]
    async fn staged_steps(
        &self,
        seg: SegmentId,
        ep: EndpointId,
        s: Slice,
        spec: &TransferRequest,
        local: Local,
        mem: &MemoryRegion,
        local_off: u64,
    ) -> Result<()> {
        let write = spec.op == Opcode::Write;
        let at = usize::try_from(local_off).map_err(|_| Error::new(ErrorKind::OutOfBounds, "local offset"))?;
        let buffer =
            |slot: u32| self.state.lock().staging.as_ref().ok_or_else(no_staging).and_then(|p| p.slot_mem(slot, s.len));
        if let (true, Local::Slot(slot)) = (write, local) {
            let (buf, dev) = (buffer(slot)?, mem.clone());
            off_runtime(move || buf.copy_from(0, &dev, at, s.len as usize)).await?;
        }
        let (rslot, raddr, rkey) =
            watched("lease", s, self.lease_remote(seg, s, write, spec.remote_addr + s.offset)).await?;
        let moved = watched("post", s, self.post_and_wait(ep, s, local, raddr, rkey, !write)).await;
        let commit = write && moved.is_ok() && self.live(s);
        let unstaged =
            watched("unstage", s, self.ask(seg, Request::Unstage { slot: rslot, commit }, "staging request")).await;
        moved?;
        match unstaged? {
            Reply::Unstaged => {}
            Reply::StageFailed { kind, message } => return Err(peer_stage_error(&kind, &message)),
            _ => return Err(Error::new(ErrorKind::Protocol, "the peer answered unstage with another reply")),
        }
        if write && !commit {
            return Err(ended());
        }
        if let (false, Local::Slot(slot)) = (write, local) {
            if !self.live(s) {
                return Err(ended());
            }
            let (buf, dev) = (buffer(slot)?, mem.clone());
            off_runtime(move || dev.copy_from(at, &buf, 0, s.len as usize)).await?;
        }
        Ok(())
    }

    /// One of this side's staging buffers for slice `s` (waits for one
    /// while its request is live).
    async fn local_slot(&self, s: Slice) -> Result<u32> {
        loop {
            let got = self.state.lock().staging.as_mut().and_then(|p| p.free.pop());
            if let Some(slot) = got {
                return Ok(slot);
            }
            if !self.live(s) {
                return Err(ended());
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// A buffer of the peer's for slice `s` (at `addr` of its staged
    /// memory): asked again, with backoff, while the peer has none free,
    /// for at most `handshake_timeout_ms`.
    async fn lease_remote(&self, seg: SegmentId, s: Slice, write: bool, addr: u64) -> Result<(u32, u64, u32)> {
        let start = std::time::Instant::now();
        let mut pause = Duration::from_millis(1);
        loop {
            if !self.live(s) {
                return Err(ended());
            }
            match self.ask(seg, Request::Stage { write, addr, len: s.len }, "staging request").await? {
                Reply::Staged { slot, addr, rkey } => return Ok((slot, addr, rkey)),
                Reply::Busy if start.elapsed() < self.cfg.handshake_timeout() => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(BUSY_BACKOFF_MAX);
                }
                Reply::Busy => {
                    return Err(Error::new(ErrorKind::Backpressure, "the peer's staging buffers stayed busy"))
                }
                Reply::StageFailed { kind, message } => return Err(peer_stage_error(&kind, &message)),
                _ => return Err(Error::new(ErrorKind::Protocol, "the peer answered stage with another reply")),
            }
        }
    }

    /// Posts the slice's work request (waiting for room on a QP while its
    /// request is live) and waits for its completion.
    async fn post_and_wait(
        &self,
        ep: EndpointId,
        s: Slice,
        local: Local,
        raddr: u64,
        rkey: u32,
        read: bool,
    ) -> Result<()> {
        loop {
            let posted = self.with_state(|st, g| st.post_for_driver(ep, s, local, raddr, rkey, read, &self.lim, g))?;
            if let Some(rx) = posted {
                return rx.await.unwrap_or_else(|_| {
                    Err(Error::new(ErrorKind::ConnectionReset, "the work request was dropped with its endpoint"))
                });
            }
            if !self.live(s) {
                return Err(ended());
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}
