//! [`FakeDevice`]: device memory for tests that faults on any host access.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::fmt;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use crate::device::DeviceMemory;
use crate::error::MemError;
use crate::region::MemoryRegion;

/// Device memory for tests: a `memfd` mapped twice, `PROT_NONE` at the
/// "device" addresses handed out (any host access there is a fault) and
/// read-write in a second mapping only the provider uses for its copies.
/// Copies can be made to fail ([`FakeDevice::fail_copies`]), slow
/// ([`FakeDevice::delay_copies`]) or wait ([`FakeDevice::hold_copies`]);
/// host memory it pins is recorded ([`FakeDevice::pinned`]).
pub struct FakeDevice {
    device: u32,
    /// The inaccessible view: what users see as device addresses.
    base: u64,
    /// The provider's own view of the same pages.
    shadow: u64,
    len: usize,
    /// Bump allocator: the next free offset (never reused).
    next: Mutex<usize>,
    /// Copies left to fail.
    failing: AtomicU64,
    /// How long each copy takes, in microseconds (0: at once).
    delay_us: AtomicU64,
    copies: AtomicU64,
    /// Copies running now, and the most seen at once.
    running: Mutex<Running>,
    /// Signalled when copies are released or one ends.
    changed: Condvar,
    /// Host ranges pinned and not yet unpinned: address to length.
    pins: Mutex<HashMap<u64, usize>>,
    /// The PCI address it reports ([`FakeDevice::set_pci_bus_id`]).
    bus_id: Mutex<Option<String>>,
    _fd: OwnedFd,
}

/// Copies running on a fake device.
#[derive(Debug, Default)]
struct Running {
    now: u64,
    most: u64,
    /// Copies wait until released ([`FakeDevice::hold_copies`]).
    held: bool,
}

/// One copy running (counted in [`FakeDevice::in_flight`] until dropped).
struct Busy<'a>(&'a FakeDevice);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        let mut r = self.0.running();
        r.now = r.now.saturating_sub(1);
        self.0.changed.notify_all();
    }
}

impl fmt::Debug for FakeDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FakeDevice")
            .field("device", &self.device)
            .field("base", &format_args!("{:#x}", self.base))
            .field("len", &self.len)
            .finish()
    }
}

fn page() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
}

impl FakeDevice {
    /// A fake device with index `device` and `capacity` bytes of memory
    /// (rounded up to whole pages), zeroed.
    pub fn new(device: u32, capacity: usize) -> Result<Self, MemError> {
        if capacity == 0 {
            return Err(MemError::ZeroLength);
        }
        let pg = page();
        let len = capacity.checked_add(pg - 1).ok_or(MemError::AllocFailed { len: capacity })? / pg * pg;
        let failed = MemError::AllocFailed { len };
        // SAFETY: memfd_create takes a NUL-terminated name (a C string
        // literal) and flags; the result is checked before use.
        let fd = unsafe { libc::memfd_create(c"kvmove-fake-device".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(failed);
        }
        // SAFETY: `fd` was just returned by memfd_create and is owned by
        // nothing else; OwnedFd closes it once.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let size = libc::off_t::try_from(len).map_err(|_| failed.clone())?;
        // SAFETY: ftruncate on a valid descriptor we own.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } != 0 {
            return Err(failed);
        }
        let map = |prot| {
            // SAFETY: a new shared mapping of our memfd at an address the
            // kernel chooses; no existing memory is touched; checked below.
            let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
            (p != libc::MAP_FAILED).then_some(p as u64)
        };
        let shadow = map(libc::PROT_READ | libc::PROT_WRITE).ok_or_else(|| failed.clone())?;
        let Some(base) = map(libc::PROT_NONE) else {
            // SAFETY: `shadow` is the mapping of `len` bytes made above.
            unsafe { libc::munmap(shadow as *mut libc::c_void, len) };
            return Err(failed);
        };
        Ok(Self {
            device,
            base,
            shadow,
            len,
            next: Mutex::new(0),
            failing: AtomicU64::new(0),
            delay_us: AtomicU64::new(0),
            copies: AtomicU64::new(0),
            running: Mutex::new(Running::default()),
            changed: Condvar::new(),
            pins: Mutex::new(HashMap::new()),
            bus_id: Mutex::new(None),
            _fd: fd,
        })
    }

    /// The PCI address this fake device reports as its place
    /// ([`DeviceMemory::pci_bus_id`]), for tests of the NIC choice on a
    /// fabricated topology; none by default.
    pub fn set_pci_bus_id(&self, bus_id: Option<String>) {
        *self.bus_id.lock().unwrap_or_else(|e| e.into_inner()) = bus_id;
    }

    /// `len` bytes of this device's memory (page-aligned, zeroed): its
    /// device address. Memory is never reused; [`MemError::AllocFailed`]
    /// once the capacity is used up.
    pub fn alloc(&self, len: usize) -> Result<u64, MemError> {
        if len == 0 {
            return Err(MemError::ZeroLength);
        }
        let pg = page();
        let mut next = self.next.lock().unwrap_or_else(|e| e.into_inner());
        let size = len.checked_add(pg - 1).ok_or(MemError::AllocFailed { len })? / pg * pg;
        let end = next.checked_add(size).filter(|&e| e <= self.len).ok_or(MemError::AllocFailed { len })?;
        let addr = self.base + *next as u64;
        *next = end;
        Ok(addr)
    }

    /// A region of `len` fresh bytes of this device's memory
    /// ([`FakeDevice::alloc`]). Safe: the fake device never frees its
    /// memory while it lives, and the region holds it.
    pub fn region(this: &Arc<Self>, len: usize) -> Result<MemoryRegion, MemError> {
        let addr = this.alloc(len)?;
        let provider: Arc<dyn DeviceMemory> = this.clone();
        // SAFETY: `addr .. addr + len` was just allocated on this device and
        // is never freed or reused while the device lives; the region keeps
        // the device alive through `provider`.
        unsafe { MemoryRegion::from_device(provider, addr, len) }
    }

    /// The next `n` copies (either way) fail with [`MemError::DeviceCopy`].
    pub fn fail_copies(&self, n: u64) {
        self.failing.store(n, Ordering::SeqCst);
    }

    /// Every copy from now on takes at least `delay` (as a slow or busy
    /// device's would): for tests of deadlines and cancellation that land
    /// while a copy runs. `Duration::ZERO` makes copies immediate again.
    pub fn delay_copies(&self, delay: std::time::Duration) {
        let us = u64::try_from(delay.as_micros()).unwrap_or(u64::MAX);
        self.delay_us.store(us, Ordering::SeqCst);
    }

    /// Copies started from now on wait (counted as in flight) until
    /// [`FakeDevice::release_copies`]: lets a test keep a copy running
    /// for as long as it needs, without timing.
    pub fn hold_copies(&self) {
        self.running().held = true;
    }

    /// Lets held copies (and later ones) run.
    pub fn release_copies(&self) {
        self.running().held = false;
        self.changed.notify_all();
    }

    /// Copies running now (held ones included).
    pub fn in_flight(&self) -> u64 {
        self.running().now
    }

    /// The most copies that ran at once since the device was made.
    pub fn max_in_flight(&self) -> u64 {
        self.running().most
    }

    /// Waits until `n` copies run at once, at most `limit`; whether they did.
    /// For tests that hold copies and then look at what is in flight.
    pub fn wait_in_flight(&self, n: u64, limit: std::time::Duration) -> bool {
        let end = std::time::Instant::now() + limit;
        let mut r = self.running();
        while r.now < n {
            let left = end.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return false;
            }
            r = self.changed.wait_timeout(r, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        true
    }

    /// Host ranges pinned through this device and not yet unpinned.
    pub fn pinned(&self) -> usize {
        self.pins.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    fn running(&self) -> std::sync::MutexGuard<'_, Running> {
        self.running.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts a copy as running, once no hold stops it.
    fn busy(&self) -> Busy<'_> {
        let mut r = self.running();
        r.now += 1;
        r.most = r.most.max(r.now);
        // Wakes a test waiting for copies in flight.
        self.changed.notify_all();
        while r.held {
            r = self.changed.wait(r).unwrap_or_else(|e| e.into_inner());
        }
        Busy(self)
    }

    /// Injected failures not yet used by a copy.
    pub fn failures_left(&self) -> u64 {
        self.failing.load(Ordering::SeqCst)
    }

    /// Copies made so far (either way, failed ones included).
    pub fn copies(&self) -> u64 {
        self.copies.load(Ordering::Relaxed)
    }

    /// The device index.
    pub fn index(&self) -> u32 {
        self.device
    }

    /// The provider's view of `addr .. addr + len`, after the checks.
    fn shadow_of(&self, addr: u64, len: usize) -> Result<u64, MemError> {
        self.copies.fetch_add(1, Ordering::Relaxed);
        let delay = self.delay_us.load(Ordering::SeqCst);
        if delay > 0 {
            std::thread::sleep(std::time::Duration::from_micros(delay));
        }
        let fail = self.failing.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok();
        if fail {
            return Err(MemError::DeviceCopy { device: self.device, why: "a fault injected by the test".into() });
        }
        if self.device_of(addr, len as u64).is_none() {
            return Err(MemError::BadRange { addr, len: len as u64 });
        }
        Ok(self.shadow + (addr - self.base))
    }
}

impl DeviceMemory for FakeDevice {
    fn name(&self) -> &str {
        "fake"
    }

    fn device_of(&self, addr: u64, len: u64) -> Option<u32> {
        let end = addr.checked_add(len)?;
        (len > 0 && addr >= self.base && end <= self.base + self.len as u64).then_some(self.device)
    }

    fn pci_bus_id(&self, device: u32) -> Option<String> {
        if device != self.device {
            return None;
        }
        self.bus_id.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn copy_to_host(&self, src: u64, dst: &mut [u8]) -> Result<(), MemError> {
        let _busy = self.busy();
        let from = self.shadow_of(src, dst.len())?;
        // SAFETY: `from .. from + dst.len()` lies inside the provider's
        // read-write mapping (checked by `shadow_of`), which lives as long
        // as `self`; `dst` is a distinct Rust slice.
        unsafe { std::ptr::copy_nonoverlapping(from as usize as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn copy_from_host(&self, src: &[u8], dst: u64) -> Result<(), MemError> {
        let _busy = self.busy();
        let to = self.shadow_of(dst, src.len())?;
        // SAFETY: as in `copy_to_host`, the other way; `ptr::copy` allows
        // a source that aliases the mapping.
        unsafe { std::ptr::copy(src.as_ptr(), to as usize as *mut u8, src.len()) };
        Ok(())
    }

    fn copy_on_device(&self, dst: u64, src: u64, len: usize) -> Result<(), MemError> {
        let _busy = self.busy();
        let from = self.shadow_of(src, len)?;
        let to = self.shadow_of(dst, len)?;
        // SAFETY: both ranges lie inside the provider's mapping (checked);
        // `ptr::copy` allows overlap.
        unsafe { std::ptr::copy(from as usize as *const u8, to as usize as *mut u8, len) };
        Ok(())
    }

    /// Records the range (nothing is locked: the fake device's copies do
    /// not need it); a range pinned twice is an error, as with CUDA.
    unsafe fn pin_host(&self, addr: u64, len: usize) -> Result<bool, MemError> {
        let mut pins = self.pins.lock().unwrap_or_else(|e| e.into_inner());
        if pins.contains_key(&addr) {
            return Err(MemError::DeviceCopy { device: self.device, why: "host memory pinned twice".into() });
        }
        pins.insert(addr, len);
        Ok(true)
    }

    unsafe fn unpin_host(&self, addr: u64) {
        self.pins.lock().unwrap_or_else(|e| e.into_inner()).remove(&addr);
    }
}

impl Drop for FakeDevice {
    fn drop(&mut self) {
        // SAFETY: both are the mappings of `len` bytes made in `new`, not
        // used after this (regions of this device hold an `Arc` to it).
        unsafe {
            libc::munmap(self.base as *mut libc::c_void, self.len);
            libc::munmap(self.shadow as *mut libc::c_void, self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Buffer, MemoryKind};

    fn device(cap: usize) -> Arc<FakeDevice> {
        Arc::new(FakeDevice::new(3, cap).unwrap())
    }

    fn region(dev: &Arc<FakeDevice>, len: usize) -> MemoryRegion {
        FakeDevice::region(dev, len).unwrap()
    }

    #[test]
    fn device_regions_are_reached_through_the_provider() {
        let dev = device(1 << 20);
        let r = region(&dev, 10_000);
        assert_eq!(r.kind(), MemoryKind::Device(3));
        assert_eq!(r.kind().to_string(), "device:3");
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        r.write_at(0, &data).unwrap();
        let mut back = vec![0u8; 100];
        r.read_at(500, &mut back).unwrap();
        assert_eq!(back, data[500..600]);
        assert_eq!(r.to_vec(), data);
        assert!(r.read_at(9_990, &mut back).is_err(), "bounds are checked before the provider");
        // Host <-> device and device <-> device, through the region API.
        let host = Buffer::new(10_000).unwrap().region();
        host.copy_from(0, &r, 0, 10_000).unwrap();
        assert_eq!(host.to_vec(), data);
        let r2 = region(&dev, 10_000);
        r2.copy_from(0, &r, 0, 10_000).unwrap();
        assert_eq!(r2.to_vec(), data);
        r2.copy_from(0, &host, 1, 9_999).unwrap();
        assert_eq!(r2.to_vec()[..9_999], data[1..]);
        let sub = r.sub(100, 10).unwrap();
        assert_eq!(sub.kind(), MemoryKind::Device(3));
        sub.fill(0xAB);
        assert_eq!(r.to_vec()[100..110], [0xAB; 10]);
        assert_eq!(r.to_vec()[110], data[110]);
    }

    #[test]
    fn host_memory_is_not_taken_for_device_memory() {
        let dev = device(1 << 16);
        let host = Buffer::new(4096).unwrap();
        // SAFETY: the buffer outlives the call; the call only checks.
        let e = unsafe { MemoryRegion::from_device(dev.clone(), host.region().addr(), 4096) }.unwrap_err();
        assert!(matches!(e, MemError::NotDeviceMemory { .. }), "{e}");
        let addr = dev.alloc(4096).unwrap();
        // SAFETY: as above; a range running past the device's memory.
        let e = unsafe { MemoryRegion::from_device(dev.clone(), addr, 1 << 20) }.unwrap_err();
        assert!(matches!(e, MemError::NotDeviceMemory { .. }), "{e}");
        assert!(dev.alloc(1 << 20).is_err(), "capacity is bounded");
    }

    #[test]
    fn failed_copies_are_errors() {
        let dev = device(1 << 16);
        let r = region(&dev, 4096);
        dev.fail_copies(1);
        let mut b = [0u8; 16];
        assert!(matches!(r.read_at(0, &mut b), Err(MemError::DeviceCopy { device: 3, .. })));
        r.read_at(0, &mut b).unwrap();
        assert!(dev.copies() >= 2);
    }

    #[test]
    fn delayed_copies_take_their_time() {
        let dev = device(1 << 16);
        let r = region(&dev, 4096);
        dev.delay_copies(std::time::Duration::from_millis(30));
        let t = std::time::Instant::now();
        r.write_at(0, &[1, 2, 3]).unwrap();
        assert!(t.elapsed() >= std::time::Duration::from_millis(30), "{:?}", t.elapsed());
        dev.delay_copies(std::time::Duration::ZERO);
        let mut b = [0u8; 3];
        r.read_at(0, &mut b).unwrap();
        assert_eq!(b, [1, 2, 3]);
    }

    #[test]
    fn held_copies_wait_and_are_counted() {
        let dev = device(1 << 16);
        let r = region(&dev, 4096);
        dev.hold_copies();
        let r2 = r.clone();
        let t = std::thread::spawn(move || r2.write_at(0, &[9; 8]));
        assert!(dev.wait_in_flight(1, std::time::Duration::from_secs(10)));
        assert_eq!(dev.in_flight(), 1);
        assert!(!t.is_finished(), "a held copy does not end");
        dev.release_copies();
        t.join().unwrap().unwrap();
        assert_eq!(dev.in_flight(), 0);
        assert_eq!(dev.max_in_flight(), 1);
        let mut b = [0u8; 8];
        r.read_at(0, &mut b).unwrap();
        assert_eq!(b, [9; 8]);
    }

    #[test]
    fn pins_are_recorded_until_undone() {
        let dev = device(1 << 16);
        let p: Arc<dyn DeviceMemory> = dev.clone();
        let mut a = crate::PinnedBuf::new(8192, Some(&p)).unwrap();
        let b = crate::PinnedBuf::new(4096, Some(&p)).unwrap();
        let c = crate::PinnedBuf::new(4096, None).unwrap();
        assert!(a.pinned() && b.pinned() && !c.pinned());
        assert_eq!(dev.pinned(), 2);
        a[8191] = 1;
        assert_eq!((a.len(), a[8191]), (8192, 1));
        drop(a);
        assert_eq!(dev.pinned(), 1);
        drop(b);
        drop(c);
        assert_eq!(dev.pinned(), 0);
    }

    /// The one property the fake device exists for: the host cannot touch
    /// its memory. A child process reads a device address directly and
    /// must die of SIGSEGV.
    #[test]
    fn host_access_to_fake_device_memory_faults() {
        let dev = device(1 << 16);
        let addr = dev.alloc(4096).unwrap();
        // SAFETY: fork in a test; the child only reads one byte (faulting)
        // and calls `_exit`, both async-signal-safe.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            // SAFETY: deliberately invalid: the page is PROT_NONE, the read
            // faults (that is the test); `_exit` if it does not.
            unsafe {
                let _ = std::ptr::read_volatile(addr as usize as *const u8);
                libc::_exit(0);
            }
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        let got = unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(got, pid);
        assert!(libc::WIFSIGNALED(status), "the child read device memory as host memory and lived: {status:#x}");
        assert_eq!(libc::WTERMSIG(status), libc::SIGSEGV);
    }
}
