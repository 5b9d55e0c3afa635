//! The conformance suite on the in-process transport: one test per case
//! (`cargo test --test conformance`; a filter such as `lifecycle::` runs a
//! group). A hook this harness cannot provide answers `Ok(false)` and the
//! cases that need it are reported ignored, with the reason.

use async_trait::async_trait;
use conformance::{Harness, Node, NodeOptions};
use kvmove_transport_template::{Config, Fabric, InProcTransport};
use transport_core::{Error, ErrorKind, Result, Transport};

/// Makes the nodes of one case, all on one fabric.
#[derive(Debug, Default)]
struct InProcHarness {
    fabric: Fabric,
}

impl InProcHarness {
    fn start(&self, config: Config) -> Result<Node> {
        let t = InProcTransport::new(&self.fabric, config)?;
        let name = t.local_segment_name();
        // `state` is where a harness keeps what its hooks need per node;
        // `kill` finds the concrete transport in it.
        Ok(Node { transport: t.clone(), name, state: t })
    }

    fn config(opts: &NodeOptions) -> Config {
        Config { max_endpoints: opts.max_endpoints, ..Config::default() }
    }
}

#[async_trait]
impl Harness for InProcHarness {
    fn backend(&self) -> &str {
        "inproc"
    }

    async fn node(&self, opts: &NodeOptions) -> Result<Node> {
        self.start(Self::config(opts))
    }

    /// The node stops as a crash would: every call on it fails, peers see
    /// it gone.
    async fn kill(&self, node: &Node) -> Result<bool> {
        let t = node.state.clone().downcast::<InProcTransport>().map_err(|_| {
            Error::new(ErrorKind::InvalidRequest, "not a node of this harness").with("node", &node.name)
        })?;
        t.kill();
        Ok(true)
    }

    async fn restart(&self, node: &Node, opts: &NodeOptions) -> Result<Node> {
        self.start(Config { name: Some(node.name.clone()), ..Self::config(opts) })
    }

    /// No connections here to cut or stall: the cases that need them are
    /// reported ignored.
    async fn cut(&self, _to: &Node) -> Result<bool> {
        Ok(false)
    }

    async fn stall(&self, _to: &Node, _on: bool) -> Result<bool> {
        Ok(false)
    }

    /// It holds no operating-system resources.
    fn os_probe(&self) -> Option<Vec<(String, u64)>> {
        None
    }

    async fn node_with_inbox(&self, opts: &NodeOptions, capacity: usize) -> Result<Option<Node>> {
        self.start(Config { inbox_capacity: capacity, ..Self::config(opts) }).map(Some)
    }
}

conformance::conformance_main!(InProcHarness::default);
