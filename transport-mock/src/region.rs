//! Registered regions of one host: lookup by handle and by address, the
//! overlap check, and the per-region lock that makes unregister and kill
//! wait for copies in progress.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use parking_lot::RwLock;
use transport_core::{Access, Error, ErrorKind, MemoryRegion, RegionId, RegionInfo, Result};

/// Whether a region may still be touched. Copies hold the read lock while
/// they move bytes; unregister and kill take the write lock, so when they
/// return no copy is running and none will start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RegionState {
    Live,
    Unregistered,
    /// Its host was killed, shut down or dropped.
    HostGone,
}

#[derive(Debug)]
pub(crate) struct RegionEntry {
    pub id: RegionId,
    pub mem: MemoryRegion,
    pub access: Access,
    pub state: RwLock<RegionState>,
}

impl RegionEntry {
    /// Whether `[addr, addr + len)` shares a byte with this region.
    pub fn overlaps_range(&self, addr: u64, len: u64) -> bool {
        let end = addr.saturating_add(len);
        let mine = self.mem.addr().saturating_add(self.mem.len() as u64);
        addr < mine && self.mem.addr() < end
    }

    /// Marks the region dead; returns once no copy touches it.
    pub fn retire(&self, state: RegionState) {
        *self.state.write() = state;
    }
}

#[derive(Debug, Default)]
pub(crate) struct RegionTable {
    by_id: HashMap<RegionId, Arc<RegionEntry>>,
    by_addr: BTreeMap<u64, Arc<RegionEntry>>,
}

impl RegionTable {
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Adds a region; overlap with a live one is `AlreadyRegistered`.
    pub fn insert(&mut self, entry: Arc<RegionEntry>) -> Result<()> {
        let start = entry.mem.addr();
        let end = start.saturating_add(entry.mem.len() as u64);
        if let Some((_, prev)) = self.by_addr.range(..end).next_back() {
            if prev.overlaps_range(start, end - start) {
                return Err(Error::new(ErrorKind::AlreadyRegistered, "memory overlaps a registered region")
                    .with("addr", format_args!("{start:#x}"))
                    .with("len", end - start)
                    .with("region", prev.id));
            }
        }
        self.by_addr.insert(start, entry.clone());
        self.by_id.insert(entry.id, entry);
        Ok(())
    }

    pub fn get(&self, id: RegionId) -> Option<Arc<RegionEntry>> {
        self.by_id.get(&id).cloned()
    }

    pub fn remove(&mut self, id: RegionId) -> Option<Arc<RegionEntry>> {
        let e = self.by_id.remove(&id)?;
        self.by_addr.remove(&e.mem.addr());
        Some(e)
    }

    pub fn drain(&mut self) -> Vec<Arc<RegionEntry>> {
        self.by_addr.clear();
        self.by_id.drain().map(|(_, e)| e).collect()
    }

    /// The region wholly containing `[addr, addr + len)`, as a peer's
    /// request names it; anything else is `OutOfBounds`.
    pub fn find_remote(&self, addr: u64, len: u64) -> Result<Arc<RegionEntry>> {
        let oob = || {
            Error::new(ErrorKind::OutOfBounds, "remote range is not inside one registered region")
                .with("remote_addr", format_args!("{addr:#x}"))
                .with("len", len)
        };
        let end = addr.checked_add(len).ok_or_else(oob)?;
        let (_, e) = self.by_addr.range(..=addr).next_back().ok_or_else(oob)?;
        if e.mem.contains(addr, end - addr) {
            Ok(e.clone())
        } else {
            Err(oob())
        }
    }

    /// The remotely accessible regions, as a descriptor lists them.
    pub fn infos(&self) -> Vec<RegionInfo> {
        self.by_addr
            .values()
            .filter(|e| e.access.is_remote())
            .map(|e| RegionInfo { addr: e.mem.addr(), len: e.mem.len() as u64, access: e.access, key: e.id.0 })
            .collect()
    }
}
