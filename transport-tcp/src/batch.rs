//! A submitted batch: per-request slice accounting, the gate that makes
//! "terminal means quiet" hold, and the terminal signal.
//!
//! Every request is cut into slices. A slice *ends* exactly once: answered
//! by the peer, skipped by a lane before it touched memory (its request was
//! ended), or failed when its endpoint was destroyed (after the lane tasks
//! were joined and the sockets closed). A request's status becomes visible
//! only when its last slice has ended, so once a request is reported
//! terminal no task still copies into or out of its buffer.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock, RwLockReadGuard};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use transport_core::{BatchId, BatchStatus, Error, RequestStatus, TransferRequest};

use crate::regions::Region;

/// Why a request was ended before its slices were answered.
#[derive(Debug, Clone)]
pub(crate) enum EndReason {
    Cancelled,
    TimedOut,
    Failed(Error),
}

#[derive(Debug)]
struct State {
    statuses: Vec<RequestStatus>,
    /// First failure or end reason per request, applied when it finishes.
    outcome: Vec<Option<EndReason>>,
    pending: usize,
}

/// One batch.
#[derive(Debug)]
pub(crate) struct Batch {
    #[allow(dead_code)]
    pub id: BatchId,
    pub reqs: Vec<TransferRequest>,
    /// The local region of each request (kept alive and gated).
    pub locals: Vec<Arc<Region>>,
    /// Shared while a lane copies a request's bytes; exclusive to end
    /// requests, so after `end` returns no copy of an ended request runs.
    gate: RwLock<()>,
    alive: Vec<AtomicBool>,
    remaining: Vec<AtomicU32>,
    state: Mutex<State>,
    terminal: watch::Sender<bool>,
    /// Slices not yet ended, all requests together (stats.inflight).
    outstanding: AtomicUsize,
    inflight_total: Arc<AtomicUsize>,
    pub deadline: Mutex<Option<JoinHandle<()>>>,
    /// Names of the endpoints that carry its slices.
    pub peers: Mutex<Vec<String>>,
}

impl Batch {
    pub fn new(
        id: BatchId,
        reqs: Vec<TransferRequest>,
        locals: Vec<Arc<Region>>,
        slices: Vec<u32>,
        inflight_total: Arc<AtomicUsize>,
    ) -> Arc<Self> {
        let n = reqs.len();
        let total: usize = slices.iter().map(|&s| s as usize).sum();
        inflight_total.fetch_add(total, Ordering::Relaxed);
        let (terminal, _) = watch::channel(false);
        Arc::new(Self {
            id,
            reqs,
            locals,
            gate: RwLock::new(()),
            alive: (0..n).map(|_| AtomicBool::new(true)).collect(),
            remaining: slices.into_iter().map(AtomicU32::new).collect(),
            state: Mutex::new(State { statuses: vec![RequestStatus::Pending; n], outcome: vec![None; n], pending: n }),
            terminal,
            outstanding: AtomicUsize::new(total),
            inflight_total,
            deadline: Mutex::new(None),
            peers: Mutex::new(Vec::new()),
        })
    }

    /// Holds the gate shared and says whether request `i` may still touch
    /// memory; keep the guard for the duration of the copy.
    pub fn enter(&self, i: usize) -> Option<RwLockReadGuard<'_, ()>> {
        let g = self.gate.read();
        if self.alive.get(i).is_some_and(|a| a.load(Ordering::Acquire)) {
            Some(g)
        } else {
            None
        }
    }

    pub fn is_alive(&self, i: usize) -> bool {
        self.alive.get(i).is_some_and(|a| a.load(Ordering::Acquire))
    }

    /// Ends the pending requests chosen by `pick` with `reason`: no copy of
    /// them runs after this returns. Their status appears once their
    /// in-flight slices have ended. Returns how many were ended.
    pub fn end(&self, reason: &EndReason, mut pick: impl FnMut(usize, &TransferRequest) -> bool) -> usize {
        let _w = self.gate.write();
        let mut st = self.state.lock();
        let mut n = 0;
        for (i, r) in self.reqs.iter().enumerate() {
            if self.alive[i].load(Ordering::Acquire) && !st.statuses[i].is_terminal() && pick(i, r) {
                self.alive[i].store(false, Ordering::Release);
                if st.outcome[i].is_none() {
                    st.outcome[i] = Some(reason.clone());
                }
                n += 1;
            }
        }
        n
    }

    /// Records that one slice of request `i` ended (with `err` if it
    /// failed). Finishes the request when it was its last slice.
    pub fn slice_done(&self, i: usize, err: Option<Error>) {
        if let Some(e) = err {
            {
                let _w = self.gate.write();
                self.alive[i].store(false, Ordering::Release);
            }
            let mut st = self.state.lock();
            if st.outcome[i].is_none() {
                st.outcome[i] = Some(EndReason::Failed(e));
            }
        }
        self.outstanding.fetch_sub(1, Ordering::Relaxed);
        self.inflight_total.fetch_sub(1, Ordering::Relaxed);
        if self.remaining[i].fetch_sub(1, Ordering::AcqRel) == 1 {
            self.finish(i);
        }
    }

    /// Fails a request none of whose slices was ever handed to a lane.
    pub fn fail_unsent(&self, i: usize, err: Error) {
        let left = self.remaining[i].swap(0, Ordering::AcqRel) as usize;
        {
            let _w = self.gate.write();
            self.alive[i].store(false, Ordering::Release);
        }
        self.outstanding.fetch_sub(left, Ordering::Relaxed);
        self.inflight_total.fetch_sub(left, Ordering::Relaxed);
        {
            let mut st = self.state.lock();
            if st.outcome[i].is_none() {
                st.outcome[i] = Some(EndReason::Failed(err));
            }
        }
        if left > 0 {
            self.finish(i);
        }
    }

    fn finish(&self, i: usize) {
        let done = {
            let mut st = self.state.lock();
            if st.statuses[i].is_terminal() {
                return;
            }
            st.statuses[i] = match st.outcome[i].take() {
                None => RequestStatus::Completed,
                Some(EndReason::Cancelled) => RequestStatus::Cancelled,
                Some(EndReason::TimedOut) => RequestStatus::TimedOut,
                Some(EndReason::Failed(e)) => RequestStatus::Failed(e.with("request", i)),
            };
            st.pending -= 1;
            st.pending == 0
        };
        if done {
            if let Some(h) = self.deadline.lock().take() {
                h.abort();
            }
            self.terminal.send_replace(true);
        }
    }

    /// Slices not yet ended.
    pub fn outstanding(&self) -> usize {
        self.outstanding.load(Ordering::Relaxed)
    }

    pub fn is_terminal(&self) -> bool {
        *self.terminal.borrow()
    }

    pub fn status(&self) -> BatchStatus {
        BatchStatus::from_requests(self.state.lock().statuses.clone())
    }

    /// Waits until every request is terminal.
    pub async fn wait_terminal(&self) {
        let mut rx = self.terminal.subscribe();
        let _ = rx.wait_for(|t| *t).await;
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        if let Some(h) = self.deadline.lock().take() {
            h.abort();
        }
        let left = self.outstanding.swap(0, Ordering::Relaxed);
        self.inflight_total.fetch_sub(left, Ordering::Relaxed);
    }
}
