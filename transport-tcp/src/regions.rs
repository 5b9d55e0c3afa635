//! Registered memory: one table for both sides (local sources and sinks,
//! and regions peers may reach), with a gate per region so unregister can
//! wait until no copy into or out of it is running.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::RwLock;
use transport_core::{Access, Error, ErrorKind, RegionId, Result};
use transport_mem::cma::PULL_MANY_MAX;
use transport_mem::window::{WindowOwner, DIRECT_READ, DIRECT_WRITE, WINDOW_ENTRIES, WINDOW_NONCE_LEN};
use transport_mem::{MemError, MemoryRegion};

use crate::proto::{Status, WireRegion};

/// One registered region.
#[derive(Debug)]
pub(crate) struct Region {
    pub id: RegionId,
    pub mem: MemoryRegion,
    pub access: Access,
    /// `true` while registered. Every copy holds it shared; unregister
    /// takes it exclusively to flip it, so once that returns no copy runs
    /// and none starts.
    gate: RwLock<bool>,
    /// Its entry in the direct-copy windows offered to same-host peers
    /// (host memory that allows remote writes or reads, while entries are
    /// left).
    slot: Option<usize>,
}

impl Region {
    /// Runs `f` on the memory while the region is registered; `None` (and
    /// `f` not run) once it was unregistered.
    pub fn with_live<R>(&self, f: impl FnOnce(&MemoryRegion) -> R) -> Option<R> {
        let g = self.gate.read();
        if *g {
            Some(f(&self.mem))
        } else {
            None
        }
    }

    /// Copies `src` into the region at offset `off`, if it is still
    /// registered (this side's own memory: the errors are the request's).
    pub fn write_live(&self, off: u64, src: &[u8]) -> Result<()> {
        self.local(off, |m, off| m.write_at(off, src))
    }

    /// Copies `dst.len()` bytes of the region at offset `off` into `dst`,
    /// as [`Region::write_live`] the other way.
    pub fn read_live(&self, off: u64, dst: &mut [u8]) -> Result<()> {
        self.local(off, |m, off| m.read_at(off, dst))
    }

    /// Runs copy `f` at offset `off` of this side's own region while it is
    /// registered, with the request's errors.
    fn local(&self, off: u64, f: impl FnOnce(&MemoryRegion, usize) -> std::result::Result<(), MemError>) -> Result<()> {
        let off = usize::try_from(off).map_err(|_| Error::new(ErrorKind::OutOfBounds, "local offset too large"))?;
        match self.with_live(|m| f(m, off)) {
            Some(r) => r.map_err(Error::from),
            None => Err(Error::region_unregistered(self.id)),
        }
    }

    /// Marks the region dead, waiting for running copies to finish.
    pub fn kill(&self) {
        *self.gate.write() = false;
    }

    /// Copies `dst.len()` bytes from the absolute address `addr`.
    pub fn read_abs(&self, addr: u64, dst: &mut [u8]) -> std::result::Result<(), Status> {
        let off = addr.checked_sub(self.mem.addr()).ok_or(Status::OutOfBounds)?;
        match self.with_live(|m| m.read_at(off as usize, dst)) {
            None => Err(Status::Unregistered),
            Some(Err(MemError::DeviceCopy { .. })) => Err(Status::DeviceCopy),
            Some(Err(_)) => Err(Status::OutOfBounds),
            Some(Ok(())) => Ok(()),
        }
    }

    /// Copies `len` bytes at `src` in process `pid` to the absolute
    /// address `addr` (a same-host WRITE).
    pub fn pull_abs(&self, addr: u64, len: u64, pid: u32, src: u64) -> std::result::Result<(), Status> {
        let off = addr.checked_sub(self.mem.addr()).ok_or(Status::OutOfBounds)?;
        let len = usize::try_from(len).map_err(|_| Status::OutOfBounds)?;
        match self.with_live(|m| m.pull_at(off as usize, len, pid, src)) {
            None => Err(Status::Unregistered),
            Some(r) => r.map_err(pull_status),
        }
    }

    /// Copies `src` to the absolute address `addr`.
    pub fn write_abs(&self, addr: u64, src: &[u8]) -> std::result::Result<(), Status> {
        let off = addr.checked_sub(self.mem.addr()).ok_or(Status::OutOfBounds)?;
        match self.with_live(|m| m.write_at(off as usize, src)) {
            None => Err(Status::Unregistered),
            Some(Err(MemError::DeviceCopy { .. })) => Err(Status::DeviceCopy),
            Some(Err(_)) => Err(Status::OutOfBounds),
            Some(Ok(())) => Ok(()),
        }
    }
}

/// Same-host copies gathered to be made by one kernel call
/// (`MemoryRegion::pull_many`): consecutive ones into host memory of one
/// region, all from one process. The target gathers the WRITEs it has in
/// hand, the initiator the READ answers; each side says when they are
/// made ([`Gathered::copy`]) and what a result means to it.
#[derive(Debug, Default)]
pub(crate) struct Gathered {
    region: Option<Arc<Region>>,
    pid: u32,
    /// `(offset in the region, len, address in process pid)` of each.
    entries: Vec<(usize, usize, u64)>,
    ids: Vec<u64>,
    /// The server's tickets for them ([`crate::applying`]), ended once
    /// they are copied.
    pub held: Vec<crate::applying::Ticket>,
}

/// One gathered copy's result: `Err(None)` when its region was
/// unregistered first (nothing was copied).
pub(crate) type Pulled = std::result::Result<(), Option<MemError>>;

impl Gathered {
    /// Whether a copy from `pid` into `region` may join those gathered.
    pub fn takes(&self, region: &Arc<Region>, pid: u32) -> bool {
        self.entries.len() < PULL_MANY_MAX
            && self.region.as_ref().is_none_or(|r| Arc::ptr_eq(r, region) && self.pid == pid)
    }

    /// Adds copy `id`: `len` bytes at `src` in process `pid` to `offset`
    /// in `region` (after [`Gathered::takes`] said yes).
    pub fn add(&mut self, region: Arc<Region>, pid: u32, (offset, len, src): (usize, usize, u64), id: u64) {
        self.region = Some(region);
        self.pid = pid;
        self.entries.push((offset, len, src));
        self.ids.push(id);
    }

    /// Makes the gathered copies (one kernel call where it can) and puts
    /// `(id, len, result)` of each into `out`, in the order they were
    /// added; then holds none. Returns the region they went into.
    pub fn copy(&mut self, out: &mut Vec<(u64, usize, Pulled)>) -> Option<Arc<Region>> {
        let region = self.region.take()?;
        let mut copied = Vec::with_capacity(self.entries.len());
        let live = region.with_live(|m| m.pull_many(self.pid, &self.entries, &mut copied)).is_some();
        let mut copied = copied.into_iter();
        for (&(_, len, _), &id) in self.entries.iter().zip(&self.ids) {
            let result = match (live, copied.next()) {
                (true, Some(r)) => r.map_err(Some),
                // `pull_many` gives one result per entry; never taken.
                (true, None) => Err(Some(MemError::OutOfBounds { offset: 0, len: len as u64, region_len: 0 })),
                (false, _) => Err(None),
            };
            out.push((id, len, result));
        }
        self.entries.clear();
        self.ids.clear();
        self.held.clear();
        Some(region)
    }
}

/// The status a failed same-host copy is answered with.
pub(crate) fn pull_status(e: MemError) -> Status {
    match e {
        MemError::DeviceCopy { .. } => Status::DeviceCopy,
        MemError::ProcessCopy { .. } => Status::SourceCopy,
        _ => Status::OutOfBounds,
    }
}

#[derive(Debug, Default)]
struct Tables {
    by_id: HashMap<RegionId, Arc<Region>>,
    by_addr: BTreeMap<u64, Arc<Region>>,
    /// The direct-write windows offered to same-host clients, live or
    /// retired; a retired one is forgotten once no write that saw it alive
    /// can still be copying ([`WindowOwner::is_quiet`]).
    windows: Vec<Arc<WindowOwner>>,
    /// Which window entries regions hold (index = entry).
    slots: Vec<bool>,
    /// Entries of unregistered regions whose unregister stopped waiting
    /// (its caller went away) before the writes that saw them open were
    /// over: freed by [`Tables::tidy`] once they are.
    closing: Vec<Closing>,
}

impl Tables {
    /// A free window entry, taken; `None` when all are held.
    fn take_slot(&mut self) -> Option<usize> {
        match self.slots.iter().position(|used| !used) {
            Some(k) => {
                self.slots[k] = true;
                Some(k)
            }
            None if self.slots.len() < WINDOW_ENTRIES => {
                self.slots.push(true);
                Some(self.slots.len() - 1)
            }
            None => None,
        }
    }

    fn free_slot(&mut self, k: usize) {
        if let Some(used) = self.slots.get_mut(k) {
            *used = false;
        }
    }

    /// Frees the entries whose closing is over and forgets the retired
    /// windows that are quiet (their files close; any later write of their
    /// client finds them retired), counting what those clients wrote.
    fn tidy(&mut self) {
        let mut quiet = Vec::new();
        self.closing.retain(|c| {
            let over = c.is_quiet();
            if over {
                quiet.push(c.slot);
            }
            !over
        });
        for k in quiet {
            self.free_slot(k);
        }
        let (mut written, mut read) = (0u64, 0u64);
        self.windows.retain(|w| {
            let keep = !w.is_quiet();
            if !keep {
                written = written.saturating_add(w.take_written());
                read = read.saturating_add(w.take_read());
            }
            keep
        });
        count_direct("write", written);
        count_direct("read", read);
    }
}

/// A region's window entry, closed in every window, with what each
/// window's client was doing right after: the entry may go to another
/// region once each write then under way is over.
#[derive(Debug)]
pub(crate) struct Closing {
    slot: usize,
    seen: Vec<(Arc<WindowOwner>, Option<u64>)>,
}

impl Closing {
    /// Whether no write that may have seen the entry open is still
    /// copying: each client's counter moved on from the odd value seen
    /// (a later write finds the entry closed), or its process exited.
    fn is_quiet(&self) -> bool {
        self.seen.iter().all(|(w, seen)| seen.is_none_or(|c| w.writing() != Some(c)) || w.writer_exited())
    }
}

/// Retires its window when the connection it was offered on ends (and
/// lets the table forget it, with its file, unless its client is inside a
/// write right then: then a later look does).
#[derive(Debug)]
pub(crate) struct WindowGuard {
    window: Arc<WindowOwner>,
    table: std::sync::Weak<RegionTable>,
}

impl WindowGuard {
    /// The window file's descriptor number in this process.
    pub fn raw_fd(&self) -> i32 {
        self.window.raw_fd()
    }
}

impl Drop for WindowGuard {
    fn drop(&mut self) {
        self.window.retire();
        if let Some(t) = self.table.upgrade() {
            t.tidy();
        }
    }
}

/// Adds the bytes same-host clients wrote directly into this process (and
/// read directly from it) since the last call to the served-bytes metrics
/// (as WRITEs and READs moved by same-host copies), as the clients count
/// them. Called whenever a
/// connection's served bytes are reported, at unregister, when a window
/// is retired, and at least once a second (the transport's reaper), so
/// the metrics lag a direct write by at most that.
pub(crate) fn report_direct(t: &RegionTable) {
    let t = t.inner.read();
    count_direct("write", t.windows.iter().map(|w| w.take_written()).fold(0, u64::saturating_add));
    count_direct("read", t.windows.iter().map(|w| w.take_read()).fold(0, u64::saturating_add));
}

fn count_direct(op: &'static str, n: u64) {
    if n > 0 {
        metrics::counter!("kvmove_tcp_served_bytes_total", "op" => op).increment(n);
        metrics::counter!("kvmove_tcp_same_host_bytes_total", "op" => op).increment(n);
    }
}

/// Returns once `done()` holds: at once for a write of microseconds,
/// yielding first, then sleeping 200 us at a time. A same-host client
/// frozen inside a direct write (stopped, under a debugger) holds it until
/// it resumes or exits, with a warning every 5 s naming `what` waits.
async fn wait_quiet(what: &str, mut done: impl FnMut() -> bool) {
    const SPIN: Duration = Duration::from_micros(200);
    const WARN_EVERY: Duration = Duration::from_secs(5);
    let started = Instant::now();
    let mut warn_at = WARN_EVERY;
    while !done() {
        let waited = started.elapsed();
        if waited < SPIN {
            tokio::task::yield_now().await;
            continue;
        }
        if waited >= warn_at {
            tracing::warn!(
                waited_s = waited.as_secs(),
                "a same-host peer is stopped inside a direct write into this process: {what} waits until it \
                 resumes or exits"
            );
            warn_at += WARN_EVERY;
        }
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
}

/// Puts a closing that its unregister stopped waiting for into the
/// table's list (see [`Tables::closing`]).
struct Unfinished<'a> {
    table: &'a RegionTable,
    closing: Option<Closing>,
}

impl Drop for Unfinished<'_> {
    fn drop(&mut self) {
        if let Some(c) = self.closing.take() {
            let mut t = self.table.inner.write();
            t.closing.push(c);
            t.tidy();
        }
    }
}

/// All live registrations of one transport.
#[derive(Debug)]
pub(crate) struct RegionTable {
    inner: RwLock<Tables>,
    /// What windows may allow (`DIRECT_WRITE`, `DIRECT_READ`: the server's
    /// `TcpConfig::direct_writes` and `direct_reads`).
    direct: u64,
}

impl Default for RegionTable {
    fn default() -> Self {
        RegionTable::new(DIRECT_WRITE | DIRECT_READ)
    }
}

impl RegionTable {
    /// A table whose windows allow at most `direct` (`DIRECT_WRITE`,
    /// `DIRECT_READ`).
    pub fn new(direct: u64) -> RegionTable {
        RegionTable { inner: RwLock::new(Tables::default()), direct }
    }

    /// What a window entry allows for `access`.
    fn modes(&self, access: Access) -> u64 {
        let w = if access.remote_write { DIRECT_WRITE } else { 0 };
        (w | if access.remote_read { DIRECT_READ } else { 0 }) & self.direct
    }

    /// Adds a region; overlap with a live one is `AlreadyRegistered`.
    pub fn insert(&self, id: RegionId, mem: MemoryRegion, access: Access) -> Result<()> {
        let (start, end) = (mem.addr(), mem.addr().saturating_add(mem.len() as u64));
        let mut t = self.inner.write();
        if let Some((_, prev)) = t.by_addr.range(..end).next_back() {
            if prev.mem.addr().saturating_add(prev.mem.len() as u64) > start {
                return Err(Error::new(ErrorKind::AlreadyRegistered, "memory overlaps a registered region")
                    .with("region", prev.id));
            }
        }
        let modes = self.modes(access);
        let slot = if modes != 0 && mem.provider().is_none() { t.take_slot() } else { None };
        let r = Arc::new(Region { id, mem, access, gate: RwLock::new(true), slot });
        if let Some(k) = slot {
            for w in &t.windows {
                w.open(k, r.mem.addr(), r.mem.len() as u64, modes);
            }
        }
        t.by_addr.insert(start, r.clone());
        t.by_id.insert(id, r);
        Ok(())
    }

    /// A direct-write window for the client process `writer` (verified),
    /// carrying the handshake's `nonce`, with every region that allows
    /// remote writes open in it. Retired when the guard drops.
    pub fn add_window(self: &Arc<Self>, nonce: &[u8; WINDOW_NONCE_LEN], writer: u32) -> std::io::Result<WindowGuard> {
        let w = Arc::new(WindowOwner::create(nonce, WINDOW_ENTRIES, writer)?);
        let mut t = self.inner.write();
        t.tidy();
        for r in t.by_id.values() {
            if let Some(k) = r.slot {
                w.open(k, r.mem.addr(), r.mem.len() as u64, self.modes(r.access));
            }
        }
        t.windows.push(w.clone());
        Ok(WindowGuard { window: w, table: Arc::downgrade(self) })
    }

    /// Stops direct writes into `r` (after `remove`): closes its entry in
    /// every window and returns once no write that saw it open is still
    /// copying; then its entry may go to another region. If the caller
    /// stops waiting, the entry is freed later, once that holds.
    pub async fn close_direct(&self, r: &Region) {
        let Some(slot) = r.slot else { return };
        let seen = {
            let t = self.inner.read();
            for w in &t.windows {
                w.close(slot);
            }
            // Read after every close: a write that read the entry open is
            // inside now, or over.
            t.windows.iter().map(|w| (w.clone(), w.writing())).collect()
        };
        let mut pending = Unfinished { table: self, closing: Some(Closing { slot, seen }) };
        wait_quiet("unregistering", || pending.closing.as_ref().is_none_or(Closing::is_quiet)).await;
        pending.closing = None;
        let mut t = self.inner.write();
        t.free_slot(slot);
        drop(t);
        self.tidy();
    }

    /// Counts what clients wrote directly, frees entries whose closing is
    /// over and forgets retired windows that are quiet.
    pub fn tidy(&self) {
        report_direct(self);
        self.inner.write().tidy();
    }

    /// Retires every window (the engine is closing): from here on no
    /// client starts a direct write into this process.
    pub fn retire_windows(&self) {
        for w in &self.inner.read().windows {
            w.retire();
        }
    }

    /// Whether every window is retired and quiet (no write that saw it
    /// alive is still copying).
    pub fn windows_quiet(&self) -> bool {
        self.inner.read().windows.iter().all(|w| w.is_quiet())
    }

    /// After [`RegionTable::retire_windows`]: returns once every window is
    /// quiet, then forgets them.
    pub async fn quiet_windows(&self) {
        wait_quiet("closing the engine", || self.windows_quiet()).await;
        self.tidy();
    }

    /// The regions direct writes could reach (host memory that allows
    /// remote writes, with a window entry).
    pub fn directly_writable(&self) -> Vec<Arc<Region>> {
        self.inner.read().by_id.values().filter(|r| r.slot.is_some() && r.access.remote_write).cloned().collect()
    }

    /// Removes a region from the table (it may still be live until killed).
    pub fn remove(&self, id: RegionId) -> Option<Arc<Region>> {
        let mut t = self.inner.write();
        let r = t.by_id.remove(&id)?;
        t.by_addr.remove(&r.mem.addr());
        Some(r)
    }

    pub fn get(&self, id: RegionId) -> Option<Arc<Region>> {
        self.inner.read().by_id.get(&id).cloned()
    }

    pub fn len(&self) -> usize {
        self.inner.read().by_id.len()
    }

    pub fn ids(&self) -> Vec<RegionId> {
        self.inner.read().by_id.keys().copied().collect()
    }

    /// The region a peer may touch with `write` (or read) at
    /// `addr .. addr + len`: the whole range inside one region that allows
    /// the access, checked without overflow.
    pub fn remote(&self, addr: u64, len: u64, write: bool) -> std::result::Result<Arc<Region>, Status> {
        let end = addr.checked_add(len).ok_or(Status::OutOfBounds)?;
        let t = self.inner.read();
        let (_, r) = t.by_addr.range(..=addr).next_back().ok_or(Status::OutOfBounds)?;
        if end > r.mem.addr().saturating_add(r.mem.len() as u64) {
            return Err(Status::OutOfBounds);
        }
        let ok = if write { r.access.remote_write } else { r.access.remote_read };
        if !ok {
            return Err(Status::AccessDenied);
        }
        Ok(r.clone())
    }

    /// The regions peers may reach, for the segment descriptor.
    pub fn exposed(&self) -> Vec<WireRegion> {
        self.inner
            .read()
            .by_addr
            .values()
            .filter(|r| r.access.is_remote())
            .map(|r| WireRegion {
                addr: r.mem.addr(),
                len: r.mem.len() as u64,
                read: r.access.remote_read,
                write: r.access.remote_write,
            })
            .collect()
    }
}
