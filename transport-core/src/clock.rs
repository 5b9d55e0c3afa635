//! Time: a driver's origin ([`Epoch`]), and for the policy layer a clock
//! tests can fake.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use parking_lot::Mutex;
use tokio::sync::oneshot;

/// A driver's time origin: the lifecycle machines take time as the
/// `Duration` since it (their `now`), and the driver turns those times
/// back into instants to sleep until. One overflow rule for every driver:
/// a time past what `Instant` can hold (a caller's huge timeout) is never,
/// so [`Epoch::instant`] is `None` and the driver does not wake for it; it
/// never panics (rule 6) and never substitutes another time.
#[derive(Debug, Clone, Copy)]
pub struct Epoch(std::time::Instant);

impl Epoch {
    /// An epoch starting now.
    pub fn start() -> Self {
        Self(std::time::Instant::now())
    }

    /// Now on this clock: the time since the epoch.
    pub fn now(&self) -> Duration {
        self.0.elapsed()
    }

    /// The instant `at` on this clock; `None`: beyond what `Instant`
    /// holds, i.e. never.
    pub fn instant(&self, at: Duration) -> Option<std::time::Instant> {
        self.0.checked_add(at)
    }

    /// When something due `after` from now is due on this clock; `None`:
    /// never.
    pub fn after(&self, after: Duration) -> Option<Duration> {
        self.now().checked_add(after)
    }

    /// Sleeps until `at` on this clock (`None`, or beyond what `Instant`
    /// holds: never), or until `sooner` completes: a deadline timer's wait
    /// for the queue's next entry or an earlier one entered meanwhile.
    pub async fn sleep_until_or(&self, at: Option<Duration>, sooner: impl std::future::Future<Output = ()>) {
        match at.and_then(|at| self.instant(at)) {
            Some(when) => {
                tokio::select! {
                    () = tokio::time::sleep_until(tokio::time::Instant::from_std(when)) => {}
                    () = sooner => {}
                }
            }
            None => sooner.await,
        }
    }
}

/// A monotonic clock and a way to sleep on it.
pub trait Clock: Send + Sync + fmt::Debug + 'static {
    /// Time since an arbitrary fixed origin.
    fn now(&self) -> Duration;
    /// A future that completes once `now()` has advanced by `d`.
    fn sleep(&self, d: Duration) -> BoxFuture<'static, ()>;
}

/// The real clock (tokio's timer, so `tokio::time::pause` also works).
#[derive(Debug, Clone)]
pub struct SystemClock {
    origin: tokio::time::Instant,
}

impl SystemClock {
    /// A clock whose origin is now.
    pub fn new() -> Self {
        Self { origin: tokio::time::Instant::now() }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }
    fn sleep(&self, d: Duration) -> BoxFuture<'static, ()> {
        Box::pin(tokio::time::sleep(d))
    }
}

/// A clock that only moves when a test calls [`ManualClock::advance`].
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    inner: Arc<Mutex<ManualInner>>,
}

#[derive(Debug, Default)]
struct ManualInner {
    now: Duration,
    next_id: u64,
    sleepers: BTreeMap<(Duration, u64), oneshot::Sender<()>>,
}

impl ManualClock {
    /// A clock at time zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Moves time forward and wakes every sleeper whose time has come.
    pub fn advance(&self, d: Duration) {
        let mut g = self.inner.lock();
        g.now += d;
        let now = g.now;
        let later = g.sleepers.split_off(&(now, u64::MAX));
        let due = std::mem::replace(&mut g.sleepers, later);
        drop(g);
        for (_, tx) in due {
            let _ = tx.send(());
        }
    }

    /// Number of sleepers waiting (lets a test wait until the code under test
    /// has gone to sleep before advancing).
    pub fn sleepers(&self) -> usize {
        self.inner.lock().sleepers.len()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Duration {
        self.inner.lock().now
    }
    fn sleep(&self, d: Duration) -> BoxFuture<'static, ()> {
        let (tx, rx) = oneshot::channel();
        {
            let mut g = self.inner.lock();
            if d.is_zero() {
                let _ = tx.send(());
            } else {
                let at = g.now + d;
                g.next_id += 1;
                let id = g.next_id;
                g.sleepers.insert((at, id), tx);
            }
        }
        Box::pin(async move {
            let _ = rx.await;
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_timer_wakes_at_its_time_or_sooner_and_never_past_the_clock() {
        let e = Epoch::start();
        // Due soon: wakes then, though `sooner` never completes.
        let t0 = std::time::Instant::now();
        e.sleep_until_or(Some(e.now() + Duration::from_millis(30)), std::future::pending()).await;
        assert!(t0.elapsed() >= Duration::from_millis(25));
        // Never (nothing due, or past the clock): only `sooner` wakes it.
        for at in [None, Some(Duration::MAX)] {
            let woke = tokio::time::timeout(Duration::from_millis(50), e.sleep_until_or(at, std::future::pending()));
            assert!(woke.await.is_err(), "{at:?} woke up by itself");
            e.sleep_until_or(at, async {}).await;
        }
        // Sooner than the time: `sooner` wins.
        let t0 = std::time::Instant::now();
        e.sleep_until_or(Some(e.now() + Duration::from_secs(60)), tokio::time::sleep(Duration::from_millis(10))).await;
        assert!(t0.elapsed() < Duration::from_secs(30));
    }

    #[test]
    fn a_time_past_what_the_clock_holds_is_never() {
        let e = Epoch::start();
        assert!(e
            .instant(Duration::from_millis(5))
            .is_some_and(|i| i > std::time::Instant::now() - Duration::from_secs(1)));
        assert_eq!(e.instant(Duration::MAX), None);
        assert_eq!(e.after(Duration::MAX), None);
        assert!(e.after(Duration::from_secs(1)).is_some_and(|d| d >= Duration::from_secs(1)));
    }

    #[tokio::test]
    async fn manual_clock_wakes_in_order() {
        let c = ManualClock::new();
        let a = c.sleep(Duration::from_secs(2));
        let b = c.sleep(Duration::from_secs(1));
        assert_eq!(c.sleepers(), 2);
        c.advance(Duration::from_secs(1));
        b.await;
        assert_eq!(c.sleepers(), 1);
        c.advance(Duration::from_secs(1));
        a.await;
        assert_eq!(c.now(), Duration::from_secs(2));
    }
}
