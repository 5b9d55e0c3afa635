//! The backend's serde configuration (rule 10: chosen by config).

use std::time::Duration;

use serde::{Deserialize, Serialize};
use transport_core::{Error, ErrorKind, Result};
use transport_rails::{RailsConfig, MAX_RAILS};

/// Most QPs one group may have (a peer asking for more is refused).
pub(crate) const MAX_QPS_PER_GROUP: usize = 64;

/// Options of an [`crate::RdmaTransport`]. Every field has a default, so
/// `{}` is a valid config (first device, port 1, GID index 0, listening on
/// an ephemeral loopback port).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RdmaConfig {
    /// RDMA device name (`mlx5_0`, `rxe0`); `None` takes the first device.
    pub device: Option<String>,
    /// Several devices as one (rails, [`crate::open_devices`]): their names, or
    /// `["all"]` for every device whose port is active, or `["auto"]` for
    /// the same devices with each registered region's bytes kept to the
    /// ones nearest its memory (the builder reads the topology from sysfs:
    /// `transport_rails::topology`). Empty (the default)
    /// uses `device` alone. Rail 0 listens on `listen` and names the
    /// transport; the others on the same host, any port. Every rail keeps
    /// its own `max_endpoints`, so the kernel holds at most
    /// `rails x max_endpoints x qps_per_endpoint` QPs.
    pub devices: Vec<String>,
    /// Where `devices = ["auto"]` reads the topology: a sysfs root
    /// (default `/sys`); a fabricated tree places devices for tests.
    pub topology_root: Option<String>,
    /// How rails pair with a peer's, spread and fail over (pause, backoff).
    pub rails: RailsConfig,
    /// With rails: continue over TCP while every rail to a peer is down
    /// (both sides need it). Honoured by builders that have the TCP backend
    /// (`kvmove`): the fallback listens on `listen`'s host, any port, with
    /// this config's `secret` and `insecure` (`[backend.tcp]`'s other
    /// options).
    pub tcp_fallback: bool,
    /// Port number on the device (1-based).
    pub port: u8,
    /// GID table index (RoCE v2 GIDs are usually 0 on rxe, 3 on mlx5 with IPv4).
    pub gid_index: u8,
    /// Address of the TCP side channel (handshakes and descriptors). The
    /// segment name peers open is its bound `host:port`.
    pub listen: String,
    /// Reliable-connected QPs per endpoint; slices spread over them.
    pub qps_per_endpoint: usize,
    /// Bound on live endpoints (rule 4); the least recently used idle one
    /// is evicted (destroyed) to make room.
    pub max_endpoints: usize,
    /// Endpoints idle this long are destroyed by a timer.
    pub idle_timeout_ms: u64,
    /// Work requests in flight per QP; more slices wait in a queue.
    pub max_outstanding_per_qp: usize,
    /// Requests are cut into slices of at most this many bytes.
    pub slice_size: u32,
    /// Pinned host buffers of `slice_size` bytes that slices of staged
    /// device memory pass through (device memory the NIC cannot reach
    /// directly: no GPUDirect), per pool: one for this side's transfers,
    /// and one that peers lease for staged regions they may reach.
    /// Allocated when the first such region is registered, freed with the
    /// last; `2 * staging_buffers * slice_size` is the most host memory
    /// staging holds (`staging_buffers * slice_size` at most 4 GiB). One
    /// peer's notification channel holds at most half of the peers' pool
    /// at once (rounded up).
    pub staging_buffers: u32,
    /// Largest request in bytes.
    pub max_request_len: u64,
    /// Largest batch.
    pub max_batch_len: usize,
    /// Shared secret of the side channel. When set, both sides prove they
    /// hold it (HMAC-SHA256 over fresh nonces, `crate::greet`) before
    /// anything is answered (descriptor, QP group, notification, staging
    /// lease); peers must set the same. Unset, `KVMOVE_SECRET` and then
    /// the file `KVMOVE_SECRET_FILE` names are tried. Default none.
    /// Never shown by `Debug`.
    pub secret: Option<transport_control::Secret>,
    /// Without a secret, answer side-channel connections from other hosts
    /// too (protected mode off). Default false: with no secret only this
    /// host's connections are answered (`transport_control::access`).
    pub insecure: bool,
    /// Side-channel connections in their handshake at once, in all
    /// (default 256), and per peer address past their hello (default 256,
    /// the whole quota: one host's processes open many side channels at
    /// once, a notification channel, a QP group and a descriptor request
    /// per peer and rail, each handshake slow on a loaded host):
    /// strangers that never finish a handshake cannot take the places of
    /// peers that do, and a full quota evicts the handshake that proved
    /// least, silent ones first, from the busiest address
    /// (`transport_control::admission`).
    pub max_handshaking: usize,
    pub max_handshaking_per_ip: usize,
    /// Side-channel limit: a connection handshake (TCP connect + exchange);
    /// opening a notification channel, and the wait for the peer's answer
    /// to a notification.
    pub handshake_timeout_ms: u64,
    /// How long to wait for a broken QP's flushed completions before
    /// destroying it anyway (destroy also stops all DMA).
    pub flush_timeout_ms: u64,
    /// Local ACK timeout exponent (4.096 us * 2^n) of the QPs.
    pub ack_timeout: u8,
    /// Transport retries before a completion fails with RetryExceeded
    /// (0-7; default 6). Soft-RoCE (`rdma_rxe`) takes 7 as "retry
    /// forever" (its completer never counts 7 down), so there a QP whose
    /// peer stopped answering (the peer's QP in error and its NAK lost)
    /// retries for as long as the endpoint lives, with no completion and
    /// no error; 6 fails it after about seven ACK timeouts everywhere.
    pub retry_count: u8,
    /// Bound on QP groups peers may hold into this transport, and
    /// (separately) on the notification channels they may hold.
    pub max_passive: usize,
    /// The same bounds for the peers of one address (at most `max_passive`
    /// each; past it the peer's open fails, its error naming the limit, as
    /// past `max_passive`), so one host, even one holding the secret,
    /// cannot take every place the others need. An engine holds one QP
    /// group per endpoint toward this one (at most its `max_endpoints`):
    /// several engines on one host, or behind one NAT, share the bound.
    /// At least 1. Default 64.
    pub max_passive_per_ip: usize,
    /// `wait` polls the completion queue itself, without sleeping, for up
    /// to this many microseconds before it falls back to waiting for the
    /// completion event (which costs a wakeup or two: tens of µs). Small
    /// transfers then finish at polling latency; 0 turns it off (no CPU
    /// spent spinning).
    pub busy_poll_us: u64,
    /// Received notifications the inbox holds (rule 11) before senders get
    /// a transient `Backpressure`; at least 1. Default
    /// [`transport_core::DEFAULT_INBOX`] (1024).
    pub inbox_capacity: usize,
    /// Whether a peer's staging lease is answered with the key of a memory
    /// window of its own, bound to the leased bytes only, the way leased,
    /// and deallocated when the lease ends (where the device has windows),
    /// instead of the key of the pool's one registration, which reaches
    /// every buffer of the pool while the pool lives. Off by default: on
    /// soft-RoCE under load, the target's QP of a peer writing and reading
    /// through window keys was seen to go to the error state (the cause is
    /// not found; with `retry_count` 7 the peer then hung, with 6 its
    /// slice fails, transient), see `docs/THREAT_MODEL.md`.
    pub staging_windows: bool,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        Self {
            device: None,
            devices: Vec::new(),
            topology_root: None,
            rails: RailsConfig::default(),
            tcp_fallback: false,
            port: 1,
            gid_index: 0,
            listen: "127.0.0.1:0".into(),
            qps_per_endpoint: 2,
            max_endpoints: 64,
            idle_timeout_ms: 60_000,
            max_outstanding_per_qp: 64,
            slice_size: 1 << 20,
            staging_buffers: 16,
            max_request_len: 1 << 32,
            max_batch_len: 1 << 16,
            handshake_timeout_ms: 5_000,
            secret: None,
            insecure: false,
            max_handshaking: 256,
            max_handshaking_per_ip: 256,
            flush_timeout_ms: 2_000,
            ack_timeout: 14,
            retry_count: 6,
            max_passive: 256,
            max_passive_per_ip: 64,
            busy_poll_us: 200,
            inbox_capacity: transport_core::DEFAULT_INBOX,
            staging_windows: false,
        }
    }
}

impl RdmaConfig {
    /// Whether `devices` is `["auto"]`: rails chosen per region from the
    /// topology.
    pub fn uses_topology(&self) -> bool {
        matches!(self.devices.as_slice(), [d] if d == "auto")
    }

    /// Checks ranges; names the field that is wrong.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, why: &str| Err(Error::new(ErrorKind::Config, format!("rdma.{field}: {why}")));
        if self.devices.len() > MAX_RAILS || self.devices.iter().any(String::is_empty) {
            return bad("devices", "at most 16 non-empty device names (or [\"all\"], or [\"auto\"])");
        }
        if self.devices.len() > 1 && self.devices.iter().any(|d| d == "all" || d == "auto") {
            return bad("devices", "\"all\" and \"auto\" stand alone");
        }
        self.rails.validate().map_err(|e| Error::new(e.kind(), format!("rdma.{}", e.message())))?;
        if self.port == 0 {
            return bad("port", "ports are numbered from 1");
        }
        if self.qps_per_endpoint == 0 || self.qps_per_endpoint > MAX_QPS_PER_GROUP {
            return bad("qps_per_endpoint", "must be 1..=64");
        }
        if self.max_endpoints == 0 {
            return bad("max_endpoints", "must be at least 1");
        }
        if self.max_outstanding_per_qp == 0 || self.max_outstanding_per_qp > 4096 {
            return bad("max_outstanding_per_qp", "must be 1..=4096");
        }
        if self.slice_size == 0 || self.slice_size > (1 << 30) {
            return bad("slice_size", "must be 1..=1 GiB");
        }
        if self.staging_buffers == 0 || u64::from(self.staging_buffers) * u64::from(self.slice_size) > (4 << 30) {
            return bad("staging_buffers", "must be at least 1, and staging_buffers * slice_size at most 4 GiB");
        }
        if self.max_batch_len == 0 || self.max_request_len == 0 {
            return bad("max_batch_len", "limits must be non-zero");
        }
        if self.busy_poll_us > 1_000_000 {
            return bad("busy_poll_us", "must be at most 1000000 (one second)");
        }
        if matches!(&self.secret, Some(s) if s.is_empty()) {
            return bad("secret", "must not be empty (leave it out to run without one)");
        }
        if !(1..=65536).contains(&self.max_handshaking) || !(1..=65536).contains(&self.max_handshaking_per_ip) {
            return bad("max_handshaking", "max_handshaking and max_handshaking_per_ip must be 1..=65536");
        }
        if self.inbox_capacity == 0 {
            return bad("inbox_capacity", "must be at least 1");
        }
        if self.max_passive_per_ip == 0 {
            return bad("max_passive_per_ip", "must be at least 1");
        }
        if self.ack_timeout > 31 || self.retry_count > 7 {
            return bad("ack_timeout", "ack_timeout must be <= 31 and retry_count <= 7");
        }
        Ok(())
    }

    pub(crate) fn idle_timeout(&self) -> Duration {
        Duration::from_millis(self.idle_timeout_ms.max(1))
    }

    pub(crate) fn busy_poll(&self) -> Duration {
        Duration::from_micros(self.busy_poll_us)
    }

    pub(crate) fn flush_timeout(&self) -> Duration {
        Duration::from_millis(self.flush_timeout_ms.max(1))
    }

    /// The bounds on side-channel connections: handshakes as configured;
    /// handshaken ones are held by `max_passive` per kind (QP groups,
    /// notification channels), plus as many short descriptor requests.
    pub(crate) fn limits(&self) -> transport_control::admission::Limits {
        let served = self.max_passive.saturating_mul(3);
        transport_control::admission::Limits {
            max_connections: served,
            max_connections_per_ip: served,
            max_handshaking: self.max_handshaking,
            max_handshaking_per_ip: self.max_handshaking_per_ip,
        }
    }

    pub(crate) fn handshake_timeout(&self) -> Duration {
        Duration::from_millis(self.handshake_timeout_ms.max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_config_is_default_and_valid() {
        let c: RdmaConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(c, RdmaConfig::default());
        c.validate().unwrap();
    }

    #[test]
    fn bad_fields_are_named() {
        let c = RdmaConfig { qps_per_endpoint: 0, ..Default::default() };
        assert!(c.validate().unwrap_err().to_string().contains("qps_per_endpoint"));
        assert!(serde_json::from_str::<RdmaConfig>(r#"{"devcie":"x"}"#).is_err());
        let c: RdmaConfig = serde_json::from_str(r#"{"inbox_capacity":0}"#).unwrap();
        assert!(c.validate().unwrap_err().to_string().contains("inbox_capacity"));
    }
}
