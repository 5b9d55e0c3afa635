//! Endpoints: the mock's simulated connections (this host -> a peer host),
//! kept in the lifecycle core's [`EndpointPool`], which decides the bound,
//! LRU eviction and idle reclaim (rule 4) and never hands out a broken
//! endpoint (rule 2). This module keeps only what is mock-specific: the
//! [`Link`] (the peer's generation and a "broken" flag a cut sets) and
//! destroying it, which in the mock is immediate.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, MutexGuard};
use transport_core::lifecycle::{Acquire, EndpointId, EndpointPool, ReleaseUse};
use transport_core::{Error, ErrorKind, Result};

use crate::wake::Clock;

/// One simulated connection.
#[derive(Debug)]
pub(crate) struct Link {
    pub id: EndpointId,
    /// The peer's generation when the endpoint was built.
    pub peer_generation: u64,
    broken: AtomicBool,
}

impl Link {
    /// The connection failed (cut, reset, peer gone, destroyed).
    pub fn break_it(&self) {
        self.broken.store(true, Ordering::SeqCst);
    }

    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::SeqCst)
    }
}

/// The pool and the links of its live endpoints.
#[derive(Debug)]
pub(crate) struct Endpoints {
    pool: EndpointPool<String>,
    links: HashMap<EndpointId, Arc<Link>>,
}

/// What [`Endpoints::acquire`] found.
pub(crate) enum Reach {
    /// Use this link (one use is counted in the pool).
    Use(Arc<Link>),
    /// Every slot is busy: wait for an event and ask again.
    Wait,
}

impl Endpoints {
    pub fn new(max_endpoints: usize) -> Self {
        Self { pool: EndpointPool::new(max_endpoints), links: HashMap::new() }
    }

    /// Slots held: live endpoints and leaked ones (rule 1's count).
    pub fn held(&self) -> usize {
        self.pool.counts().held()
    }

    pub fn max(&self) -> usize {
        self.pool.max()
    }

    /// The live link to `peer`, if any.
    pub fn link_to(&self, peer: &str) -> Option<Arc<Link>> {
        self.pool.live(&peer.to_owned()).and_then(|id| self.links.get(&id).cloned())
    }

    /// Rule 4: the live endpoint to `peer`, or a new one built under the
    /// bound (evicting the least recently used idle one), or `Wait`.
    /// `handshake(held)` is the fault plan's say on a new endpoint.
    pub fn acquire(
        &mut self,
        peer: &str,
        generation: u64,
        now: Duration,
        handshake: impl FnOnce(usize) -> Option<Error>,
    ) -> Result<Reach> {
        let key = peer.to_owned();
        // Each eviction frees a slot, so this ends within `max + 1` rounds.
        for _ in 0..=self.pool.max() {
            match self.pool.acquire(&key, now) {
                Acquire::Use(id) => match self.links.get(&id) {
                    Some(link) => return Ok(Reach::Use(link.clone())),
                    None => self.destroy(id),
                },
                Acquire::Build(id) => return self.build(id, generation, now, handshake),
                Acquire::Evict(id) => self.destroy(id),
                Acquire::Building(_) => return Ok(Reach::Wait),
                Acquire::Full { busy, .. } if busy > 0 => return Ok(Reach::Wait),
                // Only endpoints nobody will destroy (leaked) hold the slots.
                Acquire::Full { dying, .. } => {
                    return Err(Error::new(ErrorKind::ResourceExhausted, "Failed to create QP: Cannot allocate memory")
                        .with("peer", peer)
                        .with("held_endpoints", dying))
                }
            }
        }
        Ok(Reach::Wait)
    }

    fn build(
        &mut self,
        id: EndpointId,
        generation: u64,
        now: Duration,
        handshake: impl FnOnce(usize) -> Option<Error>,
    ) -> Result<Reach> {
        if let Some(e) = handshake(self.held().saturating_sub(1)) {
            self.pool.build_failed(id);
            return Err(e);
        }
        let link = Arc::new(Link { id, peer_generation: generation, broken: AtomicBool::new(false) });
        if !self.pool.built(id, now) {
            self.destroy(id);
            return Ok(Reach::Wait);
        }
        self.links.insert(id, link.clone());
        Ok(Reach::Use(link))
    }

    /// Rule 2: a failed endpoint is never handed out again and is destroyed
    /// at once. With `leak` (a deliberate bug) it is never reported
    /// destroyed, so its slot stays held.
    pub fn failed(&mut self, id: EndpointId, leak: bool) {
        if let Some(link) = self.links.remove(&id) {
            link.break_it();
        }
        if self.pool.broken(id) && !leak {
            self.pool.destroyed(id);
        }
    }

    /// Destroys `id` and frees its slot.
    fn destroy(&mut self, id: EndpointId) {
        if let Some(link) = self.links.remove(&id) {
            link.break_it();
        }
        self.pool.destroyed(id);
    }

    /// Rule 3: destroys the endpoint to `peer` (its last handle closed).
    pub fn close_peer(&mut self, peer: &str) {
        if let Some(id) = self.pool.retire_key(&peer.to_owned()) {
            self.destroy(id);
        }
    }

    /// A cut: the live link to `peer` breaks; it stays pooled until a
    /// request notices (as a real connection would).
    pub fn cut(&self, peer: &str) {
        if let Some(link) = self.link_to(peer) {
            link.break_it();
        }
    }

    /// Rule 4: destroys endpoints idle for `idle_timeout`; returns how many.
    pub fn reap(&mut self, now: Duration, idle_timeout: Duration) -> usize {
        let ids = self.pool.reap(now, idle_timeout);
        for &id in &ids {
            self.destroy(id);
        }
        ids.len()
    }

    /// Teardown: every endpoint destroyed, leaked ones included.
    pub fn clear(&mut self) {
        for id in self.pool.ids() {
            self.destroy(id);
        }
    }

    fn release(&mut self, id: EndpointId, now: Duration) {
        self.pool.release(id, now);
    }
}

/// A host's endpoints behind their lock, with the host's clock (a released
/// use is stamped with it).
#[derive(Debug)]
pub(crate) struct SharedEndpoints {
    eps: Mutex<Endpoints>,
    clock: Clock,
}

impl SharedEndpoints {
    pub fn new(eps: Endpoints, clock: Clock) -> Arc<Self> {
        Arc::new(Self { eps: Mutex::new(eps), clock })
    }

    pub fn lock(&self) -> MutexGuard<'_, Endpoints> {
        self.eps.lock()
    }
}

impl ReleaseUse for SharedEndpoints {
    fn release_use(&self, id: EndpointId) {
        let now = self.clock.now();
        self.eps.lock().release(id, now);
    }
}

/// One request's use of an endpoint; while it exists the endpoint is busy
/// (never evicted or reaped). Dropping it releases the use in the pool
/// (the core's counted use), so it must not be dropped while the endpoints
/// lock is held.
pub(crate) struct EndpointUse {
    pub link: Arc<Link>,
    _use: transport_core::lifecycle::EndpointUse<SharedEndpoints>,
}

impl EndpointUse {
    pub fn new(link: Arc<Link>, endpoints: &Arc<SharedEndpoints>) -> Self {
        let id = link.id;
        Self { link, _use: transport_core::lifecycle::EndpointUse::new(Arc::downgrade(endpoints), id) }
    }
}
