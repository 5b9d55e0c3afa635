//! Every `unsafe` of the crate: owned wrappers around verbs objects (this
//! file: device, context, async events, PD, completion channel, CQ;
//! `verbs/qp.rs`: memory registrations and QPs; `verbs/mw.rs`: memory
//! windows).
//!
//! Each verb is called through [`check`], which turns the C convention
//! (null pointer, `-1` + errno, or a positive errno) into a [`VerbsError`]
//! that names the verb and the errno, like
//! `ibv_create_qp failed: Cannot allocate memory (errno 12)`.
//!
//! Objects own their parents the way the kernel needs them released: a
//! [`Qp`] keeps its [`Pd`] and [`Cq`] alive, an MR (in a [`Registration`]) its `Pd`, a `Cq` its
//! [`CompChannel`], and all of them the [`Context`]. `Drop` releases each
//! object once, logs (never panics on) a failure, and never blocks: the
//! release order QP -> CQ -> MR -> PD -> context follows from the `Arc`s.

use std::ffi::CStr;
use std::os::raw::c_int;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use rdma_sys as ffi;

use crate::error::VerbsError;

mod mw;
mod qp;

pub(crate) use mw::{Binder, Window};
pub(crate) use qp::{Qp, QpTiming, Registration, RemoteQp, WorkRequest};

/// What a verb returns, and how to tell success from failure.
pub(crate) trait VerbsRet {
    type Ok;
    fn into_result(self, verb: &'static str) -> Result<Self::Ok, VerbsError>;
}

impl<T> VerbsRet for *mut T {
    type Ok = NonNull<T>;
    /// Null is failure; the cause is in errno.
    fn into_result(self, verb: &'static str) -> Result<NonNull<T>, VerbsError> {
        NonNull::new(self).ok_or_else(|| VerbsError::last(verb))
    }
}

impl VerbsRet for c_int {
    type Ok = ();
    /// Zero is success; a positive value is the errno itself (rdma-core's
    /// convention for most verbs); a negative one means "see errno".
    fn into_result(self, verb: &'static str) -> Result<(), VerbsError> {
        match self {
            0 => Ok(()),
            e if e > 0 => Err(VerbsError::new(verb, e)),
            _ => Err(VerbsError::last(verb)),
        }
    }
}

/// The one checked-call helper: every verb's result goes through here.
pub(crate) fn check<R: VerbsRet>(verb: &'static str, ret: R) -> Result<R::Ok, VerbsError> {
    ret.into_result(verb)
}

/// A verb that blocked its thread this long is logged (debug), with the
/// thread's name: the evidence for what held a runtime worker.
const SLOW_VERB: std::time::Duration = std::time::Duration::from_millis(20);

/// Logs `verb` (started at `started`) if it took [`SLOW_VERB`] or more.
pub(crate) fn slow_verb(verb: &'static str, started: std::time::Instant) {
    let took = started.elapsed();
    if took >= SLOW_VERB {
        let thread = std::thread::current();
        tracing::debug!(
            verb,
            took_ms = took.as_millis() as u64,
            thread = thread.name().unwrap_or("?"),
            "rdma: slow verb"
        );
    }
}

/// Makes a descriptor owned by a verbs object non-blocking.
fn set_nonblocking(fd: c_int) -> Result<(), VerbsError> {
    // SAFETY: `fd` is an open descriptor of a live verbs object; F_GETFL
    // takes no pointer.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if fl < 0 {
        return Err(VerbsError::last("fcntl(F_GETFL)"));
    }
    // SAFETY: as above; F_SETFL takes an int.
    check("fcntl(F_SETFL)", unsafe { libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) })
}

fn log_release(verb: &'static str, rc: c_int) {
    if let Err(e) = check(verb, rc) {
        tracing::warn!("{e}");
    }
}

/// An open device (`ibv_context`).
#[derive(Debug)]
pub(crate) struct Context {
    ctx: NonNull<ffi::ibv_context>,
    name: String,
}

// SAFETY: libibverbs objects may be used from any thread; every verb is
// thread-safe (rdma-core documents this), and we never hand out references
// into the C structs.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

/// Port attributes the handshake needs.
#[derive(Debug, Clone)]
pub(crate) struct PortInfo {
    pub port: u8,
    pub gid_index: u8,
    pub gid: [u8; 16],
    pub lid: u16,
    /// `ibv_mtu` enum value (1 = 256 ... 5 = 4096).
    pub active_mtu: u32,
    pub max_qp_wr: u32,
    pub max_cqe: u32,
    pub max_rd_atom: u8,
}

/// Lists the RDMA devices of this machine.
pub(crate) fn device_names() -> Result<Vec<String>, VerbsError> {
    let mut n: c_int = 0;
    // SAFETY: `n` is a valid out-pointer; the returned list is freed below.
    let list = check("ibv_get_device_list", unsafe { ffi::ibv_get_device_list(&mut n) })?;
    let mut names = Vec::new();
    for i in 0..n.max(0) as usize {
        // SAFETY: the list holds `n` valid device pointers (null-terminated).
        let dev = unsafe { *list.as_ptr().add(i) };
        if dev.is_null() {
            break;
        }
        // SAFETY: `dev` is a live device of the list; the name is a
        // NUL-terminated string owned by it, copied before the list is freed.
        let name = unsafe { CStr::from_ptr(ffi::ibv_get_device_name(dev)) };
        names.push(name.to_string_lossy().into_owned());
    }
    // SAFETY: `list` came from ibv_get_device_list and is freed once.
    unsafe { ffi::ibv_free_device_list(list.as_ptr()) };
    Ok(names)
}

impl Context {
    /// Opens device `name` (or the first one), or says why not.
    pub(crate) fn open(name: Option<&str>) -> Result<Arc<Self>, crate::error::RdmaError> {
        use crate::error::RdmaError;
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-pointer; the list is freed below on every path.
        let list = check("ibv_get_device_list", unsafe { ffi::ibv_get_device_list(&mut n) })?;
        let mut chosen = None;
        let mut seen = Vec::new();
        for i in 0..n.max(0) as usize {
            // SAFETY: the list holds `n` valid device pointers.
            let dev = unsafe { *list.as_ptr().add(i) };
            if dev.is_null() {
                break;
            }
            // SAFETY: as in `device_names`.
            let dn = unsafe { CStr::from_ptr(ffi::ibv_get_device_name(dev)) }.to_string_lossy().into_owned();
            if chosen.is_none()
                && match name {
                    None => true,
                    Some(want) => want == dn,
                }
            {
                chosen = Some((dev, dn.clone()));
            }
            seen.push(dn);
        }
        let opened = chosen.map(|(dev, dn)| {
            // SAFETY: `dev` is a live entry of the list, which is still allocated.
            (check("ibv_open_device", unsafe { ffi::ibv_open_device(dev) }), dn)
        });
        // SAFETY: freed once; an opened context stays valid after this
        // (ibv_free_device_list documents that).
        unsafe { ffi::ibv_free_device_list(list.as_ptr()) };
        match opened {
            Some((Ok(ctx), name)) => Ok(Arc::new(Context { ctx, name })),
            Some((Err(e), _)) => Err(e.into()),
            None if seen.is_empty() => Err(RdmaError::NoDevice),
            None => Err(RdmaError::DeviceNotFound { want: name.unwrap_or_default().to_string(), have: seen }),
        }
    }

    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Queries the port, its GID at `gid_index` and device limits.
    pub(crate) fn port_info(&self, port: u8, gid_index: u8) -> Result<PortInfo, crate::error::RdmaError> {
        use crate::error::RdmaError;
        let pa = self.query_port(port)?;
        if pa.state != ffi::ibv_port_state::IBV_PORT_ACTIVE {
            return Err(RdmaError::PortDown { device: self.name.clone(), port, state: pa.state });
        }
        // SAFETY: all-zero is a valid GID.
        let mut gid: ffi::ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: `ctx` open, `gid` valid out-pointer.
        check("ibv_query_gid", unsafe { ffi::ibv_query_gid(self.ctx.as_ptr(), port, gid_index as c_int, &mut gid) })?;
        // SAFETY: `raw` is the 16-byte view of the union, always initialised.
        let raw = unsafe { gid.raw };
        if raw == [0u8; 16] {
            return Err(RdmaError::NoGid { device: self.name.clone(), port, gid_index });
        }
        // SAFETY: all-zero is valid for this plain C struct.
        let mut da: ffi::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: `ctx` open, `da` valid out-pointer.
        check("ibv_query_device", unsafe { ffi::ibv_query_device(self.ctx.as_ptr(), &mut da) })?;
        Ok(PortInfo {
            port,
            gid_index,
            gid: raw,
            lid: pa.lid,
            active_mtu: pa.active_mtu,
            max_qp_wr: da.max_qp_wr.max(1) as u32,
            max_cqe: da.max_cqe.max(1) as u32,
            max_rd_atom: da.max_qp_rd_atom.min(da.max_qp_init_rd_atom).clamp(1, 16) as u8,
        })
    }
}

/// An asynchronous event of the device, copied out of `ibv_async_event`
/// (already acknowledged, so destroying the object it names never waits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AsyncEvent {
    /// A QP broke by itself (`what` names the event).
    QpError { qpn: u32, what: &'static str },
    /// The port went down (link lost).
    PortError { port: u8 },
    /// A CQ overran: completions were lost, so every QP on it is suspect.
    CqError,
    /// The device failed or is being removed; nothing on it works.
    DeviceFatal,
    /// Anything else (informational), with its `ibv_event_type` value.
    Other(u32),
}

impl Context {
    /// Makes the context's async-event descriptor non-blocking (so a
    /// reader can wait on it with a timeout and stop).
    pub(crate) fn async_events_nonblocking(&self) -> Result<(), VerbsError> {
        set_nonblocking(self.async_fd())
    }

    fn async_fd(&self) -> c_int {
        // SAFETY: the context is open; `async_fd` is a plain field.
        unsafe { (*self.ctx.as_ptr()).async_fd }
    }

    /// Waits up to `timeout_ms` for the next asynchronous event and
    /// acknowledges it; `Ok(None)` if none came.
    pub(crate) fn next_async_event(&self, timeout_ms: c_int) -> Result<Option<AsyncEvent>, VerbsError> {
        use ffi::ibv_event_type as T;
        let mut pfd = libc::pollfd { fd: self.async_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: `pfd` is one valid pollfd; the fd stays open (we hold the context).
        let n = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
        if n < 0 {
            let e = VerbsError::last("poll(async_fd)");
            return if e.errno == libc::EINTR { Ok(None) } else { Err(e) };
        }
        if n == 0 {
            return Ok(None);
        }
        let mut ev = std::mem::MaybeUninit::<ffi::ibv_async_event>::zeroed();
        // SAFETY: the context is open and `ev` is a valid out-pointer; the
        // descriptor is non-blocking, so this returns at once.
        let rc = unsafe { ffi::ibv_get_async_event(self.ctx.as_ptr(), ev.as_mut_ptr()) };
        if rc != 0 {
            let e = VerbsError::last("ibv_get_async_event");
            return if e.errno == libc::EAGAIN || e.errno == libc::EINTR { Ok(None) } else { Err(e) };
        }
        let p = ev.as_mut_ptr();
        // SAFETY: filled by ibv_get_async_event. The type is read as its raw
        // integer so that a value this binding does not know is not an
        // invalid Rust enum.
        let kind = unsafe { ptr::addr_of!((*p).event_type).cast::<u32>().read() };
        let is = |t: T| kind == t as u32;
        let qp_error = |what| {
            // SAFETY: for QP events the union holds the QP, which cannot be
            // destroyed before this event is acknowledged (below).
            let qpn = unsafe { (*(*p).element.qp).qp_num };
            AsyncEvent::QpError { qpn, what }
        };
        let out = if is(T::IBV_EVENT_QP_FATAL) {
            qp_error("IBV_EVENT_QP_FATAL")
        } else if is(T::IBV_EVENT_QP_REQ_ERR) {
            qp_error("IBV_EVENT_QP_REQ_ERR")
        } else if is(T::IBV_EVENT_QP_ACCESS_ERR) {
            qp_error("IBV_EVENT_QP_ACCESS_ERR")
        } else if is(T::IBV_EVENT_PATH_MIG_ERR) {
            qp_error("IBV_EVENT_PATH_MIG_ERR")
        } else if is(T::IBV_EVENT_PORT_ERR) {
            // SAFETY: for port events the union holds the port number.
            let port = unsafe { (*p).element.port_num }.clamp(0, 255) as u8;
            AsyncEvent::PortError { port }
        } else if is(T::IBV_EVENT_CQ_ERR) {
            AsyncEvent::CqError
        } else if is(T::IBV_EVENT_DEVICE_FATAL) {
            AsyncEvent::DeviceFatal
        } else {
            AsyncEvent::Other(kind)
        };
        // SAFETY: `ev` came from ibv_get_async_event and is acknowledged
        // exactly once; nothing reads its element afterwards.
        unsafe { ffi::ibv_ack_async_event(p) };
        Ok(Some(out))
    }

    fn query_port(&self, port: u8) -> Result<ffi::ibv_port_attr, VerbsError> {
        // SAFETY: ibv_port_attr is a plain C struct for which all-zero is valid.
        let mut pa: ffi::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: `ctx` is open; `pa` is a valid out-pointer of the right size.
        check("ibv_query_port", unsafe { ffi::___ibv_query_port(self.ctx.as_ptr(), port, &mut pa) })?;
        Ok(pa)
    }

    /// Whether `port` is ACTIVE now.
    pub(crate) fn port_active(&self, port: u8) -> Result<bool, VerbsError> {
        Ok(self.query_port(port)?.state == ffi::ibv_port_state::IBV_PORT_ACTIVE)
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: opened by ibv_open_device, closed once; every child holds
        // an `Arc<Context>`, so none is alive any more.
        log_release("ibv_close_device", unsafe { ffi::ibv_close_device(self.ctx.as_ptr()) });
    }
}

/// A protection domain.
#[derive(Debug)]
pub(crate) struct Pd {
    pd: NonNull<ffi::ibv_pd>,
    _ctx: Arc<Context>,
}

// SAFETY: see `Context`.
unsafe impl Send for Pd {}
// SAFETY: see `Context`.
unsafe impl Sync for Pd {}

impl Pd {
    pub(crate) fn new(ctx: &Arc<Context>) -> Result<Arc<Self>, VerbsError> {
        // SAFETY: `ctx` is an open context kept alive by the returned Pd.
        let pd = check("ibv_alloc_pd", unsafe { ffi::ibv_alloc_pd(ctx.ctx.as_ptr()) })?;
        Ok(Arc::new(Pd { pd, _ctx: ctx.clone() }))
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: allocated by ibv_alloc_pd, freed once; QPs and MRs hold an
        // `Arc<Pd>`, so none is alive.
        log_release("ibv_dealloc_pd", unsafe { ffi::ibv_dealloc_pd(self.pd.as_ptr()) });
    }
}

/// A completion channel (the fd that wakes the CQ poller).
#[derive(Debug)]
pub(crate) struct CompChannel {
    ch: NonNull<ffi::ibv_comp_channel>,
    _ctx: Arc<Context>,
}

// SAFETY: see `Context`.
unsafe impl Send for CompChannel {}
// SAFETY: see `Context`.
unsafe impl Sync for CompChannel {}

impl CompChannel {
    /// Creates a channel whose fd is non-blocking.
    pub(crate) fn new(ctx: &Arc<Context>) -> Result<Arc<Self>, VerbsError> {
        // SAFETY: `ctx` is open and outlives the channel (held below).
        let ch = check("ibv_create_comp_channel", unsafe { ffi::ibv_create_comp_channel(ctx.ctx.as_ptr()) })?;
        let me = Arc::new(CompChannel { ch, _ctx: ctx.clone() });
        set_nonblocking(me.fd())?;
        Ok(me)
    }

    pub(crate) fn fd(&self) -> c_int {
        // SAFETY: `ch` points to the live channel; `fd` is a plain field.
        unsafe { (*self.ch.as_ptr()).fd }
    }

    /// Registers the channel's fd with tokio's reactor. The returned value
    /// keeps the channel (and so the fd) alive.
    pub(crate) fn async_fd(self: &Arc<Self>) -> std::io::Result<tokio::io::unix::AsyncFd<ChannelFd>> {
        let owner = ChannelFd(self.clone());
        // SAFETY: (`register_with_interest` is an unsafe fn) the fd is the
        // open descriptor of the channel that `ChannelFd` keeps alive, so it
        // stays open and the same for the AsyncFd's whole life.
        unsafe { tokio::io::unix::AsyncFd::register_with_interest(owner, tokio::io::Interest::READABLE) }
            .map_err(|e| e.into_parts().1)
    }

    /// Takes one pending event and acknowledges it; `Ok(false)` if none.
    pub(crate) fn take_event(&self) -> Result<bool, VerbsError> {
        let mut cq = ptr::null_mut();
        let mut cq_ctx = ptr::null_mut();
        // SAFETY: channel live; out-pointers valid; the fd is non-blocking.
        let rc = unsafe { ffi::ibv_get_cq_event(self.ch.as_ptr(), &mut cq, &mut cq_ctx) };
        if rc != 0 {
            let e = VerbsError::last("ibv_get_cq_event");
            return if e.errno == libc::EAGAIN { Ok(false) } else { Err(e) };
        }
        // SAFETY: `cq` is the CQ the event belongs to (alive: events are only
        // delivered for CQs of this channel, which hold it); ack exactly once.
        unsafe { ffi::ibv_ack_cq_events(cq, 1) };
        Ok(true)
    }
}

impl Drop for CompChannel {
    fn drop(&mut self) {
        // SAFETY: created by ibv_create_comp_channel, destroyed once after
        // every CQ that uses it (they hold an Arc).
        log_release("ibv_destroy_comp_channel", unsafe { ffi::ibv_destroy_comp_channel(self.ch.as_ptr()) });
    }
}

/// Owns a channel on behalf of tokio's reactor.
#[derive(Debug)]
pub(crate) struct ChannelFd(Arc<CompChannel>);

impl std::os::fd::AsRawFd for ChannelFd {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.0.fd()
    }
}

/// Most completions one [`Cq::poll`] takes.
pub(crate) const POLL_BATCH: usize = 32;

/// One polled completion, copied out of `ibv_wc`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Completion {
    pub wr_id: u64,
    pub status: u32,
    pub vendor_err: u32,
    /// The QP the work request was posted on.
    pub qp_num: u32,
}

/// A completion queue bound to a channel.
#[derive(Debug)]
pub(crate) struct Cq {
    cq: NonNull<ffi::ibv_cq>,
    _ch: Arc<CompChannel>,
    _ctx: Arc<Context>,
}

// SAFETY: see `Context`.
unsafe impl Send for Cq {}
// SAFETY: see `Context`.
unsafe impl Sync for Cq {}

impl Cq {
    pub(crate) fn new(ctx: &Arc<Context>, ch: &Arc<CompChannel>, depth: u32) -> Result<Arc<Self>, VerbsError> {
        // SAFETY: `ctx` and `ch` are live and kept alive by the returned Cq.
        let cq = check("ibv_create_cq", unsafe {
            ffi::ibv_create_cq(ctx.ctx.as_ptr(), depth as c_int, ptr::null_mut(), ch.ch.as_ptr(), 0)
        })?;
        Ok(Arc::new(Cq { cq, _ch: ch.clone(), _ctx: ctx.clone() }))
    }

    /// Arms the CQ: the channel fires on the next completion.
    pub(crate) fn arm(&self) -> Result<(), VerbsError> {
        // SAFETY: the CQ is live.
        check("ibv_req_notify_cq", unsafe { ffi::ibv_req_notify_cq(self.cq.as_ptr(), 0) })
    }

    /// Polls up to `out.capacity()` completions into `out` (cleared first).
    pub(crate) fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize, VerbsError> {
        out.clear();
        // Left uninitialised: zeroing 32 entries on every poll (most of
        // them empty) costs more than the poll itself.
        let mut wcs = [const { std::mem::MaybeUninit::<ffi::ibv_wc>::uninit() }; POLL_BATCH];
        let want = max.min(wcs.len()) as i32;
        // SAFETY: the CQ is live; `wcs` has room for `want` entries
        // (MaybeUninit<ibv_wc> has ibv_wc's layout), which the provider
        // writes; it returns how many it wrote.
        let n = unsafe { ffi::ibv_poll_cq(self.cq.as_ptr(), want, wcs.as_mut_ptr().cast()) };
        if n < 0 {
            return Err(VerbsError::new("ibv_poll_cq", -n));
        }
        let n = (n as usize).min(wcs.len());
        for wc in &wcs[..n] {
            // SAFETY: ibv_poll_cq initialised the first `n` entries.
            let wc = unsafe { wc.assume_init_ref() };
            out.push(Completion { wr_id: wc.wr_id, status: wc.status, vendor_err: wc.vendor_err, qp_num: wc.qp_num });
        }
        Ok(n)
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: created by ibv_create_cq, destroyed once after every QP that
        // uses it (they hold an Arc); all its events were acknowledged in
        // `take_event`, so this does not block.
        log_release("ibv_destroy_cq", unsafe { ffi::ibv_destroy_cq(self.cq.as_ptr()) });
    }
}

/// The CPU's time-stamp counter (0 on other architectures than x86-64):
/// a timestamp that costs no system call, for the benchmark's per-step
/// stamps (in a VM whose clock source is not the TSC, reading the clock
/// is a system call of a few microseconds).
pub fn cycles() -> u64 {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: rdtsc reads a counter; it touches no memory and has no
    // precondition (it is `unsafe` only as every intrinsic is).
    return unsafe { core::arch::x86_64::_rdtsc() };
    #[cfg(not(target_arch = "x86_64"))]
    0
}
