//! Same-host copies (`TcpConfig::same_host`) between two processes: the
//! bytes move by process-to-process copies, not through the sockets; a
//! peer with them off is served through the sockets; a client that names
//! another process is never believed; a process killed mid-batch ends the
//! batch and a restarted one is reached again; small writes go straight
//! into the peer's memory, and never once the peer unregistered the
//! region.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test and benchmark code: a failure should panic

mod support;

use std::time::Duration;

use support::raw::{next_frame, WAIT};
use support::{node, run, test_config};
use tokio::io::AsyncWriteExt;
use transport_core::{Access, BatchState, Buffer, SubmitOptions, TransferRequest, Transport};
use transport_tcp::wire::{FrameType, Header, Status, NONCE_LEN, PULL_WRITES, SAME_HOST};
use transport_tcp::TcpConfig;

const LEN: usize = 8 << 20;

/// A `tcp-peer` process serving `LEN` bytes that start as `i % 251`.
struct Peer {
    child: std::process::Child,
    name: String,
    region: u64,
}

impl Peer {
    fn start(listen: &str, same_host: bool) -> Peer {
        Self::start_as(listen, same_host, None)
    }

    /// `as_user`: run it as that uid and gid.
    fn start_as(listen: &str, same_host: bool, as_user: Option<u32>) -> Peer {
        let (child, name, region) = support::tcp_peer(listen, LEN, same_host, as_user);
        Peer { child, name, region }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8).collect()
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed)).collect()
}

/// Reads the peer's region, writes a new pattern over part of it, reads
/// that back; every byte checked. Returns the bytes read and written.
async fn round_trip(a: &transport_tcp::TcpTransport, peer: &Peer) -> (u64, u64) {
    let seg = a.open_segment(&peer.name).await.unwrap();
    let back = Buffer::new(LEN).unwrap();
    let bl = a.register(back.region(), Access::LOCAL).unwrap();
    // Many sizes, small and sliced (1 MiB slices), at odd offsets.
    let mut moved = 0;
    for (k, size) in [1usize, 4095, 4096, 65537, (1 << 20) + 3, 3 << 20].into_iter().enumerate() {
        let off = (k * 4099) as u64;
        let s = run(a, vec![TransferRequest::read(bl, off, seg, peer.region + off, size as u64)]).await;
        assert_eq!(s.state, BatchState::Completed, "read {size}: {:?}", s.first_error());
        let want = &start_pattern(LEN)[off as usize..off as usize + size];
        assert_eq!(&back.to_vec()[off as usize..off as usize + size], want, "read of {size} bytes");
        moved += size as u64;
    }
    let src = Buffer::from_slice(&pattern(5, LEN)).unwrap();
    let sl = a.register(src.region(), Access::LOCAL).unwrap();
    let reqs: Vec<_> =
        (0..8u64).map(|k| TransferRequest::write(sl, k << 20, seg, peer.region + (k << 20), 1 << 20)).collect();
    let s = run(a, reqs).await;
    assert_eq!(s.state, BatchState::Completed, "writes: {:?}", s.first_error());
    back.fill(0);
    let s = run(a, vec![TransferRequest::read(bl, 0, seg, peer.region, LEN as u64)]).await;
    assert_eq!(s.state, BatchState::Completed, "{:?}", s.first_error());
    assert!(back.to_vec() == src.to_vec(), "what was written is what is read back");
    moved += LEN as u64;
    a.unregister(bl).await.unwrap();
    a.unregister(sl).await.unwrap();
    a.close_segment(seg).await.unwrap();
    (moved, LEN as u64)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_move_their_bytes_by_same_host_copies() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let peer = Peer::start("127.0.0.1:0", true);
        let a = node(test_config()).await;
        let (read, written) = round_trip(&a, &peer).await;
        assert_eq!(a.same_host_bytes(), read + written, "every byte moved by same-host copies");
        a.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn either_side_off_means_the_bytes_go_through_the_sockets() {
    tokio::time::timeout(Duration::from_secs(60), async {
        // The peer refuses; then this side does not offer.
        let off_peer = Peer::start("127.0.0.1:0", false);
        let a = node(test_config()).await;
        round_trip(&a, &off_peer).await;
        assert_eq!(a.same_host_bytes(), 0, "a peer with same-host copies off is served through the sockets");
        let on_peer = Peer::start("127.0.0.1:0", true);
        let b = node(TcpConfig { same_host: false, ..test_config() }).await;
        round_trip(&b, &on_peer).await;
        assert_eq!(b.same_host_bytes(), 0, "an initiator with them off sends through the sockets");
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_killed_mid_batch_ends_it_and_a_restarted_one_is_reached() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let peer = Peer::start("127.0.0.1:0", true);
        let a = node(test_config()).await;
        let src = Buffer::from_slice(&pattern(9, LEN)).unwrap();
        let l = a.register(src.region(), Access::LOCAL).unwrap();
        let seg = a.open_segment(&peer.name).await.unwrap();
        let reqs: Vec<_> = (0..4096u64)
            .map(|k| TransferRequest::write(l, (k % 8) << 20, seg, peer.region + ((k % 8) << 20), 1 << 20))
            .collect();
        let b = a.submit(reqs, SubmitOptions::default()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        let name = peer.name.clone();
        drop(peer); // SIGKILL
        let s = tokio::time::timeout(Duration::from_secs(30), a.wait(b)).await.unwrap().unwrap();
        a.release(b).unwrap();
        assert_eq!(s.state, BatchState::Failed, "a batch to a killed peer fails");
        assert!(s.first_error().unwrap().is_transient(), "{:?}", s.first_error());
        let gone = async {
            while a.stats().endpoints != 0 || a.stats().inflight != 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(3), gone).await.expect("the broken endpoint is destroyed");
        let before = a.same_host_bytes();
        let peer2 = Peer::start(&name, true);
        let w = TransferRequest::write(l, 0, seg, peer2.region, 1 << 20);
        if run(&a, vec![w]).await.state != BatchState::Completed {
            // The first use notices the new generation (PeerRestarted).
            assert_eq!(run(&a, vec![w]).await.state, BatchState::Completed);
        }
        assert_eq!(a.same_host_bytes() - before, 1 << 20, "the restarted peer is reached by same-host copies");
        a.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

fn is_root() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status.lines().any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(2) == Some("0"))
}

/// The kernel refuses one direction: the peer runs as another user
/// (nobody), so it may not read this process (EPERM), while this one
/// (root, with `CAP_SYS_PTRACE`) may read it. Writes, which the peer would
/// copy, go through the sockets; reads, which this side copies, do not;
/// every byte checked. Needs root (CI runs as root; elsewhere it says so
/// and checks nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direction_the_kernel_refuses_goes_through_the_socket() {
    if !is_root() {
        eprintln!("not root: cannot start a peer as another user; nothing checked");
        return;
    }
    tokio::time::timeout(Duration::from_secs(60), async {
        let peer = Peer::start_as("127.0.0.1:0", true, Some(65534));
        let a = node(test_config()).await;
        let (read, _written) = round_trip(&a, &peer).await;
        assert_eq!(a.same_host_bytes(), read, "reads by same-host copies, writes through the socket");
        a.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

/// A raw client's HELLO offering same-host copies as process `pid`, with
/// its nonce at `nonce_at`; returns the CHALLENGE's flags after finishing
/// the handshake.
async fn offer(s: &mut tokio::net::TcpStream, nonce: &[u8; NONCE_LEN], pid: u32, nonce_at: u64) -> u8 {
    let mut h = Header::new(FrameType::Hello);
    h.flags = SAME_HOST;
    h.addr = u64::from(pid);
    h.len = nonce_at;
    support::raw::hello_as(s, h, nonce).await.flags
}

/// A same-host WRITE of `len` bytes to `addr`, its source at `from`.
async fn pull_write(s: &mut tokio::net::TcpStream, generation: u64, addr: u64, len: u64, from: u64) {
    let mut h = Header::new(FrameType::Write);
    h.flags = SAME_HOST;
    h.id = 1;
    h.addr = addr;
    h.len = len;
    h.generation = generation;
    h.payload_len = 8;
    s.write_all(&h.encode()).await.unwrap();
    s.write_all(&from.to_le_bytes()).await.unwrap();
}

/// Rule 9 with same-host copies: a client is believed to be a process only
/// if that process holds the client's end of the connection. Here the
/// client names another process (a `tcp-peer` that holds a copy of the
/// client's nonce in its region, written there through the protocol) and
/// asks the server to copy that process's memory: the server does not
/// agree to same-host writes, refuses the frame, and copies nothing. A
/// client that names itself but points at no nonce is not believed either;
/// one that passes and then names a source it does not map gets an error
/// status, and the connection goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_names_another_process_is_not_believed() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let victim = Peer::start("127.0.0.1:0", true);
        let server = node(test_config()).await;
        let mem = Buffer::new(1 << 20).unwrap();
        server.register(mem.region(), Access::REMOTE_RW).unwrap();
        let generation = server.generation();
        let nonce = [0x5au8; NONCE_LEN];
        // Plant the nonce in the victim's memory through the protocol.
        let a = node(TcpConfig { same_host: false, ..test_config() }).await;
        let planted = Buffer::from_slice(&nonce).unwrap();
        let pl = a.register(planted.region(), Access::LOCAL).unwrap();
        let vseg = a.open_segment(&victim.name).await.unwrap();
        let s = run(&a, vec![TransferRequest::write(pl, 0, vseg, victim.region, NONCE_LEN as u64)]).await;
        assert_eq!(s.state, BatchState::Completed);

        let addr = server.local_addr();
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let flags = offer(&mut s, &nonce, victim.pid(), victim.region).await;
        assert_eq!(flags & PULL_WRITES, 0, "another process's pid is not believed");
        pull_write(&mut s, generation, mem.addr(), 4096, victim.region + 4096).await;
        assert!(
            support::raw::closed(&mut s).await,
            "a same-host WRITE from an unverified client closes the connection"
        );
        assert!(mem.to_vec().iter().all(|&b| b == 0), "nothing was copied from the other process");

        // Its own pid, but no nonce where it says: not believed either.
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let elsewhere = [0u8; NONCE_LEN];
        let flags = offer(&mut s, &nonce, std::process::id(), elsewhere.as_ptr() as u64).await;
        assert_eq!(flags & PULL_WRITES, 0, "a process whose memory lacks the nonce is not believed");

        // Itself, truthfully: believed; a source it does not map is an
        // error answer, and a good one is copied.
        let mine = Box::new(nonce);
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let flags = offer(&mut s, &mine, std::process::id(), mine.as_ptr() as u64).await;
        assert_eq!(flags & (PULL_WRITES | SAME_HOST), PULL_WRITES | SAME_HOST, "the client itself is believed");
        pull_write(&mut s, generation, mem.addr(), 4096, 8).await;
        let (h, _) = next_frame(&mut s, WAIT).await.expect("an answer");
        assert_eq!((h.ty, h.status), (FrameType::WriteAck, Status::SourceCopy));
        let src = Buffer::from_slice(&pattern(3, 4096)).unwrap();
        pull_write(&mut s, generation, mem.addr() + 100, 4096, src.addr()).await;
        let (h, _) = next_frame(&mut s, WAIT).await.expect("an answer");
        assert_eq!((h.ty, h.status), (FrameType::WriteAck, Status::Ok));
        assert_eq!(&mem.to_vec()[100..4196], &src.to_vec()[..]);
        // Out of the region: refused like any WRITE.
        pull_write(&mut s, generation, mem.addr() + (1 << 20) - 10, 4096, src.addr()).await;
        let (h, _) = next_frame(&mut s, WAIT).await.expect("an answer");
        assert_eq!((h.ty, h.status), (FrameType::WriteAck, Status::OutOfBounds));
        // Several in one burst (the server copies those it has in hand
        // together): each is answered on its own, by id, and only the good
        // ones land.
        let many = Buffer::from_slice(&pattern(9, 8 * 4096)).unwrap();
        let at = |k: u64| mem.addr() + (64 << 10) + k * 4096;
        let frames: Vec<(u64, u64, u64, Status)> = vec![
            (10, at(1), 8, Status::SourceCopy),
            (11, at(0), many.addr(), Status::Ok),
            (12, at(2), many.addr() + 2 * 4096, Status::Ok),
            (13, mem.addr() + (1 << 20) - 10, many.addr(), Status::OutOfBounds),
            (14, at(4), many.addr() + 4 * 4096, Status::Ok),
            (15, at(5), many.addr() + 5 * 4096, Status::Ok),
        ];
        let mut burst = Vec::new();
        for &(id, addr, from, _) in &frames {
            let mut h = Header::new(FrameType::Write);
            (h.flags, h.id, h.addr, h.len, h.generation, h.payload_len) = (SAME_HOST, id, addr, 4096, generation, 8);
            burst.extend_from_slice(&h.encode());
            burst.extend_from_slice(&from.to_le_bytes());
        }
        s.write_all(&burst).await.unwrap();
        let mut answered = std::collections::HashMap::new();
        for _ in &frames {
            let (h, _) = next_frame(&mut s, WAIT).await.expect("an answer");
            assert_eq!(h.ty, FrameType::WriteAck);
            answered.insert(h.id, h.status);
        }
        let got = mem.to_vec();
        for &(id, _, _, want) in &frames {
            assert_eq!(answered.get(&id), Some(&want), "frame {id}");
        }
        for k in 0..6usize {
            let (dst, src) = (&got[(64 << 10) + k * 4096..][..4096], &many.to_vec()[k * 4096..][..4096]);
            assert_eq!(dst == src, [0, 2, 4, 5].contains(&k), "page {k}");
        }
        a.shutdown().await.unwrap();
        server.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

/// The conformance harness's topology (`support/harness.rs`: every node
/// behind a loopback fault proxy of this process) moves its bytes by
/// same-host copies, so the `tcp` and `tcp_pull` conformance runs exercise
/// them (and `tcp_sockets`, with them off, the socket path).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_behind_the_fault_proxy_use_same_host_copies() {
    tokio::time::timeout(Duration::from_secs(30), async {
        for same_host in [true, false] {
            let cfg = TcpConfig { same_host, ..test_config() };
            let (a, b) = (node(cfg.clone()).await, node(cfg).await);
            let proxy =
                support::proxy::FaultProxy::start("127.0.0.1:0".parse().unwrap(), b.local_addr()).await.unwrap();
            let (src, dst) = (Buffer::from_slice(&pattern(4, 1 << 20)).unwrap(), Buffer::new(1 << 20).unwrap());
            let l = a.register(src.region(), Access::LOCAL).unwrap();
            b.register(dst.region(), Access::REMOTE_RW).unwrap();
            let seg = a.open_segment(&proxy.addr.to_string()).await.unwrap();
            let s = run(&a, vec![TransferRequest::write(l, 0, seg, dst.addr(), 1 << 20)]).await;
            assert_eq!(s.state, BatchState::Completed, "{:?}", s.first_error());
            assert!(dst.to_vec() == src.to_vec());
            let want = if same_host { 1 << 20 } else { 0 };
            assert_eq!(a.same_host_bytes(), want, "same_host = {same_host}");
            a.shutdown().await.unwrap();
            b.shutdown().await.unwrap();
        }
    })
    .await
    .expect("test timed out");
}

/// Direct writes (`TcpConfig::direct_writes`): small WRITEs to a same-host
/// peer process are copied straight into its memory by the submitting
/// thread, every byte where it belongs; work over the direct bound still
/// goes through the lanes (the peer copies it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_writes_go_straight_into_the_peers_memory() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let peer = Peer::start("127.0.0.1:0", true);
        let a = node(test_config()).await;
        let seg = a.open_segment(&peer.name).await.unwrap();
        let src = Buffer::from_slice(&pattern(9, 1 << 20)).unwrap();
        let sl = a.register(src.region(), Access::LOCAL).unwrap();
        let mut want = start_pattern(LEN);
        let mut direct = 0;
        for (k, size) in [1usize, 4096, 65537].into_iter().enumerate() {
            let (from, to) = (k * 7, k * 8191 + 3);
            let s =
                run(&a, vec![TransferRequest::write(sl, from as u64, seg, peer.region + to as u64, size as u64)]).await;
            assert_eq!(s.state, BatchState::Completed, "{size}: {:?}", s.first_error());
            want[to..to + size].copy_from_slice(&src.to_vec()[from..from + size]);
            direct += size as u64;
            assert_eq!(a.direct_write_bytes(), direct, "{size} bytes went straight into the peer");
        }
        let reqs: Vec<_> = (0..16u64)
            .map(|k| TransferRequest::write(sl, k * 4096, seg, peer.region + (1 << 20) + k * 4100, 4096))
            .collect();
        let s = run(&a, reqs).await;
        assert_eq!(s.state, BatchState::Completed, "{:?}", s.first_error());
        for k in 0..16usize {
            let to = (1 << 20) + k * 4100;
            want[to..to + 4096].copy_from_slice(&src.to_vec()[k * 4096..(k + 1) * 4096]);
        }
        direct += 16 * 4096;
        assert_eq!(a.direct_write_bytes(), direct, "a batch of 16 small writes went straight into the peer");
        // Over the bound (4 MiB in one batch): through the lanes.
        let before = a.same_host_bytes();
        let reqs: Vec<_> = (0..4u64)
            .map(|k| TransferRequest::write(sl, 0, seg, peer.region + (4 << 20) + (k << 20), 1 << 20))
            .collect();
        let s = run(&a, reqs).await;
        assert_eq!(s.state, BatchState::Completed, "{:?}", s.first_error());
        for k in 0..4usize {
            let to = (4 << 20) + (k << 20);
            want[to..to + (1 << 20)].copy_from_slice(&src.to_vec());
        }
        assert_eq!(a.direct_write_bytes(), direct, "large work is not written directly");
        assert_eq!(a.same_host_bytes() - before, 4 << 20, "large work is copied by the peer");
        let back = Buffer::new(LEN).unwrap();
        let bl = a.register(back.region(), Access::LOCAL).unwrap();
        let s = run(&a, vec![TransferRequest::read(bl, 0, seg, peer.region, LEN as u64)]).await;
        assert_eq!(s.state, BatchState::Completed, "{:?}", s.first_error());
        assert!(back.to_vec() == want, "every written byte is where it belongs, and no other byte changed");
        a.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

/// Rule 9 with direct writes: once the target's `unregister` returns, no
/// direct write lands in the region, not even one racing it, and later
/// writes to it fail (the target refuses them) without touching it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_direct_write_lands_once_the_target_unregistered() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let target = node(test_config()).await;
        let a = std::sync::Arc::new(node(test_config()).await);
        let dst = Buffer::new(1 << 20).unwrap();
        let src = Buffer::from_slice(&[0xA5u8; 4096]).unwrap();
        let sl = a.register(src.region(), Access::LOCAL).unwrap();
        let seg = a.open_segment(&target.local_segment_name()).await.unwrap();
        let mut refused = 0;
        for round in 0..20u64 {
            let r = target.register(dst.region(), Access::REMOTE_RW).unwrap();
            let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let writer = {
                let (a, stop, to) = (a.clone(), stop.clone(), dst.addr());
                tokio::spawn(async move {
                    let mut failed = 0u32;
                    for k in 0..100_000u64 {
                        if stop.load(std::sync::atomic::Ordering::Relaxed) {
                            break;
                        }
                        let w = TransferRequest::write(sl, 0, seg, to + (k % 256) * 4096, 4096);
                        if run(&a, vec![w]).await.state != BatchState::Completed {
                            failed += 1;
                        }
                    }
                    failed
                })
            };
            tokio::time::sleep(Duration::from_micros(300 + 100 * round)).await;
            target.unregister(r).await.unwrap();
            // From here on nothing may land in it: writes still coming fail.
            dst.fill(0);
            tokio::time::sleep(Duration::from_millis(5)).await;
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            refused += writer.await.unwrap();
            assert!(dst.to_vec().iter().all(|&b| b == 0), "round {round}: a write landed after unregister returned");
        }
        assert!(a.direct_write_bytes() > 0, "the writes went straight into the target while it was registered");
        assert!(refused > 0, "writes after the unregister failed");
        a.shutdown().await.unwrap();
        target.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

/// Direct reads (`TcpConfig::direct_reads`): small READs from a same-host
/// peer process are copied straight out of its memory by the submitting
/// thread, every byte right, and a read that follows a write (direct, or
/// through the lanes) sees that write's bytes; work over the direct bound
/// still goes through the lanes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_reads_come_straight_out_of_the_peers_memory() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let peer = Peer::start("127.0.0.1:0", true);
        let a = node(test_config()).await;
        let seg = a.open_segment(&peer.name).await.unwrap();
        let back = Buffer::new(1 << 20).unwrap();
        let bl = a.register(back.region(), Access::LOCAL).unwrap();
        let start = start_pattern(LEN);
        let mut direct = 0;
        for (k, size) in [1usize, 4096, 65537].into_iter().enumerate() {
            let (from, to) = (k * 8191 + 3, k * 7);
            let s =
                run(&a, vec![TransferRequest::read(bl, to as u64, seg, peer.region + from as u64, size as u64)]).await;
            assert_eq!(s.state, BatchState::Completed, "{size}: {:?}", s.first_error());
            assert_eq!(&back.to_vec()[to..to + size], &start[from..from + size], "a read of {size} bytes");
            direct += size as u64;
            assert_eq!(a.direct_read_bytes(), direct, "{size} bytes came straight out of the peer");
        }
        let reqs: Vec<_> = (0..16u64)
            .map(|k| TransferRequest::read(bl, k * 4096, seg, peer.region + (1 << 20) + k * 4100, 4096))
            .collect();
        let s = run(&a, reqs).await;
        assert_eq!(s.state, BatchState::Completed, "{:?}", s.first_error());
        for k in 0..16usize {
            let from = (1 << 20) + k * 4100;
            assert_eq!(&back.to_vec()[k * 4096..(k + 1) * 4096], &start[from..from + 4096], "read {k} of 16");
        }
        direct += 16 * 4096;
        assert_eq!(a.direct_read_bytes(), direct, "a batch of 16 small reads came straight out of the peer");
        // A read after a write sees it: a direct write, then a large one
        // through the lanes (the peer copies it), each read back directly.
        let src = Buffer::from_slice(&pattern(3, 4 << 20)).unwrap();
        let sl = a.register(src.region(), Access::LOCAL).unwrap();
        for (len, what) in [(4096usize, "a direct write"), (4 << 20, "a write through the lanes")] {
            let to = (2 << 20) as u64;
            let s = run(&a, vec![TransferRequest::write(sl, 0, seg, peer.region + to, len as u64)]).await;
            assert_eq!(s.state, BatchState::Completed, "{what}: {:?}", s.first_error());
            let s = run(&a, vec![TransferRequest::read(bl, 0, seg, peer.region + to + len as u64 - 4096, 4096)]).await;
            assert_eq!(s.state, BatchState::Completed, "{:?}", s.first_error());
            assert_eq!(&back.to_vec()[..4096], &src.to_vec()[len - 4096..len], "the read after {what} sees it");
            direct += 4096;
            assert_eq!(a.direct_read_bytes(), direct, "the read after {what} was direct");
        }
        // Over the bound (4 MiB in one batch): through the lanes.
        let big = Buffer::new(4 << 20).unwrap();
        let gl = a.register(big.region(), Access::LOCAL).unwrap();
        let reqs: Vec<_> =
            (0..4u64).map(|k| TransferRequest::read(gl, k << 20, seg, peer.region + (k << 20), 1 << 20)).collect();
        let s = run(&a, reqs).await;
        assert_eq!(s.state, BatchState::Completed, "{:?}", s.first_error());
        assert_eq!(a.direct_read_bytes(), direct, "large work is not read directly");
        let mut want = start[..4 << 20].to_vec();
        // The write of 4 MiB at 2 MiB covers the read's upper half.
        want[2 << 20..].copy_from_slice(&src.to_vec()[..2 << 20]);
        assert!(big.to_vec() == want, "the large read through the lanes is byte-exact");
        a.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

/// Rule 9 with direct reads: once the target's `unregister` returns, no
/// direct read copies a byte of the region, not even one racing it (the
/// target then fills the memory with a new pattern, and no read that
/// completes may hold it), and later reads fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_direct_read_copies_once_the_target_unregistered() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let target = node(test_config()).await;
        let a = std::sync::Arc::new(node(test_config()).await);
        let mem = Buffer::new(1 << 20).unwrap();
        let seg = a.open_segment(&target.local_segment_name()).await.unwrap();
        let mut refused = 0;
        for round in 0..20u64 {
            mem.fill(0xA5);
            let r = target.register(mem.region(), Access::REMOTE_RW).unwrap();
            let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let reader = {
                let (a, stop, from) = (a.clone(), stop.clone(), mem.addr());
                tokio::spawn(async move {
                    let dst = Buffer::new(4096).unwrap();
                    let dl = a.register(dst.region(), Access::LOCAL).unwrap();
                    let (mut failed, mut stale) = (0u32, 0u32);
                    for k in 0..100_000u64 {
                        if stop.load(std::sync::atomic::Ordering::Relaxed) {
                            break;
                        }
                        dst.fill(0);
                        let rd = TransferRequest::read(dl, 0, seg, from + (k % 256) * 4096, 4096);
                        if run(&a, vec![rd]).await.state != BatchState::Completed {
                            failed += 1;
                        } else if dst.to_vec().iter().any(|&b| b != 0xA5) {
                            stale += 1;
                        }
                    }
                    a.unregister(dl).await.unwrap();
                    (failed, stale)
                })
            };
            tokio::time::sleep(Duration::from_micros(300 + 100 * round)).await;
            target.unregister(r).await.unwrap();
            // From here on the memory is the target's again: a read that
            // completes with these bytes copied after the unregister.
            mem.fill(0x5A);
            tokio::time::sleep(Duration::from_millis(5)).await;
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            let (failed, stale) = reader.await.unwrap();
            assert_eq!(stale, 0, "round {round}: a read completed with bytes from after unregister returned");
            refused += failed;
        }
        assert!(a.direct_read_bytes() > 0, "the reads came straight out of the target while it was registered");
        assert!(refused > 0, "reads after the unregister failed");
        a.shutdown().await.unwrap();
        target.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

/// `SubmitOptions::round_trip` (what liveness probes use): a small read
/// from a same-host peer that is stopped still completes directly (its
/// memory is there), but one that asks for the peer itself waits for it
/// and ends at its deadline; once the peer runs again it completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_trip_needs_the_peer_itself() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let peer = Peer::start("127.0.0.1:0", true);
        let a = node(test_config()).await;
        let seg = a.open_segment(&peer.name).await.unwrap();
        let back = Buffer::new(4096).unwrap();
        let bl = a.register(back.region(), Access::LOCAL).unwrap();
        let read = || vec![TransferRequest::read(bl, 0, seg, peer.region, 64)];
        let s = run(&a, read()).await;
        assert_eq!(s.state, BatchState::Completed, "{:?}", s.first_error());
        support::stop(peer.pid());
        let direct = a.direct_read_bytes();
        let s = run(&a, read()).await;
        assert_eq!(s.state, BatchState::Completed, "a direct read does not need the peer to run");
        assert_eq!(a.direct_read_bytes(), direct + 64);
        let opts = SubmitOptions::with_timeout(Duration::from_millis(300)).round_trip();
        let id = a.submit(read(), opts).await.unwrap();
        let s = a.wait(id).await.unwrap();
        a.release(id).unwrap();
        assert_eq!(s.state, BatchState::TimedOut, "a round trip to a stopped peer waits for it");
        assert_eq!(a.direct_read_bytes(), direct + 64, "the round trip was not read directly");
        support::resume(peer.pid());
        let opts = SubmitOptions::with_timeout(Duration::from_secs(10)).round_trip();
        let id = a.submit(read(), opts).await.unwrap();
        let s = a.wait(id).await.unwrap();
        a.release(id).unwrap();
        assert_eq!(s.state, BatchState::Completed, "{:?}", s.first_error());
        assert_eq!(&back.to_vec()[..64], &start_pattern(64)[..]);
        a.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}
