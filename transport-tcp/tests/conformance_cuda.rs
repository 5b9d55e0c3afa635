//! The conformance suite's device cases (every `device_*` run, and the
//! `memory` cases about device memory) against the TCP backend through its
//! sockets and pinned staging buffers, with CUDA device memory through the
//! real CUDA provider over kvmove's CUDA driver double (the binary re-runs
//! itself with the double as `libcuda.so.1` on its library path), not the
//! fake devices of `conformance.rs`. With `KVMOVE_CUDA_TESTS=gpu` it runs
//! on a real GPU (scripts/gpu-tests.sh).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failure should panic

mod support;

use support::harness::{Path, TcpHarness};

conformance::census_allocator!();

/// Whether a run of the suite is about device memory.
fn device_run(name: &str) -> bool {
    ["::device_", "::memory::device_regions", "::memory::slow_device_copies"].iter().any(|k| name.contains(k))
}

fn main() {
    let driver = kvmove_cuda_double::run_under_double();
    kvmove_cuda_double::devices::install(driver);
    let trials = conformance::trials(|| TcpHarness::new(Path::Sockets));
    let trials: Vec<_> = trials.into_iter().filter(|t| device_run(t.name())).collect();
    assert!(trials.len() > 10, "the suite's device runs are missing ({} found)", trials.len());
    conformance::run_trials(&conformance::Arguments::from_args(), trials)
}
