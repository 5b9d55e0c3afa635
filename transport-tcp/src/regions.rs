//! Registered memory: one table for both sides (local sources and sinks,
//! and regions peers may reach), with a gate per region so unregister can
//! wait until no copy into or out of it is running.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use parking_lot::RwLock;
use transport_core::{Access, Error, ErrorKind, RegionId, Result};
use transport_mem::cma::PULL_MANY_MAX;
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
}

/// All live registrations of one transport.
#[derive(Debug, Default)]
pub(crate) struct RegionTable {
    inner: RwLock<Tables>,
}

impl RegionTable {
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
        let r = Arc::new(Region { id, mem, access, gate: RwLock::new(true) });
        t.by_addr.insert(start, r.clone());
        t.by_id.insert(id, r);
        Ok(())
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
