//! The serving side: a listener and one task per connection. This is the
//! security boundary (see the threat model in the crate docs): every frame
//! is validated before it is acted on, every memory access is checked
//! against the regions registered as remotely accessible, and anything
//! malformed closes that connection only.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use transport_core::lifecycle::TaskSet;
use transport_core::{Inbox, Notification, Refused};

use crate::applying::Applying;
use crate::bufs::{BufPool, OutBuf, PooledReader};
use crate::busypoll::BusyPoll;
use crate::config::TcpConfig;
use crate::conn::{apply_options, write_frame};
use crate::proto::{self, FrameType, Header, Status, HEADER_LEN, NONCE_LEN, VERSION};
use crate::regions::Region;
use crate::regions::{pull_status, Gathered, Pulled, RegionTable, WindowGuard};
use crate::requests::{self, Peer, Request, Requests};
use crate::samehost;
use crate::staging::{copied, copy_off, Copying, Count, Lease, Side, Staging, STAGE};
use transport_control::access::Exposure;
use transport_control::admission::{refusal_label, Admit, Counts, Proven, Slot};
use transport_control::auth;
use transport_control::handshake;

/// A connection's output buffer: answers gathered before one `write`. A
/// READ answer up to `STREAM` fits in it whole.
const OUT_BUF: usize = 256 << 10;
/// READ answers larger than this are copied and sent in chunks of it; a
/// WRITE payload is received in chunks of it (the staging buffer).
const STREAM: usize = 128 << 10;
/// Output buffers kept for reuse while unused (twice as many read and
/// staging buffers); beyond them a returned buffer is unmapped.
const POOLED: usize = 32;
/// Memory one handshaken connection may hold at most while it works: its
/// output buffer, its read buffer, a staging buffer, one NOTIFY payload,
/// and the task, socket and bookkeeping around them. A connection waiting
/// for a request with nothing to send holds no buffer, only that
/// bookkeeping (`IDLE_CONNECTION_BOUND`). `tests/memory.rs` measures both
/// against a server process.
pub const SERVED_CONNECTION_BOUND: usize = OUT_BUF + 2 * STREAM + proto::MAX_NOTIFY_PAYLOAD + IDLE_CONNECTION_BOUND;

/// Memory the server's buffer pools keep at most between uses (output
/// buffers, and twice as many read and staging buffers).
pub const SERVER_POOL_BOUND: usize = POOLED * OUT_BUF + 2 * POOLED * STREAM;

/// Memory one handshaken connection holds at most while it waits for a
/// request with nothing to send: its task, socket registration and
/// bookkeeping, no buffer.
pub const IDLE_CONNECTION_BOUND: usize = 48 << 10;

/// Connections refused at `max_connections` that may be answered `Busy` at
/// once (each for at most `REFUSE_WAIT`); beyond this, a refused connection
/// gets the answer only if its socket takes it at once, then is closed.
const MAX_REFUSING: usize = 64;
/// How long a refused connection is given to take its `Busy` answer.
const REFUSE_WAIT: Duration = Duration::from_secs(1);

/// Bytes a connection served and has not yet added to the metrics: summed
/// per burst of frames and reported when the connection has nothing in
/// hand (and when it ends), so the per-frame cost is an addition.
#[derive(Debug, Default)]
struct Served {
    write: u64,
    read: u64,
    /// Of those, moved by same-host copies (no socket payload).
    same_write: u64,
    same_read: u64,
}

impl Served {
    fn report(&mut self) {
        for (name, op, n) in [
            ("kvmove_tcp_served_bytes_total", "write", &mut self.write),
            ("kvmove_tcp_served_bytes_total", "read", &mut self.read),
            ("kvmove_tcp_same_host_bytes_total", "write", &mut self.same_write),
            ("kvmove_tcp_same_host_bytes_total", "read", &mut self.same_read),
        ] {
            if *n > 0 {
                metrics::counter!(name, "op" => op).increment(std::mem::take(n));
            }
        }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.report();
    }
}

/// What the server needs, shared with its connection tasks.
#[derive(Debug)]
pub(crate) struct Server {
    pub cfg: Arc<TcpConfig>,
    pub regions: Arc<RegionTable>,
    pub generation: u64,
    pub tasks: TaskSet,
    /// Where received notifications go (rule 11; bounded, shared by every
    /// connection).
    pub inbox: Arc<Inbox>,
    conns: Mutex<HashMap<u64, JoinHandle<()>>>,
    /// Connections being answered `Busy` (at most `MAX_REFUSING`).
    refusing: Mutex<HashMap<u64, JoinHandle<()>>>,
    counts: Arc<Mutex<Counts>>,
    next_conn: AtomicU64,
    /// Output buffers (`OUT_BUF` each), lent to connections with answers due.
    out_bufs: Arc<BufPool>,
    /// Read and staging buffers (`STREAM` each): lent to a connection's
    /// reader while it holds unread bytes, and for the time of one WRITE.
    chunk_bufs: Arc<BufPool>,
    /// Host buffers for copies into and out of device regions (the
    /// transport's, [`Side::Target`]).
    staging: Arc<Staging>,
    /// Device copies running for connections (close waits for them).
    copies: Arc<Count>,
    /// WRITE chunks being applied: a NOTIFY waits for those before it
    /// ([`crate::applying`]).
    applying: Arc<Applying>,
    /// Which connection may poll for its next request instead of sleeping
    /// (`server_poll_us`).
    busy: BusyPoll,
}

/// Why a connection is closed (logged; never crashes the server).
#[derive(Debug)]
enum Close {
    Io(std::io::Error),
    Proto(String),
}

impl From<std::io::Error> for Close {
    fn from(e: std::io::Error) -> Self {
        Close::Io(e)
    }
}

impl Server {
    pub fn new(
        cfg: Arc<TcpConfig>,
        regions: Arc<RegionTable>,
        generation: u64,
        tasks: TaskSet,
        inbox: Arc<Inbox>,
        staging: Arc<Staging>,
    ) -> Arc<Self> {
        Arc::new(Self {
            busy: BusyPoll::new(cfg.server_poll_us),
            cfg,
            regions,
            generation,
            tasks,
            inbox,
            conns: Mutex::new(HashMap::new()),
            refusing: Mutex::new(HashMap::new()),
            counts: Arc::default(),
            next_conn: AtomicU64::new(0),
            out_bufs: BufPool::new(OUT_BUF, POOLED),
            chunk_bufs: BufPool::new(STREAM, 2 * POOLED),
            staging,
            copies: Arc::default(),
            applying: Arc::default(),
        })
    }

    /// Accepts connections until aborted.
    pub async fn accept_loop(self: Arc<Self>, listener: TcpListener) {
        loop {
            let (s, peer) = match listener.accept().await {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            };
            let id = self.next_conn.fetch_add(1, Ordering::Relaxed);
            let ip = peer.ip().to_canonical();
            let here = s.local_addr().map_or(ip, |a| a.ip());
            if let Err(why) = Exposure::of(self.cfg.secret.as_deref(), self.cfg.insecure).admits(ip, here) {
                tracing::warn!(%peer, reason = why, "refusing connection (answered AuthFailed)");
                metrics::counter!("kvmove_tcp_connections_refused_total", "reason" => "protected_mode").increment(1);
                self.refuse(id, s, Status::AuthFailed, why);
                continue;
            }
            let proven = said_hello(&s);
            let (slot, evicted) = {
                let mut c = self.counts.lock();
                match c.admits(&self.cfg.limits(), ip) {
                    Admit::Yes => (Slot::handshaking(&self.counts, &mut c, ip, id), None),
                    Admit::Evict(old) => {
                        let signal = c.evict_signals.remove(&old);
                        (Slot::handshaking(&self.counts, &mut c, ip, id), signal)
                    }
                    Admit::No(why) => {
                        drop(c);
                        tracing::warn!(%peer, reason = why, "refusing connection (answered Busy)");
                        metrics::counter!("kvmove_tcp_connections_refused_total", "reason" => refusal_label(why))
                            .increment(1);
                        self.refuse(id, s, Status::Busy, "");
                        continue;
                    }
                }
            };
            // Its HELLO came with the connection: silent ones give way
            // before it from the start.
            if proven == Proven::Hello && slot.proved(&self.cfg.limits(), proven) {
                metrics::counter!("kvmove_tcp_connections_refused_total", "reason" => "evicted_handshake").increment(1);
            }
            if let Some(signal) = evicted {
                // Its count is already gone; told so, it answers `Busy` and
                // closes (its peer retries: a close in the middle of an
                // authentication would read as a wrong secret).
                signal.notify_one();
                tracing::warn!(%peer, "handshake quota full: closed a handshake of the busiest address (or of the newcomer's own), the oldest of those that proved least");
                metrics::counter!("kvmove_tcp_connections_refused_total", "reason" => "evicted_handshake").increment(1);
            }
            let mut conns = self.conns.lock();
            let me = self.clone();
            let h = self.tasks.spawn(async move {
                match me.serve(s, slot).await {
                    Ok(()) => tracing::info!(%peer, reason = "closed by the peer", "connection closed"),
                    Err(Close::Io(e)) => tracing::info!(%peer, reason = %e, "connection closed"),
                    Err(Close::Proto(m)) => tracing::warn!(%peer, reason = %m, "closing connection: bad frame"),
                }
                me.conns.lock().remove(&id);
            });
            if !h.is_finished() {
                conns.insert(id, h);
            }
        }
    }

    /// Answers a connection refused as it is accepted with an ERROR frame:
    /// status `Busy` over a limit, so the initiator reports a transient
    /// "busy" error rather than a reset; `AuthFailed` with the reason
    /// (`why`, at most `MAX_ERROR_MSG` bytes are sent) in protected mode.
    /// The answer is followed by a FIN, and what the peer sends (its
    /// HELLO) is read and dropped until it closes, so the close does not
    /// reset the connection and discard the answer; all within
    /// `REFUSE_WAIT`, and for at most `MAX_REFUSING` connections at once.
    fn refuse(self: &Arc<Self>, id: u64, mut s: TcpStream, status: Status, why: &str) {
        let mut e = Header::new(FrameType::Error);
        e.status = status;
        let mut cut = why.len().min(proto::MAX_ERROR_MSG);
        while !why.is_char_boundary(cut) {
            cut -= 1;
        }
        e.payload_len = cut as u32;
        let mut frame = e.encode().to_vec();
        frame.extend_from_slice(&why.as_bytes()[..cut]);
        let mut refusing = self.refusing.lock();
        if refusing.len() >= MAX_REFUSING {
            // Best effort: a fresh socket's send buffer takes 48 bytes.
            let _ = s.try_write(&frame);
            return;
        }
        let me = self.clone();
        let h = self.tasks.spawn(async move {
            answer_and_drain(&mut s, &frame).await;
            me.refusing.lock().remove(&id);
        });
        if !h.is_finished() {
            refusing.insert(id, h);
        }
    }

    /// Aborts every connection task and waits for them to end.
    pub async fn close_all(&self) {
        let mut conns: Vec<JoinHandle<()>> = self.conns.lock().drain().map(|(_, h)| h).collect();
        conns.extend(self.refusing.lock().drain().map(|(_, h)| h));
        for h in &conns {
            h.abort();
        }
        for h in conns {
            let _ = h.await;
        }
        // Device copies the aborted connections started run on.
        self.copies.quiet().await;
    }

    /// Aborts every connection task without waiting (drop).
    pub fn abort_all(&self) {
        for (_, h) in self.conns.lock().drain() {
            h.abort();
        }
        for (_, h) in self.refusing.lock().drain() {
            h.abort();
        }
    }

    /// The handshake; with a verified same-host client, also the window of
    /// direct writes offered to it (retired when the guard drops, that is
    /// when the connection ends).
    async fn handshake(&self, s: &mut TcpStream, slot: &mut Slot) -> Result<(Peer, Option<WindowGuard>), Close> {
        let mut b = [0u8; HEADER_LEN];
        s.read_exact(&mut b).await?;
        let h = Header::decode(&b, 2 + NONCE_LEN).map_err(|e| Close::Proto(e.to_string()))?;
        if h.ty != FrameType::Hello {
            return Err(Close::Proto(format!("expected HELLO, got {:?}", h.ty)));
        }
        let mut p = [0u8; 2 + NONCE_LEN];
        s.read_exact(&mut p).await?;
        let version = u16::from_le_bytes([p[0], p[1]]);
        let cn = &p[2..];
        let secret = self.cfg.secret.as_deref().map(str::as_bytes);
        let (hs, challenge) =
            match handshake::Server::hello(auth::TCP, secret, u32::from(VERSION), u32::from(version), cn) {
                Ok(h) => h,
                // The decoded HELLO has a nonce of the right length: only
                // the version is refused here.
                Err(r) => return Err(answer_refusal(s, Status::VersionMismatch, r.to_string()).await),
            };
        // A well-formed HELLO: silent connections give way before this one.
        slot.proved(&self.cfg.limits(), Proven::Hello);
        // With a same-host offer the client reads the server's nonce from
        // this process's memory (at this address) before it sends AUTH.
        let sn = hs.nonce();
        let mut c = Header::new(FrameType::Challenge);
        c.generation = self.generation;
        c.flags = u8::from(challenge.auth);
        let mut peer = Peer::default();
        if self.cfg.same_host && h.flags & proto::SAME_HOST != 0 {
            peer.reads = true;
            peer.pull_from = samehost::peer_process(s, &h, cn, "its writes");
            c.flags |= proto::SAME_HOST;
            if peer.pull_from.is_some() {
                c.flags |= proto::PULL_WRITES;
            }
            c.addr = u64::from(samehost::my_pid());
            c.len = sn.as_ptr() as u64;
        }
        // A client that asked for it gets this side's proof now: it may
        // then send its first request behind its AUTH (read below only
        // once the AUTH checked out).
        let mut payload = sn.to_vec();
        if h.flags & proto::EARLY_PROOF != 0 && !challenge.proof.is_empty() {
            c.flags |= proto::EARLY_PROOF;
            payload.extend_from_slice(&challenge.proof);
        }
        write_frame(s, c, &payload).await?;
        s.read_exact(&mut b).await?;
        let a = Header::decode(&b, NONCE_LEN).map_err(|e| Close::Proto(e.to_string()))?;
        if a.ty != FrameType::Auth {
            return Err(Close::Proto(format!("expected AUTH, got {:?}", a.ty)));
        }
        let mut proof = vec![0u8; a.payload_len as usize];
        s.read_exact(&mut proof).await?;
        let answer = match hs.auth(&proof) {
            Ok(answer) => answer,
            Err(r) => return Err(answer_refusal(s, Status::AuthFailed, r.to_string()).await),
        };
        // Handshaken connections filled up while this one handshook: it is
        // answered `Busy` in place of READY.
        if let Err(why) = slot.promote(&self.cfg.limits()) {
            let why = format!("refused after the handshake (answered Busy): {why}");
            return Err(answer_refusal(s, Status::Busy, why).await);
        }
        let mut ready = Header::new(FrameType::Ready);
        let mut window = None;
        if let Some(pid) = peer.pull_from.filter(|_| self.cfg.direct_writes || self.cfg.direct_reads) {
            match self.regions.add_window(sn, pid) {
                Ok(w) => {
                    ready.flags |= proto::DIRECT_WRITES;
                    ready.id = u64::from(w.raw_fd().unsigned_abs());
                    window = Some(w);
                }
                Err(e) => {
                    tracing::info!(
                        pid,
                        "no direct-copy window for this peer ({e}): its writes and reads come through here"
                    )
                }
            }
        }
        write_frame(s, ready, &answer).await?;
        Ok((peer, window))
    }

    /// Serves one connection; `slot` counts it (in its handshake, then
    /// handshaken) until this returns.
    async fn serve(&self, mut s: TcpStream, mut slot: Slot) -> Result<(), Close> {
        apply_options(&s, &self.cfg, false)?;
        let evicted = slot.evicted.clone();
        let handshake = tokio::select! {
            r = tokio::time::timeout(self.cfg.handshake_timeout, self.handshake(&mut s, &mut slot)) => Some(r),
            () = evicted.notified() => None,
        };
        let Some(handshake) = handshake else {
            let mut e = Header::new(FrameType::Error);
            e.status = Status::Busy;
            let _ = tokio::time::timeout(REFUSE_WAIT, write_frame(&mut s, e, &[])).await;
            return Err(Close::Io(std::io::Error::other("handshake slot taken by a newcomer (answered Busy)")));
        };
        // `window` is held until this returns: its drop retires the window.
        let (same, window) = handshake.map_err(|_| Close::Proto("handshake timed out".into()))??;
        if let Ok(peer) = s.peer_addr() {
            tracing::info!(
                %peer,
                authenticated = self.cfg.secret.is_some(),
                same_host_writes = same.pull_from.is_some(),
                same_host_reads = same.reads,
                direct_writes = window.is_some(),
                "peer connected"
            );
            metrics::counter!("kvmove_tcp_connections_total").increment(1);
        }
        let (r, mut w) = s.into_split();
        let mut r = PooledReader::new(r, self.chunk_bufs.clone());
        let mut out = OutBuf::new(self.out_bufs.clone());
        let e = match self.requests(&mut r, &mut w, &mut out, same).await {
            Ok(never) => match never {},
            Err(e) => e,
        };
        // `out` holds only answers not yet on the wire (every write empties
        // it, even a failed one). Answers to the valid frames read before a
        // malformed or truncated one are still due: send them, within
        // `connect_timeout`, then close.
        let read_side = match &e {
            Close::Proto(_) => true,
            Close::Io(io) => io.kind() == std::io::ErrorKind::UnexpectedEof,
        };
        if read_side && !out.is_empty() {
            let _ = tokio::time::timeout(self.cfg.connect_timeout, w.write_all(out.as_slice())).await;
        }
        Err(e)
    }

    /// Runs one wait on a handshaken connection (for a request, the rest
    /// of a frame, or the peer taking an answer), bounded by
    /// `server_idle_timeout`: a connection that makes no progress for that
    /// long is closed (an I/O error of kind `TimedOut`, logged at info).
    async fn idle<T>(&self, f: impl std::future::Future<Output = std::io::Result<T>>) -> Result<T, Close> {
        match tokio::time::timeout(self.cfg.server_idle_timeout, f).await {
            Ok(r) => Ok(r?),
            Err(_) => Err(Close::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("idle for {} ms (server_idle_timeout)", self.cfg.server_idle_timeout.as_millis()),
            ))),
        }
    }

    /// Copies the same-host WRITEs gathered in `p` (one kernel call) and
    /// answers each, in order. `landed` is room for the results, kept
    /// between calls.
    async fn land(
        &self,
        p: &mut Gathered,
        landed: &mut Vec<(u64, usize, Pulled)>,
        w: &mut OwnedWriteHalf,
        out: &mut OutBuf,
        served: &mut Served,
    ) -> Result<(), Close> {
        let _ = p.copy(landed);
        for (id, len, result) in landed.drain(..) {
            let status = result.map_err(|e| e.map_or(Status::Unregistered, pull_status));
            self.write_ack(w, out, served, id, len as u64, status).await?;
        }
        Ok(())
    }

    /// Answers a same-host WRITE of `len` bytes and counts it if it landed.
    async fn write_ack(
        &self,
        w: &mut OwnedWriteHalf,
        out: &mut OutBuf,
        served: &mut Served,
        id: u64,
        len: u64,
        status: std::result::Result<(), Status>,
    ) -> Result<(), Close> {
        if status.is_ok() {
            served.write = served.write.saturating_add(len);
            served.same_write = served.same_write.saturating_add(len);
        }
        self.room(w, out, HEADER_LEN).await?;
        out.push(&requests::answer(FrameType::WriteAck, id, status))?;
        Ok(())
    }

    /// Fills `dst` from the connection: from bytes already read when they
    /// are enough (the common case for a burst of small frames: no timer is
    /// armed), else by a wait bounded as [`Server::idle`] bounds it.
    async fn read(&self, r: &mut PooledReader, dst: &mut [u8]) -> Result<(), Close> {
        if r.read_buffered(dst) {
            return Ok(());
        }
        self.idle(r.read_exact(dst)).await
    }

    /// Writes `out` and empties it, whether or not the write succeeded (so
    /// no byte is ever sent twice).
    async fn flush(w: &mut OwnedWriteHalf, out: &mut OutBuf) -> std::io::Result<()> {
        let r = w.write_all(out.as_slice()).await;
        out.clear();
        r
    }

    /// Makes room for `need` more bytes in `out` (at most its capacity),
    /// sending what it holds if they would not fit.
    async fn room(&self, w: &mut OwnedWriteHalf, out: &mut OutBuf, need: usize) -> Result<(), Close> {
        if out.room() < need {
            self.idle(Self::flush(w, out)).await?;
        }
        Ok(())
    }

    /// Offers a received notification, as the machine checked it
    /// ([`Requests::notification`]), to the inbox; the status to answer.
    /// One the machine refused is answered with its status and nothing is
    /// queued; a full inbox is answered `Busy`. `Err` once the inbox is
    /// closed (shutting down): the connection is closed unanswered.
    fn deliver(
        &self,
        checked: std::result::Result<Notification, Status>,
    ) -> Result<std::result::Result<(), Status>, Close> {
        let n = match checked {
            Ok(n) => n,
            Err(status) => return Ok(Err(status)),
        };
        match self.inbox.offer(n) {
            Ok(()) => Ok(Ok(())),
            Err(Refused::Full) => Ok(Err(Status::Busy)),
            Err(Refused::Closed) => {
                Err(Close::Io(std::io::Error::other("shutting down: the notification inbox is closed")))
            }
        }
    }

    /// Receives a WRITE's payload of `n` bytes into device region `region`
    /// at `addr`: each chunk is read into a staging buffer (`first`, and a
    /// second when one is free) and copied to the device on the blocking
    /// pool, at most two copies running, the next chunk read meanwhile.
    /// Returns once every copy is over: `Err` with the first copy's
    /// failure (the rest of the payload is still read, not copied).
    /// `Err(Close)` when the connection fails; copies still running then
    /// are counted in `copies` (close waits for them).
    async fn receive_device(
        &self,
        r: &mut PooledReader,
        region: Arc<Region>,
        addr: u64,
        n: usize,
        first: Lease,
    ) -> Result<std::result::Result<(), Status>, Close> {
        let mut free = vec![first];
        if n > STAGE {
            free.extend(self.staging.try_acquire(Side::Target));
        }
        let mut running: VecDeque<Copying<std::result::Result<(), Status>>> = VecDeque::new();
        let mut status = Ok(());
        let mut done = 0usize;
        while done < n {
            let mut buf = match free.pop() {
                Some(b) => b,
                None => {
                    let Some(h) = running.pop_front() else {
                        return Err(Close::Proto("no staging buffer for a device write".into()));
                    };
                    let (b, got) = copied(h).await.map_err(|e| Close::Proto(e.to_string()))?;
                    status = status.and(got);
                    b
                }
            };
            let k = (n - done).min(buf.len());
            let at = addr + done as u64;
            // Applied only once wholly in hand, and not if a reset is
            // behind it (as for host memory); in memory before a later
            // NOTIFY is delivered (the ticket ends with the copy).
            self.read(r, &mut buf[..k]).await?;
            let ticket = self.applying.begin();
            r.check_reset()?;
            if status.is_ok() {
                let region = region.clone();
                running.push_back(copy_off(buf, &self.copies, move |b: &mut [u8]| {
                    let r = region.write_abs(at, &b[..k]);
                    drop(ticket);
                    r
                }));
            } else {
                free.push(buf);
            }
            done += k;
        }
        while let Some(h) = running.pop_front() {
            let (_, got) = copied(h).await.map_err(|e| Close::Proto(e.to_string()))?;
            status = status.and(got);
        }
        Ok(status)
    }

    /// Answers a READ of `n` bytes of device region `region` at `addr`
    /// (`a` its answer's header): each chunk is copied into a staging
    /// buffer on the blocking pool, the next one while this one is sent
    /// (when a second buffer is free). A first chunk that cannot be copied
    /// is answered with its status; a later one closes the connection
    /// (half an answer is on the wire).
    async fn answer_device(
        &self,
        w: &mut OwnedWriteHalf,
        out: &mut OutBuf,
        (region, addr, n): (Arc<Region>, u64, usize),
        mut a: Header,
        first: Lease,
    ) -> Result<(), Close> {
        let mut spare = if n > STAGE { self.staging.try_acquire(Side::Target) } else { None };
        let chunk = |at: u64, k: usize| {
            let region = region.clone();
            move |b: &mut [u8]| region.read_abs(at, &mut b[..k])
        };
        let k0 = n.min(STAGE);
        let (mut cur, got) =
            copied(copy_off(first, &self.copies, chunk(addr, k0))).await.map_err(|e| Close::Proto(e.to_string()))?;
        if let Err(status) = got {
            a.status = status;
            a.len = 0;
            a.payload_len = 0;
            self.room(w, out, HEADER_LEN).await?;
            out.push(&a.encode())?;
            return Ok(());
        }
        self.room(w, out, HEADER_LEN).await?;
        out.push(&a.encode())?;
        let mut done = 0usize;
        loop {
            let k = (n - done).min(STAGE);
            let next_at = done + k;
            let m = (n - next_at).min(STAGE);
            let next = match spare.take() {
                Some(b) if next_at < n => Some(copy_off(b, &self.copies, chunk(addr + next_at as u64, m))),
                other => {
                    spare = other;
                    None
                }
            };
            // The answers gathered and this header go out first.
            if !out.is_empty() {
                self.idle(Self::flush(w, out)).await?;
            }
            self.idle(w.write_all(&cur[..k])).await?;
            done = next_at;
            if done >= n {
                return Ok(());
            }
            let (b, got) = match next {
                Some(h) => {
                    let got = copied(h).await;
                    spare = Some(cur);
                    got
                }
                None => copied(copy_off(cur, &self.copies, chunk(addr + done as u64, m))).await,
            }
            .map_err(|e| Close::Proto(e.to_string()))?;
            if got.is_err() {
                return Err(Close::Proto("a device copy failed while a read was answered".into()));
            }
            cur = b;
        }
    }

    /// Serves requests until the connection ends (always with an error:
    /// a close by the peer is an `UnexpectedEof`). Answers are gathered in
    /// `out`; what is left there on return was never sent. Scratch buffers
    /// are borrowed from the server's pools only while a frame is in hand,
    /// and `out`'s is given back whenever the connection waits with nothing
    /// to send.
    async fn requests(
        &self,
        r: &mut PooledReader,
        w: &mut OwnedWriteHalf,
        out: &mut OutBuf,
        same: Peer,
    ) -> Result<std::convert::Infallible, Close> {
        let m = Requests::new(self.generation, self.cfg.max_frame, same);
        let mut note: Vec<u8> = Vec::new();
        let mut served = Served::default();
        // Same-host WRITEs read and checked, not yet copied: consecutive
        // ones into host memory of one region are copied by one kernel
        // call (`land`) before the connection reads its socket again or
        // serves any other frame, then answered in order. Whatever a
        // connection has read before a reset is applied, as for one frame
        // at a time.
        let mut pulls = Gathered::default();
        let mut landed = Vec::new();
        // Polling for the next request (`server_poll_us`): allowed by the
        // runtime, and `hot` while requests come within the window.
        let may_poll = self.busy.allowed();
        let mut hot = false;
        loop {
            if r.buffered() < HEADER_LEN {
                // The next frame is not all in hand: the socket is read
                // next, so the checked copies are made (and answered) now.
                self.land(&mut pulls, &mut landed, w, out, &mut served).await?;
            }
            // When the connection started waiting for this request (if it
            // polled or may have).
            let mut idle_from = None;
            if r.buffered() == 0 {
                served.report();
                crate::regions::report_direct(&self.regions);
                if !out.is_empty() {
                    self.idle(Self::flush(w, out)).await?;
                }
                // Nothing in hand: the connection holds no buffer while it
                // waits for its next request.
                out.release();
                r.release();
                if may_poll {
                    let from = std::time::Instant::now();
                    if let Some((_turn, until)) = self.busy.turn(hot, from) {
                        let caught = r.poll_until(until, crate::busypoll::may_spin()).await?;
                        let result = if caught { "caught" } else { "missed" };
                        metrics::counter!("kvmove_tcp_server_polls_total", "result" => result).increment(1);
                    }
                    idle_from = Some(from);
                }
            }
            let mut b = [0u8; HEADER_LEN];
            self.read(r, &mut b).await?;
            if let Some(from) = idle_from {
                hot = self.busy.is_short(from.elapsed());
            }
            // Decided by the machine (every check is there); moved here.
            let req = m.header(&b, &self.regions).map_err(Close::Proto)?;
            if req.lands_gathered() {
                // Every other frame is served after the copies before it.
                self.land(&mut pulls, &mut landed, w, out, &mut served).await?;
            }
            match req {
                Request::Describe { id } => {
                    let (a, regions) = m.describe(id, &self.regions).map_err(Close::Proto)?;
                    let need = HEADER_LEN + regions.len();
                    self.room(w, out, need).await?;
                    if need <= out.room() {
                        out.push(&a.encode())?;
                        out.push(&regions)?;
                    } else {
                        // Larger than the whole output buffer: it goes out
                        // on its own (`out` is empty here).
                        self.idle(w.write_all(&a.encode())).await?;
                        self.idle(w.write_all(&regions)).await?;
                    }
                }
                Request::PullWrite { id, addr, len, pid, target } => {
                    // The bytes stay in the client: the payload is their
                    // address there, and they are copied from it straight
                    // into the checked destination. As for a WRITE with its
                    // bytes, a reset already behind the frame means the
                    // client gave up on it: nothing is copied. Consecutive
                    // ones into host memory of one region, all in hand, are
                    // copied together by one kernel call (`Gathered`).
                    let mut src = [0u8; 8];
                    if r.buffered() < src.len() {
                        self.land(&mut pulls, &mut landed, w, out, &mut served).await?;
                    }
                    self.read(r, &mut src).await?;
                    let src = u64::from_le_bytes(src);
                    match target {
                        Ok(region) if region.mem.provider().is_none() => {
                            // Inside the region (`remote` checked it); a
                            // range that were not fails its bounds check.
                            let offset = addr
                                .checked_sub(region.mem.addr())
                                .and_then(|o| usize::try_from(o).ok())
                                .unwrap_or(usize::MAX);
                            let n = usize::try_from(len).unwrap_or(usize::MAX);
                            if !pulls.takes(&region, pid) {
                                self.land(&mut pulls, &mut landed, w, out, &mut served).await?;
                            }
                            // Checked after the landing (which may wait on
                            // the socket): a ticket is never held across it.
                            let ticket = self.applying.begin();
                            r.check_reset()?;
                            pulls.add(region, pid, (offset, n, src), id);
                            pulls.held.push(ticket);
                        }
                        status => {
                            self.land(&mut pulls, &mut landed, w, out, &mut served).await?;
                            let ticket = self.applying.begin();
                            r.check_reset()?;
                            let status = status.and_then(|region| region.pull_abs(addr, len, pid, src));
                            drop(ticket);
                            self.write_ack(w, out, &mut served, id, len, status).await?;
                        }
                    }
                }
                Request::Write { id, addr, len, target } => {
                    // The payload is received in chunks of a pooled staging
                    // buffer, each applied as soon as it is in hand (a check
                    // failure drains the rest and answers the error). Before
                    // a chunk is applied the connection is checked for a
                    // reset if bytes were read from the socket since the last
                    // check: a client that gave up on this write resets the
                    // connection, and bytes that arrive with the reset
                    // behind them are dropped, never applied.
                    // The decoder bounded a WRITE's length, its payload's, by
                    // `max_frame`.
                    let n = usize::try_from(len).map_err(|_| Close::Proto("WRITE larger than memory".into()))?;
                    let mut status = target;
                    // A chunk is applied only once it is wholly in hand (a
                    // frame cut short never touches memory). A chunk the
                    // reader already holds is applied from its buffer; the
                    // staging buffer is borrowed only otherwise (never for
                    // a small frame that came in one read).
                    // Into device memory: through the transport's staging
                    // buffers, the copies on the blocking pool.
                    let lease = match &status {
                        Ok(region) if region.mem.provider().is_some() => self.staging.acquire(Side::Target).await.ok(),
                        _ => None,
                    };
                    if let (Some(first), Ok(region)) = (lease, &status) {
                        if let Err(s) = self.receive_device(r, region.clone(), addr, n, first).await? {
                            status = Err(s);
                        }
                    } else {
                        let mut staging = None;
                        let mut done = 0usize;
                        while done < n {
                            let at = addr + done as u64;
                            let whole = (n - done).min(self.chunk_bufs.size());
                            if r.buffered() >= whole {
                                let _applying = self.applying.begin();
                                r.check_reset()?;
                                let chunk = r.take_buffered(whole);
                                if let Ok(region) = &status {
                                    if let Err(s) = region.write_abs(at, chunk) {
                                        status = Err(s);
                                    }
                                }
                                done += chunk.len();
                                continue;
                            }
                            let buf = match &mut staging {
                                Some(b) => b,
                                None => staging.insert(self.chunk_bufs.take()?),
                            };
                            let k = (n - done).min(buf.len());
                            self.idle(r.read_exact(&mut buf[..k])).await?;
                            let _applying = self.applying.begin();
                            r.check_reset()?;
                            if let Ok(region) = &status {
                                if let Err(s) = region.write_abs(at, &buf[..k]) {
                                    status = Err(s);
                                }
                            }
                            done += k;
                        }
                        drop(staging);
                    }
                    if status.is_ok() {
                        served.write = served.write.saturating_add(len);
                    }
                    self.room(w, out, HEADER_LEN).await?;
                    out.push(&requests::answer(FrameType::WriteAck, id, status.map(drop)))?;
                }
                Request::Read { id, addr, len, target, same_host } => {
                    let mut a = Header::new(FrameType::ReadResp);
                    a.id = id;
                    let region = match target {
                        Ok(region) => region,
                        Err(status) => {
                            a.status = status;
                            self.room(w, out, HEADER_LEN).await?;
                            out.push(&a.encode())?;
                            continue;
                        }
                    };
                    // Counted when answered (a read that fails half way
                    // closes the connection; rare enough to count anyway).
                    served.read = served.read.saturating_add(len);
                    // Checked here; the client copies the bytes itself
                    // (device memory cannot be copied from another process:
                    // that READ is answered with its bytes).
                    if same_host {
                        served.same_read = served.same_read.saturating_add(len);
                        a.flags = proto::SAME_HOST;
                        a.len = len;
                        self.room(w, out, HEADER_LEN).await?;
                        out.push(&a.encode())?;
                        continue;
                    }
                    // The decoder bounded `len` by `max_frame`.
                    let n = usize::try_from(len).map_err(|_| Close::Proto("READ larger than memory".into()))?;
                    a.len = len;
                    a.payload_len = n as u32;
                    if region.mem.provider().is_some() {
                        if let Ok(first) = self.staging.acquire(Side::Target).await {
                            self.answer_device(w, out, (region, addr, n), a, first).await?;
                            continue;
                        }
                    }
                    if n <= STREAM {
                        self.room(w, out, HEADER_LEN + n).await?;
                        let start = out.len();
                        let slot = out.tail(HEADER_LEN + n)?;
                        let (head, data) = slot.split_at_mut(HEADER_LEN);
                        let ok = region.read_abs(addr, data);
                        if let Err(status) = ok {
                            a.status = status;
                            a.len = 0;
                            a.payload_len = 0;
                        }
                        head.copy_from_slice(&a.encode());
                        if ok.is_err() {
                            out.truncate(start + HEADER_LEN);
                        }
                        continue;
                    }
                    // Large answers stream in chunks, each copied (under the
                    // region's gate) just before it is sent; the answers
                    // gathered so far, this header and the first chunk go
                    // out together when they fit.
                    self.room(w, out, HEADER_LEN).await?;
                    let mut head_at = Some(out.len());
                    out.push(&a.encode())?;
                    let mut done = 0u64;
                    while done < len {
                        let k = (len - done).min(STREAM as u64) as usize;
                        if out.room() < k {
                            self.idle(Self::flush(w, out)).await?;
                            head_at = None;
                        }
                        let start = out.len();
                        if region.read_abs(addr + done, out.tail(k)?).is_err() {
                            // Half an answer may be on the wire; only
                            // closing the connection ends it cleanly. The
                            // answers before it are still sent.
                            out.truncate(if done == 0 { head_at.unwrap_or(start) } else { start });
                            return Err(Close::Proto("region unregistered while a read was answered".into()));
                        }
                        self.idle(Self::flush(w, out)).await?;
                        head_at = None;
                        done += k as u64;
                    }
                }
                Request::Notify { id, len: n, stale } => {
                    // The decoder bounded the payload to 2..=MAX_NOTIFY_PAYLOAD.
                    if note.len() < n {
                        note.resize(n, 0);
                    }
                    self.read(r, &mut note[..n]).await?;
                    // Not before the WRITE chunks other connections were
                    // applying (a sender's QUIET must not overtake them).
                    self.applying.settled().await;
                    let status = self.deliver(m.notification(stale, &note[..n]))?;
                    self.room(w, out, HEADER_LEN).await?;
                    out.push(&requests::answer(FrameType::NotifyAck, id, status))?;
                }
            }
        }
    }
}

/// What a connection has shown as it is accepted: [`Proven::Hello`] when a
/// well-formed HELLO header is already waiting in its socket (a peer sends
/// it with the connection; under a flood it waits in the accept backlog
/// long enough to arrive). Peeked, not read: the handshake reads it.
fn said_hello(s: &TcpStream) -> Proven {
    // Through a duplicate of the descriptor (non-blocking, as the
    // original): the runtime has not polled a socket it just accepted, so
    // its own peek would not look yet.
    use std::os::fd::AsFd;
    let Ok(fd) = s.as_fd().try_clone_to_owned() else { return Proven::Nothing };
    let mut b = [0u8; HEADER_LEN];
    match std::net::TcpStream::from(fd).peek(&mut b) {
        Ok(HEADER_LEN) => match Header::decode(&b, 2 + NONCE_LEN) {
            Ok(h) if h.ty == FrameType::Hello => Proven::Hello,
            _ => Proven::Nothing,
        },
        _ => Proven::Nothing,
    }
}

/// Answers a handshake refused midway with an ERROR frame of `status`
/// (best effort: the connection closes either way); the close to log.
async fn answer_refusal(s: &mut TcpStream, status: Status, why: String) -> Close {
    let mut e = Header::new(FrameType::Error);
    e.status = status;
    // A client may have sent its first request behind its AUTH (early
    // proof): closing with it unread would reset the connection.
    answer_and_drain(s, &e.encode()).await;
    Close::Proto(why)
}

/// Sends `frame` (an answer before closing), then a FIN, then reads and
/// drops what the peer sends until it closes, all within `REFUSE_WAIT`:
/// closing with the peer's bytes unread would reset the connection and
/// could discard the answer. Best effort.
async fn answer_and_drain(s: &mut TcpStream, frame: &[u8]) {
    let _ = tokio::time::timeout(REFUSE_WAIT, async {
        s.write_all(frame).await?;
        s.shutdown().await?;
        let mut sink = [0u8; 256];
        while s.read(&mut sink).await? != 0 {}
        Ok::<_, std::io::Error>(())
    })
    .await;
}
