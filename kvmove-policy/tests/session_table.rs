//! The session table (rules 12, 13) under random schedules, with no
//! network: two tables, a sender "s" and a receiver "r", exchange messages
//! through FIFO links with bounded delay, duplicates and forged input; a
//! side may die. Checked: states are monotone and final states stick; both
//! live sides end in the same final state; a survivor ends within the
//! liveness timeout; a sender is final only when quiet; writes outside the
//! grant are refused.
//!
//! With pauses (`pauses_never_split_landed`), the scheduler may also
//! freeze one table while time passes (a stopped or starved process: it
//! neither ticks nor reads, and messages to it wait): neither side ever
//! reports `landed` while the other ends with a known other outcome (the
//! sender may end `OutcomeUnknown` after its FINISH), and pauses shorter
//! than half the liveness timeout change nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::VecDeque;
use std::time::Duration;

use kvmove_policy::session::wire::{Body, Message};
use kvmove_policy::session::{Action, Grant, GrantBounds, Role, SessionKey, SessionLimits, SessionState, SessionTable};
use proptest::prelude::*;
use transport_core::ErrorKind;

const ID: u64 = 5;
const BASE: u64 = 1 << 20;
const GRANTED: u64 = 1000;
/// A message is delivered at most this long after it was queued.
const MAX_DELAY: Duration = Duration::from_millis(200);

fn limits() -> SessionLimits {
    SessionLimits {
        heartbeat_interval: Duration::from_millis(100),
        liveness_timeout: Duration::from_millis(1000),
        linger: Duration::from_secs(3600),
        ..SessionLimits::default()
    }
}

#[derive(Debug, Clone)]
enum Op {
    Deliver(bool),
    Duplicate(bool),
    Advance(u64),
    Grant(u64),
    Write {
        offset: u64,
        len: u64,
    },
    EndWrite,
    Finish,
    CancelSender,
    CancelReceiver,
    Kill(bool),
    Forge(bool, u8, u64),
    /// Freeze the sender (true) or the receiver for this many ms.
    Freeze(bool, u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => any::<bool>().prop_map(Op::Deliver),
        1 => any::<bool>().prop_map(Op::Duplicate),
        4 => (1u64..150).prop_map(Op::Advance),
        1 => (20u64..800).prop_map(Op::Grant),
        3 => (0u64..1100, 1u64..400).prop_map(|(offset, len)| Op::Write { offset, len }),
        3 => Just(Op::EndWrite),
        1 => Just(Op::Finish),
        1 => Just(Op::CancelSender),
        1 => Just(Op::CancelReceiver),
        1 => any::<bool>().prop_map(Op::Kill),
        1 => (any::<bool>(), 1u8..7, 0u64..8).prop_map(|(to_s, kind, id)| Op::Forge(to_s, kind, id)),
    ]
}

/// [`op`], and freezes of either side: short ones (under half the liveness
/// timeout) and long ones (up to four times it).
fn op_with_pauses() -> impl Strategy<Value = Op> {
    prop_oneof![
        12 => op(),
        // Deadlines longer than the liveness timeout: a receiver frozen
        // with the FINISH unread may still land once it resumes.
        1 => (2000u64..6000).prop_map(Op::Grant),
        // The whole grant in one write (so that sessions do land).
        2 => Just(Op::Write { offset: 0, len: GRANTED }),
        1 => (any::<bool>(), 100u64..500).prop_map(|(s, ms)| Op::Freeze(s, ms)),
        2 => (any::<bool>(), 500u64..4000).prop_map(|(s, ms)| Op::Freeze(s, ms)),
    ]
}

struct World {
    now: Duration,
    s: SessionTable,
    r: SessionTable,
    /// Links: (queued at, bytes). `to_r`: s -> r.
    to_r: VecDeque<(Duration, Vec<u8>)>,
    to_s: VecDeque<(Duration, Vec<u8>)>,
    s_alive: bool,
    r_alive: bool,
    /// Sender writes in flight: (bytes, stopped).
    writes: Vec<(u64, bool)>,
    granted: bool,
    last_s: SessionState,
    last_r: Option<SessionState>,
    killed_at: Option<Duration>,
    survivor_final_at: Option<Duration>,
    /// The side frozen (true: the sender) and until when.
    frozen: Option<(bool, Duration)>,
    /// The longest freeze so far.
    longest_freeze: Duration,
    /// Whether the receiver was ever frozen.
    receiver_froze: bool,
    /// When the sender ended other than `Landed`, and when the receiver
    /// decided `Landed`.
    s_ended_at: Option<Duration>,
    r_landed_at: Option<Duration>,
    /// When the receiver's state turned final.
    r_final_at: Option<Duration>,
    /// When the sender's last write in flight ended (the scheduler may hold
    /// a write long after a kill; a sender is final only once quiet).
    last_write_end: Duration,
}

fn ks() -> SessionKey {
    SessionKey::new("r", ID, Role::Sender)
}
fn kr() -> SessionKey {
    SessionKey::new("s", ID, Role::Receiver)
}

fn rank(s: &SessionState) -> u8 {
    match s {
        SessionState::Waiting => 0,
        SessionState::Granted => 1,
        SessionState::Transferring => 2,
        _ => 3,
    }
}

impl World {
    fn new() -> Self {
        let mut s = SessionTable::new(limits(), 1);
        let r = SessionTable::new(limits(), 2);
        s.expect("r", ID, Duration::ZERO).unwrap();
        Self {
            now: Duration::ZERO,
            s,
            r,
            to_r: VecDeque::new(),
            to_s: VecDeque::new(),
            s_alive: true,
            r_alive: true,
            writes: Vec::new(),
            granted: false,
            last_s: SessionState::Waiting,
            last_r: None,
            killed_at: None,
            survivor_final_at: None,
            frozen: None,
            longest_freeze: Duration::ZERO,
            receiver_froze: false,
            s_ended_at: None,
            r_landed_at: None,
            r_final_at: None,
            last_write_end: Duration::ZERO,
        }
    }

    /// Whether the sender (true) or the receiver runs: alive, not frozen.
    fn runs(&self, sender: bool) -> bool {
        let alive = if sender { self.s_alive } else { self.r_alive };
        alive && self.frozen.is_none_or(|(f, _)| f != sender)
    }

    /// Lets time pass until no side is frozen.
    fn thaw(&mut self) {
        while self.frozen.is_some() {
            self.advance(50);
        }
    }

    fn collect(&mut self) {
        if self.s_alive {
            for (peer, m) in self.s.drain_outgoing() {
                assert_eq!(peer, "r");
                self.to_r.push_back((self.now, m));
            }
            for a in self.s.drain_actions() {
                let Action::StopWrites(k) = a;
                assert_eq!(k, ks());
                for w in &mut self.writes {
                    w.1 = true;
                }
            }
        }
        if self.r_alive {
            for (peer, m) in self.r.drain_outgoing() {
                assert_eq!(peer, "s");
                self.to_s.push_back((self.now, m));
            }
            assert!(self.r.drain_actions().is_empty(), "a receiver never writes");
        }
        self.check();
    }

    /// Monotone, sticky, quiet-before-final.
    fn check(&mut self) {
        if self.s_alive {
            let st = self.s.state(&ks()).expect("sender session kept (linger is long)");
            assert!(rank(&st) >= rank(&self.last_s), "sender went back: {:?} -> {st:?}", self.last_s);
            if self.last_s.is_final() {
                assert_eq!(st, self.last_s, "sender final state changed");
            }
            if st.is_final() {
                assert!(self.writes.is_empty(), "sender final with writes in flight: {st:?}");
                if st != SessionState::Landed && self.s_ended_at.is_none() {
                    self.s_ended_at = Some(self.now);
                }
            }
            self.last_s = st;
        }
        if self.r_alive {
            let st = self.r.state(&kr());
            if let (Some(a), Some(b)) = (&self.last_r, &st) {
                assert!(rank(b) >= rank(a), "receiver went back: {a:?} -> {b:?}");
                if a.is_final() {
                    assert_eq!(a, b, "receiver final state changed");
                }
            }
            if self.last_r.is_some() {
                assert!(st.is_some(), "receiver session vanished");
            }
            if matches!(st, Some(SessionState::Landed)) {
                assert!(self.writes.is_empty() || !self.s_alive, "landed with writes in flight");
                self.r_landed_at.get_or_insert(self.now);
            }
            if st.as_ref().is_some_and(SessionState::is_final) {
                self.r_final_at.get_or_insert(self.now);
            }
            self.last_r = st;
        }
        let survivor_final = if !self.s_alive {
            self.last_r.as_ref().is_none_or(|s| s.is_final())
        } else if !self.r_alive {
            self.last_s.is_final()
        } else {
            false
        };
        if survivor_final && self.survivor_final_at.is_none() {
            self.survivor_final_at = Some(self.now);
        }
    }

    fn deliver(&mut self, to_s: bool, dup: bool) {
        if self.frozen.is_some_and(|(f, _)| f == to_s) {
            return; // it waits in the frozen side's socket
        }
        let (q, alive) = if to_s { (&mut self.to_s, self.s_alive) } else { (&mut self.to_r, self.r_alive) };
        let Some((_, m)) = (if dup { q.front().cloned() } else { q.pop_front() }) else { return };
        if !alive {
            return;
        }
        if to_s {
            self.s.on_message("r", &m, self.now);
        } else {
            self.r.on_message("s", &m, self.now);
        }
        self.collect();
    }

    fn advance(&mut self, ms: u64) {
        self.now += Duration::from_millis(ms);
        // Bounded delay: anything older than MAX_DELAY arrives first.
        loop {
            let (r_runs, s_runs) = (self.frozen.is_none_or(|(f, _)| f), self.frozen.is_none_or(|(f, _)| !f));
            let old_r = r_runs && self.to_r.front().is_some_and(|(t, _)| self.now.saturating_sub(*t) >= MAX_DELAY);
            let old_s = s_runs && self.to_s.front().is_some_and(|(t, _)| self.now.saturating_sub(*t) >= MAX_DELAY);
            if old_r {
                self.deliver(false, false);
            } else if old_s {
                self.deliver(true, false);
            } else {
                break;
            }
        }
        if self.frozen.is_some_and(|(_, until)| self.now >= until) {
            self.frozen = None;
        }
        if self.runs(true) {
            self.s.tick(self.now);
        }
        if self.runs(false) {
            self.r.tick(self.now);
        }
        self.collect();
    }

    fn end_write(&mut self) {
        if let Some((len, stopped)) = self.writes.pop() {
            self.last_write_end = self.now;
            let bytes = if stopped { 0 } else { len };
            self.s.end_write(&ks(), bytes, self.now);
            self.collect();
        }
    }

    fn apply(&mut self, op: Op) {
        match op {
            Op::Deliver(to_s) => self.deliver(to_s, false),
            Op::Duplicate(to_s) => self.deliver(to_s, true),
            Op::Advance(ms) => self.advance(ms),
            Op::Grant(ms) => {
                if self.runs(false) && !self.granted {
                    let g =
                        Grant { ranges: vec![(BASE, GRANTED)], expected: GRANTED, deadline: Duration::from_millis(ms) };
                    self.r.grant_to("s", ID, g, self.now).unwrap();
                    self.granted = true;
                    self.collect();
                }
            }
            Op::Write { offset, len } => {
                if self.runs(true) {
                    // As the driver does: after a pause, confirm first.
                    if self.s.confirm_before_write(&ks(), self.now).unwrap() {
                        self.collect();
                        return;
                    }
                    let r = self.s.begin_write(&ks(), &[(BASE + offset, len)], self.now);
                    if r.is_ok() {
                        // Terminal means quiet: nothing starts toward a
                        // receiver that ended the session (a sender that
                        // paused confirms before it writes again).
                        assert!(
                            self.r_final_at.is_none() || !self.r_alive,
                            "a write began at {:?}, after the receiver ended ({:?}) as {:?}",
                            self.now,
                            self.r_final_at,
                            self.last_r
                        );
                    }
                    if offset + len > GRANTED {
                        assert!(r.is_err(), "a write outside the grant was allowed");
                    }
                    if r.is_ok() {
                        assert!(self.granted, "a write without a grant was allowed");
                        self.writes.push((len, false));
                    }
                    self.collect();
                }
            }
            Op::EndWrite => {
                if self.runs(true) {
                    self.end_write();
                }
            }
            Op::Finish => {
                if self.runs(true) {
                    let _ = self.s.finish(&ks());
                    self.collect();
                }
            }
            Op::CancelSender => {
                if self.runs(true) {
                    self.s.cancel(&ks(), None, self.now).unwrap();
                    self.collect();
                }
            }
            Op::CancelReceiver => {
                if self.runs(false) && self.granted {
                    self.r.cancel(&kr(), None, self.now).unwrap();
                    self.collect();
                }
            }
            Op::Kill(sender) => {
                if self.s_alive && self.r_alive && self.frozen.is_none() {
                    self.killed_at = Some(self.now);
                    if sender {
                        self.s_alive = false;
                        self.to_r.clear();
                        self.writes.clear(); // a dead process writes nothing
                    } else {
                        self.r_alive = false;
                        self.to_s.clear();
                    }
                }
            }
            Op::Forge(to_s, kind, id) => {
                let body = match kind {
                    1 => Body::Grant(Grant { ranges: vec![(0, 8)], expected: 8, deadline: Duration::from_secs(1) }),
                    2 => Body::Finish { bytes: GRANTED },
                    3 => Body::Quiet,
                    4 => Body::Heartbeat { reply: true },
                    _ => Body::Finish { bytes: 1 },
                };
                // Forged ids other than ours, or garbage, from the real peer.
                let m = Message { epoch: if to_s { 2 } else { 1 }, id: ID + 1 + id, body }.encode();
                let garbage = vec![0u8, b'K', b'V', b'S', 1, kind];
                // Sent by the other side, so only while it lives.
                if self.frozen.is_some() {
                } else if to_s && self.s_alive && self.r_alive {
                    self.s.on_message("r", &m, self.now);
                    self.s.on_message("r", &garbage, self.now);
                } else if !to_s && self.r_alive && self.s_alive {
                    self.r.on_message("s", &m, self.now);
                    self.r.on_message("s", &garbage, self.now);
                }
                self.collect();
            }
            Op::Freeze(sender, ms) => {
                if self.s_alive && self.r_alive && self.frozen.is_none() {
                    let d = Duration::from_millis(ms);
                    self.frozen = Some((sender, self.now + d));
                    self.longest_freeze = self.longest_freeze.max(d);
                    self.receiver_froze |= !sender;
                }
            }
        }
    }

    /// Runs `ops`, thaws a frozen side, optionally finishes (every write
    /// ended first), and settles. Returns the world and which sides lived
    /// before the settling.
    fn run(ops: Vec<Op>, finish_at_end: bool) -> (Self, bool, bool) {
        let mut w = World::new();
        for op in ops {
            w.apply(op);
        }
        w.thaw();
        if finish_at_end && w.s_alive {
            while !w.writes.is_empty() {
                w.end_write();
            }
            let _ = w.s.finish(&ks());
            w.collect();
        }
        let alive = (w.s_alive, w.r_alive);
        w.settle();
        (w, alive.0, alive.1)
    }

    /// Lets the world settle: writes end, messages flow, time passes.
    fn settle(&mut self) {
        self.thaw();
        let stop_at = self.now + Duration::from_secs(10);
        while self.now < stop_at {
            while !self.writes.is_empty() && self.s_alive {
                self.end_write();
            }
            while !self.to_r.is_empty() || !self.to_s.is_empty() {
                self.deliver(false, false);
                self.deliver(true, false);
            }
            let waiting = !self.granted && matches!(self.last_s, SessionState::Waiting) && self.r_alive;
            let s_done = !self.s_alive || self.last_s.is_final() || waiting;
            let r_done = !self.r_alive || self.last_r.as_ref().is_none_or(|s| s.is_final());
            if s_done && r_done && self.to_r.is_empty() && self.to_s.is_empty() {
                break;
            }
            self.advance(50);
        }
    }
}

proptest! {
    // SESSION_SCHEDULES=N runs N schedules per property (CI: 512).
    #![proptest_config(ProptestConfig {
        cases: std::env::var("SESSION_SCHEDULES").ok().and_then(|v| v.parse().ok()).unwrap_or(512),
        ..ProptestConfig::default()
    })]

    #[test]
    fn both_sides_agree(ops in proptest::collection::vec(op(), 1..80), finish_at_end in any::<bool>()) {
        let (w, s_alive, r_alive) = World::run(ops, finish_at_end);
        let waiting = !w.granted && matches!(w.last_s, SessionState::Waiting);
        if s_alive && !(waiting && r_alive) {
            prop_assert!(w.last_s.is_final(), "sender not final: {:?}", w.last_s);
        }
        if r_alive {
            if let Some(st) = &w.last_r {
                prop_assert!(st.is_final(), "receiver not final: {st:?}");
            }
        }
        if s_alive && r_alive {
            match &w.last_r {
                Some(r) => prop_assert_eq!(&w.last_s, r, "the sides disagree"),
                // Never granted: the sender waits (no deadline) while the
                // receiver lives, unless it cancelled.
                None => prop_assert!(
                    matches!(w.last_s, SessionState::Waiting | SessionState::Cancelled),
                    "{:?}", w.last_s
                ),
            }
        } else if let Some(k) = w.killed_at {
            // The survivor ends within the liveness timeout (plus the timer's
            // step), as failed or with an outcome already decided, counted
            // from the kill or, for a surviving sender, from the end of its
            // last write (a sender with a write in flight is not quiet, so
            // not final, however long the scheduler holds that write).
            let at = w.survivor_final_at.unwrap_or(w.now);
            let from = if s_alive { k.max(w.last_write_end) } else { k };
            let bound = limits().liveness_timeout + Duration::from_millis(350);
            prop_assert!(at <= from + bound, "survivor final {:?} after the kill (or the last write's end)", at.saturating_sub(from));
        }
    }

    #[test]
    fn pauses_never_split_landed(ops in proptest::collection::vec(op_with_pauses(), 1..80), finish_at_end in any::<bool>()) {
        let (w, s_alive, r_alive) = World::run(ops, finish_at_end);
        let unknown = matches!(&w.last_s, SessionState::Failed(e) if e.kind() == ErrorKind::OutcomeUnknown);
        if s_alive && r_alive {
            if let Some(r) = &w.last_r {
                prop_assert!(r.is_final() && w.last_s.is_final(), "not final: {:?} / {r:?}", w.last_s);
                if matches!(w.last_s, SessionState::Landed) {
                    prop_assert_eq!(r, &SessionState::Landed, "the sender landed alone");
                }
                if matches!(r, SessionState::Landed) {
                    prop_assert!(
                        matches!(w.last_s, SessionState::Landed) || unknown,
                        "the receiver landed, the sender ended {:?} (rule 13)", w.last_s
                    );
                }
                if w.longest_freeze < limits().liveness_timeout / 2 {
                    prop_assert_eq!(&w.last_s, r, "the sides disagree after pauses of at most {:?}", w.longest_freeze);
                }
            }
        }
        if unknown {
            // Only a receiver that went silent leaves the sender unsure: the
            // sender's own pauses never do (it reads the answer first).
            prop_assert!(w.receiver_froze || !r_alive, "the sender is unsure after its own pause only");
        }
        if s_alive && matches!(w.last_r, Some(SessionState::Landed)) {
            prop_assert!(matches!(w.last_s, SessionState::Landed) || unknown, "{:?}", w.last_s);
        }
        // A receiver never lands a session the sender had already ended
        // (issue 25, item 2): it confirms first after a pause of its own.
        if let (Some(ended), Some(landed)) = (w.s_ended_at, w.r_landed_at) {
            prop_assert!(landed < ended, "the receiver landed at {landed:?}, after the sender ended ({ended:?}) {:?}", w.last_s);
        }
    }
}

/// The schedules the pause property is about, spelled out:
/// - the receiver frozen with the FINISH unread for longer than the
///   liveness timeout: the sender gave up (unsure), and the receiver, once
///   resumed, asks before it lands, hears "closed" and fails: never landed
///   alone;
/// - the receiver frozen for less than the liveness timeout (but long
///   enough to notice): it asks, the sender is still waiting, both land;
/// - the sender frozen right after its FINISH while the receiver lands: the
///   sender reads the answer before it judges the receiver: both land.
#[test]
fn frozen_across_the_finish() {
    for (freeze_receiver, ms) in [(true, 2500), (true, 600), (false, 2500)] {
        let mut w = World::new();
        w.apply(Op::Grant(5000));
        w.apply(Op::Deliver(true));
        w.apply(Op::Write { offset: 0, len: GRANTED });
        w.apply(Op::EndWrite);
        w.apply(Op::Finish);
        if !freeze_receiver {
            w.apply(Op::Deliver(false)); // the receiver lands and answers
        }
        w.apply(Op::Freeze(!freeze_receiver, ms));
        w.settle();
        let r = w.last_r.clone().expect("the receiver's session");
        let case = format!("receiver frozen: {freeze_receiver}, for {ms} ms");
        if freeze_receiver && ms > 1000 {
            assert!(
                matches!(&w.last_s, SessionState::Failed(e) if e.kind() == ErrorKind::OutcomeUnknown),
                "{case}: the sender {:?}",
                w.last_s
            );
            assert!(
                matches!(&r, SessionState::Failed(e) if e.kind() == ErrorKind::PeerUnavailable),
                "{case}: the receiver {r:?}"
            );
        } else {
            assert_eq!(r, SessionState::Landed, "{case}");
            assert_eq!(w.last_s, SessionState::Landed, "{case}");
        }
        if freeze_receiver {
            assert_eq!(w.r.pauses(), 1, "{case}: the receiver noticed its pause");
        }
    }
}

/// A receiver frozen after its grant, before any write, for longer than
/// the liveness timeout: the sender gives the session up on the silence.
/// The thawed receiver asks (it paused with the session open), learns that
/// and ends the session at once, not at its deadline a minute later, so
/// its memory is free again (rule 13, pauses). Frozen for less, the
/// answer is "open" and the session goes on to land.
#[test]
fn a_thawed_receiver_learns_at_once_that_its_sender_gave_up() {
    for ms in [2500, 600] {
        let mut w = World::new();
        w.apply(Op::Grant(60_000));
        w.apply(Op::Deliver(true));
        w.apply(Op::Freeze(false, ms));
        w.thaw();
        let thawed = w.now;
        for _ in 0..20 {
            w.apply(Op::Advance(50));
        }
        let r = w.last_r.clone().expect("the receiver's session");
        if ms > 1000 {
            assert!(
                matches!(&w.last_s, SessionState::Failed(e) if e.kind() == ErrorKind::PeerUnavailable),
                "the sender {:?}",
                w.last_s
            );
            assert!(matches!(&r, SessionState::Failed(e) if e.kind() == ErrorKind::PeerUnavailable), "{r:?}");
            let took = w.r_final_at.expect("final").saturating_sub(thawed);
            assert!(took < Duration::from_secs(1), "the receiver ended {took:?} after it thawed");
        } else {
            assert!(!r.is_final() && !w.last_s.is_final(), "{r:?} / {:?}", w.last_s);
            w.apply(Op::Write { offset: 0, len: GRANTED });
            w.apply(Op::EndWrite);
            w.apply(Op::Finish);
            w.settle();
            assert_eq!(w.last_s, SessionState::Landed);
            assert_eq!(w.last_r, Some(SessionState::Landed));
        }
        assert_eq!(w.r.pauses(), 1, "frozen {ms} ms: the receiver noticed its pause");
    }
}

/// A sender that ended a session before its grant came and released it
/// (an engine dropping a request that waited too long) still refuses the
/// late grant, as it does while the session lingers: the receiver frees
/// the memory at once instead of holding an unclaimed grant until the
/// deadline.
#[test]
fn a_grant_for_a_released_session_is_refused() {
    let mut s = SessionTable::new(limits(), 1);
    let mut r = SessionTable::new(limits(), 2);
    let t = Duration::from_millis(10);
    s.expect("r", ID, t).unwrap();
    s.cancel(&ks(), None, t).unwrap();
    assert_eq!(s.state(&ks()), Some(SessionState::Cancelled));
    s.release(&ks()).unwrap();
    assert_eq!(s.state(&ks()), None);
    r.grant_to("s", ID, Grant { ranges: vec![(0, 8)], expected: 8, deadline: Duration::from_secs(60) }, t).unwrap();
    for _ in 0..3 {
        for (_, m) in r.drain_outgoing() {
            s.on_message("r", &m, t);
        }
        for (_, m) in s.drain_outgoing() {
            r.on_message("s", &m, t);
        }
    }
    let st = r.state(&kr()).expect("the receiver's session");
    assert!(st.is_final() && st != SessionState::Landed, "the receiver still holds the grant: {st:?}");
    assert_eq!(s.state(&ks()), None, "the refused grant is not taken as a new one");
}

/// A peer with nothing open is not heartbeating, so its silence is not
/// death: a new session with a peer idle for longer than the liveness
/// timeout (its entry kept by a lingering session) starts its liveness
/// window fresh instead of failing at the next tick. (A prefill that meets
/// each of 16 decodes every 4 s failed every session after the first.)
#[test]
fn a_new_session_with_a_peer_idle_past_the_liveness_timeout_starts_fresh() {
    let mut s = SessionTable::new(limits(), 1);
    let t = Duration::from_millis(10);
    s.expect("r", ID, t).unwrap();
    s.cancel(&ks(), None, t).unwrap(); // final and lingering (not released)
    let mut now = t;
    for _ in 0..50 {
        now += Duration::from_millis(100); // ticks as the driver does: no pause
        s.tick(now);
    }
    let next = SessionKey::new("r", ID + 1, Role::Sender);
    s.expect("r", ID + 1, now).unwrap();
    now += Duration::from_millis(100);
    s.tick(now);
    assert_eq!(s.state(&next), Some(SessionState::Waiting), "judged silent before it could answer");
    assert_eq!(s.pauses(), 0);
    // Still silent a liveness timeout later: now it is gone.
    for _ in 0..12 {
        now += Duration::from_millis(100);
        s.tick(now);
    }
    assert!(matches!(s.state(&next), Some(SessionState::Failed(e)) if e.kind() == ErrorKind::PeerUnavailable));
}

/// Freezes before the grant and mid-transfer, for longer than the liveness
/// timeout, on either side; once thawed, the sender tries to write every
/// byte and finish. The side that was not frozen gave the session up on
/// the silence; the frozen one, resumed, confirms before it writes or
/// lands, so nothing is written toward a receiver that ended the session
/// (checked on every write by the world), and neither side lands.
#[test]
fn frozen_before_the_grant_and_mid_transfer() {
    for freeze_sender in [true, false] {
        for mid_transfer in [false, true] {
            let case = format!("sender frozen: {freeze_sender}, mid-transfer: {mid_transfer}");
            let mut w = World::new();
            if mid_transfer {
                w.apply(Op::Grant(5000));
                w.apply(Op::Deliver(true));
                w.apply(Op::Write { offset: 0, len: GRANTED / 2 });
                w.apply(Op::EndWrite);
            }
            w.apply(Op::Freeze(freeze_sender, 2500));
            if !mid_transfer {
                w.apply(Op::Grant(5000)); // only while the receiver runs
            }
            for _ in 0..60 {
                w.apply(Op::Advance(50));
            }
            assert!(w.frozen.is_none(), "{case}: thawed");
            w.apply(Op::Grant(5000)); // a receiver frozen before it granted
            for _ in 0..4 {
                w.apply(Op::Deliver(true));
                w.apply(Op::Deliver(false));
            }
            w.apply(Op::Write { offset: 0, len: GRANTED });
            w.apply(Op::EndWrite);
            w.apply(Op::Finish);
            w.settle();
            let r = w.last_r.clone().expect("the receiver's session");
            assert!(w.last_s.is_final() && r.is_final(), "{case}: {:?} / {r:?}", w.last_s);
            assert!(
                w.last_s != SessionState::Landed && r != SessionState::Landed,
                "{case}: the sender ended {:?}, the receiver {r:?}",
                w.last_s
            );
        }
    }
}

/// A side that pauses again every time it asks (each pause long enough to
/// notice, too short for its peer to give up) stops asking after
/// `MAX_CHECKS` questions and fails the session, whichever side it is;
/// the other side ends failed too, and nobody lands.
#[test]
fn a_side_that_keeps_pausing_while_it_asks_gives_up() {
    for sender in [false, true] {
        let case = if sender { "the sender" } else { "the receiver" };
        let mut w = World::new();
        w.apply(Op::Grant(60_000));
        w.apply(Op::Deliver(true));
        w.apply(Op::Write { offset: 0, len: if sender { GRANTED / 2 } else { GRANTED } });
        w.apply(Op::EndWrite);
        if !sender {
            w.apply(Op::Finish);
        }
        for _ in 0..8 {
            w.apply(Op::Freeze(sender, 400));
            for _ in 0..10 {
                w.apply(Op::Advance(50));
            }
            if sender {
                // Each write attempt asks (or gives up once it asked enough).
                w.apply(Op::Write { offset: GRANTED / 2, len: GRANTED / 2 });
                w.apply(Op::EndWrite);
            }
            w.apply(Op::Deliver(!sender)); // the question (or FINISH) to the peer
            w.apply(Op::Deliver(sender)); // the answer back
        }
        w.settle();
        let gave_up = if sender { w.last_s.clone() } else { w.last_r.clone().expect("the receiver's session") };
        assert!(
            matches!(&gave_up, SessionState::Failed(e) if e.to_string().contains("kept pausing")),
            "{case}: {gave_up:?}"
        );
        let r = w.last_r.clone().expect("the receiver's session");
        assert!(w.last_s.is_final() && r.is_final(), "{case}: {:?} / {r:?}", w.last_s);
        assert!(w.last_s != SessionState::Landed && r != SessionState::Landed, "{case}: {:?} / {r:?}", w.last_s);
    }
}

/// Issue 27, item 3: grants no local sender expects yet (a receiver may
/// grant first) take places in the table only up to their own bounds, per
/// peer and in all; over them they are refused (the receiver frees its
/// memory). A claimed grant (`expect`) no longer counts, and grants a
/// sender expects are never refused for it.
#[test]
fn unclaimed_grants_are_bounded_per_peer_and_in_all() {
    let lim = SessionLimits { max_unclaimed: 6, max_unclaimed_per_peer: 4, ..limits() };
    let mut s = SessionTable::new(lim, 1);
    let now = Duration::ZERO;
    let grant = |id: u64| {
        let g = Grant { ranges: vec![(BASE, 64)], expected: 64, deadline: Duration::from_secs(60) };
        Message { epoch: 2, id, body: Body::Grant(g) }.encode()
    };
    let held = |s: &SessionTable, peer: &str, id: u64| {
        s.state(&SessionKey::new(peer, id, Role::Sender)) == Some(SessionState::Granted)
    };
    let refused = |s: &mut SessionTable| -> Vec<(String, u64, String)> {
        s.drain_outgoing()
            .into_iter()
            .filter_map(|(to, bytes)| match kvmove_policy::session::wire::decode(&bytes)?.body {
                Body::Refuse(v) => Some((to, kvmove_policy::session::wire::decode(&bytes)?.id, v.reason)),
                _ => None,
            })
            .collect()
    };
    for id in 0..6 {
        s.on_message("a", &grant(id), now);
    }
    assert!((0..4).all(|id| held(&s, "a", id)), "the first four of peer a are held");
    let r = refused(&mut s);
    assert_eq!(r.iter().map(|(to, id, _)| (to.as_str(), *id)).collect::<Vec<_>>(), [("a", 4), ("a", 5)]);
    assert!(r.iter().all(|(_, _, why)| why.contains("max_unclaimed_per_peer")), "{r:?}");
    for id in 0..3 {
        s.on_message("b", &grant(id), now);
    }
    assert!(held(&s, "b", 0) && held(&s, "b", 1) && !held(&s, "b", 2), "six in all");
    let r = refused(&mut s);
    assert!(r.len() == 1 && r[0].2.contains("max_unclaimed"), "{r:?}");
    // A grant the sender expects is not held back by the bound.
    s.expect("c", 9, now).unwrap();
    s.on_message("c", &grant(9), now);
    assert!(held(&s, "c", 9));
    // Claiming one of peer a's makes room for another of its own.
    s.expect("a", 0, now).unwrap();
    s.on_message("a", &grant(10), now);
    assert!(held(&s, "a", 10) && held(&s, "a", 0));
    assert!(refused(&mut s).is_empty());
}

/// Delivers everything either side has queued for the other, both ways,
/// then ticks both at `now`.
fn exchange(s: &mut SessionTable, r: &mut SessionTable, now: Duration) {
    for _ in 0..4 {
        for (_, m) in s.drain_outgoing() {
            r.on_message("s", &m, now);
        }
        for (_, m) in r.drain_outgoing() {
            s.on_message("r", &m, now);
        }
    }
    s.tick(now);
    r.tick(now);
}

/// A sender frozen after its writes and before its FINISH, for longer than
/// the liveness timeout: the receiver gives the session up on the silence
/// and its engine releases it (vLLM's connector does so at once). The
/// thawed sender's FINISH is answered at once, outcome unknown (this side
/// no longer knows it, and never claims an outcome a landed one could
/// contradict), so the sender ends within a round trip, not at its deadline
/// a minute later while the receiver answers its heartbeats (a vLLM prefill
/// SIGSTOPped mid-push held its blocks for two minutes).
#[test]
fn a_finish_for_a_session_the_receiver_released_is_answered() {
    let mut s = SessionTable::new(limits(), 1);
    let mut r = SessionTable::new(limits(), 2);
    let mut now = Duration::from_millis(10);
    s.expect("r", ID, now).unwrap();
    let g = Grant { ranges: vec![(BASE, GRANTED)], expected: GRANTED, deadline: Duration::from_secs(60) };
    r.grant_to("s", ID, g, now).unwrap();
    exchange(&mut s, &mut r, now);
    assert_eq!(s.state(&ks()), Some(SessionState::Granted));
    s.begin_write(&ks(), &[(BASE, GRANTED)], now).unwrap();
    s.end_write(&ks(), GRANTED, now);
    exchange(&mut s, &mut r, now);

    // The sender is frozen: only the receiver runs; what it sends waits in
    // the sender's socket.
    let mut queued = Vec::new();
    for _ in 0..30 {
        now += Duration::from_millis(100);
        r.tick(now);
        queued.extend(r.drain_outgoing());
    }
    let st = r.state(&kr()).expect("the receiver's session");
    assert!(matches!(&st, SessionState::Failed(e) if e.kind() == ErrorKind::PeerUnavailable), "{st:?}");
    r.release(&kr()).unwrap();

    // Thawed: it reads what came meanwhile, then finishes (no write left,
    // so nothing made it ask first).
    now += Duration::from_millis(100);
    for (_, m) in queued {
        s.on_message("r", &m, now);
    }
    s.tick(now);
    s.finish(&ks()).unwrap();
    let finished = now;
    while now < finished + Duration::from_secs(3) && !s.state(&ks()).is_some_and(|x| x.is_final()) {
        now += Duration::from_millis(50);
        exchange(&mut s, &mut r, now);
    }
    let st = s.state(&ks()).expect("the sender's session");
    assert!(matches!(&st, SessionState::Failed(e) if e.kind() == ErrorKind::OutcomeUnknown), "the sender: {st:?}");
    let took = now.saturating_sub(finished);
    assert!(took <= Duration::from_millis(200), "the sender ended {took:?} after its FINISH");
    assert_eq!(r.state(&kr()), None, "the answer opened nothing on the receiver");
}

/// Scattered ranges in descending order (a KV cache's freed blocks, as
/// vLLM hands them back): more than one GRANT message holds.
fn scattered(n: u64) -> Vec<(u64, u64)> {
    (0..n).rev().map(|i| (BASE + i * 256, 128)).collect()
}

/// A grant of 1000 ranges travels in parts and arrives whole, in order;
/// writes are checked against all of it (inside any range: allowed; in a
/// gap, or bridging one: refused); the session lands.
#[test]
fn a_grant_of_many_ranges_arrives_whole_and_bounds_the_writes() {
    let mut s = SessionTable::new(limits(), 1);
    let mut r = SessionTable::new(limits(), 2);
    let now = Duration::from_millis(10);
    s.expect("r", ID, now).unwrap();
    let ranges = scattered(1000);
    let g = Grant { ranges: ranges.clone(), expected: 1000 * 128, deadline: Duration::from_secs(60) };
    r.grant_to("s", ID, g.clone(), now).unwrap();
    let out = r.drain_outgoing();
    assert!(out.len() >= 4, "1000 ranges went in {} message(s)", out.len());
    for (_, m) in out {
        s.on_message("r", &m, now);
    }
    assert_eq!(s.grant(&ks()), Some(g), "the sender's grant is the receiver's, in order");
    for (i, &(a, l)) in ranges.iter().enumerate().step_by(97) {
        s.begin_write(&ks(), &[(a, l)], now).unwrap_or_else(|e| panic!("range {i}: {e}"));
        s.end_write(&ks(), 0, now);
    }
    for bad in [(BASE + 128, 1), (BASE + 100, 100), (BASE - 1, 2), (BASE + 999 * 256 + 120, 16)] {
        let e = s.begin_write(&ks(), &[bad], now).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::OutOfBounds, "{bad:?}");
    }
    for &(a, l) in &ranges {
        s.begin_write(&ks(), &[(a, l)], now).unwrap();
        s.end_write(&ks(), l, now);
    }
    s.finish(&ks()).unwrap();
    exchange(&mut s, &mut r, now);
    assert_eq!(s.state(&ks()), Some(SessionState::Landed));
    assert_eq!(r.state(&kr()), Some(SessionState::Landed));
}

/// A grant one of whose parts never arrived is never taken as a smaller
/// grant: the sender fails the session and tells the receiver, which frees
/// the memory at once (both end failed, nothing written). Parts whose
/// GRANT never comes are forgotten after the liveness timeout: a GRANT
/// after that is not taken either.
#[test]
fn a_grant_missing_a_part_is_refused_on_both_sides() {
    let mut s = SessionTable::new(limits(), 1);
    let mut r = SessionTable::new(limits(), 2);
    let now = Duration::from_millis(10);
    s.expect("r", ID, now).unwrap();
    let g = Grant { ranges: scattered(1000), expected: 1000 * 128, deadline: Duration::from_secs(60) };
    r.grant_to("s", ID, g, now).unwrap();
    for (i, (_, m)) in r.drain_outgoing().into_iter().enumerate() {
        if i != 1 {
            s.on_message("r", &m, now);
        }
    }
    let st = s.state(&ks()).unwrap();
    assert!(matches!(&st, SessionState::Failed(e) if e.kind() == ErrorKind::InvalidRequest), "{st:?}");
    assert_eq!(s.grant(&ks()), None);
    exchange(&mut s, &mut r, now);
    let st = r.state(&kr()).unwrap();
    assert!(matches!(&st, SessionState::Failed(e) if e.kind() == ErrorKind::InvalidRequest), "{st:?}");

    // Parts, then a GRANT only after the liveness timeout.
    let id = ID + 1;
    let key = SessionKey::new("r", id, Role::Sender);
    let mut now = now;
    s.expect("r", id, now).unwrap();
    let g = Grant { ranges: scattered(600), expected: 600 * 128, deadline: Duration::from_secs(60) };
    r.grant_to("s", id, g, now).unwrap();
    let mut msgs = r.drain_outgoing();
    let last = msgs.pop().unwrap();
    for (_, m) in msgs {
        s.on_message("r", &m, now);
    }
    for _ in 0..12 {
        now += Duration::from_millis(100);
        s.tick(now);
        for (_, m) in r.drain_outgoing() {
            s.on_message("r", &m, now);
        }
        for (_, m) in s.drain_outgoing() {
            r.on_message("s", &m, now);
        }
        r.tick(now);
    }
    s.on_message("r", &last.1, now);
    assert_eq!(s.grant(&key), None, "a grant whose parts were forgotten was taken");
    assert_eq!(s.state(&key), Some(SessionState::Waiting));
}

/// What a write is checked against: the union of the granted ranges, in
/// any order; spanning two that touch or overlap is inside, a gap, an
/// empty range or an overflowing one never is, and the error names the
/// first request outside.
#[test]
fn grant_bounds_are_the_union_of_the_ranges() {
    let b = GrantBounds::new(&[(100, 50), (0, 100), (300, 10), (305, 20), (400, 0)]);
    for ok in [(0, 150), (50, 100), (300, 25), (149, 1)] {
        b.check(&[ok]).unwrap_or_else(|e| panic!("{ok:?}: {e}"));
    }
    for bad in [(140, 20), (150, 1), (299, 2), (400, 1), (10, 0), (u64::MAX, 2)] {
        assert_eq!(b.check(&[bad]).unwrap_err().kind(), ErrorKind::OutOfBounds, "{bad:?}");
    }
    let e = b.check(&[(0, 1), (200, 1)]).unwrap_err();
    assert_eq!(e.context_value("request"), Some("1"), "{e}");
}
