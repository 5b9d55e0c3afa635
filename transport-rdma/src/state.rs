//! The transport's bookkeeping, all of it behind one mutex: regions,
//! segments, endpoints (QP groups), batches and posted work requests.
//!
//! Everything here is synchronous and never blocks (verbs calls made under
//! the lock are `ibv_post_send` and `ibv_modify_qp`, which return at once).
//! Objects that must be destroyed are handed back to the caller, which drops
//! them after releasing the lock.
//!
//! Work-request ids are taken from a counter that is never reused within a
//! transport: the id is the slice's generation. A completion whose id is no
//! longer in [`State::wrs`] (its slice was failed, timed out, cancelled or
//! force-reaped) is ignored, so a late completion never touches a request
//! that has moved on.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio::task::AbortHandle;
use transport_core::{
    Access, BatchId, BatchStatus, Error, ErrorKind, Opcode, RegionId, RegionInfo, RequestStatus, SegmentDescriptor,
    SegmentId, TransferRequest,
};

use crate::error::completion_error;
use crate::verbs::{Completion, Cq, Pd, PortInfo, Qp, Registration, WorkRequest};

/// The device objects shared by everything: released (in this order: CQ,
/// channel, PD, context, by the `Arc` chain) when the last user drops them.
#[derive(Debug)]
pub(crate) struct Verbs {
    pub cq: Arc<Cq>,
    pub chan: Arc<crate::verbs::CompChannel>,
    pub pd: Arc<Pd>,
    pub ctx: Arc<crate::verbs::Context>,
    pub port: PortInfo,
}

#[derive(Debug)]
pub(crate) struct LocalRegion {
    pub reg: Registration,
    pub access: Access,
}

#[derive(Debug)]
pub(crate) struct Segment {
    pub desc: SegmentDescriptor,
    /// Serialises endpoint builds for this handle.
    pub connect_lock: Arc<tokio::sync::Mutex<()>>,
}

#[derive(Debug)]
pub(crate) struct QpSlot {
    pub qp: Arc<Qp>,
    pub outstanding: usize,
}

/// A QP group toward one opened segment.
#[derive(Debug)]
pub(crate) struct Endpoint {
    pub segment: SegmentId,
    // Field order is drop order: QPs first, then the side channel (whose
    // close makes the peer destroy its half).
    pub qps: Vec<QpSlot>,
    pub pending: VecDeque<Slice>,
    pub next_qp: usize,
    pub last_used: Instant,
    /// When its QPs were created (async events read before that are not about it).
    pub created: Instant,
    /// Set when the endpoint broke (QPs moved to ERROR): it is never used
    /// again and is destroyed once its posted work has flushed.
    pub broken_at: Option<Instant>,
    /// The side channel, until the watcher task takes it over.
    pub stream: Option<TcpStream>,
    /// Watches the side channel: the peer closing it (crash, shutdown)
    /// breaks the endpoint at once instead of after the QP retry timeout.
    /// Aborted (closing the socket, which frees the peer's half) on drop.
    pub watcher: Option<AbortHandle>,
    /// Its place under `max_endpoints`, given back only after the QPs above
    /// were destroyed (fields drop in order), so the kernel's QP count
    /// never exceeds max_endpoints x qps_per_endpoint, not even while a
    /// replacement is being built.
    pub _slot: EndpointSlot,
}

/// One of `max_endpoints` places, held from the start of an endpoint's
/// build until its QPs are destroyed.
#[derive(Debug)]
pub(crate) struct EndpointSlot(Arc<AtomicUsize>);

impl EndpointSlot {
    /// Takes a place if fewer than `max` are held.
    pub(crate) fn try_take(held: &Arc<AtomicUsize>, max: usize) -> Option<Self> {
        held.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < max).then_some(n + 1))
            .ok()
            .map(|_| EndpointSlot(held.clone()))
    }
}

impl Drop for EndpointSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        if let Some(h) = self.watcher.take() {
            h.abort();
        }
    }
}

impl Endpoint {
    fn outstanding(&self) -> usize {
        self.qps.iter().map(|q| q.outstanding).sum()
    }

    pub(crate) fn idle(&self) -> bool {
        self.outstanding() == 0 && self.pending.is_empty()
    }
}

/// A piece of a request, posted as one work request.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Slice {
    pub batch: BatchId,
    pub req: usize,
    pub offset: u64,
    pub len: u32,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct WrRef {
    pub ep: u64,
    pub qp: usize,
    pub slice: Slice,
}

#[derive(Debug)]
pub(crate) struct Req {
    pub spec: TransferRequest,
    pub status: RequestStatus,
    pub rkey: u32,
    pub slices_left: u64,
    /// Posted work requests not yet completed (or reaped).
    pub outstanding: usize,
}

#[derive(Debug)]
pub(crate) struct Batch {
    pub reqs: Vec<Req>,
    pub notify: Arc<Notify>,
    pub deadline: Option<AbortHandle>,
}

impl Batch {
    /// The caller's view: a request with posted work still outstanding is
    /// `Pending` whatever was decided for it, so "terminal" always means
    /// "quiet" (rule 5).
    pub(crate) fn snapshot(&self) -> BatchStatus {
        BatchStatus::from_requests(
            self.reqs
                .iter()
                .map(|r| if r.outstanding > 0 { RequestStatus::Pending } else { r.status.clone() })
                .collect(),
        )
    }

    pub(crate) fn outstanding(&self) -> usize {
        self.reqs.iter().map(|r| r.outstanding).sum()
    }
}

/// The QPs peers hold into us, alive while their side channel is open.
#[derive(Debug)]
pub(crate) struct PassiveConn {
    pub qps: Vec<Qp>,
    /// When its QPs were created (async events read before that are not about it).
    pub created: Instant,
}

/// Things to destroy after the lock is released.
#[derive(Debug, Default)]
pub(crate) struct Graveyard {
    pub endpoints: Vec<Endpoint>,
    pub regions: Vec<LocalRegion>,
    pub passive: Vec<PassiveConn>,
}

impl Graveyard {
    pub(crate) fn is_empty(&self) -> bool {
        self.endpoints.is_empty() && self.regions.is_empty() && self.passive.is_empty()
    }
}

impl Drop for Graveyard {
    fn drop(&mut self) {
        for ep in &self.endpoints {
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

#[derive(Debug, Default)]
pub(crate) struct State {
    pub shutdown: bool,
    pub verbs: Option<Arc<Verbs>>,
    pub regions: BTreeMap<RegionId, LocalRegion>,
    pub segments: HashMap<SegmentId, Segment>,
    pub endpoints: HashMap<u64, Endpoint>,
    /// Live (unbroken) endpoint of each segment handle.
    pub seg_ep: HashMap<SegmentId, u64>,
    /// Places under `max_endpoints` held by live, dying and connecting
    /// endpoints (see [`EndpointSlot`]).
    pub slots: Arc<AtomicUsize>,
    pub batches: HashMap<BatchId, Batch>,
    pub wrs: HashMap<u64, WrRef>,
    pub passive: HashMap<u64, PassiveConn>,
    pub passive_tasks: HashMap<u64, AbortHandle>,
    pub deadline_tasks: usize,
    /// Set on IBV_EVENT_DEVICE_FATAL: the device is gone for good.
    pub device_failed: bool,
    pub next_id: u64,
    pub next_wr: u64,
}

/// Knobs the bookkeeping needs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub max_outstanding_per_qp: usize,
    pub flush_timeout: Duration,
    pub idle_timeout: Duration,
}

impl State {
    /// Whether endpoint `ep` exists and is not broken.
    pub(crate) fn usable(&self, ep: u64) -> bool {
        match self.endpoints.get(&ep) {
            Some(e) => e.broken_at.is_none(),
            None => false,
        }
    }

    pub(crate) fn next_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// Sets a request's terminal status if it is still pending (terminal
    /// states are sticky) and wakes the batch's waiters.
    pub(crate) fn finish_req(&mut self, batch: BatchId, req: usize, status: RequestStatus) {
        if let Some(b) = self.batches.get_mut(&batch) {
            if let Some(r) = b.reqs.get_mut(req) {
                if !r.status.is_terminal() {
                    r.status = status;
                }
            }
            b.notify.notify_waiters();
        }
    }

    fn req_pending(&self, s: &Slice) -> bool {
        self.batches.get(&s.batch).and_then(|b| b.reqs.get(s.req)).is_some_and(|r| !r.status.is_terminal())
    }

    /// Posts queued slices of endpoint `ep` while its QPs have room.
    pub(crate) fn pump(&mut self, ep_id: u64, lim: &Limits, grave: &mut Graveyard) {
        loop {
            let Some(ep) = self.endpoints.get_mut(&ep_id) else { return };
            if ep.broken_at.is_some() {
                return;
            }
            let Some(slice) = ep.pending.pop_front() else { return };
            if !self.req_pending(&slice) {
                continue;
            }
            let Some(ep) = self.endpoints.get_mut(&ep_id) else { return };
            let n = ep.qps.len();
            let Some(qi) =
                (0..n).map(|k| (ep.next_qp + k) % n).find(|&i| ep.qps[i].outstanding < lim.max_outstanding_per_qp)
            else {
                ep.pending.push_front(slice);
                return;
            };
            ep.next_qp = (qi + 1) % n;
            let Some(req) = self.batches.get(&slice.batch).and_then(|b| b.reqs.get(slice.req)) else { continue };
            let spec = req.spec;
            let rkey = req.rkey;
            let Some(region) = self.regions.get(&spec.local) else {
                let e = Error::new(ErrorKind::Unregistered, "local region was unregistered").with("region", spec.local);
                self.finish_req(slice.batch, slice.req, RequestStatus::Failed(e));
                continue;
            };
            self.next_wr += 1;
            let wr = WorkRequest {
                wr_id: self.next_wr,
                read: spec.op == Opcode::Read,
                local_offset: spec.local_offset + slice.offset,
                len: slice.len,
                remote_addr: spec.remote_addr + slice.offset,
                rkey,
            };
            let Some(ep) = self.endpoints.get_mut(&ep_id) else { return };
            let posted = ep.qps[qi].qp.post(&region.reg, &wr);
            match posted {
                Ok(()) => {
                    ep.qps[qi].outstanding += 1;
                    ep.last_used = Instant::now();
                    if let Some(r) = self.batches.get_mut(&slice.batch).and_then(|b| b.reqs.get_mut(slice.req)) {
                        r.outstanding += 1;
                    }
                    self.wrs.insert(wr.wr_id, WrRef { ep: ep_id, qp: qi, slice });
                }
                Err(e) => {
                    let e: Error = e.into();
                    let e = if e.kind() == ErrorKind::ResourceExhausted {
                        Error::new(ErrorKind::ConnectionReset, e.message().to_string())
                    } else {
                        e
                    };
                    self.finish_req(slice.batch, slice.req, RequestStatus::Failed(e.clone()));
                    self.break_endpoint(ep_id, e, grave);
                    return;
                }
            }
        }
    }

    /// Applies one completion.
    pub(crate) fn on_completion(&mut self, c: &Completion, lim: &Limits, grave: &mut Graveyard) {
        let Some(w) = self.wrs.remove(&c.wr_id) else {
            return; // late: its slice was already settled
        };
        if let Some(ep) = self.endpoints.get_mut(&w.ep) {
            if let Some(q) = ep.qps.get_mut(w.qp) {
                q.outstanding = q.outstanding.saturating_sub(1);
            }
            ep.last_used = Instant::now();
        }
        let s = w.slice;
        let mut failed = None;
        if let Some(b) = self.batches.get_mut(&s.batch) {
            if let Some(r) = b.reqs.get_mut(s.req) {
                r.outstanding = r.outstanding.saturating_sub(1);
                if c.status == rdma_sys::ibv_wc_status::IBV_WC_SUCCESS {
                    if !r.status.is_terminal() {
                        r.slices_left = r.slices_left.saturating_sub(1);
                        if r.slices_left == 0 {
                            r.status = RequestStatus::Completed;
                        }
                    }
                } else {
                    let e = completion_error(c.status, c.vendor_err).with("request", s.req);
                    if !r.status.is_terminal() {
                        r.status = RequestStatus::Failed(e.clone());
                    }
                    failed = Some(e);
                }
            }
            b.notify.notify_waiters();
        }
        if c.status != rdma_sys::ibv_wc_status::IBV_WC_SUCCESS {
            let e = failed.unwrap_or_else(|| completion_error(c.status, c.vendor_err));
            // Rule 2: a completion error breaks the QP; the endpoint goes.
            self.break_endpoint(w.ep, e, grave);
        }
        match self.endpoints.get(&w.ep) {
            Some(ep) if ep.broken_at.is_some() && ep.outstanding() == 0 => {
                if let Some(ep) = self.endpoints.remove(&w.ep) {
                    grave.endpoints.push(ep);
                }
            }
            Some(ep) if ep.broken_at.is_some() => {}
            Some(_) => self.pump(w.ep, lim, grave),
            None => {}
        }
    }

    /// Marks an endpoint broken: no new work, QPs to ERROR (posted work
    /// flushes), queued slices fail. It is destroyed at once if nothing is
    /// posted, else when its flushed completions arrive (or the flush
    /// timeout passes, see [`State::reap`]).
    pub(crate) fn break_endpoint(&mut self, ep_id: u64, reason: Error, grave: &mut Graveyard) {
        let Some(ep) = self.endpoints.get_mut(&ep_id) else { return };
        if ep.broken_at.is_none() {
            ep.broken_at = Some(Instant::now());
            for q in &ep.qps {
                if let Err(e) = q.qp.set_error() {
                    tracing::warn!("{e}");
                }
            }
        }
        let seg = ep.segment;
        let queued: Vec<Slice> = ep.pending.drain(..).collect();
        let idle = ep.outstanding() == 0;
        if self.seg_ep.get(&seg) == Some(&ep_id) {
            self.seg_ep.remove(&seg);
        }
        let reset = if reason.kind() == ErrorKind::ConnectionReset || reason.kind() == ErrorKind::RetryExceeded {
            reason
        } else {
            Error::new(ErrorKind::ConnectionReset, format!("endpoint destroyed: {}", reason.message()))
        };
        for s in queued {
            self.finish_req(s.batch, s.req, RequestStatus::Failed(reset.clone().with("request", s.req)));
        }
        if idle {
            if let Some(ep) = self.endpoints.remove(&ep_id) {
                grave.endpoints.push(ep);
            }
        }
    }

    /// Breaks whatever owns QP number `qpn` (an async event read at `at`
    /// said it failed): our endpoint, or a peer's QP group (dropped, which
    /// closes its side channel so the peer breaks its half at once). A QP
    /// created after `at` is a newer one that reuses the number: untouched.
    pub(crate) fn break_qp(&mut self, qpn: u32, at: Instant, why: Error, grave: &mut Graveyard) {
        let ep = self
            .endpoints
            .iter()
            .find(|(_, e)| e.created <= at && e.qps.iter().any(|q| q.qp.qpn() == qpn))
            .map(|(id, _)| *id);
        if let Some(ep) = ep {
            self.break_endpoint(ep, why, grave);
            return;
        }
        let passive = self
            .passive
            .iter()
            .find(|(_, p)| p.created <= at && p.qps.iter().any(|q| q.qpn() == qpn))
            .map(|(id, _)| *id);
        if let Some(id) = passive {
            self.drop_passive(id, grave);
        }
    }

    /// Breaks every endpoint and drops every peer QP group that existed at
    /// `at` (port down, device failure, lost completions); ones built since
    /// (after the port came back) are left alone.
    pub(crate) fn break_all(&mut self, at: Instant, why: &Error, grave: &mut Graveyard) {
        let ids: Vec<u64> = self.endpoints.iter().filter(|(_, e)| e.created <= at).map(|(id, _)| *id).collect();
        for id in ids {
            self.break_endpoint(id, why.clone(), grave);
        }
        let ids: Vec<u64> = self.passive.iter().filter(|(_, p)| p.created <= at).map(|(id, _)| *id).collect();
        for id in ids {
            self.drop_passive(id, grave);
        }
    }

    /// Stops serving a peer's QP group: its task (and so its side channel)
    /// ends and its QPs go to the graveyard.
    fn drop_passive(&mut self, id: u64, grave: &mut Graveyard) {
        if let Some(h) = self.passive_tasks.remove(&id) {
            h.abort();
        }
        if let Some(p) = self.passive.remove(&id) {
            grave.passive.push(p);
        }
    }

    /// Destroys broken endpoints whose work has flushed, force-destroys
    /// those whose flush took longer than the limit (destroying the QP is
    /// what guarantees the NIC is done with the buffers), and reclaims idle
    /// endpoints (rule 4). `force` destroys every broken endpoint now.
    pub(crate) fn reap(&mut self, lim: &Limits, force: bool, grave: &mut Graveyard) {
        let now = Instant::now();
        let mut doomed = Vec::new();
        for (id, ep) in &self.endpoints {
            match ep.broken_at {
                Some(t) if force || ep.outstanding() == 0 || now.duration_since(t) >= lim.flush_timeout => {
                    doomed.push(*id)
                }
                None if ep.idle() && now.duration_since(ep.last_used) >= lim.idle_timeout => doomed.push(*id),
                _ => {}
            }
        }
        for id in doomed {
            self.destroy_endpoint_now(id, grave);
        }
    }

    /// Removes an endpoint, settling every work request still posted on it
    /// (they can no longer complete once the QP is destroyed).
    pub(crate) fn destroy_endpoint_now(&mut self, ep_id: u64, grave: &mut Graveyard) {
        let Some(mut ep) = self.endpoints.remove(&ep_id) else { return };
        if self.seg_ep.get(&ep.segment) == Some(&ep_id) {
            self.seg_ep.remove(&ep.segment);
        }
        let ids: Vec<u64> = self.wrs.iter().filter(|(_, w)| w.ep == ep_id).map(|(k, _)| *k).collect();
        for id in ids {
            if let Some(w) = self.wrs.remove(&id) {
                if let Some(r) = self.batches.get_mut(&w.slice.batch).and_then(|b| b.reqs.get_mut(w.slice.req)) {
                    r.outstanding = r.outstanding.saturating_sub(1);
                }
                let e = Error::new(ErrorKind::ConnectionReset, "endpoint destroyed with work in flight");
                self.finish_req(w.slice.batch, w.slice.req, RequestStatus::Failed(e));
            }
        }
        for s in ep.pending.drain(..) {
            let e = Error::new(ErrorKind::ConnectionReset, "endpoint destroyed before the slice was posted");
            self.finish_req(s.batch, s.req, RequestStatus::Failed(e));
        }
        grave.endpoints.push(ep);
    }

    /// Endpoints holding posted work of requests that match `pred`.
    pub(crate) fn endpoints_with(&self, pred: impl Fn(BatchId, &Req) -> bool) -> HashSet<u64> {
        self.wrs
            .values()
            .filter(|w| {
                self.batches
                    .get(&w.slice.batch)
                    .and_then(|b| b.reqs.get(w.slice.req))
                    .is_some_and(|r| pred(w.slice.batch, r))
            })
            .map(|w| w.ep)
            .collect()
    }

    /// Ends every pending request matching `pred` with `status`, and breaks
    /// the endpoints that carry their posted work so it flushes.
    pub(crate) fn end_requests(
        &mut self,
        pred: impl Fn(BatchId, &Req) -> bool + Copy,
        status: RequestStatus,
        grave: &mut Graveyard,
    ) {
        let mut hit = Vec::new();
        for (id, b) in &self.batches {
            for (i, r) in b.reqs.iter().enumerate() {
                if !r.status.is_terminal() && pred(*id, r) {
                    hit.push((*id, i));
                }
            }
        }
        let eps = self.endpoints_with(pred);
        for (b, i) in hit {
            self.finish_req(b, i, status.clone());
        }
        for ep in eps {
            let why = Error::new(ErrorKind::ConnectionReset, "endpoint reset to stop work in flight");
            self.break_endpoint(ep, why, grave);
        }
    }

    /// Whether any posted work belongs to a request matching `pred`.
    pub(crate) fn any_posted(&self, pred: impl Fn(BatchId, &Req) -> bool) -> bool {
        self.wrs.values().any(|w| {
            self.batches
                .get(&w.slice.batch)
                .and_then(|b| b.reqs.get(w.slice.req))
                .is_some_and(|r| pred(w.slice.batch, r))
        })
    }

    /// The descriptor peers see: regions with any remote access.
    pub(crate) fn descriptor(&self, name: &str, generation: u64, address: &str) -> SegmentDescriptor {
        SegmentDescriptor {
            name: name.to_string(),
            backend: "rdma".into(),
            generation,
            address: address.to_string(),
            regions: self
                .regions
                .values()
                .filter(|r| r.access.is_remote())
                .map(|r| RegionInfo {
                    addr: r.reg.mem().addr(),
                    len: r.reg.mem().len() as u64,
                    access: r.access,
                    key: u64::from(r.reg.rkey()),
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_slots_are_bounded_and_given_back_on_drop() {
        let held = Arc::new(AtomicUsize::new(0));
        let a = EndpointSlot::try_take(&held, 2).expect("first place");
        let b = EndpointSlot::try_take(&held, 2).expect("second place");
        assert!(EndpointSlot::try_take(&held, 2).is_none(), "a third place under a bound of 2");
        drop(a);
        let c = EndpointSlot::try_take(&held, 2).expect("a place given back is free again");
        drop((b, c));
        assert_eq!(held.load(Ordering::Acquire), 0);
    }
}
