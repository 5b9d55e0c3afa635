//! An endpoint: the pool of lanes (TCP connections) to one peer, the queue
//! of work they pull slices from, and its destruction.
//!
//! Each lane has a writer task (pulls slices, copies WRITE payloads out of
//! local memory into a bounded send buffer, coalesces small frames into one
//! `write`) and a reader task (matches answers to outstanding slices by
//! request id, copies READ payloads into local memory). A lane may have
//! `window` slices outstanding. Any lane error destroys the whole endpoint
//! (rule 2): it is removed from the cache, its tasks are aborted and
//! joined (closing the sockets with RST), and only then are its queued and
//! outstanding slices failed, so their requests are reported terminal only
//! when nothing can touch their memory any more.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;
use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{Notify, Semaphore};
use tokio::task::JoinHandle;
use transport_core::{Error, ErrorKind, Opcode, Result};

use crate::batch::Batch;
use crate::config::TcpConfig;
use crate::conn::{self, read_header, status_err};
use crate::proto::{FrameType, Header, Status, WireRegion, HEADER_LEN};
use crate::tasks::{spawn_counted, Counters};

/// Bytes a writer gathers before one `write` when slices are small.
const COALESCE: usize = 256 << 10;
/// Payloads larger than this are copied and sent (or received and copied)
/// in chunks of this size, so each copy stays in cache.
const STREAM: usize = 256 << 10;

/// What `stage` did with a slice.
enum Staged {
    /// Ended without being sent (its request is gone).
    Skipped,
    /// The whole frame is in the send buffer.
    Inline,
    /// The header is in the send buffer; the payload is to be streamed.
    Stream { batch: Arc<Batch>, req: usize, local_off: u64, len: u64 },
}

/// The requests of one batch routed to one endpoint, and how far the lanes
/// got in cutting them into slices.
#[derive(Debug)]
pub(crate) struct Work {
    pub batch: Arc<Batch>,
    pub idx: Vec<u32>,
    pub generation: u64,
    pos: usize,
    off: u64,
}

impl Work {
    pub fn new(batch: Arc<Batch>, idx: Vec<u32>, generation: u64) -> Self {
        Self { batch, idx, generation, pos: 0, off: 0 }
    }
}

#[derive(Debug)]
struct Slice {
    batch: Arc<Batch>,
    req: usize,
    len: u64,
    local_off: u64,
    op: Opcode,
}

/// A slice taken out of the pending map by the reader; ends on drop.
struct Held {
    s: Slice,
    done: bool,
}

impl Held {
    fn finish(mut self, err: Option<Error>) {
        self.done = true;
        self.s.batch.slice_done(self.s.req, err);
    }
}

impl std::ops::Deref for Held {
    type Target = Slice;
    fn deref(&self) -> &Slice {
        &self.s
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if !self.done {
            let err = Error::new(ErrorKind::ConnectionReset, "the endpoint was destroyed mid-answer");
            self.s.batch.slice_done(self.s.req, Some(err));
        }
    }
}

#[derive(Debug, Default)]
struct Pending {
    dead: bool,
    map: HashMap<u64, Slice>,
}

#[derive(Debug)]
struct Lane {
    pending: Mutex<Pending>,
    window: Semaphore,
}

/// The set of live endpoints; an endpoint removes itself when destroyed.
#[derive(Debug, Default)]
pub(crate) struct Cache {
    pub map: Mutex<HashMap<String, Arc<Endpoint>>>,
}

/// The lane pool to one peer.
#[derive(Debug)]
pub(crate) struct Endpoint {
    pub name: String,
    pub addr: SocketAddr,
    /// The peer's generation, the same on every lane's handshake.
    pub generation: u64,
    /// The regions the peer exposed when the endpoint was built.
    pub regions: Vec<WireRegion>,
    cfg: Arc<TcpConfig>,
    counters: Arc<Counters>,
    cache: Weak<Cache>,
    lanes: Vec<Lane>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    queue: Mutex<VecDeque<Work>>,
    notify: Notify,
    dead: AtomicBool,
    last_used: AtomicU64,
}

impl Endpoint {
    /// Connects `cfg.lanes` lanes to `addr`, fetches the descriptor over
    /// the first, and starts the lane tasks.
    pub async fn connect(
        name: &str,
        addr: SocketAddr,
        cfg: Arc<TcpConfig>,
        counters: Arc<Counters>,
        cache: &Arc<Cache>,
    ) -> Result<Arc<Endpoint>> {
        let mut streams = Vec::with_capacity(cfg.lanes);
        let mut generation = 0;
        let mut regions = Vec::new();
        for i in 0..cfg.lanes {
            let (mut s, hello) = conn::connect(addr, &cfg, name).await?;
            if i == 0 {
                let (g, r) = conn::fetch_regions(&mut s, &cfg, counters.next_id(), name).await?;
                if g != hello.generation {
                    return Err(Error::new(ErrorKind::PeerRestarted, "generation changed during the handshake")
                        .with("peer", name));
                }
                generation = g;
                regions = r;
            } else if hello.generation != generation {
                return Err(Error::new(ErrorKind::PeerRestarted, "the peer restarted while lanes were connecting")
                    .with("peer", name));
            }
            streams.push(s);
        }
        let ep = Arc::new(Endpoint {
            name: name.to_owned(),
            addr,
            generation,
            regions,
            lanes: (0..cfg.lanes)
                .map(|_| Lane { pending: Mutex::new(Pending::default()), window: Semaphore::new(cfg.window) })
                .collect(),
            cfg,
            counters: counters.clone(),
            cache: Arc::downgrade(cache),
            tasks: Mutex::new(Vec::new()),
            queue: Mutex::new(VecDeque::new()),
            notify: Notify::new(),
            dead: AtomicBool::new(false),
            last_used: AtomicU64::new(counters.now_ms()),
        });
        counters.lanes.fetch_add(streams.len(), Ordering::Relaxed);
        let mut tasks = Vec::with_capacity(2 * streams.len());
        for (i, s) in streams.into_iter().enumerate() {
            let (r, w) = s.into_split();
            tasks.push(spawn_counted(&counters, ep.clone().reader(i, r)));
            tasks.push(spawn_counted(&counters, ep.clone().writer(i, w)));
        }
        *ep.tasks.lock() = tasks;
        Ok(ep)
    }

    pub fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// Milliseconds (transport clock) of the last use.
    pub fn last_used(&self) -> u64 {
        self.last_used.load(Ordering::Relaxed)
    }

    /// Whether any slice is queued or outstanding.
    pub fn busy(&self) -> bool {
        !self.queue.lock().is_empty() || self.lanes.iter().any(|l| !l.pending.lock().map.is_empty())
    }

    /// Whether `batch` has slices queued or outstanding here.
    pub fn carries(&self, batch: &Arc<Batch>) -> bool {
        self.queue.lock().iter().any(|w| Arc::ptr_eq(&w.batch, batch))
            || self.lanes.iter().any(|l| l.pending.lock().map.values().any(|s| Arc::ptr_eq(&s.batch, batch)))
    }

    /// Queues work for the lanes. Fails it at once if the endpoint died.
    pub fn enqueue(&self, work: Work) {
        self.last_used.store(self.counters.now_ms(), Ordering::Relaxed);
        {
            let mut q = self.queue.lock();
            if !self.is_dead() {
                q.push_back(work);
                drop(q);
                self.notify.notify_waiters();
                return;
            }
        }
        let err = Error::new(ErrorKind::ConnectionReset, "the endpoint was destroyed").with("peer", &self.name);
        fail_work(&work, self.cfg.slice_size as u64, &err);
    }

    /// Removes `batch`'s queued (unsent) slices, ending them as skipped.
    pub fn unqueue(&self, batch: &Arc<Batch>) {
        let removed: Vec<Work> = {
            let mut q = self.queue.lock();
            let (out, keep): (Vec<Work>, Vec<Work>) = q.drain(..).partition(|w| Arc::ptr_eq(&w.batch, batch));
            q.extend(keep);
            out
        };
        for w in &removed {
            end_work(w, self.cfg.slice_size as u64, None);
        }
    }

    /// Marks the endpoint broken and destroys it in the background (used
    /// from lane tasks, which cannot join themselves).
    fn broke(self: &Arc<Self>, err: Error) {
        if self.dead.load(Ordering::Acquire) {
            return;
        }
        tracing::warn!(peer = %self.name, error = %err, "endpoint broken; destroying it");
        let ep = self.clone();
        spawn_counted(&self.counters, async move { ep.destroy(err).await });
    }

    /// Destroys the endpoint: out of the cache, lane tasks aborted and
    /// joined (sockets closed with RST), then every queued and outstanding
    /// slice failed with `err`. Idempotent; returns when all of it is done.
    pub async fn destroy(self: &Arc<Self>, err: Error) {
        self.dead.store(true, Ordering::Release);
        if let Some(cache) = self.cache.upgrade() {
            let mut m = cache.map.lock();
            if m.get(&self.name).is_some_and(|e| Arc::ptr_eq(e, self)) {
                m.remove(&self.name);
            }
        }
        for l in &self.lanes {
            l.pending.lock().dead = true;
        }
        let tasks = std::mem::take(&mut *self.tasks.lock());
        if tasks.is_empty() {
            return;
        }
        for t in &tasks {
            t.abort();
        }
        for t in tasks {
            let _ = t.await;
        }
        self.counters.lanes.fetch_sub(self.lanes.len(), Ordering::Relaxed);
        let queued: Vec<Work> = self.queue.lock().drain(..).collect();
        for w in &queued {
            fail_work(w, self.cfg.slice_size as u64, &err);
        }
        for l in &self.lanes {
            let slices: Vec<Slice> = l.pending.lock().map.drain().map(|(_, s)| s).collect();
            for s in slices {
                s.batch.slice_done(s.req, Some(err.clone()));
            }
        }
    }

    /// Takes the next slice off the queue.
    fn take_slice(&self) -> Option<(Arc<Batch>, usize, u64, u64, u64)> {
        let mut q = self.queue.lock();
        let slice = self.cfg.slice_size as u64;
        loop {
            let w = q.front_mut()?;
            let Some(&i) = w.idx.get(w.pos) else {
                q.pop_front();
                continue;
            };
            let i = i as usize;
            let req = w.batch.reqs[i];
            let off = w.off;
            let len = slice.min(req.len - off);
            w.off += len;
            if w.off >= req.len {
                w.pos += 1;
                w.off = 0;
            }
            let generation = w.generation;
            let batch = w.batch.clone();
            if w.pos >= w.idx.len() {
                q.pop_front();
            }
            return Some((batch, i, off, len, generation));
        }
    }

    /// Puts one slice's frame into `buf[*used..]` and records it as
    /// outstanding on `lane`. A WRITE larger than [`STREAM`] gets only its
    /// header here: its payload is streamed by the writer in chunks, each
    /// copied while the request is checked alive, so the copy stays in
    /// cache and overlaps the socket.
    #[allow(clippy::too_many_arguments)]
    fn stage(
        &self,
        lane: usize,
        batch: Arc<Batch>,
        i: usize,
        off: u64,
        len: u64,
        generation: u64,
        buf: &mut Vec<u8>,
        used: &mut usize,
    ) -> Staged {
        let req = batch.reqs[i];
        let id = self.counters.next_id();
        let mut h = Header::new(if req.op == Opcode::Write { FrameType::Write } else { FrameType::Read });
        h.id = id;
        h.addr = req.remote_addr + off;
        h.len = len;
        h.generation = generation;
        let start = *used;
        let stream = req.op == Opcode::Write && len as usize > STREAM;
        let inline = if req.op == Opcode::Write && !stream { len as usize } else { 0 };
        let frame_len = HEADER_LEN + inline;
        if buf.len() < start + frame_len {
            buf.resize(start + frame_len, 0);
        }
        if req.op == Opcode::Write {
            h.payload_len = len as u32;
        }
        if inline > 0 {
            let copied = match batch.enter(i) {
                None => Ok(false),
                Some(_g) => {
                    let dst = &mut buf[start + HEADER_LEN..start + frame_len];
                    match batch.locals[i].with_live(|m| m.read_at((req.local_offset + off) as usize, dst)) {
                        Some(Ok(())) => Ok(true),
                        Some(Err(e)) => Err(Error::from(e)),
                        None => Err(Error::new(ErrorKind::Unregistered, "the local region was unregistered")),
                    }
                }
            };
            match copied {
                Ok(true) => {}
                Ok(false) => {
                    batch.slice_done(i, None);
                    return Staged::Skipped;
                }
                Err(e) => {
                    batch.slice_done(i, Some(e));
                    return Staged::Skipped;
                }
            }
        } else if !batch.is_alive(i) {
            batch.slice_done(i, None);
            return Staged::Skipped;
        }
        buf[start..start + HEADER_LEN].copy_from_slice(&h.encode());
        let mut p = self.lanes[lane].pending.lock();
        if p.dead {
            drop(p);
            let err = Error::new(ErrorKind::ConnectionReset, "the endpoint was destroyed").with("peer", &self.name);
            batch.slice_done(i, Some(err));
            return Staged::Skipped;
        }
        let local_off = req.local_offset + off;
        p.map.insert(id, Slice { batch: batch.clone(), req: i, len, local_off, op: req.op });
        *used = start + frame_len;
        if stream {
            Staged::Stream { batch, req: i, local_off, len }
        } else {
            Staged::Inline
        }
    }

    async fn writer(self: Arc<Self>, lane: usize, mut w: OwnedWriteHalf) {
        let mut buf: Vec<u8> = Vec::new();
        let mut chunk: Vec<u8> = Vec::new();
        loop {
            let Ok(permit) = self.lanes[lane].window.acquire().await else { return };
            permit.forget();
            let first = loop {
                let notified = self.notify.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if let Some(s) = self.take_slice() {
                    break s;
                }
                notified.await;
            };
            let mut used = 0;
            let mut staged = 0usize;
            let mut streamed = None;
            // Stage the first slice, then coalesce more while the window
            // has room, up to COALESCE bytes or a slice that must stream.
            let mut next = Some(first);
            while let Some((b, i, off, len, g)) = next.take() {
                match self.stage(lane, b, i, off, len, g, &mut buf, &mut used) {
                    Staged::Skipped => self.lanes[lane].window.add_permits(1),
                    Staged::Inline => staged += 1,
                    Staged::Stream { batch, req, local_off, len } => {
                        staged += 1;
                        streamed = Some((batch, req, local_off, len));
                    }
                }
                if streamed.is_some() || used >= COALESCE {
                    break;
                }
                let Ok(p) = self.lanes[lane].window.try_acquire() else { break };
                next = self.take_slice();
                if next.is_some() {
                    p.forget();
                }
            }
            if staged == 0 {
                continue;
            }
            let Some((batch, req, local_off, len)) = streamed else {
                if let Err(e) = w.write_all(&buf[..used]).await {
                    self.broke(Error::from(e).with("peer", &self.name));
                    return;
                }
                continue;
            };
            // The frames gathered so far go out with the first chunk of
            // the streamed payload (one `write`, no tiny header segment).
            let mut done = 0u64;
            while done < len {
                let n = (len - done).min(STREAM as u64) as usize;
                let (dst, prefix) = if done == 0 { (&mut buf, used) } else { (&mut chunk, 0) };
                if dst.len() < prefix + n {
                    dst.resize(prefix + n, 0);
                }
                let copied = match batch.enter(req) {
                    None => Err(Error::new(ErrorKind::Cancelled, "request ended while its slice was sent")),
                    Some(_g) => match batch.locals[req]
                        .with_live(|m| m.read_at((local_off + done) as usize, &mut dst[prefix..prefix + n]))
                    {
                        Some(Ok(())) => Ok(()),
                        Some(Err(e)) => Err(Error::from(e)),
                        None => Err(Error::new(ErrorKind::Unregistered, "the local region was unregistered")),
                    },
                };
                if let Err(e) = copied {
                    // Half a frame may be on the wire: the connection
                    // cannot continue (and the peer never applies bytes
                    // after the reset). The slice ends when the endpoint
                    // is destroyed.
                    self.broke(e.with("peer", &self.name));
                    return;
                }
                if let Err(e) = w.write_all(&dst[..prefix + n]).await {
                    self.broke(Error::from(e).with("peer", &self.name));
                    return;
                }
                done += n as u64;
            }
            if buf.len() > 2 * COALESCE.max(self.cfg.slice_size + HEADER_LEN) {
                buf = Vec::new();
            }
        }
    }

    async fn reader(self: Arc<Self>, lane: usize, r: OwnedReadHalf) {
        let mut r = BufReader::with_capacity(COALESCE, r);
        let mut payload: Vec<u8> = Vec::new();
        let peer = self.name.clone();
        loop {
            let h = match read_header(&mut r, self.cfg.max_frame, &peer).await {
                Ok(h) => h,
                Err(e) => return self.broke(e),
            };
            self.last_used.store(self.counters.now_ms(), Ordering::Relaxed);
            match h.ty {
                FrameType::WriteAck | FrameType::ReadResp => {}
                other => {
                    return self.broke(
                        Error::new(ErrorKind::Protocol, format!("unexpected {other:?} frame")).with("peer", &peer),
                    )
                }
            }
            let n = h.payload_len as usize;
            let slice = self.lanes[lane].pending.lock().map.remove(&h.id);
            let Some(s) = slice else {
                if self.is_dead() {
                    return;
                }
                return self
                    .broke(Error::new(ErrorKind::Protocol, "answer to an unknown request id").with("peer", &peer));
            };
            // Held across the payload reads: if this task is aborted (the
            // endpoint is destroyed) the slice still ends, after the task.
            let s = Held { s, done: false };
            let expected = if s.op == Opcode::Write { FrameType::WriteAck } else { FrameType::ReadResp };
            if h.ty != expected || (h.status == Status::Ok && h.ty == FrameType::ReadResp && h.len != s.len) {
                let err = Error::new(ErrorKind::Protocol, "mismatched answer").with("peer", &peer);
                s.finish(Some(err.clone()));
                return self.broke(err);
            }
            // Stream the payload into local memory chunk by chunk, each
            // copy under the batch gate (a request ended meanwhile gets no
            // more bytes; the rest is drained).
            let mut err = if h.status != Status::Ok { Some(status_err(h.status, &peer)) } else { None };
            let mut done = 0usize;
            while done < n {
                let k = (n - done).min(STREAM);
                if payload.len() < k {
                    payload.resize(k, 0);
                }
                if let Err(e) = tokio::io::AsyncReadExt::read_exact(&mut r, &mut payload[..k]).await {
                    let e = Error::from(e).with("peer", &peer);
                    s.finish(Some(e.clone()));
                    return self.broke(e);
                }
                if err.is_none() {
                    if let Some(_g) = s.batch.enter(s.req) {
                        err = match s.batch.locals[s.req]
                            .with_live(|m| m.write_at(s.local_off as usize + done, &payload[..k]))
                        {
                            Some(Ok(())) => None,
                            Some(Err(e)) => Some(Error::from(e)),
                            None => Some(Error::new(ErrorKind::Unregistered, "the local region was unregistered")),
                        };
                    }
                }
                done += k;
            }
            self.lanes[lane].window.add_permits(1);
            s.finish(err);
            if payload.len() > 2 * self.cfg.slice_size {
                payload = Vec::new();
            }
        }
    }
}

/// Number of slices of `len` bytes from `off`.
fn slices_from(len: u64, off: u64, slice: u64) -> u64 {
    (len - off).div_ceil(slice)
}

/// Ends every slice of `w` not yet taken by a lane.
fn end_work(w: &Work, slice: u64, err: Option<&Error>) {
    for (k, &i) in w.idx.iter().enumerate().skip(w.pos) {
        let i = i as usize;
        let off = if k == w.pos { w.off } else { 0 };
        for _ in 0..slices_from(w.batch.reqs[i].len, off, slice) {
            w.batch.slice_done(i, err.cloned());
        }
    }
}

fn fail_work(w: &Work, slice: u64, err: &Error) {
    end_work(w, slice, Some(err));
}
