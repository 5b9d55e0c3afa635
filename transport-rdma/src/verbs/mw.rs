//! Memory windows: the keys a peer is given for a staging lease
//! (`crate::staging`). A [`Window`] (type 1) is bound by a [`Binder`] to
//! some bytes of a registration made for windows
//! ([`Registration::for_windows`], whose own rkey reaches nothing), with
//! remote read or remote write; its rkey reaches those bytes only, only
//! that way, and only until the window is deallocated (dropped). All of
//! its `unsafe` has `// SAFETY:` reasons, like the rest of [`super`].

use std::os::raw::c_int;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_sys as ffi;

use super::qp::{Mr, Qp, QpTiming, Registration, RemoteQp};
use super::{check, CompChannel, Completion, Context, Cq, Pd, PortInfo};
use crate::error::VerbsError;

/// Longest wait for a bind's completion: a bind is local work of the
/// device (nothing crosses the wire), done in microseconds.
const BIND_WAIT: Duration = Duration::from_secs(2);

/// A type 1 memory window. Deallocated (its rkey then reaches nothing)
/// when dropped; it keeps the registration it was last bound to
/// registered until then (a device may refuse to deregister memory a
/// window is bound to).
#[derive(Debug)]
pub(crate) struct Window {
    mw: NonNull<ffi::ibv_mw>,
    rkey: u32,
    bound: Option<Arc<Mr>>,
    _pd: Arc<Pd>,
}

// SAFETY: see `Context`.
unsafe impl Send for Window {}
// SAFETY: see `Context`.
unsafe impl Sync for Window {}

impl Window {
    /// Allocates an unbound window in `pd` (its rkey reaches nothing yet).
    /// Fails with `EOPNOTSUPP` on a device without memory windows.
    pub(crate) fn new(pd: &Arc<Pd>) -> Result<Self, VerbsError> {
        // SAFETY: the PD is live and kept alive by the returned window;
        // rdma-sys's inline `ibv_alloc_mw` checks that the provider has the
        // verb (None with errno EOPNOTSUPP otherwise).
        let mw = unsafe { ffi::ibv_alloc_mw(pd.pd.as_ptr(), ffi::ibv_mw_type::IBV_MW_TYPE_1) };
        let mw = check("ibv_alloc_mw", mw.unwrap_or(std::ptr::null_mut()))?;
        // SAFETY: just allocated; `rkey` is a plain field.
        let rkey = unsafe { (*mw.as_ptr()).rkey };
        Ok(Window { mw, rkey, bound: None, _pd: pd.clone() })
    }

    /// The key a peer uses to reach what the window is bound to.
    pub(crate) fn rkey(&self) -> u32 {
        self.rkey
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        // SAFETY: allocated by ibv_alloc_mw (whose provider therefore has
        // the matching dealloc verb), deallocated once. A bound window is
        // invalidated by it; the registration it was bound to is released
        // after this body (field drop).
        let rc = unsafe { ffi::ibv_dealloc_mw(self.mw.as_ptr()) };
        if let Err(e) = check("ibv_dealloc_mw", rc) {
            // The window may still reach the memory: keep it registered.
            tracing::error!("{e}; leaking the registration the window was bound to");
            std::mem::forget(self.bound.take());
        }
    }
}

/// Binds windows: a QP connected to itself (a bind is a work request on
/// some QP of the window's PD; nothing is sent) with a CQ of its own,
/// polled by the caller until the bind completed. Callers serialise on it
/// (one bind at a time) and call it off the runtime.
#[derive(Debug)]
pub(crate) struct Binder {
    ctx: Arc<Context>,
    pd: Arc<Pd>,
    port: PortInfo,
    timing: QpTiming,
    /// The QP and its CQ; `None` after a bind failed or went unanswered
    /// (the QP may be in error): the next bind builds them again.
    link: Option<(Qp, Arc<Cq>)>,
    next: u64,
}

impl Binder {
    /// A QP in `pd` on `port`, connected to itself.
    pub(crate) fn new(ctx: &Arc<Context>, pd: &Arc<Pd>, port: &PortInfo, timing: QpTiming) -> Result<Self, VerbsError> {
        let link = Some(Self::link(ctx, pd, port, timing)?);
        Ok(Binder { ctx: ctx.clone(), pd: pd.clone(), port: port.clone(), timing, link, next: 0 })
    }

    fn link(ctx: &Arc<Context>, pd: &Arc<Pd>, port: &PortInfo, timing: QpTiming) -> Result<(Qp, Arc<Cq>), VerbsError> {
        let ch = CompChannel::new(ctx)?;
        let cq = Cq::new(ctx, &ch, 16)?;
        let qp = Qp::new(pd, &cq, port.port, 8)?;
        let me = RemoteQp { qpn: qp.qpn(), psn: 0, gid: port.gid, lid: port.lid };
        qp.connect(0, &me, port.port, port.gid_index, port.active_mtu, port.max_rd_atom, timing)?;
        Ok((qp, cq))
    }

    /// A new window bound to `len` bytes at `offset` of `reg` (a
    /// registration made [`Registration::for_windows`]), for remote write
    /// if `write`, else remote read, once the device did it.
    pub(crate) fn window(
        &mut self,
        reg: &Registration,
        offset: u64,
        len: u32,
        write: bool,
    ) -> Result<Window, VerbsError> {
        let mut w = Window::new(&self.pd)?;
        self.bind(&mut w, reg, offset, len, write)?;
        Ok(w)
    }

    /// Binds `w` as [`Binder::window`] says and waits until the device did
    /// it. Returns the window's new rkey. The range is checked against
    /// `reg` first.
    fn bind(
        &mut self,
        w: &mut Window,
        reg: &Registration,
        offset: u64,
        len: u32,
        write: bool,
    ) -> Result<u32, VerbsError> {
        if reg.mem().check(offset, u64::from(len)).is_err() || len == 0 {
            return Err(VerbsError::new("ibv_bind_mw (range outside its registration)", libc::EINVAL));
        }
        let mr = reg.shared();
        let access = if write {
            ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
        } else {
            ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ
        };
        let (qp, cq) = match self.link.take() {
            Some(l) => l,
            None => Self::link(&self.ctx, &self.pd, &self.port, self.timing)?,
        };
        self.next = self.next.wrapping_add(1);
        let wr_id = self.next;
        let mut bind = ffi::ibv_mw_bind {
            wr_id,
            send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
            bind_info: ffi::ibv_mw_bind_info {
                mr: mr.as_ptr(),
                addr: reg.mem().addr() + offset,
                length: u64::from(len),
                mw_access_flags: access.0,
            },
        };
        // SAFETY: the window is live (and of type 1, which rdma-sys's
        // inline checks); its context's provider is checked to have the
        // verb before it is called. The QP is live, in the window's PD and
        // connected; the MR is live and kept registered by the window
        // (`bound`, stored below) for as long as the window may reach it:
        // until it is deallocated. The range was checked above to lie
        // inside the registration, and `bind` outlives the call.
        let rc: c_int = unsafe {
            if (*(*w.mw.as_ptr()).context).ops.bind_mw.is_none() {
                libc::EOPNOTSUPP
            } else {
                ffi::ibv_bind_mw(qp.as_ptr(), w.mw.as_ptr(), &mut bind)
            }
        };
        // A QP that refused the post may be in error: built again next time.
        check("ibv_bind_mw", rc)?;
        // Held from the post on, even if the bind fails: the device may
        // still be doing it.
        w.bound = Some(mr);
        Self::wait(&cq, wr_id)?;
        self.link = Some((qp, cq));
        // SAFETY: the window is live; the provider stored the new key in
        // its `rkey` when the bind was posted.
        w.rkey = unsafe { (*w.mw.as_ptr()).rkey };
        Ok(w.rkey)
    }

    /// Polls `cq` until `wr_id` completed, at most [`BIND_WAIT`].
    fn wait(cq: &Cq, wr_id: u64) -> Result<(), VerbsError> {
        let start = Instant::now();
        let mut out: Vec<Completion> = Vec::with_capacity(4);
        let mut spins = 0u32;
        loop {
            cq.poll(&mut out, 4)?;
            if let Some(c) = out.iter().find(|c| c.wr_id == wr_id) {
                return match c.status {
                    0 => Ok(()),
                    s => {
                        tracing::warn!(status = s, vendor_err = c.vendor_err, "rdma: a memory window bind failed");
                        Err(VerbsError::new("ibv_bind_mw (its completion)", libc::EIO))
                    }
                };
            }
            if start.elapsed() > BIND_WAIT {
                return Err(VerbsError::new("ibv_bind_mw (no completion)", libc::ETIMEDOUT));
            }
            spins += 1;
            if spins > 64 {
                std::thread::sleep(Duration::from_micros(20));
            } else {
                std::hint::spin_loop();
            }
        }
    }
}
