//! Poll never panics (rule 6): unknown, released and random ids, batches
//! still in progress, and polling while the peer fails.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use rand::{Rng, SeedableRng};
use transport_core::{BatchId, BatchState, ErrorKind, SubmitOptions};

use crate::ctx::{bounded, expect_permanent, Ctx};
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
        expect_permanent(bounded("wait", t.wait(b)).await?, &[ErrorKind::InvalidHandle], &format!("wait({b})"))?;
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
        let s = bounded("wait", t.wait(b)).await?;
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
