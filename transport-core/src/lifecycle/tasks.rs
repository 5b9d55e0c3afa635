//! Counted background work (rule 1: tasks are a resource like any other).
//!
//! Every backend spawns tasks (lane writers, pollers, reapers, deadline
//! timers, server connections). [`TaskSet`] counts each one from spawn until
//! its future ends or is aborted, so `stats().tasks` is exact, and lets
//! teardown wait, bounded, until the count is zero. Spawning is not I/O: the
//! futures themselves belong to the driver.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::task::{AbortHandle, JoinHandle};

/// A counter of live background tasks, shared by everything that spawns
/// for one transport. Cloning shares the count.
#[derive(Debug, Clone, Default)]
pub struct TaskSet {
    live: Arc<AtomicUsize>,
}

/// Holds one count in a [`TaskSet`] until dropped: for work that is not a
/// tokio task (a thread), or to count a task from before it is spawned.
#[derive(Debug)]
pub struct TaskGuard(Arc<AtomicUsize>);

impl Drop for TaskGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl TaskSet {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Counts one task until the guard is dropped.
    pub fn guard(&self) -> TaskGuard {
        self.live.fetch_add(1, Ordering::AcqRel);
        TaskGuard(self.live.clone())
    }

    /// Spawns `fut` on the current runtime, counted until it ends or is
    /// aborted. Must be called inside a tokio runtime.
    pub fn spawn<F>(&self, fut: F) -> JoinHandle<()>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let guard = self.guard();
        tokio::spawn(async move {
            let _guard = guard;
            fut.await;
        })
    }

    /// Spawns `fut` on `runtime`, counted like [`TaskSet::spawn`].
    pub fn spawn_on<F>(&self, runtime: &Handle, fut: F) -> JoinHandle<()>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let guard = self.guard();
        runtime.spawn(async move {
            let _guard = guard;
            fut.await;
        })
    }

    /// Live tasks.
    pub fn count(&self) -> usize {
        self.live.load(Ordering::Acquire)
    }

    /// Waits until no task is live or `limit` passed; returns whether the
    /// count reached zero. Polls every 2 ms (teardown only).
    pub async fn wait_idle(&self, limit: Duration) -> bool {
        let end = tokio::time::Instant::now() + limit;
        loop {
            if self.count() == 0 {
                return true;
            }
            if tokio::time::Instant::now() >= end {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
}

/// A task counted in a [`TaskSet`] for as long as its owner holds this
/// handle: from [`OwnedTask::spawn`] until the handle is dropped (which
/// aborts the task) or the task releases it itself ([`OwnedTask::ending`]).
///
/// [`TaskSet::spawn`] counts a task until its future is dropped, which for
/// an aborted task happens later, on the runtime. An owned task's count
/// instead changes together with the bookkeeping that holds the handle
/// (a batch's deadline timer, an endpoint's watcher), so `stats().tasks`
/// is exact the moment `release` or `close_segment` returns.
#[derive(Debug)]
pub struct OwnedTask {
    abort: Option<AbortHandle>,
    _count: TaskGuard,
}

impl OwnedTask {
    /// Spawns `fut` on the current runtime, counted in `set`. Must be
    /// called inside a tokio runtime.
    pub fn spawn<F>(set: &TaskSet, fut: F) -> Self
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let count = set.guard();
        Self { abort: Some(tokio::spawn(fut).abort_handle()), _count: count }
    }

    /// The task is finishing on its own (it took its handle out of the
    /// owner's bookkeeping): uncount it without aborting it.
    pub fn ending(mut self) {
        self.abort = None;
    }
}

impl Drop for OwnedTask {
    fn drop(&mut self) {
        if let Some(h) = self.abort.take() {
            h.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn counts_from_spawn_until_end_or_abort() {
        let set = TaskSet::new();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let finishing = set.spawn(async move {
            let _ = rx.await;
        });
        let forever = set.spawn(std::future::pending());
        assert_eq!(set.count(), 2);
        let _ = tx.send(());
        let _ = finishing.await;
        assert_eq!(set.count(), 1);
        forever.abort();
        assert!(set.wait_idle(Duration::from_secs(5)).await);
        let g = set.guard();
        assert_eq!(set.count(), 1);
        drop(g);
        assert_eq!(set.count(), 0);
    }

    #[tokio::test]
    async fn owned_tasks_are_uncounted_with_their_handle() {
        let set = TaskSet::new();
        let aborted = OwnedTask::spawn(&set, std::future::pending());
        let finishing = OwnedTask::spawn(&set, async {});
        assert_eq!(set.count(), 2);
        drop(aborted);
        assert_eq!(set.count(), 1, "uncounted as the owner drops it, not later");
        finishing.ending();
        assert_eq!(set.count(), 0);
    }
}
