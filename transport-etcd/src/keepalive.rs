//! The keep-alive task: one per store, renewing every lease it owns.
//!
//! Every `lease_ttl_secs / 3` it sends one keep-alive per owned lease. A
//! lease that etcd no longer knows (it expired while this process was
//! partitioned or paused) is replaced: the task grants a new lease and
//! publishes the descriptor again, unless a larger generation took the key
//! over meanwhile (then this store gives the name up). The task is counted
//! in `Shared::tasks` and ends when the store is closed or dropped.

use std::sync::Arc;

use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;
use transport_core::{ErrorKind, Result};

use crate::shared::{bounded, Owned, Shared};

/// Starts the task, counted in `shared.tasks` until it ends or is aborted;
/// the store aborts the returned handle to stop it.
pub(crate) fn spawn(shared: Arc<Shared>) -> JoinHandle<()> {
    let tasks = shared.tasks.clone();
    tasks.spawn(async move { run(&shared).await })
}

async fn run(shared: &Shared) {
    let mut tick = tokio::time::interval(shared.config.keep_alive_interval());
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let owned: Vec<(String, Owned)> = shared.owned.lock().iter().map(|(n, o)| (n.clone(), o.clone())).collect();
        for (name, o) in owned {
            let key = shared.config.key_for(&name);
            match keep_alive_once(shared, o.lease, &key).await {
                Ok(true) => {}
                Ok(false) => {
                    tracing::warn!(key, lease = o.lease, "etcd lease expired; publishing the descriptor again");
                    republish(shared, &name, o.lease).await;
                }
                Err(e) => tracing::warn!(key, lease = o.lease, error = %e, "etcd keep-alive failed; will retry"),
            }
        }
    }
}

/// One keep-alive round trip: `Ok(true)` renewed, `Ok(false)` the lease is gone.
async fn keep_alive_once(shared: &Shared, lease: i64, key: &str) -> Result<bool> {
    let ctx = shared.ctx("lease keep-alive", key);
    let mut client = shared.client.clone();
    match bounded(&ctx, shared.config.request_timeout, client.lease_keep_alive(lease)).await {
        Ok(_stream) => Ok(true),
        // etcd-client reports a lease the server does not know as this error
        // (the server answered with TTL <= 0).
        Err(e) if matches!(source_of(&e), Some(etcd_client::Error::LeaseKeepAliveError(_))) => Ok(false),
        Err(e) => Err(e),
    }
}

fn source_of(e: &transport_core::Error) -> Option<&etcd_client::Error> {
    std::error::Error::source(e)?.downcast_ref::<etcd_client::Error>()
}

/// Replaces the lost lease of `name` and publishes its descriptor again.
async fn republish(shared: &Shared, name: &str, lost: i64) {
    let _guard = shared.write_lock.lock().await;
    let desc = match shared.owned.lock().get(name) {
        // Removed, or already replaced by a put, while we waited for the lock.
        Some(o) if o.lease == lost => o.desc.clone(),
        _ => return,
    };
    let key = shared.config.key_for(name);
    let lease = match shared.grant(&key).await {
        Ok(lease) => lease,
        Err(e) => {
            tracing::warn!(key, error = %e, "cannot grant a new etcd lease; will retry");
            return;
        }
    };
    match shared.publish(&desc, lease).await {
        Ok(()) => {
            if let Some(o) = shared.owned.lock().get_mut(name) {
                o.lease = lease;
            }
        }
        Err(e) => {
            let _ = shared.revoke(lease, &key).await;
            if e.kind() == ErrorKind::InvalidRequest {
                tracing::warn!(key, error = %e, "a newer generation took the segment over; giving it up");
                shared.owned.lock().remove(name);
            } else {
                tracing::warn!(key, error = %e, "cannot publish the descriptor again; will retry");
            }
        }
    }
}
