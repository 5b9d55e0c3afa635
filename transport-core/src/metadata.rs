//! Where segment descriptors are published and looked up.
//!
//! Three stores exist: peer-to-peer (the default for TCP and RDMA: the
//! segment name is the peer's `host:port` and the descriptor is fetched
//! from the peer itself, implemented in the backends), in-process (this
//! module, for tests and single-process use) and etcd (for clusters, in its
//! own crate).

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use parking_lot::RwLock;

use crate::error::{Error, ErrorKind, Result};
use crate::types::SegmentDescriptor;

/// A directory of segment descriptors.
///
/// # Contract
/// - `put` replaces the descriptor stored under `desc.name`; a reader never
///   sees a descriptor with a smaller generation after a larger one was put.
/// - `get` of an unknown name is `Ok(None)`.
#[async_trait]
pub trait MetadataStore: Send + Sync + std::fmt::Debug + 'static {
    /// Publishes (or replaces) a descriptor.
    async fn put(&self, desc: SegmentDescriptor) -> Result<()>;
    /// Looks a descriptor up.
    async fn get(&self, name: &str) -> Result<Option<SegmentDescriptor>>;
    /// Removes a descriptor (a peer leaving); unknown names are `Ok`.
    async fn remove(&self, name: &str) -> Result<()>;
}

/// A store inside this process, shared by cloning.
#[derive(Debug, Clone, Default)]
pub struct InProcessStore {
    map: Arc<RwLock<HashMap<String, SegmentDescriptor>>>,
}

impl InProcessStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }
}

#[async_trait]
impl MetadataStore for InProcessStore {
    async fn put(&self, desc: SegmentDescriptor) -> Result<()> {
        let mut m = self.map.write();
        if let Some(old) = m.get(&desc.name) {
            if old.generation > desc.generation {
                return Err(Error::new(
                    ErrorKind::InvalidRequest,
                    format!("descriptor generation {} is older than the stored {}", desc.generation, old.generation),
                )
                .with("segment", &desc.name));
            }
        }
        m.insert(desc.name.clone(), desc);
        Ok(())
    }

    async fn get(&self, name: &str) -> Result<Option<SegmentDescriptor>> {
        Ok(self.map.read().get(name).cloned())
    }

    async fn remove(&self, name: &str) -> Result<()> {
        self.map.write().remove(name);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(generation: u64) -> SegmentDescriptor {
        SegmentDescriptor {
            name: "a".into(),
            backend: "mock".into(),
            generation,
            address: String::new(),
            regions: vec![],
        }
    }

    #[tokio::test]
    async fn generations_never_go_back() {
        let s = InProcessStore::new();
        s.put(desc(2)).await.unwrap();
        assert!(s.put(desc(1)).await.is_err());
        assert_eq!(s.get("a").await.unwrap().unwrap().generation, 2);
        s.remove("a").await.unwrap();
        assert!(s.get("a").await.unwrap().is_none());
    }
}
