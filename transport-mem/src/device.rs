//! Device (GPU) memory: where a region's bytes live, and the provider that
//! reaches memory the host cannot touch directly.
//!
//! A region of device memory ([`MemoryRegion::from_device`]) is never
//! dereferenced by the host: every access the engine makes through the
//! region ([`MemoryRegion::read_at`], [`MemoryRegion::write_at`], ...) is a
//! copy by its [`DeviceMemory`] provider (for CUDA, `cuMemcpyDtoH` /
//! `cuMemcpyHtoD`). [`FakeDevice`] is a provider for tests on machines
//! without a GPU: its memory is mapped `PROT_NONE` at the addresses users
//! see, so any code that reads or writes it as host memory faults at once
//! instead of passing silently, and its copies can be failed on demand.
//!
//! [`MemoryRegion::from_device`]: crate::MemoryRegion::from_device
//! [`MemoryRegion::read_at`]: crate::MemoryRegion::read_at
//! [`MemoryRegion::write_at`]: crate::MemoryRegion::write_at
#![allow(unsafe_code)]

use std::fmt;
use std::os::fd::OwnedFd;

use crate::error::MemError;

/// Where a registered region's bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Host memory the process (and a NIC) may read and write directly.
    Host,
    /// Memory of the accelerator with this index (a CUDA ordinal): only its
    /// provider reaches it.
    Device(u32),
}

impl MemoryKind {
    /// Whether the bytes live on a device.
    pub fn is_device(self) -> bool {
        matches!(self, MemoryKind::Device(_))
    }
}

impl fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemoryKind::Host => f.write_str("host"),
            MemoryKind::Device(d) => write!(f, "device:{d}"),
        }
    }
}

/// What reaches device memory: a GPU runtime (CUDA) or [`FakeDevice`](crate::FakeDevice).
///
/// Addresses are device addresses as the application holds them (a CUDA
/// device pointer, `tensor.data_ptr()`); lengths are bytes. Copies are
/// synchronous from the caller's view: they return once the bytes are in
/// place (a provider may run them on its own stream and wait).
pub trait DeviceMemory: Send + Sync + fmt::Debug {
    /// A name for logs and errors ("cuda", "fake").
    fn name(&self) -> &str;

    /// The device that holds all of `addr .. addr + len`, or `None` when
    /// the range is not (entirely) this provider's device memory. This is
    /// how a pointer's kind is detected (CUDA: `cuPointerGetAttribute`).
    fn device_of(&self, addr: u64, len: u64) -> Option<u32>;

    /// Copies `dst.len()` bytes of device memory at `src` into `dst`.
    fn copy_to_host(&self, src: u64, dst: &mut [u8]) -> Result<(), MemError>;

    /// Copies `src` into device memory at `dst`.
    fn copy_from_host(&self, src: &[u8], dst: u64) -> Result<(), MemError>;

    /// Copies `len` bytes between two ranges of this provider's device
    /// memory (they may overlap).
    fn copy_on_device(&self, dst: u64, src: u64, len: usize) -> Result<(), MemError> {
        let mut bounce = vec![0u8; len];
        self.copy_to_host(src, &mut bounce)?;
        self.copy_from_host(&bounce, dst)
    }

    /// Pins (page-locks) `len` bytes of host memory at `addr` for this
    /// provider's copies (CUDA: `cuMemHostRegister`), so copies between it
    /// and the device run at full speed. `Ok(true)`: pinned, to be undone
    /// by [`DeviceMemory::unpin_host`]. `Ok(false)`: not pinned (the
    /// provider has no such thing); the memory is usable all the same. The
    /// default pins nothing. Safe wrappers: [`crate::PinnedBuf`].
    ///
    /// # Safety
    ///
    /// `addr .. addr + len` is host memory of this process that stays
    /// mapped until `unpin_host(addr)` has returned (when this returned
    /// `Ok(true)`).
    unsafe fn pin_host(&self, addr: u64, len: usize) -> Result<bool, MemError> {
        let _ = (addr, len);
        Ok(false)
    }

    /// Undoes [`DeviceMemory::pin_host`] of the memory at `addr`. The
    /// default does nothing.
    ///
    /// # Safety
    ///
    /// `addr` was pinned by this provider (`pin_host` returned `Ok(true)`)
    /// and not unpinned since; no copy of this provider uses the memory.
    unsafe fn unpin_host(&self, addr: u64) {
        let _ = addr;
    }

    /// A dma-buf exporting `addr .. addr + len`, for a NIC to reach the
    /// memory directly (GPUDirect RDMA through `ibv_reg_dmabuf_mr`), or
    /// `Ok(None)` where the provider, driver or device cannot export it.
    /// The default exports nothing.
    fn export_dmabuf(&self, addr: u64, len: u64) -> Result<Option<DmaBuf>, MemError> {
        let _ = (addr, len);
        Ok(None)
    }

    /// The PCI address of `device` (`0000:18:00.0`), so the NICs nearest
    /// it can be found (CUDA: `cuDeviceGetPCIBusId`); `None` when the
    /// provider does not know it. The default knows none.
    fn pci_bus_id(&self, device: u32) -> Option<String> {
        let _ = device;
        None
    }
}

/// A dma-buf file descriptor that exports a range of device memory:
/// the range starts `offset` bytes into the buffer. Closing the
/// descriptor (dropping this) is allowed once an importer holds the
/// buffer (an RDMA registration keeps its own reference).
#[derive(Debug)]
pub struct DmaBuf {
    /// The dma-buf.
    pub fd: OwnedFd,
    /// Where the exported range starts inside the buffer.
    pub offset: u64,
}
