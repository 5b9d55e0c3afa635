//! Deadlines of live work, sans-IO: a queue ordered by due time that a
//! driver's one timer drains (rule 5: at its deadline a batch still live
//! is expired and made quiet). Entering and leaving are O(log n), so a
//! driver enters every batch with a deadline at submit and takes it out
//! as soon as it is terminal: the queue holds only live work, and one
//! timer per transport replaces a task per batch.
//!
//! Times are offsets on the driver's clock (`Duration` since its epoch, as
//! everywhere in [`crate::lifecycle`]). The queue never sleeps and never
//! reads a clock: the driver asks [`DeadlineQueue::due`] with the time it
//! read and sleeps until [`DeadlineQueue::arm`] (which it records, so a
//! later entry needs no wake-up: one transfer after another, each taken
//! out before the next comes in, wakes the timer once, not each time).

use std::collections::BTreeMap;
use std::time::Duration;

/// Where an entry is in a [`DeadlineQueue`]: its due time and a
/// tie-breaker, so entries due at the same time all keep their place.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeadlineKey {
    at: Duration,
    seq: u64,
}

impl DeadlineKey {
    /// When the entry is due.
    pub fn at(&self) -> Duration {
        self.at
    }
}

/// Entries of `T` ordered by due time. See the module docs.
#[derive(Debug)]
pub struct DeadlineQueue<T> {
    by_time: BTreeMap<DeadlineKey, T>,
    seq: u64,
    /// When the driver's timer wakes next, as it last said ([`Self::arm`]);
    /// `None`: it sleeps with no deadline (or has not slept yet).
    armed: Option<Duration>,
}

impl<T> Default for DeadlineQueue<T> {
    fn default() -> Self {
        Self { by_time: BTreeMap::new(), seq: 0, armed: None }
    }
}

impl<T> DeadlineQueue<T> {
    /// An empty queue.
    pub fn new() -> Self {
        Self::default()
    }

    /// Enters `item`, due `at`. Returns its key (to [`Self::remove`] it)
    /// and whether the timer must wake and re-arm: the entry is now the
    /// earliest and due before the time the timer sleeps until. (Due at
    /// or after it, the timer finds it when it wakes then.)
    pub fn add(&mut self, at: Duration, item: T) -> (DeadlineKey, bool) {
        let key = DeadlineKey { at, seq: self.seq };
        self.seq = self.seq.wrapping_add(1);
        let earliest = self.by_time.keys().next().is_none_or(|k| *k > key) && self.armed.is_none_or(|armed| at < armed);
        self.by_time.insert(key, item);
        (key, earliest)
    }

    /// Takes the entry out (it became terminal); `None` if it was already
    /// due or removed.
    pub fn remove(&mut self, key: DeadlineKey) -> Option<T> {
        self.by_time.remove(&key)
    }

    /// Takes out every entry due at or before `now`, earliest first, with
    /// its due time.
    pub fn due(&mut self, now: Duration) -> Vec<(Duration, T)> {
        let mut due = Vec::new();
        while let Some(entry) = self.by_time.first_entry() {
            if entry.key().at > now {
                break;
            }
            let (key, item) = entry.remove_entry();
            due.push((key.at, item));
        }
        due
    }

    /// When the earliest entry is due; `None` when the queue is empty.
    pub fn next(&self) -> Option<Duration> {
        self.by_time.keys().next().map(|k| k.at)
    }

    /// When the earliest entry is due ([`Self::next`]), recorded as the
    /// time the driver's timer now sleeps until: the timer calls this once
    /// it took what was due, then sleeps until the answer.
    pub fn arm(&mut self) -> Option<Duration> {
        self.armed = self.next();
        self.armed
    }

    /// Entries in the queue.
    pub fn len(&self) -> usize {
        self.by_time.len()
    }

    /// Whether the queue is empty.
    pub fn is_empty(&self) -> bool {
        self.by_time.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn entries_come_due_in_order_and_removed_ones_never_do() {
        let mut q = DeadlineQueue::new();
        assert_eq!(q.add(ms(30), 'a'), (DeadlineKey { at: ms(30), seq: 0 }, true));
        let (kb, earliest) = q.add(ms(10), 'b');
        assert!(earliest, "earlier than every entry: the timer re-arms");
        let (_, earliest) = q.add(ms(20), 'c');
        assert!(!earliest);
        assert_eq!(q.remove(kb), Some('b'));
        assert_eq!(q.remove(kb), None, "removed once");
        assert!(q.due(ms(5)).is_empty());
        assert_eq!(q.next(), Some(ms(20)));
        assert_eq!(q.due(ms(30)), vec![(ms(20), 'c'), (ms(30), 'a')]);
        assert_eq!((q.next(), q.len(), q.is_empty()), (None, 0, true));
    }

    /// One entry after another, each taken out before the next comes in
    /// (transfers one at a time): the timer is woken for the first only;
    /// it wakes at that time anyway and re-arms for the next. An entry
    /// due before the armed time still wakes it.
    #[test]
    fn entries_due_after_the_armed_time_need_no_wake_up() {
        let mut q = DeadlineQueue::new();
        let (k, wake) = q.add(ms(100), 'a');
        assert!(wake, "the timer sleeps with no deadline");
        assert_eq!(q.arm(), Some(ms(100)));
        q.remove(k);
        for (i, at) in [110, 120, 130].into_iter().enumerate() {
            let (k, wake) = q.add(ms(at), char::from(b'b' + i as u8));
            assert!(!wake, "due at {at} ms, after the armed 100 ms");
            q.remove(k);
        }
        assert!(q.due(ms(100)).is_empty(), "the stale wake-up finds nothing");
        assert_eq!(q.arm(), None);
        let (_, wake) = q.add(ms(140), 'x');
        assert!(wake, "the timer sleeps with no deadline again");
        assert_eq!(q.arm(), Some(ms(140)));
        let (_, wake) = q.add(ms(90), 'y');
        assert!(wake, "due before the armed time");
    }

    #[test]
    fn entries_due_at_the_same_time_all_stay_in_arrival_order() {
        let mut q = DeadlineQueue::new();
        let keys: Vec<DeadlineKey> = (0..5).map(|i| q.add(ms(7), i).0).collect();
        assert!(keys.iter().all(|k| k.at() == ms(7)));
        assert_eq!(q.remove(keys[2]), Some(2));
        assert_eq!(q.due(ms(7)).into_iter().map(|(_, i)| i).collect::<Vec<_>>(), [0, 1, 3, 4]);
    }
}
