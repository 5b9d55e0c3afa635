//! Terminal means quiet (rule 5): deadlines end stalled work, and once a
//! batch is reported terminal its memory never changes again.

use std::time::{Duration, Instant};

use transport_core::{BatchState, RequestStatus, SubmitOptions};

use crate::ctx::{bounded, expect_quiet, wait_batch, Ctx};
use crate::ensure;
use crate::guard::pattern;
use crate::outcome::CaseResult;

const LEN: usize = 1 << 20;
const DEADLINE: Duration = Duration::from_millis(300);
const MARGIN: Duration = Duration::from_secs(2);

/// A stalled write with a 300 ms deadline ends `TimedOut` within the
/// deadline plus a margin, every request `TimedOut`, and stays so.
pub async fn stalled_transfer_times_out(cx: Ctx) -> CaseResult {
    let p = cx.pair(LEN).await?;
    let t = p.t().clone();
    cx.stall(&p.b, true).await?;
    let start = Instant::now();
    let b = t.submit(vec![p.write(0, 0, LEN as u64), p.write(0, 0, 1)], SubmitOptions::with_timeout(DEADLINE)).await?;
    let s = wait_batch(t.as_ref(), b, Some(DEADLINE), "wait on a stalled batch").await??;
    let took = start.elapsed();
    ensure!(s.state == BatchState::TimedOut, "a stalled batch with a deadline ended {:?}", s.state);
    ensure!(took <= DEADLINE + MARGIN, "the deadline of {DEADLINE:?} was enforced only after {took:?}");
    ensure!(
        s.requests.iter().all(|r| matches!(r, RequestStatus::TimedOut | RequestStatus::Completed)),
        "requests of a timed-out batch: {:?}",
        s.requests
    );
    cx.stall(&p.b, false).await?;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let again = t.poll(b)?;
    ensure!(
        again.state == BatchState::TimedOut,
        "the timed-out batch changed to {:?} after traffic resumed",
        again.state
    );
    t.release(b)?;
    Ok(())
}

/// After a timeout is reported, the memory of the batch is quiet: the
/// destination never changes again (watched while stalled and after
/// resuming), and new bytes put into the source never travel. Writes and
/// reads.
pub async fn quiet_after_timeout(cx: Ctx) -> CaseResult {
    let p = cx.pair(LEN).await?;
    let t = p.t().clone();
    cx.stall(&p.b, true).await?;
    let b = t.submit(vec![p.write(0, 0, LEN as u64)], SubmitOptions::with_timeout(DEADLINE)).await?;
    let s = wait_batch(t.as_ref(), b, Some(DEADLINE), "wait on a stalled write").await??;
    ensure!(s.is_terminal(), "wait returned {:?}", s.state);
    let remote = p.remote.snapshot();
    p.local.write(0, &pattern(66, LEN))?;
    expect_quiet(&p.remote, &remote, Duration::from_millis(200), "write destination after its timeout (stalled)")
        .await?;
    cx.stall(&p.b, false).await?;
    expect_quiet(&p.remote, &remote, Duration::from_millis(300), "write destination after its timeout (resumed)")
        .await?;
    t.release(b)?;
    if t.capabilities().read {
        cx.stall(&p.b, true).await?;
        let b = t.submit(vec![p.read(0, 0, LEN as u64)], SubmitOptions::with_timeout(DEADLINE)).await?;
        let s = wait_batch(t.as_ref(), b, Some(DEADLINE), "wait on a stalled read").await??;
        ensure!(s.is_terminal(), "wait returned {:?}", s.state);
        let local = p.local.snapshot();
        p.remote.write(0, &pattern(67, LEN))?;
        expect_quiet(&p.local, &local, Duration::from_millis(200), "read destination after its timeout (stalled)")
            .await?;
        cx.stall(&p.b, false).await?;
        expect_quiet(&p.local, &local, Duration::from_millis(300), "read destination after its timeout (resumed)")
            .await?;
        t.release(b)?;
    }
    Ok(())
}

/// Cancelling stalled work returns promptly with every request cancelled
/// (or completed), the state is sticky, and the memory is quiet after.
pub async fn cancel_in_flight_ends(cx: Ctx) -> CaseResult {
    let p = cx.pair(LEN).await?;
    let t = p.t().clone();
    cx.stall(&p.b, true).await?;
    let b = t
        .submit(
            vec![p.write(0, 0, LEN as u64 / 2), p.write(LEN as u64 / 2, LEN as u64 / 2, LEN as u64 / 2)],
            SubmitOptions::default(),
        )
        .await?;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let s = bounded("cancel of a stalled batch", t.cancel(b)).await??;
    ensure!(
        matches!(s.state, BatchState::Cancelled | BatchState::Completed),
        "a cancelled batch ended {:?} (requests {:?})",
        s.state,
        s.requests
    );
    ensure!(
        s.requests.iter().all(|r| matches!(r, RequestStatus::Cancelled | RequestStatus::Completed)),
        "requests of a cancelled batch: {:?}",
        s.requests
    );
    let remote = p.remote.snapshot();
    p.local.write(0, &pattern(68, LEN))?;
    cx.stall(&p.b, false).await?;
    expect_quiet(&p.remote, &remote, Duration::from_millis(300), "memory of a cancelled batch").await?;
    let w = wait_batch(t.as_ref(), b, None, "wait after cancel").await??;
    ensure!(w.state == s.state, "cancelled batch changed from {:?} to {:?}", s.state, w.state);
    t.release(b)?;
    Ok(())
}

/// A timeout beyond what any clock holds (`Duration::MAX`, and one that
/// overflows when added to now) means "never": such a batch completes as
/// any other, and a stalled one stays in progress (not `TimedOut` at once,
/// no panic) until it is cancelled.
pub async fn timeout_beyond_the_clock_never_fires(cx: Ctx) -> CaseResult {
    let p = cx.pair(LEN).await?;
    let t = p.t().clone();
    for (what, timeout) in [("Duration::MAX", Duration::MAX), ("u64::MAX s - 1", Duration::from_secs(u64::MAX - 1))] {
        p.local.write(0, &pattern(70, 4096))?;
        let b = t.submit(vec![p.write(0, 0, 4096)], SubmitOptions::with_timeout(timeout)).await?;
        let s = wait_batch(t.as_ref(), b, Some(timeout), "wait").await??;
        ensure!(s.state == BatchState::Completed, "a batch with timeout {what} ended {:?}: {:?}", s.state, s.requests);
        t.release(b)?;
    }
    ensure!(p.remote.snapshot()[..4096] == pattern(70, 4096)[..], "the bytes of a batch with a huge timeout differ");
    cx.stall(&p.b, true).await?;
    let b = t.submit(vec![p.write(0, 0, 4096)], SubmitOptions::with_timeout(Duration::MAX)).await?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let s = t.poll(b)?;
    ensure!(
        s.state == BatchState::InProgress,
        "a stalled batch with timeout Duration::MAX is {:?} after 200 ms",
        s.state
    );
    let s = bounded("cancel", t.cancel(b)).await??;
    ensure!(
        matches!(s.state, BatchState::Cancelled | BatchState::Completed),
        "cancel of a batch with timeout Duration::MAX ended {:?}",
        s.state
    );
    cx.stall(&p.b, false).await?;
    t.release(b)?;
    Ok(())
}
