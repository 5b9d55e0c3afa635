//! Memory is guarded (rule 9): remote access only to regions registered
//! for it, registration conflicts and unregistering under load are defined.

use std::sync::Arc;
use std::time::Duration;

use transport_core::{
    Access, BatchState, ErrorKind, MemoryRegion, RegionId, RequestStatus, SubmitOptions, TransferRequest,
};

use crate::ctx::{
    batch_error, bounded, complete, expect_permanent, expect_quiet, permanent_kind, run_batch, wait_batch, Ctx, Pair,
};
use crate::devices::TestDevice;
use crate::ensure;
use crate::guard::pattern;
use crate::harness::NodeOptions;
use crate::outcome::{CaseError, CaseResult};

const LEN: usize = 64 << 10;

/// Writing into a peer region registered read-only is `AccessDenied`; the
/// region does not change.
pub async fn write_to_read_only_denied(cx: Ctx) -> CaseResult {
    let p = cx.pair(LEN).await?;
    let ro = cx.guarded(LEN, 7)?;
    p.b.transport.register(ro.region(), Access::REMOTE_READ)?;
    let before = ro.snapshot();
    let req = TransferRequest::write(p.local_id, 0, p.seg, ro.addr(), 64);
    // The descriptor may predate the registration; reopen to see it.
    let seg = crate::ctx::open(&p.a, &p.b.name).await?;
    let req2 = TransferRequest { segment: seg, ..req };
    let e = batch_error(p.t(), vec![req2]).await?;
    permanent_kind(&e, &[ErrorKind::AccessDenied], "write into a read-only region")?;
    ro.expect(&before, "read-only region after a denied write")
}

/// Reading from a peer region registered write-only is `AccessDenied`; the
/// local destination does not change.
pub async fn read_from_write_only_denied(cx: Ctx) -> CaseResult {
    let p = cx.pair(LEN).await?;
    if !p.t().capabilities().read {
        return Err(CaseError::Skip("the backend does not support reads".into()));
    }
    let wo = cx.guarded(LEN, 8)?;
    p.b.transport.register(wo.region(), Access::REMOTE_WRITE)?;
    let seg = crate::ctx::open(&p.a, &p.b.name).await?;
    let local = p.local.snapshot();
    let e = batch_error(p.t(), vec![TransferRequest::read(p.local_id, 0, seg, wo.addr(), 64)]).await?;
    permanent_kind(&e, &[ErrorKind::AccessDenied], "read from a write-only region")?;
    p.local.expect(&local, "local region after a denied read")
}

/// A peer region registered for local use only cannot be reached.
pub async fn local_only_region_unreachable(cx: Ctx) -> CaseResult {
    let p = cx.pair(LEN).await?;
    let private = cx.guarded(LEN, 9)?;
    p.b.transport.register(private.region(), Access::LOCAL)?;
    let seg = crate::ctx::open(&p.a, &p.b.name).await?;
    let before = private.snapshot();
    let e = batch_error(p.t(), vec![TransferRequest::write(p.local_id, 0, seg, private.addr(), 64)]).await?;
    permanent_kind(
        &e,
        &[ErrorKind::AccessDenied, ErrorKind::OutOfBounds, ErrorKind::Unregistered],
        "write into a local-only region",
    )?;
    private.expect(&before, "local-only region after a refused write")
}

/// Registering the same range twice, or an overlapping one, is
/// `AlreadyRegistered`; the first registration keeps working.
pub async fn overlapping_registration_refused(cx: Ctx) -> CaseResult {
    let p = cx.pair(LEN).await?;
    let t = p.t();
    let dup = t.register(p.local.region(), Access::LOCAL);
    expect_permanent(dup, &[ErrorKind::AlreadyRegistered], "registering the same region twice")?;
    let inner = t.register(p.local.sub(4096, 4096)?, Access::LOCAL);
    expect_permanent(inner, &[ErrorKind::AlreadyRegistered], "registering a range inside a registered one")?;
    let tail = t.register(p.local.sub(LEN - 1, 1)?, Access::REMOTE_RW);
    expect_permanent(tail, &[ErrorKind::AlreadyRegistered], "registering the last byte again")?;
    let before = t.stats();
    ensure!(before.regions == 1, "refused registrations must not be counted: {before:?}");
    complete(t, vec![p.write(0, 0, 4096)]).await?;
    // After unregistering, the same memory can be registered again.
    bounded("unregister", t.unregister(p.local_id)).await??;
    let again = t.register(p.local.region(), Access::LOCAL)?;
    let req = TransferRequest { local: again, ..p.write(0, 0, 4096) };
    complete(t, vec![req]).await?;
    Ok(())
}

/// Unregistering twice, or an unknown id, is `InvalidHandle`.
pub async fn double_unregister(cx: Ctx) -> CaseResult {
    let p = cx.pair(LEN).await?;
    let t = p.t();
    bounded("unregister", t.unregister(p.local_id)).await??;
    let again = bounded("unregister", t.unregister(p.local_id)).await?;
    expect_permanent(again, &[ErrorKind::InvalidHandle], "second unregister")?;
    let unknown = bounded("unregister", t.unregister(RegionId(u64::MAX))).await?;
    expect_permanent(unknown, &[ErrorKind::InvalidHandle], "unregister of an unknown id")?;
    ensure!(t.stats().regions == 0, "regions still counted: {:?}", t.stats());
    Ok(())
}

/// A peer region unregistered before the transfer: the write fails and the
/// memory is not touched.
pub async fn write_to_unregistered_remote_fails(cx: Ctx) -> CaseResult {
    let p = cx.pair(LEN).await?;
    bounded("unregister", p.b.transport.unregister(p.remote_id)).await??;
    let before = p.remote.snapshot();
    let e = batch_error(p.t(), vec![p.write(0, 0, 4096)]).await?;
    let kinds = [ErrorKind::Unregistered, ErrorKind::OutOfBounds, ErrorKind::AccessDenied, ErrorKind::PeerRestarted];
    ensure!(kinds.contains(&e.kind()), "write into an unregistered peer region: expected one of {kinds:?}, got {e}");
    tokio::time::sleep(Duration::from_millis(50)).await;
    p.remote.expect(&before, "unregistered peer region")
}

/// Unregistering a local region with a transfer in flight (traffic
/// stalled): the call returns, the request ends (`Unregistered`, or
/// completed if it won the race), and from then on the memory is quiet:
/// new bytes put into it never reach the peer.
pub async fn unregister_local_in_flight(cx: Ctx) -> CaseResult {
    let p = cx.pair(1 << 20).await?;
    let t = p.t().clone();
    let base = t.stats();
    cx.stall(&p.b, true).await?;
    let b = t.submit(vec![p.write(0, 0, 1 << 20)], SubmitOptions::default()).await?;
    tokio::time::sleep(Duration::from_millis(50)).await;
    bounded("unregister with a transfer in flight", t.unregister(p.local_id)).await??;
    let s = t.poll(b)?;
    ensure!(s.is_terminal(), "unregister returned while its request is still {:?}", s.state);
    match &s.requests[0] {
        RequestStatus::Completed | RequestStatus::Cancelled => {}
        RequestStatus::Failed(e) => {
            permanent_kind(e, &[ErrorKind::Unregistered], "request whose region was unregistered")?
        }
        other => return Err(CaseError::Fail(format!("request ended {other:?}, expected Unregistered"))),
    }
    // Reuse the memory at once; the peer must never see the new bytes.
    p.local.write(0, &pattern(99, 1 << 20))?;
    let remote = p.remote.snapshot();
    cx.stall(&p.b, false).await?;
    expect_quiet(&p.remote, &remote, Duration::from_millis(300), "peer memory after the source was unregistered")
        .await?;
    t.release(b)?;
    let ok = crate::ctx::settle(crate::ctx::SETTLE, || {
        let s = t.stats();
        s.regions + 1 == base.regions && s.batches == base.batches && s.inflight == 0
    })
    .await;
    ensure!(ok, "after unregister and release: {:?}, baseline {base:?} less one region (rule 1)", t.stats());
    Ok(())
}

/// The peer unregisters the target region while a write into it is in
/// flight: the peer's call returns once nothing can touch the memory, the
/// write ends failed, and the memory stays quiet after traffic resumes.
pub async fn unregister_remote_in_flight(cx: Ctx) -> CaseResult {
    let p = cx.pair(1 << 20).await?;
    let t = p.t().clone();
    cx.stall(&p.b, true).await?;
    let b = t.submit(vec![p.write(0, 0, 1 << 20)], SubmitOptions::default()).await?;
    tokio::time::sleep(Duration::from_millis(50)).await;
    bounded("peer unregister with a write in flight", p.b.transport.unregister(p.remote_id)).await??;
    let remote = p.remote.snapshot();
    cx.stall(&p.b, false).await?;
    let s = wait_batch(t.as_ref(), b, None, "wait").await??;
    ensure!(s.state != BatchState::InProgress, "wait returned a non-terminal status");
    expect_quiet(&p.remote, &remote, Duration::from_millis(300), "peer memory after the peer unregistered it").await?;
    t.release(b)?;
    Ok(())
}

/// Device memory of the device source (`crate::devices`: by default a
/// fake device, `FakeDevice`: the host cannot touch it; any direct access
/// faults and kills the suite).
const DEV_LEN: usize = 1 << 20;

/// A device region of `len` bytes on `dev`, filled with `pattern(seed)`
/// through the provider.
fn device_region(dev: &Arc<dyn TestDevice>, len: usize, seed: u64) -> Result<(MemoryRegion, Vec<u8>), CaseError> {
    let r = dev.region(len).map_err(|e| CaseError::Fail(format!("device memory: {e}")))?;
    let bytes = pattern(seed, len);
    r.write_at(0, &bytes).map_err(|e| CaseError::Fail(format!("fill through the provider: {e}")))?;
    Ok((r, bytes))
}

/// Memory kinds (docs/CONTRACT.md, rule 9): device regions on a fake
/// device whose memory faults on any host access.
/// - A backend without `capabilities().device_memory` refuses a device
///   region at registration (`Unsupported`, permanent), never later.
/// - A backend with it but without `capabilities().device_memory_remote`
///   refuses a device region with remote access (`Unsupported`) and
///   moves device memory on the initiator's side only.
/// - Otherwise host to device, device to device and device to host writes
///   (and reads, where supported) land byte-exact, read back through the
///   provider; a device copy that fails ends its request with a transient
///   error and the next transfer works.
pub async fn device_regions(cx: Ctx) -> CaseResult {
    let p = cx.pair(LEN).await?;
    let (ta, tb) = (p.a.transport.clone(), p.b.transport.clone());
    let da = crate::devices::device(0, 4 * DEV_LEN)?;
    let db = crate::devices::device(1, 4 * DEV_LEN)?;
    let (la, la_bytes) = device_region(&da, DEV_LEN, 31)?;
    if !ta.capabilities().device_memory {
        let r = ta.register(la.clone(), Access::LOCAL);
        expect_permanent(r, &[ErrorKind::Unsupported], "registering device memory on a backend without it")?;
        let r = tb.register(la, Access::REMOTE_RW);
        expect_permanent(r, &[ErrorKind::Unsupported], "registering device memory for peers, without it")?;
        return Ok(());
    }
    let (rb, _) = device_region(&db, DEV_LEN, 32)?;
    if !ta.capabilities().device_memory_remote {
        let r = tb.register(rb, Access::REMOTE_RW);
        expect_permanent(r, &[ErrorKind::Unsupported], "registering device memory for peers, without remote")?;
        return initiator_device_only(&p, &da, la, &la_bytes).await;
    }
    let la_id = ta.register(la.clone(), Access::LOCAL)?;
    let rb_id = tb.register(rb.clone(), Access::REMOTE_RW)?;
    let seg = crate::ctx::open(&p.a, &p.b.name).await?;
    let n = DEV_LEN as u64;
    let half = n / 2;

    // Device to device, then host to device, then device to host.
    complete(&ta, vec![TransferRequest::write(la_id, 0, seg, rb.addr(), n)]).await?;
    ensure!(rb.to_vec() == la_bytes, "device to device write: the target's device memory differs");
    let host = pattern(33, LEN);
    p.local.region().write_at(0, &host).map_err(|e| CaseError::Fail(e.to_string()))?;
    complete(&ta, vec![TransferRequest::write(p.local_id, 0, seg, rb.addr() + 4096, LEN as u64)]).await?;
    let got = rb.to_vec();
    ensure!(got[4096..4096 + LEN] == host[..], "host to device write: the target's device memory differs");
    ensure!(got[..4096] == la_bytes[..4096], "host to device write: bytes before the range changed");
    complete(&ta, vec![TransferRequest::write(la_id, 8, seg, p.remote.addr(), LEN as u64)]).await?;
    ensure!(p.remote.snapshot() == la_bytes[8..8 + LEN], "device to host write: the target's host memory differs");

    if ta.capabilities().read {
        // Device to device and device to host reads.
        let (lr, _) = device_region(&da, DEV_LEN, 34)?;
        let lr_id = ta.register(lr.clone(), Access::LOCAL)?;
        let want = rb.to_vec();
        complete(&ta, vec![TransferRequest::read(lr_id, 0, seg, rb.addr() + half, half)]).await?;
        ensure!(lr.to_vec()[..half as usize] == want[half as usize..], "device to device read differs");
        complete(&ta, vec![TransferRequest::read(p.local_id, 0, seg, rb.addr(), LEN as u64)]).await?;
        ensure!(p.local.snapshot() == want[..LEN], "device to host read: the local host memory differs");
        ta.unregister(lr_id).await?;
    }

    // Failed device copies: the target's, then the initiator's. The
    // request fails with a transient error, or completes when a layer
    // (rails) retried it elsewhere.
    for (dev, side) in [(&db, "the target's"), (&da, "the initiator's")] {
        if !dev.fail_copies(1) {
            break; // a device source that cannot fail copies (a real GPU)
        }
        let reqs = vec![TransferRequest::write(la_id, 0, seg, rb.addr(), 4096)];
        match run_batch(&ta, reqs, SubmitOptions::default()).await? {
            Err(e) => ensure!(e.is_transient(), "a failed device copy on {side} side: {e} must be transient (rule 7)"),
            Ok(s) if s.state == BatchState::Completed => {
                ensure!(rb.to_vec()[..4096] == la_bytes[..4096], "a write retried past {side} failed copy differs")
            }
            Ok(s) => {
                let e = s.first_error().map(ToString::to_string).unwrap_or_default();
                ensure!(
                    s.first_error().is_some_and(|e| e.is_transient()),
                    "a failed device copy on {side} side ended {:?}: {e} (rule 7: transient)",
                    s.state
                );
            }
        }
        ensure!(dev.failures_left() == 0, "the injected copy failure on {side} side was never hit");
        dev.fail_copies(0);
        complete(&ta, vec![TransferRequest::write(la_id, 0, seg, rb.addr(), n)]).await?;
        ensure!(rb.to_vec() == la_bytes, "after {side} failed copy: the next write differs");
    }
    ta.unregister(la_id).await?;
    tb.unregister(rb_id).await?;
    Ok(())
}

/// [`device_regions`] on a backend that moves device memory on the
/// initiator's side only: device to host writes and reads land
/// byte-exact, a failed initiator copy is transient, the next write works.
async fn initiator_device_only(p: &Pair, da: &Arc<dyn TestDevice>, la: MemoryRegion, la_bytes: &[u8]) -> CaseResult {
    let ta = p.a.transport.clone();
    let la_id = ta.register(la.clone(), Access::LOCAL)?;
    complete(&ta, vec![TransferRequest::write(la_id, 8, p.seg, p.remote.addr(), LEN as u64)]).await?;
    ensure!(p.remote.snapshot() == la_bytes[8..8 + LEN], "device to host write: the target's host memory differs");
    if ta.capabilities().read {
        let (lr, _) = device_region(da, DEV_LEN, 34)?;
        let lr_id = ta.register(lr.clone(), Access::LOCAL)?;
        let want = p.remote.snapshot();
        complete(&ta, vec![TransferRequest::read(lr_id, 4096, p.seg, p.remote.addr(), LEN as u64)]).await?;
        ensure!(lr.to_vec()[4096..4096 + LEN] == want[..], "device to host read: the local device memory differs");
        ta.unregister(lr_id).await?;
    }
    if !da.fail_copies(1) {
        ta.unregister(la_id).await?;
        return Ok(()); // a device source that cannot fail copies (a real GPU)
    }
    let reqs = vec![TransferRequest::write(la_id, 0, p.seg, p.remote.addr(), 4096)];
    match run_batch(&ta, reqs, SubmitOptions::default()).await? {
        Err(e) => ensure!(e.is_transient(), "a failed device copy on the initiator's side: {e} must be transient"),
        Ok(s) if s.state == BatchState::Completed => {
            ensure!(p.remote.snapshot()[..4096] == la_bytes[..4096], "a write retried past a failed copy differs")
        }
        Ok(s) => ensure!(
            s.first_error().is_some_and(|e| e.is_transient()),
            "a failed device copy on the initiator's side ended {:?}: {:?} (rule 7: transient)",
            s.state,
            s.first_error().map(ToString::to_string)
        ),
    }
    ensure!(da.failures_left() == 0, "the injected copy failure on the initiator's side was never hit");
    da.fail_copies(0);
    complete(&ta, vec![TransferRequest::write(la_id, 0, p.seg, p.remote.addr(), LEN as u64)]).await?;
    ensure!(p.remote.snapshot() == la_bytes[..LEN], "after a failed initiator copy: the next write differs");
    ta.unregister(la_id).await?;
    Ok(())
}

/// How the slow-copy case ends a batch.
#[derive(Debug, Clone, Copy)]
enum End {
    Deadline,
    Cancel,
}

/// Device copies that take their time (rules 5 and 9: terminal means
/// quiet, with device memory): a deadline or a cancel that lands while the
/// target's or the initiator's device copies run ends the batch, and from
/// its terminal report on no byte of the target's device memory changes
/// (no copy still running into it).
pub async fn slow_device_copies_stay_quiet(cx: Ctx) -> CaseResult {
    const PARTS: usize = 8;
    const PART: usize = 16 << 10;
    // Each copy slow enough that the 45 ms deadline (or the cancel at
    // 40 ms) lands while they run, and each well inside a backend's wait
    // for the answers still owed (TCP's `drain_timeout`, 250 ms of the
    // target's silence: a drain that gave up while a copy ran would let it
    // land after the report; when it counted from the end, not from the
    // last answer, eight copies under a CI load outlasted it).
    const COPY: Duration = Duration::from_millis(15);
    let a = cx.node(&NodeOptions::default()).await?;
    let b = cx.node(&NodeOptions::default()).await?;
    if !a.transport.capabilities().device_memory {
        return Err(CaseError::Skip("the backend moves no device memory (memory::device_regions checks it)".into()));
    }
    let t = a.transport.clone();
    // Without remote device memory the target's is on the host and only
    // the initiator's copies are slow.
    let remote_dev = t.capabilities().device_memory_remote;
    let local = cx.guarded_on_device(PARTS * PART, 71, 0)?;
    let remote = if remote_dev {
        cx.guarded_on_device(PARTS * PART, 72, 1)?
    } else {
        crate::guard::Guarded::new(PARTS * PART, 72)?
    };
    let dev = |g: &crate::guard::Guarded| {
        g.device().cloned().ok_or_else(|| CaseError::Fail("a guarded device region without a device".into()))
    };
    let ldev = dev(&local)?;
    let mut sides = vec![(ldev, "the initiator's")];
    if remote_dev {
        sides.insert(0, (dev(&remote)?, "the target's"));
    }
    let lid = t.register(local.region(), Access::LOCAL)?;
    b.transport.register(remote.region(), Access::REMOTE_RW)?;
    let seg = crate::ctx::open(&a, &b.name).await?;
    let mut seed = 80;
    for (slow, side) in &sides {
        for end in [End::Deadline, End::Cancel] {
            seed += 1;
            let reqs = (0..PARTS as u64)
                .map(|k| {
                    TransferRequest::write(lid, k * PART as u64, seg, remote.addr() + k * PART as u64, PART as u64)
                })
                .collect();
            let opts = match end {
                End::Deadline => SubmitOptions::with_timeout(Duration::from_millis(45)),
                End::Cancel => SubmitOptions::default(),
            };
            if !slow.delay_copies(COPY) {
                return Err(CaseError::Skip(format!(
                    "the {} devices cannot slow copies",
                    crate::devices::source_name()
                )));
            }
            let id = t.submit(reqs, opts).await?;
            let s = match end {
                End::Deadline => bounded("wait for the deadline", t.wait(id)).await??,
                End::Cancel => {
                    tokio::time::sleep(Duration::from_millis(40)).await;
                    bounded("cancel while device copies run", t.cancel(id)).await??
                }
            };
            ensure!(s.is_terminal(), "{end:?} with {side} copies slow: {:?} is not terminal", s.state);
            let what = format!("target device memory after {end:?} with {side} device copies slow ({:?})", s.state);
            let snap = remote.snapshot();
            local.write(0, &pattern(seed, PARTS * PART))?;
            expect_quiet(&remote, &snap, Duration::from_millis(300), &what).await?;
            let _ = slow.delay_copies(Duration::ZERO);
            t.release(id)?;
        }
    }
    Ok(())
}
