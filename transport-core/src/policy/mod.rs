//! The shared policy layer (rule 8): retry, deadlines, circuit breaker and
//! backpressure, implemented once above every backend.

mod backoff;
mod breaker;
mod budget;
mod config;
mod engine;
pub(crate) mod metrics;
mod rails;
mod sessions;

pub use backoff::backoff;
pub use breaker::{Admit, Breaker, BreakerState};
pub use budget::{Budget, Charge, Reservation, Usage};
pub use config::{BackpressureConfig, BreakerConfig, DeadlineConfig, PolicyConfig, RetryConfig};
pub use engine::{Engine, Transfer, TransferOutcome};
pub use rails::{PathStatus, Rails};
pub use sessions::Sessions;
