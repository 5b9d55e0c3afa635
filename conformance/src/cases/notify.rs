//! Notifications (rule 11): a notification attached to a batch never
//! overtakes the batch's bytes and is never sent for a batch that did not
//! complete; per pair of transports notifications arrive in order, intact
//! and named by their sender; the inbox is bounded (a full one pushes back
//! with a transient `Backpressure`), counted, and emptied by shutdown.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use transport_core::{
    Access, BatchState, BatchStatus, Error, ErrorKind, Notification, ResourceStats, Result as TResult, SegmentId,
    SubmitOptions, TransferRequest, Transport, MAX_NOTIFY_LEN,
};

use crate::ctx::{bounded, complete, expect_kind, expect_permanent, expect_stats, open, wait_batch, Ctx, Pair};
use crate::ensure;
use crate::guard::{first_difference, pattern};
use crate::harness::{Node, NodeOptions};
use crate::outcome::{CaseError, CaseResult};

/// How long a receiver waits before it decides nothing more will arrive.
const QUIET: Duration = Duration::from_millis(300);

/// Waits (bounded) for the next notifications of `t` and takes them.
async fn next_notifications(t: &Arc<dyn Transport>, what: &str) -> Result<Vec<Notification>, CaseError> {
    loop {
        bounded(what, t.wait_notification())
            .await?
            .map_err(|e| CaseError::Fail(format!("{what}: wait_notification failed: {e}")))?;
        let got = t.take_notifications(64).map_err(|e| CaseError::Fail(format!("{what}: take failed: {e}")))?;
        if !got.is_empty() {
            return Ok(got);
        }
    }
}

/// Takes notifications of `t` until `n` have arrived (bounded), then
/// checks that no more come within [`QUIET`].
async fn collect(t: Arc<dyn Transport>, n: usize, what: String) -> Result<Vec<Notification>, CaseError> {
    let mut got = Vec::with_capacity(n);
    while got.len() < n {
        got.extend(next_notifications(&t, &what).await?);
    }
    tokio::time::sleep(QUIET).await;
    got.extend(t.take_notifications(n + 1)?);
    ensure!(got.len() == n, "{what}: {} notifications arrived, {n} were sent", got.len());
    Ok(got)
}

/// Sends `msg`, retrying (bounded) while the peer's inbox pushes back.
async fn send(t: &Arc<dyn Transport>, seg: SegmentId, msg: Vec<u8>, what: &str) -> CaseResult {
    for _ in 0..2000 {
        match bounded(what, t.notify(seg, msg.clone())).await? {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == ErrorKind::Backpressure => {
                ensure!(e.is_transient(), "{what}: Backpressure {e} must be transient (rule 7)");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Err(e) => return Err(CaseError::Fail(format!("{what}: notify failed: {e}"))),
        }
    }
    Err(CaseError::Fail(format!("{what}: the peer's inbox stayed full while it was being drained")))
}

/// Requires that `t` holds no notification, counted or taken.
fn expect_empty_inbox(t: &Arc<dyn Transport>, what: &str) -> CaseResult {
    let counted = t.stats().notifications;
    let taken = t.take_notifications(1 << 16)?;
    ensure!(
        counted == 0 && taken.is_empty(),
        "{what}: the receiver holds {counted} notification(s) ({} taken: {:?}), expected none",
        taken.len(),
        taken.iter().map(|n| String::from_utf8_lossy(&n.msg).into_owned()).collect::<Vec<_>>()
    );
    Ok(())
}

/// Requires exactly one notification from `from` with `msg`.
fn expect_one(got: &[Notification], from: &str, msg: &[u8], what: &str) -> CaseResult {
    ensure!(got.len() == 1, "{what}: {} notifications arrived, expected one", got.len());
    ensure!(got[0].from == from, "{what}: the notification says it is from {:?}, the sender is {from:?}", got[0].from);
    ensure!(
        got[0].msg == msg,
        "{what}: the message arrived as {} bytes (first difference at {:?}), {} were sent",
        got[0].msg.len(),
        first_difference(&got[0].msg, msg),
        msg.len()
    );
    Ok(())
}

// ---------------------------------------------------------------------------
// never_overtakes_data

const ROUNDS: u64 = 4;
const LARGE: u64 = 64;
const CHUNK: u64 = 256 << 10;
const SMALL: u64 = 192;
/// Slot of one small request (each is at most 500 bytes at an offset < 12).
const SLOT: u64 = 512;
/// The background load's area, after the batch's.
const BACKGROUND: u64 = 1 << 20;

/// Where the attached batch writes: (offset, len), the same offset on both
/// sides. `large` requests of `chunk` bytes, then `small` short ones at odd
/// offsets with gaps between them (which must never change).
fn layout(large: u64, chunk: u64, small: u64) -> (Vec<(u64, u64)>, u64) {
    let mut out: Vec<(u64, u64)> = (0..large).map(|i| (i * chunk, chunk)).collect();
    let base = large * chunk;
    out.extend((0..small).map(|j| (base + j * SLOT + j % 11, 1 + (j * 97) % 500)));
    (out, base + small * SLOT)
}

/// The bytes the sender puts into its source area in `round`.
fn source(round: u64, len: u64) -> Vec<u8> {
    pattern(1000 + round, len as usize)
}

/// The receiver's side of `never_overtakes_data`: for each round, waits for
/// the notification and, the moment it has it, requires every byte of that
/// round's batch in its memory (and the gaps unchanged). Acks each round.
async fn receive_rounds(
    t: Arc<dyn Transport>,
    from: String,
    p: Arc<Pair>,
    reqs: Vec<(u64, u64)>,
    area: u64,
    acks: mpsc::Sender<u64>,
) -> CaseResult {
    let mut model = p.remote.snapshot()[..area as usize].to_vec();
    for round in 0..ROUNDS {
        let src = source(round, area);
        for &(off, len) in &reqs {
            let r = off as usize..(off + len) as usize;
            model[r.clone()].copy_from_slice(&src[r]);
        }
        let what = format!("round {round}: the receiver");
        let got = next_notifications(&t, &what).await?;
        // The moment the notification is seen: the batch must have landed.
        let now = p.remote.snapshot();
        expect_one(&got, &from, format!("round {round}").as_bytes(), &what)?;
        let now = &now[..area as usize];
        if now != model.as_slice() {
            let at = first_difference(now, &model).unwrap_or(0) as u64;
            let req = reqs.iter().position(|&(o, l)| (o..o + l).contains(&at));
            return Err(CaseError::Fail(format!(
                "round {round}: the notification attached to the batch arrived before its bytes \
                 (rule 11): byte {at} (request {req:?} of {}) is {:#04x}, the batch wrote {:#04x}",
                reqs.len(),
                now[at as usize],
                model[at as usize]
            )));
        }
        p.remote.canaries_intact()?;
        if acks.send(round).await.is_err() {
            return Ok(());
        }
    }
    Ok(())
}

/// Writes to the background area from `a` until `stop`, in batches of
/// four, at most 2000 of them.
async fn background(p: Arc<Pair>, from: u64, stop: Arc<AtomicBool>) -> Result<u64, CaseError> {
    let q = BACKGROUND / 4;
    let mut n = 0;
    while !stop.load(Ordering::SeqCst) && n < 2000 {
        let reqs = (0..4).map(|k| p.write(from + k * q, from + k * q, q)).collect();
        complete(p.t(), reqs).await?;
        n += 1;
    }
    Ok(n)
}

/// A batch of 64 writes of 256 KiB and 192 short ones (distinct bytes each
/// round, spread over every lane) with a notification attached by
/// `notify_after`, four rounds, under a concurrent background load to the
/// same peer. The receiver, the moment it sees each notification, finds
/// every byte of that batch already in its memory.
pub async fn never_overtakes_data(cx: Ctx) -> CaseResult {
    let a = cx.node(&NodeOptions::default()).await?;
    let b = cx.node(&NodeOptions::default()).await?;
    let caps = a.transport.capabilities();
    let large = LARGE.min(caps.max_batch_len as u64 / 2).max(1);
    let small = SMALL.min((caps.max_batch_len as u64).saturating_sub(large));
    let chunk = CHUNK.min(caps.max_request_len);
    let (reqs, area) = layout(large, chunk, small);
    let p = Arc::new(cx.pair_between(a, b, (area + BACKGROUND) as usize).await?);
    let t = p.t().clone();
    let from = t.local_segment_name();

    let (ack_tx, mut ack_rx) = mpsc::channel(1);
    let receiver = tokio::spawn(receive_rounds(p.b.transport.clone(), from, p.clone(), reqs.clone(), area, ack_tx));
    let stop = Arc::new(AtomicBool::new(false));
    let load = tokio::spawn(background(p.clone(), area, stop.clone()));

    let sent = async {
        for round in 0..ROUNDS {
            p.local.write(0, &source(round, area))?;
            let batch_reqs = reqs.iter().map(|&(off, len)| p.write(off, off, len)).collect();
            let batch = bounded("submit", t.submit(batch_reqs, SubmitOptions::default())).await??;
            let msg = format!("round {round}").into_bytes();
            let (status, note) = bounded("notify_after", t.notify_after(batch, p.seg, msg))
                .await?
                .map_err(|e| CaseError::Fail(format!("round {round}: notify_after failed: {e}")))?;
            ensure!(status.is_terminal(), "round {round}: notify_after returned a non-terminal {:?}", status.state);
            t.release(batch)?;
            ensure!(
                status.state == BatchState::Completed,
                "round {round}: the batch ended {:?} ({:?})",
                status.state,
                status.first_error().map(ToString::to_string)
            );
            match note {
                Some(Ok(())) => {}
                Some(Err(e)) => return Err(CaseError::Fail(format!("round {round}: the notification failed: {e}"))),
                None => return Err(CaseError::Fail(format!("round {round}: a completed batch sent no notification"))),
            }
            match bounded("the receiver's check", ack_rx.recv()).await? {
                Some(r) if r == round => {}
                // The receiver stopped: its result says why.
                _ => return Ok(()),
            }
        }
        Ok::<(), CaseError>(())
    }
    .await;
    stop.store(true, Ordering::SeqCst);
    drop(ack_rx);
    if sent.is_err() {
        // The receiver may still wait for a notification that never comes.
        receiver.abort();
    }
    let received = bounded("the receiver", receiver).await?;
    let loaded = bounded("the background load", load).await?;
    match received {
        Ok(r) => r?,
        Err(e) if e.is_cancelled() => {}
        Err(e) => return Err(CaseError::Fail(format!("the receiver panicked: {e}"))),
    }
    sent?;
    let n = loaded.map_err(|e| CaseError::Fail(format!("the background load panicked: {e}")))??;
    ensure!(n > 0, "the background load ran no batch");
    p.canaries_intact()
}

// ---------------------------------------------------------------------------
// per_pair_order

const ORDERED: u32 = 200;

/// Message `i` of sender `tag`: the tag, the index, then 0 to 599 bytes.
fn numbered(tag: u8, i: u32) -> Vec<u8> {
    let mut m = vec![tag];
    m.extend_from_slice(&i.to_le_bytes());
    m.extend(pattern(u64::from(tag) << 32 | u64::from(i), (i as usize * 131) % 600));
    m
}

/// Sends [`ORDERED`] numbered messages, one after another.
async fn send_numbered(t: Arc<dyn Transport>, seg: SegmentId, tag: u8) -> CaseResult {
    for i in 0..ORDERED {
        send(&t, seg, numbered(tag, i), &format!("sender {tag}, message {i}")).await?;
    }
    Ok(())
}

/// Requires the notifications from `from` in `got` to be exactly the
/// numbered messages of `tag`, in order.
fn expect_in_order(got: &[Notification], from: &str, tag: u8, what: &str) -> CaseResult {
    let mine: Vec<&Notification> = got.iter().filter(|n| n.msg.first() == Some(&tag)).collect();
    ensure!(mine.len() == ORDERED as usize, "{what}: {} of sender {tag}'s {ORDERED} messages arrived", mine.len());
    for (i, n) in mine.iter().enumerate() {
        ensure!(n.from == from, "{what}: message {i} says it is from {:?}, the sender is {from:?}", n.from);
        let expected = numbered(tag, i as u32);
        if n.msg != expected {
            let idx = n.msg.get(1..5).and_then(|b| b.try_into().ok()).map(u32::from_le_bytes);
            return Err(CaseError::Fail(format!(
                "{what}: arrival {i} of sender {tag} is {} bytes claiming index {idx:?}, expected message {i} \
                 ({} bytes): out of order or corrupted (rule 11)",
                n.msg.len(),
                expected.len()
            )));
        }
    }
    Ok(())
}

/// 200 sequential notifications from A to B arrive in order, byte-exact,
/// each naming A; then A and C send 200 each at once and each sender's own
/// order holds.
pub async fn per_pair_order(cx: Ctx) -> CaseResult {
    let opts = NodeOptions::default();
    let a = cx.node(&opts).await?;
    let b = cx.node(&opts).await?;
    let c = cx.node(&opts).await?;
    let sa = open(&a, &b.name).await?;
    let sc = open(&c, &b.name).await?;
    let (an, cn) = (a.transport.local_segment_name(), c.transport.local_segment_name());

    let rx = tokio::spawn(collect(b.transport.clone(), ORDERED as usize, "one sender".into()));
    send_numbered(a.transport.clone(), sa, 1).await?;
    let got = bounded("the receiver", rx).await?.map_err(|e| CaseError::Fail(format!("receiver panicked: {e}")))??;
    expect_in_order(&got, &an, 1, "one sender")?;

    let rx = tokio::spawn(collect(b.transport.clone(), 2 * ORDERED as usize, "two senders".into()));
    let ta = tokio::spawn(send_numbered(a.transport.clone(), sa, 2));
    let tc = tokio::spawn(send_numbered(c.transport.clone(), sc, 3));
    for s in [ta, tc] {
        bounded("a sender", s).await?.map_err(|e| CaseError::Fail(format!("sender panicked: {e}")))??;
    }
    let got = bounded("the receiver", rx).await?.map_err(|e| CaseError::Fail(format!("receiver panicked: {e}")))??;
    expect_in_order(&got, &an, 2, "two senders")?;
    expect_in_order(&got, &cn, 3, "two senders")?;
    Ok(())
}

// ---------------------------------------------------------------------------
// failed_batch_never_notifies

/// `notify_after` on a batch that must not complete: a non-completed
/// terminal status and no notification (`None`).
fn expect_not_sent(r: TResult<(BatchStatus, Option<TResult<()>>)>, what: &str) -> Result<BatchState, CaseError> {
    let (status, note) = r.map_err(|e| CaseError::Fail(format!("{what}: notify_after failed: {e}")))?;
    ensure!(status.is_terminal(), "{what}: notify_after returned a non-terminal {:?}", status.state);
    ensure!(
        status.state != BatchState::Completed,
        "{what}: the batch completed, so this check could not run (requests {:?})",
        status.requests
    );
    ensure!(
        note.is_none(),
        "{what}: notify_after sent a notification for a batch that ended {:?} ({note:?}); a failed batch \
         never notifies (rule 11)",
        status.state
    );
    Ok(status.state)
}

/// A batch that fails (a write into a peer region unregistered after the
/// open, next to a good one), times out or is cancelled (traffic stalled):
/// `notify_after` returns its non-completed status and `None`, and the
/// receiver gets nothing (inbox and `stats().notifications` checked after a
/// settle time). Then a completed batch does notify.
pub async fn failed_batch_never_notifies(cx: Ctx) -> CaseResult {
    const LEN: usize = 1 << 20;
    let p = cx.pair(LEN).await?;
    let t = p.t().clone();
    let b = p.b.transport.clone();
    let mut ran: Vec<String> = Vec::new();
    let mut not_run: Vec<String> = Vec::new();

    // A write into a peer region that was unregistered after the open.
    let gone = cx.guarded(64 << 10, 9)?;
    let gone_id = b.register(gone.region(), Access::REMOTE_RW)?;
    let seg = open(&p.a, &p.b.name).await?;
    bounded("unregister", b.unregister(gone_id)).await??;
    let reqs = vec![p.write(0, 0, 4096), TransferRequest::write(p.local_id, 0, seg, gone.addr(), 4096)];
    match bounded("submit", t.submit(reqs, SubmitOptions::default())).await? {
        Err(e) => not_run.push(format!("a write into an unregistered peer region was refused at submit ({e})")),
        Ok(batch) => {
            let r = bounded("notify_after", t.notify_after(batch, seg, b"failed".to_vec())).await?;
            let state = expect_not_sent(r, "a write into an unregistered peer region")?;
            t.release(batch)?;
            ran.push(format!("failed ({state:?})"));
        }
    }

    // Timed out and cancelled, with traffic toward the peer stalled.
    match cx.stall(&p.b, true).await {
        Err(CaseError::Skip(why)) => not_run.push(why),
        Err(e) => return Err(e),
        Ok(()) => {
            let stalled = async {
                let opts = SubmitOptions::with_timeout(Duration::from_millis(200));
                let batch = bounded("submit", t.submit(vec![p.write(0, 0, LEN as u64)], opts)).await??;
                let r = bounded("notify_after", t.notify_after(batch, p.seg, b"timed out".to_vec())).await?;
                let state = expect_not_sent(r, "a stalled batch with a deadline")?;
                t.release(batch)?;
                ran.push(format!("timed out ({state:?})"));

                let batch =
                    bounded("submit", t.submit(vec![p.write(0, 0, LEN as u64)], SubmitOptions::default())).await??;
                let t2 = t.clone();
                let seg = p.seg;
                let waiter = tokio::spawn(async move { t2.notify_after(batch, seg, b"cancelled".to_vec()).await });
                tokio::time::sleep(Duration::from_millis(50)).await;
                bounded("cancel", t.cancel(batch)).await??;
                let r = bounded("notify_after on a cancelled batch", waiter)
                    .await?
                    .map_err(|e| CaseError::Fail(format!("notify_after panicked: {e}")))?;
                let state = expect_not_sent(r, "a cancelled batch")?;
                t.release(batch)?;
                ran.push(format!("cancelled ({state:?})"));
                Ok::<(), CaseError>(())
            }
            .await;
            cx.stall(&p.b, false).await?;
            stalled?;
        }
    }

    if ran.is_empty() {
        return Err(CaseError::Skip(format!("no batch could be made to fail: {}", not_run.join("; "))));
    }
    tokio::time::sleep(QUIET).await;
    expect_empty_inbox(&b, &format!("after batches that did not complete ({})", ran.join(", ")))?;

    // The control: a completed batch notifies.
    let batch = bounded("submit", t.submit(vec![p.write(0, 0, 4096)], SubmitOptions::default())).await??;
    let (status, note) = bounded("notify_after", t.notify_after(batch, p.seg, b"completed".to_vec())).await??;
    t.release(batch)?;
    ensure!(status.state == BatchState::Completed, "a good batch after the failed ones ended {:?}", status.state);
    ensure!(matches!(note, Some(Ok(()))), "a completed batch's notification: {note:?}");
    let got = next_notifications(&b, "the completed batch's notification").await?;
    expect_one(&got, &t.local_segment_name(), b"completed", "the completed batch's notification")
}

// ---------------------------------------------------------------------------
// inbox_bounded

const CAPACITY: usize = 8;

fn short(i: usize) -> Vec<u8> {
    format!("message {i}").into_bytes()
}

/// Sends one notification that must be accepted; the receiver then holds
/// `holds`.
async fn accepted(a: &Node, seg: SegmentId, b: &Node, i: usize, holds: usize, what: &str) -> CaseResult {
    bounded("notify", a.transport.notify(seg, short(i)))
        .await?
        .map_err(|e| CaseError::Fail(format!("{what}: notify {i} failed: {e}")))?;
    let n = b.transport.stats().notifications;
    ensure!(n == holds, "{what}: after notify {i} returned, the receiver counts {n} notifications, expected {holds}");
    Ok(())
}

/// Sends one notification into a full inbox: a transient `Backpressure`,
/// and the receiver still holds exactly its capacity.
async fn refused_full(a: &Node, seg: SegmentId, b: &Node, i: usize) -> CaseResult {
    let what = format!("notify {i} into a full inbox of capacity {CAPACITY}");
    let e =
        expect_kind(bounded("notify", a.transport.notify(seg, short(i))).await?, &[ErrorKind::Backpressure], &what)?;
    ensure!(e.is_transient(), "{what}: {e} must be transient (rule 7)");
    let n = b.transport.stats().notifications;
    ensure!(n == CAPACITY, "{what}: the receiver counts {n} notifications, its capacity is {CAPACITY}");
    Ok(())
}

/// A receiver with an inbox of 8 that does not drain: 8 notifications are
/// accepted, the next ones fail with a transient `Backpressure` and are not
/// queued; taking one makes room for exactly one; draining brings the count
/// to 0 and notify works again. `stats().notifications` follows exactly and
/// never passes the capacity.
pub async fn inbox_bounded(cx: Ctx) -> CaseResult {
    let opts = NodeOptions::default();
    let b = cx.node_with_inbox(&opts, CAPACITY).await?;
    let a = cx.node(&opts).await?;
    let seg = open(&a, &b.name).await?;
    let from = a.transport.local_segment_name();
    ensure!(b.transport.stats().notifications == 0, "a new node counts {:?}", b.transport.stats());

    for i in 0..CAPACITY {
        accepted(&a, seg, &b, i, i + 1, "filling the inbox").await?;
    }
    for i in 100..103 {
        refused_full(&a, seg, &b, i).await?;
    }
    bounded("wait_notification with a full inbox", b.transport.wait_notification()).await??;
    let first = b.transport.take_notifications(1)?;
    expect_one(&first, &from, &short(0), "the oldest notification")?;
    let n = b.transport.stats().notifications;
    ensure!(n == CAPACITY - 1, "after taking one of {CAPACITY}, the receiver counts {n}");
    accepted(&a, seg, &b, CAPACITY, CAPACITY, "after taking one").await?;
    refused_full(&a, seg, &b, 103).await?;

    let rest = b.transport.take_notifications(1 << 16)?;
    let got: Vec<String> = rest.iter().map(|n| String::from_utf8_lossy(&n.msg).into_owned()).collect();
    let want: Vec<String> = (1..=CAPACITY).map(|i| String::from_utf8_lossy(&short(i)).into_owned()).collect();
    ensure!(got == want, "the drained inbox holds {got:?}, expected {want:?} (refused ones must not be queued)");
    ensure!(rest.iter().all(|n| n.from == from), "a drained notification names the wrong sender");
    let n = b.transport.stats().notifications;
    ensure!(n == 0, "after draining, the receiver counts {n} notifications");

    accepted(&a, seg, &b, 200, 1, "after draining").await?;
    let again = b.transport.take_notifications(16)?;
    expect_one(&again, &from, &short(200), "after draining")?;
    expect_empty_inbox(&b.transport, "at the end")
}

// ---------------------------------------------------------------------------
// oversize_refused

/// `MAX_NOTIFY_LEN + 1` bytes are refused with a permanent
/// `InvalidRequest`, by `notify` and by `notify_after`, and nothing is
/// delivered; exactly `MAX_NOTIFY_LEN` bytes and an empty message arrive
/// intact.
pub async fn oversize_refused(cx: Ctx) -> CaseResult {
    let p = cx.pair(64 << 10).await?;
    let t = p.t().clone();
    let b = p.b.transport.clone();
    let big = pattern(77, MAX_NOTIFY_LEN + 1);
    expect_permanent(
        bounded("notify", t.notify(p.seg, big.clone())).await?,
        &[ErrorKind::InvalidRequest],
        "notify of MAX_NOTIFY_LEN + 1 bytes",
    )?;

    let batch = bounded("submit", t.submit(vec![p.write(0, 0, 4096)], SubmitOptions::default())).await??;
    let what = "notify_after with MAX_NOTIFY_LEN + 1 bytes";
    match bounded("notify_after", t.notify_after(batch, p.seg, big)).await? {
        Err(e) => refused_oversize(&e, what)?,
        Ok((_, Some(Err(e)))) => refused_oversize(&e, what)?,
        Ok((s, note)) => {
            return Err(CaseError::Fail(format!("{what}: not refused (batch {:?}, notification {note:?})", s.state)))
        }
    }
    let s = wait_batch(t.as_ref(), batch, None, "wait").await??;
    ensure!(s.is_terminal(), "wait returned {:?}", s.state);
    t.release(batch)?;
    tokio::time::sleep(QUIET).await;
    expect_empty_inbox(&b, "after oversize notifications")?;

    let max = pattern(78, MAX_NOTIFY_LEN);
    let from = t.local_segment_name();
    bounded("notify", t.notify(p.seg, max.clone())).await?.map_err(|e| {
        CaseError::Fail(format!("notify of exactly MAX_NOTIFY_LEN ({MAX_NOTIFY_LEN}) bytes failed: {e}"))
    })?;
    let got = next_notifications(&b, "a notification of MAX_NOTIFY_LEN bytes").await?;
    expect_one(&got, &from, &max, "a notification of MAX_NOTIFY_LEN bytes")?;
    bounded("notify", t.notify(p.seg, Vec::new()))
        .await?
        .map_err(|e| CaseError::Fail(format!("notify of an empty message failed: {e}")))?;
    let got = next_notifications(&b, "an empty notification").await?;
    expect_one(&got, &from, &[], "an empty notification")?;
    expect_empty_inbox(&b, "at the end")
}

fn refused_oversize(e: &Error, what: &str) -> CaseResult {
    ensure!(e.kind() == ErrorKind::InvalidRequest, "{what}: expected InvalidRequest, got {e}");
    ensure!(!e.is_transient(), "{what}: {e} must be permanent (rule 7)");
    Ok(())
}

// ---------------------------------------------------------------------------
// counts_return_after_shutdown

/// Notifications are counted while queued and the counts return to their
/// baseline once taken; shutdown empties the inbox (counts zero), wakes a
/// pending `wait_notification` with `Shutdown`, and later
/// `wait_notification` / `take_notifications` are `Shutdown` at once; a
/// notify to the shut-down peer is a transient error, never a hang.
/// The transport's counts once they held still for 200 ms (at most 3 s).
async fn steady(t: &Arc<dyn Transport>) -> ResourceStats {
    let until = tokio::time::Instant::now() + Duration::from_secs(3);
    let mut last = t.stats();
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = t.stats();
        if now == last || tokio::time::Instant::now() >= until {
            return now;
        }
        last = now;
    }
}

pub async fn counts_return_after_shutdown(cx: Ctx) -> CaseResult {
    let opts = NodeOptions::default();
    let a = cx.node(&opts).await?;
    let b = cx.node(&opts).await?;
    let seg = open(&a, &b.name).await?;
    let (ta, tb) = (a.transport.clone(), b.transport.clone());
    // Warm up: whatever a first notification builds (an endpoint, a task)
    // is in the baseline.
    send(&ta, seg, b"warm up".to_vec(), "a first notify").await?;
    next_notifications(&tb, "the first notification").await?;
    // Connections of the open and the warm-up may still be winding down
    // (RDMA: the descriptor fetch's passive task): the baseline is taken
    // once the counts hold still.
    let (base_a, base_b) = (steady(&ta).await, steady(&tb).await);
    ensure!(base_b.notifications == 0, "with nothing queued the receiver counts {base_b:?}");

    for i in 0..10 {
        send(&ta, seg, short(i), "notify").await?;
        let n = tb.stats().notifications;
        ensure!(n == i + 1, "after {} notifications the receiver counts {n}", i + 1);
    }
    let got = tb.take_notifications(1 << 16)?;
    ensure!(got.len() == 10, "took {} of 10 notifications", got.len());
    expect_stats(&tb, base_b, "the receiver after taking every notification").await?;
    expect_stats(&ta, base_a, "the sender after its notifications were taken").await?;

    // Shutdown with notifications queued (B) and a pending waiter (A).
    for i in 0..3 {
        send(&ta, seg, short(i), "notify").await?;
    }
    let ta2 = ta.clone();
    let waiter = tokio::spawn(async move { ta2.wait_notification().await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    ensure!(!waiter.is_finished(), "wait_notification returned with an empty inbox: {:?}", waiter.await);

    bounded("shutdown", tb.shutdown()).await??;
    expect_stats(&tb, ResourceStats::default(), "the receiver after shutdown (3 notifications were queued)").await?;
    expect_kind(
        bounded("wait_notification after shutdown", tb.wait_notification()).await?,
        &[ErrorKind::Shutdown],
        "wait_notification after shutdown",
    )?;
    expect_kind(tb.take_notifications(1), &[ErrorKind::Shutdown], "take_notifications after shutdown")?;
    let r = bounded("notify to a shut-down peer", ta.notify(seg, b"late".to_vec())).await?;
    let e = match r {
        Ok(()) => return Err(CaseError::Fail("notify to a shut-down peer returned Ok".into())),
        Err(e) => e,
    };
    ensure!(e.is_transient(), "notify to a shut-down peer: {e} must be transient (rule 7)");

    bounded("shutdown", ta.shutdown()).await??;
    let w = bounded("a wait_notification pending over shutdown", waiter)
        .await?
        .map_err(|e| CaseError::Fail(format!("the waiter panicked: {e}")))?;
    expect_kind(w, &[ErrorKind::Shutdown], "a wait_notification pending over shutdown")?;
    expect_kind(
        bounded("wait_notification after shutdown", ta.wait_notification()).await?,
        &[ErrorKind::Shutdown],
        "wait_notification after the sender's shutdown",
    )?;
    Ok(())
}
