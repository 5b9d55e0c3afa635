//! The whole conformance suite against the mock backend seen through the
//! suite's fault layer with no faults planned: a wrapper must keep the
//! contract too.
conformance::conformance_main!(|| conformance::mock::MockHarness::wrapped("mock_faulty", |t| {
    conformance::FaultLayer::new(t) as std::sync::Arc<dyn transport_core::Transport>
}));
