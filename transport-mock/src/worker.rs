//! The task that runs one batch: its requests one after another, each a
//! real memory copy between registered regions once the endpoint, the
//! peer and the fault plan allow it.
//!
//! A request waits (for latency, a stall, a free endpoint slot) on the
//! fabric's event channel, which the host's deadline timer bumps when the
//! batch's deadline comes. The copy itself
//! runs under the batch lock as the request's one unit in the ledger
//! ([`Batch::run_unit`]), holding the regions' read locks while bytes move:
//! whoever marks a request terminal or retires a region therefore knows no
//! copy runs afterwards (rules 5 and 9).

use std::sync::Arc;

use tokio::time::Instant;
use transport_core::{Error, ErrorKind, Opcode, Result};

use crate::batch::{Batch, Planned};
use crate::endpoint::EndpointUse;
use crate::fabric::FabricInner;
use crate::host::HostShared;
use crate::plan::RequestInfo;
use crate::region::RegionState;

enum Step {
    Done,
    /// Wait for an event, or until this instant.
    Wait(Option<Instant>),
}

/// What one request's steps share.
struct Ctx<'a> {
    fabric: &'a FabricInner,
    host: &'a HostShared,
    batch: &'a Batch,
    i: usize,
    plan: &'a Planned,
}

/// Runs every request of `batch`.
pub(crate) async fn run_batch(fabric: Arc<FabricInner>, host: Arc<HostShared>, batch: Arc<Batch>) {
    for (i, plan) in batch.requests.iter().enumerate() {
        run_request(&Ctx { fabric: &fabric, host: &host, batch: &batch, i, plan }).await;
        // Wake requests waiting for an endpoint slot only when there may be
        // some, so a long batch costs linear time, not one wake-up of every
        // waiter per request.
        let full = {
            let eps = host.endpoints.lock();
            eps.held() >= eps.max()
        };
        if full {
            host.events.bump();
        }
    }
    host.events.bump();
}

impl Ctx<'_> {
    /// Whether the request may still be copied: it is live, or (the
    /// `write_after_timeout` bug) it ended by a cancel or a deadline.
    fn wanted(&self) -> bool {
        self.batch.is_live(self.i, self.host.clock.now())
            || (self.host.bugs.write_after_timeout && self.batch.ended_early(self.i))
    }

    /// Fails the request (unless something decided it first).
    fn fail(&self, e: Error) -> Step {
        self.batch.fail(self.i, e.with("segment", &self.plan.segment.name));
        Step::Done
    }
}

async fn run_request(cx: &Ctx<'_>) {
    if !cx.wanted() {
        return;
    }
    let decision = cx.host.faults.lock().on_request(RequestInfo {
        segment: &cx.plan.segment.name,
        index: cx.i,
        op: cx.plan.req.op,
        remote_addr: cx.plan.req.remote_addr,
        len: cx.plan.req.len,
    });
    let mut endpoint: Option<EndpointUse> = None;
    if let Some(e) = decision.fail {
        cx.batch.fail(cx.i, e);
    } else {
        let ready_at = Instant::now() + cx.host.config.latency;
        if !wait_and_copy(cx, &mut endpoint, decision.stall, ready_at).await {
            return;
        }
    }
    if decision.reset_after {
        if let Some(u) = &endpoint {
            u.link.break_it();
        }
    }
    drop(endpoint);
    if let Some(target) = decision.kill {
        let name = target.unwrap_or_else(|| cx.host.name.clone());
        if let Some(h) = cx.fabric.live_host(&name) {
            cx.fabric.kill(&h);
        }
    }
}

/// Steps until the request is copied or ended; `false` if the event
/// channel closed (the fabric is gone).
async fn wait_and_copy(cx: &Ctx<'_>, endpoint: &mut Option<EndpointUse>, stall: bool, ready_at: Instant) -> bool {
    let mut events = cx.host.events.subscribe();
    loop {
        events.borrow_and_update();
        let Step::Wait(until) = step(cx, endpoint, stall, ready_at) else { return true };
        // A deadline wakes it through the events (the host's deadline timer).
        match until {
            Some(at) => {
                tokio::select! {
                    r = events.changed() => if r.is_err() { return false },
                    _ = tokio::time::sleep_until(at) => {}
                }
            }
            None => {
                if events.changed().await.is_err() {
                    return false;
                }
            }
        }
    }
}

fn step(cx: &Ctx<'_>, endpoint: &mut Option<EndpointUse>, fault_stall: bool, ready_at: Instant) -> Step {
    if !cx.wanted() {
        return Step::Done;
    }
    let host = cx.host;
    let peer_name = &cx.plan.segment.name;
    let Some(peer) = cx.fabric.live_host(peer_name) else {
        let had = endpoint.take().map(|u| u.link.clone()).or_else(|| host.link_to(peer_name));
        return match had {
            Some(link) => {
                host.endpoint_failed(&link);
                cx.fail(Error::new(ErrorKind::ConnectionReset, "the peer went away; its endpoint broke"))
            }
            None => cx.fail(Error::new(ErrorKind::ConnectionRefused, "the peer is not reachable")),
        };
    };
    if cx.plan.segment.generation() != peer.generation {
        cx.plan.segment.refresh(peer.descriptor());
        *endpoint = None;
        if let Some(link) = host.link_to(peer_name).filter(|l| l.peer_generation != peer.generation) {
            host.endpoint_failed(&link);
        }
        return cx.fail(
            Error::new(ErrorKind::PeerRestarted, "the peer restarted; the descriptor was refreshed")
                .with("generation", peer.generation),
        );
    }
    if endpoint.is_none() {
        match host.acquire_endpoint(peer_name, peer.generation) {
            Ok(Some(u)) => *endpoint = Some(u),
            Ok(None) => return Step::Wait(None),
            Err(e) => return cx.fail(e),
        }
    }
    let broken = endpoint.as_ref().filter(|u| u.link.is_broken() || u.link.peer_generation != peer.generation);
    if let Some(link) = broken.map(|u| u.link.clone()) {
        *endpoint = None;
        host.endpoint_failed(&link);
        return cx.fail(Error::new(ErrorKind::ConnectionReset, "the endpoint broke").with("endpoint", link.id));
    }
    if host.stalled() || peer.stalled() || fault_stall {
        return Step::Wait(None);
    }
    if Instant::now() < ready_at {
        return Step::Wait(Some(ready_at));
    }
    if host.bugs.complete_before_landing {
        let plan = Planned { req: cx.plan.req, local: cx.plan.local.clone(), segment: cx.plan.segment.clone() };
        cx.batch.run_unit(cx.i, host.clock.now(), false, || Ok(()));
        std::thread::spawn(move || {
            std::thread::sleep(crate::bugs::LATE_LANDING);
            let _ = move_bytes(&plan, &peer);
        });
        return Step::Done;
    }
    let segment = &cx.plan.segment.name;
    cx.batch.run_unit(cx.i, host.clock.now(), host.bugs.write_after_timeout, || {
        move_bytes(cx.plan, &peer).map_err(|e| e.with("segment", segment))
    });
    Step::Done
}

fn move_bytes(plan: &Planned, peer: &HostShared) -> Result<()> {
    let req = &plan.req;
    let local_state = plan.local.state.read_recursive();
    if *local_state != RegionState::Live {
        return Err(Error::region_unregistered(req.local));
    }
    let remote = peer.regions.lock().find_remote(req.remote_addr, req.len)?;
    let remote_state = remote.state.read_recursive();
    match *remote_state {
        RegionState::Live => {}
        RegionState::Unregistered => {
            return Err(Error::new(ErrorKind::Unregistered, "the peer unregistered the target memory"))
        }
        RegionState::HostGone => return Err(Error::new(ErrorKind::ConnectionReset, "the peer went away")),
    }
    if !remote.access.allows(req.op) {
        return Err(Error::new(ErrorKind::AccessDenied, format!("the peer region does not allow remote {:?}", req.op))
            .with("remote_addr", format_args!("{:#x}", req.remote_addr)));
    }
    let too_big = || Error::new(ErrorKind::OutOfBounds, "range does not fit the address space");
    let roff = req.remote_addr.checked_sub(remote.mem.addr()).ok_or_else(too_big)?;
    let roff = usize::try_from(roff).map_err(|_| too_big())?;
    let loff = usize::try_from(req.local_offset).map_err(|_| too_big())?;
    let len = usize::try_from(req.len).map_err(|_| too_big())?;
    match req.op {
        Opcode::Write => remote.mem.copy_from(roff, &plan.local.mem, loff, len)?,
        Opcode::Read => plan.local.mem.copy_from(loff, &remote.mem, roff, len)?,
    }
    Ok(())
}
