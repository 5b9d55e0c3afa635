//! A server connection waiting for its next request without sleeping
//! (`TcpConfig::server_poll_us`).
//!
//! A connection that has sent its answers and has no request in hand waits
//! on the runtime: its worker thread sleeps in the reactor, and the next
//! request wakes it. Where idle CPUs halt (a VM), that wake costs tens of
//! microseconds, most of a small transfer's round trip. UCX avoids it by
//! never sleeping. Here a connection whose requests have been coming
//! within the window reads its socket directly for up to the window
//! before it waits as usual ([`crate::bufs::PooledReader::poll_until`]).
//!
//! While it polls, the connection is hushed (`crate::hush`): the kernel
//! does not wake the runtime's sleeping worker for each request as well.
//!
//! Between reads the polling task either yields to the runtime (its worker
//! runs other tasks and reads I/O meanwhile) or spins on its worker and
//! gives the runtime a turn only now and then ([`may_spin`]; it still
//! gives the CPU up to other threads between reads: without that, next to
//! one busy process, a small write took about twice as long). Yielding at
//! every read makes the runtime wake its other worker at every request
//! (tokio hands the search for work to a sleeping worker each time the
//! polling worker finds its queue empty), which costs a separate target
//! process what the polling saves. The README's "single 4 KiB write from
//! Python over the network path" has the measurements behind each choice.
//! Spinning without turns (tried) left a runtime with its other worker
//! asleep on a condition variable and nobody reading I/O, so a process
//! that is also an initiator (its own request waiting for an answer on
//! that runtime) waited for each spin to end; such a process yields at
//! every read.
//!
//! Bounds: one connection of a server polls at a time (the others wait as
//! usual), only a connection whose previous request came within the
//! window ("hot": a connection idle for longer never polls), and only in a
//! multi-thread runtime with at least two workers (a current-thread
//! runtime would spin its only thread).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Lanes (client connections) open in this process, every transport's.
static PROCESS_LANES: AtomicUsize = AtomicUsize::new(0);

/// Counts `n` lanes opened (`true`) or closed in this process.
pub(crate) fn count_lanes(n: usize, opened: bool) {
    if opened {
        PROCESS_LANES.fetch_add(n, Ordering::Relaxed);
    } else {
        PROCESS_LANES.fetch_sub(n, Ordering::Relaxed);
    }
}

/// Whether a polling connection may spin on its worker between reads,
/// giving the runtime a turn only now and then: when this process has no
/// lanes of its own. A process that is also an initiator may be waiting
/// for answers on a runtime whose other worker sleeps; there the poll
/// yields at every read, so its worker reads I/O meanwhile
/// ([`crate::bufs::PooledReader::poll_until`]).
pub(crate) fn may_spin() -> bool {
    PROCESS_LANES.load(Ordering::Relaxed) == 0
}

/// A server's permission to poll: the window, and who is polling now.
#[derive(Debug)]
pub(crate) struct BusyPoll {
    window: Duration,
    taken: AtomicBool,
}

impl BusyPoll {
    /// Polls for up to `us` microseconds (0: never).
    pub fn new(us: u32) -> Self {
        Self { window: Duration::from_micros(u64::from(us)), taken: AtomicBool::new(false) }
    }

    /// Whether connections served from the current runtime may poll at
    /// all: a window is set, and the runtime has another worker to run
    /// everything else meanwhile.
    pub fn allowed(&self) -> bool {
        use tokio::runtime::{Handle, RuntimeFlavor};
        !self.window.is_zero()
            && Handle::try_current()
                .is_ok_and(|h| h.runtime_flavor() == RuntimeFlavor::MultiThread && h.metrics().num_workers() >= 2)
    }

    /// The turn to poll until the returned instant, for a connection
    /// whose last wait was short (`hot`) when no other connection is
    /// polling; `None` otherwise. The turn ends when the guard drops.
    pub fn turn(&self, hot: bool, now: Instant) -> Option<(Turn<'_>, Instant)> {
        if !hot || self.taken.swap(true, Ordering::Acquire) {
            return None;
        }
        Some((Turn(&self.taken), now + self.window))
    }

    /// Whether a wait of `waited` (from the answers sent to the next
    /// request in hand) makes the connection hot.
    pub fn is_short(&self, waited: Duration) -> bool {
        waited <= self.window
    }
}

/// One connection's turn to poll ([`BusyPoll::turn`]).
#[derive(Debug)]
pub(crate) struct Turn<'a>(&'a AtomicBool);

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_hot_connection_polls_at_a_time() {
        let p = BusyPoll::new(100);
        let now = Instant::now();
        assert!(p.turn(false, now).is_none(), "a cold connection never polls");
        let (first, until) = p.turn(true, now).expect("a hot connection polls");
        assert_eq!(until, now + Duration::from_micros(100));
        assert!(p.turn(true, now).is_none(), "a second connection waits as usual meanwhile");
        drop(first);
        assert!(p.turn(true, now).is_some(), "the turn is free again once the first ended");
        assert!(p.is_short(Duration::from_micros(100)));
        assert!(!p.is_short(Duration::from_micros(101)));
    }

    #[test]
    fn only_a_multi_thread_runtime_with_two_workers_polls() {
        let on = BusyPoll::new(100);
        assert!(!on.allowed(), "outside a runtime");
        let one = tokio::runtime::Builder::new_current_thread().build().unwrap();
        assert!(!one.block_on(async { on.allowed() }), "a current-thread runtime");
        let single = tokio::runtime::Builder::new_multi_thread().worker_threads(1).build().unwrap();
        assert!(!single.block_on(async { on.allowed() }), "one worker");
        let two = tokio::runtime::Builder::new_multi_thread().worker_threads(2).build().unwrap();
        assert!(two.block_on(async { on.allowed() }));
        assert!(!two.block_on(async { BusyPoll::new(0).allowed() }), "0 turns it off");
    }
}
