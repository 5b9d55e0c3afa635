//! Writes being applied to memory by the server, so that a notification
//! never overtakes a write that another connection was still applying.
//!
//! A client that gives up on a WRITE whose payload is on the wire resets
//! that connection; the server never applies a chunk it finds a reset
//! behind (`check_reset`), but a chunk it had in hand before the reset
//! came is applied: at once into host memory, by a copy on the blocking
//! pool into device memory. The client then reports the write quiet, and a
//! session's sender tells its receiver so (QUIET) in a NOTIFY, which comes
//! on another connection and could be delivered while that copy still
//! runs: the receiver would take its memory for quiet too early (rule 13).
//!
//! So every chunk takes a [`Ticket`] before its reset check and keeps it
//! until it is in memory, and a NOTIFY is delivered only once every ticket
//! taken before it was read has ended ([`Applying::settled`]). On one host
//! the reset reaches the server before anything the client sent after it,
//! so a chunk applied after the reset check has its ticket before the
//! NOTIFY is read. (Through a path that reorders two connections, a reset
//! can still arrive after a later NOTIFY; nothing on the server can see
//! that.)
//!
//! Tickets are numbered in order and a NOTIFY waits only for older ones,
//! so a steady stream of writes on other connections never holds it back
//! for longer than the chunks in progress when it was read.

use std::collections::BTreeSet;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::Notify;

/// The tickets of the chunks being applied.
#[derive(Debug, Default)]
pub(crate) struct Applying {
    state: Mutex<State>,
    ended: Notify,
}

#[derive(Debug, Default)]
struct State {
    next: u64,
    open: BTreeSet<u64>,
}

/// One chunk being applied; ends on drop.
#[derive(Debug)]
pub(crate) struct Ticket {
    of: Arc<Applying>,
    n: u64,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.of.state.lock().open.remove(&self.n);
        self.of.ended.notify_waiters();
    }
}

impl Applying {
    /// A ticket for a chunk about to be checked and applied.
    pub fn begin(self: &Arc<Self>) -> Ticket {
        let mut s = self.state.lock();
        let n = s.next;
        s.next = s.next.wrapping_add(1);
        s.open.insert(n);
        Ticket { of: self.clone(), n }
    }

    /// Waits until every ticket taken before this call has ended.
    pub async fn settled(&self) {
        let before = self.state.lock().next;
        loop {
            let ended = self.ended.notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            if self.state.lock().open.first().is_none_or(|&oldest| oldest >= before) {
                return;
            }
            ended.await;
        }
    }

    /// Chunks being applied now.
    #[cfg(test)]
    fn open(&self) -> usize {
        self.state.lock().open.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn settled_waits_for_older_tickets_only() {
        let a = Arc::new(Applying::default());
        let older = a.begin();
        let waiter = {
            let a = a.clone();
            tokio::spawn(async move { a.settled().await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        // A ticket taken after the wait began is not waited for.
        let newer = a.begin();
        assert!(!waiter.is_finished(), "settled returned with an older chunk still being applied");
        drop(older);
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("settled did not return once the older chunk ended")
            .expect("the waiter panicked");
        assert_eq!(a.open(), 1);
        drop(newer);
        assert_eq!(a.open(), 0);
        tokio::time::timeout(Duration::from_secs(5), a.settled()).await.expect("settled with nothing open");
    }
}
