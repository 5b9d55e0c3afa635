//! The CUDA provider (`transport-mem/src/cuda.rs`) against the CUDA driver
//! double of this crate, loaded as the driver is (`libcuda.so.1` found on
//! `LD_LIBRARY_PATH`): every test re-runs itself in a child process whose
//! library path holds the double under the driver's names.
//!
//! With `KVMOVE_CUDA_TESTS=gpu` (scripts/gpu-tests.sh on a machine with an
//! NVIDIA GPU) the same tests run in this process against the real
//! driver, without the checks only the double can make (its record of
//! calls, failures on demand, its counts of what is held).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::ffi::c_int;
use std::sync::Arc;

use cudarc::driver::sys;
use kvmove_cuda_double::{under_double, Double, Driver};
use transport_mem::{CudaDevices, DeviceMemory, MemError, MemoryRegion};

fn devices() -> Arc<CudaDevices> {
    Arc::new(CudaDevices::open().unwrap().expect("no CUDA device"))
}

fn pattern(n: usize, k: usize) -> Vec<u8> {
    (0..n).map(|i| (i * k + i / 4093 + 1) as u8).collect()
}

/// The caller's current context (null for none).
fn current() -> sys::CUcontext {
    let mut c: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: the driver writes one handle.
    unsafe { sys::cuCtxGetCurrent(&mut c) }.result().unwrap();
    c
}

/// Device memory is claimed with its device index, the whole allocation
/// and nothing past it; host memory (plain, or pinned through the
/// provider) is not; nor is managed memory (the host reads it itself).
#[test]
fn cuda_pointers_are_classified() {
    let Some(driver) = under_double("cuda_pointers_are_classified", &[]) else { return };
    let cuda = devices();
    let a = cuda.alloc(0, 1 << 20).unwrap();
    assert_eq!(cuda.device_of(a.addr(), 1 << 20), Some(0));
    assert_eq!(cuda.device_of(a.addr() + 4096, 4096), Some(0));
    assert_eq!(cuda.device_of(a.addr(), (1 << 20) + 1), None, "past the allocation");
    assert_eq!(cuda.device_of(a.addr(), 0), None, "an empty range");
    assert_eq!(cuda.device_of(u64::MAX - 8, 16), None, "a range that overflows");
    let host = vec![0u8; 1 << 16];
    assert_eq!(cuda.device_of(host.as_ptr() as u64, 4096), None);
    assert_eq!(cuda.device_of(0, 16), None);
    // SAFETY: `host` stays allocated until unpinned below.
    assert!(unsafe { cuda.pin_host(host.as_ptr() as u64, host.len()) }.unwrap());
    assert_eq!(cuda.device_of(host.as_ptr() as u64, 4096), None, "pinned host memory is host memory");
    // SAFETY: pinned above, not in use.
    unsafe { cuda.unpin_host(host.as_ptr() as u64) };
    if cuda.count() > 1 {
        let b = cuda.alloc(1, 4096).unwrap();
        assert_eq!(cuda.device_of(b.addr(), 4096), Some(1));
    }
    // Managed memory, made by the application in its own context.
    let _app = AppContext::enter(0);
    let mut m: sys::CUdeviceptr = 0;
    // SAFETY: a fresh managed allocation, freed below.
    unsafe { sys::cuMemAllocManaged(&mut m, 1 << 16, 1) }.result().unwrap();
    assert_eq!(cuda.device_of(m, 4096), None, "managed memory is the host's to read");
    // SAFETY: allocated above, not in use.
    unsafe { sys::cuMemFree_v2(m) }.result().unwrap();
    if driver == Driver::Double {
        assert_eq!(Double::get().live("host_registrations"), 0);
    }
}

/// The application's own context made current on this thread (as torch
/// does), popped on drop.
struct AppContext(c_int);

impl AppContext {
    fn enter(dev: c_int) -> AppContext {
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: retains device `dev`'s primary context (released on drop)
        // and makes it current on this thread.
        unsafe {
            sys::cuInit(0).result().unwrap();
            sys::cuDevicePrimaryCtxRetain(&mut ctx, dev).result().unwrap();
            sys::cuCtxPushCurrent_v2(ctx).result().unwrap();
        }
        AppContext(dev)
    }
}

impl Drop for AppContext {
    fn drop(&mut self) {
        let mut c: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: pops the context `enter` pushed and gives its retain back.
        unsafe {
            let _ = sys::cuCtxPopCurrent_v2(&mut c);
            let _ = sys::cuDevicePrimaryCtxRelease_v2(self.0);
        }
    }
}

/// An expandable segment (several mappings of `cuMemCreate` allocations
/// back to back in one reserved range, as torch's allocator makes them)
/// is one range of its device; a range running past its last mapping is
/// not. Copies across the boundaries are byte-exact.
#[test]
fn expandable_segments_are_one_range() {
    let Some(driver) = under_double("expandable_segments_are_one_range", &[]) else { return };
    let cuda = devices();
    // The application (torch) keeps its context current while it works.
    let app = AppContext::enter(0);
    let seg = 2usize << 20;
    let (mut base, mut handles) = (0u64, Vec::new());
    // SAFETY: the virtual memory calls torch's expandable segments make;
    // everything is unmapped and released at the end of the test.
    unsafe {
        sys::cuMemAddressReserve(&mut base, 4 * seg, 0, 0, 0).result().unwrap();
        for i in 0..3 {
            let mut prop: sys::CUmemAllocationProp = std::mem::zeroed();
            prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
            prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
            prop.location.id = 0;
            let mut h: sys::CUmemGenericAllocationHandle = 0;
            sys::cuMemCreate(&mut h, seg, &prop, 0).result().unwrap();
            sys::cuMemMap(base + (i * seg) as u64, seg, 0, h, 0).result().unwrap();
            handles.push(h);
        }
        let mut access: sys::CUmemAccessDesc = std::mem::zeroed();
        access.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        access.location.id = 0;
        access.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        sys::cuMemSetAccess(base, 3 * seg, &access, 1).result().unwrap();
    }
    let total = (3 * seg) as u64;
    assert_eq!(cuda.device_of(base, total), Some(0), "three mappings back to back are one range");
    assert_eq!(cuda.device_of(base + seg as u64 - 4096, 8192), Some(0), "across one boundary");
    assert_eq!(cuda.device_of(base, total + 4096), None, "past the last mapping (reserved, unmapped)");
    // Bytes across both boundaries, through the provider.
    let bytes = pattern(seg + 8192, 7);
    let at = base + seg as u64 - 4096;
    cuda.copy_from_host(&bytes, at).unwrap();
    let mut back = vec![0u8; bytes.len()];
    cuda.copy_to_host(at, &mut back).unwrap();
    assert!(back == bytes, "a copy across mappings");
    // SAFETY: unmaps and releases what was made above; nothing uses it.
    unsafe {
        sys::cuMemUnmap(base, 3 * seg).result().unwrap();
        for h in handles {
            sys::cuMemRelease(h).result().unwrap();
        }
        sys::cuMemAddressFree(base, 4 * seg).result().unwrap();
    }
    drop(app);
    if driver == Driver::Double {
        let d = Double::get();
        assert_eq!(d.live("physical"), 0, "every allocation handle the provider retained was released");
    }
}

/// Copies both ways and on the device, through a region as the engine
/// makes them; the process-wide lookup finds the memory once the
/// application loaded the driver.
#[test]
fn cuda_regions_copy_through_the_driver() {
    let Some(_) = under_double("cuda_regions_copy_through_the_driver", &[]) else { return };
    let cuda = devices();
    let a = cuda.alloc(0, 1 << 20).unwrap();
    let (p, d) =
        transport_mem::providers::find(a.addr(), 1 << 20).expect("the lookup installs CUDA and finds the memory");
    assert_eq!((p.name(), d), ("cuda", 0));
    let provider: Arc<dyn DeviceMemory> = cuda.clone();
    // SAFETY: `a` outlives the region (dropped at the end of the test,
    // after the region).
    let r = unsafe { MemoryRegion::from_device(provider, a.addr(), 1 << 20) }.unwrap();
    let bytes = pattern(1 << 20, 7);
    r.write_at(0, &bytes).unwrap();
    let mut back = vec![0u8; 1 << 20];
    r.read_at(0, &mut back).unwrap();
    assert!(back == bytes);
    r.copy_from(4096, &r, 0, 4096).unwrap();
    r.read_at(4096, &mut back[..4096]).unwrap();
    assert!(back[..4096] == bytes[..4096]);
    drop(r);
}

/// A thread that never touched CUDA (a tokio worker, a Python thread)
/// finds and copies device memory, and whatever context the caller had
/// current is current again after each call: none on a fresh thread, the
/// application's own (another device's) on a thread that set one.
#[test]
fn cuda_works_from_a_fresh_thread_and_leaves_its_context_alone() {
    let Some(driver) = under_double("cuda_works_from_a_fresh_thread_and_leaves_its_context_alone", &[]) else {
        return;
    };
    let cuda = devices();
    let a = cuda.alloc(0, 1 << 16).unwrap();
    let addr = a.addr();
    let c = cuda.clone();
    std::thread::spawn(move || {
        assert!(current().is_null(), "a fresh thread has no context");
        assert_eq!(c.device_of(addr, 1 << 16), Some(0));
        let bytes = pattern(1 << 16, 13);
        c.copy_from_host(&bytes, addr).unwrap();
        let mut back = vec![0u8; 1 << 16];
        c.copy_to_host(addr, &mut back).unwrap();
        assert!(back == bytes);
        assert!(current().is_null(), "the pushed context was popped");
        if driver == Driver::Double {
            assert_eq!(Double::get().depth(), 0, "nothing left on this thread's context stack");
        }
    })
    .join()
    .unwrap();
    if cuda.count() > 1 {
        // The application works on device 1; the provider copies device
        // 0's memory from its thread.
        let app = AppContext::enter(1);
        let mine = current();
        let depth = (driver == Driver::Double).then(|| Double::get().depth());
        let mut back = vec![0u8; 4096];
        cuda.copy_to_host(addr, &mut back).unwrap();
        cuda.copy_from_host(&back, addr + 4096).unwrap();
        assert_eq!(cuda.device_of(addr, 4096), Some(0));
        assert_eq!(current(), mine, "the application's context is current again");
        if let Some(depth) = depth {
            assert_eq!(Double::get().depth(), depth, "the context stack is as the application left it");
        }
        drop(app);
    }
    assert!(cuda.export_dmabuf(addr, 4096).is_ok(), "an export is made or refused, never an error");
    drop(a);
}

/// Overlapping copies on the device move the bytes as `memmove` does
/// (`cuMemcpy` alone does not promise that).
#[test]
fn overlapping_device_copies_are_memmoves() {
    let Some(_) = under_double("overlapping_device_copies_are_memmoves", &[]) else { return };
    let cuda = devices();
    let n = 4 << 20;
    let a = cuda.alloc(0, n).unwrap();
    let bytes = pattern(n, 7);
    // Close (through the host) and far apart (device to device, in pieces
    // of the distance), both ways.
    let far = 1536 << 10;
    for (dst, src) in [(100usize, 0usize), (0, 100), (far, 0), (0, far)] {
        cuda.copy_from_host(&bytes, a.addr()).unwrap();
        let len = n - dst.max(src);
        cuda.copy_on_device(a.addr() + dst as u64, a.addr() + src as u64, len).unwrap();
        let mut want = bytes.clone();
        want.copy_within(src..src + len, dst);
        let mut back = vec![0u8; n];
        cuda.copy_to_host(a.addr(), &mut back).unwrap();
        assert!(back == want, "overlapping copy {src} -> {dst}");
    }
}

/// Copies run on non-blocking streams of the provider's own (never the
/// legacy default stream, which would wait behind the application's
/// kernels), in the device's context, and have run when the call
/// returns: the double runs a stream's copies only when it is
/// synchronized, so bytes read back early would be the old ones.
#[test]
fn copies_run_on_streams_of_their_own_and_are_done_on_return() {
    let Some(driver) = under_double("copies_run_on_streams_of_their_own_and_are_done_on_return", &[]) else {
        return;
    };
    if driver == Driver::Gpu {
        return; // what streams a copy used is the double's record only
    }
    let d = Double::get();
    let cuda = devices();
    let a = cuda.alloc(0, 1 << 20).unwrap();
    let bytes = pattern(1 << 20, 11);
    d.clear_calls();
    cuda.copy_from_host(&bytes, a.addr()).unwrap();
    assert_eq!(d.live("pending_ops"), 0, "the copy had run when copy_from_host returned");
    let mut back = vec![0u8; 1 << 20];
    cuda.copy_to_host(a.addr(), &mut back).unwrap();
    assert!(back == bytes, "the bytes read back are in place on return");
    cuda.copy_on_device(a.addr() + (512 << 10), a.addr(), 4096).unwrap();
    assert_eq!(d.live("pending_ops"), 0);
    let report = d.report();
    let calls = report["calls"].as_array().unwrap();
    let copies: Vec<_> = calls.iter().filter(|c| c[0].as_str().unwrap().starts_with("cuMemcpy")).collect();
    assert_eq!(copies.len(), 3, "{calls:?}");
    for c in &copies {
        let stream = c[3].as_u64().unwrap();
        assert!(stream > 2, "a copy on the legacy default stream: {c:?}");
        assert_ne!(c[2].as_u64().unwrap(), 0, "a copy with no current context: {c:?}");
    }
    for f in report["stream_flags"].as_array().unwrap() {
        assert_eq!(f.as_u64(), Some(1), "streams are made CU_STREAM_NON_BLOCKING");
    }
    let syncs = calls.iter().filter(|c| c[0] == "cuStreamSynchronize").count();
    assert_eq!(syncs, 3, "each copy waited for its stream");
}

/// Opening the provider asks the driver for its version and devices and
/// nothing more: no context is made until memory of a device is copied
/// (looking up host memory makes none), and then only that device's.
#[test]
fn no_context_before_first_use_and_only_the_device_used() {
    let Some(driver) = under_double("no_context_before_first_use_and_only_the_device_used", &[]) else { return };
    if driver == Driver::Gpu {
        return;
    }
    let d = Double::get();
    let cuda = devices();
    let host = vec![0u8; 4096];
    assert_eq!(cuda.device_of(host.as_ptr() as u64, 4096), None);
    let calls = d.calls();
    assert!(!calls.iter().any(|c| c.contains("Retain") || c.contains("Push")), "a context made before use: {calls:?}");
    assert_eq!(d.live("contexts"), 0);
    let a = cuda.alloc(0, 4096).unwrap();
    cuda.copy_from_host(&host, a.addr()).unwrap();
    let retains = d.calls().iter().filter(|c| *c == "cuDevicePrimaryCtxRetain").count();
    assert_eq!(retains, 1, "device 0's context retained once");
    assert_eq!(d.live("contexts"), 1, "device 1 untouched");
    drop(a);
    drop(cuda);
    assert_eq!(d.live("contexts"), 0, "the retain given back on drop");
}

/// After allocations, copies on several threads, pinning, a dma-buf export
/// and the provider's drop, nothing the provider took is still held:
/// contexts, streams, host registrations, allocation handles, dma-bufs.
#[test]
fn everything_taken_is_given_back() {
    let Some(driver) = under_double("everything_taken_is_given_back", &[]) else { return };
    if driver == Driver::Gpu {
        return;
    }
    let d = Double::get();
    let cuda = devices();
    let a = cuda.alloc(0, 1 << 20).unwrap();
    let b = cuda.alloc(1, 1 << 20).unwrap();
    let threads: Vec<_> = (0..4)
        .map(|i| {
            let (c, at) = (cuda.clone(), if i % 2 == 0 { a.addr() } else { b.addr() });
            std::thread::spawn(move || {
                let bytes = pattern(1 << 16, i + 3);
                let off = (i as u64) << 16;
                c.copy_from_host(&bytes, at + off).unwrap();
                let mut back = vec![0u8; 1 << 16];
                c.copy_to_host(at + off, &mut back).unwrap();
                assert!(back == bytes);
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let host = vec![0u8; 1 << 16];
    // SAFETY: `host` outlives the registration (unpinned below).
    assert!(unsafe { cuda.pin_host(host.as_ptr() as u64, host.len()) }.unwrap());
    // SAFETY: as above: the same range twice is refused, not an error.
    assert!(!unsafe { cuda.pin_host(host.as_ptr() as u64, 4096) }.unwrap(), "already registered");
    let buf = cuda.export_dmabuf(a.addr() + 4096, 8192).unwrap().expect("a dma-buf");
    assert_eq!(buf.offset, 0);
    assert_eq!(d.live("dmabufs"), 1);
    drop(buf);
    assert_eq!(d.live("dmabufs"), 0);
    // SAFETY: pinned above, not in use.
    unsafe { cuda.unpin_host(host.as_ptr() as u64) };
    assert_eq!(d.live("host_registrations"), 0);
    assert!(d.live("streams") > 0, "streams are kept for the next copies");
    drop((a, b));
    assert_eq!(d.live("allocations"), 0);
    drop(cuda);
    assert_eq!(d.live("streams"), 0, "every stream destroyed");
    assert_eq!(d.live("contexts"), 0, "every primary context released");
    assert_eq!(d.live("pending_ops"), 0);
}

/// A driver failure reaches the caller as a device error naming the call
/// and the driver's code; the caller's context stack is as it was; a
/// failed context retain is not remembered (the next copy retries).
#[test]
fn driver_failures_reach_the_caller_and_leave_no_trace() {
    let Some(driver) = under_double("driver_failures_reach_the_caller_and_leave_no_trace", &[]) else { return };
    if driver == Driver::Gpu {
        return;
    }
    let d = Double::get();
    let cuda = devices();
    let a = cuda.alloc(0, 1 << 16).unwrap();
    let bytes = pattern(4096, 5);
    let cases: &[(&str, sys::CUresult, &str)] = &[
        ("cuMemcpyHtoDAsync_v2", sys::CUresult::CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS"),
        ("cuStreamSynchronize", sys::CUresult::CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED"),
        ("cuCtxPushCurrent_v2", sys::CUresult::CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT"),
        ("cuStreamCreate", sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY"),
    ];
    // Each on a thread with nothing current and a fresh provider (no
    // context retained, no idle stream), so every step of a copy is made.
    let (addr, b) = (a.addr(), bytes.clone());
    std::thread::spawn(move || {
        let (d, bytes) = (Double::get(), b);
        for &(call, code, name) in cases {
            let fresh = devices();
            d.fail(call, code as u32, 1);
            let depth = d.depth();
            let err = fresh.copy_from_host(&bytes, addr).unwrap_err();
            let MemError::DeviceCopy { device, why } = &err else { panic!("{call}: not a device error: {err:?}") };
            assert_eq!(*device, 0);
            assert!(why.contains(call.trim_end_matches("_v2")), "{call}: the call is not named in {why:?}");
            assert!(why.contains(name), "{call}: the driver's code is not in {why:?}");
            assert_eq!(d.depth(), depth, "{call}: the context stack changed");
            assert!(current().is_null(), "{call}: a context left current");
            fresh.copy_from_host(&bytes, addr).unwrap();
        }
    })
    .join()
    .unwrap();
    // A failed retain: the copy fails, the next one retries and works.
    let fresh = devices();
    d.fail("cuDevicePrimaryCtxRetain", sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY as u32, 1);
    let err = fresh.copy_from_host(&bytes, a.addr()).unwrap_err();
    assert!(err.to_string().contains("cuDevicePrimaryCtxRetain"), "{err}");
    fresh.copy_from_host(&bytes, a.addr()).unwrap();
    let mut back = vec![0u8; 4096];
    fresh.copy_to_host(a.addr(), &mut back).unwrap();
    assert!(back == bytes);
    drop(fresh);
    drop(a);
    drop(cuda);
    assert_eq!(d.live("contexts"), 0, "no retain leaked by a failure");
    assert_eq!(d.live("streams"), 0, "no stream leaked by a failure");
}

/// A machine with the driver installed and no GPU (`cuInit` answers
/// CUDA_ERROR_NO_DEVICE) has no CUDA memory: the provider is not opened,
/// and that is no error.
#[test]
fn a_driver_without_a_gpu_is_no_cuda() {
    let Some(driver) = under_double("a_driver_without_a_gpu_is_no_cuda", &[("KVMOVE_CUDA_DOUBLE_DEVICES", "0")]) else {
        return;
    };
    if driver == Driver::Gpu {
        return;
    }
    assert!(CudaDevices::open().unwrap().is_none());
    let host = [0u8; 64];
    assert!(transport_mem::providers::find(host.as_ptr() as u64, 64).is_none());
    assert_eq!(transport_mem::providers::cuda_problem(), None);
}

/// A driver that refuses to start for another reason is an error naming
/// the call and the code.
#[test]
fn a_driver_that_fails_to_start_is_an_error() {
    let Some(driver) = under_double("a_driver_that_fails_to_start_is_an_error", &[("KVMOVE_CUDA_DOUBLE_INIT", "999")])
    else {
        return;
    };
    if driver == Driver::Gpu {
        return;
    }
    let err = CudaDevices::open().unwrap_err().to_string();
    assert!(err.contains("cuInit") && err.contains("CUDA_ERROR_UNKNOWN"), "{err}");
}

/// A driver older than CUDA 11.0 is refused, with the version.
#[test]
fn a_driver_too_old_is_refused() {
    let Some(driver) = under_double("a_driver_too_old_is_refused", &[("KVMOVE_CUDA_DOUBLE_DRIVER", "10020")]) else {
        return;
    };
    if driver == Driver::Gpu {
        return;
    }
    let err = CudaDevices::open().unwrap_err().to_string();
    assert!(err.contains("too old") && err.contains("10020"), "{err}");
}

/// Before CUDA 11.7 there is no `cuMemGetHandleForAddressRange`: an export
/// is refused without calling it (the symbol would be missing).
#[test]
fn no_dmabuf_before_cuda_11_7() {
    let Some(driver) = under_double("no_dmabuf_before_cuda_11_7", &[("KVMOVE_CUDA_DOUBLE_DRIVER", "11060")]) else {
        return;
    };
    if driver == Driver::Gpu {
        return;
    }
    let d = Double::get();
    let cuda = devices();
    let a = cuda.alloc(0, 1 << 16).unwrap();
    assert!(cuda.export_dmabuf(a.addr(), 4096).unwrap().is_none());
    assert!(!d.calls().iter().any(|c| c == "cuMemGetHandleForAddressRange"));
}

/// A dma-buf covers the pages holding the range, inside the allocation;
/// one whose pages run past the allocation is not made (`None`); a driver
/// that does not support dma-buf is `None` too.
#[test]
fn dmabuf_exports_whole_pages_of_one_allocation() {
    let Some(driver) = under_double("dmabuf_exports_whole_pages_of_one_allocation", &[]) else { return };
    let cuda = devices();
    let len = 1 << 20;
    let a = cuda.alloc(0, len).unwrap();
    let Some(buf) = cuda.export_dmabuf(a.addr() + 100, 5000).unwrap() else {
        assert_eq!(driver, Driver::Gpu, "the double always exports");
        return; // a GPU or kernel without dma-buf
    };
    assert_eq!(buf.offset, 100, "the range starts 100 bytes into its first page");
    drop(buf);
    assert!(cuda.export_dmabuf(a.addr() + len as u64 - 10, 20).unwrap().is_none(), "past the allocation");
    if driver == Driver::Double {
        let d = Double::get();
        d.fail("cuMemGetHandleForAddressRange", sys::CUresult::CUDA_ERROR_NOT_SUPPORTED as u32, 1);
        assert!(cuda.export_dmabuf(a.addr(), 4096).unwrap().is_none(), "not supported: no dma-buf, no error");
        d.fail("cuMemGetHandleForAddressRange", sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY as u32, 1);
        let err = cuda.export_dmabuf(a.addr(), 4096).unwrap_err().to_string();
        assert!(err.contains("CUDA_ERROR_OUT_OF_MEMORY"), "{err}");
        assert_eq!(d.live("dmabufs"), 0);
    }
}

/// A stream of the application's.
fn app_stream() -> sys::CUstream {
    let mut s: sys::CUstream = std::ptr::null_mut();
    // SAFETY: the driver writes one handle; the stream lives as long as
    // the test process.
    unsafe { sys::cuStreamCreate(&mut s, 1) }.result().unwrap();
    s
}

/// The double itself: a copy queued on a stream has not happened before
/// the stream is synchronized (what makes the tests above able to catch a
/// copy reported done too early), and a "kernel" queued before it on the
/// same stream runs first.
#[test]
fn the_double_runs_a_streams_work_only_when_synchronized() {
    let Some(driver) = under_double("the_double_runs_a_streams_work_only_when_synchronized", &[]) else { return };
    if driver == Driver::Gpu {
        return;
    }
    let d = Double::get();
    let _app = AppContext::enter(0);
    let mut p: sys::CUdeviceptr = 0;
    // SAFETY: a fresh allocation, freed below; the host buffer outlives
    // the stream's synchronization.
    unsafe {
        sys::cuMemAlloc_v2(&mut p, 4096).result().unwrap();
        sys::cuMemsetD8_v2(p, 1, 4096).result().unwrap();
    }
    let s = app_stream();
    d.launch(s as u64, p, 9, 4096);
    let mut host = vec![0u8; 4096];
    // SAFETY: `host` lives until after the synchronization.
    unsafe { sys::cuMemcpyDtoHAsync_v2(host.as_mut_ptr().cast(), p, 4096, s) }.result().unwrap();
    assert!(host.iter().all(|&b| b == 0), "nothing ran before the stream was synchronized");
    assert_eq!(d.live("pending_ops"), 2);
    // SAFETY: a stream of this test.
    unsafe { sys::cuStreamSynchronize(s) }.result().unwrap();
    assert!(host.iter().all(|&b| b == 9), "the kernel ran, then the copy");
    // SAFETY: as above.
    unsafe {
        sys::cuStreamDestroy_v2(s).result().unwrap();
        sys::cuMemFree_v2(p).result().unwrap();
    }
}

/// A copy made after a point on the application's stream sees what the
/// work queued before the point wrote (a layer's write waits for the
/// layer's kernels) without the caller waiting for that work; a copy made
/// without the point does not wait (on the double, whose streams run only
/// when synchronized, it reads the bytes from before). The point is
/// reached once the work is done; its event is destroyed on drop; a point
/// on a stream the driver does not know is an error and leaks no event.
#[test]
fn a_copy_after_a_stream_point_sees_the_work_before_it() {
    let Some(driver) = under_double("a_copy_after_a_stream_point_sees_the_work_before_it", &[]) else { return };
    let cuda = devices();
    let app = AppContext::enter(0);
    let n = 1 << 20;
    let a = cuda.alloc(0, n).unwrap();
    cuda.copy_from_host(&vec![1u8; n], a.addr()).unwrap();
    let s = app_stream();
    // The layer's "kernel": a fill queued on the application's stream.
    // SAFETY: device memory of `a`, alive until the stream is synchronized.
    unsafe { sys::cuMemsetD8Async(a.addr(), 9, n, s) }.result().unwrap();
    let point = cuda.mark(0, s as u64).unwrap();
    if driver == Driver::Double {
        // SAFETY: as above; queued after the point.
        unsafe { sys::cuMemsetD8Async(a.addr(), 5, 4096, s) }.result().unwrap();
        assert!(!point.reached().unwrap(), "nothing ran the application's stream yet");
        let mut early = vec![0u8; n];
        cuda.copy_to_host(a.addr(), &mut early).unwrap();
        assert!(early.iter().all(|&b| b == 1), "a copy without the point does not wait for the kernel");
    }
    let mut back = vec![0u8; n];
    cuda.copy_to_host_after(&point, a.addr(), &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 9), "the copy after the point reads what the kernel wrote, and no later work");
    point.wait().unwrap();
    assert!(point.reached().unwrap());
    drop(point);
    // SAFETY: the application's stream, made by this test.
    unsafe {
        sys::cuStreamSynchronize(s).result().unwrap();
        sys::cuStreamDestroy_v2(s).result().unwrap();
    }
    drop(app);
    if driver == Driver::Double {
        let d = Double::get();
        assert!(d.calls().iter().any(|c| c == "cuStreamWaitEvent"), "the copy's stream waited on the device");
        assert_eq!(d.live("events"), 0, "the point's event destroyed");
        let err = cuda.mark(0, 0x1234_5670).unwrap_err().to_string();
        assert!(err.contains("cuEventRecord") && err.contains("CUDA_ERROR_INVALID_HANDLE"), "{err}");
        assert_eq!(d.live("events"), 0, "no event left by a failed mark");
    }
}
