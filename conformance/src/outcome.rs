//! What a case body returns: passed, or why not ([`CaseError`]: a broken
//! rule, or a skip). A leaf module: the context, the guards and the runner
//! all use it.

use std::fmt;

/// Why a case did not pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CaseError {
    /// The backend broke the rule; the message says how.
    Fail(String),
    /// The case cannot run against this backend (capability or fault hook
    /// missing); reported as ignored, never as passed.
    Skip(String),
}

impl fmt::Display for CaseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CaseError::Fail(m) => write!(f, "{m}"),
            CaseError::Skip(m) => write!(f, "skipped: {m}"),
        }
    }
}

impl From<String> for CaseError {
    fn from(m: String) -> Self {
        CaseError::Fail(m)
    }
}

impl From<&str> for CaseError {
    fn from(m: &str) -> Self {
        CaseError::Fail(m.to_owned())
    }
}

impl From<transport_core::Error> for CaseError {
    fn from(e: transport_core::Error) -> Self {
        CaseError::Fail(format!("unexpected error: {e}"))
    }
}

/// What a case body returns.
pub type CaseResult = Result<(), CaseError>;
