//! The conformance suite against the RDMA backend, on a real device (the
//! soft-RoCE VM of scripts/rdma-tests.sh where there is no hardware).
//!
//! Nodes are transports in this process. `kill` shuts the node's
//! transport down (its QPs are destroyed, so peers' work fails with a
//! transport error and their side channels close); `restart` starts a new
//! transport (new generation) on the same side-channel address and device.
//! The OS probe is the kernel's own count of this process's QPs, CQs, MRs
//! and PDs (`rdma resource`), so cases run one at a time.
//!
//! Link faults need links that may be faulted: the soft-RoCE VM
//! (scripts/rxe-vm) names them in RDMA_TEST_FAULT_LINKS ("rxe0:rv0:rvb0
//! ..."; device, its netdev, its bridge port). There each node gets a
//! device of its own, so traffic between nodes crosses the bridge, and
//! * `cut` takes the node's link down and up again (`ip link`): its port
//!   reports IBV_EVENT_PORT_ERR, it drops every QP on it, peers see their
//!   side channels close; new connections work once the port is active;
//! * `stall` drops every packet to and from the node's device (netem
//!   `loss 100%` on its netdev and its bridge port) until resumed; QPs
//!   stay up and retransmit (the ACK timeout below outlasts the stalls).
//!
//! Elsewhere (a real NIC is never faulted) `cut` and `stall` are
//! unsupported and those cases are reported ignored, never passed.
//!
//! With `RDMA_CONFORMANCE_RAILS=N` (N >= 2) every node is N devices driven
//! as rails (`transport_rdma::open_devices` under `transport_rails::Rails`), the cases
//! are named `rdma_railsN::...`, the node's endpoint bound is split over
//! its rails, and `cut` / `stall` hit every link of the node.
//!
//! With `RDMA_CONFORMANCE_CUDA=1` the binary re-runs itself with kvmove's
//! CUDA driver double as `libcuda.so.1` (`kvmove_cuda_double`) and runs
//! the device cases about data and device memory (every `device_*::data`
//! run, `memory::device_regions`, `memory::slow_device_copies_stay_quiet`)
//! with CUDA device memory through the real CUDA provider, named
//! `rdma_cuda::...`: registration (a dma-buf export the NIC cannot take
//! falls back to staging), staging buffers pinned through the driver,
//! failed and slow device copies.
//!
//! Without an RDMA device every case is reported ignored (with a loud
//! line), unless RDMA_REQUIRED=1 or RXE_VM=1, where that is a failure
//! (scripts/rdma-tests.sh sets it for its runs on a device or in the VM).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure

mod common;

use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use async_trait::async_trait;
use common::Link;
use conformance::{Harness, Node, NodeOptions};
use transport_core::{Error, ErrorKind, Result, Transport, DEFAULT_INBOX};
use transport_rails::RailsConfig;
use transport_rdma::{rdma_devices, RdmaConfig, RdmaTransport};

#[derive(Debug, Default)]
struct RdmaHarness {
    links: Vec<Link>,
    next: AtomicUsize,
    /// Devices per node (1: a plain transport; more: rails).
    rails: usize,
    label: String,
}

struct State {
    transport: Weak<dyn Transport>,
    /// The node's links (one per rail), if faultable.
    links: Vec<Link>,
    /// The node's `inbox_capacity` (a restart keeps it).
    inbox: usize,
}

fn cfg(opts: &NodeOptions, listen: String, device: Option<String>, inbox: usize) -> RdmaConfig {
    let base = common::config();
    RdmaConfig {
        listen,
        device: device.or(base.device),
        inbox_capacity: inbox,
        max_endpoints: opts.max_endpoints,
        idle_timeout_ms: opts.idle_timeout.as_millis().max(1) as u64,
        // ~0.5 s ACK timeout, 6 retries: a stalled QP retransmits for
        // ~3.8 s before it gives up, longer than any stall of the suite
        // (7 would be forever on soft-RoCE: `RdmaConfig::retry_count`).
        ack_timeout: 17,
        retry_count: 6,
        ..base
    }
}

/// Runs a `tc` script (`common::batch` with `-force`, one process); its
/// failure is the case's failure. On the blocking pool: in the VM under
/// load a process start takes up to seconds, and a runtime worker waiting
/// that long holds the task it woke last (tokio's LIFO slot is never
/// stolen), which stalled the nodes' session timers past their liveness
/// timeout (issue 31).
async fn tc_batch(script: String) -> Result<()> {
    tokio::task::spawn_blocking(move || common::batch("tc", &["-force"], &script))
        .await
        .map_err(|e| Error::new(ErrorKind::Internal, format!("tc -batch: {e}")))?
        .map_err(|e| Error::new(ErrorKind::Io, e))
}

/// Takes `netdev` down or up (`common::ip_link`: its static neighbours
/// survive), on the blocking pool like [`sh`].
async fn link(netdev: &str, up: bool) -> Result<()> {
    let n = netdev.to_string();
    tokio::task::spawn_blocking(move || common::ip_link(&n, up))
        .await
        .map_err(|e| Error::new(ErrorKind::Internal, format!("ip link set {netdev}: {e}")))?
        .map_err(|e| Error::new(ErrorKind::Io, e))
}

/// Takes every link of a node down (or up) at once and waits for their
/// ports to follow: a node's rails fail together, and a loaded VM takes
/// seconds per link.
async fn set_links(links: &[Link], up: bool) -> Result<()> {
    let state = if up { "ACTIVE" } else { "DOWN" };
    let mut all = tokio::task::JoinSet::new();
    for l in links.iter().cloned() {
        all.spawn(async move {
            link(&l.netdev, up).await?;
            port_state(&l.device, state).await
        });
    }
    while let Some(done) = all.join_next().await {
        done.map_err(|e| Error::new(ErrorKind::Internal, format!("a link change failed: {e}")))??;
    }
    Ok(())
}

/// How long a port may take to follow its link: by the clock, not by a
/// count of sleeps, which a starved VM stretches far past it.
const PORT_WAIT: Duration = Duration::from_secs(15);

/// Waits (bounded) until `device`'s port 1 is in `state` ("ACTIVE", "DOWN").
async fn port_state(device: &str, state: &str) -> Result<()> {
    let path = format!("/sys/class/infiniband/{device}/ports/1/state");
    let deadline = std::time::Instant::now() + PORT_WAIT;
    loop {
        if std::fs::read_to_string(&path).is_ok_and(|s| s.contains(state)) {
            return Ok(());
        }
        if std::time::Instant::now() >= deadline {
            return Err(Error::new(
                ErrorKind::Timeout,
                format!("{device} port 1 did not become {state} within {PORT_WAIT:?}"),
            ));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn make(opts: &NodeOptions, listen: String, links: Vec<Link>, inbox: usize) -> Result<Node> {
    // A link an earlier case cut may still be coming back on a loaded VM:
    // wait for it (bounded) rather than fail this case for it.
    for l in &links {
        let _ = port_state(&l.device, "ACTIVE").await;
    }
    let mut last = None;
    // A restarted node rebinds the old address; give the old socket a moment.
    for _ in 0..100 {
        let device = links.first().map(|l| l.device.clone());
        let made: Result<Arc<dyn Transport>> = if links.len() > 1 {
            let per_rail = NodeOptions { max_endpoints: (opts.max_endpoints / links.len()).max(1), ..opts.clone() };
            let c = RdmaConfig {
                devices: links.iter().map(|l| l.device.clone()).collect(),
                rails: RailsConfig { pause_ms: 300, max_pause_ms: 1_000, ..RailsConfig::default() },
                ..cfg(&per_rail, listen.clone(), device, inbox)
            };
            match transport_rdma::open_devices(c.clone()).await {
                Ok(rails) => transport_rails::over(rails, None, c.rails),
                Err(e) => Err(e),
            }
        } else {
            RdmaTransport::new(cfg(opts, listen.clone(), device, inbox))
                .await
                .map(|t| Arc::new(t) as Arc<dyn Transport>)
        };
        match made {
            Ok(t) => {
                let st: Arc<dyn Any + Send + Sync> =
                    Arc::new(State { transport: Arc::downgrade(&t), links: links.clone(), inbox });
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
        &self.label
    }

    async fn node(&self, opts: &NodeOptions) -> Result<Node> {
        make(opts, "127.0.0.1:0".into(), self.next_links(), DEFAULT_INBOX).await
    }

    async fn node_with_inbox(&self, opts: &NodeOptions, capacity: usize) -> Result<Option<Node>> {
        make(opts, "127.0.0.1:0".into(), self.next_links(), capacity).await.map(Some)
    }

    async fn kill(&self, node: &Node) -> Result<bool> {
        if let Some(t) = state(node)?.transport.upgrade() {
            t.shutdown().await?;
        }
        Ok(true)
    }

    async fn restart(&self, node: &Node, opts: &NodeOptions) -> Result<Node> {
        let st = state(node)?;
        make(opts, node.name.clone(), st.links.clone(), st.inbox).await
    }

    async fn cut(&self, to: &Node) -> Result<bool> {
        let links = &state(to)?.links;
        if links.is_empty() {
            return Ok(false);
        }
        // On a task of its own: a case that stops waiting for the cut (its
        // time limit) must not leave the links down for every case after it.
        let links = links.clone();
        tokio::spawn(async move {
            let down = set_links(&links, false).await;
            // The node sees IBV_EVENT_PORT_ERR and drops its QPs; give its
            // event handler a moment before the link returns (always).
            tokio::time::sleep(Duration::from_millis(50)).await;
            let up = set_links(&links, true).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
            down.and(up)
        })
        .await
        .map_err(|e| Error::new(ErrorKind::Internal, format!("the cut's task failed: {e}")))??;
        Ok(true)
    }

    async fn stall(&self, to: &Node, on: bool) -> Result<bool> {
        let links = &state(to)?.links;
        if links.is_empty() {
            return Ok(false);
        }
        // One `tc` process for every device of the node (`tc -batch`): a
        // process start costs seconds in the VM beside busy loops.
        let devs = links.iter().flat_map(|l| [&l.netdev, &l.bridge_port]);
        if on {
            let script: String = devs.map(|d| format!("qdisc replace dev {d} root netem loss 100%\n")).collect();
            tc_batch(script).await?;
        } else {
            // Nothing to delete is fine (a resume without a stall): -force
            // goes on past it.
            let script: String = devs.map(|d| format!("qdisc del dev {d} root\n")).collect();
            let _ = tc_batch(script).await;
        }
        Ok(true)
    }

    fn os_probe(&self) -> Option<Vec<(String, u64)>> {
        Some(common::my_counts().into_iter().collect())
    }
}

impl RdmaHarness {
    /// `rails` devices per node (round robin), so nodes talk across the
    /// bridge.
    fn next_links(&self) -> Vec<Link> {
        match self.links.len() {
            0 => Vec::new(),
            n => {
                let first = self.next.fetch_add(self.rails, Ordering::Relaxed);
                (0..self.rails).map(|i| self.links[(first + i) % n].clone()).collect()
            }
        }
    }
}

fn state(node: &Node) -> Result<&State> {
    node.state.downcast_ref::<State>().ok_or_else(|| Error::new(ErrorKind::Internal, "foreign node"))
}

// The heap census for `lifecycle::no_hidden_growth`.
conformance::census_allocator!();

/// The runs of the CUDA pass (`RDMA_CONFORMANCE_CUDA=1`).
fn cuda_run(name: &str) -> bool {
    name.contains("::memory::device_regions")
        || name.contains("::memory::slow_device_copies")
        || (name.contains("::device_") && name.contains("::data::"))
}

fn main() {
    let cuda = std::env::var("RDMA_CONFORMANCE_CUDA").is_ok_and(|v| v == "1");
    if cuda {
        let driver = kvmove_cuda_double::run_under_double();
        kvmove_cuda_double::devices::install(driver);
    }
    let mut args = libtest_mimic::Arguments::from_args();
    // The kernel counts are per process: one case at a time.
    args.test_threads = Some(1);
    // RUST_LOG=... shows the backends' logs (rails paused, endpoints
    // broken) next to a failing case.
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .try_init();
    }
    let have = !rdma_devices().unwrap_or_default().is_empty();
    let flag = |v: &str| std::env::var(v).is_ok_and(|x| x == "1" || x.eq_ignore_ascii_case("true"));
    // CONFORMANCE_STRICT alone does not demand a device: on a machine
    // without one, scripts/rdma-tests.sh runs this suite in the VM instead.
    let required = flag("RDMA_REQUIRED") || flag("RXE_VM");
    let links = common::fault_links();
    if have && links.is_empty() {
        eprintln!("rdma conformance: no RDMA_TEST_FAULT_LINKS (not the soft-RoCE VM): cut/stall cases are ignored");
    }
    let rails: usize = std::env::var("RDMA_CONFORMANCE_RAILS").ok().and_then(|v| v.parse().ok()).unwrap_or(1).max(1);
    let label = match (rails, cuda) {
        (_, true) => "rdma_cuda".to_string(),
        (1, false) => "rdma".to_string(),
        (n, false) => format!("rdma_rails{n}"),
    };
    let trials = conformance::trials(move || RdmaHarness {
        links: links.clone(),
        next: AtomicUsize::new(0),
        rails,
        label: label.clone(),
    });
    let trials: Vec<_> = if cuda { trials.into_iter().filter(|t| cuda_run(t.name())).collect() } else { trials };
    let trials = if have {
        trials
    } else if required {
        eprintln!("rdma conformance: no RDMA device, but RDMA_REQUIRED or RXE_VM is set");
        std::process::exit(1);
    } else {
        eprintln!("RDMA CONFORMANCE SKIPPED: no RDMA device (scripts/rdma-tests.sh runs it in a soft-RoCE VM)");
        trials.into_iter().map(|t| t.with_ignored_flag(true)).collect()
    };
    conformance::run_trials(&args, trials)
}
