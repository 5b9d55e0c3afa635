//! The whole conformance suite against the mock backend.
conformance::conformance_main!(conformance::mock::MockHarness::new);
