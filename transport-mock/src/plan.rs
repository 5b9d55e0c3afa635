//! The seeded, scriptable fault plan shared by the mock backend and the
//! fault-injecting wrapper, and its runtime state (counters and the RNG).
//!
//! Counting is 1-based and in the order the transport sees events: the
//! mock counts requests as its batch tasks start them, the wrapper as they
//! are submitted. With one batch at a time the order, and therefore a run,
//! is reproducible from the plan and its `seed`.

use std::collections::HashMap;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use transport_core::{Error, ErrorKind, Opcode, Result};

/// A scripted set of faults. Every list is empty by default (no faults).
///
/// Which transport honours which field:
///
/// | field | `MockTransport` | `FaultyTransport` |
/// | --- | --- | --- |
/// | `fail_opens` | yes | yes |
/// | `fail_handshakes` | endpoint creation | (no endpoints) |
/// | `requests` | yes, no byte moves | yes, not sent to the inner transport |
/// | `stalls` | held until deadline or cancel | batch held, inner cancelled at the deadline |
/// | `reset_endpoint_after` | yes | no |
/// | `endpoint_limit` | yes | no |
/// | `segment_limit` | yes | yes |
/// | `kill_after` | kills `host` (default: this host) | kills the wrapper |
/// | `random` | yes | yes |
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FaultPlan {
    /// Seed of the random mode's `SmallRng`.
    pub seed: u64,
    /// The Nth `open_segment` calls (1-based) fail with `HandshakeFailed`.
    pub fail_opens: Vec<u64>,
    /// The Nth endpoint creations (1-based) fail with `HandshakeFailed`.
    pub fail_handshakes: Vec<u64>,
    /// Requests that fail with a chosen kind without moving a byte.
    pub requests: Vec<RequestFault>,
    /// Requests whose completion is held past their deadline (they end
    /// `TimedOut`, or `Cancelled` when cancelled; no byte moves).
    pub stalls: Vec<StallFault>,
    /// After the Nth request (1-based, counted over the host) completes, the
    /// endpoint that carried it breaks: the next request on it fails with
    /// `ConnectionReset`, mid-batch.
    pub reset_endpoint_after: Vec<u64>,
    /// Creating an endpoint while this many are live fails with
    /// `ResourceExhausted` ("Failed to create QP: Cannot allocate memory"),
    /// instead of evicting one.
    pub endpoint_limit: Option<usize>,
    /// Opening a segment while this many are open fails with
    /// `ResourceExhausted`.
    pub segment_limit: Option<usize>,
    /// Kill a host after this many requests.
    pub kill_after: Option<KillAfter>,
    /// Each request fails with probability `p`, drawn from a `SmallRng`
    /// seeded with `seed`.
    pub random: Option<RandomFaults>,
}

/// Which requests a rule applies to. Every field that is set must match;
/// an empty matcher matches every request.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RequestMatch {
    /// The Nth request (1-based, counted over the transport).
    pub nth: Option<u64>,
    /// The request at this index of its batch.
    pub index: Option<usize>,
    /// Requests to the segment with this name.
    pub segment: Option<String>,
    /// Requests to this remote address.
    pub remote_addr: Option<u64>,
    /// Requests of this direction.
    pub op: Option<Opcode>,
    /// Only the first `n` attempts of a request: attempts are counted per
    /// (segment name, remote address, length), this one included.
    pub max_attempt: Option<u32>,
}

/// Fail matching requests with `kind`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestFault {
    /// Which requests.
    #[serde(default)]
    pub when: RequestMatch,
    /// The error kind they fail with (transient or permanent).
    pub kind: ErrorKind,
    /// How many matching requests fail before the rule is spent; `None`
    /// (default): every one.
    #[serde(default)]
    pub times: Option<u32>,
}

impl RequestFault {
    /// Fails the request at `index` of every batch with `kind`, for the
    /// first `attempts` attempts of that request.
    pub fn index(index: usize, kind: ErrorKind, attempts: u32) -> Self {
        Self {
            when: RequestMatch { index: Some(index), max_attempt: Some(attempts), ..Default::default() },
            kind,
            times: None,
        }
    }

    /// Fails the request at `index` of the next batch only.
    pub fn next_batch(index: usize, kind: ErrorKind) -> Self {
        Self { when: RequestMatch { index: Some(index), ..Default::default() }, kind, times: Some(1) }
    }

    /// Fails the Nth request (1-based) with `kind`.
    pub fn nth(n: u64, kind: ErrorKind) -> Self {
        Self { when: RequestMatch { nth: Some(n), ..Default::default() }, kind, times: Some(1) }
    }
}

/// Hold matching requests past their deadline.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StallFault {
    /// Which requests.
    pub when: RequestMatch,
    /// How many matching requests stall; `None`: every one.
    pub times: Option<u32>,
}

/// Kill a host after a number of requests.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KillAfter {
    /// The host to kill (mock only); `None`: this transport itself.
    #[serde(default)]
    pub host: Option<String>,
    /// Kill right after the Nth request (1-based) was handled.
    pub requests: u64,
}

/// Random transient failures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RandomFaults {
    /// Probability (0 to 1) that a request fails.
    pub probability: f64,
    /// The kind it fails with; must be transient. Default `ConnectionReset`.
    #[serde(default = "default_random_kind")]
    pub kind: ErrorKind,
}

fn default_random_kind() -> ErrorKind {
    ErrorKind::ConnectionReset
}

impl FaultPlan {
    /// No faults.
    pub fn none() -> Self {
        Self::default()
    }

    /// Only random transient failures with probability `p` from `seed`.
    pub fn random(seed: u64, probability: f64) -> Self {
        Self { seed, random: Some(RandomFaults { probability, kind: default_random_kind() }), ..Self::default() }
    }

    /// Checks the plan; the error names the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, why: &str| Err(Error::new(ErrorKind::Config, format!("fault_plan.{field}: {why}")));
        if self.fail_opens.contains(&0) || self.fail_handshakes.contains(&0) || self.reset_endpoint_after.contains(&0) {
            return bad("fail_opens/fail_handshakes/reset_endpoint_after", "counts start at 1");
        }
        if let Some(r) = &self.random {
            if !(0.0..=1.0).contains(&r.probability) {
                return bad("random.probability", "must be between 0 and 1");
            }
            if !r.kind.is_transient() {
                return bad("random.kind", "must be a transient kind");
            }
        }
        if matches!(&self.kill_after, Some(k) if k.requests == 0) {
            return bad("kill_after.requests", "counts start at 1");
        }
        Ok(())
    }
}

/// What the plan says about one request.
#[derive(Debug, Default)]
pub(crate) struct Decision {
    /// Fail it with this error, moving no byte.
    pub fail: Option<Error>,
    /// Hold it past its deadline.
    pub stall: bool,
    /// Break the endpoint that carried it, once it is done.
    pub reset_after: bool,
    /// Kill this host (`Some(None)`) or a named one, once it is done.
    pub kill: Option<Option<String>>,
}

/// The facts a rule matches on.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RequestInfo<'a> {
    pub segment: &'a str,
    pub index: usize,
    pub op: Opcode,
    pub remote_addr: u64,
    pub len: u64,
}

/// A plan plus its counters and RNG.
#[derive(Debug)]
pub(crate) struct FaultState {
    plan: FaultPlan,
    rng: SmallRng,
    opens: u64,
    handshakes: u64,
    requests: u64,
    spent: Vec<u32>,
    stalls_spent: Vec<u32>,
    attempts: HashMap<(String, u64, u64), u32>,
}

impl FaultState {
    pub fn new(plan: FaultPlan) -> Self {
        let rng = SmallRng::seed_from_u64(plan.seed);
        let spent = vec![0; plan.requests.len()];
        let stalls_spent = vec![0; plan.stalls.len()];
        Self { plan, rng, opens: 0, handshakes: 0, requests: 0, spent, stalls_spent, attempts: HashMap::new() }
    }

    pub fn plan(&self) -> &FaultPlan {
        &self.plan
    }

    /// Counts an `open_segment`; an error if the plan fails this one.
    pub fn on_open(&mut self, name: &str, open_now: usize) -> Option<Error> {
        self.opens += 1;
        if self.plan.fail_opens.contains(&self.opens) {
            return Some(
                Error::new(ErrorKind::HandshakeFailed, format!("injected: open #{} failed its handshake", self.opens))
                    .with("segment", name),
            );
        }
        match self.plan.segment_limit {
            Some(limit) if open_now >= limit => Some(
                Error::new(ErrorKind::ResourceExhausted, format!("injected: segment limit {limit} reached"))
                    .with("segment", name),
            ),
            _ => None,
        }
    }

    /// Counts an endpoint creation; an error if the plan refuses it.
    pub fn on_handshake(&mut self, peer: &str, live: usize) -> Option<Error> {
        if let Some(limit) = self.plan.endpoint_limit {
            if live >= limit {
                return Some(
                    Error::new(ErrorKind::ResourceExhausted, "Failed to create QP: Cannot allocate memory")
                        .with("peer", peer)
                        .with("live_endpoints", live),
                );
            }
        }
        self.handshakes += 1;
        if self.plan.fail_handshakes.contains(&self.handshakes) {
            return Some(
                Error::new(ErrorKind::HandshakeFailed, format!("injected: handshake #{} failed", self.handshakes))
                    .with("peer", peer),
            );
        }
        None
    }

    /// Counts a request and decides its fate.
    pub fn on_request(&mut self, info: RequestInfo<'_>) -> Decision {
        self.requests += 1;
        let n = self.requests;
        let attempt = {
            let a = self.attempts.entry((info.segment.to_string(), info.remote_addr, info.len)).or_default();
            *a = a.saturating_add(1);
            *a
        };
        let mut d = Decision::default();
        for (rule, spent) in self.plan.requests.iter().zip(self.spent.iter_mut()) {
            if rule.times.is_some_and(|t| *spent >= t) || !matches(&rule.when, n, attempt, &info) {
                continue;
            }
            *spent += 1;
            d.fail = Some(
                Error::new(rule.kind, format!("injected: request #{n} failed"))
                    .with("segment", info.segment)
                    .with("remote_addr", info.remote_addr)
                    .with("attempt", attempt),
            );
            break;
        }
        if d.fail.is_none() {
            for (rule, spent) in self.plan.stalls.iter().zip(self.stalls_spent.iter_mut()) {
                if rule.times.is_some_and(|t| *spent >= t) || !matches(&rule.when, n, attempt, &info) {
                    continue;
                }
                *spent += 1;
                d.stall = true;
                break;
            }
        }
        if let Some(r) = &self.plan.random {
            // Always draw, so the sequence depends only on the request count.
            let x: f64 = self.rng.gen();
            if d.fail.is_none() && !d.stall && x < r.probability {
                d.fail = Some(
                    Error::new(r.kind, format!("injected: random failure of request #{n}"))
                        .with("segment", info.segment)
                        .with("remote_addr", info.remote_addr),
                );
            }
        }
        d.reset_after = self.plan.reset_endpoint_after.contains(&n);
        if let Some(k) = &self.plan.kill_after {
            if k.requests == n {
                d.kill = Some(k.host.clone());
            }
        }
        d
    }
}

fn matches(m: &RequestMatch, n: u64, attempt: u32, info: &RequestInfo<'_>) -> bool {
    unset_or(m.nth, |x| x == n)
        && unset_or(m.index, |x| x == info.index)
        && unset_or(m.segment.as_deref(), |x| x == info.segment)
        && unset_or(m.remote_addr, |x| x == info.remote_addr)
        && unset_or(m.op, |x| x == info.op)
        && unset_or(m.max_attempt, |x| attempt <= x)
}

/// True when the matcher field is unset or `f` holds for it.
fn unset_or<T>(v: Option<T>, f: impl FnOnce(T) -> bool) -> bool {
    match v {
        Some(x) => f(x),
        None => true,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn info(index: usize) -> RequestInfo<'static> {
        RequestInfo { segment: "b", index, op: Opcode::Write, remote_addr: 4096 + index as u64, len: 8 }
    }

    #[test]
    fn random_mode_is_reproducible() {
        let run = |seed| {
            let mut s = FaultState::new(FaultPlan::random(seed, 0.3));
            (0..200).map(|_| s.on_request(info(0)).fail.is_some()).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
        let failed = run(7).iter().filter(|f| **f).count();
        assert!((30..90).contains(&failed), "{failed}");
    }

    #[test]
    fn attempts_and_times_are_counted() {
        let plan =
            FaultPlan { requests: vec![RequestFault::index(1, ErrorKind::ConnectionReset, 2)], ..FaultPlan::default() };
        let mut s = FaultState::new(plan);
        assert!(s.on_request(info(0)).fail.is_none());
        assert!(s.on_request(info(1)).fail.is_some());
        assert!(s.on_request(info(1)).fail.is_some());
        assert!(s.on_request(info(1)).fail.is_none(), "third attempt passes");
        let mut s = FaultState::new(FaultPlan { fail_opens: vec![2], segment_limit: Some(3), ..FaultPlan::default() });
        assert!(s.on_open("b", 0).is_none());
        assert_eq!(s.on_open("b", 1).unwrap().kind(), ErrorKind::HandshakeFailed);
        assert_eq!(s.on_open("b", 3).unwrap().kind(), ErrorKind::ResourceExhausted);
    }

    #[test]
    fn plan_round_trips_and_validates() {
        let plan = FaultPlan {
            requests: vec![RequestFault::nth(3, ErrorKind::AccessDenied)],
            kill_after: Some(KillAfter { host: Some("b".into()), requests: 5 }),
            ..FaultPlan::random(1, 0.5)
        };
        let s = serde_json::to_string(&plan).unwrap();
        assert_eq!(serde_json::from_str::<FaultPlan>(&s).unwrap(), plan);
        assert!(FaultPlan::random(1, 1.5).validate().is_err());
        let mut p = FaultPlan::random(1, 0.5);
        p.random = Some(RandomFaults { probability: 0.5, kind: ErrorKind::OutOfBounds });
        assert!(p.validate().is_err());
    }
}
