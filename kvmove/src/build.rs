//! Building a transport, a metadata store and an engine from the config.

use std::sync::{Arc, OnceLock};

use kvmove_policy::Engine;
use transport_core::{InProcessStore, MetadataStore, Result, SegmentDescriptor, Transport};

use crate::config::{BackendKind, EngineConfig, MetadataConfig, MetadataKind};

/// Builds the backend named by `cfg.backend.kind` with its options.
///
/// # Errors
/// - `Config` when the options are invalid, or when the backend is not
///   compiled in ("backend 'rdma' is not built in; rebuild with --features
///   rdma").
/// - Whatever the backend returns when it starts (a listen address in use,
///   no RDMA device, ...).
pub async fn build_transport(cfg: &EngineConfig) -> Result<Arc<dyn Transport>> {
    cfg.validate()?;
    let kind: BackendKind = cfg.backend.kind;
    if !kind.is_built_in() {
        return Err(kind.not_built_in());
    }
    match kind {
        #[cfg(feature = "tcp")]
        BackendKind::Tcp => crate::backends::tcp(cfg).await,
        #[cfg(feature = "rdma")]
        BackendKind::Rdma => crate::backends::rdma(cfg).await,
        #[cfg(feature = "mock")]
        BackendKind::Mock => crate::backends::mock(cfg).await,
        #[allow(unreachable_patterns)]
        other => Err(other.not_built_in()),
    }
}

/// Builds the engine: the configured backend under the shared policy layer.
pub async fn build(cfg: &EngineConfig) -> Result<Engine> {
    let transport = build_transport(cfg).await?;
    Engine::new(transport, cfg.policy.clone())
}

/// The metadata store named by the config, or `None` for peer-to-peer
/// (where the backend itself serves and fetches descriptors).
///
/// `in-process` is one store shared by the whole process
/// ([`process_store`]); `etcd` connects to the cluster (feature `etcd`).
pub async fn build_metadata(cfg: &MetadataConfig) -> Result<Option<Arc<dyn MetadataStore>>> {
    match cfg.kind {
        MetadataKind::P2p => Ok(None),
        MetadataKind::InProcess => Ok(Some(Arc::new(process_store()))),
        #[cfg(feature = "etcd")]
        MetadataKind::Etcd => {
            let store = transport_etcd::EtcdStore::connect(cfg.etcd.clone()).await?;
            Ok(Some(Arc::new(store)))
        }
        #[cfg(not(feature = "etcd"))]
        MetadataKind::Etcd => Err(transport_core::Error::new(
            transport_core::ErrorKind::Config,
            "metadata store 'etcd' is not built in; rebuild with --features etcd",
        )),
    }
}

/// The process-wide in-process metadata store (`kind = "in-process"`).
pub fn process_store() -> InProcessStore {
    static STORE: OnceLock<InProcessStore> = OnceLock::new();
    STORE.get_or_init(InProcessStore::new).clone()
}

/// The descriptor this transport serves, as a peer would see it (same
/// generation and remotely accessible regions). Used to publish a
/// descriptor to a metadata store under another name.
///
/// Asks the transport itself ([`Transport::local_descriptor`]): no
/// segment is opened and nothing crosses the network.
///
/// # Errors
/// - After shutdown: `Shutdown`.
pub async fn own_descriptor(transport: &Arc<dyn Transport>) -> Result<SegmentDescriptor> {
    transport.local_descriptor()
}
