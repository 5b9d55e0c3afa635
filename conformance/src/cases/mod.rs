//! Every case, in one list. Each names the rule of `docs/CONTRACT.md` it
//! checks.

mod backpressure;
mod bad_input;
mod config;
mod data;
mod deadline;
mod endpoints;
mod errors;
mod failure;
mod lifecycle;
mod memory;
mod notify;
mod policy;
mod poll;
mod session;

use crate::case::{Case, CaseFuture, Need};

macro_rules! case {
    ($group:ident :: $name:ident, $rule:literal, [$($need:ident),*], $summary:literal) => {
        Case {
            group: stringify!($group),
            name: stringify!($name),
            rule: $rule,
            needs: &[$(Need::$need),*],
            summary: $summary,
            run: |cx| -> CaseFuture { Box::pin($group::$name(cx)) },
        }
    };
}

static CASES: &[Case] = &[
    case!(
        data::write_lands_exact,
        5,
        [],
        "writes of 1 B to 128 KiB at odd offsets land byte-exact, nothing else changes"
    ),
    case!(data::read_lands_exact, 5, [Read], "reads land byte-exact, nothing else changes"),
    case!(
        data::random_batches_match_model,
        5,
        [],
        "proptest: random mixed batches (1 B to 3 MiB) match a model of both memories"
    ),
    case!(
        data::concurrent_batches_from_many_tasks,
        5,
        [],
        "16 tasks x 4 rounds of batches to their own slices, all exact"
    ),
    case!(
        data::terminal_state_is_sticky,
        5,
        [],
        "one terminal state per batch; poll, wait and cancel agree and never change it"
    ),
    case!(
        bad_input::local_out_of_bounds,
        9,
        [],
        "local out of bounds: OutOfBounds at submit, naming the request index"
    ),
    case!(
        bad_input::remote_out_of_bounds,
        9,
        [],
        "remote out of bounds (past the end, before the start): OutOfBounds, canaries intact"
    ),
    case!(bad_input::addr_len_overflow, 9, [], "addr + len overflow, local and remote: refused, never wrapped"),
    case!(bad_input::zero_length, 9, [], "zero-length request: InvalidRequest"),
    case!(bad_input::unknown_handles, 7, [], "unknown region and segment handles: InvalidHandle"),
    case!(bad_input::unregistered_local_region, 9, [], "a local region used after unregister: InvalidHandle"),
    case!(bad_input::empty_batch, 7, [], "empty batch: InvalidRequest, nothing counted"),
    case!(bad_input::oversized_batch, 7, [], "max_batch_len + 1 requests: InvalidRequest"),
    case!(bad_input::oversized_request, 7, [], "a request above max_request_len: refused"),
    case!(
        bad_input::refused_batch_starts_nothing,
        9,
        [],
        "one bad request refuses the batch; the valid ones move no byte"
    ),
    case!(
        memory::write_to_read_only_denied,
        9,
        [],
        "write into a remote read-only region: AccessDenied, region unchanged"
    ),
    case!(memory::read_from_write_only_denied, 9, [Read], "read from a remote write-only region: AccessDenied"),
    case!(memory::local_only_region_unreachable, 9, [], "a peer's local-only region cannot be reached"),
    case!(
        memory::overlapping_registration_refused,
        9,
        [],
        "same or overlapping registration: AlreadyRegistered; re-register after unregister works"
    ),
    case!(memory::double_unregister, 9, [], "unregister twice or an unknown id: InvalidHandle"),
    case!(
        memory::device_regions,
        9,
        [DeviceFaults],
        "device memory (a fake device that faults on host access): moved byte-exact, or refused at registration"
    ),
    case!(
        memory::slow_device_copies_stay_quiet,
        5,
        [DeviceFaults],
        "a deadline or cancel during slow device copies (either side): the target's device memory is quiet after"
    ),
    case!(
        memory::write_to_unregistered_remote_fails,
        9,
        [],
        "write into a peer region unregistered before: fails, memory untouched"
    ),
    case!(
        memory::unregister_local_in_flight,
        9,
        [Stall],
        "unregister a source in flight: request ends Unregistered, memory quiet after"
    ),
    case!(
        memory::unregister_remote_in_flight,
        9,
        [Stall],
        "peer unregisters the target in flight: its memory is quiet once the call returns"
    ),
    case!(
        lifecycle::open_close_reopen,
        3,
        [],
        "five open/transfer/close rounds: counts back to baseline, OS counts not above it"
    ),
    case!(
        lifecycle::close_releases_endpoints,
        3,
        [],
        "close destroys endpoints; the closed handle is InvalidHandle; reopen works"
    ),
    case!(lifecycle::double_close_is_an_error, 3, [], "closing twice (or an unknown handle) is InvalidHandle"),
    case!(
        lifecycle::close_with_transfers_in_flight,
        3,
        [Stall],
        "close with work in flight ends it before returning; memory quiet after"
    ),
    case!(
        lifecycle::release_frees_batches,
        1,
        [],
        "release returns the batch count; a released id is InvalidHandle everywhere"
    ),
    case!(
        lifecycle::counts_return_after_each_operation,
        1,
        [],
        "register/unregister, open/close, submit/release: counts back each time"
    ),
    case!(
        lifecycle::shutdown_with_transfers_in_flight,
        1,
        [Stall],
        "shutdown with work in flight: returns, all counts zero, later calls Shutdown"
    ),
    case!(
        lifecycle::drop_with_transfers_in_flight,
        1,
        [Stall],
        "dropping a transport with work in flight frees it (no task keeps it alive)"
    ),
    case!(
        lifecycle::no_hidden_growth,
        1,
        [Census],
        "72 open/transfer/close cycles: the process's live heap allocations (a census, not stats()) do not keep growing"
    ),
    case!(
        lifecycle::os_resources_return,
        1,
        [OsProbe],
        "OS probe (fds, kernel RDMA objects) not above baseline after three node lifetimes"
    ),
    case!(
        failure::failed_endpoint_is_freed,
        2,
        [Kill],
        "after a peer kill the broken endpoint is destroyed; no leak after restart"
    ),
    case!(
        failure::next_transfer_builds_new_endpoint,
        2,
        [Cut],
        "after a cut at most one transfer fails; the next builds a new endpoint"
    ),
    case!(
        failure::kill_restart_cycles_stay_bounded,
        4,
        [Kill],
        "field scenario: 50 kill/restart/transfer cycles, endpoints never past the bound"
    ),
    case!(failure::restart_is_noticed, 2, [Kill], "restarted peer: new generation seen, stale memory never written"),
    case!(
        endpoints::bound_never_exceeded,
        4,
        [],
        "five peers, bound two: sequential and concurrent transfers never exceed it"
    ),
    case!(endpoints::idle_endpoints_reclaimed, 4, [], "idle endpoints are destroyed on the timer"),
    case!(
        deadline::stalled_transfer_times_out,
        5,
        [Stall],
        "a stalled batch ends TimedOut within its deadline plus a margin, sticky"
    ),
    case!(
        deadline::quiet_after_timeout,
        5,
        [Stall],
        "after a timeout the batch's memory never changes (stalled and resumed)"
    ),
    case!(
        deadline::cancel_in_flight_ends,
        5,
        [Stall],
        "cancel of stalled work returns Cancelled promptly; memory quiet after"
    ),
    case!(
        deadline::timeout_beyond_the_clock_never_fires,
        5,
        [Stall],
        "a timeout past what the clock holds means never: completes, or stays in progress until cancelled"
    ),
    case!(poll::unknown_batch_ids, 6, [], "poll/wait/cancel/release of unknown or random ids: InvalidHandle, no panic"),
    case!(
        poll::release_in_progress_refused,
        6,
        [Stall],
        "release of a batch in progress: InvalidRequest, batch intact"
    ),
    case!(
        poll::polling_hint_loses_nothing,
        6,
        [],
        "answers that arrive under the polling hint, with nobody polling, are applied once it ends"
    ),
    case!(
        poll::poll_during_faults,
        6,
        [],
        "tight polling during cut, stall, cancel and kill: no panic, terminal states sticky"
    ),
    case!(errors::peer_failures_are_transient, 7, [Kill], "a killed peer gives transient peer-failure errors"),
    case!(policy::transient_failures_are_retried, 8, [], "transient failures are retried with backoff and recover"),
    case!(policy::retries_stop_at_the_limit, 8, [], "retries stop at max_attempts with the transient error"),
    case!(
        policy::permanent_errors_not_retried,
        8,
        [],
        "permanent errors (injected or from the backend) are sent exactly once"
    ),
    case!(policy::only_failed_requests_resent, 8, [], "only failed requests are resent, completed ones exactly once"),
    case!(
        policy::breaker_opens_and_recovers,
        8,
        [],
        "breaker opens at its threshold, fails fast, half-opens, closes on a good probe"
    ),
    case!(policy::breaker_is_per_peer, 8, [], "an open breaker for one peer does not block another"),
    case!(
        policy::breaker_recovers_after_peer_restart,
        8,
        [Kill],
        "real peer kill opens the breaker; after restart and cool-down a probe closes it"
    ),
    case!(
        policy::first_call_after_restart_reaches_the_peer,
        8,
        [Kill],
        "peer killed, breaker open (60 s cool-down), peer back: the first call two probe intervals later reaches it"
    ),
    case!(
        policy::prober_closes_breaker_when_peer_returns,
        8,
        [Kill],
        "peer killed, breaker open (60 s cool-down), peer back: the background prober closes the breaker within seconds"
    ),
    case!(
        policy::deadline_from_config,
        8,
        [Stall],
        "DeadlineConfig reaches the backend: stalled engine transfer times out, quiet after"
    ),
    case!(
        backpressure::full_budget_pushes_back,
        8,
        [Stall],
        "full budget: try_submit is Backpressure, submit waits and completes"
    ),
    case!(backpressure::cancel_frees_budget, 8, [Stall], "cancelling the holder frees the budget at once"),
    case!(
        config::works_behind_dyn_transport,
        10,
        [],
        "works as `Arc<dyn Transport>` under an Engine configured from JSON"
    ),
    case!(
        notify::never_overtakes_data,
        11,
        [],
        "notify_after under load: the receiver sees every byte of the batch when it sees the notification"
    ),
    case!(
        notify::per_pair_order,
        11,
        [],
        "200 notifications per sender arrive in order, byte-exact, naming the sender; also with two senders"
    ),
    case!(
        notify::failed_batch_never_notifies,
        11,
        [],
        "failed, timed-out and cancelled batches: notify_after sends nothing, the inbox stays empty"
    ),
    case!(
        notify::inbox_bounded,
        11,
        [InboxCapacity],
        "a full inbox refuses with transient Backpressure, nothing queued; draining makes room; count exact"
    ),
    case!(
        notify::oversize_refused,
        11,
        [],
        "MAX_NOTIFY_LEN + 1 bytes: InvalidRequest, nothing delivered; MAX_NOTIFY_LEN and 0 bytes arrive intact"
    ),
    case!(
        notify::counts_return_after_shutdown,
        11,
        [],
        "inbox counts return to baseline; shutdown empties it and wait_notification ends Shutdown, never hangs"
    ),
    case!(
        session::landed_on_both_sides,
        13,
        [],
        "grant of two ranges, eight layers written, finish: both Landed, every byte there when the receiver turns Landed"
    ),
    case!(
        session::no_grant_no_send,
        12,
        [],
        "no grant: write refused, no byte moves; a sender Waiting for 3 liveness timeouts does not fail, then lands"
    ),
    case!(
        session::write_outside_grant_refused,
        12,
        [],
        "writes partly or wholly outside the grant, overflowing: OutOfBounds before a byte moves; the session lands"
    ),
    case!(
        session::grant_in_parts_lands,
        12,
        [],
        "a grant of 1000 scattered ranges in descending order arrives whole and in order; a gap refused; lands"
    ),
    case!(
        session::deadline_starts_at_grant,
        12,
        [Stall],
        "a wait longer than the deadline before the grant still lands; a stall past it after the grant: both Expired"
    ),
    case!(
        session::receiver_cancels_mid_transfer,
        13,
        [],
        "the receiver cancels mid-transfer: both Cancelled; its memory quiet once its state is final"
    ),
    case!(
        session::sender_cancels,
        13,
        [],
        "the sender cancels mid-transfer, or before a grant that comes later: both Cancelled"
    ),
    case!(
        session::peer_killed,
        13,
        [Kill],
        "receiver or sender killed before the grant, mid-transfer, after finish: the survivor ends within liveness"
    ),
    case!(
        session::frozen_side,
        13,
        [],
        "one side frozen (before the grant, mid-transfer, across the finish) and resumed: landed is never contradicted"
    ),
    case!(
        session::connection_cut,
        13,
        [Cut],
        "connections cut mid-transfer: the policy's retry carries the writes, the session lands on both sides"
    ),
    case!(
        session::duplicate_and_forged_messages_ignored,
        13,
        [],
        "forged, malformed, duplicate and late session messages: ignored and counted, no state back, the session lands"
    ),
    case!(
        session::counts_return_after_teardown,
        13,
        [],
        "50 landed and 15 cancelled sessions released: session, inbox, batch and segment counts back to baseline"
    ),
];

/// Every case of the suite, in order.
pub fn cases() -> &'static [Case] {
    CASES
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn ids_are_unique_and_rules_valid() {
        let mut ids = HashSet::new();
        for c in cases() {
            assert!(ids.insert(c.id()), "duplicate case {}", c.id());
            assert!((1..=13).contains(&c.rule), "{} cites rule {}", c.id(), c.rule);
        }
    }

    #[test]
    fn every_rule_has_a_case() {
        for rule in 1..=13u8 {
            assert!(cases().iter().any(|c| c.rule == rule), "no case checks rule {rule}");
        }
    }

    #[test]
    fn the_crate_doc_table_lists_every_case() {
        let doc = include_str!("../lib.rs");
        for c in cases() {
            let needs: Vec<String> = c.needs.iter().map(|n| format!("{n:?}")).collect();
            let needs = if needs.is_empty() { "-".to_owned() } else { needs.join(", ") };
            let row = format!("| `{}` | {} | {} |", c.id(), c.rule, needs);
            assert!(doc.contains(&row), "lib.rs table lacks the row {row}");
        }
    }
}
