//! Memory registrations and queue pairs: the part of the verbs wrappers
//! that touches transfer memory (all of its `unsafe` with `// SAFETY:`
//! reasons, like the rest of [`super`]).

use std::mem::ManuallyDrop;
use std::os::raw::c_int;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use rdma_sys as ffi;
use transport_mem::MemoryRegion;

use super::{check, slow_verb, Cq, Pd};
use crate::error::VerbsError;

/// RNR NAK timer of our QPs (`ibv_qp_attr.min_rnr_timer` code 12: 0.64 ms).
const MIN_RNR_TIMER: u8 = 12;
/// RNR retries (7: retry forever; we post no receives, so RNR never happens).
const RNR_RETRY_FOREVER: u8 = 7;
/// GRH hop limit of our QPs' address vectors.
const HOP_LIMIT: u8 = 64;

/// A memory registration together with the memory it covers (private:
/// [`Registration`] is the safe way in). Dropped when the last owner lets
/// go: the transport's region table, a retiring list, or a [`Qp`] that
/// posted work on it (which holds it until the QP is destroyed).
#[derive(Debug)]
pub(super) struct Mr {
    mr: NonNull<ffi::ibv_mr>,
    /// Freed only after `ibv_dereg_mr` succeeded; leaked if it failed (the
    /// pages may still be pinned and reachable by the NIC).
    mem: ManuallyDrop<MemoryRegion>,
    _pd: Arc<Pd>,
}

// SAFETY: see `Context`.
unsafe impl Send for Mr {}
// SAFETY: see `Context`.
unsafe impl Sync for Mr {}

/// Local write always, remote read / write as asked (and binding memory
/// windows to it, for a registration peers reach only through windows).
fn access_flags(remote_read: bool, remote_write: bool, windows: bool) -> ffi::ibv_access_flags {
    let mut access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE;
    if windows {
        access |= ffi::ibv_access_flags::IBV_ACCESS_MW_BIND;
    }
    if remote_read {
        access |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ;
    }
    if remote_write {
        access |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE;
    }
    access
}

impl Mr {
    /// Registers `mem` (kept in the returned `Mr`: it is freed only after
    /// the MR is deregistered): by address (`ibv_reg_mr`), or through the
    /// dma-buf `dmabuf` that exports device memory (`ibv_reg_dmabuf_mr`,
    /// GPUDirect RDMA: the NIC reaches the device pages, the host never
    /// maps them; the MR's I/O virtual address is the region's device
    /// address, so work requests and peers address it as any other).
    fn register(
        pd: &Arc<Pd>,
        mem: MemoryRegion,
        dmabuf: Option<&transport_mem::DmaBuf>,
        remote_read: bool,
        remote_write: bool,
        windows: bool,
    ) -> Result<Self, VerbsError> {
        let access = access_flags(remote_read, remote_write, windows).0 as c_int;
        // For both: the PD is live. `mem` is valid for its whole range while
        // any clone of it lives (a `Buffer` owns it; `from_raw`'s and
        // `from_device`'s callers promised it); this clone is stored in the
        // returned `Mr` and released only after `ibv_dereg_mr` succeeded
        // (see `Drop`).
        let mr = match dmabuf {
            // SAFETY: see above; host memory registered by address.
            None => check("ibv_reg_mr", unsafe {
                ffi::ibv_reg_mr(pd.pd.as_ptr(), mem.addr() as usize as *mut _, mem.len(), access)
            })?,
            // SAFETY: see above; the dma-buf's descriptor is open and only
            // borrowed for the call (the kernel takes its own reference).
            Some(buf) => check("ibv_reg_dmabuf_mr", unsafe {
                ffi::ibv_reg_dmabuf_mr(
                    pd.pd.as_ptr(),
                    buf.offset,
                    mem.len(),
                    mem.addr(),
                    std::os::fd::AsRawFd::as_raw_fd(&buf.fd),
                    access,
                )
            })?,
        };
        Ok(Mr { mr, mem: ManuallyDrop::new(mem), _pd: pd.clone() })
    }

    /// The MR (live while `self` is).
    pub(super) fn as_ptr(&self) -> *mut ffi::ibv_mr {
        self.mr.as_ptr()
    }

    fn lkey(&self) -> u32 {
        // SAFETY: the MR is live; `lkey` is a plain field set at registration.
        unsafe { (*self.mr.as_ptr()).lkey }
    }

    fn rkey(&self) -> u32 {
        // SAFETY: as for `lkey`.
        unsafe { (*self.mr.as_ptr()).rkey }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered by ibv_reg_mr, deregistered once. No QP can
        // still have work posted on it: every `Qp` that posted on this MR
        // holds an `Arc` to it until `ibv_destroy_qp` succeeded.
        let rc = unsafe { ffi::ibv_dereg_mr(self.mr.as_ptr()) };
        match check("ibv_dereg_mr", rc) {
            // SAFETY: taken once, here, and never used again. The MR is
            // gone, so the NIC no longer reaches the memory: it may be freed.
            Ok(()) => drop(unsafe { ManuallyDrop::take(&mut self.mem) }),
            Err(e) => tracing::error!(
                "{e}; leaking {} bytes at {:#x} (still registered, must not be reused)",
                self.mem.len(),
                self.mem.addr()
            ),
        }
    }
}

/// Registered memory: the registration and the memory it covers, owned
/// together (the memory is freed only after `ibv_dereg_mr` succeeded).
/// Shared with the [`Qp`]s that post on it, so it outlives every work
/// request posted on it.
#[derive(Debug)]
pub(crate) struct Registration {
    mr: Arc<Mr>,
}

impl Registration {
    /// Registers `mem` for local write and, as asked, remote read / write.
    pub(crate) fn new(
        pd: &Arc<Pd>,
        mem: MemoryRegion,
        remote_read: bool,
        remote_write: bool,
    ) -> Result<Self, VerbsError> {
        Ok(Self { mr: Arc::new(Mr::register(pd, mem, None, remote_read, remote_write, false)?) })
    }

    /// Registers `mem` for local write and for memory windows
    /// ([`super::Window`]): its own rkey reaches nothing, a peer reaches
    /// only what a window bound to it allows.
    pub(crate) fn for_windows(pd: &Arc<Pd>, mem: MemoryRegion) -> Result<Self, VerbsError> {
        Ok(Self { mr: Arc::new(Mr::register(pd, mem, None, false, false, true)?) })
    }

    /// Registers device memory through a dma-buf that exports it
    /// (GPUDirect RDMA, see `Mr::register`).
    pub(crate) fn new_dmabuf(
        pd: &Arc<Pd>,
        mem: MemoryRegion,
        buf: &transport_mem::DmaBuf,
        remote_read: bool,
        remote_write: bool,
    ) -> Result<Self, VerbsError> {
        Ok(Self { mr: Arc::new(Mr::register(pd, mem, Some(buf), remote_read, remote_write, false)?) })
    }

    /// The memory registered.
    pub(crate) fn mem(&self) -> &MemoryRegion {
        &self.mr.mem
    }

    /// The key peers use to reach it.
    pub(crate) fn rkey(&self) -> u32 {
        self.mr.rkey()
    }

    /// Another owner of the same registration (the MR is deregistered when
    /// the last owner drops; [`Registration::pinned`] counts this one too).
    pub(crate) fn share(&self) -> Registration {
        Registration { mr: self.mr.clone() }
    }

    /// The MR itself, for a window bound to it to keep (`super::mw`).
    pub(super) fn shared(&self) -> Arc<Mr> {
        self.mr.clone()
    }

    /// Whether a QP still holds it (work was posted on it and the QP is
    /// not destroyed yet): dropping this owner then deregisters nothing.
    pub(crate) fn pinned(&self) -> bool {
        Arc::strong_count(&self.mr) > 1
    }
}

/// The remote side of a QP connection.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RemoteQp {
    pub qpn: u32,
    pub psn: u32,
    pub gid: [u8; 16],
    pub lid: u16,
}

/// Timing knobs of a connected QP.
#[derive(Debug, Clone, Copy)]
pub(crate) struct QpTiming {
    /// Local ACK timeout exponent (4.096 us * 2^timeout).
    pub timeout: u8,
    /// Transport retries before IBV_WC_RETRY_EXC_ERR.
    pub retry_cnt: u8,
}

/// One RDMA WRITE or READ to post: `len` bytes at `local_offset` of a
/// [`Registration`] to or from `remote_addr` under `rkey`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WorkRequest {
    pub wr_id: u64,
    pub read: bool,
    pub local_offset: u64,
    pub len: u32,
    pub remote_addr: u64,
    pub rkey: u32,
}

/// A reliable-connected queue pair.
#[derive(Debug)]
pub(crate) struct Qp {
    qp: NonNull<ffi::ibv_qp>,
    /// Every registration work was posted on, held until the QP is
    /// destroyed: what makes a safe [`Qp::post`] sound.
    pins: Vec<Arc<Mr>>,
    _pd: Arc<Pd>,
    _cq: Arc<Cq>,
}

// SAFETY: see `Context`.
unsafe impl Send for Qp {}
// SAFETY: see `Context`.
unsafe impl Sync for Qp {}

impl Qp {
    /// Creates an RC QP in RESET and moves it to INIT.
    pub(crate) fn new(pd: &Arc<Pd>, cq: &Arc<Cq>, port: u8, max_send_wr: u32) -> Result<Self, VerbsError> {
        // SAFETY: all-zero is valid for this plain C struct (null pointers, zero caps).
        let mut init: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq.cq.as_ptr();
        init.recv_cq = cq.cq.as_ptr();
        init.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
        init.cap.max_send_wr = max_send_wr;
        init.cap.max_recv_wr = 1;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        let started = std::time::Instant::now();
        // SAFETY: PD and CQ are live and kept alive by the returned Qp.
        let qp = check("ibv_create_qp", unsafe { ffi::ibv_create_qp(pd.pd.as_ptr(), &mut init) })?;
        slow_verb("ibv_create_qp", started);
        let me = Qp { qp, pins: Vec::new(), _pd: pd.clone(), _cq: cq.clone() };
        // SAFETY: all-zero is valid for ibv_qp_attr.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = port;
        a.qp_access_flags = (ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE)
            .0;
        use ffi::ibv_qp_attr_mask as M;
        me.modify(&mut a, M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS)?;
        Ok(me)
    }

    /// The QP, for binding windows through it (`super::mw`).
    pub(super) fn as_ptr(&self) -> *mut ffi::ibv_qp {
        self.qp.as_ptr()
    }

    pub(crate) fn qpn(&self) -> u32 {
        // SAFETY: the QP is live; `qp_num` is a plain field.
        unsafe { (*self.qp.as_ptr()).qp_num }
    }

    fn modify(&self, a: &mut ffi::ibv_qp_attr, mask: ffi::ibv_qp_attr_mask) -> Result<(), VerbsError> {
        let started = std::time::Instant::now();
        // SAFETY: the QP is live; `a` is a valid attribute struct for `mask`.
        let r = check("ibv_modify_qp", unsafe { ffi::ibv_modify_qp(self.qp.as_ptr(), a, mask.0 as c_int) });
        slow_verb("ibv_modify_qp", started);
        r
    }

    /// INIT -> RTR -> RTS toward `remote`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn connect(
        &self,
        local_psn: u32,
        remote: &RemoteQp,
        port: u8,
        gid_index: u8,
        mtu: u32,
        rd_atom: u8,
        timing: QpTiming,
    ) -> Result<(), VerbsError> {
        use ffi::ibv_qp_attr_mask as M;
        // SAFETY: all-zero is valid for ibv_qp_attr.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = mtu;
        a.dest_qp_num = remote.qpn;
        a.rq_psn = remote.psn;
        a.max_dest_rd_atomic = rd_atom;
        a.min_rnr_timer = MIN_RNR_TIMER;
        a.ah_attr.is_global = 1;
        a.ah_attr.grh.dgid = ffi::ibv_gid { raw: remote.gid };
        a.ah_attr.grh.sgid_index = gid_index;
        a.ah_attr.grh.hop_limit = HOP_LIMIT;
        a.ah_attr.dlid = remote.lid;
        a.ah_attr.sl = 0;
        a.ah_attr.port_num = port;
        self.modify(
            &mut a,
            M::IBV_QP_STATE
                | M::IBV_QP_AV
                | M::IBV_QP_PATH_MTU
                | M::IBV_QP_DEST_QPN
                | M::IBV_QP_RQ_PSN
                | M::IBV_QP_MAX_DEST_RD_ATOMIC
                | M::IBV_QP_MIN_RNR_TIMER,
        )?;
        // SAFETY: all-zero is valid for ibv_qp_attr.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTS;
        a.timeout = timing.timeout;
        a.retry_cnt = timing.retry_cnt;
        a.rnr_retry = RNR_RETRY_FOREVER;
        a.sq_psn = local_psn;
        a.max_rd_atomic = rd_atom;
        self.modify(
            &mut a,
            M::IBV_QP_STATE
                | M::IBV_QP_TIMEOUT
                | M::IBV_QP_RETRY_CNT
                | M::IBV_QP_RNR_RETRY
                | M::IBV_QP_SQ_PSN
                | M::IBV_QP_MAX_QP_RD_ATOMIC,
        )
    }

    /// Moves the QP to ERROR: every posted work request completes with
    /// IBV_WC_WR_FLUSH_ERR and the NIC stops touching their buffers.
    pub(crate) fn set_error(&self) -> Result<(), VerbsError> {
        // SAFETY: all-zero is valid for ibv_qp_attr.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_ERR;
        self.modify(&mut a, ffi::ibv_qp_attr_mask::IBV_QP_STATE)
    }

    /// Whether work was ever posted on `reg` through this QP (it then
    /// holds `reg` until it is destroyed).
    pub(crate) fn pins(&self, reg: &Registration) -> bool {
        self.pins.iter().any(|p| Arc::ptr_eq(p, &reg.mr))
    }

    /// Posts one signaled RDMA WRITE or READ on `local`. A range outside
    /// `local` is refused (`EINVAL`) before anything is posted. The QP
    /// keeps `local` registered (and its memory allocated) until the QP is
    /// destroyed; the first post on a registration stores one `Arc` clone,
    /// later ones only compare pointers.
    pub(crate) fn post(&mut self, local: &Registration, wr: &WorkRequest) -> Result<(), VerbsError> {
        let mem = local.mem();
        if mem.check(wr.local_offset, u64::from(wr.len)).is_err() {
            return Err(VerbsError::new("ibv_post_send (local range outside its registration)", libc::EINVAL));
        }
        if !self.pins(local) {
            self.pins.push(local.mr.clone());
        }
        let mut sge = ffi::ibv_sge { addr: mem.addr() + wr.local_offset, length: wr.len, lkey: local.mr.lkey() };
        // SAFETY: all-zero is valid for ibv_send_wr (null next, zero flags).
        let mut swr: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
        swr.wr_id = wr.wr_id;
        swr.sg_list = &mut sge;
        swr.num_sge = 1;
        swr.opcode = if wr.read { ffi::ibv_wr_opcode::IBV_WR_RDMA_READ } else { ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE };
        swr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        swr.wr.rdma = ffi::rdma_t { remote_addr: wr.remote_addr, rkey: wr.rkey };
        let mut bad = ptr::null_mut();
        // SAFETY: the QP is live; `swr` and `sge` outlive the call (the
        // provider copies them). The local range was checked above to lie
        // inside `local`, and `local`'s MR (with the memory it covers) was
        // pinned above: it stays registered and allocated until this QP is
        // destroyed (`Drop` drops the pins only after `ibv_destroy_qp`
        // succeeded), so the NIC never reaches freed or unregistered memory
        // through this work request. That the memory's *contents* are not
        // reused while the request is posted (rule 5) is the transport's
        // bookkeeping, not a memory-safety matter.
        check("ibv_post_send", unsafe { ffi::ibv_post_send(self.qp.as_ptr(), &mut swr, &mut bad) })
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        let started = std::time::Instant::now();
        // SAFETY: created by ibv_create_qp, destroyed once. Work may still
        // be posted (a QP dropped without flushing: passive, evicted,
        // force-reaped, or dropped with the transport): a successful
        // destroy ends it, after which the NIC no longer touches any of
        // its buffers, so the pinned registrations may go (field drop,
        // after this body).
        let rc = unsafe { ffi::ibv_destroy_qp(self.qp.as_ptr()) };
        slow_verb("ibv_destroy_qp", started);
        if let Err(e) = check("ibv_destroy_qp", rc) {
            // The QP may live on with work posted: keep what it can reach.
            tracing::error!("{e}; leaking the {} memory registration(s) it used", self.pins.len());
            for p in self.pins.drain(..) {
                std::mem::forget(p);
            }
        }
    }
}
