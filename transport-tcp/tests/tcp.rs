//! Real sockets on loopback: data integrity, concurrency, teardown,
//! authentication, faults through the proxy, and a peer process killed
//! mid-batch.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test and benchmark code: a failure should panic

mod support;

use support::run;

use std::sync::Arc;
use std::time::Duration;

use support::proxy::FaultProxy;
use support::{node, test_config};
use transport_core::{Access, BatchState, Buffer, ErrorKind, SubmitOptions, TransferRequest, Transport};
use transport_tcp::TcpConfig;

const LIMIT: Duration = Duration::from_secs(30);

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| ((i as u64).wrapping_mul(31).wrapping_add(seed * 7) % 251) as u8).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn byte_exact_writes_and_reads_of_many_sizes() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let cfg = TcpConfig { slice_size: 64 << 10, max_frame: 64 << 10, ..test_config() };
        let (a, b) = (node(cfg.clone()).await, node(cfg).await);
        let len = 4 << 20;
        let (src, dst) = (Buffer::from_slice(&pattern(1, len)).unwrap(), Buffer::new(len).unwrap());
        let l = a.register(src.region(), Access::LOCAL).unwrap();
        b.register(dst.region(), Access::REMOTE_RW).unwrap();
        let seg = a.open_segment(&b.local_segment_name()).await.unwrap();
        for (k, size) in [1usize, 7, 4095, 4096, 65535, 65536, 65537, 1 << 20, (3 << 20) + 5].into_iter().enumerate() {
            let off = (k * 13) as u64;
            dst.fill(0);
            let s = run(&a, vec![TransferRequest::write(l, off, seg, dst.addr() + off + 3, size as u64)]).await;
            assert_eq!(s.state, BatchState::Completed, "write {size}: {:?}", s.first_error());
            let got = dst.to_vec();
            assert_eq!(
                &got[off as usize + 3..off as usize + 3 + size],
                &src.to_vec()[off as usize..off as usize + size]
            );
            assert!(got[..off as usize + 3].iter().all(|&x| x == 0), "bytes before the write changed");
            assert!(got[off as usize + 3 + size..].iter().all(|&x| x == 0), "bytes after the write changed");
            // Read it back into a fresh local region.
            let back = Buffer::new(size + 16).unwrap();
            let bl = a.register(back.region(), Access::LOCAL).unwrap();
            let s = run(&a, vec![TransferRequest::read(bl, 8, seg, dst.addr() + off + 3, size as u64)]).await;
            assert_eq!(s.state, BatchState::Completed);
            assert_eq!(&back.to_vec()[8..8 + size], &src.to_vec()[off as usize..off as usize + size]);
            a.unregister(bl).await.unwrap();
        }
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_batches_land_exact() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let (a, b) = (Arc::new(node(test_config()).await), node(test_config()).await);
        let len = 8 << 20;
        let (src, dst) = (Buffer::from_slice(&pattern(2, len)).unwrap(), Buffer::new(len).unwrap());
        let l = a.register(src.region(), Access::LOCAL).unwrap();
        b.register(dst.region(), Access::REMOTE_RW).unwrap();
        let seg = a.open_segment(&b.local_segment_name()).await.unwrap();
        let mut tasks = Vec::new();
        for k in 0..16u64 {
            let (a, base) = (a.clone(), dst.addr());
            tasks.push(tokio::spawn(async move {
                let chunk = (len / 16) as u64;
                let reqs: Vec<_> = (0..64u64)
                    .map(|j| {
                        let o = k * chunk + j * (chunk / 64);
                        TransferRequest::write(l, o, seg, base + o, chunk / 64)
                    })
                    .collect();
                run(&a, reqs).await.state
            }));
        }
        for t in tasks {
            assert_eq!(t.await.unwrap(), BatchState::Completed);
        }
        assert_eq!(dst.to_vec(), src.to_vec());
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

/// Small batches go onto a lane's socket from the submitting task (no
/// hand-off to the lane's writer); with a send buffer far smaller than a
/// batch the socket takes only part at once and a lane task sends the
/// rest, while other batches queue behind it for the writers. Every byte
/// lands where it should, writes and reads, from concurrent submitters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_batches_sent_at_once_through_a_tiny_send_buffer() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let cfg = TcpConfig { send_buffer: Some(4096), ..test_config() };
        let (a, b) = (Arc::new(node(cfg).await), node(test_config()).await);
        const TASKS: u64 = 8;
        const REQS: u64 = 60; // 60 x 4 KiB: sent at once (under 256 KiB)
        const LEN: u64 = 4096;
        let len = (TASKS * REQS * LEN) as usize;
        let (src, dst) = (Buffer::from_slice(&pattern(5, len)).unwrap(), Buffer::new(len).unwrap());
        let back = Buffer::new(len).unwrap();
        let l = a.register(src.region(), Access::LOCAL).unwrap();
        let lb = a.register(back.region(), Access::LOCAL).unwrap();
        b.register(dst.region(), Access::REMOTE_RW).unwrap();
        let seg = a.open_segment(&b.local_segment_name()).await.unwrap();
        for round in 0..20u64 {
            let mut tasks = Vec::new();
            for k in 0..TASKS {
                let (a, base) = (a.clone(), dst.addr());
                tasks.push(tokio::spawn(async move {
                    // Scattered: request j of task k goes to a slot that
                    // moves with the round.
                    let slot = |j: u64| ((j * 7 + round) % REQS + k * REQS) * LEN;
                    let writes: Vec<_> =
                        (0..REQS).map(|j| TransferRequest::write(l, slot(j), seg, base + slot(j), LEN)).collect();
                    let w = run(&a, writes).await.state;
                    let reads: Vec<_> =
                        (0..REQS).map(|j| TransferRequest::read(lb, slot(j), seg, base + slot(j), LEN)).collect();
                    (w, run(&a, reads).await.state)
                }));
            }
            for t in tasks {
                assert_eq!(t.await.unwrap(), (BatchState::Completed, BatchState::Completed));
            }
            assert_eq!(dst.to_vec(), src.to_vec(), "round {round}: written bytes");
            assert_eq!(back.to_vec(), src.to_vec(), "round {round}: read bytes");
        }
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_secret_is_required_and_checked() {
    tokio::time::timeout(Duration::from_secs(30), async {
        let secret = TcpConfig { secret: Some("s3cret".into()), ..test_config() };
        let b = node(secret.clone()).await;
        let dst = Buffer::new(4096).unwrap();
        b.register(dst.region(), Access::REMOTE_RW).unwrap();
        let name = b.local_segment_name();
        let none = node(test_config()).await;
        assert_eq!(none.open_segment(&name).await.unwrap_err().kind(), ErrorKind::AuthFailed);
        let wrong = node(TcpConfig { secret: Some("nope".into()), ..test_config() }).await;
        assert_eq!(wrong.open_segment(&name).await.unwrap_err().kind(), ErrorKind::AuthFailed);
        // A client with a secret refuses a server that cannot prove it.
        let open = node(test_config()).await;
        let good = node(secret).await;
        assert_eq!(good.open_segment(&open.local_segment_name()).await.unwrap_err().kind(), ErrorKind::AuthFailed);
        let src = Buffer::from_slice(&[9u8; 4096]).unwrap();
        let l = good.register(src.region(), Access::LOCAL).unwrap();
        let seg = good.open_segment(&name).await.unwrap();
        assert_eq!(
            run(&good, vec![TransferRequest::write(l, 0, seg, dst.addr(), 4096)]).await.state,
            BatchState::Completed
        );
        assert_eq!(dst.to_vec(), vec![9u8; 4096]);
        for t in [b, none, wrong, open, good] {
            t.shutdown().await.unwrap();
        }
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_cut_stall_and_corruption() {
    tokio::time::timeout(Duration::from_secs(60), async {
        // The faults are the lanes': no direct writes, which go around them.
        let a = node(TcpConfig { direct_writes: false, ..test_config() }).await;
        let b = node(test_config()).await;
        let proxy = FaultProxy::start("127.0.0.1:0".parse().unwrap(), b.local_addr()).await.unwrap();
        let (src, dst) = (Buffer::from_slice(&pattern(3, 1 << 20)).unwrap(), Buffer::new(1 << 20).unwrap());
        let l = a.register(src.region(), Access::LOCAL).unwrap();
        b.register(dst.region(), Access::REMOTE_RW).unwrap();
        let seg = a.open_segment(&proxy.addr.to_string()).await.unwrap();
        let w = TransferRequest::write(l, 0, seg, dst.addr(), 1 << 20);
        assert_eq!(run(&a, vec![w]).await.state, BatchState::Completed);
        // Cut: the batch in flight (or the next) fails transiently, the
        // endpoint is destroyed, the next transfer rebuilds it.
        proxy.cut();
        let s = run(&a, vec![w]).await;
        if s.state != BatchState::Completed {
            assert!(s.first_error().unwrap().is_transient());
            assert_eq!(run(&a, vec![w]).await.state, BatchState::Completed);
        }
        // The broken endpoint's teardown runs on its own: it is gone
        // within a bound, leaving the one the last transfer used.
        let one = async {
            while a.stats().endpoints > 1 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(3), one).await.expect("the cut endpoint is destroyed");
        // Stall: a deadline ends it, TimedOut, and traffic resumes later.
        proxy.stall(true);
        let bt = a.submit(vec![w], SubmitOptions::with_timeout(Duration::from_millis(200))).await.unwrap();
        let s = tokio::time::timeout(LIMIT, a.wait(bt)).await.unwrap().unwrap();
        assert_eq!(s.state, BatchState::TimedOut);
        a.release(bt).unwrap();
        proxy.stall(false);
        assert_eq!(run(&a, vec![w]).await.state, BatchState::Completed);
        // Corruption of the byte stream: a header check or frame rule
        // catches it, the connection closes, the error is transient; the
        // server keeps serving.
        proxy.corrupt(997);
        let s = run(&a, vec![TransferRequest::write(l, 0, seg, dst.addr(), 4096)]).await;
        if let Some(e) = s.first_error() {
            assert!(e.is_transient(), "{e}");
        }
        proxy.corrupt(0);
        let mut ok = false;
        for _ in 0..3 {
            if run(&a, vec![w]).await.state == BatchState::Completed {
                ok = true;
                break;
            }
        }
        assert!(ok, "transfers recover after corruption stops");
        // Blackhole: the endpoint build times out, transient.
        proxy.cut();
        proxy.blackhole(true);
        let t = node(test_config()).await;
        let e = t.open_segment(&proxy.addr.to_string()).await.unwrap_err();
        assert!(e.is_transient(), "{e}");
        for t in [a, b, t] {
            t.shutdown().await.unwrap();
        }
    })
    .await
    .expect("test timed out");
}

/// Starts `tcp-peer` on `listen`; returns the child, its name and region address.
fn spawn_peer(listen: &str) -> (std::process::Child, String, u64) {
    support::tcp_peer(listen, 4 << 20, true, None)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_process_killed_mid_batch_then_restarted() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let (mut child, name, raddr) = spawn_peer("127.0.0.1:0");
        let a = node(test_config()).await;
        let src = Buffer::from_slice(&pattern(4, 4 << 20)).unwrap();
        let l = a.register(src.region(), Access::LOCAL).unwrap();
        let seg = a.open_segment(&name).await.unwrap();
        let gen1 = a.segment_descriptor(seg).unwrap().generation;
        // A long batch; the peer dies in the middle of it.
        let reqs: Vec<_> = (0..2048u64)
            .map(|k| TransferRequest::write(l, (k % 4) << 20, seg, raddr + ((k % 4) << 20), 1 << 20))
            .collect();
        let b = a.submit(reqs, SubmitOptions::default()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        child.kill().unwrap();
        child.wait().unwrap();
        let s = tokio::time::timeout(LIMIT, a.wait(b)).await.unwrap().unwrap();
        a.release(b).unwrap();
        assert_eq!(s.state, BatchState::Failed, "a batch to a killed peer fails");
        assert!(s.first_error().unwrap().is_transient(), "{:?}", s.first_error());
        let gone = async {
            while a.stats().endpoints != 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(3), gone).await.expect("the broken endpoint is destroyed");
        // The peer restarts on the same port with a new generation.
        let (mut child2, name2, raddr2) = spawn_peer(&name);
        assert_eq!(name2, name);
        let w = TransferRequest::write(l, 0, seg, raddr2, 4096);
        let first = run(&a, vec![w]).await;
        if first.state != BatchState::Completed {
            assert_eq!(first.first_error().unwrap().kind(), ErrorKind::PeerRestarted);
            assert_eq!(run(&a, vec![w]).await.state, BatchState::Completed);
        }
        assert_ne!(a.segment_descriptor(seg).unwrap().generation, gen1, "the new generation is noticed");
        drop(child2.stdin.take());
        let _ = child2.wait();
        a.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_descriptor_is_what_a_peer_sees() {
    tokio::time::timeout(Duration::from_secs(30), async {
        let (a, b) = (node(test_config()).await, node(test_config()).await);
        let (exposed, local) = (Buffer::new(1 << 16).unwrap(), Buffer::new(1 << 16).unwrap());
        b.register(exposed.region(), Access::REMOTE_RW).unwrap();
        b.register(local.region(), Access::LOCAL).unwrap();
        let own = b.local_descriptor().unwrap();
        assert_eq!(own.generation, b.generation());
        assert_eq!(own.regions.len(), 1, "only remotely accessible regions are described");
        let seg = a.open_segment(&b.local_segment_name()).await.unwrap();
        let seen = a.segment_descriptor(seg).unwrap();
        assert_eq!(own, seen);
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
        assert_eq!(b.local_descriptor().unwrap_err().kind(), ErrorKind::Shutdown);
    })
    .await
    .expect("test timed out");
}

/// Rule 3 for `Engine::probe` over real sockets: each probe opens a
/// segment and registers a scratch buffer and gives both back, whether the
/// peer answered or nothing listened; many probes leave the counts (and
/// the sockets: at most the one endpoint kept for reuse) where they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_give_back_what_they_open() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let (a, b) = (Arc::new(node(test_config()).await), node(test_config()).await);
        let mem = Buffer::new(4096).unwrap();
        b.register(mem.region(), Access::REMOTE_RW).unwrap();
        // A port nothing listens on: bound and held without listening for
        // the whole test (connections to it are refused), so no transport
        // of a test running beside this one can be given it (a port bound
        // and closed again was, once: the probe of "nothing" then worked).
        let reserved = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        reserved.bind(&std::net::SocketAddr::from(([127, 0, 0, 1], 0)).into()).unwrap();
        let dead = reserved.local_addr().unwrap().as_socket().unwrap().to_string();
        let engine = kvmove_policy::Engine::new(a.clone(), kvmove_policy::PolicyConfig::default()).unwrap();
        let before = a.stats();
        for _ in 0..50 {
            engine.probe(&b.local_segment_name()).await.expect("b is alive");
            engine.probe(&dead).await.expect_err("nothing listens");
        }
        let after = a.stats();
        assert_eq!(
            (after.segments, after.regions, after.batches, after.inflight),
            (before.segments, before.regions, before.batches, before.inflight),
            "segments, regions, batches and bytes in flight back at their counts before the probes"
        );
        assert!(after.endpoints <= 1, "at most the endpoint to b is kept: {}", after.endpoints);
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

/// Issue 55 item 3: a peer stopped (SIGSTOP) still accepts connections in
/// its kernel backlog and answers nothing. Opening it fails within the
/// connect timeout as a `Timeout` that says so, not as a failed handshake
/// (which would point at versions or secrets).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_peer_is_a_timeout_not_a_failed_handshake() {
    let (mut child, name, _) = support::tcp_peer("127.0.0.1:0", 4096, false, None);
    support::stop(child.id());
    let cfg = TcpConfig { connect_timeout: Duration::from_millis(500), ..support::test_config() };
    let a = node(cfg).await;
    let t0 = std::time::Instant::now();
    let e = a.open_segment(&name).await.unwrap_err();
    let took = t0.elapsed();
    support::resume(child.id());
    drop(child.stdin.take());
    child.wait().unwrap();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert!(e.kind().is_transient() && e.to_string().contains("did not answer the handshake"), "{e}");
    assert!(took < Duration::from_secs(3), "the open took {took:?} (connect timeout 500 ms)");
    a.shutdown().await.unwrap();
}

/// What the scripted server of the early-proof tests puts in its CHALLENGE.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Early {
    /// Its proof, as a server of this version does.
    Right,
    /// None: a server from before early proofs.
    Missing,
    /// A proof that does not verify: an impostor without the secret.
    Wrong,
}

const EARLY_SECRET: &str = "early-secret";

/// A server played by hand with [`EARLY_SECRET`], for one connection: it
/// checks the client asked for an early proof, answers with `early`,
/// reads the AUTH, then waits up to 300 ms for a frame **before** it sends
/// READY (with its proof, or a wrong one for [`Early::Wrong`]), and answers
/// a DESC_REQ whenever it comes. Returns the type of the frame that came
/// before READY, if any.
async fn scripted_server(l: tokio::net::TcpListener, early: Early) -> Option<transport_tcp::wire::FrameType> {
    use support::raw::next_frame;
    use tokio::io::AsyncWriteExt;
    use transport_control::{auth, handshake};
    use transport_tcp::wire::{encode_regions, FrameType, Header, WireRegion, EARLY_PROOF, NONCE_LEN, PROOF_LEN};
    let (mut s, _) = l.accept().await.unwrap();
    let (h, p) = next_frame(&mut s, LIMIT).await.expect("a HELLO");
    assert_eq!(h.ty, FrameType::Hello);
    assert_ne!(h.flags & EARLY_PROOF, 0, "the client asks for the server's proof early");
    let theirs = u32::from(u16::from_le_bytes([p[0], p[1]]));
    let (srv, ch) = handshake::Server::hello(auth::TCP, Some(EARLY_SECRET.as_bytes()), 1, theirs, &p[2..]).unwrap();
    let mut c = Header::new(FrameType::Challenge);
    c.flags = 1;
    c.generation = 7;
    let mut payload = srv.nonce().to_vec();
    match early {
        Early::Right => payload.extend_from_slice(&ch.proof),
        Early::Wrong => payload.extend_from_slice(&[5u8; PROOF_LEN]),
        Early::Missing => {}
    }
    if early != Early::Missing {
        c.flags |= EARLY_PROOF;
    }
    c.payload_len = payload.len() as u32;
    s.write_all(&c.encode()).await.unwrap();
    s.write_all(&payload).await.unwrap();
    assert_eq!(payload.len(), NONCE_LEN + if early == Early::Missing { 0 } else { PROOF_LEN });
    let (a, proof) = next_frame(&mut s, LIMIT).await.expect("an AUTH");
    assert_eq!(a.ty, FrameType::Auth);
    let mut answer = srv.auth(&proof).expect("the client proves the secret");
    let before_ready = next_frame(&mut s, Duration::from_millis(300)).await;
    if early == Early::Wrong {
        answer = vec![5u8; PROOF_LEN];
    }
    let mut r = Header::new(FrameType::Ready);
    r.payload_len = answer.len() as u32;
    s.write_all(&r.encode()).await.unwrap();
    s.write_all(&answer).await.unwrap();
    let desc = match &before_ready {
        Some((f, _)) => Some(*f),
        None => next_frame(&mut s, Duration::from_secs(2)).await.map(|(f, _)| f),
    };
    if let Some(d) = desc.filter(|d| d.ty == FrameType::DescReq) {
        let regions = encode_regions(&[WireRegion { addr: 1 << 20, len: 4096, read: true, write: true }]);
        let mut resp = Header::new(FrameType::DescResp);
        resp.id = d.id;
        resp.generation = 7;
        resp.payload_len = regions.len() as u32;
        s.write_all(&resp.encode()).await.unwrap();
        s.write_all(&regions).await.unwrap();
    }
    // Held until the client is done with the connection.
    let _ = next_frame(&mut s, Duration::from_millis(500)).await;
    before_ready.map(|(f, _)| f.ty)
}

/// Issue 49: the handshake costs one round trip before the first request,
/// not two. A client with the secret that checked the server's early
/// proof sends its first lane's DESC_REQ behind its AUTH, before READY
/// (the scripted server reads it before answering READY; a client that
/// waited for READY would send nothing there). A server from before
/// (no early proof) or an impostor (a wrong one) gets nothing before
/// READY, and the impostor's READY is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_request_follows_auth_only_after_the_server_proved_itself() {
    use transport_tcp::wire::FrameType;
    tokio::time::timeout(LIMIT, async {
        let cfg = TcpConfig { secret: Some(EARLY_SECRET.into()), lanes: 1, same_host: false, ..support::test_config() };
        let a = node(cfg).await;
        for early in [Early::Right, Early::Missing, Early::Wrong] {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let name = l.local_addr().unwrap().to_string();
            let server = tokio::spawn(scripted_server(l, early));
            let opened = a.open_segment(&name).await;
            let before_ready = server.await.unwrap();
            match early {
                Early::Right => {
                    assert_eq!(before_ready, Some(FrameType::DescReq), "the descriptor asked for with the AUTH");
                    a.close_segment(opened.unwrap()).await.unwrap();
                }
                Early::Missing => {
                    assert_eq!(before_ready, None, "no request before a server from before proved itself");
                    a.close_segment(opened.unwrap()).await.unwrap();
                }
                Early::Wrong => {
                    assert_eq!(before_ready, None, "nothing sent to a server whose early proof is wrong");
                    assert_eq!(opened.unwrap_err().kind(), ErrorKind::AuthFailed);
                }
            }
        }
        a.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

/// The server's side of the early proof: a HELLO that asks for it gets a
/// CHALLENGE with the server's proof behind the nonce (which a client
/// checks with the secret), one that does not (a client from before) gets
/// the nonce alone, and a server without a secret sends none. A request
/// sent behind the AUTH is answered after READY; one sent behind an AUTH
/// the server answers `Busy` (its connections filled meanwhile) does not
/// cost the client that answer: it reads `Busy`, not a reset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_proves_itself_early_to_a_client_that_asks() {
    use support::raw::{closed_within, hello, next_frame};
    use tokio::io::AsyncWriteExt;
    use tokio::net::TcpStream;
    use transport_control::{auth, handshake};
    use transport_tcp::wire::{FrameType, Header, Status, EARLY_PROOF, NONCE_LEN, PROOF_LEN, VERSION};
    /// Sends a HELLO with `flags` and `c`'s nonce; the CHALLENGE.
    async fn challenge(s: &mut TcpStream, flags: u8, c: &handshake::Client<'_>) -> (Header, Vec<u8>) {
        let mut p = VERSION.to_le_bytes().to_vec();
        p.extend_from_slice(c.nonce());
        let mut h = Header::new(FrameType::Hello);
        h.flags = flags;
        h.payload_len = p.len() as u32;
        s.write_all(&h.encode()).await.unwrap();
        s.write_all(&p).await.unwrap();
        let (ch, payload) = next_frame(s, LIMIT).await.expect("a CHALLENGE");
        assert_eq!(ch.ty, FrameType::Challenge);
        (ch, payload)
    }
    /// AUTH with `proof` and a DESC_REQ, in one write.
    async fn auth_and_desc(s: &mut TcpStream, proof: &[u8]) {
        let mut a = Header::new(FrameType::Auth);
        a.payload_len = proof.len() as u32;
        let mut out = a.encode().to_vec();
        out.extend_from_slice(proof);
        let mut d = Header::new(FrameType::DescReq);
        d.id = 1;
        out.extend_from_slice(&d.encode());
        s.write_all(&out).await.unwrap();
    }
    tokio::time::timeout(LIMIT, async {
        let secret = EARLY_SECRET.as_bytes();
        let b = node(TcpConfig { secret: Some(EARLY_SECRET.into()), ..support::test_config() }).await;
        // A client of this version: the proof comes early and checks out.
        let mut s = TcpStream::connect(b.local_addr()).await.unwrap();
        let mut c = handshake::Client::new(auth::TCP, Some(secret));
        let (ch, payload) = challenge(&mut s, EARLY_PROOF, &c).await;
        assert_ne!(ch.flags & EARLY_PROOF, 0);
        assert_eq!(payload.len(), NONCE_LEN + PROOF_LEN);
        let a = c.challenge(&payload[..NONCE_LEN], ch.flags & 1 != 0, &payload[NONCE_LEN..]).unwrap();
        assert!(a.early, "the server's early proof verifies with the secret");
        auth_and_desc(&mut s, &a.proof).await;
        let (r, proof) = next_frame(&mut s, LIMIT).await.expect("READY");
        assert_eq!(r.ty, FrameType::Ready);
        c.ready(&proof).unwrap();
        let (d, _) = next_frame(&mut s, LIMIT).await.expect("the DESC_RESP");
        assert_eq!((d.ty, d.id), (FrameType::DescResp, 1));
        // A client from before: the nonce alone, as it expects.
        let mut old = TcpStream::connect(b.local_addr()).await.unwrap();
        let (ch, payload) = challenge(&mut old, 0, &handshake::Client::new(auth::TCP, Some(secret))).await;
        assert_eq!((ch.flags & EARLY_PROOF, payload.len()), (0, NONCE_LEN));
        b.shutdown().await.unwrap();

        // No secret: no proof to send early. With one handshaken
        // connection allowed and taken while a second handshook, the
        // second's AUTH and DESC_REQ are answered Busy, readable.
        let cfg = TcpConfig { max_connections: 1, ..support::test_config() };
        let b = node(cfg).await;
        let mut late = TcpStream::connect(b.local_addr()).await.unwrap();
        let c = handshake::Client::new(auth::TCP, None);
        let (ch, payload) = challenge(&mut late, EARLY_PROOF, &c).await;
        assert_eq!((ch.flags & EARLY_PROOF, payload.len()), (0, NONCE_LEN));
        let mut first = TcpStream::connect(b.local_addr()).await.unwrap();
        hello(&mut first).await;
        auth_and_desc(&mut late, &[]).await;
        let (e, _) = next_frame(&mut late, LIMIT).await.expect("an answer, not a reset");
        assert_eq!((e.ty, e.status), (FrameType::Error, Status::Busy));
        closed_within(&mut late, LIMIT).await.expect("then the server closes");
        b.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}
