//! `EtcdStore` against a real etcd server.
//!
//! Each test starts its own `etcd` on loopback (free ports, a temporary data
//! directory) and kills it at the end, also when the test panics. Where the
//! binary is missing every test is reported *ignored* (and the run says
//! why, once), except under `CI=true`, where that is a failure: CI installs
//! etcd with `transport-etcd/install-etcd.sh`. `ETCD_BIN` names another
//! binary. A `harness = false` target (libtest-mimic), so a test that did
//! not run never counts as passed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::future::Future;
use std::io::Write;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use transport_core::{Access, ErrorKind, MetadataStore, RegionInfo, SegmentDescriptor};
use transport_etcd::{EtcdConfig, EtcdStore, SegmentWatch};

/// Every test ends within this, whatever etcd does.
const TEST_LIMIT: Duration = Duration::from_secs(90);

// ---------------------------------------------------------------- harness

/// A running etcd server, killed and cleaned up on drop.
struct Etcd {
    child: Child,
    dir: PathBuf,
    url: String,
    /// The member name, unique to this server.
    name: String,
}

impl Etcd {
    /// Starts etcd and waits (bounded) until it answers. `None`: etcd is not
    /// installed (`main` then reports the test ignored and never runs it).
    ///
    /// Ports come from `bind(0)` and are free only until etcd binds them, so
    /// two starts at once could pick the same port: one etcd then fails to
    /// bind, and its test could find the *other* test's etcd answering on
    /// that port (etcd serves its client API on the peer port too) and lose
    /// it when that test kills its server. So starts in this process go one
    /// at a time, a server counts as ready only when it names itself as this
    /// member on this URL, and a start that lost a port to another process
    /// tries again with fresh ports.
    async fn start() -> Option<Etcd> {
        let bin = etcd_binary()?;
        static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
        let _serial = ONE_AT_A_TIME.lock().await;
        let mut failures = Vec::new();
        for _ in 0..5 {
            let mut etcd = Etcd::spawn(&bin);
            match etcd.wait_ready().await {
                Ok(()) => return Some(etcd),
                Err(why) => failures.push(why),
            }
        }
        panic!("etcd did not start in 5 tries:\n{}", failures.join("\n----\n"));
    }

    fn spawn(bin: &std::path::Path) -> Etcd {
        static SEQ: AtomicUsize = AtomicUsize::new(0);
        let name = format!("kvmove-etcd-test-{}-{}", std::process::id(), SEQ.fetch_add(1, Ordering::SeqCst));
        let dir = std::env::temp_dir().join(&name);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let (client_port, peer_port) = (free_port(), free_port());
        let url = format!("http://127.0.0.1:{client_port}");
        let peer = format!("http://127.0.0.1:{peer_port}");
        let log = std::fs::File::create(dir.join("etcd.log")).unwrap();
        let child = Command::new(bin)
            .arg("--name")
            .arg(&name)
            .arg("--data-dir")
            .arg(dir.join("data"))
            .arg("--listen-client-urls")
            .arg(&url)
            .arg("--advertise-client-urls")
            .arg(&url)
            .arg("--listen-peer-urls")
            .arg(&peer)
            .arg("--initial-advertise-peer-urls")
            .arg(&peer)
            .arg("--initial-cluster")
            .arg(format!("{name}={peer}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
        Etcd { child, dir, url, name }
    }

    /// Waits (bounded) until this server answers on its URL as itself. An
    /// `Err` (with the reason and the server's log) when it exited or never
    /// did; the server is then gone.
    async fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Err(format!("etcd at {} exited during start ({status}); its log:\n{}", self.url, self.log()));
            }
            match self.answers_as_itself().await {
                Ok(()) => return Ok(()),
                Err(e) if Instant::now() > deadline => {
                    self.kill();
                    return Err(format!("etcd at {} not ready within 20 s: {e}; its log:\n{}", self.url, self.log()));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    /// Whether the server on `url` is this one (its member list names this
    /// member with this client URL), and an `EtcdStore` can use it.
    async fn answers_as_itself(&self) -> Result<(), String> {
        let connect = etcd_client::Client::connect([self.url.as_str()], None);
        let mut raw = tokio::time::timeout(Duration::from_millis(500), connect)
            .await
            .map_err(|_| "connect timed out".to_string())?
            .map_err(|e| e.to_string())?;
        let members = tokio::time::timeout(Duration::from_millis(500), raw.member_list())
            .await
            .map_err(|_| "member list timed out".to_string())?
            .map_err(|e| e.to_string())?;
        let ours = members.members().iter().any(|m| m.name() == self.name && m.client_urls().contains(&self.url));
        if !ours {
            return Err(format!("another server answers on {}: {:?}", self.url, members.members()));
        }
        let cfg = EtcdConfig {
            connect_timeout: Duration::from_millis(500),
            request_timeout: Duration::from_millis(500),
            ..EtcdConfig::with_endpoints([self.url.clone()])
        };
        let store = EtcdStore::connect(cfg).await.map_err(|e| e.to_string())?;
        store.close().await.map_err(|e| e.to_string())
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("etcd.log")).unwrap_or_default()
    }

    /// A store configuration for this server, with a per-test prefix.
    fn config(&self, ttl_secs: u64) -> EtcdConfig {
        EtcdConfig {
            lease_ttl_secs: ttl_secs,
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(2),
            ..EtcdConfig::with_endpoints([self.url.clone()])
        }
    }

    async fn store(&self, ttl_secs: u64) -> EtcdStore {
        EtcdStore::connect(self.config(ttl_secs)).await.unwrap()
    }

    /// A raw etcd client, to do what a peer of another kind (or an operator) would.
    async fn raw(&self) -> etcd_client::Client {
        etcd_client::Client::connect([self.url.as_str()], None).await.unwrap()
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The etcd binary, or `None` (after a loud notice) outside CI; under
/// `CI=true` a missing binary is a failure.
fn etcd_binary() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let candidates = std::env::var_os("ETCD_BIN")
        .map(PathBuf::from)
        .into_iter()
        .chain(std::env::split_paths(&path).map(|d| d.join("etcd")))
        .chain([PathBuf::from("/usr/bin/etcd"), PathBuf::from("/usr/local/bin/etcd")]);
    for c in candidates {
        if c.is_file() {
            return Some(c);
        }
    }
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("etcd not installed (CI=true): run transport-etcd/install-etcd.sh (Debian package etcd-server)");
    }
    // Straight to the process's stderr: libtest captures `eprintln!` of passing tests.
    let _ = writeln!(
        std::io::stderr(),
        "etcd tests IGNORED: etcd not installed (apt-get install etcd-server, or transport-etcd/install-etcd.sh)"
    );
    None
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Runs a test body under [`TEST_LIMIT`].
async fn bounded<F: Future<Output = ()>>(body: F) {
    tokio::time::timeout(TEST_LIMIT, body).await.expect("test exceeded its time limit");
}

/// Polls `cond` every 100 ms until it holds or `limit` passes; returns whether it held.
async fn eventually<F, Fut>(limit: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if cond().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

fn desc(name: &str, generation: u64) -> SegmentDescriptor {
    SegmentDescriptor {
        name: name.into(),
        backend: "tcp".into(),
        generation,
        address: format!("{name}#{generation}"),
        regions: vec![RegionInfo { addr: 0x1000 * generation, len: 4096, access: Access::REMOTE_RW, key: generation }],
    }
}

// ---------------------------------------------------------------- cases

async fn put_get_remove_round_trip() {
    let Some(etcd) = Etcd::start().await else { return };
    bounded(async {
        let store = etcd.store(10).await;
        assert_eq!(store.background_tasks(), 1);
        assert!(store.get("10.0.0.1:7000").await.unwrap().is_none());

        let d = desc("10.0.0.1:7000", 1);
        store.put(d.clone()).await.unwrap();
        assert_eq!(store.get("10.0.0.1:7000").await.unwrap(), Some(d.clone()));
        assert_eq!(store.published(), vec!["10.0.0.1:7000".to_owned()]);

        // The value really is JSON under <prefix><name>, on a lease.
        let mut raw = etcd.raw().await;
        let resp = raw.get("/kvmove/segments/10.0.0.1:7000", None).await.unwrap();
        let kv = &resp.kvs()[0];
        assert_eq!(serde_json::from_slice::<SegmentDescriptor>(kv.value()).unwrap(), d);
        assert_ne!(kv.lease(), 0, "the descriptor must be attached to a lease");

        // Another store sees it too.
        let other = etcd.store(10).await;
        assert_eq!(other.get("10.0.0.1:7000").await.unwrap(), Some(d));

        store.remove("10.0.0.1:7000").await.unwrap();
        assert!(store.get("10.0.0.1:7000").await.unwrap().is_none());
        assert!(other.get("10.0.0.1:7000").await.unwrap().is_none());
        assert!(store.published().is_empty());
        store.remove("never-there").await.unwrap();

        store.close().await.unwrap();
        assert_eq!(store.background_tasks(), 0, "close must stop the keep-alive task");
        store.close().await.unwrap();
        let e = store.put(desc("x", 1)).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Shutdown);
        other.close().await.unwrap();
    })
    .await;
}

async fn stale_generation_cannot_overwrite() {
    let Some(etcd) = Etcd::start().await else { return };
    bounded(async {
        let new_peer = etcd.store(10).await;
        let old_peer = etcd.store(10).await;
        new_peer.put(desc("p", 5)).await.unwrap();

        let e = old_peer.put(desc("p", 3)).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidRequest, "{e}");
        assert!(!e.is_transient());
        assert!(e.to_string().contains("generation 3 is older than the stored 5"), "{e}");
        assert_eq!(e.context_value("key"), Some("/kvmove/segments/p"));
        assert_eq!(e.context_value("endpoint"), Some(etcd.url.as_str()));
        assert_eq!(old_peer.get("p").await.unwrap().unwrap().generation, 5);
        assert!(old_peer.published().is_empty(), "a failed put must not own the name");

        // Equal generation replaces; larger wins.
        let mut same = desc("p", 5);
        same.address = "changed".into();
        new_peer.put(same.clone()).await.unwrap();
        assert_eq!(old_peer.get("p").await.unwrap(), Some(same));
        old_peer.put(desc("p", 6)).await.unwrap();
        assert_eq!(new_peer.get("p").await.unwrap().unwrap().generation, 6);

        new_peer.close().await.unwrap();
        old_peer.close().await.unwrap();
    })
    .await;
}

async fn racing_writers_leave_the_largest_generation() {
    let Some(etcd) = Etcd::start().await else { return };
    bounded(async {
        let a = etcd.store(10).await;
        let b = etcd.store(10).await;
        // Interleaved generations from two writers at once; the CAS must
        // keep the largest whatever the order the server sees.
        let gens_a = [3u64, 9, 1, 7, 5];
        let gens_b = [8u64, 2, 10, 4, 6];
        async fn run(s: &EtcdStore, gens: [u64; 5]) {
            for g in gens {
                // Stale puts fail with InvalidRequest; anything else is a bug.
                if let Err(e) = s.put(desc("race", g)).await {
                    assert_eq!(e.kind(), ErrorKind::InvalidRequest, "{e}");
                }
            }
        }
        tokio::join!(run(&a, gens_a), run(&b, gens_b));
        assert_eq!(a.get("race").await.unwrap().unwrap().generation, 10);
        a.close().await.unwrap();
        b.close().await.unwrap();
    })
    .await;
}

async fn lease_expiry_removes_a_dead_peers_descriptor() {
    let Some(etcd) = Etcd::start().await else { return };
    bounded(async {
        let observer = etcd.store(10).await;
        let peer = etcd.store(2).await;
        peer.put(desc("dying", 1)).await.unwrap();

        // The keep-alive task holds the 2 s lease well past its TTL.
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(observer.get("dying").await.unwrap().is_some(), "keep-alive must hold the descriptor");
        assert_eq!(peer.background_tasks(), 1);

        // Dropping the store stops the keep-alive without revoking: a crash.
        drop(peer);
        let dropped = Instant::now();
        let gone =
            eventually(Duration::from_secs(15), || async { observer.get("dying").await.unwrap().is_none() }).await;
        assert!(gone, "the descriptor of a peer that stopped its keep-alive must expire");
        // Expiry, not an eager delete: it outlived the drop by about the TTL.
        assert!(dropped.elapsed() >= Duration::from_millis(500), "gone after {:?}", dropped.elapsed());
        observer.close().await.unwrap();
    })
    .await;
}

async fn close_revokes_at_once() {
    let Some(etcd) = Etcd::start().await else { return };
    bounded(async {
        let observer = etcd.store(10).await;
        let peer = etcd.store(30).await;
        peer.put(desc("leaving", 1)).await.unwrap();
        peer.put(desc("leaving-too", 1)).await.unwrap();
        peer.close().await.unwrap();
        assert_eq!(peer.background_tasks(), 0);
        assert!(observer.get("leaving").await.unwrap().is_none());
        assert!(observer.get("leaving-too").await.unwrap().is_none());
        observer.close().await.unwrap();
    })
    .await;
}

async fn lost_lease_is_replaced_and_descriptor_republished() {
    let Some(etcd) = Etcd::start().await else { return };
    bounded(async {
        let peer = etcd.store(2).await;
        peer.put(desc("phoenix", 4)).await.unwrap();
        // An operator (or an expiry during a long pause) kills the lease.
        let mut raw = etcd.raw().await;
        let lease = raw.get("/kvmove/segments/phoenix", None).await.unwrap().kvs()[0].lease();
        raw.lease_revoke(lease).await.unwrap();
        assert!(raw.get("/kvmove/segments/phoenix", None).await.unwrap().kvs().is_empty());

        let back = eventually(Duration::from_secs(10), || async {
            peer.get("phoenix").await.unwrap().is_some_and(|d| d.generation == 4)
        })
        .await;
        assert!(back, "the keep-alive task must publish the descriptor again on a new lease");
        let new_lease = raw.get("/kvmove/segments/phoenix", None).await.unwrap().kvs()[0].lease();
        assert_ne!(new_lease, lease);
        peer.close().await.unwrap();
    })
    .await;
}

async fn watcher_sees_a_restart_as_a_new_generation() {
    let Some(etcd) = Etcd::start().await else { return };
    bounded(async {
        let observer = etcd.store(10).await;
        let mut watch = observer.watch("w").await.unwrap();
        assert_eq!(watch.name(), "w");
        assert!(watch.current().is_none());
        async fn next(w: &mut SegmentWatch) -> Option<SegmentDescriptor> {
            tokio::time::timeout(Duration::from_secs(10), w.changed()).await.expect("no change seen").unwrap()
        }

        let first = etcd.store(10).await;
        first.put(desc("w", 1)).await.unwrap();
        assert_eq!(next(&mut watch).await, Some(desc("w", 1)));
        assert_eq!(watch.current(), Some(&desc("w", 1)));

        // The peer restarts: a new process (store) publishes generation 2.
        let restarted = etcd.store(10).await;
        restarted.put(desc("w", 2)).await.unwrap();
        assert_eq!(next(&mut watch).await.unwrap().generation, 2);

        // The old incarnation leaving must not take the new one's descriptor
        // with it: the key is on the new incarnation's lease now.
        first.close().await.unwrap();
        assert_eq!(observer.get("w").await.unwrap().unwrap().generation, 2);

        // A watch created now starts from the current descriptor.
        let mut late = observer.watch("w").await.unwrap();
        assert_eq!(late.current().map(|d| d.generation), Some(2));

        restarted.remove("w").await.unwrap();
        assert_eq!(next(&mut watch).await, None);
        assert_eq!(next(&mut late).await, None);
        assert!(watch.current().is_none());

        restarted.close().await.unwrap();
        observer.close().await.unwrap();
    })
    .await;
}

async fn watcher_never_goes_back_in_generations() {
    let Some(etcd) = Etcd::start().await else { return };
    bounded(async {
        let observer = etcd.store(10).await;
        let peer = etcd.store(10).await;
        peer.put(desc("g", 5)).await.unwrap();
        let mut watch = observer.watch("g").await.unwrap();
        assert_eq!(watch.current().map(|d| d.generation), Some(5));

        // A writer that bypasses the store's check puts an older generation,
        // then a newer one: the watch skips the older one.
        let mut raw = etcd.raw().await;
        raw.put("/kvmove/segments/g", serde_json::to_vec(&desc("g", 3)).unwrap(), None).await.unwrap();
        raw.put("/kvmove/segments/g", serde_json::to_vec(&desc("g", 6)).unwrap(), None).await.unwrap();
        let next = tokio::time::timeout(Duration::from_secs(10), watch.changed()).await.unwrap().unwrap();
        assert_eq!(next.map(|d| d.generation), Some(6));
        peer.close().await.unwrap();
        observer.close().await.unwrap();
    })
    .await;
}

async fn foreign_bytes_under_our_key_are_a_protocol_error() {
    let Some(etcd) = Etcd::start().await else { return };
    bounded(async {
        let store = etcd.store(10).await;
        let mut raw = etcd.raw().await;
        raw.put("/kvmove/segments/garbage", "not json", None).await.unwrap();
        let e = store.get("garbage").await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
        assert_eq!(e.context_value("key"), Some("/kvmove/segments/garbage"));
        assert_eq!(e.context_value("endpoint"), Some(etcd.url.as_str()));

        // A descriptor of another segment under this name is not used either.
        raw.put("/kvmove/segments/misfiled", serde_json::to_vec(&desc("other", 1)).unwrap(), None).await.unwrap();
        assert_eq!(store.get("misfiled").await.unwrap_err().kind(), ErrorKind::Protocol);
        // Nor can a put overwrite what it cannot read a generation from.
        assert_eq!(store.put(desc("garbage", 1)).await.unwrap_err().kind(), ErrorKind::Protocol);
        assert_eq!(store.get("").await.unwrap_err().kind(), ErrorKind::InvalidRequest);
        store.close().await.unwrap();
    })
    .await;
}

async fn unreachable_etcd_is_a_transient_error_not_a_hang() {
    // Nothing listens on this port.
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let cfg = EtcdConfig {
        connect_timeout: Duration::from_secs(1),
        request_timeout: Duration::from_secs(1),
        ..EtcdConfig::with_endpoints([url.clone()])
    };
    let started = Instant::now();
    let e = tokio::time::timeout(Duration::from_secs(10), EtcdStore::connect(cfg))
        .await
        .expect("connect must give up by itself")
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    assert!(e.is_transient(), "{e}");
    assert_eq!(e.kind(), ErrorKind::ConnectionRefused, "{e}");
    assert_eq!(e.context_value("endpoint"), Some(url.as_str()), "{e}");
}

async fn etcd_dying_under_a_store_gives_transient_errors() {
    let Some(mut etcd) = Etcd::start().await else { return };
    bounded(async {
        let cfg = EtcdConfig { request_timeout: Duration::from_secs(1), ..etcd.config(10) };
        let store = EtcdStore::connect(cfg).await.unwrap();
        store.put(desc("d", 1)).await.unwrap();
        etcd.kill();

        for op in ["get", "put", "remove", "watch"] {
            let started = Instant::now();
            let r = match op {
                "get" => store.get("d").await.map(|_| ()),
                "put" => store.put(desc("d", 2)).await,
                "remove" => store.remove("other").await,
                _ => store.watch("d").await.map(|_| ()),
            };
            let e = r.expect_err(op);
            eprintln!("etcd down, {op}: {e}");
            assert!(started.elapsed() < Duration::from_secs(5), "{op} took {:?}", started.elapsed());
            assert!(e.is_transient(), "{op}: {e}");
            assert_eq!(e.context_value("endpoint"), Some(etcd.url.as_str()), "{op}: {e}");
        }
        // Close cannot revoke now; it still stops the task and returns.
        let _ = tokio::time::timeout(Duration::from_secs(10), store.close()).await.expect("close must not hang");
        assert_eq!(store.background_tasks(), 0);
    })
    .await;
}

/// A TCP relay to `to` that can go silent: while `frozen`, it keeps its
/// connections open and moves no byte (a member partitioned away, or
/// stopped, as its clients see it).
async fn relay(to: String, frozen: std::sync::Arc<std::sync::atomic::AtomicBool>) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let target = to.trim_start_matches("http://").to_owned();
    tokio::spawn(async move {
        while let Ok((inbound, _)) = listener.accept().await {
            let Ok(outbound) = tokio::net::TcpStream::connect(&target).await else { continue };
            let (ri, wi) = inbound.into_split();
            let (ro, wo) = outbound.into_split();
            for (mut r, mut w) in [
                (
                    Box::new(ri) as Box<dyn tokio::io::AsyncRead + Send + Unpin>,
                    Box::new(wo) as Box<dyn tokio::io::AsyncWrite + Send + Unpin>,
                ),
                (Box::new(ro), Box::new(wi)),
            ] {
                let frozen = frozen.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 16 * 1024];
                    loop {
                        while frozen.load(Ordering::SeqCst) {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        match r.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => {
                                while frozen.load(Ordering::SeqCst) {
                                    tokio::time::sleep(Duration::from_millis(20)).await;
                                }
                                if w.write_all(&buf[..n]).await.is_err() {
                                    return;
                                }
                            }
                        }
                    }
                });
            }
        }
    });
    url
}

/// One of the store's endpoints goes silent with its connection open (a
/// member partitioned away or frozen): every read still answers, from the
/// other endpoint, within the request timeout. (A store whose reads went
/// round-robin without trying again failed about half of them.)
async fn reads_go_on_when_one_endpoint_goes_silent() {
    let Some(etcd) = Etcd::start().await else { return };
    bounded(async {
        let frozen = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let silent = relay(etcd.url.clone(), frozen.clone()).await;
        let cfg = EtcdConfig {
            request_timeout: Duration::from_secs(3),
            ..EtcdConfig::with_endpoints([silent.clone(), etcd.url.clone()])
        };
        let store = EtcdStore::connect(cfg).await.unwrap();
        store.put(desc("p", 1)).await.unwrap();
        for _ in 0..10 {
            assert!(store.get("p").await.unwrap().is_some()); // both connections in use
        }
        frozen.store(true, Ordering::SeqCst);
        for i in 0..20 {
            let started = Instant::now();
            let got = store.get("p").await.unwrap_or_else(|e| panic!("read {i} with {silent} silent: {e}"));
            assert_eq!(got.map(|d| d.generation), Some(1));
            assert!(started.elapsed() < Duration::from_secs(3), "read {i} took {:?}", started.elapsed());
        }
        frozen.store(false, Ordering::SeqCst);
        store.close().await.unwrap();
    })
    .await;
}

type Test = fn() -> std::pin::Pin<Box<dyn Future<Output = ()>>>;

fn main() {
    let args = libtest_mimic::Arguments::from_args();
    let tests: Vec<(&str, Test)> = vec![
        ("put_get_remove_round_trip", || Box::pin(put_get_remove_round_trip())),
        ("stale_generation_cannot_overwrite", || Box::pin(stale_generation_cannot_overwrite())),
        ("racing_writers_leave_the_largest_generation", || Box::pin(racing_writers_leave_the_largest_generation())),
        ("lease_expiry_removes_a_dead_peers_descriptor", || Box::pin(lease_expiry_removes_a_dead_peers_descriptor())),
        ("close_revokes_at_once", || Box::pin(close_revokes_at_once())),
        ("lost_lease_is_replaced_and_descriptor_republished", || {
            Box::pin(lost_lease_is_replaced_and_descriptor_republished())
        }),
        ("watcher_sees_a_restart_as_a_new_generation", || Box::pin(watcher_sees_a_restart_as_a_new_generation())),
        ("watcher_never_goes_back_in_generations", || Box::pin(watcher_never_goes_back_in_generations())),
        ("foreign_bytes_under_our_key_are_a_protocol_error", || {
            Box::pin(foreign_bytes_under_our_key_are_a_protocol_error())
        }),
        ("unreachable_etcd_is_a_transient_error_not_a_hang", || {
            Box::pin(unreachable_etcd_is_a_transient_error_not_a_hang())
        }),
        ("etcd_dying_under_a_store_gives_transient_errors", || {
            Box::pin(etcd_dying_under_a_store_gives_transient_errors())
        }),
        ("reads_go_on_when_one_endpoint_goes_silent", || Box::pin(reads_go_on_when_one_endpoint_goes_silent())),
    ];
    let have = etcd_binary().is_some();
    let trials = tests
        .into_iter()
        .map(|(name, test)| {
            libtest_mimic::Trial::test(name, move || {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .map_err(|e| libtest_mimic::Failed::from(format!("runtime: {e}")))?;
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| rt.block_on(test()))).map_err(|e| {
                    let msg =
                        e.downcast_ref::<String>().cloned().or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()));
                    libtest_mimic::Failed::from(msg.unwrap_or_else(|| "panicked".into()))
                })
            })
            .with_ignored_flag(!have)
        })
        .collect();
    libtest_mimic::run(&args, trials).exit()
}
