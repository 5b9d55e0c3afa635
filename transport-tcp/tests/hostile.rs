//! Attacker tests over loopback for issue 12, findings 6 and 7: a request
//! frame with a non-zero status byte is refused, answers already due are
//! sent before a later malformed frame closes the connection, socket option
//! values the OS would refuse are refused up front with the option named,
//! and a server at its connection limit answers `Busy`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failure should panic

mod support;

use support::raw::{closed, hello, next_frame, send_hello, WAIT};

use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use transport_core::{Access, Buffer, ErrorKind, Transport};
use transport_tcp::wire::{FrameType, Header, Status, HEADER_LEN};
use transport_tcp::{TcpConfig, TcpTransport};

/// Finding 7a: a DESC_REQ (or any request) with a status byte other than 0
/// is a malformed frame: the connection is closed without an answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_with_a_status_byte_is_refused() {
    tokio::time::timeout(Duration::from_secs(30), async {
        let b = support::node(support::test_config()).await;
        let mem = Buffer::from_slice(&[9u8; 4096]).unwrap();
        b.register(mem.region(), Access::REMOTE_RW).unwrap();
        let addr = b.local_addr();
        // Control: a clean DESC_REQ is answered.
        let mut s = TcpStream::connect(addr).await.unwrap();
        hello(&mut s).await;
        let mut d = Header::new(FrameType::DescReq);
        d.id = 1;
        s.write_all(&d.encode()).await.unwrap();
        let (h, _) = next_frame(&mut s, WAIT).await.expect("a DESC_RESP");
        assert_eq!(h.ty, FrameType::DescResp);
        // Every request type with a status byte set: no answer, closed.
        for ty in [FrameType::DescReq, FrameType::Read, FrameType::Write] {
            let mut s = TcpStream::connect(addr).await.unwrap();
            let gen = hello(&mut s).await;
            let mut r = Header::new(ty);
            r.id = 2;
            r.status = Status::AuthFailed;
            r.generation = gen;
            r.addr = mem.addr();
            let mut bytes = Vec::new();
            if ty == FrameType::Write {
                r.len = 16;
                r.payload_len = 16;
                bytes.extend_from_slice(&r.encode());
                bytes.extend_from_slice(&[1u8; 16]);
            } else {
                if ty == FrameType::Read {
                    r.len = 16;
                }
                bytes.extend_from_slice(&r.encode());
            }
            s.write_all(&bytes).await.unwrap();
            assert!(next_frame(&mut s, WAIT).await.is_none(), "{ty:?} with status 5 must not be answered");
            assert!(closed(&mut s).await, "{ty:?} with status 5 closes the connection");
        }
        assert_eq!(mem.to_vec(), vec![9u8; 4096], "no memory was touched");
        b.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

/// Finding 7b: frames pipelined in one write, the last one malformed. The
/// answers to the valid ones before it are due and are sent before the
/// connection is closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_before_a_malformed_frame_are_sent() {
    tokio::time::timeout(Duration::from_secs(30), async {
        let b = support::node(support::test_config()).await;
        let mem = Buffer::from_slice(&[3u8; 4096]).unwrap();
        b.register(mem.region(), Access::REMOTE_RW).unwrap();
        let addr = b.local_addr();
        let bad_frames: [(&str, Vec<u8>); 3] = [
            ("garbage", vec![0xFF; HEADER_LEN]),
            ("a request with a status byte", {
                let mut d = Header::new(FrameType::DescReq);
                d.status = Status::Busy;
                d.encode().to_vec()
            }),
            ("an unexpected frame type", Header::new(FrameType::WriteAck).encode().to_vec()),
        ];
        for (what, bad) in bad_frames {
            let mut s = TcpStream::connect(addr).await.unwrap();
            let gen = hello(&mut s).await;
            let mut bytes = Vec::new();
            let mut d = Header::new(FrameType::DescReq);
            d.id = 1;
            bytes.extend_from_slice(&d.encode());
            let mut w = Header::new(FrameType::Write);
            w.id = 2;
            w.addr = mem.addr() + 64;
            w.len = 8;
            w.payload_len = 8;
            w.generation = gen;
            bytes.extend_from_slice(&w.encode());
            bytes.extend_from_slice(&[4u8; 8]);
            let mut r = Header::new(FrameType::Read);
            r.id = 3;
            r.addr = mem.addr() + 60;
            r.len = 16;
            r.generation = gen;
            bytes.extend_from_slice(&r.encode());
            bytes.extend_from_slice(&bad);
            s.write_all(&bytes).await.unwrap();
            let (h, _) = next_frame(&mut s, WAIT).await.unwrap_or_else(|| panic!("{what}: DESC_RESP is sent"));
            assert_eq!((h.ty, h.id), (FrameType::DescResp, 1), "{what}");
            let (h, _) = next_frame(&mut s, WAIT).await.unwrap_or_else(|| panic!("{what}: WRITE_ACK is sent"));
            assert_eq!((h.ty, h.id, h.status), (FrameType::WriteAck, 2, Status::Ok), "{what}");
            let (h, p) = next_frame(&mut s, WAIT).await.unwrap_or_else(|| panic!("{what}: READ_RESP is sent"));
            assert_eq!((h.ty, h.id, h.status), (FrameType::ReadResp, 3, Status::Ok), "{what}");
            assert_eq!(p, [3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4, 4, 3, 3, 3, 3], "{what}");
            assert!(closed(&mut s).await, "{what}: then the connection is closed");
        }
        b.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

/// Finding 6: a keepalive the OS would refuse (`TCP_KEEPIDLE` takes
/// 1..=32767 s) is refused when the transport is built, naming the setting
/// and its range, not later as "Invalid argument (os error 22)".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn socket_options_the_os_refuses_are_named_up_front() {
    for (cfg, field, range) in [
        (
            TcpConfig { keepalive: Some(Duration::from_millis(40_000_000)), ..support::test_config() },
            "keepalive",
            "32767",
        ),
        (TcpConfig { send_buffer: Some(1 << 32), ..support::test_config() }, "send_buffer", "2147483647"),
    ] {
        let Err(e) = TcpTransport::new(cfg).await else { panic!("the config is refused") };
        assert_eq!(e.kind(), ErrorKind::Config, "{e}");
        assert!(e.message().contains(field) && e.message().contains(range), "{e}");
    }
}

/// Finding 6: a server at `max_connections` answers `Busy` before closing,
/// and the initiator reports a transient "busy" error (not "early eof").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_at_its_connection_limit_answers_busy() {
    tokio::time::timeout(Duration::from_secs(30), async {
        let b = support::node(TcpConfig { max_connections: 1, ..support::test_config() }).await;
        let addr = b.local_addr();
        // The one slot, held by a handshaken connection.
        let mut held = TcpStream::connect(addr).await.unwrap();
        hello(&mut held).await;
        // A raw connection over the limit gets an ERROR frame, status Busy.
        for _ in 0..3 {
            let mut s = TcpStream::connect(addr).await.unwrap();
            send_hello(&mut s).await;
            let (e, _) = next_frame(&mut s, WAIT).await.expect("an answer before the close");
            assert_eq!((e.ty, e.status), (FrameType::Error, Status::Busy));
            assert!(closed(&mut s).await);
        }
        // An initiator reports it as a transient "busy" error.
        let a = support::node(TcpConfig { lanes: 1, ..support::test_config() }).await;
        let Err(e) = a.open_segment(&b.local_segment_name()).await else { panic!("refused at the limit") };
        assert_eq!(e.kind(), ErrorKind::ConnectionRefused, "{e}");
        assert!(e.kind().is_transient(), "{e}");
        assert!(e.message().contains("busy"), "{e}");
        // Once the slot is free, the same initiator is served.
        drop(held);
        let end = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            match a.open_segment(&b.local_segment_name()).await {
                Ok(_) => break,
                Err(e) if tokio::time::Instant::now() < end => {
                    assert_eq!(e.kind(), ErrorKind::ConnectionRefused, "{e}");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => panic!("still refused after the slot was freed: {e}"),
            }
        }
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

/// Issue 27, item 2: Busy is transient everywhere. The policy `Engine`
/// opening a segment on a target at its connection limit asks again with
/// backoff (rule 8), and gets through once the one slot frees; while the
/// slot stays taken it gives up after `retry.max_attempts` tries, and the
/// error says how many, over how long.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_retries_a_busy_target_until_a_slot_frees() {
    use kvmove_policy::{Engine, PolicyConfig, RetryConfig};
    use std::sync::Arc;
    tokio::time::timeout(Duration::from_secs(30), async {
        let b = support::node(TcpConfig { max_connections: 1, ..support::test_config() }).await;
        let addr = b.local_addr();
        let mut held = TcpStream::connect(addr).await.unwrap();
        hello(&mut held).await;
        let a: Arc<dyn Transport> = Arc::new(support::node(TcpConfig { lanes: 1, ..support::test_config() }).await);
        let retry =
            RetryConfig { max_attempts: 6, initial_backoff: Duration::from_millis(50), ..RetryConfig::default() };
        let engine = Engine::new(a.clone(), PolicyConfig { retry, ..PolicyConfig::default() }).unwrap();

        // The slot stays taken: every try is refused, the last error says so.
        let start = tokio::time::Instant::now();
        let Err(e) = engine.open_segment(&b.local_segment_name()).await else { panic!("served while at its limit") };
        assert_eq!(e.kind(), ErrorKind::ConnectionRefused, "{e}");
        assert_eq!(e.context_value("attempts"), Some("6"), "{e}");
        assert!(e.to_string().contains("over_ms"), "{e}");
        assert!(start.elapsed() >= Duration::from_millis(50 + 100 + 200), "backed off: {:?}", start.elapsed());

        // The slot frees while the engine is retrying: it gets through.
        let freer = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(120)).await;
            drop(held);
        });
        let seg = engine.open_segment(&b.local_segment_name()).await.expect("served once the slot freed");
        freer.await.unwrap();
        engine.close_segment(seg).await.unwrap();
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}
