//! Rule 12, admission is the receiver's: a session lands where it was
//! granted; nothing is sent without a grant, nor outside it; the deadline
//! starts at the grant.

use super::*;

// ---------------------------------------------------------------------------
// landed_on_both_sides

/// Grant of two ranges with a gap, eight layers of 256 KiB (each one
/// `write` call of several requests, each with its own bytes), finish: both
/// sides `Landed`, every byte in the receiver's memory the moment its state
/// turns `Landed` (gaps and canaries unchanged), states only forward, and
/// the counts back to baseline after release.
pub async fn landed_on_both_sides(cx: Ctx) -> CaseResult {
    let half = LAYERS / 2 * LAYER;
    let gap = 128 << 10;
    let duo = Arc::new(Duo::new(&cx, (2 * half + 2 * gap) as usize).await?);
    fill_layers(&duo.p.mem, LAYER)?;
    let id = 42;
    let (ks, kr) = (duo.ks(id), duo.kr(id));
    duo.expect_no_sessions("before the session")?;
    let base = (duo.p.s.counts(), duo.d.s.counts());

    duo.p.s.expect(&duo.dn, id)?;
    let ws = watch(&duo.p.s, &ks, "the sender");
    let ranges = [(gap, half), (2 * gap + half, half)];
    let g = duo.grant(id, &ranges, LONG).await?;
    let wr = watch(&duo.d.s, &kr, "the receiver");
    let got = duo.wait_grant(id).await?;
    ensure!(got == g, "the sender got the grant {got:?}, the receiver granted {g:?}");

    // Layer k: sender bytes [k * LAYER, ...) to the k-th slot of the ranges.
    let parts: Vec<Part> = (0..LAYERS)
        .map(|k| {
            let (off, i) = if k < LAYERS / 2 { (ranges[0].0, k) } else { (ranges[1].0, k - LAYERS / 2) };
            part(k * LAYER, off + i * LAYER, LAYER)
        })
        .collect();
    let before = duo.d.mem.snapshot();
    let want = duo.model(&before, &parts);
    // The receiver looks at its memory the moment its state turns final.
    let d2 = duo.clone();
    let landing = tokio::spawn(async move {
        let st = ends(&d2.d.s, &d2.kr(id), ENDS_WITHIN + LONG, "the receiver").await;
        (st, d2.d.mem.snapshot())
    });
    for (k, p) in parts.iter().enumerate() {
        duo.write_ok(id, &[*p], &format!("layer {k}")).await?;
        let st = duo.p.s.state(&ks);
        ensure!(
            matches!(st, Some(SessionState::Transferring)),
            "after layer {k} the sender's state is {}, expected transferring",
            state_now(&duo.p.s, &ks)
        );
    }
    duo.finish(id)?;
    let (st, now) = bounded("the receiver's landing", landing)
        .await?
        .map_err(|e| CaseError::Fail(format!("the receiver's watcher panicked: {e}")))?;
    expect_state(&st?, "landed", "the receiver")?;
    expect_bytes(
        &duo.d.mem,
        &now,
        &want,
        "when the receiver's state turned landed (rule 13: landed means every byte)",
    )?;
    duo.both_end(id, "landed", ENDS_WITHIN, "a granted, written and finished session").await?;
    let (seen_p, seen_r) = (ws.end().await?, wr.end().await?);
    ensure!(
        seen_p.last() == Some(&"landed") && seen_r.last() == Some(&"landed"),
        "the sender went through {seen_p:?}, the receiver through {seen_r:?}"
    );
    duo.d.mem.expect(&want, "after both sides landed")?;

    duo.release(id)?;
    duo.expect_no_sessions("after release")?;
    let now = (duo.p.s.counts(), duo.d.s.counts());
    ensure!(
        now.0.open == base.0.open && now.1.open == base.1.open,
        "open sessions {now:?} after release, {base:?} before"
    );
    duo.expect_inboxes_empty("after release").await
}

// ---------------------------------------------------------------------------
// no_grant_no_send

/// Without a grant a write is refused and no byte of the receiver changes
/// (no session at all, then a session waiting for its grant). A sender
/// waiting for a live but busy receiver stays `Waiting` for three liveness
/// timeouts (nothing fails, nothing is sent); then the grant comes and the
/// session lands.
pub async fn no_grant_no_send(cx: Ctx) -> CaseResult {
    let len = 1 << 20;
    let duo = Duo::new(&cx, len).await?;
    let id = 5;
    let (ks, kr) = (duo.ks(id), duo.kr(id));
    let before = duo.d.mem.snapshot();
    let all = [part(0, 0, len as u64)];

    let r = duo.write(id, &all).await?;
    expect_permanent(r, &[ErrorKind::InvalidHandle, ErrorKind::InvalidRequest], "a write for an unknown session")?;
    duo.p.s.expect(&duo.dn, id)?;
    let r = duo.write(id, &all).await?;
    expect_permanent(r, &[ErrorKind::InvalidRequest], "a write for a session waiting for its grant (rule 12)")?;
    duo.d.mem.expect(&before, "after refused writes without a grant (rule 12: nothing is sent)")?;

    // Live but busy: the receiver grants nothing for a while.
    let waited = 3 * LIVENESS;
    let end = Instant::now() + waited;
    while Instant::now() < end {
        let st = duo.p.s.state(&ks);
        ensure!(
            matches!(st, Some(SessionState::Waiting)),
            "a sender waiting for a live receiver's grant became {} (rule 12: nothing times out without a grant)",
            state_now(&duo.p.s, &ks)
        );
        ensure!(duo.d.s.state(&kr).is_none(), "the receiver knows a session it never granted");
        duo.d.mem.expect(&before, "while the sender waits for a grant (rule 12: nothing is sent)")?;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    duo.grant(id, &[(0, len as u64)], LONG).await?;
    duo.wait_grant(id).await?;
    duo.write_ok(id, &all, "the write after the grant").await?;
    duo.finish(id)?;
    duo.both_end(id, "landed", ENDS_WITHIN, &format!("after {waited:?} waiting for the grant")).await?;
    duo.d.mem.expect(&duo.model(&before, &all), "the landed session")?;
    duo.release(id)
}

// ---------------------------------------------------------------------------
// write_outside_grant_refused

/// A grant of two ranges with a gap; writes partly or wholly outside them,
/// across the gap, past the receiver's memory, with `addr + len`
/// overflowing, and a batch with one good and one bad request: each is
/// refused with a permanent `OutOfBounds` before a byte moves (the
/// receiver's memory, canaries included, unchanged, also a while later),
/// and the session stays open and lands afterwards.
pub async fn write_outside_grant_refused(cx: Ctx) -> CaseResult {
    let len: u64 = 1 << 20;
    let duo = Duo::new(&cx, len as usize).await?;
    let id = 9;
    let ks = duo.ks(id);
    let (a0, b0, gl) = (128 << 10, 384 << 10, 128 << 10);
    duo.p.s.expect(&duo.dn, id)?;
    duo.grant(id, &[(a0, gl), (b0, gl)], LONG).await?;
    duo.wait_grant(id).await?;
    let before = duo.d.mem.snapshot();
    let seg = duo.seg().await?;
    let base = duo.d.mem.addr();
    let w = |loff: u64, addr: u64, n: u64| TransferRequest::write(duo.p.region, loff, seg, addr, n);

    let cases: Vec<(&str, Vec<TransferRequest>)> = vec![
        ("a write starting one byte before the grant", vec![w(0, base + a0 - 1, 4096)]),
        ("a write ending one byte past a granted range", vec![w(0, base + a0 + gl - 4095, 4096)]),
        ("a write across the gap between two granted ranges", vec![w(0, base + a0, b0 + 4096 - a0)]),
        ("a write wholly before the grant", vec![w(0, base, 4096)]),
        ("a write wholly after the grant", vec![w(0, base + b0 + gl, 4096)]),
        ("a write past the receiver's memory", vec![w(0, base + len + 4096, 4096)]),
        ("a write whose addr + len overflows", vec![w(0, u64::MAX - 100, 4096)]),
        ("a write from a granted address whose len overflows", vec![w(0, base + a0, u64::MAX - (base + a0) + 1)]),
        (
            "a batch with a good request then one past the grant",
            vec![w(0, base + a0, 4096), w(0, base + b0 + gl - 100, 4096)],
        ),
    ];
    for (what, reqs) in cases {
        let mixed = reqs.len() > 1;
        let r = bounded("Sessions::write", duo.p.s.write(&duo.dn, id, reqs)).await?;
        let e = expect_permanent(r, &[ErrorKind::OutOfBounds], &format!("{what} (rule 12)"))?;
        if mixed {
            ensure!(
                e.context_value("request") == Some("1"),
                "{what}: the error {e} does not name the failing request (index 1)"
            );
        }
        duo.d.mem.expect(&before, &format!("{what}: refused (rule 12: before a byte moves)"))?;
        let st = duo.p.s.state(&ks);
        ensure!(
            st.as_ref().is_some_and(|s| !s.is_final()),
            "{what}: the refused write ended the session ({})",
            state_now(&duo.p.s, &ks)
        );
    }
    expect_quiet(&duo.d.mem, &before, QUIET, "after writes outside the grant were refused (rule 12)").await?;

    let parts = [part(0, a0, gl), part(gl, b0, gl)];
    duo.write_ok(id, &parts, "the granted write after the refused ones").await?;
    duo.finish(id)?;
    duo.both_end(id, "landed", ENDS_WITHIN, "the session after refused writes").await?;
    duo.d.mem.expect(&duo.model(&before, &parts), "the landed session")?;
    duo.release(id)
}

// ---------------------------------------------------------------------------
// grant_in_parts_lands

/// Ranges in the grant of [`grant_in_parts_lands`]: four notifications'
/// worth (a grant past `GRANT_RANGES_PER_MESSAGE` travels in parts).
const SCATTERED: u64 = 1000;

/// A grant of [`SCATTERED`] ranges of 512 bytes, 512-byte gaps between them,
/// in descending address order (a KV cache whose free blocks come back in
/// reverse, as vLLM's do): the sender gets exactly the granted ranges, in
/// the receiver's order; a write into one of the gaps is refused with
/// `OutOfBounds`; the ranges written in that order in four `write` calls,
/// then finish: both sides Landed, every byte where it was granted and the
/// gaps unchanged.
pub async fn grant_in_parts_lands(cx: Ctx) -> CaseResult {
    let len: u64 = 1 << 20;
    let duo = Duo::new(&cx, len as usize).await?;
    duo.p.mem.write(0, &pattern(77, len as usize))?;
    let id = 23;
    let ranges: Vec<(u64, u64)> = (0..SCATTERED).rev().map(|i| (i * 1024 + 256, 512)).collect();
    duo.p.s.expect(&duo.dn, id)?;
    let g = duo.grant(id, &ranges, LONG).await?;
    let got = duo.wait_grant(id).await?;
    ensure!(
        got == g,
        "the sender's grant differs from the receiver's (rule 12: a grant in parts arrives whole and in order): \
         {} ranges, first {:?}, last {:?}; granted {} ranges, first {:?}, last {:?}",
        got.ranges.len(),
        got.ranges.first(),
        got.ranges.last(),
        g.ranges.len(),
        g.ranges.first(),
        g.ranges.last()
    );
    let before = duo.d.mem.snapshot();
    let gap = [part(0, 256 + 512, 256)];
    let r = duo.write(id, &gap).await?;
    expect_permanent(r, &[ErrorKind::OutOfBounds], "a write into a gap of a grant in parts (rule 12)")?;
    duo.d.mem.expect(&before, "after the write into the gap was refused (rule 12: before a byte moves)")?;

    let parts: Vec<Part> = ranges.iter().enumerate().map(|(k, &(off, n))| part(k as u64 * n, off, n)).collect();
    for (i, chunk) in parts.chunks(parts.len() / 4).enumerate() {
        duo.write_ok(id, chunk, &format!("write {i} of the scattered ranges")).await?;
    }
    duo.finish(id)?;
    duo.both_end(id, "landed", ENDS_WITHIN, "a session granted in parts").await?;
    duo.d.mem.expect(&duo.model(&before, &parts), "the landed session granted in parts")?;
    duo.release(id)
}

// ---------------------------------------------------------------------------
// deadline_starts_at_grant

/// The deadline of the first session (its write and finish must fit in it
/// on a loaded machine).
const D1: Duration = Duration::from_millis(3000);
/// The deadline of the stalled session.
const D2: Duration = Duration::from_millis(200);
/// How long the stall lasts: past `D2`, well within [`LIVENESS`].
const STALL_FOR: Duration = Duration::from_millis(450);

/// A sender waits longer than the grant's deadline *before* the grant, then gets
/// the grant and still lands (the deadline starts at the grant). A second
/// session: traffic to the receiver stalled right after its grant, for
/// longer than its deadline (not longer than the liveness timeout), then
/// resumed: both sides end `Expired`, and the receiver's memory is quiet
/// once its state is final.
pub async fn deadline_starts_at_grant(cx: Ctx) -> CaseResult {
    let len = 1 << 20;
    let duo = Arc::new(Duo::new(&cx, len).await?);
    // The path is set up before the first session (a plain write), so its
    // deadline times the session, not a first connection.
    let seg = duo.seg().await?;
    let warm = TransferRequest::write(duo.p.region, 0, seg, duo.d.mem.addr(), 8);
    let warmed = bounded("the warm-up write", duo.p.s.engine().transfer(vec![warm])).await?;
    ensure!(warmed.as_ref().is_ok_and(|o| o.is_success()), "the warm-up write failed: {warmed:?}");
    let before = duo.d.mem.snapshot();
    let all = [part(0, 0, len as u64)];

    let id = 1;
    duo.p.s.expect(&duo.dn, id)?;
    let before_grant = D1 + Duration::from_secs(1);
    tokio::time::sleep(before_grant).await;
    let ks = duo.ks(id);
    ensure!(
        matches!(duo.p.s.state(&ks), Some(SessionState::Waiting)),
        "a sender waiting {before_grant:?} for a grant is {} (rule 12: no deadline before the grant)",
        state_now(&duo.p.s, &ks)
    );
    duo.grant(id, &[(0, len as u64)], D1).await?;
    duo.wait_grant(id).await?;
    duo.write_ok(id, &all, &format!("a write right after a grant with a {D1:?} deadline (rule 12)")).await?;
    duo.finish(id)?;
    duo.both_end(id, "landed", D1 + slack(), &format!("a session granted after the sender waited {before_grant:?}"))
        .await?;
    duo.d.mem.expect(&duo.model(&before, &all), "the landed session")?;
    duo.release(id)?;

    // A stall past the deadline after the grant.
    let id = 2;
    duo.p.s.expect(&duo.dn, id)?;
    let granted_at = Instant::now();
    duo.grant(id, &[(0, len as u64)], D2).await?;
    let got = bounded("wait_grant", duo.p.s.wait_grant(&duo.dn, id)).await?;
    if let Err(e) = got {
        // On a loaded machine the grant can reach the sender after its
        // deadline (ci69): the session expired before a stall could start.
        // The deadline still counted from the grant: both ends expired.
        ensure!(
            e.kind() == ErrorKind::Timeout && granted_at.elapsed() >= D2,
            "the sender's wait_grant of session {id} failed {:?} after the grant: {e}",
            granted_at.elapsed()
        );
        duo.both_end(id, "expired", LIVENESS + slack(), "a session whose grant came after its deadline (rule 12)")
            .await?;
        return duo.release(id);
    }
    cx.stall(&duo.d.node, true).await?;
    let stalled_at = Instant::now();
    let d2 = duo.clone();
    let writer = tokio::spawn(async move { d2.write(id, &[part(len as u64 / 2, 0, len as u64 / 2)]).await });
    tokio::time::sleep(STALL_FOR.saturating_sub(stalled_at.elapsed())).await;
    cx.stall(&duo.d.node, false).await?;
    let r = duo
        .both_end(
            id,
            "expired",
            LIVENESS + slack(),
            &format!("a session stalled for {STALL_FOR:?} right after a grant with a {D2:?} deadline (rule 12)"),
        )
        .await;
    let snap = duo.d.mem.snapshot();
    r?;
    expect_quiet(&duo.d.mem, &snap, QUIET, "the receiver's memory once its session expired (rule 13)").await?;
    let wrote = bounded("the stalled write", writer)
        .await?
        .map_err(|e| CaseError::Fail(format!("the stalled writer panicked: {e}")))??;
    if let Ok(o) = &wrote {
        ensure!(!o.is_success(), "a write stalled past the session's deadline completed");
    }
    duo.release(id)
}
