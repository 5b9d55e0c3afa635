//! The one configuration of the policy layer, with documented defaults.
//!
//! Durations are written in milliseconds (`*_ms` keys) in TOML and JSON:
//!
//! ```toml
//! [retry]
//! max_attempts = 4
//! initial_backoff_ms = 20
//! ```

use std::time::Duration;

use serde::{Deserialize, Serialize};

use transport_core::{Error, ErrorKind, Result};

/// Everything the policy layer decides, in one place (rule 8).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyConfig {
    pub retry: RetryConfig,
    pub deadline: DeadlineConfig,
    pub breaker: BreakerConfig,
    pub backpressure: BackpressureConfig,
    pub wait: WaitConfig,
}

impl PolicyConfig {
    /// Checks every field; the error names the field and the reason.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, why: &str| Err(Error::new(ErrorKind::Config, format!("policy.{field}: {why}")));
        if self.retry.max_attempts == 0 {
            return bad("retry.max_attempts", "must be at least 1 (1 means no retry)");
        }
        if !(self.retry.multiplier >= 1.0 && self.retry.multiplier.is_finite()) {
            return bad("retry.multiplier", "must be a finite number >= 1.0");
        }
        if !(0.0..=1.0).contains(&self.retry.jitter) {
            return bad("retry.jitter", "must be between 0.0 and 1.0");
        }
        if self.retry.initial_backoff > self.retry.max_backoff {
            return bad("retry.initial_backoff_ms", "must not exceed retry.max_backoff_ms");
        }
        if self.breaker.failure_threshold == 0 {
            return bad("breaker.failure_threshold", "must be at least 1");
        }
        let b = &self.backpressure;
        if b.max_inflight_bytes == 0 || b.max_inflight_requests == 0 {
            return bad("backpressure.max_inflight_*", "must be greater than 0");
        }
        if b.per_peer_inflight_bytes == 0 || b.per_peer_inflight_requests == 0 {
            return bad("backpressure.per_peer_inflight_*", "must be greater than 0");
        }
        self.wait.validate().or_else(|why| bad(why.0, why.1))
    }
}

/// How a caller's wait for a transfer spends its time (rule 6: a caller
/// that polls makes progress itself): what every binding's blocking wait
/// and polling call follow. Microseconds (`*_us` keys).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WaitConfig {
    /// How long a blocking wait polls on the caller's thread before it
    /// sleeps until woken. Default 50; 0: it never polls; at most 10,000.
    /// The Python APIs take `KVMOVE_SPIN_US` in its place.
    pub spin_us: u64,
    /// Two polls of one running transfer closer together than this mean
    /// the caller spins on it (NIXL's callers loop on
    /// `check_xfer_state`); such a poll may wait a little, so a spinning
    /// caller does not take a CPU from the engine's threads. Default 500.
    pub spinning_gap_us: u64,
    /// A transfer younger than this is polled without waiting: a small one
    /// ends within it, and its poller learns the end without a wake-up.
    /// Default 250.
    pub fresh_us: u64,
    /// How long a spinning caller's poll waits for the end (it returns as
    /// soon as the transfer ended) before it answers "still running".
    /// Default 1,000; at most 100,000.
    pub spinner_wait_us: u64,
}

impl Default for WaitConfig {
    fn default() -> Self {
        Self { spin_us: 50, spinning_gap_us: 500, fresh_us: 250, spinner_wait_us: 1000 }
    }
}

impl WaitConfig {
    /// The most [`WaitConfig::spin_us`] may be.
    pub const MAX_SPIN_US: u64 = 10_000;
    /// The most [`WaitConfig::spinner_wait_us`] may be.
    pub const MAX_SPINNER_WAIT_US: u64 = 100_000;

    /// The field and the reason of the first bad value.
    fn validate(&self) -> std::result::Result<(), (&'static str, &'static str)> {
        if self.spin_us > Self::MAX_SPIN_US {
            return Err(("wait.spin_us", "must be at most 10000 (10 ms)"));
        }
        if self.spinner_wait_us > Self::MAX_SPINNER_WAIT_US {
            return Err(("wait.spinner_wait_us", "must be at most 100000 (100 ms)"));
        }
        if self.spinning_gap_us > 1_000_000 || self.fresh_us > 1_000_000 {
            return Err(("wait.spinning_gap_us / wait.fresh_us", "must be at most 1000000 (1 s)"));
        }
        Ok(())
    }

    /// [`WaitConfig::spin_us`] as a duration.
    pub fn spin(&self) -> Duration {
        Duration::from_micros(self.spin_us)
    }

    /// [`WaitConfig::spinning_gap_us`] as a duration.
    pub fn spinning_gap(&self) -> Duration {
        Duration::from_micros(self.spinning_gap_us)
    }

    /// [`WaitConfig::fresh_us`] as a duration.
    pub fn fresh(&self) -> Duration {
        Duration::from_micros(self.fresh_us)
    }

    /// [`WaitConfig::spinner_wait_us`] as a duration.
    pub fn spinner_wait(&self) -> Duration {
        Duration::from_micros(self.spinner_wait_us)
    }
}

/// Retry of failed requests (only the failed ones, only transient errors).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetryConfig {
    /// Total attempts per request including the first. Default 4; 1 disables retry.
    pub max_attempts: u32,
    /// Backoff before the second attempt. Default 20 ms.
    #[serde(rename = "initial_backoff_ms", with = "transport_core::serde_ms")]
    pub initial_backoff: Duration,
    /// Cap on the backoff. Default 2 s.
    #[serde(rename = "max_backoff_ms", with = "transport_core::serde_ms")]
    pub max_backoff: Duration,
    /// Growth factor per attempt. Default 2.0.
    pub multiplier: f64,
    /// Random spread, as a fraction of the backoff (0.2 = ±20 %), so many
    /// clients that failed together do not retry together. Default 0.2.
    pub jitter: f64,
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self {
            max_attempts: 4,
            initial_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_secs(2),
            multiplier: 2.0,
            jitter: 0.2,
        }
    }
}

/// How long one attempt of a batch may take: `base + per_mib * MiB`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DeadlineConfig {
    /// Fixed allowance per attempt (connection setup, round trips). Default 5 s.
    #[serde(rename = "base_ms", with = "transport_core::serde_ms")]
    pub base: Duration,
    /// Allowance per MiB of the attempt's bytes. Default 50 ms (20 MiB/s
    /// floor, far below any healthy link, so only stalls trip it).
    #[serde(rename = "per_mib_ms", with = "transport_core::serde_ms")]
    pub per_mib: Duration,
}

impl Default for DeadlineConfig {
    fn default() -> Self {
        Self { base: Duration::from_secs(5), per_mib: Duration::from_millis(50) }
    }
}

impl DeadlineConfig {
    /// The deadline for an attempt moving `bytes` bytes.
    pub fn for_bytes(&self, bytes: u64) -> Duration {
        let mib = bytes as f64 / (1024.0 * 1024.0);
        self.base + self.per_mib.mul_f64(mib)
    }
}

/// The per-peer circuit breaker. Never a permanent blacklist.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BreakerConfig {
    /// Consecutive failed attempts to one peer that open its breaker. Default 5.
    pub failure_threshold: u32,
    /// Time an open breaker fails fast before letting one probe through. Default 2 s.
    #[serde(rename = "cooldown_ms", with = "transport_core::serde_ms")]
    pub cooldown: Duration,
    /// Within the cool-down, a call to the peer goes through as a probe
    /// (one attempt) when the peer was last tried at least this long ago
    /// (by a call, the failure that opened the breaker, or the background
    /// prober), so the first call after a restart succeeds; every other
    /// call fails fast. Default 100 ms; as long as `cooldown`, only the
    /// cool-down's probe.
    #[serde(rename = "probe_interval_ms", with = "transport_core::serde_ms")]
    pub probe_interval: Duration,
    /// The probe interval after a try that the peer's host refused itself
    /// (nothing listens on the port: the peer was killed or is
    /// restarting). Such a try is one refused connect, no handshake and no
    /// timeout, so calls probe more often and the first call a
    /// millisecond after the peer listens again finds it. Default 1 ms
    /// (a dead peer's host answers at most a thousand connects a second
    /// per engine); never longer than `probe_interval`.
    #[serde(rename = "refused_probe_interval_ms", with = "transport_core::serde_ms")]
    pub refused_probe_interval: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            failure_threshold: 5,
            cooldown: Duration::from_secs(2),
            probe_interval: Duration::from_millis(100),
            refused_probe_interval: Duration::from_millis(1),
        }
    }
}

/// Bounds on work in flight. A batch larger than a bound on its own is
/// admitted when nothing else is in flight (so it is never stuck forever).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BackpressureConfig {
    /// Bytes in flight across all peers. Default 8 GiB.
    pub max_inflight_bytes: u64,
    /// Requests in flight across all peers. Default 1,048,576.
    pub max_inflight_requests: u64,
    /// Bytes in flight to one peer. Default 2 GiB.
    pub per_peer_inflight_bytes: u64,
    /// Requests in flight to one peer. Default 262,144.
    pub per_peer_inflight_requests: u64,
    /// How long [`crate::Engine::notify`] keeps offering a notification
    /// to a peer whose inbox is full (it answered busy and queued nothing,
    /// so offering again cannot deliver it twice). Default 5 s.
    #[serde(rename = "notify_patience_ms", with = "transport_core::serde_ms")]
    pub notify_patience: Duration,
}

impl Default for BackpressureConfig {
    fn default() -> Self {
        Self {
            max_inflight_bytes: 8 << 30,
            max_inflight_requests: 1 << 20,
            per_peer_inflight_bytes: 2 << 30,
            per_peer_inflight_requests: 1 << 18,
            notify_patience: Duration::from_secs(5),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_round_trip() {
        let c = PolicyConfig::default();
        c.validate().unwrap();
        let s = toml::to_string(&c).unwrap();
        assert!(s.contains("initial_backoff_ms = 20"), "{s}");
        let back: PolicyConfig = toml::from_str(&s).unwrap();
        assert_eq!(back, c);
    }

    #[test]
    fn partial_toml_keeps_defaults_and_unknown_keys_fail() {
        let c: PolicyConfig = toml::from_str("[retry]\nmax_attempts = 2\n").unwrap();
        assert_eq!(c.retry.max_attempts, 2);
        assert_eq!(c.breaker, BreakerConfig::default());
        let err = toml::from_str::<PolicyConfig>("[retry]\nmax_attempt = 2\n").unwrap_err();
        assert!(err.to_string().contains("max_attempt"), "{err}");
    }

    #[test]
    fn bad_values_name_the_field() {
        let mut c = PolicyConfig::default();
        c.retry.max_attempts = 0;
        let e = c.validate().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.to_string().contains("retry.max_attempts"));
    }

    #[test]
    fn the_wait_policy_is_read_and_bounded() {
        let c: PolicyConfig = toml::from_str("[wait]\nspin_us = 0\nspinner_wait_us = 200\n").unwrap();
        c.validate().unwrap();
        assert_eq!((c.wait.spin(), c.wait.spinner_wait()), (Duration::ZERO, Duration::from_micros(200)));
        assert_eq!(c.wait.spinning_gap(), Duration::from_micros(500), "the others keep their defaults");
        for (toml, field) in [
            ("[wait]\nspin_us = 10001\n", "wait.spin_us"),
            ("[wait]\nspinner_wait_us = 100001\n", "wait.spinner_wait_us"),
            ("[wait]\nfresh_us = 9223372036854775807\n", "wait.spinning_gap_us / wait.fresh_us"),
        ] {
            let c: PolicyConfig = toml::from_str(toml).unwrap();
            let e = c.validate().unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Config);
            assert!(e.to_string().contains(field), "{e}");
        }
    }

    #[test]
    fn deadline_grows_with_bytes() {
        let d = DeadlineConfig { base: Duration::from_secs(1), per_mib: Duration::from_millis(10) };
        assert_eq!(d.for_bytes(0), Duration::from_secs(1));
        assert_eq!(d.for_bytes(100 << 20), Duration::from_secs(2));
    }
}
