//! What the store, its keep-alive task and its watches share: the client
//! and config, the descriptors this store owns, and the etcd calls they all
//! make (bounded, with errors that name the operation and key).

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use etcd_client::{Client, Compare, CompareOp, PutOptions, Txn, TxnOp};
use parking_lot::Mutex;
use transport_core::lifecycle::TaskSet;
use transport_core::{ErrorKind, Result, SegmentDescriptor};

use crate::codec;
use crate::config::EtcdConfig;
use crate::error::Ctx;

/// How often `put` retries its compare-and-swap when another writer changed
/// the key between the read and the write.
const MAX_CAS_ATTEMPTS: u32 = 16;

/// What the store, its keep-alive task and its watches share.
pub(crate) struct Shared {
    pub client: Client,
    pub config: EtcdConfig,
    pub endpoint: String,
    /// Descriptors this store published, by segment name, with their lease.
    pub owned: Mutex<HashMap<String, Owned>>,
    /// Live background tasks (the keep-alive task).
    pub tasks: TaskSet,
    /// Serialises `put`, `remove` and the keep-alive task's republishing,
    /// so one name never gets two leases.
    pub write_lock: tokio::sync::Mutex<()>,
}

/// A descriptor this store published and keeps alive.
#[derive(Debug, Clone)]
pub(crate) struct Owned {
    pub lease: i64,
    pub desc: SegmentDescriptor,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("config", &self.config)
            .field("owned", &self.owned.lock().len())
            .field("tasks", &self.tasks.count())
            .finish_non_exhaustive()
    }
}

impl Shared {
    pub(crate) fn ctx<'a>(&'a self, op: &'static str, key: &'a str) -> Ctx<'a> {
        Ctx { op, key, endpoint: &self.endpoint }
    }

    /// Reads the descriptor of `name` with the key's mod revision.
    pub(crate) async fn read(&self, name: &str, op: &'static str) -> Result<Option<(SegmentDescriptor, i64)>> {
        Ok(self.read_at(name, op).await?.0)
    }

    /// Like [`read`](Self::read), plus the store revision the read saw.
    pub(crate) async fn read_at(
        &self,
        name: &str,
        op: &'static str,
    ) -> Result<(Option<(SegmentDescriptor, i64)>, i64)> {
        let key = self.config.key_for(name);
        let ctx = self.ctx(op, &key);
        let mut client = self.client.clone();
        let resp = bounded(&ctx, self.config.request_timeout, client.get(key.as_bytes(), None)).await?;
        let revision = resp.header().map_or(0, |h| h.revision());
        match resp.kvs().first() {
            None => Ok((None, revision)),
            Some(kv) => Ok((Some((codec::decode(kv.value(), name, &ctx)?, kv.mod_revision())), revision)),
        }
    }

    /// Writes `desc` on `lease` unless a larger generation is stored.
    pub(crate) async fn publish(&self, desc: &SegmentDescriptor, lease: i64) -> Result<()> {
        let key = self.config.key_for(&desc.name);
        let ctx = self.ctx("put", &key);
        let value = codec::encode(desc, &ctx)?;
        for _ in 0..MAX_CAS_ATTEMPTS {
            let compare = match self.read(&desc.name, "put").await? {
                None => Compare::create_revision(key.as_bytes(), CompareOp::Equal, 0),
                Some((stored, _)) if stored.generation > desc.generation => {
                    return Err(ctx
                        .error(
                            ErrorKind::InvalidRequest,
                            format_args!(
                                "descriptor generation {} is older than the stored {}",
                                desc.generation, stored.generation
                            ),
                        )
                        .with("segment", &desc.name));
                }
                Some((_, mod_revision)) => Compare::mod_revision(key.as_bytes(), CompareOp::Equal, mod_revision),
            };
            let put = TxnOp::put(key.as_bytes(), value.clone(), Some(PutOptions::new().with_lease(lease)));
            let txn = Txn::new().when([compare]).and_then([put]);
            let mut client = self.client.clone();
            let resp = bounded(&ctx, self.config.request_timeout, client.txn(txn)).await?;
            if resp.succeeded() {
                tracing::debug!(key, generation = desc.generation, lease, "published segment descriptor");
                return Ok(());
            }
            // Another writer changed the key between our read and write: read again.
        }
        Err(ctx.error(
            ErrorKind::Io,
            format_args!("gave up after {MAX_CAS_ATTEMPTS} compare-and-swap attempts: the key kept changing"),
        ))
    }

    /// Grants a lease of `lease_ttl_secs`.
    pub(crate) async fn grant(&self, key: &str) -> Result<i64> {
        let ctx = self.ctx("lease grant", key);
        let ttl = i64::try_from(self.config.lease_ttl_secs).unwrap_or(i64::MAX);
        let mut client = self.client.clone();
        let resp = bounded(&ctx, self.config.request_timeout, client.lease_grant(ttl, None)).await?;
        if !resp.error().is_empty() {
            return Err(ctx.error(ErrorKind::Io, resp.error()));
        }
        Ok(resp.id())
    }

    /// Revokes a lease (its keys are deleted). A lease that already expired is `Ok`.
    pub(crate) async fn revoke(&self, lease: i64, key: &str) -> Result<()> {
        let ctx = self.ctx("lease revoke", key);
        let mut client = self.client.clone();
        match bounded(&ctx, self.config.request_timeout, client.lease_revoke(lease)).await {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// Runs one etcd call under a time limit, mapping its error with `ctx`.
pub(crate) async fn bounded<T>(
    ctx: &Ctx<'_>,
    limit: Duration,
    call: impl Future<Output = std::result::Result<T, etcd_client::Error>>,
) -> Result<T> {
    match tokio::time::timeout(limit, call).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(ctx.client(e)),
        Err(_) => Err(ctx.timed_out(limit)),
    }
}
