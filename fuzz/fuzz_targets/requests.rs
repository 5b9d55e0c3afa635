//! The TCP server's request machine in process (no sockets, no runtime):
//! each input is what a handshake agreed (same-host WRITEs, READs) and a
//! sequence of frames with every header field free and addresses inside or
//! around a writable region A, a read-only region B and unregistered
//! memory C, or anywhere. `transport_tcp::fuzzing::check_frames` feeds them
//! to the machine, does what it decides to real memory, and checks: no
//! WRITE outside A, no READ outside A and B, nothing served for a stale
//! generation, no same-host copy the handshake did not allow, and A, B and
//! C exactly as a model of the accepted WRITEs says. Many thousand inputs a
//! second, against tens over sockets (`server`).
#![no_main]

use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use transport_tcp::fuzzing::{check_frames, Frame, Place};
use transport_tcp::wire::FrameType;

#[derive(Debug, Arbitrary)]
enum FPlace {
    A(i16),
    B(i16),
    C(i16),
    Abs(u64),
}

#[derive(Debug, Arbitrary)]
struct FFrame {
    /// Mostly the requests a client sends; sometimes any byte.
    ty: u8,
    any_type: bool,
    status: u8,
    flags: u8,
    id: u64,
    place: FPlace,
    len: u16,
    big_len: Option<u64>,
    generation: Option<u64>,
    /// The payload as long as the frame says (the common case), or this.
    payload_len: Option<u32>,
    payload: Vec<u8>,
    corrupt: Option<(u8, u8)>,
}

#[derive(Debug, Arbitrary)]
struct Input {
    pulls: bool,
    reads: bool,
    frames: Vec<FFrame>,
}

/// The frames a client sends after its handshake.
const REQUESTS: [FrameType; 4] = [FrameType::DescReq, FrameType::Write, FrameType::Read, FrameType::Notify];

fuzz_target!(|input: Input| {
    let frames: Vec<Frame> = input
        .frames
        .into_iter()
        .take(64)
        .map(|f| {
            let ty = if f.any_type { f.ty } else { REQUESTS[usize::from(f.ty) % REQUESTS.len()] as u8 };
            let len = f.big_len.unwrap_or(u64::from(f.len));
            let payload_len = f.payload_len.unwrap_or(if ty == FrameType::Write as u8 { len as u32 } else { f.payload.len() as u32 });
            Frame {
                ty,
                status: if f.any_type { f.status } else { 0 },
                flags: f.flags,
                id: f.id,
                place: match f.place {
                    FPlace::A(o) => Place::A(i64::from(o)),
                    FPlace::B(o) => Place::B(i64::from(o)),
                    FPlace::C(o) => Place::C(i64::from(o)),
                    FPlace::Abs(x) => Place::Abs(x),
                },
                len,
                generation: f.generation,
                payload_len: payload_len.min(1 << 20),
                payload: f.payload,
                corrupt: f.corrupt,
            }
        })
        .collect();
    check_frames(input.pulls, input.reads, &frames);
});
