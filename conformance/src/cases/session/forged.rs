//! Rule 13: late, duplicate and forged messages change nothing.

use super::*;

// ---------------------------------------------------------------------------
// duplicate_and_forged_messages_ignored

fn verdict(outcome: Outcome, kind: ErrorKind) -> Verdict {
    Verdict { outcome, kind, reason: "forged".into() }
}

fn msg(epoch: u64, id: u64, body: Body) -> Vec<u8> {
    Message { epoch, id, body }.encode()
}

/// Well-formed session messages a third node cannot use: invalid grants,
/// and every message that refers to a session it does not have.
fn forged(id: u64, epoch: u64, expected: u64) -> Vec<Vec<u8>> {
    let g = |ranges: Vec<(u64, u64)>, expected: u64, deadline: Duration| Grant { ranges, expected, deadline };
    let second = Duration::from_secs(1);
    [
        Body::Grant(g(vec![], 1, second)),
        Body::Grant(g(vec![(1 << 20, 4096)], 0, second)),
        Body::Grant(g(vec![(1 << 20, 4096)], 8192, second)),
        Body::Grant(g(vec![(1 << 20, 4096)], 4096, Duration::ZERO)),
        Body::Grant(g(vec![(1 << 20, 0)], 1, second)),
        Body::End(verdict(Outcome::Landed, ErrorKind::Internal)),
        Body::End(verdict(Outcome::Cancelled, ErrorKind::Cancelled)),
        Body::End(verdict(Outcome::Failed, ErrorKind::PeerRestarted)),
        Body::End(verdict(Outcome::Expired, ErrorKind::Timeout)),
        Body::Finish { bytes: expected },
        Body::Cancel(verdict(Outcome::Cancelled, ErrorKind::Cancelled)),
        Body::Refuse(verdict(Outcome::Failed, ErrorKind::ResourceExhausted)),
        Body::Quiet,
    ]
    .into_iter()
    .map(|b| msg(epoch, id, b))
    .collect()
}

/// Malformed messages that carry the session magic (each one at least a
/// header long, so it is taken for a session message).
fn garbage(id: u64, epoch: u64) -> Vec<Vec<u8>> {
    let end = msg(epoch, id, Body::End(verdict(Outcome::Cancelled, ErrorKind::Cancelled)));
    let mut out = Vec::new();
    out.push(end[..end.len() - 1].to_vec());
    let mut longer = end.clone();
    longer.push(0);
    out.push(longer);
    for (at, v) in [(4, 2u8), (4, 0), (5, 0), (5, 99), (22, 0), (22, 9)] {
        let mut b = end.clone();
        b[at] = v;
        out.push(b);
    }
    // Reason length past the end; reason not UTF-8.
    let mut b = end.clone();
    b[24..26].copy_from_slice(&500u16.to_le_bytes());
    out.push(b);
    let mut b = msg(
        epoch,
        id,
        Body::End(Verdict { outcome: Outcome::Cancelled, kind: ErrorKind::Cancelled, reason: "ab".into() }),
    );
    let n = b.len();
    b[n - 2..].copy_from_slice(&[0xff, 0xfe]);
    out.push(b);
    // A grant claiming more ranges than fit; a grant whose range overflows.
    let mut b = msg(epoch, id, Body::Grant(Grant { ranges: vec![], expected: 1, deadline: Duration::from_secs(1) }));
    let n = b.len();
    b[n - 2..].copy_from_slice(&((GRANT_RANGES_PER_MESSAGE + 1) as u16).to_le_bytes());
    out.push(b);
    // A grant part numbered past its count; an empty part.
    let mut b = msg(epoch, id, Body::GrantMore { part: 0, parts: 2, ranges: vec![(0, 1)] });
    b[22..24].copy_from_slice(&2u16.to_le_bytes());
    out.push(b);
    let mut b = msg(epoch, id, Body::GrantMore { part: 0, parts: 2, ranges: vec![(0, 1)] });
    let n = b.len();
    b[26..28].copy_from_slice(&0u16.to_le_bytes());
    b.truncate(n - 16);
    out.push(b);
    out.push(msg(
        epoch,
        id,
        Body::Grant(Grant { ranges: vec![(u64::MAX, 2)], expected: 2, deadline: Duration::from_secs(1) }),
    ));
    // A heartbeat with a bad flag; a header alone; magic and noise.
    let mut b = msg(epoch, 0, Body::Heartbeat { reply: true });
    let n = b.len();
    b[n - 1] = 2;
    out.push(b);
    out.push(msg(epoch, id, Body::Quiet)[..22].iter().copied().chain([3u8]).collect());
    let mut noise = MAGIC.to_vec();
    noise.extend(pattern(id ^ epoch, MAX_NOTIFY_LEN - MAGIC.len()));
    out.push(noise);
    out
}

/// Sends `msg` on `t`, retrying (bounded) while the peer's inbox pushes
/// back.
async fn push(t: &Arc<dyn Transport>, seg: SegmentId, msg: Vec<u8>) -> CaseResult {
    for _ in 0..2000 {
        match bounded("notify", t.notify(seg, msg.clone())).await? {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == ErrorKind::Backpressure => tokio::time::sleep(Duration::from_millis(5)).await,
            Err(e) => return Err(CaseError::Fail(format!("notify of a forged message failed: {e}"))),
        }
    }
    Err(CaseError::Fail("the victim's inbox stayed full".into()))
}

pub(super) type Slot = Arc<Mutex<Option<Arc<Tap>>>>;

/// A layer that keeps a copy of every notification its transport hands
/// out (what the session engine above it reads), so a case can replay a
/// peer's real messages and learn its epoch. Everything else passes
/// through.
pub(super) struct Tap {
    inner: Arc<dyn Transport>,
    seen: Mutex<Vec<Notification>>,
}

impl std::fmt::Debug for Tap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tap").field("seen", &self.seen.lock().len()).finish()
    }
}

impl Tap {
    pub(super) fn slot() -> Slot {
        Arc::new(Mutex::new(None))
    }

    pub(super) fn install(slot: &Slot, inner: Arc<dyn Transport>) -> Arc<dyn Transport> {
        let tap = Arc::new(Self { inner, seen: Mutex::default() });
        *slot.lock() = Some(tap.clone());
        tap
    }

    pub(super) fn take(slot: &Slot) -> Result<Arc<Self>, CaseError> {
        slot.lock().take().ok_or_else(|| CaseError::Fail("the tap layer was not installed".into()))
    }

    /// The session messages received from `from` so far, in order.
    pub(super) fn from(&self, from: &str) -> Vec<Vec<u8>> {
        self.seen.lock().iter().filter(|n| n.from == from && decode(&n.msg).is_some()).map(|n| n.msg.clone()).collect()
    }

    /// The epoch of `from`'s session engine, from its messages seen here.
    pub(super) fn epoch(&self, from: &str) -> Option<u64> {
        self.from(from).iter().find_map(|m| decode(m)).map(|m| m.epoch)
    }
}

#[async_trait]
impl Layer for Tap {
    fn inner(&self) -> &Arc<dyn Transport> {
        &self.inner
    }
    fn take_notifications(&self, max: usize) -> TResult<Vec<Notification>> {
        let got = self.inner.take_notifications(max)?;
        self.seen.lock().extend(got.iter().cloned());
        Ok(got)
    }
}

fn ignored(s: &Sessions) -> u64 {
    s.counts().ignored
}

/// A third node `x` sends forged session messages to both sides, with the
/// real session's id and others and any epoch (from `x`, so of no session
/// of its): invalid grants, END, FINISH, CANCEL, REFUSE and QUIET, and
/// malformed bytes, before the grant, during the transfer and after
/// landing. The real peers' own transports replay every session message
/// they exchanged (duplicates, true epochs, learned through a tap layer)
/// mid-transfer and after landing, plus late END / CANCEL / REFUSE / FINISH
/// with other outcomes after landing. Nothing crashes, no state moves
/// backwards (watched throughout), the session lands on both sides with
/// every byte, `counts().ignored` grows on both by at least what `x` sent,
/// `x` opens no session, a plain notification from `x` still arrives, and a
/// second session lands afterwards.
pub async fn duplicate_and_forged_messages_ignored(cx: Ctx) -> CaseResult {
    let half = 512 << 10;
    let (duo, tap_p, tap_d) = Duo::tapped(&cx, 2 * half as usize).await?;
    let x = cx.node(&NodeOptions::default()).await?;
    let (to_p, to_d) = (open(&x, &duo.pn).await?, open(&x, &duo.dn).await?);
    let p_to_d = open(&duo.p.node, &duo.dn).await?;
    let d_to_p = open(&duo.d.node, &duo.pn).await?;
    let x_keys = |id: u64| {
        [SessionKey::new(x.name.clone(), id, Role::Sender), SessionKey::new(x.name.clone(), id, Role::Receiver)]
    };

    let id = 77;
    let (ks, kr) = (duo.ks(id), duo.kr(id));
    let base = (ignored(&duo.p.s), ignored(&duo.d.s));
    let mut sent = 0u64;
    let storm = |epochs: &[u64], sent: &mut u64| {
        let mut v = Vec::new();
        for &epoch in epochs {
            for i in [id, id + 1, 0] {
                v.extend(forged(i, epoch, half));
            }
            v.extend(garbage(id, epoch));
        }
        *sent += v.len() as u64;
        v
    };
    let xt = x.transport.clone();
    let flood = |msgs: Vec<Vec<u8>>| {
        let xt = xt.clone();
        async move {
            for m in msgs {
                push(&xt, to_p, m.clone()).await?;
                push(&xt, to_d, m).await?;
            }
            Ok::<(), CaseError>(())
        }
    };
    let replay = |what: &'static str| {
        let (tap_p, tap_d) = (tap_p.clone(), tap_d.clone());
        let (pt, dt, pn, dn) = (duo.p.t().clone(), duo.d.t().clone(), duo.pn.clone(), duo.dn.clone());
        async move {
            let (to_p, to_d) = (tap_p.from(&dn), tap_d.from(&pn));
            ensure!(!to_p.is_empty() && !to_d.is_empty(), "{what}: the peers exchanged no session message to replay");
            for m in to_p {
                push(&dt, d_to_p, m).await?;
            }
            for m in to_d {
                push(&pt, p_to_d, m).await?;
            }
            Ok::<(), CaseError>(())
        }
    };

    // Before the grant.
    duo.p.s.expect(&duo.dn, id)?;
    let ws = watch(&duo.p.s, &ks, "the sender");
    flood(storm(&[0, u64::MAX, rand::random()], &mut sent)).await?;
    tokio::time::sleep(4 * HEARTBEAT).await;
    ensure!(
        matches!(duo.p.s.state(&ks), Some(SessionState::Waiting)),
        "forged messages moved a waiting sender to {}",
        state_now(&duo.p.s, &ks)
    );
    ensure!(duo.d.s.state(&kr).is_none(), "forged messages made the receiver open session {id}");

    // During the transfer.
    let g = duo.grant(id, &[(0, half), (half, half)], LONG).await?;
    let wr = watch(&duo.d.s, &kr, "the receiver");
    duo.wait_grant(id).await?;
    let before = duo.d.mem.snapshot();
    let parts = [part(0, 0, half), part(half, half, half)];
    let want = duo.model(&before, &parts);
    duo.write_ok(id, &parts[..1], "the first half").await?;
    let learned = settle(ENDS_WITHIN, || tap_p.epoch(&duo.dn).is_some() && tap_d.epoch(&duo.pn).is_some()).await;
    ensure!(learned, "no session message between the peers was seen (a heartbeat or the grant)");
    let (ep, ed) = (tap_d.epoch(&duo.pn).unwrap_or(0), tap_p.epoch(&duo.dn).unwrap_or(0));
    flood(storm(&[ep, ed, 1], &mut sent)).await?;
    replay("mid-transfer").await?;
    push(duo.p.t(), p_to_d, msg(ep, id, Body::Quiet)).await?;
    tokio::time::sleep(4 * HEARTBEAT).await;
    ensure!(
        matches!(duo.p.s.state(&ks), Some(SessionState::Transferring)),
        "forged or duplicate messages moved a transferring sender to {}",
        state_now(&duo.p.s, &ks)
    );
    ensure!(
        matches!(duo.d.s.state(&kr), Some(SessionState::Granted)),
        "forged or duplicate messages moved a receiver mid-transfer to {}",
        state_now(&duo.d.s, &kr)
    );
    duo.write_ok(id, &parts[1..], "the second half").await?;
    duo.finish(id)?;
    duo.both_end(id, "landed", ENDS_WITHIN, "a session under forged and duplicate messages").await?;
    duo.d.mem.expect(&want, "the landed session")?;

    // After landing: forged; every real message again; late ones.
    flood(storm(&[ep, ed], &mut sent)).await?;
    replay("after landing").await?;
    let late_to_p = [
        Body::Grant(g.clone()),
        Body::End(verdict(Outcome::Cancelled, ErrorKind::Cancelled)),
        Body::End(verdict(Outcome::Expired, ErrorKind::Timeout)),
        Body::End(verdict(Outcome::Failed, ErrorKind::PeerUnavailable)),
    ];
    for b in late_to_p {
        push(duo.d.t(), d_to_p, msg(ed, id, b)).await?;
    }
    let late_to_d = [
        Body::Finish { bytes: 1 },
        Body::Quiet,
        Body::Cancel(verdict(Outcome::Cancelled, ErrorKind::Cancelled)),
        Body::Refuse(verdict(Outcome::Cancelled, ErrorKind::Cancelled)),
    ];
    for b in late_to_d {
        push(duo.p.t(), p_to_d, msg(ep, id, b)).await?;
    }
    let plain = b"a plain notification, not a session message".to_vec();
    push(&xt, to_d, plain.clone()).await?;

    let want_ignored = (base.0 + sent, base.1 + sent);
    let grew = settle(ENDS_WITHIN, || ignored(&duo.p.s) >= want_ignored.0 && ignored(&duo.d.s) >= want_ignored.1).await;
    ensure!(
        grew,
        "counts().ignored is {} on the sender and {} on the receiver after {sent} forged or malformed messages to \
         each (from {} and {})",
        ignored(&duo.p.s),
        ignored(&duo.d.s),
        base.0,
        base.1
    );
    tokio::time::sleep(4 * HEARTBEAT).await;
    for (who, s, k) in [("sender", &duo.p.s, &ks), ("receiver", &duo.d.s, &kr)] {
        ensure!(
            matches!(s.state(k), Some(SessionState::Landed)),
            "late, duplicate or forged messages moved the landed {who} to {} (rule 13)",
            state_now(s, k)
        );
    }
    duo.d.mem.expect(&want, "the landed session after late messages")?;
    bounded("a plain notification", duo.d.s.wait_notification()).await??;
    let got = duo.d.s.take_notifications(16);
    ensure!(
        got.len() == 1 && got[0].msg == plain && got[0].from == x.name,
        "the receiver's plain inbox holds {} notification(s) after forged traffic; expected the one plain message",
        got.len()
    );
    let (seen_p, seen_r) = (ws.end().await?, wr.end().await?);
    ensure!(
        seen_p.last() == Some(&"landed") && seen_r.last() == Some(&"landed"),
        "states seen: {seen_p:?}, {seen_r:?}"
    );

    // Both engines still work.
    let id2 = id + 1000;
    duo.p.s.expect(&duo.dn, id2)?;
    duo.grant(id2, &[(0, half)], LONG).await?;
    duo.wait_grant(id2).await?;
    duo.write_ok(id2, &[part(half, 0, half)], "a session after the forgery").await?;
    duo.finish(id2)?;
    duo.both_end(id2, "landed", ENDS_WITHIN, "a session after the forgery").await?;
    duo.release(id)?;
    duo.release(id2)?;
    for k in x_keys(id).iter().chain(&x_keys(id + 1)).chain(&x_keys(0)) {
        ensure!(
            duo.p.s.state(k).is_none() && duo.d.s.state(k).is_none(),
            "forged messages from {} opened a session {k:?}",
            x.name
        );
    }
    duo.expect_no_sessions("after release")
}
