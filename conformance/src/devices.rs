//! Where the device cases get their device memory: fake devices
//! (`transport_mem::FakeDevice`, memory that faults on any host access) by
//! default, or a source a test binary installs with [`install`]: the CUDA
//! provider over the CUDA driver double (`kvmove_cuda_double::conformance`),
//! or over a real GPU.

use std::fmt;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use transport_core::{FakeDevice, MemoryRegion};

use crate::outcome::CaseError;

/// One device of a source: regions of its memory, and (where the source
/// can) copies made to fail or slow.
pub trait TestDevice: Send + Sync + fmt::Debug {
    /// A region of `len` bytes of this device's memory, valid while this
    /// device object lives.
    fn region(&self, len: usize) -> Result<MemoryRegion, String>;
    /// The next `n` copies to or from this device's memory fail (0: none);
    /// `false` where the source cannot fail copies (a real GPU).
    fn fail_copies(&self, n: u64) -> bool;
    /// How many failures set by [`TestDevice::fail_copies`] are left.
    fn failures_left(&self) -> u64;
    /// Each copy to or from this device takes at least `d` (zero: no
    /// delay); `false` where the source cannot slow copies.
    fn delay_copies(&self, d: Duration) -> bool;
}

/// A source of devices: device `index` (0 or 1) with room for `len`
/// bytes of regions, fresh for each call.
pub type Source = dyn Fn(u32, usize) -> Result<Arc<dyn TestDevice>, String> + Send + Sync;

static SOURCE: RwLock<Option<(String, Arc<Source>)>> = RwLock::new(None);

/// Makes `source` (named `name` in failures) the devices of every device
/// case this process runs from now on.
pub fn install(name: &str, source: Arc<Source>) {
    *SOURCE.write().unwrap_or_else(|e| e.into_inner()) = Some((name.to_owned(), source));
}

/// The name of the device source in use (`"fake"` by default).
pub fn source_name() -> String {
    SOURCE.read().unwrap_or_else(|e| e.into_inner()).as_ref().map_or_else(|| "fake".to_owned(), |s| s.0.clone())
}

/// A fresh device `index` of the installed source, with room for `len`
/// bytes.
pub fn device(index: u32, len: usize) -> Result<Arc<dyn TestDevice>, CaseError> {
    let source = SOURCE.read().unwrap_or_else(|e| e.into_inner()).clone();
    match source {
        Some((name, make)) => make(index, len).map_err(|e| CaseError::Fail(format!("{name} device {index}: {e}"))),
        None => {
            let dev = FakeDevice::new(index, len).map_err(|e| CaseError::Fail(format!("fake device: {e}")))?;
            Ok(Arc::new(Fake(Arc::new(dev))))
        }
    }
}

/// A fake device.
#[derive(Debug)]
struct Fake(Arc<FakeDevice>);

impl TestDevice for Fake {
    fn region(&self, len: usize) -> Result<MemoryRegion, String> {
        FakeDevice::region(&self.0, len).map_err(|e| e.to_string())
    }

    fn fail_copies(&self, n: u64) -> bool {
        self.0.fail_copies(n);
        true
    }

    fn failures_left(&self) -> u64 {
        self.0.failures_left()
    }

    fn delay_copies(&self, d: Duration) -> bool {
        self.0.delay_copies(d);
        true
    }
}
