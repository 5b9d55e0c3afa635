//! The lanes of an endpoint: connecting them, and the sending side of
//! each (its answers are read in [`crate::rx`]).
//!
//! A few small slices (see [`send_now`]) go onto a free lane's socket from
//! the submitting task itself, so a small transfer costs no hand-off to a
//! task; everything else is queued for the writers. Whoever puts bytes on
//! a lane's socket holds its sending side (`Lane::out`) meanwhile.
//!
//! The writer pulls slices off the endpoint's queue, asks the batch's
//! ledger to start each one ([`Batch::start`]: a slice of a request that is
//! no longer live is dropped before it touches memory), copies WRITE
//! payloads out of local memory into a bounded send buffer and coalesces
//! small frames into one `write`. The reader ([`crate::rx`]) matches
//! answers to outstanding slices by request id, copies READ payloads into
//! local memory and ends the slice in the ledger. A lane has at most `window`
//! slices outstanding. Notifications (rule 11) ride the same lanes: the
//! writer takes a queued one before any slice and sends it as one NOTIFY
//! frame (it takes a window place like a slice), and the reader hands its
//! NOTIFY_ACK to the waiting caller. The hot path takes the batch's ledger lock once
//! when a slice starts and once when it ends (and once per 256 KiB chunk
//! of a streamed WRITE), never per byte.

use std::net::SocketAddr;
use std::sync::{Arc, Weak};

use tokio::io::AsyncWriteExt;
use tokio::net::tcp::OwnedWriteHalf;
use transport_core::lifecycle::EndpointId;
use transport_core::{Error, ErrorKind, Opcode, Result};

use crate::batch::Batch;
use crate::conn;
use crate::endpoint::{Endpoint, EndpointSlots, Env, Item, Lane, LaneOut, Next, Note, SentNote, Slice, Work};
use crate::proto::{FrameType, Header, HEADER_LEN};
use crate::regions::Region;
use crate::staging::{copied, copy_off, Side, STAGE};

/// Bytes a writer gathers before one `write` when slices are small.
const COALESCE: usize = 256 << 10;
/// Payloads larger than this are copied and sent (or received and copied)
/// in chunks of this size, so each copy stays in cache.
const STREAM: usize = 256 << 10;

/// Connects `cfg.lanes` lanes to `addr`, fetches the descriptor over the
/// first (its DESC_REQ behind the handshake's AUTH where allowed), and
/// starts the lane tasks. Sockets opened before a failure are
/// closed when this returns the error.
pub(crate) async fn connect(
    id: EndpointId,
    name: &str,
    addr: SocketAddr,
    env: &Arc<Env>,
    slots: Weak<EndpointSlots>,
) -> Result<Arc<Endpoint>> {
    let cfg = &env.cfg;
    let mut streams = Vec::with_capacity(cfg.lanes);
    let mut generation = 0;
    let mut regions = Vec::new();
    let mut same_host = Vec::with_capacity(cfg.lanes);
    for i in 0..cfg.lanes {
        // The first lane asks for the descriptor with its handshake.
        let desc = (i == 0).then(|| env.next_id());
        let first = desc.map(|id| (conn::desc_req(id), &[][..]));
        let (mut s, hello) = conn::connect(addr, cfg, name, first).await?;
        same_host.push((hello.same_host, hello.direct.clone()));
        if let Some(id) = desc {
            let (g, r) = conn::fetch_regions(&mut s, cfg, id, hello.first_sent, name).await?;
            if g != hello.generation {
                return Err(
                    Error::new(ErrorKind::PeerRestarted, "generation changed during the handshake").with("peer", name)
                );
            }
            generation = g;
            regions = r;
        } else if hello.generation != generation {
            return Err(Error::new(ErrorKind::PeerRestarted, "the peer restarted while lanes were connecting")
                .with("peer", name));
        }
        streams.push(s);
    }
    let agreed = same_host.iter().filter(|(s, _)| s.writes && s.read_from.is_some()).count();
    let direct = same_host.iter().filter(|(_, d)| d.is_some()).count();
    if cfg.same_host {
        tracing::info!(
            peer = name,
            lanes = same_host.len(),
            same_host_lanes = agreed,
            direct_write_lanes = direct,
            "endpoint connected ({})",
            if agreed == same_host.len() {
                "same-host copies"
            } else if agreed == 0 {
                "bytes over the sockets"
            } else {
                "mixed"
            }
        );
    }
    metrics::counter!("kvmove_tcp_lanes_total", "path" => "same_host").increment(agreed as u64);
    metrics::counter!("kvmove_tcp_lanes_total", "path" => "socket").increment((same_host.len() - agreed) as u64);
    let ep = Endpoint::new(id, name, addr, (generation, regions), &same_host, env.clone(), slots);
    env.lanes.fetch_add(streams.len(), std::sync::atomic::Ordering::Relaxed);
    crate::busypoll::count_lanes(streams.len(), true);
    let mut readers = Vec::with_capacity(streams.len());
    for (lane, s) in ep.lanes.iter().zip(streams) {
        let (r, w) = s.into_split();
        // Not yet shared: the lane tasks start below.
        match lane.out.try_lock() {
            Ok(mut out) => out.w = Some(w),
            Err(_) => return Err(Error::new(ErrorKind::Internal, "a new lane's sending side is in use")),
        }
        // Read by its reader task, and by callers polling (`crate::rx`).
        let r = Arc::new(r);
        lane.rx.lock().attach(r.clone());
        lane.hush.lock().attach(r.clone());
        readers.push(r);
    }
    ep.start_tasks(|| {
        let mut tasks = Vec::with_capacity(2 * readers.len());
        for (i, r) in readers.into_iter().enumerate() {
            tasks.push(env.tasks.spawn(crate::rx::reader(ep.clone(), i, r)));
            tasks.push(env.tasks.spawn(writer(ep.clone(), i)));
        }
        tasks
    });
    Ok(ep)
}

/// What `stage` did with a slice.
enum Staged {
    /// Not sent (it failed before the wire).
    Skipped,
    /// Not sent: its request is not live (none of its slices will be).
    NotLive(Arc<Batch>, usize),
    /// The whole frame is in the send buffer.
    Inline,
    /// The header is in the send buffer; the payload is to be streamed.
    Stream(Streamed),
}

/// A WRITE whose payload is streamed after its header.
struct Streamed {
    batch: Arc<Batch>,
    req: usize,
    local_off: u64,
    len: u64,
    /// Its request id, and where its frame starts in the send buffer.
    id: u64,
    start: usize,
    /// The local region is device memory: copied through staging buffers.
    device: bool,
}

/// Copies `dst.len()` bytes of request `i`'s local region from `off`.
fn copy_out(batch: &Batch, i: usize, off: u64, dst: &mut [u8]) -> Result<()> {
    let region = batch.locals.get(i).ok_or_else(|| Error::new(ErrorKind::Internal, "request without a region"))?;
    region.read_live(off, dst)
}

/// Whether request `i`'s slice goes as a same-host copy on `lane`: the
/// lane agreed to it for this operation and the local region is host
/// memory (device memory is staged through the socket path).
fn same_host_slice(ep: &Endpoint, lane: usize, batch: &Batch, i: usize, write: bool) -> bool {
    let agreed = ep.lanes[lane].same_host;
    let ok = if write { agreed.writes } else { agreed.read_from.is_some() };
    ok && batch.locals.get(i).is_some_and(|r| r.mem.provider().is_none())
}

/// Puts one slice's frame into `buf[*used..]` and records it as
/// outstanding on `lane`. A WRITE larger than [`STREAM`] gets only its
/// header here: its payload is streamed by the writer in chunks, so the
/// copy stays in cache and overlaps the socket.
fn stage(ep: &Endpoint, lane: usize, n: Next, buf: &mut Vec<u8>, used: &mut usize) -> Staged {
    let Next { batch, req: i, off, len, generation, using } = n;
    let Some(req) = batch.reqs.get(i).copied() else { return Staged::Skipped };
    // Validation bounded every request (len <= 2^40, ranges without
    // overflow), so these sums cannot overflow; checked all the same.
    let (Some(addr), Some(local_off)) = (req.remote_addr.checked_add(off), req.local_offset.checked_add(off)) else {
        batch.fail(i, Error::new(ErrorKind::OutOfBounds, "slice offset overflows"));
        return Staged::Skipped;
    };
    let id = ep.env.next_id();
    let write = req.op == Opcode::Write;
    let same = same_host_slice(ep, lane, &batch, i, write);
    // With staging on, device memory is always streamed: its copies run
    // off the runtime.
    let device = ep.env.staging.enabled() && batch.locals.get(i).is_some_and(|r| r.mem.provider().is_some());
    let stream = write && !same && (len > STREAM as u64 || device);
    {
        // Started and recorded as outstanding under the lane's lock, so
        // whoever quiets an ended request sees every started slice.
        let mut p = ep.lanes[lane].pending.lock();
        if p.dead {
            drop(p);
            batch.fail(i, Error::new(ErrorKind::ConnectionReset, "the endpoint was destroyed").with("peer", &ep.name));
            return Staged::Skipped;
        }
        // The ledger decides: a request that is not live is never touched.
        if !batch.start(i) {
            drop(p);
            return Staged::NotLive(batch, i);
        }
        let slice = Slice {
            batch: batch.clone(),
            req: i,
            len,
            local_off,
            op: req.op,
            remote: addr,
            same_host: same,
            landing: false,
            _using: using,
        };
        p.map.insert(id, slice);
        if stream {
            p.streaming = Some(id);
        }
    }
    // A slice is at most `slice_size` (<= 64 MiB) bytes; a same-host
    // WRITE carries the address of its bytes here instead.
    let inline = match (write, same) {
        (true, true) => 8,
        (true, false) if !stream => len as usize,
        _ => 0,
    };
    let start = *used;
    let frame_len = HEADER_LEN + inline;
    if buf.len() < start + frame_len {
        buf.resize(start + frame_len, 0);
    }
    let filled = if write && same {
        source_addr(&batch, i, local_off)
            .map(|a| buf[start + HEADER_LEN..start + frame_len].copy_from_slice(&a.to_le_bytes()))
    } else if inline > 0 {
        copy_out(&batch, i, local_off, &mut buf[start + HEADER_LEN..start + frame_len])
    } else {
        Ok(())
    };
    if let Err(e) = filled {
        let s = ep.lanes[lane].pending.lock().map.remove(&id);
        if let Some(s) = s {
            s.batch.slice_done(s.req, Err(e));
        }
        return Staged::Skipped;
    }
    let mut h = Header::new(if write { FrameType::Write } else { FrameType::Read });
    h.id = id;
    h.addr = addr;
    h.len = len;
    h.generation = generation;
    if same {
        h.flags = crate::proto::SAME_HOST;
    }
    if write {
        h.payload_len = if same { inline as u32 } else { len as u32 };
    }
    buf[start..start + HEADER_LEN].copy_from_slice(&h.encode());
    *used = start + frame_len;
    if stream {
        Staged::Stream(Streamed { batch, req: i, local_off, len, id, start, device })
    } else {
        Staged::Inline
    }
}

/// The address in this process of request `i`'s local bytes at `off`,
/// for a same-host WRITE (the peer copies them from there): the region
/// must still be registered.
fn source_addr(batch: &Batch, i: usize, off: u64) -> Result<u64> {
    let region = batch.locals.get(i).ok_or_else(|| Error::new(ErrorKind::Internal, "request without a region"))?;
    region
        .with_live(|m| m.addr().checked_add(off))
        .ok_or_else(|| Error::region_unregistered(region.id))?
        .ok_or_else(|| Error::new(ErrorKind::OutOfBounds, "local offset overflows"))
}

/// Puts one NOTIFY frame into `buf[*used..]` and records the note as
/// outstanding on `lane`. A note whose caller stopped waiting is dropped
/// unsent.
fn stage_note(ep: &Endpoint, lane: usize, note: Note, buf: &mut Vec<u8>, used: &mut usize) -> Staged {
    let Note { payload, generation, reply, using } = note;
    if reply.is_closed() {
        return Staged::Skipped;
    }
    // Built by `proto::encode_notify`: at most MAX_NOTIFY_PAYLOAD bytes.
    let Ok(payload_len) = u32::try_from(payload.len()) else {
        let _ = reply.send(Err(Error::new(ErrorKind::InvalidRequest, "notification too large")));
        return Staged::Skipped;
    };
    let id = ep.env.next_id();
    {
        let mut p = ep.lanes[lane].pending.lock();
        if p.dead {
            drop(p);
            let _ = reply
                .send(Err(Error::new(ErrorKind::ConnectionReset, "the endpoint was destroyed").with("peer", &ep.name)));
            return Staged::Skipped;
        }
        p.notes.insert(id, SentNote { reply, _using: using });
    }
    let mut h = Header::new(FrameType::Notify);
    h.id = id;
    h.generation = generation;
    h.payload_len = payload_len;
    let start = *used;
    let end = start + HEADER_LEN + payload.len();
    if buf.len() < end {
        buf.resize(end, 0);
    }
    buf[start..start + HEADER_LEN].copy_from_slice(&h.encode());
    buf[start + HEADER_LEN..end].copy_from_slice(&payload);
    *used = end;
    Staged::Inline
}

/// Writes the streamed slice's payload (see [`Staged::Stream`]) after the
/// frames in `buf[..used]`, chunk by chunk. Stops early (`Err`, the
/// connection cannot continue) if the request ended or a copy or write
/// failed. Once the last chunk is copied out of local memory (and before
/// it is written, so before the peer can answer) the slice is marked no
/// longer streaming on `lane`.
async fn stream_payload(
    lane: &Lane,
    w: &mut OwnedWriteHalf,
    buf: &mut Vec<u8>,
    used: usize,
    chunk: &mut Vec<u8>,
    Streamed { batch, req, local_off, len, .. }: Streamed,
) -> Result<()> {
    // The frames gathered so far go out with the first chunk of the
    // streamed payload (one `write`, no tiny header segment).
    let mut done = 0u64;
    while done < len {
        let n = (len - done).min(STREAM as u64) as usize;
        let (dst, prefix) = if done == 0 { (&mut *buf, used) } else { (&mut *chunk, 0) };
        if dst.len() < prefix + n {
            dst.resize(prefix + n, 0);
        }
        // The slice cannot end while it is streaming (the reader refuses
        // an early answer and only the teardown, after joining this task,
        // ends it), so the request is not terminal while this copies.
        if !batch.is_live(req) {
            return Err(Error::new(ErrorKind::Cancelled, "request ended while its slice was sent"));
        }
        copy_out(&batch, req, local_off + done, &mut dst[prefix..prefix + n])?;
        if done + n as u64 >= len {
            lane.pending.lock().streaming = None;
        }
        w.write_all(&dst[..prefix + n]).await.map_err(Error::from)?;
        done += n as u64;
    }
    Ok(())
}

/// Copies `n` bytes of `region` at `off` into the front of a staging
/// buffer (run on the blocking pool by [`copy_off`]).
fn chunk_out(region: Arc<Region>, off: u64, n: usize) -> impl FnOnce(&mut [u8]) -> Result<()> + Send + 'static {
    move |dst| {
        let dst = dst.get_mut(..n).ok_or_else(|| Error::new(ErrorKind::Internal, "chunk larger than a buffer"))?;
        region.read_live(off, dst)
    }
}

/// Ends streamed slice `id` before any byte of its frame went out: it
/// fails with `err`, and the frames gathered before it (`frames`) are
/// sent on their own.
async fn unsend(ep: &Endpoint, lane: usize, w: &mut OwnedWriteHalf, frames: &[u8], id: u64, err: Error) -> Result<()> {
    let s = {
        let mut p = ep.lanes[lane].pending.lock();
        p.streaming = None;
        p.map.remove(&id)
    };
    ep.lanes[lane].window.add_permits(1);
    if let Some(s) = s {
        s.batch.slice_done(s.req, Err(err));
    }
    if !frames.is_empty() {
        w.write_all(frames).await.map_err(Error::from)?;
    }
    Ok(())
}

/// Writes a streamed slice of device memory (see [`Staged::Stream`]) after
/// the frames in `buf`: its chunks are copied into staging buffers on the
/// blocking pool, the copy of the next chunk running while this one is
/// sent (when a second buffer is free). A first chunk that cannot be
/// copied ends the slice with the copy's error before its frame goes out
/// (the connection goes on); a later one breaks the connection (`Err`), as
/// half a frame is on the wire. Every copy started is counted in the
/// endpoint's `copies` (the teardown waits for them), so no copy runs once
/// the slice has ended.
async fn stream_device(ep: &Endpoint, lane: usize, w: &mut OwnedWriteHalf, buf: &[u8], s: Streamed) -> Result<()> {
    let Streamed { batch, req, local_off, len, id, start, .. } = s;
    let frames = buf.get(..start).unwrap_or_default();
    let staging = &ep.env.staging;
    let region = match batch.locals.get(req) {
        Some(r) => r.clone(),
        None => {
            return unsend(ep, lane, w, frames, id, Error::new(ErrorKind::Internal, "request without a region")).await
        }
    };
    let cancelled = || Error::new(ErrorKind::Cancelled, "request ended while its slice was sent");
    let first = match staging.acquire(Side::Initiator).await {
        Ok(b) => b,
        Err(e) => return unsend(ep, lane, w, frames, id, e).await,
    };
    let mut spare = staging.try_acquire(Side::Initiator);
    if !batch.is_live(req) {
        return unsend(ep, lane, w, frames, id, cancelled()).await;
    }
    let n0 = len.min(STAGE as u64) as usize;
    let mut cur = match copied(copy_off(first, &ep.copies, chunk_out(region.clone(), local_off, n0))).await? {
        (b, Ok(())) => b,
        (_, Err(e)) => return unsend(ep, lane, w, frames, id, e).await,
    };
    let mut head = Some(buf);
    let mut done = 0u64;
    loop {
        let n = (len - done).min(STAGE as u64) as usize;
        let next_at = done + n as u64;
        let last = next_at >= len;
        if last {
            // Copied out of local memory: the peer may answer now.
            ep.lanes[lane].pending.lock().streaming = None;
        }
        let m = (len - next_at.min(len)).min(STAGE as u64) as usize;
        let next = match spare.take() {
            Some(b) if !last => {
                if !batch.is_live(req) {
                    return Err(cancelled());
                }
                Some(copy_off(b, &ep.copies, chunk_out(region.clone(), local_off + next_at, m)))
            }
            other => {
                spare = other;
                None
            }
        };
        if let Some(h) = head.take() {
            w.write_all(h).await.map_err(Error::from)?;
        }
        w.write_all(cur.get(..n).unwrap_or_default()).await.map_err(Error::from)?;
        done = next_at;
        if last {
            return Ok(());
        }
        let (b, r) = match next {
            Some(h) => {
                let got = copied(h).await?;
                spare = Some(cur);
                got
            }
            None => {
                if !batch.is_live(req) {
                    return Err(cancelled());
                }
                copied(copy_off(cur, &ep.copies, chunk_out(region.clone(), local_off + done, m))).await?
            }
        };
        r?;
        cur = b;
    }
}

/// Most requests one submit copies directly.
const DIRECT_MAX_REQS: usize = 64;
/// Most bytes one submit copies directly (the submitting thread copies
/// them; larger work goes through the lanes, where the peer gathers its
/// copies).
const DIRECT_MAX_BYTES: u64 = 1 << 20;

/// Copies the WRITEs of `work` straight into the peer's memory, and its
/// READs straight out of it, on the submitting thread, when the peer
/// offered a direct-copy window on a lane (`transport_mem::window`) that
/// allows the range and the work is small (at most [`DIRECT_MAX_REQS`]
/// requests and [`DIRECT_MAX_BYTES`] bytes, each request one slice of host
/// memory; writes with `TcpConfig::direct_writes`, reads with
/// `direct_reads`). Each request so copied is complete when this returns:
/// a write's bytes are in the peer's memory (rule 11's order holds: a
/// notification sent later finds them there), a read's are in the local
/// region. What the window declines (a range it does not allow now, a
/// failed copy) is given back to go the usual way, which reports any real
/// error; `None` when nothing is left.
pub(crate) fn copy_direct(ep: &Arc<Endpoint>, mut work: Work) -> Option<Work> {
    let (writes, reads) = (ep.env.cfg.direct_writes, ep.env.cfg.direct_reads);
    if work.idx.len() > DIRECT_MAX_REQS || ep.is_dead() || !(writes || reads) {
        return Some(work);
    }
    let Some(view) = ep.lanes.iter().find_map(|l| l.direct.as_ref().filter(|v| !v.is_retired())) else {
        return Some(work);
    };
    let slice = ep.env.cfg.slice_size as u64;
    let mut bytes = 0u64;
    for &i in &work.idx {
        let Some(r) = work.batch.reqs.get(i as usize) else { return Some(work) };
        bytes = bytes.saturating_add(r.len);
    }
    if bytes > DIRECT_MAX_BYTES {
        return Some(work);
    }
    let batch = work.batch.clone();
    let (mut written, mut read) = (0u64, 0u64);
    work.idx.retain(|&k| {
        let i = k as usize;
        let (Some(r), Some(local)) = (batch.reqs.get(i), batch.locals.get(i)) else { return true };
        let allowed = match r.op {
            Opcode::Write => writes,
            Opcode::Read => reads,
        };
        if !allowed || r.len == 0 || r.len > slice || local.mem.provider().is_some() {
            return true;
        }
        let (Ok(off), Ok(len)) = (usize::try_from(r.local_offset), usize::try_from(r.len)) else { return true };
        // The ledger decides: a request that is not live is not touched
        // (and needs nothing more).
        if !batch.start(i) {
            return false;
        }
        let copied = local.with_live(|m| match r.op {
            Opcode::Write => view.write(m, off, len, r.remote_addr),
            Opcode::Read => view.read(m, off, len, r.remote_addr),
        });
        match copied {
            Some(Ok(())) => {
                match r.op {
                    Opcode::Write => written += r.len,
                    Opcode::Read => read += r.len,
                }
                batch.slice_done(i, Ok(()));
                false
            }
            None => {
                batch.slice_done(i, Err(Error::region_unregistered(local.id)));
                false
            }
            Some(Err(_declined)) => {
                batch.slice_back(i);
                true
            }
        }
    });
    if written + read > 0 {
        use std::sync::atomic::Ordering::Relaxed;
        ep.env.same_host_bytes.fetch_add(written + read, Relaxed);
        ep.env.direct_bytes.fetch_add(written, Relaxed);
        ep.env.direct_read_bytes.fetch_add(read, Relaxed);
        if written > 0 {
            metrics::counter!("kvmove_tcp_direct_write_bytes_total").increment(written);
        }
        if read > 0 {
            metrics::counter!("kvmove_tcp_direct_read_bytes_total").increment(read);
        }
    }
    (!work.idx.is_empty()).then_some(work)
}

/// Sends the slices of `work` at once from the submitting task, when they
/// are few and small (each one slice, inline) and a lane's sending side
/// is free with window room: no hand-off to the writer task, so no
/// wake-up between submit and the wire. Never waits: the frames are
/// written with non-blocking writes, and bytes the socket does not take
/// at once are flushed by a task of the lane (the sending side stays held
/// until then, so frames never interleave). Gives the work back when it
/// cannot be sent this way (the caller queues it).
pub(crate) fn send_now(ep: &Arc<Endpoint>, work: Work) -> Option<Work> {
    /// At most this many requests go out this way per call.
    const MAX_NOW: usize = 64;
    let n = work.idx.len();
    if n == 0 || n > MAX_NOW || ep.is_dead() || ep.has_queued() {
        return Some(work);
    }
    let slice = ep.env.cfg.slice_size as u64;
    let mut inline = 0u64;
    for &i in &work.idx {
        let Some(r) = work.batch.reqs.get(i as usize) else { return Some(work) };
        if r.len == 0 || r.len > slice || r.len > STREAM as u64 {
            return Some(work);
        }
        // With staging on, a device write's copy runs off the runtime, from
        // a lane task, never on the submitting thread.
        let device =
            ep.env.staging.enabled() && work.batch.locals.get(i as usize).is_some_and(|l| l.mem.provider().is_some());
        if r.op == Opcode::Write && device {
            return Some(work);
        }
        if r.op == Opcode::Write {
            inline += r.len;
        }
    }
    if inline + (n * HEADER_LEN) as u64 > COALESCE as u64 {
        return Some(work);
    }
    let Ok(places) = u32::try_from(n) else { return Some(work) };
    // A lane with its sending side free and room for every slice.
    let found = ep.lanes.iter().enumerate().find_map(|(k, lane)| {
        let out = lane.out.clone().try_lock_owned().ok()?;
        let permits = lane.window.try_acquire_many(places).ok()?;
        permits.forget();
        Some((k, out))
    });
    let Some((k, mut out)) = found else { return Some(work) };
    let lane = &ep.lanes[k];
    let LaneOut { w, buf } = &mut *out;
    let Some(w) = w.as_ref() else {
        lane.window.add_permits(n);
        return Some(work);
    };
    let mut used = 0;
    for &i in &work.idx {
        let i = i as usize;
        let len = work.batch.reqs.get(i).map_or(0, |r| r.len);
        let next =
            Next { batch: work.batch.clone(), req: i, off: 0, len, generation: work.generation, using: work.using() };
        match stage(ep, k, next, buf, &mut used) {
            Staged::Inline => {}
            // Never streamed (filtered above); not sent either way.
            Staged::Skipped | Staged::NotLive(..) | Staged::Stream(_) => lane.window.add_permits(1),
        }
    }
    let mut sent = 0;
    while sent < used {
        match w.try_write(&buf[sent..used]) {
            Ok(0) => {
                ep.broke(Error::new(ErrorKind::ConnectionReset, "the connection took no bytes").with("peer", &ep.name));
                return None;
            }
            Ok(m) => sent += m,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) => {
                ep.broke(Error::from(e).with("peer", &ep.name));
                return None;
            }
        }
    }
    if sent < used {
        // The rest goes out from a lane task; the sending side stays held
        // (moved into it) until then.
        let ep2 = ep.clone();
        let flush = async move {
            let LaneOut { w, buf } = &mut *out;
            let Some(w) = w.as_mut() else { return };
            if let Err(e) = w.write_all(&buf[sent..used]).await {
                ep2.broke(Error::from(e).with("peer", &ep2.name));
            }
        };
        if !ep.add_task(|| ep.env.tasks.spawn(flush)) {
            // Being torn down: the staged slices fail with the endpoint.
            return None;
        }
    }
    None
}

async fn writer(ep: Arc<Endpoint>, lane: usize) {
    let mut chunk: Vec<u8> = Vec::new();
    let window = &ep.lanes[lane].window;
    loop {
        let Ok(permit) = window.acquire().await else { return };
        permit.forget();
        let first = loop {
            let notified = ep.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(s) = ep.take_item() {
                // Writers are woken one at a time: pass the rest on.
                if ep.has_queued() {
                    ep.notify.notify_one();
                }
                break s;
            }
            notified.await;
        };
        // The sending side, held across the writes below (a submit sending
        // at once, or its flush, may hold it briefly).
        let mut out = ep.lanes[lane].out.lock().await;
        let LaneOut { w, buf } = &mut *out;
        let Some(w) = w.as_mut() else { return };
        let mut used = 0;
        let mut staged = 0usize;
        let mut streamed = None;
        // Stage the first slice, then coalesce more while the window has
        // room, up to COALESCE bytes or a slice that must stream.
        let mut next = Some(first);
        while let Some(item) = next.take() {
            let staged_now = match item {
                Item::Slice(n) => stage(&ep, lane, n, buf, &mut used),
                Item::Note(n) => stage_note(&ep, lane, n, buf, &mut used),
            };
            match staged_now {
                Staged::Skipped => window.add_permits(1),
                Staged::NotLive(batch, req) => {
                    window.add_permits(1);
                    ep.skip_rest(&batch, req);
                }
                Staged::Inline => staged += 1,
                Staged::Stream(s) => {
                    staged += 1;
                    streamed = Some(s);
                }
            }
            if streamed.is_some() || used >= COALESCE {
                break;
            }
            let Ok(p) = window.try_acquire() else { break };
            next = ep.take_item();
            if next.is_some() {
                p.forget();
            }
        }
        if staged == 0 {
            continue;
        }
        let Some(streamed) = streamed else {
            if let Err(e) = w.write_all(&buf[..used]).await {
                return ep.broke(Error::from(e).with("peer", &ep.name));
            }
            continue;
        };
        let sent = if streamed.device {
            stream_device(&ep, lane, w, &buf[..used], streamed).await
        } else {
            stream_payload(&ep.lanes[lane], w, buf, used, &mut chunk, streamed).await
        };
        if let Err(e) = sent {
            // Half a frame may be on the wire: the connection cannot
            // continue (and the peer never applies bytes after the reset).
            // The slice ends when the endpoint is destroyed.
            return ep.broke(e.with("peer", &ep.name));
        }
        if buf.len() > 2 * COALESCE.max(ep.env.cfg.slice_size + HEADER_LEN) {
            *buf = Vec::new();
        }
    }
}
