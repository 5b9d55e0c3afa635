//! The subcommands: bench, target, initiator, config.

use std::io::{IsTerminal, Write};
use std::sync::Arc;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kvmove::{Access, Buffer, Engine, Error, ErrorKind, MetadataKind, MetadataStore, SegmentDescriptor, SegmentId};

use crate::data::Verification;
use crate::plan::Plan;
use crate::report::{self, Report};
use crate::run::{PassKind, PassResult, Session};
use crate::sessions::{self as flow, Receiver, Sender};
use crate::settings::{Mode, Op, Settings};

/// How the command ended, for the exit code.
#[derive(Debug)]
pub enum Outcome {
    Ok,
    /// Bytes did not verify (exit 3).
    Mismatch(String),
}

/// Writes to stdout, ignoring a closed pipe (`kvmove target | head -1`):
/// `println!` would panic there.
fn out(text: &str) {
    let mut o = std::io::stdout().lock();
    let _ = o.write_all(text.as_bytes());
    let _ = o.flush();
}

fn config_err(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::Config, msg)
}

/// The plan, once the buffers of `copies` plans are known to fit in memory.
fn plan_of(s: &Settings, copies: u64) -> kvmove::Result<Plan> {
    check_memory(Plan::buffer_len(&s.workload).map_err(config_err)?, copies, "lower --tokens or --layers")?;
    let plan = Plan::new(&s.workload).map_err(config_err)?;
    if s.workload.concurrency == 0 {
        return Err(config_err("workload.concurrency must be at least 1"));
    }
    if s.workload.iterations == 0 {
        return Err(config_err("workload.iterations must be at least 1"));
    }
    Ok(plan)
}

/// Memory the kernel says it can still give (`MemAvailable`), if known.
fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Refuses a workload whose buffers (`copies` of the plan's size) would
/// not fit in memory, instead of being killed half-way by the kernel.
fn check_memory(buffer_len: u64, copies: u64, hint: &str) -> kvmove::Result<()> {
    let need = buffer_len.saturating_mul(copies);
    match available_memory() {
        Some(avail) if need > avail => Err(config_err(format!(
            "the workload needs {} of memory ({copies} buffers of {}) but only {} is available; {hint}",
            report::bytes(need),
            report::bytes(buffer_len),
            report::bytes(avail)
        ))),
        _ => Ok(()),
    }
}

fn alloc(len: u64, what: &str) -> kvmove::Result<Buffer> {
    let n = usize::try_from(len).map_err(|_| config_err(format!("{what} of {len} bytes does not fit in memory")))?;
    Buffer::new(n).map_err(|e| Error::from(e).with("buffer", what))
}

/// Milliseconds from the command line, bounded (a week) so no duration
/// arithmetic can overflow.
fn millis(name: &str, v: u64) -> kvmove::Result<Duration> {
    const WEEK_MS: u64 = 7 * 24 * 3600 * 1000;
    if v > WEEK_MS {
        return Err(config_err(format!("--{name} must be at most {WEEK_MS} (a week)")));
    }
    Ok(Duration::from_millis(v))
}

/// `kvmove handoff`: the seed scenario with sessions and today's way.
pub async fn handoff(s: &Settings, a: &crate::args::HandoffArgs, json: bool) -> kvmove::Result<Outcome> {
    use crate::handoff::{run, Flow, HandoffConfig, HandoffReport};
    let request_bytes = a
        .request_kib
        .checked_mul(1024)
        .filter(|b| (1..=(1 << 30)).contains(b))
        .ok_or_else(|| config_err("--request-kib must be 1 to 1048576"))?;
    let c = HandoffConfig {
        senders: a.senders,
        requests: a.requests,
        request_bytes,
        layers: a.handoff_layers,
        decode_pages: a.decode_pages,
        hold: millis("hold-ms", a.hold_ms)?,
        grant_deadline: millis("grant-deadline-ms", a.grant_deadline_ms)?,
        arrival_timeout: millis("arrival-timeout-ms", a.arrival_timeout_ms)?,
        liveness: millis("liveness-ms", a.liveness_ms)?,
        kill_decode_after: a.kill_decode_after_ms.map(|v| millis("kill-decode-after-ms", v)).transpose()?,
    };
    c.validate()?;
    let total = (c.senders as u64).saturating_mul(c.requests as u64).saturating_mul(request_bytes);
    check_memory(total, 1, "lower --senders, --requests or --request-kib")?;
    let cfg = s.engine();
    let mut reports: Vec<HandoffReport> = Vec::new();
    for flow in [Flow::Sessions, Flow::Today] {
        if !json {
            say_progress(&format!("running {} ...", flow.name()));
        }
        reports.push(run(&cfg, &c, flow).await?);
    }
    // Sessions must agree; today's way ending a request differently on its
    // two sides (the decode's timer from arrival against a sender that
    // wrote) is what the comparison shows, not a failure of the command.
    // Wrong bytes fail it in either flow.
    let split = reports.iter().filter(|r| r.flow == "sessions").map(|r| r.disagreements).sum::<usize>();
    let wrong = reports.iter().map(|r| r.wrong_bytes).sum::<usize>();
    if json {
        out(&format!("{}\n", report::handoff_json(&c, &reports)));
    } else {
        out(&report::handoff_table(&c, &reports));
    }
    if split > 0 || wrong > 0 {
        return Ok(Outcome::Mismatch(format!(
            "{split} sessions ended differently on the two sides; {wrong} requests landed with wrong bytes"
        )));
    }
    Ok(Outcome::Ok)
}

fn say_progress(msg: &str) {
    if std::io::stderr().is_terminal() {
        eprintln!("kvmove: {msg}");
    }
}

/// `kvmove config`: the effective configuration as TOML.
pub fn config(s: &Settings) -> kvmove::Result<Outcome> {
    let text = toml::to_string(s).map_err(|e| Error::new(ErrorKind::Internal, format!("cannot print config: {e}")))?;
    out(&text);
    Ok(Outcome::Ok)
}

/// `kvmove bench`: target and initiator in this process.
pub async fn bench(s: &Settings, json: bool) -> kvmove::Result<Outcome> {
    let plan = plan_of(s, 2)?;
    let cfg = s.engine();
    let target = kvmove::build(&cfg).await.map_err(|e| e.with("role", "target"))?;
    let initiator = match kvmove::build(&cfg.sibling()).await {
        Ok(e) => e,
        Err(e) => {
            let _ = target.shutdown().await;
            return Err(e.with("role", "initiator"));
        }
    };
    let result = bench_with(s, &plan, &target, &initiator, json).await;
    let _ = initiator.shutdown().await;
    let _ = target.shutdown().await;
    result
}

async fn bench_with(
    s: &Settings,
    plan: &Plan,
    target: &Engine,
    initiator: &Engine,
    json: bool,
) -> kvmove::Result<Outcome> {
    let target_buf = alloc(plan.buffer_len, "target memory")?;
    target.register(target_buf.region(), Access::REMOTE_RW)?;
    let store = kvmove::build_metadata(&s.metadata).await?;
    // With a metadata store the initiator resolves a logical name, as
    // between machines; peer to peer it opens the target's address.
    let name = match &store {
        Some(store) => {
            kvmove::publish(target, store.as_ref(), &s.target.name).await?;
            s.target.name.clone()
        }
        None => target.local_segment_name(),
    };
    let (segment, desc) = connect(initiator, store.as_deref(), &name).await?;
    let mut session = session(s, plan, initiator, segment, &desc, false)?;
    session.target_buf = Some(target_buf);
    if s.workload.sessions {
        // The target side grants from its copy of the plan, in the memory
        // the initiator writes to; asks come through a channel.
        let rx =
            Receiver::start(target, plan, session.remote_base, grant_deadline(s, plan), session.concurrency, false)?;
        match Sender::local(initiator, rx.name(), rx.asks(), session.concurrency) {
            Ok(tx) => session.flow = Some(Arc::new(tx)),
            Err(e) => {
                rx.shutdown().await;
                return Err(e);
            }
        }
        session.receiver = Some(rx);
    }
    let shown = format!("{name} (in this process)");
    let outcome = workload(s, plan, &session, "bench", shown, json).await;
    stop_sessions(&mut session).await;
    if let Some(store) = &store {
        let _ = store.remove(&s.target.name).await;
    }
    outcome
}

/// The deadline of a session's grant: every layer's compute and then some.
fn grant_deadline(s: &Settings, plan: &Plan) -> Duration {
    let compute = Duration::from_millis(s.workload.compute_delay_ms).saturating_mul(plan.layers);
    flow::deadline(compute)
}

async fn stop_sessions(session: &mut Session) {
    if let Some(tx) = session.flow.take() {
        tx.shutdown().await;
    }
    if let Some(rx) = session.receiver.take() {
        rx.shutdown().await;
    }
}

/// Opens the target: by its `host:port` when it is one, else through the
/// metadata store (which checks the generation), else as a segment name.
async fn connect(
    engine: &Engine,
    store: Option<&dyn MetadataStore>,
    target: &str,
) -> kvmove::Result<(SegmentId, SegmentDescriptor)> {
    // A literal address needs no lookup, whatever the store.
    let store = store.filter(|_| target.parse::<std::net::SocketAddr>().is_err());
    match store {
        Some(store) => kvmove::resolve(engine, store, target).await.map_err(|e| {
            if e.kind() == ErrorKind::NotFound {
                Error::new(
                    ErrorKind::NotFound,
                    format!(
                        "no target named '{target}' in the metadata store (is `kvmove target --name {target}` running?)"
                    ),
                )
            } else {
                e
            }
        }),
        // Its error names the address and keeps how many tries it took.
        None => kvmove::open(engine, target).await,
    }
}

/// The initiator's side: local memory and where the target's buffer is.
fn session(
    s: &Settings,
    plan: &Plan,
    engine: &Engine,
    segment: SegmentId,
    desc: &SegmentDescriptor,
    remote_check: bool,
) -> kvmove::Result<Session> {
    let w = &s.workload;
    let need = plan.buffer_len;
    let access_ok = |r: &kvmove::RegionInfo| match w.op {
        Op::Write => r.access.remote_write && (!remote_check || r.access.remote_read),
        Op::Read => r.access.remote_read && r.access.remote_write,
    };
    let region =
        desc.regions.iter().filter(|r| access_ok(r) && r.len >= need).max_by_key(|r| r.len).ok_or_else(|| {
            let largest = desc.regions.iter().map(|r| r.len).max().unwrap_or(0);
            config_err(format!(
            "the target serves {} of remotely writable memory but the workload needs {}; start the target with the \
             same --model/--tokens/--page-size/--layers or a larger --mem-mib",
            report::bytes(largest),
            report::bytes(need)
        ))
        })?;
    let local_buf = alloc(need, "initiator memory")?;
    let local = engine.register(local_buf.region(), Access::LOCAL)?;
    let check = if remote_check {
        let buf = alloc(need, "read-back memory")?;
        Some((engine.register(buf.region(), Access::LOCAL)?, buf))
    } else {
        None
    };
    Ok(Session {
        engine: engine.clone(),
        segment,
        local,
        local_buf,
        check,
        remote_base: region.addr,
        target_buf: None,
        op: w.op,
        concurrency: w.concurrency,
        compute_delay: Duration::from_millis(w.compute_delay_ms),
        flow: None,
        receiver: None,
    })
}

fn progress(total: u64, json: bool) -> ProgressBar {
    if json || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template(
        "{spinner} {msg:<11} [{bar:24}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec}",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

/// Runs the warm-up and measured passes of every selected mode, verifies
/// each, and prints the report.
async fn workload(
    s: &Settings,
    plan: &Plan,
    session: &Session,
    command: &'static str,
    target: String,
    json: bool,
) -> kvmove::Result<Outcome> {
    let w = &s.workload;
    let mut kinds = match w.mode {
        Mode::Both => vec![PassKind::AllAtEnd, PassKind::Layerwise],
        Mode::AllAtEnd => vec![PassKind::AllAtEnd],
        Mode::Layerwise => vec![PassKind::Layerwise],
    };
    if w.per_request {
        kinds.push(PassKind::PerRequest);
    }
    let passes = u64::from(w.warmup) + u64::from(w.iterations);
    let bar = progress(plan.total_bytes.saturating_mul(passes).saturating_mul(kinds.len() as u64), json);
    let mut modes = Vec::new();
    let mut verdict = Verification::default();
    let mut pass_no = 0u64;
    for kind in kinds {
        bar.set_message(kind.name());
        let mut measured: Vec<PassResult> = Vec::new();
        for i in 0..passes {
            pass_no += 1;
            let seed = w.seed.wrapping_add(pass_no.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            let r = session.pass(plan, kind, seed, &bar).await;
            let r = match r {
                Ok(r) => r,
                Err(e) => {
                    bar.finish_and_clear();
                    return Err(e.with("mode", kind.name()));
                }
            };
            verdict.bytes = verdict.bytes.saturating_add(r.verdict.bytes);
            verdict.requests = verdict.requests.saturating_add(r.verdict.requests);
            verdict.mismatched = verdict.mismatched.saturating_add(r.verdict.mismatched);
            if i >= u64::from(w.warmup) {
                measured.push(r);
            }
        }
        modes.push(report::mode_report(kind, &measured));
    }
    bar.finish_and_clear();
    let metadata = s.metadata.kind.to_string();
    let report = Report::new(command, s.backend.kind.to_string(), metadata, target, w, plan, modes, verdict);
    if json {
        let text = serde_json::to_string(&report)
            .map_err(|e| Error::new(ErrorKind::Internal, format!("cannot write JSON: {e}")))?;
        out(&format!("{text}\n"));
    } else {
        out(&report.table());
        if let Some(line) = crate::metrics::stage_line() {
            out(&line);
        }
    }
    if report.ok {
        Ok(Outcome::Ok)
    } else {
        Ok(Outcome::Mismatch(format!(
            "verification failed: {} of {} requests differ between source and destination",
            verdict.mismatched,
            verdict.mismatched + verdict.requests
        )))
    }
}

/// `kvmove target`: serve memory until Ctrl-C or SIGTERM.
pub async fn target(s: &Settings, json: bool) -> kvmove::Result<Outcome> {
    if s.backend.kind == kvmove::BackendKind::Mock {
        return Err(config_err(
            "the mock backend only reaches peers inside one process; use `kvmove bench --backend mock`, \
             or --backend tcp for a target",
        ));
    }
    let plan = plan_of(s, 1)?;
    let len = match s.target.mem_mib {
        Some(0) => return Err(config_err("target.mem_mib: --mem-mib must be at least 1")),
        Some(m) => m.checked_mul(1 << 20).ok_or_else(|| config_err("target.mem_mib: --mem-mib is too large"))?,
        None => plan.buffer_len,
    };
    check_memory(len, 1, "lower --mem-mib")?;
    if s.workload.sessions && len < plan.buffer_len {
        return Err(config_err(format!(
            "--sessions true grants the workload's memory ({}) but --mem-mib serves {}; drop --mem-mib or raise it",
            report::bytes(plan.buffer_len),
            report::bytes(len)
        )));
    }
    let engine = kvmove::build(&s.engine()).await?;
    let served = serve(s, &plan, &engine, len, json).await;
    let _ = engine.shutdown().await;
    served
}

async fn serve(s: &Settings, plan: &Plan, engine: &Engine, len: u64, json: bool) -> kvmove::Result<Outcome> {
    let buf = alloc(len, "target memory")?;
    engine.register(buf.region(), Access::REMOTE_RW)?;
    let segment = engine.local_segment_name();
    let store = kvmove::build_metadata(&s.metadata).await?;
    let desc = match &store {
        Some(store) => kvmove::publish(engine, store.as_ref(), &s.target.name).await?,
        None => engine.local_descriptor()?,
    };
    let published = store.as_ref().map(|_| s.target.name.clone());
    // With sessions, grants go to initiators that ask, for the units of
    // this side's plan, in the memory it serves (as initiators see it).
    let receiver = if s.workload.sessions {
        // The region an initiator picks: the largest served (the only one).
        let base = desc.regions.iter().max_by_key(|r| r.len).map_or_else(|| buf.addr(), |r| r.addr);
        Some(Receiver::start(engine, plan, base, grant_deadline(s, plan), s.workload.concurrency, true)?)
    } else {
        None
    };
    if json {
        let line = serde_json::json!({
            "event": "ready",
            "segment": segment,
            "backend": s.backend.kind.as_str(),
            "metadata": s.metadata.kind.as_str(),
            "name": published,
            "generation": desc.generation,
            "bytes": len,
            "sessions": s.workload.sessions,
        });
        out(&format!("{line}\n"));
    } else {
        let via = match &published {
            Some(n) => format!(", published as '{n}' in {} metadata", s.metadata.kind),
            None => String::new(),
        };
        out(&format!(
            "kvmove target: serving {} at {segment} ({}, generation {}{via}); Ctrl-C to stop\nrun: kvmove initiator \
             --target {}\n",
            report::bytes(len),
            s.backend.kind,
            desc.generation,
            published.as_deref().unwrap_or(&segment)
        ));
    }
    let signal = shutdown_signal().await;
    if let (Some(store), Some(name)) = (&store, &published) {
        let _ = tokio::time::timeout(Duration::from_secs(3), store.remove(name)).await;
    }
    let sessions = match receiver {
        Some(rx) => {
            let (counts, times) = rx.counts();
            rx.shutdown().await;
            Some((counts, report::Percentiles::of(&times)))
        }
        None => None,
    };
    if json {
        let sessions = sessions.as_ref().map(|(c, t)| {
            serde_json::json!({
                "granted": c.granted, "landed": c.landed, "not_landed": c.not_landed,
                "ignored_asks": c.ignored_asks, "grant_to_landed": t,
            })
        });
        out(&format!("{}\n", serde_json::json!({ "event": "stopped", "signal": signal, "sessions": sessions })));
    } else {
        crate::say!("kvmove target: {signal}, stopping");
        if let Some((c, t)) = &sessions {
            let p = |f: fn(&report::Percentiles) -> f64| t.as_ref().map_or("-".into(), |t| format!("{:.3}", f(t)));
            crate::say!(
                "kvmove target: sessions: {} granted, {} landed, {} did not land, {} asks ignored; grant to landed \
                 p50 {} ms, p99 {} ms",
                c.granted,
                c.landed,
                c.not_landed,
                c.ignored_asks,
                p(|t| t.p50_ms),
                p(|t| t.p99_ms)
            );
        }
    }
    Ok(Outcome::Ok)
}

/// Waits for Ctrl-C or SIGTERM; names the one that came.
pub(crate) async fn shutdown_signal() -> &'static str {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => return "interrupted",
                _ = term.recv() => return "terminated",
            }
        }
    }
    match tokio::signal::ctrl_c().await {
        Ok(()) => "interrupted",
        // No signal handling available: serve until killed.
        Err(_) => std::future::pending().await,
    }
}

/// `kvmove initiator --target ...`: run the workload against a target
/// and verify it.
pub async fn initiator(s: &Settings, target: &str, json: bool) -> kvmove::Result<Outcome> {
    if s.backend.kind == kvmove::BackendKind::Mock {
        return Err(config_err(
            "the mock backend only reaches peers inside one process; use `kvmove bench --backend mock`",
        ));
    }
    let plan = plan_of(s, if s.workload.op == Op::Write { 2 } else { 1 })?;
    let engine = kvmove::build(&s.engine()).await?;
    let r = initiate(s, &plan, &engine, target, json).await;
    let _ = engine.shutdown().await;
    r
}

async fn initiate(s: &Settings, plan: &Plan, engine: &Engine, target: &str, json: bool) -> kvmove::Result<Outcome> {
    let store: Option<Arc<dyn MetadataStore>> = match s.metadata.kind {
        MetadataKind::P2p => None,
        _ => kvmove::build_metadata(&s.metadata).await?,
    };
    let (segment, desc) = connect(engine, store.as_deref(), target).await?;
    let mut session = session(s, plan, engine, segment, &desc, s.workload.op == Op::Write)?;
    if s.workload.sessions {
        // Sessions name the target by the segment name it serves under.
        session.flow = Some(Arc::new(Sender::remote(engine, desc.name.clone(), plan, s.workload.concurrency).await?));
    }
    let shown = if desc.name == target { target.to_owned() } else { format!("{target} ({})", desc.name) };
    let outcome = workload(s, plan, &session, "initiator", shown, json).await;
    stop_sessions(&mut session).await;
    outcome
}

#[cfg(all(test, feature = "mock"))]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    /// A store entry whose generation differs from what the peer serves
    /// (the peer restarted) is refused, never used.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stale_generation_in_the_store_is_refused() {
        let cfg = kvmove::EngineConfig::from_toml_str("[backend]\nkind = \"mock\"\n").unwrap();
        let target = kvmove::build(&cfg).await.unwrap();
        let initiator = kvmove::build(&cfg).await.unwrap();
        let store = kvmove::InProcessStore::new();
        let mut desc = kvmove::publish(&target, &store, "stale-peer").await.unwrap();
        let (seg, _) = connect(&initiator, Some(&store), "stale-peer").await.unwrap();
        initiator.close_segment(seg).await.unwrap();
        desc.generation = desc.generation.wrapping_add(1);
        store.put(desc).await.unwrap();
        let e = connect(&initiator, Some(&store), "stale-peer").await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::PeerRestarted);
        assert!(e.to_string().contains("stale"), "{e}");
        assert_eq!(connect(&initiator, Some(&store), "absent").await.unwrap_err().kind(), ErrorKind::NotFound);
        initiator.shutdown().await.unwrap();
        target.shutdown().await.unwrap();
    }
}
