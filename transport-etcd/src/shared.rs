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
    /// With several endpoints: a client per member, for reads that try
    /// another member when one does not answer ([`Shared::read_with_failover`]).
    pub readers: Vec<Client>,
    /// The reader that answered last (tried first).
    pub preferred: std::sync::atomic::AtomicUsize,
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
        let resp = self.read_with_failover(&ctx, &key).await?;
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

impl Shared {
    /// A read, tried again on the next member when one does not answer
    /// (killed, partitioned away, stopped): attempts go to one member each,
    /// starting with the one that answered last, so a silent member costs
    /// one attempt, once. Up to [`READ_ATTEMPTS`] attempts, each bounded by
    /// a share of `request_timeout`, all of them by `request_timeout`.
    /// Reads only: a read tried twice changes nothing.
    async fn read_with_failover(&self, ctx: &Ctx<'_>, key: &str) -> Result<etcd_client::GetResponse> {
        let limit = self.config.request_timeout;
        let each = (limit / READ_ATTEMPTS).max(Duration::from_millis(100));
        let until = tokio::time::Instant::now() + limit;
        let mut attempt = 1;
        loop {
            let left = until.saturating_duration_since(tokio::time::Instant::now());
            let n = self.readers.len();
            let first = self.preferred.load(std::sync::atomic::Ordering::Relaxed);
            let pick = (first + attempt as usize - 1) % n.max(1);
            let mut client = self.readers.get(pick).unwrap_or(&self.client).clone();
            match bounded(ctx, each.min(left), client.get(key.as_bytes(), None)).await {
                Ok(r) => {
                    if n > 0 {
                        self.preferred.store(pick, std::sync::atomic::Ordering::Relaxed);
                    }
                    return Ok(r);
                }
                Err(e) if attempt < READ_ATTEMPTS && left > each && is_unreachable(e.kind()) => {
                    tracing::debug!(key, attempt, error = %e, "etcd read failed; trying again (another member)");
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// Attempts of one read ([`Shared::read_with_failover`]).
const READ_ATTEMPTS: u32 = 3;

/// The member the call went to did not answer (as opposed to an answer
/// that refuses).
fn is_unreachable(kind: ErrorKind) -> bool {
    matches!(kind, ErrorKind::ConnectionRefused | ErrorKind::ConnectionReset | ErrorKind::Timeout)
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
