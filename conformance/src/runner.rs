//! Running cases: one tokio runtime and one timeout per case, results as
//! passed, skipped (ignored, with a reason) or failed; a `libtest-mimic`
//! main for `harness = false` test targets.

use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

use libtest_mimic::{Arguments, Completion, Failed, Trial};

use crate::case::{Case, Need};
use crate::cases::cases;
use crate::ctx::{Ctx, MemoryMode};
use crate::harness::Harness;
use crate::outcome::CaseError;

/// How long one case may run before it counts as hung (a failure), by
/// default; [`case_timeout`] is what the runner uses.
pub const CASE_TIMEOUT: Duration = Duration::from_secs(60);

/// How long one case may run: [`CASE_TIMEOUT`], or three hang limits when
/// `CONFORMANCE_WAIT_S` makes that longer (a case may wait on a few
/// hooks in a row: a slower harness gets its case the same room).
pub fn case_timeout() -> Duration {
    CASE_TIMEOUT.max(crate::timeline::wait_limit().saturating_mul(3))
}

/// How long the cleanup after a case (shutting every node down) may take.
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(10);

/// Set to `1` to turn every skip into a failure (for machines where every
/// capability and fault hook is expected to work, e.g. RDMA CI).
pub const STRICT_ENV: &str = "CONFORMANCE_STRICT";

/// What a harness supports, found by [`probe`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Support {
    pub read: bool,
    pub kill: bool,
    pub cut: bool,
    pub stall: bool,
    pub os_probe: bool,
    pub inbox_capacity: bool,
    /// The heap census is installed ([`crate::census_allocator!`]).
    pub census: bool,
    /// The backend moves device memory (`capabilities().device_memory`).
    pub device_memory: bool,
    /// Peers may reach its device memory (`capabilities().device_memory_remote`).
    pub device_memory_remote: bool,
}

impl Support {
    /// Whether `need` is met.
    pub fn has(&self, need: Need) -> bool {
        match need {
            Need::Read => self.read,
            Need::Kill => self.kill,
            Need::Cut => self.cut,
            Need::Stall => self.stall,
            Need::OsProbe => self.os_probe,
            Need::InboxCapacity => self.inbox_capacity,
            Need::Census => self.census,
            Need::DeviceFaults => true,
        }
    }
}

/// Finds what `harness` supports by trying each hook on a throw-away node
/// (`stall(false)`, `cut`, then `kill`) and asking for a second one with a
/// small inbox (`node_with_inbox`). `None` if no node could be made.
pub async fn probe(harness: &dyn Harness) -> Option<Support> {
    let opts = crate::harness::NodeOptions::default();
    let node = harness.node(&opts).await.ok()?;
    let read = node.transport.capabilities().read;
    let device_memory = node.transport.capabilities().device_memory;
    let device_memory_remote = node.transport.capabilities().device_memory_remote;
    let stall = matches!(harness.stall(&node, false).await, Ok(true));
    let cut = matches!(harness.cut(&node).await, Ok(true));
    let kill = matches!(harness.kill(&node).await, Ok(true));
    let _ = node.transport.shutdown().await;
    let inbox_capacity = match harness.node_with_inbox(&opts, 4).await {
        Ok(Some(n)) => {
            let _ = n.transport.shutdown().await;
            true
        }
        _ => false,
    };
    Some(Support {
        read,
        kill,
        cut,
        stall,
        os_probe: harness.os_probe().is_some(),
        inbox_capacity,
        census: crate::census().is_some(),
        device_memory,
        device_memory_remote,
    })
}

/// The result of a case that did not fail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The backend kept the rule.
    Passed,
    /// The case could not run; the reason says what is missing.
    Skipped(String),
}

/// The groups whose cases run again with device memory (rule 9: memory
/// kinds): every data case in each [`MemoryMode::DEVICE`] mode, the others
/// in one mode each, in turn.
const DEVICE_GROUPS: &[&str] = &["data", "deadline", "lifecycle", "failure", "poll", "session"];

/// Every `(case, memory mode)` the suite runs, in order: each case on host
/// memory, then the device runs of the data, deadline, lifecycle, failure,
/// poll and session groups.
pub fn runs() -> Vec<(Case, MemoryMode)> {
    let mut out: Vec<(Case, MemoryMode)> = cases().iter().map(|c| (*c, MemoryMode::Host)).collect();
    let mut turn = 0usize;
    for c in cases().iter().filter(|c| DEVICE_GROUPS.contains(&c.group)) {
        if c.group == "data" {
            out.extend(MemoryMode::DEVICE.iter().map(|m| (*c, *m)));
        } else {
            out.push((*c, MemoryMode::DEVICE[turn % MemoryMode::DEVICE.len()]));
            turn += 1;
        }
    }
    out
}

/// The name of a run: `group::case` on host memory,
/// `device_<mode>::group::case` on device memory (`device_d2d`,
/// `device_h2d`, `device_d2h`).
pub fn run_id(case: &Case, memory: MemoryMode) -> String {
    match memory {
        MemoryMode::Host => case.id(),
        m => format!("device_{}::{}", m.name(), case.id()),
    }
}

/// Runs one case (`"group::case"`, `"device_d2d::group::case"`, with or
/// without the backend in front) against `harness`, in its own runtime
/// with [`case_timeout`]. `Err` carries the failure message (or says the
/// case is unknown).
pub fn run_case<H: Harness>(harness: H, id: &str) -> Result<Outcome, String> {
    let (case, memory) = find_case(id)?;
    let cell = parking_lot::Mutex::new(Some(harness));
    execute(&|| cell.lock().take().map(|h| Arc::new(h) as Arc<dyn Harness>), &case, memory, case_timeout())
}

/// Like [`run_case`] with a harness factory and a timeout of your choice.
pub fn run_case_with(make: &dyn Fn() -> Arc<dyn Harness>, id: &str, timeout: Duration) -> Result<Outcome, String> {
    let (case, memory) = find_case(id)?;
    execute(&|| Some(make()), &case, memory, timeout)
}

fn find_case(id: &str) -> Result<(Case, MemoryMode), String> {
    let device = MemoryMode::DEVICE.iter().find(|m| id.contains(&format!("device_{}::", m.name()))).copied();
    let memory = device.unwrap_or(MemoryMode::Host);
    cases()
        .iter()
        .find(|c| {
            let rid = run_id(c, memory);
            id == rid || id.ends_with(&format!("::{rid}"))
        })
        .map(|c| (*c, memory))
        .ok_or_else(|| format!("no conformance case named {id:?}"))
}

fn panic_message(p: Box<dyn Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

/// Held shared by every case while it runs, and exclusively by a case
/// that must run alone ([`Need::runs_alone`]): one that takes a census of
/// the process's heap (cases running side by side on other threads would
/// move it), or one that sets faults on the shared test devices (the
/// others would meet them).
static ALONE: parking_lot::RwLock<()> = parking_lot::RwLock::new(());

fn execute(
    make: &dyn Fn() -> Option<Arc<dyn Harness>>,
    case: &Case,
    memory: MemoryMode,
    timeout: Duration,
) -> Result<Outcome, String> {
    let (_shared, _alone) = if case.needs.iter().any(|n| n.runs_alone()) {
        (None, Some(ALONE.write()))
    } else {
        (Some(ALONE.read()), None)
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .thread_name_fn(|| {
            static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
            format!("conformance-{}", N.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
        })
        .build()
        .map_err(|e| format!("cannot build a tokio runtime: {e}"))?;
    let harness = {
        let _enter = rt.enter();
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(make))
            .map_err(|p| format!("harness constructor panicked: {}", panic_message(p)))?
            .ok_or("harness already used")?
    };
    let ctx = Ctx::new(harness, run_id(case, memory), memory);
    let watchdog = stall_trace_ms().map(|ms| Watchdog::start(Duration::from_millis(ms)));
    let body = (case.run)(ctx.clone());
    let result = rt.block_on(async {
        let mut task = tokio::spawn(crate::timeline::scope(body));
        match tokio::time::timeout(timeout, &mut task).await {
            Err(_) => {
                task.abort();
                Err(CaseError::Fail(format!("case did not finish within {timeout:?} (something hangs)")))
            }
            Ok(Err(j)) if j.is_panic() => Err(CaseError::Fail(format!("panicked: {}", panic_message(j.into_panic())))),
            Ok(Err(_)) => Err(CaseError::Fail("case task was cancelled".into())),
            Ok(Ok(r)) => r,
        }
    });
    drop(watchdog); // the cleanup below shuts the runtime's work down
    let cleanup = rt.block_on(async { tokio::time::timeout(CLEANUP_TIMEOUT, ctx.cleanup()).await });
    rt.shutdown_timeout(Duration::from_secs(5));
    // The context (and the memory it keeps alive for transports) is dropped
    // only now, after the runtime and every task that could touch it.
    drop(ctx);
    match (result, cleanup) {
        (Ok(()), Err(_)) => Err(format!("cleanup: shutting the nodes down took longer than {CLEANUP_TIMEOUT:?}")),
        (Ok(()), Ok(())) => Ok(Outcome::Passed),
        (Err(CaseError::Skip(why)), _) => Ok(Outcome::Skipped(why)),
        (Err(CaseError::Fail(why)), _) => Err(why),
    }
}

/// Set to a number of milliseconds to trace what the case's threads block
/// in: a thread of its own samples every thread of the process
/// (`/proc/self/task/*`) every 20 ms and prints, with the time, each one
/// found in the same kernel wait (other than the runtime's idle waits:
/// futex, epoll) for that long or more, and its own sleeps that ran that
/// late (the process or the machine stalled). It spawns nothing on the
/// runtime, so it does not wake it. A diagnostic for liveness failures;
/// off by default.
pub const STALL_TRACE_ENV: &str = "CONFORMANCE_STALL_TRACE_MS";

fn stall_trace_ms() -> Option<u64> {
    std::env::var(STALL_TRACE_ENV).ok().and_then(|v| v.parse().ok()).filter(|ms| *ms > 0)
}

/// The thread behind [`STALL_TRACE_ENV`]; stops when dropped.
struct Watchdog {
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watchdog {
    fn start(limit: Duration) -> Self {
        use std::collections::HashMap;
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::time::Instant;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("stall-watchdog".into())
            .spawn(move || {
                let period = Duration::from_millis(20);
                // Per thread: the wait it is in, since when, and whether reported.
                let mut seen: HashMap<String, (String, Instant, bool)> = HashMap::new();
                while !flag.load(Ordering::Relaxed) {
                    let asked = Instant::now();
                    std::thread::sleep(period);
                    let overslept = asked.elapsed().saturating_sub(period);
                    if overslept >= limit {
                        eprintln!(
                            "stall-trace {}: the watchdog's sleep ran {overslept:?} late (process or machine stalled)",
                            wall()
                        );
                    }
                    let now = Instant::now();
                    for (tid, wait) in threads_now() {
                        let e = seen.entry(tid.clone()).or_insert_with(|| (wait.clone(), now, false));
                        if e.0 != wait {
                            if e.2 {
                                eprintln!("stall-trace {}: thread {tid} left that wait after {:?}", wall(), now - e.1);
                            }
                            *e = (wait, now, false);
                        } else if !e.2 && now - e.1 >= limit && !idle_wait(&wait) {
                            e.2 = true;
                            eprintln!("stall-trace {}: thread {tid} in {wait} for {:?}", wall(), now - e.1);
                        }
                    }
                }
            })
            .ok();
        Self { stop, thread }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The wall clock as the tracing logs print it (UTC, seconds of the day).
fn wall() -> String {
    let d = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let s = d.as_secs() % 86_400;
    format!("{:02}:{:02}:{:02}.{:06}", s / 3600, s / 60 % 60, s % 60, d.subsec_micros())
}

/// Waits of an idle runtime thread (parked, or polling its driver).
fn idle_wait(wait: &str) -> bool {
    wait.contains("futex") || wait.contains("ep_poll") || wait.contains("do_epoll_wait")
}

/// Every thread of this process (`tid/name`) and what it is doing: its
/// state and kernel wait channel, with the top of its kernel stack where
/// that is readable (root). A running thread is in no wait.
fn threads_now() -> Vec<(String, String)> {
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else { return out };
    for t in dir.flatten() {
        let p = t.path();
        let read = |f: &str| std::fs::read_to_string(p.join(f)).unwrap_or_default();
        let stat = read("stat");
        // The state is the field after the parenthesised name.
        let state = stat.rsplit(')').next().and_then(|r| r.split_whitespace().next()).unwrap_or("?").to_string();
        let id = format!("{}/{}", t.file_name().to_string_lossy(), read("comm").trim());
        if state == "R" {
            out.push((id, "running".into()));
            continue;
        }
        let stack: Vec<String> =
            read("stack").lines().take(5).map(|l| l.split_whitespace().last().unwrap_or("").to_string()).collect();
        out.push((id, format!("{state} {} [{}]", read("wchan").trim(), stack.join(" < "))));
    }
    out
}

/// Whether [`STRICT_ENV`] asks skips to fail.
pub fn strict() -> bool {
    std::env::var(STRICT_ENV).map(|v| v == "1" || v.eq_ignore_ascii_case("true")).unwrap_or(false)
}

/// The libtest-compatible trials for one backend: one per case, named
/// `<backend>::<group>::<case>`. `make` is called once per case (inside
/// that case's runtime) and once more up front to learn the backend name.
pub fn trials<H, F>(make: F) -> Vec<Trial>
where
    H: Harness,
    F: Fn() -> H + Send + Sync + 'static,
{
    let make = Arc::new(make);
    let strict = strict();
    // Under nextest, which cannot see a skip decided at run time, cases the
    // harness cannot run are marked ignored up front (found by `probe`).
    let static_skips = std::env::var_os("NEXTEST").is_some() && !strict;
    let (backend, support) = {
        // The constructor may need a runtime (spawning, binding sockets).
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build();
        match rt {
            Ok(rt) => {
                let h = {
                    let _enter = rt.enter();
                    make()
                };
                let support = if static_skips {
                    rt.block_on(async { tokio::time::timeout(Duration::from_secs(30), probe(&h)).await.ok().flatten() })
                } else {
                    None
                };
                let name = h.backend().to_owned();
                drop(h);
                rt.shutdown_timeout(Duration::from_secs(5));
                (name, support)
            }
            Err(_) => (make().backend().to_owned(), None),
        }
    };
    runs()
        .into_iter()
        .map(|(case, memory)| {
            let make = make.clone();
            let name = format!("{backend}::{}", run_id(&case, memory));
            let unmet = support.is_some_and(|s| {
                case.needs.iter().any(|n| !s.has(*n))
                    || (memory.is_device() && !s.device_memory)
                    || (memory.remote_on_device() && !s.device_memory_remote)
            });
            let timed = name.clone();
            Trial::ignorable_test(name, move || {
                let factory = || Some(Arc::new(make()) as Arc<dyn Harness>);
                let started = std::time::Instant::now();
                let outcome = execute(&factory, &case, memory, case_timeout());
                took(&timed, started.elapsed());
                match outcome {
                    Ok(Outcome::Passed) => Ok(Completion::Completed),
                    Ok(Outcome::Skipped(why)) if strict => {
                        Err(Failed::from(format!("skipped in strict mode ({STRICT_ENV}=1): {why}")))
                    }
                    Ok(Outcome::Skipped(why)) => Ok(Completion::ignored_with(why)),
                    Err(why) => Err(Failed::from(format!("[rule {}] {why}", case.rule))),
                }
            })
            .with_ignored_flag(unmet)
        })
        .collect()
}

/// Runs the whole suite as a libtest-compatible program (parses the
/// command line: `--list`, `--exact`, filters, `--ignored`, ...) and exits.
/// Use through [`crate::conformance_main!`].
pub fn main_with<H, F>(make: F) -> !
where
    H: Harness,
    F: Fn() -> H + Send + Sync + 'static,
{
    run_trials(&Arguments::from_args(), trials(make))
}

/// Runs `trials` (from [`trials`], filtered or marked as a harness
/// needs) as libtest would, names the slowest cases on stderr, and exits
/// with the run's status. For a `main` that builds its trials itself.
pub fn run_trials(args: &Arguments, trials: Vec<Trial>) -> ! {
    let conclusion = libtest_mimic::run(args, trials);
    slowest(SLOWEST);
    conclusion.exit()
}

/// How many of the slowest cases [`main_with`] names after a run.
const SLOWEST: usize = 8;

/// Every case's wall time in this process, for [`slowest`].
static TIMES: parking_lot::Mutex<Vec<(String, Duration)>> = parking_lot::Mutex::new(Vec::new());

fn took(case: &str, d: Duration) {
    TIMES.lock().push((case.to_owned(), d));
}

/// Prints (stderr) the `n` slowest cases of the run and the total: where
/// a suite's time goes, for whoever has to make it shorter.
fn slowest(n: usize) {
    let mut all = std::mem::take(&mut *TIMES.lock());
    if all.len() < 2 {
        return;
    }
    let total: Duration = all.iter().map(|t| t.1).sum();
    all.sort_by_key(|t| std::cmp::Reverse(t.1));
    let list: Vec<String> = all.iter().take(n).map(|(c, d)| format!("{c} {:.1}s", d.as_secs_f64())).collect();
    eprintln!(
        "conformance: {} cases ran {:.1}s in all; the slowest: {}",
        all.len(),
        total.as_secs_f64(),
        list.join(", ")
    );
}

/// Expands to a `main` that runs the whole conformance suite against the
/// harness the closure builds. Put it alone in a `harness = false` test
/// target:
///
/// ```ignore
/// // tests/conformance.rs, with `[[test]] name = "conformance" harness = false`
/// conformance::conformance_main!(|| MyHarness::new());
/// ```
#[macro_export]
macro_rules! conformance_main {
    ($make:expr) => {
        $crate::census_allocator!();
        fn main() {
            $crate::main_with($make)
        }
    };
}

/// Makes the suite's counting allocator ([`crate::CountingAlloc`], the
/// system allocator counting live allocations) the test binary's global
/// allocator, so `lifecycle::no_hidden_growth` can take a census of the
/// heap that does not trust the backend's `stats()`. `conformance_main!`
/// does it; a `main` of your own calls it once at the crate's top level.
/// Without it that case is skipped, saying why. (A binary with another
/// global allocator cannot have this one too.)
#[macro_export]
macro_rules! census_allocator {
    () => {
        #[global_allocator]
        static CONFORMANCE_CENSUS: $crate::CountingAlloc = $crate::CountingAlloc;
    };
}
