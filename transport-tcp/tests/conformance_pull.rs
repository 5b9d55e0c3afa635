//! The conformance suite against the TCP backend with same-host copies but
//! no direct writes: every byte is copied by the side it lands on, after a
//! frame through the fault proxy (so the cases that stall traffic run on
//! the same-host path).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test and benchmark code: a failure should panic

mod support;

conformance::conformance_main!(|| support::harness::TcpHarness::new(support::harness::Path::Pull));
