//! The whole conformance suite against the mock backend seen through
//! `transport_mock::FaultyTransport` with no faults planned: a fault
//! injector at rest must keep the contract too.
conformance::conformance_main!(|| conformance::mock::MockHarness::wrapped("mock_faulty", |t| {
    transport_mock::FaultyTransport::wrap(t) as std::sync::Arc<dyn transport_core::Transport>
}));
