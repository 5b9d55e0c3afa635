//! Batch deadlines (rule 5), kept by one timer task per transport rather
//! than one task per batch: spawning, and then aborting, a task for every
//! batch was a large part of a small transfer's cost. A batch with a
//! deadline is entered here at submit and taken out as soon as it is
//! terminal, so the table holds only live batches (bounded by the batch
//! table). At its deadline a batch still live is expired in the ledger and
//! quieted (the endpoints carrying its started slices are reset) in a
//! task of its own, so one slow quiet never delays another deadline.

use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::Notify;
use transport_core::lifecycle::{DeadlineKey, DeadlineQueue};

/// The transport's deadline table: the core's sans-IO [`DeadlineQueue`]
/// of batches (held weakly: a dropped batch is skipped) behind a lock,
/// and the signal that wakes the timer (`Inner::timer`) when an earlier
/// deadline is entered.
#[derive(Debug)]
pub(crate) struct Deadlines<T> {
    queue: Mutex<DeadlineQueue<Weak<T>>>,
    /// The earliest deadline changed (the timer re-arms).
    pub earlier: Notify,
}

impl<T> Default for Deadlines<T> {
    fn default() -> Self {
        Self { queue: Mutex::new(DeadlineQueue::new()), earlier: Notify::new() }
    }
}

impl<T> Deadlines<T> {
    /// Enters `item` (held weakly), due `at` on the transport's clock; its
    /// key, to [`Deadlines::remove`] it once it is terminal.
    pub fn add(&self, at: Duration, item: Weak<T>) -> DeadlineKey {
        let (key, earliest) = self.queue.lock().add(at, item);
        if earliest {
            self.earlier.notify_one();
        }
        key
    }

    pub fn remove(&self, key: DeadlineKey) {
        self.queue.lock().remove(key);
    }

    /// Live entries in the table.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.queue.lock().len()
    }

    /// Takes out the entries due at `now` that still live (with their
    /// deadlines), and returns the next deadline after them.
    pub fn due(&self, now: Duration) -> (Vec<(Duration, Arc<T>)>, Option<Duration>) {
        let mut q = self.queue.lock();
        let due = q.due(now).into_iter().filter_map(|(at, w)| w.upgrade().map(|b| (at, b))).collect();
        (due, q.arm())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::batch::Batch;

    #[test]
    fn due_in_order_and_removed_entries_never_come_due() {
        let d = Deadlines::<Batch>::default();
        let batch = || Batch::new(Vec::new(), Vec::new(), Vec::<u64>::new(), None, Vec::new());
        let (a, b, c) = (batch(), batch(), batch());
        d.add(Duration::from_millis(30), Arc::downgrade(&a));
        let kb = d.add(Duration::from_millis(10), Arc::downgrade(&b));
        d.add(Duration::from_millis(20), Arc::downgrade(&c));
        d.remove(kb);
        let (due, next) = d.due(Duration::from_millis(5));
        assert!(due.is_empty());
        assert_eq!(next, Some(Duration::from_millis(20)));
        let (due, next) = d.due(Duration::from_millis(30));
        let got: Vec<Duration> = due.iter().map(|(at, _)| *at).collect();
        assert_eq!(got, [Duration::from_millis(20), Duration::from_millis(30)]);
        assert!(Arc::ptr_eq(&due[0].1, &c) && Arc::ptr_eq(&due[1].1, &a));
        assert_eq!(next, None);
        assert_eq!(d.len(), 0);
        // A dropped batch's entry is skipped.
        d.add(Duration::from_millis(40), Arc::downgrade(&batch()));
        assert!(d.due(Duration::from_millis(50)).0.is_empty());
    }

    #[test]
    fn a_batch_leaves_the_table_when_terminal_or_dropped() {
        let d = Arc::new(Deadlines::<Batch>::default());
        let b = Batch::new(Vec::new(), Vec::new(), [1u64], None, Vec::new());
        b.set_deadline(&d, Duration::from_secs(60));
        assert_eq!(d.len(), 1);
        b.fail(0, transport_core::Error::new(transport_core::ErrorKind::Internal, "ended"));
        assert!(b.is_terminal());
        assert_eq!(d.len(), 0, "terminal: out of the table");
        b.set_deadline(&d, Duration::from_secs(60));
        assert_eq!(d.len(), 0, "already terminal: never entered");
        let live = Batch::new(Vec::new(), Vec::new(), [1u64], None, Vec::new());
        live.set_deadline(&d, Duration::from_secs(60));
        assert_eq!(d.len(), 1);
        drop(live);
        assert_eq!(d.len(), 0, "dropped: out of the table");
    }
}
