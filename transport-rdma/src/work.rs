//! The data path over the lifecycle core: slices are posted as work
//! requests (ledger units: [`BatchLedger::start`] before each post,
//! [`BatchLedger::unit_done`] for each completion, in CQ order), endpoints
//! break and are destroyed ([`EndpointPool::broken`], the place freed by
//! [`Inner::with_state`] once the QPs are gone), and requests end early
//! ([`BatchLedger::end_where`]) with the endpoints carrying their posted
//! work reset so it flushes ("terminal means quiet").
//!
//! [`BatchLedger::start`]: transport_core::lifecycle::BatchLedger::start
//! [`BatchLedger::unit_done`]: transport_core::lifecycle::BatchLedger::unit_done
//! [`BatchLedger::end_where`]: transport_core::lifecycle::BatchLedger::end_where
//! [`EndpointPool::broken`]: transport_core::lifecycle::EndpointPool::broken

use std::collections::HashSet;
use std::time::{Duration, Instant};

use transport_core::lifecycle::{EndReason, EndpointId};
use transport_core::{BatchId, Error, ErrorKind, Opcode};

use crate::error::completion_error;
use crate::stage::{no_staging, CopyDir, StageCopy};
use crate::state::{Graveyard, Inner, Limits, PeerGroupId, Slice, State, Target, WrId, WrRef};
use crate::verbs::{Completion, WorkRequest};

/// How often [`Inner::settle`] looks again.
const SETTLE_POLL: Duration = Duration::from_millis(1);
/// Added to twice the flush timeout before [`Inner::settle`] destroys
/// every broken endpoint regardless.
const SETTLE_GRACE: Duration = Duration::from_millis(100);

impl State {
    /// Ends request `req` of `batch` early (first decision wins).
    pub(crate) fn end_request(&mut self, batch: BatchId, req: usize, reason: EndReason) {
        if let Ok(b) = self.batches.get_mut(batch) {
            let p = b.ledger.end(req, reason);
            b.wake(p);
        }
    }

    /// Posts queued slices of endpoint `ep_id` while its QPs have room.
    /// Each work request is a ledger unit, started before it is posted; a
    /// slice of a request that is no longer live is dropped unposted.
    pub(crate) fn pump(&mut self, ep_id: EndpointId, lim: &Limits, grave: &mut Graveyard) {
        loop {
            let Some(ep) = self.endpoints.get_mut(&ep_id) else { return };
            if ep.broken_at.is_some() {
                return;
            }
            let n = ep.qps.len();
            let Some(qi) =
                (0..n).map(|k| (ep.next_qp + k) % n).find(|&i| ep.qps[i].outstanding < lim.max_outstanding_per_qp)
            else {
                return;
            };
            // Staged writes whose buffer is filled go first: their units
            // are started and they hold a buffer.
            let (slice, filled) = match ep.ready.pop_front() {
                Some((s, slot)) => (s, Some(slot)),
                None => match ep.pending.pop_front() {
                    Some(s) => (s, None),
                    None => return,
                },
            };
            let Ok(b) = self.batches.get_mut(slice.batch) else { continue };
            let Some(&Target { spec, rkey }) = b.targets.get(slice.req) else { continue };
            // Remote staged memory never comes through here (its driver
            // posts for it): refused rather than posted without a key.
            let Some(rkey) = rkey else {
                let e = Error::new(ErrorKind::Internal, "a slice of remote staged memory queued for posting");
                let p = match filled {
                    Some(_) => b.ledger.unit_done(slice.req, Err(e)),
                    None => b.ledger.end(slice.req, EndReason::Failed(e)),
                };
                b.wake(p);
                if let (Some(slot), Some(st)) = (filled, self.staging.as_mut()) {
                    st.free.push(slot);
                }
                continue;
            };
            let read = spec.op == Opcode::Read;
            // A request that is no longer live is neither ended again (the
            // first decision stands) nor started.
            let Some(region) = self.regions.get(&spec.local) else {
                let p = match filled {
                    Some(_) => b.ledger.unit_done(slice.req, Err(Error::region_unregistered(spec.local))),
                    None => b.ledger.end(slice.req, EndReason::Failed(Error::region_unregistered(spec.local))),
                };
                b.wake(p);
                if let (Some(slot), Some(st)) = (filled, self.staging.as_mut()) {
                    st.free.push(slot);
                }
                continue;
            };
            // Which registration the NIC uses, at which offset: the
            // region's own, or a staging buffer.
            let slot = match (filled, &region.reg) {
                // Ended since its buffer was filled: it goes nowhere.
                (Some(slot), _) if !b.ledger.is_live(slice.req) => {
                    let p = b.ledger.unit_back(slice.req);
                    b.wake(p);
                    if let Some(st) = self.staging.as_mut() {
                        st.free.push(slot);
                    }
                    continue;
                }
                (Some(slot), _) => Some(slot),
                (None, Some(_)) => {
                    if !b.ledger.start(slice.req) {
                        continue;
                    }
                    None
                }
                (None, None) => {
                    let Some(staging) = self.staging.as_mut() else {
                        let p = b.ledger.end(slice.req, EndReason::Failed(no_staging()));
                        b.wake(p);
                        continue;
                    };
                    let Some(slot) = staging.free.pop() else {
                        ep.pending.push_front(slice);
                        if !staging.waiting.contains(&ep_id) {
                            staging.waiting.push(ep_id);
                        }
                        return;
                    };
                    if !b.ledger.start(slice.req) {
                        staging.free.push(slot);
                        continue;
                    }
                    if !read {
                        // Fill the buffer first (off the lock); the slice
                        // comes back through `ready`.
                        let dir = CopyDir::ToBuffer;
                        match StageCopy::new(Some(staging), dir, ep_id, slice, slot, &region.mem, spec.local_offset) {
                            Ok(c) => {
                                ep.copying += 1;
                                grave.copies.push(c);
                            }
                            Err(e) => {
                                let p = b.ledger.unit_done(slice.req, Err(e));
                                b.wake(p);
                                staging.free.push(slot);
                            }
                        }
                        continue;
                    }
                    Some(slot)
                }
            };
            let (local, local_offset) = match (slot, &region.reg, &self.staging) {
                (Some(slot), _, Some(staging)) => (&staging.reg, staging.offset(slot)),
                // No overflow: submit checked local_offset + len against
                // the region.
                (None, Some(reg), _) => (reg, spec.local_offset + slice.offset),
                _ => {
                    let p = b.ledger.unit_done(slice.req, Err(no_staging()));
                    b.wake(p);
                    continue;
                }
            };
            let wr_id = self.wr_ids.next();
            // No overflow: submit checked remote_addr + len for overflow.
            let wr = WorkRequest {
                wr_id: wr_id.0,
                read,
                local_offset,
                len: slice.len,
                remote_addr: spec.remote_addr + slice.offset,
                rkey,
            };
            ep.next_qp = (qi + 1) % n;
            let q = &mut ep.qps[qi];
            match q.qp.post(local, &wr) {
                Ok(()) => {
                    q.outstanding += 1;
                    self.wrs.insert(wr_id, WrRef { ep: ep_id, qp: qi, slice, slot, waiter: None });
                }
                Err(e) => {
                    let e: Error = e.into();
                    let e = if e.kind() == ErrorKind::ResourceExhausted {
                        Error::new(ErrorKind::ConnectionReset, e.message().to_string())
                    } else {
                        e
                    };
                    let p = b.ledger.unit_done(slice.req, Err(e.clone()));
                    b.wake(p);
                    if let (Some(slot), Some(st)) = (slot, self.staging.as_mut()) {
                        st.free.push(slot);
                    }
                    self.break_endpoint(ep_id, e, grave);
                    return;
                }
            }
        }
    }

    /// Applies one completion. `link_down`, when the port was found down
    /// as this completion was read, replaces its error status.
    pub(crate) fn on_completion(
        &mut self,
        c: &Completion,
        link_down: Option<&Error>,
        lim: &Limits,
        grave: &mut Graveyard,
    ) {
        let Some(w) = self.wrs.remove(&WrId(c.wr_id)) else {
            return; // late: its endpoint was destroyed
        };
        let mut posted_on = None;
        if let Some(q) = self.endpoints.get_mut(&w.ep).and_then(|ep| ep.qps.get_mut(w.qp)) {
            q.outstanding = q.outstanding.saturating_sub(1);
            posted_on = Some(q.qp.qpn());
        }
        let mut failed = (c.status != rdma_sys::ibv_wc_status::IBV_WC_SUCCESS).then(|| match link_down {
            Some(e) => e.clone().with("wc_status", c.status),
            None => completion_error(c.status, c.vendor_err),
        });
        let mut w = w;
        // A completion must come from the QP its work request was posted
        // on; one that does not is never taken as data in place.
        if posted_on.is_some_and(|qpn| qpn != c.qp_num) {
            tracing::error!(wr_id = c.wr_id, qp_num = c.qp_num, posted_on = ?posted_on, "rdma: a completion from another queue pair");
            failed = Some(Error::new(
                ErrorKind::Internal,
                "a completion came from another queue pair than its work request's",
            ));
        }
        if let Some(waiter) = w.waiter.take() {
            // A staging driver's: it owns the unit and its buffers.
            let _ = waiter.send(match &failed {
                None => Ok(()),
                Some(e) => Err(e.clone()),
            });
            if let Some(e) = failed {
                self.break_endpoint(w.ep, e, grave);
            }
            self.after_work(w.ep, lim, grave);
            return;
        }
        // A staged READ's bytes are in its buffer: the unit ends once
        // they are copied to the device (if the request still wants them).
        let drain = w.slot.filter(|_| failed.is_none()).and_then(|slot| {
            let b = self.batches.get(w.slice.batch).ok()?;
            let t = b.targets.get(w.slice.req)?;
            (t.spec.op == Opcode::Read && b.ledger.is_live(w.slice.req)).then_some((slot, t.spec))
        });
        if let Some((slot, spec)) = drain {
            let copy = match self.regions.get(&spec.local) {
                Some(r) => StageCopy::new(
                    self.staging.as_ref(),
                    CopyDir::FromBuffer,
                    w.ep,
                    w.slice,
                    slot,
                    &r.mem,
                    spec.local_offset,
                ),
                None => Err(Error::region_unregistered(spec.local)),
            };
            match copy {
                Ok(c) => {
                    if let Some(ep) = self.endpoints.get_mut(&w.ep) {
                        ep.copying += 1;
                    }
                    grave.copies.push(c);
                }
                Err(e) => {
                    if let Ok(b) = self.batches.get_mut(w.slice.batch) {
                        let p = b.ledger.unit_done(w.slice.req, Err(e));
                        b.wake(p);
                    }
                    self.free_slots(vec![slot], lim, grave);
                }
            }
        } else {
            if let Ok(b) = self.batches.get_mut(w.slice.batch) {
                let result = match &failed {
                    None => Ok(()),
                    Some(e) => Err(e.clone()),
                };
                let p = b.ledger.unit_done(w.slice.req, result);
                b.wake(p);
            }
            if let Some(slot) = w.slot {
                self.free_slots(vec![slot], lim, grave);
            }
        }
        if let Some(e) = failed {
            // Rule 2: a completion error breaks the QP; the endpoint goes.
            self.break_endpoint(w.ep, e, grave);
        }
        self.after_work(w.ep, lim, grave);
    }

    /// After work on `ep_id` ended: a broken endpoint that has flushed is
    /// destroyed; a live one posts what is queued and, once idle, gives its
    /// use back to the pool (it may then be evicted or reclaimed).
    pub(crate) fn after_work(&mut self, ep_id: EndpointId, lim: &Limits, grave: &mut Graveyard) {
        match self.endpoints.get(&ep_id) {
            Some(ep) if ep.broken_at.is_some() && ep.outstanding() == 0 => {
                if let Some(ep) = self.endpoints.remove(&ep_id) {
                    grave.endpoints.push((ep_id, ep));
                }
            }
            Some(ep) if ep.broken_at.is_some() => {}
            Some(_) => {
                self.pump(ep_id, lim, grave);
                if let Some(ep) = self.endpoints.get_mut(&ep_id) {
                    if ep.busy && ep.broken_at.is_none() && ep.idle() {
                        ep.busy = false;
                        let now = self.epoch.now();
                        self.pool.release(ep_id, now);
                        // Idle now: if it pins an unregistered region, it
                        // goes, so that region's MR is released.
                        self.drop_if_pinning_retired(ep_id, grave);
                    }
                }
            }
            None => {}
        }
        self.pump_waiting(lim, grave);
    }

    /// Destroys endpoint `ep_id` if it is idle and one of its QPs pins a
    /// retiring (unregistered) region, which it would otherwise keep
    /// registered until the endpoint is destroyed.
    pub(crate) fn drop_if_pinning_retired(&mut self, ep_id: EndpointId, grave: &mut Graveyard) {
        if self.retiring.is_empty() {
            return;
        }
        let Some(ep) = self.endpoints.get(&ep_id) else { return };
        if ep.idle() && ep.qps.iter().any(|q| self.retiring.iter().any(|r| q.qp.pins(r))) {
            let why = Error::new(ErrorKind::ConnectionReset, "endpoint released an unregistered region");
            self.break_endpoint(ep_id, why, grave);
        }
    }

    /// Marks an endpoint broken: never handed out again, QPs to ERROR
    /// (posted work flushes), queued slices fail. It is destroyed at once
    /// if nothing is posted, else when its flushed completions arrive (or
    /// the flush timeout passes, see [`State::reap`]).
    pub(crate) fn break_endpoint(&mut self, ep_id: EndpointId, reason: Error, grave: &mut Graveyard) {
        let Some(ep) = self.endpoints.get_mut(&ep_id) else { return };
        if ep.broken_at.is_none() {
            tracing::debug!(endpoint = ?ep_id, outstanding = ep.outstanding(), reason = %reason, "rdma: endpoint broken");
            ep.broken_at = Some(Instant::now());
            for q in &ep.qps {
                if let Err(e) = q.qp.set_error() {
                    tracing::warn!("{e}");
                }
            }
        }
        let queued: Vec<Slice> = ep.pending.drain(..).collect();
        let idle = ep.outstanding() == 0;
        self.pool.broken(ep_id);
        let reset = if matches!(reason.kind(), ErrorKind::ConnectionReset | ErrorKind::RetryExceeded) {
            reason
        } else {
            Error::new(ErrorKind::ConnectionReset, format!("endpoint destroyed: {}", reason.message()))
        };
        self.drop_ready(ep_id, &reset);
        for s in queued {
            self.end_request(s.batch, s.req, EndReason::Failed(reset.clone()));
        }
        if idle {
            if let Some(ep) = self.endpoints.remove(&ep_id) {
                grave.endpoints.push((ep_id, ep));
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
        let ids: Vec<EndpointId> = self.endpoints.iter().filter(|(_, e)| e.created <= at).map(|(id, _)| *id).collect();
        for id in ids {
            self.break_endpoint(id, why.clone(), grave);
        }
        let ids: Vec<PeerGroupId> = self.passive.iter().filter(|(_, p)| p.created <= at).map(|(id, _)| *id).collect();
        for id in ids {
            self.drop_passive(id, grave);
        }
    }

    /// Stops serving a peer's QP group: its task (and so its side channel)
    /// ends and its QPs go to the graveyard.
    pub(crate) fn drop_passive(&mut self, id: PeerGroupId, grave: &mut Graveyard) {
        self.passive_tasks.remove(&id); // aborts it
        if let Some(p) = self.passive.remove(&id) {
            grave.passive.push(p);
        }
    }

    /// Destroys broken endpoints whose work has flushed, force-destroys
    /// those whose flush took longer than the limit (destroying the QP is
    /// what guarantees the NIC is done with the buffers), and reclaims idle
    /// endpoints ([`EndpointPool::reap`], rule 4). `force` destroys every
    /// broken endpoint now. Idle notification channels are closed as well.
    ///
    /// [`EndpointPool::reap`]: transport_core::lifecycle::EndpointPool::reap
    pub(crate) fn reap(&mut self, lim: &Limits, force: bool, grave: &mut Graveyard) {
        let now = Instant::now();
        let mut doomed: Vec<EndpointId> = self
            .endpoints
            .iter()
            .filter(|(_, ep)| {
                ep.broken_at
                    .is_some_and(|t| force || ep.outstanding() == 0 || now.duration_since(t) >= lim.flush_timeout)
            })
            .map(|(id, _)| *id)
            .collect();
        let clock = self.now();
        let reaped = self.pool.reap(clock, lim.idle_timeout);
        if !reaped.is_empty() {
            crate::counters::endpoint_event("reclaimed", reaped.len() as u64);
        }
        doomed.extend(reaped);
        // Idle notification channels are closed too (their carrier is
        // aborted with them); the next notification opens a new one.
        for s in self.segments.values_mut() {
            if s.notes.as_ref().is_some_and(|n| n.idle(now, lim.idle_timeout)) {
                s.notes = None;
            }
        }
        for id in doomed {
            self.destroy_endpoint_now(id, grave);
        }
        self.prune_retiring(grave);
        self.remove_orphans(grave);
    }

    /// Removes an endpoint. The work requests still posted on it can no
    /// longer complete once its QPs are destroyed: they are forgotten here
    /// (a late completion is ignored) and recorded in the graveyard, whose
    /// owner ([`Inner::with_state`]) settles them only after the QPs were
    /// destroyed, so no batch is reported terminal while a QP that may
    /// still touch its memory exists (rule 5).
    pub(crate) fn destroy_endpoint_now(&mut self, ep_id: EndpointId, grave: &mut Graveyard) {
        self.pool.broken(ep_id);
        let unposted = Error::new(ErrorKind::ConnectionReset, "endpoint destroyed before the slice was posted");
        self.drop_ready(ep_id, &unposted);
        let Some(mut ep) = self.endpoints.remove(&ep_id) else { return };
        if ep.outstanding() > 0 {
            let mine: Vec<WrId> = self.wrs.iter().filter(|(_, w)| w.ep == ep_id).map(|(id, _)| *id).collect();
            for id in mine {
                let Some(mut w) = self.wrs.remove(&id) else { continue };
                match w.waiter.take() {
                    Some(waiter) => grave.waiters.push(waiter),
                    None => grave.lose(w.slice.batch, w.slice.req),
                }
                grave.slots.extend(w.slot);
            }
        }
        for s in ep.pending.drain(..) {
            self.end_request(s.batch, s.req, EndReason::Failed(unposted.clone()));
        }
        grave.endpoints.push((ep_id, ep));
    }

    /// Ends every live request that `pick` selects with `reason`, and
    /// resets the endpoints that carry posted work of decided requests so
    /// it flushes (the requests become terminal once it has).
    pub(crate) fn end_requests(
        &mut self,
        pick: impl Fn(BatchId, &Target) -> bool,
        reason: &EndReason,
        grave: &mut Graveyard,
    ) {
        for (&id, b) in self.batches.iter_mut() {
            let targets = &b.targets;
            let (_, p) = b.ledger.end_where(reason, |i| targets.get(i).is_some_and(|t| pick(id, t)));
            b.wake(p);
        }
        let eps: HashSet<EndpointId> = self
            .wrs
            .values()
            .filter(|w| self.batches.get(w.slice.batch).is_ok_and(|b| b.ledger.needs_quiet(w.slice.req)))
            .map(|w| w.ep)
            .collect();
        for ep in eps {
            let why = Error::new(ErrorKind::ConnectionReset, "endpoint reset to stop work in flight");
            self.break_endpoint(ep, why, grave);
        }
    }

    /// Whether any work of a request that `pick` selects is on the wire:
    /// posted, or posted on a QP not yet destroyed (the ledger counts it
    /// until [`State::after_destroy`]).
    pub(crate) fn any_on_wire(&self, pick: impl Fn(&Target) -> bool) -> bool {
        self.batches.iter().any(|(_, b)| {
            b.ledger.on_wire() > 0 && b.targets.iter().enumerate().any(|(i, t)| b.ledger.on_wire_of(i) > 0 && pick(t))
        })
    }
}

impl Inner {
    /// Waits (bounded) until `quiet` holds and no QP is being destroyed off
    /// the runtime, reaping flushed endpoints; after twice the flush
    /// timeout, destroys every broken endpoint, which makes the state quiet
    /// by construction.
    pub(crate) async fn settle(&self, quiet: impl Fn(&State) -> bool) {
        let start = Instant::now();
        let limit = self.lim.flush_timeout * 2 + SETTLE_GRACE;
        loop {
            let done = self.with_state(|st, g| {
                let force = start.elapsed() >= limit;
                st.reap(&self.lim, force, g);
                quiet(st) || force
            });
            // QPs still being destroyed off the runtime (`with_state`).
            let buried = self.burying.load(std::sync::atomic::Ordering::SeqCst) == 0;
            let done = done && (buried || start.elapsed() >= limit);
            if done {
                return;
            }
            tokio::time::sleep(SETTLE_POLL).await;
        }
    }
}
