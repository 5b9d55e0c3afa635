//! Device memory over real loopback sockets, on fake devices: large
//! transfers are byte-exact, the staging buffers come and go with the
//! device regions (every pin undone), a held device copy keeps its batch
//! from being reported terminal, the target's copies overlap, the
//! initiator's READ copies run off its reader, and a peer answering a
//! staged READ twice gets none of its second answer's bytes in.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failure should panic

mod support;

use std::sync::Arc;
use std::time::Duration;

use support::fake_peer::{self, FakePeer, Script};
use support::{eventually, node, run, test_config};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use transport_core::{Access, BatchState, Buffer, FakeDevice, MemoryRegion, SubmitOptions, TransferRequest, Transport};
use transport_tcp::wire::{FrameType, Header};
use transport_tcp::{TcpConfig, TcpTransport};

/// The tests' configuration with staging on (it is off by default).
fn staged() -> TcpConfig {
    TcpConfig { staging_buffers: 16, ..test_config() }
}

const LIMIT: Duration = Duration::from_secs(60);
/// One staging buffer (the transport's `STAGE`).
const STAGE: u64 = 1 << 20;

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| ((i as u64).wrapping_mul(31).wrapping_add(seed * 7) % 251) as u8).collect()
}

fn device(index: u32, cap: usize) -> Arc<FakeDevice> {
    Arc::new(FakeDevice::new(index, cap).unwrap())
}

/// A region of `len` bytes on `dev` holding `pattern(seed)`.
fn filled(dev: &Arc<FakeDevice>, len: usize, seed: u64) -> (MemoryRegion, Vec<u8>) {
    let r = FakeDevice::region(dev, len).unwrap();
    let bytes = pattern(seed, len);
    r.write_at(0, &bytes).unwrap();
    (r, bytes)
}

/// Holds `dev`'s copies until dropped, so a failing test lets them go
/// (and ends) instead of waiting for them forever at the runtime's end.
struct Held(Arc<FakeDevice>);

impl Held {
    fn new(dev: &Arc<FakeDevice>) -> Self {
        dev.hold_copies();
        Held(dev.clone())
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.0.release_copies();
    }
}

fn staging(t: &TcpTransport) -> u64 {
    t.stats().staging_bytes
}

/// Submits `reqs` with `dev`'s copies held, then cancels the batch (and
/// again, lets its deadline pass): it is not reported terminal while a
/// copy is held, and no copy runs once it is. The deadline starts at 30 ms
/// and is tried again longer when it passed before the first copy began
/// (a loaded machine): that batch ends with nothing held, which shows
/// nothing.
async fn ends_only_after_held_copies(a: &Arc<TcpTransport>, dev: &Arc<FakeDevice>, reqs: &[TransferRequest]) {
    let tries = [None, Some(30), Some(250), Some(2000)];
    let mut deadline_shown = false;
    for deadline in tries {
        if deadline_shown {
            break;
        }
        let held = Held::new(dev);
        let opts = match deadline {
            Some(ms) => SubmitOptions::with_timeout(Duration::from_millis(ms)),
            None => SubmitOptions::default(),
        };
        let id = a.submit(reqs.to_vec(), opts).await.unwrap();
        let started = eventually(|| dev.in_flight() > 0 || a.poll(id).is_ok_and(|s| s.is_terminal())).await;
        assert!(started, "no device copy started and the batch did not end (deadline: {deadline:?})");
        if dev.in_flight() == 0 {
            assert!(deadline.is_some(), "a batch without a deadline ended before its first copy");
            drop(held);
            a.release(id).unwrap();
            continue;
        }
        deadline_shown = deadline.is_some();
        let t = a.clone();
        let ended = tokio::spawn(async move {
            if deadline.is_some() {
                t.wait(id).await
            } else {
                t.cancel(id).await
            }
        });
        // Well past the deadline and the drain timeout: still not over.
        let past = Duration::from_millis(deadline.unwrap_or(0) + 300);
        tokio::time::sleep(past).await;
        assert!(!ended.is_finished(), "reported terminal while a device copy runs (deadline: {deadline:?})");
        assert!(!a.poll(id).unwrap().is_terminal());
        drop(held);
        let s = ended.await.unwrap().unwrap();
        assert!(s.is_terminal(), "{:?}", s.state);
        assert_eq!(dev.in_flight(), 0, "a copy runs after the terminal report");
        a.release(id).unwrap();
    }
    assert!(deadline_shown, "every deadline passed before the first device copy began");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_device_to_device_transfers_are_byte_exact_and_staging_comes_and_goes() {
    tokio::time::timeout(LIMIT, async {
        const LEN: usize = 64 << 20;
        let cfg = staged();
        let bound = cfg.staging_buffers as u64 * STAGE;
        let (a, b) = (node(cfg.clone()).await, node(cfg).await);
        let (da, db) = (device(0, 2 * LEN + (1 << 20)), device(1, LEN + (1 << 20)));
        assert_eq!((staging(&a), staging(&b)), (0, 0), "no device region, no staging buffer");
        let (src, bytes) = filled(&da, LEN, 1);
        let dst = FakeDevice::region(&db, LEN).unwrap();
        let l = a.register(src.clone(), Access::LOCAL).unwrap();
        let r = b.register(dst.clone(), Access::REMOTE_RW).unwrap();
        for t in [&a, &b] {
            let s = staging(t);
            assert!(s > 0 && s <= bound, "staging bytes {s} while a device region is registered (bound {bound})");
        }
        assert!(da.pinned() > 0 && db.pinned() > 0, "the staging buffers are pinned through the providers");
        let seg = a.open_segment(&b.local_segment_name()).await.unwrap();
        const PART: u64 = 16 << 20;
        let reqs = (0..LEN as u64 / PART)
            .map(|k| TransferRequest::write(l, k * PART, seg, dst.addr() + k * PART, PART))
            .collect();
        let s = run(&a, reqs).await;
        assert_eq!(s.state, BatchState::Completed, "write: {:?}", s.first_error());
        assert!(dst.to_vec() == bytes, "device to device write: the target's bytes differ");
        // And back, into a second device region of the initiator.
        let back = FakeDevice::region(&da, LEN).unwrap();
        let bl = a.register(back.clone(), Access::LOCAL).unwrap();
        let reqs = (0..LEN as u64 / PART)
            .map(|k| TransferRequest::read(bl, k * PART, seg, dst.addr() + k * PART, PART))
            .collect();
        let s = run(&a, reqs).await;
        assert_eq!(s.state, BatchState::Completed, "read: {:?}", s.first_error());
        assert!(back.to_vec() == bytes, "device to device read: the local bytes differ");
        assert_eq!((da.in_flight(), db.in_flight()), (0, 0), "no copy runs once the batches ended");
        // The last device region of each side takes the buffers with it.
        a.unregister(l).await.unwrap();
        assert!(staging(&a) > 0, "one device region is still registered");
        a.unregister(bl).await.unwrap();
        b.unregister(r).await.unwrap();
        assert!(eventually(|| staging(&a) == 0 && staging(&b) == 0).await, "staging bytes stay after unregister");
        assert!(eventually(|| da.pinned() == 0 && db.pinned() == 0).await, "a pin was not undone");
        // Registered again, the buffers come back; close frees them.
        let l = a.register(src, Access::LOCAL).unwrap();
        assert!(staging(&a) > 0);
        let s = run(&a, vec![TransferRequest::write(l, 0, seg, dst.addr(), 4096)]).await;
        assert_ne!(s.state, BatchState::Completed, "the target's region is gone");
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
        assert_eq!((staging(&a), staging(&b)), (0, 0));
        assert_eq!((da.pinned(), db.pinned()), (0, 0), "every pin is undone after close");
    })
    .await
    .expect("test timed out");
}

/// A batch whose initiator-side device copy is held is not reported
/// terminal (by cancel, nor by its deadline) until the copy is over: no
/// copy out of the caller's memory runs after the terminal report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_device_copy_keeps_its_batch_from_ending() {
    tokio::time::timeout(LIMIT, async {
        let cfg = TcpConfig { drain_timeout: Duration::from_millis(20), ..staged() };
        let (a, b) = (Arc::new(node(cfg.clone()).await), node(cfg).await);
        let da = device(0, 4 << 20);
        let (src, _) = filled(&da, 1 << 20, 2);
        let dst = Buffer::new(1 << 20).unwrap();
        let l = a.register(src, Access::LOCAL).unwrap();
        b.register(dst.region(), Access::REMOTE_RW).unwrap();
        let seg = a.open_segment(&b.local_segment_name()).await.unwrap();
        let write = vec![TransferRequest::write(l, 0, seg, dst.addr(), 1 << 20)];
        ends_only_after_held_copies(&a, &da, &write).await;
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

/// The target copies a WRITE's chunks into device memory off the
/// runtime, two at a time per connection, while it reads the next: with
/// its copies held, two are in flight at once (never more), and the write
/// completes byte-exact once they are let go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn target_device_copies_overlap_two_per_connection() {
    tokio::time::timeout(LIMIT, async {
        // One slice of four staging buffers' worth.
        const LEN: usize = 4 * STAGE as usize;
        let cfg = TcpConfig { lanes: 1, slice_size: LEN, max_frame: LEN, ..staged() };
        let (a, b) = (node(cfg.clone()).await, node(cfg).await);
        let (da, db) = (device(0, LEN), device(1, LEN));
        let (src, bytes) = filled(&da, LEN, 3);
        let dst = FakeDevice::region(&db, LEN).unwrap();
        let l = a.register(src, Access::LOCAL).unwrap();
        b.register(dst.clone(), Access::REMOTE_RW).unwrap();
        let seg = a.open_segment(&b.local_segment_name()).await.unwrap();
        let held = Held::new(&db);
        let id = a
            .submit(vec![TransferRequest::write(l, 0, seg, dst.addr(), LEN as u64)], SubmitOptions::default())
            .await
            .unwrap();
        assert!(eventually(|| db.in_flight() >= 2).await, "the target never ran two copies at once");
        assert!(!a.poll(id).unwrap().is_terminal(), "answered before its copies ended");
        drop(held);
        let s = tokio::time::timeout(Duration::from_secs(30), a.wait(id)).await.unwrap().unwrap();
        assert_eq!(s.state, BatchState::Completed, "{:?}", s.first_error());
        a.release(id).unwrap();
        assert!(dst.to_vec() == bytes, "the target's device bytes differ");
        assert_eq!(db.max_in_flight(), 2, "at most two copies per connection");
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

/// A client that gave up on a WRITE into the target's device memory (its
/// connection reset) while the target was still copying a chunk it had in
/// hand, then sends a notification (as a session's sender says QUIET): the
/// notification is not delivered while that copy runs, so a receiver
/// that acts on it finds its memory quiet (rule 13; rule 11 across
/// connections).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notification_waits_for_the_copy_of_an_abandoned_write() {
    tokio::time::timeout(LIMIT, async {
        const LEN: usize = 4 * STAGE as usize;
        let cfg = TcpConfig { lanes: 1, slice_size: LEN, max_frame: LEN, ..staged() };
        let (a, b) = (node(cfg.clone()).await, node(cfg).await);
        let db = device(1, LEN);
        let src = Buffer::from_slice(&pattern(5, LEN)).unwrap();
        let dst = FakeDevice::region(&db, LEN).unwrap();
        let l = a.register(src.region(), Access::LOCAL).unwrap();
        b.register(dst.clone(), Access::REMOTE_RW).unwrap();
        let seg = a.open_segment(&b.local_segment_name()).await.unwrap();
        let held = Held::new(&db);
        let id = a
            .submit(vec![TransferRequest::write(l, 0, seg, dst.addr(), LEN as u64)], SubmitOptions::default())
            .await
            .unwrap();
        assert!(eventually(|| db.in_flight() > 0).await, "the target never started a copy");
        let s = tokio::time::timeout(Duration::from_secs(30), a.cancel(id)).await.unwrap().unwrap();
        assert!(s.is_terminal(), "{:?}", s.state);
        a.release(id).unwrap();
        let t = Arc::new(a);
        let sent = {
            let t = t.clone();
            tokio::spawn(async move { t.notify(seg, b"quiet".to_vec()).await })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(db.in_flight() > 0, "the held copy ended by itself");
        let early = b.take_notifications(8).unwrap();
        assert!(early.is_empty(), "a notification was delivered while a copy of an earlier write ran");
        drop(held);
        tokio::time::timeout(Duration::from_secs(30), sent).await.unwrap().unwrap().unwrap();
        assert_eq!(db.in_flight(), 0, "a copy ran once the notification was delivered");
        let got = b.take_notifications(8).unwrap();
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0].msg, b"quiet");
        t.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

/// The initiator's READ into device memory goes through staging buffers
/// too: with its device's copies held, several copies of one slice are in
/// flight at once (the lane's reader goes on reading while they run, where
/// an unstaged copy would hold the reader), the batch is not reported
/// terminal (done, cancelled or past its deadline) while one runs, and
/// the bytes are exact once they are let go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initiator_reads_into_device_memory_off_the_reader() {
    tokio::time::timeout(LIMIT, async {
        const LEN: usize = 2 << 20;
        let cfg = TcpConfig { lanes: 1, drain_timeout: Duration::from_millis(20), ..staged() };
        let (a, b) = (Arc::new(node(cfg.clone()).await), node(cfg).await);
        let da = device(0, 4 * LEN);
        let src = Buffer::from_slice(&pattern(4, LEN)).unwrap();
        let dst = FakeDevice::region(&da, LEN).unwrap();
        let l = a.register(dst.clone(), Access::LOCAL).unwrap();
        b.register(src.region(), Access::REMOTE_RW).unwrap();
        let seg = a.open_segment(&b.local_segment_name()).await.unwrap();
        let read = vec![TransferRequest::read(l, 0, seg, src.addr(), LEN as u64)];

        let held = Held::new(&da);
        let id = a.submit(read.clone(), SubmitOptions::default()).await.unwrap();
        assert!(eventually(|| da.in_flight() >= 2).await, "never two copies at once: {}", da.in_flight());
        assert!(!a.poll(id).unwrap().is_terminal(), "reported done before its copies ended");
        drop(held);
        let s = tokio::time::timeout(Duration::from_secs(30), a.wait(id)).await.unwrap().unwrap();
        assert_eq!(s.state, BatchState::Completed, "{:?}", s.first_error());
        a.release(id).unwrap();
        assert!(dst.to_vec() == src.to_vec(), "the device bytes differ");
        let most = da.max_in_flight();
        assert!(most <= cfg_initiator_half(), "{most} copies at once, more than the initiator's buffers");

        ends_only_after_held_copies(&a, &da, &read).await;
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

/// Rule 9 against a peer that answers one staged READ twice: the second
/// answer comes while the first one's bytes are still being copied into
/// device memory (its slice not ended yet). It is a protocol error that
/// breaks the endpoint, and none of its bytes reach the device.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_answer_to_a_staged_read_is_never_copied() {
    tokio::time::timeout(LIMIT, async {
        const LEN: u64 = 64 << 10;
        let script: Script = Arc::new(|mut s: TcpStream| {
            Box::pin(async move {
                while let Some(h) = fake_peer::next_request(&mut s).await {
                    if h.ty != FrameType::Read {
                        return;
                    }
                    let mut burst = Vec::new();
                    for fill in [pattern(5, h.len as usize), vec![0x5a; h.len as usize]] {
                        let mut r = Header::new(FrameType::ReadResp);
                        (r.id, r.len, r.payload_len) = (h.id, h.len, h.len as u32);
                        burst.extend_from_slice(&r.encode());
                        burst.extend_from_slice(&fill);
                    }
                    if s.write_all(&burst).await.is_err() {
                        return;
                    }
                }
            })
        });
        let peer = FakePeer::start(script).await;
        let a = node(TcpConfig { lanes: 1, ..staged() }).await;
        let da = device(0, 1 << 20);
        let dst = FakeDevice::region(&da, LEN as usize).unwrap();
        let l = a.register(dst.clone(), Access::LOCAL).unwrap();
        let seg = a.open_segment(&peer.name()).await.unwrap();
        assert_eq!(a.stats().endpoints, 1);
        let held = Held::new(&da);
        let r = TransferRequest::read(l, 0, seg, fake_peer::REGION.addr, LEN);
        let id = a.submit(vec![r], SubmitOptions::default()).await.unwrap();
        assert!(eventually(|| da.in_flight() > 0).await, "the first answer's copy never started");
        // The second answer is read meanwhile and breaks the endpoint,
        // whose teardown waits for the copy.
        tokio::time::sleep(Duration::from_millis(200)).await;
        drop(held);
        let s = tokio::time::timeout(Duration::from_secs(10), a.wait(id)).await.expect("the read ends").unwrap();
        assert!(s.is_terminal(), "{s:?}");
        assert!(eventually(|| a.stats().endpoints == 0).await, "the second answer did not break the endpoint");
        assert!(dst.to_vec() == pattern(5, LEN as usize), "the device holds other bytes than the first answer's");
        a.release(id).unwrap();
        a.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

/// The buffers `staged()` gives this side's own requests (half of them).
fn cfg_initiator_half() -> u64 {
    staged().staging_buffers as u64 / 2
}
