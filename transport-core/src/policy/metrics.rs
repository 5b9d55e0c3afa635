//! The engine's metrics, through the `metrics` facade: the embedding
//! program installs a recorder (a Prometheus exporter, say) and sees them;
//! without one every call is a no-op. Names and labels are listed in
//! [`crate::Engine`]'s docs. Peer labels are bounded: the first
//! [`MAX_PEER_LABELS`] peers get their own label, the rest share
//! `peer="other"`, so a churn of peers cannot grow a scrape without bound.

use std::collections::HashSet;
use std::time::Duration;

use metrics::{counter, gauge, histogram};
use parking_lot::Mutex;

use super::breaker::BreakerState;
use crate::error::ErrorKind;
use crate::types::{BatchState, Opcode, RequestStatus, TransferRequest};

/// Distinct peers that get their own label value.
pub const MAX_PEER_LABELS: usize = 64;

/// The label value standing for every peer past [`MAX_PEER_LABELS`].
pub const OTHER_PEER: &str = "other";

/// The peers that have a label of their own.
#[derive(Debug, Default)]
pub(crate) struct PeerLabels {
    named: Mutex<HashSet<String>>,
}

impl PeerLabels {
    /// The label value for `peer`.
    pub fn of(&self, peer: &str) -> String {
        let mut named = self.named.lock();
        if named.contains(peer) {
            return peer.to_owned();
        }
        if named.len() < MAX_PEER_LABELS {
            named.insert(peer.to_owned());
            return peer.to_owned();
        }
        OTHER_PEER.to_owned()
    }
}

fn op_name(op: Opcode) -> &'static str {
    match op {
        Opcode::Read => "read",
        Opcode::Write => "write",
    }
}

fn state_name(s: BatchState) -> &'static str {
    match s {
        BatchState::InProgress => "in_progress",
        BatchState::Completed => "completed",
        BatchState::Failed => "failed",
        BatchState::TimedOut => "timed_out",
        BatchState::Cancelled => "cancelled",
    }
}

/// Requests of one transfer counted together: (operation, peer index,
/// request state).
type GroupKey = (&'static str, usize, &'static str);

/// A transfer the engine finished: bytes and requests by operation, peer
/// and final state, the transfer by final state, its latency, retries, and
/// failed requests by error kind. Counts are summed per transfer first, so
/// a large batch costs a few metric updates, not a few per request.
#[allow(clippy::too_many_arguments)]
pub(crate) fn transfer_done(
    labels: &PeerLabels,
    requests: &[TransferRequest],
    peer_of: &[usize],
    peers: &[String],
    status: &[RequestStatus],
    state: BatchState,
    attempts: u32,
    took: Duration,
) {
    // (op, peer index, request state) -> (requests, bytes); kind -> count.
    let mut groups: Vec<(GroupKey, (u64, u64))> = Vec::new();
    let mut kinds: Vec<(&'static str, u64)> = Vec::new();
    for ((r, st), &p) in requests.iter().zip(status).zip(peer_of) {
        let (st_name, kind) = match st {
            RequestStatus::Completed => ("completed", None),
            RequestStatus::Failed(e) => ("failed", Some(e.kind().as_str())),
            RequestStatus::TimedOut => ("timed_out", Some(ErrorKind::Timeout.as_str())),
            RequestStatus::Cancelled | RequestStatus::Pending => ("cancelled", None),
        };
        let key = (op_name(r.op), p, st_name);
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, (n, bytes))) => {
                *n += 1;
                *bytes = bytes.saturating_add(r.len);
            }
            None => groups.push((key, (1, r.len))),
        }
        if let Some(kind) = kind {
            match kinds.iter_mut().find(|(k, _)| *k == kind) {
                Some((_, n)) => *n += 1,
                None => kinds.push((kind, 1)),
            }
        }
    }
    for ((op, p, st), (n, bytes)) in groups {
        let peer = peers.get(p).map_or_else(|| OTHER_PEER.to_owned(), |name| labels.of(name));
        if st == "completed" {
            counter!("kvmove_bytes_total", "op" => op, "peer" => peer.clone()).increment(bytes);
        }
        counter!("kvmove_requests_total", "op" => op, "peer" => peer, "state" => st).increment(n);
    }
    for (kind, n) in kinds {
        counter!("kvmove_errors_total", "kind" => kind).increment(n);
    }
    counter!("kvmove_transfers_total", "state" => state_name(state)).increment(1);
    counter!("kvmove_retries_total").increment(u64::from(attempts.saturating_sub(1)));
    histogram!("kvmove_transfer_seconds", "state" => state_name(state)).record(took.as_secs_f64());
}

/// Time spent in one stage of a transfer: `submit` (handing a batch to
/// the backend) or `complete` (from then until its requests are terminal;
/// on the wire and waiting for the answers); `budget`, the wait for room in
/// the in-flight budget, is [`budget_wait`].
pub(crate) fn stage(stage: &'static str, took: Duration) {
    histogram!("kvmove_stage_seconds", "stage" => stage).record(took.as_secs_f64());
}

/// Time a transfer waited for room in the in-flight budget.
pub(crate) fn budget_wait(took: Duration) {
    stage("budget", took);
}

/// The in-flight budget's use now.
pub(crate) fn inflight(bytes: u64, requests: u64) {
    gauge!("kvmove_inflight_bytes").set(bytes as f64);
    gauge!("kvmove_inflight_requests").set(requests as f64);
}

/// A breaker moved from `from` to `to`.
pub(crate) fn breaker(labels: &PeerLabels, peer: &str, from: BreakerState, to: BreakerState) {
    if from == to {
        return;
    }
    let peer = labels.of(peer);
    let name = |s: BreakerState| match s {
        BreakerState::Closed => "closed",
        BreakerState::Open => "open",
        BreakerState::HalfOpen => "half_open",
    };
    counter!("kvmove_breaker_transitions_total", "peer" => peer.clone(), "to" => name(to)).increment(1);
    gauge!("kvmove_breaker_open", "peer" => peer).set(if to == BreakerState::Closed { 0.0 } else { 1.0 });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_labels_are_bounded() {
        let l = PeerLabels::default();
        for i in 0..MAX_PEER_LABELS {
            assert_eq!(l.of(&format!("p{i}")), format!("p{i}"));
        }
        assert_eq!(l.of("one-too-many"), OTHER_PEER);
        assert_eq!(l.of("p0"), "p0", "a named peer keeps its label");
    }
}
