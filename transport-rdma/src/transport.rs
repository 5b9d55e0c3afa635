//! [`RdmaTransport`]: the [`Transport`] implementation over verbs.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use parking_lot::Mutex;
use tokio::io::BufReader;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use transport_core::{
    Access, BatchId, BatchStatus, Capabilities, Error, ErrorKind, MemoryRegion, RegionId, RequestStatus, ResourceStats,
    Result, SegmentDescriptor, SegmentId, SubmitOptions, TransferRequest, Transport,
};

use crate::config::RdmaConfig;
use crate::state::{
    Batch, Endpoint, EndpointSlot, Graveyard, Limits, LocalRegion, QpSlot, Req, Segment, Slice, State, Verbs,
};
use crate::verbs::{AsyncEvent, CompChannel, Context, Cq, Pd, Qp, QpTiming, Registration, RemoteQp};
use crate::wire::{self, QpInfo, Reply, Request};

/// Background tasks that run for the transport's whole life: CQ poller,
/// reaper, side-channel listener, async-event handler.
const FIXED_TASKS: usize = 4;

/// How often the async-event thread checks whether it should stop.
const EVENT_POLL_MS: i32 = 100;

/// How much of the CQ a call of [`Inner::drain_cq`] takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Drain {
    All,
    Chunk,
}

pub(crate) struct Inner {
    pub cfg: RdmaConfig,
    pub lim: Limits,
    pub name: String,
    pub generation: u64,
    pub address: String,
    pub device: String,
    pub state: Mutex<State>,
    pub tasks: Mutex<Vec<JoinHandle<()>>>,
    /// Held across polling the CQ and applying what was polled.
    cq_lock: Mutex<()>,
    /// Stops the async-event thread (it checks every `EVENT_POLL_MS`).
    events_stop: Arc<AtomicBool>,
    events_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    me: Weak<Inner>,
}

/// The RDMA backend: RC queue pairs over one device, handshakes over a TCP
/// side channel, one CQ polled by a background task.
///
/// # Resources
/// `stats().endpoints` counts the QP groups this transport opened to peers
/// (`endpoint_lanes` their QPs); QP groups that peers hold into this
/// transport are counted in `tasks` (one serving task each). The kernel's
/// own count (`rdma resource show qp`) covers both.
///
/// # Cancellation and deadlines
/// Work already posted to a QP cannot be recalled, so cancelling, timing
/// out, closing a segment or unregistering a region with work in flight
/// moves the QPs carrying it to ERROR; the requests are reported terminal
/// only after their flushed completions came back (or the QPs were
/// destroyed after `flush_timeout_ms`). Other requests on those QPs fail
/// with a transient `ConnectionReset` and may be retried.
pub struct RdmaTransport {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for RdmaTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaTransport")
            .field("name", &self.inner.name)
            .field("device", &self.inner.device)
            .field("generation", &self.inner.generation)
            .finish()
    }
}

/// Names of the RDMA devices on this machine (empty if none).
pub fn rdma_devices() -> Result<Vec<String>> {
    Ok(crate::verbs::device_names()?)
}

fn shut() -> Error {
    Error::new(ErrorKind::Shutdown, "the RDMA transport was shut down")
}

fn link_down(dev: &str, port: u8) -> Error {
    Error::new(
        ErrorKind::ConnectionReset,
        format!("link down: port {port} of {dev} is not active (IBV_EVENT_PORT_ERR); retry when it is back"),
    )
}

fn device_failed(dev: &str) -> Error {
    Error::new(
        ErrorKind::Shutdown,
        format!("RDMA device {dev} failed (IBV_EVENT_DEVICE_FATAL); recreate the transport"),
    )
}

fn bad_segment(s: SegmentId) -> Error {
    Error::new(ErrorKind::InvalidHandle, format!("unknown or closed segment {s}")).with("segment", s)
}

impl RdmaTransport {
    /// Opens the configured device, allocates the PD and CQ, binds the side
    /// channel and starts the background tasks. Must be called inside a
    /// tokio runtime.
    ///
    /// Errors: `Config` when there is no RDMA device (`no RDMA device
    /// found`), the named device does not exist, or the GID index is empty;
    /// `ConnectionReset` when the port is down; the failing verb otherwise.
    pub async fn new(cfg: RdmaConfig) -> Result<Self> {
        cfg.validate()?;
        let ctx = Context::open(cfg.device.as_deref())?;
        let port = ctx.port_info(cfg.port, cfg.gid_index)?;
        ctx.async_events_nonblocking()?;
        let pd = Pd::new(&ctx)?;
        let chan = CompChannel::new(&ctx)?;
        let per_qp = cfg.max_outstanding_per_qp.min(port.max_qp_wr as usize);
        let want_cqe = (cfg.max_endpoints * cfg.qps_per_endpoint * per_qp).clamp(256, 1 << 20);
        let cq = Cq::new(&ctx, &chan, want_cqe.min(port.max_cqe as usize) as u32)?;
        let listener = TcpListener::bind(&cfg.listen).await.map_err(|e| Error::from(e).with("listen", &cfg.listen))?;
        let local = listener.local_addr()?;
        let name = local.to_string();
        let generation = loop {
            let g: u64 = rand::random();
            if g != 0 {
                break g;
            }
        };
        let device = ctx.name().to_string();
        let address = format!("{device}/{}/gid={}", port.port, wire::gid_hex(&port.gid));
        let lim = Limits {
            max_outstanding_per_qp: per_qp.max(1),
            flush_timeout: cfg.flush_timeout(),
            idle_timeout: cfg.idle_timeout(),
        };
        let verbs = Arc::new(Verbs { cq, chan, pd, ctx: ctx.clone(), port });
        let state = State { verbs: Some(verbs.clone()), ..Default::default() };
        let inner = Arc::new_cyclic(|me| Inner {
            me: me.clone(),
            cfg,
            lim,
            name,
            generation,
            address,
            device,
            state: Mutex::new(state),
            tasks: Mutex::new(Vec::new()),
            cq_lock: Mutex::new(()),
            events_stop: Arc::new(AtomicBool::new(false)),
            events_thread: Mutex::new(None),
        });
        let weak = Arc::downgrade(&inner);
        // Async events are read (and acknowledged at once) on a thread of
        // their own: `ibv_destroy_qp` waits until every event reported for
        // the QP was acknowledged, so the reader must never wait behind a
        // destroy running on a runtime worker.
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let stop = inner.events_stop.clone();
        let thread = std::thread::Builder::new()
            .name("kvmove-rdma-events".into())
            .spawn(move || read_async_events(&ctx, &stop, &tx))
            .map_err(|e| {
                Error::new(ErrorKind::ResourceExhausted, format!("cannot start the async-event thread: {e}"))
            })?;
        *inner.events_thread.lock() = Some(thread);
        let poller = tokio::spawn(poller(weak.clone(), verbs.cq.clone(), verbs.chan.clone()));
        let reaper = tokio::spawn(reaper(weak.clone()));
        let events = tokio::spawn(on_async_events(weak.clone(), rx));
        let server = tokio::spawn(crate::server::listen(weak, listener));
        inner.tasks.lock().extend([poller, reaper, events, server]);
        Ok(Self { inner })
    }

    /// The device in use.
    pub fn device(&self) -> &str {
        &self.inner.device
    }

    /// This instance's generation (changes on every start).
    pub fn generation(&self) -> u64 {
        self.inner.generation
    }
}

impl Drop for RdmaTransport {
    fn drop(&mut self) {
        // Background tasks hold only weak references; stopping them lets the
        // state (QPs, MRs, CQ, PD, context) drop in order with `Inner`. The
        // event thread ends within `EVENT_POLL_MS` and then lets the context go.
        self.inner.events_stop.store(true, Ordering::Relaxed);
        for t in self.inner.tasks.lock().drain(..) {
            t.abort();
        }
        let mut st = self.inner.state.lock();
        for (_, h) in st.passive_tasks.drain() {
            h.abort();
        }
        for b in st.batches.values_mut() {
            if let Some(h) = b.deadline.take() {
                h.abort();
            }
        }
    }
}

async fn poller(weak: Weak<Inner>, cq: Arc<Cq>, chan: Arc<CompChannel>) {
    let afd = match chan.async_fd() {
        Ok(a) => Some(a),
        Err(e) => {
            tracing::error!("completion channel cannot be polled ({e}); falling back to a 1 ms timer");
            None
        }
    };
    let mut buf = Vec::with_capacity(32);
    loop {
        if let Err(e) = cq.arm() {
            tracing::warn!("{e}");
        }
        {
            let Some(inner) = weak.upgrade() else { return };
            inner.drain_cq(&mut buf, Drain::All);
        }
        match &afd {
            Some(afd) => {
                tokio::select! {
                    r = afd.readable() => {
                        if let Ok(mut g) = r {
                            while chan.take_event().unwrap_or(false) {}
                            g.clear_ready();
                        }
                    }
                    _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                }
            }
            None => tokio::time::sleep(Duration::from_millis(1)).await,
        }
    }
}

/// The async-event thread: reads, acknowledges and forwards events until
/// told to stop or nobody listens.
/// Each event is stamped with the time it was read, so that it only
/// touches objects that existed then (a late PORT_ERR must not break an
/// endpoint built after the link came back). The thread ends after a
/// device failure, or when the device's event file stops working.
fn read_async_events(ctx: &Context, stop: &AtomicBool, tx: &tokio::sync::mpsc::UnboundedSender<(AsyncEvent, Instant)>) {
    let mut errors = 0;
    while !stop.load(Ordering::Relaxed) && !tx.is_closed() {
        match ctx.next_async_event(EVENT_POLL_MS) {
            Ok(Some(ev)) => {
                if tx.send((ev, Instant::now())).is_err() || ev == AsyncEvent::DeviceFatal {
                    return;
                }
                errors = 0;
            }
            Ok(None) => {}
            Err(e) => {
                errors += 1;
                if errors == 1 {
                    tracing::error!("reading async events of {}: {e}", ctx.name());
                }
                if matches!(e.errno, libc::EIO | libc::ENODEV) || errors >= 10 {
                    tracing::error!("{}: no more async events will be read ({e})", ctx.name());
                    return;
                }
                std::thread::sleep(Duration::from_millis(EVENT_POLL_MS as u64));
            }
        }
    }
}

/// Applies async events: a failed QP breaks its endpoint (or peer group);
/// the port going down breaks everything on it (new endpoints are refused
/// while the port is not active, see `Inner::link_usable`); a device
/// failure ends all work for good.
async fn on_async_events(weak: Weak<Inner>, mut rx: tokio::sync::mpsc::UnboundedReceiver<(AsyncEvent, Instant)>) {
    while let Some((ev, at)) = rx.recv().await {
        let Some(inner) = weak.upgrade() else { return };
        inner.on_async_event(ev, at);
    }
}

async fn reaper(weak: Weak<Inner>) {
    let period = {
        let Some(inner) = weak.upgrade() else { return };
        (inner.lim.idle_timeout / 4).clamp(Duration::from_millis(5), Duration::from_millis(200))
    };
    loop {
        tokio::time::sleep(period).await;
        let Some(inner) = weak.upgrade() else { return };
        let grave = {
            let mut st = inner.state.lock();
            let mut g = Graveyard::default();
            st.reap(&inner.lim, false, &mut g);
            g
        };
        drop(grave);
    }
}

impl Inner {
    /// Applies `ev`, read at `at`, to the objects that existed then.
    fn on_async_event(&self, ev: AsyncEvent, at: Instant) {
        let dev = &self.device;
        let port = self.cfg.port;
        let grave = {
            let mut st = self.state.lock();
            let mut g = Graveyard::default();
            match ev {
                AsyncEvent::QpError { qpn, what } => {
                    tracing::warn!("{dev}: queue pair {qpn} failed ({what})");
                    let why = Error::new(ErrorKind::ConnectionReset, format!("queue pair {qpn} failed ({what})"));
                    st.break_qp(qpn, at, why, &mut g);
                }
                AsyncEvent::PortError { port: p } if p == port => {
                    tracing::warn!("{dev}: port {p} went down; breaking every endpoint on it");
                    st.break_all(at, &link_down(dev, port), &mut g);
                }
                AsyncEvent::CqError => {
                    tracing::error!("{dev}: completion queue overrun; breaking every endpoint");
                    let why = Error::new(ErrorKind::ConnectionReset, "completion queue overrun (completions lost)");
                    st.break_all(at, &why, &mut g);
                }
                AsyncEvent::DeviceFatal => {
                    tracing::error!("{dev}: device failed (IBV_EVENT_DEVICE_FATAL)");
                    st.device_failed = true;
                    st.break_all(at, &device_failed(dev), &mut g);
                }
                other => tracing::debug!("{dev}: async event {other:?}"),
            }
            g
        };
        drop(grave);
    }

    /// Refuses new endpoints once the device has failed, or while the port
    /// is not active (asked of the device itself: one query per endpoint
    /// build, never on the data path, and no cached flag to go stale).
    pub(crate) fn link_usable(&self) -> Result<()> {
        let (failed, v) = {
            let st = self.state.lock();
            (st.device_failed, st.verbs.clone())
        };
        if failed {
            return Err(device_failed(&self.device));
        }
        match v.ok_or_else(shut)?.ctx.port_active(self.cfg.port) {
            Ok(true) => Ok(()),
            _ => Err(link_down(&self.device, self.cfg.port)),
        }
    }

    /// Polls the CQ and applies what it finds, in CQ order: the poll and
    /// the apply happen under `cq_lock`, so a busy-polling waiter and the
    /// poller never apply completions out of order (a flush completion
    /// must not overtake the error that caused it). `Drain::All` (the
    /// poller) waits for the lock and empties the CQ; `Drain::Chunk` (a
    /// busy-polling waiter) takes at most one chunk, and nothing if the
    /// poller is at it. Returns how many completions were applied.
    fn drain_cq(&self, buf: &mut Vec<crate::verbs::Completion>, how: Drain) -> usize {
        let Some(v) = self.state.lock().verbs.clone() else { return 0 };
        let _order = match how {
            Drain::All => self.cq_lock.lock(),
            Drain::Chunk => match self.cq_lock.try_lock() {
                Some(g) => g,
                None => return 0,
            },
        };
        let mut total = 0;
        loop {
            match v.cq.poll(buf, 32) {
                Ok(0) => return total,
                Ok(n) => {
                    total += n;
                    self.on_completions(buf);
                    if how == Drain::Chunk {
                        return total;
                    }
                }
                Err(e) => {
                    tracing::error!("{e}");
                    return total;
                }
            }
        }
    }

    fn on_completions(&self, cs: &[crate::verbs::Completion]) {
        let grave = {
            let mut st = self.state.lock();
            let mut g = Graveyard::default();
            for c in cs {
                st.on_completion(c, &self.lim, &mut g);
            }
            g
        };
        drop(grave);
    }

    fn weak(&self) -> Weak<Inner> {
        self.me.clone()
    }

    pub(crate) fn descriptor(&self) -> SegmentDescriptor {
        self.state.lock().descriptor(&self.name, self.generation, &self.address)
    }

    pub(crate) fn verbs(&self) -> Result<Arc<Verbs>> {
        self.state.lock().verbs.clone().ok_or_else(shut)
    }

    pub(crate) fn timing(&self) -> QpTiming {
        QpTiming { timeout: self.cfg.ack_timeout, retry_cnt: self.cfg.retry_count }
    }

    /// Creates `n` QPs in INIT with random PSNs.
    pub(crate) fn new_qps(&self, v: &Verbs, n: usize) -> Result<Vec<(Qp, u32)>> {
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let qp = Qp::new(&v.pd, &v.cq, v.port.port, self.lim.max_outstanding_per_qp as u32)?;
            out.push((qp, rand::random::<u32>() & 0x00ff_ffff));
        }
        Ok(out)
    }

    /// Waits (bounded) until `quiet` holds, reaping flushed endpoints; after
    /// twice the flush timeout, destroys every broken endpoint, which makes
    /// the state quiet by construction.
    async fn settle(&self, quiet: impl Fn(&State) -> bool) {
        let start = Instant::now();
        let limit = self.lim.flush_timeout * 2 + Duration::from_millis(100);
        loop {
            let (done, grave) = {
                let mut st = self.state.lock();
                let mut g = Graveyard::default();
                let force = start.elapsed() >= limit;
                st.reap(&self.lim, force, &mut g);
                (quiet(&st) || force, g)
            };
            drop(grave);
            if done {
                return;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Asks a peer for its descriptor over the side channel.
    async fn fetch_descriptor(&self, name: &str) -> Result<SegmentDescriptor> {
        let work = async {
            let s = TcpStream::connect(name).await.map_err(|e| Error::from(e).with("segment", name))?;
            s.set_nodelay(true)?;
            let (r, mut w) = s.into_split();
            let mut r = BufReader::new(r);
            wire::send(&mut w, &Request::Describe).await?;
            match wire::recv::<_, Reply>(&mut r).await? {
                Reply::Descriptor { descriptor } => Ok(descriptor),
                Reply::Error { message } => Err(Error::new(ErrorKind::HandshakeFailed, message)),
                other => Err(Error::new(ErrorKind::Protocol, format!("unexpected reply {other:?}"))),
            }
        };
        let d = match tokio::time::timeout(self.cfg.handshake_timeout(), work).await {
            Ok(r) => r?,
            Err(_) => return Err(Error::new(ErrorKind::HandshakeFailed, "descriptor request timed out")),
        };
        if d.backend != "rdma" {
            return Err(Error::new(
                ErrorKind::HandshakeFailed,
                format!("segment is served by {:?}, not rdma", d.backend),
            )
            .with("segment", name));
        }
        Ok(d)
    }

    /// Returns the live endpoint of `seg`, building one if needed. The bool
    /// says the peer restarted (its generation changed) since the handle's
    /// descriptor was read; the descriptor has been refreshed.
    async fn endpoint(&self, seg: SegmentId) -> Result<(u64, bool)> {
        let lock = {
            let st = self.state.lock();
            if st.shutdown {
                return Err(shut());
            }
            let s = st.segments.get(&seg).ok_or_else(|| bad_segment(seg))?;
            if let Some(&ep) = st.seg_ep.get(&seg) {
                return Ok((ep, false));
            }
            s.connect_lock.clone()
        };
        let _guard = lock.lock().await;
        let name = {
            let st = self.state.lock();
            let s = st.segments.get(&seg).ok_or_else(|| bad_segment(seg))?;
            if let Some(&ep) = st.seg_ep.get(&seg) {
                return Ok((ep, false));
            }
            s.desc.name.clone()
        };
        self.link_usable()?;
        let slot = self.reserve_slot().await?;
        // On failure the QPs built so far are destroyed before `slot` goes.
        let (ep, peer) = self.build_endpoint(seg, &name, slot).await?;
        let mut st = self.state.lock();
        if st.shutdown {
            return Err(shut());
        }
        let Some(s) = st.segments.get_mut(&seg) else {
            return Err(bad_segment(seg));
        };
        let restarted = peer.generation != s.desc.generation;
        s.desc = peer;
        let id = st.next_id();
        let mut ep = ep;
        if let Some(stream) = ep.stream.take() {
            ep.watcher = Some(tokio::spawn(watch(self.weak(), id, stream)).abort_handle());
        }
        st.endpoints.insert(id, ep);
        st.seg_ep.insert(seg, id);
        Ok((id, restarted))
    }

    /// Takes a slot under `max_endpoints`, evicting the least recently used
    /// idle endpoint if the store is full. If every endpoint is busy (or
    /// still flushing), waits up to `handshake_timeout_ms` for one to go
    /// idle, then fails with `ResourceExhausted` (transient).
    async fn reserve_slot(&self) -> Result<EndpointSlot> {
        let start = Instant::now();
        loop {
            let grave = {
                let mut st = self.state.lock();
                let mut g = Graveyard::default();
                // Reaped endpoints give their places back once destroyed
                // (below, outside the lock); look again after that.
                st.reap(&self.lim, false, &mut g);
                if g.is_empty() {
                    if let Some(slot) = EndpointSlot::try_take(&st.slots, self.cfg.max_endpoints) {
                        return Ok(slot);
                    }
                    let lru = st
                        .endpoints
                        .iter()
                        .filter(|(_, e)| e.broken_at.is_none() && e.idle())
                        .min_by_key(|(_, e)| e.last_used)
                        .map(|(id, _)| *id);
                    match lru {
                        Some(id) => st.destroy_endpoint_now(id, &mut g),
                        // Busy endpoints go idle when their work completes,
                        // broken ones when they have flushed, dying ones
                        // when their QPs are destroyed: wait, bounded.
                        None if start.elapsed() < self.cfg.handshake_timeout() => {}
                        None => {
                            return Err(Error::new(
                                ErrorKind::ResourceExhausted,
                                format!(
                                    "endpoint store full: {} endpoints, all busy for {:?}",
                                    self.cfg.max_endpoints,
                                    self.cfg.handshake_timeout()
                                ),
                            ))
                        }
                    }
                }
                g
            };
            let wait = !grave.is_empty();
            drop(grave);
            if !wait {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    }

    async fn build_endpoint(
        &self,
        seg: SegmentId,
        name: &str,
        slot: EndpointSlot,
    ) -> Result<(Endpoint, SegmentDescriptor)> {
        let v = self.verbs()?;
        let created = Instant::now();
        let qps = self.new_qps(&v, self.cfg.qps_per_endpoint)?;
        let hello = Request::Connect {
            gid: wire::gid_hex(&v.port.gid),
            lid: v.port.lid,
            mtu: v.port.active_mtu,
            qps: qps.iter().map(|(q, psn)| QpInfo { qpn: q.qpn(), psn: *psn }).collect(),
        };
        let work = async {
            let s = TcpStream::connect(name).await.map_err(|e| Error::from(e).with("segment", name))?;
            s.set_nodelay(true)?;
            let mut s = BufReader::new(s);
            wire::send(s.get_mut(), &hello).await?;
            let reply = wire::recv::<_, Reply>(&mut s).await?;
            Ok::<_, Error>((s, reply))
        };
        let (stream, reply) = match tokio::time::timeout(self.cfg.handshake_timeout(), work).await {
            Ok(r) => r?,
            Err(_) => return Err(Error::new(ErrorKind::HandshakeFailed, "handshake timed out").with("segment", name)),
        };
        let (gid, lid, mtu, theirs, desc) = match reply {
            Reply::Connected { gid, lid, mtu, qps, descriptor } => (gid, lid, mtu, qps, descriptor),
            Reply::Error { message } => {
                return Err(Error::new(ErrorKind::HandshakeFailed, message).with("segment", name));
            }
            Reply::Descriptor { .. } => {
                return Err(Error::new(ErrorKind::Protocol, "descriptor sent instead of a connect reply"))
            }
        };
        if theirs.len() != qps.len() {
            return Err(Error::new(ErrorKind::HandshakeFailed, "peer answered with a different QP count"));
        }
        let gid = wire::parse_gid(&gid)?;
        // MTU: the smaller of both ports' active MTUs.
        let mtu = mtu.clamp(1, 5).min(v.port.active_mtu);
        for ((qp, psn), r) in qps.iter().zip(&theirs) {
            let remote = RemoteQp { qpn: r.qpn, psn: r.psn, gid, lid };
            qp.connect(*psn, &remote, v.port.port, v.port.gid_index, mtu, v.port.max_rd_atom, self.timing())
                .map_err(|e| Error::new(ErrorKind::HandshakeFailed, e.to_string()))?;
        }
        let ep = Endpoint {
            segment: seg,
            qps: qps.into_iter().map(|(q, _)| QpSlot { qp: Arc::new(q), outstanding: 0 }).collect(),
            pending: Default::default(),
            next_qp: 0,
            last_used: Instant::now(),
            created,
            broken_at: None,
            stream: Some(stream.into_inner()),
            watcher: None,
            _slot: slot,
        };
        Ok((ep, desc))
    }

    /// Validates one request; returns the remote key, or `None` if the
    /// remote range is not in the handle's descriptor (it may be stale).
    fn check_request(&self, st: &State, r: &TransferRequest) -> Result<Option<u32>> {
        if r.len == 0 || r.len > self.cfg.max_request_len {
            return Err(Error::new(ErrorKind::InvalidRequest, format!("request length {} is not allowed", r.len)));
        }
        let region = st.regions.get(&r.local).ok_or_else(|| {
            Error::new(ErrorKind::InvalidHandle, format!("unknown or unregistered region {}", r.local))
        })?;
        region.reg.mem().check(r.local_offset, r.len).map_err(Error::from)?;
        let seg = st.segments.get(&r.segment).ok_or_else(|| bad_segment(r.segment))?;
        let Some(info) = seg.desc.region_for(r.remote_addr, r.len) else {
            return Ok(None);
        };
        if !info.access.allows(r.op) {
            return Err(Error::new(ErrorKind::AccessDenied, format!("remote region does not allow {:?}", r.op))
                .with("segment", r.segment));
        }
        u32::try_from(info.key)
            .map(Some)
            .map_err(|_| Error::new(ErrorKind::Protocol, "remote key does not fit an rkey"))
    }

    async fn submit(self: &Arc<Self>, requests: Vec<TransferRequest>, opts: SubmitOptions) -> Result<BatchId> {
        if requests.is_empty() || requests.len() > self.cfg.max_batch_len {
            return Err(Error::new(
                ErrorKind::InvalidRequest,
                format!("batch of {} requests (allowed 1..={})", requests.len(), self.cfg.max_batch_len),
            ));
        }
        // Validate; refresh stale descriptors once if a remote range is unknown.
        let mut keys = Vec::with_capacity(requests.len());
        let mut refreshed = HashSet::new();
        loop {
            let mut stale = None;
            {
                let st = self.state.lock();
                if st.shutdown {
                    return Err(shut());
                }
                keys.clear();
                for (i, r) in requests.iter().enumerate() {
                    match self.check_request(&st, r).map_err(|e| e.with("request", i))? {
                        Some(k) => keys.push(k),
                        None if !refreshed.contains(&r.segment) => {
                            let name = st.segments.get(&r.segment).map(|s| s.desc.name.clone()).unwrap_or_default();
                            stale = Some((i, r.segment, name));
                            break;
                        }
                        None => {
                            return Err(Error::new(
                                ErrorKind::OutOfBounds,
                                format!("remote range {:#x}+{} is in no region of the segment", r.remote_addr, r.len),
                            )
                            .with("segment", r.segment)
                            .with("request", i))
                        }
                    }
                }
            }
            let Some((i, seg, name)) = stale else { break };
            refreshed.insert(seg);
            let d = self.fetch_descriptor(&name).await.map_err(|e| e.with("request", i))?;
            let mut st = self.state.lock();
            let s = st.segments.get_mut(&seg).ok_or_else(|| bad_segment(seg).with("request", i))?;
            if d.generation != s.desc.generation {
                s.desc = d;
                return Err(Error::new(ErrorKind::PeerRestarted, "the peer restarted; re-read its descriptor")
                    .with("segment", seg)
                    .with("request", i));
            }
            s.desc = d;
        }
        // Create the batch.
        let slice = u64::from(self.cfg.slice_size);
        let id;
        {
            let mut st = self.state.lock();
            if st.shutdown {
                return Err(shut());
            }
            id = BatchId(st.next_id());
            let reqs = requests
                .iter()
                .zip(&keys)
                .map(|(r, k)| Req {
                    spec: *r,
                    status: RequestStatus::Pending,
                    rkey: *k,
                    slices_left: r.len.div_ceil(slice),
                    outstanding: 0,
                })
                .collect();
            let mut batch = Batch { reqs, notify: Arc::new(Notify::new()), deadline: None };
            if let Some(t) = opts.timeout {
                let weak = Arc::downgrade(self);
                batch.deadline = Some(tokio::spawn(deadline(weak, id, t)).abort_handle());
                st.deadline_tasks += 1;
            }
            st.batches.insert(id, batch);
        }
        // Start each segment's requests on its endpoint.
        let mut segs: Vec<SegmentId> = requests.iter().map(|r| r.segment).collect();
        segs.dedup();
        let mut seen = HashSet::new();
        for seg in segs {
            if !seen.insert(seg) {
                continue;
            }
            // The endpoint may be evicted (it is idle until our slices are
            // queued) between `endpoint` and taking the lock: try again.
            let mut attempts = 0;
            let grave = loop {
                attempts += 1;
                let got = self.endpoint(seg).await;
                let mut st = self.state.lock();
                if let Ok((ep, false)) = &got {
                    if attempts < 5 && !st.usable(*ep) {
                        drop(st);
                        continue;
                    }
                }
                let mut g = Graveyard::default();
                match got {
                    Err(e) => {
                        for (i, r) in requests.iter().enumerate() {
                            if r.segment == seg {
                                st.finish_req(id, i, RequestStatus::Failed(e.clone().with("request", i)));
                            }
                        }
                    }
                    Ok((_, true)) => {
                        for (i, r) in requests.iter().enumerate() {
                            if r.segment == seg {
                                let e =
                                    Error::new(ErrorKind::PeerRestarted, "the peer restarted; re-read its descriptor")
                                        .with("segment", seg)
                                        .with("request", i);
                                st.finish_req(id, i, RequestStatus::Failed(e));
                            }
                        }
                    }
                    Ok((ep, false)) => {
                        if !st.usable(ep) {
                            for (i, r) in requests.iter().enumerate() {
                                if r.segment == seg {
                                    let e = Error::new(ErrorKind::ConnectionReset, "endpoint evicted while starting")
                                        .with("request", i);
                                    st.finish_req(id, i, RequestStatus::Failed(e));
                                }
                            }
                        } else if let Some(e) = st.endpoints.get_mut(&ep) {
                            for (i, r) in requests.iter().enumerate() {
                                if r.segment != seg {
                                    continue;
                                }
                                let mut off = 0;
                                while off < r.len {
                                    let len = (r.len - off).min(slice) as u32;
                                    e.pending.push_back(Slice { batch: id, req: i, offset: off, len });
                                    off += u64::from(len);
                                }
                            }
                            e.last_used = Instant::now();
                        }
                        st.pump(ep, &self.lim, &mut g);
                    }
                }
                break g;
            };
            drop(grave);
        }
        Ok(id)
    }

    /// Ends pending requests of `batch` with `status`, flushes its posted
    /// work and waits until the batch is quiet.
    async fn stop_batch(&self, batch: BatchId, status: RequestStatus) -> Result<BatchStatus> {
        let grave = {
            let mut st = self.state.lock();
            if !st.batches.contains_key(&batch) {
                return Err(Error::new(ErrorKind::InvalidHandle, format!("unknown or released {batch}")));
            }
            let mut g = Graveyard::default();
            st.end_requests(|b, _| b == batch, status, &mut g);
            g
        };
        drop(grave);
        self.settle(|st| batch_quiet(st.batches.get(&batch))).await;
        let st = self.state.lock();
        st.batches
            .get(&batch)
            .map(Batch::snapshot)
            .ok_or_else(|| Error::new(ErrorKind::InvalidHandle, format!("{batch} was released")))
    }
}

/// A released batch, or one with no posted work, is quiet.
fn batch_quiet(b: Option<&Batch>) -> bool {
    match b {
        None => true,
        Some(b) => b.outstanding() == 0,
    }
}

/// Breaks endpoint `ep` when the peer closes its side channel.
async fn watch(weak: Weak<Inner>, ep: u64, mut stream: TcpStream) {
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 64];
    loop {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
    }
    let Some(inner) = weak.upgrade() else { return };
    let grave = {
        let mut st = inner.state.lock();
        let mut g = Graveyard::default();
        if let Some(e) = st.endpoints.get_mut(&ep) {
            e.watcher = None; // this task is ending by itself
            let why = Error::new(ErrorKind::ConnectionReset, "the peer closed the side channel (crashed or shut down)");
            st.break_endpoint(ep, why, &mut g);
        }
        g
    };
    drop(grave);
}

async fn deadline(weak: Weak<Inner>, batch: BatchId, after: Duration) {
    tokio::time::sleep(after).await;
    let Some(inner) = weak.upgrade() else { return };
    {
        let mut st = inner.state.lock();
        st.deadline_tasks = st.deadline_tasks.saturating_sub(1);
        if let Some(b) = st.batches.get_mut(&batch) {
            b.deadline = None;
        }
    }
    let _ = inner.stop_batch(batch, RequestStatus::TimedOut).await;
}

#[async_trait]
impl Transport for RdmaTransport {
    fn backend(&self) -> &str {
        "rdma"
    }

    fn capabilities(&self) -> Capabilities {
        let mut c = Capabilities::new(self.inner.cfg.max_endpoints);
        c.max_batch_len = self.inner.cfg.max_batch_len;
        c.max_request_len = self.inner.cfg.max_request_len;
        c.lanes_per_endpoint = self.inner.cfg.qps_per_endpoint;
        c
    }

    fn local_segment_name(&self) -> String {
        self.inner.name.clone()
    }

    fn register(&self, mem: MemoryRegion, access: Access) -> Result<RegionId> {
        let mut st = self.inner.state.lock();
        if st.shutdown {
            return Err(shut());
        }
        if let Some((id, _)) = st.regions.iter().find(|(_, r)| r.reg.mem().overlaps(&mem)) {
            return Err(Error::new(ErrorKind::AlreadyRegistered, format!("memory overlaps {id}")));
        }
        let pd = st.verbs.as_ref().map(|v| v.pd.clone()).ok_or_else(shut)?;
        let reg = Registration::new(&pd, mem, access.remote_read, access.remote_write)?;
        let id = RegionId(st.next_id());
        st.regions.insert(id, LocalRegion { reg, access });
        Ok(id)
    }

    async fn unregister(&self, region: RegionId) -> Result<()> {
        let (taken, grave) = {
            let mut st = self.inner.state.lock();
            if st.shutdown {
                return Err(shut());
            }
            let Some(r) = st.regions.remove(&region) else {
                return Err(Error::new(ErrorKind::InvalidHandle, format!("unknown or unregistered {region}")));
            };
            let mut g = Graveyard::default();
            let e = Error::new(ErrorKind::Unregistered, format!("{region} was unregistered"));
            st.end_requests(|_, q| q.spec.local == region, RequestStatus::Failed(e), &mut g);
            (r, g)
        };
        drop(grave);
        self.inner.settle(|st| !st.any_posted(|_, q| q.spec.local == region)).await;
        drop(taken); // ibv_dereg_mr, then the memory may go
        Ok(())
    }

    async fn open_segment(&self, name: &str) -> Result<SegmentId> {
        if self.inner.state.lock().shutdown {
            return Err(shut());
        }
        let desc = self.inner.fetch_descriptor(name).await?;
        let mut st = self.inner.state.lock();
        if st.shutdown {
            return Err(shut());
        }
        let id = SegmentId(st.next_id());
        st.segments.insert(id, Segment { desc, connect_lock: Arc::new(tokio::sync::Mutex::new(())) });
        Ok(id)
    }

    async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        let grave = {
            let mut st = self.inner.state.lock();
            if st.shutdown {
                return Err(shut());
            }
            if st.segments.remove(&segment).is_none() {
                return Err(bad_segment(segment));
            }
            let mut g = Graveyard::default();
            st.end_requests(|_, q| q.spec.segment == segment, RequestStatus::Cancelled, &mut g);
            let mine: Vec<u64> = st.endpoints.iter().filter(|(_, e)| e.segment == segment).map(|(id, _)| *id).collect();
            for id in mine {
                let why = Error::new(ErrorKind::ConnectionReset, "segment closed");
                st.break_endpoint(id, why, &mut g);
            }
            g
        };
        drop(grave);
        self.inner.settle(|st| !st.endpoints.values().any(|e| e.segment == segment)).await;
        Ok(())
    }

    fn segment_descriptor(&self, segment: SegmentId) -> Result<SegmentDescriptor> {
        let st = self.inner.state.lock();
        st.segments.get(&segment).map(|s| s.desc.clone()).ok_or_else(|| bad_segment(segment))
    }

    async fn submit(&self, requests: Vec<TransferRequest>, opts: SubmitOptions) -> Result<BatchId> {
        self.inner.submit(requests, opts).await
    }

    fn poll(&self, batch: BatchId) -> Result<BatchStatus> {
        let st = self.inner.state.lock();
        st.batches
            .get(&batch)
            .map(Batch::snapshot)
            .ok_or_else(|| Error::new(ErrorKind::InvalidHandle, format!("unknown or released {batch}")))
    }

    async fn wait(&self, batch: BatchId) -> Result<BatchStatus> {
        // Busy-poll first (bounded by `busy_poll_us`): a small transfer's
        // completion is then seen here, without a wakeup through the
        // completion channel and the poller task.
        let spin_until = Instant::now() + self.inner.cfg.busy_poll();
        let mut buf = Vec::new(); // allocated by the first poll that finds work
        loop {
            let notify = {
                let st = self.inner.state.lock();
                let b = st
                    .batches
                    .get(&batch)
                    .ok_or_else(|| Error::new(ErrorKind::InvalidHandle, format!("unknown or released {batch}")))?;
                let s = b.snapshot();
                if s.is_terminal() {
                    return Ok(s);
                }
                b.notify.clone()
            };
            if Instant::now() < spin_until {
                self.inner.drain_cq(&mut buf, Drain::Chunk);
                tokio::task::yield_now().await;
                continue;
            }
            let _ = tokio::time::timeout(Duration::from_millis(2), notify.notified()).await;
        }
    }

    async fn cancel(&self, batch: BatchId) -> Result<BatchStatus> {
        self.inner.stop_batch(batch, RequestStatus::Cancelled).await
    }

    fn release(&self, batch: BatchId) -> Result<()> {
        let mut st = self.inner.state.lock();
        let b = st
            .batches
            .get(&batch)
            .ok_or_else(|| Error::new(ErrorKind::InvalidHandle, format!("unknown or released {batch}")))?;
        if !b.snapshot().is_terminal() {
            return Err(Error::new(
                ErrorKind::InvalidRequest,
                format!("{batch} is still in progress; cancel it first"),
            ));
        }
        if let Some(b) = st.batches.remove(&batch) {
            if let Some(h) = b.deadline {
                h.abort();
                st.deadline_tasks = st.deadline_tasks.saturating_sub(1);
            }
        }
        Ok(())
    }

    fn stats(&self) -> ResourceStats {
        let st = self.inner.state.lock();
        let running = if st.verbs.is_some() { FIXED_TASKS } else { 0 };
        ResourceStats {
            endpoints: st.endpoints.len(),
            endpoint_lanes: st.endpoints.values().map(|e| e.qps.len()).sum(),
            segments: st.segments.len(),
            regions: st.regions.len(),
            batches: st.batches.len(),
            inflight: st.wrs.len(),
            tasks: running
                + st.deadline_tasks
                + st.passive_tasks.len()
                + st.endpoints.values().filter(|e| e.watcher.is_some()).count(),
        }
    }

    async fn shutdown(&self) -> Result<()> {
        let inner = &self.inner;
        let grave = {
            let mut st = inner.state.lock();
            if st.shutdown {
                return Ok(());
            }
            st.shutdown = true;
            let mut g = Graveyard::default();
            st.end_requests(|_, _| true, RequestStatus::Cancelled, &mut g);
            let ids: Vec<u64> = st.endpoints.keys().copied().collect();
            for id in ids {
                st.break_endpoint(id, Error::new(ErrorKind::Shutdown, "transport shut down"), &mut g);
            }
            for (_, h) in st.passive_tasks.drain() {
                h.abort();
            }
            g.passive.extend(st.passive.drain().map(|(_, p)| p));
            g
        };
        drop(grave);
        inner.settle(|st| st.endpoints.is_empty()).await;
        let tasks: Vec<JoinHandle<()>> = inner.tasks.lock().drain(..).collect();
        for t in &tasks {
            t.abort();
        }
        for t in tasks {
            let _ = t.await;
        }
        inner.events_stop.store(true, Ordering::Relaxed);
        let thread = inner.events_thread.lock().take();
        if let Some(th) = thread {
            // Ends within EVENT_POLL_MS; joined off the runtime's workers.
            let _ = tokio::task::spawn_blocking(move || th.join()).await;
        }
        let (grave, verbs) = {
            let mut st = inner.state.lock();
            let mut g = Graveyard::default();
            st.segments.clear();
            st.seg_ep.clear();
            for b in st.batches.values_mut() {
                if let Some(h) = b.deadline.take() {
                    h.abort();
                }
            }
            st.deadline_tasks = 0;
            st.batches.clear();
            st.wrs.clear();
            g.regions.extend(std::mem::take(&mut st.regions).into_values());
            (g, st.verbs.take())
        };
        drop(grave); // QPs are gone already; MRs now
        drop(verbs); // then CQ, channel, PD, context (last Arc)
        Ok(())
    }
}
