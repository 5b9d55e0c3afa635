//! Poll never panics (rule 6): unknown, released and random ids, batches
//! still in progress, and polling while the peer fails.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use rand::{Rng, SeedableRng};
use transport_core::{BatchId, BatchState, ErrorKind, SubmitOptions};

use crate::ctx::{bounded, expect_permanent, wait_batch, Ctx};
use crate::ensure;
use crate::outcome::{CaseError, CaseResult};

/// `poll`, `wait`, `cancel` and `release` of ids never issued (0,
/// `u64::MAX`, random) are `InvalidHandle`, never a panic or a hang.
pub async fn unknown_batch_ids(cx: Ctx) -> CaseResult {
    let p = cx.pair(4096).await?;
    let t = p.t().clone();
    let mut rng = rand::rngs::SmallRng::seed_from_u64(6);
    let mut ids = vec![0, u64::MAX, u64::MAX - 1, 1 << 63];
    ids.extend((0..100).map(|_| rng.gen::<u64>() | (1 << 62)));
    for id in ids {
        let b = BatchId(id);
        expect_permanent(t.poll(b), &[ErrorKind::InvalidHandle], &format!("poll({b})"))?;
        expect_permanent(t.release(b), &[ErrorKind::InvalidHandle], &format!("release({b})"))?;
        expect_permanent(
            wait_batch(t.as_ref(), b, None, "wait").await?,
            &[ErrorKind::InvalidHandle],
            &format!("wait({b})"),
        )?;
        expect_permanent(bounded("cancel", t.cancel(b)).await?, &[ErrorKind::InvalidHandle], &format!("cancel({b})"))?;
    }
    Ok(())
}

/// Releasing a batch still in progress is `InvalidRequest` and leaves it
/// intact: it can still be polled, cancelled and then released.
pub async fn release_in_progress_refused(cx: Ctx) -> CaseResult {
    let p = cx.pair(1 << 20).await?;
    let t = p.t().clone();
    cx.stall(&p.b, true).await?;
    let b = t.submit(vec![p.write(0, 0, 1 << 20)], SubmitOptions::default()).await?;
    let s = t.poll(b)?;
    if s.state == BatchState::InProgress {
        expect_permanent(t.release(b), &[ErrorKind::InvalidRequest], "release of a batch in progress")?;
        t.poll(b)?;
    }
    let c = bounded("cancel", t.cancel(b)).await??;
    ensure!(c.is_terminal(), "cancel returned {:?}", c.state);
    t.release(b)?;
    cx.stall(&p.b, false).await?;
    Ok(())
}

/// The polling hint (`Transport::polling`) loses nothing: answers that
/// arrive while a caller said it polls, but did not, are applied once it
/// says it stopped, without anyone polling (the backend's own threads wake
/// for them). Nested and unmatched hints, hints for unknown, terminal and
/// released batches are harmless.
pub async fn polling_hint_loses_nothing(cx: Ctx) -> CaseResult {
    let p = cx.pair(64 << 10).await?;
    let t = p.t().clone();
    t.polling(BatchId(u64::MAX), true);
    t.polling(BatchId(u64::MAX), false);
    for round in 0..3u64 {
        let mut reqs = vec![p.write(round * 4096, round * 4096, 4096)];
        if t.capabilities().read {
            reqs.push(p.read(32_768 + round * 4096, 49_152, 4096));
        }
        let mut model = crate::cases::data::Model::of(&p);
        for r in &reqs {
            model.apply(&p, r);
        }
        let b = t.submit(reqs, SubmitOptions::default()).await?;
        t.polling(b, true);
        if round == 1 {
            t.polling(b, true);
        }
        // The answers arrive meanwhile; nobody polls.
        tokio::time::sleep(Duration::from_millis(50)).await;
        if round == 1 {
            t.polling(b, false);
        }
        t.polling(b, false);
        let s = tokio::time::timeout(Duration::from_secs(2), t.wait(b)).await.map_err(|_| {
            CaseError::Fail(format!("round {round}: the batch did not end within 2 s of the hint's end"))
        })??;
        ensure!(s.state == BatchState::Completed, "round {round}: {:?}", s.state);
        model.check(&p, &format!("round {round}"))?;
        // After the end: ignored.
        t.polling(b, true);
        t.polling(b, false);
        t.release(b)?;
    }
    // Released between the two calls (after polling it to its end): the
    // next batch, which nobody polls, still ends.
    let b = t.submit(vec![p.write(0, 0, 4096)], SubmitOptions::default()).await?;
    t.polling(b, true);
    let polled = tokio::time::timeout(Duration::from_secs(10), async {
        while !t.poll(b).is_ok_and(|s| s.is_terminal()) {
            tokio::task::yield_now().await;
        }
    });
    polled.await.map_err(|_| CaseError::Fail("a polled batch did not end within 10 s".into()))?;
    t.release(b)?;
    t.polling(b, false);
    let b = t.submit(vec![p.write(4096, 4096, 4096)], SubmitOptions::default()).await?;
    let s = tokio::time::timeout(Duration::from_secs(2), t.wait(b))
        .await
        .map_err(|_| CaseError::Fail("after a release under the hint, a batch did not end within 2 s".into()))??;
    ensure!(s.state == BatchState::Completed, "after a release under the hint: {:?}", s.state);
    t.release(b)?;
    Ok(())
}

/// Four tasks poll every batch id seen so far (and random ones) in a tight
/// loop while batches run through a cut, a stall with cancel and a peer
/// kill: every answer is a status or an error, and terminal states never
/// change. Fault hooks the harness lacks are left out.
pub async fn poll_during_faults(cx: Ctx) -> CaseResult {
    let p = cx.pair(1 << 20).await?;
    let t = p.t().clone();
    let ids: Arc<Mutex<Vec<BatchId>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let mut pollers = Vec::new();
    for k in 0..4u64 {
        let (t, ids, stop) = (t.clone(), ids.clone(), stop.clone());
        pollers.push(tokio::spawn(async move {
            let mut seen: HashMap<BatchId, BatchState> = HashMap::new();
            let mut rng = rand::rngs::SmallRng::seed_from_u64(k);
            while !stop.load(Ordering::Relaxed) {
                let list = ids.lock().clone();
                for b in list.into_iter().chain(std::iter::once(BatchId(rng.gen()))) {
                    if let Ok(s) = t.poll(b) {
                        if let Some(first) = seen.get(&b) {
                            if *first != s.state {
                                return Err(format!("{b} went from terminal {first:?} to {:?}", s.state));
                            }
                        } else if s.is_terminal() {
                            seen.insert(b, s.state);
                        }
                    }
                }
                tokio::task::yield_now().await;
            }
            Ok(())
        }));
    }
    let opts = SubmitOptions::with_timeout(Duration::from_secs(2));
    let mut submitted = Vec::new();
    for i in 0..20u64 {
        match i {
            5 => ignore_skip(cx.cut(&p.b).await)?,
            10 => ignore_skip(cx.stall(&p.b, true).await)?,
            15 => ignore_skip(cx.kill(&p.b).await)?,
            _ => {}
        }
        if let Ok(b) = t.submit(vec![p.write(i * 4096, i * 4096, 4096)], opts).await {
            ids.lock().push(b);
            submitted.push(b);
        }
        if i == 12 {
            for &b in &submitted {
                let _ = bounded("cancel", t.cancel(b)).await?;
            }
            ignore_skip(cx.stall(&p.b, false).await)?;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for &b in &submitted {
        let s = wait_batch(t.as_ref(), b, None, "wait").await?;
        if let Ok(s) = s {
            ensure!(s.is_terminal(), "wait({b}) returned {:?}", s.state);
        }
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    stop.store(true, Ordering::Relaxed);
    for task in pollers {
        bounded("a poller", task).await?.map_err(|e| CaseError::Fail(format!("poller panicked: {e}")))??;
    }
    for b in submitted {
        t.release(b)?;
    }
    Ok(())
}

fn ignore_skip(r: CaseResult) -> CaseResult {
    match r {
        Err(CaseError::Skip(_)) => Ok(()),
        other => other,
    }
}
