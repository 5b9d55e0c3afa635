//! `kvmove pd`: one engine of a prefill/decode cluster, driven by a router
//! over its stdin and reporting over its stdout (one JSON object a line).
//!
//! Every request is a handoff session (rules 12 and 13):
//!
//! - A **decode** (`--role decode`) serves a KV pool of `--pages` pages of
//!   `--page-kib` KiB. A prefill asks for a page with the plain
//!   notification `kvmove/pd ask <id>`; the decode grants a free page (the
//!   whole page, its bytes expected) when its pool has room, in the order
//!   asks came, and queues the ask otherwise (a saturated decode makes
//!   prefills wait, it does not fail them). When a session lands the decode
//!   checks every byte of the page against the request's pattern, keeps the
//!   page `--hold-ms` (decoding) and frees it.
//! - A **prefill** (`--role prefill`) reads `req <id> <decode>` lines on
//!   stdin: it resolves the decode's name in the metadata store, asks it,
//!   waits for the grant (asking again every [`crate::sessions::REASK`]),
//!   writes the request's pattern into the granted page in `--writes`
//!   writes (layer by layer), finishes and waits for the outcome. A request
//!   not ended within `--request-timeout-ms` is cancelled (both ends agree).
//!
//! Both roles print `{"ev":"end",...}` for every session they end, with the
//! final state, so a runner can compare the two ends of each request; and
//! `{"ev":"ready",...}` once published. The engine stops on stdin's end or
//! SIGTERM and prints `{"ev":"bye",...}`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvmove::{Access, Buffer, Engine, Error, ErrorKind, MetadataStore, RegionId, TransferRequest};
use kvmove_policy::session::{Grant, GrantPool, Role, SessionKey, SessionLimits, SessionState, RECENT_ASKS};
use kvmove_policy::Sessions;
use tokio::io::AsyncBufReadExt;
use tokio::sync::Semaphore;

use crate::args::{PdArgs, PdRole};
use crate::commands::Outcome;
use crate::sessions::lock;
use crate::settings::Settings;

const PREFIX: &str = "kvmove/pd ask ";

/// Asks a decode keeps queued at most; one over it is dropped (its prefill
/// asks again).
const MAX_QUEUED: usize = 4096;

fn config_err(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::Config, msg)
}

/// Milliseconds since the Unix epoch: the runner reads events against the
/// times of the faults it made.
fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn emit(v: serde_json::Value) {
    use std::io::Write;
    let mut o = std::io::stdout().lock();
    let _ = writeln!(o, "{v}");
    let _ = o.flush();
}

/// The 8-byte word `i` of request `id`'s KV bytes.
fn word(id: u64, i: u64) -> u64 {
    id.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i.wrapping_mul(0xc2b2_ae3d_27d4_eb4f)
}

/// Request `id`'s bytes, `len` of them (a multiple of 8).
fn pattern(id: u64, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len);
    for i in 0..(len / 8) as u64 {
        v.extend_from_slice(&word(id, i).to_le_bytes());
    }
    v
}

fn state_json(st: &SessionState) -> (String, Option<String>) {
    match st {
        SessionState::Failed(e) => (st.name().to_owned(), Some(format!("{}: {}", e.kind().as_str(), e.message()))),
        _ => (st.name().to_owned(), None),
    }
}

/// Session bounds for a cluster engine.
fn limits(args: &PdArgs) -> kvmove::Result<SessionLimits> {
    if !(50..=600_000).contains(&args.liveness_ms) {
        return Err(config_err("--liveness-ms must be 50 to 600000"));
    }
    let liveness = Duration::from_millis(args.liveness_ms);
    let room = args.max_inflight.max(args.pages).saturating_mul(4).saturating_add(64);
    let d = SessionLimits::default();
    Ok(SessionLimits {
        liveness_timeout: liveness,
        heartbeat_interval: liveness / 4,
        max_sessions: d.max_sessions.max(room),
        max_sessions_per_peer: d.max_sessions_per_peer.max(room),
        max_unclaimed: d.max_unclaimed.max(room),
        max_unclaimed_per_peer: d.max_unclaimed_per_peer.max(room),
        ..d
    })
}

fn page_len(args: &PdArgs) -> kvmove::Result<u64> {
    if !(1..=65_536).contains(&args.page_kib) {
        return Err(config_err("--page-kib must be 1 to 65536"));
    }
    Ok(args.page_kib * 1024)
}

/// `kvmove pd`.
pub async fn run(s: &Settings, args: &PdArgs) -> kvmove::Result<Outcome> {
    if s.backend.kind == kvmove::BackendKind::Mock {
        return Err(config_err("kvmove pd runs one engine per process; use --backend tcp or rdma"));
    }
    if !(1..=4096).contains(&args.pages) || !(1..=4096).contains(&args.max_inflight) {
        return Err(config_err("--pages and --max-inflight must be 1 to 4096"));
    }
    if !(1..=1024).contains(&args.writes) {
        return Err(config_err("--writes must be 1 to 1024"));
    }
    if args.hold_ms > 600_000 || args.compute_ms > 600_000 || !(1..=3_600_000).contains(&args.request_timeout_ms) {
        return Err(config_err("--hold-ms and --compute-ms must be at most 600000, --request-timeout-ms 1 to 3600000"));
    }
    let page = page_len(args)?;
    let limits = limits(args)?;
    let engine = kvmove::build(&s.engine()).await?;
    let r = serve(s, args, &engine, page, limits).await;
    let _ = engine.shutdown().await;
    r
}

async fn serve(
    s: &Settings,
    args: &PdArgs,
    engine: &Engine,
    page: u64,
    limits: SessionLimits,
) -> kvmove::Result<Outcome> {
    let slots = match args.role {
        PdRole::Decode => args.pages,
        PdRole::Prefill => args.max_inflight,
    };
    let len = page
        .checked_mul(slots as u64)
        .and_then(|l| usize::try_from(l).ok())
        .ok_or_else(|| config_err("--page-kib times the pages does not fit in memory"))?;
    let buf = Buffer::new(len).map_err(|e| Error::from(e).with("buffer", "KV pool"))?;
    let access = match args.role {
        PdRole::Decode => Access::REMOTE_WRITE,
        PdRole::Prefill => Access::LOCAL,
    };
    let region = engine.register(buf.region(), access)?;
    let store = kvmove::build_metadata(&s.metadata).await?;
    let name = s.target.name.clone();
    if let Some(store) = &store {
        kvmove::publish(engine, store.as_ref(), &name).await?;
    }
    let sess = Sessions::start(engine.clone(), limits)?;
    emit(serde_json::json!({
        "ev": "ready", "t": now_ms(), "name": name, "segment": sess.name(),
        "role": args.role.as_str(), "pid": std::process::id(), "bytes": len,
    }));
    let ended = match args.role {
        PdRole::Decode => {
            let d = Arc::new(Decode::new(sess.clone(), buf, page, args));
            let task = tokio::spawn(d.clone().listen());
            let why = crate::commands::shutdown_signal().await;
            task.abort();
            why
        }
        PdRole::Prefill => {
            let p = Arc::new(Prefill {
                sess: sess.clone(),
                store: store.clone(),
                buf,
                region,
                page,
                writes: args.writes,
                compute: Duration::from_millis(args.compute_ms),
                timeout: Duration::from_millis(args.request_timeout_ms),
                slots: Mutex::new((0..args.max_inflight).collect()),
                room: Semaphore::new(args.max_inflight),
                peers: Mutex::default(),
            });
            tokio::select! {
                why = crate::commands::shutdown_signal() => why,
                why = p.clone().requests() => why,
            }
        }
    };
    if let Some(store) = &store {
        let _ = tokio::time::timeout(Duration::from_secs(3), store.remove(&name)).await;
    }
    let counts = sess.counts();
    sess.shutdown().await;
    emit(serde_json::json!({"ev": "bye", "t": now_ms(), "why": ended, "sessions": format!("{counts:?}")}));
    Ok(Outcome::Ok)
}

// ------------------------------------------------------------------ decode

struct Decode {
    sess: Sessions,
    buf: Buffer,
    page: u64,
    hold: Duration,
    deadline: Duration,
    /// Page offsets in the pool buffer, and the asks waiting for them.
    pool: Mutex<GrantPool>,
}

impl Decode {
    fn new(sess: Sessions, buf: Buffer, page: u64, args: &PdArgs) -> Decode {
        let pages = (0..args.pages as u64).map(|i| i * page);
        Decode {
            sess,
            buf,
            page,
            hold: Duration::from_millis(args.hold_ms),
            deadline: Duration::from_millis(args.request_timeout_ms),
            pool: Mutex::new(GrantPool::new(pages, MAX_QUEUED, RECENT_ASKS)),
        }
    }

    async fn listen(self: Arc<Self>) {
        loop {
            if self.sess.wait_notification().await.is_err() {
                return;
            }
            for n in self.sess.take_notifications(256) {
                let Some(id) = std::str::from_utf8(&n.msg)
                    .ok()
                    .and_then(|t| t.strip_prefix(PREFIX))
                    .and_then(|t| t.parse::<u64>().ok())
                    .filter(|&id| id != 0)
                else {
                    tracing::debug!(peer = %n.from, len = n.msg.len(), "notification ignored");
                    continue;
                };
                lock(&self.pool).ask(&n.from, id);
            }
            self.clone().grant_free();
        }
    }

    /// Grants queued asks while pages are free.
    fn grant_free(self: Arc<Self>) {
        loop {
            let Some(((peer, id), off)) = lock(&self.pool).next_grant() else { return };
            tokio::spawn(self.clone().session(peer, id, off));
        }
    }

    async fn session(self: Arc<Self>, peer: String, id: u64, off: u64) {
        let grant =
            Grant { ranges: vec![(self.buf.addr() + off, self.page)], expected: self.page, deadline: self.deadline };
        let key = SessionKey::new(peer.clone(), id, Role::Receiver);
        let granted = Instant::now();
        let st = match self.sess.grant(&peer, id, grant).await {
            Ok(()) => self.sess.wait(&key).await,
            Err(e) => {
                // Forget the ask so the prefill's next ask is taken.
                lock(&self.pool).unsent(&(peer.clone(), id), off);
                tracing::warn!(peer = %peer, id, error = %e, "cannot grant");
                return;
            }
        };
        let Ok(st) = st else { return }; // shutting down
        let verified = (st == SessionState::Landed).then(|| self.verify(id, off));
        let (state, why) = state_json(&st);
        emit(serde_json::json!({
            "ev": "end", "t": now_ms(), "role": "decode", "id": id, "peer": peer, "state": state,
            "why": why, "verified": verified, "ms": granted.elapsed().as_secs_f64() * 1e3,
        }));
        let _ = self.sess.release(&key);
        if st == SessionState::Landed {
            tokio::time::sleep(self.hold).await;
        }
        lock(&self.pool).release(off);
        self.grant_free();
    }

    fn verify(&self, id: u64, off: u64) -> bool {
        let Ok(len) = usize::try_from(self.page) else { return false };
        let Ok(at) = usize::try_from(off) else { return false };
        let mut got = vec![0u8; len];
        self.buf.read_at(at, &mut got).is_ok() && got == pattern(id, len)
    }
}

// ----------------------------------------------------------------- prefill

struct Prefill {
    sess: Sessions,
    store: Option<Arc<dyn MetadataStore>>,
    buf: Buffer,
    region: RegionId,
    page: u64,
    writes: u32,
    compute: Duration,
    timeout: Duration,
    slots: Mutex<Vec<usize>>,
    room: Semaphore,
    /// Decode names looked up: the segment name sessions use, and whether
    /// it is still trusted (false after a request to it did not land).
    peers: Mutex<HashMap<String, (String, bool)>>,
}

impl Prefill {
    async fn requests(self: Arc<Self>) -> &'static str {
        let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
        loop {
            let line = match lines.next_line().await {
                Ok(Some(l)) => l,
                Ok(None) => return "stdin closed",
                Err(_) => return "stdin unreadable",
            };
            let mut w = line.split_whitespace();
            let (Some("req"), Some(id), Some(decode), None) = (w.next(), w.next(), w.next(), w.next()) else {
                emit(serde_json::json!({"ev": "bad-line", "t": now_ms(), "line": line}));
                continue;
            };
            let Some(id) = id.parse::<u64>().ok().filter(|&i| i != 0) else {
                emit(serde_json::json!({"ev": "bad-line", "t": now_ms(), "line": line}));
                continue;
            };
            let decode = decode.to_owned();
            let Ok(permit) = self.room.try_acquire() else {
                emit(serde_json::json!({
                    "ev": "end", "t": now_ms(), "role": "prefill", "id": id, "decode": decode,
                    "state": "refused", "why": "busy: --max-inflight requests in flight",
                }));
                continue;
            };
            permit.forget();
            let me = self.clone();
            tokio::spawn(async move {
                me.request(id, decode).await;
                me.room.add_permits(1);
            });
        }
    }

    /// The segment name of the decode published as `decode`: looked up once
    /// and kept; looked up again after a request to it did not land (it may
    /// have restarted elsewhere). When the store cannot answer (an etcd
    /// member down, an election), the last address known is used: requests
    /// between live engines do not wait for the metadata store.
    async fn peer(&self, decode: &str) -> kvmove::Result<String> {
        let cached = lock(&self.peers).get(decode).cloned();
        if let Some((seg, true)) = &cached {
            return Ok(seg.clone());
        }
        let looked_up = match &self.store {
            Some(store) => store.get(decode).await.and_then(|d| {
                d.map(|d| d.address)
                    .ok_or_else(|| Error::new(ErrorKind::NotFound, format!("nothing is published as '{decode}'")))
            }),
            None => Ok(decode.to_owned()),
        };
        match (looked_up, cached) {
            (Ok(seg), _) => {
                lock(&self.peers).insert(decode.to_owned(), (seg.clone(), true));
                Ok(seg)
            }
            (Err(e), Some((seg, _))) if e.kind() != ErrorKind::NotFound => {
                tracing::warn!(decode, error = %e, "the metadata store did not answer; using the last known address");
                Ok(seg)
            }
            (Err(e), _) => Err(e),
        }
    }

    async fn request(&self, id: u64, decode: String) {
        let start = Instant::now();
        let mut granted_ms = None;
        let r = match self.peer(&decode).await {
            Err(e) => Err(e),
            Ok(peer) => {
                let key = SessionKey::new(peer.clone(), id, Role::Sender);
                let run = self.handoff(&peer, id, &mut granted_ms);
                let st = match tokio::time::timeout(self.timeout, run).await {
                    Ok(r) => r,
                    Err(_) => self.sess.cancel(&key).await,
                };
                let _ = self.sess.release(&key);
                st.map(|st| (peer, st))
            }
        };
        let (peer, state, why) = match r {
            Ok((peer, st)) => {
                let (state, why) = state_json(&st);
                (Some(peer), state, why)
            }
            Err(e) => (None, "error".to_owned(), Some(format!("{}: {}", e.kind().as_str(), e.message()))),
        };
        if state != "landed" {
            // The decode may have restarted elsewhere: look it up again.
            if let Some(p) = lock(&self.peers).get_mut(&decode) {
                p.1 = false;
            }
        }
        emit(serde_json::json!({
            "ev": "end", "t": now_ms(), "role": "prefill", "id": id, "decode": decode, "peer": peer,
            "state": state, "why": why, "grant_ms": granted_ms, "ms": start.elapsed().as_secs_f64() * 1e3,
        }));
    }

    /// One request's session: ask, grant, writes, finish, outcome.
    async fn handoff(&self, peer: &str, id: u64, granted_ms: &mut Option<f64>) -> kvmove::Result<SessionState> {
        let start = Instant::now();
        self.sess.expect(peer, id)?;
        let key = SessionKey::new(peer, id, Role::Sender);
        let grant = loop {
            self.ask(peer, id).await?;
            match tokio::time::timeout(crate::sessions::REASK, self.sess.wait_grant(peer, id)).await {
                Ok(Ok(g)) => break g,
                Ok(Err(_)) => return self.sess.wait(&key).await,
                Err(_) => {}
            }
        };
        *granted_ms = Some(start.elapsed().as_secs_f64() * 1e3);
        let &[(addr, len)] = grant.ranges.as_slice() else {
            return self.sess.cancel(&key).await;
        };
        if len != self.page || grant.expected != self.page {
            tracing::warn!(peer, id, len, "the decode granted another page size than --page-kib; cancelled");
            return self.sess.cancel(&key).await;
        }
        let slot = lock(&self.slots).pop();
        let Some(slot) = slot else { return self.sess.cancel(&key).await };
        let r = self.write(peer, id, slot, addr).await;
        lock(&self.slots).push(slot);
        if let Err(e) = r {
            tracing::debug!(peer, id, error = %e, "write failed");
            return self.sess.wait(&key).await;
        }
        self.sess.finish(peer, id)?;
        self.sess.wait(&key).await
    }

    async fn write(&self, peer: &str, id: u64, slot: usize, addr: u64) -> kvmove::Result<()> {
        let len = usize::try_from(self.page).map_err(|_| config_err("page too large"))?;
        let at = slot * len;
        self.buf.write_at(at, &pattern(id, len)).map_err(Error::from)?;
        let seg = self.sess.segment(peer).await?;
        let writes = u64::from(self.writes).min(self.page / 8).max(1);
        let step = (self.page / writes) & !7;
        for w in 0..writes {
            if !self.compute.is_zero() {
                tokio::time::sleep(self.compute).await; // the layer's forward pass
            }
            let off = w * step;
            let n = if w + 1 == writes { self.page - off } else { step };
            let req = TransferRequest::write(self.region, at as u64 + off, seg, addr + off, n);
            self.sess.write(peer, id, vec![req]).await?.into_result()?;
        }
        Ok(())
    }

    async fn ask(&self, peer: &str, id: u64) -> kvmove::Result<()> {
        crate::sessions::notify(&self.sess, peer, format!("{PREFIX}{id}")).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_differ_by_request_and_position() {
        let a = pattern(7, 4096);
        assert_eq!(a.len(), 4096);
        assert_ne!(a, pattern(8, 4096));
        assert_ne!(a[..8], a[8..16]);
        assert_eq!(a, pattern(7, 4096));
    }
}
