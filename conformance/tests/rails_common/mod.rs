//! The conformance harness over `transport_rails::Rails`: every node is two
//! mock hosts (two rails) driven as one transport, paired by index with its
//! peers' rails, with or without a topology. Kill, cut and stall hit both
//! rails of a node (a rail failure that leaves the other up is what
//! `transport-mock/tests/rails.rs` and the RDMA VM tests do).
// Each of the two binaries uses one of the constructors.
#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use conformance::{Harness, Node, NodeOptions};
use transport_core::{Result, Transport};
use transport_mock::{MockConfig, MockFabric, MockTransport};
use transport_rails::topology::{Place, Sysfs, Topology};
use transport_rails::Rails;
use transport_rails::RailsConfig;

const RAILS: usize = 2;
static NEXT: AtomicUsize = AtomicUsize::new(0);

#[derive(Debug, Default)]
pub struct RailsHarness {
    fabric: MockFabric,
    /// With a topology: rail 0's NIC on NUMA node 0, rail 1's on node 1,
    /// and every region's memory on node 1 (a stand-in for `/proc` that
    /// says so), so every region keeps to rail 1 while it is up.
    placed: Option<FakeProc>,
}

/// A directory that stands for `/proc`, placing all memory on node 1.
#[derive(Debug)]
struct FakeProc(std::path::PathBuf);

impl Drop for FakeProc {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl RailsHarness {
    /// Rails with the topology above.
    pub fn placed() -> Self {
        // One per harness (the suite makes one per case, in parallel).
        static HARNESSES: AtomicUsize = AtomicUsize::new(0);
        let n = HARNESSES.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("kvmove-rails-proc-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("self")).expect("a stand-in for /proc");
        std::fs::write(dir.join("self/maps"), "0-ffffffffffffffff rw-p 00000000 00:00 0\n").expect("maps");
        std::fs::write(dir.join("self/numa_maps"), "0 default anon=1 N1=1\n").expect("numa_maps");
        RailsHarness { fabric: MockFabric::default(), placed: Some(FakeProc(dir)) }
    }
}

/// The names of a node's rails (rail 0's is the node's).
struct Names(Vec<String>);

impl RailsHarness {
    fn start(&self, names: Vec<String>, opts: &NodeOptions, inbox: Option<usize>) -> Result<Node> {
        let mut rails: Vec<Arc<dyn Transport>> = Vec::new();
        for n in &names {
            let mut cfg = MockConfig {
                name: Some(n.clone()),
                // The node's bound split over its rails: `Rails` reports
                // the sum as its own bound (and counts every rail's).
                max_endpoints: (opts.max_endpoints / RAILS).max(1),
                idle_timeout: opts.idle_timeout,
                ..MockConfig::default()
            };
            if let Some(c) = inbox {
                cfg.inbox_capacity = c;
            }
            rails.push(MockTransport::new(&self.fabric, cfg)?);
        }
        // Small slices and chunks, so even the suite's small batches are
        // spread over both rails.
        let cfg = RailsConfig { slice_size: 64 << 10, chunk_bytes: 128 << 10, ..RailsConfig::default() };
        let topology = self.placed.as_ref().map(|proc| {
            let places = vec![Place { pci: Vec::new(), numa: Some(0) }, Place { pci: Vec::new(), numa: Some(1) }];
            Topology::of_places(Sysfs::new("/nonexistent"), places).with_proc_root(&proc.0)
        });
        let t = Rails::placed(rails, None, cfg, topology)?;
        Ok(Node { name: t.local_segment_name(), transport: t, state: Arc::new(Names(names)) })
    }

    fn names(node: &Node) -> Vec<String> {
        node.state.downcast_ref::<Names>().map(|n| n.0.clone()).unwrap_or_else(|| vec![node.name.clone()])
    }

    fn fresh() -> Vec<String> {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        (0..RAILS).map(|r| format!("rails-{n}.r{r}")).collect()
    }
}

#[async_trait]
impl Harness for RailsHarness {
    fn backend(&self) -> &str {
        if self.placed.is_some() {
            "rails_placed"
        } else {
            "rails_mock"
        }
    }

    async fn node(&self, opts: &NodeOptions) -> Result<Node> {
        self.start(Self::fresh(), opts, None)
    }

    async fn kill(&self, node: &Node) -> Result<bool> {
        for n in Self::names(node) {
            self.fabric.kill(&n)?;
        }
        Ok(true)
    }

    async fn restart(&self, node: &Node, opts: &NodeOptions) -> Result<Node> {
        self.start(Self::names(node), opts, None)
    }

    async fn cut(&self, to: &Node) -> Result<bool> {
        for n in Self::names(to) {
            self.fabric.cut(&n)?;
        }
        Ok(true)
    }

    async fn stall(&self, to: &Node, on: bool) -> Result<bool> {
        for n in Self::names(to) {
            self.fabric.stall(&n, on)?;
        }
        Ok(true)
    }

    fn os_probe(&self) -> Option<Vec<(String, u64)>> {
        None
    }

    async fn node_with_inbox(&self, opts: &NodeOptions, capacity: usize) -> Result<Option<Node>> {
        self.start(Self::fresh(), opts, Some(capacity)).map(Some)
    }
}
