//! `TcpTransport`: the `Transport` implementation tying the pieces
//! together (regions, segments, endpoints, batches, server, reaper).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use transport_core::lifecycle::{validate_batch, BatchLimits, BatchTable, EndReason, TaskSet};
use transport_core::{
    check_notification, check_received, Access, BatchId, BatchStatus, Capabilities, Error, ErrorKind, Inbox,
    Notification, RegionId, ResourceStats, Result, SegmentDescriptor, SegmentId, SubmitOptions, TransferRequest,
    Transport,
};
use transport_mem::MemoryRegion;

use crate::batch::Batch;
use crate::config::TcpConfig;
use crate::driver::{descriptor, reaper, resolve, AbandonedSubmit, Inner, SegmentEntry};
use crate::endpoint::{EndpointSlots, Env, Note, Work};
use crate::proto;
use crate::regions::RegionTable;
use crate::server::Server;
use crate::staging::Staging;

/// Largest batch accepted.
const MAX_BATCH: usize = 1 << 20;
/// Largest single request.
const MAX_REQUEST: u64 = 1 << 40;
/// How long `notify` waits for the peer's answer once it has an endpoint
/// (building one is bounded by `connect_timeout`, as for transfers): the
/// NOTIFY may wait behind up to `window` slices on its lane. Past this the
/// call fails with a transient `Timeout` (the message may or may not have
/// been delivered).
pub const NOTIFY_TIMEOUT: Duration = Duration::from_secs(30);

/// The TCP backend. Cheap to share behind an `Arc<dyn Transport>`;
/// dropping the last handle stops every task it started.
#[derive(Debug)]
pub struct TcpTransport {
    inner: Arc<Inner>,
    bound: SocketAddr,
}

impl TcpTransport {
    /// Binds the listener and starts serving. Must be called inside a
    /// tokio runtime. The segment name is the bound `host:port`.
    pub async fn new(mut cfg: TcpConfig) -> Result<Self> {
        cfg.validate()?;
        cfg.secret =
            transport_control::access::resolve_secret(cfg.secret.as_deref())?.map(transport_control::Secret::from);
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
        let bound = listener.local_addr()?;
        let cfg = Arc::new(cfg);
        let tasks = TaskSet::new();
        let direct = if cfg.direct_writes { transport_mem::window::DIRECT_WRITE } else { 0 }
            | if cfg.direct_reads { transport_mem::window::DIRECT_READ } else { 0 };
        let regions = Arc::new(RegionTable::new(direct));
        let generation = transport_core::fresh_generation();
        let inbox = Arc::new(Inbox::new(cfg.inbox_capacity));
        let staging = Arc::new(Staging::new(cfg.staging_buffers));
        let server =
            Server::new(cfg.clone(), regions.clone(), generation, tasks.clone(), inbox.clone(), staging.clone());
        let inner = Arc::new(Inner {
            cfg: cfg.clone(),
            local_name: cfg.advertise.clone().unwrap_or_else(|| bound.to_string()),
            generation,
            env: Env::new(cfg.clone(), tasks.clone(), staging),
            regions,
            server: server.clone(),
            inbox,
            slots: EndpointSlots::new(cfg.max_endpoints),
            segments: Mutex::new(Default::default()),
            batches: Mutex::new(BatchTable::new()),
            deadlines: Arc::default(),
            background: Mutex::new(Vec::new()),
            next_handle: AtomicU64::new(1),
            shut: AtomicBool::new(false),
        });
        let accept = tasks.spawn(server.accept_loop(listener));
        let reaper = tasks.spawn(reaper(Arc::downgrade(&inner)));
        let timer = tasks.spawn(crate::driver::timer(Arc::downgrade(&inner)));
        inner.background.lock().extend([accept, reaper, timer]);
        tracing::info!(listen = %bound, generation, "tcp transport serving");
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

    /// Bytes of this transport's own requests (writes it sent, reads it
    /// made) that moved by same-host copies instead of through its sockets
    /// (see [`TcpConfig::same_host`]). Which peers' lanes agreed to them is
    /// logged when each endpoint connects and counted in the metric
    /// `kvmove_tcp_lanes_total{path="same_host"|"socket"}`.
    pub fn same_host_bytes(&self) -> u64 {
        self.inner.env.same_host_bytes.load(Ordering::Relaxed)
    }

    /// Of [`TcpTransport::same_host_bytes`], the bytes this transport's
    /// requests wrote straight into peers' memory (see
    /// [`TcpConfig::direct_writes`]).
    pub fn direct_write_bytes(&self) -> u64 {
        self.inner.env.direct_bytes.load(Ordering::Relaxed)
    }

    /// Of [`TcpTransport::same_host_bytes`], the bytes this transport's
    /// requests read straight out of peers' memory (see
    /// [`TcpConfig::direct_reads`]).
    pub fn direct_read_bytes(&self) -> u64 {
        self.inner.env.direct_read_bytes.load(Ordering::Relaxed)
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        let i = &self.inner;
        i.shut.store(true, Ordering::Release);
        i.inbox.close();
        for h in i.background.lock().drain(..) {
            h.abort();
        }
        i.server.abort_all();
        // Same-host peers find their windows retired from now on. A direct
        // write that saw one alive is over within microseconds: waited for
        // here (bounded, a drop cannot wait on another process for long).
        // If a peer is frozen inside one, the memory it may still write is
        // never freed (its regions are leaked) rather than reused.
        i.regions.retire_windows();
        let until = std::time::Instant::now() + Duration::from_secs(1);
        while !i.regions.windows_quiet() {
            if std::time::Instant::now() >= until {
                let kept = i.regions.directly_writable();
                tracing::error!(
                    regions = kept.len(),
                    "transport dropped while a same-host peer is stopped inside a direct write: its regions are \
                     kept (leaked) so the write cannot land in freed memory; memory it does not own (registered \
                     from a raw address) must not be freed while that peer lives (call shutdown, which waits)"
                );
                std::mem::forget(kept);
                break;
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        if tokio::runtime::Handle::try_current().is_ok() {
            for ep in i.slots.retire_all() {
                ep.begin_destroy(Error::new(ErrorKind::Shutdown, "transport dropped"));
            }
        }
        for (_, b) in i.batches.lock().drain() {
            b.forget_deadline();
        }
    }
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
        // Device regions are read and written through their provider.
        c.device_memory = true;
        c.device_memory_remote = true;
        c
    }

    fn local_segment_name(&self) -> String {
        self.inner.local_name.clone()
    }

    fn local_descriptor(&self) -> Result<SegmentDescriptor> {
        let i = &self.inner;
        i.check_open()?;
        // The address a peer would resolve the name to; no lookup here (an
        // advertised host name is given as the bound address).
        let addr = i.local_name.parse::<SocketAddr>().unwrap_or(self.bound);
        Ok(descriptor(&i.local_name, addr, i.generation, &i.regions.exposed()))
    }

    fn register(&self, mem: MemoryRegion, access: Access) -> Result<RegionId> {
        self.inner.check_open()?;
        let id = RegionId(self.inner.handle());
        // A device region needs the staging buffers (the first maps them).
        let provider = mem.provider().cloned();
        if let Some(p) = &provider {
            self.inner.env.staging.device_added(p)?;
        }
        if let Err(e) = self.inner.regions.insert(id, mem, access) {
            if provider.is_some() {
                self.inner.env.staging.device_removed();
            }
            return Err(e);
        }
        Ok(id)
    }

    async fn unregister(&self, region: RegionId) -> Result<()> {
        let i = &self.inner;
        let r = i.regions.remove(region).ok_or_else(|| Error::unknown_region(region))?;
        // Peers' copies into or out of it stop here (the gate waits for a
        // running one); so do same-host peers' direct writes (its range is
        // closed in their windows, and a write that saw it open is waited
        // for); then local requests using it are ended and quieted.
        r.kill();
        if r.mem.provider().is_some() {
            i.env.staging.device_removed();
        }
        i.regions.close_direct(&r).await;
        for b in i.running() {
            if b.reqs.iter().any(|q| q.local == region) {
                let reason = EndReason::Failed(Error::region_unregistered(region));
                i.end_requests(&b, reason, |q| q.local == region).await;
            }
        }
        Ok(())
    }

    async fn open_segment(&self, name: &str) -> Result<SegmentId> {
        let i = &self.inner;
        i.check_open()?;
        let addr = resolve(name)?;
        // The descriptor comes from the peer itself, over the endpoint's
        // first lane (the endpoint is built here and cached).
        let (ep, using) = i.endpoint(name, addr).await?;
        let desc = descriptor(name, ep.addr, ep.generation, &ep.regions);
        drop(using);
        let id = SegmentId(i.handle());
        i.check_open()?;
        i.segments.lock().insert(id, SegmentEntry { name: name.to_owned(), addr, desc });
        Ok(id)
    }

    async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        let i = &self.inner;
        let entry = i.segments.lock().remove(&segment).ok_or_else(|| Error::unknown_segment(segment))?;
        for b in i.running() {
            if b.reqs.iter().any(|q| q.segment == segment) {
                i.end_requests(&b, EndReason::Cancelled, |q| q.segment == segment).await;
            }
        }
        let shared = i.segments.lock().values().any(|s| s.name == entry.name);
        if !shared {
            i.retire_peer(&entry.name, Error::new(ErrorKind::Cancelled, "segment closed")).await;
        }
        Ok(())
    }

    fn segment_descriptor(&self, segment: SegmentId) -> Result<SegmentDescriptor> {
        let segs = self.inner.segments.lock();
        segs.get(&segment).map(|s| s.desc.clone()).ok_or_else(|| Error::unknown_segment(segment))
    }

    async fn submit(&self, requests: Vec<TransferRequest>, opts: SubmitOptions) -> Result<BatchId> {
        let i = &self.inner;
        i.check_open()?;
        let limits = BatchLimits::from(&self.capabilities());
        let slice = i.cfg.slice_size as u64;
        let mut targets: Vec<(SegmentId, String, SocketAddr, Vec<u32>)> = Vec::new();
        let locals = {
            let segs = i.segments.lock();
            let local = |id| i.regions.get(id).map(|r| (r.clone(), r.mem.len() as u64));
            let locals = validate_batch(&requests, limits, local, |s| segs.contains_key(&s))?;
            for (k, r) in requests.iter().enumerate() {
                let seg = segs.get(&r.segment).ok_or_else(|| Error::unknown_segment(r.segment).with("request", k))?;
                // At most MAX_BATCH (2^20) requests: the index fits.
                let k = u32::try_from(k).map_err(|_| Error::new(ErrorKind::InvalidRequest, "batch too long"))?;
                match targets.iter_mut().find(|t| t.0 == r.segment) {
                    Some(t) => t.3.push(k),
                    None => targets.push((r.segment, seg.name.clone(), seg.addr, vec![k])),
                }
            }
            locals
        };
        let slices: Vec<u64> = requests.iter().map(|r| r.len.div_ceil(slice)).collect();
        let deadline = opts.timeout.and_then(|t| i.slots.now().checked_add(t));
        let peers = targets.iter().map(|t| t.1.clone()).collect();
        let batch = Batch::new(requests, locals, slices, deadline, peers);
        let id = i.batches.lock().insert(batch.clone());
        let abandoned = AbandonedSubmit::new(Arc::downgrade(&self.inner), id, batch.clone());
        if let Some(at) = deadline {
            batch.set_deadline(&i.deadlines, at);
        }
        for (seg, name, addr, idx) in targets {
            let (ep, using) = match i.endpoint(&name, addr).await {
                Ok(x) => x,
                Err(e) => {
                    for k in idx {
                        batch.fail(k as usize, e.clone());
                    }
                    continue;
                }
            };
            // A new generation means the peer restarted: requests naming
            // its old memory fail (transient) and the handle's descriptor is
            // refreshed; the stale one is never used again.
            if let Err(e) = i.check_generation(seg, &name, &ep) {
                for k in idx {
                    batch.fail(k as usize, e.clone());
                }
                continue;
            }
            let generation = ep.generation;
            batch.carried_by(Arc::downgrade(&ep) as std::sync::Weak<dyn crate::batch::Carrier>);
            // Few small slices go out from here at once; the rest is queued
            // for the lanes' writers.
            let work = Work::new(batch.clone(), idx, generation, using);
            let work = if opts.round_trip { Some(work) } else { crate::lane::copy_direct(&ep, work) };
            if let Some(work) = work.and_then(|w| crate::lane::send_now(&ep, w)) {
                ep.enqueue(work);
            }
        }
        abandoned.disarm();
        Ok(id)
    }

    fn poll(&self, batch: BatchId) -> Result<BatchStatus> {
        let b = self.inner.batch(batch)?;
        // The answers that have arrived are applied on the caller's thread
        // (never waiting), so a caller spinning on `poll` sees a small
        // transfer complete without a hand-off from a runtime thread.
        // Outside the runtime (where a broken lane could not start its
        // teardown) the lanes' reader tasks do it all.
        if tokio::runtime::Handle::try_current().is_ok() {
            b.progress();
        }
        Ok(b.status())
    }

    fn polling(&self, batch: BatchId, on: bool) {
        // The lanes carrying the batch stop waking the reactor while a
        // caller polls them (`crate::hush`).
        if let Ok(b) = self.inner.batch(batch) {
            b.polling(on);
        }
    }

    async fn wait(&self, batch: BatchId) -> Result<BatchStatus> {
        let b = self.inner.batch(batch)?;
        b.wait_terminal().await;
        Ok(b.status())
    }

    async fn cancel(&self, batch: BatchId) -> Result<BatchStatus> {
        let b = self.inner.batch(batch)?;
        if !b.is_terminal() {
            self.inner.end_requests(&b, EndReason::Cancelled, |_| true).await;
            b.wait_terminal().await;
        }
        Ok(b.status())
    }

    fn release(&self, batch: BatchId) -> Result<()> {
        let b = self.inner.batches.lock().release(batch, |b| b.is_terminal())?;
        b.polling_ends();
        Ok(())
    }

    fn stats(&self) -> ResourceStats {
        let i = &self.inner;
        let (batches, inflight) = {
            let t = i.batches.lock();
            (t.len(), t.iter().map(|(_, b)| b.on_wire()).sum::<u64>())
        };
        ResourceStats {
            endpoints: i.slots.counts().held(),
            endpoint_lanes: i.env.lanes.load(Ordering::Relaxed),
            segments: i.segments.lock().len(),
            regions: i.regions.len(),
            batches,
            inflight: usize::try_from(inflight).unwrap_or(usize::MAX),
            tasks: i.env.tasks.count(),
            notifications: i.inbox.len(),
            // Mapped while a device region is registered (and until every
            // buffer on loan is back).
            staging_bytes: i.env.staging.bytes() as u64,
        }
    }

    /// Rule 11: a NOTIFY (this transport's segment name and `msg`) on one
    /// lane of the peer's endpoint, acquired as a transfer does; returns
    /// once the peer answered that the message is in its inbox, so calls
    /// that returned arrive in order. `Busy` (a full inbox) is a transient
    /// `Backpressure`; a lost connection a transient error as for writes;
    /// no answer within [`NOTIFY_TIMEOUT`] a transient `Timeout`.
    async fn notify(&self, segment: SegmentId, msg: Vec<u8>) -> Result<()> {
        let i = &self.inner;
        i.check_open()?;
        check_notification(&msg)?;
        check_received(&i.local_name, &msg).map_err(|e| e.with("from", &i.local_name))?;
        let payload = proto::encode_notify(&i.local_name, &msg)
            .ok_or_else(|| Error::new(ErrorKind::InvalidRequest, "notification too large"))?;
        let (name, addr) = {
            let segs = i.segments.lock();
            let s = segs.get(&segment).ok_or_else(|| Error::unknown_segment(segment))?;
            (s.name.clone(), s.addr)
        };
        let (ep, using) = i.endpoint(&name, addr).await?;
        i.check_generation(segment, &name, &ep)?;
        let (reply, answer) = oneshot::channel();
        ep.enqueue_note(Note { payload, generation: ep.generation, reply, using });
        drop(ep);
        match tokio::time::timeout(NOTIFY_TIMEOUT, answer).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => {
                Err(Error::new(ErrorKind::ConnectionReset, "the endpoint went away before the peer answered")
                    .with("peer", &name))
            }
            Err(_) => Err(Error::new(ErrorKind::Timeout, "no answer to the notification in time")
                .with("peer", &name)
                .with("timeout_ms", NOTIFY_TIMEOUT.as_millis())),
        }
    }

    fn take_notifications(&self, max: usize) -> Result<Vec<Notification>> {
        self.inner.check_open()?;
        Ok(self.inner.inbox.take(max))
    }

    async fn wait_notification(&self) -> Result<()> {
        self.inner.check_open()?;
        self.inner.inbox.wait().await
    }

    async fn shutdown(&self) -> Result<()> {
        let i = &self.inner;
        if i.shut.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        // Waiters wake with `Shutdown`; notifications arriving from now on
        // are refused (their connections closed unanswered).
        i.inbox.close();
        for b in i.running() {
            i.end_requests(&b, EndReason::Cancelled, |_| true).await;
        }
        for ep in i.slots.retire_all() {
            ep.destroy(Error::shut_down()).await;
        }
        let bg: Vec<JoinHandle<()>> = i.background.lock().drain(..).collect();
        for h in &bg {
            h.abort();
        }
        for h in bg {
            let _ = h.await;
        }
        i.server.close_all().await;
        // Device copies of aborted connections run on: waited for.
        i.env.staging.quiet().await;
        // No same-host peer writes directly into this process any more.
        i.regions.retire_windows();
        i.regions.quiet_windows().await;
        for id in i.regions.ids() {
            if let Some(r) = i.regions.remove(id) {
                r.kill();
            }
        }
        i.env.staging.close();
        i.segments.lock().clear();
        for (_, b) in i.batches.lock().drain() {
            b.forget_deadline();
        }
        // Endpoint destroyers and builds that raced the shutdown finish on
        // their own; wait (bounded) until every task and slot is gone.
        let end = tokio::time::Instant::now() + Duration::from_secs(5);
        while (i.env.tasks.count() > 0 || i.slots.counts().held() > 0) && tokio::time::Instant::now() < end {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        Ok(())
    }
}
