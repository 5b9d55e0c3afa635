//! Turning pass results into the table and the JSON report.

use std::fmt::Write as _;
use std::time::Duration;

use serde::Serialize;

use crate::plan::Plan;
use crate::run::{PassKind, PassResult};
use crate::settings::WorkloadConfig;

/// Latency percentiles in milliseconds (nearest rank).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Percentiles {
    pub samples: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
}

impl Percentiles {
    pub fn of(samples: &[Duration]) -> Option<Percentiles> {
        if samples.is_empty() {
            return None;
        }
        let mut v: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e3).collect();
        v.sort_by(f64::total_cmp);
        let at = |q: f64| {
            let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
            v[rank - 1]
        };
        Some(Percentiles { samples: v.len(), p50_ms: at(0.50), p99_ms: at(0.99), p999_ms: at(0.999), max_ms: at(1.0) })
    }
}

/// Everything measured in one mode, over its measured passes.
#[derive(Debug, Clone, Serialize)]
pub struct ModeReport {
    pub mode: &'static str,
    pub passes: usize,
    pub bytes: u64,
    pub requests: u64,
    /// Bytes over time from first submit to last byte (not reported for
    /// layerwise, whose transfer time includes the simulated compute).
    pub bandwidth_gib_s: Option<f64>,
    pub bandwidth_gbit_s: Option<f64>,
    pub requests_per_s: Option<f64>,
    /// Per batch (one per layer) in the layer modes.
    pub batch_latency: Option<Percentiles>,
    /// Per request in the per-request mode.
    pub request_latency: Option<Percentiles>,
    /// Median over passes of last-layer-ready to last byte.
    pub tail_ms: Option<f64>,
    /// Median over passes of first-layer-compute to last byte.
    pub end_to_end_ms: Option<f64>,
    /// With `--sessions true`: what the sessions measured.
    pub sessions: Option<SessionReport>,
}

/// The sessions of one mode's measured passes (one per pass in the layer
/// modes, one per request in `per-request`).
#[derive(Debug, Clone, Serialize)]
pub struct SessionReport {
    /// Sessions that landed (every one of them, or the run fails).
    pub landed: usize,
    /// The unit's start (expect and ask) to the grant on the initiator.
    pub grant_wait: Option<Percentiles>,
    /// The unit's start to Landed, as the initiator learnt it.
    pub time_to_landed: Option<Percentiles>,
    /// The initiator's finish to the target seeing Landed (bench: both
    /// sides in one process, one clock; absent for `initiator`).
    pub notify_delay: Option<Percentiles>,
    /// The initiator's finish to its Landed (FINISH there, END back).
    pub finish_to_landed: Option<Percentiles>,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub command: &'static str,
    pub backend: String,
    pub metadata: String,
    pub target: String,
    pub workload: WorkloadConfig,
    pub layers: u32,
    pub parts: u32,
    pub page_bytes: u64,
    pub bytes_per_pass: u64,
    pub requests_per_pass: usize,
    pub batches_per_pass: usize,
    pub modes: Vec<ModeReport>,
    /// all-at-end tail / layerwise tail, when both ran.
    pub overlap_gain: Option<f64>,
    pub verified_bytes: u64,
    pub verified_requests: u64,
    pub mismatched_requests: u64,
    pub ok: bool,
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

/// Summarises the measured passes of one mode.
pub fn mode_report(kind: PassKind, passes: &[PassResult]) -> ModeReport {
    let bytes: u64 = passes.iter().map(|p| p.bytes).sum();
    let requests: u64 = passes.iter().map(|p| p.requests).sum();
    let secs: f64 = passes.iter().map(|p| p.transfer.as_secs_f64()).sum();
    let rate = |x: f64| (kind != PassKind::Layerwise && secs > 0.0).then(|| x / secs);
    let latencies: Vec<Duration> = passes.iter().flat_map(|p| p.latencies.iter().copied()).collect();
    let lat = Percentiles::of(&latencies);
    let ms = |d: Option<Duration>| d.map(|d| d.as_secs_f64() * 1e3);
    let units: Vec<&crate::sessions::UnitTimes> = passes.iter().flat_map(|p| p.units.iter()).collect();
    let series = |f: fn(&crate::sessions::UnitTimes) -> Duration| {
        Percentiles::of(&units.iter().map(|u| f(u)).collect::<Vec<_>>())
    };
    let sessions = (!units.is_empty()).then(|| SessionReport {
        landed: units.len(),
        grant_wait: series(|u| u.grant_wait),
        time_to_landed: series(|u| u.time_to_landed),
        notify_delay: Percentiles::of(&passes.iter().flat_map(|p| p.notify_delays.iter().copied()).collect::<Vec<_>>()),
        finish_to_landed: series(|u| u.finish_to_landed),
    });
    ModeReport {
        mode: kind.name(),
        passes: passes.len(),
        bytes,
        requests,
        bandwidth_gib_s: rate(bytes as f64 / (1u64 << 30) as f64),
        bandwidth_gbit_s: rate(bytes as f64 * 8.0 / 1e9),
        requests_per_s: rate(requests as f64),
        batch_latency: if kind == PassKind::PerRequest { None } else { lat },
        request_latency: if kind == PassKind::PerRequest { lat } else { None },
        tail_ms: median(passes.iter().filter_map(|p| ms(p.tail)).collect()),
        end_to_end_ms: median(passes.iter().filter_map(|p| ms(p.end_to_end)).collect()),
        sessions,
    }
}

/// `1.5 GiB`, `32.0 KiB`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

impl Report {
    /// Builds the report of a finished run.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        command: &'static str,
        backend: String,
        metadata: String,
        target: String,
        workload: &WorkloadConfig,
        plan: &Plan,
        modes: Vec<ModeReport>,
        verdict: crate::data::Verification,
    ) -> Report {
        let tail = |m: &str| modes.iter().find(|r| r.mode == m).and_then(|r| r.tail_ms);
        let overlap_gain = match (tail("all-at-end"), tail("layerwise")) {
            (Some(a), Some(l)) if l > 0.0 => Some(a / l),
            _ => None,
        };
        Report {
            command,
            backend,
            metadata,
            target,
            workload: workload.clone(),
            layers: plan.layers,
            parts: plan.model.parts,
            page_bytes: plan.page_bytes,
            bytes_per_pass: plan.total_bytes,
            requests_per_pass: plan.total_requests,
            batches_per_pass: plan.by_layer.len(),
            modes,
            overlap_gain,
            verified_bytes: verdict.bytes,
            verified_requests: verdict.requests,
            mismatched_requests: verdict.mismatched,
            ok: verdict.mismatched == 0 && verdict.requests > 0,
        }
    }

    /// The human-readable table.
    pub fn table(&self) -> String {
        let w = &self.workload;
        let mut s = String::new();
        let parts = if self.parts == 2 { "K,V" } else { "MLA latent" };
        let _ =
            writeln!(s, "kvmove {}: {} ({} metadata) -> {}", self.command, self.backend, self.metadata, self.target);
        let _ = writeln!(
            s,
            "workload: {}, {} tokens, {} layers x {}, page {} tokens ({}), {}, {}",
            w.model,
            w.tokens,
            self.layers,
            parts,
            w.page_size,
            bytes(self.page_bytes),
            kebab(&w.fragmentation),
            kebab(&w.op),
        );
        let _ = writeln!(
            s,
            "per pass: {} in {} requests, {} batches (one per layer); {} measured passes per mode after {} warm-up; \
             concurrency {}; compute {} ms per layer",
            bytes(self.bytes_per_pass),
            thousands(self.requests_per_pass as u64),
            self.batches_per_pass,
            w.iterations,
            w.warmup,
            w.concurrency,
            w.compute_delay_ms
        );
        if w.sessions {
            let _ = writeln!(
                s,
                "sessions: one per pass in the layer modes, one per request in per-request; granted by the target, \
                 every write checked against its grant, done when Landed"
            );
        }
        let _ = writeln!(s);
        let mut header = format!("{:<28}", "");
        for m in &self.modes {
            let _ = write!(header, "{:>14}", m.mode);
        }
        let _ = writeln!(s, "{}", header.trim_end());
        type Cell = fn(&ModeReport) -> Option<String>;
        let rows: [(&str, Cell); 20] = [
            ("bandwidth (GiB/s)", |m| m.bandwidth_gib_s.map(|v| format!("{v:.2}"))),
            ("bandwidth (Gbit/s)", |m| m.bandwidth_gbit_s.map(|v| format!("{v:.2}"))),
            ("requests/s", |m| m.requests_per_s.map(|v| thousands(v as u64))),
            ("batch latency p50 (ms)", |m| m.batch_latency.map(|p| format!("{:.2}", p.p50_ms))),
            ("batch latency p99 (ms)", |m| m.batch_latency.map(|p| format!("{:.2}", p.p99_ms))),
            ("batch latency p999 (ms)", |m| m.batch_latency.map(|p| format!("{:.2}", p.p999_ms))),
            ("request latency p50 (ms)", |m| m.request_latency.map(|p| format!("{:.3}", p.p50_ms))),
            ("request latency p99 (ms)", |m| m.request_latency.map(|p| format!("{:.3}", p.p99_ms))),
            ("request latency p999 (ms)", |m| m.request_latency.map(|p| format!("{:.3}", p.p999_ms))),
            ("tail after last layer (ms)", |m| m.tail_ms.map(|v| format!("{v:.2}"))),
            ("compute + transfer (ms)", |m| m.end_to_end_ms.map(|v| format!("{v:.2}"))),
            ("sessions landed", |m| m.sessions.as_ref().map(|x| thousands(x.landed as u64))),
            ("grant wait p50 (ms)", |m| session_ms(m, |x| x.grant_wait, |p| p.p50_ms)),
            ("grant wait p99 (ms)", |m| session_ms(m, |x| x.grant_wait, |p| p.p99_ms)),
            ("time to landed p50 (ms)", |m| session_ms(m, |x| x.time_to_landed, |p| p.p50_ms)),
            ("time to landed p99 (ms)", |m| session_ms(m, |x| x.time_to_landed, |p| p.p99_ms)),
            ("notification delay p50 (ms)", |m| session_ms(m, |x| x.notify_delay, |p| p.p50_ms)),
            ("notification delay p99 (ms)", |m| session_ms(m, |x| x.notify_delay, |p| p.p99_ms)),
            ("finish to landed p50 (ms)", |m| session_ms(m, |x| x.finish_to_landed, |p| p.p50_ms)),
            ("finish to landed p99 (ms)", |m| session_ms(m, |x| x.finish_to_landed, |p| p.p99_ms)),
        ];
        for (name, cell) in rows {
            if self.modes.iter().all(|m| cell(m).is_none()) {
                continue;
            }
            let mut line = format!("{name:<28}");
            for m in &self.modes {
                let _ = write!(line, "{:>14}", cell(m).unwrap_or_else(|| "-".into()));
            }
            let _ = writeln!(s, "{}", line.trim_end());
        }
        let _ = writeln!(s);
        if let Some(g) = self.overlap_gain {
            let tail = |m: &str| self.modes.iter().find(|r| r.mode == m).and_then(|r| r.tail_ms).unwrap_or(0.0);
            let verdict = if g >= 1.0 { format!("{g:.1}x sooner") } else { format!("{:.1}x later", 1.0 / g) };
            let _ = writeln!(
                s,
                "overlap: the last byte landed {:.2} ms after the last layer was ready when sending all at the end, \
                 {:.2} ms when sending layer by layer ({verdict})",
                tail("all-at-end"),
                tail("layerwise"),
            );
        }
        if self.ok {
            let _ = writeln!(
                s,
                "verified: {} in {} requests; xxh3 of source and destination equal for every request",
                bytes(self.verified_bytes),
                thousands(self.verified_requests)
            );
        } else {
            let _ = writeln!(
                s,
                "VERIFICATION FAILED: {} requests differ between source and destination ({} verified)",
                thousands(self.mismatched_requests),
                thousands(self.verified_requests)
            );
        }
        s
    }
}

/// A session percentile of a mode, in ms with 3 decimals.
fn session_ms(
    m: &ModeReport,
    series: fn(&SessionReport) -> Option<Percentiles>,
    at: fn(&Percentiles) -> f64,
) -> Option<String> {
    m.sessions.as_ref().and_then(series).map(|p| format!("{:.3}", at(&p)))
}

fn kebab<T: Serialize>(v: &T) -> String {
    serde_json::to_value(v).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default()
}

fn ms(us: f64) -> String {
    if us >= 1000.0 {
        format!("{:.1} ms", us / 1000.0)
    } else {
        format!("{us:.0} us")
    }
}

fn failures(r: &crate::handoff::HandoffReport) -> String {
    if r.failed.is_empty() {
        return "0".into();
    }
    let mut v: Vec<(&String, &usize)> = r.failed.iter().collect();
    v.sort();
    let parts: Vec<String> = v.iter().map(|(k, n)| format!("{n} {k}")).collect();
    format!("{} ({})", r.failed.values().sum::<usize>(), parts.join(", "))
}

/// The `kvmove handoff` table: one column per flow.
pub fn handoff_table(c: &crate::handoff::HandoffConfig, rs: &[crate::handoff::HandoffReport]) -> String {
    let mut s = format!(
        "handoff: {} senders x {} requests of {}, decode memory for {} at once, each held {} ms after landing\n\n",
        c.senders,
        c.requests,
        bytes(c.request_bytes),
        c.decode_pages,
        c.hold.as_millis()
    );
    type Cell = Box<dyn Fn(&crate::handoff::HandoffReport) -> String>;
    let rows: Vec<(&str, Cell)> = vec![
        ("requests", Box::new(|r| r.requests.to_string())),
        ("landed, bytes verified", Box::new(|r| r.landed.to_string())),
        ("failed", Box::new(failures)),
        ("sides disagree", Box::new(|r| r.disagreements.to_string())),
        ("grant wait p50 / p99", Box::new(|r| format!("{} / {}", ms(r.grant_wait.p50_us), ms(r.grant_wait.p99_us)))),
        (
            "time to landed p50 / p99",
            Box::new(|r| format!("{} / {}", ms(r.time_to_landed.p50_us), ms(r.time_to_landed.p99_us))),
        ),
        (
            "notification delay p50 / p99",
            Box::new(|r| format!("{} / {}", ms(r.notify_delay.p50_us), ms(r.notify_delay.p99_us))),
        ),
        ("sender in-flight bytes, max", Box::new(|r| bytes(r.max_inflight_bytes))),
        ("sender endpoints, max", Box::new(|r| r.max_endpoints.to_string())),
        ("elapsed", Box::new(|r| format!("{:.2} s", r.elapsed.as_secs_f64()))),
    ];
    s += &format!("{:<32}", "");
    for r in rs {
        s += &format!("{:<40}", r.flow);
    }
    s += "\n";
    for (name, f) in &rows {
        s += &format!("{name:<32}");
        for r in rs {
            s += &format!("{:<40}", f(r));
        }
        s += "\n";
    }
    for r in rs {
        if let Some(t) = r.slowest_fail_after_kill {
            s += &format!(
                "\n{}: decode killed with {} sessions open; the last failed on its sender {} ms after the kill (liveness {} ms)\n",
                r.flow,
                r.open_at_kill,
                t.as_millis(),
                c.liveness.as_millis()
            );
        }
    }
    s
}

/// The same as one JSON object.
pub fn handoff_json(c: &crate::handoff::HandoffConfig, rs: &[crate::handoff::HandoffReport]) -> String {
    let lat = |l: &crate::handoff::Latency| serde_json::json!({"count": l.count, "p50_us": l.p50_us, "p99_us": l.p99_us, "max_us": l.max_us});
    let flows: Vec<serde_json::Value> = rs
        .iter()
        .map(|r| {
            serde_json::json!({
                "flow": r.flow,
                "requests": r.requests,
                "landed": r.landed,
                "failed": r.failed,
                "disagreements": r.disagreements,
                "wrong_bytes": r.wrong_bytes,
                "grant_wait": lat(&r.grant_wait),
                "time_to_landed": lat(&r.time_to_landed),
                "notify_delay": lat(&r.notify_delay),
                "max_inflight_bytes": r.max_inflight_bytes,
                "max_endpoints": r.max_endpoints,
                "open_at_kill": r.open_at_kill,
                "slowest_fail_after_kill_ms": r.slowest_fail_after_kill.map(|d| d.as_millis() as u64),
                "elapsed_s": r.elapsed.as_secs_f64(),
                "pauses": r.pauses,
            })
        })
        .collect();
    serde_json::json!({
        "handoff": {
            "senders": c.senders, "requests": c.requests, "request_bytes": c.request_bytes,
            "decode_pages": c.decode_pages, "hold_ms": c.hold.as_millis() as u64,
        },
        "flows": flows,
    })
    .to_string()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn percentiles_nearest_rank() {
        let v: Vec<Duration> = (1..=1000).map(Duration::from_millis).collect();
        let p = Percentiles::of(&v).unwrap();
        assert_eq!((p.p50_ms, p.p99_ms, p.p999_ms, p.max_ms), (500.0, 990.0, 999.0, 1000.0));
        assert!(Percentiles::of(&[]).is_none());
    }

    #[test]
    fn formatting() {
        assert_eq!(bytes(32 << 10), "32.0 KiB");
        assert_eq!(bytes(512), "512 B");
        assert_eq!(thousands(1234567), "1,234,567");
    }
}
