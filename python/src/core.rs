//! The engine behind both Python APIs: one backend wrapped in the shared
//! policy layer, its own small tokio runtime, the table of registered
//! memory, and the cache of opened peer segments.
//!
//! Everything here is plain Rust with no Python objects on the data path:
//! callers release the GIL around every method that blocks.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use kvmove_policy::session::SessionLimits;
use kvmove_policy::{Engine, Sessions, Transfer, TransferOutcome, WaitConfig};
use parking_lot::Mutex;
use pyo3::buffer::PyBuffer;
use tokio::runtime::Runtime;
use transport_core::{Access, Error, ErrorKind, MemoryKind, Notification, Opcode, Result, SegmentId, TransferRequest};

use crate::backend;
use crate::backend::metadata::Directory;
use crate::devmem::{self, Want};
use crate::regions::{Entry, Regions};

/// One transfer as Python describes it: raw local address, remote address.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawOp {
    pub(crate) op: Opcode,
    pub(crate) local_addr: u64,
    pub(crate) remote_addr: u64,
    pub(crate) len: u64,
}

/// A running engine.
#[derive(Debug)]
pub(crate) struct Core {
    rt: Runtime,
    engine: Engine,
    session_id: String,
    regions: Mutex<Regions>,
    /// Segments opened by name for the Mooncake API (one per peer).
    by_name: Mutex<HashMap<String, SegmentId>>,
    /// The metadata server's names (Mooncake API in metadata mode): peer
    /// names are looked up there instead of being `host:port`.
    directory: Option<Directory>,
    /// The session driver (Pythonic API), started on first use. While it
    /// runs it owns the transport's notification inbox.
    sessions: Mutex<Option<Sessions>>,
    closed: AtomicBool,
    /// Turns true when [`Core::close`] begins: wakes every blocking wait.
    closing: tokio::sync::watch::Sender<bool>,
    /// How waits and polls spend their time (`policy.wait`, with
    /// `KVMOVE_SPIN_US` in place of its `spin_us`).
    wait: WaitConfig,
}

/// Worker threads of each engine's runtime: the data path is I/O-bound
/// and the backends run their own per-connection tasks.
const WORKER_THREADS: usize = 2;

impl Core {
    /// Starts the runtime and the backend the config names, under the
    /// config's policy.
    /// The first engine of the process installs the in-memory metrics
    /// recorder (`kvmove.metrics()` reports it if that failed).
    pub(crate) fn start(cfg: &kvmove::EngineConfig) -> Result<Self> {
        let wait = backend::wait_from_env(&cfg.policy.wait)?;
        let _ = crate::metrics::install();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(WORKER_THREADS)
            .thread_name("kvmove-rt")
            .enable_all()
            .build()
            .map_err(|e| Error::from(e).with("while", "starting the tokio runtime"))?;
        let transport = rt.block_on(backend::build(cfg))?;
        let session_id = transport.local_segment_name();
        let engine = Engine::new(transport, cfg.policy.clone())?;
        Ok(Self {
            rt,
            engine,
            session_id,
            regions: Mutex::new(Regions::default()),
            by_name: Mutex::new(HashMap::new()),
            directory: None,
            sessions: Mutex::new(None),
            closed: AtomicBool::new(false),
            closing: tokio::sync::watch::channel(false).0,
            wait,
        })
    }

    /// Runs a future on the engine's runtime (the caller released the GIL).
    pub(crate) fn block_on<F: Future>(&self, f: F) -> F::Output {
        self.rt.block_on(f)
    }

    /// How long a blocking wait polls on the caller's thread before it
    /// sleeps (`policy.wait.spin_us` or `KVMOVE_SPIN_US`, see
    /// [`Core::transfer`]).
    pub(crate) fn spin(&self) -> Duration {
        self.wait.spin()
    }

    /// The wait policy: how polls of running transfers spend their time.
    pub(crate) fn wait_policy(&self) -> &WaitConfig {
        &self.wait
    }

    /// Runs `f` inside the engine's runtime context (for synchronous calls
    /// of the session driver, which may spawn its sending tasks).
    pub(crate) fn in_rt<T>(&self, f: impl FnOnce() -> T) -> T {
        let _in_rt = self.rt.enter();
        f()
    }

    /// Spawns a task on the engine's runtime.
    pub(crate) fn spawn<F>(&self, f: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.rt.spawn(f)
    }

    /// The session driver over this engine, started on first use (once).
    pub(crate) fn sessions(&self) -> Result<Sessions> {
        self.live()?;
        let mut slot = self.sessions.lock();
        if let Some(s) = &*slot {
            return Ok(s.clone());
        }
        let _in_rt = self.rt.enter();
        let s = Sessions::start(self.engine.clone(), SessionLimits::default())?;
        *slot = Some(s.clone());
        Ok(s)
    }

    /// Sends `msg` to the peer of `seg` (Mooncake API), offered again while
    /// the peer's inbox is full for the policy's `notify_patience`
    /// ([`Engine::notify`](kvmove_policy::Engine::notify)).
    pub(crate) fn notify_segment(&self, seg: SegmentId, msg: Vec<u8>) -> Result<()> {
        self.live()?;
        self.rt.block_on(self.engine.notify(seg, msg))
    }

    /// Takes every notification received so far (Mooncake API), oldest
    /// first: from the session driver's inbox if it runs, else from the
    /// transport's.
    pub(crate) fn take_notifications(&self) -> Result<Vec<Notification>> {
        self.live()?;
        const CHUNK: usize = 1024;
        let sessions = self.sessions.lock().clone();
        let mut all = Vec::new();
        loop {
            let got = match &sessions {
                Some(s) => s.take_notifications(CHUNK),
                None => self.engine.take_notifications(CHUNK)?,
            };
            let n = got.len();
            all.extend(got);
            if n < CHUNK {
                return Ok(all);
            }
        }
    }

    /// Completes once the engine begins to close.
    pub(crate) fn until_closed(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.closing.subscribe();
        async move {
            let _ = rx.wait_for(|c| *c).await;
        }
    }

    pub(crate) fn live(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::new(ErrorKind::Shutdown, "the engine was closed"));
        }
        Ok(())
    }

    /// The address peers reach this engine at (`host:port`).
    pub(crate) fn session_id(&self) -> &str {
        &self.session_id
    }

    /// Looks peer names up in `directory` (which holds this engine's own
    /// record) from now on.
    pub(crate) fn attach_directory(&mut self, directory: Directory) {
        self.directory = Some(directory);
    }

    /// The name peers pass to reach this engine: its segment name in
    /// metadata mode, else its address.
    pub(crate) fn segment_name(&self) -> &str {
        self.directory.as_ref().map_or(&self.session_id, Directory::name)
    }

    /// The address of the peer `name`: the name itself (`host:port`), or
    /// in metadata mode the address the metadata server gives for it.
    fn address_of<'a>(&self, name: &'a str) -> Result<std::borrow::Cow<'a, str>> {
        match &self.directory {
            None => check_peer_name(name).map(|()| name.into()),
            Some(d) => d.resolve(name).map(Into::into),
        }
    }

    /// After a failure that says the peer went away, its address is looked
    /// up again next time (a restarted peer listens elsewhere).
    fn forget_address_after(&self, name: &str, err: &Error) {
        if let Some(d) = &self.directory {
            if err.kind().reopens_segment() {
                d.forget(name);
            }
        }
    }

    /// The port of [`Core::session_id`].
    pub(crate) fn rpc_port(&self) -> Result<u16> {
        self.session_id.rsplit_once(':').and_then(|(_, p)| p.parse().ok()).ok_or_else(|| {
            Error::new(ErrorKind::Internal, "backend segment name has no port").with("name", &self.session_id)
        })
    }

    /// Whether memory registered here may be device memory. Every region
    /// the Python APIs register is reachable by peers (`REMOTE_RW`), so
    /// this needs both capabilities.
    pub(crate) fn device_memory(&self) -> bool {
        let c = self.engine.capabilities();
        c.device_memory && c.device_memory_remote
    }

    /// The kind of the registered region holding `addr` (`host`,
    /// `device:N`).
    pub(crate) fn memory_kind(&self, addr: u64) -> Result<MemoryKind> {
        self.live()?;
        Ok(self.regions.lock().locate_entry(addr, 1)?.0.mem.kind())
    }

    /// The backend kind (`tcp`, `rdma`).
    pub(crate) fn backend(&self) -> String {
        self.engine.backend().to_owned()
    }

    /// Registers `addr .. addr + len` for local use and remote read/write:
    /// device memory of an installed provider, or host memory this process
    /// can read, as `want` allows ([`devmem::region_at`]); anything else
    /// is refused with `Unsupported` before a backend could touch it.
    ///
    /// # Safety
    ///
    /// The caller keeps the contract of [`transport_core::MemoryRegion::from_raw`] (or
    /// [`transport_core::MemoryRegion::from_device`] for device memory): the range stays
    /// valid, allocated, writable memory until [`Core::unregister`] of
    /// `addr` returns (or the engine is closed).
    pub(crate) unsafe fn register(
        &self,
        addr: u64,
        len: u64,
        keepalive: Option<PyBuffer<u8>>,
        want: Want,
    ) -> Result<MemoryKind> {
        self.live()?;
        let mut regions = self.regions.lock();
        regions.check_free(addr, len)?;
        // SAFETY: forwarded from this function's contract.
        let mem = unsafe { devmem::region_at(addr, len, want) }?;
        let kind = mem.kind();
        let id = self.engine.register(mem.clone(), Access::REMOTE_RW)?;
        regions.insert(addr, Entry { id, len, mem, keepalive });
        Ok(kind)
    }

    /// Unregisters the region that starts at `addr`. Returns the buffer
    /// export that kept it alive, if any, for the caller to drop with the
    /// GIL held. The transport is quiet on the memory when this returns.
    pub(crate) fn unregister(&self, addr: u64) -> Result<Option<PyBuffer<u8>>> {
        self.live()?;
        let id = self.regions.lock().at(addr)?.id;
        self.rt.block_on(self.engine.unregister(id))?;
        Ok(self.regions.lock().remove(addr).and_then(|e| e.keepalive))
    }

    /// Registers every `(addr, len)` of `ranges` or none of them: the whole
    /// batch is checked first (zero lengths, null or overflowing ranges,
    /// overlaps inside the batch and with registered regions), and a
    /// registration that still fails undoes the ones made before it.
    ///
    /// # Safety
    ///
    /// As [`Core::register`], for every range.
    pub(crate) unsafe fn register_all(&self, ranges: &[(u64, u64)], want: Want) -> Result<()> {
        self.live()?;
        let mut sorted = ranges.to_vec();
        sorted.sort_unstable();
        let mut prev_end = 0u64;
        for (i, &(addr, len)) in sorted.iter().enumerate() {
            let range = |e: Error| e.with("addr", format_args!("{addr:#x}")).with("len", len);
            if len == 0 {
                return Err(range(Error::new(ErrorKind::InvalidRequest, "zero-length region in the batch")));
            }
            if addr == 0 {
                return Err(range(Error::new(ErrorKind::InvalidRequest, "null address in the batch")));
            }
            let end = addr
                .checked_add(len)
                .ok_or_else(|| range(Error::new(ErrorKind::OutOfBounds, "region wraps around the address space")))?;
            if i > 0 && addr < prev_end {
                return Err(range(Error::new(ErrorKind::AlreadyRegistered, "regions of the batch overlap each other")));
            }
            prev_end = end;
        }
        // Every range classified (device or readable host memory) before
        // any is registered: all or nothing.
        let mut mems = Vec::with_capacity(ranges.len());
        for &(addr, len) in ranges {
            // SAFETY: forwarded from this function's contract.
            mems.push(unsafe { devmem::region_at(addr, len, want) }?);
        }
        let mut done = Vec::with_capacity(ranges.len());
        let r = (|| {
            let mut regions = self.regions.lock();
            for &(addr, len) in &sorted {
                regions.check_free(addr, len)?;
            }
            for (&(addr, len), mem) in ranges.iter().zip(mems) {
                let id = self.engine.register(mem.clone(), Access::REMOTE_RW)?;
                regions.insert(addr, Entry { id, len, mem, keepalive: None });
                done.push(addr);
            }
            Ok(())
        })();
        if r.is_err() {
            for addr in done {
                drop(self.unregister(addr));
            }
        }
        r
    }

    /// Unregisters every region starting at an address of `addrs`, or none:
    /// each must be registered (and listed once) before any is unregistered.
    pub(crate) fn unregister_all(&self, addrs: &[u64]) -> Result<()> {
        self.live()?;
        {
            let regions = self.regions.lock();
            let mut seen = std::collections::HashSet::with_capacity(addrs.len());
            for &a in addrs {
                regions.at(a)?;
                if !seen.insert(a) {
                    return Err(Error::new(ErrorKind::InvalidRequest, "address listed twice in the batch")
                        .with("addr", format_args!("{a:#x}")));
                }
            }
        }
        let mut first = Ok(());
        for &a in addrs {
            if let Err(e) = self.unregister(a) {
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }

    /// Copies `src` into registered local memory at `addr`.
    pub(crate) fn write_local(&self, addr: u64, src: &[u8]) -> Result<()> {
        self.live()?;
        let regions = self.regions.lock();
        let (e, off) = regions.locate_entry(addr, src.len() as u64)?;
        Ok(e.mem.write_at(off as usize, src)?)
    }

    /// Copies `len` bytes of registered local memory at `addr`.
    pub(crate) fn read_local(&self, addr: u64, len: u64) -> Result<Vec<u8>> {
        self.live()?;
        let regions = self.regions.lock();
        let (e, off) = regions.locate_entry(addr, len)?;
        let n = usize::try_from(len).map_err(|_| Error::new(ErrorKind::OutOfBounds, "length too large"))?;
        let mut v = vec![0u8; n];
        e.mem.read_at(off as usize, &mut v)?;
        Ok(v)
    }

    /// The address of the first region a peer exposes (0 if none).
    pub(crate) fn first_remote_region(&self, name: &str) -> Result<u64> {
        let seg = self.open_segment(name)?;
        let desc = self.engine.segment_descriptor(seg);
        let _ = self.close_segment(seg);
        Ok(desc?.regions.first().map_or(0, |r| r.addr))
    }

    /// Number of registered regions.
    pub(crate) fn region_count(&self) -> usize {
        self.regions.lock().len()
    }

    /// Opens a new, independent handle to a peer's segment.
    pub(crate) fn open_segment(&self, name: &str) -> Result<SegmentId> {
        self.live()?;
        let addr = self.address_of(name)?;
        self.rt.block_on(self.engine.open_segment(&addr)).inspect_err(|e| self.forget_address_after(name, e))
    }

    /// Asks the peer `name` whether it is there (a real round trip, see
    /// [`Engine::probe`]): not held back by the peer's open breaker, and a
    /// success closes it.
    pub(crate) fn probe(&self, name: &str) -> Result<()> {
        self.live()?;
        let addr = self.address_of(name)?;
        self.rt.block_on(self.engine.probe(&addr)).inspect_err(|e| self.forget_address_after(name, e))
    }

    /// Closes a handle from [`Core::open_segment`].
    pub(crate) fn close_segment(&self, seg: SegmentId) -> Result<()> {
        self.live()?;
        self.rt.block_on(self.engine.close_segment(seg))
    }

    /// The cached handle for `name` (Mooncake API), opened on first use.
    pub(crate) fn cached_segment(&self, name: &str) -> Result<SegmentId> {
        if let Some(&s) = self.by_name.lock().get(name) {
            return Ok(s);
        }
        let seg = self.open_segment(name)?;
        let mut map = self.by_name.lock();
        if let Some(&other) = map.get(name) {
            // Another thread opened it meanwhile: keep theirs.
            drop(map);
            let _ = self.rt.block_on(self.engine.close_segment(seg));
            return Ok(other);
        }
        map.insert(name.to_owned(), seg);
        Ok(seg)
    }

    /// Drops the cached handle of `name` after a failure that says the peer
    /// went away, so the next call fetches a fresh descriptor (a restarted
    /// peer has new addresses and keys).
    pub(crate) fn forget_segment_after(&self, name: &str, seg: SegmentId, err: &Error) {
        if !err.kind().reopens_segment() {
            return;
        }
        self.forget_address_after(name, err);
        let mut map = self.by_name.lock();
        if map.get(name) == Some(&seg) {
            map.remove(name);
            drop(map);
            let _ = self.rt.block_on(self.engine.close_segment(seg));
        }
    }

    /// Maps raw operations to engine requests on `seg`.
    pub(crate) fn requests(&self, seg: SegmentId, ops: &[RawOp]) -> Result<Vec<TransferRequest>> {
        if ops.is_empty() {
            return Err(Error::new(ErrorKind::InvalidRequest, "empty batch"));
        }
        let regions = self.regions.lock();
        ops.iter()
            .enumerate()
            .map(|(i, o)| {
                let (local, local_offset) = regions.locate(o.local_addr, o.len).map_err(|e| e.with("request", i))?;
                if o.remote_addr.checked_add(o.len).is_none() {
                    return Err(Error::new(ErrorKind::OutOfBounds, "remote address range overflows").with("request", i));
                }
                Ok(TransferRequest {
                    op: o.op,
                    local,
                    local_offset,
                    segment: seg,
                    remote_addr: o.remote_addr,
                    len: o.len,
                })
            })
            .collect()
    }

    /// A handle on the engine, for work the runtime does on its own
    /// (submitting off the caller's thread).
    pub(crate) fn engine(&self) -> Result<Engine> {
        self.live()?;
        Ok(self.engine.clone())
    }

    /// Starts a transfer (waits for room in the in-flight budget).
    pub(crate) fn submit(&self, requests: Vec<TransferRequest>) -> Result<Transfer> {
        self.live()?;
        self.rt.block_on(self.engine.submit(requests))
    }

    /// Waits for a transfer's final outcome.
    pub(crate) fn wait(&self, t: Transfer) -> Result<TransferOutcome> {
        self.rt.block_on(t.wait())
    }

    /// Cancels what has not completed; returns once the transfer is quiet.
    pub(crate) fn cancel(&self, t: Transfer) -> Result<TransferOutcome> {
        self.rt.block_on(t.cancel())
    }

    /// Submits and waits: first by polling for at most `policy.wait.spin_us` (50 us) on
    /// this thread (the transport applies the answers that arrived as it
    /// polls, docs/CONTRACT.md rule 6), so a small transfer whose answer
    /// comes within microseconds completes here without a hand-off from a
    /// runtime thread (nor, while it polls, a wake of one by the kernel:
    /// `Transfer::spin` tells the transport); then asleep. Between polls
    /// the thread yields, so a thread this CPU should run meanwhile (the
    /// peer's, on a small machine) is not kept waiting by the spin.
    pub(crate) fn transfer(&self, requests: Vec<TransferRequest>) -> Result<TransferOutcome> {
        let t = self.submit(requests)?;
        let spin = self.wait.spin();
        if !spin.is_zero() {
            let _in_rt = self.rt.enter();
            t.spin(spin);
        }
        self.wait(t)
    }

    /// Live resource counts of the backend, plus this layer's own.
    pub(crate) fn stats(&self) -> Vec<(&'static str, u64)> {
        let s = self.engine.stats();
        let inflight = self.engine.inflight();
        let counts = self.sessions.lock().as_ref().map(Sessions::counts);
        vec![
            ("endpoints", s.endpoints as u64),
            ("endpoint_lanes", s.endpoint_lanes as u64),
            ("segments", s.segments as u64),
            ("regions", s.regions as u64),
            ("batches", s.batches as u64),
            ("inflight", s.inflight as u64),
            ("tasks", s.tasks as u64),
            ("active_transfers", self.engine.active_transfers() as u64),
            ("inflight_bytes", inflight.bytes),
            ("registered", self.region_count() as u64),
            ("cached_segments", self.by_name.lock().len() as u64),
            ("sessions_open", counts.as_ref().map_or(0, |c| c.open as u64)),
            ("sessions_lingering", counts.as_ref().map_or(0, |c| c.lingering as u64)),
        ]
    }

    /// Shuts the backend down (all transfers end, all memory is
    /// unregistered) and returns the buffer exports to drop with the GIL.
    /// A second call does nothing.
    pub(crate) fn close(&self) -> Vec<PyBuffer<u8>> {
        if self.closed.swap(true, Ordering::AcqRel) {
            return Vec::new();
        }
        self.closing.send_replace(true);
        // Peers stop finding this engine before it stops answering.
        if let Some(d) = &self.directory {
            if let Err(e) = d.unpublish() {
                eprintln!("kvmove: could not remove segment {:?} from the metadata server: {e}", d.name());
            }
        }
        self.by_name.lock().clear();
        // The session driver first: its tasks use the transport.
        if let Some(s) = self.sessions.lock().take() {
            self.rt.block_on(s.shutdown());
        }
        if let Err(e) = self.rt.block_on(self.engine.shutdown()) {
            // Shutdown stops everything it can even when it reports an error;
            // the memory below is only released after it returned.
            eprintln!("kvmove: engine shutdown reported: {e}");
        }
        self.regions.lock().drain().into_iter().filter_map(|e| e.keepalive).collect()
    }
}

impl Drop for Core {
    fn drop(&mut self) {
        drop(self.close());
    }
}

/// A peer name must be `host:port`.
pub(crate) fn check_peer_name(name: &str) -> Result<()> {
    let ok = match name.rsplit_once(':') {
        Some((h, p)) => !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p != 0),
        None => false,
    };
    if ok {
        Ok(())
    } else {
        Err(Error::new(ErrorKind::InvalidRequest, "peer name must be \"host:port\" (the peer's session id)")
            .with("peer", name))
    }
}
