//! A per-peer circuit breaker: fail fast while a peer is down, probe after
//! a cool-down, close again on success. Never a permanent blacklist.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::config::BreakerConfig;

/// What a breaker currently does with new work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BreakerState {
    /// Healthy: work flows.
    Closed,
    /// Failing: work fails fast with `PeerUnavailable` until the cool-down ends.
    Open,
    /// Cool-down over: one probe is let through; its result decides.
    HalfOpen,
}

/// The breaker of one peer, as a pure state machine over `now`.
#[derive(Debug, Clone)]
pub struct Breaker {
    state: State,
}

#[derive(Debug, Clone, Copy)]
enum State {
    Closed { failures: u32 },
    Open { until: Duration },
    HalfOpen { probing: bool },
}

/// The answer to "may I send to this peer now?".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Yes.
    Yes,
    /// Yes, as the single probe of a half-open breaker.
    Probe,
    /// No: open, or a probe is already out. Retry after this long.
    No { retry_after: Duration },
}

impl Default for Breaker {
    fn default() -> Self {
        Self { state: State::Closed { failures: 0 } }
    }
}

impl Breaker {
    /// The state as seen at `now` (an open breaker whose cool-down ended
    /// reads as half-open).
    pub fn state(&self, now: Duration) -> BreakerState {
        match self.state {
            State::Closed { .. } => BreakerState::Closed,
            State::Open { until } if now >= until => BreakerState::HalfOpen,
            State::Open { .. } => BreakerState::Open,
            State::HalfOpen { .. } => BreakerState::HalfOpen,
        }
    }

    /// Asks to send work at `now`.
    pub fn admit(&mut self, now: Duration) -> Admit {
        match self.state {
            State::Closed { .. } => Admit::Yes,
            State::Open { until } if now < until => Admit::No { retry_after: until - now },
            State::Open { .. } | State::HalfOpen { probing: false } => {
                self.state = State::HalfOpen { probing: true };
                Admit::Probe
            }
            State::HalfOpen { probing: true } => Admit::No { retry_after: Duration::ZERO },
        }
    }

    /// Work to the peer succeeded: the breaker closes.
    pub fn on_success(&mut self) {
        self.state = State::Closed { failures: 0 };
    }

    /// Work to the peer failed because of the peer (see
    /// [`transport_core::ErrorKind::is_peer_failure`]).
    pub fn on_failure(&mut self, now: Duration, cfg: &BreakerConfig) {
        self.state = match self.state {
            State::Closed { failures } if failures + 1 < cfg.failure_threshold => {
                State::Closed { failures: failures + 1 }
            }
            _ => State::Open { until: now + cfg.cooldown },
        };
    }

    /// A probe ended without a verdict (cancelled, or failed for a reason
    /// that says nothing about the peer): let another probe through.
    pub fn on_abandoned_probe(&mut self) {
        if let State::HalfOpen { probing: true } = self.state {
            self.state = State::HalfOpen { probing: false };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn opens_at_threshold_probes_after_cooldown_and_closes() {
        let cfg = BreakerConfig { failure_threshold: 3, cooldown: 10 * S };
        let mut b = Breaker::default();
        for _ in 0..2 {
            b.on_failure(S, &cfg);
            assert_eq!(b.admit(S), Admit::Yes);
        }
        b.on_failure(S, &cfg);
        assert_eq!(b.state(S), BreakerState::Open);
        assert_eq!(b.admit(2 * S), Admit::No { retry_after: 9 * S });
        assert_eq!(b.state(11 * S), BreakerState::HalfOpen);
        assert_eq!(b.admit(11 * S), Admit::Probe);
        assert!(matches!(b.admit(11 * S), Admit::No { .. }), "one probe at a time");
        b.on_success();
        assert_eq!(b.state(11 * S), BreakerState::Closed);
        assert_eq!(b.admit(11 * S), Admit::Yes);
    }

    #[test]
    fn failed_probe_reopens_and_success_resets_count() {
        let cfg = BreakerConfig { failure_threshold: 2, cooldown: S };
        let mut b = Breaker::default();
        b.on_failure(Duration::ZERO, &cfg);
        b.on_success();
        b.on_failure(Duration::ZERO, &cfg);
        assert_eq!(b.state(Duration::ZERO), BreakerState::Closed, "success reset the count");
        b.on_failure(Duration::ZERO, &cfg);
        assert_eq!(b.admit(S), Admit::Probe);
        b.on_failure(S, &cfg);
        assert_eq!(b.state(S), BreakerState::Open);
        assert_eq!(b.admit(2 * S), Admit::Probe, "never a permanent blacklist");
        b.on_abandoned_probe();
        assert_eq!(b.admit(2 * S), Admit::Probe);
    }
}
