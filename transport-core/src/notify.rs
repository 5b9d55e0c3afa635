//! Notifications (rule 11): small messages from one transport to a peer,
//! and the bounded inbox every backend keeps for the ones it receives.
//!
//! The inbox is the same for every backend: a FIFO of at most a configured
//! number of notifications. A full inbox refuses (the sender's
//! [`crate::Transport::notify`] fails with a transient `Backpressure`), so a
//! receiver that does not drain it pushes back on its senders instead of
//! growing without bound.

use std::collections::VecDeque;
use std::fmt;

use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::error::{Error, ErrorKind, Result};

/// Largest notification message, in bytes.
pub const MAX_NOTIFY_LEN: usize = 4096;
/// Largest sender name a notification may carry, in bytes.
pub const MAX_NOTIFY_FROM: usize = 256;
/// Default number of notifications an inbox holds.
pub const DEFAULT_INBOX: usize = 1024;

/// A notification as the receiver sees it.
#[derive(Clone, PartialEq, Eq)]
pub struct Notification {
    /// The sender's segment name (its [`crate::Transport::local_segment_name`]):
    /// what the receiver opens to answer. As trustworthy as the connection it
    /// came over (authenticated where the backend has a shared secret).
    pub from: String,
    /// The message, at most [`MAX_NOTIFY_LEN`] bytes.
    pub msg: Vec<u8>,
}

impl fmt::Debug for Notification {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Notification").field("from", &self.from).field("len", &self.msg.len()).finish()
    }
}

/// Checks a message before it is sent: at most [`MAX_NOTIFY_LEN`] bytes,
/// else a permanent `InvalidRequest`.
pub fn check_notification(msg: &[u8]) -> Result<()> {
    if msg.len() > MAX_NOTIFY_LEN {
        return Err(Error::new(ErrorKind::InvalidRequest, "notification larger than MAX_NOTIFY_LEN")
            .with("len", msg.len())
            .with("max", MAX_NOTIFY_LEN));
    }
    Ok(())
}

/// Checks a received notification (sender name and message lengths), as a
/// backend does before it offers bytes from the wire to its inbox.
pub fn check_received(from: &str, msg: &[u8]) -> Result<()> {
    check_notification(msg)?;
    if from.len() > MAX_NOTIFY_FROM {
        return Err(Error::new(ErrorKind::InvalidRequest, "notification sender name too long")
            .with("len", from.len())
            .with("max", MAX_NOTIFY_FROM));
    }
    Ok(())
}

/// The error a full inbox gives its sender.
pub fn inbox_full() -> Error {
    Error::new(ErrorKind::Backpressure, "the peer's notification inbox is full (it is not draining it)")
}

/// A bounded FIFO of received notifications, with an awaitable "not empty".
/// Not I/O: backends offer what they receive; users take.
pub struct Inbox {
    queue: Mutex<InboxState>,
    ready: Notify,
}

struct InboxState {
    items: VecDeque<Notification>,
    capacity: usize,
    closed: bool,
}

impl fmt::Debug for Inbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let q = self.queue.lock();
        f.debug_struct("Inbox").field("len", &q.items.len()).field("capacity", &q.capacity).finish()
    }
}

/// Why [`Inbox::offer`] refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// At capacity: the sender gets a transient `Backpressure`.
    Full,
    /// The inbox was closed (its transport shut down).
    Closed,
}

impl Refused {
    /// The error the sender sees.
    pub fn into_error(self) -> Error {
        match self {
            Refused::Full => inbox_full(),
            Refused::Closed => Error::shut_down(),
        }
    }
}

impl Inbox {
    /// An inbox holding at most `capacity` notifications (at least 1).
    pub fn new(capacity: usize) -> Self {
        Self {
            queue: Mutex::new(InboxState { items: VecDeque::new(), capacity: capacity.max(1), closed: false }),
            ready: Notify::new(),
        }
    }

    /// Queues a notification, or refuses when full or closed.
    pub fn offer(&self, n: Notification) -> std::result::Result<(), Refused> {
        {
            let mut q = self.queue.lock();
            if q.closed {
                return Err(Refused::Closed);
            }
            if q.items.len() >= q.capacity {
                return Err(Refused::Full);
            }
            q.items.push_back(n);
        }
        self.ready.notify_waiters();
        self.ready.notify_one();
        Ok(())
    }

    /// Takes up to `max` notifications, oldest first.
    pub fn take(&self, max: usize) -> Vec<Notification> {
        let mut q = self.queue.lock();
        let n = max.min(q.items.len());
        q.items.drain(..n).collect()
    }

    /// Notifications queued now.
    pub fn len(&self) -> usize {
        self.queue.lock().items.len()
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Waits until at least one notification is queued. `Shutdown` once the
    /// inbox is closed.
    pub async fn wait(&self) -> Result<()> {
        loop {
            let notified = self.ready.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let q = self.queue.lock();
                if q.closed {
                    return Err(Error::shut_down());
                }
                if !q.items.is_empty() {
                    return Ok(());
                }
            }
            notified.await;
        }
    }

    /// Closes the inbox: drops what it holds, refuses new offers and wakes
    /// every waiter (which then sees `Shutdown`).
    pub fn close(&self) {
        {
            let mut q = self.queue.lock();
            q.closed = true;
            q.items.clear();
        }
        self.ready.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(i: u8) -> Notification {
        Notification { from: "p".into(), msg: vec![i] }
    }

    #[test]
    fn bounded_fifo() {
        let inbox = Inbox::new(2);
        assert_eq!(inbox.offer(n(1)), Ok(()));
        assert_eq!(inbox.offer(n(2)), Ok(()));
        assert_eq!(inbox.offer(n(3)), Err(Refused::Full));
        assert!(Refused::Full.into_error().is_transient());
        assert_eq!(inbox.take(1), vec![n(1)]);
        assert_eq!(inbox.offer(n(3)), Ok(()));
        assert_eq!(inbox.take(10), vec![n(2), n(3)]);
        assert!(inbox.is_empty());
    }

    #[test]
    fn sizes_checked() {
        assert!(check_notification(&[0; MAX_NOTIFY_LEN]).is_ok());
        let e = check_notification(&[0; MAX_NOTIFY_LEN + 1]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidRequest);
        assert!(check_received(&"x".repeat(MAX_NOTIFY_FROM + 1), b"").is_err());
    }

    #[tokio::test]
    async fn wait_wakes_and_close_ends() {
        let inbox = std::sync::Arc::new(Inbox::new(4));
        let i2 = inbox.clone();
        let waiter = tokio::spawn(async move { i2.wait().await });
        tokio::task::yield_now().await;
        inbox.offer(n(1)).unwrap();
        assert!(waiter.await.unwrap().is_ok());
        inbox.take(1);
        let i3 = inbox.clone();
        let waiter = tokio::spawn(async move { i3.wait().await });
        tokio::task::yield_now().await;
        inbox.close();
        assert_eq!(waiter.await.unwrap().unwrap_err().kind(), ErrorKind::Shutdown);
        assert_eq!(inbox.offer(n(2)), Err(Refused::Closed));
    }
}
