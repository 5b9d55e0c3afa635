//! Choosing and building the backend from the `initialize` arguments.

use std::sync::Arc;

use transport_core::{Error, ErrorKind, Result, Transport};

/// Environment variable that overrides the protocol `initialize` asks for
/// (`tcp` or `rdma`): lets an unmodified caller that hard-codes `"rdma"`
/// (SGLang does) run over TCP on a machine without RDMA.
pub(crate) const PROTOCOL_ENV: &str = "KVMOVE_PROTOCOL";

/// What the caller asked for, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BackendOptions {
    /// `tcp` or `rdma`.
    pub(crate) protocol: String,
    /// Host (name or IP) to listen on and to advertise.
    pub(crate) host: String,
    /// Port to listen on; 0 picks a free one (see `get_rpc_port`).
    pub(crate) port: u16,
    /// RDMA device name (`mlx5_0`); empty picks the first. Mooncake accepts a
    /// comma-separated filter: the first name is used.
    pub(crate) device: String,
}

impl BackendOptions {
    /// Parses Mooncake's `initialize` arguments. `local_hostname` may be
    /// `host` or `host:port` (IPv6 as `[addr]:port`). `metadata_server` must
    /// be `P2PHANDSHAKE` (peer-to-peer: the segment name is the peer's
    /// `host:port`); other stores are refused with a `Config` error.
    pub(crate) fn from_mooncake(
        local_hostname: &str,
        metadata_server: &str,
        protocol: &str,
        device_name: &str,
    ) -> Result<Self> {
        let meta = metadata_server.trim();
        if !(meta.eq_ignore_ascii_case("P2PHANDSHAKE") || meta.is_empty() || meta.eq_ignore_ascii_case("p2p")) {
            return Err(Error::new(
                ErrorKind::Unsupported,
                "only peer-to-peer metadata (\"P2PHANDSHAKE\") is supported by the Python package",
            )
            .with("metadata_server", metadata_server));
        }
        let protocol =
            std::env::var(PROTOCOL_ENV).ok().filter(|p| !p.is_empty()).unwrap_or_else(|| protocol.to_owned());
        let protocol = protocol.trim().to_ascii_lowercase();
        let (host, port) = split_host_port(local_hostname)?;
        let device = device_name.split(',').map(str::trim).find(|d| !d.is_empty()).unwrap_or_default().to_owned();
        Ok(Self { protocol, host, port, device })
    }

    /// `host:port` to listen on.
    pub(crate) fn listen_addr(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// Splits `host`, `host:port`, `[v6]` or `[v6]:port`.
pub(crate) fn split_host_port(s: &str) -> Result<(String, u16)> {
    let s = s.trim();
    let bad = |why: &str| Error::new(ErrorKind::Config, format!("local_hostname: {why}")).with("value", s);
    if s.is_empty() {
        return Err(bad("empty host name"));
    }
    let (host, port) = if let Some(rest) = s.strip_prefix('[') {
        let (h, after) = rest.split_once(']').ok_or_else(|| bad("unclosed '['"))?;
        match after.strip_prefix(':') {
            Some(p) => (h, Some(p)),
            None if after.is_empty() => (h, None),
            None => return Err(bad("junk after ']'")),
        }
    } else {
        match s.rsplit_once(':') {
            Some((h, _)) if h.contains(':') => (s, None), // bare IPv6
            Some((h, p)) => (h, Some(p)),
            None => (s, None),
        }
    };
    if host.is_empty() {
        return Err(bad("empty host name"));
    }
    let port = match port {
        Some(p) => p.parse::<u16>().map_err(|_| bad("port is not a number in 0..=65535"))?,
        None => 0,
    };
    Ok((host.to_owned(), port))
}

/// Builds the backend. Must run inside the engine's tokio runtime.
pub(crate) async fn build(opts: &BackendOptions) -> Result<Arc<dyn Transport>> {
    match opts.protocol.as_str() {
        "tcp" => build_tcp(opts).await,
        "rdma" => build_rdma(opts).await,
        other => {
            Err(Error::new(ErrorKind::Unsupported, "unknown protocol; use \"tcp\" or \"rdma\"").with("protocol", other))
        }
    }
}

async fn build_tcp(opts: &BackendOptions) -> Result<Arc<dyn Transport>> {
    let cfg = transport_tcp::TcpConfig { listen: opts.listen_addr(), ..Default::default() };
    Ok(Arc::new(transport_tcp::TcpTransport::new(cfg).await?))
}

#[cfg(feature = "rdma")]
async fn build_rdma(opts: &BackendOptions) -> Result<Arc<dyn Transport>> {
    let cfg = transport_rdma::RdmaConfig {
        device: (!opts.device.is_empty()).then(|| opts.device.clone()),
        listen: opts.listen_addr(),
        ..Default::default()
    };
    Ok(Arc::new(transport_rdma::RdmaTransport::new(cfg).await?))
}

#[cfg(not(feature = "rdma"))]
async fn build_rdma(_opts: &BackendOptions) -> Result<Arc<dyn Transport>> {
    Err(Error::new(
        ErrorKind::Unsupported,
        format!(
            "this build of kvmove has no RDMA backend (rebuild with the `rdma` feature), \
             or set {PROTOCOL_ENV}=tcp to run over TCP"
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_forms() {
        assert_eq!(split_host_port("10.0.0.1").unwrap(), ("10.0.0.1".into(), 0));
        assert_eq!(split_host_port("10.0.0.1:17000").unwrap(), ("10.0.0.1".into(), 17000));
        assert_eq!(split_host_port("localhost:0").unwrap(), ("localhost".into(), 0));
        assert_eq!(split_host_port("[::1]:80").unwrap(), ("::1".into(), 80));
        assert_eq!(split_host_port("::1").unwrap(), ("::1".into(), 0));
        assert!(split_host_port("").is_err());
        assert!(split_host_port("h:99999").is_err());
        assert!(split_host_port("h:x").is_err());
        assert!(split_host_port(":80").is_err());
    }

    #[test]
    fn metadata_must_be_p2p() {
        assert!(BackendOptions::from_mooncake("h", "P2PHANDSHAKE", "tcp", "").is_ok());
        let e = BackendOptions::from_mooncake("h", "etcd://127.0.0.1:2379", "tcp", "").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported);
        let o = BackendOptions::from_mooncake("h:5", "P2PHANDSHAKE", "rdma", "mlx5_1, mlx5_2").unwrap();
        assert_eq!(o.device, "mlx5_1");
        assert_eq!(o.listen_addr(), "h:5");
    }
}
