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
/// port) carries transfers while every rail to a peer is down.
#[cfg(feature = "rdma")]
pub(crate) async fn rdma(cfg: &EngineConfig) -> Result<Arc<dyn Transport>> {
    let r = &cfg.backend.rdma;
    let device = match (r.devices.is_empty(), &r.device) {
        (false, _) => format!("devices {}", r.devices.join(",")),
        (true, Some(d)) => d.clone(),
        (true, None) => "the first RDMA device".into(),
    };
    let fallback = if r.tcp_fallback { Some(rdma_fallback(cfg).await?) } else { None };
    let rails = transport_rdma::open_devices(r.clone()).await.map_err(|e| {
        transport_core::Error::new(
            e.kind(),
            format!(
                "cannot open {device}: {}; check `ibv_devices` (or load soft-RoCE, rdma_rxe), or use the tcp backend",
                e.message()
            ),
        )
        .with("backend", "rdma")
    })?;
    transport_rails::over(rails, fallback, r.rails.clone()).map_err(|e| e.with("backend", "rdma"))
}

#[cfg(all(feature = "rdma", feature = "tcp"))]
async fn rdma_fallback(cfg: &EngineConfig) -> Result<Arc<dyn Transport>> {
    let host = cfg.backend.rdma.listen.rsplit_once(':').map_or("127.0.0.1", |(h, _)| h);
    let tcp = transport_tcp::TcpConfig { listen: format!("{host}:0"), ..cfg.backend.tcp.clone() };
    let t = transport_tcp::TcpTransport::new(tcp).await.map_err(|e| e.with("backend", "rdma.tcp_fallback"))?;
    Ok(Arc::new(t))
}

#[cfg(all(feature = "rdma", not(feature = "tcp")))]
async fn rdma_fallback(_cfg: &EngineConfig) -> Result<Arc<dyn Transport>> {
    Err(transport_core::Error::new(
        transport_core::ErrorKind::Config,
        "backend.rdma.tcp_fallback needs the tcp backend; rebuild with --features tcp",
    ))
}
