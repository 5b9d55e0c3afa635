//! Backpressure (rule 8): a full in-flight budget is a clear transient
//! error or an awaitable wait, never a silent stall.

use std::time::Duration;

use kvmove_policy::{Engine, PolicyConfig};
use transport_core::{BatchState, ErrorKind};

use crate::ctx::{bounded, Ctx};
use crate::ensure;
use crate::outcome::CaseResult;

fn tiny() -> PolicyConfig {
    let mut cfg = PolicyConfig::default();
    cfg.backpressure.per_peer_inflight_requests = 1;
    // A cancel may break the endpoint it ran on (rule 2), failing what was
    // queued behind it with a transient error: the engine's retry covers it.
    cfg.retry.max_attempts = 3;
    cfg.retry.initial_backoff = Duration::from_millis(5);
    cfg
}

/// With room for one request per peer and the peer stalled,
/// `try_submit` of a second transfer is a transient `Backpressure`; an
/// awaiting `submit` waits, and completes once the first one finishes.
pub async fn full_budget_pushes_back(cx: Ctx) -> CaseResult {
    let p = cx.pair(1 << 20).await?;
    let engine = Engine::new(p.t().clone(), tiny())?;
    cx.stall(&p.b, true).await?;
    let first = bounded("try_submit", engine.try_submit(vec![p.write(0, 0, 4096)])).await??;
    let second = bounded("try_submit", engine.try_submit(vec![p.write(4096, 4096, 4096)])).await?;
    let e = second.err().ok_or("try_submit past the budget started a transfer")?;
    ensure!(e.kind() == ErrorKind::Backpressure && e.is_transient(), "try_submit past the budget: {e}");
    let e2 = engine.clone();
    let w = p.write(4096, 4096, 4096);
    let waiting = tokio::spawn(async move { e2.transfer(vec![w]).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    ensure!(!waiting.is_finished(), "submit past the budget did not wait for room");
    cx.stall(&p.b, false).await?;
    let o1 = bounded("first transfer", first.wait()).await??;
    ensure!(o1.is_success(), "first transfer ended {:?}: {:?}", o1.state, o1.first_error().map(ToString::to_string));
    let o2 = bounded("waiting transfer", waiting).await?.map_err(|e| format!("task: {e}"))??;
    ensure!(
        o2.is_success(),
        "the waiting transfer ended {:?}: {:?}",
        o2.state,
        o2.first_error().map(ToString::to_string)
    );
    let used = engine.inflight();
    ensure!(used.bytes == 0 && used.requests == 0, "in-flight budget not returned: {used:?}");
    Ok(())
}

/// Cancelling the transfer that holds the budget frees it at once: the
/// next `try_submit` is admitted.
pub async fn cancel_frees_budget(cx: Ctx) -> CaseResult {
    let p = cx.pair(1 << 20).await?;
    let engine = Engine::new(p.t().clone(), tiny())?;
    cx.stall(&p.b, true).await?;
    let first = bounded("try_submit", engine.try_submit(vec![p.write(0, 0, 4096)])).await??;
    let o = bounded("cancel", first.cancel()).await??;
    ensure!(matches!(o.state, BatchState::Cancelled | BatchState::Completed), "cancelled transfer ended {:?}", o.state);
    let next = bounded("try_submit", engine.try_submit(vec![p.write(4096, 4096, 4096)])).await?;
    let next = next.map_err(|e| format!("try_submit after cancel: {e}"))?;
    cx.stall(&p.b, false).await?;
    let o = bounded("transfer", next.wait()).await??;
    ensure!(
        o.is_success(),
        "transfer after cancel ended {:?}: {:?}",
        o.state,
        o.first_error().map(ToString::to_string)
    );
    Ok(())
}
