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

/// The bounds a server's connections are held to (each backend's config
/// gives them: `TcpConfig`, `RdmaConfig`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Handshaken connections in all.
    pub max_connections: usize,
    /// Handshaken connections per peer address.
    pub max_connections_per_ip: usize,
    /// Connections in their handshake in all (the pre-authentication
    /// quota).
    pub max_handshaking: usize,
    /// Connections in their handshake per peer address.
    pub max_handshaking_per_ip: usize,
}

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
///
/// Who gives way is decided by what each handshake has proven before its
/// age ([`Proven`]): the oldest handshake that has not yet sent a
/// well-formed HELLO goes first, and one that has goes only when its
/// address has none silent left. A legitimate initiator sends its HELLO
/// with the connection, so a flood of silent connections from its own
/// address (which reopens thousands of times a second) evicts its own
/// sockets, not the initiator waiting one round trip for its proof.
#[derive(Debug, Default)]
pub struct Counts {
    pub handshaking: usize,
    pub served: usize,
    pub per_ip: HashMap<IpAddr, PerIp>,
    /// How to tell each connection in its handshake that its slot was
    /// taken (it answers `Busy` and closes, so its peer retries instead of
    /// reading the close as a failed authentication).
    pub evict_signals: HashMap<u64, Arc<Notify>>,
}

/// One peer address's connections; removed when it has none.
#[derive(Debug, Default)]
pub struct PerIp {
    /// Its connections in their handshake, oldest first.
    pub handshaking: VecDeque<Handshake>,
    pub served: usize,
}

/// A connection in its handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Handshake {
    pub id: u64,
    pub proven: Proven,
}

/// How far a handshake has got: what it has shown of being a real peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Proven {
    /// Connected, no HELLO read yet.
    Nothing,
    /// Sent a well-formed HELLO of this protocol version (and was
    /// challenged: its answer is one round trip away).
    Hello,
}

impl PerIp {
    /// Takes out the handshake that gives way first: the oldest of those
    /// that have proven the least.
    fn give_way(&mut self) -> Option<u64> {
        let least = self.handshaking.iter().map(|h| h.proven).min()?;
        let at = self.handshaking.iter().position(|h| h.proven == least)?;
        self.handshaking.remove(at).map(|h| h.id)
    }

    fn position(&self, id: u64) -> Option<usize> {
        self.handshaking.iter().position(|h| h.id == id)
    }
}

/// What to do with a new connection.
#[derive(Debug, PartialEq, Eq)]
pub enum Admit {
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
    /// the pre-authentication quota (or a busier address to take it from)
    /// and among the handshaken connections it would join. A newcomer has
    /// proven nothing yet: its address's share (`max_handshaking_per_ip`)
    /// counts the handshakes that sent a HELLO, and is kept as each does
    /// ([`Counts::prove`]); silent ones are held to the quota alone, and
    /// give way first.
    pub fn admits(&mut self, cfg: &Limits, ip: IpAddr) -> Admit {
        let (h, s) = self.per_ip.get(&ip).map_or((0, 0), |e| (e.handshaking.len(), e.served));
        if self.served >= cfg.max_connections {
            return Admit::No("connection limit (max_connections) reached");
        }
        if s >= cfg.max_connections_per_ip {
            return Admit::No("per-address connection cap (max_connections_per_ip) reached");
        }
        if self.handshaking >= cfg.max_handshaking {
            return match self.evict(h).or_else(|| self.evict_own(ip)) {
                Some(id) => Admit::Evict(id),
                None => Admit::No("handshake quota (max_handshaking) reached"),
            };
        }
        Admit::Yes
    }

    /// Records that handshake `id` of `ip` has `proven` this much (it then
    /// gives way after those that proved less). When that makes more of
    /// its address's handshakes past their HELLO than
    /// `max_handshaking_per_ip`, the oldest other one of them is uncounted:
    /// its signal is returned, for the caller to notify (it answers `Busy`
    /// and closes). Nothing if `id` was evicted meanwhile.
    pub fn prove(&mut self, cfg: &Limits, ip: IpAddr, id: u64, proven: Proven) -> Option<Arc<Notify>> {
        let e = self.per_ip.get_mut(&ip)?;
        let at = e.position(id)?;
        if e.handshaking[at].proven >= proven {
            return None;
        }
        e.handshaking[at].proven = proven;
        let past_hello = e.handshaking.iter().filter(|h| h.proven >= Proven::Hello).count();
        if past_hello <= cfg.max_handshaking_per_ip {
            return None;
        }
        let j = e.handshaking.iter().position(|h| h.proven >= Proven::Hello && h.id != id)?;
        let old = e.handshaking.remove(j)?.id;
        self.handshaking = self.handshaking.saturating_sub(1);
        self.evict_signals.remove(&old)
    }

    /// Uncounts the handshake of `ip` itself that gives way first (see
    /// [`PerIp::give_way`]), if it has one; its id, for the caller to
    /// close.
    pub fn evict_own(&mut self, ip: IpAddr) -> Option<u64> {
        let id = self.per_ip.get_mut(&ip)?.give_way()?;
        self.handshaking = self.handshaking.saturating_sub(1);
        Some(id)
    }

    /// Uncounts the handshake that gives way first (see
    /// [`PerIp::give_way`]) of the address with the most under way, if it
    /// has more than `than` + 1 (so the newcomer, counted next, never ends
    /// up with more than it); its id, for the caller to close.
    pub fn evict(&mut self, than: usize) -> Option<u64> {
        let (ip, e) = self.per_ip.iter_mut().max_by_key(|(_, e)| e.handshaking.len())?;
        if e.handshaking.len() <= than + 1 {
            return None;
        }
        let (ip, id) = (*ip, e.give_way()?);
        self.handshaking = self.handshaking.saturating_sub(1);
        self.forget_if_empty(ip);
        Some(id)
    }

    pub fn forget_if_empty(&mut self, ip: IpAddr) {
        if self.per_ip.get(&ip).is_some_and(|e| e.handshaking.is_empty() && e.served == 0) {
            self.per_ip.remove(&ip);
        }
    }
}

/// A connection's place in [`Counts`]; given back when dropped.
#[derive(Debug)]
pub struct Slot {
    pub counts: Arc<Mutex<Counts>>,
    pub ip: IpAddr,
    pub id: u64,
    pub served: bool,
    /// Notified when a newcomer took this handshake's slot.
    pub evicted: Arc<Notify>,
}

impl Slot {
    /// Counts connection `id` in its handshake (the caller checked
    /// [`Counts::admits`] under the same lock; a server that finds the
    /// HELLO already waiting in the socket then calls [`Counts::prove`]).
    pub fn handshaking(counts: &Arc<Mutex<Counts>>, c: &mut Counts, ip: IpAddr, id: u64) -> Self {
        c.handshaking += 1;
        c.per_ip.entry(ip).or_default().handshaking.push_back(Handshake { id, proven: Proven::Nothing });
        let evicted = Arc::new(Notify::new());
        c.evict_signals.insert(id, evicted.clone());
        Self { counts: counts.clone(), ip, id, served: false, evicted }
    }

    /// Records what the handshake has proven ([`Counts::prove`]), and
    /// tells the handshake that gave way for it, if one did. Whether one
    /// did.
    pub fn proved(&self, cfg: &Limits, proven: Proven) -> bool {
        let evicted = self.counts.lock().prove(cfg, self.ip, self.id, proven);
        if let Some(signal) = &evicted {
            signal.notify_one();
        }
        evicted.is_some()
    }

    /// Moves the connection from its handshake to the handshaken ones, if
    /// there is room; otherwise it stays counted in its handshake (and is
    /// to be answered `Busy` and closed). A connection whose handshake slot
    /// was taken by a newcomer is refused too (its task is being aborted).
    pub fn promote(&mut self, cfg: &Limits) -> Result<(), &'static str> {
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
        let Some(at) = e.position(self.id) else {
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
        } else if let Some(at) = e.position(self.id) {
            // (Not found: evicted, and uncounted then.)
            e.handshaking.remove(at);
            c.handshaking = c.handshaking.saturating_sub(1);
        }
        c.forget_if_empty(self.ip);
    }
}

/// The metric label for a refusal reason (a fixed set).
pub fn refusal_label(why: &str) -> &'static str {
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
#[allow(clippy::unwrap_used)]
mod tests {
    use std::net::IpAddr;

    use super::*;

    fn ip(n: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, n])
    }

    fn cfg(quota: usize, per_ip: usize) -> Limits {
        Limits {
            max_connections: 1024,
            max_connections_per_ip: 64,
            max_handshaking: quota,
            max_handshaking_per_ip: per_ip,
        }
    }

    /// Admits a connection as the accept loop does; its slot and the id
    /// it evicted.
    fn admit(
        counts: &Arc<Mutex<Counts>>,
        cfg: &Limits,
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

    /// An address's share counts the handshakes that sent a HELLO: when
    /// one more of them sends its HELLO, its address's oldest such gives
    /// way (peers behind one address, a NAT or co-tenants of a host, are
    /// not locked out by a flood from it); other addresses' slots are
    /// untouched.
    #[test]
    fn an_address_at_its_share_gives_up_its_own_oldest() {
        let counts = Arc::new(Mutex::new(Counts::default()));
        let cfg = cfg(16, 3);
        let others: Vec<Slot> = (0..2).map(|i| admit(&counts, &cfg, ip(2), 100 + i).unwrap().0).collect();
        for o in &others {
            assert!(!o.proved(&cfg, Proven::Hello));
        }
        let mut flood = Vec::new();
        for n in 0..10u64 {
            let (slot, evicted) = admit(&counts, &cfg, ip(1), n).unwrap();
            assert_eq!(evicted, None, "room in the quota");
            let gave_way = slot.proved(&cfg, Proven::Hello);
            assert_eq!(gave_way, n >= 3, "HELLO {n}: the oldest of address 1 gives way past its share of 3");
            flood.push(slot);
            let c = counts.lock();
            assert_eq!(c.per_ip[&ip(1)].handshaking.len(), (n as usize + 1).min(3), "address 1 stays at its share");
            assert_eq!(c.per_ip[&ip(2)].handshaking.len(), 2, "address 2 keeps its slots");
        }
        // The newest from address 1 (a legitimate peer behind the flood's
        // address) finishes its handshake; the evicted ones cannot.
        let mut legit = flood.pop().unwrap();
        assert!(legit.promote(&cfg).is_ok());
        assert!(flood[0].promote(&cfg).is_err());
        drop(others);
    }

    /// Issue 49, item 5: silent connections (no HELLO) are held to the
    /// quota alone and give way first: a handshake that sent its HELLO
    /// outlasts any number of silent newcomers from its own address (each
    /// takes the slot of the oldest silent one) or from others, whatever
    /// its age.
    #[test]
    fn silent_handshakes_give_way_before_one_that_sent_hello() {
        let counts = Arc::new(Mutex::new(Counts::default()));
        let cfg = cfg(8, 4);
        let mut flood: Vec<Slot> = (0..2).map(|i| admit(&counts, &cfg, ip(1), i).unwrap().0).collect();
        let (mut legit, _) = admit(&counts, &cfg, ip(1), 10).unwrap();
        flood.push(admit(&counts, &cfg, ip(1), 2).unwrap().0);
        assert!(!legit.proved(&cfg, Proven::Hello));
        // A thousand silent newcomers from its address: it soon is the
        // oldest there, and never the one evicted.
        for n in 100..1100 {
            let (slot, evicted) = admit(&counts, &cfg, ip(1), n).unwrap();
            assert_ne!(evicted, Some(10), "newcomer {n} evicted the handshake that sent HELLO");
            flood.push(slot);
        }
        assert_eq!(counts.lock().per_ip[&ip(1)].handshaking.len(), 8, "silent ones fill the quota, no more");
        // A newcomer from another address takes a silent one too.
        let (_other, evicted) = admit(&counts, &cfg, ip(2), 5000).unwrap();
        assert!(evicted.is_some_and(|id| id != 10));
        assert!(legit.promote(&cfg).is_ok(), "the legitimate handshake completes");
        // When every handshake left sent HELLO, the oldest of them gives
        // way to a newcomer.
        let left: Vec<u64> = counts.lock().per_ip[&ip(1)].handshaking.iter().map(|h| h.id).collect();
        for s in flood.iter().filter(|s| left.contains(&s.id)) {
            s.proved(&cfg, Proven::Hello);
        }
        let past_hello = counts.lock().per_ip[&ip(1)].handshaking.len();
        assert_eq!(past_hello, 4, "the share of 4 kept as they sent HELLO");
        let (_d, evicted) = admit(&counts, &cfg, ip(1), 9003).unwrap();
        let (_e, evicted2) = admit(&counts, &cfg, ip(1), 9004).unwrap();
        // Room in the quota (8) for these two; a third, with the quota
        // full, takes the oldest silent of its own address first.
        assert_eq!((evicted, evicted2), (None, None));
        let (_f, evicted) = admit(&counts, &cfg, ip(1), 9005).unwrap();
        assert_eq!(evicted, None, "7 of 8");
        let (_g, evicted) = admit(&counts, &cfg, ip(1), 9006).unwrap();
        assert_eq!(evicted, Some(9003), "the oldest silent goes before older ones past their HELLO");
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
