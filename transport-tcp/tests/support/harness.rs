//! The conformance harness of the TCP backend. Every node lives behind a
//! loopback fault proxy (its segment name is the proxy's address), so
//! `cut` and `stall` are real socket faults; `kill` resets every connection
//! and stops the listener abruptly, then drops the node; `restart` starts a
//! new node (new generation) behind a proxy on the same address.
//!
//! With direct same-host writes on (the default configuration), small
//! writes never touch a socket, so no proxy can stall them (as no network
//! fault stalls a copy within one host): that harness says it cannot stall,
//! and the cases that need a stall run against the other two paths.

use std::any::Any;
use std::net::SocketAddr;
use std::sync::{Arc, Weak};
use std::time::Duration;

use super::proxy::FaultProxy;
use async_trait::async_trait;
use conformance::{Harness, Node, NodeOptions};
use transport_core::{Error, ErrorKind, Result, Transport};
use transport_tcp::{TcpConfig, TcpTransport};

/// Where the nodes' bytes go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// The default configuration: same-host copies and direct writes.
    Direct,
    /// Same-host copies, no direct writes: every byte is copied by the
    /// side it lands on, after a frame through the proxy.
    Pull,
    /// `same_host = false`: every byte through the sockets.
    Sockets,
}

/// One per case: remembers the ports of its nodes, so its OS probe counts
/// only this case's sockets (cases run in parallel in one process).
pub struct TcpHarness {
    ports: parking_lot::Mutex<Vec<u16>>,
    path: Path,
}

impl TcpHarness {
    /// Nodes whose bytes go by `path`.
    pub fn new(path: Path) -> Self {
        Self { ports: parking_lot::Mutex::default(), path }
    }
}

struct State {
    proxy: Arc<FaultProxy>,
    transport: Weak<TcpTransport>,
}

fn state(node: &Node) -> Result<&State> {
    node.state.downcast_ref::<State>().ok_or_else(|| Error::new(ErrorKind::Internal, "foreign node state"))
}

async fn make(h: &TcpHarness, opts: &NodeOptions, listen: SocketAddr, inbox: Option<usize>) -> Result<Node> {
    // The proxy comes first so the node can advertise its address.
    let mut proxy = None;
    for _ in 0..200 {
        match FaultProxy::start(listen, listen).await {
            Ok(p) => {
                proxy = Some(p);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
    let proxy = proxy.ok_or_else(|| Error::new(ErrorKind::Io, "cannot bind the proxy address"))?;
    let cfg = TcpConfig {
        advertise: Some(proxy.addr.to_string()),
        max_endpoints: opts.max_endpoints,
        idle_timeout: opts.idle_timeout,
        connect_timeout: Duration::from_secs(2),
        inbox_capacity: inbox.unwrap_or(transport_core::DEFAULT_INBOX),
        same_host: h.path != Path::Sockets,
        direct_writes: h.path == Path::Direct,
        direct_reads: h.path == Path::Direct,
        // Through the sockets, device memory goes through staging buffers
        // (off by default): the device cases run both ways.
        staging_buffers: if h.path == Path::Sockets { 16 } else { 0 },
        // A deadline or cancel waits for the target's answers until it is
        // silent this long, then resets (a copy the target had started can
        // land after that: docs/CONTRACT.md, tcp row). Beside the rest of
        // CI on two cores a target stalls past the default 250 ms, and
        // `memory::slow_device_copies_stay_quiet` saw a copy land after
        // the report (ci65, ci67); a second of silence is a stalled peer.
        drain_timeout: Duration::from_secs(1),
        ..TcpConfig::default()
    };
    let t = Arc::new(TcpTransport::new(cfg).await?);
    proxy.set_upstream(t.local_addr());
    h.ports.lock().extend([proxy.addr.port(), t.local_addr().port()]);
    let name = proxy.addr.to_string();
    let st: Arc<dyn Any + Send + Sync> = Arc::new(State { proxy, transport: Arc::downgrade(&t) });
    Ok(Node { transport: t, name, state: st })
}

#[async_trait]
impl Harness for TcpHarness {
    fn backend(&self) -> &str {
        match self.path {
            Path::Direct => "tcp",
            Path::Pull => "tcp_pull",
            Path::Sockets => "tcp_sockets",
        }
    }

    async fn node(&self, opts: &NodeOptions) -> Result<Node> {
        make(self, opts, "127.0.0.1:0".parse().map_err(|_| Error::new(ErrorKind::Internal, "addr"))?, None).await
    }

    async fn node_with_inbox(&self, opts: &NodeOptions, capacity: usize) -> Result<Option<Node>> {
        let any = "127.0.0.1:0".parse().map_err(|_| Error::new(ErrorKind::Internal, "addr"))?;
        make(self, opts, any, Some(capacity)).await.map(Some)
    }

    async fn kill(&self, node: &Node) -> Result<bool> {
        let s = state(node)?;
        s.proxy.kill();
        if let Some(t) = s.transport.upgrade() {
            t.shutdown().await?;
        }
        Ok(true)
    }

    async fn restart(&self, node: &Node, opts: &NodeOptions) -> Result<Node> {
        let addr: SocketAddr =
            node.name.parse().map_err(|_| Error::new(ErrorKind::Internal, "node name is not an address"))?;
        make(self, opts, addr, None).await
    }

    async fn cut(&self, to: &Node) -> Result<bool> {
        state(to)?.proxy.cut();
        Ok(true)
    }

    async fn stall(&self, to: &Node, on: bool) -> Result<bool> {
        if self.path == Path::Direct {
            return Ok(false);
        }
        state(to)?.proxy.stall(on);
        Ok(true)
    }

    fn os_probe(&self) -> Option<Vec<(String, u64)>> {
        let ports = self.ports.lock().clone();
        Some(vec![("sockets".into(), super::sockets_on(&ports))])
    }
}
