//! Host staging buffers between the sockets and device memory, and the
//! device copies made through them off the runtime.
//!
//! A transport keeps `staging_buffers` buffers of [`STAGE`] bytes while at
//! least one device region is registered: mapped when the first one is
//! registered, pinned through its provider (`transport_mem::PinnedBuf`),
//! unpinned and unmapped when the last one is unregistered (once every
//! buffer on loan is back). Half of them serve this side's requests, the
//! other half the peers' (the server), so a side waiting for a buffer never
//! waits for the other side's progress: two transports writing to each other
//! cannot hold each other's buffers.
//!
//! A device copy runs on tokio's blocking pool ([`copy_off`]), with the
//! buffer moved into it and given back when it ends, so socket I/O goes on
//! meanwhile. Every buffer on loan is counted: [`Staging::quiet`] waits
//! until none is out, so no such copy still runs (a blocking task is not
//! stopped by aborting its caller).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use transport_core::{Error, ErrorKind, Result};
use transport_mem::{DeviceMemory, PinnedBuf};

use crate::regions::Region;

/// Bytes of one staging buffer: one device copy each. At 256 KiB the
/// hand-off per chunk cost a quarter of the throughput on 2 cores
/// (`device_bench --staging=16`: 0.76-0.77x of host-to-host against
/// 0.94-0.95x at 1 MiB), and a GPU's copies pay a launch per chunk too.
pub(crate) const STAGE: usize = 1 << 20;

/// Who asks for a buffer: this side's requests, or the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    Initiator,
    Target,
}

/// The staging buffers of one transport.
#[derive(Debug)]
pub(crate) struct Staging {
    count: usize,
    state: Mutex<State>,
    /// Bytes of buffers mapped now (`stats().staging_bytes`).
    bytes: Arc<AtomicUsize>,
    out: Arc<Count>,
}

#[derive(Debug, Default)]
struct State {
    /// Device regions registered.
    devices: usize,
    pool: Option<Arc<Pool>>,
}

/// Things under way (buffers on loan, copies running), counted so that
/// whoever must wait until none runs can.
#[derive(Debug, Default)]
pub(crate) struct Count {
    n: AtomicUsize,
    done: Notify,
}

/// One counted thing; uncounted on drop.
#[derive(Debug)]
pub(crate) struct Counted(Arc<Count>);

impl Drop for Counted {
    fn drop(&mut self) {
        if self.0.n.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.done.notify_waiters();
        }
    }
}

impl Count {
    /// Counts one more until the result drops.
    pub fn enter(self: &Arc<Self>) -> Counted {
        self.n.fetch_add(1, Ordering::AcqRel);
        Counted(self.clone())
    }

    /// How many are counted now.
    pub fn now(&self) -> usize {
        self.n.load(Ordering::Acquire)
    }

    /// Waits until none is counted.
    pub async fn quiet(&self) {
        loop {
            let done = self.done.notified();
            tokio::pin!(done);
            done.as_mut().enable();
            if self.now() == 0 {
                return;
            }
            done.await;
        }
    }
}

/// One set of buffers, from the first device region to the last. It is
/// freed (unpinned, unmapped) when dropped: once no longer current and
/// every loan is back.
#[derive(Debug)]
struct Pool {
    free: Mutex<Vec<PinnedBuf>>,
    initiator: Arc<Semaphore>,
    target: Arc<Semaphore>,
    len: usize,
    bytes: Arc<AtomicUsize>,
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.bytes.fetch_sub(self.len * STAGE, Ordering::Relaxed);
    }
}

/// A staging buffer on loan; back to its pool on drop.
#[derive(Debug)]
pub(crate) struct Lease {
    buf: Option<PinnedBuf>,
    pool: Arc<Pool>,
    _permit: OwnedSemaphorePermit,
    _out: Counted,
}

impl std::ops::Deref for Lease {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.buf.as_deref().unwrap_or(&[])
    }
}

impl std::ops::DerefMut for Lease {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.buf.as_deref_mut().unwrap_or(&mut [])
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.pool.free.lock().push(b);
        }
    }
}

impl Staging {
    /// `count` buffers (0: staging off; otherwise at least 2, one per
    /// side), mapped once a device region is registered.
    pub fn new(count: usize) -> Self {
        let count = if count == 0 { 0 } else { count.max(2) };
        Self { count, state: Mutex::default(), bytes: Arc::default(), out: Arc::default() }
    }

    /// Whether device memory goes through staging buffers (`staging_buffers`
    /// is not 0). Off, device slices are copied as before: by the task that
    /// does the socket I/O, into and out of its own buffers.
    pub fn enabled(&self) -> bool {
        self.count > 0
    }

    /// Bytes of buffers mapped now.
    pub fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }

    /// A device region of `provider` was registered: the first one maps
    /// and pins the buffers. A buffer the provider fails to pin is used
    /// unpinned (logged); the buffers failing to map is an error.
    pub fn device_added(&self, provider: &Arc<dyn DeviceMemory>) -> Result<()> {
        let mut st = self.state.lock();
        if st.pool.is_none() && self.enabled() {
            let mut free = Vec::with_capacity(self.count);
            let mut unpinned = 0;
            for _ in 0..self.count {
                let buf = match PinnedBuf::new(STAGE, Some(provider)) {
                    Ok(b) => b,
                    Err(_) => PinnedBuf::new(STAGE, None).map_err(|e| {
                        Error::new(ErrorKind::Io, "cannot map the staging buffers").with("reason", e.to_string())
                    })?,
                };
                unpinned += usize::from(!buf.pinned());
                free.push(buf);
            }
            if unpinned > 0 {
                tracing::debug!(provider = provider.name(), unpinned, "staging buffers not pinned");
            }
            let initiator = self.count / 2;
            self.bytes.fetch_add(self.count * STAGE, Ordering::Relaxed);
            st.pool = Some(Arc::new(Pool {
                free: Mutex::new(free),
                initiator: Arc::new(Semaphore::new(initiator)),
                target: Arc::new(Semaphore::new(self.count - initiator)),
                len: self.count,
                bytes: self.bytes.clone(),
            }));
        }
        st.devices += 1;
        Ok(())
    }

    /// A device region was unregistered: after the last one the buffers
    /// go (once every loan is back).
    pub fn device_removed(&self) {
        let mut st = self.state.lock();
        st.devices = st.devices.saturating_sub(1);
        if st.devices == 0 {
            st.pool = None;
        }
    }

    /// Drops the buffers whatever is registered (the transport closes).
    pub fn close(&self) {
        let mut st = self.state.lock();
        st.devices = 0;
        st.pool = None;
    }

    fn pool(&self) -> Result<Arc<Pool>> {
        self.state
            .lock()
            .pool
            .clone()
            .ok_or_else(|| Error::new(ErrorKind::Io, "no staging buffers: no device region is registered"))
    }

    fn lease(&self, pool: Arc<Pool>, permit: OwnedSemaphorePermit) -> Result<Lease> {
        let buf = pool.free.lock().pop();
        let lease = Lease { buf, pool, _permit: permit, _out: self.out.enter() };
        if lease.buf.is_none() {
            return Err(Error::new(ErrorKind::Internal, "a staging permit without a buffer"));
        }
        Ok(lease)
    }

    /// A buffer for `side`, waiting for one to be free.
    pub async fn acquire(&self, side: Side) -> Result<Lease> {
        let pool = self.pool()?;
        let sem = if side == Side::Initiator { pool.initiator.clone() } else { pool.target.clone() };
        let permit =
            sem.acquire_owned().await.map_err(|_| Error::new(ErrorKind::Internal, "staging buffers closed"))?;
        self.lease(pool, permit)
    }

    /// A buffer for `side` if one is free now.
    pub fn try_acquire(&self, side: Side) -> Option<Lease> {
        let pool = self.pool().ok()?;
        let sem = if side == Side::Initiator { pool.initiator.clone() } else { pool.target.clone() };
        let permit = sem.try_acquire_owned().ok()?;
        self.lease(pool, permit).ok()
    }

    /// Waits until every buffer is back, so no copy through one runs.
    pub async fn quiet(&self) {
        self.out.quiet().await;
    }
}

/// Runs `copy` on `lease` on tokio's blocking pool, counted in `count`
/// until it ends; the buffer and the result come back when it ends. The
/// copy runs to its end even if the caller stops waiting: the lease is
/// back (for [`Staging::quiet`]) and `count` lets it go only then.
pub(crate) fn copy_off<R, F>(mut lease: Lease, count: &Arc<Count>, copy: F) -> Copying<R>
where
    R: Send + 'static,
    F: FnOnce(&mut [u8]) -> R + Send + 'static,
{
    let counted = count.enter();
    tokio::task::spawn_blocking(move || {
        let r = copy(&mut lease);
        drop(counted);
        (lease, r)
    })
}

/// A copy started by [`copy_off`].
pub(crate) type Copying<R> = tokio::task::JoinHandle<(Lease, R)>;

/// The end of a [`copy_off`]: its buffer and result. An error only if the
/// copy's task panicked or was cancelled (the runtime shuts down).
pub(crate) async fn copied<R>(h: Copying<R>) -> Result<(Lease, R)> {
    h.await.map_err(|e| Error::new(ErrorKind::Internal, "a device copy task failed").with("reason", e.to_string()))
}

/// A READ payload on its way into device memory through staging buffers
/// (staging on): its bytes are gathered into a buffer, and each full
/// buffer is copied into the device on the blocking pool while the reader
/// goes on. With no buffer free, a piece is copied at once, unstaged, so
/// the reader never waits for one. Every copy is counted in the endpoint's
/// `copies` (the teardown waits for them).
#[derive(Debug)]
pub(crate) struct StagedRead {
    region: Arc<Region>,
    /// The buffer being filled, the local offset of its first byte and
    /// how many bytes it holds.
    filling: Option<(Lease, u64, usize)>,
    copies: Vec<Copying<Result<()>>>,
}

impl StagedRead {
    pub fn new(region: Arc<Region>) -> Self {
        Self { region, filling: None, copies: Vec::new() }
    }

    /// Takes the payload's bytes `src`, which go at local offset `off`:
    /// buffers from `staging`, copies counted in `count`.
    pub fn feed(&mut self, staging: &Staging, count: &Arc<Count>, mut off: u64, mut src: &[u8]) -> Result<()> {
        while !src.is_empty() {
            // The buffer's first byte goes at `start` and the payload
            // arrives in order, so `off` is `start + filled`.
            let (lease, _, filled) = match self.filling.as_mut() {
                Some(f) => f,
                None => match staging.try_acquire(Side::Initiator) {
                    Some(l) => self.filling.insert((l, off, 0)),
                    None => return self.region.write_live(off, src),
                },
            };
            let n = (lease.len() - *filled).min(src.len());
            lease[*filled..*filled + n].copy_from_slice(&src[..n]);
            *filled += n;
            let full = *filled == lease.len();
            off = off.saturating_add(n as u64);
            src = &src[n..];
            if full {
                self.flush(count);
            }
        }
        Ok(())
    }

    /// Starts the copy of the buffer being filled, if any.
    pub fn flush(&mut self, count: &Arc<Count>) {
        if let Some((lease, start, n)) = self.filling.take() {
            let region = self.region.clone();
            self.copies.push(copy_off(lease, count, move |b| region.write_live(start, &b[..n])));
        }
    }

    /// The copies started, to wait for.
    pub fn into_copies(self) -> Vec<Copying<Result<()>>> {
        self.copies
    }
}
