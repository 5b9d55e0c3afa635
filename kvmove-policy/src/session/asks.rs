//! What a receiver (a decode) grants from, sans-IO: the asks of senders,
//! queued in arrival order and granted as pages free (rule 12: a grant is
//! the receiver's pre-allocation, so an ask with no free page waits, and no
//! timer runs for it), and the asks seen lately, so that an ask repeated
//! (a sender asks again when it hears nothing) is granted once.
//!
//! The driver does the I/O: it feeds asks in, sends the grants
//! [`GrantPool::next_grant`] hands out, and gives each page back once its
//! session ended ([`GrantPool::release`]) or its grant could not be sent
//! ([`GrantPool::unsent`]).

use std::collections::{HashSet, VecDeque};

/// An ask: the sender's name and the request's id.
pub type Ask = (String, u64);

/// How many asks [`RecentAsks::default`] remembers.
pub const RECENT_ASKS: usize = 1 << 16;

/// The last `capacity` asks remembered, the oldest forgotten first.
#[derive(Debug, Clone)]
pub struct RecentAsks {
    order: VecDeque<Ask>,
    set: HashSet<Ask>,
    capacity: usize,
}

impl RecentAsks {
    /// Remembers at most `capacity` asks (at least one).
    pub fn new(capacity: usize) -> Self {
        Self { order: VecDeque::new(), set: HashSet::new(), capacity: capacity.max(1) }
    }

    /// Whether `ask` is remembered.
    pub fn contains(&self, ask: &Ask) -> bool {
        self.set.contains(ask)
    }

    /// Remembers `ask`, forgetting the oldest beyond the capacity.
    pub fn insert(&mut self, ask: Ask) {
        if self.set.insert(ask.clone()) {
            self.order.push_back(ask);
        }
        while self.order.len() > self.capacity {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
    }

    /// Forgets `ask` (its grant could not be sent: the next ask is taken).
    pub fn remove(&mut self, ask: &Ask) {
        if self.set.remove(ask) {
            self.order.retain(|o| o != ask);
        }
    }

    /// How many asks are remembered.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }
}

impl Default for RecentAsks {
    /// Remembers [`RECENT_ASKS`] asks.
    fn default() -> Self {
        Self::new(RECENT_ASKS)
    }
}

/// What [`GrantPool::ask`] did with an ask.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Asked {
    /// Queued: it is granted once a page is free and the asks before it
    /// were granted.
    Queued,
    /// Queued or granted already (a repeated ask): ignored.
    Repeated,
    /// The queue holds its bound of asks: ignored (the sender asks again).
    Full,
}

/// Pages (offsets, or any `u64` the driver maps to memory) and the asks
/// waiting for them.
#[derive(Debug, Clone)]
pub struct GrantPool {
    /// Free pages; the last is granted next.
    free: Vec<u64>,
    queue: VecDeque<Ask>,
    max_queued: usize,
    recent: RecentAsks,
}

impl GrantPool {
    /// A pool of `pages`, granted in the order given; at most `max_queued`
    /// asks wait, and the last `remember` asks queued or granted are
    /// recognised when repeated (make it larger than what a sender may
    /// have outstanding).
    pub fn new(pages: impl IntoIterator<Item = u64>, max_queued: usize, remember: usize) -> Self {
        let mut free: Vec<u64> = pages.into_iter().collect();
        free.reverse();
        Self { free, queue: VecDeque::new(), max_queued, recent: RecentAsks::new(remember) }
    }

    /// A sender asks for request `id`.
    pub fn ask(&mut self, peer: &str, id: u64) -> Asked {
        let ask = (peer.to_string(), id);
        if self.recent.contains(&ask) {
            return Asked::Repeated;
        }
        if self.queue.len() >= self.max_queued {
            return Asked::Full;
        }
        self.recent.insert(ask.clone());
        self.queue.push_back(ask);
        Asked::Queued
    }

    /// The oldest queued ask and the page it is granted, while a page is
    /// free; the driver sends the grant.
    pub fn next_grant(&mut self) -> Option<(Ask, u64)> {
        if self.free.is_empty() {
            return None;
        }
        let ask = self.queue.pop_front()?;
        let page = self.free.pop()?;
        Some((ask, page))
    }

    /// `page` is free again: its session ended (and the receiver is done
    /// with what landed in it).
    pub fn release(&mut self, page: u64) {
        self.free.push(page);
    }

    /// The grant of `page` to `ask` could not be sent: the page is free
    /// again and the ask forgotten, so the sender's next ask is taken.
    pub fn unsent(&mut self, ask: &Ask, page: u64) {
        self.recent.remove(ask);
        self.free.push(page);
    }

    /// Asks waiting for a page.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Pages free.
    pub fn free(&self) -> usize {
        self.free.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(p: &str, id: u64) -> Ask {
        (p.to_string(), id)
    }

    #[test]
    fn asks_are_granted_in_arrival_order_as_pages_free() {
        let mut p = GrantPool::new([0, 4096], 8, 64);
        assert_eq!(p.ask("a", 1), Asked::Queued);
        assert_eq!(p.ask("b", 1), Asked::Queued);
        assert_eq!(p.ask("a", 2), Asked::Queued);
        assert_eq!(p.next_grant(), Some((ask("a", 1), 0)));
        assert_eq!(p.next_grant(), Some((ask("b", 1), 4096)));
        // No page free: the third ask waits (no timer, nothing refused).
        assert_eq!(p.next_grant(), None);
        assert_eq!((p.queued(), p.free()), (1, 0));
        p.release(4096);
        assert_eq!(p.next_grant(), Some((ask("a", 2), 4096)));
        assert_eq!(p.next_grant(), None);
        p.release(0);
        assert_eq!(p.next_grant(), None, "a free page and no ask grants nothing");
        assert_eq!(p.free(), 1);
    }

    #[test]
    fn a_repeated_ask_is_granted_once_and_an_unsent_grant_takes_the_next_ask() {
        let mut p = GrantPool::new([7], 8, 64);
        assert_eq!(p.ask("a", 1), Asked::Queued);
        assert_eq!(p.ask("a", 1), Asked::Repeated, "queued already");
        let (k, page) = p.next_grant().unwrap();
        assert_eq!(p.ask("a", 1), Asked::Repeated, "granted already");
        p.unsent(&k, page);
        assert_eq!(p.free(), 1);
        assert_eq!(p.ask("a", 1), Asked::Queued, "an unsent grant's ask is taken again");
        assert_eq!(p.next_grant(), Some((ask("a", 1), 7)));
    }

    #[test]
    fn the_queue_and_the_memory_of_asks_are_bounded() {
        let mut p = GrantPool::new([], 2, 3);
        assert_eq!(p.ask("a", 1), Asked::Queued);
        assert_eq!(p.ask("a", 2), Asked::Queued);
        assert_eq!(p.ask("a", 3), Asked::Full);
        assert_eq!(p.queued(), 2);
        let mut r = RecentAsks::new(3);
        for id in 0..10 {
            r.insert(ask("x", id));
            r.insert(ask("x", id));
        }
        assert_eq!(r.len(), 3);
        assert!(r.contains(&ask("x", 9)) && !r.contains(&ask("x", 6)));
        r.remove(&ask("x", 8));
        assert_eq!(r.len(), 2);
        assert!(!r.contains(&ask("x", 8)));
        assert!(RecentAsks::new(0).is_empty());
        assert_eq!(RecentAsks::default().capacity, RECENT_ASKS);
    }
}
