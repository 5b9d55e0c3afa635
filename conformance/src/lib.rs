//! The conformance suite every transport backend runs to prove it keeps
//! the contract of `DESIGN.md` (rules 1 to 10, stated on
//! [`transport_core::Transport`]).
//!
//! TABLE_PLACEHOLDER
#![deny(unsafe_code)]

mod cases;
mod ctx;
mod faults;
mod guard;
mod harness;
mod runner;

pub use cases::cases;
pub use ctx::{
    batch_error, bounded, complete, expect_kind, expect_permanent, expect_quiet, expect_stats, open, permanent_kind,
    run_batch, settle, Ctx, Pair, SETTLE, WAIT_LIMIT,
};
pub use faults::{FaultLayer, Target};
pub use guard::{pattern, Guarded, CANARY, GUARD};
pub use harness::{Harness, Node, NodeOptions};
pub use runner::{
    main_with, run_case, run_case_with, strict, trials, Case, CaseError, CaseFuture, CaseResult, Outcome, CASE_TIMEOUT,
    STRICT_ENV,
};
