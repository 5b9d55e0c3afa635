//! The engine's metrics, through the `metrics` facade: the embedding
//! program installs a recorder (a Prometheus exporter, say) and sees them;
//! without one every call is a no-op. Names and labels are listed in
//! [`crate::Engine`]'s docs.
//!
//! Cheap on the hot path: an engine registers its handles once, when it is
//! made (so install the recorder before making engines, as with any
//! `metrics` recorder), and a peer's handles the first time it is seen; a
//! transfer's requests are summed before they are counted, so a transfer
//! costs a few atomic additions whatever its size. Peer labels are bounded:
//! the first [`MAX_PEER_LABELS`] peers get their own label, the rest share
//! `peer="other"`, so a churn of peers cannot grow a scrape without bound.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use metrics::{counter, gauge, histogram, Counter, Gauge, Histogram};
use parking_lot::Mutex;

use super::breaker::BreakerState;
use transport_core::ErrorKind;
use transport_core::{BatchState, Opcode, RequestStatus, TransferRequest};

/// Gives the installed recorder the description of every metric the
/// engine and the sessions emit (Prometheus `# HELP`, the Python
/// collector's documentation). Call once after installing a recorder.
pub fn describe_metrics() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    describe_counter!("kvmove_bytes_total", "Bytes of completed requests, by operation and peer.");
    describe_counter!("kvmove_requests_total", "Requests finished, by operation, peer and final state.");
    describe_counter!("kvmove_transfers_total", "Transfers (batches) finished, by final state.");
    describe_counter!("kvmove_retries_total", "Transfer attempts after the first.");
    describe_counter!("kvmove_errors_total", "Failed requests, by error kind.");
    describe_counter!("kvmove_breaker_transitions_total", "Circuit breaker transitions, by peer and new state.");
    describe_gauge!("kvmove_breaker_open", "1 while a peer's circuit breaker is open or half-open, else 0.");
    describe_gauge!("kvmove_inflight_bytes", "Bytes of the in-flight budget in use.");
    describe_gauge!("kvmove_inflight_requests", "Requests of the in-flight budget in use.");
    describe_histogram!("kvmove_transfer_seconds", "Time from a transfer's start to its outcome, by final state.");
    describe_histogram!(
        "kvmove_stage_seconds",
        "Time in each stage of a transfer: budget (queued for the in-flight budget), submit (handing the batch \
         to the backend), complete (on the wire until every request is terminal)."
    );
    describe_counter!("kvmove_sessions_total", "Handoff sessions, each counted once when final, by role and state.");
    describe_histogram!("kvmove_session_landed_seconds", "Time until a handoff session's data landed, by role.");
    describe_histogram!("kvmove_session_grant_wait_seconds", "Time a sender waited for the receiver's grant.");
    describe_counter!(
        "kvmove_session_pauses_total",
        "Times this process did not run for a while (a pause): the session engine did not count the gap against any peer."
    );
    describe_counter!("kvmove_notifications_total", "Plain notifications, by direction (sent or received).");
}

/// Distinct peers that get their own label value.
pub const MAX_PEER_LABELS: usize = 64;

/// The label value standing for every peer past [`MAX_PEER_LABELS`].
pub const OTHER_PEER: &str = "other";

const OPS: [&str; 2] = ["read", "write"];
const REQUEST_STATES: [&str; 4] = ["completed", "failed", "timed_out", "cancelled"];
const BATCH_STATES: [&str; 5] = ["in_progress", "completed", "failed", "timed_out", "cancelled"];

fn op_index(op: Opcode) -> usize {
    match op {
        Opcode::Read => 0,
        Opcode::Write => 1,
    }
}

fn batch_index(s: BatchState) -> usize {
    match s {
        BatchState::InProgress => 0,
        BatchState::Completed => 1,
        BatchState::Failed => 2,
        BatchState::TimedOut => 3,
        BatchState::Cancelled => 4,
    }
}

/// One peer label's handles.
#[derive(Debug)]
struct PeerMetrics {
    label: String,
    /// By operation.
    bytes: [Counter; 2],
    /// By operation, then request state.
    requests: [[Counter; 4]; 2],
}

impl PeerMetrics {
    fn new(label: &str) -> Self {
        let l = label.to_owned();
        Self {
            label: l.clone(),
            bytes: OPS.map(|op| counter!("kvmove_bytes_total", "op" => op, "peer" => l.clone())),
            requests: OPS.map(|op| {
                REQUEST_STATES
                    .map(|st| counter!("kvmove_requests_total", "op" => op, "peer" => l.clone(), "state" => st))
            }),
        }
    }
}

/// An engine's metric handles.
#[derive(Debug)]
pub(crate) struct EngineMetrics {
    transfers: [Counter; 5],
    transfer_seconds: [Histogram; 5],
    retries: Counter,
    budget: Histogram,
    submit: Histogram,
    complete: Histogram,
    inflight_bytes: Gauge,
    inflight_requests: Gauge,
    /// Peers with a label of their own (at most [`MAX_PEER_LABELS`]), and
    /// the shared `other` label.
    peers: Mutex<HashMap<String, Arc<PeerMetrics>>>,
    other: Arc<PeerMetrics>,
    errors: Mutex<HashMap<&'static str, Counter>>,
}

impl Default for EngineMetrics {
    fn default() -> Self {
        let stage = |s: &'static str| histogram!("kvmove_stage_seconds", "stage" => s);
        Self {
            transfers: BATCH_STATES.map(|s| counter!("kvmove_transfers_total", "state" => s)),
            transfer_seconds: BATCH_STATES.map(|s| histogram!("kvmove_transfer_seconds", "state" => s)),
            retries: counter!("kvmove_retries_total"),
            budget: stage("budget"),
            submit: stage("submit"),
            complete: stage("complete"),
            inflight_bytes: gauge!("kvmove_inflight_bytes"),
            inflight_requests: gauge!("kvmove_inflight_requests"),
            peers: Mutex::new(HashMap::new()),
            other: Arc::new(PeerMetrics::new(OTHER_PEER)),
            errors: Mutex::new(HashMap::new()),
        }
    }
}

impl EngineMetrics {
    /// The handles of `peer` (its own label, or `other` past the cap).
    fn peer(&self, peer: &str) -> Arc<PeerMetrics> {
        let mut peers = self.peers.lock();
        if let Some(p) = peers.get(peer) {
            return p.clone();
        }
        if peers.len() >= MAX_PEER_LABELS {
            return self.other.clone();
        }
        let p = Arc::new(PeerMetrics::new(peer));
        peers.insert(peer.to_owned(), p.clone());
        p
    }

    /// The label value `peer` is counted under.
    pub fn peer_label(&self, peer: &str) -> String {
        self.peer(peer).label.clone()
    }

    /// A transfer the engine finished: bytes and requests by operation,
    /// peer and final state, the transfer by final state, its latency,
    /// retries, and failed requests by error kind. Counts are summed per
    /// transfer first.
    #[allow(clippy::too_many_arguments)]
    pub fn transfer_done(
        &self,
        requests: &[TransferRequest],
        peer_of: &[usize],
        peers: &[String],
        status: &[RequestStatus],
        state: BatchState,
        attempts: u32,
        took: Duration,
    ) {
        // Per peer index: [op][request state] -> requests, [op] -> bytes.
        let mut counts: Vec<([[u64; 4]; 2], [u64; 2])> = vec![([[0; 4]; 2], [0; 2]); peers.len().max(1)];
        let mut kinds: Vec<(&'static str, u64)> = Vec::new();
        for ((r, st), &p) in requests.iter().zip(status).zip(peer_of) {
            let (si, kind) = match st {
                RequestStatus::Completed => (0, None),
                RequestStatus::Failed(e) => (1, Some(e.kind().as_str())),
                RequestStatus::TimedOut => (2, Some(ErrorKind::Timeout.as_str())),
                RequestStatus::Cancelled | RequestStatus::Pending => (3, None),
            };
            let o = op_index(r.op);
            if let Some(c) = counts.get_mut(p) {
                c.0[o][si] += 1;
                if si == 0 {
                    c.1[o] = c.1[o].saturating_add(r.len);
                }
            }
            if let Some(kind) = kind {
                match kinds.iter_mut().find(|(k, _)| *k == kind) {
                    Some((_, n)) => *n += 1,
                    None => kinds.push((kind, 1)),
                }
            }
        }
        for (p, (reqs, bytes)) in counts.iter().enumerate() {
            let Some(name) = peers.get(p) else { continue };
            let m = self.peer(name);
            for o in 0..2 {
                if bytes[o] > 0 {
                    m.bytes[o].increment(bytes[o]);
                }
                for (si, &n) in reqs[o].iter().enumerate() {
                    if n > 0 {
                        m.requests[o][si].increment(n);
                    }
                }
            }
        }
        if !kinds.is_empty() {
            let mut errors = self.errors.lock();
            for (kind, n) in kinds {
                errors.entry(kind).or_insert_with(|| counter!("kvmove_errors_total", "kind" => kind)).increment(n);
            }
        }
        let b = batch_index(state);
        self.transfers[b].increment(1);
        if attempts > 1 {
            self.retries.increment(u64::from(attempts - 1));
        }
        self.transfer_seconds[b].record(took.as_secs_f64());
    }

    /// Time spent in one stage of a transfer: `budget` (waiting for room
    /// in the in-flight budget), `submit` (handing a batch to the backend)
    /// or `complete` (from then until its requests are terminal: on the
    /// wire and waiting for the answers).
    pub fn stage(&self, stage: Stage, took: Duration) {
        let h = match stage {
            Stage::Budget => &self.budget,
            Stage::Submit => &self.submit,
            Stage::Complete => &self.complete,
        };
        h.record(took.as_secs_f64());
    }

    /// The in-flight budget's use now.
    pub fn inflight(&self, bytes: u64, requests: u64) {
        self.inflight_bytes.set(bytes as f64);
        self.inflight_requests.set(requests as f64);
    }

    /// A breaker moved from `from` to `to` (rare: handles made per call).
    pub fn breaker(&self, peer: &str, from: BreakerState, to: BreakerState) {
        if from == to {
            return;
        }
        let peer = self.peer_label(peer);
        let name = |s: BreakerState| match s {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half_open",
        };
        counter!("kvmove_breaker_transitions_total", "peer" => peer.clone(), "to" => name(to)).increment(1);
        gauge!("kvmove_breaker_open", "peer" => peer).set(if to == BreakerState::Closed { 0.0 } else { 1.0 });
    }
}

/// The stages of a transfer timed in `kvmove_stage_seconds`.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Stage {
    Budget,
    Submit,
    Complete,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_labels_are_bounded() {
        let m = EngineMetrics::default();
        for i in 0..MAX_PEER_LABELS {
            assert_eq!(m.peer_label(&format!("p{i}")), format!("p{i}"));
        }
        assert_eq!(m.peer_label("one-too-many"), OTHER_PEER);
        assert_eq!(m.peer_label("p0"), "p0", "a named peer keeps its label");
    }
}
