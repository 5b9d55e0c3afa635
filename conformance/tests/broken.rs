//! The suite can fail: each deliberately broken transport fails the case
//! that checks the rule it breaks, and the correct mock passes that case.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use conformance::broken::BrokenLayer;
use conformance::mock::MockHarness;
use conformance::{cases, run_case, Outcome};
use transport_mock::MockBugs;

// The heap census for `lifecycle::no_hidden_growth`.
conformance::census_allocator!();

fn bugs(f: impl FnOnce(&mut MockBugs)) -> MockHarness {
    let mut b = MockBugs::default();
    f(&mut b);
    MockHarness::with_bugs(b)
}

/// The correct mock passes `case`; `broken` fails it.
fn caught(broken: MockHarness, case: &str) {
    assert_eq!(run_case(MockHarness::new(), case), Ok(Outcome::Passed), "the correct mock must pass {case}");
    match run_case(broken.clone(), case) {
        Err(why) => eprintln!("{broken:?} fails {case} as it must: {why}"),
        Ok(o) => panic!("{case} did not catch {broken:?}: {o:?}"),
    }
}

#[test]
fn leak_on_failure_fails_failure_frees() {
    caught(bugs(|b| b.leak_endpoint_on_failure = true), "failure::failed_endpoint_is_freed");
}

#[test]
fn cached_broken_endpoint_fails_next_transfer_builds_new() {
    caught(bugs(|b| b.cache_broken_endpoint = true), "failure::next_transfer_builds_new_endpoint");
}

#[test]
fn write_after_timeout_fails_terminal_quiet() {
    caught(bugs(|b| b.write_after_timeout = true), "deadline::quiet_after_timeout");
}

#[test]
fn noop_close_fails_close_is_real() {
    caught(bugs(|b| b.noop_close_segment = true), "lifecycle::close_releases_endpoints");
}

/// Requests of the mock wait this long before their bytes move, so a
/// notification sent at submit arrives while the copies still run.
const LATENCY: Duration = Duration::from_millis(2);

#[test]
fn notify_before_landing_fails_never_overtakes_data() {
    let case = "notify::never_overtakes_data";
    let slow = MockHarness::new().with_latency(LATENCY);
    assert_eq!(run_case(slow, case), Ok(Outcome::Passed), "the correct mock with latency must pass {case}");
    caught(bugs(|b| b.notify_before_landing = true).with_latency(LATENCY), case);
}

#[test]
fn dropped_failure_notices_fail_receiver_cancels() {
    caught(
        MockHarness::wrapped("drops_failure_notices", BrokenLayer::drops_failure_notices),
        "session::receiver_cancels_mid_transfer",
    );
}

#[test]
fn dropped_failure_notices_fail_sender_cancels() {
    caught(
        MockHarness::wrapped("drops_failure_notices", BrokenLayer::drops_failure_notices),
        "session::sender_cancels",
    );
}

/// A leak the backend does not count (a map of "connections" that
/// close_segment never prunes, while stats() is the correct mock's) passes
/// every case that reads stats(), and the heap census catches it.
#[test]
fn leak_hidden_from_stats_is_caught_by_the_census() {
    let broken = || MockHarness::wrapped("hides_leak", BrokenLayer::hides_leak);
    for blind in ["lifecycle::open_close_reopen", "lifecycle::counts_return_after_each_operation"] {
        assert_eq!(run_case(broken(), blind), Ok(Outcome::Passed), "{blind} reads stats() and cannot see the leak");
    }
    caught(broken(), "lifecycle::no_hidden_growth");
}

#[test]
fn retries_permanent_fails_permanent_not_retried() {
    caught(
        MockHarness::wrapped("retries_permanent", BrokenLayer::retries_permanent),
        "policy::permanent_errors_not_retried",
    );
}

/// A completion reported before the bytes landed is caught by the data
/// cases, and the message says when: how long before the check the batch
/// was reported completed, and that the bytes became right later (not a
/// wrong offset).
#[test]
fn completed_before_landing_is_caught_and_said_so() {
    let case = "data::write_lands_exact";
    assert_eq!(run_case(MockHarness::new(), case), Ok(Outcome::Passed), "the correct mock must pass {case}");
    let why = run_case(bugs(|b| b.complete_before_landing = true), case).expect_err("the early completion is caught");
    eprintln!("complete_before_landing fails {case} as it must: {why}");
    assert!(why.contains("was reported Completed"), "the message names the state and when: {why}");
    assert!(why.contains("the bytes became right"), "the message says the bytes landed later: {why}");
}

/// Set in the child process of `forgotten_device_memory_is_caught`.
const CHILD: &str = "KVMOVE_BROKEN_DEVICE_CHILD";

/// The signal of a segmentation fault (Linux, every architecture).
const SIGSEGV: i32 = 11;

/// A backend that takes device memory for host memory is caught by the
/// suite's device runs: the fake device's memory faults on the first host
/// access, which kills the process, so the broken mock runs in a child
/// that must die of SIGSEGV (or fail the case); the correct mock passes.
#[test]
fn forgotten_device_memory_is_caught() {
    use std::os::unix::process::ExitStatusExt;
    let case = "device_d2d::data::write_lands_exact";
    assert_eq!(run_case(MockHarness::new(), case), Ok(Outcome::Passed), "the correct mock must pass {case}");
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "forgotten_device_memory_child", "--include-ignored", "--nocapture", "--test-threads", "1"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let how = (out.status.signal(), out.status.code());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        how == (Some(SIGSEGV), None) || how == (None, Some(3)),
        "the broken mock was not caught by {case}: child ended {:?}\n{err}",
        out.status
    );
    eprintln!("the broken mock is caught by {case}: child ended {:?}", out.status);
}

/// The child of `forgotten_device_memory_is_caught` (runs only there).
#[test]
#[ignore = "run by forgotten_device_memory_is_caught in a child process"]
fn forgotten_device_memory_child() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    match run_case(bugs(|b| b.forget_device_memory = true), "device_d2d::data::write_lands_exact") {
        Err(why) => {
            eprintln!("failed the case: {why}");
            std::process::exit(3);
        }
        Ok(o) => panic!("the broken mock passed: {o:?}"),
    }
}

/// Every case against every broken transport, printed as a table (for
/// the README). `cargo test -p conformance --test broken -- --ignored --nocapture`
#[test]
#[ignore = "slow survey; run by hand"]
fn survey() {
    type Make = fn() -> MockHarness;
    let variants: Vec<(&str, Make)> = vec![
        ("leak_endpoint_on_failure", || bugs(|b| b.leak_endpoint_on_failure = true)),
        ("cache_broken_endpoint", || bugs(|b| b.cache_broken_endpoint = true)),
        ("write_after_timeout", || bugs(|b| b.write_after_timeout = true)),
        ("noop_close_segment", || bugs(|b| b.noop_close_segment = true)),
        ("retries_permanent", || MockHarness::wrapped("retries_permanent", BrokenLayer::retries_permanent)),
        ("notify_before_landing", || bugs(|b| b.notify_before_landing = true).with_latency(LATENCY)),
        ("drop_failure_notices", || MockHarness::wrapped("drops_failure_notices", BrokenLayer::drops_failure_notices)),
    ];
    for (name, make) in variants {
        let failed: Vec<String> =
            cases().iter().filter(|c| run_case(make(), &c.id()).is_err()).map(|c| c.id()).collect();
        println!("{name}: {} failing: {}", failed.len(), failed.join(", "));
    }
}

/// The mock, except that `kill` only says it killed the node.
#[derive(Clone, Debug)]
struct KillDoesNothing(MockHarness);

#[async_trait::async_trait]
impl conformance::Harness for KillDoesNothing {
    fn backend(&self) -> &str {
        "kill_does_nothing"
    }
    async fn node(&self, opts: &conformance::NodeOptions) -> transport_core::Result<conformance::Node> {
        self.0.node(opts).await
    }
    async fn kill(&self, _: &conformance::Node) -> transport_core::Result<bool> {
        Ok(true)
    }
    async fn restart(
        &self,
        node: &conformance::Node,
        opts: &conformance::NodeOptions,
    ) -> transport_core::Result<conformance::Node> {
        self.0.restart(node, opts).await
    }
    async fn cut(&self, to: &conformance::Node) -> transport_core::Result<bool> {
        self.0.cut(to).await
    }
    async fn stall(&self, to: &conformance::Node, on: bool) -> transport_core::Result<bool> {
        self.0.stall(to, on).await
    }
    fn os_probe(&self) -> Option<Vec<(String, u64)>> {
        None
    }
}

/// A harness whose `kill` leaves the node working fails with a message
/// naming the hook, at the kill, not with a timeout further on.
#[test]
fn a_kill_that_leaves_the_node_working_is_named() {
    let case = "errors::peer_failures_are_transient";
    let why = run_case(KillDoesNothing(MockHarness::new()), case).expect_err("a kill that kills nothing is caught");
    eprintln!("a kill that does nothing fails {case}: {why}");
    assert!(why.contains("the harness's kill left"), "the message names the hook: {why}");
    assert!(why.contains("Harness::kill must crash the node"), "the message says what kill must do: {why}");
}
