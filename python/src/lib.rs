//! Python bindings of the kvmove transfer engine (module `kvmove._native`).
//!
//! # Design
//!
//! Two Python APIs share one engine ([`core::Core`]): a backend (TCP or
//! RDMA, chosen by the `protocol` string) wrapped in `kvmove_policy`'s
//! policy layer (retry, deadlines, circuit breaker, backpressure), with its
//! own small multi-threaded tokio runtime.
//!
//! * `TransferEngine` ([`compat`]) answers the calls serving engines make on
//!   Mooncake's `mooncake.engine.TransferEngine`, with its return codes.
//! * `NativeEngine` / `NativeBatch` ([`native`]) raise exceptions with a
//!   kind and `is_transient`; the pure-Python package `kvmove` wraps them in
//!   context managers (`Engine`, `Region`, `Session`, `Batch`).
//! * `NativeHandoff` / `NativeSessionWrite` ([`handoff`]) are the two sides
//!   of a handoff session (rules 12, 13) over `kvmove_policy::Sessions`,
//!   which also carries the Pythonic API's plain notifications (rule 11);
//!   the Mooncake API's notifications go straight through the transport.
//! * `NixlXfer` ([`nixl`]) is a transfer of the NIXL-style agent
//!   (`kvmove.nixl`): the runtime sends its notification once every request
//!   completed, so the message never arrives before the data.
//!
//! * [`named`] is the one framing of a named notification, for the
//!   Mooncake API (`TransferNotify`) and the NIXL API alike.
//!
//! * [`metrics`] keeps the engine's metrics (emitted through the `metrics`
//!   facade) in memory for `kvmove.metrics()` and the `prometheus_client`
//!   collector; the first engine of any API installs it.
//!
//! * [`devmem`] tells device memory (an installed provider's: CUDA, or
//!   `kvmove.FakeDevice` in tests) from host memory at every registration,
//!   so device memory is only ever reached through its provider.
//!
//! Callers pass raw local addresses; a table of registered regions
//! ([`regions`]) maps each to `(region, offset)` and refuses anything
//! outside registered memory before the engine sees it. Every blocking call
//! releases the GIL, and nothing on the data path calls into Python.

mod backend;
mod compat;
mod core;
mod devmem;
mod errors;
mod handoff;
mod hostmem;
mod metrics;
mod named;
mod native;
mod nixl;
mod outcome;
mod regions;
mod words;

use pyo3::prelude::*;

/// The native module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::add_to_module(m)?;
    m.add_class::<compat::MooncakeEngine>()?;
    m.add_class::<compat::TransferNotify>()?;
    m.add_class::<native::NativeEngine>()?;
    m.add_class::<native::NativeBatch>()?;
    m.add_class::<handoff::NativeHandoff>()?;
    m.add_class::<handoff::NativeSessionWrite>()?;
    m.add_class::<nixl::NixlXfer>()?;
    m.add_class::<nixl::NixlOps>()?;
    m.add_class::<devmem::PyFakeDevice>()?;
    m.add_function(wrap_pyfunction!(devmem::device_providers, m)?)?;
    m.add_function(wrap_pyfunction!(backend::control_access, m)?)?;
    m.add_function(wrap_pyfunction!(nixl::nixl_desc_rows, m)?)?;
    m.add_function(wrap_pyfunction!(nixl::nixl_index_words, m)?)?;
    m.add_function(wrap_pyfunction!(nixl::nixl_uncovered, m)?)?;
    m.add_function(wrap_pyfunction!(metrics::metrics_snapshot, m)?)?;
    m.add_function(wrap_pyfunction!(named::named_notification, m)?)?;
    m.add_function(wrap_pyfunction!(named::read_named_notification, m)?)?;
    m.add("MAX_NOTIFY_LEN", transport_core::MAX_NOTIFY_LEN)?;
    m.add("PROTOCOL_ENV", backend::PROTOCOL_ENV)?;
    m.add("HAS_RDMA", backend::has_rdma())?;
    Ok(())
}
