//! Bounded endpoints (rule 4): a configured maximum that eviction keeps,
//! and idle endpoints reclaimed on a timer.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use transport_core::{Access, TransferRequest};

use crate::ctx::{bounded, complete, complete_retrying, open, settle, Ctx};
use crate::ensure;
use crate::harness::NodeOptions;
use crate::outcome::{CaseError, CaseResult};

/// Five peers, a bound of two: sequential and concurrent transfers to all
/// of them complete, and the endpoint count never passes two.
pub async fn bound_never_exceeded(cx: Ctx) -> CaseResult {
    let opts = NodeOptions { max_endpoints: 2, ..NodeOptions::default() };
    let a = cx.node(&opts).await?;
    let t = a.transport.clone();
    ensure!(
        t.capabilities().max_endpoints == 2,
        "capabilities().max_endpoints is {}, configured 2",
        t.capabilities().max_endpoints
    );
    let local = cx.guarded_local(64 << 10, 1)?;
    let lid = t.register(local.region(), Access::LOCAL)?;
    let mut targets = Vec::new();
    for i in 0..5u64 {
        let b = cx.node(&opts).await?;
        let mem = cx.guarded(64 << 10, 20 + i)?;
        b.transport.register(mem.region(), Access::REMOTE_RW)?;
        let seg = open(&a, &b.name).await?;
        targets.push((seg, mem));
    }
    let max_seen = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (t, max_seen, stop) = (t.clone(), max_seen.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                max_seen.fetch_max(t.stats().endpoints, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
    };
    for round in 0..3 {
        for (i, (seg, mem)) in targets.iter().enumerate() {
            complete(&t, vec![TransferRequest::write(lid, 0, *seg, mem.addr(), 4096)]).await?;
            let n = t.stats().endpoints;
            ensure!(n <= 2, "round {round}, peer {i}: {n} endpoints live, bound 2 (rule 4)");
        }
    }
    let mut tasks = Vec::new();
    for (seg, mem) in targets.iter() {
        let (t, seg, addr) = (t.clone(), *seg, mem.addr());
        tasks.push(tokio::spawn(async move {
            for k in 0..5u64 {
                // Evicting an endpoint another task is using may fail that
                // task's batch transiently; it must go through on retry.
                let req = TransferRequest::write(lid, k * 4096, seg, addr + k * 4096, 4096);
                complete_retrying(&t, vec![req], 5).await?;
            }
            Ok::<(), CaseError>(())
        }));
    }
    for task in tasks {
        bounded("a concurrent task", task).await?.map_err(|e| CaseError::Fail(format!("task panicked: {e}")))??;
    }
    stop.store(true, Ordering::Relaxed);
    let _ = sampler.await;
    let max = max_seen.load(Ordering::Relaxed);
    ensure!(max <= 2, "{max} endpoints were live at once, bound 2 (rule 4)");
    Ok(())
}

/// With a short idle timeout, an endpoint nobody uses is destroyed on the
/// timer (no new connection needed to trigger it), and the next transfer
/// builds a new one.
pub async fn idle_endpoints_reclaimed(cx: Ctx) -> CaseResult {
    let opts = NodeOptions { idle_timeout: Duration::from_millis(200), ..NodeOptions::default() };
    let p = cx.pair_with(64 << 10, &opts).await?;
    let t = p.t().clone();
    complete(&t, vec![p.write(0, 0, 4096)]).await?;
    let live = t.stats().endpoints;
    if live == 0 {
        return Err(CaseError::Skip("the transport shows no endpoint after a transfer; nothing to reclaim".into()));
    }
    // The only peer is idle now: every endpoint must go, on the timer.
    let reclaimed = settle(Duration::from_secs(3), || t.stats().endpoints == 0).await;
    ensure!(
        reclaimed,
        "{} endpoints still live 3 s after the last use, idle timeout 200 ms (rule 4)",
        t.stats().endpoints
    );
    complete(&t, vec![p.write(0, 4096, 4096)]).await?;
    Ok(())
}
