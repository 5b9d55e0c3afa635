//! The runner itself: unknown names, failures and panics are reported.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use async_trait::async_trait;
use conformance::{cases, run_case, Harness, Node, NodeOptions};
use transport_core::{Error, ErrorKind, Result};

/// A harness whose nodes cannot be created (or whose constructor panics).
struct NoNodes {
    panic: bool,
}

#[async_trait]
impl Harness for NoNodes {
    fn backend(&self) -> &str {
        "none"
    }
    async fn node(&self, _: &NodeOptions) -> Result<Node> {
        if self.panic {
            panic!("harness bug");
        }
        Err(Error::new(ErrorKind::Unsupported, "no nodes here"))
    }
    async fn kill(&self, _: &Node) -> Result<bool> {
        Ok(false)
    }
    async fn restart(&self, _: &Node, _: &NodeOptions) -> Result<Node> {
        Err(Error::new(ErrorKind::Unsupported, "no nodes here"))
    }
    async fn cut(&self, _: &Node) -> Result<bool> {
        Ok(false)
    }
    async fn stall(&self, _: &Node, _: bool) -> Result<bool> {
        Ok(false)
    }
    fn os_probe(&self) -> Option<Vec<(String, u64)>> {
        None
    }
}

#[test]
fn unknown_case_is_an_error() {
    let e = run_case(NoNodes { panic: false }, "data::no_such_case").unwrap_err();
    assert!(e.contains("no conformance case"), "{e}");
}

#[test]
fn a_harness_error_fails_the_case() {
    let e = run_case(NoNodes { panic: false }, "none::data::write_lands_exact").unwrap_err();
    assert!(e.contains("could not create a node"), "{e}");
}

#[test]
fn a_panic_fails_the_case() {
    let e = run_case(NoNodes { panic: true }, "data::write_lands_exact").unwrap_err();
    assert!(e.contains("panicked") && e.contains("harness bug"), "{e}");
}

#[test]
fn every_case_is_reachable_by_name() {
    for c in cases() {
        let r = run_case(NoNodes { panic: false }, &c.id());
        assert!(r != Ok(conformance::Outcome::Passed), "{} passed without a node", c.id());
    }
}

/// The mock with its stall hook switched off.
struct NoStall(conformance::mock::MockHarness);

#[async_trait]
impl Harness for NoStall {
    fn backend(&self) -> &str {
        "nostall"
    }
    async fn node(&self, o: &NodeOptions) -> Result<Node> {
        self.0.node(o).await
    }
    async fn kill(&self, n: &Node) -> Result<bool> {
        self.0.kill(n).await
    }
    async fn restart(&self, n: &Node, o: &NodeOptions) -> Result<Node> {
        self.0.restart(n, o).await
    }
    async fn cut(&self, n: &Node) -> Result<bool> {
        self.0.cut(n).await
    }
    async fn stall(&self, _: &Node, _: bool) -> Result<bool> {
        Ok(false)
    }
    fn os_probe(&self) -> Option<Vec<(String, u64)>> {
        None
    }
}

#[test]
fn a_missing_hook_is_a_skip_not_a_pass() {
    let r = run_case(NoStall(conformance::mock::MockHarness::new()), "deadline::quiet_after_timeout");
    match r {
        Ok(conformance::Outcome::Skipped(why)) => assert!(why.contains("stall"), "{why}"),
        other => panic!("expected a skip, got {other:?}"),
    }
}
