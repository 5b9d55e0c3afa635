//! Malformed requests are refused with a clear permanent error before a
//! byte moves (rules 7 and 9). Canaries around every region prove that
//! nothing was written where it must not be.

use std::time::Duration;

use transport_core::{ErrorKind, RegionId, SegmentId, SubmitOptions, TransferRequest};

use crate::ctx::{batch_error, bounded, expect_permanent, permanent_kind, Ctx, Pair};
use crate::ensure;
use crate::outcome::{CaseError, CaseResult};

const LEN: usize = 64 << 10;

/// Both regions still hold what they held before, canaries intact.
fn untouched(p: &Pair, local: &[u8], remote: &[u8]) -> CaseResult {
    p.local.expect(local, "local region after a refused request")?;
    p.remote.expect(remote, "remote region after a refused request")
}

async fn refused_at_submit(p: &Pair, reqs: Vec<TransferRequest>, kinds: &[ErrorKind], what: &str) -> CaseResult {
    let r = bounded("submit", p.t().submit(reqs, SubmitOptions::default())).await?;
    expect_permanent(r, kinds, what)?;
    Ok(())
}

/// A request past the end of its local region: `OutOfBounds` at submit,
/// naming the request index.
pub async fn local_out_of_bounds(cx: Ctx) -> CaseResult {
    let p = cx.pair(LEN).await?;
    let (l, r) = (p.local.snapshot(), p.remote.snapshot());
    let n = LEN as u64;
    refused_at_submit(&p, vec![p.write(n - 10, 0, 11)], &[ErrorKind::OutOfBounds], "write past local end").await?;
    refused_at_submit(&p, vec![p.write(n, 0, 1)], &[ErrorKind::OutOfBounds], "write at local end").await?;
    let bad = vec![p.write(0, 0, 8), p.write(8, 8, 8), p.write(n - 1, 16, 2)];
    let e = expect_permanent(
        bounded("submit", p.t().submit(bad, SubmitOptions::default())).await?,
        &[ErrorKind::OutOfBounds],
        "third request out of bounds",
    )?;
    ensure!(e.context_value("request") == Some("2"), "the error must name the failing request (request: 2): {e}");
    if p.t().capabilities().read {
        refused_at_submit(&p, vec![p.read(n - 10, 0, 11)], &[ErrorKind::OutOfBounds], "read past local end").await?;
    }
    untouched(&p, &l, &r)
}

/// A request past either end of the remote region: `OutOfBounds`, and the
/// canaries around the remote region are intact.
pub async fn remote_out_of_bounds(cx: Ctx) -> CaseResult {
    let p = cx.pair(LEN).await?;
    let (l, r) = (p.local.snapshot(), p.remote.snapshot());
    let n = LEN as u64;
    let e = batch_error(p.t(), vec![p.write(0, n - 10, 11)]).await?;
    permanent_kind(&e, &[ErrorKind::OutOfBounds], "write past remote end")?;
    let before = TransferRequest::write(p.local_id, 0, p.seg, p.remote.addr() - 8, 16);
    let e = batch_error(p.t(), vec![before]).await?;
    permanent_kind(&e, &[ErrorKind::OutOfBounds], "write starting before the remote region")?;
    if p.t().capabilities().read {
        let e = batch_error(p.t(), vec![p.read(0, n - 10, 11)]).await?;
        permanent_kind(&e, &[ErrorKind::OutOfBounds], "read past remote end")?;
    }
    untouched(&p, &l, &r)
}

/// `addr + len` overflowing u64, locally and remotely: `OutOfBounds` (or
/// `InvalidRequest` for a length above the maximum), never a wrap-around.
pub async fn addr_len_overflow(cx: Ctx) -> CaseResult {
    let p = cx.pair(LEN).await?;
    let (l, r) = (p.local.snapshot(), p.remote.snapshot());
    let kinds = [ErrorKind::OutOfBounds, ErrorKind::InvalidRequest];
    refused_at_submit(&p, vec![p.write(u64::MAX - 4, 0, 16)], &kinds, "local offset + len overflows").await?;
    refused_at_submit(&p, vec![p.write(8, 0, u64::MAX)], &kinds, "local len u64::MAX").await?;
    let wrap = TransferRequest::write(p.local_id, 0, p.seg, u64::MAX - 4, 16);
    let e = batch_error(p.t(), vec![wrap]).await?;
    permanent_kind(&e, &kinds, "remote addr + len overflows")?;
    // Wraps to exactly the region's start if the sum is computed unchecked.
    let wrap_to_region = TransferRequest::write(p.local_id, 0, p.seg, p.remote.addr().wrapping_sub(1 << 40), 1 << 40);
    let e = batch_error(p.t(), vec![wrap_to_region]).await?;
    permanent_kind(&e, &kinds, "remote range ending at the region start")?;
    untouched(&p, &l, &r)
}

/// A zero-length request: `InvalidRequest` at submit.
pub async fn zero_length(cx: Ctx) -> CaseResult {
    let p = cx.pair(LEN).await?;
    let (l, r) = (p.local.snapshot(), p.remote.snapshot());
    refused_at_submit(&p, vec![p.write(0, 0, 0)], &[ErrorKind::InvalidRequest], "zero-length write").await?;
    refused_at_submit(
        &p,
        vec![p.write(0, 0, 4), p.write(4, 4, 0)],
        &[ErrorKind::InvalidRequest],
        "batch with a zero-length request",
    )
    .await?;
    untouched(&p, &l, &r)
}

/// Unknown region and segment handles: `InvalidHandle` at submit.
pub async fn unknown_handles(cx: Ctx) -> CaseResult {
    let p = cx.pair(LEN).await?;
    let (l, r) = (p.local.snapshot(), p.remote.snapshot());
    let bad_region = TransferRequest::write(RegionId(u64::MAX), 0, p.seg, p.remote.addr(), 8);
    refused_at_submit(&p, vec![bad_region], &[ErrorKind::InvalidHandle], "unknown local region").await?;
    // The remote region's id belongs to the peer, not to this transport.
    let foreign = TransferRequest::write(RegionId(p.remote_id.0 + 1_000_000), 0, p.seg, p.remote.addr(), 8);
    refused_at_submit(&p, vec![foreign], &[ErrorKind::InvalidHandle], "region id never issued here").await?;
    let bad_seg = TransferRequest::write(p.local_id, 0, SegmentId(u64::MAX), p.remote.addr(), 8);
    refused_at_submit(&p, vec![bad_seg], &[ErrorKind::InvalidHandle], "unknown segment").await?;
    untouched(&p, &l, &r)
}

/// A local region used after it was unregistered: `InvalidHandle` (or
/// `Unregistered`) at submit.
pub async fn unregistered_local_region(cx: Ctx) -> CaseResult {
    let p = cx.pair(LEN).await?;
    let (l, r) = (p.local.snapshot(), p.remote.snapshot());
    bounded("unregister", p.t().unregister(p.local_id)).await??;
    refused_at_submit(
        &p,
        vec![p.write(0, 0, 8)],
        &[ErrorKind::InvalidHandle, ErrorKind::Unregistered],
        "unregistered local region",
    )
    .await?;
    untouched(&p, &l, &r)
}

/// An empty batch: `InvalidRequest`.
pub async fn empty_batch(cx: Ctx) -> CaseResult {
    let p = cx.pair(LEN).await?;
    let before = p.t().stats();
    refused_at_submit(&p, vec![], &[ErrorKind::InvalidRequest], "empty batch").await?;
    ensure!(p.t().stats().batches == before.batches, "a refused batch must not be counted");
    Ok(())
}

/// A batch of `max_batch_len + 1` requests: `InvalidRequest`, nothing moved.
pub async fn oversized_batch(cx: Ctx) -> CaseResult {
    let p = cx.pair(LEN).await?;
    let max = p.t().capabilities().max_batch_len;
    if max >= 1 << 22 {
        return Err(CaseError::Skip(format!("max_batch_len {max} is too large to build a batch past it")));
    }
    let (l, r) = (p.local.snapshot(), p.remote.snapshot());
    let reqs = (0..=max as u64).map(|i| p.write(i % LEN as u64, i % LEN as u64, 1)).collect();
    refused_at_submit(&p, reqs, &[ErrorKind::InvalidRequest], "batch of max_batch_len + 1").await?;
    untouched(&p, &l, &r)
}

/// A request longer than `max_request_len`: refused (`InvalidRequest`, or
/// `OutOfBounds` when it is also past the region).
pub async fn oversized_request(cx: Ctx) -> CaseResult {
    let p = cx.pair(LEN).await?;
    let max = p.t().capabilities().max_request_len;
    let (l, r) = (p.local.snapshot(), p.remote.snapshot());
    let kinds = [ErrorKind::InvalidRequest, ErrorKind::OutOfBounds];
    refused_at_submit(&p, vec![p.write(0, 0, max.saturating_add(1))], &kinds, "request above max_request_len").await?;
    untouched(&p, &l, &r)
}

/// One bad request refuses the whole batch: the valid requests before it
/// move no byte, and no batch or in-flight work is counted.
pub async fn refused_batch_starts_nothing(cx: Ctx) -> CaseResult {
    let p = cx.pair(LEN).await?;
    let (l, r) = (p.local.snapshot(), p.remote.snapshot());
    let before = p.t().stats();
    let reqs = vec![p.write(0, 0, 4096), p.write(4096, 4096, 4096), p.write(0, 0, 0)];
    let e = expect_permanent(
        bounded("submit", p.t().submit(reqs, SubmitOptions::default())).await?,
        &[ErrorKind::InvalidRequest],
        "batch whose last request is invalid",
    )?;
    ensure!(e.context_value("request") == Some("2"), "the error must name the failing request (request: 2): {e}");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let after = p.t().stats();
    ensure!(
        after.batches == before.batches && after.inflight == before.inflight,
        "a refused batch left work counted: {before:?} -> {after:?}"
    );
    untouched(&p, &l, &r)
}
