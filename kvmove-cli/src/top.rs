//! `kvmove top`: a live view of a running kvmove (any command started with
//! `--metrics HOST:PORT`): it scrapes `/metrics` every interval and prints
//! rates, latency percentiles, in-flight work and a row per peer with its
//! breaker. On a terminal each frame replaces the last; otherwise frames
//! follow each other (for logs, and for tests).

use std::collections::BTreeMap;
use std::io::{IsTerminal, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use crate::report::bytes;

/// One scrape: series (`name{labels}` as exported, labels sorted) to value.
#[derive(Debug, Default, Clone)]
pub struct Sample {
    series: BTreeMap<String, f64>,
}

/// A series' name and labels.
fn split(series: &str) -> (&str, Vec<(&str, &str)>) {
    let Some((name, rest)) = series.split_once('{') else { return (series, Vec::new()) };
    let body = rest.strip_suffix('}').unwrap_or(rest);
    let labels = body
        .split("\",")
        .filter_map(|kv| {
            let (k, v) = kv.split_once("=\"")?;
            Some((k.trim_matches(','), v.trim_end_matches('"')))
        })
        .collect();
    (name, labels)
}

impl Sample {
    /// Parses Prometheus text (comments and malformed lines skipped).
    pub fn parse(text: &str) -> Sample {
        let mut series = BTreeMap::new();
        for line in text.lines() {
            if line.starts_with('#') || line.trim().is_empty() {
                continue;
            }
            let Some((key, value)) = line.rsplit_once(' ') else { continue };
            if let Ok(v) = value.trim().parse::<f64>() {
                series.insert(key.trim().to_owned(), v);
            }
        }
        Sample { series }
    }

    /// Sum of every series of `name` whose labels include `want`.
    pub fn sum(&self, name: &str, want: &[(&str, &str)]) -> f64 {
        self.series
            .iter()
            .filter(|(k, _)| {
                let (n, labels) = split(k);
                n == name && want.iter().all(|w| labels.contains(w))
            })
            .map(|(_, v)| v)
            .sum::<f64>()
            // (An empty sum is -0.0.)
            + 0.0
    }

    /// Distinct values of label `label` among series of `name`.
    fn label_values(&self, name: &str, label: &str) -> Vec<String> {
        let mut out: Vec<String> = self
            .series
            .keys()
            .filter_map(|k| {
                let (n, labels) = split(k);
                (n == name).then(|| labels.iter().find(|(l, _)| *l == label).map(|(_, v)| (*v).to_owned()))?
            })
            .collect();
        out.sort();
        out.dedup();
        out
    }
}

/// Fetches `/metrics` from `addr` (plain HTTP/1.0), within `limit`.
pub fn scrape(addr: SocketAddr, limit: Duration) -> std::io::Result<String> {
    let mut s = TcpStream::connect_timeout(&addr, limit)?;
    s.set_read_timeout(Some(limit))?;
    s.set_write_timeout(Some(limit))?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: kvmove\r\n\r\n")?;
    let mut text = String::new();
    s.take(64 << 20).read_to_string(&mut text)?;
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    if !head.starts_with("HTTP/1.") || !head.lines().next().is_some_and(|l| l.contains(" 200")) {
        return Err(std::io::Error::other(format!(
            "{addr} did not answer /metrics with 200: {}",
            head.lines().next().unwrap_or("")
        )));
    }
    Ok(body.to_owned())
}

fn rate(now: &Sample, before: &Sample, secs: f64, name: &str, want: &[(&str, &str)]) -> f64 {
    if secs <= 0.0 {
        return 0.0;
    }
    ((now.sum(name, want) - before.sum(name, want)) / secs).max(0.0)
}

fn per_s(bytes_per_s: f64) -> String {
    format!("{}/s", bytes(bytes_per_s as u64))
}

/// Milliseconds of a summary quantile, or "-".
fn quantile(s: &Sample, name: &str, want: &[(&str, &str)], q: &str) -> String {
    let mut w = want.to_vec();
    w.push(("quantile", q));
    let key_exists = s.series.keys().any(|k| {
        let (n, labels) = split(k);
        n == name && w.iter().all(|x| labels.contains(x))
    });
    if !key_exists {
        return "-".into();
    }
    format!("{:.2} ms", s.sum(name, &w) * 1e3)
}

/// One frame of the view.
pub fn render(addr: SocketAddr, n: u64, now: &Sample, before: &Sample, secs: f64) -> String {
    let mut o = String::new();
    let r = |name: &str, want: &[(&str, &str)]| rate(now, before, secs, name, want);
    o.push_str(&format!("kvmove top  {addr}  sample {n}  over {secs:.1} s\n"));
    o.push_str(&format!(
        "served     write {:>12}   read {:>12}   connections {} ({:.0}/s)   refused {:.0}/s\n",
        per_s(r("kvmove_tcp_served_bytes_total", &[("op", "write")])),
        per_s(r("kvmove_tcp_served_bytes_total", &[("op", "read")])),
        now.sum("kvmove_tcp_connections_total", &[]),
        r("kvmove_tcp_connections_total", &[]),
        r("kvmove_tcp_connections_refused_total", &[]),
    ));
    o.push_str(&format!(
        "moved      write {:>12}   read {:>12}   requests {:.0}/s\n",
        per_s(r("kvmove_bytes_total", &[("op", "write")])),
        per_s(r("kvmove_bytes_total", &[("op", "read")])),
        r("kvmove_requests_total", &[]),
    ));
    o.push_str(&format!(
        "transfers  completed {:.0}/s  failed {:.0}/s  timed out {:.0}/s  cancelled {:.0}/s  retries {:.0}/s  errors {:.0}/s\n",
        r("kvmove_transfers_total", &[("state", "completed")]),
        r("kvmove_transfers_total", &[("state", "failed")]),
        r("kvmove_transfers_total", &[("state", "timed_out")]),
        r("kvmove_transfers_total", &[("state", "cancelled")]),
        r("kvmove_retries_total", &[]),
        r("kvmove_errors_total", &[]),
    ));
    let t = "kvmove_transfer_seconds";
    let st = "kvmove_stage_seconds";
    o.push_str(&format!(
        "latency    transfer p50 {}  p99 {}   stages p50: budget {}  submit {}  complete {}\n",
        quantile(now, t, &[("state", "completed")], "0.5"),
        quantile(now, t, &[("state", "completed")], "0.99"),
        quantile(now, st, &[("stage", "budget")], "0.5"),
        quantile(now, st, &[("stage", "submit")], "0.5"),
        quantile(now, st, &[("stage", "complete")], "0.5"),
    ));
    o.push_str(&format!(
        "in flight  {}  {:.0} requests\n",
        bytes(now.sum("kvmove_inflight_bytes", &[]) as u64),
        now.sum("kvmove_inflight_requests", &[]),
    ));
    // With rails: paths not used (no route; the log names them, once
    // each) and what their health did.
    let unreachable = now.series.keys().any(|k| split(k).0 == "kvmove_rail_paths_unreachable");
    if unreachable || now.series.keys().any(|k| split(k).0 == "kvmove_rail_events_total") {
        o.push_str(&format!(
            "rails      paths unreachable {:.0}   paused {:.0}/s   resumed {:.0}/s   over the fallback {:.0}/s\n",
            now.sum("kvmove_rail_paths_unreachable", &[]),
            r("kvmove_rail_events_total", &[("event", "paused")]),
            r("kvmove_rail_events_total", &[("event", "resumed")]),
            r("kvmove_rail_events_total", &[("event", "fallback")]),
        ));
    }
    let mut peers = now.label_values("kvmove_bytes_total", "peer");
    for p in now.label_values("kvmove_breaker_open", "peer") {
        if !peers.contains(&p) {
            peers.push(p);
        }
    }
    // The shared label of peers past the cap, only when it moved bytes.
    peers.retain(|p| p != kvmove_policy::OTHER_PEER || now.sum("kvmove_bytes_total", &[("peer", p)]) > 0.0);
    if !peers.is_empty() {
        o.push_str(&format!("{:<28} {:>14} {:>14} {:>9}\n", "peer", "write", "read", "breaker"));
        for p in peers {
            let open = now.sum("kvmove_breaker_open", &[("peer", &p)]) > 0.0;
            o.push_str(&format!(
                "{:<28} {:>14} {:>14} {:>9}\n",
                p,
                per_s(r("kvmove_bytes_total", &[("op", "write"), ("peer", &p)])),
                per_s(r("kvmove_bytes_total", &[("op", "read"), ("peer", &p)])),
                if open { "open" } else { "closed" },
            ));
        }
    }
    o
}

/// Runs the view: `count` frames (0 = until interrupted), one per
/// `interval`. A scrape that fails is one line and the view goes on; the
/// error is returned only when the first scrape fails.
pub fn run(addr: SocketAddr, interval: Duration, count: u64) -> kvmove::Result<()> {
    let limit = interval.max(Duration::from_secs(1));
    let io = |e: std::io::Error| {
        kvmove::Error::new(kvmove::ErrorKind::ConnectionRefused, format!("kvmove top: {addr}/metrics: {e}"))
    };
    let mut before = Sample::parse(&scrape(addr, limit).map_err(io)?);
    let mut at = Instant::now();
    let tty = std::io::stdout().is_terminal();
    let mut n = 0u64;
    while count == 0 || n < count {
        std::thread::sleep(interval);
        n += 1;
        let now = match scrape(addr, limit) {
            Ok(text) => Sample::parse(&text),
            Err(e) => {
                crate::say!("kvmove top: {addr}/metrics: {e}");
                continue;
            }
        };
        let secs = at.elapsed().as_secs_f64();
        at = Instant::now();
        let frame = render(addr, n, &now, &before, secs);
        let mut out = std::io::stdout().lock();
        let _ = if tty { write!(out, "\x1b[2J\x1b[H{frame}") } else { writeln!(out, "{frame}") };
        let _ = out.flush();
        before = now;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# TYPE kvmove_bytes_total counter\n\
        kvmove_bytes_total{op=\"write\",peer=\"10.0.0.1:5000\"} 2048\n\
        kvmove_bytes_total{op=\"read\",peer=\"10.0.0.1:5000\"} 1024\n\
        kvmove_transfer_seconds{state=\"completed\",quantile=\"0.5\"} 0.0015\n\
        kvmove_breaker_open{peer=\"10.0.0.2:5000\"} 1\n\
        kvmove_tcp_connections_total 3\n";

    #[test]
    fn parses_and_sums_by_labels() {
        let s = Sample::parse(TEXT);
        assert_eq!(s.sum("kvmove_bytes_total", &[]), 3072.0);
        assert_eq!(s.sum("kvmove_bytes_total", &[("op", "write")]), 2048.0);
        assert_eq!(s.sum("kvmove_tcp_connections_total", &[]), 3.0);
        assert_eq!(s.label_values("kvmove_bytes_total", "peer"), vec!["10.0.0.1:5000".to_owned()]);
    }

    #[test]
    fn renders_rates_percentiles_and_peers() {
        let before = Sample::parse("kvmove_bytes_total{op=\"write\",peer=\"10.0.0.1:5000\"} 0\n");
        let now = Sample::parse(TEXT);
        let f = render("127.0.0.1:9000".parse().unwrap(), 1, &now, &before, 1.0);
        let moved = f.lines().find(|l| l.starts_with("moved")).unwrap();
        assert!(moved.contains("write    2.0 KiB/s") && moved.contains("read    1.0 KiB/s"), "{f}");
        assert!(f.contains("transfer p50 1.50 ms"), "{f}");
        assert!(f.contains("10.0.0.1:5000") && f.contains("10.0.0.2:5000"), "{f}");
        assert!(f.lines().any(|l| l.starts_with("10.0.0.2:5000") && l.ends_with("open")), "{f}");
        assert!(!f.contains("rails"), "no rails, no rails line: {f}");
    }

    /// Issue 52 item 3: rail paths that are not used show in the view.
    #[test]
    fn renders_unreachable_rail_paths() {
        let text = format!(
            "{TEXT}kvmove_rail_paths_unreachable 2\nkvmove_rail_events_total{{event=\"unreachable\"}} 2\n\
             kvmove_rail_events_total{{event=\"paused\"}} 4\n"
        );
        let before = Sample::parse("kvmove_rail_events_total{event=\"paused\"} 1\n");
        let f = render("127.0.0.1:9000".parse().unwrap(), 1, &Sample::parse(&text), &before, 1.0);
        let rails = f.lines().find(|l| l.starts_with("rails")).expect("a rails line");
        assert!(rails.contains("paths unreachable 2") && rails.contains("paused 3/s"), "{f}");
    }
}
