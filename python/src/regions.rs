//! The table of registered local memory, keyed by address, so the raw
//! addresses Python passes (`tensor.data_ptr()`, `buffer_addr`) map to a
//! `(region, offset)` pair the engine understands.

use std::collections::BTreeMap;

use pyo3::buffer::PyBuffer;
use transport_core::{Error, ErrorKind, MemoryRegion, RegionId, Result};

/// One registered range.
#[derive(Debug)]
pub(crate) struct Entry {
    pub(crate) id: RegionId,
    pub(crate) len: u64,
    /// The memory itself (for the local byte helpers).
    pub(crate) mem: MemoryRegion,
    /// For Python buffers: the buffer export that keeps the memory alive
    /// (and, for a `bytearray`, unresizable) until unregistered.
    pub(crate) keepalive: Option<PyBuffer<u8>>,
}

/// Registered regions by start address. Regions never overlap (the
/// transport refuses overlap, and so does [`Regions::check_free`]).
#[derive(Debug, Default)]
pub(crate) struct Regions {
    by_addr: BTreeMap<u64, Entry>,
}

impl Regions {
    /// Fails with `AlreadyRegistered` if `addr .. addr + len` overlaps a
    /// registered region.
    pub(crate) fn check_free(&self, addr: u64, len: u64) -> Result<()> {
        let end = addr.checked_add(len).ok_or_else(|| bad_range(addr, len))?;
        if let Some((&a, e)) = self.by_addr.range(..end).next_back() {
            if a.saturating_add(e.len) > addr {
                return Err(Error::new(ErrorKind::AlreadyRegistered, "memory overlaps a registered region")
                    .with("addr", format_args!("{addr:#x}"))
                    .with("registered", format_args!("{a:#x}+{}", e.len)));
            }
        }
        Ok(())
    }

    pub(crate) fn insert(&mut self, addr: u64, entry: Entry) {
        self.by_addr.insert(addr, entry);
    }

    /// The region registered at exactly `addr`.
    pub(crate) fn at(&self, addr: u64) -> Result<&Entry> {
        self.by_addr.get(&addr).ok_or_else(|| {
            Error::new(ErrorKind::Unregistered, "no region is registered at this address")
                .with("addr", format_args!("{addr:#x}"))
        })
    }

    pub(crate) fn remove(&mut self, addr: u64) -> Option<Entry> {
        self.by_addr.remove(&addr)
    }

    /// Maps `addr .. addr + len` to the region that holds it and the offset
    /// inside it. `Unregistered` when `addr` lies in no region, `OutOfBounds`
    /// when the range runs past the end of the region holding `addr`.
    pub(crate) fn locate(&self, addr: u64, len: u64) -> Result<(RegionId, u64)> {
        self.locate_entry(addr, len).map(|(e, off)| (e.id, off))
    }

    /// Like [`Regions::locate`], returning the entry.
    pub(crate) fn locate_entry(&self, addr: u64, len: u64) -> Result<(&Entry, u64)> {
        if len == 0 {
            return Err(Error::new(ErrorKind::InvalidRequest, "zero-length transfer"));
        }
        let (&start, e) =
            self.by_addr.range(..=addr).next_back().filter(|(&a, e)| addr - a < e.len).ok_or_else(|| {
                Error::new(ErrorKind::Unregistered, "local address is not inside registered memory")
                    .with("addr", format_args!("{addr:#x}"))
                    .with("len", len)
            })?;
        let offset = addr - start;
        match offset.checked_add(len) {
            Some(end) if end <= e.len => Ok((e, offset)),
            _ => Err(Error::new(ErrorKind::OutOfBounds, "local range runs past the end of its registered region")
                .with("addr", format_args!("{addr:#x}"))
                .with("len", len)
                .with("region", format_args!("{start:#x}+{}", e.len))),
        }
    }

    /// Removes every entry (at shutdown).
    pub(crate) fn drain(&mut self) -> Vec<Entry> {
        std::mem::take(&mut self.by_addr).into_values().collect()
    }

    pub(crate) fn len(&self) -> usize {
        self.by_addr.len()
    }
}

fn bad_range(addr: u64, len: u64) -> Error {
    Error::new(ErrorKind::OutOfBounds, "address range overflows")
        .with("addr", format_args!("{addr:#x}"))
        .with("len", len)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: u64, len: u64) -> Entry {
        // SAFETY: the tests never access the memory of these regions.
        let mem = unsafe { MemoryRegion::from_raw(0x1000, len as usize) }.unwrap();
        Entry { id: RegionId(id), len, mem, keepalive: None }
    }

    #[test]
    fn locate_maps_inside_and_rejects_outside() {
        let mut r = Regions::default();
        r.insert(0x1000, entry(1, 0x100));
        r.insert(0x2000, entry(2, 0x100));
        assert_eq!(r.locate(0x1000, 0x100).unwrap(), (RegionId(1), 0));
        assert_eq!(r.locate(0x2010, 0x10).unwrap(), (RegionId(2), 0x10));
        assert_eq!(r.locate(0x1100, 1).unwrap_err().kind(), ErrorKind::Unregistered);
        assert_eq!(r.locate(0xfff, 1).unwrap_err().kind(), ErrorKind::Unregistered);
        assert_eq!(r.locate(0x10f0, 0x20).unwrap_err().kind(), ErrorKind::OutOfBounds);
        assert_eq!(r.locate(0x1000, u64::MAX).unwrap_err().kind(), ErrorKind::OutOfBounds);
        assert_eq!(r.locate(0x1000, 0).unwrap_err().kind(), ErrorKind::InvalidRequest);
    }

    #[test]
    fn overlap_is_refused() {
        let mut r = Regions::default();
        r.insert(0x1000, entry(1, 0x100));
        assert!(r.check_free(0x1100, 0x10).is_ok());
        assert!(r.check_free(0xf00, 0x100).is_ok());
        assert_eq!(r.check_free(0x10ff, 1).unwrap_err().kind(), ErrorKind::AlreadyRegistered);
        assert_eq!(r.check_free(0xf00, 0x101).unwrap_err().kind(), ErrorKind::AlreadyRegistered);
        assert_eq!(r.check_free(u64::MAX, 2).unwrap_err().kind(), ErrorKind::OutOfBounds);
    }
}
