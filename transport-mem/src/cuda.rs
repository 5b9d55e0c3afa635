//! The CUDA provider: device memory of NVIDIA GPUs, reached through the
//! CUDA driver API (`libcuda`), loaded at run time, so a build with the
//! `cuda` feature runs on machines without a driver or a GPU (there
//! [`CudaDevices::open`] answers `None`).
//!
//! Pointers are classified as CUDA classifies them
//! (`cuPointerGetAttribute`): device memory (`cudaMalloc`, the caching
//! allocators of torch and friends, including their expandable segments,
//! which are several mappings back to back) is this provider's; managed
//! memory and pinned host memory are host memory the process reads
//! directly, and are left to the host path.
//!
//! Nothing is asked of the driver before it is needed. A device's primary
//! context (the one the CUDA runtime, and so torch, uses) is retained the
//! first time memory of that device is copied, never for devices this
//! process does not touch; a pointer is looked up in a context that is
//! already current or already active. Every call pushes the context it
//! needs and pops it after, so the caller's current context (torch's
//! current device) is left as it was. Copies run on a non-blocking stream
//! of this provider's (never the legacy default stream, which would wait
//! for the application's kernels) and return once the stream has finished
//! them: once a copy returns, its bytes are in place.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::fmt;
use std::marker::PhantomData;
use std::sync::{Mutex, MutexGuard};

use cudarc::driver::{result, sys};

use crate::device::{DeviceMemory, DmaBuf};
use crate::error::MemError;

/// One CUDA device: its handle, and once first used its retained primary
/// context and the streams copies run on.
struct Device {
    dev: sys::CUdevice,
    state: Mutex<DevState>,
}

impl Device {
    /// Its state (a panic elsewhere while it was held leaves it usable:
    /// every change is one assignment or push).
    fn state(&self) -> MutexGuard<'_, DevState> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[derive(Default)]
struct DevState {
    /// Retained on first use (a failure is not remembered: the next use
    /// tries again).
    ctx: Option<sys::CUcontext>,
    /// Streams not in use: each copy takes one (or makes one), so copies
    /// of several threads run side by side, and gives it back after.
    idle: Vec<sys::CUstream>,
}

/// Every CUDA device of this process, through their primary contexts.
pub struct CudaDevices {
    devices: Vec<Device>,
    /// `cuDriverGetVersion` (12020 for CUDA 12.2).
    driver: i32,
}

// SAFETY: CUDA context and stream handles may be used from any thread (the
// driver API is thread-safe; every use here pushes the context on the
// calling thread first and pops it after). The handles are only passed to
// the driver; a context is retained once (under its device's lock), a
// stream is used by one copy at a time, and both are released in `Drop`.
unsafe impl Send for CudaDevices {}
// SAFETY: as for `Send`: shared use only hands the handles to the driver.
unsafe impl Sync for CudaDevices {}

impl fmt::Debug for CudaDevices {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDevices").field("devices", &self.devices.len()).field("driver", &self.driver).finish()
    }
}

fn failed(device: u32, what: &str, e: impl fmt::Display) -> MemError {
    MemError::DeviceCopy { device, why: format!("{what}: {e}") }
}

/// The context pushed by [`CudaDevices::enter`], popped on drop (so the
/// caller's current context is current again). Not `Send`: it is popped
/// on the thread that pushed it.
struct Pushed(bool, PhantomData<*const ()>);

impl Pushed {
    fn popped_on_drop() -> Pushed {
        Pushed(true, PhantomData)
    }

    fn nothing() -> Pushed {
        Pushed(false, PhantomData)
    }
}

impl Drop for Pushed {
    fn drop(&mut self) {
        if self.0 {
            let mut popped: sys::CUcontext = std::ptr::null_mut();
            // SAFETY: pops the context this guard pushed on this thread
            // (guards are dropped in reverse order of their pushes); the
            // driver writes the popped handle into `popped`.
            let _ = unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
        }
    }
}

/// Whether the CUDA driver library is already loaded in this process.
/// Device memory cannot exist in a process that has not loaded it, so the
/// process-wide lookup ([`crate::providers::find`]) starts CUDA only then,
/// and never starts the driver (or makes contexts) in a process that
/// moves host memory only.
pub fn driver_loaded() -> bool {
    [c"libcuda.so.1", c"libcuda.so"].iter().any(|name| {
        // SAFETY: `RTLD_NOLOAD` only looks the library up among those
        // already loaded (no constructor runs); a handle it returns holds
        // one more reference, given back at once.
        unsafe {
            let h = libc::dlopen(name.as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_LAZY);
            if h.is_null() {
                return false;
            }
            libc::dlclose(h);
            true
        }
    })
}

/// The memory type CUDA reports for device memory.
const DEVICE: u32 = sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32;

/// At most this many mappings back to back make one device range (an
/// expandable segment of torch's allocator maps 2 MiB or 20 MiB pages).
const MAX_SEGMENTS: usize = 1 << 16;

/// Overlapping device copies whose ranges are at least this far apart go
/// device to device in pieces of that distance; closer ones through a
/// host buffer of at most [`BOUNCE`] bytes.
const DIRECT_GAP: u64 = 1 << 20;
const BOUNCE: u64 = 4 << 20;

/// The oldest driver this provider calls (CUDA 11.0: the `_v2` primary
/// context calls cudarc binds).
const MIN_DRIVER: i32 = 11000;

impl CudaDevices {
    /// The CUDA devices of this machine: `Ok(None)` where there is no
    /// driver library or no device (the usual case on a CPU machine), an
    /// error where the driver is present but refuses to start. Loads the
    /// driver (tests and benchmarks allocate through it); no context is
    /// made yet.
    pub fn open() -> Result<Option<CudaDevices>, MemError> {
        // SAFETY: only tries to dlopen the driver library by its usual
        // names; no symbol is called.
        if !unsafe { sys::is_culib_present() } {
            return Ok(None);
        }
        if let Err(e) = result::init() {
            // No device (CUDA_ERROR_NO_DEVICE) or no usable driver: no
            // CUDA memory can exist in this process either.
            if e.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE || e.0 == sys::CUresult::CUDA_ERROR_NOT_INITIALIZED {
                return Ok(None);
            }
            return Err(failed(0, "cuInit", format_args!("{e:?}")));
        }
        let mut driver = 0;
        // SAFETY: the driver writes its version into `driver`.
        let r = unsafe { sys::cuDriverGetVersion(&mut driver) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(failed(0, "cuDriverGetVersion", format_args!("{r:?}")));
        }
        if driver < MIN_DRIVER {
            let why = format_args!("version {driver}, {MIN_DRIVER} or later needed");
            return Err(failed(0, "the CUDA driver is too old", why));
        }
        let n = result::device::get_count().map_err(|e| failed(0, "cuDeviceGetCount", format_args!("{e:?}")))?;
        let mut devices = Vec::new();
        for i in 0..n.max(0) {
            let dev = result::device::get(i).map_err(|e| failed(i as u32, "cuDeviceGet", format_args!("{e:?}")))?;
            devices.push(Device { dev, state: Mutex::new(DevState::default()) });
        }
        Ok((!devices.is_empty()).then_some(CudaDevices { devices, driver }))
    }

    /// How many devices.
    pub fn count(&self) -> usize {
        self.devices.len()
    }

    /// Device `d` and its primary context, retained on first use.
    fn ctx(&self, d: u32) -> Result<(&Device, sys::CUcontext), MemError> {
        let dev = self.devices.get(d as usize).ok_or_else(|| failed(d, "no such CUDA device", d))?;
        let mut st = dev.state();
        if let Some(ctx) = st.ctx {
            return Ok((dev, ctx));
        }
        // SAFETY: `dev.dev` is a device handle from `cuDeviceGet`; the
        // retain is released once, in `Drop`.
        let ctx = unsafe { result::primary_ctx::retain(dev.dev) }
            .map_err(|e| failed(d, "cuDevicePrimaryCtxRetain", format_args!("{e:?}")))?;
        st.ctx = Some(ctx);
        Ok((dev, ctx))
    }

    /// Makes device `d`'s primary context current on this thread until the
    /// guard drops.
    fn enter(&self, d: u32) -> Result<Pushed, MemError> {
        let (_, ctx) = self.ctx(d)?;
        if result::ctx::get_current().ok().flatten() == Some(ctx) {
            return Ok(Pushed::nothing());
        }
        // SAFETY: `ctx` is retained until `Drop`, after every use.
        unsafe { sys::cuCtxPushCurrent_v2(ctx) }
            .result()
            .map_err(|e| failed(d, "cuCtxPushCurrent", format_args!("{e:?}")))?;
        Ok(Pushed::popped_on_drop())
    }

    /// A context to look pointers up in, if this thread has none: one
    /// already active (made by the application, or by this provider), so
    /// looking a pointer up never makes a context. `Ok(None)` with no
    /// context anywhere: then no device memory exists to find. An error
    /// when the context could not be made current (the caller of a copy
    /// must see the driver's refusal, not "not device memory").
    fn lookup_ctx(&self) -> Result<Option<Pushed>, MemError> {
        if result::ctx::get_current().ok().flatten().is_some() {
            return Ok(Some(Pushed::nothing()));
        }
        let active = self.devices.iter().position(|dev| {
            if dev.state().ctx.is_some() {
                return true;
            }
            let (mut flags, mut active) = (0u32, 0i32);
            // SAFETY: the driver writes the primary context's flags and
            // whether it is active into the two locals.
            let r = unsafe { sys::cuDevicePrimaryCtxGetState(dev.dev, &mut flags, &mut active) };
            r == sys::CUresult::CUDA_SUCCESS && active != 0
        });
        match active.and_then(|d| u32::try_from(d).ok()) {
            Some(d) => self.enter(d).map(Some),
            None => Ok(None),
        }
    }

    /// One attribute of the pointer `addr` (an integer attribute), looked
    /// up in the context current on this thread.
    fn attribute(addr: u64, attr: sys::CUpointer_attribute) -> Option<u32> {
        let mut v: u32 = 0;
        // SAFETY: the driver writes one 32-bit value (the memory type, the
        // device ordinal and the managed flag are `unsigned int`s) into
        // `v`, which lives across the call; `addr` is only looked up,
        // never dereferenced.
        let r = unsafe { sys::cuPointerGetAttribute(std::ptr::from_mut(&mut v).cast::<c_void>(), attr, addr) };
        (r == sys::CUresult::CUDA_SUCCESS).then_some(v)
    }

    /// The device of the (not managed) device memory at `addr`, looked up
    /// in the current context.
    fn device_at(addr: u64) -> Option<u32> {
        use sys::CUpointer_attribute as A;
        if Self::attribute(addr, A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE)? != DEVICE {
            return None;
        }
        if Self::attribute(addr, A::CU_POINTER_ATTRIBUTE_IS_MANAGED).unwrap_or(0) != 0 {
            return None; // the host reads managed memory itself
        }
        Self::attribute(addr, A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)
    }

    /// The allocation (or mapping) holding `addr`: its base and end.
    fn allocation(addr: u64) -> Option<(u64, u64)> {
        let (mut base, mut size) = (0 as sys::CUdeviceptr, 0usize);
        // SAFETY: the driver writes the allocation's base and size into the
        // two locals; `addr` is only looked up.
        let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr) };
        (r == sys::CUresult::CUDA_SUCCESS).then_some(())?;
        Some((base, base.checked_add(u64::try_from(size).ok()?)?))
    }

    /// The device of the device memory at `addr`, for a copy. Looked up
    /// with no context current too (memory of a context that is not a
    /// primary one: the lookup makes no context).
    fn device_for_copy(&self, addr: u64) -> Result<u32, MemError> {
        let _ctx = self.lookup_ctx()?;
        Self::device_at(addr).ok_or_else(|| MemError::NotDeviceMemory { addr, len: 0, provider: "cuda".into() })
    }

    /// Whether `addr` is memory mapped through CUDA's virtual memory
    /// management (`cuMemMap`: what an expandable segment is made of).
    fn mapped(addr: u64) -> bool {
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: the driver writes one handle into `h` (and takes a
        // reference on it, given back at once); `addr` is only looked up.
        unsafe {
            if sys::cuMemRetainAllocationHandle(&mut h, addr as *mut c_void) != sys::CUresult::CUDA_SUCCESS {
                return false;
            }
            let _ = sys::cuMemRelease(h);
        }
        true
    }

    /// Runs `copy` on one of device `d`'s streams (taken for this copy
    /// alone) and waits for it.
    fn copy_on(
        &self,
        d: u32,
        what: &str,
        copy: impl FnOnce(sys::CUstream) -> Result<(), result::DriverError>,
    ) -> Result<(), MemError> {
        let _pushed = self.enter(d)?;
        let (dev, _) = self.ctx(d)?;
        let taken = dev.state().idle.pop();
        let stream = match taken {
            Some(s) => s,
            None => result::stream::create(result::stream::StreamKind::NonBlocking)
                .map_err(|e| failed(d, "cuStreamCreate", format_args!("{e:?}")))?,
        };
        let r = copy(stream).map_err(|e| failed(d, what, format_args!("{e:?}"))).and_then(|()| {
            // SAFETY: `stream` is this copy's, made in `d`'s context.
            unsafe { result::stream::synchronize(stream) }
                .map_err(|e| failed(d, "cuStreamSynchronize", format_args!("{e:?}")))
        });
        // Waited for (or failed, when the context is unusable anyway):
        // nothing of this copy is left for a next one to wait behind.
        dev.state().idle.push(stream);
        r
    }

    /// `len` bytes from `src` to `dst` on the device where the two ranges
    /// overlap, as `memmove` does: in pieces no longer than the distance
    /// between them (device to device), or, for ranges closer than
    /// [`DIRECT_GAP`], through a host buffer of at most [`BOUNCE`] bytes;
    /// first to last when `dst` is below `src`, last to first otherwise.
    fn move_on_device(&self, dst: u64, src: u64, len: u64) -> Result<(), MemError> {
        let gap = dst.abs_diff(src);
        if gap == 0 {
            return Ok(());
        }
        let direct = gap >= DIRECT_GAP;
        let piece = if direct { gap } else { BOUNCE }.min(len);
        let mut bounce = if direct { Vec::new() } else { vec![0u8; piece as usize] };
        let mut done = 0u64;
        while done < len {
            let n = piece.min(len - done);
            let off = if dst < src { done } else { len - done - n };
            let (s, t) = (src + off, dst + off);
            if direct {
                let d = self.device_for_copy(t)?;
                // SAFETY: both pieces are device memory of registered
                // regions, and `n <= gap`: they do not overlap.
                self.copy_on(d, "cuMemcpyDtoDAsync", |st| unsafe { result::memcpy_dtod_async(t, s, n as usize, st) })?;
            } else {
                let b = &mut bounce[..n as usize];
                self.copy_to_host(s, b)?;
                self.copy_from_host(b, t)?;
            }
            done += n;
        }
        Ok(())
    }

    /// A point in the work queued so far on `stream`, a stream of the
    /// application's on device `d` (a `CUstream`: torch's
    /// `torch.cuda.current_stream().cuda_stream`): an event recorded on it,
    /// in `d`'s primary context. Work queued on `stream` later is not
    /// waited for. Nothing waits here: the application's stream goes on.
    pub fn mark(self: &std::sync::Arc<Self>, d: u32, stream: u64) -> Result<StreamPoint, MemError> {
        let _pushed = self.enter(d)?;
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
        let event = result::event::create(flags).map_err(|e| failed(d, "cuEventCreate", format_args!("{e:?}")))?;
        // SAFETY: `event` was made just now in `d`'s context; `stream` is
        // the caller's stream of device `d` (the caller's promise; the
        // driver refuses a handle it does not know).
        if let Err(e) = unsafe { result::event::record(event, stream as sys::CUstream) } {
            // SAFETY: the event made above, used by nothing else.
            let _ = unsafe { result::event::destroy(event) };
            return Err(failed(d, "cuEventRecord", format_args!("{e:?}")));
        }
        Ok(StreamPoint { devices: self.clone(), device: d, event })
    }

    /// `dst.len()` bytes of device memory at `src` into `dst`, once the
    /// work before `after` on the application's stream is done: the copy's
    /// stream waits for it on the device (`cuStreamWaitEvent`), so a layer
    /// is read after the kernels that wrote it without the caller waiting
    /// for them first. Returns once the bytes are in `dst`.
    pub fn copy_to_host_after(&self, after: &StreamPoint, src: u64, dst: &mut [u8]) -> Result<(), MemError> {
        let d = self.device_for_copy(src)?;
        let event = after.event;
        // SAFETY: as in `copy_to_host`; the event is alive while `after`
        // is borrowed.
        self.copy_on(d, "cuMemcpyDtoHAsync", |s| unsafe {
            result::stream::wait_event(s, event, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)?;
            result::memcpy_dtoh_async(dst, src, s)
        })
    }

    /// `len` bytes of device memory on device `d` (`cuMemAlloc`), freed
    /// when the returned allocation drops: for tests and benchmarks.
    pub fn alloc(self: &std::sync::Arc<Self>, d: u32, len: usize) -> Result<CudaAlloc, MemError> {
        let _pushed = self.enter(d)?;
        // SAFETY: a fresh allocation in device `d`'s primary context; freed
        // once in `CudaAlloc::drop`.
        let ptr = unsafe { result::malloc_sync(len) }.map_err(|_| MemError::AllocFailed { len })?;
        Ok(CudaAlloc { devices: self.clone(), device: d, ptr, len })
    }
}

impl Drop for CudaDevices {
    fn drop(&mut self) {
        for dev in &self.devices {
            let st = std::mem::take(&mut *dev.state());
            let Some(ctx) = st.ctx else { continue };
            // SAFETY: the streams were made in `ctx`, which is pushed for
            // their destruction (no copy runs: `self` is being dropped);
            // then the retain made in `ctx()` is given back, once.
            unsafe {
                if sys::cuCtxPushCurrent_v2(ctx) == sys::CUresult::CUDA_SUCCESS {
                    let _pop = Pushed::popped_on_drop();
                    for s in st.idle {
                        let _ = result::stream::destroy(s);
                    }
                }
                let _ = result::primary_ctx::release(dev.dev);
            }
        }
    }
}

impl DeviceMemory for CudaDevices {
    fn name(&self) -> &str {
        "cuda"
    }

    fn pci_bus_id(&self, device: u32) -> Option<String> {
        let dev = self.devices.get(device as usize)?;
        // "dddd:bb:dd.f" with a domain of up to 8 digits, and its NUL.
        let mut buf = [0 as std::ffi::c_char; 32];
        // SAFETY: the driver writes at most `buf.len()` bytes, NUL
        // included, into `buf`; `dev.dev` is a handle from `cuDeviceGet`.
        let r = unsafe { sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as std::ffi::c_int, dev.dev) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return None;
        }
        let bytes: Vec<u8> = buf.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
        String::from_utf8(bytes).ok()
    }

    fn device_of(&self, addr: u64, len: u64) -> Option<u32> {
        let end = addr.checked_add(len).filter(|_| len > 0)?;
        let d = {
            let _ctx = self.lookup_ctx().ok()?;
            Self::device_at(addr)?
        };
        // Ranges are looked up in the device's own context.
        let _pushed = self.enter(d).ok()?;
        // The whole range must be device memory of `d`: one allocation, or
        // mappings of `d` back to back (an expandable segment: both sides
        // of every boundary crossed are mapped memory; two allocations that
        // merely lie side by side are not one range).
        let mut at = addr;
        for _ in 0..MAX_SEGMENTS {
            let (_, seg_end) = Self::allocation(at)?;
            if end <= seg_end {
                return Some(d);
            }
            if !(Self::mapped(at) && Self::mapped(seg_end) && Self::device_at(seg_end)? == d) {
                return None;
            }
            at = seg_end;
        }
        None
    }

    fn copy_to_host(&self, src: u64, dst: &mut [u8]) -> Result<(), MemError> {
        let d = self.device_for_copy(src)?;
        // SAFETY: `src .. src + dst.len()` is device memory of a registered
        // region (its owner keeps it allocated, the region's contract); the
        // driver writes `dst.len()` bytes into `dst`, which outlives the
        // copy (`copy_on` waits for the stream).
        self.copy_on(d, "cuMemcpyDtoHAsync", |s| unsafe { result::memcpy_dtoh_async(dst, src, s) })
    }

    fn copy_from_host(&self, src: &[u8], dst: u64) -> Result<(), MemError> {
        let d = self.device_for_copy(dst)?;
        // SAFETY: as in `copy_to_host`, the other way: `src` is read until
        // the stream is done.
        self.copy_on(d, "cuMemcpyHtoDAsync", |s| unsafe { result::memcpy_htod_async(dst, src, s) })
    }

    fn copy_on_device(&self, dst: u64, src: u64, len: usize) -> Result<(), MemError> {
        let n = len as u64;
        let overlap = dst < src.saturating_add(n) && src < dst.saturating_add(n);
        if overlap {
            // cuMemcpy is no memmove.
            return self.move_on_device(dst, src, n);
        }
        let d = self.device_for_copy(dst)?;
        // SAFETY: both ranges are device memory of registered regions
        // (unified addressing: any context copies between devices), and
        // they do not overlap.
        self.copy_on(d, "cuMemcpyDtoDAsync", |s| unsafe { result::memcpy_dtod_async(dst, src, len, s) })
    }

    /// `cuMemGetHandleForAddressRange` with `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD`
    /// over the host pages holding the range (a driver of CUDA 11.7 or
    /// later, and a kernel with dma-buf support); `None` where that is not
    /// possible: an older driver, pages that reach past the allocation,
    /// or a driver that answers that it does not support it.
    fn export_dmabuf(&self, addr: u64, len: u64) -> Result<Option<DmaBuf>, MemError> {
        if self.driver < 11070 {
            return Ok(None); // no cuMemGetHandleForAddressRange
        }
        let d = self.device_for_copy(addr)?;
        let _pushed = self.enter(d)?;
        // SAFETY: `sysconf` only reads a system setting.
        let pg = u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).ok().filter(|&p| p > 0).unwrap_or(4096);
        let start = addr / pg * pg;
        let end = addr.checked_add(len).and_then(|e| e.checked_add(pg - 1)).ok_or(MemError::BadRange { addr, len })?
            / pg
            * pg;
        match Self::allocation(addr) {
            Some((base, alloc_end)) if base <= start && end <= alloc_end => {}
            _ => return Ok(None), // the pages run past the allocation
        }
        let size = usize::try_from(end - start).map_err(|_| MemError::BadRange { addr, len })?;
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: the driver writes one file descriptor into `fd`; the
        // range is device memory of a registered region (kept allocated by
        // its owner, the region's contract) and is only looked up. The
        // symbol exists: the driver is 11.7 or later (checked above).
        let r = unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut std::ffi::c_int).cast::<c_void>(),
                start,
                size,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        };
        if r == sys::CUresult::CUDA_ERROR_NOT_SUPPORTED || r == sys::CUresult::CUDA_ERROR_INVALID_VALUE {
            return Ok(None);
        }
        if r != sys::CUresult::CUDA_SUCCESS || fd < 0 {
            return Err(failed(d, "cuMemGetHandleForAddressRange", format_args!("{r:?}")));
        }
        // SAFETY: the driver just opened `fd` for us; nothing else owns it.
        let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        Ok(Some(DmaBuf { fd, offset: addr - start }))
    }

    /// `cuMemHostRegister` with `CU_MEMHOSTREGISTER_PORTABLE` (pinned for
    /// every context, so any device's copies use it), made in device 0's
    /// primary context. `Ok(false)` when the driver refuses (the memory
    /// is then plain pageable memory, still usable).
    unsafe fn pin_host(&self, addr: u64, len: usize) -> Result<bool, MemError> {
        if self.devices.is_empty() || len == 0 {
            return Ok(false);
        }
        let _pushed = self.enter(0)?;
        // SAFETY: the caller promises `addr .. addr + len` is host memory
        // of this process that stays mapped until `unpin_host`; the driver
        // only page-locks it.
        let r = unsafe { sys::cuMemHostRegister_v2(addr as *mut c_void, len, sys::CU_MEMHOSTREGISTER_PORTABLE) };
        Ok(r == sys::CUresult::CUDA_SUCCESS)
    }

    /// `cuMemHostUnregister`, in the context `pin_host` used.
    unsafe fn unpin_host(&self, addr: u64) {
        let Ok(_pushed) = self.enter(0) else { return };
        // SAFETY: the caller promises `addr` was registered by `pin_host`
        // and that no copy uses it now.
        let _ = unsafe { sys::cuMemHostUnregister(addr as *mut c_void) };
    }
}

/// A point in the work an application queued on one of its streams
/// ([`CudaDevices::mark`]): whatever that work writes is in place once
/// the point is reached. A copy made with [`CudaDevices::copy_to_host_after`]
/// waits for it on the device; [`StreamPoint::wait`] makes the caller wait
/// (before a NIC reads the memory directly, GPUDirect);
/// [`StreamPoint::reached`] asks without waiting. The event is destroyed
/// on drop.
pub struct StreamPoint {
    devices: std::sync::Arc<CudaDevices>,
    device: u32,
    event: sys::CUevent,
}

// SAFETY: an event handle may be used from any thread (the driver API is
// thread-safe; every use pushes the device's context first).
unsafe impl Send for StreamPoint {}
// SAFETY: as for `Send`: shared use only hands the handle to the driver.
unsafe impl Sync for StreamPoint {}

impl fmt::Debug for StreamPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamPoint").field("device", &self.device).finish()
    }
}

impl StreamPoint {
    /// Whether the work before the point is done (`cuEventQuery`), without
    /// waiting.
    pub fn reached(&self) -> Result<bool, MemError> {
        let _pushed = self.devices.enter(self.device)?;
        // SAFETY: the event is alive until `self` drops.
        match unsafe { result::event::query(self.event) } {
            Ok(()) => Ok(true),
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            Err(e) => Err(failed(self.device, "cuEventQuery", format_args!("{e:?}"))),
        }
    }

    /// Waits until the work before the point is done (`cuEventSynchronize`).
    pub fn wait(&self) -> Result<(), MemError> {
        let _pushed = self.devices.enter(self.device)?;
        // SAFETY: the event is alive until `self` drops.
        unsafe { result::event::synchronize(self.event) }
            .map_err(|e| failed(self.device, "cuEventSynchronize", format_args!("{e:?}")))
    }
}

impl Drop for StreamPoint {
    fn drop(&mut self) {
        if let Ok(_pushed) = self.devices.enter(self.device) {
            // SAFETY: the event made in `mark`, destroyed once; a copy
            // waiting for it has returned (it borrowed the point).
            let _ = unsafe { result::event::destroy(self.event) };
        }
    }
}

/// Device memory from [`CudaDevices::alloc`], freed on drop.
pub struct CudaAlloc {
    devices: std::sync::Arc<CudaDevices>,
    device: u32,
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl fmt::Debug for CudaAlloc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaAlloc").field("device", &self.device).field("len", &self.len).finish()
    }
}

impl CudaAlloc {
    /// The device address.
    pub fn addr(&self) -> u64 {
        self.ptr
    }

    /// The length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never: allocations have at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for CudaAlloc {
    fn drop(&mut self) {
        if let Ok(_pushed) = self.devices.enter(self.device) {
            // SAFETY: frees the allocation made in `CudaDevices::alloc`,
            // once; whoever registered it unregistered it first (the
            // region's contract).
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where there is no driver (every CI machine) the provider is not
    /// selected, and nothing panics on the way. The provider's own tests
    /// run against the CUDA driver double (`cuda-double/tests/provider.rs`),
    /// and against a real GPU in scripts/gpu-tests.sh.
    #[test]
    fn open_answers_none_or_real_devices() {
        let have_driver = driver_files_present();
        match CudaDevices::open() {
            Ok(None) => assert!(!have_driver || no_gpu(), "a driver and a GPU are present but none was opened"),
            Ok(Some(d)) => assert!(d.count() > 0),
            Err(e) => panic!("the CUDA driver refused to start: {e}"),
        }
    }

    fn driver_files_present() -> bool {
        ["/dev/nvidiactl", "/proc/driver/nvidia/version"].iter().any(|p| std::path::Path::new(p).exists())
    }

    fn no_gpu() -> bool {
        !std::path::Path::new("/dev/nvidia0").exists()
    }
}
