//! Property tests of the lifecycle core on a fake clock: random operation
//! sequences against the batch ledger (rules 1 and 5) and the endpoint pool
//! (rules 2 and 4), no network, no VM.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use proptest::prelude::*;
use transport_core::lifecycle::{Acquire, BatchLedger, EndReason, EndpointId, EndpointPool, EndpointState};
use transport_core::{BatchState, Error, ErrorKind, RequestStatus};

#[derive(Debug, Clone)]
enum LedgerOp {
    Start(usize),
    Done(usize, bool),
    End(usize, u8),
    Expire(u64),
}

fn ledger_op(n: usize) -> impl Strategy<Value = LedgerOp> {
    prop_oneof![
        4 => (0..n + 1).prop_map(LedgerOp::Start),
        4 => (0..n + 1, any::<bool>()).prop_map(|(i, ok)| LedgerOp::Done(i, ok)),
        1 => (0..n + 1, 0u8..3).prop_map(|(i, r)| LedgerOp::End(i, r)),
        1 => (0u64..200).prop_map(LedgerOp::Expire),
    ]
}

fn reason(r: u8) -> EndReason {
    match r {
        0 => EndReason::Cancelled,
        1 => EndReason::TimedOut,
        _ => EndReason::Failed(Error::new(ErrorKind::ConnectionReset, "cut")),
    }
}

fn same(a: &RequestStatus, b: &RequestStatus) -> bool {
    std::mem::discriminant(a) == std::mem::discriminant(b)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Rule 5: a request is visible as terminal only when none of its units
    /// is on the wire, keeps its first terminal status, and the batch turns
    /// terminal exactly once; rule 1: the unit count returns to zero.
    #[test]
    fn ledger_terminal_is_quiet_sticky_and_once(
        units in proptest::collection::vec(1u64..4, 1..6),
        ops in proptest::collection::vec(ledger_op(6), 0..80),
    ) {
        let n = units.len();
        let mut l = BatchLedger::new(units.clone(), Some(Duration::from_millis(100)));
        let mut on_wire = vec![0u64; n];
        let mut seen: Vec<Option<RequestStatus>> = vec![None; n];
        let mut terminal_events = 0;
        let apply = |l: &mut BatchLedger, op: &LedgerOp, on_wire: &mut Vec<u64>| {
            let p = match *op {
                LedgerOp::Start(i) => {
                    let live = l.is_live(i);
                    let started = l.start(i);
                    if started {
                        prop_assert!(live, "started a request that was not live");
                        on_wire[i] += 1;
                    }
                    Default::default()
                }
                LedgerOp::Done(i, ok) => {
                    if i < n && on_wire[i] > 0 {
                        on_wire[i] -= 1;
                    }
                    let r = if ok { Ok(()) } else { Err(Error::new(ErrorKind::ConnectionReset, "x")) };
                    l.unit_done(i, r)
                }
                LedgerOp::End(i, r) => l.end(i, reason(r)),
                LedgerOp::Expire(t) => l.expire(Duration::from_millis(t)),
            };
            Ok(p)
        };
        for op in &ops {
            let p = apply(&mut l, op, &mut on_wire)?;
            terminal_events += usize::from(p.batch_terminal);
            prop_assert_eq!(l.on_wire(), on_wire.iter().sum::<u64>());
            for i in 0..n {
                prop_assert_eq!(l.on_wire_of(i), on_wire[i]);
                let now = l.request(i).cloned().unwrap_or(RequestStatus::Pending);
                if now.is_terminal() {
                    prop_assert_eq!(on_wire[i], 0, "request {} terminal with work on the wire", i);
                    prop_assert!(!l.is_live(i));
                }
                match &seen[i] {
                    Some(first) => prop_assert!(same(first, &now), "request {} changed {:?} -> {:?}", i, first, now),
                    None if now.is_terminal() => seen[i] = Some(now),
                    None => {}
                }
            }
            prop_assert_eq!(l.is_terminal(), l.status().state != BatchState::InProgress);
        }
        // Teardown: end everything, then let every unit on the wire end.
        let (_, p) = l.end_where(&EndReason::Cancelled, |_| true);
        terminal_events += usize::from(p.batch_terminal);
        for (i, w) in on_wire.iter_mut().enumerate() {
            while *w > 0 {
                *w -= 1;
                terminal_events += usize::from(l.unit_done(i, Ok(())).batch_terminal);
            }
        }
        prop_assert!(l.is_terminal());
        prop_assert_eq!(l.on_wire(), 0);
        prop_assert_eq!(terminal_events, 1, "the batch must become terminal exactly once");
        for (i, first) in seen.iter().enumerate() {
            if let (Some(first), Some(now)) = (first, l.request(i)) {
                prop_assert!(same(first, now));
            }
        }
    }
}

#[derive(Debug, Clone)]
enum PoolOp {
    Acquire(u8),
    Release,
    Break,
    Destroy,
    Reap,
    Tick(u64),
}

fn pool_op() -> impl Strategy<Value = PoolOp> {
    prop_oneof![
        5 => (0u8..6).prop_map(PoolOp::Acquire),
        3 => Just(PoolOp::Release),
        1 => Just(PoolOp::Break),
        3 => Just(PoolOp::Destroy),
        1 => Just(PoolOp::Reap),
        2 => (1u64..50).prop_map(PoolOp::Tick),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Rule 4: endpoints in any state never exceed the bound, and a slot is
    /// only freed by `destroyed`. Rule 2: a retired (broken, evicted,
    /// reaped) endpoint is never handed out again; ids are never reused.
    /// Rule 1: after teardown every count is zero.
    #[test]
    fn pool_never_exceeds_the_bound_nor_reuses_the_dead(
        max in 1usize..4,
        pick in any::<prop::sample::Index>(),
        ops in proptest::collection::vec(pool_op(), 0..120),
    ) {
        let mut p: EndpointPool<u8> = EndpointPool::new(max);
        let mut now = Duration::ZERO;
        let mut uses: Vec<EndpointId> = Vec::new();
        let mut dying: Vec<EndpointId> = Vec::new();
        let mut retired: HashSet<EndpointId> = HashSet::new();
        let mut issued: HashMap<EndpointId, u8> = HashMap::new();
        for op in &ops {
            match *op {
                PoolOp::Acquire(k) => match p.acquire(&k, now) {
                    Acquire::Use(id) => {
                        prop_assert!(!retired.contains(&id), "handed out a retired endpoint");
                        prop_assert_eq!(issued.get(&id), Some(&k));
                        uses.push(id);
                    }
                    Acquire::Build(id) => {
                        prop_assert!(!issued.contains_key(&id), "id reused");
                        issued.insert(id, k);
                        // Builds succeed in this model; a built endpoint has one user.
                        prop_assert!(p.built(id, now));
                        uses.push(id);
                    }
                    Acquire::Building(_) => prop_assert!(false, "builds finish at once in this model"),
                    Acquire::Evict(id) => {
                        prop_assert!(retired.insert(id));
                        prop_assert_eq!(p.users(id), 0, "evicted a busy endpoint");
                        dying.push(id);
                    }
                    Acquire::Full { busy, dying: d } => {
                        prop_assert_eq!(busy + d, max);
                    }
                },
                PoolOp::Release if !uses.is_empty() => {
                    let id = uses.swap_remove(pick.index(uses.len()));
                    p.release(id, now);
                }
                PoolOp::Break if !uses.is_empty() => {
                    let id = uses[pick.index(uses.len())];
                    if p.broken(id) {
                        prop_assert!(retired.insert(id));
                        dying.push(id);
                    }
                }
                PoolOp::Destroy if !dying.is_empty() => {
                    let id = dying.swap_remove(pick.index(dying.len()));
                    p.destroyed(id);
                    prop_assert_eq!(p.state(id), None);
                }
                PoolOp::Reap => {
                    for id in p.reap(now, Duration::from_millis(30)) {
                        prop_assert_eq!(p.users(id), 0, "reaped a busy endpoint");
                        prop_assert!(retired.insert(id));
                        dying.push(id);
                    }
                }
                PoolOp::Tick(ms) => now += Duration::from_millis(ms),
                _ => {}
            }
            let c = p.counts();
            prop_assert!(c.held() <= max, "{:?} over the bound {}", c, max);
            prop_assert_eq!(c.dying, dying.len());
            for id in &dying {
                prop_assert_eq!(p.state(*id), Some(EndpointState::Dying));
            }
        }
        for id in p.retire_all() {
            dying.push(id);
        }
        for id in dying.drain(..) {
            p.destroyed(id);
        }
        prop_assert_eq!(p.counts().held(), 0);
        prop_assert!(p.ids().is_empty());
    }
}
