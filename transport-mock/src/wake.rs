//! What waiters share: the fabric-wide event channel (every change that may
//! unblock a waiter bumps it) and a host's monotonic clock, on which the
//! lifecycle core's deadlines and endpoint times are `Duration`s.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

/// One event channel for a whole fabric. Cheap to clone.
#[derive(Debug, Clone)]
pub(crate) struct Events(Arc<watch::Sender<u64>>);

impl Default for Events {
    fn default() -> Self {
        Self(Arc::new(watch::channel(0).0))
    }
}

impl Events {
    /// Wakes every waiter: something changed.
    pub fn bump(&self) {
        self.0.send_modify(|v| *v = v.wrapping_add(1));
    }

    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.0.subscribe()
    }
}

/// A host's clock: the time since the host started.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Clock(Instant);

impl Clock {
    pub fn start() -> Self {
        Self(Instant::now())
    }

    /// Now, on this clock.
    pub fn now(&self) -> Duration {
        self.0.elapsed()
    }

    /// The instant `at` on this clock, for `sleep_until`. A time past what
    /// `Instant` can hold (a caller's huge timeout) is a year from the
    /// start instead of a panic (rule 6).
    pub fn instant(&self, at: Duration) -> Instant {
        const FAR: Duration = Duration::from_secs(365 * 24 * 3600);
        self.0.checked_add(at).or_else(|| self.0.checked_add(FAR)).unwrap_or(self.0)
    }
}
