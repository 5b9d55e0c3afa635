//! kvmove: the KV-cache transfer engine with its backend chosen by
//! configuration (rule 10 of the contract, `docs/CONTRACT.md`), not by code.
//!
//! # Design
//!
//! A program reads one [`EngineConfig`] (TOML or any serde format) that
//! names the backend (`tcp`, `rdma` or `mock`) with its options, the shared
//! policy ([`PolicyConfig`]: retry, deadlines, circuit breaker,
//! backpressure) and the metadata store (`p2p`, `etcd`, `in-process`), and
//! calls [`build`]. It gets an [`Engine`] over an `Arc<dyn Transport>`
//! and never names a backend type, so the same code runs over TCP, RDMA
//! or the in-process mock by changing the file:
//!
//! ```no_run
//! # async fn demo() -> kvmove::Result<()> {
//! let cfg = kvmove::EngineConfig::from_toml_str(r#"
//!     [backend]
//!     kind = "tcp"
//!     [backend.tcp]
//!     listen = "127.0.0.1:0"
//!     [policy.retry]
//!     max_attempts = 4
//! "#)?;
//! let engine = kvmove::build(&cfg).await?;
//! println!("serving as {}", engine.local_segment_name());
//! # Ok(()) }
//! ```
//!
//! Backends are Cargo features: `tcp` (default), `mock`, `rdma` (needs
//! libibverbs), and the `etcd` metadata store. A config that selects a
//! backend this build lacks fails with a `Config` error that says which
//! feature to turn on; its options table is still accepted, so one file
//! serves every build.
//!
//! Peers find each other peer to peer by default (the segment name is the
//! peer's `host:port`). With a metadata store ([`build_metadata`]: etcd or
//! in-process), [`publish`] puts an engine's descriptor (asked of the
//! engine itself, [`Engine::local_descriptor`]: no round trip) under a logical
//! name and [`resolve`] opens the peer behind a name after checking that it
//! serves the generation the store advertises (a restarted peer's stale
//! entry is refused, never used).
//!
//! The mock backend keeps one fabric per process: every engine built with
//! `kind = "mock"` in a process can reach every other by segment name.
//!
//! Config errors are one line that names the file, line, column, table and
//! key (`kvmove.toml:7:1: in [backend.tcp]: unknown field `lane` ...`).
#![forbid(unsafe_code)]

#[cfg(any(feature = "tcp", feature = "mock", feature = "rdma"))]
mod backends;
mod build;
mod config;
mod directory;
mod toml_error;

pub use toml_error::locate as locate_error;

#[cfg(feature = "mock")]
pub use backends::mock_fabric;
pub use build::{build, build_metadata, build_transport, own_descriptor, process_store};
pub use config::{
    parse_toml, read_file, BackendConfig, BackendKind, EngineConfig, EtcdOptions, MetadataConfig, MetadataKind,
    MockOptions, RdmaOptions, TcpOptions,
};
pub use directory::{open, publish, resolve};

/// Gives the installed `metrics` recorder the description of every metric
/// kvmove emits: the engine's and the sessions', and those of every backend
/// built in. Call once, after installing the recorder (the `kvmove`
/// command and the Python package do).
pub fn describe_metrics() {
    kvmove_policy::describe_metrics();
    transport_core::describe_endpoint_metrics();
    #[cfg(feature = "tcp")]
    transport_tcp::describe_metrics();
    #[cfg(feature = "rdma")]
    {
        transport_rdma::describe_metrics();
        transport_rails::describe_metrics();
    }
}
pub use kvmove_policy::{Engine, PolicyConfig, Transfer, TransferOutcome};
pub use transport_core::{
    Access, Buffer, Error, ErrorKind, InProcessStore, MemoryRegion, MetadataStore, RegionId, RegionInfo, Result,
    SegmentDescriptor, SegmentId, TransferRequest, Transport,
};
/// Where NICs and memory sit (sysfs) and which rails are nearest a region:
/// what `backend.rdma.devices = ["auto"]` uses, and `kvmove topology` shows.
pub use transport_rails::topology;
