//! What a handshaken connection's requests ask for, decided without I/O:
//! a frame's header in, one [`Request`] out (or the reason the connection
//! is closed). Every check the server makes before it touches memory or
//! queues a notification is here, once: the header's own validity, the
//! engine generation the frame was meant for, the region that holds the
//! whole range with the access asked for, and what the handshake allowed
//! (same-host copies). The driver (`server.rs`) moves the bytes the
//! request names (reads the payload, copies, answers) and owns the timers
//! (`server_idle_timeout` bounds each of its waits); nothing here waits,
//! allocates per frame, or reads a clock.
//!
//! The machine is fuzzed in process (`fuzz/fuzz_targets/requests.rs`,
//! through [`fuzzing::check_frames`]): frames built from arbitrary fields,
//! fed to it with a driver that applies what it decides to real memory,
//! checked against a model of that memory. The socket fuzzer
//! (`fuzz/fuzz_targets/server.rs`) covers the driver around it.

use std::sync::Arc;

use transport_core::{check_received, Notification};

use crate::proto::{self, FrameType, Header, ProtoError, Status, HEADER_LEN};
use crate::regions::{Region, RegionTable};

/// What a handshaken connection's client may do by same-host copies
/// (agreed in the handshake).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Peer {
    /// The client's verified process: its WRITEs may name source bytes
    /// there instead of carrying them.
    pub pull_from: Option<u32>,
    /// Both sides offered same-host copies: a READ may ask for an answer
    /// without payload (the client copies from this process itself).
    pub reads: bool,
}

/// Where a request's bytes go or come from: the registered region holding
/// the whole range with the access asked for, or the status to answer.
pub(crate) type Target = std::result::Result<Arc<Region>, Status>;

/// One request, checked.
#[derive(Debug)]
pub(crate) enum Request {
    /// Answer with the descriptor of every region peers may reach
    /// ([`Requests::describe`]).
    Describe { id: u64 },
    /// A WRITE whose bytes stay in the client process `pid`: its 8-byte
    /// payload is their address there.
    PullWrite { id: u64, addr: u64, len: u64, pid: u32, target: Target },
    /// A WRITE carrying its `len` bytes: received, and applied at `addr`
    /// when `target` is a region (drained otherwise), then answered.
    Write { id: u64, addr: u64, len: u64, target: Target },
    /// A READ of `len` bytes at `addr`. `same_host`: answered without
    /// payload, the client copies the bytes itself (host memory only).
    Read { id: u64, addr: u64, len: u64, target: Target, same_host: bool },
    /// A NOTIFY of `len` payload bytes, to be read and then offered
    /// ([`Requests::notification`]); `stale` when it was meant for another
    /// generation of this engine (answered so, nothing queued).
    Notify { id: u64, len: usize, stale: bool },
}

impl Request {
    /// Whether the same-host WRITEs gathered before this request are
    /// copied and answered first: before every request but another
    /// same-host WRITE (which may join them).
    pub fn lands_gathered(&self) -> bool {
        !matches!(self, Request::PullWrite { .. })
    }
}

/// The decisions of one handshaken connection.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Requests {
    generation: u64,
    max_frame: usize,
    peer: Peer,
}

impl Requests {
    /// For a connection to the engine of `generation`, frames bounded by
    /// `max_frame`, with what its handshake agreed.
    pub fn new(generation: u64, max_frame: usize, peer: Peer) -> Self {
        Self { generation, max_frame, peer }
    }

    /// A frame's header: the request it makes, checked, or why the
    /// connection is closed (a malformed header, a frame a client never
    /// sends, a same-host copy the handshake did not agree to).
    pub fn header(&self, b: &[u8; HEADER_LEN], regions: &RegionTable) -> Result<Request, String> {
        let h = Header::decode(b, self.max_frame).map_err(|e| e.to_string())?;
        let current = h.generation == self.generation;
        // The range, for a frame meant for this generation: a frame for an
        // earlier one (a peer holding an old descriptor) touches nothing.
        let target = |write: bool| {
            if current {
                regions.remote(h.addr, h.len, write)
            } else {
                Err(Status::StaleGeneration)
            }
        };
        let same_host = h.flags & proto::SAME_HOST != 0;
        match h.ty {
            FrameType::DescReq => Ok(Request::Describe { id: h.id }),
            FrameType::Write if same_host => {
                let Some(pid) = self.peer.pull_from else {
                    return Err("same-host WRITE from a client that was not verified".into());
                };
                Ok(Request::PullWrite { id: h.id, addr: h.addr, len: h.len, pid, target: target(true) })
            }
            FrameType::Write => Ok(Request::Write { id: h.id, addr: h.addr, len: h.len, target: target(true) }),
            FrameType::Read => {
                if same_host && !self.peer.reads {
                    return Err("same-host READ on a connection that did not agree to them".into());
                }
                let target = target(false);
                // Device memory cannot be copied from another process:
                // such a READ is answered with its bytes.
                let same_host = same_host && target.as_ref().is_ok_and(|r| r.mem.provider().is_none());
                Ok(Request::Read { id: h.id, addr: h.addr, len: h.len, target, same_host })
            }
            FrameType::Notify => Ok(Request::Notify { id: h.id, len: h.payload_len as usize, stale: !current }),
            other => Err(format!("unexpected {other:?} frame from a client")),
        }
    }

    /// The answer to a DESC_REQ: its header and payload (every region peers
    /// may reach), or why the connection is closed (a descriptor larger
    /// than `max_frame`, which the client could not take).
    pub fn describe(&self, id: u64, regions: &RegionTable) -> Result<(Header, Vec<u8>), String> {
        let payload = proto::encode_regions(&regions.exposed());
        if payload.len() > self.max_frame {
            return Err("descriptor larger than max_frame".into());
        }
        let mut a = Header::new(FrameType::DescResp);
        a.id = id;
        a.generation = self.generation;
        a.payload_len = u32::try_from(payload.len()).map_err(|_| "descriptor larger than 4 GiB".to_string())?;
        Ok((a, payload))
    }

    /// A NOTIFY's payload, read whole: the notification to offer the
    /// inbox, or the status to answer (nothing queued): `StaleGeneration`
    /// for another generation's, `TooLarge` or `Protocol` for a payload
    /// that breaks the notification rules.
    pub fn notification(&self, stale: bool, payload: &[u8]) -> std::result::Result<Notification, Status> {
        if stale {
            return Err(Status::StaleGeneration);
        }
        let (from, msg) = match proto::decode_notify(payload) {
            Ok(x) => x,
            Err(ProtoError::TooLarge { .. }) => return Err(Status::TooLarge),
            Err(_) => return Err(Status::Protocol),
        };
        check_received(from, msg).map_err(|_| Status::TooLarge)?;
        Ok(Notification { from: from.to_owned(), msg: msg.to_vec() })
    }
}

/// An answer carrying no payload (WRITE_ACK, NOTIFY_ACK, a failed READ):
/// its header, encoded.
pub(crate) fn answer(ty: FrameType, id: u64, status: std::result::Result<(), Status>) -> [u8; HEADER_LEN] {
    let mut a = Header::new(ty);
    a.id = id;
    a.status = status.err().unwrap_or(Status::Ok);
    a.encode()
}

/// The machine driven in process, for the fuzzer and the tests: not an
/// API (hidden from the docs, unstable).
#[doc(hidden)]
pub mod fuzzing {
    use std::sync::Arc;

    use transport_core::{Access, Buffer, RegionId};

    use super::{Peer, Request, Requests};
    use crate::proto::{self, FrameType, Header, HEADER_LEN};
    use crate::regions::RegionTable;

    /// The engine generation the machine serves.
    pub const GENERATION: u64 = 7;
    /// The verified client process of a connection that agreed to
    /// same-host WRITEs.
    pub const CLIENT_PID: u32 = 4242;
    const A_LEN: usize = 16 << 10;
    const B_LEN: usize = 4 << 10;
    const B_BYTE: u8 = 0xB7;
    const C_BYTE: u8 = 0xC3;
    const MAX_FRAME: usize = 8 << 10;

    /// Where a frame's address points.
    #[derive(Debug, Clone, Copy)]
    pub enum Place {
        /// Region A (remote read and write), plus an offset.
        A(i64),
        /// Region B (remote read only), plus an offset.
        B(i64),
        /// Memory C, never registered, plus an offset.
        C(i64),
        /// Anywhere.
        Abs(u64),
    }

    /// One frame a fuzzed client sends (every field free; the header's
    /// check is computed, so a frame is refused for what it says, not for
    /// a wrong checksum, unless `corrupt` asks for one).
    #[derive(Debug, Clone)]
    pub struct Frame {
        pub ty: u8,
        pub status: u8,
        pub flags: u8,
        pub id: u64,
        pub place: Place,
        pub len: u64,
        /// For this generation, or the one given.
        pub generation: Option<u64>,
        /// The payload's length as the header says it; the payload itself
        /// is `payload`, cut or padded with zeros to that length.
        pub payload_len: u32,
        pub payload: Vec<u8>,
        /// A byte of the encoded header to flip.
        pub corrupt: Option<(u8, u8)>,
    }

    impl Frame {
        /// The frame's header bytes with its address at `addr`: the
        /// fields as given (type and status any byte), the check computed
        /// over them, then the byte `corrupt` names flipped.
        pub fn header(&self, addr: u64) -> [u8; HEADER_LEN] {
            let mut h = Header::new(FrameType::Hello);
            h.flags = self.flags;
            h.payload_len = self.payload_len;
            h.id = self.id;
            h.addr = addr;
            h.len = self.len;
            h.generation = self.generation.unwrap_or(GENERATION);
            let mut bytes = h.encode();
            bytes[1] = self.ty;
            bytes[2] = self.status;
            let check = proto::fnv1a(&bytes[..40]);
            bytes[40..44].copy_from_slice(&check.to_le_bytes());
            if let Some((at, x)) = self.corrupt {
                bytes[usize::from(at) % HEADER_LEN] ^= x;
            }
            bytes
        }
    }

    /// Runs `frames` through a connection's machine (one that agreed to
    /// same-host WRITEs if `pulls`, READs if `reads`) with a driver that
    /// does what each request says to real memory: region A (writable),
    /// region B (read-only) and memory C (never registered). Panics when
    /// the machine lets a frame touch memory it must not (a WRITE outside
    /// A, a READ outside A and B, a stale generation served, a same-host
    /// copy the handshake did not allow) or when A, B or C differ from a
    /// model of what the accepted WRITEs wrote.
    pub fn check_frames(pulls: bool, reads: bool, frames: &[Frame]) {
        drive(pulls, reads, frames, &|m, b, t| m.header(b, t));
    }

    /// What decides a header: the machine, or (in the tests that show the
    /// checker can fail) a broken one around it.
    pub(crate) type Decide = dyn Fn(&Requests, &[u8; HEADER_LEN], &RegionTable) -> Result<Request, String>;

    /// [`check_frames`] with `decide` in the machine's place.
    pub(crate) fn drive(pulls: bool, reads: bool, frames: &[Frame], decide: &Decide) {
        let (Ok(a), Ok(b), Ok(c)) = (Buffer::new(A_LEN), Buffer::new(B_LEN), Buffer::new(B_LEN)) else {
            return;
        };
        b.fill(B_BYTE);
        c.fill(C_BYTE);
        let regions = Arc::new(RegionTable::default());
        if regions.insert(RegionId(1), a.region(), Access::REMOTE_RW).is_err()
            || regions.insert(RegionId(2), b.region(), Access::REMOTE_READ).is_err()
        {
            return;
        }
        let (a_at, b_at, c_at) = (a.region().addr(), b.region().addr(), c.region().addr());
        let peer = Peer { pull_from: pulls.then_some(CLIENT_PID), reads };
        let m = Requests::new(GENERATION, MAX_FRAME, peer);
        let mut model = vec![0u8; A_LEN];
        let inside = |at: u64, len: u64, start: u64, n: usize| {
            at >= start && at.checked_add(len).is_some_and(|end| end <= start + n as u64)
        };
        for f in frames {
            let addr = match f.place {
                Place::A(o) => a_at.wrapping_add_signed(o),
                Place::B(o) => b_at.wrapping_add_signed(o),
                Place::C(o) => c_at.wrapping_add_signed(o),
                Place::Abs(x) => x,
            };
            let bytes = f.header(addr);
            let mut payload = f.payload.clone();
            payload.resize(f.payload_len as usize, 0);
            let stale = f.generation.is_some_and(|g| g != GENERATION);
            let Ok(req) = decide(&m, &bytes, &regions) else {
                // Closed: nothing more is read from this connection.
                break;
            };
            let decoded = Header::decode(&bytes, MAX_FRAME).ok();
            assert!(decoded.is_some(), "a request from a header that does not decode");
            match req {
                Request::Describe { id } => {
                    let Ok((head, body)) = m.describe(id, &regions) else { break };
                    assert_eq!(head.payload_len as usize, body.len());
                    let listed = proto::decode_regions(&body).unwrap_or_default();
                    let addrs: Vec<u64> = listed.iter().map(|r| r.addr).collect();
                    assert!(!addrs.contains(&c_at), "the descriptor lists memory never registered");
                    assert_eq!(listed.len(), 2, "the descriptor lists A and B");
                }
                Request::PullWrite { addr, len, pid, target, .. } => {
                    assert!(pulls, "a same-host WRITE accepted without the handshake's agreement");
                    assert_eq!(pid, CLIENT_PID);
                    if target.is_ok() {
                        assert!(!stale, "a stale generation's same-host WRITE reached memory");
                        assert!(inside(addr, len, a_at, A_LEN), "a same-host WRITE outside A: {addr:#x}+{len}");
                    }
                    // The copy from the client process is not made here.
                }
                Request::Write { addr, len, target, .. } => {
                    assert_eq!(len as usize, payload.len(), "a WRITE's length and payload differ");
                    if let Ok(region) = target {
                        assert!(!stale, "a stale generation's WRITE reached memory");
                        assert!(inside(addr, len, a_at, A_LEN), "a WRITE outside A: {addr:#x}+{len}");
                        assert_eq!(region.write_abs(addr, &payload), Ok(()), "a checked WRITE failed");
                        let off = (addr - a_at) as usize;
                        model[off..off + payload.len()].copy_from_slice(&payload);
                    }
                }
                Request::Read { addr, len, target, same_host, .. } => {
                    if same_host {
                        assert!(reads, "a same-host READ accepted without the handshake's agreement");
                    }
                    if let Ok(region) = target {
                        assert!(!stale, "a stale generation's READ was served");
                        let mut got = vec![0u8; len as usize];
                        assert_eq!(region.read_abs(addr, &mut got), Ok(()), "a checked READ failed");
                        if inside(addr, len, b_at, B_LEN) {
                            assert!(got.iter().all(|&x| x == B_BYTE), "a READ of B returned other bytes");
                        } else {
                            assert!(inside(addr, len, a_at, A_LEN), "a READ outside A and B: {addr:#x}+{len}");
                            let off = (addr - a_at) as usize;
                            assert_eq!(got, model[off..off + got.len()], "a READ of A differs from its writes");
                        }
                    }
                }
                Request::Notify { len, stale: s, .. } => {
                    assert_eq!(s, stale);
                    assert_eq!(len, payload.len());
                    if let Ok(n) = m.notification(s, &payload) {
                        assert!(!stale, "a stale generation's notification was queued");
                        assert!(transport_core::check_received(&n.from, &n.msg).is_ok());
                    }
                }
            }
        }
        assert!(b.to_vec().iter().all(|&x| x == B_BYTE), "read-only region B changed");
        assert!(c.to_vec().iter().all(|&x| x == C_BYTE), "unregistered memory C changed");
        assert_eq!(a.to_vec(), model, "region A differs from what the accepted WRITEs wrote");
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::fuzzing::{check_frames, Frame, Place, GENERATION};
    use super::*;
    use transport_core::{Access, Buffer, RegionId};

    fn frame(ty: FrameType, place: Place, len: u64, payload: usize) -> Frame {
        Frame {
            ty: ty as u8,
            status: 0,
            flags: 0,
            id: 1,
            place,
            len,
            generation: None,
            payload_len: payload as u32,
            payload: vec![0x5A; payload],
            corrupt: None,
        }
    }

    fn table() -> (Buffer, Buffer, Arc<RegionTable>) {
        let a = Buffer::new(8192).unwrap();
        let b = Buffer::new(4096).unwrap();
        let t = Arc::new(RegionTable::default());
        t.insert(RegionId(1), a.region(), Access::REMOTE_RW).unwrap();
        t.insert(RegionId(2), b.region(), Access::REMOTE_READ).unwrap();
        (a, b, t)
    }

    #[test]
    fn a_write_is_checked_once_for_generation_region_and_access() {
        let (a, b, t) = table();
        let m = Requests::new(GENERATION, 64 << 10, Peer::default());
        let w = frame(FrameType::Write, Place::Abs(0), 16, 16);
        let at = |bytes| m.header(&bytes, &t).unwrap();
        match at(w.header(a.region().addr() + 8)) {
            Request::Write { target: Ok(r), len: 16, .. } => assert_eq!(r.id, RegionId(1)),
            other => panic!("{other:?}"),
        }
        // Read-only B, past A's end, a stale generation: the status, no region.
        match at(w.header(b.region().addr())) {
            Request::Write { target: Err(Status::AccessDenied), .. } => {}
            other => panic!("{other:?}"),
        }
        match at(w.header(a.region().addr() + 8192 - 8)) {
            Request::Write { target: Err(Status::OutOfBounds), .. } => {}
            other => panic!("{other:?}"),
        }
        let stale = Frame { generation: Some(GENERATION + 1), ..w.clone() };
        match at(stale.header(a.region().addr())) {
            Request::Write { target: Err(Status::StaleGeneration), .. } => {}
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn same_host_copies_need_the_handshakes_agreement() {
        let (a, _b, t) = table();
        let pull = Frame { flags: proto::SAME_HOST, payload_len: 8, ..frame(FrameType::Write, Place::Abs(0), 64, 8) };
        let read = Frame { flags: proto::SAME_HOST, ..frame(FrameType::Read, Place::Abs(0), 64, 0) };
        let none = Requests::new(GENERATION, 64 << 10, Peer::default());
        let err = none.header(&pull.header(a.region().addr()), &t).unwrap_err();
        assert!(err.contains("not verified"), "{err}");
        let err = none.header(&read.header(a.region().addr()), &t).unwrap_err();
        assert!(err.contains("did not agree"), "{err}");
        let both = Requests::new(GENERATION, 64 << 10, Peer { pull_from: Some(9), reads: true });
        match both.header(&pull.header(a.region().addr()), &t).unwrap() {
            Request::PullWrite { pid: 9, target: Ok(_), .. } => {}
            other => panic!("{other:?}"),
        }
        match both.header(&read.header(a.region().addr()), &t).unwrap() {
            Request::Read { same_host: true, target: Ok(_), .. } => {}
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn answers_and_unexpected_frames_close_the_connection() {
        let (a, _b, t) = table();
        let m = Requests::new(GENERATION, 64 << 10, Peer::default());
        for ty in [FrameType::WriteAck, FrameType::ReadResp, FrameType::DescResp] {
            let mut f = frame(ty, Place::Abs(0), 0, 4);
            f.status = 0;
            let r = m.header(&f.header(a.region().addr()), &t);
            assert!(r.is_err(), "{ty:?} accepted from a client: {r:?}");
        }
        let mut bad = frame(FrameType::DescReq, Place::Abs(0), 0, 0).header(0);
        bad[12] ^= 1;
        assert!(m.header(&bad, &t).unwrap_err().contains("check"));
    }

    #[test]
    fn notifications_are_checked_before_they_are_queued() {
        let m = Requests::new(GENERATION, 64 << 10, Peer::default());
        let ok = proto::encode_notify("prefill-0", b"done").unwrap();
        assert_eq!(m.notification(false, &ok).unwrap().from, "prefill-0");
        assert_eq!(m.notification(true, &ok).unwrap_err(), Status::StaleGeneration);
        assert_eq!(m.notification(false, &[5, 0, b'a']).unwrap_err(), Status::Protocol);
        assert_eq!(m.notification(false, &[0xFF, 0xFF, 1]).unwrap_err(), Status::TooLarge);
    }

    /// The in-process fuzz check on streams a small generator makes, so
    /// every test run drives it (the fuzzer explores far more).
    #[test]
    fn generated_streams_keep_the_invariants() {
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let types = [FrameType::DescReq, FrameType::Write, FrameType::Read, FrameType::Notify];
        for round in 0..400 {
            let mut frames = Vec::new();
            for _ in 0..(next() % 12) {
                let ty = types[(next() % 4) as usize];
                let off = (next() % 20_000) as i64 - 2_000;
                let place = match next() % 4 {
                    0 => Place::A(off),
                    1 => Place::B(off),
                    2 => Place::C(off),
                    _ => Place::Abs(next()),
                };
                let len = 1 + next() % 5_000;
                let payload = match ty {
                    FrameType::Write => len as usize,
                    FrameType::Notify => 2 + (next() % 40) as usize,
                    _ => 0,
                };
                let mut f = frame(ty, place, len, payload);
                f.payload = (0..payload).map(|_| next() as u8).collect();
                if ty == FrameType::Notify && next() % 2 == 0 {
                    f.payload = proto::encode_notify("p", &f.payload[..payload - 2]).unwrap_or_default();
                    f.payload_len = f.payload.len() as u32;
                }
                if next() % 8 == 0 {
                    f.flags = proto::SAME_HOST;
                    if ty == FrameType::Write {
                        f.payload_len = 8;
                        f.payload.truncate(8);
                    }
                }
                if next() % 10 == 0 {
                    f.generation = Some(next() % 10);
                }
                frames.push(f);
            }
            check_frames(round % 2 == 0, round % 3 == 0, &frames);
        }
    }

    /// The checker itself can fail: a machine that forgets the access
    /// check (a WRITE into read-only memory handed to the driver as if it
    /// were allowed) is caught.
    #[test]
    #[should_panic(expected = "a WRITE outside A")]
    fn the_checker_catches_a_machine_without_the_access_check() {
        let forgetful = |m: &Requests, b: &[u8; HEADER_LEN], t: &RegionTable| match m.header(b, t)? {
            Request::Write { id, addr, len, target: Err(Status::AccessDenied) } => {
                Ok(Request::Write { id, addr, len, target: t.remote(addr, len, false) })
            }
            other => Ok(other),
        };
        let w = frame(FrameType::Write, Place::B(16), 32, 32);
        super::fuzzing::drive(false, false, &[w], &forgetful);
    }
}
