//! The backend's metrics counters, in one place (a leaf).

use crate::stage::MemPath;

/// Counts endpoint events (`built`, `evicted`, `reclaimed`, `destroyed`)
/// in the metrics.
pub(crate) fn endpoint_event(event: &'static str, n: u64) {
    metrics::counter!("kvmove_endpoints_total", "backend" => "rdma", "event" => event).increment(n);
    // Live endpoints of every RDMA transport in the process.
    match event {
        "built" => metrics::gauge!("kvmove_endpoints_live", "backend" => "rdma").increment(n as f64),
        "destroyed" => metrics::gauge!("kvmove_endpoints_live", "backend" => "rdma").decrement(n as f64),
        _ => {}
    }
}

/// Counts a device region registered, by the path it took, in the metrics
/// (`kvmove_device_regions_total{backend="rdma",path=...}`).
pub(crate) fn count_path(path: MemPath) {
    metrics::counter!("kvmove_device_regions_total", "backend" => "rdma", "path" => path.as_str()).increment(1);
}

/// Describes the RDMA backend's metrics (and the endpoint metrics every
/// backend emits) to the installed recorder. Call once after installing it.
pub fn describe_metrics() {
    transport_core::describe_endpoint_metrics();
    metrics::describe_counter!(
        "kvmove_device_regions_total",
        "Device (GPU) regions registered by the RDMA backend, by the path the NIC reaches them by."
    );
}
