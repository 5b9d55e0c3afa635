//! Who may connect: connections counted per phase (in their handshake,
//! handshaken) in all and per peer address, and the fair eviction of
//! handshakes when the pre-authentication quota is full. Sans-IO: the
//! server asks [`Counts::admits`] under its lock and holds a [`Slot`] per
//! connection.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::config::TcpConfig;

/// Connections counted per phase, in all and per peer IP address: those
/// in their handshake (limited by `max_handshaking` and
/// `max_handshaking_per_ip`) and those handshaken (`max_connections`), so
/// peers that never finish a handshake cannot take the slots of peers that
/// do. When the handshake quota is full, a newcomer from an address with
/// fewer handshakes under way than the busiest address takes the slot of
/// that address's oldest handshake ([`Admit::Evict`]): a flood spread over
/// many addresses keeps at most its fair share, and a peer that opens one
/// connection at a time always finds room. When the newcomer's own address
/// is at its share (`max_handshaking_per_ip`, or the busiest at a full
/// quota), it takes the slot of its own address's oldest handshake: peers
/// behind one address (a NAT, co-tenants of a host) are not locked out by
/// a flood from that address, which can hold a slot only until its next
/// reopening.
#[derive(Debug, Default)]
pub(crate) struct Counts {
    pub(crate) handshaking: usize,
    pub(crate) served: usize,
    pub(crate) per_ip: HashMap<IpAddr, PerIp>,
    /// How to tell each connection in its handshake that its slot was
    /// taken (it answers `Busy` and closes, so its peer retries instead of
    /// reading the close as a failed authentication).
    pub(crate) evict_signals: HashMap<u64, Arc<Notify>>,
}

/// One peer address's connections; removed when it has none.
#[derive(Debug, Default)]
pub(crate) struct PerIp {
    /// Ids of its connections in their handshake, oldest first.
    pub(crate) handshaking: VecDeque<u64>,
    pub(crate) served: usize,
}

/// What to do with a new connection.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Admit {
    /// Room: count it in its handshake.
    Yes,
    /// Room once the handshake of connection `0` (from the busiest
    /// address) is closed: [`Counts::evict`] has already uncounted it.
    Evict(u64),
    /// Over a limit (why): answer `Busy` and close.
    No(&'static str),
}

impl Counts {
    /// Whether a new connection from `ip` may start its handshake: room in
    /// the pre-authentication quota (or a busier address to take it from),
    /// in its IP's share of it, and among the handshaken connections it
    /// would join.
    pub(crate) fn admits(&mut self, cfg: &TcpConfig, ip: IpAddr) -> Admit {
        let (h, s) = self.per_ip.get(&ip).map_or((0, 0), |e| (e.handshaking.len(), e.served));
        if self.served >= cfg.max_connections {
            return Admit::No("connection limit (max_connections) reached");
        }
        if s >= cfg.max_connections_per_ip {
            return Admit::No("per-address connection cap (max_connections_per_ip) reached");
        }
        if h >= cfg.max_handshaking_per_ip {
            return match self.evict_own(ip) {
                Some(id) => Admit::Evict(id),
                None => Admit::No("per-address handshake cap (max_handshaking_per_ip) reached"),
            };
        }
        if self.handshaking >= cfg.max_handshaking {
            return match self.evict(h).or_else(|| self.evict_own(ip)) {
                Some(id) => Admit::Evict(id),
                None => Admit::No("handshake quota (max_handshaking) reached"),
            };
        }
        Admit::Yes
    }

    /// Uncounts the oldest handshake of `ip` itself, if it has one; its id,
    /// for the caller to close.
    pub(crate) fn evict_own(&mut self, ip: IpAddr) -> Option<u64> {
        let id = self.per_ip.get_mut(&ip)?.handshaking.pop_front()?;
        self.handshaking = self.handshaking.saturating_sub(1);
        Some(id)
    }

    /// Uncounts the oldest handshake of the address with the most under
    /// way, if it has more than `than` + 1 (so the newcomer, counted next,
    /// never ends up with more than it); its id, for the caller to close.
    pub(crate) fn evict(&mut self, than: usize) -> Option<u64> {
        let (ip, e) = self.per_ip.iter_mut().max_by_key(|(_, e)| e.handshaking.len())?;
        if e.handshaking.len() <= than + 1 {
            return None;
        }
        let (ip, id) = (*ip, e.handshaking.pop_front()?);
        self.handshaking = self.handshaking.saturating_sub(1);
        self.forget_if_empty(ip);
        Some(id)
    }

    pub(crate) fn forget_if_empty(&mut self, ip: IpAddr) {
        if self.per_ip.get(&ip).is_some_and(|e| e.handshaking.is_empty() && e.served == 0) {
            self.per_ip.remove(&ip);
        }
    }
}

/// A connection's place in [`Counts`]; given back when dropped.
#[derive(Debug)]
pub(crate) struct Slot {
    pub(crate) counts: Arc<Mutex<Counts>>,
    pub(crate) ip: IpAddr,
    pub(crate) id: u64,
    pub(crate) served: bool,
    /// Notified when a newcomer took this handshake's slot.
    pub(crate) evicted: Arc<Notify>,
}

impl Slot {
    /// Counts connection `id` in its handshake (the caller checked
    /// [`Counts::admits`] under the same lock).
    pub(crate) fn handshaking(counts: &Arc<Mutex<Counts>>, c: &mut Counts, ip: IpAddr, id: u64) -> Self {
        c.handshaking += 1;
        c.per_ip.entry(ip).or_default().handshaking.push_back(id);
        let evicted = Arc::new(Notify::new());
        c.evict_signals.insert(id, evicted.clone());
        Self { counts: counts.clone(), ip, id, served: false, evicted }
    }

    /// Moves the connection from its handshake to the handshaken ones, if
    /// there is room; otherwise it stays counted in its handshake (and is
    /// to be answered `Busy` and closed). A connection whose handshake slot
    /// was taken by a newcomer is refused too (its task is being aborted).
    pub(crate) fn promote(&mut self, cfg: &TcpConfig) -> Result<(), &'static str> {
        let mut c = self.counts.lock();
        if c.served >= cfg.max_connections {
            return Err("connection limit (max_connections) reached");
        }
        let Some(e) = c.per_ip.get_mut(&self.ip) else {
            return Err("handshake slot taken by a newcomer (max_handshaking reached)");
        };
        if e.served >= cfg.max_connections_per_ip {
            return Err("per-address connection cap (max_connections_per_ip) reached");
        }
        let Some(at) = e.handshaking.iter().position(|&i| i == self.id) else {
            return Err("handshake slot taken by a newcomer (max_handshaking reached)");
        };
        e.handshaking.remove(at);
        e.served += 1;
        c.handshaking = c.handshaking.saturating_sub(1);
        c.served += 1;
        c.evict_signals.remove(&self.id);
        self.served = true;
        Ok(())
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut c = self.counts.lock();
        c.evict_signals.remove(&self.id);
        let Some(e) = c.per_ip.get_mut(&self.ip) else { return };
        if self.served {
            e.served = e.served.saturating_sub(1);
            c.served = c.served.saturating_sub(1);
        } else if let Some(at) = e.handshaking.iter().position(|&i| i == self.id) {
            // (Not found: evicted, and uncounted then.)
            e.handshaking.remove(at);
            c.handshaking = c.handshaking.saturating_sub(1);
        }
        c.forget_if_empty(self.ip);
    }
}

/// The metric label for a refusal reason (a fixed set).
pub(crate) fn refusal_label(why: &str) -> &'static str {
    if why.contains("max_connections_per_ip") {
        "max_connections_per_ip"
    } else if why.contains("max_connections") {
        "max_connections"
    } else if why.contains("max_handshaking_per_ip") {
        "max_handshaking_per_ip"
    } else if why.contains("max_handshaking") {
        "max_handshaking"
    } else {
        "other"
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::*;

    fn ip(n: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, n])
    }

    fn cfg(quota: usize, per_ip: usize) -> TcpConfig {
        TcpConfig { max_handshaking: quota, max_handshaking_per_ip: per_ip, ..TcpConfig::default() }
    }

    /// Admits a connection as the accept loop does; its slot and the id
    /// it evicted.
    fn admit(
        counts: &Arc<Mutex<Counts>>,
        cfg: &TcpConfig,
        from: IpAddr,
        id: u64,
    ) -> Result<(Slot, Option<u64>), &'static str> {
        let mut c = counts.lock();
        match c.admits(cfg, from) {
            Admit::Yes => Ok((Slot::handshaking(counts, &mut c, from, id), None)),
            Admit::Evict(old) => Ok((Slot::handshaking(counts, &mut c, from, id), Some(old))),
            Admit::No(why) => Err(why),
        }
    }

    #[test]
    fn a_full_quota_takes_from_the_busiest_address_only() {
        let counts = Arc::new(Mutex::new(Counts::default()));
        let cfg = cfg(4, 4);
        // Address 1 holds the whole quota.
        let mut flood: Vec<Slot> = (0..4).map(|i| admit(&counts, &cfg, ip(1), i).unwrap().0).collect();
        // A newcomer from address 2 takes the oldest of them.
        let (mut legit, evicted) = admit(&counts, &cfg, ip(2), 10).unwrap();
        assert_eq!(evicted, Some(0));
        assert_eq!(counts.lock().handshaking, 4, "never over the quota");
        // The evicted one cannot be promoted, and uncounts nothing more.
        assert!(flood[0].promote(&cfg).is_err());
        drop(flood.remove(0));
        assert_eq!(counts.lock().handshaking, 4);
        // Address 1 (3 under way) cannot take address 2's slot back (1):
        // its newcomer takes the slot of its own oldest (1) instead.
        let (f11, evicted) = admit(&counts, &cfg, ip(1), 11).unwrap();
        assert_eq!(evicted, Some(1));
        drop(flood.remove(0));
        flood.push(f11);
        assert_eq!(counts.lock().handshaking, 4);
        // Address 3 takes from address 1 again (3 > 0 + 1), then address
        // 4 finds address 1 at 2 and everyone else at 1: still 2 > 0 + 1.
        let (_c, evicted) = admit(&counts, &cfg, ip(3), 12).unwrap();
        assert_eq!(evicted, Some(2));
        let (_d, evicted) = admit(&counts, &cfg, ip(4), 13).unwrap();
        assert_eq!(evicted, Some(3));
        // Now every address holds one: a fifth, with none of its own, is
        // refused.
        assert!(admit(&counts, &cfg, ip(5), 14).is_err());
        // The newcomer from address 2 finishes its handshake.
        assert!(legit.promote(&cfg).is_ok());
        let c = counts.lock();
        assert_eq!((c.handshaking, c.served), (3, 1));
    }

    /// A newcomer from an address at its cap takes its own address's
    /// oldest handshake, so a flood from an initiator's own address cannot
    /// lock it out; other addresses' slots are untouched.
    #[test]
    fn an_address_at_its_cap_gives_up_its_own_oldest() {
        let counts = Arc::new(Mutex::new(Counts::default()));
        let cfg = cfg(16, 3);
        let others: Vec<Slot> = (0..2).map(|i| admit(&counts, &cfg, ip(2), 100 + i).unwrap().0).collect();
        let mut flood: Vec<Slot> = (0..3).map(|i| admit(&counts, &cfg, ip(1), i).unwrap().0).collect();
        for (n, want) in (3..10).zip(0..) {
            let (slot, evicted) = admit(&counts, &cfg, ip(1), n).unwrap();
            assert_eq!(evicted, Some(want), "the oldest of address 1 gives way");
            flood.push(slot);
            let c = counts.lock();
            assert_eq!(c.per_ip[&ip(1)].handshaking.len(), 3, "address 1 stays at its cap");
            assert_eq!(c.per_ip[&ip(2)].handshaking.len(), 2, "address 2 keeps its slots");
        }
        // The newest from address 1 (a legitimate peer behind the flood's
        // address) finishes its handshake; the evicted ones cannot.
        let mut legit = flood.pop().unwrap();
        assert!(legit.promote(&cfg).is_ok());
        assert!(flood[0].promote(&cfg).is_err());
        drop(others);
    }

    #[test]
    fn slots_uncount_exactly_once() {
        let counts = Arc::new(Mutex::new(Counts::default()));
        let cfg = cfg(8, 8);
        let (mut a, _) = admit(&counts, &cfg, ip(1), 1).unwrap();
        let (b, _) = admit(&counts, &cfg, ip(1), 2).unwrap();
        a.promote(&cfg).unwrap();
        drop(b);
        let (h, s) = {
            let c = counts.lock();
            (c.handshaking, c.served)
        };
        assert_eq!((h, s), (0, 1));
        drop(a);
        let c = counts.lock();
        assert_eq!((c.handshaking, c.served), (0, 0));
        assert!(c.per_ip.is_empty(), "an address with no connection is forgotten");
    }
}
