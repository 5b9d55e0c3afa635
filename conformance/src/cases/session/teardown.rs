//! Rules 1 and 13: session and inbox counts return to their baseline
//! after teardown.

use super::*;

// ---------------------------------------------------------------------------
// counts_return_after_teardown

const SESSIONS: u64 = 50;
const SLOT: u64 = 64 << 10;

/// The transport counts sessions may change while they run.
fn session_stats(s: &ResourceStats) -> (usize, usize, usize, usize) {
    (s.segments, s.batches, s.inflight, s.notifications)
}

async fn expect_session_stats(t: &Arc<dyn Transport>, base: &ResourceStats, segments: bool, what: &str) -> CaseResult {
    let want = |s: &ResourceStats| {
        let (a, b) = (session_stats(s), session_stats(base));
        (!segments || a.0 == b.0) && a.1 == b.1 && a.2 == b.2 && a.3 == b.3
    };
    let ok = settle(SETTLE, || want(&t.stats())).await;
    ensure!(
        ok,
        "{what}: (segments, batches, inflight, notifications) = {:?}, {:?} before the sessions (rule 13: counts \
         return to baseline)",
        session_stats(&t.stats()),
        session_stats(base)
    );
    Ok(())
}

/// Fifty sessions granted, written and finished concurrently, all landed
/// with their bytes; fifteen cancelled (by the sender before its grant, by
/// the receiver after it, by the sender mid-way). After release: no open or
/// lingering session and no tracked peer on either side, transport
/// batches, requests in flight and notifications at their baseline; after
/// `Sessions::shutdown`, segments too.
pub async fn counts_return_after_teardown(cx: Ctx) -> CaseResult {
    let slots = SESSIONS + 15;
    let duo = Duo::new(&cx, (slots * SLOT) as usize).await?;
    let zero = SessionCounts::default();
    ensure!(duo.p.s.counts() == zero && duo.d.s.counts() == zero, "new session engines count {:?}", duo.p.s.counts());
    let before = duo.d.mem.snapshot();

    let ids: Vec<u64> = (0..SESSIONS).collect();
    for &id in &ids {
        duo.p.s.expect(&duo.dn, id)?;
        duo.grant(id, &[(id * SLOT, SLOT)], LONG).await?;
    }
    let c = duo.p.s.counts();
    ensure!(c.open == SESSIONS as usize && c.peers == 1, "with {SESSIONS} sessions the sender counts {c:?}");
    let runs = ids.iter().map(|&id| {
        let duo = &duo;
        async move {
            duo.wait_grant(id).await?;
            duo.write_ok(id, &[part(id * SLOT, id * SLOT, SLOT)], &format!("session {id}")).await?;
            duo.finish(id)?;
            duo.both_end(id, "landed", ENDS_WITHIN, &format!("session {id} of {SESSIONS}")).await
        }
    });
    for r in join_all(runs).await {
        r?;
    }
    let parts: Vec<Part> = ids.iter().map(|&id| part(id * SLOT, id * SLOT, SLOT)).collect();
    duo.d.mem.expect(&duo.model(&before, &parts), &format!("{SESSIONS} landed sessions"))?;

    let mut cancelled = Vec::new();
    for k in 0..5 {
        // The sender cancels before its grant; the grant comes later.
        let id = SESSIONS + k;
        duo.p.s.expect(&duo.dn, id)?;
        bounded("cancel", duo.p.s.cancel(&duo.ks(id))).await??;
        duo.grant(id, &[(id * SLOT, SLOT)], LONG).await?;
        cancelled.push(id);
        // The receiver cancels after its grant.
        let id = SESSIONS + 5 + k;
        duo.p.s.expect(&duo.dn, id)?;
        duo.grant(id, &[(id * SLOT, SLOT)], LONG).await?;
        duo.wait_grant(id).await?;
        bounded("cancel", duo.d.s.cancel(&duo.kr(id))).await??;
        cancelled.push(id);
        // The sender cancels after a write.
        let id = SESSIONS + 10 + k;
        duo.p.s.expect(&duo.dn, id)?;
        duo.grant(id, &[(id * SLOT, SLOT)], LONG).await?;
        duo.wait_grant(id).await?;
        duo.write_ok(id, &[part(id * SLOT, id * SLOT, SLOT / 2)], &format!("session {id}")).await?;
        bounded("cancel", duo.p.s.cancel(&duo.ks(id))).await??;
        cancelled.push(id);
    }
    for &id in &cancelled {
        duo.both_end(id, "cancelled", ENDS_WITHIN, &format!("cancelled session {id}")).await?;
    }
    for id in ids.iter().chain(&cancelled) {
        duo.release(*id)?;
    }
    duo.expect_no_sessions(&format!("after releasing {} sessions", SESSIONS + 15))?;
    duo.expect_inboxes_empty("after release").await?;
    for (who, side) in [("sender", &duo.p), ("receiver", &duo.d)] {
        expect_session_stats(side.t(), &side.base, false, &format!("the {who}'s transport after release")).await?;
        let n = side.s.engine().active_transfers();
        ensure!(n == 0, "the {who}'s engine still has {n} transfer(s) after every session ended");
    }

    for side in [&duo.p, &duo.d] {
        bounded("Sessions::shutdown", side.s.shutdown()).await?;
    }
    for (who, side) in [("sender", &duo.p), ("receiver", &duo.d)] {
        let what = format!("the {who}'s transport after Sessions::shutdown");
        // The peer's last words (a heartbeat's answer, an END) may land after
        // this side stopped reading: the transport keeps them as it keeps any
        // notification nobody took. They are taken here; every one must be a
        // session message (no plain notification was sent).
        let t = side.t();
        let mut strays = Vec::new();
        settle(SETTLE, || {
            strays.extend(t.take_notifications(64).unwrap_or_default());
            t.stats().notifications == 0
        })
        .await;
        // Last words only: a few, each a heartbeat (one sent while the last
        // sessions were open may still be on its way) or a message that
        // ends an exchange (END, QUIET, CONFIRM, REFUSE), never one that
        // starts a new exchange (GRANT, FINISH, CANCEL, CHECK).
        ensure!(strays.len() <= 8, "{what}: {} notifications arrived after it (a sender kept going?)", strays.len());
        for n in &strays {
            let parts = unbundle(&n.msg).unwrap_or_default();
            let bodies: Vec<Option<Body>> = parts.iter().map(|p| decode(p).map(|m| m.body)).collect();
            let last_words = !bodies.is_empty()
                && bodies.iter().all(|b| {
                    matches!(
                        b,
                        Some(
                            Body::Heartbeat { .. }
                                | Body::End(_)
                                | Body::Quiet
                                | Body::Confirm { .. }
                                | Body::Refuse(_)
                        )
                    )
                });
            ensure!(last_words, "{what}: a notification other than a session's last words was left: {bodies:?}");
        }
        expect_session_stats(t, &side.base, true, &what).await?;
    }
    Ok(())
}
