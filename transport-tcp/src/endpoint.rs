//! An endpoint: the pool of lanes (TCP connections) to one peer, the queue
//! of work its lanes pull slices from (and of notifications, rule 11), and
//! its destruction. The lane tasks themselves are in `lane.rs`.
//!
//! Any lane error destroys the whole endpoint (rule 2): the pool retires it
//! (never handed out again), its lane tasks are aborted and joined (closing
//! the sockets with RST), only then are its queued and outstanding slices
//! failed, and only then is its slot given back to the pool
//! ([`Slots::destroyed`]), so the sockets never outnumber the bound and a
//! request is reported terminal only when nothing can touch its memory.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use futures::future::{BoxFuture, FutureExt, Shared};
use parking_lot::Mutex;
use tokio::sync::{oneshot, Notify, Semaphore};
use tokio::task::JoinHandle;
use transport_core::lifecycle::{EndpointId, TaskSet};
use transport_core::{Error, ErrorKind, Opcode, Result};

use crate::batch::Batch;
use crate::config::TcpConfig;
use crate::hush::LaneHush;
use crate::pool::Slots;
use crate::proto::WireRegion;
use crate::samehost::SameHost;
use crate::staging::{Count, Staging};
use transport_mem::window::WindowView;

/// What every endpoint of one transport shares: the configuration, the
/// counted tasks, the socket count and the request id source.
#[derive(Debug)]
pub(crate) struct Env {
    pub cfg: Arc<TcpConfig>,
    pub tasks: TaskSet,
    /// Client sockets (lanes) open, for `stats().endpoint_lanes`.
    pub lanes: AtomicUsize,
    /// Bytes this side's requests moved by same-host copies (answered
    /// writes the peer copied, reads copied here).
    pub same_host_bytes: AtomicU64,
    /// Of those, the bytes this side wrote directly into peers' memory
    /// (`lane::copy_direct`).
    pub direct_bytes: AtomicU64,
    /// And the bytes it read directly out of peers' memory.
    pub direct_read_bytes: AtomicU64,
    /// Request ids: unique per transport, never reused, so a late answer
    /// can never be taken for another slice's.
    next_id: AtomicU64,
    /// Host buffers for device copies (shared with the server).
    pub staging: Arc<Staging>,
}

impl Env {
    pub fn new(cfg: Arc<TcpConfig>, tasks: TaskSet, staging: Arc<Staging>) -> Arc<Self> {
        Arc::new(Self {
            cfg,
            tasks,
            staging,
            lanes: AtomicUsize::new(0),
            same_host_bytes: AtomicU64::new(0),
            direct_bytes: AtomicU64::new(0),
            direct_read_bytes: AtomicU64::new(0),
            next_id: AtomicU64::new(1),
        })
    }

    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }
}

/// The endpoint slots of a transport.
pub(crate) type EndpointSlots = Slots<Endpoint>;
/// One counted use of an endpoint (held by work and its slices).
pub(crate) type EndpointUse = Arc<transport_core::lifecycle::EndpointUse<Slots<Endpoint>>>;

/// The requests of one batch routed to one endpoint, and how far the lanes
/// got in cutting them into slices.
#[derive(Debug)]
pub(crate) struct Work {
    pub batch: Arc<Batch>,
    pub idx: Vec<u32>,
    pub generation: u64,
    pos: usize,
    off: u64,
    using: EndpointUse,
}

impl Work {
    pub fn new(batch: Arc<Batch>, idx: Vec<u32>, generation: u64, using: EndpointUse) -> Self {
        Self { batch, idx, generation, pos: 0, off: 0, using }
    }

    /// Another counted use for one of its slices.
    pub fn using(&self) -> EndpointUse {
        self.using.clone()
    }

    /// Fails every request of `w` not yet wholly cut into slices (slices
    /// already started end on their own).
    fn fail(&self, err: &Error) {
        for &i in self.idx.iter().skip(self.pos) {
            self.batch.fail(i as usize, err.clone());
        }
    }
}

/// The next slice to send, taken off the queue.
pub(crate) struct Next {
    pub batch: Arc<Batch>,
    pub req: usize,
    pub off: u64,
    pub len: u64,
    pub generation: u64,
    pub using: EndpointUse,
}

/// A slice on the wire (started in its batch's ledger).
#[derive(Debug)]
pub(crate) struct Slice {
    pub batch: Arc<Batch>,
    pub req: usize,
    pub len: u64,
    pub local_off: u64,
    pub op: Opcode,
    /// Its address in the peer (a same-host READ copies from there).
    pub remote: u64,
    /// Sent as a same-host copy (no payload either way).
    pub same_host: bool,
    /// Answered, its bytes still being copied into device memory (a
    /// staged READ): any further answer to it is a protocol error.
    pub landing: bool,
    /// Keeps the endpoint counted as in use until the slice ends.
    pub _using: EndpointUse,
}

/// A notification (rule 11) waiting for a lane: the NOTIFY payload, the
/// generation of the peer it is meant for, and where its answer goes.
#[derive(Debug)]
pub(crate) struct Note {
    pub payload: Vec<u8>,
    pub generation: u64,
    pub reply: oneshot::Sender<Result<()>>,
    /// Keeps the endpoint counted as in use until the note is answered.
    pub using: EndpointUse,
}

/// A notification on the wire, waiting for its NOTIFY_ACK.
#[derive(Debug)]
pub(crate) struct SentNote {
    pub reply: oneshot::Sender<Result<()>>,
    pub _using: EndpointUse,
}

/// What a lane's writer takes off the endpoint's queues next.
pub(crate) enum Item {
    Slice(Next),
    Note(Note),
}

#[derive(Debug, Default)]
pub(crate) struct Pending {
    pub dead: bool,
    pub map: HashMap<u64, Slice>,
    /// Notifications sent on this lane and not yet answered (each holds a
    /// window permit, like a slice).
    pub notes: HashMap<u64, SentNote>,
    /// The WRITE slice whose payload the writer is streaming out of local
    /// memory: an answer to it before it is wholly sent is a protocol
    /// error (its slice must not end while the writer still reads the
    /// caller's buffer).
    pub streaming: Option<u64>,
}

impl Pending {
    /// Slices or notifications sent on the lane wait for their answers.
    pub fn awaits_answers(&self) -> bool {
        !self.dead && (!self.map.is_empty() || !self.notes.is_empty())
    }
}

#[derive(Debug)]
pub(crate) struct Lane {
    pub pending: Mutex<Pending>,
    pub window: Semaphore,
    /// What this lane moves by same-host copies (agreed at its handshake).
    pub same_host: SameHost,
    /// The peer's window of direct writes for this lane's connection
    /// (offered at its handshake), used by `lane::copy_direct`.
    pub direct: Option<Arc<WindowView>>,
    /// The lane's sending side. Whoever holds it is the only one putting
    /// bytes on the socket: the writer task (across its writes), or a
    /// submit sending small work at once (`lane::send_now`, without
    /// waiting). The teardown takes the socket out once the lane tasks are
    /// joined.
    pub out: Arc<tokio::sync::Mutex<LaneOut>>,
    /// The lane's receiving side: read by its reader task and by callers
    /// polling (`crate::batch::Carrier::progress`), one at a time. The teardown takes
    /// it (waiting for a caller reading) once the lane tasks are joined.
    pub rx: Mutex<Rx>,
    /// Whether callers polling their transfers keep arrivals from waking
    /// the runtime (`crate::hush`).
    pub hush: Mutex<LaneHush>,
}

/// A slice answer whose payload is still arriving (see [`Rx`]).
#[derive(Debug)]
pub(crate) struct Body {
    pub id: u64,
    pub batch: Arc<Batch>,
    pub req: usize,
    pub local_off: u64,
    /// The payload goes into local memory (a READ that is still fine).
    pub copy: bool,
    pub len: usize,
    pub done: usize,
    pub result: Result<()>,
    /// A READ into device memory with staging on: its bytes go through
    /// staging buffers, copied into the device off the reader.
    pub staged: Option<crate::staging::StagedRead>,
}

/// The reading state of one lane: its socket's read half, the bytes read
/// and not yet applied, and the answer whose payload is still arriving.
/// Read and applied by `crate::rx` (the lane's reader task, or a caller
/// polling); defined here, with the lane, so the endpoint needs nothing of
/// the reading itself.
#[derive(Debug, Default)]
pub(crate) struct Rx {
    /// `None` until the lane is connected, and again once torn down.
    pub sock: Option<Arc<tokio::net::tcp::OwnedReadHalf>>,
    pub buf: Vec<u8>,
    /// Unread bytes are `buf[lo..hi]`.
    pub lo: usize,
    pub hi: usize,
    pub body: Option<Body>,
    pub stopped: bool,
}

impl Rx {
    /// Starts reading `sock` (a new lane).
    pub fn attach(&mut self, sock: Arc<tokio::net::tcp::OwnedReadHalf>) {
        self.sock = Some(sock);
    }

    /// Stops reading for good and lets go of the socket (the teardown,
    /// once the reader task is joined).
    pub fn detach(&mut self) {
        self.stopped = true;
        self.sock = None;
        self.body = None;
        self.buf = Vec::new();
    }
}

/// A lane's socket (write half) and its staging buffer.
#[derive(Debug, Default)]
pub(crate) struct LaneOut {
    /// `None` until the lane is connected, and again once torn down.
    pub w: Option<tokio::net::tcp::OwnedWriteHalf>,
    pub buf: Vec<u8>,
}

/// The lane tasks of an endpoint, and whether its teardown took them.
#[derive(Debug, Default)]
struct LaneTasks {
    handles: Vec<JoinHandle<()>>,
    taken: bool,
}

/// The lane pool to one peer.
#[derive(Debug)]
pub(crate) struct Endpoint {
    pub id: EndpointId,
    pub name: String,
    pub addr: SocketAddr,
    /// The peer's generation, the same on every lane's handshake.
    pub generation: u64,
    /// The regions the peer exposed when the endpoint was built.
    pub regions: Vec<WireRegion>,
    pub env: Arc<Env>,
    slots: Weak<EndpointSlots>,
    pub lanes: Vec<Lane>,
    tasks: Mutex<LaneTasks>,
    queue: Mutex<VecDeque<Work>>,
    /// Notifications waiting for a lane; taken before slices (they are
    /// small, and their callers wait for the answer).
    notes: Mutex<VecDeque<Note>>,
    pub notify: Notify,
    dead: AtomicBool,
    /// The teardown task, once started; awaiting it means the endpoint is
    /// destroyed and the task itself is gone (no longer counted).
    teardown: Mutex<Option<Shared<BoxFuture<'static, ()>>>>,
    /// Device copies of its lanes running on the blocking pool: the
    /// teardown waits for them before it ends any slice.
    pub copies: Arc<Count>,
}

impl Endpoint {
    /// An endpoint of `lanes` lanes whose tasks are not started yet (see
    /// [`Endpoint::start_tasks`]).
    pub fn new(
        id: EndpointId,
        name: &str,
        addr: SocketAddr,
        peer: (u64, Vec<WireRegion>),
        same_host: &[(SameHost, Option<Arc<WindowView>>)],
        env: Arc<Env>,
        slots: Weak<EndpointSlots>,
    ) -> Arc<Self> {
        let (lanes, window) = (env.cfg.lanes, env.cfg.window);
        Arc::new(Endpoint {
            id,
            name: name.to_owned(),
            addr,
            generation: peer.0,
            regions: peer.1,
            lanes: (0..lanes)
                .map(|i| Lane {
                    pending: Mutex::new(Pending::default()),
                    window: Semaphore::new(window),
                    same_host: same_host.get(i).map(|s| s.0).unwrap_or_default(),
                    direct: same_host.get(i).and_then(|s| s.1.clone()),
                    out: Arc::default(),
                    rx: Mutex::default(),
                    hush: Mutex::default(),
                })
                .collect(),
            env,
            slots,
            tasks: Mutex::new(LaneTasks::default()),
            copies: Arc::default(),
            queue: Mutex::new(VecDeque::new()),
            notes: Mutex::new(VecDeque::new()),
            notify: Notify::new(),
            dead: AtomicBool::new(false),
            teardown: Mutex::new(None),
        })
    }

    /// Starts the lane tasks (their sockets are counted in `env.lanes`):
    /// `spawn` runs under the lock of the task list, so a teardown started
    /// at once by one of them (a lane already closed by the peer) finds
    /// every handle and aborts and joins them all. If the endpoint was torn
    /// down already, `spawn` is dropped unrun (closing what it owns).
    pub fn start_tasks(&self, spawn: impl FnOnce() -> Vec<JoinHandle<()>>) {
        let mut t = self.tasks.lock();
        if !t.taken {
            t.handles = spawn();
        }
    }

    /// Adds a lane task started later (a flush of what `lane::send_now`
    /// could not write at once), so the teardown aborts and joins it too.
    /// `false` (and `spawn` dropped unrun) once the teardown has begun.
    pub fn add_task(&self, spawn: impl FnOnce() -> JoinHandle<()>) -> bool {
        let mut t = self.tasks.lock();
        if t.taken {
            return false;
        }
        t.handles.retain(|h| !h.is_finished());
        t.handles.push(spawn());
        true
    }

    pub fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// A new counted use of this endpoint.
    pub fn new_use(&self) -> EndpointUse {
        Arc::new(transport_core::lifecycle::EndpointUse::new(self.slots.clone(), self.id))
    }

    /// Whether a started slice of `batch` whose request is no longer live
    /// is on one of the lanes (the endpoint must be reset to quiet it). A
    /// slice stays in its lane's pending map until it ends, also while the
    /// writer streams its payload or the reader receives its answer's.
    pub fn carries_ended(&self, batch: &Arc<Batch>) -> bool {
        self.ended_carried(batch) > 0
    }

    /// How many slices of `batch`'s ended requests this endpoint carries
    /// (on the wire, not yet answered).
    pub fn ended_carried(&self, batch: &Arc<Batch>) -> usize {
        let reqs: Vec<usize> = self
            .lanes
            .iter()
            .flat_map(|l| {
                l.pending
                    .lock()
                    .map
                    .values()
                    .filter(|s| Arc::ptr_eq(&s.batch, batch))
                    .map(|s| s.req)
                    .collect::<Vec<_>>()
            })
            .collect();
        reqs.into_iter().filter(|&i| !batch.is_live(i)).count()
    }

    /// Queues work for the lanes. Fails it at once if the endpoint died.
    pub fn enqueue(&self, work: Work) {
        {
            let mut q = self.queue.lock();
            if !self.is_dead() {
                q.push_back(work);
                drop(q);
                // One writer; it wakes the next if more is left (waking
                // every lane for one small slice cost each request a
                // herd of wake-ups).
                self.notify.notify_one();
                return;
            }
        }
        work.fail(&Error::new(ErrorKind::ConnectionReset, "the endpoint was destroyed").with("peer", &self.name));
    }

    /// Queues a notification for the lanes. Answers it at once with a
    /// transient error if the endpoint died.
    pub fn enqueue_note(&self, note: Note) {
        {
            let mut q = self.notes.lock();
            if !self.is_dead() {
                q.push_back(note);
                drop(q);
                self.notify.notify_one();
                return;
            }
        }
        let err = Error::new(ErrorKind::ConnectionReset, "the endpoint was destroyed").with("peer", &self.name);
        let _ = note.reply.send(Err(err));
    }

    /// Drops `batch`'s queued work (none of its requests is live: their
    /// unsent slices will never be started), giving its use back.
    pub fn unqueue(&self, batch: &Arc<Batch>) {
        let removed: Vec<Work> = {
            let mut q = self.queue.lock();
            let (out, keep): (Vec<Work>, Vec<Work>) = q.drain(..).partition(|w| Arc::ptr_eq(&w.batch, batch));
            q.extend(keep);
            out
        };
        drop(removed);
    }

    /// Marks the endpoint broken and destroys it in the background (used
    /// from lane tasks, which cannot join themselves).
    pub fn broke(self: &Arc<Self>, err: Error) {
        if !self.is_dead() {
            tracing::warn!(peer = %self.name, error = %err, "endpoint broken; destroying it");
        }
        self.begin_destroy(err);
    }

    /// Starts destroying the endpoint (see [`Endpoint::destroy`]) in a
    /// counted task of its own, so that a caller that stops waiting cannot
    /// leave it half done. Must be called inside a tokio runtime.
    pub fn begin_destroy(self: &Arc<Self>, err: Error) {
        let mut teardown = self.teardown.lock();
        if teardown.is_some() {
            return;
        }
        // Retired in the pool first, then marked dead: once anyone can see
        // the endpoint dead (and fail work on it at once), the pool no
        // longer hands it out, so the next transfer builds a new endpoint
        // (rule 2). The other order let a caller, failed at once by the
        // dead mark, retry onto the same endpoint before the pool heard.
        if let Some(s) = self.slots.upgrade() {
            let _ = s.broken(self.id);
        }
        self.dead.store(true, Ordering::Release);
        for l in &self.lanes {
            l.pending.lock().dead = true;
        }
        let ep = self.clone();
        let task = self.env.tasks.spawn(async move { ep.teardown(err).await });
        *teardown = Some(task.map(drop).boxed().shared());
    }

    /// Destroys the endpoint: retired in the pool (never handed out again),
    /// lane tasks aborted and joined (sockets closed with RST), every queued
    /// and outstanding slice failed with `err`, then its slot freed.
    /// Idempotent; every caller returns once all of it is done.
    pub async fn destroy(self: &Arc<Self>, err: Error) {
        self.begin_destroy(err);
        let task = self.teardown.lock().clone();
        if let Some(task) = task {
            task.await;
        }
    }

    async fn teardown(self: Arc<Self>, err: Error) {
        let tasks = {
            let mut t = self.tasks.lock();
            t.taken = true;
            std::mem::take(&mut t.handles)
        };
        for t in &tasks {
            t.abort();
        }
        for t in tasks {
            let _ = t.await;
        }
        // A device copy the aborted tasks started runs on: its slice
        // ends only after it (terminal means quiet).
        self.copies.quiet().await;
        // No caller reads a lane after this (one reading now is waited
        // for: it holds the lock only while it reads what has arrived).
        for l in &self.lanes {
            l.rx.lock().detach();
            l.hush.lock().detach();
        }
        // A caller's poll that was reading a lane may have started a device
        // copy (a staged READ) before the lane was detached: none starts
        // now, and the slices end only after those too.
        self.copies.quiet().await;
        // The write halves go last: with the readers gone, each socket is
        // closed (with RST) here, before any slice is failed below. A
        // submit sending at once holds a lane's side only briefly and never
        // across a wait.
        for l in &self.lanes {
            l.out.lock().await.w = None;
        }
        self.env.lanes.fetch_sub(self.lanes.len(), Ordering::Relaxed);
        crate::busypoll::count_lanes(self.lanes.len(), false);
        let queued: Vec<Work> = self.queue.lock().drain(..).collect();
        for w in &queued {
            w.fail(&err);
        }
        drop(queued);
        let notes: Vec<Note> = self.notes.lock().drain(..).collect();
        for n in notes {
            let _ = n.reply.send(Err(err.clone()));
        }
        for l in &self.lanes {
            let (slices, sent): (Vec<Slice>, Vec<SentNote>) = {
                let mut p = l.pending.lock();
                (p.map.drain().map(|(_, s)| s).collect(), p.notes.drain().map(|(_, n)| n).collect())
            };
            for s in slices {
                s.batch.slice_done(s.req, Err(err.clone()));
            }
            for n in sent {
                let _ = n.reply.send(Err(err.clone()));
            }
        }
        if let Some(s) = self.slots.upgrade() {
            s.destroyed(self.id);
        }
    }

    /// Drops the slices of request `req` of `batch` not yet taken off the
    /// queue: it is no longer live, so none of them would be started.
    pub fn skip_rest(&self, batch: &Arc<Batch>, req: usize) {
        let removed: Vec<Work> = {
            let mut q = self.queue.lock();
            for w in q.iter_mut() {
                if Arc::ptr_eq(&w.batch, batch) && w.idx.get(w.pos).is_some_and(|&i| i as usize == req) {
                    w.pos += 1;
                    w.off = 0;
                }
            }
            let (done, keep): (Vec<Work>, Vec<Work>) = q.drain(..).partition(|w| w.pos >= w.idx.len());
            q.extend(keep);
            done
        };
        drop(removed);
    }

    /// Whether slices or notifications are queued.
    pub fn has_queued(&self) -> bool {
        !self.notes.lock().is_empty() || !self.queue.lock().is_empty()
    }

    /// Takes the next notification, or else the next slice, off the queues.
    pub fn take_item(&self) -> Option<Item> {
        if let Some(n) = self.notes.lock().pop_front() {
            return Some(Item::Note(n));
        }
        self.take_slice().map(Item::Slice)
    }

    /// Takes the next slice off the queue.
    pub fn take_slice(&self) -> Option<Next> {
        let mut q = self.queue.lock();
        let slice = self.env.cfg.slice_size as u64;
        loop {
            let w = q.front_mut()?;
            let Some(&i) = w.idx.get(w.pos) else {
                q.pop_front();
                continue;
            };
            let i = i as usize;
            let Some(req) = w.batch.reqs.get(i).copied() else {
                w.pos += 1;
                continue;
            };
            let off = w.off;
            let len = slice.min(req.len.saturating_sub(off));
            w.off += len;
            if w.off >= req.len {
                w.pos += 1;
                w.off = 0;
            }
            let next =
                Next { batch: w.batch.clone(), req: i, off, len, generation: w.generation, using: w.using.clone() };
            if w.pos >= w.idx.len() {
                q.pop_front();
            }
            return Some(next);
        }
    }
}
