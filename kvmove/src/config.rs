//! The one configuration of an engine: which backend, its options, the
//! shared policy and where segment metadata lives.
//!
//! ```toml
//! [backend]
//! kind = "tcp"            # "tcp" (default) | "rdma" | "mock"
//! [backend.tcp]           # options of the TCP backend (transport_tcp::TcpConfig)
//! lanes = 4
//! [policy.retry]          # kvmove_policy::PolicyConfig
//! max_attempts = 4
//! [metadata]
//! kind = "p2p"            # "p2p" (default) | "etcd" | "in-process"
//! [metadata.etcd]         # used when kind = "etcd" (transport_etcd::EtcdConfig)
//! endpoints = ["http://127.0.0.1:2379"]
//! ```
//!
//! Every table and key is optional; a missing one takes its default.
//! Unknown keys are errors. Options of a backend that is not compiled in
//! are accepted as an opaque table, so one file serves every build; only
//! *selecting* such a backend is an error, raised by [`crate::build`].

use std::fmt;
use std::path::Path;

use kvmove_policy::PolicyConfig;
use serde::{Deserialize, Serialize};
use transport_core::{Error, ErrorKind, Result};

use crate::toml_error;

/// Options of the TCP backend: `transport_tcp::TcpConfig` when the `tcp`
/// feature is on, an opaque table otherwise.
#[cfg(feature = "tcp")]
pub type TcpOptions = transport_tcp::TcpConfig;
/// Options of the TCP backend: `transport_tcp::TcpConfig` when the `tcp`
/// feature is on, an opaque table otherwise.
#[cfg(not(feature = "tcp"))]
pub type TcpOptions = toml::Table;

/// Options of the RDMA backend: `transport_rdma::RdmaConfig` when the
/// `rdma` feature is on, an opaque table otherwise.
#[cfg(feature = "rdma")]
pub type RdmaOptions = transport_rdma::RdmaConfig;
/// Options of the RDMA backend: `transport_rdma::RdmaConfig` when the
/// `rdma` feature is on, an opaque table otherwise.
#[cfg(not(feature = "rdma"))]
pub type RdmaOptions = toml::Table;

/// Options of the mock backend: `transport_mock::MockConfig` when the
/// `mock` feature is on, an opaque table otherwise.
#[cfg(feature = "mock")]
pub type MockOptions = transport_mock::MockConfig;
/// Options of the mock backend: `transport_mock::MockConfig` when the
/// `mock` feature is on, an opaque table otherwise.
#[cfg(not(feature = "mock"))]
pub type MockOptions = toml::Table;

/// Options of the etcd metadata store: `transport_etcd::EtcdConfig` when
/// the `etcd` feature is on, an opaque table otherwise.
#[cfg(feature = "etcd")]
pub type EtcdOptions = transport_etcd::EtcdConfig;
/// Options of the etcd metadata store: `transport_etcd::EtcdConfig` when
/// the `etcd` feature is on, an opaque table otherwise.
#[cfg(not(feature = "etcd"))]
pub type EtcdOptions = toml::Table;

/// Everything needed to build an engine, without naming a backend type.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    /// Which backend moves the bytes, and its options.
    pub backend: BackendConfig,
    /// Retry, deadlines, circuit breaker, backpressure (shared by all backends).
    pub policy: PolicyConfig,
    /// Where segment descriptors are published and looked up.
    pub metadata: MetadataConfig,
}

/// The backend: its kind plus one options table per backend (only the one
/// named by `kind` is used).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BackendConfig {
    /// Default `tcp`.
    pub kind: BackendKind,
    /// `[backend.tcp]`.
    pub tcp: TcpOptions,
    /// `[backend.rdma]`.
    pub rdma: RdmaOptions,
    /// `[backend.mock]`.
    pub mock: MockOptions,
}

/// The backend kinds this crate knows (whether or not compiled in).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// TCP sockets (feature `tcp`, on by default).
    #[default]
    Tcp,
    /// RDMA verbs (feature `rdma`, off by default: needs libibverbs).
    Rdma,
    /// The in-process backend (feature `mock`): every engine of the process
    /// shares one fabric, so segments are names inside this process.
    Mock,
}

impl BackendKind {
    /// Every kind.
    pub const ALL: [BackendKind; 3] = [BackendKind::Tcp, BackendKind::Rdma, BackendKind::Mock];

    /// The config name (`tcp`, `rdma`, `mock`).
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Tcp => "tcp",
            BackendKind::Rdma => "rdma",
            BackendKind::Mock => "mock",
        }
    }

    /// Whether this build contains the backend.
    pub fn is_built_in(self) -> bool {
        match self {
            BackendKind::Tcp => cfg!(feature = "tcp"),
            BackendKind::Rdma => cfg!(feature = "rdma"),
            BackendKind::Mock => cfg!(feature = "mock"),
        }
    }

    /// The `Config` error for a backend that is not compiled in.
    pub fn not_built_in(self) -> Error {
        let name = self.as_str();
        Error::new(ErrorKind::Config, format!("backend '{name}' is not built in; rebuild with --features {name}"))
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for BackendKind {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        BackendKind::ALL.into_iter().find(|k| k.as_str() == s).ok_or_else(|| {
            Error::new(ErrorKind::Config, format!("unknown backend '{s}'; expected one of: tcp, rdma, mock"))
        })
    }
}

/// Where descriptors live.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetadataConfig {
    /// Default `p2p`.
    pub kind: MetadataKind,
    /// `[metadata.etcd]`, used when `kind = "etcd"`.
    pub etcd: EtcdOptions,
}

/// The metadata stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MetadataKind {
    /// Peer to peer (default): the segment name is the peer's `host:port`
    /// and the descriptor is fetched from the peer itself.
    #[default]
    P2p,
    /// An etcd cluster (feature `etcd`): peers publish their descriptor
    /// under a logical name, others resolve it.
    Etcd,
    /// One store shared by everything in this process (tests, one-process
    /// benchmarks).
    InProcess,
}

impl MetadataKind {
    /// The config name.
    pub fn as_str(self) -> &'static str {
        match self {
            MetadataKind::P2p => "p2p",
            MetadataKind::Etcd => "etcd",
            MetadataKind::InProcess => "in-process",
        }
    }
}

impl fmt::Display for MetadataKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl EngineConfig {
    /// Parses and validates TOML text. Errors are `Config` and read
    /// `<config>:line:column: in [table]: what is wrong` (or
    /// `<config>:line: table.key: why` for a value out of range).
    pub fn from_toml_str(text: &str) -> Result<Self> {
        Self::from_toml_named(text, "<config>")
    }

    /// Like [`EngineConfig::from_toml_str`], naming the source `origin`
    /// (a file path) in errors instead of `<config>`.
    pub fn from_toml_named(text: &str, origin: &str) -> Result<Self> {
        let cfg: EngineConfig = parse_toml(text, origin)?;
        cfg.validate().map_err(|e| toml_error::locate(e, text, origin))?;
        Ok(cfg)
    }

    /// Reads and parses a TOML file; errors name the file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = read_file(path)?;
        Self::from_toml_named(&text, &path.display().to_string())
    }

    /// The configuration as TOML (every option, defaults included).
    pub fn to_toml(&self) -> Result<String> {
        toml::to_string(self)
            .map_err(|e| Error::new(ErrorKind::Config, format!("cannot write the config as TOML: {e}")))
    }

    /// Checks the policy and the options of the selected backend and
    /// metadata store; errors are `Config` and name the field. A backend
    /// that is not compiled in is not an error here (see [`crate::build`]).
    pub fn validate(&self) -> Result<()> {
        self.policy.validate()?;
        match self.backend.kind {
            #[cfg(feature = "tcp")]
            BackendKind::Tcp => prefix("backend", self.backend.tcp.validate())?,
            #[cfg(feature = "rdma")]
            BackendKind::Rdma => prefix("backend", self.backend.rdma.validate())?,
            _ => {}
        }
        #[cfg(feature = "etcd")]
        if self.metadata.kind == MetadataKind::Etcd {
            prefix("metadata", self.metadata.etcd.validate())?;
        }
        Ok(())
    }
}

#[cfg(any(feature = "tcp", feature = "rdma", feature = "etcd"))]
/// Prefixes a validation error's message with the table it came from, so
/// `tcp.lanes` reads `backend.tcp.lanes` like the file does.
fn prefix(table: &str, r: Result<()>) -> Result<()> {
    r.map_err(|e| Error::new(e.kind(), format!("{table}.{}", e.message())))
}

/// Reads a config file; the error names the path.
pub fn read_file(path: &Path) -> Result<String> {
    std::fs::read_to_string(path)
        .map_err(|e| Error::new(ErrorKind::Config, format!("cannot read config file {}: {e}", path.display())))
}

/// Parses TOML text into any serde type with one-line errors that name the
/// origin, line, column, table and key: `file.toml:3:1: in [backend.tcp]:
/// unknown field `lane`, expected one of ...`. Used by [`EngineConfig`] and
/// by programs that embed the engine config in a larger file.
pub fn parse_toml<T: serde::de::DeserializeOwned>(text: &str, origin: &str) -> Result<T> {
    toml::from_str(text).map_err(|e| toml_error::describe(&e, text, origin))
}

impl BackendConfig {
    /// Sets the listen address of the selected backend (`tcp`, `rdma`);
    /// the mock has no address and ignores it. Works whether or not the
    /// backend is compiled in.
    pub fn set_listen(&mut self, addr: &str) {
        match self.kind {
            BackendKind::Tcp => set_listen_tcp(&mut self.tcp, addr),
            BackendKind::Rdma => set_listen_rdma(&mut self.rdma, addr),
            BackendKind::Mock => {}
        }
    }
}

#[cfg(feature = "tcp")]
fn set_listen_tcp(o: &mut TcpOptions, addr: &str) {
    o.listen = addr.to_owned();
}
#[cfg(not(feature = "tcp"))]
fn set_listen_tcp(o: &mut TcpOptions, addr: &str) {
    o.insert("listen".into(), toml::Value::String(addr.to_owned()));
}
#[cfg(feature = "rdma")]
fn set_listen_rdma(o: &mut RdmaOptions, addr: &str) {
    o.listen = addr.to_owned();
}
#[cfg(not(feature = "rdma"))]
fn set_listen_rdma(o: &mut RdmaOptions, addr: &str) {
    o.insert("listen".into(), toml::Value::String(addr.to_owned()));
}

impl MetadataConfig {
    /// Sets `[metadata.etcd] endpoints`, whether or not etcd is compiled in.
    pub fn set_etcd_endpoints(&mut self, endpoints: Vec<String>) {
        #[cfg(feature = "etcd")]
        {
            self.etcd.endpoints = endpoints;
        }
        #[cfg(not(feature = "etcd"))]
        {
            let list = endpoints.into_iter().map(toml::Value::String).collect();
            self.etcd.insert("endpoints".into(), toml::Value::Array(list));
        }
    }
}

impl EngineConfig {
    /// The config of a second engine in the same process (a benchmark's
    /// initiator beside its target): the same options, but listening on
    /// any free port of the same interface, and with an automatic mock
    /// host name, so the two never collide.
    pub fn sibling(&self) -> EngineConfig {
        #[allow(unused_mut)] // nothing to change when no backend with an address is built in
        let mut cfg = self.clone();
        #[cfg(feature = "tcp")]
        {
            cfg.backend.tcp.listen = any_port(&cfg.backend.tcp.listen);
        }
        #[cfg(feature = "rdma")]
        {
            cfg.backend.rdma.listen = any_port(&cfg.backend.rdma.listen);
        }
        #[cfg(feature = "mock")]
        {
            cfg.backend.mock.name = None;
        }
        cfg
    }
}

/// `host:port` with port 0 (any free port on the same interface).
#[cfg(any(feature = "tcp", feature = "rdma"))]
fn any_port(listen: &str) -> String {
    match listen.rsplit_once(':') {
        Some((host, _)) => format!("{host}:0"),
        None => "127.0.0.1:0".into(),
    }
}
