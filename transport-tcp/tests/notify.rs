//! Notifications (rule 11) over real sockets on loopback: round trip,
//! per-pair order, the bounded inbox pushing back, refusals before the
//! wire, hostile NOTIFY frames, `notify_after` on a write batch, a
//! restarted peer, shutdown and the inbox count in `stats`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failure should panic

mod support;

use support::raw::{closed, hello, next_frame, WAIT};
use support::{node, test_config};

use std::sync::Arc;
use std::time::Duration;

use support::proxy::FaultProxy;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use transport_core::{
    Access, BatchState, Buffer, ErrorKind, SubmitOptions, TransferRequest, Transport, MAX_NOTIFY_FROM, MAX_NOTIFY_LEN,
};
use transport_tcp::wire::{encode_notify, FrameType, Header, Status, MAX_NOTIFY_PAYLOAD};
use transport_tcp::{TcpConfig, TcpTransport};

const LIMIT: Duration = Duration::from_secs(60);

/// Takes every queued notification of `t` as (from, msg) pairs.
fn drain(t: &TcpTransport) -> Vec<(String, Vec<u8>)> {
    t.take_notifications(usize::MAX).unwrap().into_iter().map(|n| (n.from, n.msg)).collect()
}

/// A NOTIFY frame as a raw client would send it.
fn notify_frame(id: u64, generation: u64, payload: &[u8]) -> Vec<u8> {
    let mut h = Header::new(FrameType::Notify);
    h.id = id;
    h.generation = generation;
    h.payload_len = payload.len() as u32;
    let mut v = h.encode().to_vec();
    v.extend_from_slice(payload);
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notification_round_trip() {
    tokio::time::timeout(LIMIT, async {
        let (a, b) = (node(test_config()).await, node(test_config()).await);
        let seg = a.open_segment(&b.local_segment_name()).await.unwrap();
        assert!(b.take_notifications(10).unwrap().is_empty());
        a.notify(seg, b"layer 3 done".to_vec()).await.unwrap();
        tokio::time::timeout(WAIT, b.wait_notification()).await.expect("a notification arrives").unwrap();
        let got = b.take_notifications(10).unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].from, a.local_segment_name());
        assert_eq!(got[0].msg, b"layer 3 done");
        // The empty message and the largest one arrive byte for byte.
        let big: Vec<u8> = (0..MAX_NOTIFY_LEN).map(|i| (i % 251) as u8).collect();
        a.notify(seg, Vec::new()).await.unwrap();
        a.notify(seg, big.clone()).await.unwrap();
        let from = a.local_segment_name();
        assert_eq!(drain(&b), vec![(from.clone(), Vec::new()), (from, big)]);
        // And the other way, over B's own endpoint to A.
        let back = b.open_segment(&a.local_segment_name()).await.unwrap();
        b.notify(back, b"ack".to_vec()).await.unwrap();
        assert_eq!(drain(&a), vec![(b.local_segment_name(), b"ack".to_vec())]);
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_arrive_in_the_order_of_returned_calls() {
    tokio::time::timeout(LIMIT, async {
        let (a, b) = (node(test_config()).await, node(test_config()).await);
        let seg = a.open_segment(&b.local_segment_name()).await.unwrap();
        // Drained while they arrive, so the order is the inbox's, not a
        // snapshot's.
        let mut got = Vec::new();
        for i in 0u32..200 {
            a.notify(seg, i.to_le_bytes().to_vec()).await.unwrap();
            if i % 17 == 0 {
                got.extend(drain(&b));
            }
        }
        got.extend(drain(&b));
        let want: Vec<(String, Vec<u8>)> =
            (0u32..200).map(|i| (a.local_segment_name(), i.to_le_bytes().to_vec())).collect();
        assert_eq!(got, want);
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_inbox_pushes_back_until_drained() {
    tokio::time::timeout(LIMIT, async {
        let a = node(test_config()).await;
        let b = node(TcpConfig { inbox_capacity: 4, ..test_config() }).await;
        let seg = a.open_segment(&b.local_segment_name()).await.unwrap();
        for i in 0u8..4 {
            a.notify(seg, vec![i]).await.unwrap();
        }
        assert_eq!(b.stats().notifications, 4);
        let e = a.notify(seg, vec![4]).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Backpressure, "{e}");
        assert!(e.is_transient(), "{e}");
        // Refused, not queued: the inbox still holds the first four, and
        // the endpoint was not broken by the refusal.
        assert_eq!(b.stats().notifications, 4);
        assert_eq!(a.stats().endpoints, 1);
        let first: Vec<Vec<u8>> = b.take_notifications(2).unwrap().into_iter().map(|n| n.msg).collect();
        assert_eq!(first, vec![vec![0], vec![1]]);
        a.notify(seg, vec![4]).await.unwrap();
        a.notify(seg, vec![5]).await.unwrap();
        assert_eq!(a.notify(seg, vec![6]).await.unwrap_err().kind(), ErrorKind::Backpressure);
        let rest: Vec<Vec<u8>> = drain(&b).into_iter().map(|n| n.1).collect();
        assert_eq!(rest, vec![vec![2], vec![3], vec![4], vec![5]]);
        a.notify(seg, vec![6]).await.unwrap();
        assert_eq!(drain(&b).len(), 1);
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_message_is_refused_before_the_wire() {
    tokio::time::timeout(LIMIT, async {
        let (a, b) = (node(test_config()).await, node(test_config()).await);
        let seg = a.open_segment(&b.local_segment_name()).await.unwrap();
        let e = a.notify(seg, vec![1; MAX_NOTIFY_LEN + 1]).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidRequest, "{e}");
        assert!(!e.is_transient(), "{e}");
        // `notify_after` refuses it before waiting for the batch.
        let e = a.notify_after(transport_core::BatchId(u64::MAX), seg, vec![1; MAX_NOTIFY_LEN + 1]).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidRequest, "{e}");
        // A name too long to send is refused the same way.
        let long = node(TcpConfig { advertise: Some("n".repeat(MAX_NOTIFY_FROM + 1)), ..test_config() }).await;
        let s2 = long.open_segment(&b.local_segment_name()).await.unwrap();
        assert_eq!(long.notify(s2, b"x".to_vec()).await.unwrap_err().kind(), ErrorKind::InvalidRequest);
        // An unknown handle is refused too.
        let e = a.notify(transport_core::SegmentId(u64::MAX), b"x".to_vec()).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidHandle, "{e}");
        // Nothing was delivered; the endpoint still works.
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(b.take_notifications(10).unwrap().is_empty());
        assert_eq!(b.stats().notifications, 0);
        a.notify(seg, b"fine".to_vec()).await.unwrap();
        assert_eq!(drain(&b), vec![(a.local_segment_name(), b"fine".to_vec())]);
        long.shutdown().await.unwrap();
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

/// NOTIFY frames a hostile client writes by hand: lengths that contradict
/// each other, oversized names, messages and frames, a name that is not
/// UTF-8, another generation, a status byte. Each is refused (answered
/// with an error status, or its connection closed), nothing of theirs is
/// queued, and the server goes on serving the same connection (after a
/// refused payload) and other clients.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_notify_frames_are_refused_and_others_served() {
    tokio::time::timeout(LIMIT, async {
        let b = node(TcpConfig { max_frame: 1 << 20, ..test_config() }).await;
        let addr = b.local_addr();
        let mut s = TcpStream::connect(addr).await.unwrap();
        let gen = hello(&mut s).await;
        // Well-delimited frames whose payload breaks the rules: answered,
        // not queued, and the connection goes on.
        let mut long_msg = vec![0u8, 0];
        long_msg.extend_from_slice(&[1; MAX_NOTIFY_LEN + 1]);
        let mut long_name = ((MAX_NOTIFY_FROM + 1) as u16).to_le_bytes().to_vec();
        long_name.extend_from_slice(&vec![b'n'; MAX_NOTIFY_FROM + 1]);
        let answered: [(&str, Vec<u8>, u64, Status); 6] = [
            ("name length past the payload", vec![200, 0, b'a', b'b', b'c'], gen, Status::Protocol),
            ("name length 65535", vec![0xFF, 0xFF, b'a'], gen, Status::TooLarge),
            ("name not UTF-8", vec![2, 0, 0xC3, 0x28, b'm'], gen, Status::Protocol),
            ("message over MAX_NOTIFY_LEN", long_msg, gen, Status::TooLarge),
            ("name over MAX_NOTIFY_FROM", long_name, gen, Status::TooLarge),
            ("another generation", encode_notify("x", b"m").unwrap(), gen ^ 1, Status::StaleGeneration),
        ];
        for (k, (what, payload, g, status)) in answered.iter().enumerate() {
            s.write_all(&notify_frame(k as u64 + 1, *g, payload)).await.unwrap();
            let (h, p) = next_frame(&mut s, WAIT).await.unwrap_or_else(|| panic!("{what}: answered"));
            assert_eq!((h.ty, h.id, h.status), (FrameType::NotifyAck, k as u64 + 1, *status), "{what}");
            assert!(p.is_empty(), "{what}");
        }
        assert_eq!(b.stats().notifications, 0, "nothing refused was queued");
        // The same connection still delivers a valid one; its `from` is
        // whatever the client put there.
        s.write_all(&notify_frame(100, gen, &encode_notify("raw-peer", b"ok").unwrap())).await.unwrap();
        let (h, _) = next_frame(&mut s, WAIT).await.expect("answered");
        assert_eq!((h.ty, h.id, h.status), (FrameType::NotifyAck, 100, Status::Ok));
        assert_eq!(drain(&b), vec![("raw-peer".to_owned(), b"ok".to_vec())]);
        // Frames the decoder refuses: the connection is closed unanswered.
        let mut closing: Vec<(&str, Vec<u8>)> = Vec::new();
        let mut over = Header::new(FrameType::Notify);
        over.generation = gen;
        over.payload_len = MAX_NOTIFY_PAYLOAD as u32 + 1;
        let mut v = over.encode().to_vec();
        v.extend_from_slice(&vec![0u8; MAX_NOTIFY_PAYLOAD + 1]);
        closing.push(("payload over MAX_NOTIFY_PAYLOAD (under max_frame)", v));
        let mut huge = over;
        huge.payload_len = u32::MAX;
        closing.push(("payload length u32::MAX", huge.encode().to_vec()));
        closing.push(("payload shorter than the name length field", notify_frame(1, gen, &[0])));
        let mut status = Header::new(FrameType::Notify);
        status.status = Status::Busy;
        status.payload_len = 2;
        let mut v = status.encode().to_vec();
        v.extend_from_slice(&[0, 0]);
        closing.push(("a status byte in the request", v));
        closing.push(("an answer frame from a client", Header::new(FrameType::NotifyAck).encode().to_vec()));
        for (what, bytes) in &closing {
            let mut s = TcpStream::connect(addr).await.unwrap();
            hello(&mut s).await;
            s.write_all(bytes).await.unwrap();
            assert!(next_frame(&mut s, WAIT).await.is_none(), "{what}: not answered");
            assert!(closed(&mut s).await, "{what}: connection closed");
        }
        // Before the handshake, a NOTIFY closes the connection.
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(&notify_frame(1, gen, &encode_notify("pre", b"auth").unwrap())).await.unwrap();
        assert!(closed(&mut s).await, "a NOTIFY before the handshake closes the connection");
        assert_eq!(b.stats().notifications, 0, "nothing refused was queued");
        // A well-behaved transport is still served.
        let a = node(test_config()).await;
        let seg = a.open_segment(&b.local_segment_name()).await.unwrap();
        a.notify(seg, b"still here".to_vec()).await.unwrap();
        assert_eq!(drain(&b), vec![(a.local_segment_name(), b"still here".to_vec())]);
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notify_after_a_write_batch_follows_every_byte() {
    tokio::time::timeout(LIMIT, async {
        let cfg = TcpConfig { slice_size: 64 << 10, ..test_config() };
        let (a, b) = (node(cfg.clone()).await, Arc::new(node(cfg).await));
        let len = 8 << 20;
        let data: Vec<u8> = (0..len).map(|i| (i % 253) as u8 ^ 0x5A).collect();
        let (src, dst) = (Buffer::from_slice(&data).unwrap(), Buffer::new(len).unwrap());
        let l = a.register(src.region(), Access::LOCAL).unwrap();
        b.register(dst.region(), Access::REMOTE_RW).unwrap();
        let seg = a.open_segment(&b.local_segment_name()).await.unwrap();
        // B looks at its memory the moment the notification is there.
        let watcher = {
            let (b, dst) = (b.clone(), dst.clone());
            tokio::spawn(async move {
                b.wait_notification().await.unwrap();
                let snapshot = dst.to_vec();
                (b.take_notifications(10).unwrap(), snapshot)
            })
        };
        let chunk = (len / 64) as u64;
        let reqs =
            (0..64u64).map(|k| TransferRequest::write(l, k * chunk, seg, dst.addr() + k * chunk, chunk)).collect();
        let batch = a.submit(reqs, SubmitOptions::default()).await.unwrap();
        let (status, sent) = a.notify_after(batch, seg, b"kv ready".to_vec()).await.unwrap();
        assert_eq!(status.state, BatchState::Completed);
        sent.expect("a completed batch notifies").unwrap();
        let (got, snapshot) = watcher.await.unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!((got[0].from.as_str(), got[0].msg.as_slice()), (a.local_segment_name().as_str(), &b"kv ready"[..]));
        assert!(snapshot == data, "every byte of the batch was in B's memory when the notification was taken");
        a.release(batch).unwrap();
        // A batch that fails sends nothing.
        let bad = a
            .submit(vec![TransferRequest::write(l, 0, seg, dst.addr() + len as u64 - 8, 64)], SubmitOptions::default())
            .await
            .unwrap();
        let (status, sent) = a.notify_after(bad, seg, b"kv ready".to_vec()).await.unwrap();
        assert_eq!(status.state, BatchState::Failed);
        assert!(sent.is_none(), "a failed batch never notifies");
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(b.take_notifications(10).unwrap().is_empty());
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

/// A notification meant for a peer that restarted behind the same name
/// never reaches the new process as if it were the old one: the handle's
/// stale generation gives a transient `PeerRestarted` (the descriptor is
/// refreshed), and the next call reaches the new process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_peer_is_reported_then_reached() {
    tokio::time::timeout(LIMIT, async {
        let a = node(test_config()).await;
        let b1 = node(test_config()).await;
        let proxy = FaultProxy::start("127.0.0.1:0".parse().unwrap(), b1.local_addr()).await.unwrap();
        let seg = a.open_segment(&proxy.addr.to_string()).await.unwrap();
        a.notify(seg, b"one".to_vec()).await.unwrap();
        assert_eq!(drain(&b1).len(), 1);
        let b2 = node(test_config()).await;
        proxy.set_upstream(b2.local_addr());
        proxy.cut();
        b1.shutdown().await.unwrap();
        let mut kinds = Vec::new();
        let end = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            match a.notify(seg, b"two".to_vec()).await {
                Ok(()) => break,
                Err(e) => {
                    assert!(e.is_transient(), "{e}");
                    assert!(tokio::time::Instant::now() < end, "never reached the restarted peer: {e}");
                    kinds.push(e.kind());
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
        assert!(kinds.contains(&ErrorKind::PeerRestarted), "{kinds:?}");
        assert_eq!(a.segment_descriptor(seg).unwrap().generation, b2.generation());
        assert_eq!(drain(&b2), vec![(a.local_segment_name(), b"two".to_vec())]);
        a.shutdown().await.unwrap();
        b2.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_waits_and_refuses_notifications() {
    tokio::time::timeout(LIMIT, async {
        let (a, b) = (node(test_config()).await, Arc::new(node(test_config()).await));
        let seg = a.open_segment(&b.local_segment_name()).await.unwrap();
        a.notify(seg, b"queued".to_vec()).await.unwrap();
        b.take_notifications(10).unwrap();
        let waiter = {
            let b = b.clone();
            tokio::spawn(async move { b.wait_notification().await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished());
        b.shutdown().await.unwrap();
        let e = tokio::time::timeout(WAIT, waiter).await.expect("the waiter wakes").unwrap().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Shutdown, "{e}");
        assert_eq!(b.wait_notification().await.unwrap_err().kind(), ErrorKind::Shutdown);
        assert_eq!(b.take_notifications(1).unwrap_err().kind(), ErrorKind::Shutdown);
        // The sender of a notification to a peer that is gone gets a
        // transient error, not a hang.
        let e = tokio::time::timeout(WAIT, a.notify(seg, b"late".to_vec())).await.expect("no hang").unwrap_err();
        assert!(e.is_transient(), "{e}");
        a.shutdown().await.unwrap();
        let e = a.notify(seg, b"after".to_vec()).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Shutdown, "{e}");
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_count_queued_notifications() {
    tokio::time::timeout(LIMIT, async {
        let (a, b) = (node(test_config()).await, node(test_config()).await);
        let seg = a.open_segment(&b.local_segment_name()).await.unwrap();
        assert_eq!(b.stats().notifications, 0);
        for i in 0u8..3 {
            a.notify(seg, vec![i]).await.unwrap();
        }
        assert_eq!(b.stats().notifications, 3);
        assert_eq!(a.stats().notifications, 0, "the sender queues nothing");
        assert_eq!(b.take_notifications(2).unwrap().len(), 2);
        assert_eq!(b.stats().notifications, 1);
        assert_eq!(b.take_notifications(10).unwrap().len(), 1);
        assert_eq!(b.stats().notifications, 0);
        // Nothing of a notification stays in flight on the sender.
        let s = a.stats();
        assert_eq!((s.inflight, s.batches), (0, 0));
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}
