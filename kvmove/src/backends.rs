//! One constructor per compiled-in backend: options in, `Arc<dyn Transport>` out.

use std::sync::Arc;

use transport_core::{Result, Transport};

use crate::config::EngineConfig;

/// A TCP transport listening on `backend.tcp.listen`.
#[cfg(feature = "tcp")]
pub(crate) async fn tcp(cfg: &EngineConfig) -> Result<Arc<dyn Transport>> {
    let listen = cfg.backend.tcp.listen.clone();
    let t = transport_tcp::TcpTransport::new(cfg.backend.tcp.clone()).await.map_err(|e| e.with("listen", listen))?;
    Ok(Arc::new(t))
}

/// A host on the process-wide mock fabric ([`crate::mock_fabric`]).
#[cfg(feature = "mock")]
pub(crate) async fn mock(cfg: &EngineConfig) -> Result<Arc<dyn Transport>> {
    let t = transport_mock::MockTransport::new(&crate::mock_fabric(), cfg.backend.mock.clone())?;
    Ok(t)
}

/// The fabric every mock transport of this process lives on, so engines
/// built from configs reach each other by segment name, and tests can
/// inject faults (`kill`, `cut`, `stall`) into them.
#[cfg(feature = "mock")]
pub fn mock_fabric() -> transport_mock::MockFabric {
    static FABRIC: std::sync::OnceLock<transport_mock::MockFabric> = std::sync::OnceLock::new();
    FABRIC.get_or_init(transport_mock::MockFabric::new).clone()
}

/// An RDMA transport on `backend.rdma.device`, or on every device of
/// `backend.rdma.devices` as rails (`transport_rails`, a layer this builder
/// composes over the devices); with `backend.rdma.tcp_fallback`, a TCP
/// transport (the `[backend.tcp]` options, on the RDMA listen host, any
/// port, with the RDMA backend's secret: [`fallback_tcp_config`]) carries
/// transfers while every rail to a peer is down.
#[cfg(feature = "rdma")]
pub(crate) async fn rdma(cfg: &EngineConfig) -> Result<Arc<dyn Transport>> {
    let r = &cfg.backend.rdma;
    let device = match (r.devices.is_empty(), &r.device) {
        (false, _) => format!("devices {}", r.devices.join(",")),
        (true, Some(d)) => d.clone(),
        (true, None) => "the first RDMA device".into(),
    };
    let fallback = if r.tcp_fallback { Some(rdma_fallback(cfg).await?) } else { None };
    // `["auto"]`: the active devices, named, and where each sits, so each
    // region's bytes keep to the rails nearest its memory.
    let mut open = r.clone();
    let mut topology = None;
    if r.uses_topology() {
        let names: Vec<String> =
            transport_rdma::rail_devices(r).map_err(|e| e.with("backend", "rdma"))?.into_iter().flatten().collect();
        let sysfs = transport_rails::topology::Sysfs::new(r.topology_root.as_deref().unwrap_or("/sys"));
        let t = transport_rails::topology::Topology::of_devices(sysfs, &names);
        for (name, place) in t.names().iter().zip(t.rails()) {
            tracing::info!(device = %name, %place, "rdma.devices = [\"auto\"]: a rail");
        }
        open.devices = names;
        topology = Some(t);
    }
    let rails = transport_rdma::open_devices(open).await.map_err(|e| {
        transport_core::Error::new(
            e.kind(),
            format!(
                "cannot open {device}: {}; check `ibv_devices` (or load soft-RoCE, rdma_rxe), or use the tcp backend",
                e.message()
            ),
        )
        .with("backend", "rdma")
    })?;
    transport_rails::over_placed(rails, fallback, r.rails.clone(), topology).map_err(|e| e.with("backend", "rdma"))
}

#[cfg(all(feature = "rdma", feature = "tcp"))]
async fn rdma_fallback(cfg: &EngineConfig) -> Result<Arc<dyn Transport>> {
    let r = &cfg.backend.rdma;
    let tcp = fallback_tcp_config(&cfg.backend.tcp, &r.listen, r.secret.as_deref(), r.insecure);
    let t = transport_tcp::TcpTransport::new(tcp).await.map_err(|e| e.with("backend", "rdma.tcp_fallback"))?;
    Ok(Arc::new(t))
}

/// The RDMA backend's TCP fallback: the `[backend.tcp]` options, listening
/// on the host of `rdma_listen` (any port), and guarded as the RDMA backend
/// is: its `secret` when it has one (else `[backend.tcp]`'s, else the
/// environment's, as for any TCP transport), and `insecure` if either
/// section says so. A secret set only under `[backend.rdma]` used to leave
/// the fallback without one: in protected mode it refused every peer on
/// another host, so the fallback never carried a byte.
#[cfg(feature = "tcp")]
#[cfg_attr(not(feature = "rdma"), allow(dead_code))] // used with `rdma` (and its test)
pub(crate) fn fallback_tcp_config(
    tcp: &transport_tcp::TcpConfig,
    rdma_listen: &str,
    rdma_secret: Option<&str>,
    rdma_insecure: bool,
) -> transport_tcp::TcpConfig {
    let host = rdma_listen.rsplit_once(':').map_or("127.0.0.1", |(h, _)| h);
    transport_tcp::TcpConfig {
        listen: format!("{host}:0"),
        secret: rdma_secret.map(|s| s.to_owned().into()).or_else(|| tcp.secret.clone()),
        insecure: tcp.insecure || rdma_insecure,
        ..tcp.clone()
    }
}

#[cfg(all(feature = "rdma", not(feature = "tcp")))]
async fn rdma_fallback(_cfg: &EngineConfig) -> Result<Arc<dyn Transport>> {
    Err(transport_core::Error::new(
        transport_core::ErrorKind::Config,
        "backend.rdma.tcp_fallback needs the tcp backend; rebuild with --features tcp",
    ))
}

#[cfg(all(test, feature = "tcp"))]
mod tests {
    use super::fallback_tcp_config;
    use transport_tcp::TcpConfig;

    #[test]
    fn the_rdma_fallback_is_guarded_as_the_rdma_backend() {
        let tcp = TcpConfig::default();
        // A secret only under [backend.rdma] reaches the fallback.
        let f = fallback_tcp_config(&tcp, "10.0.0.5:7000", Some("rdma-secret"), false);
        assert_eq!(f.listen, "10.0.0.5:0");
        assert_eq!(f.secret.as_deref(), Some("rdma-secret"));
        assert!(!f.insecure);
        // The RDMA backend's secret wins over [backend.tcp]'s; without
        // one, [backend.tcp]'s stays.
        let tcp = TcpConfig { secret: Some("tcp-secret".to_string().into()), ..TcpConfig::default() };
        assert_eq!(fallback_tcp_config(&tcp, "h:1", Some("rdma-secret"), false).secret.as_deref(), Some("rdma-secret"));
        assert_eq!(fallback_tcp_config(&tcp, "h:1", None, false).secret.as_deref(), Some("tcp-secret"));
        // insecure in either section.
        assert!(fallback_tcp_config(&TcpConfig::default(), "h:1", None, true).insecure);
        let tcp = TcpConfig { insecure: true, ..TcpConfig::default() };
        assert!(fallback_tcp_config(&tcp, "h:1", None, false).insecure);
        // A listen address without a port: loopback.
        assert_eq!(fallback_tcp_config(&TcpConfig::default(), "nohost", None, false).listen, "127.0.0.1:0");
    }
}
