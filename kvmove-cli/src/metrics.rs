//! The command's metrics recorder. On by default: every command records
//! the engine's metrics in memory (the facade's calls are then real), so
//! `bench` and `initiator` can print the time per stage under their table;
//! `--metrics HOST:PORT` also serves them as Prometheus text on `/metrics`;
//! `--no-metrics` installs nothing (the facade's calls are no-ops), the
//! switch the overhead is measured against.

use std::net::SocketAddr;
use std::sync::OnceLock;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

use crate::top::Sample;

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the recorder (with an HTTP listener on `serve`); call inside
/// the runtime. An error names what failed.
pub fn install(serve: Option<SocketAddr>) -> Result<(), String> {
    let b = PrometheusBuilder::new();
    let recorder = match serve {
        Some(addr) => {
            let (recorder, exporter) = b
                .with_http_listener(addr)
                .build()
                .map_err(|e| format!("--metrics {addr}: cannot serve metrics there: {e}"))?;
            tokio::spawn(exporter);
            recorder
        }
        None => b.build_recorder(),
    };
    let handle = recorder.handle();
    ::metrics::set_global_recorder(recorder).map_err(|e| format!("cannot install the metrics recorder: {e}"))?;
    kvmove::describe_metrics();
    // Histogram samples wait in a queue until an upkeep folds them into
    // their summaries: keep that queue short in a long-running command.
    let upkeep = handle.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(std::time::Duration::from_secs(5)).await;
            upkeep.run_upkeep();
        }
    });
    let _ = HANDLE.set(handle);
    Ok(())
}

/// The time per stage of the transfers so far, one line for the table:
/// `None` without a recorder or before any transfer.
pub fn stage_line() -> Option<String> {
    let h = HANDLE.get()?;
    h.run_upkeep();
    let s = Sample::parse(&h.render());
    let n = s.sum("kvmove_stage_seconds_count", &[("stage", "complete")]);
    if n == 0.0 {
        return None;
    }
    let q = |stage: &str, quantile: &str| {
        format!("{:.3}", s.sum("kvmove_stage_seconds", &[("stage", stage), ("quantile", quantile)]) * 1e3)
    };
    let mut line = format!("stages per engine transfer ({n:.0} transfers), p50 / p99 ms:");
    for stage in ["budget", "submit", "complete"] {
        line.push_str(&format!("  {stage} {} / {}", q(stage, "0.5"), q(stage, "0.99")));
    }
    Some(line + "\n")
}
