//! The endpoint slots of one transport: [`transport_core::EndpointPool`]
//! (bound, LRU eviction, idle reclaim, "failure frees") behind one mutex,
//! together with the endpoints it decided to keep, the transport's clock
//! and a wake-up for callers waiting on a slot.
//!
//! Generic over the endpoint type so that this module does not depend on
//! the one that builds endpoints (no module cycle).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::Notify;
use transport_core::lifecycle::{Acquire, EndpointId, EndpointPool, Found, PoolCounts, ReleaseUse};
use transport_core::Epoch;

#[derive(Debug)]
struct State<E> {
    pool: EndpointPool<String>,
    /// Every built endpoint until it is destroyed (live or dying).
    built: HashMap<EndpointId, Arc<E>>,
}

/// Endpoint slots, shared by the transport and its endpoints (which hold a
/// `Weak` to report release and destruction).
#[derive(Debug)]
pub(crate) struct Slots<E> {
    state: Mutex<State<E>>,
    origin: Epoch,
    changed: Notify,
}

impl<E> Slots<E> {
    pub fn new(max_endpoints: usize) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(State { pool: EndpointPool::new(max_endpoints), built: HashMap::new() }),
            origin: Epoch::start(),
            changed: Notify::new(),
        })
    }

    /// The transport's clock: time since it started.
    pub fn now(&self) -> Duration {
        self.origin.now()
    }

    /// The transport's clock.
    pub fn epoch(&self) -> Epoch {
        self.origin
    }

    /// What to do to reach `key` (see [`Acquire`]), with the endpoint to use
    /// or destroy, for [`transport_core::lifecycle::reach`].
    pub fn acquire(&self, key: &String) -> Found<Arc<E>> {
        let now = self.now();
        let mut s = self.state.lock();
        match s.pool.acquire(key, now) {
            Acquire::Use(id) => match s.built.get(&id).cloned() {
                Some(e) => Found::Use(e),
                // Live in the pool but not stored: cannot happen; treat as
                // broken so it is never handed out, and ask again.
                None => {
                    s.pool.release(id, now);
                    let _ = s.pool.broken(id);
                    s.pool.destroyed(id);
                    Found::Again
                }
            },
            Acquire::Build(id) => Found::Build(id),
            Acquire::Building(_) => Found::Building,
            Acquire::Evict(id) => match s.built.get(&id).cloned() {
                Some(e) => {
                    endpoint_event("evicted");
                    Found::Evict(e)
                }
                None => {
                    s.pool.destroyed(id);
                    Found::Again
                }
            },
            Acquire::Full { .. } => Found::Full,
        }
    }

    /// The build of `id` succeeded. `false`: it was retired (or already
    /// destroyed: a lane broke as it started) meanwhile; `e` is not kept
    /// and the caller must destroy it (its teardown reports
    /// [`Slots::destroyed`]).
    pub fn built(&self, id: EndpointId, e: &Arc<E>) -> bool {
        let now = self.now();
        let live = {
            let mut s = self.state.lock();
            let live = s.pool.built(id, now);
            if live {
                s.built.insert(id, e.clone());
                endpoint_event("built");
            }
            live
        };
        self.changed.notify_waiters();
        live
    }

    /// The build of `id` failed; nothing exists to destroy.
    pub fn build_failed(&self, id: EndpointId) {
        self.state.lock().pool.build_failed(id);
        self.changed.notify_waiters();
    }

    /// One use of `id` ended.
    pub fn release(&self, id: EndpointId) {
        let now = self.now();
        self.state.lock().pool.release(id, now);
        self.changed.notify_waiters();
    }

    /// `id` broke or is closed: never handed out again. `true` if this call
    /// retired it.
    pub fn broken(&self, id: EndpointId) -> bool {
        self.state.lock().pool.broken(id)
    }

    /// `id` was destroyed (its sockets closed, its tasks joined): its slot
    /// is free.
    pub fn destroyed(&self, id: EndpointId) {
        {
            let mut s = self.state.lock();
            s.pool.destroyed(id);
            if s.built.remove(&id).is_some() {
                endpoint_event("destroyed");
            }
        }
        self.changed.notify_waiters();
    }

    /// Retires the endpoint of `key` (live or building) and returns every
    /// built endpoint of `key` in any state, for destruction, and the ids
    /// of all of them (built or not), to wait for their slots.
    pub fn retire_key_all(&self, key: &String) -> (Vec<Arc<E>>, Vec<EndpointId>) {
        let mut s = self.state.lock();
        let _ = s.pool.retire_key(key);
        let ids: Vec<EndpointId> = s.pool.ids().into_iter().filter(|&id| s.pool.key(id) == Some(key)).collect();
        let eps = ids.iter().filter_map(|id| s.built.get(id).cloned()).collect();
        (eps, ids)
    }

    /// Whether every one of `ids` is destroyed (its slot free).
    pub fn all_gone(&self, ids: &[EndpointId]) -> bool {
        let s = self.state.lock();
        ids.iter().all(|&id| s.pool.state(id).is_none())
    }

    /// Retires every endpoint; returns the built ones for destruction
    /// (including those already dying, whose destroyer may still run).
    pub fn retire_all(&self) -> Vec<Arc<E>> {
        let mut s = self.state.lock();
        let _ = s.pool.retire_all();
        s.built.values().cloned().collect()
    }

    /// Retires endpoints idle for `idle` or longer; returns them.
    pub fn reap(&self, idle: Duration) -> Vec<Arc<E>> {
        let now = self.now();
        let mut s = self.state.lock();
        let ids = s.pool.reap(now, idle);
        let reaped: Vec<Arc<E>> = ids.iter().filter_map(|id| s.built.get(id).cloned()).collect();
        if !reaped.is_empty() {
            metrics::counter!("kvmove_endpoints_total", "backend" => "tcp", "event" => "reclaimed")
                .increment(reaped.len() as u64);
        }
        reaped
    }

    /// Built endpoints (live or dying) whose key `pick` selects.
    pub fn built_where(&self, mut pick: impl FnMut(&E) -> bool) -> Vec<Arc<E>> {
        self.state.lock().built.values().filter(|e| pick(e)).cloned().collect()
    }

    /// Endpoints in each state.
    pub fn counts(&self) -> PoolCounts {
        self.state.lock().pool.counts()
    }

    /// Waits until a slot may have changed or `limit` passed.
    pub async fn changed(&self, limit: Duration) {
        let n = self.changed.notified();
        let _ = tokio::time::timeout(limit, n).await;
    }
}

impl<E: Send + Sync> ReleaseUse for Slots<E> {
    fn release_use(&self, id: EndpointId) {
        self.release(id);
    }
}

/// Counts an endpoint event (`built`, `evicted`, `reclaimed`, `destroyed`)
/// in the metrics.
fn endpoint_event(event: &'static str) {
    metrics::counter!("kvmove_endpoints_total", "backend" => "tcp", "event" => event).increment(1);
    // Live endpoints of every TCP transport in the process.
    match event {
        "built" => metrics::gauge!("kvmove_endpoints_live", "backend" => "tcp").increment(1.0),
        "destroyed" => metrics::gauge!("kvmove_endpoints_live", "backend" => "tcp").decrement(1.0),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn build(slots: &Slots<u32>, key: &str) -> EndpointId {
        match slots.acquire(&key.to_owned()) {
            Found::Build(id) => id,
            other => panic!("expected a build slot, got {other:?}"),
        }
    }

    #[test]
    fn an_endpoint_destroyed_before_it_is_built_is_not_kept() {
        let slots = Slots::<u32>::new(4);
        let id = build(&slots, "peer");
        // A lane broke as it started: its teardown ran before `built`.
        assert!(slots.broken(id));
        slots.destroyed(id);
        assert!(!slots.built(id, &Arc::new(7)));
        assert!(slots.built_where(|_| true).is_empty(), "a destroyed endpoint is never stored");
        assert_eq!(slots.counts().held(), 0);
        // The next acquire builds afresh.
        let again = build(&slots, "peer");
        assert!(slots.built(again, &Arc::new(8)));
        assert_eq!(slots.built_where(|_| true).len(), 1);
    }

    #[test]
    fn an_endpoint_retired_while_building_is_not_kept() {
        let slots = Slots::<u32>::new(4);
        let id = build(&slots, "peer");
        let (eps, ids) = slots.retire_key_all(&"peer".to_owned());
        assert!(eps.is_empty(), "nothing built to hand back yet");
        assert_eq!(ids, vec![id]);
        assert!(!slots.built(id, &Arc::new(7)));
        assert!(slots.built_where(|_| true).is_empty());
        // Its slot is held until the caller destroys what it built.
        assert_eq!(slots.counts().dying, 1);
        assert!(!slots.all_gone(&ids));
        slots.destroyed(id);
        assert!(slots.all_gone(&ids));
        assert_eq!(slots.counts().held(), 0);
    }
}
