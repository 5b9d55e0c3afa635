//! The whole conformance suite against `transport_rails::Rails` with a
//! topology (`rails_common`, `RailsHarness::placed`): rail 0's NIC on NUMA
//! node 0, rail 1's on node 1, every region's memory on node 1, so every
//! region keeps to rail 1 while it is up and fails over to rail 0; every
//! rule holds all the same.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod rails_common;

conformance::conformance_main!(rails_common::RailsHarness::placed);
