//! `EtcdStore`: descriptors in etcd, each on a lease this store keeps alive.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{Client, ConnectOptions};
use parking_lot::Mutex;
use tokio::task::JoinHandle;
use transport_core::lifecycle::TaskSet;
use transport_core::{Error, ErrorKind, MetadataStore, Result, SegmentDescriptor};

use crate::codec;
use crate::config::EtcdConfig;
use crate::error::Ctx;
use crate::keepalive;
use crate::shared::{bounded, Owned, Shared};
use crate::watch::SegmentWatch;

/// A [`MetadataStore`] in etcd. See the crate docs for the key layout,
/// leases, generations and watches.
///
/// Dropping the store stops its keep-alive task at once, without revoking:
/// its descriptors then disappear when the lease expires, exactly as if the
/// process had died. [`EtcdStore::close`] is the graceful way out: it stops
/// the task and revokes the leases, so the descriptors disappear now.
#[derive(Debug)]
pub struct EtcdStore {
    shared: Arc<Shared>,
    keep_alive: Mutex<Option<JoinHandle<()>>>,
}

impl EtcdStore {
    /// Connects to etcd and starts the keep-alive task.
    ///
    /// Fails with a transient error (`ConnectionRefused`, naming the
    /// endpoints) when no endpoint answers within `connect_timeout`, and with
    /// `Config` when the configuration is invalid. Must be called inside a
    /// tokio runtime.
    pub async fn connect(config: EtcdConfig) -> Result<Self> {
        config.validate()?;
        let endpoint = config.endpoint_list();
        let ctx = Ctx { op: "connect", key: "", endpoint: &endpoint };
        let options = ConnectOptions::new()
            .with_connect_timeout(config.connect_timeout)
            .with_timeout(config.request_timeout)
            .with_keep_alive(Duration::from_secs(5), config.request_timeout);
        let mut client = bounded(&ctx, config.connect_timeout, Client::connect(&config.endpoints, Some(options)))
            .await
            .map_err(|e| unreachable(&ctx, e))?;
        // The client connects lazily; one cheap request proves that a member answers.
        bounded(&ctx, config.connect_timeout, client.status()).await.map_err(|e| unreachable(&ctx, e))?;

        // One client per member for reads that must go around a silent one
        // (the balanced client keeps picking the member it picked).
        let mut readers = Vec::new();
        if config.endpoints.len() > 1 {
            for ep in &config.endpoints {
                let options = ConnectOptions::new()
                    .with_connect_timeout(config.connect_timeout)
                    .with_timeout(config.request_timeout)
                    .with_keep_alive(Duration::from_secs(5), config.request_timeout);
                if let Ok(Ok(c)) =
                    tokio::time::timeout(config.connect_timeout, Client::connect([ep], Some(options))).await
                {
                    readers.push(c);
                }
            }
        }
        let shared = Arc::new(Shared {
            client,
            readers,
            preferred: std::sync::atomic::AtomicUsize::new(0),
            config,
            endpoint,
            owned: Mutex::new(HashMap::new()),
            tasks: TaskSet::new(),
            write_lock: tokio::sync::Mutex::new(()),
        });
        let handle = keepalive::spawn(shared.clone());
        Ok(Self { shared, keep_alive: Mutex::new(Some(handle)) })
    }

    /// The configuration this store runs with.
    pub fn config(&self) -> &EtcdConfig {
        &self.shared.config
    }

    /// Live background tasks of this store: 1 while the keep-alive task
    /// runs, 0 after [`close`](Self::close) (and shortly after drop).
    pub fn background_tasks(&self) -> usize {
        self.shared.tasks.count()
    }

    /// Names of the segments this store published and keeps alive.
    pub fn published(&self) -> Vec<String> {
        let mut names: Vec<String> = self.shared.owned.lock().keys().cloned().collect();
        names.sort();
        names
    }

    /// Watches the descriptor of segment `name`: the returned watch holds the
    /// current descriptor and yields every later change in order, so a peer
    /// that restarted (new generation) is noticed rather than used stale.
    pub async fn watch(&self, name: &str) -> Result<SegmentWatch> {
        codec::check_name(name)?;
        SegmentWatch::start(&self.shared, name).await
    }

    /// Stops the keep-alive task (waiting for it, bounded), then revokes the
    /// leases of every descriptor this store published, so they disappear
    /// now. Further `put`s fail with `Shutdown`. Calling it twice is fine.
    ///
    /// Revocation errors are returned after every lease was tried; the
    /// task is stopped either way, and an unrevoked lease expires by itself.
    pub async fn close(&self) -> Result<()> {
        let handle = self.keep_alive.lock().take();
        if let Some(handle) = handle {
            handle.abort();
            // An aborted task finishes at its next await point; bounded anyway.
            let _ = tokio::time::timeout(Duration::from_secs(1), handle).await;
        }
        let _guard = self.shared.write_lock.lock().await;
        let owned: Vec<(String, Owned)> = self.shared.owned.lock().drain().collect();
        let mut first_error = None;
        for (name, o) in owned {
            if let Err(e) = self.shared.revoke(o.lease, &self.shared.config.key_for(&name)).await {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    fn check_open(&self) -> Result<()> {
        if self.keep_alive.lock().is_none() {
            return Err(
                Error::new(ErrorKind::Shutdown, "the etcd store was closed").with("endpoint", &self.shared.endpoint)
            );
        }
        Ok(())
    }
}

impl Drop for EtcdStore {
    fn drop(&mut self) {
        if let Some(handle) = self.keep_alive.get_mut().take() {
            handle.abort();
        }
    }
}

#[async_trait]
impl MetadataStore for EtcdStore {
    /// Publishes `desc` under `<prefix><desc.name>` on a lease of this store.
    ///
    /// # Behavior
    /// - A stored descriptor with a larger generation is never overwritten:
    ///   the put fails with `InvalidRequest` (permanent) and names both
    ///   generations. The check and the write are one etcd transaction
    ///   (compare-and-swap on the key's mod revision), so two writers racing
    ///   cannot interleave.
    /// - An equal generation replaces the stored descriptor.
    /// - The first put of a name grants a lease of `lease_ttl_secs`; later
    ///   puts of the same name reuse it.
    async fn put(&self, desc: SegmentDescriptor) -> Result<()> {
        codec::check_name(&desc.name)?;
        self.check_open()?;
        let _guard = self.shared.write_lock.lock().await;
        self.check_open()?;
        let existing = self.shared.owned.lock().get(&desc.name).map(|o| o.lease);
        let (lease, fresh) = match existing {
            Some(lease) => (lease, false),
            None => (self.shared.grant(&self.shared.config.key_for(&desc.name)).await?, true),
        };
        match self.shared.publish(&desc, lease).await {
            Ok(()) => {
                self.shared.owned.lock().insert(desc.name.clone(), Owned { lease, desc });
                Ok(())
            }
            Err(e) => {
                if fresh {
                    // Best effort: an unused lease would expire by itself anyway.
                    let _ = self.shared.revoke(lease, &self.shared.config.key_for(&desc.name)).await;
                }
                Err(e)
            }
        }
    }

    /// The descriptor stored under `<prefix><name>`, `None` when absent.
    /// Bytes there that are not a descriptor of `name` are a `Protocol` error.
    async fn get(&self, name: &str) -> Result<Option<SegmentDescriptor>> {
        codec::check_name(name)?;
        Ok(self.shared.read(name, "get").await?.map(|(desc, _)| desc))
    }

    /// Removes the descriptor of `name`.
    ///
    /// # Behavior
    /// - When this store published it: the lease is revoked, which deletes
    ///   the key, unless a newer publisher (a restarted peer, with its own
    ///   lease) has taken the key over since; then its descriptor stays.
    /// - Otherwise the key is deleted.
    /// - Unknown names are `Ok`.
    async fn remove(&self, name: &str) -> Result<()> {
        codec::check_name(name)?;
        let _guard = self.shared.write_lock.lock().await;
        let key = self.shared.config.key_for(name);
        let owned = self.shared.owned.lock().remove(name);
        match owned {
            Some(o) => self.shared.revoke(o.lease, &key).await,
            None => {
                let ctx = self.shared.ctx("delete", &key);
                let mut client = self.shared.client.clone();
                bounded(&ctx, self.shared.config.request_timeout, client.delete(key.as_bytes(), None)).await?;
                Ok(())
            }
        }
    }
}

/// At connect time any failure to reach a member says "etcd is not there":
/// reported as `ConnectionRefused` (transient) unless it is a config error.
fn unreachable(ctx: &Ctx<'_>, e: Error) -> Error {
    match e.kind() {
        ErrorKind::Config | ErrorKind::AuthFailed => e,
        _ => ctx
            .attach(Error::new(ErrorKind::ConnectionRefused, "etcd connect: no etcd endpoint answered"))
            .with_source(e),
    }
}
