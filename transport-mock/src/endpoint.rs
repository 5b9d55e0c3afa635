//! Endpoints: one simulated connection from this host to a peer host,
//! created lazily on the first transfer, bounded with LRU eviction of idle
//! ones, reclaimed by the reaper, destroyed when broken.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

#[derive(Debug)]
pub(crate) struct Endpoint {
    pub id: u64,
    pub peer: String,
    /// The peer's generation when the endpoint was built.
    pub peer_generation: u64,
    broken: AtomicBool,
    destroyed: AtomicBool,
    users: AtomicUsize,
    last_used: Mutex<Instant>,
}

impl Endpoint {
    pub fn new(id: u64, peer: String, peer_generation: u64) -> Self {
        Self {
            id,
            peer,
            peer_generation,
            broken: AtomicBool::new(false),
            destroyed: AtomicBool::new(false),
            users: AtomicUsize::new(0),
            last_used: Mutex::new(Instant::now()),
        }
    }

    /// The connection failed (reset, cut, peer gone).
    pub fn break_it(&self) {
        self.broken.store(true, Ordering::SeqCst);
    }

    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::SeqCst)
    }

    pub fn is_destroyed(&self) -> bool {
        self.destroyed.load(Ordering::SeqCst)
    }

    fn destroy(&self) {
        self.broken.store(true, Ordering::SeqCst);
        self.destroyed.store(true, Ordering::SeqCst);
    }

    fn idle(&self) -> bool {
        self.users.load(Ordering::SeqCst) == 0
    }
}

/// A request's use of an endpoint; while one exists the endpoint is busy
/// (never evicted or reaped).
#[derive(Debug)]
pub(crate) struct EndpointUse {
    pub ep: Arc<Endpoint>,
}

impl EndpointUse {
    fn new(ep: Arc<Endpoint>) -> Self {
        ep.users.fetch_add(1, Ordering::SeqCst);
        Self { ep }
    }
}

impl Drop for EndpointUse {
    fn drop(&mut self) {
        *self.ep.last_used.lock() = Instant::now();
        self.ep.users.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Live endpoints by peer name, plus those leaked by the
/// `leak_endpoint_on_failure` bug.
#[derive(Debug, Default)]
pub(crate) struct EndpointCache {
    live: HashMap<String, Arc<Endpoint>>,
    leaked: Vec<Arc<Endpoint>>,
}

impl EndpointCache {
    /// Endpoints allocated (live and leaked).
    pub fn count(&self) -> usize {
        self.live.len() + self.leaked.len()
    }

    pub fn has_live(&self) -> bool {
        !self.live.is_empty()
    }

    pub fn get(&self, peer: &str) -> Option<Arc<Endpoint>> {
        self.live.get(peer).cloned()
    }

    pub fn use_of(&self, ep: &Arc<Endpoint>) -> EndpointUse {
        EndpointUse::new(ep.clone())
    }

    pub fn insert(&mut self, ep: Arc<Endpoint>) -> EndpointUse {
        let u = EndpointUse::new(ep.clone());
        if let Some(old) = self.live.insert(ep.peer.clone(), ep) {
            old.destroy();
        }
        u
    }

    /// Takes `ep` out of the cache (if it is the cached one) and destroys it,
    /// or, with `leak`, keeps it allocated and counted forever.
    pub fn remove(&mut self, ep: &Arc<Endpoint>, leak: bool) {
        if self.live.get(&ep.peer).is_some_and(|e| e.id == ep.id) {
            self.live.remove(&ep.peer);
        }
        if leak {
            ep.break_it();
            if !self.leaked.iter().any(|e| e.id == ep.id) {
                self.leaked.push(ep.clone());
            }
        } else {
            ep.destroy();
        }
    }

    /// Destroys the endpoint to `peer`, if any.
    pub fn destroy_peer(&mut self, peer: &str) -> bool {
        match self.live.remove(peer) {
            Some(ep) => {
                ep.destroy();
                true
            }
            None => false,
        }
    }

    /// Destroys the least recently used idle endpoint; false if all are busy.
    pub fn evict_lru_idle(&mut self) -> bool {
        let victim =
            self.live.values().filter(|e| e.idle()).min_by_key(|e| *e.last_used.lock()).map(|e| e.peer.clone());
        match victim {
            Some(peer) => self.destroy_peer(&peer),
            None => false,
        }
    }

    /// Destroys idle endpoints unused for `idle_timeout`; returns how many.
    pub fn reap(&mut self, now: Instant, idle_timeout: Duration) -> usize {
        let old: Vec<String> = self
            .live
            .values()
            .filter(|e| e.idle() && now.saturating_duration_since(*e.last_used.lock()) >= idle_timeout)
            .map(|e| e.peer.clone())
            .collect();
        old.iter().filter(|p| self.destroy_peer(p)).count()
    }

    /// Breaks every live endpoint toward `peer` (a cut); they stay cached
    /// until a request notices.
    pub fn break_peer(&self, peer: &str) {
        if let Some(ep) = self.live.get(peer) {
            ep.break_it();
        }
    }

    pub fn clear(&mut self) {
        for ep in self.live.values().chain(self.leaked.iter()) {
            ep.destroy();
        }
        self.live.clear();
        self.leaked.clear();
    }
}
