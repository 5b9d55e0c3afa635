//! Many rails as one, sans-IO: the health of one *path* (a local rail to
//! one of the peer's rails) with pause and backoff, the pairing of local
//! rails with a peer's, and the list of rails a transport advertises in
//! its descriptor. The driver is [`crate::Rails`].
//!
//! A path that fails `pause_after_errors` times within `error_window` is
//! *paused*: nothing is sent on it for `pause`, which doubles on every
//! pause that follows a failed probe, up to `max_pause`. When the pause
//! ends the path is on *probation*: one sub-batch at a time is let through;
//! its success takes the path back (and resets the pause), its failure
//! pauses it again for twice as long. A paused path sends nothing, so it
//! rebuilds nothing: that is the rate limit on reconnects after NIC errors.

use std::collections::VecDeque;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use transport_core::{Error, ErrorKind, Result};

/// How local rails pair with a peer's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Pairing {
    /// Local rail `i` with the peer's rail `i` (modulo the shorter list):
    /// `max(local, peer)` paths. The usual choice for rail-optimised
    /// fabrics, where NIC `i` of every server sits on switch `i`.
    #[default]
    Index,
    /// Every local rail with every peer rail: `local x peer` paths.
    All,
    /// Local and peer rails whose GIDs share the 64-bit subnet prefix
    /// (RoCE v2 / IB); an error if no pair does.
    Subnet,
}

/// How many times one slice may be moved to another path within one
/// batch (one attempt of the engine) before its request fails with the
/// last error: `2 x paths + 2`, enough to try every path twice. The one
/// bound on the layer's reposting (`docs/CONTRACT.md`, rule 8, "Layers").
pub fn max_moves(paths: usize) -> u32 {
    u32::try_from(paths).unwrap_or(u32::MAX).saturating_mul(2).saturating_add(2)
}

/// Options of [`crate::Rails`] (serde; every field has a default).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RailsConfig {
    /// How local rails pair with the peer's.
    pub pairing: Pairing,
    /// Requests are cut into slices of at most this many bytes; slices are
    /// what is spread over the paths and reposted after a failure.
    pub slice_size: u64,
    /// Bytes per sub-batch handed to one path at a time.
    pub chunk_bytes: u64,
    /// Sub-batches in flight per path. A path that moves faster finishes
    /// its sub-batches sooner and is handed more: the spread follows what
    /// each path actually moves.
    pub subs_per_path: usize,
    /// Failures within `error_window_ms` that pause a path.
    pub pause_after_errors: u32,
    pub error_window_ms: u64,
    /// First pause; doubled after each failed probe, up to `max_pause_ms`.
    pub pause_ms: u64,
    pub max_pause_ms: u64,
}

impl Default for RailsConfig {
    fn default() -> Self {
        Self {
            pairing: Pairing::Index,
            slice_size: 1 << 20,
            chunk_bytes: 4 << 20,
            subs_per_path: 2,
            pause_after_errors: 3,
            error_window_ms: 10_000,
            pause_ms: 30_000,
            max_pause_ms: 300_000,
        }
    }
}

impl RailsConfig {
    /// Checks ranges; names the field that is wrong.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, why: &str| Err(Error::new(ErrorKind::Config, format!("rails.{field}: {why}")));
        if self.slice_size == 0 || self.slice_size > (1 << 30) {
            return bad("slice_size", "must be 1..=1 GiB");
        }
        if self.chunk_bytes < self.slice_size {
            return bad("chunk_bytes", "must be at least slice_size");
        }
        if self.subs_per_path == 0 || self.subs_per_path > 64 {
            return bad("subs_per_path", "must be 1..=64");
        }
        if self.pause_after_errors == 0 {
            return bad("pause_after_errors", "must be at least 1");
        }
        if self.pause_ms == 0 || self.max_pause_ms < self.pause_ms {
            return bad("pause_ms", "must be at least 1 and at most max_pause_ms");
        }
        Ok(())
    }

    fn window(&self) -> Duration {
        Duration::from_millis(self.error_window_ms)
    }
}

/// What a path does with new work, as seen at some instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PathState {
    /// Healthy: sub-batches flow, up to `subs_per_path`.
    Up,
    /// Failing: nothing is sent until the pause ends.
    Paused,
    /// The pause ended: one sub-batch at a time; its result decides.
    Probation,
}

/// The health of one path, over the driver's clock.
#[derive(Debug, Clone)]
pub struct PathHealth {
    /// Failures within the window (their times).
    errors: VecDeque<Duration>,
    /// While paused: until when.
    paused_until: Option<Duration>,
    /// Set once a pause ended and no success was seen since.
    probation: bool,
    /// The next pause's length.
    next_pause: Duration,
    /// Times this path was paused.
    pauses: u64,
}

/// What a reported failure did to the path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathVerdict {
    /// Still usable.
    Kept,
    /// Paused for this long.
    Paused(Duration),
}

impl PathHealth {
    pub fn new(cfg: &RailsConfig) -> Self {
        Self {
            errors: VecDeque::new(),
            paused_until: None,
            probation: false,
            next_pause: Duration::from_millis(cfg.pause_ms),
            pauses: 0,
        }
    }

    /// The state at `now`.
    pub fn state(&self, now: Duration) -> PathState {
        match self.paused_until {
            Some(until) if now < until => PathState::Paused,
            _ if self.probation || self.paused_until.is_some() => PathState::Probation,
            _ => PathState::Up,
        }
    }

    /// How many sub-batches the path may carry at `now`.
    pub fn room(&self, now: Duration, cfg: &RailsConfig) -> usize {
        match self.state(now) {
            PathState::Up => cfg.subs_per_path,
            PathState::Probation => 1,
            PathState::Paused => 0,
        }
    }

    /// When a paused path ends its pause (`None` if not paused at `now`).
    pub fn paused_until(&self, now: Duration) -> Option<Duration> {
        self.paused_until.filter(|&u| now < u)
    }

    /// Times the path was paused so far.
    pub fn pauses(&self) -> u64 {
        self.pauses
    }

    /// A sub-batch on the path completed: a path on probation is back.
    /// Returns whether it came back just now.
    pub fn success(&mut self, now: Duration, cfg: &RailsConfig) -> bool {
        if self.state(now) == PathState::Probation {
            self.paused_until = None;
            self.probation = false;
            self.errors.clear();
            self.next_pause = Duration::from_millis(cfg.pause_ms);
            return true;
        }
        false
    }

    /// A failure of the path (a failed sub-batch, a refused submit).
    pub fn failure(&mut self, now: Duration, cfg: &RailsConfig) -> PathVerdict {
        match self.state(now) {
            // Failures of work sent before the pause add nothing.
            PathState::Paused => PathVerdict::Kept,
            PathState::Probation => self.pause(now, cfg),
            PathState::Up => {
                let window = cfg.window();
                while self.errors.front().is_some_and(|&t| now.saturating_sub(t) >= window) {
                    self.errors.pop_front();
                }
                self.errors.push_back(now);
                if self.errors.len() >= cfg.pause_after_errors as usize {
                    self.pause(now, cfg)
                } else {
                    PathVerdict::Kept
                }
            }
        }
    }

    fn pause(&mut self, now: Duration, cfg: &RailsConfig) -> PathVerdict {
        let pause = self.next_pause;
        self.paused_until = Some(now.saturating_add(pause));
        self.probation = true;
        self.errors.clear();
        self.pauses += 1;
        self.next_pause = pause.saturating_mul(2).min(Duration::from_millis(cfg.max_pause_ms));
        PathVerdict::Paused(pause)
    }
}

/// The rails a transport advertises in its descriptor's `address`, so a
/// peer that opens its first rail learns the others:
/// `rails(<name0>,<name1>,...;tcp=<name>)`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RailList {
    /// Segment names of the rails, rail 0 first (the transport's own name).
    pub rails: Vec<String>,
    /// The TCP fallback's segment name, if the transport has one.
    pub tcp: Option<String>,
}

const OPEN: &str = "rails(";

impl RailList {
    /// The text appended to the first rail's descriptor address.
    pub fn format(&self) -> String {
        let mut s = format!("{OPEN}{}", self.rails.join(","));
        if let Some(t) = &self.tcp {
            s.push_str(";tcp=");
            s.push_str(t);
        }
        s.push(')');
        s
    }

    /// The list advertised in `address`, `None` if there is none (a peer
    /// with one rail). Malformed lists are a `Protocol` error: the peer
    /// controls this text.
    pub fn parse(address: &str) -> Result<Option<Self>> {
        let Some(start) = address.find(OPEN) else { return Ok(None) };
        let rest = &address[start + OPEN.len()..];
        let bad =
            |why: &str| Error::new(ErrorKind::Protocol, format!("bad rails list in the peer's descriptor: {why}"));
        let end = rest.find(')').ok_or_else(|| bad("no closing parenthesis"))?;
        let body = &rest[..end];
        let (names, tcp) = match body.split_once(';') {
            Some((n, t)) => (n, Some(t.strip_prefix("tcp=").ok_or_else(|| bad("expected tcp=<name>"))?)),
            None => (body, None),
        };
        let rails: Vec<String> = names.split(',').map(str::to_string).collect();
        if rails.iter().any(|n| n.is_empty() || n.len() > 256) || rails.len() > MAX_RAILS {
            return Err(bad("empty or oversized entry"));
        }
        if tcp.is_some_and(|t| t.is_empty() || t.len() > 256) {
            return Err(bad("empty or oversized tcp entry"));
        }
        Ok(Some(Self { rails, tcp: tcp.map(str::to_string) }))
    }
}

/// Most rails per transport (and per advertised list).
pub const MAX_RAILS: usize = 16;

/// Most ranges a [`NearList`] holds (about 30 bytes of descriptor each).
pub const MAX_NEAR: usize = 1024;

const NEAR_OPEN: &str = "near(";

/// The rails nearest each region a transport lets its peers reach, written
/// after its [`RailList`] in rail 0's descriptor address:
/// `near(<addr>+<len>:<mask>,...)` (hexadecimal; bit `k` of the mask is
/// rail `k`). A peer sending to one of those ranges prefers the paths that
/// end on those rails, so the bytes arrive through the NIC nearest the
/// memory that holds them. Only regions that keep to some of the rails are
/// listed; anything else is served by every rail. Sorted by address, the
/// ranges never overlap.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NearList {
    ranges: Vec<(u64, u64, u32)>,
}

impl NearList {
    /// The list of `(addr, len, mask)` ranges: sorted, ranges that touch
    /// with the same mask merged, empty ranges, empty masks and ranges
    /// overlapping an earlier one dropped, at most [`MAX_NEAR`] kept.
    /// Returns it and how many ranges were left out past the bound.
    pub fn new(mut ranges: Vec<(u64, u64, u32)>) -> (Self, usize) {
        ranges.sort_unstable();
        let mut out: Vec<(u64, u64, u32)> = Vec::with_capacity(ranges.len().min(MAX_NEAR));
        let mut over = 0;
        for (addr, len, mask) in ranges {
            let Some(end) = addr.checked_add(len) else { continue };
            if len == 0 || mask == 0 {
                continue;
            }
            if let Some(last) = out.last_mut() {
                let last_end = last.0.saturating_add(last.1);
                if addr < last_end {
                    continue;
                }
                if addr == last_end && mask == last.2 {
                    last.1 = end - last.0;
                    continue;
                }
            }
            if out.len() == MAX_NEAR {
                over += 1;
                continue;
            }
            out.push((addr, len, mask));
        }
        (Self { ranges: out }, over)
    }

    /// The text to append to the descriptor address (empty for an empty
    /// list, so a transport without a topology advertises what it did).
    pub fn format(&self) -> String {
        if self.ranges.is_empty() {
            return String::new();
        }
        let body: Vec<String> = self.ranges.iter().map(|(a, l, m)| format!("{a:x}+{l:x}:{m:x}")).collect();
        format!(" {NEAR_OPEN}{})", body.join(","))
    }

    /// The list in a peer's descriptor `address`, whose advertised rails
    /// number `rails` (empty if it has none). The peer controls this text:
    /// anything malformed, a mask naming a rail it does not have,
    /// overlapping ranges or more than [`MAX_NEAR`] of them is a `Protocol`
    /// error.
    pub fn parse(address: &str, rails: usize) -> Result<Self> {
        let Some(start) = address.find(NEAR_OPEN) else { return Ok(Self::default()) };
        let bad = |why: &str| {
            Error::new(ErrorKind::Protocol, format!("bad list of near rails in the peer's descriptor: {why}"))
        };
        let rest = &address[start + NEAR_OPEN.len()..];
        let body = &rest[..rest.find(')').ok_or_else(|| bad("no closing parenthesis"))?];
        let allowed = u32::try_from(rails).ok().and_then(|r| 1u32.checked_shl(r)).map_or(u32::MAX, |b| b - 1);
        let mut ranges = Vec::new();
        for entry in body.split(',').filter(|e| !e.is_empty()) {
            if ranges.len() == MAX_NEAR {
                return Err(bad(&format!("more than {MAX_NEAR} ranges")));
            }
            let hex = |t: &str| u64::from_str_radix(t, 16).ok().filter(|_| !t.is_empty() && t.len() <= 16);
            let (range, mask) = entry.split_once(':').ok_or_else(|| bad("an entry without ':'"))?;
            let (addr, len) = range.split_once('+').ok_or_else(|| bad("an entry without '+'"))?;
            let (Some(addr), Some(len), Some(mask)) = (hex(addr), hex(len), hex(mask)) else {
                return Err(bad("an entry that is not hexadecimal"));
            };
            let mask = u32::try_from(mask).map_err(|_| bad("a mask wider than 32 rails"))?;
            if len == 0 || addr.checked_add(len).is_none() {
                return Err(bad("an empty range, or one past the end of the address space"));
            }
            if mask == 0 || mask & !allowed != 0 {
                return Err(bad(&format!("a mask {mask:#x} naming no rail or one of more than {rails}")));
            }
            ranges.push((addr, len, mask));
        }
        ranges.sort_unstable();
        if ranges.windows(2).any(|w| w[0].0 + w[0].1 > w[1].0) {
            return Err(bad("overlapping ranges"));
        }
        Ok(Self { ranges })
    }

    /// The rails nearest the memory at `addr` (a mask), or every rail
    /// (`u32::MAX`) where the list says nothing.
    pub fn mask_at(&self, addr: u64) -> u32 {
        let i = self.ranges.partition_point(|r| r.0 <= addr);
        match i.checked_sub(1).map(|i| self.ranges[i]) {
            Some((a, l, m)) if addr - a < l => m,
            _ => u32::MAX,
        }
    }

    pub fn len(&self) -> usize {
        self.ranges.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }
}

/// The 64-bit subnet prefix of a GID written as `gid=<32 hex digits>` in a
/// descriptor address (RDMA), if there is one.
pub fn gid_prefix(address: &str) -> Option<&str> {
    let at = address.find("gid=")? + 4;
    let hex = address.get(at..at + 32)?;
    hex.bytes().all(|b| b.is_ascii_hexdigit()).then(|| &hex[..16])
}

/// The paths `(local rail, peer rail)` for `local` and `peer` rails.
/// `local_addr(i)` / `peer_addr(j)` give the descriptor addresses used by
/// [`Pairing::Subnet`].
pub fn pair(
    pairing: Pairing,
    local: usize,
    peer: usize,
    local_addr: impl Fn(usize) -> Option<String>,
    peer_addr: impl Fn(usize) -> Option<String>,
) -> Result<Vec<(usize, usize)>> {
    if local == 0 || peer == 0 {
        return Err(Error::new(ErrorKind::Config, "no rails to pair"));
    }
    let out: Vec<(usize, usize)> = match pairing {
        Pairing::Index => (0..local.max(peer)).map(|i| (i % local, i % peer)).collect(),
        Pairing::All => (0..local).flat_map(|i| (0..peer).map(move |j| (i, j))).collect(),
        Pairing::Subnet => {
            let mut v = Vec::new();
            for i in 0..local {
                let Some(a) = local_addr(i) else { continue };
                for j in 0..peer {
                    let Some(b) = peer_addr(j) else { continue };
                    if gid_prefix(&a).is_some() && gid_prefix(&a) == gid_prefix(&b) {
                        v.push((i, j));
                    }
                }
            }
            v
        }
    };
    if out.is_empty() {
        return Err(Error::new(
            ErrorKind::Config,
            "rails.pairing = subnet: no local rail shares a GID subnet with the peer's",
        ));
    }
    Ok(out)
}

/// Paths that could not be used, peer by peer (a local rail with no route
/// to one of the peer's rails: its open failed, or with pairing `subnet`
/// its GID shares no subnet with it), so that each is logged once with its
/// reason and counted for the metrics, and no batch waits on it: it is
/// simply not one of the peer's paths. Sans-IO: [`Rails`](crate::Rails)
/// reports each opening of a peer and logs what it is told to.
#[derive(Debug, Default)]
pub struct Reachability {
    /// Paths `(peer, rail, peer rail)` whose failure was logged and that
    /// have not opened since; at most [`MAX_LOGGED_PATHS`].
    logged: std::collections::HashSet<(String, usize, usize)>,
    /// Unusable paths per peer, as of its last opening; at most
    /// [`MAX_LOGGED_PATHS`] peers.
    unusable: std::collections::HashMap<String, usize>,
}

/// Paths whose failure is remembered as logged, and peers whose unusable
/// paths are counted. Past this many, a newly failing path is logged
/// again at each opening of its peer, and a new peer's are not counted
/// (the memory stays bounded whatever peers come and go).
pub const MAX_LOGGED_PATHS: usize = 4096;

impl Reachability {
    /// One opening of `peer`: each candidate path `(rail, peer rail)` and
    /// `None` if it opened, or why it cannot be used. Returns the failures
    /// to log now (those not logged since the path last worked).
    pub fn opened<'a>(
        &mut self,
        peer: &str,
        paths: &'a [(usize, usize, Option<String>)],
    ) -> Vec<&'a (usize, usize, Option<String>)> {
        let mut log = Vec::new();
        let mut unusable = 0;
        for p in paths {
            let key = (peer.to_owned(), p.0, p.1);
            match &p.2 {
                None => {
                    self.logged.remove(&key);
                }
                Some(_) => {
                    unusable += 1;
                    if !self.logged.contains(&key) {
                        if self.logged.len() < MAX_LOGGED_PATHS {
                            self.logged.insert(key);
                        }
                        log.push(p);
                    }
                }
            }
        }
        if unusable > 0 {
            if self.unusable.len() < MAX_LOGGED_PATHS || self.unusable.contains_key(peer) {
                self.unusable.insert(peer.to_owned(), unusable);
            }
        } else {
            self.unusable.remove(peer);
        }
        log
    }

    /// Unusable paths to `peer` as of its last opening.
    pub fn unusable(&self, peer: &str) -> usize {
        self.unusable.get(peer).copied().unwrap_or(0)
    }

    /// Unusable paths to every peer, as of each one's last opening.
    pub fn unusable_total(&self) -> usize {
        self.unusable.values().sum()
    }
}

#[cfg(test)]
mod tests {
    /// Issue 52 item 3: a path with no route is logged once with its
    /// reason (again only after it worked in between), counted per peer
    /// as of the peer's last opening.
    #[test]
    fn an_unreachable_path_is_logged_once_and_counted() {
        let mut r = Reachability::default();
        let down = vec![(0, 0, None), (1, 1, Some("no route".to_owned()))];
        assert_eq!(r.opened("p", &down).len(), 1, "first time: logged");
        assert_eq!(r.unusable("p"), 1);
        assert!(r.opened("p", &down).is_empty(), "the same path again: not logged");
        assert!(r.opened("q", &down).len() == 1 && r.unusable_total() == 2, "another peer is another path");
        let up = vec![(0, 0, None), (1, 1, None)];
        assert!(r.opened("p", &up).is_empty());
        assert_eq!((r.unusable("p"), r.unusable_total()), (0, 1));
        assert_eq!(r.opened("p", &down).len(), 1, "failing again after it worked: logged again");
    }

    use super::*;

    #[test]
    fn a_slice_may_try_every_path_twice_and_the_bound_never_overflows() {
        assert_eq!(max_moves(1), 4);
        assert_eq!(max_moves(3), 8);
        assert_eq!(max_moves(usize::MAX), u32::MAX);
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn cfg() -> RailsConfig {
        RailsConfig { pause_ms: 100, max_pause_ms: 350, error_window_ms: 1000, ..Default::default() }
    }

    #[test]
    fn three_failures_in_the_window_pause() {
        let c = cfg();
        let mut h = PathHealth::new(&c);
        assert_eq!(h.failure(ms(0), &c), PathVerdict::Kept);
        assert_eq!(h.failure(ms(500), &c), PathVerdict::Kept);
        // The first one left the window: still two.
        assert_eq!(h.failure(ms(1200), &c), PathVerdict::Kept);
        assert_eq!(h.state(ms(1200)), PathState::Up);
        assert_eq!(h.failure(ms(1300), &c), PathVerdict::Paused(ms(100)));
        assert_eq!(h.state(ms(1350)), PathState::Paused);
        assert_eq!(h.room(ms(1350), &c), 0);
        // Late failures of work sent before the pause add nothing.
        assert_eq!(h.failure(ms(1360), &c), PathVerdict::Kept);
        assert_eq!(h.state(ms(1400)), PathState::Probation);
        assert_eq!(h.room(ms(1400), &c), 1);
        assert_eq!(h.pauses(), 1);
    }

    #[test]
    fn failed_probes_double_the_pause_up_to_the_cap_and_success_resets_it() {
        let c = cfg();
        let mut h = PathHealth::new(&c);
        for t in 0..3 {
            let _ = h.failure(ms(t), &c);
        }
        assert_eq!(h.failure(ms(200), &c), PathVerdict::Paused(ms(200)));
        assert_eq!(h.failure(ms(400), &c), PathVerdict::Paused(ms(350)), "capped at max_pause_ms");
        assert_eq!(h.failure(ms(750), &c), PathVerdict::Paused(ms(350)));
        assert!(!h.success(ms(800), &c), "still paused: a late success of old work takes nothing back");
        assert!(h.success(ms(1100), &c));
        assert_eq!(h.state(ms(1100)), PathState::Up);
        for t in 0..3 {
            let _ = h.failure(ms(2000 + t), &c);
        }
        assert_eq!(h.paused_until(ms(2002)), Some(ms(2102)), "back to the first pause");
        assert_eq!(h.pauses(), 5);
    }

    /// Issue 52: the near rails each region advertises survive the trip
    /// through a descriptor, are found by address, and a peer's malformed
    /// or oversized list is refused, never trusted.
    #[test]
    fn near_lists_round_trip_and_hostile_ones_are_refused() {
        let (l, over) = NearList::new(vec![(0x3000, 0x1000, 0b10), (0x1000, 0x1000, 0b01), (0x2000, 0x1000, 0b01)]);
        assert_eq!((l.len(), over), (2, 0), "touching ranges of one mask merged: {l:?}");
        let addr = format!("10.0.0.1:5000 gid=fe80 {} {}", RailList::default().format(), l.format());
        let back = NearList::parse(&addr, 2).unwrap();
        assert_eq!(back, l);
        assert_eq!((back.mask_at(0x1000), back.mask_at(0x2fff), back.mask_at(0x3000)), (1, 1, 2));
        assert_eq!((back.mask_at(0xfff), back.mask_at(0x4000)), (u32::MAX, u32::MAX), "outside: every rail");
        assert_eq!(NearList::parse("10.0.0.1:5000 rails(a,b)", 2).unwrap(), NearList::default());
        assert_eq!(NearList::new(Vec::new()).0.format(), "", "nothing to say: the address as before");
        let (capped, over) = NearList::new((0..MAX_NEAR as u64 + 5).map(|i| (i * 0x2000, 0x1000, 1)).collect());
        assert_eq!((capped.len(), over), (MAX_NEAR, 5));
        assert_eq!(NearList::parse(&capped.format(), 1).unwrap(), capped);
        let too_many = format!("near({})", vec!["0+1:1"; MAX_NEAR + 1].join(","));
        for bad in [
            "near(1000+1000:4)".to_owned(),          // rail 2 of 2
            "near(1000+1000:0)".to_owned(),          // no rail
            "near(1000+0:1)".to_owned(),             // empty
            "near(ffffffffffffffff+2:1)".to_owned(), // past the end
            "near(1000+1000:1,1800+10:2)".to_owned(),
            "near(1000+1000:1".to_owned(),
            "near(1000:1)".to_owned(),
            "near(x+1:1)".to_owned(),
            "near(1+1:100000000)".to_owned(),
            "near(00000000000000001+1:1)".to_owned(),
            too_many,
        ] {
            let e = NearList::parse(&bad, 2).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Protocol, "{bad}: {e}");
        }
    }

    #[test]
    fn rail_lists_round_trip_and_hostile_ones_are_refused() {
        let l =
            RailList { rails: vec!["10.0.0.1:5000".into(), "[::1]:5001".into()], tcp: Some("10.0.0.1:6000".into()) };
        let addr = format!("rxe0/1/gid=fe80 {}", l.format());
        assert_eq!(RailList::parse(&addr).unwrap(), Some(l));
        let one = RailList { rails: vec!["a:1".into()], tcp: None };
        assert_eq!(RailList::parse(&one.format()).unwrap(), Some(one));
        assert_eq!(RailList::parse("rxe0/1/gid=00").unwrap(), None);
        for bad in ["rails(a:1", "rails(a:1,,b:2)", "rails(a:1;udp=x)", "rails(a:1;tcp=)", "rails()"] {
            let e = RailList::parse(bad).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Protocol, "{bad}");
        }
        let many = format!("rails({})", vec!["h:1"; MAX_RAILS + 1].join(","));
        assert!(RailList::parse(&many).is_err());
    }

    #[test]
    fn pairings() {
        let none = |_| None;
        assert_eq!(pair(Pairing::Index, 2, 2, none, none).unwrap(), vec![(0, 0), (1, 1)]);
        assert_eq!(pair(Pairing::Index, 2, 3, none, none).unwrap(), vec![(0, 0), (1, 1), (0, 2)]);
        assert_eq!(pair(Pairing::Index, 1, 2, none, none).unwrap(), vec![(0, 0), (0, 1)]);
        assert_eq!(pair(Pairing::All, 2, 2, none, none).unwrap(), vec![(0, 0), (0, 1), (1, 0), (1, 1)]);
        let gid = |p: &str| format!("mlx5_{p}/1/gid={p}{}", "0".repeat(32 - p.len()));
        let local = |i: usize| Some(gid(["aa", "bb"][i]));
        let peer = |j: usize| Some(gid(["bb", "cc", "aa"][j]));
        assert_eq!(pair(Pairing::Subnet, 2, 3, local, peer).unwrap(), vec![(0, 2), (1, 0)]);
        let e = pair(Pairing::Subnet, 1, 1, |_| Some(gid("aa")), |_| Some(gid("cc"))).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(pair(Pairing::Index, 0, 1, none, none).is_err());
    }

    #[test]
    fn config_checks_name_the_field() {
        RailsConfig::default().validate().unwrap();
        let c = RailsConfig { chunk_bytes: 1, ..Default::default() };
        assert!(c.validate().unwrap_err().to_string().contains("chunk_bytes"));
        let c = RailsConfig { pause_ms: 10, max_pause_ms: 5, ..Default::default() };
        assert!(c.validate().unwrap_err().to_string().contains("pause_ms"));
    }
}
