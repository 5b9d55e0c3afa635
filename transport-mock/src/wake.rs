//! What waiters share: the fabric-wide event channel (every change that may
//! unblock a waiter bumps it) and a host's monotonic clock, on which the
//! lifecycle core's deadlines and endpoint times are `Duration`s.

use std::sync::Arc;

use tokio::sync::watch;
use transport_core::Epoch;

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

/// A host's clock: the time since the host started (the core's [`Epoch`]).
pub(crate) type Clock = Epoch;
