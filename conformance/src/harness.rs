//! What a backend provides so the suite can run against it.

use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use transport_core::{Result, Transport};

/// Options for a node (one transport instance with its own segment name).
#[derive(Debug, Clone)]
pub struct NodeOptions {
    /// Bound on live endpoints (rule 4).
    pub max_endpoints: usize,
    /// Idle endpoints are reclaimed after this long (rule 4).
    pub idle_timeout: Duration,
}

impl Default for NodeOptions {
    fn default() -> Self {
        Self { max_endpoints: 8, idle_timeout: Duration::from_secs(30) }
    }
}

/// One transport under test and the name peers open it by.
#[derive(Clone)]
pub struct Node {
    pub transport: Arc<dyn Transport>,
    /// The segment name peers pass to `open_segment`.
    pub name: String,
    /// Harness-private state (a proxy, a child process, a fabric host id).
    pub state: Arc<dyn Any + Send + Sync>,
}

impl fmt::Debug for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Node").field("name", &self.name).field("backend", &self.transport.backend()).finish()
    }
}

/// A backend under test. Implemented once per backend (the mock's lives in
/// this crate; TCP's and RDMA's in their crates' tests) and handed to
/// [`crate::run_case`] / [`crate::conformance_main!`]. The runner builds one
/// harness per case (cases run in parallel threads of one process), so a
/// harness can keep per-case state such as the ports of its nodes.
///
/// Fault hooks return `Ok(false)` when the backend cannot produce that
/// fault; cases that need it are then reported as skipped, never passed.
#[async_trait]
pub trait Harness: Send + Sync + 'static {
    /// Backend kind, used as the first part of every case name.
    fn backend(&self) -> &str;

    /// Creates a fresh node.
    async fn node(&self, opts: &NodeOptions) -> Result<Node>;

    /// Crashes `node` abruptly, as a process killed with SIGKILL, without
    /// any orderly shutdown. Once it returns the node is silent both ways:
    /// - every call on its transport fails (as after `shutdown`; the suite
    ///   checks this at once, with `open_segment`, and fails the case with a
    ///   message naming this hook if the node still works);
    /// - nothing it started reaches a peer afterwards: no transfer, no
    ///   notification, no session message (heartbeats included);
    /// - its peers' connections to it break, and connecting to its name
    ///   fails until [`Harness::restart`].
    ///
    /// The suite never uses a killed node again, except for its name in
    /// `restart`; the case's cleanup still calls `shutdown` on it, which
    /// must return (an error is fine). `Ok(false)` if unsupported.
    async fn kill(&self, node: &Node) -> Result<bool>;

    /// Starts a new node under the same segment name as the killed `node`,
    /// with a new generation (a restarted peer): peers that had the old
    /// one open learn of the restart at their next transfer (rule 2).
    async fn restart(&self, node: &Node, opts: &NodeOptions) -> Result<Node>;

    /// Cuts, once, every live connection toward `to` from every node of
    /// this harness, data and notification channels alike: a real reset,
    /// as a link flap does. `to` stays up and accepts new connections, so
    /// the next transfer builds a new endpoint (rules 2 and 4); nothing is
    /// cut afterwards. `Ok(false)` if unsupported.
    async fn cut(&self, to: &Node) -> Result<bool>;

    /// With `on = true`, from its return until it is called with
    /// `on = false`: no byte moves, in either direction, on the
    /// connections peers have open or open anew toward `to`, transfers and
    /// notifications (session messages) alike; connections stay up, with
    /// no reset and no error, so those peers see only silence (the
    /// deadline and liveness cases rely on it). What `to` itself opens
    /// toward others may be stalled too (the mock stalls all of `to`'s
    /// traffic); no case relies on either. Resuming lets everything queued
    /// move again. A case that ends (fails, or times out) with a node
    /// still stalled has it resumed by the suite, before the case's nodes
    /// shut down, so a stall that is a real fault (netem on a device other
    /// cases use) never outlives its case. `Ok(false)` if unsupported.
    async fn stall(&self, to: &Node, on: bool) -> Result<bool>;

    /// Operating-system resource counts (open file descriptors, sockets,
    /// kernel RDMA objects), or `None` if there is no probe. Cases run in
    /// parallel in one process, so count only what this harness's nodes
    /// hold (e.g. sockets on their ports). The suite checks that no count
    /// stays above its baseline once things are closed (rule 1).
    fn os_probe(&self) -> Option<Vec<(String, u64)>>;

    /// Creates a fresh node whose notification inbox holds at most
    /// `capacity` notifications (rule 11; the backend's `inbox_capacity`
    /// option), or `Ok(None)` when the harness cannot configure it. The
    /// default is `Ok(None)`: the cases that need it are skipped.
    async fn node_with_inbox(&self, opts: &NodeOptions, capacity: usize) -> Result<Option<Node>> {
        let _ = (opts, capacity);
        Ok(None)
    }

    /// Wraps every transport the suite uses from this harness (after
    /// [`Harness::node`] and [`Harness::restart`]). The default is the
    /// identity. Wrappers let one harness run the suite through a layer: a
    /// benign fault injector (`mock_faulty`), or a deliberately broken layer
    /// ([`crate::broken::BrokenLayer`]) to prove the suite fails it.
    ///
    /// Fault hooks (`kill`, `cut`, `stall`) still receive the unwrapped
    /// [`Node`] data (`name`, `state`), so wrapping never disables them.
    fn wrap(&self, transport: Arc<dyn Transport>) -> Arc<dyn Transport> {
        transport
    }
}
