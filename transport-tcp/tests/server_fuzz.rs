//! The serving side as a security boundary: arbitrary bytes into the frame
//! decoder (property test), and raw sockets sending malformed, truncated,
//! oversized and unexpected frames or skipping authentication: each such
//! connection is closed, memory is untouched, and the server keeps serving.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test and benchmark code: a failure should panic

mod support;

use support::raw::{closed, hello};

use std::time::Duration;

use proptest::prelude::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use transport_core::{Access, BatchState, Buffer, SubmitOptions, TransferRequest, Transport};
use transport_tcp::wire::{
    decode_notify, encode_notify, FrameDecoder, FrameType, Header, HEADER_LEN, MAX_NOTIFY_PAYLOAD, NONCE_LEN, VERSION,
};
use transport_tcp::TcpConfig;

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn decoder_never_panics_and_stays_bounded(chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..200), 0..20)) {
        let mut d = FrameDecoder::new(4096);
        for c in chunks {
            match d.push(&c) {
                // A NOTIFY has its own bound, whatever max_frame.
                Ok(frames) => for (h, p) in frames { prop_assert_eq!(h.payload_len as usize, p.len()); prop_assert!(p.len() <= 4096.max(MAX_NOTIFY_PAYLOAD)); },
                Err(_) => break,
            }
            prop_assert!(d.buffered() <= 4096.max(HEADER_LEN).max(MAX_NOTIFY_PAYLOAD));
        }
    }

    #[test]
    fn valid_headers_with_one_flipped_byte_are_refused(id in any::<u64>(), addr in any::<u64>(), pos in 0usize..44, bit in 0u8..8, notify in any::<bool>()) {
        let mut h = Header::new(if notify { FrameType::Notify } else { FrameType::Read });
        h.id = id;
        h.addr = addr;
        if notify {
            h.payload_len = 16;
        } else {
            h.len = 16;
        }
        prop_assert!(Header::decode(&h.encode(), 4096).is_ok());
        let mut b = h.encode();
        b[pos] ^= 1 << bit;
        prop_assert!(Header::decode(&b, 4096).is_err());
    }

    #[test]
    fn notify_payloads_never_panic_and_stay_bounded(p in proptest::collection::vec(any::<u8>(), 0..(MAX_NOTIFY_PAYLOAD + 64))) {
        if let Ok((from, msg)) = decode_notify(&p) {
            prop_assert!(from.len() <= transport_core::MAX_NOTIFY_FROM);
            prop_assert!(msg.len() <= transport_core::MAX_NOTIFY_LEN);
            prop_assert_eq!(2 + from.len() + msg.len(), p.len());
            prop_assert_eq!(encode_notify(from, msg), Some(p.clone()));
        }
    }

    #[test]
    fn notify_payloads_round_trip(from in "\\PC{0,64}", msg in proptest::collection::vec(any::<u8>(), 0..=transport_core::MAX_NOTIFY_LEN)) {
        let p = encode_notify(&from, &msg).unwrap();
        prop_assert!(p.len() <= MAX_NOTIFY_PAYLOAD);
        let (f, m) = decode_notify(&p).unwrap();
        prop_assert_eq!((f, m), (from.as_str(), msg.as_slice()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_frames_close_only_their_connection() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let b = support::node(support::test_config()).await;
        let mem = Buffer::new(1 << 16).unwrap();
        let ro = Buffer::new(4096).unwrap();
        b.register(mem.region(), Access::REMOTE_RW).unwrap();
        b.register(ro.region(), Access::REMOTE_READ).unwrap();
        let addr = b.local_addr();
        let snapshot = (mem.to_vec(), ro.to_vec());
        let gen = {
            let mut s = TcpStream::connect(addr).await.unwrap();
            hello(&mut s).await
        };
        let mut cases: Vec<(&str, Vec<u8>)> =
            vec![("garbage", vec![0xFF; 100]), ("truncated header", vec![0x4B, 7, 0])];
        let mut big = Header::new(FrameType::Write);
        big.len = 64 << 20;
        big.payload_len = 64 << 20;
        big.addr = mem.addr();
        big.generation = gen;
        cases.push(("oversized frame", big.encode().to_vec()));
        let mut out = Header::new(FrameType::Write);
        out.len = 16;
        out.payload_len = 16;
        out.addr = mem.addr() + (1 << 16) - 8;
        out.generation = gen;
        let mut v = out.encode().to_vec();
        v.extend_from_slice(&[1u8; 16]);
        cases.push(("write past the region (answered, not applied)", v));
        let mut wrap = out;
        wrap.addr = u64::MAX - 4;
        let mut v = wrap.encode().to_vec();
        v.extend_from_slice(&[1u8; 16]);
        cases.push(("write with addr + len overflow", v));
        let mut denied = out;
        denied.addr = ro.addr();
        let mut v = denied.encode().to_vec();
        v.extend_from_slice(&[1u8; 16]);
        cases.push(("write into a read-only region", v));
        let mut truncated = out;
        truncated.addr = mem.addr();
        let mut v = truncated.encode().to_vec();
        v.extend_from_slice(&[1u8; 5]);
        cases.push(("truncated payload", v));
        let mut unexpected = Header::new(FrameType::WriteAck);
        unexpected.id = 1;
        cases.push(("unexpected frame type", unexpected.encode().to_vec()));
        for (what, bytes) in &cases {
            let mut s = TcpStream::connect(addr).await.unwrap();
            hello(&mut s).await;
            s.write_all(bytes).await.unwrap();
            if what.contains("answered") || what.contains("overflow") || what.contains("read-only") {
                let mut hb = [0u8; HEADER_LEN];
                s.read_exact(&mut hb).await.unwrap();
                let h = Header::decode(&hb, 1 << 20).unwrap();
                assert_ne!(h.status, transport_tcp::wire::Status::Ok, "{what}");
            } else if what.contains("truncated") {
                s.shutdown().await.unwrap();
                assert!(closed(&mut s).await, "{what}: connection closed");
            } else {
                assert!(closed(&mut s).await, "{what}: connection closed");
            }
        }
        // Unauthenticated raw bytes before any handshake.
        let mut s = TcpStream::connect(addr).await.unwrap();
        let mut w = Header::new(FrameType::Write);
        w.len = 4;
        w.payload_len = 4;
        w.addr = mem.addr();
        s.write_all(&w.encode()).await.unwrap();
        s.write_all(&[1, 2, 3, 4]).await.unwrap();
        assert!(closed(&mut s).await, "a frame before the handshake closes the connection");
        assert_eq!((mem.to_vec(), ro.to_vec()), snapshot, "no memory was touched");
        // The server still serves a well-behaved client.
        let a = support::node(support::test_config()).await;
        let src = Buffer::from_slice(&[5u8; 4096]).unwrap();
        let l = a.register(src.region(), Access::LOCAL).unwrap();
        let seg = a.open_segment(&b.local_segment_name()).await.unwrap();
        let bt = a
            .submit(vec![TransferRequest::write(l, 0, seg, mem.addr(), 4096)], SubmitOptions::default())
            .await
            .unwrap();
        assert_eq!(a.wait(bt).await.unwrap().state, BatchState::Completed);
        assert_eq!(&mem.to_vec()[..4096], &[5u8; 4096][..]);
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_without_the_secret_is_refused_and_others_served() {
    tokio::time::timeout(Duration::from_secs(30), async {
        let b = support::node(TcpConfig { secret: Some("k".into()), ..support::test_config() }).await;
        let mut s = TcpStream::connect(b.local_addr()).await.unwrap();
        let mut p = VERSION.to_le_bytes().to_vec();
        p.extend_from_slice(&[1u8; NONCE_LEN]);
        let mut h = Header::new(FrameType::Hello);
        h.payload_len = p.len() as u32;
        s.write_all(&h.encode()).await.unwrap();
        s.write_all(&p).await.unwrap();
        let mut hb = [0u8; HEADER_LEN];
        s.read_exact(&mut hb).await.unwrap();
        let mut n = [0u8; NONCE_LEN];
        s.read_exact(&mut n).await.unwrap();
        let mut a = Header::new(FrameType::Auth);
        a.payload_len = NONCE_LEN as u32;
        s.write_all(&a.encode()).await.unwrap();
        s.write_all(&[0u8; NONCE_LEN]).await.unwrap();
        s.read_exact(&mut hb).await.unwrap();
        let r = Header::decode(&hb, 1 << 20).unwrap();
        assert_eq!(r.ty, FrameType::Error);
        assert_eq!(r.status, transport_tcp::wire::Status::AuthFailed);
        assert!(closed(&mut s).await);
        let ok = support::node(TcpConfig { secret: Some("k".into()), ..support::test_config() }).await;
        ok.open_segment(&b.local_segment_name()).await.unwrap();
        ok.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}
