//! Backpressure: bounded bytes and requests in flight, per peer and in total.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::Notify;

use super::config::BackpressureConfig;
use transport_core::{Error, ErrorKind, Result};

/// What one transfer holds against the budget, per peer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Charge {
    per_peer: Vec<(String, Usage)>,
}

/// Bytes and requests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub bytes: u64,
    pub requests: u64,
}

impl Usage {
    fn add(&mut self, o: Usage) {
        self.bytes += o.bytes;
        self.requests += o.requests;
    }
    fn sub(&mut self, o: Usage) {
        self.bytes = self.bytes.saturating_sub(o.bytes);
        self.requests = self.requests.saturating_sub(o.requests);
    }
    fn is_zero(self) -> bool {
        self.bytes == 0 && self.requests == 0
    }
}

impl Charge {
    /// Adds one request of `bytes` to `peer`.
    pub fn add(&mut self, peer: &str, bytes: u64) {
        let one = Usage { bytes, requests: 1 };
        match self.per_peer.iter_mut().find(|(p, _)| p == peer) {
            Some((_, u)) => u.add(one),
            None => self.per_peer.push((peer.to_owned(), one)),
        }
    }

    /// Total over all peers.
    pub fn total(&self) -> Usage {
        let mut t = Usage::default();
        for (_, u) in &self.per_peer {
            t.add(*u);
        }
        t
    }
}

/// The shared in-flight budget.
#[derive(Debug)]
pub struct Budget {
    cfg: BackpressureConfig,
    state: Mutex<State>,
    room: Notify,
}

#[derive(Debug, Default)]
struct State {
    total: Usage,
    per_peer: HashMap<String, Usage>,
}

/// Held while a transfer is in flight; gives its charge back on drop, so the
/// budget cannot leak even if the transfer's task is aborted.
#[derive(Debug)]
pub struct Reservation {
    budget: Arc<Budget>,
    charge: Charge,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget.release(&self.charge);
    }
}

impl Budget {
    /// An empty budget.
    pub fn new(cfg: BackpressureConfig) -> Arc<Self> {
        Arc::new(Self { cfg, state: Mutex::new(State::default()), room: Notify::new() })
    }

    /// Takes the charge if it fits now, else a transient `Backpressure`
    /// error naming the bound that is full. A charge larger than a bound
    /// by itself fits when nothing else is in flight in that scope.
    pub fn try_reserve(self: &Arc<Self>, charge: Charge) -> Result<Reservation> {
        let mut s = self.state.lock();
        let total = charge.total();
        let c = &self.cfg;
        let over = |used: Usage, add: Usage, max_b: u64, max_r: u64| {
            !used.is_zero() && (used.bytes + add.bytes > max_b || used.requests + add.requests > max_r)
        };
        if over(s.total, total, c.max_inflight_bytes, c.max_inflight_requests) {
            return Err(Error::new(ErrorKind::Backpressure, "in-flight budget is full; wait for transfers to finish")
                .with("inflight_bytes", s.total.bytes)
                .with("inflight_requests", s.total.requests)
                .with("max_inflight_bytes", c.max_inflight_bytes));
        }
        for (peer, u) in &charge.per_peer {
            let used = s.per_peer.get(peer).copied().unwrap_or_default();
            if over(used, *u, c.per_peer_inflight_bytes, c.per_peer_inflight_requests) {
                return Err(Error::new(
                    ErrorKind::Backpressure,
                    "in-flight budget for this peer is full; wait for its transfers to finish",
                )
                .with("peer", peer)
                .with("inflight_bytes", used.bytes)
                .with("inflight_requests", used.requests));
            }
        }
        s.total.add(total);
        for (peer, u) in &charge.per_peer {
            s.per_peer.entry(peer.clone()).or_default().add(*u);
        }
        Ok(Reservation { budget: self.clone(), charge })
    }

    /// Waits until the charge fits, then takes it.
    pub async fn reserve(self: &Arc<Self>, charge: Charge) -> Reservation {
        loop {
            let room = self.room.notified();
            tokio::pin!(room);
            room.as_mut().enable();
            if let Ok(r) = self.try_reserve(charge.clone()) {
                return r;
            }
            room.await;
        }
    }

    fn release(&self, charge: &Charge) {
        let mut s = self.state.lock();
        s.total.sub(charge.total());
        for (peer, u) in &charge.per_peer {
            if let Some(used) = s.per_peer.get_mut(peer) {
                used.sub(*u);
                if used.is_zero() {
                    s.per_peer.remove(peer);
                }
            }
        }
        drop(s);
        self.room.notify_waiters();
    }

    /// Bytes and requests in flight in total.
    pub fn used(&self) -> Usage {
        self.state.lock().total
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn cfg() -> BackpressureConfig {
        BackpressureConfig {
            max_inflight_bytes: 100,
            max_inflight_requests: 10,
            per_peer_inflight_bytes: 60,
            per_peer_inflight_requests: 10,
            ..BackpressureConfig::default()
        }
    }

    fn charge(peer: &str, bytes: u64) -> Charge {
        let mut c = Charge::default();
        c.add(peer, bytes);
        c
    }

    #[test]
    fn per_peer_and_total_bounds() {
        let b = Budget::new(cfg());
        let r1 = b.try_reserve(charge("a", 50)).unwrap();
        let e = b.try_reserve(charge("a", 20)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Backpressure);
        assert!(e.is_transient());
        let r2 = b.try_reserve(charge("b", 50)).unwrap();
        assert_eq!(b.try_reserve(charge("c", 1)).unwrap_err().kind(), ErrorKind::Backpressure, "total full");
        drop(r1);
        drop(r2);
        assert_eq!(b.used(), Usage::default());
    }

    #[test]
    fn oversized_alone_is_admitted() {
        let b = Budget::new(cfg());
        let r = b.try_reserve(charge("a", 1000)).unwrap();
        assert!(b.try_reserve(charge("b", 1)).is_err());
        drop(r);
    }

    #[tokio::test]
    async fn waiter_gets_room_when_released() {
        let b = Budget::new(cfg());
        let r1 = b.try_reserve(charge("a", 60)).unwrap();
        let b2 = b.clone();
        let waiter = tokio::spawn(async move { b2.reserve(charge("a", 60)).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished());
        drop(r1);
        let r2 = tokio::time::timeout(Duration::from_secs(5), waiter).await.unwrap().unwrap();
        assert_eq!(b.used().bytes, 60);
        drop(r2);
    }
}
