//! [`RdmaTransport`]: the [`Transport`] implementation over verbs: the
//! constructor and the trait's methods, each a short driver call into the
//! state (`state.rs`, `work.rs`), the endpoints (`endpoint.rs`) and
//! `submit.rs`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use transport_core::lifecycle::{EndReason, TaskSet};
use transport_core::{
    Access, BatchId, BatchStatus, Capabilities, Error, ErrorKind, Inbox, MemoryRegion, Notification, RegionId,
    ResourceStats, Result, SegmentDescriptor, SegmentId, SubmitOptions, TransferRequest, Transport,
};

use crate::background::{self, Drain};
use crate::config::RdmaConfig;
use crate::handshake;
use crate::staging::{self, MemPath, Staging};
use crate::state::{Inner, Limits, LocalRegion, Segment, State, Verbs};
use crate::verbs::{CompChannel, Context, Cq, Pd, Registration, POLL_BATCH};
use crate::wire;

/// The CQ holds a completion for every work request that can be posted
/// (`max_endpoints x qps_per_endpoint x max_outstanding_per_qp`), within
/// these bounds and the device's own limit.
const MIN_CQE: usize = 256;
const MAX_CQE: usize = 1 << 20;
/// How long `wait` sleeps on the batch's notification before it looks
/// again: a safety bound only, as the sleep is registered under the lock
/// that every wake is sent under.
const WAIT_NAP: Duration = Duration::from_millis(2);
/// Empty CQ polls a busy-polling `wait` makes between two looks at the
/// clock (and turns given to the runtime).
const SPINS_PER_TURN: u32 = 8;
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

impl RdmaTransport {
    /// Opens the configured device, allocates the PD and CQ, binds the side
    /// channel and starts the background tasks. Must be called inside a
    /// tokio runtime.
    ///
    /// Errors: `Config` when there is no RDMA device (`no RDMA device
    /// found`), the named device does not exist, the GID index is empty, or
    /// `devices` is set (that is [`crate::open_devices`]'s);
    /// `ConnectionReset` when the port is down; the failing verb otherwise.
    pub async fn new(mut cfg: RdmaConfig) -> Result<Self> {
        cfg.validate()?;
        cfg.secret =
            transport_control::access::resolve_secret(cfg.secret.as_deref())?.map(transport_control::Secret::from);
        let exposure = transport_control::access::Exposure::of(cfg.secret.as_deref(), cfg.insecure);
        if !cfg.devices.is_empty() {
            return Err(Error::new(
                ErrorKind::Config,
                "rdma.devices is for transport_rdma::open_devices (rails); one RdmaTransport drives the one `device`",
            ));
        }
        let ctx = Context::open(cfg.device.as_deref())?;
        let port = ctx.port_info(cfg.port, cfg.gid_index)?;
        ctx.async_events_nonblocking()?;
        let pd = Pd::new(&ctx)?;
        let chan = CompChannel::new(&ctx)?;
        let per_qp = cfg.max_outstanding_per_qp.min(port.max_qp_wr as usize);
        let want_cqe = cfg
            .max_endpoints
            .saturating_mul(cfg.qps_per_endpoint)
            .saturating_mul(per_qp)
            .clamp(MIN_CQE, MAX_CQE)
            .min(port.max_cqe as usize);
        let cq = Cq::new(&ctx, &chan, u32::try_from(want_cqe).unwrap_or(u32::MAX))?;
        let listener = TcpListener::bind(&cfg.listen).await.map_err(|e| Error::from(e).with("listen", &cfg.listen))?;
        let name = listener.local_addr()?.to_string();
        let generation = transport_core::fresh_generation();
        let device = ctx.name().to_string();
        let address = format!("{device}/{}/gid={}", port.port, wire::gid_hex(&port.gid));
        let lim = Limits {
            max_outstanding_per_qp: per_qp.max(1),
            flush_timeout: cfg.flush_timeout(),
            idle_timeout: cfg.idle_timeout(),
        };
        let verbs = Arc::new(Verbs { cq, chan, pd, ctx: ctx.clone(), port });
        let state = State::new(verbs.clone(), cfg.max_endpoints, transport_core::Epoch::start());
        let inbox = Inbox::new(cfg.inbox_capacity);
        let inner = Arc::new_cyclic(|me| Inner {
            me: me.clone(),
            burying: std::sync::atomic::AtomicUsize::new(0),
            admission: Arc::default(),
            exposure,
            refusing: std::sync::atomic::AtomicUsize::new(0),
            cfg,
            lim,
            name,
            generation,
            address: Mutex::new(address.clone()),
            base_address: address,
            device,
            state: Mutex::new(state),
            tasks: TaskSet::new(),
            fixed: Mutex::new(Vec::new()),
            earlier_deadline: Arc::default(),
            cq_lock: Mutex::new(Vec::with_capacity(POLL_BATCH)),
            events_stop: Arc::new(AtomicBool::new(false)),
            events_thread: Mutex::new(None),
            inbox,
        });
        let weak = Arc::downgrade(&inner);
        // Async events are read (and acknowledged at once) on a thread of
        // their own: `ibv_destroy_qp` waits until every event reported for
        // the QP was acknowledged, so the reader must never wait behind a
        // destroy running on a runtime worker.
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let stop = inner.events_stop.clone();
        let counted = inner.tasks.guard();
        let thread = std::thread::Builder::new()
            .name("kvmove-rdma-events".into())
            .spawn(move || {
                let _counted = counted;
                background::read_async_events(&ctx, &stop, &tx);
            })
            .map_err(|e| {
                Error::new(ErrorKind::ResourceExhausted, format!("cannot start the async-event thread: {e}"))
            })?;
        *inner.events_thread.lock() = Some(thread);
        let t = &inner.tasks;
        let fixed = [
            t.spawn(background::poller(weak.clone(), verbs.cq.clone(), verbs.chan.clone())),
            t.spawn(background::reaper(weak.clone())),
            t.spawn(background::on_async_events(weak.clone(), rx)),
            t.spawn(crate::submit::timer(weak.clone())),
            t.spawn(crate::server::listen(weak, listener)),
        ];
        inner.fixed.lock().extend(fixed);
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
        // event thread ends within `EVENT_POLL` and then lets the context go.
        self.inner.events_stop.store(true, Ordering::Relaxed);
        for t in self.inner.fixed.lock().drain(..) {
            t.abort();
        }
        let mut st = self.inner.state.lock();
        st.passive_tasks.clear(); // aborts them
        st.drivers.clear(); // aborts them (each holds the state alive)
        st.deadlines = transport_core::lifecycle::DeadlineQueue::new();
    }
}

#[async_trait]
impl Transport for RdmaTransport {
    fn backend(&self) -> &str {
        crate::BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        let mut c = Capabilities::new(self.inner.cfg.max_endpoints);
        c.max_batch_len = self.inner.cfg.max_batch_len;
        c.max_request_len = self.inner.cfg.max_request_len;
        c.lanes_per_endpoint = self.inner.cfg.qps_per_endpoint;
        // GPUDirect where registration finds it, else staged through host
        // buffers on both sides (crate::staging).
        c.device_memory = true;
        c.device_memory_remote = true;
        c
    }

    fn local_segment_name(&self) -> String {
        self.inner.name.clone()
    }

    fn local_descriptor(&self) -> Result<SegmentDescriptor> {
        let st = self.inner.state.lock();
        if st.shutdown {
            return Err(Error::shut_down());
        }
        let address = self.inner.address.lock().clone();
        Ok(st.descriptor(&self.inner.name, self.inner.generation, &address))
    }

    /// Peers that open this transport see `extra` after the device, port
    /// and GID in the descriptor's address (`Rails` lists its rails there).
    fn advertise(&self, extra: &str) -> Result<()> {
        if self.inner.state.lock().shutdown {
            return Err(Error::shut_down());
        }
        *self.inner.address.lock() = format!("{} {extra}", self.inner.base_address);
        Ok(())
    }

    fn register(&self, mem: MemoryRegion, access: Access) -> Result<RegionId> {
        let mut st = self.inner.state.lock();
        if st.shutdown {
            return Err(Error::shut_down());
        }
        if let Some((id, _)) = st.regions.iter().find(|(_, r)| r.mem.overlaps(&mem)) {
            return Err(Error::new(ErrorKind::AlreadyRegistered, format!("memory overlaps {id}")));
        }
        let pd = st.verbs.as_ref().map(|v| v.pd.clone()).ok_or_else(Error::shut_down)?;
        // Device memory: GPUDirect where the NIC can reach it, else staged
        // (docs/CONTRACT.md, memory kinds; refused here, never at the
        // first transfer).
        let (reg, path) = if mem.kind().is_device() {
            let (reg, path) = staging::register_device(&pd, &mem, access)?;
            if path == MemPath::Staged {
                self.inner.ensure_staging(&mut st, &pd, &mem, access.is_remote())?;
            }
            (reg, path)
        } else {
            (Some(Registration::new(&pd, mem.clone(), access.remote_read, access.remote_write)?), MemPath::Host)
        };
        let id = st.new_region_id();
        if path != MemPath::Host {
            tracing::debug!(region = %id, kind = %mem.kind(), path = path.as_str(), "rdma: device memory registered");
            staging::count_path(path);
        }
        st.regions.insert(id, LocalRegion { reg, mem, access, path });
        Ok(id)
    }

    async fn unregister(&self, region: RegionId) -> Result<()> {
        let gone = self.inner.with_state(|st, g| {
            if st.shutdown {
                return Err(Error::shut_down());
            }
            let r = st.regions.remove(&region).ok_or_else(|| Error::unknown_region(region))?;
            let gone = r.mem.clone();
            let why = EndReason::Failed(Error::region_unregistered(region));
            st.end_requests(|_, t| t.spec.local == region, &why, g);
            // Parked in the state, not in this future: the QPs that posted
            // on it hold its MR until they are destroyed, and whoever
            // drops the last of them (or the next prune) lets it go.
            st.retiring.extend(r.reg);
            st.release_staging();
            let ids: Vec<_> = st.endpoints.keys().copied().collect();
            for id in ids {
                st.drop_if_pinning_retired(id, g);
            }
            st.prune_retiring(g);
            Ok(gone)
        })?;
        // Nothing of the region on the wire, and no peer's staged write
        // still being copied into it.
        self.inner.settle(|st| !st.any_on_wire(|t| t.spec.local == region) && !st.staging_into(&gone)).await;
        self.inner.with_state(|st, g| {
            st.release_staging();
            st.prune_retiring(g); // ibv_dereg_mr, then the memory may go
        });
        Ok(())
    }

    async fn open_segment(&self, name: &str) -> Result<SegmentId> {
        if self.inner.state.lock().shutdown {
            return Err(Error::shut_down());
        }
        let (desc, spare) =
            handshake::fetch_descriptor(name, self.inner.cfg.handshake_timeout(), self.inner.cfg.secret.as_deref())
                .await?;
        let mut st = self.inner.state.lock();
        if st.shutdown {
            return Err(Error::shut_down());
        }
        let id = st.new_segment_id();
        st.segments.insert(id, Segment::new(desc));
        st.keep_spare(id, spare);
        Ok(id)
    }

    async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        self.inner.with_state(|st, g| {
            if st.shutdown {
                return Err(Error::shut_down());
            }
            st.segments.remove(&segment).ok_or_else(|| Error::unknown_segment(segment))?;
            st.end_requests(|_, t| t.spec.segment == segment, &EndReason::Cancelled, g);
            // One being built is retired: its builder destroys it.
            st.pool.retire_key(&segment);
            let mine: Vec<_> = st.endpoints.iter().filter(|(_, e)| e.segment == segment).map(|(id, _)| *id).collect();
            for id in mine {
                st.break_endpoint(id, Error::new(ErrorKind::ConnectionReset, "segment closed"), g);
            }
            Ok(())
        })?;
        self.inner
            .settle(|st| {
                !st.endpoints.values().any(|e| e.segment == segment) && !st.any_on_wire(|t| t.spec.segment == segment)
            })
            .await;
        Ok(())
    }

    fn segment_descriptor(&self, segment: SegmentId) -> Result<SegmentDescriptor> {
        let st = self.inner.state.lock();
        st.segments.get(&segment).map(|s| s.desc.clone()).ok_or_else(|| Error::unknown_segment(segment))
    }

    async fn submit(&self, requests: Vec<TransferRequest>, opts: SubmitOptions) -> Result<BatchId> {
        self.inner.submit(requests, opts).await
    }

    fn poll(&self, batch: BatchId) -> Result<BatchStatus> {
        self.inner.state.lock().batches.get(batch).map(|b| b.ledger.status())
    }

    async fn wait(&self, batch: BatchId) -> Result<BatchStatus> {
        // Busy-poll first (bounded by `busy_poll_us`): a small transfer's
        // completion is then seen here, without a wakeup through the
        // completion channel and the poller task. Whatever the CQ already
        // holds is taken before the clock is first read, so a batch whose
        // completion is there costs no clock read and no yield; while
        // spinning, the clock is read and the runtime given a turn once
        // every `SPINS_PER_TURN` empty polls (in a VM without a usable TSC
        // each clock read is a system call).
        let busy = self.inner.cfg.busy_poll();
        let mut spin_until = None;
        let mut empty = 0u32;
        loop {
            {
                let st = self.inner.state.lock();
                let b = st.batches.get(batch)?;
                if b.ledger.is_terminal() {
                    return Ok(b.ledger.status());
                }
            }
            if self.inner.drain_cq(Drain::Chunk) > 0 {
                continue;
            }
            if !busy.is_zero() {
                empty += 1;
                if empty < SPINS_PER_TURN {
                    std::hint::spin_loop();
                    continue;
                }
                empty = 0;
                let until = *spin_until.get_or_insert_with(|| Instant::now() + busy);
                if Instant::now() < until {
                    tokio::task::yield_now().await;
                    continue;
                }
            }
            // Sleep until the batch's progress wakes us (bounded by
            // `WAIT_NAP`). The batch's `Notify` is made only now, so a
            // batch finished while spinning never has one; the wait is
            // registered before the lock is let go, so a wake in between
            // is not missed.
            let notify = {
                let mut st = self.inner.state.lock();
                let b = st.batches.get_mut(batch)?;
                if b.ledger.is_terminal() {
                    return Ok(b.ledger.status());
                }
                b.notify.get_or_insert_with(|| Arc::new(Notify::new())).clone()
            };
            let notified = notify.notified();
            tokio::pin!(notified);
            {
                let st = self.inner.state.lock();
                notified.as_mut().enable();
                if st.batches.get(batch)?.ledger.is_terminal() {
                    continue;
                }
            }
            let _ = tokio::time::timeout(WAIT_NAP, notified).await;
        }
    }

    async fn cancel(&self, batch: BatchId) -> Result<BatchStatus> {
        self.inner.stop_batch(batch, EndReason::Cancelled).await
    }

    fn release(&self, batch: BatchId) -> Result<()> {
        let mut st = self.inner.state.lock();
        let released = st.release_batch(batch)?;
        drop(st);
        drop(released);
        Ok(())
    }

    fn stats(&self) -> ResourceStats {
        let st = self.inner.state.lock();
        ResourceStats {
            endpoints: st.endpoints.len(),
            endpoint_lanes: st.endpoints.values().map(|e| e.qps.len()).sum(),
            segments: st.segments.len(),
            regions: st.regions.len(),
            batches: st.batches.len(),
            inflight: st.wrs.len(),
            tasks: self.inner.tasks.count(),
            notifications: self.inner.inbox.len(),
            staging_bytes: [&st.staging, &st.remote_staging].iter().map(|p| p.as_ref().map_or(0, |s| s.bytes())).sum(),
        }
    }

    /// Rule 11: over the handle's notification channel, answered once the
    /// peer has queued it (see the crate docs; `notify_after` is the
    /// trait's: the message leaves only after the batch completed).
    async fn notify(&self, segment: SegmentId, msg: Vec<u8>) -> Result<()> {
        self.inner.notify(segment, msg).await
    }

    fn take_notifications(&self, max: usize) -> Result<Vec<Notification>> {
        if self.inner.state.lock().shutdown {
            return Err(Error::shut_down());
        }
        Ok(self.inner.inbox.take(max))
    }

    async fn wait_notification(&self) -> Result<()> {
        if self.inner.state.lock().shutdown {
            return Err(Error::shut_down());
        }
        self.inner.inbox.wait().await
    }

    async fn shutdown(&self) -> Result<()> {
        let inner = &self.inner;
        let first = inner.with_state(|st, g| {
            if st.shutdown {
                return false;
            }
            st.shutdown = true;
            // Wakes every `wait_notification` (then `Shutdown`) and refuses
            // what peers still send; our notification channels close.
            inner.inbox.close();
            for s in st.segments.values_mut() {
                s.notes = None;
            }
            st.end_requests(|_, _| true, &EndReason::Cancelled, g);
            st.pool.retire_all();
            let ids: Vec<_> = st.endpoints.keys().copied().collect();
            for id in ids {
                st.break_endpoint(id, Error::new(ErrorKind::Shutdown, "transport shut down"), g);
            }
            st.passive_tasks.clear(); // aborts them
            g.passive.extend(st.passive.drain().map(|(_, p)| p));
            true
        });
        if !first {
            return Ok(());
        }
        inner.settle(|st| st.endpoints.is_empty()).await;
        let fixed: Vec<JoinHandle<()>> = inner.fixed.lock().drain(..).collect();
        for t in &fixed {
            t.abort();
        }
        for t in fixed {
            let _ = t.await;
        }
        inner.events_stop.store(true, Ordering::Relaxed);
        let thread = inner.events_thread.lock().take();
        if let Some(th) = thread {
            // Ends within EVENT_POLL; joined off the runtime's workers.
            let _ = tokio::task::spawn_blocking(move || th.join()).await;
        }
        let verbs = inner.with_state(|st, g| {
            st.segments.clear();
            drop(st.batches.drain());
            st.deadlines = transport_core::lifecycle::DeadlineQueue::new();
            st.wrs.clear();
            g.regions.extend(std::mem::take(&mut st.regions).into_values().filter_map(|r| r.reg));
            // Both staging pools go with the regions (a killed node must
            // not keep its pinned buffers until its last handle drops).
            g.regions.extend(st.staging.take().map(Staging::into_registrations).unwrap_or_default());
            g.regions.extend(st.remote_staging.take().map(Staging::into_registrations).unwrap_or_default());
            st.leases.clear();
            g.regions.append(&mut st.retiring);
            st.verbs.take()
        }); // QPs are gone already; MRs now
        drop(verbs); // then CQ, channel, PD, context (last Arc)
        Ok(())
    }
}
