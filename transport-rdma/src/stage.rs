//! The staging path's data (see `crate::staging` for how it works): how
//! a region is reached ([`MemPath`]), the pinned buffers ([`Staging`]),
//! copies between them and device memory ([`StageCopy`]), leases and
//! drives. [`crate::state::State`] holds these; the logic that moves them
//! lives in `crate::staging`.

use std::sync::Arc;

use transport_core::lifecycle::EndpointId;
use transport_core::{Buffer, DeviceMemory, Error, ErrorKind, MemoryRegion, Result, SegmentId};

use crate::ids::{PeerGroupId, Slice};
use crate::verbs::{Binder, Pd, Registration, Window};

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

/// Who reaches a pool of staging buffers, and how.
#[derive(Debug)]
pub(crate) enum Reach {
    /// This side's own work requests only (the initiator's pool).
    Local,
    /// Peers, each lease through a memory window of its own bound to the
    /// leased bytes (the target's pool with `staging_windows`, where the
    /// device has windows): no registration of the pool has remote access.
    Windows(Arc<parking_lot::Mutex<Binder>>),
    /// Peers, through the pool's one registration (the target's pool by
    /// default, or on a device without memory windows): a lease's rkey reaches every
    /// buffer of the pool for as long as the pool lives.
    Pool,
}

/// The pinned host buffers staged slices pass through.
#[derive(Debug)]
pub(crate) struct Staging {
    /// One registration over all the buffers, `slot_len` bytes each.
    pub reg: Registration,
    pub reach: Reach,
    /// With [`Reach::Windows`], one registration per buffer that windows
    /// bind to, none with remote access of its own. One per buffer, not
    /// one for the pool, because soft-RoCE checks a window's range against
    /// its registration only: a window on one buffer's registration
    /// reaches no other buffer on any device.
    pub windows: Vec<Registration>,
    pub slot_len: u32,
    pub slots: u32,
    pub free: Vec<u32>,
    /// Endpoints that stopped posting for want of a free buffer.
    pub waiting: Vec<EndpointId>,
}

impl Staging {
    /// `slots` buffers of `slot_len` bytes, registered once, for `reach`.
    /// Pinned for `provider`'s copies (the device of the staged region
    /// that made the pool: CUDA copies from pinned memory at full speed),
    /// or unpinned where that provider refuses (logged).
    pub(crate) fn new(
        pd: &Arc<Pd>,
        slots: u32,
        slot_len: u32,
        reach: Reach,
        provider: Option<&Arc<dyn DeviceMemory>>,
    ) -> Result<Self> {
        let len = usize::try_from(u64::from(slots) * u64::from(slot_len))
            .map_err(|_| Error::new(ErrorKind::Config, "staging buffers do not fit in memory"))?;
        let pinned = provider.map(|p| (p, Buffer::pinned(len, p)));
        let buf = match pinned {
            Some((_, Ok(b))) => Ok(b),
            Some((p, Err(e))) => {
                tracing::info!(provider = p.name(), error = %e, "rdma: staging buffers not pinned for device copies");
                Buffer::new(len)
            }
            None => Buffer::new(len),
        }
        .map_err(|e| Error::from(e).with("staging_bytes", len))?;
        let remote = matches!(reach, Reach::Pool);
        let reg = Registration::new(pd, buf.region(), remote, remote)?;
        let mut windows = Vec::new();
        if let Reach::Windows(_) = reach {
            for slot in 0..slots {
                let at = usize::try_from(u64::from(slot) * u64::from(slot_len))
                    .map_err(|_| Error::new(ErrorKind::Internal, "staging offset"))?;
                windows.push(Registration::for_windows(pd, reg.mem().sub(at, slot_len as usize)?)?);
            }
        }
        Ok(Self { reg, reach, windows, slot_len, slots, free: (0..slots).rev().collect(), waiting: Vec::new() })
    }

    /// Its registrations, to deregister outside the state lock (the
    /// binder of [`Reach::Windows`] goes with `self`).
    pub(crate) fn into_registrations(self) -> Vec<Registration> {
        let mut regs = self.windows;
        regs.push(self.reg);
        regs
    }

    /// Host memory held.
    pub(crate) fn bytes(&self) -> u64 {
        self.reg.mem().len() as u64
    }

    /// Whether every buffer is free.
    pub(crate) fn all_back(&self) -> bool {
        self.free.len() as u64 == u64::from(self.slots)
    }

    /// Where buffer `slot` starts in the registration.
    pub(crate) fn offset(&self, slot: u32) -> u64 {
        u64::from(slot) * u64::from(self.slot_len)
    }

    /// Buffer `slot`'s first `len` bytes.
    pub(crate) fn slot_mem(&self, slot: u32, len: u32) -> Result<MemoryRegion> {
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
    pub device: MemoryRegion,
    pub device_offset: usize,
    pub buffer: MemoryRegion,
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

    pub(crate) fn run(&self) -> Result<()> {
        let len = self.buffer.len();
        match self.dir {
            CopyDir::ToBuffer => self.buffer.copy_from(0, &self.device, self.device_offset, len),
            CopyDir::FromBuffer => self.device.copy_from(self.device_offset, &self.buffer, 0, len),
        }
        .map_err(Error::from)
    }
}

/// What a staged slice gets when its region has no staging buffers (a
/// bug: they live as long as any staged region).
pub(crate) fn no_staging() -> Error {
    Error::new(ErrorKind::Internal, "a staged region without staging buffers")
}

/// The descriptor key of a staged region with remote access: it has no
/// rkey (rkeys are 32 bits); peers reach it through staging buffers.
pub(crate) const STAGED_KEY: u64 = 1 << 32;

/// A peer's lease on one of this side's remote staging buffers (its
/// channel's; given back with `unstage` or when the channel closes).
#[derive(Debug)]
pub(crate) struct Lease {
    pub chan: PeerGroupId,
    pub write: bool,
    pub addr: u64,
    pub len: u32,
    /// A copy between the buffer and device memory, or the bind of its
    /// window, is under way.
    pub copying: bool,
    /// The window the peer reaches the leased bytes through
    /// ([`Reach::Windows`]): dropping it (outside the state lock) ends the
    /// peer's access.
    pub window: Option<Window>,
}

/// Slices of requests into a peer's staged memory, driven on endpoint `ep`.
#[derive(Debug)]
pub(crate) struct Drive {
    pub seg: SegmentId,
    pub ep: EndpointId,
    pub slices: Vec<Slice>,
}
