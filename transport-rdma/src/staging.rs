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
//! different phases at once, so copies overlap the wire. A staged region
//! is reachable only by this side: one asked for with remote access is
//! refused at registration (`Unsupported`), since peers would need the
//! target's help to reach it (not built).
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

use transport_core::lifecycle::EndpointId;
use transport_core::{Access, Buffer, Error, ErrorKind, MemoryRegion, Result};

use crate::state::{Graveyard, Inner, Limits, Slice, State};
use crate::verbs::{Pd, Registration};

/// How the NIC reaches a registered region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MemPath {
    /// Host memory, `ibv_reg_mr`.
    Host,
    /// Device memory through a dma-buf (`ibv_reg_dmabuf_mr`): GPUDirect.
    DmaBuf,
    /// Device memory registered by address (a peer-memory module): GPUDirect.
    PeerMemory,
    /// Device memory copied through pinned host buffers.
    Staged,
}

impl MemPath {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            MemPath::Host => "host",
            MemPath::DmaBuf => "gpudirect-dmabuf",
            MemPath::PeerMemory => "gpudirect-peer-memory",
            MemPath::Staged => "staged",
        }
    }
}

/// The pinned host buffers staged slices pass through.
#[derive(Debug)]
pub(crate) struct Staging {
    /// One registration over all the buffers, `slot_len` bytes each.
    pub reg: Registration,
    pub slot_len: u32,
    slots: u32,
    pub free: Vec<u32>,
    /// Endpoints that stopped posting for want of a free buffer.
    pub waiting: Vec<EndpointId>,
}

impl Staging {
    fn new(pd: &Arc<Pd>, slots: u32, slot_len: u32) -> Result<Self> {
        let len = usize::try_from(u64::from(slots) * u64::from(slot_len))
            .map_err(|_| Error::new(ErrorKind::Config, "staging buffers do not fit in memory"))?;
        let buf = Buffer::new(len).map_err(|e| Error::from(e).with("staging_bytes", len))?;
        let reg = Registration::new(pd, buf.region(), false, false)?;
        Ok(Self { reg, slot_len, slots, free: (0..slots).rev().collect(), waiting: Vec::new() })
    }

    /// Host memory held.
    pub(crate) fn bytes(&self) -> u64 {
        self.reg.mem().len() as u64
    }

    /// Where buffer `slot` starts in the registration.
    pub(crate) fn offset(&self, slot: u32) -> u64 {
        u64::from(slot) * u64::from(self.slot_len)
    }

    /// Buffer `slot`'s first `len` bytes.
    fn slot_mem(&self, slot: u32, len: u32) -> Result<MemoryRegion> {
        let off = usize::try_from(self.offset(slot)).map_err(|_| Error::new(ErrorKind::Internal, "staging offset"))?;
        Ok(self.reg.mem().sub(off, len as usize)?)
    }
}

/// Which way a staging copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CopyDir {
    /// Device memory into the buffer, before an RDMA WRITE from it.
    ToBuffer,
    /// The buffer into device memory, after an RDMA READ into it.
    FromBuffer,
}

/// One copy between a staged region and a staging buffer, run off the lock.
#[derive(Debug)]
pub(crate) struct StageCopy {
    pub dir: CopyDir,
    pub ep: EndpointId,
    pub slice: Slice,
    pub slot: u32,
    device: MemoryRegion,
    device_offset: usize,
    buffer: MemoryRegion,
}

impl StageCopy {
    /// A copy for `slice` (of a request whose local region is the staged
    /// `device`, at `local_offset`) through buffer `slot` of `staging`.
    pub(crate) fn new(
        staging: Option<&Staging>,
        dir: CopyDir,
        ep: EndpointId,
        slice: Slice,
        slot: u32,
        device: &MemoryRegion,
        local_offset: u64,
    ) -> Result<Self> {
        let staging = staging.ok_or_else(|| Error::new(ErrorKind::Internal, "no staging buffers"))?;
        let at = local_offset
            .checked_add(slice.offset)
            .and_then(|o| usize::try_from(o).ok())
            .ok_or_else(|| Error::new(ErrorKind::Internal, "staged offset overflows"))?;
        Ok(Self {
            dir,
            ep,
            slice,
            slot,
            device: device.clone(),
            device_offset: at,
            buffer: staging.slot_mem(slot, slice.len)?,
        })
    }

    fn run(&self) -> Result<()> {
        let len = self.buffer.len();
        match self.dir {
            CopyDir::ToBuffer => self.buffer.copy_from(0, &self.device, self.device_offset, len),
            CopyDir::FromBuffer => self.device.copy_from(self.device_offset, &self.buffer, 0, len),
        }
        .map_err(Error::from)
    }
}

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
                    crate::work::wake(b, p);
                }
                self.free_slots(vec![c.slot], lim, grave);
                self.after_work(c.ep, lim, grave);
                return;
            }
        };
        if let Some(result) = outcome {
            if let Ok(b) = self.batches.get_mut(c.slice.batch) {
                let p = b.ledger.unit_done(c.slice.req, result);
                crate::work::wake(b, p);
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
                crate::work::wake(b, p);
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
        let all_back = self.staging.as_ref().is_some_and(|s| s.free.len() as u64 == u64::from(s.slots));
        if !all_back || self.any_staged() {
            return;
        }
        if let Some(s) = self.staging.take() {
            self.retiring.push(s.reg);
        }
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
    if access.is_remote() {
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "the NIC cannot reach this device memory directly (no GPUDirect: {why}), and staged device memory \
                 cannot be exposed to peers; register it without remote access (it is then staged through host \
                 buffers on this side), or use the TCP backend"
            ),
        )
        .with("kind", mem.kind()));
    }
    tracing::info!(kind = %mem.kind(), len = mem.len(), why = %why, "rdma: device memory staged through host buffers");
    Ok((None, MemPath::Staged))
}

impl Inner {
    /// The staging buffers, made with the first staged region.
    pub(crate) fn ensure_staging(&self, st: &mut State, pd: &Arc<Pd>) -> Result<()> {
        if st.staging.is_none() {
            st.staging = Some(Staging::new(pd, self.cfg.staging_buffers, self.cfg.slice_size)?);
        }
        Ok(())
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

/// What a staged slice gets when its region has no staging buffers (a
/// bug: they live as long as any staged region).
pub(crate) fn no_staging() -> Error {
    Error::new(ErrorKind::Internal, "a staged region without staging buffers")
}

/// Counts a device region registered, by the path it took, in the metrics
/// (`kvmove_device_regions_total{backend="rdma",path=...}`).
pub(crate) fn count_path(path: MemPath) {
    metrics::counter!("kvmove_device_regions_total", "backend" => "rdma", "path" => path.as_str()).increment(1);
}
