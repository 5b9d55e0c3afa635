//! The retry decision of one transfer (rule 8), sans-IO: which requests go
//! into the next attempt, when the transfer is over, the final status of
//! each request, and what an attempt says about each peer.
//!
//! The engine's driver task ([`crate::Engine`]) does the I/O around it:
//! it submits [`Retry::current`], waits, hands the statuses to
//! [`Retry::ended`], sleeps the backoff, asks each peer's breaker
//! ([`Retry::refuse`] for a refusal), and starts the next attempt with
//! [`Retry::start_next`]. Nothing here reads a clock or touches a transport, so
//! `tests/retry.rs` drives it against a scripted backend, at random.
//!
//! The rules, in one place:
//! - a request is retried only after a transient failure other than
//!   `PeerUnavailable` (the breaker already said no), or a timeout;
//! - a connection the peer's host refused (nothing listens there,
//!   [`Error::nothing_listens`]) is not tried again: the segment was open,
//!   so the peer was there, and is gone (opening a segment asks once more,
//!   for a listener about to come up: `Engine::open_segment`);
//! - after a first attempt whose retried requests all failed because
//!   their established connection broke (`ConnectionReset`), the second
//!   attempt starts at once ([`Retry::at_once`]): the reconnect either
//!   finds the peer (an idle connection reclaimed, a peer back) or is
//!   refused by its host, so a killed peer is reported as soon as the
//!   kernel reports the break; later attempts back off as before;
//! - never after it completed, never after a permanent error;
//! - at most `max_attempts` attempts in all (the first included);
//! - a cancelled transfer ends every request that has not completed or
//!   failed permanently as `Cancelled`.

use transport_core::{BatchState, Error, ErrorKind, RequestStatus};

/// The final report of a transfer.
#[derive(Debug, Clone)]
pub struct TransferOutcome {
    /// The overall state, derived from `requests` as for a batch.
    pub state: BatchState,
    /// One final status per submitted request, in submission order.
    pub requests: Vec<RequestStatus>,
    /// Backend submissions made (1 when nothing was retried).
    pub attempts: u32,
}

impl TransferOutcome {
    /// Whether every request completed.
    pub fn is_success(&self) -> bool {
        self.state == BatchState::Completed
    }

    /// The first request error, if any failed.
    pub fn first_error(&self) -> Option<&Error> {
        self.requests.iter().find_map(RequestStatus::error)
    }

    /// `Ok(self)` when every request completed, else the most useful error:
    /// the first failure, or a `Timeout` / `Cancelled` error.
    pub fn into_result(self) -> transport_core::Result<Self> {
        match self.state {
            BatchState::Completed => Ok(self),
            BatchState::Failed => Err(self
                .first_error()
                .cloned()
                .unwrap_or_else(|| Error::new(ErrorKind::Internal, "failed transfer without an error"))),
            BatchState::TimedOut => Err(Error::new(ErrorKind::Timeout, "transfer deadline passed")
                .with("attempts", self.attempts)
                .with("completed", self.requests.iter().filter(|r| r.is_completed()).count())),
            BatchState::Cancelled => Err(Error::new(ErrorKind::Cancelled, "transfer was cancelled")),
            BatchState::InProgress => Err(Error::new(ErrorKind::Internal, "outcome reported while in progress")),
        }
    }
}

/// Whether a request that ended with `status` may be tried again.
pub fn retryable(status: &RequestStatus) -> bool {
    match status {
        RequestStatus::Failed(e) => e.is_transient() && e.kind() != ErrorKind::PeerUnavailable,
        RequestStatus::TimedOut => true,
        _ => false,
    }
}

/// What one attempt said about a peer (fed to its circuit breaker).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerVerdict {
    /// A request to it completed and none failed for the peer's sake.
    Healthy,
    /// A request to it timed out or failed with a peer failure
    /// ([`ErrorKind::is_peer_failure`]).
    Failed,
    /// A request to it failed because its host refused the connection
    /// itself ([`transport_core::Error::nothing_listens`]): failed, and
    /// cheap to try again (its breaker probes it more often).
    Refused,
    /// Its requests ended for reasons that say nothing about it
    /// (cancelled, refused locally, a permanent request error).
    Unknown,
}

impl PeerVerdict {
    /// The verdict of a peer failure `e`: [`PeerVerdict::Refused`] when
    /// its host refused the connection itself, else `Failed`.
    pub fn failed(e: &Error) -> Self {
        if e.nothing_listens() {
            Self::Refused
        } else {
            Self::Failed
        }
    }
}

/// One verdict per peer from an attempt: `requests[k]` ended with
/// `results[k]` and went to peer `peer_of[requests[k]]` (of `peers`).
/// `None` for a peer the attempt did not reach. A failure outweighs a
/// success: one timed-out request makes the peer `Failed` (and any other
/// failure outweighs a refusal).
pub fn verdicts(
    requests: &[usize],
    results: &[RequestStatus],
    peer_of: &[usize],
    peers: usize,
) -> Vec<Option<PeerVerdict>> {
    let mut out: Vec<Option<PeerVerdict>> = vec![None; peers];
    for (&idx, st) in requests.iter().zip(results) {
        let v = match st {
            RequestStatus::Completed => PeerVerdict::Healthy,
            RequestStatus::TimedOut => PeerVerdict::Failed,
            RequestStatus::Failed(e) if e.kind().is_peer_failure() => PeerVerdict::failed(e),
            _ => PeerVerdict::Unknown,
        };
        let Some(slot) = peer_of.get(idx).and_then(|&p| out.get_mut(p)) else { continue };
        *slot = Some(match (*slot, v) {
            (Some(PeerVerdict::Failed), _) | (_, PeerVerdict::Failed) => PeerVerdict::Failed,
            (Some(PeerVerdict::Refused), _) | (_, PeerVerdict::Refused) => PeerVerdict::Refused,
            (Some(PeerVerdict::Healthy), _) | (_, PeerVerdict::Healthy) => PeerVerdict::Healthy,
            _ => PeerVerdict::Unknown,
        });
    }
    out
}

/// The retry state of one transfer of `n` requests.
#[derive(Debug, Clone)]
pub struct Retry {
    status: Vec<RequestStatus>,
    /// The requests of the attempt in flight (empty between attempts).
    current: Vec<usize>,
    /// The requests chosen for the next attempt, not yet started.
    next: Vec<usize>,
    attempts: u32,
    max_attempts: u32,
    cancelled: bool,
}

impl Retry {
    /// A transfer of `n` requests whose first attempt (all of them) is in
    /// flight; at most `max_attempts` attempts (at least 1).
    pub fn new(n: usize, max_attempts: u32) -> Self {
        Self {
            status: vec![RequestStatus::Pending; n],
            current: (0..n).collect(),
            next: Vec::new(),
            attempts: 1,
            max_attempts: max_attempts.max(1),
            cancelled: false,
        }
    }

    /// The requests of the attempt in flight, in the order the attempt's
    /// statuses come back.
    pub fn current(&self) -> &[usize] {
        &self.current
    }

    /// Attempts started so far (the first included).
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// The attempt in flight ended, with one status per request of
    /// [`Retry::current`] (in that order; a missing one counts as an
    /// internal failure, an extra one is ignored). Returns the requests
    /// chosen for the next attempt: empty when the transfer is over.
    pub fn ended(&mut self, results: impl IntoIterator<Item = RequestStatus>) -> &[usize] {
        let current = std::mem::take(&mut self.current);
        let mut results = results.into_iter();
        for idx in current {
            let st = results.next().unwrap_or_else(|| {
                RequestStatus::Failed(Error::new(ErrorKind::Internal, "the backend reported no status for a request"))
            });
            let down = matches!(&st, RequestStatus::Failed(e) if e.nothing_listens());
            if !self.cancelled && retryable(&st) && !down && self.attempts < self.max_attempts {
                self.next.push(idx);
            }
            if let Some(s) = self.status.get_mut(idx) {
                *s = st;
            }
        }
        &self.next
    }

    /// Whether the next attempt may start without a backoff: the attempt
    /// that ended was the transfer's first, and every request chosen for
    /// the next one failed because its established connection broke
    /// (`ConnectionReset`). A break is not a sign of load: reconnecting at
    /// once finds the peer, or its host refuses (nothing listens) and the
    /// transfer ends, as soon as the kernel reported the break. At most
    /// one attempt of a transfer goes without a pause.
    pub fn at_once(&self) -> bool {
        let broke = |&i: &usize| matches!(self.status.get(i), Some(RequestStatus::Failed(e)) if e.kind() == ErrorKind::ConnectionReset);
        self.attempts == 1 && !self.next.is_empty() && self.next.iter().all(broke)
    }

    /// The requests chosen for the next attempt (by [`Retry::ended`], less
    /// those refused since).
    pub fn chosen(&self) -> &[usize] {
        &self.next
    }

    /// Request `idx`, chosen for the next attempt, may not go (its peer's
    /// breaker refused it): it ends with `err`.
    pub fn refuse(&mut self, idx: usize, err: Error) {
        if let Some(k) = self.next.iter().position(|&i| i == idx) {
            self.next.remove(k);
            if let Some(s) = self.status.get_mut(idx) {
                *s = RequestStatus::Failed(err);
            }
        }
    }

    /// Starts the next attempt with the requests chosen for it; `None` (and
    /// nothing started) when none is left or the transfer was cancelled, or
    /// while an attempt is still in flight.
    pub fn start_next(&mut self) -> Option<&[usize]> {
        if self.cancelled || self.next.is_empty() || !self.current.is_empty() {
            return None;
        }
        self.current = std::mem::take(&mut self.next);
        self.attempts += 1;
        Some(&self.current)
    }

    /// The caller cancelled: nothing more is started, and requests that
    /// did not complete or fail permanently end as `Cancelled` (those of an
    /// attempt in flight once it ends).
    pub fn cancel(&mut self) {
        self.cancelled = true;
        self.next.clear();
    }

    /// Whether the transfer is over: no attempt in flight and none to start.
    pub fn is_over(&self) -> bool {
        self.current.is_empty() && (self.next.is_empty() || self.cancelled)
    }

    /// The final report. Requests never reported (an attempt still in
    /// flight) stay `Pending`, so the state says `InProgress`.
    pub fn finish(self) -> TransferOutcome {
        let mut status = self.status;
        if self.cancelled {
            for s in status.iter_mut() {
                let keep = s.is_completed() || matches!(s, RequestStatus::Failed(e) if !e.is_transient());
                if !keep && !matches!(s, RequestStatus::Pending) {
                    *s = RequestStatus::Cancelled;
                }
            }
        }
        TransferOutcome { state: BatchState::summarize(&status), requests: status, attempts: self.attempts }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn transient() -> RequestStatus {
        RequestStatus::Failed(Error::new(ErrorKind::ConnectionReset, "cut"))
    }

    #[test]
    fn only_transient_failures_are_retried_up_to_the_bound() {
        let mut r = Retry::new(4, 2);
        let permanent = RequestStatus::Failed(Error::new(ErrorKind::InvalidRequest, "bad"));
        let unavailable = RequestStatus::Failed(Error::new(ErrorKind::PeerUnavailable, "open"));
        assert_eq!(r.ended([RequestStatus::Completed, transient(), permanent, unavailable]), &[1]);
        assert_eq!(r.start_next(), Some(&[1][..]));
        assert_eq!(r.attempts(), 2);
        // The bound: the second attempt's transient failure is final.
        assert!(r.ended([transient()]).is_empty());
        assert!(r.is_over() && r.start_next().is_none());
        let o = r.finish();
        assert_eq!(o.state, BatchState::Failed);
        assert_eq!(o.attempts, 2);
        assert!(o.requests[0].is_completed());
        assert_eq!(o.requests[1].error().map(Error::kind), Some(ErrorKind::ConnectionReset));
    }

    #[test]
    fn a_refused_request_ends_with_the_refusal() {
        let mut r = Retry::new(2, 5);
        assert_eq!(r.ended([RequestStatus::TimedOut, RequestStatus::TimedOut]), &[0, 1]);
        r.refuse(0, Error::new(ErrorKind::PeerUnavailable, "breaker open"));
        assert_eq!(r.start_next(), Some(&[1][..]));
        assert!(r.ended([RequestStatus::Completed]).is_empty());
        let o = r.finish();
        assert_eq!(o.requests[0].error().map(Error::kind), Some(ErrorKind::PeerUnavailable));
        assert!(o.requests[1].is_completed());
    }

    #[test]
    fn a_host_refusing_ends_the_request() {
        let down = || RequestStatus::Failed(Error::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused)));
        let busy = || RequestStatus::Failed(Error::new(ErrorKind::ConnectionRefused, "the peer is busy"));
        // A killed peer: the established connection broke, then its host
        // refused the reconnect: over, though attempts are left.
        let mut r = Retry::new(2, 4);
        assert_eq!(r.ended([transient(), busy()]), &[0, 1]);
        assert_eq!(r.start_next(), Some(&[0, 1][..]));
        assert_eq!(r.ended([down(), busy()]), &[1], "a refusal by the host ends the request");
        // Refused at the first attempt (the peer died between two
        // transfers): over at once; the peer's own refusal (busy) is not.
        let mut r = Retry::new(2, 4);
        assert_eq!(r.ended([down(), busy()]), &[1]);
        assert_eq!(r.start_next(), Some(&[1][..]));
        assert!(r.ended([RequestStatus::Completed]).is_empty());
        let o = r.finish();
        assert_eq!(o.attempts, 2);
        assert!(o.requests[0].error().is_some_and(Error::nothing_listens));
        assert!(o.requests[1].is_completed());
    }

    #[test]
    fn only_a_first_attempt_that_broke_goes_again_at_once() {
        let timeout = || RequestStatus::TimedOut;
        // Every retried request's connection broke at the first attempt.
        let mut r = Retry::new(3, 4);
        let permanent = RequestStatus::Failed(Error::new(ErrorKind::InvalidRequest, "bad"));
        assert_eq!(r.ended([transient(), RequestStatus::Completed, permanent]), &[0]);
        assert!(r.at_once());
        assert_eq!(r.start_next(), Some(&[0][..]));
        // Broken again: the third attempt backs off.
        assert_eq!(r.ended([transient()]), &[0]);
        assert!(!r.at_once(), "only the second attempt goes without a pause");
        // One of them timed out: the peer may be slow, so a pause.
        let mut r = Retry::new(2, 4);
        assert_eq!(r.ended([transient(), timeout()]), &[0, 1]);
        assert!(!r.at_once());
        // Nothing left to retry.
        let mut r = Retry::new(1, 1);
        assert!(r.ended([transient()]).is_empty());
        assert!(!r.at_once());
    }

    #[test]
    fn cancel_ends_what_would_have_been_retried() {
        let mut r = Retry::new(3, 5);
        let permanent = RequestStatus::Failed(Error::new(ErrorKind::InvalidRequest, "bad"));
        assert_eq!(r.ended([RequestStatus::Completed, transient(), permanent]), &[1]);
        r.cancel();
        assert!(r.start_next().is_none() && r.is_over());
        let o = r.finish();
        assert!(o.requests[0].is_completed());
        assert!(matches!(o.requests[1], RequestStatus::Cancelled));
        assert_eq!(o.requests[2].error().map(Error::kind), Some(ErrorKind::InvalidRequest));
        assert_eq!(o.attempts, 1);
    }

    #[test]
    fn a_short_report_fails_the_unreported_requests() {
        let mut r = Retry::new(2, 1);
        assert!(r.ended([RequestStatus::Completed]).is_empty());
        let o = r.finish();
        assert_eq!(o.requests[1].error().map(Error::kind), Some(ErrorKind::Internal));
    }

    #[test]
    fn a_failure_outweighs_a_success_for_a_peer() {
        let peer_of = [0, 0, 1, 2];
        let v = verdicts(
            &[0, 1, 2],
            &[RequestStatus::Completed, RequestStatus::TimedOut, RequestStatus::Cancelled],
            &peer_of,
            3,
        );
        assert_eq!(v, vec![Some(PeerVerdict::Failed), Some(PeerVerdict::Unknown), None]);
    }

    /// Issue 55: a request its peer's host refused (nothing listens) makes
    /// the peer `Refused` (its breaker probes it sooner); a peer's own
    /// refusal (busy) is `Failed`, and any other failure outweighs a
    /// refusal, as a refusal outweighs a success.
    #[test]
    fn a_refusal_by_the_host_is_its_own_verdict() {
        let host = || RequestStatus::Failed(Error::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused)));
        let busy = RequestStatus::Failed(Error::new(ErrorKind::ConnectionRefused, "busy"));
        let peer_of = [0, 0, 1, 1, 2];
        let results = [host(), RequestStatus::Completed, host(), RequestStatus::TimedOut, busy];
        let v = verdicts(&[0, 1, 2, 3, 4], &results, &peer_of, 3);
        assert_eq!(v, vec![Some(PeerVerdict::Refused), Some(PeerVerdict::Failed), Some(PeerVerdict::Failed)]);
    }
}
