//! One constructor per compiled-in backend: options in, `Arc<dyn Transport>` out.

use std::sync::Arc;

use transport_core::{Result, Transport};

use crate::config::EngineConfig;

/// A TCP transport listening on `backend.tcp.listen`.
#[cfg(feature = "tcp")]
pub(crate) async fn tcp(cfg: &EngineConfig) -> Result<Arc<dyn Transport>> {
    let listen = cfg.backend.tcp.listen.clone();
    let t = transport_tcp::TcpTransport::new(cfg.backend.tcp.clone())
        .await
        .map_err(|e| e.with("listen", listen))?;
    Ok(Arc::new(t))
}
