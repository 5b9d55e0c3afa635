//! The serving side, over real loopback sockets: one TCP transport serves
//! a writable region A, a read-only region B and keeps an unregistered
//! canary C. Each input is a handshaken connection that sends a sequence
//! of frames (any type, status, flags, addresses inside or around A, B and
//! C or anywhere, lengths, generations, payloads, or raw bytes), then
//! closes its sending half. Checked:
//!
//! - the server answers and closes within 10 s (no hang), and every frame
//!   it sends is a well-formed server frame;
//! - a READ is answered with data only inside A or B (B's bytes exactly),
//!   a WRITE is acknowledged only inside A;
//! - B and C never change; the server keeps serving (the next input's
//!   handshake).
#![no_main]

use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Duration;

use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::runtime::Runtime;
use transport_core::{Access, Buffer, Transport};
use transport_tcp::wire::{FrameDecoder, FrameType, Header, Status, NONCE_LEN, VERSION};
use transport_tcp::{TcpConfig, TcpTransport};

const MAX_FRAME: usize = 64 << 10;
const A_LEN: usize = 64 << 10;
const B_LEN: usize = 4 << 10;
const B_BYTE: u8 = 0xB7;
const C_BYTE: u8 = 0xC3;

struct World {
    rt: Runtime,
    t: TcpTransport,
    addr: SocketAddr,
    a: Buffer,
    b: Buffer,
    c: Buffer,
}

fn world() -> &'static World {
    static W: OnceLock<World> = OnceLock::new();
    W.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let cfg = TcpConfig {
            max_frame: MAX_FRAME,
            slice_size: MAX_FRAME,
            inbox_capacity: 16,
            handshake_timeout: Duration::from_secs(5),
            ..TcpConfig::default()
        };
        let t = rt.block_on(TcpTransport::new(cfg)).unwrap();
        let a = Buffer::new(A_LEN).unwrap();
        let b = Buffer::new(B_LEN).unwrap();
        b.fill(B_BYTE);
        let c = Buffer::new(B_LEN).unwrap();
        c.fill(C_BYTE);
        t.register(a.region(), Access::REMOTE_RW).unwrap();
        t.register(b.region(), Access::REMOTE_READ).unwrap();
        let addr = t.local_addr();
        World { rt, t, addr, a, b, c }
    })
}

const TYPES: [FrameType; 13] = [
    FrameType::Hello,
    FrameType::Challenge,
    FrameType::Auth,
    FrameType::Ready,
    FrameType::DescReq,
    FrameType::DescResp,
    FrameType::Write,
    FrameType::WriteAck,
    FrameType::Read,
    FrameType::ReadResp,
    FrameType::Error,
    FrameType::Notify,
    FrameType::NotifyAck,
];

/// Where a frame points.
#[derive(Arbitrary, Debug)]
enum Place {
    A(u32),
    B(u32),
    Canary(u32),
    /// Just below A, B or C (by the offset), to cross their starts.
    Below(u8, u16),
    Raw(u64),
}

#[derive(Arbitrary, Debug)]
enum Op {
    Frame {
        ty: u8,
        status: u8,
        flags: u8,
        place: Place,
        len: u32,
        /// Payload length announced: `len` (the rule for WRITE), or any.
        payload_len: Option<u32>,
        /// The server's generation, or a wrong one.
        stale: bool,
        payload: Vec<u8>,
        /// Zero bytes appended to the payload (large WRITEs).
        pad: u16,
    },
    Raw(Vec<u8>),
}

/// What a frame sent by the harness asked, by its id.
struct Sent {
    ty: FrameType,
    addr: u64,
    len: u64,
}

fn within(addr: u64, len: u64, base: u64, size: usize) -> bool {
    addr >= base && addr.checked_add(len).is_some_and(|end| end <= base + size as u64)
}

async fn handshake(s: &mut TcpStream) -> u64 {
    let mut p = VERSION.to_le_bytes().to_vec();
    p.extend_from_slice(&[5u8; NONCE_LEN]);
    let mut h = Header::new(FrameType::Hello);
    h.payload_len = p.len() as u32;
    s.write_all(&h.encode()).await.unwrap();
    s.write_all(&p).await.unwrap();
    let mut d = FrameDecoder::new(MAX_FRAME);
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let mut generation = None;
    while got.is_empty()
        || (generation.is_some() && got.iter().all(|(h, _): &(Header, Vec<u8>)| h.ty != FrameType::Ready))
    {
        let n = s.read(&mut buf).await.unwrap();
        assert!(n > 0, "the server closed a clean handshake");
        got.extend(d.push(&buf[..n]).unwrap());
        if generation.is_none() {
            if let Some((c, _)) = got.first() {
                assert_eq!(c.ty, FrameType::Challenge);
                generation = Some(c.generation);
                s.write_all(&Header::new(FrameType::Auth).encode()).await.unwrap();
            }
        }
    }
    generation.unwrap()
}

fn encode(ops: &[Op], w: &World, generation: u64, sent: &mut Vec<(u64, Sent)>) -> Vec<u8> {
    let bases = [w.a.addr(), w.b.addr(), w.c.addr()];
    let mut out = Vec::new();
    for (i, op) in ops.iter().enumerate() {
        match op {
            Op::Raw(bytes) => out.extend_from_slice(bytes),
            Op::Frame { ty, status, flags, place, len, payload_len, stale, payload, pad } => {
                let ty = TYPES[usize::from(*ty) % TYPES.len()];
                let addr = match *place {
                    Place::A(o) => bases[0].wrapping_add(u64::from(o) % (A_LEN as u64 + 64)),
                    Place::B(o) => bases[1].wrapping_add(u64::from(o) % (B_LEN as u64 + 64)),
                    Place::Canary(o) => bases[2].wrapping_add(u64::from(o) % (B_LEN as u64 + 64)),
                    Place::Below(which, o) => bases[usize::from(which) % 3].wrapping_sub(u64::from(o)),
                    Place::Raw(a) => a,
                };
                let mut body = payload.clone();
                body.resize(body.len() + usize::from(*pad), 0);
                let mut h = Header::new(ty);
                h.id = (1 << 40) + i as u64;
                h.status = Status::from_u8(*status % 10).unwrap_or(Status::Ok);
                h.flags = *flags;
                h.addr = addr;
                h.len = u64::from(*len) % (2 * MAX_FRAME as u64);
                if ty == FrameType::Write && payload_len.is_none() {
                    body.resize(h.len as usize, 0x5A);
                }
                h.payload_len = payload_len.unwrap_or(body.len() as u32);
                h.generation = if *stale { generation ^ 1 } else { generation };
                sent.push((h.id, Sent { ty, addr, len: h.len }));
                out.extend_from_slice(&h.encode());
                out.extend_from_slice(&body);
            }
        }
    }
    out
}

fuzz_target!(|ops: Vec<Op>| {
    let w = world();
    w.rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(10), async {
            let _ = w.t.take_notifications(1024);
            let mut s = TcpStream::connect(w.addr).await.unwrap();
            let generation = handshake(&mut s).await;
            let mut sent = Vec::new();
            let bytes = encode(&ops, w, generation, &mut sent);
            let (mut r, mut wr) = s.into_split();
            // Send while reading, so answers never block the sender.
            let sender = tokio::spawn(async move {
                let _ = wr.write_all(&bytes).await;
                let _ = wr.shutdown().await;
                wr
            });
            let mut d = FrameDecoder::new(MAX_FRAME);
            let mut buf = vec![0u8; 64 << 10];
            loop {
                let n = match r.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                for (h, p) in d.push(&buf[..n]).expect("the server sends well-formed frames") {
                    assert!(
                        matches!(
                            h.ty,
                            FrameType::DescResp
                                | FrameType::WriteAck
                                | FrameType::ReadResp
                                | FrameType::NotifyAck
                                | FrameType::Error
                        ),
                        "a server frame: {:?}",
                        h.ty
                    );
                    let Some((_, q)) = sent.iter().find(|(id, _)| *id == h.id) else { continue };
                    // An answer to a frame forged inside raw bytes could
                    // reuse an id: only answers of the asked type count.
                    let asked = matches!(
                        (h.ty, q.ty),
                        (FrameType::ReadResp, FrameType::Read) | (FrameType::WriteAck, FrameType::Write)
                    );
                    if h.status != Status::Ok || !asked {
                        continue;
                    }
                    match h.ty {
                        FrameType::ReadResp => {
                            let in_a = within(q.addr, q.len, w.a.addr(), A_LEN);
                            let in_b = within(q.addr, q.len, w.b.addr(), B_LEN);
                            assert!(in_a || in_b, "data answered outside the exposed regions: {:#x}+{}", q.addr, q.len);
                            if in_b && !in_a {
                                assert!(p.iter().all(|&x| x == B_BYTE), "B's bytes, exactly");
                            }
                        }
                        FrameType::WriteAck => {
                            assert!(within(q.addr, q.len, w.a.addr(), A_LEN), "a write acknowledged outside A");
                        }
                        _ => {}
                    }
                }
            }
            let _ = sender.await;
        })
        .await
        .expect("the server answered and closed within 10 s");
    });
    assert!(w.b.to_vec().iter().all(|&x| x == B_BYTE), "read-only region B was written");
    assert!(w.c.to_vec().iter().all(|&x| x == C_BYTE), "unregistered canary C was written");
});
