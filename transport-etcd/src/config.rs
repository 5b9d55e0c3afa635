//! The store's configuration, with documented defaults.
//!
//! Durations are written in milliseconds (`*_ms` keys) in TOML and JSON,
//! like the policy configuration of `transport-core`:
//!
//! ```toml
//! endpoints = ["http://10.0.0.5:2379"]
//! prefix = "/kvmove/segments/"
//! lease_ttl_secs = 10
//! connect_timeout_ms = 3000
//! request_timeout_ms = 3000
//! ```

use std::time::Duration;

use serde::{Deserialize, Serialize};
use transport_core::{Error, ErrorKind, Result};

/// Where the etcd cluster is and how the store uses it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EtcdConfig {
    /// Client URLs of the etcd members. Default `["http://127.0.0.1:2379"]`.
    pub endpoints: Vec<String>,
    /// Prefix of every key; a descriptor lives at `<prefix><segment name>`.
    /// Default `"/kvmove/segments/"`.
    pub prefix: String,
    /// Time to live of the lease that carries this store's descriptors, in
    /// seconds: a peer that stops keeping it alive (crashed, partitioned)
    /// loses its descriptors this long after its last keep-alive. The
    /// keep-alive is sent every third of it. etcd raises values below its
    /// own minimum (about 2 s with default server settings). Default 10.
    pub lease_ttl_secs: u64,
    /// Bound on establishing the connection when the store is created.
    /// Default 3 s.
    #[serde(rename = "connect_timeout_ms", with = "transport_core::serde_ms")]
    pub connect_timeout: Duration,
    /// Bound on every request (get, put, delete, lease calls). Default 3 s.
    #[serde(rename = "request_timeout_ms", with = "transport_core::serde_ms")]
    pub request_timeout: Duration,
}

impl Default for EtcdConfig {
    fn default() -> Self {
        Self {
            endpoints: vec!["http://127.0.0.1:2379".to_owned()],
            prefix: "/kvmove/segments/".to_owned(),
            lease_ttl_secs: 10,
            connect_timeout: Duration::from_secs(3),
            request_timeout: Duration::from_secs(3),
        }
    }
}

impl EtcdConfig {
    /// The default configuration with these endpoints.
    pub fn with_endpoints<S: Into<String>>(endpoints: impl IntoIterator<Item = S>) -> Self {
        Self { endpoints: endpoints.into_iter().map(Into::into).collect(), ..Self::default() }
    }

    /// Checks every field; the error names the field and the reason.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, why: &str| Err(Error::new(ErrorKind::Config, format!("etcd.{field}: {why}")));
        if self.endpoints.is_empty() {
            return bad("endpoints", "must name at least one etcd client URL");
        }
        if let Some(e) = self.endpoints.iter().find(|e| e.trim().is_empty()) {
            return bad("endpoints", &format!("contains an empty URL ({e:?})"));
        }
        if self.prefix.is_empty() {
            return bad("prefix", "must not be empty (it keeps the store's keys apart from others)");
        }
        if self.lease_ttl_secs == 0 || self.lease_ttl_secs > i64::MAX as u64 {
            return bad("lease_ttl_secs", "must be at least 1");
        }
        if self.connect_timeout.is_zero() {
            return bad("connect_timeout_ms", "must be greater than 0");
        }
        if self.request_timeout.is_zero() {
            return bad("request_timeout_ms", "must be greater than 0");
        }
        Ok(())
    }

    /// The key that holds the descriptor of segment `name`.
    pub fn key_for(&self, name: &str) -> String {
        format!("{}{}", self.prefix, name)
    }

    /// The interval between keep-alives: a third of the lease, at least 200 ms.
    pub(crate) fn keep_alive_interval(&self) -> Duration {
        (Duration::from_secs(self.lease_ttl_secs) / 3).max(Duration::from_millis(200))
    }

    /// The endpoints as one string, for error context.
    pub(crate) fn endpoint_list(&self) -> String {
        self.endpoints.join(",")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_round_trip() {
        let c = EtcdConfig::default();
        c.validate().unwrap();
        let s = serde_json::to_string(&c).unwrap();
        assert!(s.contains("\"request_timeout_ms\":3000"), "{s}");
        let back: EtcdConfig = serde_json::from_str(&s).unwrap();
        assert_eq!(back, c);
        let partial: EtcdConfig = serde_json::from_str(r#"{"lease_ttl_secs": 2}"#).unwrap();
        assert_eq!(partial.lease_ttl_secs, 2);
        assert_eq!(partial.endpoints, c.endpoints);
        assert_eq!(c.key_for("10.0.0.1:7000"), "/kvmove/segments/10.0.0.1:7000");
    }

    #[test]
    fn invalid_fields_are_named() {
        let mut c = EtcdConfig::default();
        c.endpoints.clear();
        assert!(c.validate().unwrap_err().to_string().contains("etcd.endpoints"));
        let c = EtcdConfig { lease_ttl_secs: 0, ..EtcdConfig::default() };
        let e = c.validate().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.to_string().contains("lease_ttl_secs"));
        let c = EtcdConfig { request_timeout: Duration::ZERO, ..EtcdConfig::default() };
        assert!(c.validate().is_err());
    }
}
