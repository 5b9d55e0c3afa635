//! The command's configuration file: the engine config plus the workload
//! and the target's options, every key optional.

use std::path::Path;

use kvmove::{BackendConfig, EngineConfig, MetadataConfig, PolicyConfig};
use serde::{Deserialize, Serialize};

/// The whole file (`--config`). `[backend]`, `[policy]` and `[metadata]`
/// are the library's [`EngineConfig`]; `[workload]` and `[target]` belong
/// to the command.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    pub backend: BackendConfig,
    pub policy: PolicyConfig,
    pub metadata: MetadataConfig,
    pub workload: WorkloadConfig,
    pub target: TargetConfig,
}

impl Settings {
    /// Reads the file; errors name the file, line, table and key. The
    /// path must be a regular file (a FIFO or a device would block or
    /// never end) of at most [`MAX_CONFIG_BYTES`].
    pub fn from_file(path: &Path) -> kvmove::Result<Settings> {
        let cfg_err = |m: String| kvmove::Error::new(kvmove::ErrorKind::Config, m);
        let meta =
            std::fs::metadata(path).map_err(|e| cfg_err(format!("cannot read config file {}: {e}", path.display())))?;
        if !meta.is_file() {
            return Err(cfg_err(format!(
                "config file {} is not a regular file (a directory, FIFO, socket or device); --config needs a \
                 regular file",
                path.display()
            )));
        }
        if meta.len() > MAX_CONFIG_BYTES {
            return Err(cfg_err(format!(
                "config file {} is {} bytes; at most {MAX_CONFIG_BYTES} are accepted",
                path.display(),
                meta.len()
            )));
        }
        let text = kvmove::read_file(path)?;
        Self::from_toml_named(&text, &path.display().to_string())
    }

    /// Parses TOML text; `origin` names it in errors.
    pub fn from_toml_named(text: &str, origin: &str) -> kvmove::Result<Settings> {
        let s: Settings = kvmove::parse_toml(text, origin)?;
        s.validate().map_err(|e| kvmove::locate_error(e, text, origin))?;
        Ok(s)
    }

    /// Checks the engine config and every number of `[workload]` and
    /// `[target]` against its range (see [`LIMITS`]); the error names the
    /// key and the option.
    pub fn validate(&self) -> kvmove::Result<()> {
        self.engine().validate()?;
        let w = &self.workload;
        check("tokens", w.tokens)?;
        check("page_size", w.page_size)?;
        if let Some(l) = w.layers {
            check("layers", u64::from(l))?;
        }
        if let Some(b) = w.bytes_per_token {
            check("bytes_per_token", b)?;
        }
        check("concurrency", u64::try_from(w.concurrency).unwrap_or(u64::MAX))?;
        check("compute_delay_ms", w.compute_delay_ms)?;
        check("iterations", u64::from(w.iterations))?;
        check("warmup", u64::from(w.warmup))?;
        if let Some(m) = self.target.mem_mib {
            check("mem_mib", m)?;
        }
        if w.sessions && w.op == Op::Read {
            return Err(kvmove::Error::new(
                kvmove::ErrorKind::Config,
                "workload.sessions: --sessions true needs --op write; sessions hand off writes only (a read is pulled \
                 by the initiator, nothing for the target to grant)",
            ));
        }
        Ok(())
    }

    /// The engine part.
    pub fn engine(&self) -> EngineConfig {
        EngineConfig { backend: self.backend.clone(), policy: self.policy.clone(), metadata: self.metadata.clone() }
    }
}

/// Largest `--config` file read (a config is a few hundred bytes).
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// A numeric setting's range: key (under its table), table, option,
/// smallest and largest value accepted.
pub struct Limit {
    pub key: &'static str,
    pub table: &'static str,
    pub option: &'static str,
    pub min: u64,
    pub max: u64,
}

/// Every numeric setting of `[workload]` and `[target]` with its range.
/// The bounds keep every size, count and duration, and their products,
/// far from overflow; the memory check refuses what does not fit.
pub const LIMITS: [Limit; 9] = [
    Limit { key: "tokens", table: "workload", option: "--tokens", min: 1, max: 1 << 24 },
    Limit { key: "page_size", table: "workload", option: "--page-size", min: 1, max: 1 << 20 },
    Limit { key: "layers", table: "workload", option: "--layers", min: 1, max: 10_000 },
    Limit { key: "bytes_per_token", table: "workload", option: "--bytes-per-token", min: 1, max: 16 << 20 },
    Limit { key: "concurrency", table: "workload", option: "--concurrency", min: 1, max: 65_536 },
    Limit { key: "compute_delay_ms", table: "workload", option: "--compute-delay-ms", min: 0, max: 60_000 },
    Limit { key: "iterations", table: "workload", option: "--iterations", min: 1, max: 1_000_000 },
    Limit { key: "warmup", table: "workload", option: "--warmup", min: 0, max: 1_000_000 },
    Limit { key: "mem_mib", table: "target", option: "--mem-mib", min: 1, max: 1 << 20 },
];

/// `value` of the setting `key` within its [`LIMITS`] range, or one line
/// naming the key, the option, the range and the value.
fn check(key: &str, value: u64) -> kvmove::Result<()> {
    let Some(l) = LIMITS.iter().find(|l| l.key == key) else {
        return Err(kvmove::Error::new(kvmove::ErrorKind::Internal, format!("no range for setting {key}")));
    };
    if (l.min..=l.max).contains(&value) {
        return Ok(());
    }
    Err(kvmove::Error::new(
        kvmove::ErrorKind::Config,
        format!("{}.{}: {} must be between {} and {}, got {value}", l.table, l.key, l.option, l.min, l.max),
    ))
}

/// Direction of the measured transfers, seen from the initiator (the
/// prefill side): `write` pushes its KV cache into the target, `read` pulls
/// the target's KV cache into local memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Op {
    #[default]
    Write,
    Read,
}

/// Which timing modes run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// One batch per layer, submitted as soon as the layer is computed.
    Layerwise,
    /// Wait for every layer's compute, then send everything.
    AllAtEnd,
    /// Both, so the overlap gain is measured.
    #[default]
    Both,
}

/// Page placement (see `plan`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Fragmentation {
    /// Adjacent pages merge into one request per layer and K/V part.
    Contiguous,
    /// Every page is its own request to a random slot.
    #[default]
    Scattered,
}

/// `[workload]`: the KV cache moved per pass. Defaults are small enough
/// for a fast default run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkloadConfig {
    /// Model preset: llama3-8b, llama3-70b, deepseek-v3. Default llama3-8b.
    pub model: String,
    /// Prompt length in tokens. Default 1024.
    pub tokens: u64,
    /// Tokens per page. Default 16.
    pub page_size: u64,
    /// Layer count override (default: the model's).
    pub layers: Option<u32>,
    /// Bytes per token per layer, all K/V parts together (default: the model's).
    pub bytes_per_token: Option<u64>,
    /// write | read. Default write.
    pub op: Op,
    /// Transfers in flight at once. Default 32.
    pub concurrency: usize,
    /// layerwise | all-at-end | both. Default both.
    pub mode: Mode,
    /// Simulated compute per layer, in milliseconds. Default 2.
    pub compute_delay_ms: u64,
    /// contiguous | scattered. Default scattered.
    pub fragmentation: Fragmentation,
    /// Measured passes per mode. Default 3.
    pub iterations: u32,
    /// Unmeasured passes before them (connection setup, warm caches). Default 1.
    pub warmup: u32,
    /// Also send every request as its own transfer to measure per-request
    /// latency and requests/s. Default true.
    pub per_request: bool,
    /// Seed of the page placement and the data pattern. Default 42.
    pub seed: u64,
    /// Run every transfer unit as a session (rules 12 and 13): the target
    /// grants it, the initiator writes within the grant, finishes and waits
    /// for Landed. Writes only. Default false.
    pub sessions: bool,
}

impl Default for WorkloadConfig {
    fn default() -> Self {
        Self {
            model: "llama3-8b".into(),
            tokens: 1024,
            page_size: 16,
            layers: None,
            bytes_per_token: None,
            op: Op::Write,
            concurrency: 32,
            mode: Mode::Both,
            compute_delay_ms: 2,
            fragmentation: Fragmentation::Scattered,
            iterations: 3,
            warmup: 1,
            per_request: true,
            seed: 42,
            sessions: false,
        }
    }
}

/// `[target]`: what `kvmove target` serves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TargetConfig {
    /// Logical name published to the metadata store (etcd, in-process).
    /// Default "kvmove-target".
    pub name: String,
    /// Bytes of memory served, in MiB (default: the workload's size).
    pub mem_mib: Option<u64>,
}

impl Default for TargetConfig {
    fn default() -> Self {
        Self { name: "kvmove-target".into(), mem_mib: None }
    }
}
