//! One submitted batch: its validated requests and their lifecycle, kept
//! in the core's [`BatchLedger`] (one unit per request: its copy).
//!
//! The ledger sits behind the batch lock, and a copy runs under that lock
//! between `ledger.start(i)` and `ledger.unit_done(i, ..)`. So marking a
//! request terminal (cancel, deadline, close, unregister, kill) under the
//! same lock makes it quiet at once (rule 5): no copy is in progress, and
//! `start` refuses every later one.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use parking_lot::Mutex;
use transport_core::lifecycle::{BatchLedger, DeadlineKey, EndReason};
use transport_core::{BatchStatus, Error, RequestStatus, Result, TransferRequest};

use crate::region::RegionEntry;
use crate::segment::SegmentEntry;

#[derive(Debug)]
pub(crate) struct Planned {
    pub req: TransferRequest,
    pub local: Arc<RegionEntry>,
    pub segment: Arc<SegmentEntry>,
}

#[derive(Debug)]
pub(crate) struct Batch {
    pub requests: Vec<Planned>,
    ledger: Mutex<BatchLedger>,
    /// Its place in the host's deadline queue, once entered.
    pub deadline_key: OnceLock<DeadlineKey>,
}

impl Batch {
    /// `deadline` is on the host's clock.
    pub fn new(requests: Vec<Planned>, deadline: Option<Duration>) -> Self {
        let ledger = BatchLedger::new(requests.iter().map(|_| 1), deadline);
        Self { requests, ledger: Mutex::new(ledger), deadline_key: OnceLock::new() }
    }

    /// The deadline, on the host's clock.
    pub fn deadline(&self) -> Option<Duration> {
        self.ledger.lock().deadline()
    }

    /// The ledger with the deadline applied at `now` (rule 5: every reader
    /// enforces it, not only the batch task).
    fn at(&self, now: Duration) -> parking_lot::MutexGuard<'_, BatchLedger> {
        let mut ledger = self.ledger.lock();
        let _ = ledger.expire(now);
        ledger
    }

    /// Applies the deadline at `now` (the host's deadline timer, when it
    /// comes due).
    pub fn expire(&self, now: Duration) {
        drop(self.at(now));
    }

    /// A snapshot at `now`.
    pub fn status(&self, now: Duration) -> BatchStatus {
        self.at(now).status()
    }

    pub fn is_terminal(&self, now: Duration) -> bool {
        self.at(now).is_terminal()
    }

    /// Whether request `i` may still be copied.
    pub fn is_live(&self, i: usize, now: Duration) -> bool {
        self.at(now).is_live(i)
    }

    /// Whether request `i` ended by a cancel or a deadline (what the
    /// `write_after_timeout` bug still copies).
    pub fn ended_early(&self, i: usize) -> bool {
        matches!(self.ledger.lock().request(i), Some(RequestStatus::Cancelled | RequestStatus::TimedOut))
    }

    /// Fails request `i` unless it is already decided (first decision wins).
    pub fn fail(&self, i: usize, err: Error) {
        let _ = self.ledger.lock().end(i, EndReason::Failed(err));
    }

    /// Ends every live request `pick` selects; returns how many.
    pub fn end_where(&self, reason: &EndReason, mut pick: impl FnMut(&Planned) -> bool) -> usize {
        let mut ledger = self.ledger.lock();
        ledger.end_where(reason, |i| self.requests.get(i).is_some_and(&mut pick)).0
    }

    /// Cancels every live request at `now` (ones past the deadline end
    /// `TimedOut` first); returns the terminal status.
    pub fn cancel(&self, now: Duration) -> BatchStatus {
        let mut ledger = self.at(now);
        let _ = ledger.end_where(&EndReason::Cancelled, |_| true);
        ledger.status()
    }

    /// Runs `copy` as request `i`'s one unit, under the batch lock, only if
    /// the request is live at `now` (rule 5), and records its outcome. With
    /// `ghost` (the `write_after_timeout` bug) a request ended by a cancel
    /// or deadline is copied anyway, unrecorded.
    pub fn run_unit(&self, i: usize, now: Duration, ghost: bool, copy: impl FnOnce() -> Result<()>) {
        let mut ledger = self.at(now);
        if ledger.start(i) {
            let result = copy();
            let _ = ledger.unit_done(i, result);
        } else if ghost && matches!(ledger.request(i), Some(RequestStatus::Cancelled | RequestStatus::TimedOut)) {
            let _ = copy();
        }
    }

    /// Requests not yet terminal (`stats().inflight`).
    pub fn pending(&self) -> usize {
        self.ledger.lock().pending()
    }
}
