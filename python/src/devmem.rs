//! What memory given by address is: device memory of an installed provider
//! (a CUDA device, a fake device in tests), or host memory this process can
//! read. Every registration from Python (`register_memory`, a NIXL
//! descriptor, `Engine.register`) goes through [`region_at`], so device
//! memory is reached only through its provider and an address that is
//! neither is refused before a backend could copy from it and crash.
//!
//! A NIXL descriptor or an object says what it holds ([`Want`]); Mooncake's
//! `register_memory` does not, and the answer is found as Mooncake finds
//! it: by asking the device runtime about the pointer.

use std::sync::Arc;

use pyo3::prelude::*;
use transport_core::{Error, ErrorKind, FakeDevice, MemoryRegion, Result};
use transport_mem::providers;

use crate::errors::to_pyerr;
use crate::hostmem;

/// What the caller says the memory is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Want {
    /// Nothing said: whatever an installed provider or the host check
    /// finds (Mooncake's `register_memory`).
    Any,
    /// Host memory (NIXL `"DRAM"`, a DLPack CPU tensor): device memory is
    /// refused, since a peer of the real engine would treat it as host.
    Host,
    /// Device memory, on this device where given (NIXL `"VRAM"` with its
    /// `devId`, `__cuda_array_interface__`). Host memory that this process
    /// can read is taken too: serving engines on CPU label their host KV
    /// cache `"VRAM"` (SGLang's NIXL backend with `--device cpu`).
    Device(Option<u32>),
}

impl Want {
    /// `"auto"`, `"host"`, `"device"` (any device) or `"device:N"`.
    pub(crate) fn parse(s: &str) -> Result<Want> {
        let bad = || {
            Error::new(ErrorKind::InvalidRequest, "memory kind must be \"auto\", \"host\", \"device\" or \"device:N\"")
                .with("kind", s)
        };
        match s {
            "auto" => Ok(Want::Any),
            "host" => Ok(Want::Host),
            "device" => Ok(Want::Device(None)),
            _ => {
                let n = s.strip_prefix("device:").ok_or_else(bad)?;
                n.parse().map(|d| Want::Device(Some(d))).map_err(|_| bad())
            }
        }
    }
}

/// The region for `addr .. addr + len`, of the kind the memory is.
///
/// # Safety
///
/// The contract of [`MemoryRegion::from_raw`] (host memory) or
/// [`MemoryRegion::from_device`] (device memory), whichever the range is:
/// it stays allocated until the region is unregistered everywhere.
pub(crate) unsafe fn region_at(addr: u64, len: u64, want: Want) -> Result<MemoryRegion> {
    let size = usize::try_from(len).map_err(|_| Error::new(ErrorKind::OutOfBounds, "length too large"))?;
    let at = |e: Error| e.with("addr", format_args!("{addr:#x}")).with("len", len);
    if let Some((provider, device)) = providers::find(addr, len) {
        match want {
            Want::Host => {
                return Err(at(Error::new(
                    ErrorKind::InvalidRequest,
                    format!("memory given as host memory is on device {device} ({} provider)", provider.name()),
                )))
            }
            Want::Device(Some(d)) if d != device => {
                return Err(at(Error::new(
                    ErrorKind::InvalidRequest,
                    format!("memory given as device {d}'s is on device {device} ({} provider)", provider.name()),
                )))
            }
            _ => {}
        }
        // SAFETY: forwarded from this function's contract.
        return unsafe { MemoryRegion::from_device(provider, addr, size) }.map_err(|e| at(e.into()));
    }
    if let Err(e) = hostmem::check_readable(addr, len) {
        if e.kind() != ErrorKind::Unsupported {
            return Err(e);
        }
        let installed = providers::names();
        let known = if installed.is_empty() { "none".to_owned() } else { installed.join(", ") };
        let mut refused = Error::new(
            ErrorKind::Unsupported,
            format!("{}, nor device memory of an installed device provider (installed: {known})", e.message()),
        );
        for (k, v) in e.context() {
            refused = refused.with(k, v);
        }
        return Err(refused);
    }
    // SAFETY: forwarded from this function's contract.
    unsafe { MemoryRegion::from_raw(addr, size) }.map_err(|e| at(e.into()))
}

/// A device whose memory this process cannot touch (`kvmove.FakeDevice`):
/// its addresses fault on any host access, and only its provider copies in
/// and out. Made for tests on machines without a GPU: registered memory
/// of a fake device moves between processes as a GPU's would, and a path
/// that reads it as host memory crashes the test instead of passing. It is
/// found by address, like CUDA memory, while it is open.
#[pyclass(name = "FakeDevice", module = "kvmove._native", frozen)]
#[derive(Debug)]
pub(crate) struct PyFakeDevice {
    dev: Arc<FakeDevice>,
}

impl PyFakeDevice {
    fn provider(&self) -> Arc<dyn transport_core::DeviceMemory> {
        self.dev.clone()
    }

    /// Checked before a buffer of `len` bytes is allocated for the copy.
    fn range(&self, py: Python<'_>, addr: u64, len: usize) -> PyResult<()> {
        use transport_core::DeviceMemory;
        if self.dev.device_of(addr, len as u64).is_none() {
            let e = Error::new(ErrorKind::OutOfBounds, "range is not this fake device's memory")
                .with("addr", format_args!("{addr:#x}"))
                .with("len", len);
            return Err(to_pyerr(py, &e));
        }
        Ok(())
    }
}

#[pymethods]
impl PyFakeDevice {
    /// A fake device with index `device` and `capacity` bytes, installed as
    /// a provider until [`close`](Self::close).
    #[new]
    #[pyo3(signature = (device = 0, capacity = 64 << 20))]
    fn new(py: Python<'_>, device: u32, capacity: u64) -> PyResult<Self> {
        let cap = usize::try_from(capacity).map_err(|_| {
            to_pyerr(py, &Error::new(ErrorKind::InvalidRequest, "capacity too large").with("capacity", capacity))
        })?;
        let dev = FakeDevice::new(device, cap).map_err(|e| to_pyerr(py, &e.into()))?;
        let this = Self { dev: Arc::new(dev) };
        providers::install(this.provider());
        Ok(this)
    }

    /// The device index.
    #[getter]
    fn index(&self) -> u32 {
        self.dev.index()
    }

    /// `length` fresh zeroed bytes of device memory: their device address.
    /// Never freed while the device lives.
    fn alloc(&self, py: Python<'_>, length: u64) -> PyResult<u64> {
        let len = usize::try_from(length).unwrap_or(usize::MAX);
        self.dev.alloc(len).map_err(|e| to_pyerr(py, &e.into()))
    }

    /// Copies `data` into device memory at `addr` (through the provider).
    fn write(&self, py: Python<'_>, addr: u64, data: &[u8]) -> PyResult<()> {
        use transport_core::DeviceMemory;
        self.range(py, addr, data.len())?;
        self.dev.copy_from_host(data, addr).map_err(|e| to_pyerr(py, &e.into()))
    }

    /// Copies `length` bytes of device memory at `addr` out (through the
    /// provider).
    fn read<'py>(&self, py: Python<'py>, addr: u64, length: u64) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
        use transport_core::DeviceMemory;
        let len = usize::try_from(length).unwrap_or(usize::MAX);
        self.range(py, addr, len)?;
        let mut out = vec![0u8; len];
        self.dev.copy_to_host(addr, &mut out).map_err(|e| to_pyerr(py, &e.into()))?;
        Ok(pyo3::types::PyBytes::new(py, &out))
    }

    /// The next `n` copies to or from this device fail (a device error).
    fn fail_copies(&self, n: u64) {
        self.dev.fail_copies(n);
    }

    /// Injected failures not yet used.
    #[getter]
    fn failures_left(&self) -> u64 {
        self.dev.failures_left()
    }

    /// Every copy from now on takes at least `seconds`.
    fn delay_copies(&self, py: Python<'_>, seconds: f64) -> PyResult<()> {
        let d = std::time::Duration::try_from_secs_f64(seconds).map_err(|_| {
            to_pyerr(py, &Error::new(ErrorKind::InvalidRequest, "delay must be a finite number of seconds >= 0"))
        })?;
        self.dev.delay_copies(d);
        Ok(())
    }

    /// Copies made so far, either way.
    #[getter]
    fn copies(&self) -> u64 {
        self.dev.copies()
    }

    /// Stops finding this device's memory for new registrations; what is
    /// registered keeps working (each region holds the device).
    fn close(&self) {
        providers::uninstall(&self.provider());
    }

    fn __repr__(&self) -> String {
        format!("FakeDevice(index={})", self.dev.index())
    }
}

/// The names of the installed device-memory providers, in the order they
/// are asked (`["cuda"]` on a machine with a GPU, `["fake"]` per open
/// fake device).
#[pyfunction]
pub(crate) fn device_providers() -> Vec<String> {
    providers::names()
}
