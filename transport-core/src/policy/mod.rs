//! Rails: several transports driven as one (moving to its own crate).

mod rails;

pub use rails::{PathStatus, Rails};
