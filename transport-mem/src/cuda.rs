//! The CUDA provider: device memory of NVIDIA GPUs, reached through the
//! CUDA driver API (`libcuda`), loaded when first asked for, so a build
//! with the `cuda` feature runs on machines without a driver or a GPU
//! (there [`CudaDevices::open`] answers `None`).
//!
//! Pointers are classified as CUDA classifies them
//! (`cuPointerGetAttribute`): device memory (`cudaMalloc`, the caching
//! allocators of torch and friends) is this provider's; managed and pinned
//! host memory is host memory the process reads directly, and is left to
//! the host path. Copies are synchronous `cuMemcpy` calls in the device's
//! primary context (the one the CUDA runtime, and so torch, uses).
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::fmt;

use cudarc::driver::{result, sys};

use crate::device::{DeviceMemory, DmaBuf};
use crate::error::MemError;

/// Every CUDA device of this process, through their primary contexts.
pub struct CudaDevices {
    /// `(device, primary context)` by ordinal.
    ctxs: Vec<(sys::CUdevice, sys::CUcontext)>,
}

// SAFETY: a CUDA context handle may be used from any thread (the driver
// API is thread-safe; each call makes the context current on the calling
// thread first). The handles are only passed to the driver.
unsafe impl Send for CudaDevices {}
// SAFETY: as for `Send`: shared use only hands the handles to the driver.
unsafe impl Sync for CudaDevices {}

impl fmt::Debug for CudaDevices {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDevices").field("devices", &self.ctxs.len()).finish()
    }
}

fn failed(device: u32, what: &str, e: impl fmt::Display) -> MemError {
    MemError::DeviceCopy { device, why: format!("{what}: {e}") }
}

impl CudaDevices {
    /// The CUDA devices of this machine: `Ok(None)` where there is no
    /// driver library or no device (the usual case on a CPU machine), an
    /// error where the driver is present but refuses to start.
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
        let n = result::device::get_count().map_err(|e| failed(0, "cuDeviceGetCount", format_args!("{e:?}")))?;
        let mut ctxs = Vec::new();
        for i in 0..n.max(0) {
            let dev = result::device::get(i).map_err(|e| failed(i as u32, "cuDeviceGet", format_args!("{e:?}")))?;
            // SAFETY: `dev` is a device handle the driver just returned;
            // the retained primary context is released in `Drop`.
            let ctx = unsafe { result::primary_ctx::retain(dev) }
                .map_err(|e| failed(i as u32, "cuDevicePrimaryCtxRetain", format_args!("{e:?}")))?;
            ctxs.push((dev, ctx));
        }
        Ok((!ctxs.is_empty()).then_some(CudaDevices { ctxs }))
    }

    /// How many devices.
    pub fn count(&self) -> usize {
        self.ctxs.len()
    }

    /// Makes device `d`'s primary context current on this thread.
    fn enter(&self, d: u32) -> Result<(), MemError> {
        let (_, ctx) = *self.ctxs.get(d as usize).ok_or_else(|| failed(d, "no such CUDA device", d))?;
        // SAFETY: `ctx` is a primary context retained in `open` and not yet
        // released (that happens in `Drop`, after every use).
        unsafe { result::ctx::set_current(ctx) }.map_err(|e| failed(d, "cuCtxSetCurrent", format_args!("{e:?}")))
    }

    /// One attribute of the pointer `addr` (an integer attribute).
    fn attribute(addr: u64, attr: sys::CUpointer_attribute) -> Option<u32> {
        let mut v: u32 = 0;
        // SAFETY: the driver writes one 32-bit value (the memory type and
        // the device ordinal are `unsigned int`s) into `v`, which lives
        // across the call; `addr` is only looked up, never dereferenced.
        let r = unsafe { sys::cuPointerGetAttribute(std::ptr::from_mut(&mut v).cast::<c_void>(), attr, addr) };
        (r == sys::CUresult::CUDA_SUCCESS).then_some(v)
    }

    /// `len` bytes of device memory on device `d` (`cuMemAlloc`), freed
    /// when the returned allocation drops: for tests and benchmarks.
    pub fn alloc(self: &std::sync::Arc<Self>, d: u32, len: usize) -> Result<CudaAlloc, MemError> {
        self.enter(d)?;
        // SAFETY: a fresh allocation in the current context; freed once in
        // `CudaAlloc::drop`.
        let ptr = unsafe { result::malloc_sync(len) }.map_err(|_| MemError::AllocFailed { len })?;
        Ok(CudaAlloc { devices: self.clone(), device: d, ptr, len })
    }
}

impl Drop for CudaDevices {
    fn drop(&mut self) {
        for (dev, _) in &self.ctxs {
            // SAFETY: releases the retain made in `open`, once.
            let _ = unsafe { result::primary_ctx::release(*dev) };
        }
    }
}

impl DeviceMemory for CudaDevices {
    fn name(&self) -> &str {
        "cuda"
    }

    fn device_of(&self, addr: u64, len: u64) -> Option<u32> {
        let end = addr.checked_add(len).filter(|_| len > 0)?;
        let kind = Self::attribute(addr, sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE)?;
        if kind != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            return None;
        }
        let d = Self::attribute(addr, sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)?;
        self.enter(d).ok()?;
        let (mut base, mut size) = (0 as sys::CUdeviceptr, 0usize);
        // SAFETY: the driver writes the allocation's base and size into the
        // two locals; `addr` is only looked up.
        let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return None;
        }
        // The whole range must lie in the one allocation holding `addr`.
        (end <= base.checked_add(size as u64)?).then_some(d)
    }

    fn copy_to_host(&self, src: u64, dst: &mut [u8]) -> Result<(), MemError> {
        let d = Self::attribute(src, sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL).unwrap_or(0);
        self.enter(d)?;
        // SAFETY: `src .. src + dst.len()` is device memory of a registered
        // region (its owner keeps it allocated, the region's contract);
        // the driver writes `dst.len()` bytes into `dst`.
        unsafe { result::memcpy_dtoh_sync(dst, src) }.map_err(|e| failed(d, "cuMemcpyDtoH", format_args!("{e:?}")))
    }

    fn copy_from_host(&self, src: &[u8], dst: u64) -> Result<(), MemError> {
        let d = Self::attribute(dst, sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL).unwrap_or(0);
        self.enter(d)?;
        // SAFETY: as in `copy_to_host`, the other way.
        unsafe { result::memcpy_htod_sync(dst, src) }.map_err(|e| failed(d, "cuMemcpyHtoD", format_args!("{e:?}")))
    }

    fn copy_on_device(&self, dst: u64, src: u64, len: usize) -> Result<(), MemError> {
        let d = Self::attribute(dst, sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL).unwrap_or(0);
        self.enter(d)?;
        // SAFETY: both ranges are device memory of registered regions
        // (unified addressing: any context copies between devices).
        unsafe { result::memcpy_dtod_sync(dst, src, len) }.map_err(|e| failed(d, "cuMemcpyDtoD", format_args!("{e:?}")))
    }

    /// `cuMemGetHandleForAddressRange` with `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD`
    /// over the host pages holding the range (CUDA 11.7+, a driver and
    /// kernel with dma-buf support); `None` where the driver answers that
    /// it is not supported.
    fn export_dmabuf(&self, addr: u64, len: u64) -> Result<Option<DmaBuf>, MemError> {
        let d = Self::attribute(addr, sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL).unwrap_or(0);
        self.enter(d)?;
        let pg = 4096u64;
        let start = addr / pg * pg;
        let end = addr.checked_add(len).and_then(|e| e.checked_add(pg - 1)).ok_or(MemError::BadRange { addr, len })?
            / pg
            * pg;
        let size = usize::try_from(end - start).map_err(|_| MemError::BadRange { addr, len })?;
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: the driver writes one file descriptor into `fd`; the
        // range is device memory of a registered region (kept allocated by
        // its owner, the region's contract) and is only looked up.
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
        if self.devices.enter(self.device).is_ok() {
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
    /// selected, and nothing panics on the way.
    #[test]
    fn open_answers_none_or_real_devices() {
        let have_driver = driver_files_present();
        match CudaDevices::open() {
            Ok(None) => assert!(!have_driver || no_gpu(), "a driver and a GPU are present but none was opened"),
            Ok(Some(d)) => assert!(d.count() > 0),
            Err(e) => panic!("the CUDA driver refused to start: {e}"),
        }
    }

    fn devices() -> std::sync::Arc<CudaDevices> {
        std::sync::Arc::new(CudaDevices::open().unwrap().expect("no CUDA device"))
    }

    /// Device memory is claimed with its device index, the whole
    /// allocation and nothing past it; host memory is not.
    #[test]
    #[ignore = "needs an NVIDIA GPU: scripts/gpu-tests.sh"]
    fn cuda_pointers_are_classified() {
        let cuda = devices();
        let a = cuda.alloc(0, 1 << 20).unwrap();
        assert_eq!(cuda.device_of(a.addr(), 1 << 20), Some(0));
        assert_eq!(cuda.device_of(a.addr() + 4096, 4096), Some(0));
        assert_eq!(cuda.device_of(a.addr(), (1 << 20) + 1), None, "past the allocation");
        let host = vec![0u8; 4096];
        assert_eq!(cuda.device_of(host.as_ptr() as u64, 4096), None);
        assert_eq!(cuda.device_of(0, 16), None);
        if cuda.count() > 1 {
            let b = cuda.alloc(1, 4096).unwrap();
            assert_eq!(cuda.device_of(b.addr(), 4096), Some(1));
        }
    }

    /// Copies both ways and on the device, through a region as the
    /// engine makes them; the process-wide lookup finds the memory.
    #[test]
    #[ignore = "needs an NVIDIA GPU: scripts/gpu-tests.sh"]
    fn cuda_regions_copy_through_the_driver() {
        let cuda = devices();
        let a = cuda.alloc(0, 1 << 20).unwrap();
        let (p, d) = crate::providers::find(a.addr(), 1 << 20).expect("the lookup installs CUDA and finds the memory");
        assert_eq!((p.name(), d), ("cuda", 0));
        let provider: std::sync::Arc<dyn DeviceMemory> = cuda.clone();
        // SAFETY: `a` outlives the region (dropped at the end of the test,
        // after the region).
        let r = unsafe { crate::MemoryRegion::from_device(provider, a.addr(), 1 << 20) }.unwrap();
        let bytes: Vec<u8> = (0..1u32 << 20).map(|i| (i * 7 + 3) as u8).collect();
        r.write_at(0, &bytes).unwrap();
        let mut back = vec![0u8; 1 << 20];
        r.read_at(0, &mut back).unwrap();
        assert!(back == bytes);
        r.copy_from(4096, &r, 0, 4096).unwrap();
        r.read_at(4096, &mut back[..4096]).unwrap();
        assert!(back[..4096] == bytes[..4096]);
        drop(r);
    }

    fn driver_files_present() -> bool {
        ["/dev/nvidiactl", "/proc/driver/nvidia/version"].iter().any(|p| std::path::Path::new(p).exists())
    }

    fn no_gpu() -> bool {
        !std::path::Path::new("/dev/nvidia0").exists()
    }
}
