//! The retry decision (rule 8) under random schedules, two-sided: the
//! engine's sans-IO [`Retry`] on one side, a scripted backend on the other
//! that answers every submitted request with a random status (any
//! `ErrorKind`, timeouts, cancels, short reports), while a breaker refuses
//! random retries and the caller may cancel between attempts.
//!
//! Checked from the backend's side: a request is submitted again only
//! after a retryable answer (transient, not `PeerUnavailable`, or a
//! timeout), never after it completed or failed permanently, and never in
//! more than `max_attempts` attempts; nothing is submitted after a cancel.
//! From the caller's side: the transfer ends within `max_attempts`
//! attempts, each request's final status is the backend's last answer (or
//! the breaker's refusal, or `Cancelled` after a cancel), the state
//! summarizes them, and each peer's verdict is `Failed` exactly when one of
//! its requests in that attempt timed out or failed for the peer's sake.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvmove_policy::retry::{verdicts, PeerVerdict, Retry};
use proptest::prelude::*;
use transport_core::{BatchState, Error, ErrorKind, RequestStatus};

/// One answer the backend may give a request.
#[derive(Debug, Clone)]
enum Answer {
    Completed,
    TimedOut,
    Cancelled,
    Failed(usize),
}

fn answer() -> impl Strategy<Value = Answer> {
    prop_oneof![
        3 => Just(Answer::Completed),
        1 => Just(Answer::TimedOut),
        1 => Just(Answer::Cancelled),
        4 => (0..ErrorKind::ALL.len()).prop_map(Answer::Failed),
    ]
}

fn status(a: &Answer) -> RequestStatus {
    match a {
        Answer::Completed => RequestStatus::Completed,
        Answer::TimedOut => RequestStatus::TimedOut,
        Answer::Cancelled => RequestStatus::Cancelled,
        Answer::Failed(k) => RequestStatus::Failed(Error::new(ErrorKind::ALL[*k], "scripted")),
    }
}

/// What the caller and breaker do between attempts.
#[derive(Debug, Clone)]
struct Between {
    cancel: bool,
    /// Refuse the k-th chosen request when `refuse[k % len]`.
    refuse: Vec<bool>,
}

fn between() -> impl Strategy<Value = Between> {
    (prop::bool::weighted(0.1), prop::collection::vec(prop::bool::weighted(0.2), 1..4))
        .prop_map(|(cancel, refuse)| Between { cancel, refuse })
}

#[derive(Debug, Clone)]
struct Script {
    n: usize,
    max_attempts: u32,
    peers: usize,
    peer_of: Vec<usize>,
    /// answers[attempt][request]
    answers: Vec<Vec<Answer>>,
    between: Vec<Between>,
    /// Per attempt: the backend reports this many statuses fewer (0: all).
    short: Vec<usize>,
}

fn script() -> impl Strategy<Value = Script> {
    (1usize..8, 1u32..6, 1usize..4).prop_flat_map(|(n, max_attempts, peers)| {
        let attempts = max_attempts as usize;
        (
            prop::collection::vec(0..peers, n),
            prop::collection::vec(prop::collection::vec(answer(), n), attempts),
            prop::collection::vec(between(), attempts),
            prop::collection::vec(prop_oneof![9 => Just(0usize), 1 => 1usize..3], attempts),
        )
            .prop_map(move |(peer_of, answers, between, short)| Script {
                n,
                max_attempts,
                peers,
                peer_of,
                answers,
                between,
                short,
            })
    })
}

/// The rule, restated here (not the crate's `retryable`): a timeout, or a
/// transient failure that is not the breaker's `PeerUnavailable`.
fn may_retry(s: &RequestStatus) -> bool {
    match s {
        RequestStatus::TimedOut => true,
        RequestStatus::Failed(e) => e.kind().is_transient() && e.kind() != ErrorKind::PeerUnavailable,
        _ => false,
    }
}

/// What the backend saw and answered, per request.
#[derive(Debug, Default, Clone)]
struct Seen {
    submitted: u32,
    last: Option<RequestStatus>,
}

fn run(s: &Script) -> Result<(), TestCaseError> {
    let mut retry = Retry::new(s.n, s.max_attempts);
    let mut seen = vec![Seen::default(); s.n];
    let mut refused: Vec<bool> = vec![false; s.n];
    let mut cancelled = false;
    let mut attempt = 0usize;
    loop {
        prop_assert!(attempt < s.max_attempts as usize, "more than {} attempts", s.max_attempts);
        prop_assert_eq!(retry.attempts() as usize, attempt + 1);
        // The backend's side: what is submitted may be submitted.
        let todo = retry.current().to_vec();
        prop_assert!(!todo.is_empty(), "an empty attempt was started");
        for &i in &todo {
            let sn = &seen[i];
            match &sn.last {
                None => prop_assert_eq!(sn.submitted, 0),
                Some(last) => prop_assert!(may_retry(last), "request {} resubmitted after {:?}", i, last),
            }
            prop_assert!(!refused[i], "request {} resubmitted after the breaker refused it", i);
            seen[i].submitted += 1;
        }
        let mut results: Vec<RequestStatus> = todo.iter().map(|&i| status(&s.answers[attempt][i])).collect();
        let reported = results.len().saturating_sub(s.short[attempt]);
        results.truncate(reported);
        // An unreported request is, to the backend, one that failed.
        for (k, &i) in todo.iter().enumerate() {
            seen[i].last = Some(
                results
                    .get(k)
                    .cloned()
                    .unwrap_or_else(|| RequestStatus::Failed(Error::new(ErrorKind::Internal, "unreported"))),
            );
        }
        // Verdicts against the rule, peer by peer.
        let full: Vec<RequestStatus> = todo.iter().map(|&i| seen[i].last.clone().unwrap()).collect();
        let v = verdicts(&todo, &full, &s.peer_of, s.peers);
        for (p, got) in v.iter().enumerate() {
            let mine: Vec<&RequestStatus> =
                todo.iter().zip(&full).filter(|(&i, _)| s.peer_of[i] == p).map(|(_, st)| st).collect();
            let failed = mine.iter().any(|st| match st {
                RequestStatus::TimedOut => true,
                RequestStatus::Failed(e) => e.kind().is_peer_failure(),
                _ => false,
            });
            let expect = if mine.is_empty() {
                None
            } else if failed {
                Some(PeerVerdict::Failed)
            } else if mine.iter().any(|st| st.is_completed()) {
                Some(PeerVerdict::Healthy)
            } else {
                Some(PeerVerdict::Unknown)
            };
            prop_assert_eq!(*got, expect, "peer {} in attempt {}", p, attempt);
        }
        let chosen = retry.ended(results).to_vec();
        // Chosen exactly: retryable answers, while attempts are left.
        let expect: Vec<usize> = todo
            .iter()
            .copied()
            .filter(|&i| attempt + 1 < s.max_attempts as usize && may_retry(seen[i].last.as_ref().unwrap()))
            .collect();
        prop_assert_eq!(&chosen, &expect);
        if chosen.is_empty() {
            prop_assert!(retry.is_over());
            break;
        }
        let b = &s.between[attempt];
        if b.cancel {
            retry.cancel();
            cancelled = true;
            prop_assert!(retry.start_next().is_none(), "an attempt started after a cancel");
            break;
        }
        for (k, &i) in chosen.iter().enumerate() {
            if b.refuse[k % b.refuse.len()] {
                retry.refuse(i, Error::new(ErrorKind::PeerUnavailable, "breaker open"));
                refused[i] = true;
            }
        }
        if retry.start_next().is_none() {
            prop_assert!(chosen.iter().all(|&i| refused[i]), "chosen requests were dropped");
            break;
        }
        attempt += 1;
    }
    prop_assert!(retry.is_over());
    let attempts = retry.attempts();
    let o = retry.finish();
    prop_assert_eq!(o.attempts, attempts);
    prop_assert!(o.attempts <= s.max_attempts);
    prop_assert_eq!(o.requests.len(), s.n);
    prop_assert_eq!(o.state, BatchState::summarize(&o.requests));
    prop_assert!(o.state != BatchState::InProgress);
    for (i, st) in o.requests.iter().enumerate() {
        let last = seen[i].last.clone().unwrap();
        prop_assert!(seen[i].submitted >= 1);
        let expect = if refused[i] {
            RequestStatus::Failed(Error::new(ErrorKind::PeerUnavailable, "breaker open"))
        } else {
            last
        };
        let expect = match expect {
            s @ RequestStatus::Completed => s,
            RequestStatus::Failed(e) if !e.is_transient() => RequestStatus::Failed(e),
            _ if cancelled => RequestStatus::Cancelled,
            s => s,
        };
        prop_assert_eq!(kind_of(st), kind_of(&expect), "request {}", i);
    }
    Ok(())
}

/// A status reduced to what the rules speak of (errors by kind).
fn kind_of(s: &RequestStatus) -> (u8, Option<ErrorKind>) {
    match s {
        RequestStatus::Pending => (0, None),
        RequestStatus::Completed => (1, None),
        RequestStatus::Failed(e) => (2, Some(e.kind())),
        RequestStatus::TimedOut => (3, None),
        RequestStatus::Cancelled => (4, None),
    }
}

proptest! {
    // RETRY_SCHEDULES=N runs N schedules (default 2048; each is cheap).
    #![proptest_config(ProptestConfig {
        cases: std::env::var("RETRY_SCHEDULES").ok().and_then(|v| v.parse().ok()).unwrap_or(2048),
        ..ProptestConfig::default()
    })]

    #[test]
    fn retries_keep_the_rules_whatever_the_backend_answers(s in script()) {
        run(&s)?;
    }
}
