//! The session messages, carried as notifications (rule 11's channel).
//!
//! ```text
//! offset size field
//!   0     4   magic "\0KVS" (a plain notification starting with it is not
//!             delivered to the user when sessions run)
//!   4     1   version (1)
//!   5     1   type (Kind)
//!   6     8   epoch of the sender's session table (new on every start)
//!  14     8   session id (0 in HEARTBEAT)
//!  22     -   body:
//!             GRANT:  deadline_ms u64, expected u64, n u16, n x (addr u64, len u64)
//!             GRANT_MORE: part u16, parts u16, n u16, n x (addr u64, len u64)
//!             FINISH: bytes u64
//!             END, CANCEL, REFUSE: outcome u8, error kind u8, reason_len u16,
//!                     reason (UTF-8)
//!             HEARTBEAT: reply wanted u8
//!             QUIET: empty
//! ```
//! All integers little-endian. A decoder error means "ignore the message".
//!
//! A grant with more ranges than one notification holds
//! ([`GRANT_RANGES_PER_MESSAGE`]) travels as GRANT_MORE parts 0 to
//! `parts - 1`, in order, then the GRANT with its last ranges; the sender
//! puts the ranges back together in that order (notifications keep their
//! order per pair, rule 11). At most [`MAX_GRANT_RANGES`] ranges in all.
//!
//! Several messages to one peer may travel as one notification, a BUNDLE:
//! magic, version, type 8, count u16, then count x (len u16, message); a
//! bundle never holds a bundle. The driver bundles what queued up while the
//! previous notification was in flight, so a busy pair pays one round trip
//! for many messages.

use std::time::Duration;

use transport_core::ErrorKind;
use transport_core::MAX_NOTIFY_LEN;

/// First bytes of every session message.
pub const MAGIC: [u8; 4] = *b"\0KVS";
const VERSION: u8 = 1;
const HEADER: usize = 22;
/// Most ranges a GRANT message carries (it fits one notification); a
/// larger grant sends its first ranges ahead in GRANT_MORE parts.
pub const GRANT_RANGES_PER_MESSAGE: usize = (MAX_NOTIFY_LEN - HEADER - 18) / 16;
/// Most ranges a GRANT_MORE part carries.
pub const GRANT_MORE_RANGES: usize = (MAX_NOTIFY_LEN - HEADER - 6) / 16;
/// Most ranges in one grant, all parts together (a sender holds at most
/// 16 bytes for each while the grant lasts: 1 MiB). A KV cache in
/// scattered blocks needs one range per block per plane (layer, or key and
/// value of a layer): 64 planes of 1024 scattered blocks.
pub const MAX_GRANT_RANGES: usize = 65536;
/// Longest reason text carried by END.
pub const MAX_REASON: usize = 512;

/// What the receiver allows: where the sender may write, how much, by when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// Remote ranges `(addr, len)` in the receiver's registered memory.
    pub ranges: Vec<(u64, u64)>,
    /// Bytes the sender must report written when it finishes.
    pub expected: u64,
    /// Time from the grant to the session's deadline.
    pub deadline: Duration,
}

/// The final outcome the receiver decides and both sides adopt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Landed = 1,
    Failed = 2,
    Cancelled = 3,
    Expired = 4,
}

/// An outcome with the error that explains it (`kind` and `reason` matter
/// for `Failed`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub outcome: Outcome,
    pub kind: ErrorKind,
    pub reason: String,
}

/// One decoded session message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Body {
    /// Receiver -> sender: the transfer is admitted.
    Grant(Grant),
    /// Receiver -> sender: the first ranges of a grant too large for one
    /// message, part `part` of `parts`; the GRANT follows with the rest.
    GrantMore { part: u16, parts: u16, ranges: Vec<(u64, u64)> },
    /// Sender -> receiver: every write completed; `bytes` written in all.
    Finish { bytes: u64 },
    /// Sender -> receiver: the sender stopped (it is quiet) and asks to
    /// end the session as `outcome` (`Cancelled`, or `Failed` when its
    /// policy gave up on a write).
    Cancel(Verdict),
    /// Receiver -> sender: the session's final outcome.
    End(Verdict),
    /// Sender -> receiver: a grant that came after the sender had already
    /// ended the session (cancelled or failed before any grant), or that its
    /// table had no room for; nothing was written, and the sender's outcome
    /// stands on both sides.
    Refuse(Verdict),
    /// Sender -> receiver: after an END that is not `Landed`, the sender is
    /// quiet (nothing of the session is on the wire any more).
    Quiet,
    /// Liveness, either way; `reply` asks the peer to answer at once.
    Heartbeat { reply: bool },
    /// Either way, after the asking side paused with the session open (its
    /// peer may have given up on it meanwhile): is the session still open
    /// on your side? A receiver asks before it decides `Landed` on a
    /// FINISH; a sender (`by_sender`) before it writes again.
    Check { by_sender: bool },
    /// The answer to CHECK (`to_sender`: the sender asked). `open`: the
    /// session is open here and nothing is decided; otherwise it has ended
    /// (or is ending, or was forgotten).
    Confirm { open: bool, to_sender: bool },
}

/// A session message with its header fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub epoch: u64,
    pub id: u64,
    pub body: Body,
}

#[derive(Clone, Copy)]
enum Kind {
    Grant = 1,
    Finish = 2,
    Cancel = 3,
    End = 4,
    Quiet = 5,
    Heartbeat = 6,
    Refuse = 7,
    // 8 is a bundle's type.
    Check = 9,
    Confirm = 10,
    GrantMore = 11,
}

const BUNDLE: u8 = 8;
const BUNDLE_HEADER: usize = 8;

/// Whether a notification is a session message or bundle (by its magic).
pub fn is_session_message(msg: &[u8]) -> bool {
    msg.len() >= BUNDLE_HEADER && msg[..4] == MAGIC
}

/// Packs encoded messages into as few notifications as possible, in
/// order; a lone message stays as it is. Messages that cannot fit a bundle
/// with others travel alone.
pub fn bundle(msgs: Vec<Vec<u8>>) -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = Vec::new();
    let mut cur: Vec<Vec<u8>> = Vec::new();
    let mut size = BUNDLE_HEADER;
    let flush = |cur: &mut Vec<Vec<u8>>, out: &mut Vec<Vec<u8>>| match cur.len() {
        0 => {}
        1 => out.append(cur),
        n => {
            let mut b = Vec::with_capacity(MAX_NOTIFY_LEN);
            b.extend_from_slice(&MAGIC);
            b.push(VERSION);
            b.push(BUNDLE);
            b.extend_from_slice(&(n as u16).to_le_bytes());
            for m in cur.drain(..) {
                b.extend_from_slice(&(m.len() as u16).to_le_bytes());
                b.extend_from_slice(&m);
            }
            out.push(b);
        }
    };
    for m in msgs {
        let need = 2 + m.len();
        if size + need > MAX_NOTIFY_LEN || cur.len() >= usize::from(u16::MAX) {
            flush(&mut cur, &mut out);
            size = BUNDLE_HEADER;
        }
        size += need;
        cur.push(m);
    }
    flush(&mut cur, &mut out);
    out
}

/// The messages of a notification: the parts of a bundle, or the
/// notification itself. `None` for a malformed bundle (ignored whole).
pub fn unbundle(msg: &[u8]) -> Option<Vec<&[u8]>> {
    if !(is_session_message(msg) && msg[4] == VERSION && msg[5] == BUNDLE) {
        return Some(vec![msg]);
    }
    let mut r = Reader(&msg[6..]);
    let n = usize::from(r.u16()?);
    let mut parts = Vec::with_capacity(n.min(MAX_NOTIFY_LEN / 2));
    for _ in 0..n {
        let len = usize::from(r.u16()?);
        let part = r.take(len)?;
        if is_session_message(part) && part[5] == BUNDLE {
            return None;
        }
        parts.push(part);
    }
    if !r.0.is_empty() {
        return None;
    }
    Some(parts)
}

/// Whether a notification is a session notice that ends a session other
/// than by landing (CANCEL, or END that is not `Landed`). Used by the
/// conformance suite's broken transport that drops them.
pub fn is_failure_notice(msg: &[u8]) -> bool {
    match unbundle(msg) {
        Some(parts) if parts.len() > 1 || parts.first().is_some_and(|p| p.len() != msg.len()) => {
            return parts.iter().any(|p| is_failure_notice(p));
        }
        _ => {}
    }
    match decode(msg) {
        Some(Message { body: Body::Cancel(_) | Body::Refuse(_), .. }) => true,
        Some(Message { body: Body::End(v), .. }) => v.outcome != Outcome::Landed,
        _ => false,
    }
}

impl Message {
    /// Encodes the message; the result is at most `MAX_NOTIFY_LEN` bytes
    /// (ranges beyond [`MAX_GRANT_RANGES`] and reason text beyond
    /// [`MAX_REASON`] are refused earlier, by the table).
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(64);
        b.extend_from_slice(&MAGIC);
        b.push(VERSION);
        let kind = match &self.body {
            Body::Grant(_) => Kind::Grant,
            Body::GrantMore { .. } => Kind::GrantMore,
            Body::Finish { .. } => Kind::Finish,
            Body::Cancel(_) => Kind::Cancel,
            Body::End(_) => Kind::End,
            Body::Refuse(_) => Kind::Refuse,
            Body::Quiet => Kind::Quiet,
            Body::Heartbeat { .. } => Kind::Heartbeat,
            Body::Check { .. } => Kind::Check,
            Body::Confirm { .. } => Kind::Confirm,
        };
        b.push(kind as u8);
        b.extend_from_slice(&self.epoch.to_le_bytes());
        b.extend_from_slice(&self.id.to_le_bytes());
        match &self.body {
            Body::Grant(g) => {
                let ms = u64::try_from(g.deadline.as_millis()).unwrap_or(u64::MAX);
                b.extend_from_slice(&ms.to_le_bytes());
                b.extend_from_slice(&g.expected.to_le_bytes());
                put_ranges(&mut b, &g.ranges, GRANT_RANGES_PER_MESSAGE);
            }
            Body::GrantMore { part, parts, ranges } => {
                b.extend_from_slice(&part.to_le_bytes());
                b.extend_from_slice(&parts.to_le_bytes());
                put_ranges(&mut b, ranges, GRANT_MORE_RANGES);
            }
            Body::Finish { bytes } => b.extend_from_slice(&bytes.to_le_bytes()),
            Body::End(v) | Body::Cancel(v) | Body::Refuse(v) => {
                let reason = &v.reason;
                b.push(v.outcome as u8);
                b.push(v.kind.code());
                let mut r = reason.as_bytes();
                if r.len() > MAX_REASON {
                    let mut cut = MAX_REASON;
                    while !reason.is_char_boundary(cut) {
                        cut -= 1;
                    }
                    r = &r[..cut];
                }
                b.extend_from_slice(&(r.len() as u16).to_le_bytes());
                b.extend_from_slice(r);
            }
            Body::Heartbeat { reply } => b.push(u8::from(*reply)),
            Body::Check { by_sender } => b.push(u8::from(*by_sender)),
            Body::Confirm { open, to_sender } => b.extend_from_slice(&[u8::from(*open), u8::from(*to_sender)]),
            Body::Quiet => {}
        }
        b
    }
}

/// Count and ranges, at most `max` of them (more are refused earlier).
fn put_ranges(b: &mut Vec<u8>, ranges: &[(u64, u64)], max: usize) {
    let n = ranges.len().min(max);
    b.extend_from_slice(&(n as u16).to_le_bytes());
    for (a, l) in ranges.iter().take(n) {
        b.extend_from_slice(&a.to_le_bytes());
        b.extend_from_slice(&l.to_le_bytes());
    }
}

/// Splits a grant's ranges into the messages that carry them: GRANT_MORE
/// parts (none when they fit one GRANT), then the GRANT. `None` when the
/// grant has more than [`MAX_GRANT_RANGES`] ranges.
pub fn grant_messages(g: &Grant) -> Option<Vec<Body>> {
    if g.ranges.len() > MAX_GRANT_RANGES {
        return None;
    }
    let last = g.ranges.len().min(GRANT_RANGES_PER_MESSAGE);
    let (ahead, tail) = g.ranges.split_at(g.ranges.len() - last);
    let parts = u16::try_from(ahead.len().div_ceil(GRANT_MORE_RANGES)).ok()?;
    let mut out = Vec::with_capacity(usize::from(parts) + 1);
    for (i, chunk) in ahead.chunks(GRANT_MORE_RANGES).enumerate() {
        let part = u16::try_from(i).ok()?;
        out.push(Body::GrantMore { part, parts, ranges: chunk.to_vec() });
    }
    out.push(Body::Grant(Grant { ranges: tail.to_vec(), expected: g.expected, deadline: g.deadline }));
    Some(out)
}

fn flag(b: u8) -> Option<bool> {
    match b {
        0 => Some(false),
        1 => Some(true),
        _ => None,
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn u16(&mut self) -> Option<u16> {
        self.take(2).and_then(|b| b.try_into().ok()).map(u16::from_le_bytes)
    }
    fn u64(&mut self) -> Option<u64> {
        self.take(8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes)
    }
}

/// A count and that many ranges, at most `max`, none overflowing.
fn get_ranges(r: &mut Reader<'_>, max: usize) -> Option<Vec<(u64, u64)>> {
    let n = usize::from(r.u16()?);
    if n > max {
        return None;
    }
    let mut ranges = Vec::with_capacity(n);
    for _ in 0..n {
        let a = r.u64()?;
        let l = r.u64()?;
        a.checked_add(l)?;
        ranges.push((a, l));
    }
    Some(ranges)
}

/// Decodes a session message; `None` for anything malformed (wrong magic,
/// version or type, short, trailing bytes, bad values).
pub fn decode(msg: &[u8]) -> Option<Message> {
    if !is_session_message(msg) || msg.len() > MAX_NOTIFY_LEN {
        return None;
    }
    let mut r = Reader(&msg[4..]);
    if r.u8()? != VERSION {
        return None;
    }
    let ty = r.u8()?;
    let epoch = r.u64()?;
    let id = r.u64()?;
    let body = match ty {
        1 => {
            let ms = r.u64()?;
            let expected = r.u64()?;
            let ranges = get_ranges(&mut r, GRANT_RANGES_PER_MESSAGE)?;
            Body::Grant(Grant { ranges, expected, deadline: Duration::from_millis(ms) })
        }
        11 => {
            let part = r.u16()?;
            let parts = r.u16()?;
            if part >= parts {
                return None;
            }
            let ranges = get_ranges(&mut r, GRANT_MORE_RANGES)?;
            if ranges.is_empty() {
                return None;
            }
            Body::GrantMore { part, parts, ranges }
        }
        2 => Body::Finish { bytes: r.u64()? },
        3 | 4 | 7 => {
            let outcome = match r.u8()? {
                1 => Outcome::Landed,
                2 => Outcome::Failed,
                3 => Outcome::Cancelled,
                4 => Outcome::Expired,
                _ => return None,
            };
            let kind = ErrorKind::from_code(r.u8()?);
            let n = usize::from(r.u16()?);
            if n > MAX_REASON {
                return None;
            }
            let reason = std::str::from_utf8(r.take(n)?).ok()?.to_string();
            let v = Verdict { outcome, kind, reason };
            match ty {
                3 => Body::Cancel(v),
                4 => Body::End(v),
                _ => Body::Refuse(v),
            }
        }
        5 => Body::Quiet,
        6 => Body::Heartbeat { reply: flag(r.u8()?)? },
        9 => Body::Check { by_sender: flag(r.u8()?)? },
        10 => Body::Confirm { open: flag(r.u8()?)?, to_sender: flag(r.u8()?)? },
        _ => return None,
    };
    if !r.0.is_empty() {
        return None;
    }
    Some(Message { epoch, id, body })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> Vec<Message> {
        let g = Grant { ranges: vec![(4096, 100), (1 << 40, 7)], expected: 107, deadline: Duration::from_millis(1500) };
        [
            Body::Grant(g),
            Body::Finish { bytes: 107 },
            Body::Cancel(Verdict { outcome: Outcome::Cancelled, kind: ErrorKind::Cancelled, reason: "user".into() }),
            Body::End(Verdict { outcome: Outcome::Expired, kind: ErrorKind::Timeout, reason: "deadline".into() }),
            Body::Quiet,
            Body::Heartbeat { reply: true },
            Body::Refuse(Verdict {
                outcome: Outcome::Failed,
                kind: ErrorKind::ResourceExhausted,
                reason: "full".into(),
            }),
            Body::Check { by_sender: false },
            Body::Confirm { open: true, to_sender: true },
            Body::Confirm { open: false, to_sender: false },
            Body::GrantMore { part: 1, parts: 3, ranges: vec![(8192, 64), (0, 1)] },
        ]
        .into_iter()
        .map(|body| Message { epoch: 9, id: 42, body })
        .collect()
    }

    #[test]
    fn round_trip() {
        for m in all() {
            let b = m.encode();
            assert!(b.len() <= MAX_NOTIFY_LEN);
            assert_eq!(decode(&b), Some(m));
        }
    }

    #[test]
    fn malformed_is_none() {
        for m in all() {
            let b = m.encode();
            for cut in 0..b.len() {
                assert_eq!(decode(&b[..cut]), None, "{m:?} cut at {cut}");
            }
            let mut longer = b.clone();
            longer.push(0);
            assert_eq!(decode(&longer), None);
        }
        let mut b = all()[0].encode();
        b[5] = 77;
        assert_eq!(decode(&b), None);
        assert_eq!(decode(b"hello, not a session message"), None);
    }

    #[test]
    fn failure_notices() {
        let v: Vec<bool> = all().iter().map(|m| is_failure_notice(&m.encode())).collect();
        assert_eq!(v, vec![false, false, true, true, false, false, true, false, false, false, false]);
    }

    #[test]
    fn bundles_round_trip_and_refuse_garbage() {
        let msgs: Vec<Vec<u8>> = (0..300).map(|i| all()[i % 7].encode()).collect();
        let packed = bundle(msgs.clone());
        assert!(packed.len() > 1 && packed.len() < 30, "{}", packed.len());
        let mut back = Vec::new();
        for b in &packed {
            assert!(b.len() <= MAX_NOTIFY_LEN);
            back.extend(unbundle(b).unwrap().into_iter().map(<[u8]>::to_vec));
        }
        assert_eq!(back, msgs);
        assert_eq!(bundle(vec![msgs[0].clone()]), vec![msgs[0].clone()]);
        assert!(is_failure_notice(&bundle(vec![msgs[0].clone(), msgs[2].clone()])[0]));
        let mut bad = packed[0].clone();
        bad.truncate(bad.len() - 1);
        assert_eq!(unbundle(&bad), None);
        let inner = bundle(vec![msgs[0].clone(), msgs[1].clone()]).remove(0);
        let nested = bundle(vec![inner, msgs[2].clone()]);
        assert_eq!(nested.len(), 1);
        assert!(unbundle(&nested[0]).is_none(), "a bundle inside a bundle is refused");
    }

    #[test]
    fn max_grant_fits() {
        let g = Grant { ranges: vec![(1, 1); GRANT_RANGES_PER_MESSAGE], expected: 1, deadline: Duration::ZERO };
        let b = Message { epoch: 1, id: 1, body: Body::Grant(g) }.encode();
        assert!(b.len() <= MAX_NOTIFY_LEN, "{}", b.len());
        assert!(decode(&b).is_some());
        let more = Body::GrantMore { part: 0, parts: 1, ranges: vec![(1, 1); GRANT_MORE_RANGES] };
        let b = Message { epoch: 1, id: 1, body: more }.encode();
        assert!(b.len() <= MAX_NOTIFY_LEN, "{}", b.len());
        assert!(decode(&b).is_some());
    }

    #[test]
    fn large_grants_split_in_order_and_back() {
        for n in [1, GRANT_RANGES_PER_MESSAGE, GRANT_RANGES_PER_MESSAGE + 1, 1000, MAX_GRANT_RANGES] {
            let ranges: Vec<(u64, u64)> = (0..n as u64).rev().map(|i| (i * 128, 64)).collect();
            let g = Grant { ranges, expected: 7, deadline: Duration::from_secs(3) };
            let bodies = grant_messages(&g).unwrap();
            let mut back = Vec::new();
            let mut next = 0u16;
            for (i, body) in bodies.iter().enumerate() {
                let b = Message { epoch: 1, id: 2, body: body.clone() }.encode();
                assert!(b.len() <= MAX_NOTIFY_LEN);
                match decode(&b).unwrap().body {
                    Body::GrantMore { part, parts, ranges } => {
                        assert_eq!((part, usize::from(parts)), (next, bodies.len() - 1));
                        next += 1;
                        back.extend(ranges);
                    }
                    Body::Grant(last) => {
                        assert_eq!(i, bodies.len() - 1, "the GRANT comes last");
                        assert_eq!((last.expected, last.deadline), (g.expected, g.deadline));
                        back.extend(last.ranges);
                    }
                    other => panic!("{other:?}"),
                }
            }
            assert_eq!(back, g.ranges, "{n} ranges");
        }
        let g = Grant { ranges: vec![(0, 1); MAX_GRANT_RANGES + 1], expected: 1, deadline: Duration::ZERO };
        assert!(grant_messages(&g).is_none());
        // A part numbered past its count, and an empty part, are malformed.
        for (part, parts, ranges) in [(3, 3, vec![(0, 1)]), (0, 1, vec![])] {
            let b = Message { epoch: 1, id: 1, body: Body::GrantMore { part, parts, ranges } }.encode();
            assert_eq!(decode(&b), None);
        }
    }
}
