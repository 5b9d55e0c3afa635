//! Deliberately broken behaviours, for tests only.
//!
//! Each switch is a real code path in the mock, used to prove that the
//! conformance suite fails a backend that has it. They are not part of the
//! serde [`crate::MockConfig`] (a config file can never switch one on);
//! tests reach them through the `bugs` cargo feature and
//! `MockTransport::with_bugs`.

/// The broken behaviours; all `false` by default (a correct mock).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MockBugs {
    /// A broken endpoint is taken out of use but never reported destroyed
    /// to the endpoint pool: its slot stays held and counted against
    /// `max_endpoints` (so enough failures end in "Failed to create QP:
    /// Cannot allocate memory"). Breaks rule 2.
    pub leak_endpoint_on_failure: bool,
    /// A broken endpoint is never reported broken to the pool: it stays
    /// cached and is reused, so every later transfer to the peer fails
    /// again (the field's "blacklisted peer"). Breaks rule 2.
    pub cache_broken_endpoint: bool,
    /// Cancel and deadlines report `Cancelled`/`TimedOut` at once, but the
    /// pending copy still runs later (e.g. when a stall ends), outside the
    /// batch ledger. Breaks rule 5.
    pub write_after_timeout: bool,
    /// `close_segment` returns `Ok` but keeps the handle and its endpoint.
    /// Breaks rule 3.
    pub noop_close_segment: bool,
    /// `notify_after` sends the attached notification as soon as it is
    /// called, while the batch's bytes are still being copied. Breaks
    /// rule 11.
    pub notify_before_landing: bool,
    /// `register` takes device regions for host memory (their provider
    /// forgotten), so the copies touch device memory directly: on a fake
    /// device the first one kills the process. Breaks rule 9 (memory
    /// kinds).
    pub forget_device_memory: bool,
    /// A request is reported `Completed` as its copy starts, and its bytes
    /// land [`LATE_LANDING`] later, on a thread of their own. Breaks rule 5
    /// (terminal means quiet: the memory is written after the state).
    pub complete_before_landing: bool,
}

/// How late the bytes of a request land under
/// [`MockBugs::complete_before_landing`].
pub const LATE_LANDING: std::time::Duration = std::time::Duration::from_millis(500);
