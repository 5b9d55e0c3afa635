//! A per-peer circuit breaker: fail fast while a peer is down, probe after
//! a cool-down (and, between, one call per probe interval), close again on
//! success. Never a permanent blacklist.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::config::BreakerConfig;

/// What a breaker currently does with new work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BreakerState {
    /// Healthy: work flows.
    Closed,
    /// Failing: work fails fast with `PeerUnavailable` until the cool-down
    /// ends, except one call per `probe_interval`, which probes the peer.
    Open,
    /// Cool-down over: one probe is let through; its result decides.
    HalfOpen,
}

/// The breaker of one peer, as a pure state machine over `now`.
#[derive(Debug, Clone)]
pub struct Breaker {
    state: State,
    /// Whether the peer's host itself refused the last try (nothing
    /// listens there): a try costs one refused connect, so an open
    /// breaker lets calls probe every `cfg.refused_probe_interval`.
    refused: bool,
}

#[derive(Debug, Clone, Copy)]
enum State {
    Closed {
        failures: u32,
    },
    /// `last_probe`: when the peer was last tried (the failure that opened
    /// the breaker, a call's probe, a background probe).
    Open {
        until: Duration,
        last_probe: Duration,
    },
    /// `reopen`: for a probe let through before the cool-down ended, the
    /// cool-down's end, which its failure does not move.
    HalfOpen {
        probing: bool,
        reopen: Option<Duration>,
    },
}

/// The answer to "may I send to this peer now?".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Yes.
    Yes,
    /// Yes, as the single probe of a half-open breaker (or of an open one
    /// whose last probe is older than the probe interval).
    Probe,
    /// No: open, or a probe is already out. Retry after this long.
    No { retry_after: Duration },
}

impl Default for Breaker {
    fn default() -> Self {
        Self { state: State::Closed { failures: 0 }, refused: false }
    }
}

impl Breaker {
    /// The state as seen at `now` (an open breaker whose cool-down ended
    /// reads as half-open; one probed by a call before then, as open).
    pub fn state(&self, now: Duration) -> BreakerState {
        match self.state {
            State::Closed { .. } => BreakerState::Closed,
            State::Open { until, .. } | State::HalfOpen { reopen: Some(until), .. } if now < until => {
                BreakerState::Open
            }
            State::Open { .. } | State::HalfOpen { .. } => BreakerState::HalfOpen,
        }
    }

    /// Asks to send work at `now`. An open breaker lets one call through
    /// as a probe once its cool-down ended, or earlier when the peer was
    /// last tried at least `cfg.probe_interval` ago (`cfg.refused_probe_interval`
    /// when its host refused that try): a peer that came back is found by
    /// the first call after it did, and a dead one costs at most one
    /// call's attempt per interval.
    pub fn admit(&mut self, now: Duration, cfg: &BreakerConfig) -> Admit {
        match self.state {
            State::Closed { .. } => Admit::Yes,
            State::Open { until, .. } if now >= until => {
                self.state = State::HalfOpen { probing: true, reopen: None };
                Admit::Probe
            }
            State::Open { until, last_probe } => {
                let next = last_probe.saturating_add(self.interval(cfg));
                if now >= next {
                    self.state = State::HalfOpen { probing: true, reopen: Some(until) };
                    Admit::Probe
                } else {
                    Admit::No { retry_after: next.min(until).saturating_sub(now) }
                }
            }
            State::HalfOpen { probing: false, reopen } => {
                self.state = State::HalfOpen { probing: true, reopen };
                Admit::Probe
            }
            State::HalfOpen { probing: true, .. } => Admit::No { retry_after: Duration::ZERO },
        }
    }

    /// How long after a try of an open breaker's peer a call may probe it.
    fn interval(&self, cfg: &BreakerConfig) -> Duration {
        if self.refused {
            cfg.refused_probe_interval.min(cfg.probe_interval)
        } else {
            cfg.probe_interval
        }
    }

    /// Whether the peer's host refused the last try recorded (by a
    /// failure or a probe; a success clears it).
    pub fn refused(&self) -> bool {
        self.refused
    }

    /// Whether a call let through as the probe is out and its verdict not
    /// in yet (calls meanwhile are answered [`Admit::No`] with no wait).
    pub fn probing(&self) -> bool {
        matches!(self.state, State::HalfOpen { probing: true, .. })
    }

    /// The peer was tried at `now` outside [`admit`](Self::admit) (the
    /// background prober, `Engine::probe`): an open breaker counts its
    /// probe interval from here (`refused`: its host refused the probe).
    pub fn on_probe(&mut self, now: Duration, refused: bool) {
        if let State::Open { until, .. } = self.state {
            self.state = State::Open { until, last_probe: now };
            self.refused = refused;
        }
    }

    /// Work to the peer succeeded: the breaker closes.
    pub fn on_success(&mut self) {
        self.state = State::Closed { failures: 0 };
        self.refused = false;
    }

    /// Work to the peer failed because of the peer (see
    /// [`transport_core::ErrorKind::is_peer_failure`]). A probe let
    /// through before the cool-down ended leaves the cool-down as it was.
    /// `refused`: the peer's host refused the connection itself
    /// ([`transport_core::Error::nothing_listens`]).
    pub fn on_failure(&mut self, now: Duration, cfg: &BreakerConfig, refused: bool) {
        self.refused = refused;
        self.state = match self.state {
            State::Closed { failures } if failures.saturating_add(1) < cfg.failure_threshold => {
                State::Closed { failures: failures + 1 }
            }
            State::HalfOpen { reopen: Some(until), .. } => State::Open { until, last_probe: now },
            _ => State::Open { until: now.saturating_add(cfg.cooldown), last_probe: now },
        };
    }

    /// A probe ended without a verdict (cancelled, or failed for a reason
    /// that says nothing about the peer): let another probe through (for
    /// one before the cool-down's end: after the probe interval).
    pub fn on_abandoned_probe(&mut self, now: Duration) {
        match self.state {
            State::HalfOpen { probing: true, reopen: None } => {
                self.state = State::HalfOpen { probing: false, reopen: None }
            }
            State::HalfOpen { probing: true, reopen: Some(until) } => {
                self.state = State::Open { until, last_probe: now }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn opens_at_threshold_probes_after_cooldown_and_closes() {
        let cfg =
            BreakerConfig { failure_threshold: 3, cooldown: 10 * S, probe_interval: 10 * S, refused_probe_interval: S };
        let mut b = Breaker::default();
        for _ in 0..2 {
            b.on_failure(S, &cfg, false);
            assert_eq!(b.admit(S, &cfg), Admit::Yes);
        }
        b.on_failure(S, &cfg, false);
        assert_eq!(b.state(S), BreakerState::Open);
        assert_eq!(b.admit(2 * S, &cfg), Admit::No { retry_after: 9 * S });
        assert_eq!(b.state(11 * S), BreakerState::HalfOpen);
        assert_eq!(b.admit(11 * S, &cfg), Admit::Probe);
        assert!(matches!(b.admit(11 * S, &cfg), Admit::No { .. }), "one probe at a time");
        b.on_success();
        assert_eq!(b.state(11 * S), BreakerState::Closed);
        assert_eq!(b.admit(11 * S, &cfg), Admit::Yes);
    }

    #[test]
    fn failed_probe_reopens_and_success_resets_count() {
        let cfg = BreakerConfig { failure_threshold: 2, cooldown: S, probe_interval: S, refused_probe_interval: S };
        let mut b = Breaker::default();
        b.on_failure(Duration::ZERO, &cfg, false);
        b.on_success();
        b.on_failure(Duration::ZERO, &cfg, false);
        assert_eq!(b.state(Duration::ZERO), BreakerState::Closed, "success reset the count");
        b.on_failure(Duration::ZERO, &cfg, false);
        assert_eq!(b.admit(S, &cfg), Admit::Probe);
        b.on_failure(S, &cfg, false);
        assert_eq!(b.state(S), BreakerState::Open);
        assert_eq!(b.admit(2 * S, &cfg), Admit::Probe, "never a permanent blacklist");
        b.on_abandoned_probe(2 * S);
        assert_eq!(b.admit(2 * S, &cfg), Admit::Probe);
    }

    /// Issue 55 item 3: between cool-downs, one call per probe interval
    /// goes through as the probe (counted from the last time the peer was
    /// tried, by a call or in the background); its failure does not move
    /// the cool-down's end, its success closes the breaker.
    #[test]
    fn an_open_breaker_lets_one_call_probe_per_interval() {
        let ms = Duration::from_millis;
        let cfg = BreakerConfig {
            failure_threshold: 1,
            cooldown: 10 * S,
            probe_interval: ms(100),
            refused_probe_interval: ms(100),
        };
        let mut b = Breaker::default();
        b.on_failure(S, &cfg, false);
        assert_eq!(b.state(S), BreakerState::Open);
        assert_eq!(b.admit(S + ms(99), &cfg), Admit::No { retry_after: ms(1) }, "the opening failure was a try");
        assert_eq!(b.admit(S + ms(100), &cfg), Admit::Probe);
        assert_eq!(b.state(S + ms(100)), BreakerState::Open, "a call's probe leaves it open until it answers");
        assert_eq!(b.admit(S + ms(100), &cfg), Admit::No { retry_after: Duration::ZERO }, "one probe at a time");
        b.on_failure(S + ms(150), &cfg, false);
        assert_eq!(b.state(S + ms(150)), BreakerState::Open);
        assert_eq!(b.admit(S + ms(249), &cfg), Admit::No { retry_after: ms(1) }, "counted from the probe's end");
        b.on_probe(S + ms(240), false);
        assert_eq!(b.admit(S + ms(300), &cfg), Admit::No { retry_after: ms(40) }, "a background probe counts");
        assert_eq!(b.state(11 * S), BreakerState::HalfOpen, "the failed early probe kept the cool-down's end");
        // Abandoned: the next call may probe one interval later.
        assert_eq!(b.admit(S + ms(340), &cfg), Admit::Probe);
        b.on_abandoned_probe(S + ms(350));
        assert_eq!(b.state(S + ms(350)), BreakerState::Open);
        assert!(matches!(b.admit(S + ms(400), &cfg), Admit::No { .. }));
        assert_eq!(b.admit(S + ms(450), &cfg), Admit::Probe);
        b.on_success();
        assert_eq!(b.admit(S + ms(450), &cfg), Admit::Yes);
        // An interval as long as the cool-down: only the cool-down's probe.
        let slow = BreakerConfig { probe_interval: 10 * S, ..cfg };
        b.on_failure(20 * S, &slow, false);
        assert!(matches!(b.admit(29 * S, &slow), Admit::No { .. }));
        assert_eq!(b.admit(30 * S, &slow), Admit::Probe);
    }

    /// Issue 55 item 3: a peer whose host refused the last try (nothing
    /// listens: killed, or restarting) is probed every
    /// `refused_probe_interval`, a try that timed out or broke every
    /// `probe_interval`; the shorter interval never exceeds the longer.
    #[test]
    fn a_refusing_host_is_probed_at_the_shorter_interval() {
        let ms = Duration::from_millis;
        let cfg = BreakerConfig {
            failure_threshold: 1,
            cooldown: 10 * S,
            probe_interval: ms(100),
            refused_probe_interval: ms(1),
        };
        let mut b = Breaker::default();
        b.on_failure(S, &cfg, true);
        assert_eq!(b.state(S), BreakerState::Open);
        assert_eq!(b.admit(S, &cfg), Admit::No { retry_after: ms(1) }, "the refusal that opened it was a try");
        assert_eq!(b.admit(S + ms(1), &cfg), Admit::Probe);
        b.on_failure(S + ms(1), &cfg, true);
        assert_eq!(b.admit(S + ms(2), &cfg), Admit::Probe, "refused again: one millisecond on");
        // The probe timed out: the peer's host no longer answers.
        b.on_failure(S + ms(500), &cfg, false);
        assert_eq!(b.admit(S + ms(501), &cfg), Admit::No { retry_after: ms(99) });
        // The background prober was refused: the short interval again.
        b.on_probe(S + ms(550), true);
        assert_eq!(b.admit(S + ms(551), &cfg), Admit::Probe);
        b.on_success();
        // A success forgets the refusal: the next opening failure timed out.
        b.on_failure(2 * S, &cfg, false);
        assert!(matches!(b.admit(2 * S + ms(50), &cfg), Admit::No { .. }));
        // Never longer than the probe interval.
        let odd = BreakerConfig { refused_probe_interval: S, ..cfg };
        b.on_failure(3 * S, &odd, true);
        assert_eq!(b.admit(3 * S + ms(100), &odd), Admit::Probe);
    }
}
