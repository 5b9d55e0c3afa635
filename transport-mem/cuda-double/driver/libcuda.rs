//! A CUDA driver double: a shared library with the driver API's symbols
//! and ABI, loaded where the real `libcuda.so.1` would be (a directory on
//! `LD_LIBRARY_PATH` holding it under the driver's names), so kvmove's
//! CUDA provider (`transport-mem/src/cuda.rs`) runs its real code on a
//! machine without a GPU.
//!
//! What it keeps of the driver's documented behaviour, because the
//! provider depends on it:
//! - device memory the host cannot touch: a `memfd` mapped `PROT_NONE` at
//!   the address handed out (a host access faults) and read-write in a
//!   second mapping only the double's copies use;
//! - devices, primary contexts with reference counts (a context whose
//!   count falls to zero is destroyed), a current-context stack per
//!   thread, and calls that need a current context failing without one;
//! - streams whose asynchronous copies happen at `cuStreamSynchronize`
//!   (or a sync of an event recorded after them), not before: a caller
//!   that uses the bytes early sees the old ones;
//! - pointer attributes of device, managed, registered host and plain host
//!   memory; allocations made of several mappings back to back (what
//!   torch's expandable segments are: `cuMemAddressReserve`,
//!   `cuMemCreate`, `cuMemMap`); host registration; a dma-buf file
//!   descriptor per exported range; `cuInit` failing as on a machine with
//!   a driver and no GPU (`KVMOVE_CUDA_DOUBLE_DEVICES=0`).
//!
//! And what a test needs beyond the driver, through functions of its own
//! (`kvmove_double_*`, found with `dlsym`): any call made to fail on
//! demand with a chosen `CUresult`, a record of every call (name, thread,
//! current context, stream), counts of what is still held (contexts
//! retained, streams, events, registrations, allocation handles, dma-buf
//! descriptors, copies not yet run), and a "kernel" (a fill queued on a
//! stream) for tests of copies that must wait for the application's work.
//!
//! Settings, read by `cuInit` and `cuDriverGetVersion`:
//! `KVMOVE_CUDA_DOUBLE_DEVICES` (default 2), `KVMOVE_CUDA_DOUBLE_DRIVER`
//! (the version reported, default 12020), `KVMOVE_CUDA_DOUBLE_INIT` (a
//! `CUresult` every `cuInit` returns). It is for tests only: never install
//! it where a real driver is expected.
//!
//! Built by this crate's build script with `rustc` alone (no crates: the
//! few C library calls it makes are declared below), as
//! `libkvmove_cuda_double.so` with the soname `libcuda.so.1`; the crate's
//! library says where ([`crate::library`] there).
#![allow(unsafe_code)]
#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void, CStr};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

/// The C library calls the double makes (Linux, x86_64 and aarch64).
mod libc {
    pub use std::ffi::{c_char, c_int, c_long, c_uint, c_void};
    #[allow(non_camel_case_types)]
    pub type off_t = i64;
    pub const PROT_NONE: c_int = 0;
    pub const PROT_READ: c_int = 1;
    pub const PROT_WRITE: c_int = 2;
    pub const MAP_SHARED: c_int = 0x01;
    pub const MAP_PRIVATE: c_int = 0x02;
    pub const MAP_FIXED: c_int = 0x10;
    pub const MAP_ANONYMOUS: c_int = 0x20;
    pub const MAP_NORESERVE: c_int = 0x4000;
    pub const MAP_FAILED: *mut c_void = !0usize as *mut c_void;
    pub const MFD_CLOEXEC: c_uint = 1;
    pub const _SC_PAGESIZE: c_int = 30;
    extern "C" {
        pub fn memfd_create(name: *const c_char, flags: c_uint) -> c_int;
        pub fn ftruncate(fd: c_int, len: off_t) -> c_int;
        pub fn mmap(addr: *mut c_void, len: usize, prot: c_int, flags: c_int, fd: c_int, off: off_t) -> *mut c_void;
        pub fn munmap(addr: *mut c_void, len: usize) -> c_int;
        pub fn close(fd: c_int) -> c_int;
        pub fn sysconf(name: c_int) -> c_long;
    }
}

type CUresult = c_uint;
type Fallible = Result<(), CUresult>;

const SUCCESS: CUresult = 0;
const INVALID_VALUE: CUresult = 1;
const OUT_OF_MEMORY: CUresult = 2;
const NOT_INITIALIZED: CUresult = 3;
const NO_DEVICE: CUresult = 100;
const INVALID_DEVICE: CUresult = 101;
const INVALID_CONTEXT: CUresult = 201;
const INVALID_HANDLE: CUresult = 400;
const NOT_FOUND: CUresult = 500;
const NOT_READY: CUresult = 600;
const CONTEXT_IS_DESTROYED: CUresult = 709;
const HOST_MEMORY_ALREADY_REGISTERED: CUresult = 712;
const HOST_MEMORY_NOT_REGISTERED: CUresult = 713;
const NOT_SUPPORTED: CUresult = 801;

/// Names and descriptions `cuGetErrorName` / `cuGetErrorString` give.
const ERRORS: &[(CUresult, &CStr, &CStr)] = &[
    (SUCCESS, c"CUDA_SUCCESS", c"no error"),
    (INVALID_VALUE, c"CUDA_ERROR_INVALID_VALUE", c"invalid argument"),
    (OUT_OF_MEMORY, c"CUDA_ERROR_OUT_OF_MEMORY", c"out of memory"),
    (NOT_INITIALIZED, c"CUDA_ERROR_NOT_INITIALIZED", c"initialization error"),
    (NO_DEVICE, c"CUDA_ERROR_NO_DEVICE", c"no CUDA-capable device is detected"),
    (INVALID_DEVICE, c"CUDA_ERROR_INVALID_DEVICE", c"invalid device ordinal"),
    (INVALID_CONTEXT, c"CUDA_ERROR_INVALID_CONTEXT", c"invalid device context"),
    (INVALID_HANDLE, c"CUDA_ERROR_INVALID_HANDLE", c"invalid resource handle"),
    (NOT_FOUND, c"CUDA_ERROR_NOT_FOUND", c"named symbol not found"),
    (NOT_READY, c"CUDA_ERROR_NOT_READY", c"device not ready"),
    (700, c"CUDA_ERROR_ILLEGAL_ADDRESS", c"an illegal memory access was encountered"),
    (CONTEXT_IS_DESTROYED, c"CUDA_ERROR_CONTEXT_IS_DESTROYED", c"context is destroyed"),
    (
        HOST_MEMORY_ALREADY_REGISTERED,
        c"CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
        c"part or all of the requested memory range is already mapped",
    ),
    (
        HOST_MEMORY_NOT_REGISTERED,
        c"CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
        c"pointer does not correspond to a registered memory region",
    ),
    (719, c"CUDA_ERROR_LAUNCH_FAILED", c"unspecified launch failure"),
    (NOT_SUPPORTED, c"CUDA_ERROR_NOT_SUPPORTED", c"operation not supported"),
    (999, c"CUDA_ERROR_UNKNOWN", c"unknown error"),
];

/// Handles are small tagged integers, never addresses.
const CTX_BASE: usize = 0xc7_0000;
const STREAM_BASE: usize = 0x57_0000_0000;
const EVENT_BASE: usize = 0xe7_0000_0000;
/// Most devices, and the largest allocation, the double accepts.
const MAX_DEVICES: u32 = 16;
const MAX_ALLOC: u64 = 1 << 36;
/// Calls recorded at most (later ones are counted, not recorded).
const MAX_LOG: usize = 1 << 20;

/// What a device address range is.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `cuMemAlloc`: device memory.
    Device,
    /// `cuMemAllocManaged`: readable by the host.
    Managed,
    /// `cuMemMap` of a `cuMemCreate` allocation.
    Mapped { handle: u64 },
}

struct Mem {
    len: u64,
    dev: u32,
    kind: Kind,
    /// The read-write view of the same pages.
    shadow: usize,
    /// The memfd (and the length of both views) when this range owns them.
    own: Option<(c_int, usize)>,
}

/// A `cuMemCreate` allocation.
struct Phys {
    dev: u32,
    len: u64,
    fd: c_int,
    shadow: usize,
    /// Its own reference, each mapping's and each retain's.
    refs: u32,
}

enum Op {
    /// Bytes gathered from `src` pieces and scattered to `dst` pieces
    /// (addresses the double may touch: host memory or shadows).
    Copy { dst: Vec<(usize, usize)>, src: Vec<(usize, usize)> },
    /// A "kernel" of the application's: `byte` over the pieces.
    Fill { dst: Vec<(usize, usize)>, byte: u8 },
    /// Nothing later on this stream runs before `stream` ran `upto` ops.
    Wait { stream: usize, upto: u64 },
}

struct Stream {
    dev: u32,
    ops: VecDeque<Op>,
    /// Ops queued and ops run since it was made.
    queued: u64,
    done: u64,
}

struct Call {
    name: &'static str,
    thread: u64,
    ctx: usize,
    stream: usize,
}

#[derive(Default)]
struct State {
    init: bool,
    devices: u32,
    /// Each device's primary context's reference count.
    primary: Vec<u32>,
    mems: BTreeMap<u64, Mem>,
    phys: HashMap<u64, Phys>,
    /// Address ranges reserved (`cuMemAddressReserve`): base to length.
    reserved: BTreeMap<u64, u64>,
    /// Registered host memory: address to (length, device).
    hosts: BTreeMap<u64, (u64, u32)>,
    streams: HashMap<usize, Stream>,
    /// Events: where they were recorded (stream, ops queued then).
    events: HashMap<usize, Option<(usize, u64)>>,
    next: usize,
    calls: Vec<Call>,
    calls_dropped: u64,
    /// Flags of every stream made, in order.
    stream_flags: Vec<c_uint>,
    /// Calls to fail: name to (code, how many more times).
    failing: HashMap<String, (CUresult, u32)>,
    /// Copies to or from a device's memory left to fail, by device.
    copy_failures: HashMap<u32, u64>,
    /// How long a synchronization of a stream with copies pending takes,
    /// by device, in microseconds.
    copy_delay_us: HashMap<u32, u64>,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);
static THREADS: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// This thread's current-context stack (context handles).
    static STACK: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
    static THREAD: u64 = THREADS.fetch_add(1, Ordering::Relaxed);
}

fn lock() -> MutexGuard<'static, Option<State>> {
    STATE.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn current() -> usize {
    STACK.with(|s| s.borrow().last().copied().unwrap_or(0))
}

fn ctx_of(dev: u32) -> usize {
    CTX_BASE + dev as usize * 16
}

fn env_num(name: &str) -> Option<u64> {
    std::env::var(name).ok()?.trim().parse().ok()
}

/// Writes `v` where the caller asked for an output.
fn put<T>(p: *mut T, v: T) -> Fallible {
    if p.is_null() {
        return Err(INVALID_VALUE);
    }
    // SAFETY: the driver API's contract: an output pointer the caller
    // passes points to a writable, aligned `T` (null is refused above).
    unsafe { p.write(v) };
    Ok(())
}

/// One driver call: recorded, failed on demand, refused before `cuInit`.
fn api(name: &'static str, stream: usize, f: impl FnOnce(&mut State) -> Fallible) -> CUresult {
    let mut guard = lock();
    let st = guard.get_or_insert_with(State::default);
    if st.calls.len() < MAX_LOG {
        let thread = THREAD.with(|t| *t);
        st.calls.push(Call { name, thread, ctx: current(), stream });
    } else {
        st.calls_dropped += 1;
    }
    if let Some((code, left)) = st.failing.get_mut(name) {
        let code = *code;
        *left -= 1;
        if *left == 0 {
            st.failing.remove(name);
        }
        return code;
    }
    let before_init = matches!(name, "cuInit" | "cuDriverGetVersion" | "cuGetErrorName" | "cuGetErrorString");
    if !st.init && !before_init {
        return NOT_INITIALIZED;
    }
    match f(st) {
        Ok(()) => SUCCESS,
        Err(code) => code,
    }
}

fn page() -> u64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
}

fn round_up(n: u64) -> Option<u64> {
    let pg = page();
    n.checked_add(pg - 1).map(|x| x / pg * pg)
}

/// A memfd of `len` bytes and a read-write mapping of it.
fn shared_pages(len: usize, name: &CStr) -> Result<(c_int, usize), CUresult> {
    // SAFETY: memfd_create reads the NUL-terminated name; the rest are
    // plain calls on the descriptor it returns (closed on every failure).
    unsafe {
        let fd = libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC);
        if fd < 0 {
            return Err(OUT_OF_MEMORY);
        }
        let size = libc::off_t::try_from(len).map_err(|_| OUT_OF_MEMORY);
        if size.is_err() || libc::ftruncate(fd, size.unwrap_or(0)) != 0 {
            libc::close(fd);
            return Err(OUT_OF_MEMORY);
        }
        let rw = libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0);
        if rw == libc::MAP_FAILED {
            libc::close(fd);
            return Err(OUT_OF_MEMORY);
        }
        Ok((fd, rw as usize))
    }
}

/// Maps `len` bytes of `fd` from `offset` with no access at `at` (fixed)
/// or where the kernel likes (`at` 0): the addresses users see.
fn inaccessible(fd: c_int, len: usize, offset: u64, at: u64) -> Result<usize, CUresult> {
    let flags = libc::MAP_SHARED | if at == 0 { 0 } else { libc::MAP_FIXED };
    let off = libc::off_t::try_from(offset).map_err(|_| INVALID_VALUE)?;
    // SAFETY: maps pages of our memfd with no access; with MAP_FIXED only
    // over a range this double reserved (checked by the caller).
    let p = unsafe { libc::mmap(at as *mut c_void, len, libc::PROT_NONE, flags, fd, off) };
    if p == libc::MAP_FAILED {
        return Err(OUT_OF_MEMORY);
    }
    Ok(p as usize)
}

fn unmap(addr: usize, len: usize) {
    // SAFETY: unmaps a mapping this double made (its views and shadows are
    // never handed to anyone as host memory).
    unsafe { libc::munmap(addr as *mut c_void, len) };
}

impl State {
    fn need_ctx(&self) -> Result<u32, CUresult> {
        let ctx = current();
        if ctx == 0 {
            return Err(INVALID_CONTEXT);
        }
        let dev = self.ctx_dev(ctx).ok_or(INVALID_CONTEXT)?;
        if self.primary[dev as usize] == 0 {
            return Err(CONTEXT_IS_DESTROYED);
        }
        Ok(dev)
    }

    fn ctx_dev(&self, ctx: usize) -> Option<u32> {
        let off = ctx.checked_sub(CTX_BASE)?;
        let dev = u32::try_from(off / 16).ok()?;
        (off % 16 == 0 && dev < self.devices).then_some(dev)
    }

    fn dev(&self, d: c_int) -> Result<u32, CUresult> {
        u32::try_from(d).ok().filter(|&d| d < self.devices).ok_or(INVALID_DEVICE)
    }

    fn next(&mut self) -> usize {
        self.next += 1;
        self.next
    }

    /// The range holding `addr`: its base and what it is.
    fn find(&self, addr: u64) -> Option<(u64, &Mem)> {
        let (&base, m) = self.mems.range(..=addr).next_back()?;
        (addr - base < m.len).then_some((base, m))
    }

    /// Whether `addr` is device memory the host cannot touch.
    fn is_device(&self, addr: u64) -> bool {
        self.find(addr).is_some_and(|(_, m)| m.kind != Kind::Managed)
    }

    /// A copy touching device memory at `addrs` (device addresses): fails
    /// (CUDA_ERROR_ILLEGAL_ADDRESS) while failures are set for a device
    /// it touches ([`kvmove_double_fail_copies`]).
    fn copy_allowed(&mut self, addrs: &[u64]) -> Fallible {
        for &a in addrs {
            let Some(dev) = self.find(a).map(|(_, m)| m.dev) else { continue };
            if let Some(left) = self.copy_failures.get_mut(&dev).filter(|l| **l > 0) {
                *left -= 1;
                return Err(700);
            }
        }
        Ok(())
    }

    /// The shadow pieces of `len` device bytes at `addr`; every byte must
    /// be device (or managed) memory, across mappings back to back.
    fn pieces(&self, addr: u64, len: u64) -> Result<Vec<(usize, usize)>, CUresult> {
        let mut out = Vec::new();
        let mut at = addr;
        let end = addr.checked_add(len).ok_or(INVALID_VALUE)?;
        while at < end {
            let (base, m) = self.find(at).ok_or(INVALID_VALUE)?;
            let n = (base + m.len - at).min(end - at);
            out.push((m.shadow + (at - base) as usize, n as usize));
            at += n;
        }
        Ok(out)
    }

    /// A host buffer for a copy: it must not be device memory.
    fn host(&self, p: usize, len: usize) -> Result<Vec<(usize, usize)>, CUresult> {
        if p == 0 && len > 0 {
            return Err(INVALID_VALUE);
        }
        let end = (p as u64).checked_add(len as u64).ok_or(INVALID_VALUE)?;
        if self.is_device(p as u64) || (len > 0 && self.is_device(end - 1)) {
            return Err(INVALID_VALUE);
        }
        Ok(vec![(p, len)])
    }

    /// Queues `op` on `stream` (made in the current context), or runs it
    /// at once on the legacy default stream.
    fn enqueue(&mut self, stream: usize, op: Op) -> Fallible {
        let dev = self.need_ctx()?;
        if stream <= 2 {
            run_op(self, op);
            return Ok(());
        }
        let s = self.streams.get_mut(&stream).ok_or(INVALID_HANDLE)?;
        if s.dev != dev {
            return Err(INVALID_CONTEXT);
        }
        s.ops.push_back(op);
        s.queued += 1;
        Ok(())
    }

    /// Runs `stream`'s ops until `upto` of them ran.
    fn run(&mut self, stream: usize, upto: u64) {
        loop {
            let Some(s) = self.streams.get_mut(&stream) else { return };
            if s.done >= upto {
                return;
            }
            let Some(op) = s.ops.pop_front() else { return };
            s.done += 1;
            run_op(self, op);
        }
    }

    fn run_all(&mut self, stream: usize) {
        self.run(stream, u64::MAX);
    }

    fn free_phys(&mut self, handle: u64) {
        if let Some(p) = self.phys.get(&handle) {
            if p.refs == 0 {
                unmap(p.shadow, p.len as usize);
                // SAFETY: closes the memfd this allocation owned, once.
                unsafe { libc::close(p.fd) };
                self.phys.remove(&handle);
            }
        }
    }

    fn release(&mut self, handle: u64) -> Fallible {
        let p = self.phys.get_mut(&handle).ok_or(INVALID_HANDLE)?;
        p.refs = p.refs.saturating_sub(1);
        self.free_phys(handle);
        Ok(())
    }
}

fn run_op(st: &mut State, op: Op) {
    match op {
        Op::Copy { dst, src } => {
            let (mut di, mut si, mut doff, mut soff) = (0, 0, 0, 0);
            while di < dst.len() && si < src.len() {
                let n = (dst[di].1 - doff).min(src[si].1 - soff);
                // SAFETY: both sides were checked when the copy was queued:
                // shadows of live device memory, or host memory the caller
                // keeps valid until the stream is synchronized (the
                // driver's contract for asynchronous copies).
                unsafe { std::ptr::copy((src[si].0 + soff) as *const u8, (dst[di].0 + doff) as *mut u8, n) };
                doff += n;
                soff += n;
                if doff == dst[di].1 {
                    di += 1;
                    doff = 0;
                }
                if soff == src[si].1 {
                    si += 1;
                    soff = 0;
                }
            }
        }
        Op::Fill { dst, byte } => {
            for (p, n) in dst {
                // SAFETY: shadows of live device memory, checked when queued.
                unsafe { std::ptr::write_bytes(p as *mut u8, byte, n) };
            }
        }
        Op::Wait { stream, upto } => st.run(stream, upto),
    }
}

// ---- initialization and devices ----

#[no_mangle]
pub extern "C" fn cuInit(flags: c_uint) -> CUresult {
    api("cuInit", 0, |st| {
        if let Some(code) = env_num("KVMOVE_CUDA_DOUBLE_INIT").and_then(|c| CUresult::try_from(c).ok()) {
            return Err(code);
        }
        if flags != 0 {
            return Err(INVALID_VALUE);
        }
        if st.init {
            return Ok(());
        }
        let n = env_num("KVMOVE_CUDA_DOUBLE_DEVICES").unwrap_or(2).min(u64::from(MAX_DEVICES)) as u32;
        if n == 0 {
            return Err(NO_DEVICE);
        }
        st.devices = n;
        st.primary = vec![0; n as usize];
        st.init = true;
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CUresult {
    api("cuDriverGetVersion", 0, |_| {
        let v = env_num("KVMOVE_CUDA_DOUBLE_DRIVER").and_then(|v| c_int::try_from(v).ok()).unwrap_or(12020);
        put(version, v)
    })
}

#[no_mangle]
pub extern "C" fn cuGetErrorName(code: CUresult, out: *mut *const c_char) -> CUresult {
    api("cuGetErrorName", 0, |_| {
        let (_, name, _) = ERRORS.iter().find(|e| e.0 == code).ok_or(INVALID_VALUE)?;
        put(out, name.as_ptr())
    })
}

#[no_mangle]
pub extern "C" fn cuGetErrorString(code: CUresult, out: *mut *const c_char) -> CUresult {
    api("cuGetErrorString", 0, |_| {
        let (_, _, text) = ERRORS.iter().find(|e| e.0 == code).ok_or(INVALID_VALUE)?;
        put(out, text.as_ptr())
    })
}

#[no_mangle]
pub extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    api("cuDeviceGetCount", 0, |st| put(count, st.devices as c_int))
}

#[no_mangle]
pub extern "C" fn cuDeviceGet(dev: *mut c_int, ordinal: c_int) -> CUresult {
    api("cuDeviceGet", 0, |st| {
        let d = st.dev(ordinal)?;
        put(dev, d as c_int)
    })
}

#[no_mangle]
pub extern "C" fn cuDeviceGetPCIBusId(buf: *mut c_char, len: c_int, dev: c_int) -> CUresult {
    api("cuDeviceGetPCIBusId", 0, |st| {
        let d = st.dev(dev)?;
        let id = format!("0000:{:02x}:00.0\0", 0x17 + d);
        let cap = usize::try_from(len).map_err(|_| INVALID_VALUE)?;
        if buf.is_null() || cap < id.len() {
            return Err(INVALID_VALUE);
        }
        // SAFETY: the caller's buffer holds `len` bytes (checked to fit the
        // id and its NUL).
        unsafe { std::ptr::copy_nonoverlapping(id.as_ptr(), buf.cast::<u8>(), id.len()) };
        Ok(())
    })
}

// ---- contexts ----

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut *mut c_void, dev: c_int) -> CUresult {
    api("cuDevicePrimaryCtxRetain", 0, |st| {
        let d = st.dev(dev)?;
        put(ctx, ctx_of(d) as *mut c_void)?;
        st.primary[d as usize] += 1;
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: c_int) -> CUresult {
    api("cuDevicePrimaryCtxRelease_v2", 0, |st| {
        let d = st.dev(dev)?;
        let refs = &mut st.primary[d as usize];
        if *refs == 0 {
            return Err(INVALID_CONTEXT);
        }
        *refs -= 1;
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxGetState(dev: c_int, flags: *mut c_uint, active: *mut c_int) -> CUresult {
    api("cuDevicePrimaryCtxGetState", 0, |st| {
        let d = st.dev(dev)?;
        put(flags, 0)?;
        put(active, c_int::from(st.primary[d as usize] > 0))
    })
}

/// A context handle that names a live primary context.
fn live_ctx(st: &State, ctx: usize) -> Result<u32, CUresult> {
    let d = st.ctx_dev(ctx).ok_or(INVALID_CONTEXT)?;
    if st.primary[d as usize] == 0 {
        return Err(INVALID_CONTEXT);
    }
    Ok(d)
}

#[no_mangle]
pub extern "C" fn cuCtxGetCurrent(ctx: *mut *mut c_void) -> CUresult {
    api("cuCtxGetCurrent", 0, |_| put(ctx, current() as *mut c_void))
}

#[no_mangle]
pub extern "C" fn cuCtxSetCurrent(ctx: *mut c_void) -> CUresult {
    api("cuCtxSetCurrent", 0, |st| {
        let ctx = ctx as usize;
        if ctx != 0 {
            live_ctx(st, ctx)?;
        }
        STACK.with(|s| {
            let mut s = s.borrow_mut();
            s.pop();
            if ctx != 0 {
                s.push(ctx);
            }
        });
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuCtxPushCurrent_v2(ctx: *mut c_void) -> CUresult {
    api("cuCtxPushCurrent_v2", 0, |st| {
        live_ctx(st, ctx as usize)?;
        STACK.with(|s| s.borrow_mut().push(ctx as usize));
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuCtxPopCurrent_v2(ctx: *mut *mut c_void) -> CUresult {
    api("cuCtxPopCurrent_v2", 0, |_| {
        let top = STACK.with(|s| s.borrow_mut().pop()).ok_or(INVALID_CONTEXT)?;
        if !ctx.is_null() {
            put(ctx, top as *mut c_void)?;
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuCtxSynchronize() -> CUresult {
    api("cuCtxSynchronize", 0, |st| {
        let dev = st.need_ctx()?;
        let ids: Vec<usize> = st.streams.iter().filter(|(_, s)| s.dev == dev).map(|(&id, _)| id).collect();
        for id in ids {
            st.run_all(id);
        }
        Ok(())
    })
}

// ---- memory ----

#[no_mangle]
pub extern "C" fn cuMemAlloc_v2(dptr: *mut u64, size: usize) -> CUresult {
    api("cuMemAlloc_v2", 0, |st| {
        let dev = st.need_ctx()?;
        let len = size as u64;
        if len == 0 {
            return Err(INVALID_VALUE);
        }
        if len > MAX_ALLOC {
            return Err(OUT_OF_MEMORY);
        }
        let view_len = round_up(len).ok_or(OUT_OF_MEMORY)? as usize;
        let (fd, shadow) = shared_pages(view_len, c"kvmove-cuda-double")?;
        let view = match inaccessible(fd, view_len, 0, 0) {
            Ok(v) => v,
            Err(e) => {
                unmap(shadow, view_len);
                // SAFETY: the memfd made just above, not handed out.
                unsafe { libc::close(fd) };
                return Err(e);
            }
        };
        st.mems.insert(view as u64, Mem { len, dev, kind: Kind::Device, shadow, own: Some((fd, view_len)) });
        put(dptr, view as u64)
    })
}

#[no_mangle]
pub extern "C" fn cuMemAllocManaged(dptr: *mut u64, size: usize, _flags: c_uint) -> CUresult {
    api("cuMemAllocManaged", 0, |st| {
        let dev = st.need_ctx()?;
        let len = size as u64;
        if len == 0 || len > MAX_ALLOC {
            return Err(if len == 0 { INVALID_VALUE } else { OUT_OF_MEMORY });
        }
        let view_len = round_up(len).ok_or(OUT_OF_MEMORY)? as usize;
        let (fd, shadow) = shared_pages(view_len, c"kvmove-cuda-double-managed")?;
        st.mems.insert(shadow as u64, Mem { len, dev, kind: Kind::Managed, shadow, own: Some((fd, 0)) });
        put(dptr, shadow as u64)
    })
}

#[no_mangle]
pub extern "C" fn cuMemFree_v2(dptr: u64) -> CUresult {
    api("cuMemFree_v2", 0, |st| {
        st.need_ctx()?;
        match st.mems.get(&dptr) {
            Some(m) if m.kind != Kind::Device && m.kind != Kind::Managed => return Err(INVALID_VALUE),
            Some(_) => {}
            None => return Err(INVALID_VALUE),
        }
        if let Some(m) = st.mems.remove(&dptr) {
            if let Some((fd, view_len)) = m.own {
                let shadow_len = round_up(m.len).unwrap_or(m.len) as usize;
                unmap(m.shadow, shadow_len);
                if view_len > 0 {
                    unmap(dptr as usize, view_len);
                }
                // SAFETY: closes the memfd this allocation owned, once.
                unsafe { libc::close(fd) };
            }
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuPointerGetAttribute(data: *mut c_void, attribute: c_uint, ptr: u64) -> CUresult {
    api("cuPointerGetAttribute", 0, |st| {
        // The double asks for a current context here (the provider always
        // has one pushed when it looks a pointer up).
        st.need_ctx()?;
        const MEMORY_TYPE: c_uint = 2;
        const IS_MANAGED: c_uint = 8;
        const DEVICE_ORDINAL: c_uint = 9;
        const RANGE_START: c_uint = 11;
        const RANGE_SIZE: c_uint = 12;
        let (mtype, managed, dev, range) = if let Some((base, m)) = st.find(ptr) {
            (2u32, u32::from(m.kind == Kind::Managed), m.dev, Some((base, m.len)))
        } else if let Some((&base, &(len, dev))) =
            st.hosts.range(..=ptr).next_back().filter(|(&b, &(l, _))| ptr - b < l)
        {
            (1u32, 0, dev, Some((base, len))) // registered host memory
        } else {
            return Err(INVALID_VALUE); // plain host memory: unknown to CUDA
        };
        match attribute {
            MEMORY_TYPE => put(data.cast::<u32>(), mtype),
            IS_MANAGED => put(data.cast::<u32>(), managed),
            DEVICE_ORDINAL => put(data.cast::<u32>(), dev),
            RANGE_START => put(data.cast::<u64>(), range.map_or(0, |r| r.0)),
            RANGE_SIZE => put(data.cast::<usize>(), range.map_or(0, |r| r.1 as usize)),
            _ => Err(INVALID_VALUE),
        }
    })
}

#[no_mangle]
pub extern "C" fn cuMemGetAddressRange_v2(base: *mut u64, size: *mut usize, dptr: u64) -> CUresult {
    api("cuMemGetAddressRange_v2", 0, |st| {
        st.need_ctx()?;
        let (b, m) = st.find(dptr).ok_or(NOT_FOUND)?;
        let len = m.len as usize;
        if !base.is_null() {
            put(base, b)?;
        }
        if !size.is_null() {
            put(size, len)?;
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuMemHostRegister_v2(p: *mut c_void, size: usize, _flags: c_uint) -> CUresult {
    api("cuMemHostRegister_v2", 0, |st| {
        let dev = st.need_ctx()?;
        let (addr, len) = (p as u64, size as u64);
        let end = addr.checked_add(len).ok_or(INVALID_VALUE)?;
        if addr == 0 || len == 0 || st.is_device(addr) {
            return Err(INVALID_VALUE);
        }
        let overlaps = st.hosts.range(..end).next_back().is_some_and(|(&b, &(l, _))| b + l > addr);
        if overlaps {
            return Err(HOST_MEMORY_ALREADY_REGISTERED);
        }
        st.hosts.insert(addr, (len, dev));
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuMemHostUnregister(p: *mut c_void) -> CUresult {
    api("cuMemHostUnregister", 0, |st| {
        st.need_ctx()?;
        st.hosts.remove(&(p as u64)).map(|_| ()).ok_or(HOST_MEMORY_NOT_REGISTERED)
    })
}

#[no_mangle]
pub extern "C" fn cuMemGetHandleForAddressRange(
    handle: *mut c_void,
    dptr: u64,
    size: usize,
    handle_type: c_uint,
    _flags: c_ulonglong,
) -> CUresult {
    api("cuMemGetHandleForAddressRange", 0, |st| {
        st.need_ctx()?;
        const DMA_BUF_FD: c_uint = 1;
        let pg = page();
        let len = size as u64;
        if handle_type != DMA_BUF_FD || len == 0 || !dptr.is_multiple_of(pg) || !len.is_multiple_of(pg) {
            return Err(INVALID_VALUE);
        }
        let (base, m) = st.find(dptr).ok_or(INVALID_VALUE)?;
        if m.kind == Kind::Managed || dptr + len > base + m.len {
            return Err(INVALID_VALUE);
        }
        // SAFETY: memfd_create reads the NUL-terminated name.
        let fd = unsafe { libc::memfd_create(c"kvmove-cuda-double-dmabuf".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(OUT_OF_MEMORY);
        }
        put(handle.cast::<c_int>(), fd)
    })
}

// ---- virtual memory management (expandable segments) ----

#[no_mangle]
pub extern "C" fn cuMemAddressReserve(
    ptr: *mut u64,
    size: usize,
    _align: usize,
    _addr: u64,
    _flags: c_ulonglong,
) -> CUresult {
    api("cuMemAddressReserve", 0, |st| {
        let len = size as u64;
        if len == 0 || !len.is_multiple_of(page()) || len > MAX_ALLOC {
            return Err(INVALID_VALUE);
        }
        let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
        // SAFETY: a fresh anonymous reservation with no access.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), size, libc::PROT_NONE, flags, -1, 0) };
        if p == libc::MAP_FAILED {
            return Err(OUT_OF_MEMORY);
        }
        st.reserved.insert(p as u64, len);
        put(ptr, p as u64)
    })
}

#[no_mangle]
pub extern "C" fn cuMemAddressFree(ptr: u64, size: usize) -> CUresult {
    api("cuMemAddressFree", 0, |st| {
        if st.reserved.get(&ptr) != Some(&(size as u64)) {
            return Err(INVALID_VALUE);
        }
        if st.mems.range(ptr..ptr + size as u64).next().is_some() {
            return Err(INVALID_VALUE); // still mapped
        }
        st.reserved.remove(&ptr);
        unmap(ptr as usize, size);
        Ok(())
    })
}

/// `CUmemAllocationProp`'s leading fields (the double reads no others).
#[repr(C)]
struct AllocationProp {
    kind: c_uint,
    handle_types: c_uint,
    location_type: c_uint,
    location_id: c_int,
}

#[no_mangle]
pub extern "C" fn cuMemCreate(handle: *mut u64, size: usize, prop: *const c_void, _flags: c_ulonglong) -> CUresult {
    api("cuMemCreate", 0, |st| {
        if prop.is_null() {
            return Err(INVALID_VALUE);
        }
        // SAFETY: the caller passes a `CUmemAllocationProp`, whose first
        // four 32-bit fields are read (layout of the driver's header).
        let prop = unsafe { prop.cast::<AllocationProp>().read_unaligned() };
        let _ = (prop.kind, prop.handle_types, prop.location_type);
        let dev = st.dev(prop.location_id)?;
        let len = size as u64;
        if len == 0 || !len.is_multiple_of(page()) || len > MAX_ALLOC {
            return Err(INVALID_VALUE);
        }
        let (fd, shadow) = shared_pages(size, c"kvmove-cuda-double-vmm")?;
        let h = st.next() as u64;
        st.phys.insert(h, Phys { dev, len, fd, shadow, refs: 1 });
        put(handle, h)
    })
}

#[no_mangle]
pub extern "C" fn cuMemMap(ptr: u64, size: usize, offset: usize, handle: u64, _flags: c_ulonglong) -> CUresult {
    api("cuMemMap", 0, |st| {
        let (len, off) = (size as u64, offset as u64);
        let p = st.phys.get(&handle).ok_or(INVALID_HANDLE)?;
        let (dev, fd, shadow) = (p.dev, p.fd, p.shadow);
        if len == 0 || off.checked_add(len).is_none_or(|e| e > p.len) {
            return Err(INVALID_VALUE);
        }
        let end = ptr.checked_add(len).ok_or(INVALID_VALUE)?;
        let inside = st.reserved.range(..=ptr).next_back().is_some_and(|(&b, &l)| end <= b + l);
        let taken = st.mems.range(..end).next_back().is_some_and(|(&b, m)| b + m.len > ptr);
        if !inside || taken {
            return Err(INVALID_VALUE);
        }
        inaccessible(fd, size, off, ptr)?;
        st.mems.insert(ptr, Mem { len, dev, kind: Kind::Mapped { handle }, shadow: shadow + offset, own: None });
        if let Some(p) = st.phys.get_mut(&handle) {
            p.refs += 1;
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuMemSetAccess(ptr: u64, size: usize, desc: *const c_void, count: usize) -> CUresult {
    api("cuMemSetAccess", 0, |st| {
        if desc.is_null() || count == 0 {
            return Err(INVALID_VALUE);
        }
        st.pieces(ptr, size as u64).map(|_| ())
    })
}

#[no_mangle]
pub extern "C" fn cuMemUnmap(ptr: u64, size: usize) -> CUresult {
    api("cuMemUnmap", 0, |st| {
        let end = ptr.checked_add(size as u64).ok_or(INVALID_VALUE)?;
        let inside: Vec<u64> = st.mems.range(ptr..end).map(|(&b, _)| b).collect();
        if inside.is_empty() {
            return Err(INVALID_VALUE);
        }
        for b in inside {
            let Some(m) = st.mems.remove(&b) else { continue };
            let Kind::Mapped { handle } = m.kind else {
                st.mems.insert(b, m);
                return Err(INVALID_VALUE);
            };
            let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED;
            // SAFETY: puts the reservation back over a mapping this double
            // made inside it.
            unsafe { libc::mmap(b as *mut c_void, m.len as usize, libc::PROT_NONE, flags, -1, 0) };
            st.release(handle)?;
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuMemRetainAllocationHandle(handle: *mut u64, addr: *mut c_void) -> CUresult {
    api("cuMemRetainAllocationHandle", 0, |st| {
        let (_, m) = st.find(addr as u64).ok_or(INVALID_VALUE)?;
        let Kind::Mapped { handle: h } = m.kind else { return Err(INVALID_VALUE) };
        put(handle, h)?;
        if let Some(p) = st.phys.get_mut(&h) {
            p.refs += 1;
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuMemRelease(handle: u64) -> CUresult {
    api("cuMemRelease", 0, |st| st.release(handle))
}

// ---- streams, copies and events ----

#[no_mangle]
pub extern "C" fn cuStreamCreate(stream: *mut *mut c_void, flags: c_uint) -> CUresult {
    api("cuStreamCreate", 0, |st| {
        let dev = st.need_ctx()?;
        let id = STREAM_BASE + st.next() * 16;
        put(stream, id as *mut c_void)?;
        st.streams.insert(id, Stream { dev, ops: VecDeque::new(), queued: 0, done: 0 });
        st.stream_flags.push(flags);
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuStreamDestroy_v2(stream: *mut c_void) -> CUresult {
    api("cuStreamDestroy_v2", stream as usize, |st| {
        let id = stream as usize;
        if !st.streams.contains_key(&id) {
            return Err(INVALID_HANDLE);
        }
        st.run_all(id);
        st.streams.remove(&id);
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuStreamSynchronize(stream: *mut c_void) -> CUresult {
    // A slowed device's copies take their time outside the lock, so other
    // threads' driver calls go on meanwhile.
    let delay = {
        let guard = lock();
        guard.as_ref().and_then(|st| {
            let s = st.streams.get(&(stream as usize))?;
            let copies = s.ops.iter().any(|op| matches!(op, Op::Copy { .. }));
            st.copy_delay_us.get(&s.dev).copied().filter(|_| copies)
        })
    };
    if let Some(us) = delay.filter(|&us| us > 0) {
        std::thread::sleep(std::time::Duration::from_micros(us));
    }
    api("cuStreamSynchronize", stream as usize, |st| {
        let id = stream as usize;
        if id <= 2 {
            return Ok(());
        }
        if !st.streams.contains_key(&id) {
            return Err(INVALID_HANDLE);
        }
        st.run_all(id);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(dst: u64, src: *const c_void, n: usize, stream: *mut c_void) -> CUresult {
    api("cuMemcpyHtoDAsync_v2", stream as usize, |st| {
        st.copy_allowed(&[dst])?;
        let op = Op::Copy { dst: st.pieces(dst, n as u64)?, src: st.host(src as usize, n)? };
        st.enqueue(stream as usize, op)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(dst: *mut c_void, src: u64, n: usize, stream: *mut c_void) -> CUresult {
    api("cuMemcpyDtoHAsync_v2", stream as usize, |st| {
        st.copy_allowed(&[src])?;
        let op = Op::Copy { dst: st.host(dst as usize, n)?, src: st.pieces(src, n as u64)? };
        st.enqueue(stream as usize, op)
    })
}

#[no_mangle]
pub extern "C" fn cuMemcpyDtoDAsync_v2(dst: u64, src: u64, n: usize, stream: *mut c_void) -> CUresult {
    api("cuMemcpyDtoDAsync_v2", stream as usize, |st| {
        st.copy_allowed(&[dst, src])?;
        let op = Op::Copy { dst: st.pieces(dst, n as u64)?, src: st.pieces(src, n as u64)? };
        st.enqueue(stream as usize, op)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, n: usize) -> CUresult {
    api("cuMemcpyHtoD_v2", 0, |st| {
        let op = Op::Copy { dst: st.pieces(dst, n as u64)?, src: st.host(src as usize, n)? };
        st.enqueue(0, op)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, n: usize) -> CUresult {
    api("cuMemcpyDtoH_v2", 0, |st| {
        let op = Op::Copy { dst: st.host(dst as usize, n)?, src: st.pieces(src, n as u64)? };
        st.enqueue(0, op)
    })
}

#[no_mangle]
pub extern "C" fn cuMemsetD8_v2(dst: u64, byte: u8, n: usize) -> CUresult {
    api("cuMemsetD8_v2", 0, |st| {
        let op = Op::Fill { dst: st.pieces(dst, n as u64)?, byte };
        st.enqueue(0, op)
    })
}

#[no_mangle]
pub extern "C" fn cuMemsetD8Async(dst: u64, byte: u8, n: usize, stream: *mut c_void) -> CUresult {
    api("cuMemsetD8Async", stream as usize, |st| {
        let op = Op::Fill { dst: st.pieces(dst, n as u64)?, byte };
        st.enqueue(stream as usize, op)
    })
}

#[no_mangle]
pub extern "C" fn cuEventCreate(event: *mut *mut c_void, _flags: c_uint) -> CUresult {
    api("cuEventCreate", 0, |st| {
        st.need_ctx()?;
        let id = EVENT_BASE + st.next() * 16;
        put(event, id as *mut c_void)?;
        st.events.insert(id, None);
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuEventDestroy_v2(event: *mut c_void) -> CUresult {
    api("cuEventDestroy_v2", 0, |st| st.events.remove(&(event as usize)).map(|_| ()).ok_or(INVALID_HANDLE))
}

#[no_mangle]
pub extern "C" fn cuEventRecord(event: *mut c_void, stream: *mut c_void) -> CUresult {
    api("cuEventRecord", stream as usize, |st| {
        let (e, s) = (event as usize, stream as usize);
        if !st.events.contains_key(&e) {
            return Err(INVALID_HANDLE);
        }
        let at = if s <= 2 { None } else { Some((s, st.streams.get(&s).ok_or(INVALID_HANDLE)?.queued)) };
        st.events.insert(e, at);
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuEventQuery(event: *mut c_void) -> CUresult {
    api("cuEventQuery", 0, |st| {
        let at = *st.events.get(&(event as usize)).ok_or(INVALID_HANDLE)?;
        match at {
            Some((s, pos)) if st.streams.get(&s).is_some_and(|s| s.done < pos) => Err(NOT_READY),
            _ => Ok(()),
        }
    })
}

#[no_mangle]
pub extern "C" fn cuEventSynchronize(event: *mut c_void) -> CUresult {
    api("cuEventSynchronize", 0, |st| {
        if let Some((s, pos)) = *st.events.get(&(event as usize)).ok_or(INVALID_HANDLE)? {
            st.run(s, pos);
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuStreamWaitEvent(stream: *mut c_void, event: *mut c_void, _flags: c_uint) -> CUresult {
    api("cuStreamWaitEvent", stream as usize, |st| {
        let at = *st.events.get(&(event as usize)).ok_or(INVALID_HANDLE)?;
        let s = stream as usize;
        let Some((other, upto)) = at else { return Ok(()) };
        if s <= 2 {
            st.run(other, upto);
            return Ok(());
        }
        let target = st.streams.get_mut(&s).ok_or(INVALID_HANDLE)?;
        target.ops.push_back(Op::Wait { stream: other, upto });
        target.queued += 1;
        Ok(())
    })
}

// ---- the double's own functions, for tests ----

/// Queues a "kernel" of the application's on `stream`: `len` bytes of
/// device memory at `dst` set to `byte` when the stream gets there.
#[no_mangle]
pub extern "C" fn kvmove_double_launch(stream: *mut c_void, dst: u64, byte: u8, len: usize) -> CUresult {
    api("kvmove_double_launch", stream as usize, |st| {
        let op = Op::Fill { dst: st.pieces(dst, len as u64)?, byte };
        st.enqueue(stream as usize, op)
    })
}

/// The next `count` calls of the driver function `name` return `code`.
#[no_mangle]
pub unsafe extern "C" fn kvmove_double_fail(name: *const c_char, code: CUresult, count: c_uint) -> c_int {
    if name.is_null() || count == 0 {
        return -1;
    }
    // SAFETY: the caller passes a NUL-terminated string.
    let name = unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned();
    let mut guard = lock();
    guard.get_or_insert_with(State::default).failing.insert(name, (code, count));
    0
}

/// The next `count` copies to or from device `dev`'s memory fail with
/// CUDA_ERROR_ILLEGAL_ADDRESS when queued (0: none fail).
#[no_mangle]
pub extern "C" fn kvmove_double_fail_copies(dev: c_uint, count: u64) {
    let mut guard = lock();
    guard.get_or_insert_with(State::default).copy_failures.insert(dev, count);
}

/// How many of the failures set by [`kvmove_double_fail_copies`] for
/// device `dev` are left.
#[no_mangle]
pub extern "C" fn kvmove_double_copy_failures_left(dev: c_uint) -> u64 {
    let mut guard = lock();
    guard.get_or_insert_with(State::default).copy_failures.get(&dev).copied().unwrap_or(0)
}

/// Each synchronization of a stream of device `dev` with copies pending
/// takes `us` microseconds more (0: none).
#[no_mangle]
pub extern "C" fn kvmove_double_delay_copies(dev: c_uint, us: u64) {
    let mut guard = lock();
    guard.get_or_insert_with(State::default).copy_delay_us.insert(dev, us);
}

/// Forgets the calls recorded so far.
#[no_mangle]
pub extern "C" fn kvmove_double_clear_calls() {
    let mut guard = lock();
    let st = guard.get_or_insert_with(State::default);
    st.calls.clear();
    st.calls_dropped = 0;
}

/// How deep this thread's current-context stack is.
#[no_mangle]
pub extern "C" fn kvmove_double_stack_depth() -> c_uint {
    STACK.with(|s| s.borrow().len() as c_uint)
}

/// dma-buf descriptors the double exported that are still open in this
/// process (read from `/proc/self/fd`).
fn open_dmabufs() -> u64 {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else { return 0 };
    dir.filter_map(Result::ok)
        .filter(|e| {
            std::fs::read_link(e.path())
                .is_ok_and(|t| t.to_string_lossy().starts_with("/memfd:kvmove-cuda-double-dmabuf"))
        })
        .count() as u64
}

/// The double's state as JSON: every call recorded (`calls`: name, thread,
/// current context, stream), the flags of every stream made, and what is
/// still held (`live`). Writes at most `cap` bytes (NUL included) into
/// `buf`; returns the length the whole report needs (without its NUL).
#[no_mangle]
pub unsafe extern "C" fn kvmove_double_report(buf: *mut c_char, cap: usize) -> usize {
    let mut out = String::from("{\"calls\":[");
    {
        let mut guard = lock();
        let st = guard.get_or_insert_with(State::default);
        for (i, c) in st.calls.iter().enumerate() {
            let sep = if i == 0 { "" } else { "," };
            let _ = write!(out, "{sep}[\"{}\",{},{},{}]", c.name, c.thread, c.ctx, c.stream);
        }
        let flags: Vec<String> = st.stream_flags.iter().map(u32::to_string).collect();
        let pending: u64 = st.streams.values().map(|s| s.ops.len() as u64).sum();
        let _ = write!(
            out,
            "],\"calls_dropped\":{},\"stream_flags\":[{}],\"live\":{{\"contexts\":{},\"streams\":{},\"events\":{},\
             \"allocations\":{},\"host_registrations\":{},\"physical\":{},\"physical_refs\":{},\"reservations\":{},\
             \"dmabufs\":{},\"pending_ops\":{}}}}}",
            st.calls_dropped,
            flags.join(","),
            st.primary.iter().map(|&r| u64::from(r)).sum::<u64>(),
            st.streams.len(),
            st.events.len(),
            st.mems.values().filter(|m| m.own.is_some()).count(),
            st.hosts.len(),
            st.phys.len(),
            st.phys.values().map(|p| u64::from(p.refs)).sum::<u64>(),
            st.reserved.len(),
            open_dmabufs(),
            pending,
        );
    }
    if !buf.is_null() && cap > 0 {
        let n = out.len().min(cap - 1);
        // SAFETY: the caller's buffer holds `cap` bytes; `n + 1 <= cap`.
        unsafe {
            std::ptr::copy_nonoverlapping(out.as_ptr(), buf.cast::<u8>(), n);
            *buf.add(n) = 0;
        }
    }
    out.len()
}
