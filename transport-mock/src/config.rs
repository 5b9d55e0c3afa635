//! The serde configuration of one mock host. It has no switch for the
//! deliberate bugs (see `crate::bugs`): a config file can never break the
//! mock, and an unknown key such as `[bugs]` is refused.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use transport_core::{Error, ErrorKind, Result};

use crate::plan::FaultPlan;

/// Configuration of one [`crate::MockTransport`] (one host on a
/// [`crate::MockFabric`]). Every field has a default; durations are written
/// in milliseconds (`*_ms` keys), as in `kvmove_policy::PolicyConfig`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MockConfig {
    /// Segment name of the host. `None` (default): `mock-N`, unique in the
    /// fabric.
    pub name: Option<String>,
    /// Bound on live endpoints (rule 4). Default 64.
    pub max_endpoints: usize,
    /// An endpoint unused for this long is destroyed by the reaper task.
    /// Default 30 s.
    #[serde(rename = "idle_timeout_ms", with = "transport_core::serde_ms")]
    pub idle_timeout: Duration,
    /// Time each request takes before its bytes move (so that cancel and
    /// deadlines have something to act on). Default 0.
    #[serde(rename = "latency_ms", with = "transport_core::serde_ms")]
    pub latency: Duration,
    /// Largest batch; more requests is `InvalidRequest`. Default 65 536.
    pub max_batch_len: usize,
    /// Largest single request in bytes. Default 4 GiB.
    pub max_request_len: u64,
    /// Lanes (simulated QPs or sockets) per endpoint. Default 1.
    pub lanes_per_endpoint: usize,
    /// Notifications the inbox holds before senders get `Backpressure`
    /// (rule 11). Default 1024.
    pub inbox_capacity: usize,
    /// Faults injected by this host (empty by default).
    pub fault_plan: FaultPlan,
}

impl Default for MockConfig {
    fn default() -> Self {
        Self {
            name: None,
            max_endpoints: 64,
            idle_timeout: Duration::from_secs(30),
            latency: Duration::ZERO,
            max_batch_len: 1 << 16,
            max_request_len: 1 << 32,
            lanes_per_endpoint: 1,
            inbox_capacity: transport_core::DEFAULT_INBOX,
            fault_plan: FaultPlan::default(),
        }
    }
}

impl MockConfig {
    /// A default configuration with a fixed segment name.
    pub fn named(name: impl Into<String>) -> Self {
        Self { name: Some(name.into()), ..Self::default() }
    }

    /// Checks the values; the error names the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, why: &str| Err(Error::new(ErrorKind::Config, format!("mock.{field}: {why}")));
        if self.max_endpoints == 0 {
            return bad("max_endpoints", "must be at least 1");
        }
        if self.idle_timeout.is_zero() {
            return bad("idle_timeout_ms", "must be at least 1 ms");
        }
        if self.max_batch_len == 0 {
            return bad("max_batch_len", "must be at least 1");
        }
        if self.max_request_len == 0 {
            return bad("max_request_len", "must be at least 1");
        }
        if self.lanes_per_endpoint == 0 {
            return bad("lanes_per_endpoint", "must be at least 1");
        }
        if self.inbox_capacity == 0 {
            return bad("inbox_capacity", "must be at least 1");
        }
        if matches!(&self.name, Some(n) if n.is_empty()) {
            return bad("name", "must not be empty");
        }
        self.fault_plan.validate()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn defaults_round_trip_and_partial_config_keeps_defaults() {
        let c = MockConfig::default();
        c.validate().unwrap();
        let s = serde_json::to_string(&c).unwrap();
        assert!(s.contains("\"idle_timeout_ms\":30000"), "{s}");
        let back: MockConfig = serde_json::from_str(&s).unwrap();
        assert_eq!(back, c);
        let p: MockConfig = toml::from_str("max_endpoints = 2\n").unwrap();
        assert_eq!(p, MockConfig { max_endpoints: 2, ..MockConfig::default() });
        assert!(toml::from_str::<MockConfig>("max_endpoint = 2\n").is_err());
    }

    /// The deliberate bugs are reachable from tests only: a config file
    /// that tries to switch one on is refused (unknown field).
    #[test]
    fn a_bugs_table_is_refused() {
        let e = toml::from_str::<MockConfig>("max_endpoints = 2\n[bugs]\nnoop_close_segment = true\n").unwrap_err();
        assert!(e.to_string().contains("bugs"), "{e}");
        assert!(serde_json::from_str::<MockConfig>(r#"{"bugs":{"write_after_timeout":true}}"#).is_err());
    }

    #[test]
    fn bad_values_name_the_field() {
        let c = MockConfig { max_endpoints: 0, ..MockConfig::default() };
        assert!(c.validate().unwrap_err().to_string().contains("max_endpoints"));
    }
}
