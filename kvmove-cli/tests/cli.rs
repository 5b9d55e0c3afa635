//! The built `kvmove` binary, run as a user would: tiny workloads, JSON
//! output, two processes over loopback, and the errors a user can act on.
//! Every child process is bounded in time and killed on the way out.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

#[test]
fn default_bench_over_tcp_verifies_every_byte() {
    let v = json(&run(&args(&["--json"])));
    assert_eq!(v["command"], "bench");
    assert_eq!(v["backend"], "tcp");
    // all-at-end, layerwise, per-request: one pass each.
    assert_eq!(v["modes"].as_array().unwrap().len(), 3);
    assert_verified(&v, 3);
    let gain = v["overlap_gain"].as_f64().unwrap();
    assert!(gain > 0.0, "{v}");
    let m = &v["modes"][0];
    assert_eq!(m["mode"], "all-at-end");
    assert!(m["bandwidth_gib_s"].as_f64().unwrap() > 0.0);
    assert!(m["tail_ms"].as_f64().is_some());
    assert!(v["modes"][2]["request_latency"]["p999_ms"].as_f64().is_some());
}

#[test]
fn bench_subcommand_over_mock_reads_contiguous_pages() {
    let v = json(&run(&args(&[
        "bench",
        "--json",
        "--backend",
        "mock",
        "--op",
        "read",
        "--fragmentation",
        "contiguous",
        "--mode",
        "layerwise",
        "--per-request",
        "false",
    ])));
    assert_eq!(v["backend"], "mock");
    assert_eq!(v["modes"].as_array().unwrap().len(), 1);
    assert_eq!(v["requests_per_pass"], 8, "one request per layer and K/V");
    assert_verified(&v, 1);
}

#[test]
fn bench_with_in_process_metadata_resolves_a_name() {
    let v = json(&run(&args(&["--json", "--metadata", "in-process", "--mode", "all-at-end"])));
    assert_eq!(v["metadata"], "in-process");
    assert!(v["target"].as_str().unwrap().starts_with("kvmove-target"), "{v}");
}

#[test]
fn table_output_has_the_numbers() {
    let r = run(TINY);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    for needle in
        ["bandwidth (GiB/s)", "bandwidth (Gbit/s)", "requests/s", "p999", "tail after last layer", "verified:"]
    {
        assert!(r.stdout.contains(needle), "missing {needle}:\n{}", r.stdout);
    }
    assert!(r.stderr.is_empty(), "no progress bar when not a terminal: {}", r.stderr);
}

#[test]
fn initiator_against_a_target_process_writes_and_reads() {
    let (mut target, segment) = start_target(&[]);
    assert!(segment.starts_with("127.0.0.1:"), "{segment}");
    for op in ["write", "read"] {
        let v = json(&run(&args(&["initiator", "--target", &segment, "--json", "--op", op])));
        assert_eq!(v["command"], "initiator");
        assert_verified(&v, 3);
    }
    // SIGTERM stops the target cleanly (exit 0), within the time limit.
    stop(&mut target);
}

/// Percentiles of a session series, present with at least one sample.
fn assert_series(m: &serde_json::Value, series: &str, samples: u64) {
    let p = &m["sessions"][series];
    assert_eq!(p["samples"].as_u64(), Some(samples), "{series}: {m}");
    assert!(p["p50_ms"].as_f64().unwrap() >= 0.0 && p["p99_ms"].as_f64().unwrap() >= p["p50_ms"].as_f64().unwrap());
}

/// Sessions in one process: one session per layer pass and one per
/// request, all landed, every byte verified, and the session numbers
/// (grant wait, time to landed, notification delay) in the JSON and the
/// table; over TCP and the mock.
#[test]
fn bench_with_sessions_verifies_every_byte_and_reports_them() {
    for backend in ["tcp", "mock"] {
        let v = json(&run(&args(&["--json", "--sessions", "true", "--backend", backend])));
        assert_eq!(v["workload"]["sessions"], true);
        assert_verified(&v, 3);
        let modes = v["modes"].as_array().unwrap();
        assert_eq!(modes.len(), 3);
        for m in modes {
            let units = if m["mode"] == "per-request" { 32 } else { 1 };
            assert_eq!(m["sessions"]["landed"], units, "{m}");
            for series in ["grant_wait", "time_to_landed", "notify_delay", "finish_to_landed"] {
                assert_series(m, series, units);
            }
        }
    }
    let r = run(&args(&["--sessions", "true"]));
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    for needle in ["sessions landed", "grant wait p99 (ms)", "time to landed p50 (ms)", "notification delay p99 (ms)"] {
        assert!(r.stdout.contains(needle), "missing {needle}:\n{}", r.stdout);
    }
    // Off by default: no session rows.
    let r = run(TINY);
    assert!(!r.stdout.contains("grant wait"), "{}", r.stdout);
}

/// `kvmove target --sessions true` grants what `kvmove initiator
/// --sessions true` asks for, after checking both run the same plan; the
/// target reports its sessions when it stops. An initiator with another
/// plan, or against a target without sessions, is one line.
#[test]
fn initiator_with_sessions_against_a_target_process() {
    let (mut target, segment, events) = start_target_with(&["--sessions", "true"], Stdio::null());
    let v = json(&run(&args(&["initiator", "--target", &segment, "--json", "--sessions", "true"])));
    assert_eq!(v["command"], "initiator");
    assert_verified(&v, 3);
    for m in v["modes"].as_array().unwrap() {
        let units = if m["mode"] == "per-request" { 32 } else { 1 };
        assert_eq!(m["sessions"]["landed"], units, "{m}");
        for series in ["grant_wait", "time_to_landed", "finish_to_landed"] {
            assert_series(m, series, units);
        }
        // Two clocks: the initiator cannot see when the target saw Landed.
        assert!(m["sessions"]["notify_delay"].is_null(), "{m}");
    }
    let r = run(&args(&["initiator", "--target", &segment, "--sessions", "true", "--seed", "7"]));
    assert_one_line_error(&r, "another workload");
    assert!(r.stderr.contains("--seed"), "{}", r.stderr);
    assert_eq!(r.code, Some(2));
    stop(&mut target);
    let stopped = events.recv_timeout(Duration::from_secs(10)).expect("the target's stopped event");
    let e: serde_json::Value = serde_json::from_str(&stopped).unwrap_or_else(|e| panic!("{e}: {stopped}"));
    assert_eq!(e["event"], "stopped");
    assert_eq!(e["sessions"]["landed"], 34, "1 + 1 + 32 sessions: {e}");
    assert_eq!(e["sessions"]["not_landed"], 0, "{e}");

    let (_plain, segment) = start_target(&[]);
    let began = Instant::now();
    let r = run(&args(&["initiator", "--target", &segment, "--sessions", "true"]));
    assert_one_line_error(&r, "--sessions true");
    assert!(began.elapsed() < Duration::from_secs(30), "{:?}", began.elapsed());
}

/// Sessions carry writes only: `--sessions true --op read` is refused up
/// front, from the options or the file (with its line).
#[test]
fn sessions_with_reads_is_a_one_line_config_error() {
    let r = run(&args(&["--sessions", "true", "--op", "read"]));
    assert_one_line_error(&r, "workload.sessions: --sessions true needs --op write");
    assert_eq!(r.code, Some(2));
    let dir = std::env::temp_dir().join(format!("kvmove-cli-sessions-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("read.toml");
    std::fs::write(&path, "[workload]\nop = \"read\"\nsessions = true\n").unwrap();
    let r = run(&["--config", path.to_str().unwrap()]);
    assert_one_line_error(&r, &format!("{}:3: workload.sessions", path.display()));
    assert_eq!(r.code, Some(2));
    let r = run(&["config", "--sessions", "true"]);
    assert!(r.stdout.contains("sessions = true"), "{}", r.stdout);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn initiator_to_a_dead_peer_is_one_line() {
    // Port 1: privileged (nothing here listens on it) and never handed out
    // as an ephemeral port, so no target of a test running beside this one
    // can be on it (a port bound and dropped again could be given to one).
    let addr = "127.0.0.1:1".to_string();
    let r = run(&args(&["initiator", "--target", &addr]));
    assert_one_line_error(&r, &addr);
    assert_eq!(r.code, Some(1));
}

#[test]
fn initiator_to_a_bad_address_is_one_line() {
    let r = run(&args(&["initiator", "--target", "not-an-address"]));
    assert_one_line_error(&r, "not-an-address");
}

#[test]
fn a_target_too_small_for_the_workload_is_named() {
    let (_target, segment) = start_target(&[]);
    let r = run(&["initiator", "--target", &segment, "--tokens", "4096", "--layers", "4"]);
    assert_one_line_error(&r, "--mem-mib");
}

#[test]
fn bad_config_file_names_file_line_and_key() {
    let dir = std::env::temp_dir().join(format!("kvmove-cli-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bad.toml");
    std::fs::write(&path, "[workload]\ntokens = 64\n\n[backend.tcp]\nlane = 2\n").unwrap();
    let r = run(&["--config", path.to_str().unwrap()]);
    assert_one_line_error(&r, &format!("{}:5:1: in [backend.tcp]", path.display()));
    assert!(r.stderr.contains("lane"), "{}", r.stderr);
    assert_eq!(r.code, Some(2));

    std::fs::write(&path, "[workload]\nop = \"sideways\"\n").unwrap();
    let r = run(&["--config", path.to_str().unwrap()]);
    assert_one_line_error(&r, ":2:");

    std::fs::write(&path, "[policy.retry]\nmax_attempts = 0\n").unwrap();
    let r = run(&["--config", path.to_str().unwrap()]);
    assert_one_line_error(&r, "policy.retry.max_attempts");

    let r = run(&["--config", dir.join("missing.toml").to_str().unwrap()]);
    assert_one_line_error(&r, "missing.toml");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn config_file_drives_the_run_and_config_prints_it() {
    let dir = std::env::temp_dir().join(format!("kvmove-cli-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("run.toml");
    std::fs::write(
        &path,
        "[backend]\nkind = \"mock\"\n[workload]\ntokens = 64\nlayers = 4\niterations = 1\nwarmup = 0\nmode = \"all-at-end\"\n\
         per_request = false\n",
    )
    .unwrap();
    let r = run(&["config", "--config", path.to_str().unwrap(), "--seed", "7"]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(r.stdout.contains("kind = \"mock\"") && r.stdout.contains("seed = 7"), "{}", r.stdout);
    // The printed config is itself a valid config file.
    let printed = dir.join("printed.toml");
    std::fs::write(&printed, &r.stdout).unwrap();
    let v = json(&run(&["--config", printed.to_str().unwrap(), "--json"]));
    assert_eq!(v["backend"], "mock");
    assert_eq!(v["workload"]["seed"], 7);
    assert_verified(&v, 1);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn unknown_model_and_backend_are_one_line() {
    assert_one_line_error(&run(&["--model", "gpt-9"]), "llama3-8b");
    assert_one_line_error(&run(&["--backend", "carrier-pigeon"]), "carrier-pigeon");
    let r = run(&["--op", "sideways"]);
    assert_eq!(r.code, Some(2));
    assert_eq!(r.stderr.lines().count(), 1, "{}", r.stderr);
    assert!(r.stderr.contains("sideways") && r.stderr.contains("write, read"), "{}", r.stderr);
    // 1M tokens of llama3-70b is 320 GiB per side: refused before allocating.
    assert_one_line_error(&run(&["--model", "llama3-70b", "--tokens", "1000000"]), "memory");
    // Not built in ("rebuild with --features rdma") or no device here:
    // either way one line that names RDMA.
    assert_one_line_error(&run(&["--backend", "rdma"]), "rdma");
}

#[test]
fn a_target_that_dies_mid_run_ends_the_initiator_with_one_line() {
    let (mut target, segment) = start_target(&[]);
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(800));
        let _ = target.0.kill();
        let _ = target.0.wait();
    });
    // Far more passes than fit in 800 ms.
    let r = run(&["initiator", "--target", &segment, "--tokens", "64", "--layers", "4", "--iterations", "100000"]);
    killer.join().unwrap();
    assert_one_line_error(&r, &segment);
    assert_eq!(r.code, Some(1));
}

/// Numbers past an option's range are refused up front with one line that
/// names the option and its range: no overflow panic, no endless sleep.
#[test]
fn numbers_out_of_range_are_one_line_and_quick() {
    let max = u64::MAX.to_string();
    let half = i64::MAX.to_string();
    let cases: [(&[&str], &str); 6] = [
        (&["bench", "--tokens", "16", "--layers", "2000", "--compute-delay-ms", &max], "--compute-delay-ms"),
        (&["bench", "--tokens", "16", "--layers", "1100", "--compute-delay-ms", &half], "--compute-delay-ms"),
        (&["bench", "--tokens", "16", "--compute-delay-ms", &max], "--compute-delay-ms"),
        (&["bench", "--tokens", &max, "--page-size", "1", "--layers", "4294967295"], "--tokens"),
        (&["bench", "--bytes-per-token", &max], "--bytes-per-token"),
        (&["target", "--mem-mib", &max], "--mem-mib"),
    ];
    for (a, needle) in cases {
        let began = Instant::now();
        let r = run(a);
        assert!(began.elapsed() < Duration::from_secs(10), "{a:?} took {:?}", began.elapsed());
        assert_one_line_error(&r, needle);
        assert!(r.stderr.contains("must be between"), "the range is named: {}", r.stderr);
        assert_eq!(r.code, Some(2), "{a:?}: {}", r.stderr);
    }
}

/// A FIFO (or a directory) given as `--config` is refused at once: reading
/// a FIFO would block until a writer came.
#[test]
fn a_config_path_that_is_not_a_regular_file_is_refused_quickly() {
    let dir = std::env::temp_dir().join(format!("kvmove-cli-fifo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fifo = dir.join("config.fifo");
    let made = Command::new("mkfifo").arg(&fifo).status();
    if made.map(|s| s.success()).unwrap_or(false) {
        let began = Instant::now();
        let r = run(&["config", "--config", fifo.to_str().unwrap()]);
        assert!(began.elapsed() < Duration::from_secs(10), "took {:?}", began.elapsed());
        assert_one_line_error(&r, "not a regular file");
        assert!(r.stderr.contains("config.fifo"), "{}", r.stderr);
        assert_eq!(r.code, Some(2));
    } else {
        eprintln!("SKIPPED the FIFO case: no `mkfifo` here");
    }
    let r = run(&["config", "--config", dir.to_str().unwrap()]);
    assert_one_line_error(&r, "not a regular file");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `kvmove target` logs, at its default level and with no `RUST_LOG`, one
/// line to stderr when it closes a connection that sent garbage: JSON
/// lines under `--json`, naming the peer. Stdout keeps only its events.
#[test]
fn a_target_logs_a_bad_connection_to_stderr() {
    use std::io::Write as _;
    let (mut target, segment, _) = start_target_with(&[], Stdio::piped());
    let stderr = target.0.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut conn = std::net::TcpStream::connect(&segment).unwrap();
    let me = conn.local_addr().unwrap().to_string();
    conn.write_all(&[0x67; 64]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut seen = Vec::new();
    let line = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) if l.contains(&me) => break l,
            Ok(l) => seen.push(l),
            Err(_) => panic!("no log line about {me} within 15 s; stderr so far: {seen:?}"),
        }
    };
    let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
    assert!(["WARN", "INFO", "ERROR"].contains(&v["level"].as_str().unwrap_or("")), "{line}");
    assert!(v["message"].as_str().is_some_and(|m| !m.is_empty()), "{line}");
    drop(conn);
}

#[test]
fn handoff_sessions_land_everything_where_today_times_out() {
    let v = json(&run(&[
        "handoff",
        "--json",
        "--senders",
        "2",
        "--requests",
        "6",
        "--request-kib",
        "64",
        "--decode-pages",
        "1",
        "--hold-ms",
        "60",
        "--arrival-timeout-ms",
        "150",
    ]));
    let flows = v["flows"].as_array().unwrap();
    let (with, today) = (&flows[0], &flows[1]);
    assert_eq!(with["flow"], "sessions");
    assert_eq!(with["landed"], 12, "{v}");
    assert_eq!(with["disagreements"], 0);
    assert!(with["notify_delay"]["count"].as_u64().unwrap() == 12, "{v}");
    assert_eq!(today["flow"], "today");
    assert!(today["landed"].as_u64().unwrap() < 12, "{v}");
    // Today's way may end a request differently on its two sides (that is
    // what the comparison shows; the command still succeeds); wrong bytes
    // never.
    assert_eq!((&with["wrong_bytes"], &today["wrong_bytes"]), (&0.into(), &0.into()), "{v}");
}

#[test]
fn handoff_bad_numbers_are_one_line() {
    assert_one_line_error(&run(&["handoff", "--liveness-ms", "1"]), "liveness");
    assert_one_line_error(&run(&["handoff", "--hold-ms", "18446744073709551615"]), "hold-ms");
    assert_one_line_error(&run(&["handoff", "--request-kib", "18446744073709551615"]), "request-kib");
    assert_one_line_error(&run(&["handoff", "--senders", "0"]), "senders");
}

/// A loopback port that was free a moment ago.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// The body of `GET /metrics` from `addr` (plain HTTP/1.0 over a socket).
fn scrape(addr: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    std::io::Write::write_all(&mut s, b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    assert!(text.starts_with("HTTP/1.") && text.contains(" 200 "), "{text}");
    text.split_once("\r\n\r\n").map(|(_, body)| body.to_owned()).unwrap_or_default()
}

/// The value of one series (`name{labels}` exactly as exported).
fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Issue 15: `kvmove target --metrics` serves Prometheus text whose
/// counters match the workload an initiator ran against it: the bytes it
/// wrote and the bytes it read back to verify, and the connections it made.
#[test]
fn target_serves_metrics_that_count_the_workload() {
    let maddr = format!("127.0.0.1:{}", free_port());
    let (mut target, segment) = start_target(&["--metrics", &maddr]);
    let before = scrape(&maddr);
    assert_eq!(metric(&before, r#"kvmove_tcp_served_bytes_total{op="write"}"#), None, "nothing served yet: {before}");
    let v = json(&run(&args(&["initiator", "--target", &segment, "--json"])));
    assert_verified(&v, 3);
    let bytes = v["verified_bytes"].as_u64().unwrap() as f64;
    let text = scrape(&maddr);
    assert_eq!(metric(&text, r#"kvmove_tcp_served_bytes_total{op="write"}"#), Some(bytes), "{text}");
    // Every family carries the engine's own description (describe_metrics).
    assert!(text.contains("# HELP kvmove_tcp_served_bytes_total Bytes this engine's TCP server served"), "{text}");
    // The initiator reads every byte back to verify it.
    assert_eq!(metric(&text, r#"kvmove_tcp_served_bytes_total{op="read"}"#), Some(bytes), "{text}");
    let conns = metric(&text, "kvmove_tcp_connections_total").unwrap_or(0.0);
    assert!(conns >= 1.0, "{text}");
    // The live view renders a frame from the same endpoint.
    let top = run(&["top", "--url", &maddr, "--interval-ms", "200", "--count", "2"]);
    assert_eq!(top.code, Some(0), "{}", top.stderr);
    let frames: Vec<&str> = top.stdout.split("kvmove top  ").filter(|f| !f.trim().is_empty()).collect();
    assert_eq!(frames.len(), 2, "{}", top.stdout);
    let served = frames[1].lines().find(|l| l.starts_with("served")).unwrap_or("");
    assert!(served.contains(&format!("connections {conns} ")), "{}", top.stdout);
    stop(&mut target);
    // Nothing to watch any more: one line, not a hang.
    let gone = run(&["top", "--url", &maddr, "--count", "1"]);
    assert_one_line_error(&gone, "/metrics");
}

/// `--metrics` on an address that cannot be served is one line, exit 2.
#[test]
fn metrics_on_a_busy_address_is_one_line() {
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = busy.local_addr().unwrap().to_string();
    let r = run(&args(&["bench", "--metrics", &addr]));
    assert_eq!(r.code, Some(2));
    assert_one_line_error(&r, "--metrics");
}

/// Issue 15: the bench prints the time per stage under its table (metrics
/// are recorded by default): every stage, and as many transfers as the
/// workload made; `--no-metrics` records nothing and prints no such line.
#[test]
fn bench_prints_a_stage_breakdown_unless_metrics_are_off() {
    let r = run(TINY);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let line = r.stdout.lines().find(|l| l.starts_with("stages per engine transfer")).unwrap_or_else(|| {
        panic!("no stage line:\n{}", r.stdout);
    });
    for stage in ["budget", "submit", "complete"] {
        assert!(line.contains(&format!("  {stage} ")), "{line}");
    }
    let transfers: u64 = line.split('(').nth(1).and_then(|t| t.split(' ').next()).and_then(|n| n.parse().ok()).unwrap();
    assert!(transfers > 0, "{line}");
    let off = run(&args(&["--no-metrics"]));
    assert_eq!(off.code, Some(0), "{}", off.stderr);
    assert!(!off.stdout.contains("stages per engine transfer"), "{}", off.stdout);
    let both = run(&args(&["--no-metrics", "--metrics", "127.0.0.1:1"]));
    assert_one_line_error(&both, "exclude each other");
}

/// Issue 27, item 2: a target at its connection limit answers Busy, and
/// the initiator waits for a slot (the policy's retry, here up to 40 tries
/// 50-100 ms apart) instead of ending the run. The target serves one
/// connection; a first initiator holds it for a couple of seconds while a
/// second one starts: both verify every byte, and the target refused
/// someone on the way.
#[test]
fn initiator_waits_for_a_busy_target_and_gets_through() {
    let dir = std::env::temp_dir().join(format!("kvmove-cli-busy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tcfg = dir.join("target.toml");
    std::fs::write(&tcfg, "[backend.tcp]\nmax_connections = 1\n").unwrap();
    let icfg = dir.join("initiator.toml");
    std::fs::write(
        &icfg,
        "[backend.tcp]\nlanes = 1\n[policy.retry]\nmax_attempts = 200\ninitial_backoff_ms = 50\nmax_backoff_ms = 100\n\
         [policy.deadline]\nbase_ms = 30000\n",
    )
    .unwrap();
    let log = dir.join("target.err");
    let stderr = Stdio::from(std::fs::File::create(&log).unwrap());
    let (mut target, segment, _) = start_target_with(&["--config", tcfg.to_str().unwrap()], stderr);
    let ic = icfg.to_str().unwrap();
    // The first initiator: ten passes with 20 ms of compute per layer.
    let mut holder = Command::new(BIN)
        .args(["initiator", "--target", &segment, "--config", ic, "--json"])
        .args(["--tokens", "64", "--layers", "4", "--iterations", "10", "--warmup", "0", "--compute-delay-ms", "20"])
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map(Guard)
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let v = json(&run(&args(&["initiator", "--target", &segment, "--config", ic, "--json"])));
    assert_eq!(v["ok"], true, "{v}");
    let deadline = Instant::now() + LIMIT;
    let status = loop {
        if let Some(s) = holder.0.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "the first initiator did not finish");
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut out = String::new();
    holder.0.stdout.take().unwrap().read_to_string(&mut out).unwrap();
    assert!(status.success(), "the first initiator failed: {out}");
    let first: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(first["ok"], true, "{first}");
    stop(&mut target);
    let refusals = std::fs::read_to_string(&log).unwrap().matches("refusing connection").count();
    assert!(refusals > 0, "the target never answered Busy: the test did not test the retry");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A `kvmove pd` process with its stdout lines (JSON events) on a channel.
struct Pd {
    child: Guard,
    events: std::sync::mpsc::Receiver<serde_json::Value>,
}

impl Pd {
    fn start(args: &[&str]) -> Pd {
        let mut child = Command::new(BIN)
            .arg("pd")
            .args(args)
            .args(["--listen", "127.0.0.1:0"])
            .env_remove("RUST_LOG")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start kvmove pd");
        let out = child.stdout.take().unwrap();
        let (tx, events) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) {
                    let _ = tx.send(v);
                }
            }
        });
        Pd { child: Guard(child), events }
    }

    /// The next event named `ev`, skipping others (bounded).
    fn next(&self, ev: &str) -> serde_json::Value {
        let deadline = Instant::now() + LIMIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let v = self.events.recv_timeout(left).unwrap_or_else(|e| panic!("no '{ev}' event: {e}"));
            if v["ev"] == ev {
                return v;
            }
        }
    }

    fn send(&mut self, line: &str) {
        use std::io::Write;
        let stdin = self.child.0.stdin.as_mut().unwrap();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
    }
}

/// `kvmove pd`: a prefill hands requests to a decode whose pool holds two
/// pages (so the third request waits for a page), every page is checked
/// byte for byte on the decode, both ends report the same outcome for
/// every request, a malformed line is reported and skipped, and the
/// prefill says goodbye when its stdin ends.
#[test]
fn pd_prefill_hands_requests_to_a_decode_and_both_ends_agree() {
    let small = ["--page-kib", "16", "--hold-ms", "20", "--writes", "4"];
    let decode = Pd::start(&[&["--role", "decode", "--pages", "2"][..], &small].concat());
    let ready = decode.next("ready");
    let segment = ready["segment"].as_str().unwrap().to_owned();
    assert_eq!(ready["role"], "decode");
    let mut prefill = Pd::start(&[&["--role", "prefill"][..], &small].concat());
    prefill.next("ready");
    prefill.send("req x nowhere");
    assert_eq!(prefill.next("bad-line")["line"], "req x nowhere");
    let ids = [11u64, 12, 13, 14, 15];
    for id in ids {
        prefill.send(&format!("req {id} {segment}"));
    }
    let mut sender: Vec<(u64, String)> = (0..ids.len())
        .map(|_| {
            let e = prefill.next("end");
            (e["id"].as_u64().unwrap(), e["state"].as_str().unwrap().to_owned())
        })
        .collect();
    let mut receiver: Vec<(u64, String)> = (0..ids.len())
        .map(|_| {
            let e = decode.next("end");
            assert_eq!(e["verified"], true, "{e}");
            (e["id"].as_u64().unwrap(), e["state"].as_str().unwrap().to_owned())
        })
        .collect();
    sender.sort();
    receiver.sort();
    assert_eq!(sender, receiver);
    assert!(sender.iter().all(|(_, st)| st == "landed"), "{sender:?}");
    assert_eq!(sender.iter().map(|x| x.0).collect::<Vec<_>>(), ids);
    drop(prefill.child.0.stdin.take());
    assert_eq!(prefill.next("bye")["why"], "stdin closed");
}
