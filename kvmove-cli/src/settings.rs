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
    /// Reads the file; errors name the file, line, table and key.
    pub fn from_file(path: &Path) -> kvmove::Result<Settings> {
        let text = kvmove::read_file(path)?;
        Self::from_toml_named(&text, &path.display().to_string())
    }

    /// Parses TOML text; `origin` names it in errors.
    pub fn from_toml_named(text: &str, origin: &str) -> kvmove::Result<Settings> {
        let s: Settings = kvmove::parse_toml(text, origin)?;
        s.engine().validate().map_err(|e| kvmove::locate_error(e, text, origin))?;
        Ok(s)
    }

    /// The engine part.
    pub fn engine(&self) -> EngineConfig {
        EngineConfig { backend: self.backend.clone(), policy: self.policy.clone(), metadata: self.metadata.clone() }
    }
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
