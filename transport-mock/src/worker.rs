//! The task that runs one batch: its requests one after another, each a
//! real memory copy between registered regions once the endpoint, the
//! peer and the fault plan allow it.
//!
//! A request waits (for latency, a stall, a free endpoint slot) on the
//! fabric's event channel, bounded by the batch deadline. Before a copy it
//! re-checks, under the batch lock, that the request is still pending, and
//! holds the regions' read locks while bytes move: whoever marks a request
//! terminal or retires a region therefore knows no copy runs afterwards.

use std::sync::Arc;

use tokio::time::Instant;
use transport_core::{Error, ErrorKind, Opcode, RequestStatus, Result};

use crate::batch::{Batch, Planned};
use crate::endpoint::EndpointUse;
use crate::host::HostShared;
use crate::plan::RequestInfo;
use crate::region::RegionState;

enum Step {
    Done,
    /// Wait for an event, or until this instant.
    Wait(Option<Instant>),
}

/// Runs every request of `batch`.
pub(crate) async fn run_batch(host: Arc<HostShared>, batch: Arc<Batch>) {
    for i in 0..batch.requests.len() {
        run_request(&host, &batch, i).await;
        // Wake requests waiting for an endpoint slot only when there may be
        // some, so a long batch costs linear time, not one wake-up of every
        // waiter per request.
        if host.endpoints.lock().count() >= host.config.max_endpoints {
            host.fabric.bump();
        }
    }
    host.fabric.bump();
}

/// Whether a terminal status still lets the worker copy: only with the
/// `write_after_timeout` bug, for requests ended by a deadline or a cancel.
fn ghost(host: &HostShared, status: &RequestStatus) -> bool {
    host.config.bugs.write_after_timeout && matches!(status, RequestStatus::TimedOut | RequestStatus::Cancelled)
}

async fn run_request(host: &Arc<HostShared>, batch: &Arc<Batch>, i: usize) {
    let Some(plan) = batch.requests.get(i) else { return };
    let first = batch.status_of(i);
    if first.is_terminal() && !ghost(host, &first) {
        return;
    }
    let decision = host.faults.lock().on_request(RequestInfo {
        segment: &plan.segment.name,
        index: i,
        op: plan.req.op,
        remote_addr: plan.req.remote_addr,
        len: plan.req.len,
    });
    let mut endpoint: Option<EndpointUse> = None;
    if let Some(e) = decision.fail {
        batch.finish(i, RequestStatus::Failed(e.with("request", i)));
    } else {
        let ready_at = Instant::now() + host.config.latency;
        let mut events = host.fabric.subscribe();
        loop {
            events.borrow_and_update();
            let step = step(host, batch, i, plan, &mut endpoint, decision.stall, ready_at);
            let Step::Wait(until) = step else { break };
            let status = batch.status_of(i);
            let deadline = if status.is_terminal() { None } else { batch.deadline };
            let wake = match (until, deadline) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            match wake {
                Some(at) => {
                    tokio::select! {
                        r = events.changed() => if r.is_err() { return },
                        _ = tokio::time::sleep_until(at) => {}
                    }
                }
                None => {
                    if events.changed().await.is_err() {
                        return;
                    }
                }
            }
        }
    }
    if decision.reset_after {
        if let Some(u) = &endpoint {
            u.ep.break_it();
        }
    }
    drop(endpoint);
    if let Some(target) = decision.kill {
        let name = target.unwrap_or_else(|| host.name.clone());
        if let Some(h) = host.fabric.live_host(&name) {
            host.fabric.kill(&h);
        }
    }
}

fn step(
    host: &HostShared,
    batch: &Batch,
    i: usize,
    plan: &Planned,
    endpoint: &mut Option<EndpointUse>,
    fault_stall: bool,
    ready_at: Instant,
) -> Step {
    let status = batch.status_of(i);
    let ghost = status.is_terminal();
    if ghost && !self::ghost(host, &status) {
        return Step::Done;
    }
    let fail = |e: Error| {
        if !ghost {
            batch.finish(i, RequestStatus::Failed(e.with("request", i).with("segment", &plan.segment.name)));
        }
        Step::Done
    };
    let peer_name = &plan.segment.name;
    let Some(peer) = host.fabric.live_host(peer_name) else {
        let had = endpoint.as_ref().map(|u| u.ep.clone()).or_else(|| host.has_endpoint(peer_name));
        return match had {
            Some(ep) => {
                *endpoint = None;
                host.endpoint_failed(&ep);
                fail(Error::new(ErrorKind::ConnectionReset, "the peer went away; its endpoint broke"))
            }
            None => fail(Error::new(ErrorKind::ConnectionRefused, "the peer is not reachable")),
        };
    };
    if plan.segment.generation() != peer.generation {
        plan.segment.refresh(peer.descriptor());
        if let Some(ep) = host.has_endpoint(peer_name).filter(|e| e.peer_generation != peer.generation) {
            host.endpoint_failed(&ep);
        }
        *endpoint = None;
        return fail(
            Error::new(ErrorKind::PeerRestarted, "the peer restarted; the descriptor was refreshed")
                .with("generation", peer.generation),
        );
    }
    if endpoint.is_none() {
        match host.acquire_endpoint(&peer) {
            Ok(Some(u)) => *endpoint = Some(u),
            Ok(None) => return Step::Wait(None),
            Err(e) => return fail(e),
        }
    }
    if let Some(u) = endpoint.as_ref() {
        if u.ep.is_destroyed() || u.ep.is_broken() || u.ep.peer_generation != peer.generation {
            let ep = u.ep.clone();
            *endpoint = None;
            host.endpoint_failed(&ep);
            return fail(Error::new(ErrorKind::ConnectionReset, "the endpoint broke").with("endpoint", ep.id));
        }
    }
    if host.stalled() || peer.stalled() || fault_stall {
        return Step::Wait(None);
    }
    if Instant::now() < ready_at {
        return Step::Wait(Some(ready_at));
    }
    copy(batch, i, plan, &peer, ghost);
    Step::Done
}

/// Moves the bytes of request `i`, under the batch lock and the regions'
/// read locks, and records the outcome (unless the request is a ghost).
fn copy(batch: &Batch, i: usize, plan: &Planned, peer: &HostShared, ghost: bool) {
    let mut statuses = batch.statuses.lock();
    batch.expire_if_due(&mut statuses);
    let Some(slot) = statuses.get_mut(i) else { return };
    if slot.is_terminal() && !ghost {
        return;
    }
    let result = move_bytes(plan, peer);
    if !ghost {
        *slot = match result {
            Ok(()) => RequestStatus::Completed,
            Err(e) => RequestStatus::Failed(e.with("request", i).with("segment", &plan.segment.name)),
        };
    }
}

fn move_bytes(plan: &Planned, peer: &HostShared) -> Result<()> {
    let req = &plan.req;
    let local_state = plan.local.state.read_recursive();
    if *local_state != RegionState::Live {
        return Err(Error::new(ErrorKind::Unregistered, "the local region was unregistered").with("region", req.local));
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
