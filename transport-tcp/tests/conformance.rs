//! The conformance suite against the TCP backend as configured by default:
//! its loopback lanes move their bytes by same-host copies, and small
//! writes go straight into the peer's memory (direct writes; see
//! `support/harness.rs` for the nodes and their faults).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test and benchmark code: a failure should panic

mod support;

conformance::conformance_main!(|| support::harness::TcpHarness::new(support::harness::Path::Direct));
