//! The batch ledger: per-request sticky status and "terminal only when
//! quiet" (rules 5 and 1), kept once for every backend.
//!
//! A backend cuts each request into *units* (TCP slices, RDMA work
//! requests, one copy for the mock). The ledger knows, per request, how many
//! units are still to complete, how many the driver has handed to the wire
//! and not yet seen end, and whether the request was *decided* early
//! (cancelled, timed out, failed). From that it derives what the caller may
//! see:
//!
//! - a request is reported terminal only when it is decided (or all its
//!   units completed) **and** none of its units is on the wire: "terminal
//!   means quiet";
//! - the first decision wins and never changes: statuses are sticky;
//! - a decided request is not *live*: [`BatchLedger::start`] refuses to put
//!   more of its units on the wire, so the driver never touches its memory
//!   again once the units it already started have ended.
//!
//! The ledger does no I/O and takes the time as an argument (deadlines are
//! checked with [`BatchLedger::expire`]), so every rule can be tested
//! without a network.

use std::time::Duration;

use crate::error::{Error, Result};
use crate::types::{BatchStatus, RequestStatus};

/// Why a request ended before all its units completed.
#[derive(Debug, Clone)]
pub enum EndReason {
    /// The caller cancelled it (or `close_segment` / `shutdown` did).
    Cancelled,
    /// The batch's deadline passed.
    TimedOut,
    /// It failed; the error says whether retrying may help.
    Failed(Error),
}

impl EndReason {
    fn into_status(self, request: usize) -> RequestStatus {
        match self {
            EndReason::Cancelled => RequestStatus::Cancelled,
            EndReason::TimedOut => RequestStatus::TimedOut,
            EndReason::Failed(e) => RequestStatus::Failed(e.with("request", request)),
        }
    }
}

#[derive(Debug, Clone)]
struct Entry {
    /// Units not yet completed successfully.
    left: u64,
    /// Units started and not yet ended.
    on_wire: u64,
    /// The early decision, if any (first one wins).
    decided: Option<EndReason>,
    /// What the caller sees; set once, when the request is quiet.
    visible: RequestStatus,
}

impl Entry {
    fn live(&self) -> bool {
        self.decided.is_none() && self.left > 0
    }
}

/// What a call changed, for the driver to act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[must_use]
pub struct Progress {
    /// Requests that became visibly terminal in this call.
    pub finished: usize,
    /// The whole batch became terminal in this call (wake its waiters).
    pub batch_terminal: bool,
}

impl Progress {
    /// Adds `o` to this one (for a driver summing several calls).
    pub fn merge(&mut self, o: Progress) {
        self.finished += o.finished;
        self.batch_terminal |= o.batch_terminal;
    }
}

/// The lifecycle of one batch. Not synchronised: the driver keeps it behind
/// its own lock.
#[derive(Debug, Clone)]
pub struct BatchLedger {
    entries: Vec<Entry>,
    /// Requests not yet visibly terminal.
    pending: usize,
    /// Units on the wire, all requests together.
    on_wire: u64,
    /// When pending requests time out, on the driver's clock.
    deadline: Option<Duration>,
}

impl BatchLedger {
    /// A ledger for requests cut into `units[i]` units each (a request of
    /// zero units would complete at once; validation refuses zero-length
    /// requests before a ledger exists). `deadline` is an instant on the
    /// driver's clock (see [`BatchLedger::expire`]).
    pub fn new(units: impl IntoIterator<Item = u64>, deadline: Option<Duration>) -> Self {
        let entries: Vec<Entry> = units
            .into_iter()
            .map(|u| Entry {
                left: u,
                on_wire: 0,
                decided: None,
                visible: if u == 0 { RequestStatus::Completed } else { RequestStatus::Pending },
            })
            .collect();
        let pending = entries.iter().filter(|e| !e.visible.is_terminal()).count();
        Self { entries, pending, on_wire: 0, deadline }
    }

    /// Number of requests.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the batch has no requests.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The deadline given at creation.
    pub fn deadline(&self) -> Option<Duration> {
        self.deadline
    }

    /// Whether the driver may still start units of request `i` (it is not
    /// decided and not complete). Out of range is never live.
    pub fn is_live(&self, i: usize) -> bool {
        self.entries.get(i).is_some_and(Entry::live)
    }

    /// Whether any request is still live.
    pub fn any_live(&self) -> bool {
        self.entries.iter().any(Entry::live)
    }

    /// Whether request `i` is decided (ended early) but still has units on
    /// the wire: the driver must make them end (reset the endpoint carrying
    /// them) before the request can be reported.
    pub fn needs_quiet(&self, i: usize) -> bool {
        self.entries.get(i).is_some_and(|e| e.decided.is_some() && e.on_wire > 0)
    }

    /// The driver is about to put one unit of request `i` on the wire.
    /// Returns `false` (and counts nothing) if the request is not live:
    /// the unit must then not be started, its memory not touched.
    pub fn start(&mut self, i: usize) -> bool {
        match self.entries.get_mut(i) {
            Some(e) if e.live() && e.on_wire < e.left => {
                e.on_wire += 1;
                self.on_wire += 1;
                true
            }
            _ => false,
        }
    }

    /// A started unit of request `i` ended. `Ok` means its bytes are in
    /// place; an error decides the request `Failed` (if nothing was decided
    /// before). A unit that was not started is ignored.
    pub fn unit_done(&mut self, i: usize, result: Result<()>) -> Progress {
        let Some(e) = self.entries.get_mut(i) else { return Progress::default() };
        if e.on_wire == 0 {
            return Progress::default();
        }
        e.on_wire -= 1;
        self.on_wire -= 1;
        match result {
            Ok(()) => e.left = e.left.saturating_sub(1),
            Err(err) => {
                if e.decided.is_none() && e.left > 0 {
                    e.decided = Some(EndReason::Failed(err));
                }
            }
        }
        self.settle(i)
    }

    /// A started unit of request `i` came back without an outcome of its
    /// own and may be started again (a multi-rail driver reposts a slice
    /// whose rail failed: the rail reported it terminal, so it is quiet).
    /// Counts nothing against the request; if the request was decided
    /// meanwhile it may become terminal now.
    pub fn unit_back(&mut self, i: usize) -> Progress {
        let Some(e) = self.entries.get_mut(i) else { return Progress::default() };
        if e.on_wire == 0 {
            return Progress::default();
        }
        e.on_wire -= 1;
        self.on_wire -= 1;
        self.settle(i)
    }

    /// Ends request `i` early with `reason` unless it is already decided or
    /// complete (the first decision wins). It becomes visible once its units
    /// on the wire have ended. Returns what became terminal.
    pub fn end(&mut self, i: usize, reason: EndReason) -> Progress {
        let Some(e) = self.entries.get_mut(i) else { return Progress::default() };
        if e.live() {
            e.decided = Some(reason);
        }
        self.settle(i)
    }

    /// [`BatchLedger::end`] for every request `pick` selects; returns what
    /// became terminal and how many requests were newly decided (in
    /// `Progress::finished` only those already quiet count).
    pub fn end_where(&mut self, reason: &EndReason, mut pick: impl FnMut(usize) -> bool) -> (usize, Progress) {
        let mut decided = 0;
        let mut p = Progress::default();
        for i in 0..self.entries.len() {
            if self.entries[i].live() && pick(i) {
                decided += 1;
                p.merge(self.end(i, reason.clone()));
            }
        }
        (decided, p)
    }

    /// Times out every live request if `now` is at or past the deadline.
    pub fn expire(&mut self, now: Duration) -> Progress {
        match self.deadline {
            Some(d) if now >= d => self.end_where(&EndReason::TimedOut, |_| true).1,
            _ => Progress::default(),
        }
    }

    /// The driver gave up on `n` started units of request `i` without an
    /// outcome of their own (their endpoint was destroyed after the request
    /// was decided). Equivalent to `n` failed units when the request is
    /// already decided; otherwise it decides it `Failed(err)`.
    pub fn units_lost(&mut self, i: usize, n: u64, err: &Error) -> Progress {
        let mut p = Progress::default();
        for _ in 0..n {
            p.merge(self.unit_done(i, Err(err.clone())));
        }
        p
    }

    fn settle(&mut self, i: usize) -> Progress {
        let Some(e) = self.entries.get_mut(i) else { return Progress::default() };
        if e.visible.is_terminal() || e.on_wire > 0 {
            return Progress::default();
        }
        let status = match &e.decided {
            Some(reason) => reason.clone().into_status(i),
            None if e.left == 0 => RequestStatus::Completed,
            None => return Progress::default(),
        };
        e.visible = status;
        self.pending -= 1;
        Progress { finished: 1, batch_terminal: self.pending == 0 }
    }

    /// The caller's view of request `i` (`None` out of range).
    pub fn request(&self, i: usize) -> Option<&RequestStatus> {
        self.entries.get(i).map(|e| &e.visible)
    }

    /// A snapshot: one status per request, the batch state derived.
    pub fn status(&self) -> BatchStatus {
        BatchStatus::from_requests(self.entries.iter().map(|e| e.visible.clone()).collect())
    }

    /// Whether every request is visibly terminal (and so quiet).
    pub fn is_terminal(&self) -> bool {
        self.pending == 0
    }

    /// Units on the wire (for `stats().inflight`).
    pub fn on_wire(&self) -> u64 {
        self.on_wire
    }

    /// Units on the wire for request `i`.
    pub fn on_wire_of(&self, i: usize) -> u64 {
        self.entries.get(i).map_or(0, |e| e.on_wire)
    }

    /// Requests not yet visibly terminal.
    pub fn pending(&self) -> usize {
        self.pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;
    use crate::types::BatchState;

    fn reset() -> Error {
        Error::new(ErrorKind::ConnectionReset, "cut")
    }

    #[test]
    fn completes_when_every_unit_is_done() {
        let mut l = BatchLedger::new([2, 1], None);
        assert!(l.start(0) && l.start(0) && !l.start(0), "at most `left` units on the wire");
        assert!(l.start(1));
        assert_eq!(l.unit_done(0, Ok(())), Progress::default());
        assert_eq!(l.unit_done(1, Ok(())), Progress { finished: 1, batch_terminal: false });
        assert_eq!(l.unit_done(0, Ok(())), Progress { finished: 1, batch_terminal: true });
        assert_eq!(l.status().state, BatchState::Completed);
        assert_eq!(l.on_wire(), 0);
    }

    #[test]
    fn decided_request_is_reported_only_when_quiet() {
        let mut l = BatchLedger::new([3], None);
        assert!(l.start(0));
        let p = l.end(0, EndReason::Cancelled);
        assert_eq!(p.finished, 0, "a unit is still on the wire");
        assert!(!l.is_live(0) && l.needs_quiet(0) && !l.start(0));
        assert!(!l.request(0).is_some_and(RequestStatus::is_terminal));
        // The unit's late success does not change the decision.
        let p = l.unit_done(0, Ok(()));
        assert!(p.batch_terminal);
        assert!(matches!(l.request(0), Some(RequestStatus::Cancelled)));
    }

    #[test]
    fn first_decision_wins() {
        let mut l = BatchLedger::new([1, 1], None);
        assert!(l.start(0));
        let _ = l.unit_done(0, Err(reset()));
        let _ = l.end(0, EndReason::Cancelled);
        assert!(matches!(l.request(0), Some(RequestStatus::Failed(e)) if e.context_value("request") == Some("0")));
        let _ = l.end(1, EndReason::TimedOut);
        let _ = l.end(1, EndReason::Failed(reset()));
        assert!(matches!(l.request(1), Some(RequestStatus::TimedOut)));
        assert_eq!(l.status().state, BatchState::Failed);
    }

    #[test]
    fn deadline_is_checked_against_the_time_given() {
        let mut l = BatchLedger::new([1, 1], Some(Duration::from_millis(100)));
        assert!(l.start(0));
        let _ = l.unit_done(0, Ok(()));
        assert_eq!(l.expire(Duration::from_millis(99)), Progress::default());
        let p = l.expire(Duration::from_millis(100));
        assert!(p.batch_terminal);
        assert!(l.request(0).is_some_and(RequestStatus::is_completed), "completed stays completed");
        assert!(matches!(l.request(1), Some(RequestStatus::TimedOut)));
    }

    #[test]
    fn out_of_range_and_unstarted_units_are_ignored() {
        let mut l = BatchLedger::new([1], None);
        assert!(!l.start(7));
        assert_eq!(l.unit_done(7, Ok(())), Progress::default());
        assert_eq!(l.unit_done(0, Ok(())), Progress::default(), "not started");
        assert_eq!(l.end(9, EndReason::Cancelled), Progress::default());
        assert!(!l.is_terminal());
    }

    #[test]
    fn lost_units_fail_an_undecided_request() {
        let mut l = BatchLedger::new([4], None);
        assert!(l.start(0) && l.start(0));
        let p = l.units_lost(0, 2, &reset());
        assert!(p.batch_terminal);
        assert_eq!(l.status().first_error().map(Error::kind), Some(ErrorKind::ConnectionReset));
    }

    #[test]
    fn a_unit_given_back_can_start_again_and_counts_nothing() {
        let mut l = BatchLedger::new([2], None);
        assert!(l.start(0));
        assert!(l.start(0));
        assert!(!l.start(0), "no more units than the request has");
        assert_eq!(l.unit_back(0), Progress::default());
        assert_eq!(l.on_wire(), 1);
        assert!(l.start(0), "given back: may start again");
        assert_eq!(l.unit_done(0, Ok(())), Progress::default());
        assert_eq!(l.unit_done(0, Ok(())), Progress { finished: 1, batch_terminal: true });
        assert_eq!(l.status().state, BatchState::Completed);
        // Decided while a unit was out: terminal once it is given back.
        let mut l = BatchLedger::new([1], None);
        assert!(l.start(0));
        assert_eq!(l.end(0, EndReason::Cancelled), Progress::default());
        assert_eq!(l.unit_back(0), Progress { finished: 1, batch_terminal: true });
        assert_eq!(l.status().state, BatchState::Cancelled);
        assert_eq!(l.unit_back(0), Progress::default(), "nothing out: ignored");
    }
}
