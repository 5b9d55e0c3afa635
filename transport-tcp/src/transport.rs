//! `TcpTransport`: the `Transport` implementation tying the pieces
//! together (regions, segments, endpoints, batches, server, reaper).

use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use transport_core::{
    Access, BatchId, BatchStatus, Capabilities, Error, ErrorKind, RegionId, RegionInfo, ResourceStats, Result,
    SegmentDescriptor, SegmentId, SubmitOptions, TransferRequest, Transport,
};
use transport_mem::MemoryRegion;

use crate::batch::{Batch, EndReason};
use crate::config::TcpConfig;
use crate::endpoint::{Cache, Endpoint, Work};
use crate::proto::WireRegion;
use crate::regions::RegionTable;
use crate::server::Server;
use crate::tasks::{spawn_counted, Counters};

/// Largest batch accepted.
const MAX_BATCH: usize = 1 << 20;
/// Largest single request.
const MAX_REQUEST: u64 = 1 << 40;

/// The TCP backend. Cheap to share behind an `Arc<dyn Transport>`;
/// dropping the last handle stops every task it started.
#[derive(Debug)]
pub struct TcpTransport {
    inner: Arc<Inner>,
    bound: SocketAddr,
}

#[derive(Debug)]
struct SegmentEntry {
    name: String,
    addr: SocketAddr,
    desc: SegmentDescriptor,
}

#[derive(Debug)]
struct Inner {
    cfg: Arc<TcpConfig>,
    local_name: String,
    generation: u64,
    counters: Arc<Counters>,
    regions: Arc<RegionTable>,
    server: Arc<Server>,
    cache: Arc<Cache>,
    build: tokio::sync::Mutex<()>,
    segments: Mutex<HashMap<SegmentId, SegmentEntry>>,
    batches: Mutex<HashMap<BatchId, Arc<Batch>>>,
    background: Mutex<Vec<JoinHandle<()>>>,
    next_handle: AtomicU64,
    shut: AtomicBool,
}

fn fresh_generation() -> u64 {
    let t =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    (t ^ rand::random::<u64>()) | 1
}

fn shut_err() -> Error {
    Error::new(ErrorKind::Shutdown, "the transport was shut down")
}

impl TcpTransport {
    /// Binds the listener and starts serving. Must be called inside a
    /// tokio runtime. The segment name is the bound `host:port`.
    pub async fn new(cfg: TcpConfig) -> Result<Self> {
        cfg.validate()?;
        let addr = resolve(&cfg.listen)?;
        let sock = socket2::Socket::new(socket2::Domain::for_address(addr), socket2::Type::STREAM, None)?;
        sock.set_reuse_address(true)?;
        sock.set_nonblocking(true)?;
        if let Some(n) = cfg.recv_buffer {
            sock.set_recv_buffer_size(n)?;
        }
        sock.bind(&addr.into()).map_err(|e| Error::from(e).with("listen", addr))?;
        sock.listen(1024)?;
        let listener = TcpListener::from_std(sock.into())?;
        let local = listener.local_addr()?;
        let bound = local;
        let cfg = Arc::new(cfg);
        let counters = Counters::new();
        let regions = Arc::new(RegionTable::default());
        let generation = fresh_generation();
        let server = Server::new(cfg.clone(), regions.clone(), generation, counters.clone());
        let inner = Arc::new(Inner {
            cfg: cfg.clone(),
            local_name: cfg.advertise.clone().unwrap_or_else(|| local.to_string()),
            generation,
            counters: counters.clone(),
            regions,
            server: server.clone(),
            cache: Arc::new(Cache::default()),
            build: tokio::sync::Mutex::new(()),
            segments: Mutex::new(HashMap::new()),
            batches: Mutex::new(HashMap::new()),
            background: Mutex::new(Vec::new()),
            next_handle: AtomicU64::new(1),
            shut: AtomicBool::new(false),
        });
        let accept = spawn_counted(&counters, server.accept_loop(listener));
        let reaper = spawn_counted(&counters, reaper(Arc::downgrade(&inner)));
        inner.background.lock().extend([accept, reaper]);
        tracing::info!(listen = %local, generation, "tcp transport serving");
        Ok(Self { inner, bound })
    }

    /// The configuration in force.
    pub fn config(&self) -> &TcpConfig {
        &self.inner.cfg
    }

    /// This transport's generation (changes on every start).
    pub fn generation(&self) -> u64 {
        self.inner.generation
    }

    /// The address the listener is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.bound
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        let i = &self.inner;
        i.shut.store(true, Ordering::Release);
        for h in i.background.lock().drain(..) {
            h.abort();
        }
        i.server.abort_all();
        let eps: Vec<Arc<Endpoint>> = i.cache.map.lock().drain().map(|(_, e)| e).collect();
        for ep in eps {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move { ep.destroy(Error::new(ErrorKind::Shutdown, "transport dropped")).await });
            }
        }
        for (_, b) in i.batches.lock().drain() {
            if let Some(h) = b.deadline.lock().take() {
                h.abort();
            }
        }
    }
}

fn resolve(name: &str) -> Result<SocketAddr> {
    name.to_socket_addrs()
        .map_err(|e| {
            Error::new(ErrorKind::NotFound, format!("cannot resolve segment name: {e}")).with("segment", name)
        })?
        .next()
        .ok_or_else(|| Error::new(ErrorKind::NotFound, "segment name resolves to no address").with("segment", name))
}

/// Reclaims idle endpoints on a timer (rule 4).
async fn reaper(inner: std::sync::Weak<Inner>) {
    loop {
        let tick = match inner.upgrade() {
            Some(i) => (i.cfg.idle_timeout / 4).clamp(Duration::from_millis(10), Duration::from_secs(1)),
            None => return,
        };
        tokio::time::sleep(tick).await;
        let Some(i) = inner.upgrade() else { return };
        let now = i.counters.now_ms();
        let idle = i.cfg.idle_timeout.as_millis() as u64;
        let victims: Vec<Arc<Endpoint>> = i
            .cache
            .map
            .lock()
            .values()
            .filter(|e| now.saturating_sub(e.last_used()) >= idle && !e.busy())
            .cloned()
            .collect();
        for ep in victims {
            tracing::debug!(peer = %ep.name, "reclaiming idle endpoint");
            ep.destroy(Error::new(ErrorKind::ConnectionReset, "idle endpoint reclaimed")).await;
        }
    }
}

impl Inner {
    fn check_open(&self) -> Result<()> {
        if self.shut.load(Ordering::Acquire) {
            Err(shut_err())
        } else {
            Ok(())
        }
    }

    fn handle(&self) -> u64 {
        self.next_handle.fetch_add(1, Ordering::Relaxed)
    }

    /// The live endpoint to `name`, built if needed, within the bound.
    async fn endpoint(&self, name: &str, addr: SocketAddr) -> Result<Arc<Endpoint>> {
        if let Some(ep) = self.cache.map.lock().get(name).filter(|e| !e.is_dead()).cloned() {
            return Ok(ep);
        }
        let _b = self.build.lock().await;
        self.check_open()?;
        if let Some(ep) = self.cache.map.lock().get(name).filter(|e| !e.is_dead()).cloned() {
            return Ok(ep);
        }
        let start = tokio::time::Instant::now();
        loop {
            let victim = {
                let m = self.cache.map.lock();
                if m.len() < self.cfg.max_endpoints {
                    break;
                }
                m.values().filter(|e| !e.busy()).min_by_key(|e| e.last_used()).cloned()
            };
            match victim {
                Some(ep) => {
                    tracing::debug!(peer = %ep.name, "evicting endpoint at the bound");
                    ep.destroy(Error::new(ErrorKind::ConnectionReset, "endpoint evicted")).await;
                }
                None if start.elapsed() >= self.cfg.connect_timeout => {
                    return Err(Error::new(
                        ErrorKind::ResourceExhausted,
                        "every endpoint is busy and the endpoint bound is reached",
                    )
                    .with("peer", name));
                }
                None => tokio::time::sleep(Duration::from_millis(2)).await,
            }
        }
        let ep = Endpoint::connect(name, addr, self.cfg.clone(), self.counters.clone(), &self.cache).await?;
        self.check_open().inspect_err(|_| {
            let ep = ep.clone();
            tokio::spawn(async move { ep.destroy(shut_err()).await });
        })?;
        self.cache.map.lock().insert(name.to_owned(), ep.clone());
        Ok(ep)
    }

    fn descriptor(&self, name: &str, ep: &Endpoint) -> SegmentDescriptor {
        descriptor(name, ep.addr, ep.generation, &ep.regions)
    }

    /// Ends the pending requests of `batch` chosen by `pick`, then makes
    /// them quiet: their unsent slices are dropped and every endpoint that
    /// still carries slices of the batch is destroyed (its sockets reset),
    /// so nothing of theirs is read, written or applied afterwards.
    async fn end_requests(
        &self,
        batch: &Arc<Batch>,
        reason: EndReason,
        pick: impl FnMut(usize, &TransferRequest) -> bool,
    ) {
        if batch.end(&reason, pick) == 0 && batch.outstanding() == 0 {
            return;
        }
        let peers = batch.peers.lock().clone();
        let eps: Vec<Arc<Endpoint>> =
            { self.cache.map.lock().iter().filter(|(k, _)| peers.contains(k)).map(|(_, e)| e.clone()).collect() };
        for ep in &eps {
            ep.unqueue(batch);
        }
        for ep in eps {
            if ep.carries(batch) {
                let err =
                    Error::new(ErrorKind::ConnectionReset, "endpoint reset to end a batch").with("peer", &ep.name);
                ep.destroy(err).await;
            }
        }
    }

    fn batch(&self, id: BatchId) -> Result<Arc<Batch>> {
        self.batches
            .lock()
            .get(&id)
            .cloned()
            .ok_or_else(|| Error::new(ErrorKind::InvalidHandle, "unknown or released batch").with("batch", id))
    }
}

fn descriptor(name: &str, addr: SocketAddr, generation: u64, regions: &[WireRegion]) -> SegmentDescriptor {
    SegmentDescriptor {
        name: name.to_owned(),
        backend: "tcp".into(),
        generation,
        address: addr.to_string(),
        regions: regions
            .iter()
            .map(|r| RegionInfo {
                addr: r.addr,
                len: r.len,
                access: Access { remote_read: r.read, remote_write: r.write },
                key: 0,
            })
            .collect(),
    }
}

fn invalid(kind: ErrorKind, msg: &str, i: usize) -> Error {
    Error::new(kind, msg).with("request", i)
}

#[async_trait]
impl Transport for TcpTransport {
    fn backend(&self) -> &str {
        "tcp"
    }

    fn capabilities(&self) -> Capabilities {
        let mut c = Capabilities::new(self.inner.cfg.max_endpoints);
        c.max_batch_len = MAX_BATCH;
        c.max_request_len = MAX_REQUEST;
        c.lanes_per_endpoint = self.inner.cfg.lanes;
        c
    }

    fn local_segment_name(&self) -> String {
        self.inner.local_name.clone()
    }

    fn register(&self, mem: MemoryRegion, access: Access) -> Result<RegionId> {
        self.inner.check_open()?;
        let id = RegionId(self.inner.handle());
        self.inner.regions.insert(id, mem, access)?;
        Ok(id)
    }

    async fn unregister(&self, region: RegionId) -> Result<()> {
        let i = &self.inner;
        let r = i.regions.remove(region).ok_or_else(|| {
            Error::new(ErrorKind::InvalidHandle, "unknown or unregistered region").with("region", region)
        })?;
        // Peers' copies into or out of it stop here (the gate waits for a
        // running one); then local requests using it are ended and quieted.
        r.kill();
        let batches: Vec<Arc<Batch>> = i.batches.lock().values().cloned().collect();
        for b in batches {
            if b.is_terminal() || !b.reqs.iter().any(|q| q.local == region) {
                continue;
            }
            let err =
                Error::new(ErrorKind::Unregistered, "the local region was unregistered with the request in flight")
                    .with("region", region);
            i.end_requests(&b, EndReason::Failed(err), |_, q| q.local == region).await;
        }
        Ok(())
    }

    async fn open_segment(&self, name: &str) -> Result<SegmentId> {
        let i = &self.inner;
        i.check_open()?;
        let addr = resolve(name)?;
        // The descriptor comes from the peer itself, over the endpoint's
        // first lane (the endpoint is built here and cached).
        let ep = i.endpoint(name, addr).await?;
        let desc = i.descriptor(name, &ep);
        let id = SegmentId(i.handle());
        i.check_open()?;
        i.segments.lock().insert(id, SegmentEntry { name: name.to_owned(), addr, desc });
        Ok(id)
    }

    async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        let i = &self.inner;
        let entry = i.segments.lock().remove(&segment).ok_or_else(|| {
            Error::new(ErrorKind::InvalidHandle, "unknown or closed segment").with("segment", segment)
        })?;
        let batches: Vec<Arc<Batch>> = i.batches.lock().values().cloned().collect();
        for b in batches {
            if !b.is_terminal() && b.reqs.iter().any(|q| q.segment == segment) {
                i.end_requests(&b, EndReason::Cancelled, |_, q| q.segment == segment).await;
            }
        }
        let shared = i.segments.lock().values().any(|s| s.name == entry.name);
        if !shared {
            let ep = i.cache.map.lock().get(&entry.name).cloned();
            if let Some(ep) = ep {
                ep.destroy(Error::new(ErrorKind::Cancelled, "segment closed")).await;
            }
        }
        Ok(())
    }

    fn segment_descriptor(&self, segment: SegmentId) -> Result<SegmentDescriptor> {
        self.inner
            .segments
            .lock()
            .get(&segment)
            .map(|s| s.desc.clone())
            .ok_or_else(|| Error::new(ErrorKind::InvalidHandle, "unknown or closed segment").with("segment", segment))
    }

    async fn submit(&self, requests: Vec<TransferRequest>, opts: SubmitOptions) -> Result<BatchId> {
        let i = &self.inner;
        i.check_open()?;
        if requests.is_empty() || requests.len() > MAX_BATCH {
            return Err(Error::new(ErrorKind::InvalidRequest, format!("a batch holds 1..={MAX_BATCH} requests")));
        }
        let slice = i.cfg.slice_size as u64;
        let mut locals = Vec::with_capacity(requests.len());
        let mut slices = Vec::with_capacity(requests.len());
        let mut targets: Vec<(SegmentId, String, SocketAddr, Vec<u32>)> = Vec::new();
        {
            let segs = i.segments.lock();
            let mut cached: Option<Arc<crate::regions::Region>> = None;
            for (k, r) in requests.iter().enumerate() {
                if r.len == 0 {
                    return Err(invalid(ErrorKind::InvalidRequest, "zero-length request", k));
                }
                if r.len > MAX_REQUEST {
                    return Err(invalid(ErrorKind::InvalidRequest, "request longer than max_request_len", k));
                }
                let region = match &cached {
                    Some(c) if c.id == r.local => c.clone(),
                    _ => {
                        let c = i.regions.get(r.local).ok_or_else(|| {
                            invalid(ErrorKind::InvalidHandle, "unknown or unregistered local region", k)
                        })?;
                        cached = Some(c.clone());
                        c
                    }
                };
                region.mem.check(r.local_offset, r.len).map_err(|e| Error::from(e).with("request", k))?;
                if r.remote_addr.checked_add(r.len).is_none() {
                    return Err(invalid(ErrorKind::OutOfBounds, "remote address + length overflows", k));
                }
                let seg = segs
                    .get(&r.segment)
                    .ok_or_else(|| invalid(ErrorKind::InvalidHandle, "unknown or closed segment", k))?;
                match targets.iter_mut().find(|t| t.0 == r.segment) {
                    Some(t) => t.3.push(k as u32),
                    None => targets.push((r.segment, seg.name.clone(), seg.addr, vec![k as u32])),
                }
                locals.push(region);
                slices.push(r.len.div_ceil(slice) as u32);
            }
        }
        let id = BatchId(i.handle());
        let batch = Batch::new(id, requests, locals, slices, i.counters.inflight.clone());
        *batch.peers.lock() = targets.iter().map(|t| t.1.clone()).collect();
        i.batches.lock().insert(id, batch.clone());
        if let Some(t) = opts.timeout {
            let (weak, b) = (Arc::downgrade(&self.inner), batch.clone());
            let h = spawn_counted(&i.counters, async move {
                tokio::time::sleep(t).await;
                if let Some(inner) = weak.upgrade() {
                    inner.end_requests(&b, EndReason::TimedOut, |_, _| true).await;
                }
            });
            *batch.deadline.lock() = Some(h);
        }
        for (seg, name, addr, idx) in targets {
            let ep = match i.endpoint(&name, addr).await {
                Ok(ep) => ep,
                Err(e) => {
                    for k in idx {
                        batch.fail_unsent(k as usize, e.clone());
                    }
                    continue;
                }
            };
            // A new generation means the peer restarted: requests naming
            // its old memory fail (transient) and the handle's descriptor is
            // refreshed; the stale one is never used again.
            let stale = {
                let mut segs = i.segments.lock();
                match segs.get_mut(&seg) {
                    None => Some(Error::new(ErrorKind::Cancelled, "segment closed during submit")),
                    Some(s) if s.desc.generation != ep.generation => {
                        let old = s.desc.generation;
                        s.desc = i.descriptor(&name, &ep);
                        Some(
                            Error::new(ErrorKind::PeerRestarted, "the peer restarted; its descriptor was refreshed")
                                .with("peer", &name)
                                .with("old_generation", old)
                                .with("generation", ep.generation),
                        )
                    }
                    Some(_) => None,
                }
            };
            if let Some(e) = stale {
                for k in idx {
                    batch.fail_unsent(k as usize, e.clone());
                }
                continue;
            }
            let generation = ep.generation;
            ep.enqueue(Work::new(batch.clone(), idx, generation));
        }
        Ok(id)
    }

    fn poll(&self, batch: BatchId) -> Result<BatchStatus> {
        Ok(self.inner.batch(batch)?.status())
    }

    async fn wait(&self, batch: BatchId) -> Result<BatchStatus> {
        let b = self.inner.batch(batch)?;
        b.wait_terminal().await;
        Ok(b.status())
    }

    async fn cancel(&self, batch: BatchId) -> Result<BatchStatus> {
        let b = self.inner.batch(batch)?;
        if !b.is_terminal() {
            self.inner.end_requests(&b, EndReason::Cancelled, |_, _| true).await;
            b.wait_terminal().await;
        }
        Ok(b.status())
    }

    fn release(&self, batch: BatchId) -> Result<()> {
        let mut m = self.inner.batches.lock();
        let b = m
            .get(&batch)
            .ok_or_else(|| Error::new(ErrorKind::InvalidHandle, "unknown or released batch").with("batch", batch))?;
        if !b.is_terminal() {
            return Err(
                Error::new(ErrorKind::InvalidRequest, "the batch is in progress; cancel it first").with("batch", batch)
            );
        }
        m.remove(&batch);
        Ok(())
    }

    fn stats(&self) -> ResourceStats {
        let i = &self.inner;
        ResourceStats {
            endpoints: i.cache.map.lock().len(),
            endpoint_lanes: i.counters.lanes.load(Ordering::Relaxed),
            segments: i.segments.lock().len(),
            regions: i.regions.len(),
            batches: i.batches.lock().len(),
            inflight: i.counters.inflight.load(Ordering::Relaxed),
            tasks: i.counters.tasks.load(Ordering::Relaxed),
        }
    }

    async fn shutdown(&self) -> Result<()> {
        let i = &self.inner;
        if i.shut.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let _b = i.build.lock().await;
        let batches: Vec<Arc<Batch>> = i.batches.lock().values().cloned().collect();
        for b in &batches {
            if !b.is_terminal() {
                i.end_requests(b, EndReason::Cancelled, |_, _| true).await;
            }
        }
        let eps: Vec<Arc<Endpoint>> = i.cache.map.lock().values().cloned().collect();
        for ep in eps {
            ep.destroy(shut_err()).await;
        }
        let bg: Vec<JoinHandle<()>> = i.background.lock().drain(..).collect();
        for h in &bg {
            h.abort();
        }
        for h in bg {
            let _ = h.await;
        }
        i.server.close_all().await;
        for id in i.regions.ids() {
            if let Some(r) = i.regions.remove(id) {
                r.kill();
            }
        }
        i.segments.lock().clear();
        let left: Vec<Arc<Batch>> = i.batches.lock().drain().map(|(_, b)| b).collect();
        for b in left {
            if let Some(h) = b.deadline.lock().take() {
                h.abort();
            }
        }
        // Endpoint destroyers spawned by lane tasks finish on their own;
        // wait (bounded) until every counted task is gone.
        let end = tokio::time::Instant::now() + Duration::from_secs(5);
        while i.counters.tasks.load(Ordering::Relaxed) > 0 && tokio::time::Instant::now() < end {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        Ok(())
    }
}
