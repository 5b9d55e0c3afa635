//! Every resource is counted and given back (rule 1); close is real
//! (rule 3).

use std::sync::Arc;
use std::time::Duration;

use transport_core::{Access, BatchState, ErrorKind, SubmitOptions, Transport};

use crate::ctx::{
    bounded, complete, expect_permanent, expect_quiet, expect_stats, open, settle, wait_batch, Ctx, SETTLE,
};
use crate::ensure;
use crate::guard::pattern;
use crate::harness::NodeOptions;
use crate::outcome::{CaseError, CaseResult};

const LEN: usize = 256 << 10;

/// Open, transfer, close, reopen, transfer, close: the counts (and the OS
/// counts) return to their baseline after each close.
pub async fn open_close_reopen(cx: Ctx) -> CaseResult {
    let p = cx.pair(LEN).await?;
    let t = p.t().clone();
    bounded("close", t.close_segment(p.seg)).await??;
    let base = t.stats();
    let os = cx.os_probe();
    for round in 0..5 {
        let seg = open(&p.a, &p.b.name).await?;
        let req = transport_core::TransferRequest { segment: seg, ..p.write(0, 0, 4096) };
        complete(&t, vec![req]).await?;
        bounded("close", t.close_segment(seg)).await??;
        expect_stats(&t, base, &format!("after close, round {round}")).await?;
    }
    cx.expect_os(&os, "after five open/close rounds").await
}

/// `close_segment` destroys the segment's endpoints (counts back to the
/// baseline); the closed handle is `InvalidHandle` for submit and
/// `segment_descriptor`; the name opens again.
pub async fn close_releases_endpoints(cx: Ctx) -> CaseResult {
    let a = cx.node(&NodeOptions::default()).await?;
    let b = cx.node(&NodeOptions::default()).await?;
    let t = a.transport.clone();
    let local = cx.guarded_local(LEN, 1)?;
    let remote = cx.guarded(LEN, 2)?;
    let lid = t.register(local.region(), Access::LOCAL)?;
    b.transport.register(remote.region(), Access::REMOTE_RW)?;
    let base = t.stats();
    let seg = open(&a, &b.name).await?;
    let req = transport_core::TransferRequest::write(lid, 0, seg, remote.addr(), 4096);
    complete(&t, vec![req]).await?;
    ensure!(t.stats().segments == base.segments + 1, "an open segment must be counted: {:?}", t.stats());
    bounded("close", t.close_segment(seg)).await??;
    expect_stats(&t, base, "after close_segment").await?;
    let again = bounded("submit", t.submit(vec![req], SubmitOptions::default())).await?;
    expect_permanent(again, &[ErrorKind::InvalidHandle], "submit on a closed segment")?;
    expect_permanent(t.segment_descriptor(seg), &[ErrorKind::InvalidHandle], "descriptor of a closed segment")?;
    let seg2 = open(&a, &b.name).await?;
    ensure!(seg2 != seg, "segment ids must not be reused ({seg} twice)");
    complete(&t, vec![transport_core::TransferRequest { segment: seg2, ..req }]).await?;
    Ok(())
}

/// Closing a segment twice is `InvalidHandle`, not a crash.
pub async fn double_close_is_an_error(cx: Ctx) -> CaseResult {
    let p = cx.pair(LEN).await?;
    bounded("close", p.t().close_segment(p.seg)).await??;
    let again = bounded("close", p.t().close_segment(p.seg)).await?;
    expect_permanent(again, &[ErrorKind::InvalidHandle], "second close_segment")?;
    let unknown = bounded("close", p.t().close_segment(transport_core::SegmentId(u64::MAX))).await?;
    expect_permanent(unknown, &[ErrorKind::InvalidHandle], "close of an unknown segment")?;
    Ok(())
}

/// Closing a segment with a transfer in flight (traffic stalled): the
/// batch is terminal (cancelled or failed) when close returns, the memory
/// stays quiet after traffic resumes, and the counts return.
pub async fn close_with_transfers_in_flight(cx: Ctx) -> CaseResult {
    let p = cx.pair(1 << 20).await?;
    let t = p.t().clone();
    bounded("close", t.close_segment(p.seg)).await??;
    let base = t.stats();
    let seg = open(&p.a, &p.b.name).await?;
    cx.stall(&p.b, true).await?;
    let req = transport_core::TransferRequest { segment: seg, ..p.write(0, 0, 1 << 20) };
    let b = t.submit(vec![req], SubmitOptions::default()).await?;
    tokio::time::sleep(Duration::from_millis(50)).await;
    bounded("close_segment with a transfer in flight", t.close_segment(seg)).await??;
    let s = t.poll(b)?;
    ensure!(
        matches!(s.state, BatchState::Cancelled | BatchState::Failed | BatchState::Completed),
        "after close_segment the batch is {:?}; it must have ended (cancelled or failed)",
        s.state
    );
    let remote = p.remote.snapshot();
    p.local.write(0, &pattern(77, 1 << 20))?;
    cx.stall(&p.b, false).await?;
    expect_quiet(&p.remote, &remote, Duration::from_millis(300), "peer memory after close_segment").await?;
    t.release(b)?;
    expect_stats(&t, base, "after close with a transfer in flight").await
}

/// `release` forgets a terminal batch (the batch count returns); a
/// released id is `InvalidHandle` everywhere.
pub async fn release_frees_batches(cx: Ctx) -> CaseResult {
    let p = cx.pair(LEN).await?;
    let t = p.t().clone();
    let base = t.stats();
    let mut ids = Vec::new();
    for i in 0..8u64 {
        let b = t.submit(vec![p.write(i * 4096, i * 4096, 4096)], SubmitOptions::default()).await?;
        ids.push(b);
    }
    ensure!(t.stats().batches == base.batches + 8, "eight unreleased batches must be counted: {:?}", t.stats());
    for &b in &ids {
        wait_batch(t.as_ref(), b, None, "wait").await??;
        t.release(b)?;
    }
    // The endpoint the transfers built may stay cached (rule 4).
    let ok = settle(SETTLE, || {
        let s = t.stats();
        s.batches == base.batches && s.inflight == base.inflight
    })
    .await;
    ensure!(ok, "after releasing every batch: {:?}, baseline {base:?} (rule 1)", t.stats());
    let b = ids[0];
    expect_permanent(t.poll(b), &[ErrorKind::InvalidHandle], "poll of a released batch")?;
    expect_permanent(t.release(b), &[ErrorKind::InvalidHandle], "second release")?;
    expect_permanent(
        wait_batch(t.as_ref(), b, None, "wait").await?,
        &[ErrorKind::InvalidHandle],
        "wait on a released batch",
    )?;
    expect_permanent(bounded("cancel", t.cancel(b)).await?, &[ErrorKind::InvalidHandle], "cancel of a released batch")?;
    Ok(())
}

/// Register/unregister, open/close and submit/release, one after the
/// other: after each pair the counts are back where they were.
pub async fn counts_return_after_each_operation(cx: Ctx) -> CaseResult {
    let p = cx.pair(LEN).await?;
    let t = p.t().clone();
    let os = cx.os_probe();
    let base = t.stats();
    ensure!(base.regions == 1 && base.segments == 1, "one region and one segment must be counted: {base:?}");
    let extra = cx.guarded(4096, 3)?;
    let r = t.register(extra.region(), Access::REMOTE_RW)?;
    ensure!(t.stats().regions == 2, "a new region must be counted: {:?}", t.stats());
    bounded("unregister", t.unregister(r)).await??;
    expect_stats(&t, base, "after register + unregister").await?;
    let s = open(&p.a, &p.b.name).await?;
    bounded("close", t.close_segment(s)).await??;
    expect_stats(&t, base, "after open + close").await?;
    let b = t.submit(vec![p.write(0, 0, 4096)], SubmitOptions::default()).await?;
    wait_batch(t.as_ref(), b, None, "wait").await??;
    t.release(b)?;
    // The endpoint built by the transfer may stay cached (rule 4).
    let ok = settle(SETTLE, || {
        let s = t.stats();
        s.batches == base.batches
            && s.inflight == base.inflight
            && s.regions == base.regions
            && s.segments == base.segments
    })
    .await;
    ensure!(ok, "after submit + release: {:?} vs baseline {base:?}", t.stats());
    bounded("close", t.close_segment(p.seg)).await??;
    bounded("unregister", t.unregister(p.local_id)).await??;
    let empty = t.stats();
    ensure!(
        empty.endpoints == 0 && empty.segments == 0 && empty.regions == 0 && empty.batches == 0 && empty.inflight == 0,
        "with everything closed, nothing may be live: {empty:?}"
    );
    cx.expect_os(&os, "with everything closed").await
}

/// `shutdown` with a transfer in flight returns, ends the batch, frees
/// every count (tasks included), later calls fail with `Shutdown`, and a
/// second shutdown is `Ok`.
pub async fn shutdown_with_transfers_in_flight(cx: Ctx) -> CaseResult {
    let p = cx.pair(1 << 20).await?;
    let t = p.t().clone();
    cx.stall(&p.b, true).await?;
    let b = t.submit(vec![p.write(0, 0, 1 << 20)], SubmitOptions::default()).await?;
    tokio::time::sleep(Duration::from_millis(50)).await;
    bounded("shutdown with a transfer in flight", t.shutdown()).await??;
    let remote = p.remote.snapshot();
    p.local.write(0, &pattern(55, 1 << 20))?;
    cx.stall(&p.b, false).await?;
    expect_quiet(&p.remote, &remote, Duration::from_millis(300), "peer memory after shutdown").await?;
    let s = t.stats();
    ensure!(
        s == transport_core::ResourceStats::default(),
        "after shutdown nothing may be live (tasks included): {s:?}"
    );
    let later = bounded("open after shutdown", t.open_segment(&p.b.name)).await?;
    expect_permanent(later, &[ErrorKind::Shutdown], "open_segment after shutdown")?;
    let again = cx.guarded_local(4096, 4)?;
    expect_permanent(t.register(again.region(), Access::LOCAL), &[ErrorKind::Shutdown], "register after shutdown")?;
    let _ = t.poll(b);
    bounded("second shutdown", t.shutdown()).await??;
    Ok(())
}

/// Dropping the last handle of a transport with a transfer in flight frees
/// it: no task keeps it alive, and the OS counts return.
pub async fn drop_with_transfers_in_flight(cx: Ctx) -> CaseResult {
    let os = cx.os_probe();
    let p = cx.pair(1 << 20).await?;
    cx.stall(&p.b, true).await?;
    let b = p.t().submit(vec![p.write(0, 0, 1 << 20)], SubmitOptions::default()).await?;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let _ = b;
    let weak: std::sync::Weak<dyn Transport> = Arc::downgrade(p.t());
    cx.forget(&p.a);
    let remote = p.remote.snapshot();
    let b_node = p.b.clone();
    drop(p);
    let gone = settle(SETTLE, || weak.upgrade().is_none()).await;
    cx.stall(&b_node, false).await?;
    ensure!(gone, "the dropped transport is still alive: a task or the harness keeps a strong reference");
    let _ = remote;
    bounded("peer shutdown", b_node.transport.shutdown()).await??;
    cx.forget(&b_node);
    drop(b_node);
    cx.expect_os(&os, "after dropping both transports").await
}

/// The OS agrees (file descriptors, kernel RDMA objects): after a full
/// open/transfer/close/shutdown cycle the probe is back to its baseline.
pub async fn os_resources_return(cx: Ctx) -> CaseResult {
    let Some(_) = cx.os_probe() else {
        return Err(CaseError::Skip("the harness has no OS resource probe (os_probe() is None)".into()));
    };
    let os = cx.os_probe();
    for _ in 0..3 {
        let p = cx.pair(LEN).await?;
        complete(p.t(), vec![p.write(0, 0, 4096)]).await?;
        bounded("shutdown", p.a.transport.shutdown()).await??;
        bounded("shutdown", p.b.transport.shutdown()).await??;
        cx.forget(&p.a);
        cx.forget(&p.b);
    }
    cx.expect_os(&os, "after three node lifetimes").await
}

/// Cycles before the census's first count (caches, pools and the
/// runtime's own structures reach their size).
const WARM_CYCLES: usize = 8;
/// Cycles between two counts of the census: a leak of one allocation per
/// cycle shows as this many more.
const COUNTED_CYCLES: i64 = 32;
/// Live allocations the heap may gain over [`COUNTED_CYCLES`] cycles
/// without it being a leak (a map or a slab that grew once).
const CENSUS_SLACK: i64 = COUNTED_CYCLES / 4;

/// Rule 1 without trusting `stats()`: open a segment, move a block, close
/// it, again and again, and count the process's live heap allocations
/// (a counting global allocator, [`crate::census`]; the case runs alone)
/// after `WARM_CYCLES`, then after each of two rounds of `COUNTED_CYCLES`
/// more: they do not grow by more than `CENSUS_SLACK` in both rounds. A
/// backend that keeps anything per closed segment (a connection map it
/// never prunes: the endpoint leak of the field reports) grows them by
/// one or more a cycle in every round, whatever its `stats()` says; a
/// structure that grew once (a slab, a cache filling) grows in one.
pub async fn no_hidden_growth(cx: Ctx) -> CaseResult {
    if crate::census().is_none() {
        return Err(CaseError::Skip(
            "no heap census: the test binary's global allocator is not the suite's counting one \
             (conformance_main! installs it; a main of your own: conformance::census_allocator!())"
                .into(),
        ));
    }
    let p = cx.pair(LEN).await?;
    let t = p.t().clone();
    bounded("close", t.close_segment(p.seg)).await??;
    let base = t.stats();
    let cycle = |round: usize| {
        let (t, p) = (t.clone(), &p);
        async move {
            let seg = open(&p.a, &p.b.name).await?;
            let req = transport_core::TransferRequest { segment: seg, ..p.write(0, 0, 4096) };
            complete(&t, vec![req]).await?;
            bounded("close", t.close_segment(seg))
                .await?
                .map_err(|e| CaseError::Fail(format!("close_segment in cycle {round} failed: {e}")))
        }
    };
    let mut done = 0;
    for _ in 0..WARM_CYCLES {
        cycle(done).await?;
        done += 1;
    }
    expect_stats(&t, base, "after the warm-up cycles").await?;
    let mut counts = vec![quiet_census().await];
    for round in 0..2 {
        for _ in 0..COUNTED_CYCLES {
            cycle(done).await?;
            done += 1;
        }
        expect_stats(&t, base, &format!("after counted round {round}")).await?;
        counts.push(quiet_census().await);
    }
    let grew: Vec<i64> = counts.windows(2).map(|w| w[1].allocations - w[0].allocations).collect();
    ensure!(
        grew.iter().any(|g| *g <= CENSUS_SLACK),
        "the process's live heap allocations grew by {grew:?} in two rounds of {COUNTED_CYCLES} \
         open/transfer/close cycles (counts {:?}, bytes {:?}; more than {CENSUS_SLACK} in every round is a leak), \
         while stats() said every count was back: something is kept per closed segment and not counted",
        counts.iter().map(|c| c.allocations).collect::<Vec<_>>(),
        counts.iter().map(|c| c.bytes).collect::<Vec<_>>()
    );
    if grew.iter().any(|g| *g > CENSUS_SLACK) {
        // One round past the slack: not a leak by the rule, but the log
        // should show it (a slow leak would grow in both).
        eprintln!("conformance: {}: the heap census grew by {grew:?} in its two rounds (a pass)", cx.case());
    }
    Ok(())
}

/// The census once the nodes' work after a close (connections ending,
/// tasks returning) has settled: the lowest count of samples over about
/// two seconds (settling only frees; a soft-RoCE VM settles slowly).
async fn quiet_census() -> crate::Census {
    let mut low: Option<crate::Census> = None;
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if let Some(c) = crate::census() {
            if low.is_none_or(|l| c.allocations < l.allocations) {
                low = Some(c);
            }
        }
    }
    low.unwrap_or(crate::Census { allocations: 0, bytes: 0 })
}
