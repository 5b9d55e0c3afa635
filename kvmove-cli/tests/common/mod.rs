//! What the command's tests share: running the built binary (bounded),
//! starting a target process, reading its JSON.
#![allow(dead_code)] // each test target uses a part

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_kvmove");
pub const LIMIT: Duration = Duration::from_secs(60);

/// Small enough for a debug build on two cores: 64 tokens of a 4-layer
/// llama3-8b (2 MiB per pass).
pub const TINY: &[&str] =
    &["--tokens", "64", "--layers", "4", "--iterations", "1", "--warmup", "0", "--compute-delay-ms", "1"];

pub struct Run {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

/// Kills the child when dropped, so a failing test leaves nothing behind.
pub struct Guard(pub Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn run(args: &[&str]) -> Run {
    let mut child = Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start kvmove");
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let out_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + LIMIT;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("kvmove {args:?} did not finish within {LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Run { code: status.code(), stdout: out_t.join().unwrap(), stderr: err_t.join().unwrap() }
}

pub fn args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut v: Vec<&str> = extra.to_vec();
    v.extend_from_slice(TINY);
    v
}

pub fn json(r: &Run) -> serde_json::Value {
    assert_eq!(r.code, Some(0), "stderr: {}", r.stderr);
    serde_json::from_str(r.stdout.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {}", r.stdout))
}

/// Each pass moves the whole plan once and verifies every request.
pub fn assert_verified(v: &serde_json::Value, passes: u64) {
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(v["mismatched_requests"], 0);
    let per_pass = v["bytes_per_pass"].as_u64().unwrap();
    assert_eq!(per_pass, 64 * 4096 * 4, "64 tokens x 4 KiB x 4 layers");
    assert_eq!(v["verified_bytes"].as_u64().unwrap(), per_pass * passes, "{v}");
    assert_eq!(v["verified_requests"].as_u64().unwrap(), v["requests_per_pass"].as_u64().unwrap() * passes);
}

/// A failure is one line on stderr, a non-zero exit and never a panic.
pub fn assert_one_line_error(r: &Run, needle: &str) {
    assert_ne!(r.code, Some(0), "stdout: {}", r.stdout);
    assert!(!r.stderr.contains("panicked") && !r.stderr.contains("RUST_BACKTRACE"), "{}", r.stderr);
    let lines: Vec<&str> = r.stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line: {:?}", r.stderr);
    assert!(lines[0].starts_with("kvmove: error: "), "{}", lines[0]);
    assert!(lines[0].contains(needle), "{} should mention {needle}", lines[0]);
}

/// Starts `kvmove target` on an ephemeral loopback port and returns it
/// with the segment name it printed.
pub fn start_target(extra: &[&str]) -> (Guard, String) {
    let (guard, segment, _) = start_target_with(extra, Stdio::null());
    (guard, segment)
}

/// [`start_target`], with the target's stderr going to `stderr`; also
/// returns the target's later stdout lines (its events).
pub fn start_target_with(extra: &[&str], stderr: Stdio) -> (Guard, String, std::sync::mpsc::Receiver<String>) {
    let mut a = vec!["target", "--json", "--listen", "127.0.0.1:0"];
    a.extend_from_slice(extra);
    a.extend_from_slice(TINY);
    let mut cmd = Command::new(BIN);
    cmd.args(&a).env_remove("RUST_LOG").stdin(Stdio::null()).stdout(Stdio::piped()).stderr(stderr);
    let mut child = cmd.spawn().unwrap();
    let stdout = child.stdout.take().unwrap();
    let guard = Guard(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let line = rx.recv_timeout(Duration::from_secs(30)).expect("target printed its address");
    let v: serde_json::Value = serde_json::from_str(line.trim()).unwrap_or_else(|e| panic!("{e}: {line}"));
    assert_eq!(v["event"], "ready");
    (guard, v["segment"].as_str().unwrap().to_owned(), rx)
}

/// Sends SIGTERM and waits (bounded) for a clean exit.
pub fn stop(target: &mut Guard) {
    assert!(target.0.try_wait().unwrap().is_none(), "target still running");
    let pid = target.0.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = target.0.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "target did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status}");
}
