//! An honest in-process transport backend, with fault injection.
//!
//! (design doc: see below)
#![forbid(unsafe_code)]

mod batch;
mod config;
mod endpoint;
mod fabric;
mod faulty;
mod host;
mod plan;
mod region;
mod segment;
mod transport;
mod worker;

pub use config::{MockBugs, MockConfig};
pub use fabric::MockFabric;
pub use faulty::FaultyTransport;
pub use plan::{FaultPlan, KillAfter, RandomFaults, RequestFault, RequestMatch, StallFault};
pub use transport::MockTransport;
