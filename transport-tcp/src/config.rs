//! The TCP backend's configuration (serde, with documented defaults).

use std::time::Duration;

use serde::{Deserialize, Serialize};
use transport_core::{Error, ErrorKind, Result};

/// Seconds `keepalive` may be: what Linux accepts for `TCP_KEEPIDLE`
/// (`MAX_TCP_KEEPIDLE`).
pub const KEEPALIVE_SECS: std::ops::RangeInclusive<u64> = 1..=32767;
/// Bytes `send_buffer` and `recv_buffer` may be: `setsockopt` takes a
/// positive C `int`.
pub const SOCKET_BUFFER_RANGE: std::ops::RangeInclusive<usize> = 1..=(i32::MAX as usize);

/// What `max_handshaking` and `max_handshaking_per_ip` may be (also
/// `max_connections_per_ip`).
pub const MAX_HANDSHAKING_RANGE: std::ops::RangeInclusive<usize> = 1..=65536;
/// What `handshake_timeout` may be: 10 ms..=600 s.
pub const HANDSHAKE_TIMEOUT_RANGE: std::ops::RangeInclusive<Duration> =
    Duration::from_millis(10)..=Duration::from_secs(600);
/// What `server_idle_timeout` may be: 10 ms..=7 days.
pub const SERVER_IDLE_TIMEOUT_RANGE: std::ops::RangeInclusive<Duration> =
    Duration::from_millis(10)..=Duration::from_secs(7 * 86400);

/// What `server_poll_us` may be: 0 (off)..=1000 us.
pub const SERVER_POLL_US_RANGE: std::ops::RangeInclusive<u32> = 0..=1000;

/// What `drain_timeout` may be: 0..=60 s.
pub const DRAIN_TIMEOUT_RANGE: std::ops::RangeInclusive<Duration> = Duration::ZERO..=Duration::from_secs(60);

/// Configuration of a [`crate::TcpTransport`]. Every field has a default;
/// a JSON or TOML config may name only the fields it changes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TcpConfig {
    /// Address the listener binds; its `host:port` is the segment name peers
    /// open. Default `127.0.0.1:0` (loopback, any free port).
    pub listen: String,
    /// The segment name to publish instead of the bound `host:port`, for a
    /// listener reached through a proxy, NAT or port forward. Default
    /// `None` (the bound address).
    pub advertise: Option<String>,
    /// TCP connections ("lanes") per peer endpoint; large requests are cut
    /// into slices spread over them. Default 4.
    pub lanes: usize,
    /// Largest slice a request is cut into, in bytes (also the largest frame
    /// payload sent). Default 1 MiB: big enough that per-frame costs vanish,
    /// small enough that 4 lanes x `window` slices stay a few MiB.
    pub slice_size: usize,
    /// Slices a lane may have outstanding (sent, not yet answered). Default
    /// 64; with small requests this is the pipelining depth per lane.
    pub window: usize,
    /// Bound on live endpoints (rule 4); at the bound an idle endpoint is
    /// evicted (its sockets closed), or the caller waits up to
    /// `connect_timeout` for one to become idle. Default 64.
    pub max_endpoints: usize,
    /// An endpoint unused for this long is closed by the reaper task
    /// (initiator side). Default 30 s. Keep it below the peers'
    /// `server_idle_timeout` (default 300 s), so an idle lane is closed by
    /// its initiator before the server closes it; if a server closes an
    /// idle lane first, the endpoint is found broken and rebuilt on its
    /// next use.
    #[serde(with = "transport_core::serde_ms")]
    pub idle_timeout: Duration,
    /// Connecting and handshaking one lane (and fetching a descriptor) must
    /// finish within this. Default 5 s.
    #[serde(with = "transport_core::serde_ms")]
    pub connect_timeout: Duration,
    /// `TCP_NODELAY` on every socket. Default true.
    pub nodelay: bool,
    /// `SO_SNDBUF` in bytes, `None` = the kernel's autotuning. Default 4 MiB.
    /// Must be within [`SOCKET_BUFFER_RANGE`] (`setsockopt` takes a C
    /// `int`; the kernel clamps it to `net.core.wmem_max`).
    pub send_buffer: Option<usize>,
    /// `SO_RCVBUF` in bytes, `None` = the kernel's autotuning. Default 4 MiB.
    /// Must be within [`SOCKET_BUFFER_RANGE`] (the kernel clamps it to
    /// `net.core.rmem_max`).
    pub recv_buffer: Option<usize>,
    /// TCP keepalive idle time (`SO_KEEPALIVE` + `TCP_KEEPIDLE`, whole
    /// seconds; a fraction is dropped), `None` = off. Must be within
    /// [`KEEPALIVE_SECS`] seconds, what Linux accepts for `TCP_KEEPIDLE`
    /// (in milliseconds in a config file: 1000..=32767000). Default 10 s.
    #[serde(with = "transport_core::serde_ms::option")]
    pub keepalive: Option<Duration>,
    /// Shared secret. When set, both sides prove they hold it (HMAC-SHA256
    /// challenge-response) before any request is served, and a peer without
    /// it is refused (`AuthFailed`). Unset, `KVMOVE_SECRET` and then the
    /// file `KVMOVE_SECRET_FILE` names are tried. Default `None`.
    /// Never shown by `Debug`.
    pub secret: Option<transport_control::Secret>,
    /// Without a secret, serve peers on other hosts too (protected mode
    /// off). Default false: with no secret only this host's connections
    /// (loopback, or to the address they reached) are served, others are
    /// refused with `AuthFailed` and a reason that says what to set
    /// (`transport_control::access`).
    pub insecure: bool,
    /// Largest frame payload accepted from a peer, in bytes; a larger frame
    /// closes the connection. Bounds memory per connection. Must be at least
    /// `slice_size`. Default 1 MiB.
    pub max_frame: usize,
    /// Handshaken connections the server serves at once; one more is
    /// answered `Busy` (before its handshake, or in place of READY if the
    /// limit filled up during it) and closed. Connections still in
    /// their handshake do not count here (see `max_handshaking`). Must be
    /// at least 1. Default 1024.
    pub max_connections: usize,
    /// Handshaken connections served at once from one peer IP address; one
    /// more is answered `Busy` and closed. Must be 1..=65536 (above
    /// `max_connections` it has no effect). An initiator opens `lanes` connections per endpoint, so keep it at
    /// least `lanes` x the initiators' endpoints toward this server from
    /// one host. Default 256.
    pub max_connections_per_ip: usize,
    /// Connections in their handshake (accepted, READY not yet sent) at
    /// once, from all peers. A small pre-authentication quota, so peers
    /// without the secret cannot take the slots of peers with it. When it
    /// is full, a newcomer from an address with fewer handshakes under way
    /// than the busiest address takes that address's oldest handshake slot
    /// (closing it); otherwise it is answered `Busy` and closed at once.
    /// Must be within
    /// [`MAX_HANDSHAKING_RANGE`]. Default 256.
    pub max_handshaking: usize,
    /// Connections in their handshake past their HELLO at once from one
    /// peer IP address; when one more sends its HELLO, that address's
    /// oldest such is answered `Busy` and closed. Connections that have
    /// sent nothing yet are held to `max_handshaking` alone and give way
    /// first (`transport_control::admission`). Must be 1..=65536 (above
    /// `max_handshaking` it has no effect). Default 32: an initiator
    /// connects its lanes one after the other, so this leaves room for many
    /// initiator processes on one host starting at once (every rank of a
    /// node), while one address cannot take more than an eighth of the
    /// default quota with handshakes under way.
    pub max_handshaking_per_ip: usize,
    /// The server closes a connection whose handshake has not finished
    /// within this (server side; the initiator bounds its own side with
    /// `connect_timeout`). Must be within [`HANDSHAKE_TIMEOUT_RANGE`]
    /// (10 ms..=600 s). Default 2 s.
    #[serde(with = "transport_core::serde_ms")]
    pub handshake_timeout: Duration,
    /// The server closes a handshaken connection that sent no request for
    /// this long, or on which a frame or an answer made no progress for
    /// this long (logged at info). Must be within
    /// [`SERVER_IDLE_TIMEOUT_RANGE`] (10 ms..=7 days). Default 300 s,
    /// above the initiators' `idle_timeout` (default 30 s), so in normal
    /// use an initiator closes its idle lanes first.
    #[serde(with = "transport_core::serde_ms")]
    pub server_idle_timeout: Duration,
    /// Received notifications (rule 11) held until taken: a full inbox
    /// answers `Busy` and the sender's `notify` fails with a transient
    /// `Backpressure`. Bounds the memory notifications take: at most this
    /// many x (`MAX_NOTIFY_LEN` + `MAX_NOTIFY_FROM`) bytes (about 4.3 KiB
    /// each). Must be at least 1. Default
    /// [`transport_core::DEFAULT_INBOX`] (1024).
    pub inbox_capacity: usize,
    /// When a deadline or a cancel ends requests whose slices are on the
    /// wire, the initiator waits for the target's answers to them before
    /// it resets the connections that carry them (rule 5): until the
    /// target has been silent this long (each answer starts the wait
    /// again), at most eight times this long in all. The target answers a
    /// slice only once its bytes are applied (for device memory, once the
    /// copy into the device finished), so what answers in time leaves no
    /// copy running at the target, and its connections live on; what does
    /// not (a stalled peer) is reset, as before. Must be within
    /// [`DRAIN_TIMEOUT_RANGE`] (0..=60 s). Default 250 ms.
    #[serde(with = "transport_core::serde_ms")]
    pub drain_timeout: Duration,
    /// Same-host copies: when a peer is a process of this host that this
    /// one may read and that may read this one (Linux cross-memory attach,
    /// `process_vm_readv`: same user, or ptrace rights), the bytes of its
    /// lanes move by one kernel copy from process to process instead of
    /// through the sockets, which still carry the requests and answers.
    /// Each side copies only into its own memory, after its own checks.
    /// Offered by both ends of a lane and used where both agree and the
    /// check of the peer's identity passes; otherwise the lane carries
    /// the bytes itself, as it does with this set to false. Default true.
    pub same_host: bool,
    /// Direct same-host writes (with `same_host`): a small WRITE to a
    /// same-host peer that offers it is copied by the submitting thread
    /// straight into the peer's memory (one kernel copy), with no
    /// frame and no round trip. The peer offers a window per connection
    /// listing the ranges it allows (its regions that allow remote
    /// writes); its `unregister` closes the range and waits until no
    /// direct write that saw it open is still copying
    /// (`transport_mem::window`). As a server, false opens no range for
    /// writes in its windows; as a client, false writes none directly.
    /// Default true.
    pub direct_writes: bool,
    /// Direct same-host reads (with `same_host`), the mirror of
    /// `direct_writes`: a small READ from a same-host peer that allows it
    /// (its regions that allow remote reads, in the same window) is
    /// copied by the submitting thread straight out of the peer's memory,
    /// with no frame and no round trip; the peer's `unregister` waits until
    /// no direct read that saw the range open is still copying, so no byte
    /// is read once it returned. As a server, false opens no range for
    /// reads; as a client, false reads none directly. Default true.
    pub direct_reads: bool,
    /// Host staging buffers (1 MiB each) for device memory: with them,
    /// device copies go through them, on tokio's blocking pool, overlapped
    /// with the sockets. Mapped (and pinned by the device's provider, CUDA:
    /// `cuMemHostRegister`) when the first device region is registered,
    /// freed when the last one is unregistered. Half serve this side's
    /// requests, half the peers'. 0 (the default) or 2..=1024. At 0 a
    /// device slice is copied by the task doing its socket I/O, into and
    /// out of that task's own buffers: on fake devices on 2 cores that is
    /// somewhat faster (a thread hand-off per 1 MiB chunk, on cores the
    /// sockets already use); on a GPU, pinned buffers should win, not yet
    /// measured.
    pub staging_buffers: usize,
    /// Microseconds a server connection reads its socket directly, without
    /// sleeping, for the next request after it sent its answers (as UCX's
    /// threads progress without sleeping), before it waits on the runtime
    /// as usual. Waking a sleeping thread costs tens of microseconds where
    /// idle CPUs halt (most VMs); a request that comes within the window is
    /// served without that wake. Only a connection whose last request came
    /// within the window polls, one connection of a server at a time, and
    /// only in a multi-thread runtime with at least two workers; between
    /// reads it yields to the runtime, whose other tasks and I/O go on
    /// meanwhile. The cost is CPU: a worker kept awake for up to this long
    /// after each answer. Must be within [`SERVER_POLL_US_RANGE`]; 0 turns
    /// it off. Default 100.
    pub server_poll_us: u32,
}

impl Default for TcpConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:0".into(),
            advertise: None,
            lanes: 4,
            slice_size: 1 << 20,
            window: 64,
            max_endpoints: 64,
            idle_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
            nodelay: true,
            send_buffer: Some(4 << 20),
            recv_buffer: Some(4 << 20),
            keepalive: Some(Duration::from_secs(10)),
            secret: None,
            insecure: false,
            max_frame: 1 << 20,
            max_connections: 1024,
            max_connections_per_ip: 256,
            max_handshaking: 256,
            max_handshaking_per_ip: 32,
            handshake_timeout: Duration::from_secs(2),
            server_idle_timeout: Duration::from_secs(300),
            inbox_capacity: transport_core::DEFAULT_INBOX,
            drain_timeout: Duration::from_millis(250),
            same_host: true,
            direct_writes: true,
            direct_reads: true,
            staging_buffers: 0,
            server_poll_us: 100,
        }
    }
}

impl TcpConfig {
    /// The connection bounds the server's admission keeps.
    pub(crate) fn limits(&self) -> transport_control::admission::Limits {
        transport_control::admission::Limits {
            max_connections: self.max_connections,
            max_connections_per_ip: self.max_connections_per_ip,
            max_handshaking: self.max_handshaking,
            max_handshaking_per_ip: self.max_handshaking_per_ip,
        }
    }

    /// Checks the values; names the field that is wrong.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, why: &str| Err(Error::new(ErrorKind::Config, format!("tcp.{field}: {why}")));
        if self.lanes == 0 || self.lanes > 64 {
            return bad("lanes", "must be 1..=64");
        }
        if self.slice_size < 4096 || self.slice_size > (64 << 20) {
            return bad("slice_size", "must be 4 KiB..=64 MiB");
        }
        if self.staging_buffers == 1 || self.staging_buffers > 1024 {
            return bad("staging_buffers", "must be 0 (off) or 2..=1024");
        }
        if !SERVER_POLL_US_RANGE.contains(&self.server_poll_us) {
            return bad("server_poll_us", &format!("{} us is outside 0..=1000 (0: off)", self.server_poll_us));
        }
        if self.window == 0 || self.window > 4096 {
            return bad("window", "must be 1..=4096");
        }
        if self.max_endpoints == 0 {
            return bad("max_endpoints", "must be at least 1");
        }
        if self.max_frame < self.slice_size || self.max_frame > (64 << 20) {
            return bad("max_frame", "must be at least slice_size and at most 64 MiB");
        }
        if self.idle_timeout.is_zero() || self.connect_timeout.is_zero() {
            return bad("idle_timeout/connect_timeout", "must be positive");
        }
        if self.max_connections == 0 {
            return bad("max_connections", "must be at least 1");
        }
        if !MAX_HANDSHAKING_RANGE.contains(&self.max_connections_per_ip) {
            return bad("max_connections_per_ip", "must be 1..=65536");
        }
        if !MAX_HANDSHAKING_RANGE.contains(&self.max_handshaking) {
            return bad("max_handshaking", "must be 1..=65536");
        }
        if !MAX_HANDSHAKING_RANGE.contains(&self.max_handshaking_per_ip) {
            return bad("max_handshaking_per_ip", "must be 1..=65536");
        }
        if !HANDSHAKE_TIMEOUT_RANGE.contains(&self.handshake_timeout) {
            return bad(
                "handshake_timeout",
                &format!("{} ms is outside 10..=600000 ms", self.handshake_timeout.as_millis()),
            );
        }
        if !DRAIN_TIMEOUT_RANGE.contains(&self.drain_timeout) {
            return bad("drain_timeout", &format!("{} ms is outside 0..=60000 ms", self.drain_timeout.as_millis()));
        }
        if !SERVER_IDLE_TIMEOUT_RANGE.contains(&self.server_idle_timeout) {
            return bad(
                "server_idle_timeout",
                &format!("{} ms is outside 10..=604800000 ms (7 days)", self.server_idle_timeout.as_millis()),
            );
        }
        if let Some(t) = self.keepalive {
            if !KEEPALIVE_SECS.contains(&t.as_secs()) {
                return bad(
                    "keepalive",
                    &format!(
                        "{} ms is outside what TCP_KEEPIDLE accepts: 1..=32767 s (1000..=32767000 ms), or null to \
                         disable keepalive",
                        t.as_millis()
                    ),
                );
            }
        }
        for (field, v) in [("send_buffer", self.send_buffer), ("recv_buffer", self.recv_buffer)] {
            if let Some(n) = v {
                if !SOCKET_BUFFER_RANGE.contains(&n) {
                    return bad(
                        field,
                        &format!("{n} bytes is outside 1..={} (a C int), or null for autotuning", i32::MAX),
                    );
                }
            }
        }
        if self.inbox_capacity == 0 {
            return bad("inbox_capacity", "must be at least 1");
        }
        if matches!(&self.secret, Some(s) if s.is_empty()) {
            return bad("secret", "must not be empty (leave it out to disable authentication)");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_round_trip() {
        let c = TcpConfig::default();
        c.validate().unwrap();
        // The initiator closes its idle lanes before a server would.
        assert!(c.idle_timeout < c.server_idle_timeout);
        let j = serde_json::to_string(&c).unwrap();
        let back: TcpConfig = serde_json::from_str(&j).unwrap();
        assert_eq!(c, back);
        let partial: TcpConfig = serde_json::from_str(r#"{"lanes": 2, "idle_timeout": 500}"#).unwrap();
        assert_eq!(partial.lanes, 2);
        assert_eq!(partial.idle_timeout, Duration::from_millis(500));
    }

    #[test]
    fn bad_values_name_the_field() {
        let c = TcpConfig { max_frame: 1024, ..TcpConfig::default() };
        let e = c.validate().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.message().contains("max_frame"));
        let e = TcpConfig { inbox_capacity: 0, ..TcpConfig::default() }.validate().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.message().contains("inbox_capacity"), "{e}");
        TcpConfig { inbox_capacity: 1, ..TcpConfig::default() }.validate().unwrap();
        let e = TcpConfig { server_poll_us: 1001, ..TcpConfig::default() }.validate().unwrap_err();
        assert!(e.message().contains("server_poll_us") && e.message().contains("1001 us"), "{e}");
        for us in [0, 1000] {
            TcpConfig { server_poll_us: us, ..TcpConfig::default() }.validate().unwrap();
        }
    }

    #[test]
    fn socket_options_outside_what_the_os_accepts_are_refused() {
        for (c, field) in [
            (TcpConfig { keepalive: Some(Duration::from_secs(40_000)), ..TcpConfig::default() }, "keepalive"),
            (TcpConfig { keepalive: Some(Duration::from_millis(999)), ..TcpConfig::default() }, "keepalive"),
            (TcpConfig { send_buffer: Some(0), ..TcpConfig::default() }, "send_buffer"),
            (TcpConfig { recv_buffer: Some(1 << 31), ..TcpConfig::default() }, "recv_buffer"),
            (TcpConfig { max_handshaking: 0, ..TcpConfig::default() }, "max_handshaking"),
            (TcpConfig { max_handshaking: 65537, ..TcpConfig::default() }, "max_handshaking"),
            (TcpConfig { max_handshaking_per_ip: 65537, ..TcpConfig::default() }, "max_handshaking_per_ip"),
            (TcpConfig { max_handshaking_per_ip: 0, ..TcpConfig::default() }, "max_handshaking_per_ip"),
            (TcpConfig { max_connections_per_ip: 0, ..TcpConfig::default() }, "max_connections_per_ip"),
            (TcpConfig { max_connections_per_ip: 65537, ..TcpConfig::default() }, "max_connections_per_ip"),
            (TcpConfig { handshake_timeout: Duration::ZERO, ..TcpConfig::default() }, "handshake_timeout"),
            (TcpConfig { drain_timeout: Duration::from_secs(61), ..TcpConfig::default() }, "drain_timeout"),
            (TcpConfig { handshake_timeout: Duration::from_secs(601), ..TcpConfig::default() }, "handshake_timeout"),
            (TcpConfig { server_idle_timeout: Duration::ZERO, ..TcpConfig::default() }, "server_idle_timeout"),
            (TcpConfig { server_idle_timeout: Duration::MAX, ..TcpConfig::default() }, "server_idle_timeout"),
        ] {
            let e = c.validate().unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Config);
            assert!(e.message().contains(field), "{e}");
        }
        for c in [
            TcpConfig { keepalive: Some(Duration::from_secs(32_767)), ..TcpConfig::default() },
            TcpConfig { keepalive: Some(Duration::from_secs(1)), ..TcpConfig::default() },
            TcpConfig { keepalive: None, send_buffer: None, recv_buffer: None, ..TcpConfig::default() },
        ] {
            c.validate().unwrap();
        }
    }
}
