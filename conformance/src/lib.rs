//! The conformance suite every transport backend runs to prove it keeps
//! the contract: rules 1 to 13 of `docs/CONTRACT.md`, shown on
//! [`transport_core::Transport`]. Rules 12 and 13 (sessions: admission is
//! the receiver's; both ends agree) are checked through
//! `kvmove_policy::Sessions` running over an `Engine` on the backend.
//!
//! # Running it against a backend: one line
//!
//! Implement [`Harness`] for the backend (make nodes; kill, restart, cut
//! and stall them where the backend can; an OS resource probe if there is
//! one; a node with a small notification inbox,
//! [`Harness::node_with_inbox`], if its capacity can be configured), then
//! add a test target with `harness = false`:
//!
//! ```toml
//! [[test]]
//! name = "conformance"
//! harness = false
//! ```
//!
//! ```ignore
//! // tests/conformance.rs
//! conformance::conformance_main!(|| TcpHarness::new());
//! ```
//!
//! `cargo test` (or `cargo nextest run`) then runs one test per case, named
//! `<backend>::<group>::<case>` (e.g. `tcp::lifecycle::close_releases_endpoints`),
//! with the usual filters, `--exact` and `--list`. Each case runs in its own
//! multi-thread tokio runtime with a timeout ([`case_timeout`]); a panic, a
//! hang or a broken rule fails it, and the message starts with the rule.
//!
//! A case the backend cannot run (a fault hook returns `Ok(false)`, no
//! [`Harness::os_probe`], `capabilities().read == false`, ...) is reported
//! as **ignored** with the reason, never as passed; with
//! `CONFORMANCE_STRICT=1` ([`STRICT_ENV`]) those skips fail instead. Each
//! case lists what it [`Need`]s; under nextest, which cannot see a skip
//! decided at run time, the runner first [`probe`]s the harness (a
//! throw-away node: `stall(false)`, `cut`, `kill`, `capabilities().read`,
//! `os_probe`, `node_with_inbox`) and marks the cases whose needs are unmet as ignored up
//! front, so they show as skipped there too.
//!
//! Failure messages say when: a wait that hangs names the hang limit
//! ([`wait_limit`]: 20 s, or `CONFORMANCE_WAIT_S` seconds, to iterate
//! faster on a transport that hangs), when in the case it began, the
//! deadline the batch was submitted with and what `poll` said of it then;
//! a byte that differs after a terminal state names how long before the
//! check the batch was reported terminal and whether the bytes became
//! right later (and when): a backend that reports `Completed` before its
//! bytes land reads as that, not as a wrong offset.
//!
//! [`run_case`] runs one case programmatically (this is how the tests of
//! [`broken`] prove the suite fails broken transports), and [`cases`]
//! enumerates them all.
//!
//! # Layers
//!
//! [`Harness::wrap`] puts a layer around every transport a harness gives
//! the suite: `mock_faulty` runs the whole suite through
//! `transport_mock::FaultyTransport` with no faults planned, and
//! [`broken::BrokenLayer`] is a deliberately broken layer. The policy
//! cases put their own `FaultyTransport` *below* that wrapper (see
//! [`Ctx::node_layered`]), so its counts see every request a wrapper
//! resends.
//!
//! # Device memory
//!
//! Every case runs on host memory; the data, deadline, lifecycle, failure,
//! poll and session cases run again with their guarded memory on fake
//! devices (`transport_mem::FakeDevice`: the host cannot touch it, every
//! access is a provider copy), named `device_d2d::`, `device_h2d::` and
//! `device_d2h::` by where the initiator's and the target's memory lives
//! ([`MemoryMode`], [`runs`]): the data cases in all three modes, the
//! others in one each, in turn. A backend without
//! `capabilities().device_memory` has them skipped, with the reason
//! (`memory::device_regions` checks that it refuses device memory); one
//! without `device_memory_remote` has the modes with the target's memory on
//! a device skipped (d2d, h2d) and runs the d2h ones.
//!
//! # The suite can fail
//!
//! `tests/broken.rs` runs it against deliberately broken transports and
//! asserts that the matching case fails while the correct mock passes it:
//!
//! | broken transport | caught by |
//! | --- | --- |
//! | mock, `leak_endpoint_on_failure` | `failure::failed_endpoint_is_freed` |
//! | mock, `cache_broken_endpoint` | `failure::next_transfer_builds_new_endpoint` |
//! | mock, `write_after_timeout` | `deadline::quiet_after_timeout` |
//! | mock, `noop_close_segment` | `lifecycle::close_releases_endpoints` |
//! | [`broken::BrokenLayer`] `RetriesPermanent` around the mock | `policy::permanent_errors_not_retried` |
//! | mock with 2 ms latency, `notify_before_landing` | `notify::never_overtakes_data` |
//! | [`broken::BrokenLayer`] `DropsFailureNotices` around the mock | `session::receiver_cancels_mid_transfer`, `session::sender_cancels` |
//! | mock, `complete_before_landing` (bytes land 500 ms after `Completed`) | `data::write_lands_exact`, the message saying the bytes became right after the check |
//! | the mock with a `kill` that kills nothing (`tests/broken.rs`) | every case that kills a node, at the kill: the message names `Harness::kill` and what it must do |
//! | mock, `forget_device_memory` (device regions taken for host memory) | `device_d2d::data::write_lands_exact`: the process dies of SIGSEGV on the fake device's memory, so the test runs it in a child |
//!
//! # The cases
//!
//! Every rule of the contract has at least one case; the rule numbers are
//! those of `docs/CONTRACT.md` (shown on [`transport_core::Transport`]).
//!
//! | case | rule | needs | checks |
//! | --- | --- | --- | --- |
//! | `data::write_lands_exact` | 5 | - | writes of 1 B to 128 KiB at odd offsets land byte-exact, nothing else changes |
//! | `data::read_lands_exact` | 5 | Read | reads land byte-exact, nothing else changes |
//! | `data::random_batches_match_model` | 5 | - | proptest: random mixed batches (1 B to 3 MiB) match a model of both memories |
//! | `data::concurrent_batches_from_many_tasks` | 5 | - | 16 tasks x 4 rounds of batches to their own slices, all exact |
//! | `data::terminal_state_is_sticky` | 5 | - | one terminal state per batch; poll, wait and cancel agree and never change it |
//! | `bad_input::local_out_of_bounds` | 9 | - | local out of bounds: OutOfBounds at submit, naming the request index |
//! | `bad_input::remote_out_of_bounds` | 9 | - | remote out of bounds (past the end, before the start): OutOfBounds, canaries intact |
//! | `bad_input::addr_len_overflow` | 9 | - | addr + len overflow, local and remote: refused, never wrapped |
//! | `bad_input::zero_length` | 9 | - | zero-length request: InvalidRequest |
//! | `bad_input::unknown_handles` | 7 | - | unknown region and segment handles: InvalidHandle |
//! | `bad_input::unregistered_local_region` | 9 | - | a local region used after unregister: InvalidHandle |
//! | `bad_input::empty_batch` | 7 | - | empty batch: InvalidRequest, nothing counted |
//! | `bad_input::oversized_batch` | 7 | - | max_batch_len + 1 requests: InvalidRequest |
//! | `bad_input::oversized_request` | 7 | - | a request above max_request_len: refused |
//! | `bad_input::refused_batch_starts_nothing` | 9 | - | one bad request refuses the batch; the valid ones move no byte |
//! | `memory::write_to_read_only_denied` | 9 | - | write into a remote read-only region: AccessDenied, region unchanged |
//! | `memory::read_from_write_only_denied` | 9 | Read | read from a remote write-only region: AccessDenied |
//! | `memory::local_only_region_unreachable` | 9 | - | a peer's local-only region cannot be reached |
//! | `memory::overlapping_registration_refused` | 9 | - | same or overlapping registration: AlreadyRegistered; re-register after unregister works |
//! | `memory::double_unregister` | 9 | - | unregister twice or an unknown id: InvalidHandle |
//! | `memory::device_regions` | 9 | DeviceFaults | device regions on a fake device whose memory faults on any host access: a backend without `capabilities().device_memory` refuses them at registration (`Unsupported`), one without `device_memory_remote` refuses them with remote access and is checked device to host only (writes, reads, a failed initiator copy); otherwise host to device, device to device and device to host writes and reads land byte-exact (read back through the provider), and a failed device copy on either side is a transient error after which the next write works |
//! | `memory::slow_device_copies_stay_quiet` | 5 | DeviceFaults | device copies slowed to 15 ms each, on the target's side (where peers may reach device memory) and on the initiator's: a deadline (45 ms) or a cancel (after 40 ms) that lands while they run ends the batch, and from its terminal report on no byte of the target's device memory changes (no copy still running into it) |
//! | `memory::write_to_unregistered_remote_fails` | 9 | - | write into a peer region unregistered before: fails, memory untouched |
//! | `memory::unregister_local_in_flight` | 9 | Stall | unregister a source in flight: request ends Unregistered, memory quiet after |
//! | `memory::unregister_remote_in_flight` | 9 | Stall | peer unregisters the target in flight: its memory is quiet once the call returns |
//! | `lifecycle::open_close_reopen` | 3 | - | five open/transfer/close rounds: counts back to baseline, OS counts not above it |
//! | `lifecycle::close_releases_endpoints` | 3 | - | close destroys endpoints; the closed handle is InvalidHandle; reopen works |
//! | `lifecycle::double_close_is_an_error` | 3 | - | closing twice (or an unknown handle) is InvalidHandle |
//! | `lifecycle::close_with_transfers_in_flight` | 3 | Stall | close with work in flight ends it before returning; memory quiet after |
//! | `lifecycle::release_frees_batches` | 1 | - | release returns the batch count; a released id is InvalidHandle everywhere |
//! | `lifecycle::counts_return_after_each_operation` | 1 | - | register/unregister, open/close, submit/release: counts back each time |
//! | `lifecycle::shutdown_with_transfers_in_flight` | 1 | Stall | shutdown with work in flight: returns, all counts zero, later calls Shutdown |
//! | `lifecycle::drop_with_transfers_in_flight` | 1 | Stall | dropping a transport with work in flight frees it (no task keeps it alive) |
//! | `lifecycle::no_hidden_growth` | 1 | Census | open/transfer/close a segment 8 times, then twice 32 more: the process's live heap allocations (a counting global allocator, the case alone in the process) grew by at most 8 in one of the two rounds, while `stats()` is back at its baseline: nothing kept per closed segment that the backend does not count |
//! | `lifecycle::os_resources_return` | 1 | OsProbe | OS probe (fds, kernel RDMA objects) not above baseline after three node lifetimes |
//! | `failure::failed_endpoint_is_freed` | 2 | Kill | after a peer kill the broken endpoint is destroyed; no leak after restart |
//! | `failure::next_transfer_builds_new_endpoint` | 2 | Cut | after a cut at most one transfer fails; the next builds a new endpoint |
//! | `failure::kill_restart_cycles_stay_bounded` | 4 | Kill | field scenario: 50 kill/restart/transfer cycles, endpoints never past the bound |
//! | `failure::restart_is_noticed` | 2 | Kill | restarted peer: new generation seen, stale memory never written |
//! | `endpoints::bound_never_exceeded` | 4 | - | five peers, bound two: sequential and concurrent transfers never exceed it |
//! | `endpoints::idle_endpoints_reclaimed` | 4 | - | idle endpoints are destroyed on the timer |
//! | `deadline::stalled_transfer_times_out` | 5 | Stall | a stalled batch ends TimedOut within its deadline plus a margin, sticky |
//! | `deadline::quiet_after_timeout` | 5 | Stall | after a timeout the batch's memory never changes (stalled and resumed) |
//! | `deadline::cancel_in_flight_ends` | 5 | Stall | cancel of stalled work returns Cancelled promptly; memory quiet after |
//! | `deadline::timeout_beyond_the_clock_never_fires` | 5 | Stall | a timeout past what the clock holds means never: completes, or stays in progress until cancelled |
//! | `poll::unknown_batch_ids` | 6 | - | poll/wait/cancel/release of unknown or random ids: InvalidHandle, no panic |
//! | `poll::release_in_progress_refused` | 6 | Stall | release of a batch in progress: InvalidRequest, batch intact |
//! | `poll::polling_hint_loses_nothing` | 6 | - | answers that arrive under the polling hint, with nobody polling, are applied once it ends |
//! | `poll::poll_during_faults` | 6 | - | tight polling during cut, stall, cancel and kill: no panic, terminal states sticky |
//! | `errors::peer_failures_are_transient` | 7 | Kill | a killed peer gives transient peer-failure errors |
//! | `policy::transient_failures_are_retried` | 8 | - | transient failures are retried with backoff and recover |
//! | `policy::retries_stop_at_the_limit` | 8 | - | retries stop at max_attempts with the transient error |
//! | `policy::permanent_errors_not_retried` | 8 | - | permanent errors (injected or from the backend) are sent exactly once |
//! | `policy::only_failed_requests_resent` | 8 | - | only failed requests are resent, completed ones exactly once |
//! | `policy::breaker_opens_and_recovers` | 8 | - | breaker opens at its threshold, fails fast, half-opens, closes on a good probe |
//! | `policy::breaker_is_per_peer` | 8 | - | an open breaker for one peer does not block another |
//! | `policy::breaker_recovers_after_peer_restart` | 8 | Kill | real peer kill opens the breaker; after restart and cool-down a probe closes it |
//! | `policy::first_call_after_restart_reaches_the_peer` | 8 | Kill | peer killed, breaker open (60 s cool-down): a burst of calls fails fast but one per probe interval (1 ms for a refusing host); peer back: the first call two intervals later reaches it |
//! | `policy::prober_closes_breaker_when_peer_returns` | 8 | Kill | peer killed, breaker open (60 s cool-down), peer back: the background prober closes the breaker within seconds |
//! | `policy::deadline_from_config` | 8 | Stall | DeadlineConfig reaches the backend: stalled engine transfer times out, quiet after |
//! | `backpressure::full_budget_pushes_back` | 8 | Stall | full budget: try_submit is Backpressure, submit waits and completes |
//! | `backpressure::cancel_frees_budget` | 8 | Stall | cancelling the holder frees the budget at once |
//! | `config::works_behind_dyn_transport` | 10 | - | works as `Arc<dyn Transport>` under an Engine configured from JSON |
//! | `notify::never_overtakes_data` | 11 | - | 4 rounds of a 64 x 256 KiB + 192 small-write batch with `notify_after`, under background load: when the receiver sees the notification, every byte of the batch is in its memory |
//! | `notify::per_pair_order` | 11 | - | 200 sequential notifications arrive in order, byte-exact, `from` the sender; with two senders at once each one's order holds |
//! | `notify::failed_batch_never_notifies` | 11 | - | a failed (unregistered peer region), timed-out or cancelled (stalled) batch: `notify_after` gives its status and `None`, the receiver gets nothing; a completed one notifies |
//! | `notify::inbox_bounded` | 11 | InboxCapacity | inbox of 8 not drained: 8 accepted, then transient Backpressure and nothing queued; taking one makes room for one; `stats().notifications` exact, back to 0 |
//! | `notify::oversize_refused` | 11 | - | `MAX_NOTIFY_LEN + 1` bytes: InvalidRequest from `notify` and `notify_after`, nothing delivered; `MAX_NOTIFY_LEN` and 0 bytes arrive intact |
//! | `notify::counts_return_after_shutdown` | 11 | - | inbox counts return to baseline; shutdown empties it, wakes a pending `wait_notification` with Shutdown; later calls Shutdown; notify to the shut-down peer transient |
//! | `session::landed_on_both_sides` | 13 | - | a grant of two ranges, eight layers of 256 KiB (one `write` each, distinct bytes), finish: both sides Landed; the moment the receiver's state turns Landed every byte is in its memory (gaps, canaries unchanged); states only move forward; session counts and inboxes back to baseline after release |
//! | `session::no_grant_no_send` | 12 | - | without a grant (no session, or one Waiting) `write` is refused with a permanent error and no byte of the receiver changes; a sender Waiting for a live receiver stays Waiting for three liveness timeouts, then gets the grant and lands |
//! | `session::write_outside_grant_refused` | 12 | - | writes starting before, ending past, bridging the gap of, wholly outside the grant, past the receiver's memory, with `addr + len` overflowing, and a batch with one bad request: permanent OutOfBounds (naming the request) before a byte moves; the session stays open and lands |
//! | `session::grant_in_parts_lands` | 12 | - | a grant of 1000 ranges of 512 bytes with gaps, in descending address order (four notifications' worth: it travels in parts): the sender's grant equals the receiver's, in order; a write into a gap is OutOfBounds before a byte moves; written in four calls and finished: both Landed, every byte where granted, gaps unchanged |
//! | `session::deadline_starts_at_grant` | 12 | Stall | a sender that waited longer than the deadline (3 s) before the grant still lands after it; traffic to the receiver stalled right after a 200 ms grant for 450 ms (under the liveness timeout): both sides Expired, memory quiet after |
//! | `session::receiver_cancels_mid_transfer` | 13 | - | the receiver cancels while the sender rewrites a 2 MiB grant: both sides Cancelled (bounded); from the moment the receiver's state is final no byte of its memory changes |
//! | `session::sender_cancels` | 13 | - | the sender cancels mid-transfer: both Cancelled, receiver memory quiet after; a sender cancelled before any grant: a later grant ends Cancelled on the receiver too, the sender's state unchanged |
//! | `session::peer_killed` | 13 | Kill | receiver killed before the grant or mid-transfer, sender killed mid-transfer: the survivor ends Failed (transient) within the liveness timeout + 1 s; sender killed right after finish: the receiver ends Landed with every byte or Failed, never Landed on one side only |
//! | `session::frozen_side` | 13 | - | one side's session engine frozen (`Sessions::hold`: no tick, no read, no send) and resumed: the receiver across the finish past the liveness timeout (the sender ends `outcome_unknown`, the receiver asks before landing and fails), briefly (both Landed, every byte); the sender as the answer comes (both Landed); the sender mid-transfer (the receiver fails on the silence, the resumed sender asks before writing: nothing more reaches the receiver's memory); the receiver before its grant and the sender while its grant came (both failed, nothing written) |
//! | `session::connection_cut` | 13 | Cut | connections toward the receiver (twice) and the sender (once) cut as layer writes start (sixteen of them), the next layer only once the cut is over: every write completes through the policy's retry, no side gives the session up (each cut is shorter than the liveness timeout), both sides Landed, every byte |
//! | `session::duplicate_and_forged_messages_ignored` | 13 | - | a third node sends forged (invalid grants, END/FINISH/CANCEL/REFUSE/QUIET for the victims' ids, any epoch) and malformed session messages before the grant, mid-transfer and after landing; the peers replay duplicates and late messages with their true epochs: nothing crashes, no state moves back, `counts().ignored` grows, plain notifications still arrive, the session and a later one land |
//! | `session::counts_return_after_teardown` | 13 | - | 50 concurrent sessions landed and 15 cancelled (sender before the grant, receiver after it, sender mid-way), all released: no open or lingering session or tracked peer, transport batches, in-flight and notifications at baseline; after `Sessions::shutdown` segments too (session messages the peer sent after it, left in the inbox, taken first) |
#![forbid(unsafe_code)]

pub mod broken;
mod case;
mod cases;
mod ctx;
pub mod devices;
mod guard;
mod harness;
#[cfg(feature = "self-test")]
pub mod mock;
mod outcome;
mod runner;
mod timeline;

pub use case::{Case, CaseFuture, Need};
pub use cases::cases;
pub use ctx::{
    batch_error, bounded, complete, complete_retrying, expect_kind, expect_permanent, expect_quiet, expect_stats, open,
    permanent_kind, run_batch, settle, wait_batch, Ctx, MemoryMode, Pair, SETTLE, WAIT_LIMIT,
};
pub use guard::{pattern, Guarded, CANARY, GUARD, LATE_WINDOW};
pub use harness::{Harness, Node, NodeOptions};
pub use libtest_mimic::{Arguments, Trial};
pub use outcome::{CaseError, CaseResult};
pub use runner::{
    case_timeout, main_with, probe, run_case, run_case_with, run_id, run_trials, runs, strict, trials, Outcome,
    Support, CASE_TIMEOUT, STRICT_ENV,
};
pub use timeline::{wait_limit, WAIT_ENV};
pub use transport_mem::{census, Census, CountingAlloc};
