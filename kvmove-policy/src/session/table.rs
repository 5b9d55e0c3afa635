//! The session table: both roles of every session of one engine, as a
//! sans-IO state machine. The driver feeds it calls, received messages and
//! the time; it answers with decisions, messages to send
//! ([`SessionTable::drain_outgoing`]) and actions
//! ([`SessionTable::drain_actions`]).
//!
//! # The protocol (rules 12 and 13)
//!
//! The receiver is the arbiter: it alone decides the final outcome, and the
//! sender adopts it.
//!
//! ```text
//! sender (prefill)                         receiver (decode)
//! expect(peer, id)  Waiting
//!                            <- GRANT      grant(...)  Granted (deadline starts)
//! Granted
//! write ... (checked against the grant)
//! Transferring
//! finish()          -> FINISH(bytes)       bytes == expected: Landed
//!                            <- END(Landed)
//! Landed
//! ```
//!
//! - Cancel by the sender: it stops its writes, and once they are quiet
//!   sends CANCEL; the receiver ends the session (Cancelled, or whatever it
//!   had decided first) and answers END.
//! - Cancel, expiry or failure decided by the receiver: END(outcome) to the
//!   sender, which stops its writes and, once quiet, answers QUIET; only
//!   then is the receiver's state final, so a receiver that sees a final
//!   state knows no write of the session can land any more ("terminal
//!   means quiet", for sessions).
//! - A sender's state is final only once none of its writes is in flight.
//! - Liveness: while a peer has open sessions, heartbeats go to it every
//!   `heartbeat_interval` (asking for a reply); every message from it
//!   counts as heard. Silent for `liveness_timeout`: its open sessions
//!   fail (`PeerUnavailable`); a new epoch from it (a restart): they fail
//!   (`PeerRestarted`).
//! - Pauses: time this side did not run (no tick, message or call for a
//!   quarter of the liveness timeout or more, where the driver ticks many
//!   times as often: the process was stopped, starved or swapped out) is
//!   not its peers' silence; each peer's silence is credited with the gap,
//!   and the judgements of the next tick wait, so what they sent meanwhile
//!   is read before they are judged.
//! - A sender that finished (FINISH sent) and then loses its receiver does
//!   not know the outcome: the receiver may have decided `landed` before
//!   it went silent. It ends `Failed` with [`ErrorKind::OutcomeUnknown`],
//!   never with a plain failure the receiver could contradict.
//! - A receiver that paused while a session was open does not land it
//!   alone: the sender may have given up on it meanwhile. On the FINISH it
//!   asks first (CHECK); the sender answers CONFIRM(open) while it waits
//!   for the decision (and counts the deadline's grace from its answer),
//!   or CONFIRM(closed) once it has ended the session; closed, no answer
//!   within the liveness timeout, or [`MAX_CHECKS`] pauses while asking:
//!   the receiver fails the session instead of landing it.
//! - A sender that paused while a session was open does not write again
//!   before it asks the same (CHECK from the sender,
//!   [`SessionTable::confirm_before_write`]): the receiver may have taken
//!   its silence for death and ended the session, and its memory is no
//!   longer the sender's to write. Closed, or no answer within the liveness
//!   timeout: the sender fails the session.
//! - Late, duplicate, forged or malformed messages are ignored or answered
//!   with the final outcome again; no message moves a state backwards.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Duration;

use super::wire::{decode, grant_messages, Body, Grant, Message, Outcome, Verdict, MAX_GRANT_RANGES, MAX_REASON};
use transport_core::{Error, ErrorKind, Result};

use super::types::{Action, Outgoing, Role, SessionCounts, SessionKey, SessionLimits, SessionState};

#[derive(Debug, Clone, PartialEq, Eq)]
enum Phase {
    Open,
    /// Sender: FINISH sent, waiting for END.
    Finishing,
    /// Sender: cancel asked; CANCEL goes once writes are quiet.
    Cancelling(Verdict),
    /// Sender: CANCEL sent, waiting for END.
    CancelSent,
    /// Sender: END adopted, waiting for writes to be quiet (then QUIET).
    /// Receiver: END sent, waiting for QUIET (or CANCEL) from the sender.
    Closing(Verdict),
    /// Receiver: the FINISH came while in doubt (this side paused with the
    /// session open); CHECK sent (`Session::checking`), waiting for CONFIRM.
    Confirming,
    Final,
}

#[derive(Debug)]
struct Session {
    state: SessionState,
    phase: Phase,
    grant: Option<Grant>,
    /// Sender: the granted memory as sorted, disjoint `(start, end)`
    /// intervals (the union of the grant's ranges), for checking writes
    /// against a grant of many ranges in logarithmic time.
    bounds: GrantBounds,
    deadline: Option<Duration>,
    written: u64,
    writes: u32,
    final_at: Option<Duration>,
    created: Duration,
    /// This side paused while the session was open, so the peer may have
    /// given up on it by its clock: a receiver confirms a FINISH with the
    /// sender (CHECK) before it decides `Landed`; a sender confirms the
    /// session before it writes again.
    doubt: bool,
    /// CHECK sent at this time, no answer yet (a sender's writes wait, a
    /// receiver is `Confirming`).
    checking: Option<Duration>,
    /// CHECKs sent, at most [`MAX_CHECKS`].
    checks: u8,
    /// Receiver: CHECKs sent by `probe_after_pause` not answered yet (their
    /// answers come first, before that of a FINISH's question).
    probes: u8,
    /// Sender: the receiver's CHECKs answered `open` that extended the
    /// grace, at most [`MAX_CHECKS`].
    answers: u8,
    /// Sender: when it last answered a CHECK with `open` (the receiver was
    /// alive then and deciding: the deadline's grace counts from here).
    answered: Option<Duration>,
    /// The state or grant changed since the driver last asked.
    dirty: bool,
    /// Sender: granted before any local `expect` (not claimed yet).
    unclaimed: bool,
}

/// The GRANT_MORE parts of a grant received so far (the GRANT with its
/// last ranges comes after them).
#[derive(Debug)]
struct PartialGrant {
    parts: u16,
    got: u16,
    ranges: Vec<(u64, u64)>,
    /// The last part came at this time (moved on by this side's pauses).
    last: Duration,
    /// Why the grant cannot be used (a part missing or out of order, too
    /// many ranges): its GRANT is refused.
    broken: Option<Error>,
}

#[derive(Debug)]
struct Peer {
    epoch: Option<u64>,
    heard: Duration,
    beat: Option<Duration>,
}

/// Both roles of every session of one engine. Not synchronised: the driver
/// keeps it behind a lock.
#[derive(Debug)]
pub struct SessionTable {
    limits: SessionLimits,
    epoch: u64,
    sessions: HashMap<SessionKey, Session>,
    peers: HashMap<String, Peer>,
    out: Vec<Outgoing>,
    actions: Vec<Action>,
    ignored: u64,
    /// Peers without sessions here whose heartbeats were answered, and when
    /// (a sender waiting for a grant learns from the answers that this
    /// side's session engine is alive). Bounded: [`MAX_STRANGERS`].
    strangers: HashMap<String, Duration>,
    /// Sender sessions released after they ended without a grant, and
    /// receiver sessions released, with when: a late GRANT for a sender's
    /// is refused (as a lingering one's is), so the receiver frees its
    /// memory at once instead of holding an unclaimed grant until the
    /// deadline; a late FINISH for a receiver's is answered (outcome
    /// unknown), so the sender does not wait out its deadline. Kept for
    /// `linger`, at most `max_lingering`.
    released: VecDeque<(SessionKey, Duration)>,
    released_set: HashSet<SessionKey>,
    /// When this side last ran (a tick, a message read, a call), to notice
    /// its own pauses.
    last_ran: Option<Duration>,
    /// A pause was noticed since the last tick: its judgements wait one
    /// tick, for what the peers sent meanwhile to be read.
    just_paused: bool,
    /// Pauses noticed so far.
    pauses: u64,
    /// Grants arriving in parts, by the sender's key. Bounded like
    /// unclaimed grants (`max_unclaimed`, `max_unclaimed_per_peer`), and
    /// [`MAX_PARTIAL_RANGES`] ranges in all.
    partial: HashMap<SessionKey, PartialGrant>,
}

/// Ranges held by grants still arriving in parts, all peers together (16
/// bytes each: 4 MiB).
pub const MAX_PARTIAL_RANGES: usize = 4 * MAX_GRANT_RANGES;

/// Peers without sessions whose heartbeats are answered, at most; an answer
/// goes at most once per heartbeat interval to each, so a claimed name can
/// make this side send one small message per interval, to a bounded set.
pub const MAX_STRANGERS: usize = 256;

/// CHECKs one session sends at most (one per pause while it confirms),
/// and a sender's answers that extend its grace; a side that paused this
/// often while confirming fails the session.
pub const MAX_CHECKS: u8 = 4;

fn table_full(what: &str) -> Error {
    Error::new(ErrorKind::ResourceExhausted, format!("session table full: {what}"))
}

/// A grant's memory as sorted, disjoint `(start, end)` intervals (the
/// union of its ranges, overlapping and touching ones merged): what every
/// write is checked against, in logarithmic time. The session table keeps
/// one per sender session; a binding that checks before it calls the table
/// (to raise at once) uses the same.
#[derive(Debug, Clone, Default)]
pub struct GrantBounds(Vec<(u64, u64)>);

impl GrantBounds {
    pub fn new(ranges: &[(u64, u64)]) -> Self {
        let mut v: Vec<(u64, u64)> =
            ranges.iter().filter(|r| r.1 > 0).filter_map(|&(a, l)| a.checked_add(l).map(|e| (a, e))).collect();
        v.sort_unstable();
        let mut out: Vec<(u64, u64)> = Vec::with_capacity(v.len());
        for (a, e) in v {
            match out.last_mut() {
                Some(last) if a <= last.1 => last.1 = last.1.max(e),
                _ => out.push((a, e)),
            }
        }
        Self(out)
    }

    /// `Ok` when every `(addr, len)` is non-empty and inside the granted
    /// memory; else `OutOfBounds` naming the first request that is not.
    pub fn check(&self, ranges: &[(u64, u64)]) -> Result<()> {
        for (i, &(a, l)) in ranges.iter().enumerate() {
            let inside = a.checked_add(l).is_some_and(|end| {
                // The last interval starting at or before `a` is the only
                // one that can hold it (they are disjoint and sorted).
                let at = self.0.partition_point(|&(start, _)| start <= a);
                l > 0 && at > 0 && self.0.get(at - 1).is_some_and(|&(_, e)| end <= e)
            });
            if !inside {
                return Err(Error::new(ErrorKind::OutOfBounds, "write outside the grant")
                    .with("request", i)
                    .with("addr", a)
                    .with("len", l));
            }
        }
        Ok(())
    }
}

fn verdict(outcome: Outcome, kind: ErrorKind, reason: impl Into<String>) -> Verdict {
    let mut reason = reason.into();
    if reason.len() > MAX_REASON {
        let mut cut = MAX_REASON;
        while !reason.is_char_boundary(cut) {
            cut -= 1;
        }
        reason.truncate(cut);
    }
    Verdict { outcome, kind, reason }
}

/// A sender's end when it cannot learn the receiver's decision after its
/// FINISH: `Failed` with [`ErrorKind::OutcomeUnknown`].
fn unknown_outcome(why: &str) -> Verdict {
    verdict(Outcome::Failed, ErrorKind::OutcomeUnknown, format!("the receiver's decision is unknown: {why}"))
}

/// Checks a grant before it is sent: 1 to [`MAX_GRANT_RANGES`] ranges,
/// none empty or overflowing, `expected` not above their sum.
pub fn check_grant(g: &Grant) -> Result<()> {
    let bad = |why: &str| Err(Error::new(ErrorKind::InvalidRequest, format!("bad grant: {why}")));
    if g.ranges.is_empty() || g.ranges.len() > MAX_GRANT_RANGES {
        return Err(Error::new(
            ErrorKind::InvalidRequest,
            format!("bad grant: {} ranges; 1 to {MAX_GRANT_RANGES} (MAX_GRANT_RANGES) allowed", g.ranges.len()),
        ));
    }
    let mut total: u64 = 0;
    for &(a, l) in &g.ranges {
        if l == 0 || a.checked_add(l).is_none() {
            return bad("a range is empty or overflows");
        }
        total = total.saturating_add(l);
    }
    if g.expected == 0 || g.expected > total {
        return bad("expected bytes must be 1 to the ranges' total");
    }
    if g.deadline.is_zero() {
        return bad("deadline must be positive");
    }
    Ok(())
}

impl SessionTable {
    /// An empty table; `epoch` must be new on every start of the engine
    /// (peers tell a restart by it).
    pub fn new(limits: SessionLimits, epoch: u64) -> Self {
        Self {
            limits,
            epoch,
            sessions: HashMap::new(),
            peers: HashMap::new(),
            out: Vec::new(),
            actions: Vec::new(),
            ignored: 0,
            strangers: HashMap::new(),
            released: VecDeque::new(),
            released_set: HashSet::new(),
            last_ran: None,
            just_paused: false,
            pauses: 0,
            partial: HashMap::new(),
        }
    }

    /// Times this side noticed it had not run for a quarter of the
    /// liveness timeout or more (see the module docs).
    pub fn pauses(&self) -> u64 {
        self.pauses
    }

    /// This side runs at `now` (a tick, a message read, a call). After a
    /// gap of a quarter of the liveness timeout or more (the driver ticks
    /// far more often: the process did not run), every peer's silence is
    /// credited with the gap: a pause is not the peers' fault.
    fn ran(&mut self, now: Duration) {
        if let Some(last) = self.last_ran {
            let gap = now.saturating_sub(last);
            if gap >= self.limits.liveness_timeout / 4 {
                self.pauses += 1;
                self.just_paused = true;
                for p in self.peers.values_mut() {
                    p.heard = p.heard.saturating_add(gap).min(now);
                }
                for p in self.partial.values_mut() {
                    p.last = p.last.saturating_add(gap).min(now);
                }
                // The peers did not hear from this side either: they may
                // have given up on the sessions open here.
                for s in self.sessions.values_mut() {
                    if !s.state.is_final() && matches!(s.phase, Phase::Open | Phase::Confirming) {
                        s.doubt = true;
                    }
                }
            }
        }
        self.last_ran = Some(self.last_ran.map_or(now, |l| l.max(now)));
    }

    /// This table's epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The limits it was made with.
    pub fn limits(&self) -> &SessionLimits {
        &self.limits
    }

    /// Messages to send, in order; the driver delivers each (retrying
    /// transient failures) until the peer is declared gone.
    pub fn drain_outgoing(&mut self) -> Vec<Outgoing> {
        std::mem::take(&mut self.out)
    }

    /// Actions for the driver.
    pub fn drain_actions(&mut self) -> Vec<Action> {
        std::mem::take(&mut self.actions)
    }

    /// Sessions whose state or grant changed since the last call (for the
    /// driver to wake only their waiters).
    pub fn drain_changed(&mut self) -> Vec<SessionKey> {
        self.sessions
            .iter_mut()
            .filter(|(_, s)| s.dirty)
            .map(|(k, s)| {
                s.dirty = false;
                k.clone()
            })
            .collect()
    }

    /// Current counts.
    pub fn counts(&self) -> SessionCounts {
        let open = self.sessions.values().filter(|s| !s.state.is_final()).count();
        SessionCounts { open, lingering: self.sessions.len() - open, peers: self.peers.len(), ignored: self.ignored }
    }

    /// The state of a session, if the table knows it.
    pub fn state(&self, key: &SessionKey) -> Option<SessionState> {
        self.sessions.get(key).map(|s| s.state.clone())
    }

    /// The grant of a session, if it has one.
    pub fn grant(&self, key: &SessionKey) -> Option<Grant> {
        self.sessions.get(key).and_then(|s| s.grant.clone())
    }

    /// Time left before a session's deadline (`None`: no deadline yet).
    pub fn remaining(&self, key: &SessionKey, now: Duration) -> Option<Duration> {
        self.sessions.get(key).and_then(|s| s.deadline).map(|d| d.saturating_sub(now))
    }

    /// Sender sessions holding a grant and not yet writing or finishing.
    pub fn grants(&self) -> Vec<(SessionKey, Grant)> {
        let mut v: Vec<(SessionKey, Grant, Duration)> = self
            .sessions
            .iter()
            .filter(|(k, s)| k.role == Role::Sender && s.state == SessionState::Granted)
            .filter_map(|(k, s)| s.grant.clone().map(|g| (k.clone(), g, s.created)))
            .collect();
        v.sort_by_key(|x| x.2);
        v.into_iter().map(|(k, g, _)| (k, g)).collect()
    }

    /// Sessions (both roles) that are not final.
    pub fn open_keys(&self) -> Vec<SessionKey> {
        self.sessions.iter().filter(|(_, s)| !s.state.is_final()).map(|(k, _)| k.clone()).collect()
    }

    fn room_for(&self, peer: &str) -> Result<()> {
        let l = &self.limits;
        self.room(peer, |_| true, ("max_sessions", l.max_sessions), ("max_sessions_per_peer", l.max_sessions_per_peer))
    }

    /// Room for one more open session counted by `counted`: under `all`
    /// in all and `per_peer` with `peer` (each a limit's name and value).
    fn room(
        &self,
        peer: &str,
        counted: impl Fn(&Session) -> bool,
        all: (&str, usize),
        per_peer: (&str, usize),
    ) -> Result<()> {
        let open: Vec<&SessionKey> =
            self.sessions.iter().filter(|(_, s)| !s.state.is_final() && counted(s)).map(|(k, _)| k).collect();
        if open.len() >= all.1 {
            return Err(table_full(all.0).with("max", all.1));
        }
        if open.iter().filter(|k| k.peer == peer).count() >= per_peer.1 {
            return Err(table_full(per_peer.0).with("peer", peer).with("max", per_peer.1));
        }
        Ok(())
    }

    fn touch_peer(&mut self, peer: &str, now: Duration) {
        self.peers.entry(peer.to_string()).or_insert(Peer { epoch: None, heard: now, beat: None });
    }

    fn insert(&mut self, key: SessionKey, state: SessionState, grant: Option<Grant>, now: Duration) {
        let deadline = grant.as_ref().map(|g| now.saturating_add(g.deadline));
        let bounds = match (&grant, key.role) {
            (Some(g), Role::Sender) => GrantBounds::new(&g.ranges),
            _ => GrantBounds::default(),
        };
        // A peer with nothing open here was not heartbeating (nothing asked
        // it to): its silence counts from this session on, not from the last
        // message of an earlier one (its entry may have stayed for lingering
        // sessions), and it is sent a heartbeat at once.
        let idle = !self.sessions.iter().any(|(k, s)| k.peer == key.peer && !s.state.is_final());
        self.touch_peer(&key.peer, now);
        if idle {
            if let Some(p) = self.peers.get_mut(&key.peer) {
                p.heard = p.heard.max(now);
                p.beat = None;
            }
        }
        self.sessions.insert(
            key,
            Session {
                state,
                phase: Phase::Open,
                grant,
                bounds,
                deadline,
                written: 0,
                writes: 0,
                final_at: None,
                created: now,
                doubt: false,
                checking: None,
                probes: 0,
                checks: 0,
                answers: 0,
                answered: None,
                dirty: true,
                unclaimed: false,
            },
        );
    }

    /// Room for one more grant nobody expects from `peer`
    /// ([`SessionLimits::max_unclaimed`], `max_unclaimed_per_peer`).
    fn room_for_unclaimed(&self, peer: &str) -> Result<()> {
        let l = &self.limits;
        let (all, per_peer) =
            (("max_unclaimed", l.max_unclaimed), ("max_unclaimed_per_peer", l.max_unclaimed_per_peer));
        self.room(peer, |s| s.unclaimed, all, per_peer)
    }

    fn send(&mut self, peer: &str, id: u64, body: Body) {
        let m = Message { epoch: self.epoch, id, body };
        self.out.push((peer.to_string(), m.encode()));
    }

    fn exists_error(key: &SessionKey) -> Error {
        Error::new(ErrorKind::InvalidRequest, "a session with this peer and id exists (release it first)")
            .with("peer", &key.peer)
            .with("id", key.id)
    }

    fn unknown(key: &SessionKey) -> Error {
        Error::new(ErrorKind::InvalidHandle, "unknown session").with("peer", &key.peer).with("id", key.id)
    }

    // ---- sender calls ----

    /// Sender: expect a grant from `peer` for `id` (the session starts
    /// Waiting; its peer's liveness is watched). A grant that came first is
    /// kept: then this is a no-op.
    pub fn expect(&mut self, peer: &str, id: u64, now: Duration) -> Result<()> {
        self.ran(now);
        let key = SessionKey::new(peer, id, Role::Sender);
        if let Some(s) = self.sessions.get_mut(&key) {
            if s.state.is_final() {
                return Err(Self::exists_error(&key));
            }
            s.unclaimed = false; // a grant that came first, claimed now
            return Ok(());
        }
        self.room_for(peer)?;
        self.insert(key, SessionState::Waiting, None, now);
        Ok(())
    }

    /// Sender: a write of the remote ranges `(addr, len)` is about to
    /// start. Refused (nothing may be sent) unless the session holds a
    /// grant, is open, before its deadline, and every range lies inside the
    /// granted memory (the union of the grant's ranges: a write may span
    /// two granted ranges that touch, never a gap). Returns the time left
    /// before the deadline.
    pub fn begin_write(&mut self, key: &SessionKey, ranges: &[(u64, u64)], now: Duration) -> Result<Duration> {
        self.ran(now);
        let s = self.sessions.get_mut(key).ok_or_else(|| Self::unknown(key))?;
        if key.role != Role::Sender {
            return Err(Error::new(ErrorKind::InvalidRequest, "only the sender writes"));
        }
        if s.phase != Phase::Open || s.state.is_final() {
            return Err(Error::new(ErrorKind::InvalidRequest, "the session is no longer open for writes")
                .with("state", s.state.name()));
        }
        let Some(g) = &s.grant else {
            return Err(Error::new(ErrorKind::InvalidRequest, "no grant yet: nothing may be sent"));
        };
        if s.doubt || s.checking.is_some() {
            return Err(Error::new(
                ErrorKind::Backpressure,
                "this side paused with the session open: confirm it with the receiver first (confirm_before_write)",
            ));
        }
        let left = s.deadline.map(|d| d.saturating_sub(now)).unwrap_or(Duration::ZERO);
        if left.is_zero() {
            return Err(Error::new(ErrorKind::Timeout, "the session's deadline passed"));
        }
        debug_assert!(!g.ranges.is_empty());
        s.bounds.check(ranges)?;
        s.writes = s.writes.saturating_add(1);
        if s.state == SessionState::Granted {
            s.state = SessionState::Transferring;
            s.dirty = true;
        }
        Ok(left)
    }

    /// Sender: a write begun with [`SessionTable::begin_write`] ended
    /// (quiet); `bytes` of it completed.
    pub fn end_write(&mut self, key: &SessionKey, bytes: u64, now: Duration) {
        self.ran(now);
        let Some(s) = self.sessions.get_mut(key) else { return };
        s.writes = s.writes.saturating_sub(1);
        s.written = s.written.saturating_add(bytes);
        if s.writes == 0 {
            self.after_quiet(key, now);
        }
    }

    /// Sender: every write completed; tell the receiver. Refused while
    /// writes are in flight or when the session is not open.
    pub fn finish(&mut self, key: &SessionKey) -> Result<()> {
        let s = self.sessions.get_mut(key).ok_or_else(|| Self::unknown(key))?;
        if key.role != Role::Sender || s.grant.is_none() || s.phase != Phase::Open || s.state.is_final() {
            return Err(Error::new(ErrorKind::InvalidRequest, "finish needs an open sender session with a grant")
                .with("state", s.state.name()));
        }
        if s.writes > 0 {
            return Err(Error::new(ErrorKind::InvalidRequest, "writes still in flight").with("writes", s.writes));
        }
        s.phase = Phase::Finishing;
        let bytes = s.written;
        self.send(&key.peer, key.id, Body::Finish { bytes });
        Ok(())
    }

    /// Either side: cancel. The sender stops its writes and asks the
    /// receiver; the receiver decides at once and tells the sender. Its
    /// final state follows (see the module docs). `outcome` is `Cancelled`,
    /// or `Failed` with the error when a side gives up.
    pub fn cancel(&mut self, key: &SessionKey, error: Option<Error>, now: Duration) -> Result<()> {
        self.ran(now);
        let s = self.sessions.get_mut(key).ok_or_else(|| Self::unknown(key))?;
        let confirming = key.role == Role::Receiver && matches!(s.phase, Phase::Confirming);
        if s.state.is_final() || (s.phase != Phase::Open && !confirming) {
            return Ok(());
        }
        let v = match &error {
            Some(e) => verdict(Outcome::Failed, e.kind(), e.to_string()),
            None => verdict(Outcome::Cancelled, ErrorKind::Cancelled, "cancelled by the sender"),
        };
        match key.role {
            Role::Sender if s.grant.is_none() => {
                // Nothing was granted, so nothing was written: final now; a
                // grant that comes later is answered with CANCEL.
                s.phase = Phase::Cancelling(v.clone());
                Self::finalize(s, SessionState::from_verdict(&v), now);
            }
            Role::Sender => {
                s.phase = Phase::Cancelling(v);
                if s.writes > 0 {
                    self.actions.push(Action::StopWrites(key.clone()));
                } else {
                    self.after_quiet(key, now);
                }
            }
            Role::Receiver => {
                let v = match error {
                    Some(_) => v,
                    None => verdict(Outcome::Cancelled, ErrorKind::Cancelled, "cancelled by the receiver"),
                };
                self.close_receiver(key, v);
            }
        }
        Ok(())
    }

    /// Forgets a final session. `InvalidRequest` while it is open.
    pub fn release(&mut self, key: &SessionKey) -> Result<()> {
        let s = self.sessions.get(key).ok_or_else(|| Self::unknown(key))?;
        if !s.state.is_final() {
            return Err(Error::new(ErrorKind::InvalidRequest, "the session is still open (cancel it first)"));
        }
        // Remembered (bounded): a sender's session released before its
        // grant came refuses a late grant; a receiver's answers a late
        // FINISH (see `on_finish`).
        let remember = key.role == Role::Receiver || s.grant.is_none();
        if remember && self.released_set.insert(key.clone()) {
            self.released.push_back((key.clone(), self.last_ran.unwrap_or_default()));
            while self.released.len() > self.limits.max_lingering {
                if let Some((k, _)) = self.released.pop_front() {
                    self.released_set.remove(&k);
                }
            }
        }
        self.sessions.remove(key);
        self.forget_idle_peers();
        Ok(())
    }

    // ---- receiver calls ----

    /// Receiver: grant `peer` the right to write `grant.ranges` for `id`;
    /// the deadline starts now. Queues the GRANT.
    pub fn grant_to(&mut self, peer: &str, id: u64, grant: Grant, now: Duration) -> Result<()> {
        self.ran(now);
        check_grant(&grant)?;
        let key = SessionKey::new(peer, id, Role::Receiver);
        if self.sessions.contains_key(&key) {
            return Err(Self::exists_error(&key));
        }
        self.room_for(peer)?;
        let Some(bodies) = grant_messages(&grant) else {
            return Err(Error::new(ErrorKind::InvalidRequest, "bad grant: too many ranges"));
        };
        for body in bodies {
            self.send(peer, id, body);
        }
        self.insert(key, SessionState::Granted, Some(grant), now);
        Ok(())
    }

    // ---- the common machinery ----

    fn finalize(s: &mut Session, state: SessionState, now: Duration) {
        if s.state.is_final() {
            return;
        }
        debug_assert!(state.rank() >= s.state.rank());
        s.state = state;
        s.phase = Phase::Final;
        s.final_at = Some(now);
        s.dirty = true;
    }

    /// Sender: its writes just became quiet; send what waited for that.
    fn after_quiet(&mut self, key: &SessionKey, now: Duration) {
        let Some(s) = self.sessions.get_mut(key) else { return };
        if key.role != Role::Sender || s.writes > 0 {
            return;
        }
        match s.phase.clone() {
            Phase::Cancelling(v) if !s.state.is_final() => {
                // Quiet now: ask the receiver; its END decides the outcome.
                s.phase = Phase::CancelSent;
                self.send(&key.peer, key.id, Body::Cancel(v));
            }
            Phase::Closing(v) => {
                Self::finalize(s, SessionState::from_verdict(&v), now);
                self.send(&key.peer, key.id, Body::Quiet);
            }
            _ => {}
        }
    }

    /// Receiver: decide `v` (not Landed), tell the sender, wait for QUIET.
    fn close_receiver(&mut self, key: &SessionKey, v: Verdict) {
        let Some(s) = self.sessions.get_mut(key) else { return };
        if s.state.is_final() || matches!(s.phase, Phase::Closing(_)) {
            return;
        }
        s.phase = Phase::Closing(v.clone());
        self.send(&key.peer, key.id, Body::End(v));
    }

    /// A session message (or anything else) received from `from`. Never
    /// fails: what cannot be used is counted as ignored.
    pub fn on_message(&mut self, from: &str, bytes: &[u8], now: Duration) {
        self.ran(now);
        match super::wire::unbundle(bytes) {
            Some(parts) if parts.len() == 1 && parts[0].len() == bytes.len() => self.on_one(from, bytes, now),
            Some(parts) => {
                for p in parts {
                    self.on_one(from, p, now);
                }
            }
            None => self.ignored += 1,
        }
    }

    fn on_one(&mut self, from: &str, bytes: &[u8], now: Duration) {
        let Some(m) = decode(bytes) else {
            self.ignored += 1;
            return;
        };
        // Liveness and restarts.
        let known = self.peers.contains_key(from);
        if known {
            let restarted = self.peers.get(from).and_then(|p| p.epoch).is_some_and(|e| e != m.epoch);
            if restarted {
                let err = Error::new(ErrorKind::PeerRestarted, "the peer restarted (new epoch)").with("peer", from);
                self.peer_gone(from, err, now);
            }
        }
        if let Some(p) = self.peers.get_mut(from) {
            p.epoch = Some(m.epoch);
            p.heard = now;
        }
        match m.body {
            Body::Heartbeat { reply } => {
                if reply && (known || self.answer_stranger(from, now)) {
                    self.send(from, 0, Body::Heartbeat { reply: false });
                }
            }
            Body::Grant(g) => self.on_grant(from, m.id, g, m.epoch, now),
            Body::GrantMore { part, parts, ranges } => self.on_grant_more(from, m.id, part, parts, ranges, now),
            Body::End(v) => self.on_end(from, m.id, v, now),
            Body::Finish { bytes } => self.on_finish(from, m.id, bytes, now),
            Body::Cancel(v) => self.on_cancel(from, m.id, v, now),
            Body::Refuse(v) => self.on_refuse(from, m.id, v, now),
            Body::Quiet => self.on_quiet(from, m.id, now),
            Body::Check { by_sender } => self.on_check(from, m.id, by_sender, known, now),
            Body::Confirm { open, to_sender: false } => self.on_confirm(from, m.id, open, now),
            Body::Confirm { open, to_sender: true } => self.on_sender_confirm(from, m.id, open, now),
        }
    }

    /// A part of a grant too large for one message: kept, in order, until
    /// its GRANT comes. Parts for a session that has its grant or has
    /// ended are ignored (its GRANT is answered as a lone one would be).
    fn on_grant_more(&mut self, from: &str, id: u64, part: u16, parts: u16, ranges: Vec<(u64, u64)>, now: Duration) {
        let key = SessionKey::new(from, id, Role::Sender);
        let settled = self.sessions.get(&key).is_some_and(|s| s.state.is_final() || s.grant.is_some());
        if settled || self.released_set.contains(&key) {
            self.ignored += 1;
            return;
        }
        let held: usize = self.partial.values().map(|p| p.ranges.len()).sum();
        if part == 0 {
            self.partial.remove(&key);
            let per_peer = self.partial.keys().filter(|k| k.peer == from).count();
            if self.partial.len() >= self.limits.max_unclaimed || per_peer >= self.limits.max_unclaimed_per_peer {
                // No room to note even that it is broken: its GRANT then
                // carries too few ranges and is ignored as malformed.
                self.ignored += 1;
                return;
            }
            let p = PartialGrant { parts, got: 0, ranges: Vec::new(), last: now, broken: None };
            self.partial.insert(key.clone(), p);
        }
        let Some(p) = self.partial.get_mut(&key) else {
            self.ignored += 1;
            return;
        };
        p.last = now;
        if p.broken.is_some() {
            return;
        }
        if p.parts != parts || p.got != part {
            let e = Error::new(ErrorKind::InvalidRequest, "bad grant: a part of it is missing or out of order")
                .with("part", part)
                .with("expected_part", p.got);
            p.broken = Some(e);
            p.ranges = Vec::new();
            return;
        }
        if p.ranges.len().saturating_add(ranges.len()) > MAX_GRANT_RANGES
            || held.saturating_add(ranges.len()) > MAX_PARTIAL_RANGES
        {
            p.broken = Some(
                table_full("grants arriving in parts hold too many ranges")
                    .with("max_grant_ranges", MAX_GRANT_RANGES)
                    .with("max_partial_ranges", MAX_PARTIAL_RANGES),
            );
            p.ranges = Vec::new();
            return;
        }
        p.got = p.got.saturating_add(1);
        p.ranges.extend(ranges);
    }

    /// A grant this side cannot use (its parts were broken): the sender's
    /// session, if it waits for it, fails, and the receiver is told to
    /// free the memory at once.
    fn refuse_grant(&mut self, key: &SessionKey, err: Error, now: Duration) {
        if let Some(s) = self.sessions.get_mut(key) {
            if !s.state.is_final() && s.grant.is_none() {
                Self::finalize(s, SessionState::Failed(err.clone()), now);
            }
        }
        self.send(&key.peer, key.id, Body::Refuse(verdict(Outcome::Failed, err.kind(), err.to_string())));
    }

    fn on_grant(&mut self, from: &str, id: u64, mut g: Grant, epoch: u64, now: Duration) {
        let key = SessionKey::new(from, id, Role::Sender);
        if let Some(p) = self.partial.remove(&key) {
            let missing = (p.got != p.parts).then(|| {
                Error::new(ErrorKind::InvalidRequest, "bad grant: parts of it are missing")
                    .with("parts", p.parts)
                    .with("received", p.got)
            });
            if let Some(e) = p.broken.or(missing) {
                self.refuse_grant(&key, e, now);
                return;
            }
            let mut ranges = p.ranges;
            ranges.append(&mut g.ranges);
            g.ranges = ranges;
        }
        if check_grant(&g).is_err() {
            self.ignored += 1;
            return;
        }
        match self.sessions.get_mut(&key) {
            Some(s) if s.state == SessionState::Waiting && s.phase == Phase::Open => {
                s.deadline = Some(now.saturating_add(g.deadline));
                s.bounds = GrantBounds::new(&g.ranges);
                s.grant = Some(g);
                s.state = SessionState::Granted;
                s.dirty = true;
            }
            Some(s) if s.state.is_final() && s.grant.is_none() => {
                // Cancelled before the grant came: tell the receiver to free it.
                let v = match &s.state {
                    SessionState::Failed(e) => verdict(Outcome::Failed, e.kind(), e.to_string()),
                    _ => verdict(Outcome::Cancelled, ErrorKind::Cancelled, "cancelled by the sender before the grant"),
                };
                self.send(from, id, Body::Refuse(v));
            }
            Some(_) => self.ignored += 1, // a duplicate
            None if self.released_set.contains(&key) => {
                let why = "the sender ended the session before the grant came";
                self.send(from, id, Body::Refuse(verdict(Outcome::Cancelled, ErrorKind::Cancelled, why)));
            }
            None => match self.room_for_unclaimed(from).and_then(|()| self.room_for(from)) {
                Ok(()) => {
                    self.insert(key.clone(), SessionState::Granted, Some(g), now);
                    if let Some(s) = self.sessions.get_mut(&key) {
                        s.unclaimed = true;
                    }
                    if let Some(p) = self.peers.get_mut(from) {
                        p.epoch = Some(epoch);
                    }
                }
                Err(e) => {
                    // Refuse it so the receiver frees the memory at once.
                    self.send(from, id, Body::Refuse(verdict(Outcome::Failed, e.kind(), e.to_string())));
                }
            },
        }
    }

    fn on_end(&mut self, from: &str, id: u64, v: Verdict, now: Duration) {
        let key = SessionKey::new(from, id, Role::Sender);
        let Some(s) = self.sessions.get_mut(&key) else {
            self.ignored += 1;
            return;
        };
        if s.state.is_final() {
            if v.outcome != Outcome::Landed {
                // A duplicate END: answer QUIET again (we are quiet).
                self.send(from, id, Body::Quiet);
            }
            return;
        }
        if s.grant.is_none() {
            self.ignored += 1; // END before any grant: forged or confused
            return;
        }
        if v.outcome == Outcome::Landed {
            if s.phase == Phase::Finishing && s.writes == 0 {
                Self::finalize(s, SessionState::Landed, now);
            } else {
                self.ignored += 1; // Landed without our FINISH: not credible
            }
            return;
        }
        s.phase = Phase::Closing(v);
        if s.writes > 0 {
            self.actions.push(Action::StopWrites(key));
        } else {
            self.after_quiet(&key, now);
        }
    }

    fn on_finish(&mut self, from: &str, id: u64, bytes: u64, now: Duration) {
        let key = SessionKey::new(from, id, Role::Receiver);
        let Some(s) = self.sessions.get_mut(&key) else {
            // A session this side ended and its engine released (e.g. it
            // took the sender's pause for death): answered, or the sender
            // would wait out its deadline while this side answers its
            // heartbeats. Its outcome is no longer known here, so the answer
            // says exactly that, never an outcome a landed one could
            // contradict (rule 13). Only sessions released lately (the
            // last `max_lingering`) are answered, once per FINISH; anything
            // else is ignored, and both change nothing here.
            self.ignored += 1;
            if self.released_set.contains(&key) {
                let why = "this side no longer holds the session (it ended and was released)";
                self.send(from, id, Body::End(unknown_outcome(why)));
            }
            return;
        };
        match (&s.phase, &s.state) {
            (Phase::Open, _) => {
                let expected = s.grant.as_ref().map_or(0, |g| g.expected);
                if bytes == expected && s.doubt {
                    // Landing alone is what must never happen: ask first.
                    s.phase = Phase::Confirming;
                    self.ask(&key, now);
                } else if bytes == expected {
                    Self::finalize(s, SessionState::Landed, now);
                    let v = verdict(Outcome::Landed, ErrorKind::Internal, "");
                    self.send(from, id, Body::End(v));
                } else {
                    // The sender is quiet (it finished): final at once.
                    let why = format!("the sender finished with {bytes} of {expected} granted bytes");
                    let v = verdict(Outcome::Failed, ErrorKind::InvalidRequest, why);
                    Self::finalize(s, SessionState::from_verdict(&v), now);
                    self.send(from, id, Body::End(v));
                }
            }
            // A FINISH after our END crossed it: the sender is quiet.
            (Phase::Closing(v), _) => {
                let v = v.clone();
                Self::finalize(s, SessionState::from_verdict(&v), now);
                self.send(from, id, Body::End(v));
            }
            (Phase::Final, st) => {
                let v = Self::verdict_of(st);
                self.send(from, id, Body::End(v));
            }
            _ => self.ignored += 1,
        }
    }

    /// The peer asks whether session `id` is still open here (it paused
    /// with the session open; `by_sender`: the peer is its sender, so this
    /// side is the receiver). Answered for known peers, and for others as
    /// a heartbeat is (bounded).
    fn on_check(&mut self, from: &str, id: u64, by_sender: bool, known: bool, now: Duration) {
        let role = if by_sender { Role::Receiver } else { Role::Sender };
        let key = SessionKey::new(from, id, role);
        let open = match self.sessions.get_mut(&key).map(|s| Self::still_open(s, role, now)) {
            Some(Some(open)) => open,
            // Forgotten (it ended long ago) or never here.
            None if known || self.answer_stranger(from, now) => false,
            // Forged or confused, or a stranger over its bound.
            _ => {
                self.ignored += 1;
                return;
            }
        };
        self.send(from, id, Body::Confirm { open, to_sender: by_sender });
    }

    /// Whether session `s` (this side's `role`) is open for the peer that
    /// asks; `None` when the question makes no sense here. A sender waiting
    /// for the receiver's decision gives the asking receiver a fresh grace
    /// (a bounded number of times).
    fn still_open(s: &mut Session, role: Role, now: Duration) -> Option<bool> {
        Some(match (role, &s.phase, &s.state) {
            (Role::Receiver, phase, st) => !st.is_final() && matches!(phase, Phase::Open | Phase::Confirming),
            (Role::Sender, _, SessionState::Landed) => true,
            (Role::Sender, Phase::Finishing, st) if !st.is_final() => {
                if s.answers < MAX_CHECKS {
                    s.answers += 1;
                    s.answered = Some(now);
                }
                true
            }
            (Role::Sender, Phase::Closing(_) | Phase::Final, _) => false,
            // Still granted or writing here: a receiver that paused asks so
            // (it frees the memory at once if not).
            (Role::Sender, Phase::Open, st) if !st.is_final() => true,
            (Role::Sender, ..) => return None,
        })
    }

    /// Sends CHECK for `key` (one more question; its answer clears
    /// `checking`).
    fn ask(&mut self, key: &SessionKey, now: Duration) {
        let Some(s) = self.sessions.get_mut(key) else { return };
        s.doubt = false;
        s.checks = s.checks.saturating_add(1);
        s.checking = Some(now);
        self.send(&key.peer, key.id, Body::Check { by_sender: key.role == Role::Sender });
    }

    /// Sender: the receiver's answer to our CHECK.
    fn on_sender_confirm(&mut self, from: &str, id: u64, open: bool, now: Duration) {
        let key = SessionKey::new(from, id, Role::Sender);
        let Some(s) = self.sessions.get_mut(&key) else {
            self.ignored += 1;
            return;
        };
        if s.checking.is_none() || s.state.is_final() {
            self.ignored += 1;
            return;
        }
        s.dirty = true; // writes waiting for the answer look again
        if !open {
            // The receiver ended the session while we were paused (it took
            // our silence for death): end it here too, writing nothing more.
            s.checking = None;
            let why = "the receiver had ended the session while this side was paused";
            let v = verdict(Outcome::Failed, ErrorKind::PeerUnavailable, why);
            if matches!(s.phase, Phase::Open) {
                s.phase = Phase::Closing(v);
                if s.writes > 0 {
                    self.actions.push(Action::StopWrites(key));
                } else {
                    self.after_quiet(&key, now);
                }
            }
        } else {
            // Answered. If this side paused again since the CHECK (`doubt`),
            // the next write asks again (confirm_before_write gives up after
            // MAX_CHECKS).
            s.checking = None;
        }
    }

    /// Sender: whether a write must wait because this side paused with the
    /// session open and has not yet confirmed it with the receiver (then a
    /// CHECK is on its way; the session's waiters are woken by the answer,
    /// and a session whose receiver does not answer within the liveness
    /// timeout fails).
    pub fn confirm_before_write(&mut self, key: &SessionKey, now: Duration) -> Result<bool> {
        self.ran(now);
        let s = self.sessions.get_mut(key).ok_or_else(|| Self::unknown(key))?;
        if key.role != Role::Sender || s.state.is_final() || s.phase != Phase::Open || s.grant.is_none() {
            return Ok(false); // begin_write says why not, if it must
        }
        if s.checking.is_some() {
            return Ok(true);
        }
        if !s.doubt {
            return Ok(false);
        }
        if s.checks >= MAX_CHECKS {
            let e = Error::new(ErrorKind::PeerUnavailable, "this side kept pausing while it confirmed the session");
            self.cancel(key, Some(e), now)?;
            return Ok(false); // begin_write refuses: the session is no longer open
        }
        self.ask(key, now);
        Ok(true)
    }

    /// Receiver, after a pause of its own: asks the sender of every session
    /// still open here (no FINISH yet) whether it is still open there. The
    /// sender may have taken the pause for this side's death and ended its
    /// part; then the session ends here at once, on the answer, instead of
    /// holding its memory until the deadline. Unlike a FINISH's question,
    /// the answer lands nothing: `doubt` stays until a FINISH is confirmed.
    fn probe_after_pause(&mut self, now: Duration) {
        let keys: Vec<SessionKey> = self
            .sessions
            .iter()
            .filter(|(k, s)| {
                k.role == Role::Receiver
                    && s.phase == Phase::Open
                    && s.doubt
                    && s.checking.is_none()
                    && !s.state.is_final()
                    && s.checks < MAX_CHECKS
            })
            .map(|(k, _)| k.clone())
            .collect();
        for key in keys {
            let Some(s) = self.sessions.get_mut(&key) else { continue };
            s.checks = s.checks.saturating_add(1);
            s.probes = s.probes.saturating_add(1);
            s.checking = Some(now);
            self.send(&key.peer, key.id, Body::Check { by_sender: false });
        }
    }

    /// Receiver: the sender's answer to CHECK.
    fn on_confirm(&mut self, from: &str, id: u64, open: bool, now: Duration) {
        let key = SessionKey::new(from, id, Role::Receiver);
        let Some(s) = self.sessions.get_mut(&key) else {
            self.ignored += 1;
            return;
        };
        if s.probes > 0 && matches!(s.phase, Phase::Open | Phase::Confirming) {
            // The answer to a probe after a pause. It lands nothing: a
            // FINISH that came since waits for the answer to its own CHECK.
            s.probes -= 1;
            if s.phase == Phase::Open {
                s.checking = None;
            }
            if !open {
                // The sender ended its part (quiet): so do we, now.
                let why = "the sender had ended the session while this side was paused";
                let v = verdict(Outcome::Failed, ErrorKind::PeerUnavailable, why);
                Self::finalize(s, SessionState::from_verdict(&v), now);
            }
            return;
        }
        if s.phase != Phase::Confirming {
            self.ignored += 1;
            return;
        }
        s.checking = None;
        if !open {
            // The sender ended it without our decision (it gave up on this
            // side while we were paused): it is quiet; we must not land.
            let why = "the sender had ended the session before its finish was confirmed (this side paused)";
            let v = verdict(Outcome::Failed, ErrorKind::PeerUnavailable, why);
            Self::finalize(s, SessionState::from_verdict(&v), now);
        } else if s.doubt && s.checks >= MAX_CHECKS {
            let why = "this side kept pausing while it confirmed the sender's finish";
            self.give_up_confirming(&key, why, now);
        } else if s.doubt {
            // Paused again since the CHECK: the answer may be stale.
            self.ask(&key, now);
        } else {
            Self::finalize(s, SessionState::Landed, now);
            self.send(from, id, Body::End(verdict(Outcome::Landed, ErrorKind::Internal, "")));
        }
    }

    /// Receiver: confirming failed (no answer, or too many pauses): fail
    /// the session and tell the sender, which is quiet (it finished) and
    /// adopts it, unless it has ended already.
    fn give_up_confirming(&mut self, key: &SessionKey, why: &str, now: Duration) {
        let Some(s) = self.sessions.get_mut(key) else { return };
        let v = verdict(Outcome::Failed, ErrorKind::PeerUnavailable, why);
        Self::finalize(s, SessionState::from_verdict(&v), now);
        self.send(&key.peer, key.id, Body::End(v));
    }

    fn verdict_of(st: &SessionState) -> Verdict {
        match st {
            SessionState::Landed => verdict(Outcome::Landed, ErrorKind::Internal, ""),
            SessionState::Cancelled => verdict(Outcome::Cancelled, ErrorKind::Cancelled, "cancelled"),
            SessionState::Expired => verdict(Outcome::Expired, ErrorKind::Timeout, "deadline passed"),
            SessionState::Failed(e) => verdict(Outcome::Failed, e.kind(), e.to_string()),
            _ => verdict(Outcome::Failed, ErrorKind::Internal, "not final"),
        }
    }

    fn on_cancel(&mut self, from: &str, id: u64, v: Verdict, now: Duration) {
        let key = SessionKey::new(from, id, Role::Receiver);
        let Some(s) = self.sessions.get_mut(&key) else {
            self.ignored += 1;
            return;
        };
        // The sender is quiet when it sends CANCEL.
        let decided = match &s.phase {
            Phase::Open => match v.outcome {
                Outcome::Failed => v,
                _ => verdict(Outcome::Cancelled, ErrorKind::Cancelled, "cancelled by the sender"),
            },
            Phase::Closing(mine) => mine.clone(),
            Phase::Final => Self::verdict_of(&s.state),
            _ => {
                self.ignored += 1;
                return;
            }
        };
        Self::finalize(s, SessionState::from_verdict(&decided), now);
        self.send(from, id, Body::End(decided));
    }

    fn on_refuse(&mut self, from: &str, id: u64, v: Verdict, now: Duration) {
        let key = SessionKey::new(from, id, Role::Receiver);
        let Some(s) = self.sessions.get_mut(&key) else {
            self.ignored += 1;
            return;
        };
        if s.state.is_final() || v.outcome == Outcome::Landed || v.outcome == Outcome::Expired {
            self.ignored += 1;
            return;
        }
        // The sender never wrote and has already ended as `v`: adopt it,
        // whatever this side was closing with (the sender will not adopt
        // an END any more).
        Self::finalize(s, SessionState::from_verdict(&v), now);
    }

    fn on_quiet(&mut self, from: &str, id: u64, now: Duration) {
        let key = SessionKey::new(from, id, Role::Receiver);
        let Some(s) = self.sessions.get_mut(&key) else {
            self.ignored += 1;
            return;
        };
        if let Phase::Closing(v) = &s.phase {
            let st = SessionState::from_verdict(v);
            Self::finalize(s, st, now);
        } else {
            self.ignored += 1;
        }
    }

    /// Whether to answer a heartbeat from a peer with no session here: at
    /// most once per heartbeat interval each, and to at most
    /// [`MAX_STRANGERS`] peers at a time (the least recently answered goes).
    fn answer_stranger(&mut self, from: &str, now: Duration) -> bool {
        let every = self.limits.heartbeat_interval;
        if let Some(&at) = self.strangers.get(from) {
            if now.saturating_sub(at) < every / 2 {
                return false;
            }
        } else if self.strangers.len() >= MAX_STRANGERS {
            let oldest = self.strangers.iter().min_by_key(|(_, t)| **t).map(|(p, _)| p.clone());
            if let Some(p) = oldest {
                self.strangers.remove(&p);
            }
        }
        self.strangers.insert(from.to_string(), now);
        true
    }

    /// Every open session with `peer` fails with `err` (the peer died,
    /// restarted, or cannot be reached any more). Receiver sessions that
    /// were closing end with the outcome they had decided: a dead sender
    /// writes nothing more.
    pub fn peer_gone(&mut self, peer: &str, err: Error, now: Duration) {
        self.partial.retain(|k, _| k.peer != peer);
        let keys: Vec<SessionKey> = self
            .sessions
            .iter()
            .filter(|(k, s)| k.peer == peer && !s.state.is_final())
            .map(|(k, _)| k.clone())
            .collect();
        for key in keys {
            let Some(s) = self.sessions.get_mut(&key) else { continue };
            let v = match &s.phase {
                Phase::Closing(v) => v.clone(),
                // FINISH went: the receiver may have landed before it went.
                Phase::Finishing => unknown_outcome(&format!("after the finish: {err}")),
                _ => verdict(Outcome::Failed, err.kind(), err.to_string()),
            };
            match key.role {
                Role::Receiver => Self::finalize(s, SessionState::from_verdict(&v), now),
                Role::Sender => {
                    s.phase = Phase::Closing(v);
                    if s.writes > 0 {
                        self.actions.push(Action::StopWrites(key));
                    } else if let Some(s) = self.sessions.get_mut(&key) {
                        if let Phase::Closing(v) = s.phase.clone() {
                            Self::finalize(s, SessionState::from_verdict(&v), now);
                        }
                    }
                }
            }
        }
        if let Some(p) = self.peers.get_mut(peer) {
            p.epoch = None;
        }
    }

    /// The timer: deadlines, liveness, heartbeats, lingering sessions.
    pub fn tick(&mut self, now: Duration) {
        // This side's own pause is not its peers' silence (issue 25).
        self.ran(now);
        let paused = std::mem::take(&mut self.just_paused);
        if paused {
            self.probe_after_pause(now);
        }
        // Grants whose GRANT never followed their parts (the receiver
        // stopped half way): forgotten after a liveness timeout.
        let stale = self.limits.liveness_timeout;
        self.partial.retain(|_, p| now.saturating_sub(p.last) < stale);
        // Receiver deadlines.
        let expired: Vec<SessionKey> = self
            .sessions
            .iter()
            .filter(|(k, s)| k.role == Role::Receiver && s.phase == Phase::Open && s.deadline.is_some_and(|d| now >= d))
            .map(|(k, _)| k.clone())
            .collect();
        for key in expired {
            let v = verdict(Outcome::Expired, ErrorKind::Timeout, "the session's deadline passed");
            self.close_receiver(&key, v);
        }
        // Sender deadlines: stop writing (the receiver's END decides).
        let late: Vec<SessionKey> = self
            .sessions
            .iter()
            .filter(|(k, s)| {
                k.role == Role::Sender && s.writes > 0 && !s.state.is_final() && s.deadline.is_some_and(|d| now >= d)
            })
            .map(|(k, _)| k.clone())
            .collect();
        for key in late {
            self.actions.push(Action::StopWrites(key));
        }
        // A sender whose receiver neither ended the session by its deadline
        // nor went silent (an honest receiver sends END(Expired) then): it
        // ends the session itself, as the receiver should have, one liveness
        // timeout after the deadline.
        // (Not judged right after a pause: the receiver's END may be
        // waiting to be read.)
        let grace = self.limits.liveness_timeout;
        let overdue: Vec<SessionKey> = self
            .sessions
            .iter()
            .filter(|(k, s)| {
                !paused
                    && k.role == Role::Sender
                    && !s.state.is_final()
                    && !matches!(s.phase, Phase::Closing(_))
                    && s.deadline.is_some_and(|d| now >= d.max(s.answered.unwrap_or(d)).saturating_add(grace))
            })
            .map(|(k, _)| k.clone())
            .collect();
        for key in overdue {
            let Some(s) = self.sessions.get_mut(&key) else { continue };
            s.phase = Phase::Closing(if s.phase == Phase::Finishing {
                // The receiver had FINISH in time and may have landed.
                unknown_outcome("the receiver did not answer the finish by the deadline")
            } else {
                verdict(Outcome::Expired, ErrorKind::Timeout, "the receiver did not end the session by its deadline")
            });
            if s.writes > 0 {
                self.actions.push(Action::StopWrites(key));
            } else {
                self.after_quiet(&key, now);
            }
        }
        // A CHECK the peer did not answer within the liveness timeout: a
        // receiver cannot know and must not land; a sender gives the session
        // up (as a failed write would, the receiver learns it).
        let unanswered: Vec<SessionKey> = self
            .sessions
            .iter()
            .filter(|(_, s)| {
                !paused
                    && !s.state.is_final()
                    && s.checking.is_some_and(|at| now.saturating_sub(at) >= self.limits.liveness_timeout)
            })
            .map(|(k, _)| k.clone())
            .collect();
        for key in unanswered {
            if let Some(s) = self.sessions.get_mut(&key) {
                s.checking = None;
                s.dirty = true;
            }
            let probing = self.sessions.get(&key).is_some_and(|s| s.phase == Phase::Open);
            match key.role {
                // A probe after a pause: the sender's silence is judged by
                // liveness, as ever.
                Role::Receiver if probing => {}
                Role::Receiver => {
                    let why = "the sender did not confirm the finish within the liveness timeout (this side paused)";
                    self.give_up_confirming(&key, why, now);
                }
                Role::Sender => {
                    let why = "the receiver did not confirm the session within the liveness timeout (this side paused)";
                    let _ = self.cancel(&key, Some(Error::new(ErrorKind::PeerUnavailable, why)), now);
                }
            }
        }
        // Strangers answered long ago are forgotten.
        let keep = self.limits.liveness_timeout;
        self.strangers.retain(|_, t| now.saturating_sub(*t) < keep);
        while self.released.front().is_some_and(|(_, t)| now.saturating_sub(*t) >= self.limits.linger) {
            if let Some((k, _)) = self.released.pop_front() {
                self.released_set.remove(&k);
            }
        }
        // Liveness and heartbeats, for peers with open sessions.
        let mut busy: HashMap<String, bool> = HashMap::new();
        for (k, s) in &self.sessions {
            if !s.state.is_final() {
                busy.insert(k.peer.clone(), true);
            }
        }
        let peers: Vec<String> = busy.keys().cloned().collect();
        for peer in peers {
            let Some(p) = self.peers.get(&peer) else { continue };
            if now.saturating_sub(p.heard) >= self.limits.liveness_timeout {
                let err = Error::new(ErrorKind::PeerUnavailable, "the peer went silent past the liveness timeout")
                    .with("peer", &peer)
                    .with("liveness_timeout_ms", self.limits.liveness_timeout.as_millis())
                    .with("silent_ms", now.saturating_sub(p.heard).as_millis());
                self.peer_gone(&peer, err, now);
                if let Some(p) = self.peers.get_mut(&peer) {
                    p.heard = now; // sessions made later get a fresh window
                }
                continue;
            }
            let due = p.beat.is_none_or(|b| now.saturating_sub(b) >= self.limits.heartbeat_interval);
            if due {
                if let Some(p) = self.peers.get_mut(&peer) {
                    p.beat = Some(now);
                }
                self.send(&peer, 0, Body::Heartbeat { reply: true });
            }
        }
        // Lingering final sessions.
        let linger = self.limits.linger;
        self.sessions.retain(|_, s| s.final_at.is_none_or(|t| now.saturating_sub(t) < linger));
        let lingering: usize = self.sessions.values().filter(|s| s.state.is_final()).count();
        if lingering > self.limits.max_lingering {
            let mut old: Vec<(SessionKey, Duration)> =
                self.sessions.iter().filter_map(|(k, s)| s.final_at.map(|t| (k.clone(), t))).collect();
            old.sort_by_key(|x| x.1);
            for (k, _) in old.into_iter().take(lingering - self.limits.max_lingering) {
                self.sessions.remove(&k);
            }
        }
        self.forget_idle_peers();
    }

    /// Peers the table tracks (they have sessions, open or lingering).
    pub fn known_peers(&self) -> std::collections::HashSet<String> {
        self.peers.keys().cloned().collect()
    }

    /// Peers with no session at all are forgotten (their epoch too).
    fn forget_idle_peers(&mut self) {
        let sessions = &self.sessions;
        self.peers.retain(|p, _| sessions.keys().any(|k| &k.peer == p));
    }
}
