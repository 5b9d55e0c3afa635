//! The endpoint pool: the bound on live endpoints, LRU eviction and idle
//! reclaim (rule 4), and "failure frees" (rule 2), decided once for every
//! backend.
//!
//! The pool owns no connection. It hands out [`EndpointId`]s and tells the
//! driver what to do: use this endpoint, build one in a slot it reserved,
//! destroy that one first, or wait. A slot under the bound is given back
//! only when the driver reports the endpoint *destroyed*
//! ([`EndpointPool::destroyed`]), so the operating system's count of
//! connections (sockets, kernel QPs) never exceeds the bound, not even while
//! a replacement is being built.
//!
//! Endpoints move `Building -> Live -> Dying -> (gone)`; a `Dying` endpoint
//! is never handed out again (a broken endpoint is never cached). Time is
//! passed in (a `Duration` on the driver's monotonic clock).

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasher, Hash};
use std::time::Duration;

use super::IdMap;

/// One endpoint of a pool. Never reused within a pool, so a late report
/// about a destroyed endpoint can never touch its successor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EndpointId(pub u64);

impl fmt::Display for EndpointId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "endpoint#{}", self.0)
    }
}

/// Where an endpoint is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointState {
    /// A slot is reserved; the driver is connecting.
    Building,
    /// Usable.
    Live,
    /// Broken, evicted, reclaimed or closed: never handed out again; its
    /// slot is held until the driver reports it destroyed.
    Dying,
}

/// The pool's answer to [`EndpointPool::acquire`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acquire {
    /// Use this live endpoint (one use is counted; end it with
    /// [`EndpointPool::release`]).
    Use(EndpointId),
    /// No endpoint to the key: a slot is reserved for this new id; build
    /// the connection, then report [`EndpointPool::built`] or
    /// [`EndpointPool::build_failed`].
    Build(EndpointId),
    /// Another caller is building the endpoint to this key: wait for it
    /// and ask again.
    Building(EndpointId),
    /// The bound is reached; this idle endpoint (least recently used) is now
    /// `Dying`: destroy it, report [`EndpointPool::destroyed`], ask again.
    Evict(EndpointId),
    /// The bound is reached and nothing can be evicted now: `busy` live or
    /// building endpoints have users, `dying` ones wait to be destroyed.
    /// Wait for one of them (bounded by the driver's connect timeout).
    Full {
        /// Live or building endpoints in use.
        busy: usize,
        /// Endpoints waiting for the driver to destroy them.
        dying: usize,
    },
}

#[derive(Debug, Clone)]
struct Entry<K> {
    key: K,
    state: EndpointState,
    users: usize,
    last_used: Duration,
}

/// Counts for `stats()`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolCounts {
    /// Live endpoints.
    pub live: usize,
    /// Endpoints being built.
    pub building: usize,
    /// Endpoints waiting to be destroyed.
    pub dying: usize,
}

impl PoolCounts {
    /// Slots held (every endpoint that exists in any state).
    pub fn held(&self) -> usize {
        self.live + self.building + self.dying
    }
}

/// A bounded set of endpoints keyed by peer (`K`: a peer name, a segment
/// handle, ...; `S` hashes the keys: the standard hasher unless the keys
/// are the driver's own ids, see [`IdMap`]). Not synchronised: the driver
/// keeps it behind its lock.
#[derive(Debug, Clone)]
pub struct EndpointPool<K, S = RandomState> {
    max: usize,
    entries: IdMap<EndpointId, Entry<K>>,
    /// The building or live endpoint of each key.
    by_key: HashMap<K, EndpointId, S>,
    next: u64,
}

impl<K: Clone + Eq + Hash> EndpointPool<K> {
    /// A pool of at most `max_endpoints` endpoints (at least one), its keys
    /// hashed by the standard hasher.
    pub fn new(max_endpoints: usize) -> Self {
        Self::with_hasher(max_endpoints)
    }
}

impl<K: Clone + Eq + Hash, S: BuildHasher + Default> EndpointPool<K, S> {
    /// A pool of at most `max_endpoints` endpoints (at least one), its keys
    /// hashed by `S`.
    pub fn with_hasher(max_endpoints: usize) -> Self {
        Self { max: max_endpoints.max(1), entries: IdMap::default(), by_key: HashMap::default(), next: 1 }
    }

    /// The bound.
    pub fn max(&self) -> usize {
        self.max
    }

    /// What to do to reach `key` at time `now` (see [`Acquire`]).
    pub fn acquire(&mut self, key: &K, now: Duration) -> Acquire {
        if let Some(&id) = self.by_key.get(key) {
            if let Some(e) = self.entries.get_mut(&id) {
                return match e.state {
                    EndpointState::Live => {
                        e.users += 1;
                        e.last_used = now;
                        Acquire::Use(id)
                    }
                    EndpointState::Building => Acquire::Building(id),
                    // by_key never holds a dying endpoint.
                    EndpointState::Dying => Acquire::Full { busy: 0, dying: 1 },
                };
            }
        }
        if self.entries.len() < self.max {
            let id = EndpointId(self.next);
            self.next += 1;
            self.entries
                .insert(id, Entry { key: key.clone(), state: EndpointState::Building, users: 1, last_used: now });
            self.by_key.insert(key.clone(), id);
            return Acquire::Build(id);
        }
        let victim = self
            .entries
            .iter()
            .filter(|(_, e)| e.state == EndpointState::Live && e.users == 0)
            .min_by_key(|(id, e)| (e.last_used, **id))
            .map(|(id, _)| *id);
        if let Some(id) = victim {
            self.retire(id);
            return Acquire::Evict(id);
        }
        let dying = self.entries.values().filter(|e| e.state == EndpointState::Dying).count();
        Acquire::Full { busy: self.entries.len() - dying, dying }
    }

    /// The build of `id` succeeded at `now`. Returns `false` if the endpoint
    /// was retired while it was being built (closed, shut down): the driver
    /// must destroy what it built and report [`EndpointPool::destroyed`].
    pub fn built(&mut self, id: EndpointId, now: Duration) -> bool {
        match self.entries.get_mut(&id) {
            Some(e) if e.state == EndpointState::Building => {
                e.state = EndpointState::Live;
                e.last_used = now;
                true
            }
            _ => false,
        }
    }

    /// The build of `id` failed: nothing exists to destroy; its slot is free.
    pub fn build_failed(&mut self, id: EndpointId) {
        self.forget(id);
    }

    /// Counts one more use of a live endpoint (the driver found it by id).
    /// It takes no time: an endpoint with users is never idle, and its idle
    /// time starts when its last use is released ([`EndpointPool::release`]),
    /// so a hot path that finds its endpoint this way reads no clock.
    pub fn use_again(&mut self, id: EndpointId) -> bool {
        match self.entries.get_mut(&id) {
            Some(e) if e.state == EndpointState::Live => {
                e.users += 1;
                true
            }
            _ => false,
        }
    }

    /// One use of `id` ended at `now` (the work it carried ended).
    pub fn release(&mut self, id: EndpointId, now: Duration) {
        if let Some(e) = self.entries.get_mut(&id) {
            e.users = e.users.saturating_sub(1);
            e.last_used = e.last_used.max(now);
        }
    }

    /// `id` broke (rule 2): it is never handed out again. Returns `true` if
    /// this call retired it: the driver must destroy it and then report
    /// [`EndpointPool::destroyed`].
    pub fn broken(&mut self, id: EndpointId) -> bool {
        match self.entries.get(&id) {
            Some(e) if e.state != EndpointState::Dying => {
                self.retire(id);
                true
            }
            _ => false,
        }
    }

    /// Retires the endpoint of `key`, if any (close, peer restart). Returns
    /// it if this call retired it: destroy it, then report `destroyed`.
    pub fn retire_key(&mut self, key: &K) -> Option<EndpointId> {
        let id = *self.by_key.get(key)?;
        self.broken(id).then_some(id)
    }

    /// Retires every endpoint that is not already dying (shutdown); returns
    /// them for the driver to destroy.
    pub fn retire_all(&mut self) -> Vec<EndpointId> {
        let ids: Vec<EndpointId> =
            self.entries.iter().filter(|(_, e)| e.state != EndpointState::Dying).map(|(id, _)| *id).collect();
        for &id in &ids {
            self.retire(id);
        }
        ids
    }

    /// Retires live endpoints without users that were last used
    /// `idle_timeout` or longer before `now` (the idle reclaim of rule 4);
    /// returns them for the driver to destroy.
    pub fn reap(&mut self, now: Duration, idle_timeout: Duration) -> Vec<EndpointId> {
        let ids: Vec<EndpointId> = self
            .entries
            .iter()
            .filter(|(_, e)| {
                e.state == EndpointState::Live && e.users == 0 && now.saturating_sub(e.last_used) >= idle_timeout
            })
            .map(|(id, _)| *id)
            .collect();
        for &id in &ids {
            self.retire(id);
        }
        ids
    }

    /// The driver destroyed `id` (its sockets closed, its QPs destroyed):
    /// the slot is free. Unknown ids are ignored (reported twice).
    pub fn destroyed(&mut self, id: EndpointId) {
        self.forget(id);
    }

    /// The live endpoint of `key`.
    pub fn live(&self, key: &K) -> Option<EndpointId> {
        let id = *self.by_key.get(key)?;
        (self.state(id) == Some(EndpointState::Live)).then_some(id)
    }

    /// The state of `id` (`None` once destroyed or never known).
    pub fn state(&self, id: EndpointId) -> Option<EndpointState> {
        self.entries.get(&id).map(|e| e.state)
    }

    /// The key of `id`.
    pub fn key(&self, id: EndpointId) -> Option<&K> {
        self.entries.get(&id).map(|e| &e.key)
    }

    /// Uses of `id` not yet released.
    pub fn users(&self, id: EndpointId) -> usize {
        self.entries.get(&id).map_or(0, |e| e.users)
    }

    /// Endpoints in each state.
    pub fn counts(&self) -> PoolCounts {
        let mut c = PoolCounts::default();
        for e in self.entries.values() {
            match e.state {
                EndpointState::Live => c.live += 1,
                EndpointState::Building => c.building += 1,
                EndpointState::Dying => c.dying += 1,
            }
        }
        c
    }

    /// Every endpoint id in the pool, in any state.
    pub fn ids(&self) -> Vec<EndpointId> {
        self.entries.keys().copied().collect()
    }

    fn retire(&mut self, id: EndpointId) {
        if let Some(e) = self.entries.get_mut(&id) {
            e.state = EndpointState::Dying;
            if self.by_key.get(&e.key) == Some(&id) {
                self.by_key.remove(&e.key);
            }
        }
    }

    fn forget(&mut self, id: EndpointId) {
        if let Some(e) = self.entries.remove(&id) {
            if self.by_key.get(&e.key) == Some(&id) {
                self.by_key.remove(&e.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn build(p: &mut EndpointPool<&'static str>, k: &'static str, now: Duration) -> EndpointId {
        match p.acquire(&k, now) {
            Acquire::Build(id) => {
                assert!(p.built(id, now));
                id
            }
            other => panic!("expected a build for {k}, got {other:?}"),
        }
    }

    #[test]
    fn reuses_the_live_endpoint_of_a_key() {
        let mut p = EndpointPool::new(2);
        let a = build(&mut p, "a", ms(0));
        assert_eq!(p.acquire(&"a", ms(1)), Acquire::Use(a));
        assert_eq!(p.users(a), 2);
    }

    #[test]
    fn evicts_the_least_recently_used_idle_endpoint_and_frees_its_slot_only_when_destroyed() {
        let mut p = EndpointPool::new(2);
        let a = build(&mut p, "a", ms(0));
        let b = build(&mut p, "b", ms(5));
        p.release(a, ms(10));
        p.release(b, ms(6));
        assert_eq!(p.acquire(&"c", ms(20)), Acquire::Evict(b));
        assert_eq!(p.acquire(&"c", ms(21)), Acquire::Evict(a));
        assert_eq!(p.acquire(&"c", ms(22)), Acquire::Full { busy: 0, dying: 2 }, "no slot until destroyed");
        p.destroyed(b);
        assert!(matches!(p.acquire(&"c", ms(23)), Acquire::Build(_)));
    }

    #[test]
    fn busy_endpoints_are_never_evicted_or_reaped() {
        let mut p = EndpointPool::new(1);
        let a = build(&mut p, "a", ms(0));
        assert_eq!(p.acquire(&"b", ms(1)), Acquire::Full { busy: 1, dying: 0 });
        assert!(p.reap(ms(10_000), ms(1)).is_empty());
        p.release(a, ms(2));
        assert_eq!(p.reap(ms(3), ms(5)), vec![]);
        assert_eq!(p.reap(ms(7), ms(5)), vec![a]);
        assert_eq!(p.state(a), Some(EndpointState::Dying));
    }

    #[test]
    fn an_endpoint_used_again_is_idle_only_from_its_last_release() {
        // Rule 4: use_again takes no time; idleness counts from the release
        // of the last use, however long the endpoint was busy before.
        let mut p = EndpointPool::new(1);
        let a = build(&mut p, "a", ms(0));
        p.release(a, ms(1));
        assert!(p.use_again(a));
        assert_eq!(p.users(a), 1);
        assert!(p.reap(ms(1_000), ms(5)).is_empty(), "in use: never reaped");
        p.release(a, ms(1_000));
        assert!(p.reap(ms(1_004), ms(5)).is_empty(), "idle for 4 ms only");
        assert_eq!(p.reap(ms(1_005), ms(5)), vec![a]);
        assert!(!p.use_again(a), "a retired endpoint is not used again");
    }

    #[test]
    fn a_broken_endpoint_is_never_handed_out_again() {
        let mut p = EndpointPool::new(2);
        let a = build(&mut p, "a", ms(0));
        assert!(p.broken(a));
        assert!(!p.broken(a), "retired once");
        let next = p.acquire(&"a", ms(1));
        assert!(matches!(next, Acquire::Build(id) if id != a));
        assert_eq!(p.counts(), PoolCounts { live: 0, building: 1, dying: 1 });
    }

    #[test]
    fn a_build_retired_meanwhile_must_be_destroyed() {
        let mut p = EndpointPool::new(1);
        let Acquire::Build(id) = p.acquire(&"a", ms(0)) else { panic!("build") };
        assert_eq!(p.acquire(&"a", ms(0)), Acquire::Building(id));
        assert_eq!(p.retire_key(&"a"), Some(id));
        assert!(!p.built(id, ms(1)));
        p.destroyed(id);
        assert_eq!(p.counts().held(), 0);
    }
}
