//! Counters shared by every part of a transport, and counted task spawning.

use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use tokio::task::JoinHandle;

/// Live counts for `stats()` and the id source for requests.
#[derive(Debug)]
pub(crate) struct Counters {
    /// Background tasks alive (lanes, server connections, timers, reaper).
    pub tasks: AtomicUsize,
    /// Slices submitted and not yet ended.
    pub inflight: Arc<AtomicUsize>,
    /// Client sockets (lanes) open.
    pub lanes: AtomicUsize,
    /// Request ids: unique per transport, never reused, so a late answer
    /// can never be taken for another slice's.
    next_id: AtomicU64,
    origin: Instant,
}

impl Counters {
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            tasks: AtomicUsize::new(0),
            inflight: Arc::new(AtomicUsize::new(0)),
            lanes: AtomicUsize::new(0),
            next_id: AtomicU64::new(1),
            origin: Instant::now(),
        })
    }

    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Milliseconds since the transport started (for idle tracking).
    pub fn now_ms(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64
    }
}

struct TaskGuard(Arc<Counters>);

impl Drop for TaskGuard {
    fn drop(&mut self) {
        self.0.tasks.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Spawns `fut`, counted in `tasks` until it ends or is aborted.
pub(crate) fn spawn_counted<F>(c: &Arc<Counters>, fut: F) -> JoinHandle<()>
where
    F: Future<Output = ()> + Send + 'static,
{
    c.tasks.fetch_add(1, Ordering::Relaxed);
    let guard = TaskGuard(c.clone());
    tokio::spawn(async move {
        let _guard = guard;
        fut.await;
    })
}
