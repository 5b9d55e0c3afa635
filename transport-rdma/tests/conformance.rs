//! The conformance suite against the RDMA backend, on a real device (the
//! soft-RoCE VM of scripts/rdma-tests.sh where there is no hardware).
//!
//! Nodes are transports in this process on the test device. `kill` shuts
//! the node's transport down (its QPs are destroyed, so peers' work fails
//! with a transport error and their side channels close); `restart` starts
//! a new transport (new generation) on the same side-channel address. `cut`
//! and `stall` are not supported (one soft-RoCE device has no per-peer link
//! to cut): those cases are reported as ignored, never passed. The OS
//! probe is the kernel's own count of this process's QPs, CQs, MRs and PDs
//! (`rdma resource`), so cases run one at a time.
//!
//! Without an RDMA device every case is reported ignored (with a loud
//! line), unless RDMA_REQUIRED=1 or RXE_VM=1, where that is a failure
//! (scripts/rdma-tests.sh sets it for its runs on a device or in the VM).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure

mod common;

use std::any::Any;
use std::sync::{Arc, Weak};
use std::time::Duration;

use async_trait::async_trait;
use conformance::{Harness, Node, NodeOptions};
use transport_core::{Error, ErrorKind, Result, Transport};
use transport_rdma::{rdma_devices, RdmaConfig, RdmaTransport};

#[derive(Debug, Default)]
struct RdmaHarness;

struct State {
    transport: Weak<RdmaTransport>,
}

fn cfg(opts: &NodeOptions, listen: String) -> RdmaConfig {
    RdmaConfig {
        listen,
        max_endpoints: opts.max_endpoints,
        idle_timeout_ms: opts.idle_timeout.as_millis().max(1) as u64,
        ..common::config()
    }
}

async fn make(opts: &NodeOptions, listen: String) -> Result<Node> {
    let mut last = None;
    // A restarted node rebinds the old address; give the old socket a moment.
    for _ in 0..100 {
        match RdmaTransport::new(cfg(opts, listen.clone())).await {
            Ok(t) => {
                let t = Arc::new(t);
                let st: Arc<dyn Any + Send + Sync> = Arc::new(State { transport: Arc::downgrade(&t) });
                return Ok(Node { name: t.local_segment_name(), transport: t, state: st });
            }
            Err(e) if e.kind() == ErrorKind::Io || e.kind() == ErrorKind::ResourceExhausted => {
                last = Some(e);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| Error::new(ErrorKind::Internal, "no transport")))
}

#[async_trait]
impl Harness for RdmaHarness {
    fn backend(&self) -> &str {
        "rdma"
    }

    async fn node(&self, opts: &NodeOptions) -> Result<Node> {
        make(opts, "127.0.0.1:0".into()).await
    }

    async fn kill(&self, node: &Node) -> Result<bool> {
        let st = node.state.downcast_ref::<State>().ok_or_else(|| Error::new(ErrorKind::Internal, "foreign node"))?;
        if let Some(t) = st.transport.upgrade() {
            t.shutdown().await?;
        }
        Ok(true)
    }

    async fn restart(&self, node: &Node, opts: &NodeOptions) -> Result<Node> {
        make(opts, node.name.clone()).await
    }

    async fn cut(&self, _to: &Node) -> Result<bool> {
        Ok(false)
    }

    async fn stall(&self, _to: &Node, _on: bool) -> Result<bool> {
        Ok(false)
    }

    fn os_probe(&self) -> Option<Vec<(String, u64)>> {
        Some(common::my_counts().into_iter().collect())
    }
}

fn main() {
    let mut args = libtest_mimic::Arguments::from_args();
    // The kernel counts are per process: one case at a time.
    args.test_threads = Some(1);
    let have = !rdma_devices().unwrap_or_default().is_empty();
    let flag = |v: &str| std::env::var(v).is_ok_and(|x| x == "1" || x.eq_ignore_ascii_case("true"));
    // CONFORMANCE_STRICT alone does not demand a device: on a machine
    // without one, scripts/rdma-tests.sh runs this suite in the VM instead.
    let required = flag("RDMA_REQUIRED") || flag("RXE_VM");
    let trials = conformance::trials(|| RdmaHarness);
    let trials = if have {
        trials
    } else if required {
        eprintln!("rdma conformance: no RDMA device, but RDMA_REQUIRED or RXE_VM is set");
        std::process::exit(1);
    } else {
        eprintln!("RDMA CONFORMANCE SKIPPED: no RDMA device (scripts/rdma-tests.sh runs it in a soft-RoCE VM)");
        trials.into_iter().map(|t| t.with_ignored_flag(true)).collect()
    };
    libtest_mimic::run(&args, trials).exit()
}
