//! The answer side of a lane: the frames its peer sends back (WRITE_ACK,
//! READ_RESP, NOTIFY_ACK), read off the socket and applied to the slices
//! and notifications waiting for them.
//!
//! Two parties read a lane, never at once (its [`Rx`] is behind a lock):
//! the lane's reader task, woken by the runtime when the socket has bytes,
//! and a caller's thread polling its own batch ([`Carrier::progress`]),
//! which reads what has already arrived without waiting. The second is
//! what makes a small transfer finish on the thread that waits for it,
//! with no wake-up of a runtime thread in between (as UCX progresses on
//! its caller's thread). Reading is a non-blocking state machine: a frame
//! whose payload has only partly arrived is carried over in [`Rx`] to
//! whoever reads next.
//!
//! A slice with a payload (or a same-host READ, which copies) stays in
//! its lane's pending map until its bytes are in: whoever quiets an ended
//! request sees it there and resets the endpoint, whose teardown joins the
//! reader task and then takes this lock (so waits for a caller reading)
//! before it ends the slice. Once stopped, an `Rx` never reads again.

use std::io::Read;
use std::sync::Arc;

use tokio::io::Interest;
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::TcpStream;
use transport_core::{inbox_full, Error, ErrorKind, Opcode, Result};

use crate::batch::{Batch, Carrier};
use crate::conn::{proto_err, status_err};
use crate::endpoint::{Body, Endpoint, Rx, Slice};
use crate::proto::{FrameType, Header, Status, HEADER_LEN, SAME_HOST};
use crate::regions::{Gathered, Region};
use crate::staging::{copied, StagedRead};

/// The reading buffer's size: also the largest piece of a READ payload
/// copied into local memory at once.
const BUF: usize = 256 << 10;
/// Bytes a caller's thread reads in one [`Rx::pump`] at most: enough for
/// the answers of a small batch, little enough that a poll stays short.
const CALLER_BUDGET: usize = 64 << 10;
/// Bytes the reader task reads before it yields to the runtime's other
/// tasks.
const TASK_BUDGET: usize = 4 << 20;

impl Carrier for Endpoint {
    /// Reads and applies the answers that have already arrived on the
    /// lanes with work outstanding, on the caller's thread, without
    /// waiting: a lane its reader task (or another caller) is reading is
    /// skipped. Must be called inside the endpoint's tokio runtime (a
    /// broken lane starts its teardown).
    fn progress(self: Arc<Self>) {
        for (k, lane) in self.lanes.iter().enumerate() {
            if !lane.pending.lock().awaits_answers() {
                continue;
            }
            if let Some(mut rx) = lane.rx.try_lock() {
                rx.pump(&self, k, CALLER_BUDGET);
            }
        }
    }

    fn hush(&self) -> u64 {
        let mut hushed = 0u64;
        for (k, lane) in self.lanes.iter().enumerate().take(64) {
            if lane.pending.lock().awaits_answers() {
                lane.hush.lock().enter();
                hushed |= 1 << k;
            }
        }
        hushed
    }

    fn loud(&self, lanes: u64) {
        for (k, lane) in self.lanes.iter().enumerate().take(64) {
            if lanes & (1 << k) == 0 {
                continue;
            }
            if let Err(e) = lane.hush.lock().leave() {
                // The socket is gone (its endpoint is being torn down):
                // nothing could wake a waiter on it.
                tracing::debug!(peer = %self.name, lane = k, error = %e, "lane could not be made loud");
            }
        }
    }
}

/// What a [`Rx::pump`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pumped {
    /// Read everything the socket had: it said it would block.
    Drained,
    /// Stopped at the budget: more bytes may be waiting.
    Budget,
    /// The lane is read no more (its endpoint broke or is being destroyed).
    Stop,
}

/// Why reading a lane stopped for good.
enum Stop {
    /// The endpoint is already being destroyed: nothing to report.
    Quiet,
    /// The lane broke: its endpoint is destroyed with this error.
    Broke(Error),
}

impl Rx {
    /// Reads what the socket has, up to about `budget` bytes, and applies
    /// every whole frame (and every arrived piece of a payload). Never
    /// waits. A broken lane destroys its endpoint here, so this must run
    /// inside the endpoint's tokio runtime.
    pub fn pump(&mut self, ep: &Arc<Endpoint>, lane: usize, budget: usize) -> Pumped {
        if self.stopped {
            return Pumped::Stop;
        }
        match self.run(ep, lane, budget) {
            Ok(p) => p,
            Err(stop) => {
                self.stopped = true;
                self.body = None;
                if let Stop::Broke(e) = stop {
                    ep.broke(e);
                }
                Pumped::Stop
            }
        }
    }

    fn run(&mut self, ep: &Arc<Endpoint>, lane: usize, budget: usize) -> Result<Pumped, Stop> {
        let mut read = 0usize;
        loop {
            self.apply(ep, lane)?;
            if read >= budget {
                return Ok(Pumped::Budget);
            }
            match self.fill(&ep.name)? {
                Some(k) => read = read.saturating_add(k),
                None => return Ok(Pumped::Drained),
            }
        }
    }

    /// Reads once into the buffer: the bytes read, `None` if the socket
    /// has none now.
    fn fill(&mut self, peer: &str) -> Result<Option<usize>, Stop> {
        // Not connected yet: nothing to read (torn down: `stopped` is set).
        let Some(sock) = self.sock.as_ref() else { return Ok(None) };
        // `apply` left less than a header unread: move it to the front.
        if self.lo > 0 {
            self.buf.copy_within(self.lo..self.hi, 0);
            self.hi -= self.lo;
            self.lo = 0;
        }
        if self.buf.len() < BUF {
            self.buf.resize(BUF, 0);
        }
        // The socket is non-blocking (tokio set it so): this never waits.
        let stream: &TcpStream = sock.as_ref().as_ref();
        let sock = socket2::SockRef::from(stream);
        loop {
            match (&*sock).read(&mut self.buf[self.hi..]) {
                Ok(0) => {
                    let eof = std::io::Error::from(std::io::ErrorKind::UnexpectedEof);
                    return Err(Stop::Broke(Error::from(eof).with("peer", peer)));
                }
                Ok(k) => {
                    self.hi += k;
                    return Ok(Some(k));
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Stop::Broke(Error::from(e).with("peer", peer))),
            }
        }
    }

    /// Applies what is buffered: payload bytes of the frame in progress,
    /// then whole frames, until less than a header is left. The copies of
    /// consecutive same-host READ answers into one local region are made
    /// together ([`land`]), all before this returns.
    fn apply(&mut self, ep: &Arc<Endpoint>, lane: usize) -> Result<(), Stop> {
        let mut pulls = Gathered::default();
        let r = self.apply_frames(ep, lane, &mut pulls);
        let landed = land(&mut pulls, ep, lane);
        r.and(landed)
    }

    fn apply_frames(&mut self, ep: &Arc<Endpoint>, lane: usize, pulls: &mut Gathered) -> Result<(), Stop> {
        loop {
            if let Some(body) = self.body.as_mut() {
                let k = (self.hi - self.lo).min(body.len - body.done);
                if k == 0 {
                    return Ok(());
                }
                if body.copy && body.result.is_ok() {
                    let off = body.local_off.saturating_add(body.done as u64);
                    let src = &self.buf[self.lo..self.lo + k];
                    body.result = match body.staged.as_mut() {
                        Some(s) => s.feed(&ep.env.staging, &ep.copies, off, src),
                        None => copy_in(&body.batch, body.req, off, src),
                    };
                }
                body.done += k;
                self.lo += k;
                if body.done == body.len {
                    if let Some(b) = self.body.take() {
                        finish(ep, lane, b);
                    }
                }
                continue;
            }
            let Some(bytes) = self.buf.get(self.lo..self.lo + HEADER_LEN).filter(|_| self.hi - self.lo >= HEADER_LEN)
            else {
                return Ok(());
            };
            let mut b = [0u8; HEADER_LEN];
            b.copy_from_slice(bytes);
            self.lo += HEADER_LEN;
            let h = Header::decode(&b, ep.env.cfg.max_frame).map_err(|e| Stop::Broke(proto_err(e, &ep.name)))?;
            let same_host_ok =
                h.ty == FrameType::ReadResp && h.flags & SAME_HOST != 0 && h.status == Status::Ok && h.payload_len == 0;
            if !same_host_ok {
                // Any other answer is applied after the copies gathered
                // before it, whose slices then have ended: a second answer
                // to one of them is one to an unknown request.
                land(pulls, ep, lane)?;
            }
            match frame(ep, lane, &h)? {
                Answer::Done => {}
                Answer::Body(b) => self.body = Some(b),
                Answer::Pull { id, region, pid, entry } => {
                    if !pulls.takes(&region, pid) {
                        land(pulls, ep, lane)?;
                    }
                    pulls.add(region, pid, entry, id);
                }
            }
        }
    }
}

/// What one answer's header leaves to do.
enum Answer {
    /// Applied (its slice or notification ended).
    Done,
    /// Its payload follows.
    Body(Body),
    /// A same-host READ answered: `entry` (`(local offset, len, address
    /// in process `pid`)`) is to be copied into `region`, then slice `id`
    /// ends.
    Pull { id: u64, region: Arc<Region>, pid: u32, entry: (usize, usize, u64) },
}

/// Makes the copies of the same-host READ answers gathered in `pulls`
/// (consecutive ones into one local region, from the peer's process, one
/// kernel call) and ends their slices; each slice stayed in its lane's
/// pending map until its copy was made. Two same-host answers to one
/// request in the group (both copies were made, into its own range, before
/// either ended it) are a protocol error: the second ends nothing and
/// gives no window place back.
fn land(pulls: &mut Gathered, ep: &Endpoint, lane: usize) -> Result<(), Stop> {
    let mut landed = Vec::new();
    let Some(region) = pulls.copy(&mut landed) else { return Ok(()) };
    let mut dup = false;
    for (id, len, result) in landed {
        let result = result.map_err(|e| e.map_or_else(|| Error::region_unregistered(region.id), Error::from));
        let Some(slice) = ep.lanes[lane].pending.lock().map.remove(&id) else {
            dup = true;
            continue;
        };
        if result.is_ok() {
            ep.env.same_host_bytes.fetch_add(len as u64, std::sync::atomic::Ordering::Relaxed);
        }
        end_slice(ep, lane, id, Some(slice), result);
    }
    if dup {
        let e = Error::new(ErrorKind::Protocol, "two answers to one request").with("peer", &ep.name);
        return Err(Stop::Broke(e));
    }
    Ok(())
}

/// Applies one answer's header: ends its slice (or notification) at once,
/// or returns the slice whose payload follows.
fn frame(ep: &Arc<Endpoint>, lane: usize, h: &Header) -> Result<Answer, Stop> {
    let peer = &ep.name;
    let broke = |kind, msg: &str| Stop::Broke(Error::new(kind, msg.to_owned()).with("peer", peer));
    match h.ty {
        FrameType::WriteAck | FrameType::ReadResp => {}
        FrameType::NotifyAck => {
            // No payload (the decoder checked): the note ends here.
            let note = ep.lanes[lane].pending.lock().notes.remove(&h.id);
            let Some(note) = note else {
                if ep.is_dead() {
                    return Err(Stop::Quiet);
                }
                return Err(broke(ErrorKind::Protocol, "notification answer to an unknown request id"));
            };
            ep.lanes[lane].window.add_permits(1);
            let result = match h.status {
                Status::Ok => Ok(()),
                Status::Busy => Err(inbox_full().with("peer", peer)),
                other => Err(status_err(other, peer)),
            };
            let _ = note.reply.send(result);
            return Ok(Answer::Done);
        }
        other => return Err(broke(ErrorKind::Protocol, &format!("unexpected {other:?} frame"))),
    }
    let n = h.payload_len as usize;
    // An answer without payload ends its slice at once (taken out of the
    // pending map). One with a payload leaves the slice in the map until
    // the payload is in (see the module's doc).
    let found = {
        let mut p = ep.lanes[lane].pending.lock();
        if p.streaming == Some(h.id) {
            // Answered before it was wholly sent: the writer is still
            // reading the caller's buffer, so the slice must not end here;
            // the teardown ends it after joining the writer.
            drop(p);
            return Err(broke(ErrorKind::Protocol, "answer to a WRITE before its payload was sent"));
        }
        // A same-host READ's answer brings no payload, but the bytes are
        // copied into local memory below: the slice stays in the map until
        // then, as for a payload.
        let copies = h.ty == FrameType::ReadResp && h.flags & SAME_HOST != 0 && h.status == Status::Ok;
        let info = |s: &Slice| (s.batch.clone(), s.req, s.local_off, s.len, s.op, (s.same_host, s.remote));
        // A slice whose staged copies still run (`landing`) was answered
        // already: another answer is a protocol error, and it stays put.
        let found = if n == 0 && !copies {
            match p.map.remove(&h.id) {
                Some(s) if s.landing => {
                    p.map.insert(h.id, s);
                    None
                }
                s => Some(s.map(|s| (info(&s), Some(s)))),
            }
        } else {
            match p.map.get(&h.id).map(|s| (s.landing, info(s))) {
                Some((true, _)) => None,
                s => Some(s.map(|(_, i)| (i, None))),
            }
        };
        match found {
            Some(found) => found,
            None => {
                drop(p);
                return Err(broke(ErrorKind::Protocol, "two answers to one request"));
            }
        }
    };
    let Some(((batch, req, local_off, slice_len, op, (same, remote)), taken)) = found else {
        if ep.is_dead() {
            return Err(Stop::Quiet);
        }
        return Err(broke(ErrorKind::Protocol, "answer to an unknown request id"));
    };
    let expected = if op == Opcode::Write { FrameType::WriteAck } else { FrameType::ReadResp };
    // A READ answer carries exactly the slice (or nothing, with an error
    // status); anything else is a protocol error, so a peer can never make
    // the copy into local memory leave the slice's range. A same-host
    // answer comes only to a same-host READ, also for the whole slice, and
    // without payload. A same-host READ may still be answered with its
    // bytes (the peer's region is device memory).
    let answered_same = h.flags & SAME_HOST != 0;
    let ok_len = h.status != Status::Ok
        || h.ty != FrameType::ReadResp
        || (h.len == slice_len && n as u64 == if answered_same { 0 } else { h.len });
    let ok_same = h.ty != FrameType::ReadResp || !answered_same || same;
    if h.ty != expected || !ok_len || !ok_same {
        let err = Error::new(ErrorKind::Protocol, "mismatched answer").with("peer", peer);
        if let Some(s) = taken {
            s.batch.slice_done(s.req, Err(err.clone()));
        }
        return Err(Stop::Broke(err));
    }
    let mut result = if h.status != Status::Ok { Err(status_err(h.status, peer)) } else { Ok(()) };
    let same = same && (op == Opcode::Write || answered_same);
    if result.is_ok() && same {
        if op == Opcode::Read {
            // The copy is made with those of the answers next to it.
            match pull_of(ep, lane, h.id, (&batch, req, local_off, slice_len), remote) {
                Ok(pull) => return Ok(pull),
                Err(e) => result = Err(e),
            }
        } else {
            ep.env.same_host_bytes.fetch_add(slice_len, std::sync::atomic::Ordering::Relaxed);
        }
    }
    if n == 0 {
        end_slice(ep, lane, h.id, taken, result);
        return Ok(Answer::Done);
    }
    // A read error or a copy error (the region was unregistered) drains
    // the rest of the payload; a broken lane's teardown ends the slice.
    let copy = op == Opcode::Read;
    let staged = match batch.locals.get(req) {
        Some(r) if copy && ep.env.staging.enabled() && r.mem.provider().is_some() => Some(StagedRead::new(r.clone())),
        _ => None,
    };
    Ok(Answer::Body(Body { id: h.id, batch, req, local_off, copy, len: n, done: 0, result, staged }))
}

/// Ends an answer whose payload is wholly in. A READ staged into device
/// memory ends once its copies have: its slice stays in the pending map
/// until then (so whoever quiets its request resets the endpoint, whose
/// teardown waits for the copies).
fn finish(ep: &Arc<Endpoint>, lane: usize, b: Body) {
    let Body { id, result, staged, .. } = b;
    let copies = match staged {
        Some(mut s) => {
            if result.is_ok() {
                s.flush(&ep.copies);
            }
            s.into_copies()
        }
        None => Vec::new(),
    };
    if copies.is_empty() {
        end_slice(ep, lane, id, None, result);
        return;
    }
    if let Some(s) = ep.lanes[lane].pending.lock().map.get_mut(&id) {
        s.landing = true;
    }
    let ep = ep.clone();
    tokio::spawn(async move {
        let mut result = result;
        for c in copies {
            let r = copied(c).await.and_then(|(_, r)| r);
            if result.is_ok() {
                result = r;
            }
        }
        end_slice(&ep, lane, id, None, result);
    });
}

/// Ends slice `id` of `lane` with `result` (taken out of the pending map
/// unless the caller already took it) and gives its window place back.
fn end_slice(ep: &Endpoint, lane: usize, id: u64, taken: Option<Slice>, result: Result<()>) {
    let s = match taken {
        Some(s) => Some(s),
        None => ep.lanes[lane].pending.lock().map.remove(&id),
    };
    ep.lanes[lane].window.add_permits(1);
    if let Some(s) = s {
        s.batch.slice_done(s.req, result);
    }
}

/// Copies `src` into request `i`'s local region at `off`.
fn copy_in(batch: &Batch, i: usize, off: u64, src: &[u8]) -> Result<()> {
    let region = batch.locals.get(i).ok_or_else(|| Error::new(ErrorKind::Internal, "request without a region"))?;
    region.write_live(off, src)
}

/// The copy of same-host READ slice `id` (request `i` of `batch`, `len`
/// bytes at `off` of its local region) from `remote` in the peer's
/// process, as an [`Answer::Pull`].
fn pull_of(
    ep: &Endpoint,
    lane: usize,
    id: u64,
    (batch, i, off, len): (&Batch, usize, u64, u64),
    remote: u64,
) -> Result<Answer> {
    let Some(pid) = ep.lanes[lane].same_host.read_from else {
        return Err(Error::new(ErrorKind::Internal, "a same-host READ on a lane without the peer's process"));
    };
    let region = batch.locals.get(i).ok_or_else(|| Error::new(ErrorKind::Internal, "request without a region"))?;
    let (Ok(off), Ok(len)) = (usize::try_from(off), usize::try_from(len)) else {
        return Err(Error::new(ErrorKind::OutOfBounds, "local range too large"));
    };
    Ok(Answer::Pull { id, region: region.clone(), pid, entry: (off, len, remote) })
}

/// A lane's reader task: waits until the socket has bytes, then reads and
/// applies them (under the lane's [`Rx`] lock, which a polling caller may
/// hold for a moment). Ends when the lane stops.
pub(crate) async fn reader(ep: Arc<Endpoint>, lane: usize, sock: Arc<OwnedReadHalf>) {
    loop {
        if let Err(e) = sock.readable().await {
            return ep.broke(Error::from(e).with("peer", &ep.name));
        }
        // If the runtime's readiness was stale the closure is not run:
        // nothing was read, so wait again.
        let mut pumped = Pumped::Drained;
        {
            let mut rx = ep.lanes[lane].rx.lock();
            // A `WouldBlock` from inside tells the runtime the socket is
            // drained (so `readable` waits for the next bytes); bytes a
            // polling caller read meanwhile make the same answer.
            let stream: &TcpStream = sock.as_ref().as_ref();
            let _ = stream.try_io(Interest::READABLE, || {
                pumped = rx.pump(&ep, lane, TASK_BUDGET);
                match pumped {
                    Pumped::Drained => Err(std::io::ErrorKind::WouldBlock.into()),
                    Pumped::Budget | Pumped::Stop => Ok(()),
                }
            });
        }
        match pumped {
            Pumped::Stop => return,
            Pumped::Drained => {}
            Pumped::Budget => tokio::task::yield_now().await,
        }
    }
}
