//! A batch's driver task: plans under the lock ([`Inner::step`]), sends
//! the sub-batches, accounts for each as it ends, until the batch is
//! terminal; and the waits that let callers see its work accounted for.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::stream::{FuturesUnordered, StreamExt};
use tokio::sync::Notify;

use transport_core::lifecycle::EndReason;
use transport_core::{BatchId, BatchStatus, Error, ErrorKind, Result, SegmentId, SubmitOptions, TransferRequest};

use crate::state::*;

/// How long `close_segment`, `unregister` and `shutdown` wait for the
/// batch drivers to account for work the rails already made quiet.
pub(crate) const SETTLE_LIMIT: Duration = Duration::from_secs(30);
/// A waiter looks again at least this often.
pub(crate) const NAP: Duration = Duration::from_millis(20);

impl Inner {
    /// Fails every live request of a batch that has nothing on the wire
    /// and nothing queued (never expected; keeps waiters from hanging).
    pub(crate) fn abandon(&self, id: BatchId) {
        let mut st = self.state.lock();
        if let Ok(b) = st.batches.get_mut(id) {
            let why = EndReason::Failed(Error::new(ErrorKind::Internal, "rails: a batch had nothing left to send"));
            if b.ledger.end_where(&why, |_| true).1.batch_terminal {
                b.done.notify_waiters();
            }
        }
    }

    /// Waits (bounded) until `quiet` holds of the state.
    pub(crate) async fn settle(&self, quiet: impl Fn(&State) -> bool) {
        let start = Instant::now();
        while start.elapsed() < SETTLE_LIMIT {
            let n = self.settled.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if quiet(&self.state.lock()) {
                return;
            }
            let _ = tokio::time::timeout(NAP, n).await;
        }
        tracing::warn!("rails: work still unaccounted for after {SETTLE_LIMIT:?}");
    }
}

/// Whether a sub-batch's outcome says the peer restarted (rule 2).
fn saw_restart(r: &Result<BatchStatus>) -> bool {
    match r {
        Err(e) => e.kind() == ErrorKind::PeerRestarted,
        Ok(st) => st.requests.iter().filter_map(|q| q.error()).any(|e| e.kind() == ErrorKind::PeerRestarted),
    }
}

impl Inner {
    /// A path saw the peer restarted: rail 0's control handle, which moves
    /// no data and so learns of it last (or never, when every region keeps
    /// to other rails), is opened again, so the segment's descriptor shows
    /// the new generation (rule 2) and notifications go to the new peer.
    /// One refresh at a time per segment; a failed open leaves the old
    /// handle (the next failure tries again).
    pub(crate) async fn refresh_control(&self, segment: SegmentId) {
        let name = {
            let mut st = self.state.lock();
            let Some(s) = st.segments.get_mut(&segment).filter(|s| !s.closing && !s.refreshing) else {
                return;
            };
            s.refreshing = true;
            s.name.clone()
        };
        let fresh = self.all[0].open_segment(&name).await;
        let stale = {
            let mut st = self.state.lock();
            match (st.segments.get_mut(&segment), fresh) {
                (Some(s), Ok(h)) if !s.closing => {
                    s.refreshing = false;
                    Some(std::mem::replace(&mut s.control, h))
                }
                (Some(s), fresh) => {
                    s.refreshing = false;
                    fresh.ok()
                }
                (None, fresh) => fresh.ok(),
            }
        };
        if let Some(h) = stale {
            let _ = self.all[0].close_segment(h).await;
        }
    }
}

/// The driver of one batch: hands out sub-batches, collects their
/// outcomes, reposts what a failed path gave back, cancels on stop.
pub(crate) async fn drive(
    inner: Arc<Inner>,
    id: BatchId,
    reqs: Vec<TransferRequest>,
    mut queue: VecDeque<Slice>,
    wake: Arc<Notify>,
    // Every sub-batch served by the peer itself (`SubmitOptions::round_trip`).
    round_trip: bool,
) {
    type Done = (Sub, BatchId, Result<BatchStatus>);
    let mut running: FuturesUnordered<futures::future::BoxFuture<'static, Done>> = FuturesUnordered::new();
    let mut live: HashSet<(usize, BatchId)> = HashSet::new();
    let mut mine = HashMap::new();
    let mut cancelled = false;
    // Distinct segments of the batch: once each waits for room, a step
    // stops looking at the queue.
    let segs = reqs.iter().map(|r| r.segment).collect::<HashSet<_>>().len();
    while let Some(step) = inner.step(id, &reqs, &mut queue, &mut mine, segs) {
        if step.terminal && running.is_empty() {
            break;
        }
        if step.cancel && !cancelled {
            cancelled = true;
            let cancels = live.iter().map(|&(k, bid)| {
                let t = inner.all[k].clone();
                async move {
                    let _ = t.cancel(bid).await;
                }
            });
            futures::future::join_all(cancels).await;
        }
        let mut refused = false;
        for plan in step.plans {
            let t = inner.all[plan.sub.k].clone();
            let opts = SubmitOptions { timeout: plan.timeout, round_trip };
            if tracing::enabled!(tracing::Level::TRACE) {
                let slices: Vec<(usize, u64, u64)> = plan.sub.slices.iter().map(|s| (s.req, s.off, s.len)).collect();
                tracing::trace!(batch = ?id, k = plan.sub.k, path = plan.sub.path, ?slices, "rails: sub-batch out");
            }
            match t.submit(plan.requests, opts).await {
                Ok(bid) => {
                    live.insert((plan.sub.k, bid));
                    let sub = plan.sub;
                    running.push(Box::pin(async move {
                        let r = t.wait(bid).await;
                        (sub, bid, r)
                    }));
                }
                Err(e) => {
                    refused = true;
                    inner.finish(id, plan.sub, Err(e), &mut queue, &mut mine);
                }
            }
        }
        if refused {
            continue;
        }
        if running.is_empty() && queue.is_empty() && !step.terminal {
            // Nothing out and nothing left to send, yet not terminal: a
            // bookkeeping bug. End it rather than hang its waiters.
            inner.abandon(id);
            continue;
        }
        // The deadline wakes `wake` too (the rails' one timer, `timer`).
        tokio::select! {
            Some((sub, bid, r)) = running.next(), if !running.is_empty() => {
                live.remove(&(sub.k, bid));
                let _ = inner.all[sub.k].release(bid);
                let seg = sub.seg;
                let restarted = saw_restart(&r);
                inner.finish(id, sub, r, &mut queue, &mut mine);
                if restarted {
                    // In a task of its own: the open may take as long as
                    // a handshake, and this driver keeps its deadline.
                    let refresh = {
                        let inner = inner.clone();
                        async move { inner.refresh_control(seg).await }
                    };
                    inner.tasks.spawn(refresh);
                }
            }
            _ = wake.notified() => {}
            // Slices waiting for room on a path shared with other batches.
            _ = tokio::time::sleep(NAP), if running.is_empty() && !queue.is_empty() => {}
        }
    }
}

/// The rails' one deadline timer (rule 5): sleeps until the next deadline
/// in [`State::deadlines`] (or until an earlier one is entered) and wakes
/// the driver of every batch whose deadline came; the driver then sees it
/// expired and cancels what is on the rails. Holds the rails weakly; ends
/// with them (its handle, `Inner::timer`, aborts it).
pub(crate) async fn timer(weak: std::sync::Weak<Inner>) {
    loop {
        let Some(inner) = weak.upgrade() else { return };
        let signal = inner.earlier.clone();
        let earlier = signal.notified();
        tokio::pin!(earlier);
        earlier.as_mut().enable();
        let next = {
            let mut st = inner.state.lock();
            let due = st.deadlines.due(inner.now());
            for (_, id) in due {
                if let Ok(b) = st.batches.get_mut(id) {
                    b.deadline = None;
                    b.wake.notify_one();
                }
            }
            st.deadlines.arm()
        };
        let epoch = inner.epoch;
        drop(inner);
        epoch.sleep_until_or(next, earlier).await;
    }
}
