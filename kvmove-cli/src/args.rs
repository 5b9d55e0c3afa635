//! Command-line arguments. Every option overrides the same key of the
//! `--config` file; anything not given keeps the file's value or the default.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::settings::{Fragmentation, Mode, Op, Settings};

/// KV-cache transfer engine: benchmark, target and initiator.
///
/// With no subcommand, runs `bench`: a target and an initiator in this
/// process over TCP on loopback, moving a KV-cache-shaped workload and
/// verifying every byte.
#[derive(Debug, Parser)]
#[command(name = "kvmove", version, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub opts: Options,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Target and initiator in one process (the default).
    Bench,
    /// Serve registered memory and print the segment name; runs until
    /// Ctrl-C or SIGTERM.
    Target,
    /// Run the workload against a running target and verify it.
    Initiator(InitiatorArgs),
    /// Print the effective configuration (file plus options) as TOML.
    Config,
    /// The handoff scenario: several prefill senders, one decode whose
    /// memory is saturated; run with sessions (receiver-granted, rules 12
    /// and 13) and the way connectors work today (timeouts from arrival),
    /// every byte verified; prints both side by side.
    Handoff(HandoffArgs),
    /// A live view of a running kvmove started with `--metrics HOST:PORT`:
    /// rates, latency percentiles, in-flight work, peers and breakers,
    /// refreshed every interval.
    Top(TopArgs),
    /// One engine of a prefill/decode cluster (`scripts/pd-cluster`): a
    /// decode grants pages of its KV pool to the prefills that ask; a
    /// prefill reads `req <id> <decode>` lines on stdin and hands each
    /// request's KV to that decode in a session. Prints one JSON line per
    /// session it ends.
    Pd(PdArgs),
    /// Where each RDMA device and GPU sits (sysfs), and the devices
    /// `backend.rdma.devices = ["auto"]` gives each GPU's memory and each
    /// NUMA node's host memory.
    Topology(TopologyArgs),
}

#[derive(Debug, Args)]
pub struct TopologyArgs {
    /// The sysfs tree to read
    #[arg(long, default_value = "/sys", value_name = "DIR")]
    pub sysfs: PathBuf,
    /// Show a fabricated tree of a known layout instead of this host's
    #[arg(long, value_enum, conflicts_with = "sysfs")]
    pub fabricate: Option<Layout>,
}

/// Fabricated layouts (`kvmove topology --fabricate`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Layout {
    /// 8 GPUs and 8 NICs, a GPU and a NIC under each PCIe switch, 2 NUMA nodes
    DgxH100,
    /// One NIC on each of 2 sockets, a GPU on the second
    NicPerSocket,
    /// Two NICs on one host bridge and a soft-RoCE device, no GPU, no NUMA
    NicsNoGpu,
}

impl Layout {
    pub fn name(self) -> &'static str {
        match self {
            Layout::DgxH100 => "dgx-h100",
            Layout::NicPerSocket => "nic-per-socket",
            Layout::NicsNoGpu => "nics-no-gpu",
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Layout::DgxH100 => "8 GPUs, 8 NICs, a GPU and a NIC under each PCIe switch, 2 NUMA nodes",
            Layout::NicPerSocket => "one NIC per socket, a GPU on node 1 under another host bridge",
            Layout::NicsNoGpu => "two NICs on one host bridge and soft-RoCE, no GPU, NUMA unknown",
        }
    }
}

/// The role of a `kvmove pd` engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PdRole {
    Prefill,
    Decode,
}

impl PdRole {
    pub fn as_str(self) -> &'static str {
        match self {
            PdRole::Prefill => "prefill",
            PdRole::Decode => "decode",
        }
    }
}

#[derive(Debug, Args)]
pub struct PdArgs {
    /// prefill | decode
    #[arg(long, value_enum)]
    pub role: PdRole,
    /// KV bytes of one request (one decode page), in KiB (1 to 65536)
    #[arg(long, default_value_t = 256)]
    pub page_kib: u64,
    /// Decode: pages in the KV pool (1 to 4096)
    #[arg(long, default_value_t = 8)]
    pub pages: usize,
    /// Prefill: writes per request, layer by layer (1 to 1024)
    #[arg(long, default_value_t = 4)]
    pub writes: u32,
    /// Prefill: milliseconds of simulated compute before each write (the
    /// layer's forward pass)
    #[arg(long, default_value_t = 0)]
    pub compute_ms: u64,
    /// Decode: milliseconds a page stays in use after its request landed
    #[arg(long, default_value_t = 50)]
    pub hold_ms: u64,
    /// Prefill: a request not ended by then is cancelled; decode: the
    /// grant's deadline (milliseconds)
    #[arg(long, default_value_t = 30_000)]
    pub request_timeout_ms: u64,
    /// Sessions: a peer silent this long fails its sessions (milliseconds)
    #[arg(long, default_value_t = 1000)]
    pub liveness_ms: u64,
    /// Prefill: requests in flight at most; one more is refused (1 to 4096)
    #[arg(long, default_value_t = 64)]
    pub max_inflight: usize,
}

#[derive(Debug, Args)]
pub struct TopArgs {
    /// The `--metrics` address of the kvmove to watch
    #[arg(long, value_name = "HOST:PORT")]
    pub url: std::net::SocketAddr,
    /// Refresh interval in milliseconds (100 to 3600000)
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(100..=3_600_000))]
    pub interval_ms: u64,
    /// Frames to print before exiting (0: until Ctrl-C)
    #[arg(long, default_value_t = 0)]
    pub count: u64,
}

#[derive(Debug, Args)]
pub struct HandoffArgs {
    /// Prefill senders (1 to 64)
    #[arg(long, default_value_t = 4)]
    pub senders: usize,
    /// Requests per sender (1 to 100000)
    #[arg(long, default_value_t = 16)]
    pub requests: usize,
    /// KV bytes per request, in KiB (1 to 1048576)
    #[arg(long, default_value_t = 256)]
    pub request_kib: u64,
    /// Writes per request (layer by layer)
    #[arg(long, default_value_t = 4)]
    pub handoff_layers: u32,
    /// Requests the decode has memory for at once (1 to 4096)
    #[arg(long, default_value_t = 2)]
    pub decode_pages: usize,
    /// Milliseconds the decode keeps a page after its request landed
    #[arg(long, default_value_t = 100)]
    pub hold_ms: u64,
    /// Today's way: timeout from the request's arrival, in milliseconds
    #[arg(long, default_value_t = 1000)]
    pub arrival_timeout_ms: u64,
    /// Sessions: deadline from the grant, in milliseconds
    #[arg(long, default_value_t = 10_000)]
    pub grant_deadline_ms: u64,
    /// Sessions: liveness timeout, in milliseconds (at least 50)
    #[arg(long, default_value_t = 1000)]
    pub liveness_ms: u64,
    /// Sessions: kill the decode this many milliseconds after the start
    #[arg(long)]
    pub kill_decode_after_ms: Option<u64>,
}

#[derive(Debug, Args)]
pub struct InitiatorArgs {
    /// The target: its segment name `host:port`, or with etcd metadata
    /// its logical name.
    #[arg(long)]
    pub target: String,
}

/// Options of every subcommand (they may come before or after it).
#[derive(Debug, Args)]
pub struct Options {
    /// TOML file with [backend], [policy], [metadata], [workload], [target].
    #[arg(long, global = true, value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// Print one JSON object (target: one per event) instead of the table;
    /// hides the progress bar.
    #[arg(long, global = true)]
    pub json: bool,
    /// Backend: tcp | rdma | mock  [default: tcp]
    #[arg(long, global = true, value_name = "KIND")]
    pub backend: Option<String>,
    /// Metadata store: p2p | etcd | in-process  [default: p2p]
    #[arg(long, global = true, value_name = "KIND")]
    pub metadata: Option<String>,
    /// etcd client URLs, comma separated (sets metadata.etcd.endpoints).
    #[arg(long, global = true, value_name = "URLS", value_delimiter = ',')]
    pub etcd_endpoints: Option<Vec<String>>,
    /// Serve the engine's metrics as Prometheus text on http://HOST:PORT/metrics
    /// (counters, gauges and histograms of transfers, peers, breakers and
    /// connections) while the command runs  [default: off]
    #[arg(long, global = true, value_name = "HOST:PORT")]
    pub metrics: Option<std::net::SocketAddr>,
    /// Record no metrics at all (they are recorded in memory by default,
    /// for the stage breakdown under the table)
    #[arg(long, global = true)]
    pub no_metrics: bool,
    /// Address the backend listens on (backend.<kind>.listen)  [default: 127.0.0.1:0]
    #[arg(long, global = true, value_name = "HOST:PORT")]
    pub listen: Option<String>,
    /// Target: logical name published to the metadata store  [default: kvmove-target]
    #[arg(long, global = true)]
    pub name: Option<String>,
    /// Target: memory served in MiB  [default: the workload's size]
    #[arg(long, global = true, value_name = "MIB")]
    pub mem_mib: Option<u64>,
    /// Model preset: llama3-8b | llama3-70b | deepseek-v3  [default: llama3-8b]
    #[arg(long, global = true)]
    pub model: Option<String>,
    /// Prompt length in tokens  [default: 1024]
    #[arg(long, global = true)]
    pub tokens: Option<u64>,
    /// Tokens per page  [default: 16]
    #[arg(long, global = true, value_name = "TOKENS")]
    pub page_size: Option<u64>,
    /// Layer count  [default: the model's]
    #[arg(long, global = true)]
    pub layers: Option<u32>,
    /// Bytes per token per layer, K and V together  [default: the model's]
    #[arg(long, global = true, value_name = "BYTES")]
    pub bytes_per_token: Option<u64>,
    /// Direction seen from the initiator  [default: write]
    #[arg(long, global = true, value_enum)]
    pub op: Option<Op>,
    /// Transfers in flight at once  [default: 32]
    #[arg(long, global = true)]
    pub concurrency: Option<usize>,
    /// Timing modes to run  [default: both]
    #[arg(long, global = true, value_enum)]
    pub mode: Option<Mode>,
    /// Simulated compute per layer in milliseconds  [default: 2]
    #[arg(long, global = true, value_name = "MS")]
    pub compute_delay_ms: Option<u64>,
    /// Page placement  [default: scattered]
    #[arg(long, global = true, value_enum)]
    pub fragmentation: Option<Fragmentation>,
    /// Measured passes per mode  [default: 3]
    #[arg(long, global = true)]
    pub iterations: Option<u32>,
    /// Unmeasured passes first  [default: 1]
    #[arg(long, global = true)]
    pub warmup: Option<u32>,
    /// Run the per-request pass: true | false  [default: true]
    #[arg(long, global = true, value_name = "BOOL")]
    pub per_request: Option<bool>,
    /// Seed of page placement and data  [default: 42]
    #[arg(long, global = true)]
    pub seed: Option<u64>,
    /// Run each transfer unit as a session granted by the target (writes
    /// only): true | false  [default: false]
    #[arg(long, global = true, value_name = "BOOL")]
    pub sessions: Option<bool>,
}

impl Options {
    /// Loads the file (if any) and applies the options over it.
    pub fn settings(&self) -> kvmove::Result<Settings> {
        let mut s = match &self.config {
            Some(p) => Settings::from_file(p)?,
            None => Settings::default(),
        };
        if let Some(b) = &self.backend {
            s.backend.kind = b.parse().map_err(|e: kvmove::Error| {
                kvmove::Error::new(kvmove::ErrorKind::Config, format!("--backend: {}", e.message()))
            })?;
        }
        if let Some(m) = &self.metadata {
            s.metadata.kind = match m.as_str() {
                "p2p" => kvmove::MetadataKind::P2p,
                "etcd" => kvmove::MetadataKind::Etcd,
                "in-process" => kvmove::MetadataKind::InProcess,
                other => {
                    return Err(kvmove::Error::new(
                        kvmove::ErrorKind::Config,
                        format!("--metadata: unknown store '{other}'; expected one of: p2p, etcd, in-process"),
                    ))
                }
            };
        }
        if let Some(e) = &self.etcd_endpoints {
            s.metadata.set_etcd_endpoints(e.clone());
        }
        if let Some(l) = &self.listen {
            s.backend.set_listen(l);
        }
        let t = &mut s.target;
        if let Some(v) = &self.name {
            t.name = v.clone();
        }
        if let Some(v) = self.mem_mib {
            t.mem_mib = Some(v);
        }
        let w = &mut s.workload;
        macro_rules! set {
            ($($field:ident),*) => {$(
                if let Some(v) = &self.$field {
                    w.$field = v.clone().into();
                }
            )*};
        }
        set!(model, tokens, page_size, op, concurrency, mode, compute_delay_ms, fragmentation, iterations, warmup);
        set!(per_request, seed, sessions);
        if let Some(v) = self.layers {
            w.layers = Some(v);
        }
        if let Some(v) = self.bytes_per_token {
            w.bytes_per_token = Some(v);
        }
        s.validate()?;
        Ok(s)
    }
}
