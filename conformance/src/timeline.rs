//! When things happened in a case, for failure messages that say when: a
//! byte mismatch names the last terminal state the case saw and how long
//! before the check it was reported; a hang names the limit and what the
//! batch looked like when it ran out.
//!
//! Each case body runs inside [`scope`] (a tokio task-local, so cases run
//! side by side on their own threads never mix); the helpers of
//! [`crate::ctx`] record each terminal status they see. Outside a case's
//! own task (a task it spawned) nothing is recorded and messages say less.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use transport_core::{BatchId, BatchState, BatchStatus, RequestStatus};

/// The hang limit's environment variable: seconds, 1 to 3600 (default 20).
pub const WAIT_ENV: &str = "CONFORMANCE_WAIT_S";

/// The longest a single `wait`, `cancel`, `close` or `shutdown` may take
/// before the case counts it as hanging: [`crate::WAIT_LIMIT`], or
/// [`WAIT_ENV`] seconds when set (to iterate faster on a transport that
/// hangs; a value out of range or not a number is ignored, with a line on
/// stderr once).
pub fn wait_limit() -> Duration {
    static LIMIT: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(|| match std::env::var(WAIT_ENV) {
        Err(_) => crate::WAIT_LIMIT,
        Ok(v) => match v.trim().parse::<u64>() {
            Ok(s) if (1..=3600).contains(&s) => Duration::from_secs(s),
            _ => {
                eprintln!(
                    "conformance: {WAIT_ENV}={v:?} is not a number of seconds from 1 to 3600; using {:?}",
                    crate::WAIT_LIMIT
                );
                crate::WAIT_LIMIT
            }
        },
    })
}

struct Timeline {
    start: Instant,
    last_terminal: Mutex<Option<(Instant, BatchId, BatchState)>>,
}

tokio::task_local! {
    static TIMELINE: Arc<Timeline>;
}

/// Runs a case body with a timeline of its own.
pub(crate) fn scope<F: Future>(body: F) -> impl Future<Output = F::Output> {
    TIMELINE.scope(Arc::new(Timeline { start: Instant::now(), last_terminal: Mutex::new(None) }), body)
}

/// Records a status a helper saw, if it is terminal.
pub(crate) fn saw(batch: BatchId, status: &BatchStatus) {
    if status.is_terminal() {
        let now = Instant::now();
        let _ = TIMELINE.try_with(|t| *t.last_terminal.lock() = Some((now, batch, status.state)));
    }
}

/// "{batch} was reported {state} {d} before this check ({t} into the case)",
/// when the case saw a terminal state.
pub(crate) fn last_terminal(check: Instant) -> Option<String> {
    TIMELINE
        .try_with(|t| {
            t.last_terminal.lock().map(|(at, batch, state)| {
                format!(
                    "{batch} was reported {state:?} {:.3?} before this check ({:.3?} into the case)",
                    check.saturating_duration_since(at),
                    at.saturating_duration_since(t.start)
                )
            })
        })
        .ok()
        .flatten()
}

/// How long into the case `at` is (for hang messages).
pub(crate) fn into_case(at: Instant) -> Option<Duration> {
    TIMELINE.try_with(|t| at.saturating_duration_since(t.start)).ok()
}

/// One line on a batch's status: its state and how many requests are in
/// each state, with the first error.
pub(crate) fn describe(status: &BatchStatus) -> String {
    let (mut done, mut failed, mut timed_out, mut cancelled, mut pending) = (0, 0, 0, 0, 0);
    for r in &status.requests {
        match r {
            RequestStatus::Completed => done += 1,
            RequestStatus::Failed(_) => failed += 1,
            RequestStatus::TimedOut => timed_out += 1,
            RequestStatus::Cancelled => cancelled += 1,
            RequestStatus::Pending => pending += 1,
        }
    }
    let mut s = format!(
        "{:?}: {} requests, {done} completed, {pending} not ended, {failed} failed, {timed_out} timed out, \
         {cancelled} cancelled",
        status.state,
        status.requests.len()
    );
    if let Some(e) = status.first_error() {
        s.push_str(&format!(" (first error: {e})"));
    }
    s
}
