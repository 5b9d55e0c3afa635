//! Registered memory with canary bytes on both sides, so a stray write
//! outside a region (or after a terminal report) is seen, not suffered.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use transport_core::{Buffer, MemoryRegion};

use crate::devices::TestDevice;

use crate::outcome::CaseError;

/// Bytes of canary before and after every guarded region.
pub const GUARD: usize = 4096;
/// The canary byte.
pub const CANARY: u8 = 0xC5;

/// A region in the middle of a larger allocation whose edges hold
/// [`CANARY`] bytes. Made by [`crate::Ctx::guarded`], which keeps the
/// allocation alive until every transport of the case is gone. The
/// allocation is host memory, or (the suite's device runs) memory of a
/// device of [`crate::devices`] (a fake device that faults on any host
/// access, by default); every access here goes through the region, so the
/// same checks hold for both.
#[derive(Clone)]
pub struct Guarded {
    /// The whole allocation, guards included.
    whole: MemoryRegion,
    region: MemoryRegion,
    /// What keeps the allocation alive (a host buffer, or the device).
    _owner: Owner,
}

#[derive(Clone)]
enum Owner {
    Host(#[allow(dead_code)] Buffer),
    Device(Arc<dyn TestDevice>),
}

impl fmt::Debug for Guarded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Guarded")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("kind", &self.region.kind())
            .finish()
    }
}

impl Guarded {
    /// Allocates `len` bytes (plus guards) filled with `pattern(seed)`.
    pub(crate) fn new(len: usize, seed: u64) -> Result<Self, CaseError> {
        if len == 0 {
            return Err(CaseError::Fail("a guarded region needs at least one byte".into()));
        }
        let buf = Buffer::new(len + 2 * GUARD).map_err(|e| CaseError::Fail(format!("allocation failed: {e}")))?;
        Self::around(buf.region(), len, seed, Owner::Host(buf))
    }

    /// Like [`Guarded::new`], on a fresh device with index `device` of
    /// the device source ([`crate::devices`]): device memory the host
    /// cannot touch.
    pub(crate) fn on_device(len: usize, seed: u64, device: u32) -> Result<Self, CaseError> {
        if len == 0 {
            return Err(CaseError::Fail("a guarded region needs at least one byte".into()));
        }
        let dev = crate::devices::device(device, len + 2 * GUARD)?;
        let whole =
            dev.region(len + 2 * GUARD).map_err(|e| CaseError::Fail(format!("device allocation failed: {e}")))?;
        Self::around(whole, len, seed, Owner::Device(dev))
    }

    fn around(whole: MemoryRegion, len: usize, seed: u64, owner: Owner) -> Result<Self, CaseError> {
        whole.fill(CANARY);
        let region = whole.sub(GUARD, len).map_err(|e| CaseError::Fail(format!("cannot make a region: {e}")))?;
        let g = Self { whole, region, _owner: owner };
        g.fill_pattern(seed);
        Ok(g)
    }

    /// The device holding the bytes (`None` for host memory): to slow or
    /// fail its copies.
    pub fn device(&self) -> Option<&Arc<dyn TestDevice>> {
        match &self._owner {
            Owner::Device(d) => Some(d),
            Owner::Host(_) => None,
        }
    }

    /// Whether the bytes live on a (fake) device.
    pub fn is_device(&self) -> bool {
        self.region.kind().is_device()
    }

    /// The region to register.
    pub fn region(&self) -> MemoryRegion {
        self.region.clone()
    }

    /// Address of the first byte of the region.
    pub fn addr(&self) -> u64 {
        self.region.addr()
    }

    /// Length of the region.
    pub fn len(&self) -> usize {
        self.region.len()
    }

    /// Always false.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// A region over `offset .. offset + len` of this one (to test
    /// overlapping registration). Fails if it does not fit.
    pub fn sub(&self, offset: usize, len: usize) -> Result<MemoryRegion, CaseError> {
        self.region.check(offset as u64, len as u64).map_err(|e| CaseError::Fail(format!("bad sub-region: {e}")))?;
        self.region.sub(offset, len).map_err(|e| CaseError::Fail(format!("cannot make a sub-region: {e}")))
    }

    /// A copy of the region's bytes.
    pub fn snapshot(&self) -> Vec<u8> {
        self.region.to_vec()
    }

    /// Copies `data` into the region at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), CaseError> {
        self.region.write_at(offset, data).map_err(|e| CaseError::Fail(format!("local write failed: {e}")))
    }

    /// Fills the region with the deterministic [`pattern`] of `seed`.
    pub fn fill_pattern(&self, seed: u64) {
        let _ = self.region.write_at(0, &pattern(seed, self.len()));
    }

    /// Checks the canaries on both sides; names the first changed byte.
    pub fn canaries_intact(&self) -> Result<(), CaseError> {
        let all = self.whole.to_vec();
        let len = self.len();
        let before = &all[..GUARD];
        let after = &all[GUARD + len..];
        if let Some(i) = before.iter().position(|&b| b != CANARY) {
            return Err(CaseError::Fail(format!(
                "canary byte {} bytes before the region at {:#x} was overwritten",
                GUARD - i,
                self.addr()
            )));
        }
        if let Some(i) = after.iter().position(|&b| b != CANARY) {
            return Err(CaseError::Fail(format!(
                "canary byte {} bytes after the end of the region at {:#x} was overwritten",
                i + 1,
                self.addr()
            )));
        }
        Ok(())
    }

    /// Checks that the region equals `expected` and the canaries are intact.
    ///
    /// A mismatch says when: how long before the check the case last saw a
    /// batch reported terminal, and whether the bytes became right within
    /// [`LATE_WINDOW`] after it (and when): bytes that land after their
    /// batch was reported completed break rule 5, which a wrong offset
    /// would not explain.
    pub fn expect(&self, expected: &[u8], what: &str) -> Result<(), CaseError> {
        self.canaries_intact()?;
        let checked = Instant::now();
        let now = self.snapshot();
        let Some(i) = first_difference(&now, expected) else { return Ok(()) };
        let mut msg = format!(
            "{what}: byte {i} is {:#04x}, expected {:#04x}",
            now.get(i).copied().unwrap_or(0),
            expected.get(i).copied().unwrap_or(0)
        );
        if let Some(last) = crate::timeline::last_terminal(checked) {
            msg.push_str(&format!("; {last}"));
        }
        msg.push_str(&match self.becomes(expected, checked) {
            Some(after) => format!(
                "; the bytes became right {after:.3?} after the check: they landed after the state was reported \
                 (rule 5: once reported terminal, the transport never touches the memory again)"
            ),
            None => format!("; still wrong {LATE_WINDOW:?} after the check"),
        });
        Err(CaseError::Fail(msg))
    }

    /// How long after `checked` the region came to equal `expected`,
    /// watched for at most [`LATE_WINDOW`] (a failure path only: it sleeps
    /// the thread in short steps).
    fn becomes(&self, expected: &[u8], checked: Instant) -> Option<Duration> {
        let mut step = Duration::from_micros(100);
        while checked.elapsed() < LATE_WINDOW {
            std::thread::sleep(step);
            step = (step * 2).min(Duration::from_millis(20));
            if first_difference(&self.snapshot(), expected).is_none() {
                return Some(checked.elapsed());
            }
        }
        None
    }
}

/// How long a byte mismatch is watched for the bytes becoming right.
pub const LATE_WINDOW: Duration = Duration::from_secs(2);

/// The first index where `a` and `b` differ (or where one ends).
pub fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y).or(if a.len() == b.len() { None } else { Some(a.len().min(b.len())) })
}

/// Deterministic, seed-dependent bytes that never repeat the canary run.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes()[..(len - out.len()).min(8)]);
    }
    out
}
