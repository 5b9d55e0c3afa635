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

/// An RDMA transport on `backend.rdma.device` (the first device when unset).
#[cfg(feature = "rdma")]
pub(crate) async fn rdma(cfg: &EngineConfig) -> Result<Arc<dyn Transport>> {
    let device = cfg.backend.rdma.device.clone().unwrap_or_else(|| "the first RDMA device".into());
    let t = transport_rdma::RdmaTransport::new(cfg.backend.rdma.clone()).await.map_err(|e| {
        transport_core::Error::new(
            e.kind(),
            format!(
                "cannot open {device}: {}; check `ibv_devices` (or load soft-RoCE, rdma_rxe), or use the tcp backend",
                e.message()
            ),
        )
        .with("backend", "rdma")
    })?;
    Ok(Arc::new(t))
}
