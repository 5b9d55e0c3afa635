//! The command with etcd metadata, against a real etcd server. Without an
//! `etcd` binary on PATH the test is reported *ignored* (never passed),
//! except under `CI=true`, where that is a failure. A `harness = false`
//! target (libtest-mimic) for that reason.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// Through a real etcd server (reported ignored where `etcd` is not
/// installed, a failure under `CI=true`; the tests build the binary with etcd through the
/// dev-dependency on `kvmove`): the target publishes
/// under a logical name, the initiator resolves it, and a name nobody
/// serves is one clear line.
fn initiator_resolves_a_target_through_etcd() {
    let Some(etcd) = start_etcd() else { panic!("etcd did not start") };
    let url = etcd.1.clone();
    let (_target, segment) = start_target(&["--metadata", "etcd", "--etcd-endpoints", &url, "--name", "prefill-7"]);
    let v = json(&run(&args(&[
        "initiator",
        "--target",
        "prefill-7",
        "--metadata",
        "etcd",
        "--etcd-endpoints",
        &url,
        "--json",
    ])));
    assert_verified(&v, 3);
    assert!(v["target"].as_str().unwrap().contains("prefill-7"), "{v}");
    let _ = segment;
    let r = run(&args(&["initiator", "--target", "nobody", "--metadata", "etcd", "--etcd-endpoints", &url]));
    assert_one_line_error(&r, "no target named 'nobody'");
    let (server, _, dir) = etcd;
    drop(server);
    let _ = std::fs::remove_dir_all(dir);
}

fn start_etcd() -> Option<(Guard, String, std::path::PathBuf)> {
    let free = || std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let (client, peer) = (format!("http://127.0.0.1:{}", free()), format!("http://127.0.0.1:{}", free()));
    let dir = std::env::temp_dir().join(format!("kvmove-cli-etcd-{}", std::process::id()));
    let child = Command::new("etcd")
        .args(["--name", "kvmove-cli", "--data-dir"])
        .arg(dir.join("data"))
        .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
        .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
        .arg("--initial-cluster")
        .arg(format!("kvmove-cli={peer}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let guard = Guard(child);
    let port: u16 = client.rsplit(':').next().unwrap().parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "etcd did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    Some((guard, client, dir))
}

/// Whether an `etcd` binary is on PATH.
fn have_etcd() -> bool {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).any(|d| d.join("etcd").is_file())
}

fn main() {
    let args = libtest_mimic::Arguments::from_args();
    let have = have_etcd();
    if !have {
        assert!(
            std::env::var("CI").map_or(true, |v| v != "true"),
            "etcd not installed (CI=true): run transport-etcd/install-etcd.sh"
        );
        eprintln!("etcd tests IGNORED: no `etcd` binary on PATH");
    }
    let trial = libtest_mimic::Trial::test("initiator_resolves_a_target_through_etcd", || {
        std::panic::catch_unwind(initiator_resolves_a_target_through_etcd).map_err(|e| {
            let msg = e.downcast_ref::<String>().cloned().or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()));
            libtest_mimic::Failed::from(msg.unwrap_or_else(|| "panicked".into()))
        })
    })
    .with_ignored_flag(!have);
    libtest_mimic::run(&args, vec![trial]).exit()
}
