//! Reaching a peer's endpoint under the bound (rule 4), written once for
//! every driver that can wait: ask the pool, use or build what it hands
//! out, destroy what it evicts, and wait, bounded, while every slot is
//! busy or another caller is building the endpoint.
//!
//! [`reach`] is the loop; the driver supplies the I/O as callbacks (ask
//! the pool under its lock, destroy an evicted endpoint, wait for a slot
//! to change). Building is left to the caller, which reports the build to
//! the pool itself ([`EndpointPool::built`](super::EndpointPool::built) or
//! [`build_failed`](super::EndpointPool::build_failed)), usually holding a
//! guard so that a dropped caller gives the slot back.
//!
//! [`EndpointUse`] is the one counted use of an endpoint: while it lives
//! the endpoint is busy (never evicted or reaped); dropping it tells the
//! pool ([`ReleaseUse`]).

use std::future::Future;
use std::sync::Weak;
use std::time::Duration;

use super::pool::EndpointId;
use crate::{Error, ErrorKind};

/// What the pool said, as the driver hands it to [`reach`] (the pool's
/// [`Acquire`](super::Acquire), with the driver's endpoint in place of its
/// id where it has one).
#[derive(Debug)]
pub enum Found<E> {
    /// A live endpoint; one use is counted.
    Use(E),
    /// A slot is reserved for a new endpoint: the caller builds it.
    Build(EndpointId),
    /// This idle endpoint was retired to free a slot: destroy it, then ask
    /// again.
    Evict(E),
    /// Something changed under the driver's own lock (an endpoint it
    /// destroyed there): ask again at once.
    Again,
    /// Another caller is building the endpoint to this peer: wait.
    Building,
    /// Every slot is busy (or dying): wait.
    Full,
}

/// What [`reach`] ends with.
#[derive(Debug)]
pub enum Reached<E> {
    /// Use this endpoint (one use counted).
    Use(E),
    /// Build the endpoint in slot `id`.
    Build(EndpointId),
}

/// Why [`reach`] gave up after waiting its bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GaveUp {
    /// Another caller's build of the endpoint took the whole bound.
    Building,
    /// Every slot stayed busy for the whole bound.
    Full,
}

impl GaveUp {
    /// The error a caller gets: a transient `ConnectionRefused` for a build
    /// that did not finish, [`Error::endpoints_exhausted`] for a full pool.
    pub fn error(self, peer: &str, max_endpoints: usize) -> Error {
        match self {
            GaveUp::Building => {
                Error::new(ErrorKind::ConnectionRefused, "connect timed out (another caller's connect to the peer)")
                    .with("peer", peer)
            }
            GaveUp::Full => Error::endpoints_exhausted(peer, max_endpoints),
        }
    }
}

/// Asks the pool (`ask`) until it hands out an endpoint or a slot to build
/// one in. An evicted endpoint is destroyed (`evict`) before asking again;
/// while every slot is busy or another caller builds the endpoint, waits
/// (`wait`, which returns when a slot may have changed or after a short
/// while) for at most `bound` in all, then fails with [`GaveUp::error`].
/// An error from `ask` (shut down, a closed handle) ends it at once.
pub async fn reach<E, EF, WF>(
    peer: &str,
    max_endpoints: usize,
    bound: Duration,
    mut ask: impl FnMut() -> Result<Found<E>, Error>,
    mut evict: impl FnMut(E) -> EF,
    mut wait: impl FnMut() -> WF,
) -> Result<Reached<E>, Error>
where
    EF: Future<Output = ()>,
    WF: Future<Output = ()>,
{
    // `None`: beyond what the clock holds, i.e. never give up.
    let give_up = tokio::time::Instant::now().checked_add(bound);
    loop {
        let gave_up = match ask()? {
            Found::Use(e) => return Ok(Reached::Use(e)),
            Found::Build(id) => return Ok(Reached::Build(id)),
            Found::Evict(e) => {
                evict(e).await;
                continue;
            }
            Found::Again => continue,
            Found::Building => GaveUp::Building,
            Found::Full => GaveUp::Full,
        };
        if give_up.is_some_and(|g| tokio::time::Instant::now() >= g) {
            return Err(gave_up.error(peer, max_endpoints));
        }
        wait().await;
    }
}

/// Whoever counts the uses of endpoints (the driver's pool).
pub trait ReleaseUse: Send + Sync {
    /// One use of `id` ended (the work it carried ended).
    fn release_use(&self, id: EndpointId);
}

/// One counted use of an endpoint, released in its pool when dropped. The
/// pool is held weakly: a use outliving its transport releases nothing.
#[derive(Debug)]
pub struct EndpointUse<P: ReleaseUse + ?Sized> {
    pool: Weak<P>,
    id: EndpointId,
}

impl<P: ReleaseUse + ?Sized> EndpointUse<P> {
    /// A use of `id`, already counted in `pool`.
    pub fn new(pool: Weak<P>, id: EndpointId) -> Self {
        Self { pool, id }
    }

    /// The endpoint in use.
    pub fn id(&self) -> EndpointId {
        self.id
    }
}

impl<P: ReleaseUse + ?Sized> Drop for EndpointUse<P> {
    fn drop(&mut self) {
        if let Some(p) = self.pool.upgrade() {
            p.release_use(self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use super::*;
    use crate::lifecycle::{Acquire, EndpointPool};

    fn found(a: Acquire) -> Found<EndpointId> {
        match a {
            Acquire::Use(id) => Found::Use(id),
            Acquire::Build(id) => Found::Build(id),
            Acquire::Evict(id) => Found::Evict(id),
            Acquire::Building(_) => Found::Building,
            Acquire::Full { .. } => Found::Full,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_evicted_endpoint_is_destroyed_before_its_slot_is_reused() {
        let pool = parking_lot::Mutex::new(EndpointPool::<&str>::new(1));
        let Acquire::Build(a) = pool.lock().acquire(&"a", Duration::ZERO) else { panic!() };
        assert!(pool.lock().built(a, Duration::ZERO));
        pool.lock().release(a, Duration::ZERO);
        let destroyed = parking_lot::Mutex::new(Vec::new());
        let got = reach(
            "b",
            1,
            Duration::from_secs(1),
            || Ok(found(pool.lock().acquire(&"b", Duration::from_millis(1)))),
            |id| {
                pool.lock().destroyed(id);
                destroyed.lock().push(id);
                async {}
            },
            || async {},
        )
        .await
        .unwrap();
        assert!(matches!(got, Reached::Build(b) if b != a));
        assert_eq!(*destroyed.lock(), vec![a]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_pool_is_waited_for_within_the_bound() {
        let pool = parking_lot::Mutex::new(EndpointPool::<&str>::new(1));
        let Acquire::Build(a) = pool.lock().acquire(&"a", Duration::ZERO) else { panic!() };
        assert!(pool.lock().built(a, Duration::ZERO));
        // `a` stays busy: "b" waits, then gives up after the bound.
        let waits = AtomicUsize::new(0);
        let start = tokio::time::Instant::now();
        let err = reach(
            "b",
            1,
            Duration::from_millis(100),
            || Ok(found(pool.lock().acquire(&"b", Duration::ZERO))),
            |_| async {},
            || {
                waits.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(5))
            },
        )
        .await
        .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::ResourceExhausted);
        assert!(start.elapsed() >= Duration::from_millis(100));
        assert!(waits.load(Ordering::Relaxed) >= 20);
        // A slot that frees while waiting is taken.
        let freed = AtomicUsize::new(0);
        let got = reach(
            "b",
            1,
            Duration::from_secs(1),
            || Ok(found(pool.lock().acquire(&"b", Duration::ZERO))),
            |id| {
                pool.lock().destroyed(id);
                async {}
            },
            || {
                if freed.fetch_add(1, Ordering::Relaxed) == 3 {
                    pool.lock().release(a, Duration::ZERO);
                }
                tokio::time::sleep(Duration::from_millis(5))
            },
        )
        .await
        .unwrap();
        assert!(matches!(got, Reached::Build(_)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_build_by_another_caller_is_waited_for_then_refused() {
        let pool = parking_lot::Mutex::new(EndpointPool::<&str>::new(4));
        let Acquire::Build(_) = pool.lock().acquire(&"a", Duration::ZERO) else { panic!() };
        let err = reach(
            "a",
            4,
            Duration::from_millis(50),
            || Ok(found(pool.lock().acquire(&"a", Duration::ZERO))),
            |_| async {},
            || tokio::time::sleep(Duration::from_millis(5)),
        )
        .await
        .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::ConnectionRefused);
        assert!(err.is_transient());
        // An error from the pool's driver ends the loop at once.
        let err =
            reach::<EndpointId, _, _>("a", 4, Duration::MAX, || Err(Error::shut_down()), |_| async {}, || async {})
                .await
                .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Shutdown);
    }

    struct Counted(AtomicUsize);

    impl ReleaseUse for Counted {
        fn release_use(&self, _: EndpointId) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn a_use_is_released_once_and_not_after_its_pool() {
        let pool = Arc::new(Counted(AtomicUsize::new(0)));
        let u = EndpointUse::new(Arc::downgrade(&pool), EndpointId(3));
        assert_eq!(u.id(), EndpointId(3));
        drop(u);
        assert_eq!(pool.0.load(Ordering::Relaxed), 1);
        let late = EndpointUse::new(Arc::downgrade(&pool), EndpointId(4));
        drop(pool);
        drop(late); // nothing to tell, no panic
    }
}
