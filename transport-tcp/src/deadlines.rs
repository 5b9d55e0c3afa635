//! Batch deadlines (rule 5), kept by one timer task per transport rather
//! than one task per batch: spawning, and then aborting, a task for every
//! batch was a large part of a small transfer's cost. A batch with a
//! deadline is entered here at submit and taken out as soon as it is
//! terminal, so the table holds only live batches (bounded by the batch
//! table). At its deadline a batch still live is expired in the ledger and
//! quieted (the endpoints carrying its started slices are reset) in a
//! task of its own, so one slow quiet never delays another deadline.

use std::collections::BTreeMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::batch::Batch;
use crate::driver::Inner;

/// Where a batch is in the table: its deadline and a tie-breaker.
pub(crate) type Key = (Duration, u64);

#[derive(Debug, Default)]
pub(crate) struct Deadlines {
    table: Mutex<Table>,
    /// The earliest deadline changed (the timer re-arms).
    earlier: Notify,
}

#[derive(Debug, Default)]
struct Table {
    by_time: BTreeMap<Key, Weak<Batch>>,
    next: u64,
}

impl Deadlines {
    /// Enters `batch`, due `at` on the transport's clock; its key, to
    /// [`Deadlines::remove`] it once it is terminal.
    pub fn add(&self, at: Duration, batch: &Arc<Batch>) -> Key {
        let mut t = self.table.lock();
        let key = (at, t.next);
        t.next = t.next.wrapping_add(1);
        let first = t.by_time.keys().next().is_none_or(|k| *k > key);
        t.by_time.insert(key, Arc::downgrade(batch));
        drop(t);
        if first {
            self.earlier.notify_one();
        }
        key
    }

    pub fn remove(&self, key: Key) {
        self.table.lock().by_time.remove(&key);
    }

    /// Live batches in the table.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.table.lock().by_time.len()
    }

    /// Takes out the batches due at `now` (with their deadlines), and
    /// returns the next deadline after them.
    fn due(&self, now: Duration) -> (Vec<(Duration, Arc<Batch>)>, Option<Duration>) {
        let mut t = self.table.lock();
        let mut due = Vec::new();
        while let Some(entry) = t.by_time.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let ((at, _), weak) = entry.remove_entry();
            if let Some(b) = weak.upgrade() {
                due.push((at, b));
            }
        }
        let next = t.by_time.keys().next().map(|k| k.0);
        (due, next)
    }
}

/// The transport's timer: sleeps until the earliest deadline (or until an
/// earlier one is entered) and expires what is due. Ends with the transport.
pub(crate) async fn timer(weak: Weak<Inner>) {
    loop {
        let Some(inner) = weak.upgrade() else { return };
        let deadlines = inner.deadlines.clone();
        let earlier = deadlines.earlier.notified();
        tokio::pin!(earlier);
        earlier.as_mut().enable();
        let (due, next) = deadlines.due(inner.slots.now());
        for (at, batch) in due {
            let w = weak.clone();
            inner.env.tasks.spawn(async move {
                let Some(i) = w.upgrade() else { return };
                batch.expire(i.slots.now().max(at));
                i.quiet(&batch).await;
            });
        }
        // `None` also when beyond what the clock can represent: never.
        let wake = next.and_then(|at| inner.slots.instant(at));
        drop(inner);
        match wake {
            Some(when) => {
                tokio::select! {
                    _ = tokio::time::sleep_until(tokio::time::Instant::from_std(when)) => {}
                    _ = earlier => {}
                }
            }
            None => earlier.await,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn due_in_order_and_removed_entries_never_come_due() {
        let d = Deadlines::default();
        let batch = || Batch::new(Vec::new(), Vec::new(), Vec::<u64>::new(), None, Vec::new());
        let (a, b, c) = (batch(), batch(), batch());
        d.add(Duration::from_millis(30), &a);
        let kb = d.add(Duration::from_millis(10), &b);
        d.add(Duration::from_millis(20), &c);
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
        d.add(Duration::from_millis(40), &batch());
        assert!(d.due(Duration::from_millis(50)).0.is_empty());
    }

    #[test]
    fn a_batch_leaves_the_table_when_terminal_or_dropped() {
        let d = Arc::new(Deadlines::default());
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
