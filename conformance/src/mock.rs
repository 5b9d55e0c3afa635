//! The harness of the in-process mock backend (`transport-mock`): every
//! fault hook is supported (kill, restart, cut, stall), and nodes with a
//! given inbox capacity; there is no OS probe (the mock holds no OS
//! resources).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use transport_core::{Result, Transport};
use transport_mock::{MockBugs, MockConfig, MockFabric, MockTransport};

use crate::harness::{Harness, Node, NodeOptions};

type Wrapper = Arc<dyn Fn(Arc<dyn Transport>) -> Arc<dyn Transport> + Send + Sync>;

/// Runs the suite against [`MockTransport`] hosts on one [`MockFabric`]
/// (one fabric per harness, so per case).
#[derive(Clone)]
pub struct MockHarness {
    fabric: MockFabric,
    label: String,
    bugs: MockBugs,
    latency: Duration,
    wrapper: Option<Wrapper>,
}

impl fmt::Debug for MockHarness {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MockHarness")
            .field("label", &self.label)
            .field("bugs", &self.bugs)
            .field("latency", &self.latency)
            .finish()
    }
}

impl Default for MockHarness {
    fn default() -> Self {
        Self::new()
    }
}

impl MockHarness {
    /// The correct mock; cases are named `mock::...`.
    pub fn new() -> Self {
        Self {
            fabric: MockFabric::new(),
            label: "mock".into(),
            bugs: MockBugs::default(),
            latency: Duration::ZERO,
            wrapper: None,
        }
    }

    /// The mock with deliberate bugs switched on (to prove the suite fails it).
    pub fn with_bugs(bugs: MockBugs) -> Self {
        Self { bugs, label: "mock_broken".into(), ..Self::new() }
    }

    /// The mock with every transport wrapped by `wrap` (see
    /// [`Harness::wrap`]); cases are named `<label>::...`.
    pub fn wrapped(
        label: &str,
        wrap: impl Fn(Arc<dyn Transport>) -> Arc<dyn Transport> + Send + Sync + 'static,
    ) -> Self {
        Self { label: label.into(), wrapper: Some(Arc::new(wrap)), ..Self::new() }
    }

    /// Every request of its nodes waits `latency` before its bytes move
    /// (`MockConfig::latency`), so copies are still running for a while
    /// after submit.
    pub fn with_latency(self, latency: Duration) -> Self {
        Self { latency, ..self }
    }

    /// The fabric the nodes live on.
    pub fn fabric(&self) -> &MockFabric {
        &self.fabric
    }

    fn config(&self, name: Option<String>, opts: &NodeOptions) -> MockConfig {
        MockConfig {
            name,
            max_endpoints: opts.max_endpoints,
            idle_timeout: opts.idle_timeout,
            latency: self.latency,
            ..MockConfig::default()
        }
    }

    fn start(&self, cfg: MockConfig) -> Result<Node> {
        let t = MockTransport::with_bugs(&self.fabric, cfg, self.bugs)?;
        let name = t.local_segment_name();
        Ok(Node { transport: t, name, state: Arc::new(()) })
    }
}

#[async_trait]
impl Harness for MockHarness {
    fn backend(&self) -> &str {
        &self.label
    }

    async fn node(&self, opts: &NodeOptions) -> Result<Node> {
        self.start(self.config(None, opts))
    }

    async fn kill(&self, node: &Node) -> Result<bool> {
        self.fabric.kill(&node.name)?;
        Ok(true)
    }

    async fn restart(&self, node: &Node, opts: &NodeOptions) -> Result<Node> {
        self.start(self.config(Some(node.name.clone()), opts))
    }

    async fn cut(&self, to: &Node) -> Result<bool> {
        self.fabric.cut(&to.name)?;
        Ok(true)
    }

    async fn stall(&self, to: &Node, on: bool) -> Result<bool> {
        self.fabric.stall(&to.name, on)?;
        Ok(true)
    }

    fn os_probe(&self) -> Option<Vec<(String, u64)>> {
        None
    }

    async fn node_with_inbox(&self, opts: &NodeOptions, capacity: usize) -> Result<Option<Node>> {
        let cfg = MockConfig { inbox_capacity: capacity, ..self.config(None, opts) };
        self.start(cfg).map(Some)
    }

    fn wrap(&self, transport: Arc<dyn Transport>) -> Arc<dyn Transport> {
        match &self.wrapper {
            Some(w) => w(transport),
            None => transport,
        }
    }
}
