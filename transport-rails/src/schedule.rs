//! What a batch's driver does under the lock: hand slices to the path with
//! the fewest bytes in flight ([`choose`]), and account for a finished
//! sub-batch (land its slices, or give them back for another path within
//! the bound of [`crate::paths::max_moves`]). No I/O: the driver sends.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::Duration;

use transport_core::lifecycle::{EndReason, Progress};
use transport_core::{
    BatchId, BatchStatus, Error, ErrorKind, RegionId, RequestStatus, Result, SegmentId, TransferRequest,
};

use crate::paths::{max_moves, NearList, PathState, PathVerdict, RailsConfig};
use crate::state::*;

impl Inner {
    /// Decides under the lock what a batch's driver does next: deadline
    /// and stop, then the sub-batches to hand out.
    pub(crate) fn step(
        &self,
        id: BatchId,
        reqs: &[TransferRequest],
        queue: &mut VecDeque<Slice>,
        mine: &mut HashMap<(SegmentId, usize), usize>,
        segs: usize,
    ) -> Option<Step> {
        let now = self.now();
        let mut st = self.state.lock();
        let st = &mut *st;
        let b = st.batches.get_mut(id).ok()?;
        let mut p = b.ledger.expire(now);
        let expired = b.ledger.deadline().is_some_and(|d| now >= d);
        let cancel = b.stop || expired;
        if cancel {
            p.merge(b.ledger.end_where(&EndReason::Cancelled, |_| true).1);
        }
        let mut plans = Vec::new();
        let mut keep = VecDeque::new();
        let mut blocked = HashSet::new();
        let timeout = b.ledger.deadline().map(|d| d.saturating_sub(now));
        while let Some(slice) = queue.pop_front() {
            if !b.ledger.is_live(slice.req) {
                continue; // decided (cancelled, closed, unregistered, failed): dropped
            }
            let seg_id = reqs[slice.req].segment;
            if blocked.contains(&seg_id) {
                keep.push_back(slice);
                continue;
            }
            let Some(seg) = st.segments.get_mut(&seg_id) else {
                keep.push_back(slice);
                continue;
            };
            let near = wants(&st.regions, &seg.peer_near, &reqs[slice.req], &slice);
            match choose(seg, seg_id, mine, now, &self.cfg, near) {
                Choice::Path(pi) => {
                    let path = &mut seg.paths[pi];
                    let k = path.k;
                    let max = self.max_batch[k];
                    let mut sub = Sub { seg: seg_id, path: pi, k, slices: Vec::new(), bytes: 0 };
                    let mut requests = Vec::new();
                    let mut next = Some(slice);
                    while let Some(mut s) = next.take() {
                        if !b.ledger.is_live(s.req) {
                            next = pop_for(queue, seg_id, reqs, &st.regions, &seg.peer_near, near); // decided: dropped whole
                            continue;
                        }
                        if s.len > self.cfg.slice_size {
                            let rest = Slice {
                                req: s.req,
                                off: s.off + self.cfg.slice_size,
                                len: s.len - self.cfg.slice_size,
                                tries: 0,
                            };
                            s.len = self.cfg.slice_size;
                            queue.push_front(rest);
                        }
                        let r = &reqs[s.req];
                        let Some(region) = st.regions.get(&r.local) else {
                            // Unregistered since: the request was decided.
                            next = pop_for(queue, seg_id, reqs, &st.regions, &seg.peer_near, near);
                            continue;
                        };
                        if !b.ledger.start(s.req) {
                            next = pop_for(queue, seg_id, reqs, &st.regions, &seg.peer_near, near);
                            continue;
                        }
                        requests.push(TransferRequest {
                            op: r.op,
                            local: region.ids[k],
                            local_offset: r.local_offset + s.off,
                            segment: path.seg,
                            remote_addr: r.remote_addr + s.off,
                            len: s.len,
                        });
                        sub.bytes += s.len;
                        sub.slices.push(s);
                        if sub.bytes >= self.cfg.chunk_bytes || requests.len() >= max {
                            break;
                        }
                        next = pop_for(queue, seg_id, reqs, &st.regions, &seg.peer_near, near);
                    }
                    if sub.slices.is_empty() {
                        continue;
                    }
                    path.subs += 1;
                    path.inflight += sub.bytes;
                    *mine.entry((seg_id, pi)).or_default() += 1;
                    plans.push(Plan { sub, requests, timeout });
                }
                Choice::Wait => {
                    keep.push_back(slice);
                    blocked.insert(seg_id);
                    if blocked.len() >= segs {
                        break; // every segment waits: leave the rest queued as it is
                    }
                }
                Choice::None(why) => {
                    p.merge(b.ledger.end(slice.req, EndReason::Failed(why)));
                }
            }
        }
        while let Some(s) = keep.pop_back() {
            queue.push_front(s);
        }
        let terminal = b.ledger.is_terminal();
        if p.batch_terminal {
            b.done.notify_waiters();
        }
        if p.finished > 0 {
            self.settled.notify_waiters();
        }
        Some(Step { plans, terminal, cancel })
    }

    /// Accounts for a finished (or refused) sub-batch.
    pub(crate) fn finish(
        &self,
        id: BatchId,
        sub: Sub,
        outcome: Result<BatchStatus>,
        queue: &mut VecDeque<Slice>,
        mine: &mut HashMap<(SegmentId, usize), usize>,
    ) {
        let now = self.now();
        let mut st = self.state.lock();
        let st = &mut *st;
        if let Some(n) = mine.get_mut(&(sub.seg, sub.path)) {
            *n = n.saturating_sub(1);
        }
        let mut path = st.segments.get_mut(&sub.seg).and_then(|s| s.paths.get_mut(sub.path));
        if let Some(p) = path.as_deref_mut() {
            p.subs = p.subs.saturating_sub(1);
            p.inflight = p.inflight.saturating_sub(sub.bytes);
        }
        let label = path.as_deref().map(|p| self.label(p)).unwrap_or_default();
        let Ok(b) = st.batches.get_mut(id) else { return };
        let max_tries = max_moves(st.segments.get(&sub.seg).map_or(1, |s| s.paths.len()));
        let mut progress = Progress::default();
        let mut failed: Option<Error> = None;
        let mut moved = 0;
        let mut reposted = 0usize;
        let statuses: Vec<std::result::Result<RequestStatus, Error>> = match outcome {
            Ok(status) if status.requests.len() == sub.slices.len() => status.requests.into_iter().map(Ok).collect(),
            Ok(_) => {
                vec![Err(Error::new(ErrorKind::Internal, "a rail answered for a different batch")); sub.slices.len()]
            }
            Err(e) => vec![Err(e); sub.slices.len()],
        };
        if tracing::enabled!(tracing::Level::TRACE) {
            for (s, rs) in sub.slices.iter().zip(&statuses) {
                tracing::trace!(path = %label, req = s.req, off = s.off, len = s.len, outcome = ?rs, "rails: slice outcome");
            }
        }
        for (mut s, rs) in sub.slices.into_iter().zip(statuses) {
            let e = match rs {
                Ok(RequestStatus::Completed) => {
                    moved += s.len;
                    progress.merge(b.ledger.unit_done(s.req, Ok(())));
                    continue;
                }
                // Every cancel of ours (cancel, close, shutdown) decides the
                // request before a rail sees it: a rail that cancelled a
                // live one did it by itself (it shut down), so it fails over.
                Ok(RequestStatus::Cancelled) if b.ledger.is_live(s.req) => {
                    Error::new(ErrorKind::Shutdown, "the rail ended the work by itself (it shut down)")
                }
                Ok(RequestStatus::Cancelled) => {
                    progress.merge(b.ledger.unit_back(s.req));
                    continue;
                }
                Ok(RequestStatus::TimedOut) => {
                    progress.merge(b.ledger.end(s.req, EndReason::TimedOut));
                    progress.merge(b.ledger.unit_back(s.req));
                    continue;
                }
                Ok(RequestStatus::Failed(e)) | Err(e) => e,
                Ok(RequestStatus::Pending) => {
                    Error::new(ErrorKind::Internal, "a rail reported a pending request as final")
                }
            };
            let e = e.with("path", &label);
            if transient_path_failure(&e) {
                failed = Some(e.clone());
                if b.ledger.is_live(s.req) && s.tries < max_tries {
                    s.tries += 1;
                    progress.merge(b.ledger.unit_back(s.req));
                    queue.push_front(s);
                    reposted += 1;
                    continue;
                }
            }
            progress.merge(b.ledger.unit_done(s.req, Err(e)));
        }
        // Pausing the last path that is up (with no fallback) helps no one:
        // every path failing at once is the peer or the whole network,
        // which the policy layer's breaker handles, not a rail.
        let last = st.segments.get(&sub.seg).is_some_and(|s| {
            !s.paths.iter().any(|p| p.fallback)
                && !s.paths.iter().enumerate().any(|(i, p)| i != sub.path && p.health.state(now) == PathState::Up)
        });
        if let Some(e) = &failed {
            tracing::debug!(path = %label, reposted, error = %e, "rails: a sub-batch failed on its path");
        }
        if let Some(p) = st.segments.get_mut(&sub.seg).and_then(|s| s.paths.get_mut(sub.path)) {
            p.bytes += moved;
            match failed {
                Some(_) if last && p.health.state(now) == PathState::Up => p.failures += 1,
                Some(e) => {
                    p.failures += 1;
                    if let PathVerdict::Paused(d) = p.health.failure(now, &self.cfg) {
                        rail_event("paused");
                        tracing::warn!(path = %label, pause_ms = d.as_millis() as u64, error = %e, "rail path paused");
                    }
                }
                None if moved > 0 && p.health.success(now, &self.cfg) => {
                    rail_event("resumed");
                    tracing::info!(path = %label, "rail path back after its pause");
                }
                _ => {}
            }
        }
        if progress.batch_terminal {
            b.done.notify_waiters();
        }
        if progress.finished > 0 {
            self.settled.notify_waiters();
        }
    }
}

/// The rails a slice keeps to, on either end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Near {
    /// Ours nearest its local memory (bit `k`: rail `k`).
    pub(crate) local: u32,
    /// The peer's nearest its remote memory (bit `j`: the peer's rail `j`),
    /// as the peer's descriptor says ([`NearList`]).
    pub(crate) peer: u32,
}

impl Near {
    /// Every rail on both ends.
    #[cfg(test)]
    pub(crate) const ANY: Near = Near { local: u32::MAX, peer: u32::MAX };

    #[cfg(test)]
    pub(crate) fn local(local: u32) -> Near {
        Near { local, peer: u32::MAX }
    }
}

/// The next queued slice when it goes to the same segment over the same
/// rails (its [`wants`] are `near`): one sub-batch carries it too.
pub(crate) fn pop_for(
    queue: &mut VecDeque<Slice>,
    seg: SegmentId,
    reqs: &[TransferRequest],
    regions: &BTreeMap<RegionId, Region>,
    peer_near: &NearList,
    near: Near,
) -> Option<Slice> {
    match queue.front() {
        Some(s) if reqs[s.req].segment == seg && wants(regions, peer_near, &reqs[s.req], s) == near => {
            queue.pop_front()
        }
        _ => None,
    }
}

/// The rails a slice of `req` keeps to: on our side those nearest its
/// local region (every rail for a region registered without a topology,
/// or unregistered since), on the peer's those its descriptor names for
/// the remote memory at the slice (every rail where it names none).
pub(crate) fn wants(
    regions: &BTreeMap<RegionId, Region>,
    peer_near: &NearList,
    req: &TransferRequest,
    slice: &Slice,
) -> Near {
    Near {
        local: regions.get(&req.local).map_or(u32::MAX, |r| r.near),
        peer: peer_near.mask_at(req.remote_addr.saturating_add(slice.off)),
    }
}

pub(crate) enum Choice {
    Path(usize),
    Wait,
    None(Error),
}

/// The path for the next sub-batch of a batch to `seg`: a path on
/// probation (one sub-batch at a time: its probe), else the RDMA path with
/// room and the fewest bytes in flight while any is up, else the fallback.
/// Only among the paths near the memory while any of them is up: those
/// from a rail in `near.local` to a peer rail in `near.peer` first, else
/// those from a rail in `near.local`, else those to a peer rail in
/// `near.peer`. A region's bytes keep to the rails nearest its memory
/// (waiting for room on them), and take the others only while those are
/// down (paused, or on probation after a pause).
pub(crate) fn choose(
    seg: &Seg,
    id: SegmentId,
    mine: &HashMap<(SegmentId, usize), usize>,
    now: Duration,
    cfg: &RailsConfig,
    near: Near,
) -> Choice {
    let bit = |k: usize| u32::try_from(k).ok().and_then(|k| 1u32.checked_shl(k)).unwrap_or(0);
    let ours = |p: &Path| !p.fallback && near.local & bit(p.k) != 0;
    let theirs = |p: &Path| !p.fallback && p.peer.is_some_and(|j| near.peer & bit(j) != 0);
    let both = |p: &Path| ours(p) && theirs(p);
    let tiers: [&dyn Fn(&Path) -> bool; 3] = [&both, &ours, &theirs];
    let tier = tiers.into_iter().find(|t| seg.paths.iter().any(|p| t(p) && p.health.state(now) == PathState::Up));
    let allowed = |p: &Path| tier.is_none_or(|t| t(p));
    let room = |i: usize, p: &Path| {
        let mine = mine.get(&(id, i)).copied().unwrap_or(0);
        match p.health.state(now) {
            PathState::Up => mine < cfg.subs_per_path,
            PathState::Probation => p.subs == 0,
            PathState::Paused => false,
        }
    };
    let best = |pick: &dyn Fn(&Path) -> bool| {
        seg.paths
            .iter()
            .enumerate()
            .filter(|(i, p)| allowed(p) && pick(p) && room(*i, p))
            .min_by_key(|(_, p)| p.inflight)
            .map(|(i, _)| i)
    };
    // A path back from its pause gets one sub-batch, its probe, first.
    let probation = |p: &Path| !p.fallback && p.health.state(now) == PathState::Probation;
    if let Some(i) = best(&probation) {
        return Choice::Path(i);
    }
    let up = |p: &Path| !p.fallback && p.health.state(now) == PathState::Up;
    if seg.paths.iter().any(|p| allowed(p) && up(p)) {
        return best(&up).map_or(Choice::Wait, Choice::Path);
    }
    let fallback = |p: &Path| p.fallback && p.health.state(now) != PathState::Paused;
    if seg.paths.iter().any(fallback) {
        if let Some(i) = best(&fallback) {
            if seg.paths[i].subs == 0 && seg.paths[i].bytes == 0 {
                rail_event("fallback");
                tracing::warn!(peer = %seg.name, "every RDMA path to the peer is down: moving over the TCP fallback");
            }
            return Choice::Path(i);
        }
        return Choice::Wait;
    }
    if seg.paths.iter().any(|p| p.health.state(now) != PathState::Paused) {
        return Choice::Wait; // a probe is out
    }
    let next = seg.paths.iter().filter_map(|p| p.health.paused_until(now)).min().unwrap_or(now);
    Choice::None(
        Error::new(
            ErrorKind::ConnectionReset,
            format!(
                "every path to {} is paused after failures (the next is tried again in {} ms)",
                seg.name,
                next.saturating_sub(now).as_millis()
            ),
        )
        .with("segment", id),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::paths::PathHealth;

    fn path(k: usize, fallback: bool, cfg: &RailsConfig) -> Path {
        Path {
            k,
            peer: (!fallback).then_some(k),
            seg: SegmentId(k as u64 + 10),
            fallback,
            health: PathHealth::new(cfg),
            subs: 0,
            inflight: 0,
            bytes: 0,
            failures: 0,
        }
    }

    fn seg(paths: Vec<Path>) -> Seg {
        Seg {
            name: "peer".into(),
            control: SegmentId(1),
            paths,
            closing: false,
            refreshing: false,
            peer_near: NearList::default(),
            peer_address: String::new(),
        }
    }

    fn pause(p: &mut Path, now: Duration, cfg: &RailsConfig) {
        for _ in 0..cfg.pause_after_errors {
            let _ = p.health.failure(now, cfg);
        }
    }

    fn picked(c: Choice) -> Option<usize> {
        match c {
            Choice::Path(i) => Some(i),
            Choice::Wait => None,
            Choice::None(e) => panic!("nothing usable: {e}"),
        }
    }

    #[test]
    fn the_least_loaded_up_path_with_room_is_chosen_and_the_fallback_idles() {
        let cfg = RailsConfig { subs_per_path: 1, ..RailsConfig::default() };
        let id = SegmentId(5);
        let mut s = seg(vec![path(0, false, &cfg), path(1, false, &cfg), path(2, true, &cfg)]);
        let now = Duration::from_secs(1);
        let mut mine = HashMap::new();
        s.paths[0].inflight = 10;
        assert_eq!(picked(choose(&s, id, &mine, now, &cfg, Near::ANY)), Some(1));
        mine.insert((id, 1), 1);
        assert_eq!(picked(choose(&s, id, &mine, now, &cfg, Near::ANY)), Some(0));
        mine.insert((id, 0), 1);
        assert_eq!(picked(choose(&s, id, &mine, now, &cfg, Near::ANY)), None, "both full: wait, never the fallback");
    }

    #[test]
    fn a_probe_goes_first_and_the_fallback_only_while_no_rail_is_up() {
        let cfg = RailsConfig { pause_ms: 100, ..RailsConfig::default() };
        let id = SegmentId(5);
        let mut s = seg(vec![path(0, false, &cfg), path(1, false, &cfg), path(2, true, &cfg)]);
        let t0 = Duration::from_secs(1);
        let mine = HashMap::new();
        pause(&mut s.paths[0], t0, &cfg);
        assert_eq!(picked(choose(&s, id, &mine, t0, &cfg, Near::ANY)), Some(1), "paused: skipped");
        pause(&mut s.paths[1], t0, &cfg);
        assert_eq!(picked(choose(&s, id, &mine, t0, &cfg, Near::ANY)), Some(2), "no rail up: the fallback");
        let later = t0 + Duration::from_millis(150);
        assert_eq!(
            picked(choose(&s, id, &mine, later, &cfg, Near::ANY)),
            Some(0),
            "back from its pause: the probe first"
        );
        s.paths[0].subs = 1;
        s.paths[1].subs = 1;
        assert_eq!(
            picked(choose(&s, id, &mine, later, &cfg, Near::ANY)),
            Some(2),
            "probes out: the rest over the fallback"
        );
        let _ = s.paths[1].health.success(later, &cfg);
        s.paths[1].subs = 0;
        assert_eq!(picked(choose(&s, id, &mine, later, &cfg, Near::ANY)), Some(1), "a rail is back: off the fallback");
    }

    #[test]
    fn a_region_keeps_to_its_near_rails_while_one_is_up() {
        let cfg = RailsConfig { subs_per_path: 1, pause_ms: 100, ..RailsConfig::default() };
        let id = SegmentId(5);
        let mut s = seg(vec![path(0, false, &cfg), path(1, false, &cfg), path(2, true, &cfg)]);
        let t0 = Duration::from_secs(1);
        let mut mine = HashMap::new();
        let near = 0b10; // rail 1 only
        s.paths[1].inflight = 1 << 20;
        assert_eq!(picked(choose(&s, id, &mine, t0, &cfg, Near::local(near))), Some(1), "the near rail, though busier");
        assert_eq!(picked(choose(&s, id, &mine, t0, &cfg, Near::ANY)), Some(0), "without a topology: the least loaded");
        mine.insert((id, 1), 1);
        assert_eq!(
            picked(choose(&s, id, &mine, t0, &cfg, Near::local(near))),
            None,
            "the near rail full: wait, never the far one"
        );
        mine.clear();
        pause(&mut s.paths[1], t0, &cfg);
        assert_eq!(
            picked(choose(&s, id, &mine, t0, &cfg, Near::local(near))),
            Some(0),
            "the near rail down: the far one"
        );
        pause(&mut s.paths[0], t0, &cfg);
        assert_eq!(
            picked(choose(&s, id, &mine, t0, &cfg, Near::local(near))),
            Some(2),
            "every rail down: the fallback"
        );
        let later = t0 + Duration::from_millis(150);
        let _ = s.paths[0].health.success(later, &cfg);
        assert_eq!(
            picked(choose(&s, id, &mine, later, &cfg, Near::local(near))),
            Some(1),
            "back from its pause: its probe"
        );
        s.paths[1].subs = 1;
        assert_eq!(
            picked(choose(&s, id, &mine, later, &cfg, Near::local(near))),
            Some(0),
            "its probe out: the far rail meanwhile"
        );
        s.paths[1].subs = 0;
        let _ = s.paths[1].health.success(later, &cfg);
        assert_eq!(
            picked(choose(&s, id, &mine, later, &cfg, Near::local(near))),
            Some(1),
            "probed: back on the near rail"
        );
    }

    /// Issue 52: with every local rail paired with every peer rail, a
    /// slice goes over the path from the rail nearest its local memory to
    /// the peer's rail nearest its remote memory; without such a path up,
    /// over one from the near local rail, then one to the near peer rail.
    #[test]
    fn a_slice_goes_from_the_rail_near_its_source_to_the_peer_rail_near_its_destination() {
        let cfg = RailsConfig { pause_ms: 100, ..RailsConfig::default() };
        let id = SegmentId(5);
        let mut paths = Vec::new();
        for (k, j) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
            let mut p = path(k, false, &cfg);
            p.peer = Some(j);
            paths.push(p);
        }
        let mut s = seg(paths);
        let t0 = Duration::from_secs(1);
        let mine = HashMap::new();
        let near = Near { local: 0b01, peer: 0b10 };
        s.paths[1].inflight = 1 << 20;
        assert_eq!(
            picked(choose(&s, id, &mine, t0, &cfg, near)),
            Some(1),
            "rail 0 to the peer's rail 1, though busiest"
        );
        assert_eq!(picked(choose(&s, id, &mine, t0, &cfg, Near::local(0b01))), Some(0), "the peer's side unknown");
        let theirs = Near { local: u32::MAX, peer: 0b01 };
        s.paths[2].inflight = 1;
        assert_eq!(picked(choose(&s, id, &mine, t0, &cfg, theirs)), Some(0), "our side unknown: to the peer's rail 0");
        pause(&mut s.paths[1], t0, &cfg);
        assert_eq!(picked(choose(&s, id, &mine, t0, &cfg, near)), Some(0), "that path down: from our near rail");
        pause(&mut s.paths[0], t0, &cfg);
        assert_eq!(picked(choose(&s, id, &mine, t0, &cfg, near)), Some(3), "our near rail down: to their near rail");
        pause(&mut s.paths[3], t0, &cfg);
        assert_eq!(picked(choose(&s, id, &mine, t0, &cfg, near)), Some(2), "only the far path left");
    }

    #[test]
    fn every_path_paused_without_a_fallback_is_a_transient_error() {
        let cfg = RailsConfig::default();
        let mut s = seg(vec![path(0, false, &cfg)]);
        let now = Duration::from_secs(1);
        pause(&mut s.paths[0], now, &cfg);
        match choose(&s, SegmentId(5), &HashMap::new(), now, &cfg, Near::ANY) {
            Choice::None(e) => assert!(e.is_transient(), "{e}"),
            _ => panic!("a paused path was chosen"),
        }
    }

    /// What happens to paths between two choices, drawn at random.
    #[derive(Debug, Clone)]
    enum Event {
        /// Time passes (ms).
        Wait(u64),
        /// A sub-batch on path `i` fails / succeeds (and leaves it).
        Fail(usize),
        Succeed(usize),
        /// The batch asks for a path and sends a sub-batch of `bytes` on it.
        Choose(u64),
    }

    fn event() -> impl proptest::strategy::Strategy<Value = Event> {
        use proptest::prelude::*;
        prop_oneof![
            (0u64..400).prop_map(Event::Wait),
            (0usize..4).prop_map(Event::Fail),
            (0usize..4).prop_map(Event::Succeed),
            (1u64..(1 << 20)).prop_map(Event::Choose),
        ]
    }

    proptest::proptest! {
        /// Whatever happens to the paths, what `choose` picks keeps the
        /// rules: never a paused path; never more sub-batches of one batch
        /// on a path than `subs_per_path`, one at a time on probation; the
        /// fallback never while a rail is up; a probe before any up rail;
        /// among up rails the least loaded with room; no path at all (an
        /// error) only when every path is paused; waiting only when nothing
        /// eligible has room.
        #[test]
        fn choices_keep_the_rules_whatever_the_paths_do(
            rails in 1usize..4,
            fallback in proptest::bool::ANY,
            events in proptest::collection::vec(event(), 1..120),
        ) {
            let cfg = RailsConfig {
                subs_per_path: 2,
                pause_after_errors: 2,
                pause_ms: 100,
                max_pause_ms: 400,
                ..RailsConfig::default()
            };
            let id = SegmentId(5);
            let mut paths: Vec<Path> = (0..rails).map(|k| path(k, false, &cfg)).collect();
            if fallback {
                paths.push(path(rails, true, &cfg));
            }
            let mut s = seg(paths);
            let n = s.paths.len();
            let mut mine: HashMap<(SegmentId, usize), usize> = HashMap::new();
            let mut now = Duration::from_secs(1);
            for e in events {
                match e {
                    Event::Wait(ms) => now += Duration::from_millis(ms),
                    Event::Fail(i) | Event::Succeed(i) => {
                        let i = i % n;
                        let p = &mut s.paths[i];
                        if p.subs > 0 {
                            p.subs -= 1;
                            p.inflight = p.inflight.saturating_sub(1 << 20);
                            if let Some(m) = mine.get_mut(&(id, i)) {
                                *m = m.saturating_sub(1);
                            }
                        }
                        if matches!(e, Event::Fail(_)) {
                            let _ = p.health.failure(now, &cfg);
                        } else {
                            let _ = p.health.success(now, &cfg);
                        }
                    }
                    Event::Choose(bytes) => {
                        let state = |p: &Path| p.health.state(now);
                        let has_room = |i: usize, p: &Path| match state(p) {
                            PathState::Up => mine.get(&(id, i)).copied().unwrap_or(0) < cfg.subs_per_path,
                            PathState::Probation => p.subs == 0,
                            PathState::Paused => false,
                        };
                        let rail_up = s.paths.iter().any(|p| !p.fallback && state(p) == PathState::Up);
                        match choose(&s, id, &mine, now, &cfg, Near::ANY) {
                            Choice::Path(i) => {
                                let p = &s.paths[i];
                                proptest::prop_assert!(state(p) != PathState::Paused, "a paused path was chosen");
                                proptest::prop_assert!(has_room(i, p), "path {} had no room", i);
                                proptest::prop_assert!(!(p.fallback && rail_up), "the fallback while a rail is up");
                                if !p.fallback && state(p) == PathState::Up {
                                    let probe_waiting = s.paths.iter().enumerate().any(|(j, q)| {
                                        !q.fallback && state(q) == PathState::Probation && has_room(j, q)
                                    });
                                    proptest::prop_assert!(!probe_waiting, "a probe was due first");
                                    let least = s
                                        .paths
                                        .iter()
                                        .enumerate()
                                        .filter(|(j, q)| !q.fallback && state(q) == PathState::Up && has_room(*j, q))
                                        .map(|(_, q)| q.inflight)
                                        .min();
                                    proptest::prop_assert_eq!(Some(p.inflight), least, "not the least loaded");
                                }
                                let p = &mut s.paths[i];
                                p.subs += 1;
                                p.inflight += bytes;
                                *mine.entry((id, i)).or_default() += 1;
                            }
                            Choice::Wait => {
                                let eligible = s.paths.iter().enumerate().any(|(j, q)| {
                                    has_room(j, q) && (!q.fallback || !rail_up)
                                });
                                proptest::prop_assert!(!eligible, "waited with an eligible path free");
                                proptest::prop_assert!(s.paths.iter().any(|q| state(q) != PathState::Paused));
                            }
                            Choice::None(e) => {
                                proptest::prop_assert!(e.is_transient());
                                proptest::prop_assert!(
                                    s.paths.iter().all(|q| state(q) == PathState::Paused),
                                    "gave up with a path not paused"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
