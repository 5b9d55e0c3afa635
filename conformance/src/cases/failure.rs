//! Failure frees (rule 2): a broken endpoint is destroyed, never cached; the
//! next transfer builds a new one; a restarted peer is noticed.

use std::time::{Duration, Instant};

use transport_core::{Access, BatchState, SubmitOptions, TransferRequest, Transport};

use crate::ctx::{bounded, complete, open, run_batch, settle, Ctx, SETTLE};
use crate::ensure;
use crate::harness::{Node, NodeOptions};
use crate::outcome::{CaseError, CaseResult};

const LEN: usize = 64 << 10;

/// The outcome of one transfer attempt: `Ok(None)` completed, `Ok(Some(why))`
/// failed with a transient error (or timed out); a permanent error or a hang
/// fails the case.
async fn attempt(t: &std::sync::Arc<dyn Transport>, req: TransferRequest) -> Result<Option<String>, CaseError> {
    let (state, err) = match run_batch(t, vec![req], SubmitOptions::with_timeout(Duration::from_secs(5))).await? {
        Err(e) => (BatchState::Failed, Some(e)),
        Ok(s) => (s.state, s.first_error().cloned()),
    };
    match (state, err) {
        (BatchState::Completed, _) => Ok(None),
        (BatchState::TimedOut, e) => Ok(Some(format!("timed out ({:?})", e.map(|e| e.to_string())))),
        (_, Some(e)) if e.is_transient() => Ok(Some(e.to_string())),
        (s, e) => Err(CaseError::Fail(format!(
            "a transfer to a failed or restarted peer must fail with a transient error, got {s:?} {:?}",
            e.map(|e| e.to_string())
        ))),
    }
}

/// After the peer is killed, the transfer fails (transient) and the broken
/// endpoint is destroyed: the endpoint count drops back and stays there,
/// and after a restart the next transfers build exactly one new endpoint.
pub async fn failed_endpoint_is_freed(cx: Ctx) -> CaseResult {
    let opts = NodeOptions::default();
    let p = cx.pair_with(LEN, &opts).await?;
    let t = p.t().clone();
    let idle = t.stats().endpoints;
    complete(&t, vec![p.write(0, 0, 4096)]).await?;
    let live = t.stats().endpoints;
    ensure!(live >= idle, "endpoint count went down during a transfer");
    cx.kill(&p.b).await?;
    for _ in 0..3 {
        ensure!(attempt(&t, p.write(0, 0, 4096)).await?.is_some(), "a transfer to a killed peer completed");
    }
    let freed = settle(SETTLE, || t.stats().endpoints <= idle).await;
    ensure!(freed, "after failures to a killed peer {} endpoints are live, {idle} before the first transfer: the broken endpoint was kept (rule 2)", t.stats().endpoints);
    let b2 = cx.restart(&p.b, &opts).await?;
    let remote2 = cx.guarded(LEN, 5)?;
    b2.transport.register(remote2.region(), Access::REMOTE_RW)?;
    let seg2 = open(&p.a, &b2.name).await?;
    let req = TransferRequest::write(p.local_id, 0, seg2, remote2.addr(), 4096);
    for i in 0..3 {
        complete(&t, vec![req]).await?;
        // The broken endpoint's teardown is a task of its own, which may
        // still run when the restarted peer is reached (the count above
        // includes endpoints being destroyed): waited for, bounded. A
        // leaked endpoint never goes.
        let ok = settle(SETTLE, || t.stats().endpoints <= live).await;
        let n = t.stats().endpoints;
        ensure!(
            ok,
            "transfer {i} after the restart: {n} endpoints, {live} before the failure: an endpoint leaked (rule 2)"
        );
    }
    Ok(())
}

/// After a connection cut, at most one transfer fails (transient); the
/// next one builds a new endpoint and completes. Three cuts in a row.
pub async fn next_transfer_builds_new_endpoint(cx: Ctx) -> CaseResult {
    let p = cx.pair(LEN).await?;
    let t = p.t().clone();
    complete(&t, vec![p.write(0, 0, 4096)]).await?;
    let live = t.stats().endpoints;
    for cut in 0..3 {
        cx.cut(&p.b).await?;
        if let Some(first) = attempt(&t, p.write(0, 0, 4096)).await? {
            let second = attempt(&t, p.write(4096, 4096, 4096)).await?;
            ensure!(
                second.is_none(),
                "cut {cut}: the transfer after a failed one failed too: the broken endpoint was reused (rule 2); \
                 first: {first}; second: {}",
                second.unwrap_or_default()
            );
        }
        // The broken endpoint's teardown is a task of its own: waited for.
        let ok = settle(SETTLE, || t.stats().endpoints <= live).await;
        let n = t.stats().endpoints;
        ensure!(ok, "cut {cut}: {n} endpoints live, {live} before: the broken endpoint was not destroyed");
    }
    complete(&t, vec![p.write(0, 0, LEN as u64)]).await?;
    p.canaries_intact()
}

/// The field scenario: up to 50 cycles (bounded to 20 s) of peer kill,
/// restart and transfer over one cached handle. Transfers recover within
/// a few attempts and the endpoint count never passes the bound.
pub async fn kill_restart_cycles_stay_bounded(cx: Ctx) -> CaseResult {
    let opts = NodeOptions { max_endpoints: 2, ..NodeOptions::default() };
    let p = cx.pair_with(LEN, &opts).await?;
    let t = p.t().clone();
    complete(&t, vec![p.write(0, 0, 4096)]).await?;
    let bound = opts.max_endpoints;
    let start = Instant::now();
    let mut b: Node = p.b.clone();
    let mut seg = p.seg;
    let mut cycles = 0;
    while cycles < 50 && start.elapsed() < Duration::from_secs(20) {
        cx.kill(&b).await?;
        b = cx.restart(&b, &opts).await?;
        let remote = cx.guarded(4096, 10 + cycles)?;
        b.transport.register(remote.region(), Access::REMOTE_RW)?;
        let mut done = false;
        let mut last = String::new();
        for round in 0..6u32 {
            if round > 0 {
                // Backed off as a caller's policy would (40 ms doubling, 1.2 s
                // in all): a loaded machine may need that long to bring the
                // restarted peer's listener up.
                tokio::time::sleep(Duration::from_millis(20 << round)).await;
            }
            if round == 3 {
                // The cached handle did not recover: a fresh one must.
                seg = open(&p.a, &b.name).await?;
            }
            let req = TransferRequest::write(p.local_id, 0, seg, remote.addr(), 4096);
            match run_batch(&t, vec![req], SubmitOptions::with_timeout(Duration::from_secs(5))).await? {
                Ok(s) if s.state == BatchState::Completed => {
                    done = true;
                    break;
                }
                Ok(s) => last = format!("{:?}: {:?}", s.state, s.first_error().map(ToString::to_string)),
                Err(e) => last = e.to_string(),
            }
            let n = t.stats().endpoints;
            ensure!(n <= bound, "cycle {cycles}: {n} endpoints live, bound {bound} (rule 4)");
        }
        ensure!(done, "cycle {cycles}: no transfer to the restarted peer completed in 6 attempts (the last: {last})");
        let n = t.stats().endpoints;
        ensure!(n <= bound, "cycle {cycles}: {n} endpoints live, bound {bound} (rule 4)");
        cycles += 1;
    }
    ensure!(cycles >= 5, "only {cycles} kill/restart cycles fit in 20 s");
    Ok(())
}

/// A restarted peer is noticed: a request to its old memory never
/// completes and never touches the old memory, the handle's descriptor
/// gets the new generation, and transfers to the new memory work.
pub async fn restart_is_noticed(cx: Ctx) -> CaseResult {
    let opts = NodeOptions::default();
    let p = cx.pair_with(LEN, &opts).await?;
    let t = p.t().clone();
    complete(&t, vec![p.write(0, 0, 4096)]).await?;
    let gen1 = t.segment_descriptor(p.seg)?.generation;
    cx.kill(&p.b).await?;
    let b2 = cx.restart(&p.b, &opts).await?;
    ensure!(b2.name == p.b.name, "restart must keep the segment name");
    let remote2 = cx.guarded(LEN, 6)?;
    b2.transport.register(remote2.region(), Access::REMOTE_RW)?;
    let old = p.remote.snapshot();
    p.local.write(0, &crate::guard::pattern(123, 4096))?;
    let stale = p.write(0, 0, 4096);
    let r = run_batch(&t, vec![stale], SubmitOptions::with_timeout(Duration::from_secs(5))).await?;
    if let Ok(s) = &r {
        ensure!(
            s.state != BatchState::Completed,
            "a write to the old peer's memory completed after the peer restarted: the stale descriptor was used"
        );
    }
    let ok = settle(SETTLE, || t.segment_descriptor(p.seg).map(|d| d.generation != gen1).unwrap_or(false)).await;
    let _ = run_batch(&t, vec![stale], SubmitOptions::with_timeout(Duration::from_secs(5))).await?;
    let gen2 = t.segment_descriptor(p.seg).map(|d| d.generation);
    ensure!(
        ok || gen2.as_ref().map(|g| *g != gen1).unwrap_or(false),
        "after a failed transfer to the restarted peer the handle still has generation {gen1} ({gen2:?})"
    );
    p.remote.expect(&old, "the killed peer's memory")?;
    let fresh = TransferRequest::write(p.local_id, 0, p.seg, remote2.addr(), 4096);
    // A few attempts, with pauses as a caller's policy would make them (a
    // loaded machine may still be bringing the new peer's path up).
    let mut last = None;
    let mut pause = Duration::from_millis(40);
    for _ in 0..8 {
        match run_batch(&t, vec![fresh], SubmitOptions::with_timeout(Duration::from_secs(5))).await? {
            Ok(s) if s.state == BatchState::Completed => {
                last = None;
                break;
            }
            r => last = Some(format!("{r:?}")),
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(640));
    }
    ensure!(
        last.is_none(),
        "transfers to the restarted peer's new memory over the refreshed handle do not complete (8 attempts, the last: \
         {})",
        last.unwrap_or_default()
    );
    let _ = bounded("close", t.close_segment(p.seg)).await?;
    Ok(())
}
