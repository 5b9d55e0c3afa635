//! The handoff scenario: several prefill senders, one decode receiver whose
//! KV memory is saturated (it has room for a few requests and frees a page
//! only some time after a request landed), run two ways:
//!
//! - [`Flow::Sessions`]: the decode grants each request when a page is
//!   free ([`kvmove_policy::Sessions`], rules 12 and 13); the senders wait
//!   for the grant with no deadline; the deadline starts at the grant.
//! - [`Flow::Today`]: the way serving engines' connectors work around a
//!   transfer engine today: the decode sends the destination in a plain
//!   message when it has allocated; the prefill waits for it with a timeout
//!   counted from the request's arrival, writes, then sends "done"; each
//!   side times out on its own.
//!
//! Both run over the configured backend, with every byte verified on the
//! decode. [`run`] returns the counts and latencies; the `kvmove handoff`
//! command prints them side by side.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmove_policy::session::{Grant, GrantPool, Role, SessionKey, SessionLimits, SessionState};
use kvmove_policy::{Engine, Sessions};
use parking_lot::Mutex;
use transport_core::{Access, Buffer, Error, ErrorKind, RegionId, Result, TransferRequest};

use kvmove::EngineConfig;

/// How the handoff is run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    /// Receiver-granted sessions (this engine).
    Sessions,
    /// Deadlines from the request's arrival, no grants (today's connectors).
    Today,
}

impl Flow {
    pub fn name(self) -> &'static str {
        match self {
            Flow::Sessions => "sessions",
            Flow::Today => "today",
        }
    }
}

/// The scenario's knobs.
#[derive(Debug, Clone)]
pub struct HandoffConfig {
    /// Prefill engines.
    pub senders: usize,
    /// Requests per sender, all arriving at the start.
    pub requests: usize,
    /// KV bytes per request.
    pub request_bytes: u64,
    /// Writes per request (layer by layer).
    pub layers: u32,
    /// Requests the decode has memory for at once.
    pub decode_pages: usize,
    /// How long the decode keeps a page after its request landed (the
    /// decode's own work); this is what saturates it.
    pub hold: Duration,
    /// Session deadline, from the grant (sessions).
    pub grant_deadline: Duration,
    /// Timeout from the request's arrival (today's way).
    pub arrival_timeout: Duration,
    /// Session liveness timeout; heartbeats every fifth of it.
    pub liveness: Duration,
    /// Kill the decode this long after the start (sessions), if set.
    pub kill_decode_after: Option<Duration>,
}

impl Default for HandoffConfig {
    fn default() -> Self {
        Self {
            senders: 4,
            requests: 16,
            request_bytes: 256 << 10,
            layers: 4,
            decode_pages: 2,
            hold: Duration::from_millis(100),
            grant_deadline: Duration::from_secs(10),
            arrival_timeout: Duration::from_secs(1),
            liveness: Duration::from_millis(1000),
            kill_decode_after: None,
        }
    }
}

impl HandoffConfig {
    /// Checks the values (the error names the knob).
    pub fn validate(&self) -> Result<()> {
        let bad = |what: &str| Err(Error::new(ErrorKind::Config, format!("handoff: {what}")));
        if self.senders == 0 || self.senders > 64 {
            return bad("senders must be 1 to 64");
        }
        if self.requests == 0 || self.requests > 100_000 {
            return bad("requests must be 1 to 100000");
        }
        if self.request_bytes == 0 || self.request_bytes > (1 << 30) {
            return bad("request bytes must be 1 B to 1 GiB");
        }
        if self.layers == 0 || u64::from(self.layers) > self.request_bytes {
            return bad("layers must be 1 to the request's bytes");
        }
        if self.decode_pages == 0 || self.decode_pages > 4096 {
            return bad("decode pages must be 1 to 4096");
        }
        let total =
            (self.senders as u64).checked_mul(self.requests as u64).and_then(|n| n.checked_mul(self.request_bytes));
        if total.is_none_or(|t| t > (8 << 30)) {
            return bad("senders x requests x request bytes must stay within 8 GiB");
        }
        if self.liveness < Duration::from_millis(50) {
            return bad("liveness must be at least 50 ms");
        }
        Ok(())
    }
}

/// Percentiles of one latency series, in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Latency {
    pub count: usize,
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
}

impl Latency {
    fn of(mut v: Vec<Duration>) -> Self {
        if v.is_empty() {
            return Self::default();
        }
        v.sort();
        let at = |q: f64| {
            let i = ((v.len() as f64 - 1.0) * q).round() as usize;
            v[i.min(v.len() - 1)].as_secs_f64() * 1e6
        };
        Self { count: v.len(), p50_us: at(0.5), p99_us: at(0.99), max_us: at(1.0) }
    }
}

/// What one run measured.
#[derive(Debug, Clone, Default)]
pub struct HandoffReport {
    pub flow: &'static str,
    pub requests: usize,
    /// Requests landed, bytes verified on the decode.
    pub landed: usize,
    /// Requests that failed on the sender, by reason.
    pub failed: HashMap<String, usize>,
    /// Requests whose two sides ended differently (one landed or waiting,
    /// the other failed), or a landed request whose bytes were wrong.
    pub disagreements: usize,
    /// Of those, the landed requests whose bytes were wrong.
    pub wrong_bytes: usize,
    /// Arrival to grant (sessions) or to the destination (today).
    pub grant_wait: Latency,
    /// Arrival to landed, as the sender learns it.
    pub time_to_landed: Latency,
    /// Sender's finish (all writes completed) to the decode seeing it landed.
    pub notify_delay: Latency,
    /// Most bytes in flight on any sender's engine, and the budget.
    pub max_inflight_bytes: u64,
    /// Most live endpoints on any sender.
    pub max_endpoints: usize,
    /// After the decode was killed: sessions open then, and the longest
    /// time any of them took to fail on its sender.
    pub open_at_kill: usize,
    pub slowest_fail_after_kill: Option<Duration>,
    pub elapsed: Duration,
    /// Times a session driver found its own timer a quarter of the
    /// liveness timeout late (a starved process), summed over the engines
    /// (sessions flow): next to a liveness failure, whether this process
    /// was short of CPU.
    pub pauses: u64,
}

fn pattern(sender: usize, id: u64, len: usize) -> Vec<u8> {
    let seed = (sender as u64).wrapping_mul(0x9E37_79B9).wrapping_add(id.wrapping_mul(31));
    (0..len).map(|i| (seed.wrapping_add(i as u64).wrapping_mul(0x2545_F491) >> 24) as u8).collect()
}

struct Node {
    engine: Engine,
    buf: Buffer,
    region: RegionId,
    name: String,
}

async fn node(cfg: &EngineConfig, bytes: usize) -> Result<Node> {
    let engine = kvmove::build(cfg).await?;
    let buf = Buffer::new(bytes.max(1)).map_err(|e| Error::new(ErrorKind::ResourceExhausted, e.to_string()))?;
    let region = engine.register(buf.region(), Access::REMOTE_RW)?;
    let name = engine.local_segment_name();
    Ok(Node { engine, buf, region, name })
}

fn limits(c: &HandoffConfig) -> SessionLimits {
    SessionLimits {
        heartbeat_interval: c.liveness / 5,
        liveness_timeout: c.liveness,
        max_sessions_per_peer: c.requests.max(1),
        max_sessions: c.requests.saturating_mul(c.senders).max(1),
        // Decode grants as soon as it has room, often before the sender
        // expects the id: every request may be granted ahead.
        max_unclaimed_per_peer: c.requests.max(1),
        max_unclaimed: c.requests.saturating_mul(c.senders).max(1),
        ..SessionLimits::default()
    }
}

/// Shared bookkeeping of a run.
#[derive(Default)]
struct Book {
    grant_wait: Vec<Duration>,
    landed_at_sender: Vec<Duration>,
    finish_at: HashMap<(usize, u64), Instant>,
    landed_at_decode: HashMap<(usize, u64), Instant>,
    sender_final: HashMap<(usize, u64), String>,
    decode_final: HashMap<(usize, u64), String>,
    bad_bytes: usize,
    fail_times: Vec<Instant>,
}

impl Book {
    /// The counts and latencies both flows report; `agree` says whether a
    /// request's final states on the sender and the decode match.
    fn report(&self, flow: Flow, agree: impl Fn(&str, Option<&str>) -> bool) -> HandoffReport {
        let mut failed: HashMap<String, usize> = HashMap::new();
        let mut disagreements = self.bad_bytes;
        for (k, st) in &self.sender_final {
            if st != "landed" {
                *failed.entry(st.clone()).or_default() += 1;
            }
            if !agree(st, self.decode_final.get(k).map(String::as_str)) {
                disagreements += 1;
            }
        }
        let notify_delay: Vec<Duration> = self
            .finish_at
            .iter()
            .filter_map(|(k, f)| self.landed_at_decode.get(k).map(|l| l.saturating_duration_since(*f)))
            .collect();
        HandoffReport {
            flow: flow.name(),
            landed: self.sender_final.values().filter(|s| *s == "landed").count(),
            failed,
            disagreements,
            wrong_bytes: self.bad_bytes,
            grant_wait: Latency::of(self.grant_wait.clone()),
            time_to_landed: Latency::of(self.landed_at_sender.clone()),
            notify_delay: Latency::of(notify_delay),
            ..HandoffReport::default()
        }
    }
}

/// Runs the scenario once with `flow` over the backend of `cfg`.
pub async fn run(cfg: &EngineConfig, c: &HandoffConfig, flow: Flow) -> Result<HandoffReport> {
    c.validate()?;
    let req = usize::try_from(c.request_bytes).map_err(|_| Error::new(ErrorKind::Config, "request too large"))?;
    let decode = node(cfg, req * c.decode_pages).await?;
    let mut senders = Vec::with_capacity(c.senders);
    for s in 0..c.senders {
        let n = node(cfg, req * c.requests).await?;
        for id in 0..c.requests {
            n.buf
                .write_at(id * req, &pattern(s, id as u64, req))
                .map_err(|e| Error::new(ErrorKind::Internal, e.to_string()))?;
        }
        senders.push(n);
    }
    match flow {
        Flow::Sessions => run_sessions(c, req, decode, senders).await,
        Flow::Today => run_today(c, req, decode, senders).await,
    }
}

/// Samples the senders' in-flight bytes and endpoints until stopped.
fn sampler(engines: Vec<Engine>) -> (tokio::task::JoinHandle<(u64, usize)>, tokio::sync::watch::Sender<bool>) {
    let (tx, mut rx) = tokio::sync::watch::channel(false);
    let h = tokio::spawn(async move {
        let (mut bytes, mut eps) = (0u64, 0usize);
        loop {
            for e in &engines {
                bytes = bytes.max(e.inflight().bytes);
                eps = eps.max(e.stats().endpoints);
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(2)) => {}
                _ = rx.changed() => return (bytes, eps),
            }
        }
    });
    (h, tx)
}

async fn run_sessions(c: &HandoffConfig, req: usize, decode: Node, senders: Vec<Node>) -> Result<HandoffReport> {
    let start = Instant::now();
    let book = Arc::new(Mutex::new(Book::default()));
    let dsess = Sessions::start(decode.engine.clone(), limits(c))?;
    let mut ssess = Vec::new();
    for n in &senders {
        ssess.push(Sessions::start(n.engine.clone(), limits(c))?);
    }
    let names: Vec<String> = senders.iter().map(|n| n.name.clone()).collect();
    let (sample, stop_sample) = sampler(senders.iter().map(|n| n.engine.clone()).collect());

    // The decode: every request asks at once (round robin over senders);
    // the pool grants them in that order as pages free.
    let asks: Vec<(usize, u64)> = (0..c.requests as u64).flat_map(|id| (0..c.senders).map(move |s| (s, id))).collect();
    let decode_task = {
        let dsess = dsess.clone();
        let book = book.clone();
        let names = names.clone();
        let (hold, deadline, pages) = (c.hold, c.grant_deadline, c.decode_pages);
        let dbuf = decode.buf.clone();
        let base = decode.buf.addr();
        tokio::spawn(async move {
            let pool = Arc::new(Mutex::new(GrantPool::new(0..pages as u64, asks.len(), asks.len())));
            for &(s, id) in &asks {
                pool.lock().ask(&names[s], id);
            }
            // A page given back wakes the loop (a permit is kept when it
            // does not wait).
            let freed = Arc::new(tokio::sync::Notify::new());
            loop {
                let (next, waiting) = {
                    let mut p = pool.lock();
                    (p.next_grant(), p.queued())
                };
                let ((peer, id), page) = match next {
                    Some(g) => g,
                    None if waiting == 0 => return,
                    None => {
                        freed.notified().await;
                        continue;
                    }
                };
                let Some(s) = names.iter().position(|n| *n == peer) else { continue };
                let Ok(page_no) = usize::try_from(page) else { continue };
                let addr = base + (page_no * req) as u64;
                let g = Grant { ranges: vec![(addr, req as u64)], expected: req as u64, deadline };
                if dsess.grant(&peer, id, g).await.is_err() {
                    book.lock().decode_final.insert((s, id), "grant refused".into());
                    pool.lock().release(page);
                    continue;
                }
                let (dsess, book, pool, freed, dbuf) =
                    (dsess.clone(), book.clone(), pool.clone(), freed.clone(), dbuf.clone());
                tokio::spawn(async move {
                    let key = SessionKey::new(peer, id, Role::Receiver);
                    let st = dsess.wait(&key).await;
                    let at = Instant::now();
                    let name = match &st {
                        Ok(st) => st.name().to_string(),
                        Err(e) => format!("error: {}", e.kind()),
                    };
                    if matches!(st, Ok(SessionState::Landed)) {
                        let mut got = vec![0u8; req];
                        let ok = dbuf.read_at(page_no * req, &mut got).is_ok() && got == pattern(s, id, req);
                        let mut b = book.lock();
                        b.landed_at_decode.insert((s, id), at);
                        if !ok {
                            b.bad_bytes += 1;
                        }
                    }
                    book.lock().decode_final.insert((s, id), name);
                    let _ = dsess.release(&key);
                    tokio::time::sleep(hold).await;
                    pool.lock().release(page);
                    freed.notify_one();
                });
            }
        })
    };

    // The senders: every request arrives now and waits for its grant.
    let mut tasks = Vec::new();
    for (s, n) in senders.iter().enumerate() {
        for id in 0..c.requests as u64 {
            let sess = ssess[s].clone();
            let book = book.clone();
            let peer = decode.name.clone();
            let region = n.region;
            let layers = u64::from(c.layers);
            tasks.push(tokio::spawn(async move {
                let arrival = Instant::now();
                let key = SessionKey::new(peer.clone(), id, Role::Sender);
                let result: Result<SessionState> = async {
                    let g = sess.wait_grant(&peer, id).await?;
                    book.lock().grant_wait.push(arrival.elapsed());
                    let seg = sess.segment(&peer).await?;
                    let (addr, len) = g.ranges[0];
                    let chunk = len.div_ceil(layers);
                    let mut off = 0;
                    while off < len {
                        let l = chunk.min(len - off);
                        let r = TransferRequest::write(region, id * len + off, seg, addr + off, l);
                        sess.write(&peer, id, vec![r]).await?.into_result()?;
                        off += l;
                    }
                    sess.finish(&peer, id)?;
                    book.lock().finish_at.insert((s, id), Instant::now());
                    sess.wait(&key).await
                }
                .await;
                let final_state = match result {
                    Ok(st) => st,
                    // A write refused or given up: the session's own state says the rest.
                    Err(_) => sess.wait(&key).await.unwrap_or(SessionState::Failed(Error::shut_down())),
                };
                let mut b = book.lock();
                if final_state == SessionState::Landed {
                    b.landed_at_sender.push(arrival.elapsed());
                } else {
                    b.fail_times.push(Instant::now());
                }
                let name = match &final_state {
                    SessionState::Failed(e) => format!("failed: {}", e.kind()),
                    other => other.name().to_string(),
                };
                b.sender_final.insert((s, id), name);
                drop(b);
                let _ = sess.release(&key);
            }));
        }
    }

    // The kill, if asked: the decode's engine and session driver stop.
    let mut kill_at = None;
    let mut open_at_kill = 0;
    if let Some(after) = c.kill_decode_after {
        tokio::time::sleep(after).await;
        open_at_kill = ssess.iter().map(|s| s.counts().open).sum();
        kill_at = Some(Instant::now());
        decode_task.abort();
        dsess.shutdown().await;
        let _ = decode.engine.shutdown().await;
    }
    for t in tasks {
        let _ = t.await;
    }
    if kill_at.is_none() {
        let _ = decode_task.await;
        // The last requests' decode watchers record their final state: a
        // session ends on the decode at the latest at its deadline (plus
        // the liveness timeout), which a loaded machine may near.
        let want = c.requests * c.senders;
        let until = Instant::now() + c.grant_deadline + c.liveness * 2;
        while book.lock().decode_final.len() < want && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    let _ = stop_sample.send(true);
    let (max_inflight_bytes, max_endpoints) = sample.await.unwrap_or((0, 0));
    let elapsed = start.elapsed();
    let pauses = ssess.iter().chain([&dsess]).map(Sessions::pauses).sum();
    for s in &ssess {
        s.shutdown().await;
    }
    if kill_at.is_none() {
        dsess.shutdown().await;
    }
    for n in &senders {
        let _ = n.engine.shutdown().await;
    }
    let _ = decode.engine.shutdown().await;

    // After a kill the decode's side is gone: nothing to agree with.
    let agree = |sender: &str, decode: Option<&str>| {
        kill_at.is_some()
            || match (sender, decode.unwrap_or("unknown")) {
                (a, b) if a == b => true,
                (a, b) => a.starts_with("failed") && b.starts_with("failed"),
            }
    };
    let mut r = book.lock().report(Flow::Sessions, agree);
    r.requests = c.requests * c.senders;
    r.max_inflight_bytes = max_inflight_bytes;
    r.max_endpoints = max_endpoints;
    r.pauses = pauses;
    r.open_at_kill = open_at_kill;
    r.slowest_fail_after_kill = kill_at
        .map(|k| book.lock().fail_times.iter().map(|t| t.saturating_duration_since(k)).max().unwrap_or_default());
    r.elapsed = elapsed;
    Ok(r)
}

/// The decode's DONE waiters, by (sender, request id).
type Waiters = HashMap<(usize, u64), tokio::sync::oneshot::Sender<()>>;

/// Today's way: plain messages and timeouts from arrival, on each side.
async fn run_today(c: &HandoffConfig, req: usize, decode: Node, senders: Vec<Node>) -> Result<HandoffReport> {
    let start = Instant::now();
    let book = Arc::new(Mutex::new(Book::default()));
    let names: Vec<String> = senders.iter().map(|n| n.name.clone()).collect();
    let (sample, stop_sample) = sampler(senders.iter().map(|n| n.engine.clone()).collect());
    let index: HashMap<String, usize> = names.iter().cloned().enumerate().map(|(i, n)| (n, i)).collect();

    // Decode: allocate in arrival order, send DEST, wait for DONE up to the
    // timeout (counted from its DEST), then free.
    let dt = decode.engine.clone();
    let waiting_done: Arc<Mutex<Waiters>> = Arc::default();
    let decode_reader = {
        let dt = dt.clone();
        let waiting_done = waiting_done.clone();
        let index = index.clone();
        tokio::spawn(async move {
            while dt.wait_notification().await.is_ok() {
                let Ok(ns) = dt.take_notifications(256) else { return };
                for n in ns {
                    let (Some(&s), Ok(b)) = (index.get(&n.from), <[u8; 8]>::try_from(n.msg.as_slice())) else {
                        continue;
                    };
                    if let Some(tx) = waiting_done.lock().remove(&(s, u64::from_le_bytes(b))) {
                        let _ = tx.send(());
                    }
                }
            }
        })
    };
    let mut dsegs = Vec::new();
    for n in &names {
        dsegs.push(dt.open_segment(n).await?);
    }
    let decode_task = {
        let (dt, book, waiting_done, dbuf) = (dt.clone(), book.clone(), waiting_done.clone(), decode.buf.clone());
        let (hold, timeout, pages, base) = (c.hold, c.arrival_timeout, c.decode_pages, decode.buf.addr());
        let pending: VecDeque<(usize, u64)> =
            (0..c.requests as u64).flat_map(|id| (0..c.senders).map(move |s| (s, id))).collect();
        tokio::spawn(async move {
            let mut pending = pending;
            let (free_tx, mut free_rx) = tokio::sync::mpsc::unbounded_channel::<usize>();
            for p in 0..pages {
                let _ = free_tx.send(p);
            }
            while let Some((s, id)) = pending.pop_front() {
                let Some(page) = free_rx.recv().await else { return };
                let addr = base + (page * req) as u64;
                let (tx, rx) = tokio::sync::oneshot::channel();
                waiting_done.lock().insert((s, id), tx);
                let mut msg = id.to_le_bytes().to_vec();
                msg.extend_from_slice(&addr.to_le_bytes());
                let sent = dt.notify(dsegs[s], msg).await;
                let (book, free_tx, dbuf, waiting_done) =
                    (book.clone(), free_tx.clone(), dbuf.clone(), waiting_done.clone());
                tokio::spawn(async move {
                    let done = sent.is_ok() && tokio::time::timeout(timeout, rx).await.is_ok_and(|r| r.is_ok());
                    let at = Instant::now();
                    waiting_done.lock().remove(&(s, id));
                    {
                        let mut b = book.lock();
                        if done {
                            let mut got = vec![0u8; req];
                            if dbuf.read_at(page * req, &mut got).is_err() || got != pattern(s, id, req) {
                                b.bad_bytes += 1;
                            }
                            b.landed_at_decode.insert((s, id), at);
                            b.decode_final.insert((s, id), "landed".into());
                        } else {
                            b.decode_final.insert((s, id), "failed: timeout".into());
                        }
                    }
                    tokio::time::sleep(hold).await;
                    let _ = free_tx.send(page);
                });
            }
        })
    };

    // Senders: one reader per sender routes DEST messages to the requests.
    let mut tasks = Vec::new();
    let mut readers = Vec::new();
    for (s, n) in senders.iter().enumerate() {
        let t = n.engine.clone();
        let dests: Arc<Mutex<HashMap<u64, tokio::sync::oneshot::Sender<u64>>>> = Arc::default();
        let early: Arc<Mutex<HashMap<u64, u64>>> = Arc::default();
        {
            let (t, dests, early) = (t.clone(), dests.clone(), early.clone());
            readers.push(tokio::spawn(async move {
                while t.wait_notification().await.is_ok() {
                    let Ok(ns) = t.take_notifications(256) else { return };
                    for n in ns {
                        if n.msg.len() != 16 {
                            continue;
                        }
                        let id = u64::from_le_bytes(n.msg[..8].try_into().unwrap_or_default());
                        let addr = u64::from_le_bytes(n.msg[8..].try_into().unwrap_or_default());
                        match dests.lock().remove(&id) {
                            Some(tx) => {
                                let _ = tx.send(addr);
                            }
                            None => {
                                early.lock().insert(id, addr);
                            }
                        }
                    }
                }
            }));
        }
        let seg = n.engine.open_segment(&decode.name).await?;
        for id in 0..c.requests as u64 {
            let (engine, t, book, dests, early) =
                (n.engine.clone(), t.clone(), book.clone(), dests.clone(), early.clone());
            let (region, timeout, layers) = (n.region, c.arrival_timeout, u64::from(c.layers));
            tasks.push(tokio::spawn(async move {
                let arrival = Instant::now();
                let (tx, rx) = tokio::sync::oneshot::channel();
                let ready = early.lock().remove(&id);
                let addr = match ready {
                    Some(a) => Some(a),
                    None => {
                        dests.lock().insert(id, tx);
                        tokio::time::timeout(timeout, rx).await.ok().and_then(|r| r.ok())
                    }
                };
                let result: Result<()> = async {
                    let Some(addr) = addr else {
                        dests.lock().remove(&id);
                        return Err(Error::new(ErrorKind::Timeout, "bootstrap timeout"));
                    };
                    book.lock().grant_wait.push(arrival.elapsed());
                    let len = req as u64;
                    let chunk = len.div_ceil(layers);
                    let mut off = 0;
                    while off < len {
                        let left = timeout.saturating_sub(arrival.elapsed());
                        if left.is_zero() {
                            return Err(Error::new(ErrorKind::Timeout, "transfer timeout"));
                        }
                        let l = chunk.min(len - off);
                        let r = TransferRequest::write(region, id * len + off, seg, addr + off, l);
                        let t = engine.submit(vec![r]).await?;
                        match tokio::time::timeout(left, t.wait()).await {
                            Ok(o) => {
                                o?.into_result()?;
                            }
                            Err(_) => return Err(Error::new(ErrorKind::Timeout, "transfer timeout")),
                        }
                        off += l;
                    }
                    book.lock().finish_at.insert((s, id), Instant::now());
                    // "Done" after completion, best effort (as connectors do).
                    t.notify(seg, id.to_le_bytes().to_vec()).await
                }
                .await;
                let mut b = book.lock();
                let name = match result {
                    Ok(()) => {
                        b.landed_at_sender.push(arrival.elapsed());
                        "landed".to_string()
                    }
                    Err(e) => {
                        b.fail_times.push(Instant::now());
                        format!("failed: {}", e.kind())
                    }
                };
                b.sender_final.insert((s, id), name);
            }));
        }
    }
    for t in tasks {
        let _ = t.await;
    }
    let _ = decode_task.await;
    let want = c.requests * c.senders;
    let until = Instant::now() + c.arrival_timeout + c.hold * 2 + Duration::from_millis(500);
    while book.lock().decode_final.len() < want && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let _ = stop_sample.send(true);
    let (max_inflight_bytes, max_endpoints) = sample.await.unwrap_or((0, 0));
    let elapsed = start.elapsed();
    decode_reader.abort();
    for r in readers {
        r.abort();
    }
    for n in &senders {
        let _ = n.engine.shutdown().await;
    }
    let _ = decode.engine.shutdown().await;

    // Today the two sides agree only on whether the request landed.
    let agree = |sender: &str, decode: Option<&str>| (sender == "landed") == (decode == Some("landed"));
    let mut r = book.lock().report(Flow::Today, agree);
    r.requests = want;
    r.max_inflight_bytes = max_inflight_bytes;
    r.max_endpoints = max_endpoints;
    r.elapsed = elapsed;
    Ok(r)
}

#[cfg(test)]
mod tests;
