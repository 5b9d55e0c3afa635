//! One conformance case: its name, the rule of `docs/CONTRACT.md` it
//! checks, what it needs, and its body.

use std::fmt;
use std::future::Future;
use std::pin::Pin;

use crate::ctx::Ctx;
use crate::outcome::CaseResult;

/// A boxed case body.
pub type CaseFuture = Pin<Box<dyn Future<Output = CaseResult> + Send + 'static>>;

/// What a case needs from the harness or the backend beyond the basics.
/// Cases whose needs are not met are skipped (reported as ignored).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// `capabilities().read`.
    Read,
    /// [`crate::Harness::kill`] and [`crate::Harness::restart`].
    Kill,
    /// [`crate::Harness::cut`].
    Cut,
    /// [`crate::Harness::stall`].
    Stall,
    /// [`crate::Harness::os_probe`].
    OsProbe,
    /// [`crate::Harness::node_with_inbox`] (a node with a small
    /// notification inbox).
    InboxCapacity,
    /// A heap census ([`crate::census`]: the test binary's global
    /// allocator is [`crate::CountingAlloc`], `conformance::census_allocator!`).
    /// A case with this need runs alone in its process: no other case
    /// starts until it ends (the census counts every thread's heap).
    Census,
    /// Faults set on the process's test devices (`crate::devices`: copies
    /// that fail or take their time), which every case using those devices
    /// meanwhile would meet: a failed device read in another case's check
    /// reads zeros. Always met (the case skips itself where its devices
    /// cannot fault); a case with this need runs alone in its process, as
    /// a census does.
    DeviceFaults,
}

impl Need {
    /// Whether a case with this need runs alone in its process (no other
    /// case starts until it ends, and it starts only once the others
    /// running have ended).
    pub fn runs_alone(self) -> bool {
        matches!(self, Need::Census | Need::DeviceFaults)
    }
}

/// One conformance case.
#[derive(Clone, Copy)]
pub struct Case {
    /// Group, the middle part of the test name (`teardown`, `data`, ...).
    pub group: &'static str,
    /// Case name, the last part of the test name.
    pub name: &'static str,
    /// The rule of `docs/CONTRACT.md` (1..=13) it checks.
    pub rule: u8,
    /// Hooks and capabilities it needs (it skips without them).
    pub needs: &'static [Need],
    /// One line: what it checks.
    pub summary: &'static str,
    /// The body.
    pub run: fn(Ctx) -> CaseFuture,
}

impl Case {
    /// `group::name`.
    pub fn id(&self) -> String {
        format!("{}::{}", self.group, self.name)
    }
}

impl fmt::Debug for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Case").field("id", &self.id()).field("rule", &self.rule).finish()
    }
}
