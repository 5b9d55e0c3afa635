//! The conformance suite against the TCP backend with same-host copies
//! off: every byte goes through the sockets, as between two hosts, and
//! device memory through staging buffers (`staging_buffers = 16`).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test and benchmark code: a failure should panic

mod support;

conformance::conformance_main!(|| support::harness::TcpHarness::new(support::harness::Path::Sockets));
