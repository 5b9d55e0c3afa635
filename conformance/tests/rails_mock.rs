//! The whole conformance suite against `transport_rails::Rails`: every node
//! is two mock hosts (two rails) driven as one transport
//! (`rails_common`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod rails_common;

conformance::conformance_main!(rails_common::RailsHarness::default);
