//! Rails: several transports of one kind, one per NIC, driven as one
//! [`transport_core::Transport`] ([`Rails`]), with an optional fallback
//! transport while every rail to a peer is down.
//!
//! A layer, not a backend: it holds no sockets or verbs of its own and
//! composes over any `Transport`. The builder that knows which backends it
//! has (the `kvmove` facade) puts it together: [`over`] takes the rails
//! one backend opened and the fallback another one did.
//!
//! - [`paths`] (sans-IO): the health of one path (a local rail to one of
//!   the peer's rails) with pause and backoff, the pairing of local rails
//!   with a peer's, and the rail list a transport advertises.
//! - [`Rails`] drives them: slices, failover, probes, the fallback.
//! - [`topology`]: where each rail's NIC and each region's memory sit
//!   (sysfs), and which rails are nearest a region.
//!
//! How rails relate to the contract's rule 8 (backends do not retry) is
//! stated in `docs/CONTRACT.md` ("Layers"): a slice a rail failed with a
//! transient peer failure is moved to another path of the *same* attempt,
//! never retried after the batch is terminal; the Engine's retries stack on
//! top, and `RailsConfig` bounds the reposts per batch.
//!
//! A layer reports, as a backend does; it cannot reach the policy layer:
//!
//! ```compile_fail
//! use kvmove_policy::Engine;
//! ```
#![forbid(unsafe_code)]

mod drive;
mod layer;
pub mod paths;
mod schedule;
mod state;
pub mod topology;

use std::sync::Arc;

use transport_core::{Result, Transport};

pub use layer::{PathStatus, Rails};
pub use paths::{gid_prefix, Pairing, PathState, RailsConfig, MAX_RAILS};
pub use state::describe_metrics;

/// The transport `rails` and `fallback` make: one rail without a fallback
/// is itself (no layer in between); anything else is a [`Rails`] over them
/// with `cfg`. `rails` must not be empty.
pub fn over(
    rails: Vec<Arc<dyn Transport>>,
    fallback: Option<Arc<dyn Transport>>,
    cfg: RailsConfig,
) -> Result<Arc<dyn Transport>> {
    over_placed(rails, fallback, cfg, None)
}

/// [`over`], with each region's bytes kept to the rails nearest its memory
/// when a `topology` (one place per rail) is given ([`Rails::placed`]).
pub fn over_placed(
    mut rails: Vec<Arc<dyn Transport>>,
    fallback: Option<Arc<dyn Transport>>,
    cfg: RailsConfig,
    topology: Option<topology::Topology>,
) -> Result<Arc<dyn Transport>> {
    if rails.len() == 1 && fallback.is_none() {
        if let Some(one) = rails.pop() {
            return Ok(one);
        }
    }
    let t: Arc<dyn Transport> = Rails::placed(rails, fallback, cfg, topology)?;
    Ok(t)
}
