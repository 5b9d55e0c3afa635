//! The fabric: mock hosts of one process found by segment name, the
//! generation counter, one event channel every waiter listens to, and the
//! real faults a test can cause (kill, cut, stall).

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;
use transport_core::{Error, ErrorKind, Result};

use crate::host::{HostShared, Life};
use crate::wake::Events;

/// A registry of mock hosts in one process, by segment name. Cheap to
/// clone; clones share the hosts.
///
/// Fault hooks act on the host currently registered under a name:
/// - [`MockFabric::kill`]: the host crashes. Endpoints toward it break;
///   requests in flight to it fail with transient `ConnectionReset`; opens
///   and new endpoints fail with `ConnectionRefused`; its memory is never
///   touched again; its own transport answers `Shutdown`. A new
///   [`crate::MockTransport`] with the same name is its restart (new
///   generation).
/// - [`MockFabric::cut`]: every live endpoint toward the host breaks; the
///   host stays up and accepts new endpoints.
/// - [`MockFabric::stall`]: copies toward or from the host wait until it is
///   resumed (or their batch is cancelled or past its deadline).
#[derive(Clone, Default)]
pub struct MockFabric {
    pub(crate) inner: Arc<FabricInner>,
}

pub(crate) struct FabricInner {
    hosts: Mutex<HashMap<String, Weak<HostShared>>>,
    next_generation: AtomicU64,
    next_name: AtomicU64,
    pub events: Events,
}

impl Default for FabricInner {
    fn default() -> Self {
        Self {
            hosts: Mutex::default(),
            next_generation: AtomicU64::new(1),
            next_name: AtomicU64::new(1),
            events: Events::default(),
        }
    }
}

impl fmt::Debug for MockFabric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MockFabric").field("hosts", &self.hosts()).finish()
    }
}

impl MockFabric {
    /// An empty fabric.
    pub fn new() -> Self {
        Self::default()
    }

    /// Names of the live hosts.
    pub fn hosts(&self) -> Vec<String> {
        let mut v: Vec<String> = self.inner.live_hosts().into_iter().map(|h| h.name.clone()).collect();
        v.sort();
        v
    }

    /// The generation of the live host `name`, if any.
    pub fn generation(&self, name: &str) -> Option<u64> {
        self.inner.live_host(name).map(|h| h.generation)
    }

    /// Crashes the host `name` (see the type doc). `NotFound` if no live
    /// host has that name.
    pub fn kill(&self, name: &str) -> Result<()> {
        let host = self.inner.live_host(name).ok_or_else(|| not_found(name))?;
        self.inner.kill(&host);
        Ok(())
    }

    /// Breaks every live endpoint toward `name`. `NotFound` if no host
    /// ever had that name; a no-op for a host that is down.
    pub fn cut(&self, name: &str) -> Result<()> {
        self.inner.known(name)?;
        self.inner.cut(name);
        Ok(())
    }

    /// Stalls (`true`) or resumes copies toward and from `name`. `NotFound`
    /// if no host ever had that name; a no-op for a host that is down.
    pub fn stall(&self, name: &str, on: bool) -> Result<()> {
        self.inner.known(name)?;
        if let Some(host) = self.inner.live_host(name) {
            host.set_stalled(on);
        }
        self.inner.bump();
        Ok(())
    }
}

fn not_found(name: &str) -> Error {
    Error::new(ErrorKind::NotFound, "no live mock host has this name").with("segment", name)
}

impl FabricInner {
    pub fn next_generation(&self) -> u64 {
        self.next_generation.fetch_add(1, Ordering::Relaxed)
    }

    pub fn auto_name(&self) -> String {
        format!("mock-{}", self.next_name.fetch_add(1, Ordering::Relaxed))
    }

    /// Registers a host under its name; refused while a live host has it.
    pub fn add(&self, host: &Arc<HostShared>) -> Result<()> {
        let mut hosts = self.hosts.lock();
        if let Some(old) = hosts.get(&host.name).and_then(Weak::upgrade) {
            if old.life() == Life::Live {
                return Err(Error::new(
                    ErrorKind::Config,
                    "a live mock host already has this name (kill or shut it down before restarting)",
                )
                .with("segment", &host.name));
            }
        }
        hosts.insert(host.name.clone(), Arc::downgrade(host));
        Ok(())
    }

    fn known(&self, name: &str) -> Result<()> {
        if self.hosts.lock().contains_key(name) {
            Ok(())
        } else {
            Err(not_found(name))
        }
    }

    pub fn live_host(&self, name: &str) -> Option<Arc<HostShared>> {
        self.hosts.lock().get(name).and_then(Weak::upgrade).filter(|h| h.life() == Life::Live)
    }

    pub fn live_hosts(&self) -> Vec<Arc<HostShared>> {
        self.hosts.lock().values().filter_map(Weak::upgrade).filter(|h| h.life() == Life::Live).collect()
    }

    /// Crashes `host` and breaks the endpoints toward it.
    pub fn kill(&self, host: &Arc<HostShared>) {
        drop(host.teardown(Life::Killed));
        self.cut(&host.name);
    }

    /// Breaks every live host's endpoint toward `name`.
    fn cut(&self, name: &str) {
        for h in self.live_hosts() {
            h.endpoints.lock().cut(name);
        }
        self.bump();
    }

    /// Wakes every waiter: something changed.
    pub fn bump(&self) {
        self.events.bump();
    }
}
