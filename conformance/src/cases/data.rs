//! Data lands byte-exact (rule 5: `Completed` means every byte is in place).

use std::sync::Arc;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};
use transport_core::{BatchState, Opcode, SubmitOptions, TransferRequest};

use crate::ctx::{bounded, complete, wait_batch, Ctx, Pair};
use crate::ensure;
use crate::guard::pattern;
use crate::outcome::{CaseError, CaseResult};

/// What both regions of a [`Pair`] should hold.
pub(crate) struct Model {
    local: Vec<u8>,
    remote: Vec<u8>,
}

impl Model {
    pub(crate) fn of(p: &Pair) -> Self {
        Self { local: p.local.snapshot(), remote: p.remote.snapshot() }
    }

    pub(crate) fn apply(&mut self, p: &Pair, r: &TransferRequest) {
        let l = r.local_offset as usize;
        let m = (r.remote_addr - p.remote.addr()) as usize;
        let n = r.len as usize;
        match r.op {
            Opcode::Write => self.remote[m..m + n].copy_from_slice(&self.local[l..l + n]),
            Opcode::Read => self.local[l..l + n].copy_from_slice(&self.remote[m..m + n]),
        }
    }

    pub(crate) fn check(&self, p: &Pair, what: &str) -> CaseResult {
        p.local.expect(&self.local, &format!("{what}: local region"))?;
        p.remote.expect(&self.remote, &format!("{what}: remote region"))
    }
}

fn need_read(p: &Pair) -> CaseResult {
    if p.t().capabilities().read {
        Ok(())
    } else {
        Err(CaseError::Skip("the backend does not support reads (capabilities().read == false)".into()))
    }
}

/// Writes of several sizes and offsets land exactly; nothing else changes.
pub async fn write_lands_exact(cx: Ctx) -> CaseResult {
    let p = cx.pair(256 << 10).await?;
    let reqs = vec![
        p.write(0, 0, 1),
        p.write(100, 4096, 4096),
        p.write(10_000, 20_003, 30_001),
        p.write(65_536, 131_072, 131_072),
    ];
    let mut model = Model::of(&p);
    for r in &reqs {
        model.apply(&p, r);
    }
    complete(p.t(), reqs).await?;
    model.check(&p, "after writes")
}

/// Reads of several sizes and offsets land exactly; nothing else changes.
pub async fn read_lands_exact(cx: Ctx) -> CaseResult {
    let p = cx.pair(256 << 10).await?;
    need_read(&p)?;
    let reqs = vec![
        p.read(0, 0, 1),
        p.read(100, 4096, 4096),
        p.read(10_000, 20_003, 30_001),
        p.read(65_536, 131_072, 131_072),
    ];
    let mut model = Model::of(&p);
    for r in &reqs {
        model.apply(&p, r);
    }
    complete(p.t(), reqs).await?;
    model.check(&p, "after reads")
}

/// One random batch: (is_write, len, source seed, gap before destination).
type Plan = Vec<(bool, u64, u64, u64)>;

fn plan_strategy() -> impl Strategy<Value = Plan> {
    let len = prop_oneof![3 => 1u64..=64, 3 => 65u64..=8192, 1 => 8193u64..=(3 << 20)];
    proptest::collection::vec((any::<bool>(), len, any::<u64>(), 0u64..=300), 1..48)
}

/// Turns a plan into requests: writes go from `local[0..H]` to
/// `remote[0..H]`, reads from `remote[H..N]` to `local[H..N]`, destinations
/// never overlap, so the result is independent of request order.
fn requests(p: &Pair, plan: &Plan, read: bool) -> Vec<TransferRequest> {
    let n = p.local.len() as u64;
    let h = n / 2;
    let (mut wcur, mut rcur) = (0u64, h);
    let mut out = Vec::new();
    for &(is_write, len, seed, gap) in plan {
        let is_write = is_write || !read;
        let len = len.min(h);
        let src = seed % (h - len + 1);
        if is_write {
            let dst = wcur + gap;
            if dst + len > h {
                continue;
            }
            wcur = dst + len;
            out.push(p.write(src, dst, len));
        } else {
            let dst = rcur + gap;
            if dst + len > n {
                continue;
            }
            rcur = dst + len;
            out.push(p.read(dst, h + src, len));
        }
    }
    if out.is_empty() {
        out.push(p.write(0, 0, 1));
    }
    out
}

async fn check_plan(p: &Pair, plan: &Plan, read: bool) -> CaseResult {
    let reqs = requests(p, plan, read);
    let before = Model::of(p);
    let mut model = Model::of(p);
    for r in &reqs {
        model.apply(p, r);
    }
    let start = Instant::now();
    complete(p.t(), reqs.clone()).await?;
    if start.elapsed() > Duration::from_secs(5) {
        let bytes: u64 = reqs.iter().map(|r| r.len).sum();
        eprintln!("random batch of {} requests ({bytes} bytes) took {:?}", reqs.len(), start.elapsed());
    }
    model.check(p, "after a random batch").map_err(|e| explain(p, &before, &model, &reqs, e))
}

/// Adds to a mismatch what helps find its cause: the wrong bytes' extent,
/// the request whose destination holds the first one, and where in the
/// expected source the bytes found there come from (a misplaced or stale
/// transfer shows as an offset).
fn explain(p: &Pair, before: &Model, model: &Model, reqs: &[TransferRequest], e: CaseError) -> CaseError {
    let CaseError::Fail(msg) = e else { return e };
    let mut out = msg;
    let sides = [
        ("local", p.local.snapshot(), &model.local, &before.local),
        ("remote", p.remote.snapshot(), &model.remote, &before.remote),
    ];
    for (side, now, want, old) in sides {
        let bad: Vec<usize> =
            now.iter().zip(want.iter()).enumerate().filter(|(_, (a, b))| a != b).map(|(i, _)| i).collect();
        let (Some(&first), Some(&last)) = (bad.first(), bad.last()) else { continue };
        let unchanged = bad.iter().filter(|&&i| now[i] == old[i]).count();
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for &i in &bad {
            match runs.last_mut() {
                Some(r) if i <= r.1 + 64 => r.1 = i,
                _ => runs.push((i, i)),
            }
        }
        let shown: Vec<String> = runs.iter().take(8).map(|(a, b)| format!("{a}..={b}")).collect();
        out += &format!("; {side}: wrong runs {} of {}", shown.join(" "), runs.len());
        out += &format!(
            "; {side}: {} bytes differ in {first}..={last} ({unchanged} of them still hold what was there before the batch)",
            bad.len()
        );
        // (source offset, destination offset) of a request in its regions.
        let ends = |r: &TransferRequest| {
            let remote = r.remote_addr - p.remote.addr();
            if r.op == Opcode::Read {
                (remote, r.local_offset)
            } else {
                (r.local_offset, remote)
            }
        };
        let covering = reqs.iter().enumerate().find(|(_, r)| {
            let dst = ends(r).1;
            (r.op == Opcode::Read) == (side == "local") && (dst..dst + r.len).contains(&(first as u64))
        });
        if let Some((i, r)) = covering {
            let (src, dst) = ends(r);
            out += &format!(
                " (request {i} of {}: {:?} of {} bytes, source offset {src}, destination offset {dst}; the first wrong \
                 byte is {} bytes in)",
                reqs.len(),
                r.op,
                r.len,
                first as u64 - dst
            );
        }
        // Where the 32 bytes found there occur in the source memory.
        let probe = &now[first..(first + 32).min(now.len())];
        let source = if side == "local" { &model.remote } else { &model.local };
        if probe.len() == 32 {
            if let Some(at) = source.windows(32).position(|w| w == probe) {
                out += &format!("; the bytes found there are the source's at offset {at}");
            } else if let Some(at) = want.windows(32).position(|w| w == probe) {
                out += &format!("; the bytes found there are this region's expected bytes at offset {at}");
            }
        }
    }
    // Proptest reports the smallest failing batch after shrinking, when
    // later batches may see leftovers of the first failure: print each.
    eprintln!("random batch: {out}");
    CaseError::Fail(out)
}

/// Proptest: random batches of 1 B to 3 MiB requests at random offsets,
/// reads and writes mixed, checked against a model of both memories
/// (deterministic seed, 12 cases, shrinking on failure).
pub async fn random_batches_match_model(cx: Ctx) -> CaseResult {
    let p = Arc::new(cx.pair(8 << 20).await?);
    let read = p.t().capabilities().read;
    let handle = tokio::runtime::Handle::current();
    let pp = p.clone();
    let result = tokio::task::spawn_blocking(move || {
        // Shrinking is bounded in time too, so a failure is reported
        // within the case's bound rather than cut off by it.
        let config = Config {
            cases: 12,
            failure_persistence: None,
            max_shrink_iters: 64,
            max_shrink_time: 30_000,
            ..Config::default()
        };
        let mut runner = TestRunner::new_with_rng(config, TestRng::deterministic_rng(RngAlgorithm::ChaCha));
        runner
            .run(&plan_strategy(), |plan| {
                handle.block_on(check_plan(&pp, &plan, read)).map_err(|e| {
                    // Shown as it happens: shrinking may run past the
                    // case's bound and hide the first failure.
                    eprintln!("random batch of {} requests failed: {e}", plan.len());
                    TestCaseError::fail(e.to_string())
                })
            })
            .map_err(|e| e.to_string())
    })
    .await
    .map_err(|e| CaseError::Fail(format!("proptest task failed: {e}")))?;
    result.map_err(|e| CaseError::Fail(format!("random batch differs from the model: {e}")))
}

/// Sixteen tasks each push and pull their own slices concurrently, in
/// batches of four requests, four rounds; every slice ends exact.
pub async fn concurrent_batches_from_many_tasks(cx: Ctx) -> CaseResult {
    const TASKS: u64 = 16;
    const SLICE: u64 = 64 << 10;
    let p = Arc::new(cx.pair((2 * TASKS * SLICE) as usize).await?);
    let read = p.t().capabilities().read;
    let mut tasks = Vec::new();
    for i in 0..TASKS {
        let p = p.clone();
        tasks.push(tokio::spawn(async move {
            for round in 0..4u64 {
                let data = pattern(100 + i * 10 + round, SLICE as usize);
                p.local.write((i * SLICE) as usize, &data)?;
                let q = SLICE / 4;
                let writes = (0..4).map(|k| p.write(i * SLICE + k * q, i * SLICE + k * q, q)).collect();
                complete(p.t(), writes).await?;
                let mut got = vec![0u8; SLICE as usize];
                if read {
                    let back = (TASKS + i) * SLICE;
                    let reads = (0..4).map(|k| p.read(back + k * q, i * SLICE + k * q, q)).collect();
                    complete(p.t(), reads).await?;
                    got = p.local.snapshot()[back as usize..(back + SLICE) as usize].to_vec();
                } else {
                    got.copy_from_slice(&p.remote.snapshot()[(i * SLICE) as usize..((i + 1) * SLICE) as usize]);
                }
                ensure!(got == data, "task {i} round {round}: the slice came back different");
            }
            Ok::<(), CaseError>(())
        }));
    }
    for t in tasks {
        bounded("a concurrent task", t).await?.map_err(|e| CaseError::Fail(format!("task panicked: {e}")))??;
    }
    p.canaries_intact()
}

/// Polling a batch to its end: exactly one terminal state, then sticky.
pub async fn terminal_state_is_sticky(cx: Ctx) -> CaseResult {
    let p = cx.pair(1 << 20).await?;
    let t = p.t().clone();
    let b = t.submit(vec![p.write(0, 0, 1 << 20), p.write(0, 0, 1)], SubmitOptions::default()).await?;
    let end = Instant::now() + Duration::from_secs(20);
    let first = loop {
        let s = t.poll(b)?;
        if s.is_terminal() {
            break s;
        }
        ensure!(Instant::now() < end, "batch still {:?} after 20 s", s.state);
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    ensure!(first.state == BatchState::Completed, "batch ended {:?}", first.state);
    for _ in 0..50 {
        let s = t.poll(b)?;
        ensure!(
            s.state == first.state && s.completed() == first.completed(),
            "terminal state changed to {:?}",
            s.state
        );
    }
    let w = wait_batch(t.as_ref(), b, None, "wait").await??;
    ensure!(w.state == first.state, "wait after terminal says {:?}", w.state);
    let c = bounded("cancel", t.cancel(b)).await??;
    ensure!(c.state == first.state, "cancel of a terminal batch changed it to {:?}", c.state);
    t.release(b)?;
    Ok(())
}
