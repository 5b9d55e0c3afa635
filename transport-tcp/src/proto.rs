//! The wire protocol: fixed 48-byte frame headers, an optional payload,
//! and a decoder that refuses anything malformed (sans-io, so a property
//! test can feed it arbitrary bytes).
//!
//! ```text
//! offset size field
//!   0     1   magic 0x4B
//!   1     1   frame type (FrameType)
//!   2     1   status (Status) in answers, 0 in requests (else refused)
//!   3     1   flags (CHALLENGE: bit 0 = authentication required;
//!             bit 1 SAME_HOST and bit 2 PULL_WRITES: below; READY:
//!             bit 3 DIRECT_WRITES; HELLO, CHALLENGE: bit 4 EARLY_PROOF)
//!   4     4   payload length (bytes after the header), <= max_frame
//!             (NOTIFY: 2..=MAX_NOTIFY_PAYLOAD, whatever max_frame)
//!   8     8   request id (unique per transport, never reused)
//!  16     8   remote address (WRITE, READ); HELLO, CHALLENGE with
//!             SAME_HOST: the sender's process id
//!  24     8   length (WRITE: = payload length; READ: bytes asked);
//!             HELLO, CHALLENGE with SAME_HOST: the address of the
//!             sender's nonce in its memory
//!  32     8   generation (CHALLENGE, DESC_RESP: the server's; WRITE, READ,
//!             NOTIFY: the one the client's descriptor has; a mismatch is
//!             refused)
//!  40     4   header check (FNV-1a of bytes 0..40)
//!  44     4   reserved, 0
//! ```
//! All integers little-endian.
//!
//! Same-host copies (`samehost.rs`): a HELLO with SAME_HOST offers them
//! (process id and nonce address); a CHALLENGE with SAME_HOST offers the
//! server's, and with PULL_WRITES says the server verified the client. A
//! WRITE with SAME_HOST carries, instead of the bytes, an 8-byte payload:
//! the address of the source bytes in the client (the server copies them
//! from there). A READ with SAME_HOST is answered by a READ_RESP with
//! SAME_HOST and no payload (the client copies the bytes from the server).
//! A READY with DIRECT_WRITES (sent only to a verified same-host client)
//! carries in its request-id field the descriptor number, in the server,
//! of a window file that lets the client copy small WRITEs straight into
//! the server's memory (`transport_mem::window`).
//!
//! Early proof (`transport_control::handshake`): a HELLO with EARLY_PROOF
//! says the client takes the server's proof in the CHALLENGE; a server
//! with a secret then answers a CHALLENGE with EARLY_PROOF whose payload is
//! its nonce followed by its proof (`NONCE_LEN` + `PROOF_LEN` bytes). A
//! client whose check of that proof passes (or that has no secret) sends
//! its first request right behind its AUTH; the server reads it only after
//! it has checked the AUTH. A server from before ignores the HELLO's flag
//! and sends its nonce alone, as it always did.
//!
//! A NOTIFY payload (rule 11) is the sender's name and the message:
//!
//! ```text
//! offset        size      field
//!   0           2         from_len (u16), <= MAX_NOTIFY_FROM (256)
//!   2           from_len  from: the sender's segment name, UTF-8
//!   2+from_len  the rest  msg, <= MAX_NOTIFY_LEN (4096) bytes
//! ```
//! It is answered by a NOTIFY_ACK without payload: `Ok` once the message
//! is in the receiver's inbox, `Busy` when the inbox is full, `TooLarge` or
//! `Protocol` for a payload that breaks these rules, `StaleGeneration` for
//! another generation of the receiver.

use std::fmt;

use transport_core::{MAX_NOTIFY_FROM, MAX_NOTIFY_LEN};

/// Flag bit 1 (HELLO, CHALLENGE, WRITE, READ, READ_RESP): same-host
/// copies, see `samehost.rs`.
pub const SAME_HOST: u8 = 2;
/// Flag bit 2 (CHALLENGE): the server verified the client's process, so
/// WRITEs with [`SAME_HOST`] are served.
pub const PULL_WRITES: u8 = 4;

/// Flag bit 3 (READY): the server offers a window of direct writes to
/// this client; the READY's request-id field is the window file's
/// descriptor number in the server (`transport_mem::window`).
pub const DIRECT_WRITES: u8 = 8;

/// Flag bit 4: in a HELLO, the client takes the server's proof in the
/// CHALLENGE; in a CHALLENGE, its payload is the nonce and then the
/// server's proof ([`PROOF_LEN`] bytes). Sent only to a client that asked.
pub const EARLY_PROOF: u8 = 16;
/// Bytes of a proof of the shared secret (an AUTH's or READY's payload,
/// and the tail of a CHALLENGE with [`EARLY_PROOF`]).
pub const PROOF_LEN: usize = transport_control::handshake::PROOF_LEN;

/// Protocol version carried in HELLO; a server refuses any other.
pub const VERSION: u16 = 1;
/// Size of every frame header.
pub const HEADER_LEN: usize = 48;
const MAGIC: u8 = 0x4B;
/// Bytes of a handshake nonce and of an authentication proof.
pub const NONCE_LEN: usize = transport_control::auth::NONCE_LEN;
/// Largest ERROR message payload.
pub const MAX_ERROR_MSG: usize = 256;
/// Largest NOTIFY payload: the name length (2 bytes), the longest sender
/// name and the longest message. A NOTIFY is bounded by this, not by
/// `max_frame`.
pub const MAX_NOTIFY_PAYLOAD: usize = 2 + MAX_NOTIFY_FROM + MAX_NOTIFY_LEN;

/// What a frame is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameType {
    /// Client opens: payload = version (u16) + client nonce.
    Hello = 1,
    /// Server answers: generation, auth flag, payload = server nonce.
    Challenge = 2,
    /// Client proves the secret: payload = proof (empty without a secret).
    Auth = 3,
    /// Server accepts: payload = server proof (empty without a secret).
    Ready = 4,
    /// Client asks for the segment descriptor.
    DescReq = 5,
    /// Server answers with its exposed regions.
    DescResp = 6,
    /// Client writes `len` payload bytes at `addr`.
    Write = 7,
    /// Server acknowledges a write: the bytes are in its memory.
    WriteAck = 8,
    /// Client asks for `len` bytes at `addr`.
    Read = 9,
    /// Server answers a read: status, and on success `len` payload bytes.
    ReadResp = 10,
    /// Server refuses the connection (status says why) and closes it.
    Error = 11,
    /// Client sends a notification (rule 11): payload = from_len (u16) +
    /// from + msg, at most [`MAX_NOTIFY_PAYLOAD`] bytes.
    Notify = 12,
    /// Server answers a notification: `Ok` once it is in the inbox, `Busy`
    /// when the inbox is full. No payload.
    NotifyAck = 13,
}

impl FrameType {
    /// Whether a client sends this frame to a server (HELLO, AUTH, DESC_REQ,
    /// WRITE, READ, NOTIFY). Requests carry status 0 (`Status::Ok`).
    pub fn is_request(self) -> bool {
        matches!(
            self,
            FrameType::Hello
                | FrameType::Auth
                | FrameType::DescReq
                | FrameType::Write
                | FrameType::Read
                | FrameType::Notify
        )
    }

    fn from_u8(b: u8) -> Option<Self> {
        use FrameType::*;
        Some(match b {
            1 => Hello,
            2 => Challenge,
            3 => Auth,
            4 => Ready,
            5 => DescReq,
            6 => DescResp,
            7 => Write,
            8 => WriteAck,
            9 => Read,
            10 => ReadResp,
            11 => Error,
            12 => Notify,
            13 => NotifyAck,
            _ => return None,
        })
    }
}

/// Outcome of a request, as the server reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Status {
    Ok = 0,
    /// The range is not inside one exposed region (or overflows).
    OutOfBounds = 1,
    /// The region does not allow this access.
    AccessDenied = 2,
    /// The region was unregistered while the request was served.
    Unregistered = 3,
    /// The request named another generation of this server.
    StaleGeneration = 4,
    /// The peer did not prove the shared secret.
    AuthFailed = 5,
    /// The peer sent something this side cannot parse.
    Protocol = 6,
    /// A frame or request is larger than allowed.
    TooLarge = 7,
    /// The peer speaks another protocol version.
    VersionMismatch = 8,
    /// The server is at its connection limit or shutting down.
    Busy = 9,
    /// The server's copy to or from its device (GPU) memory failed.
    DeviceCopy = 10,
    /// A same-host WRITE's copy from the client's memory failed (the
    /// address it named is not mapped there, or the client is gone).
    SourceCopy = 11,
}

impl Status {
    /// Decodes a status byte; unknown values are a protocol error.
    pub fn from_u8(b: u8) -> Option<Self> {
        use Status::*;
        Some(match b {
            0 => Ok,
            1 => OutOfBounds,
            2 => AccessDenied,
            3 => Unregistered,
            4 => StaleGeneration,
            5 => AuthFailed,
            6 => Protocol,
            7 => TooLarge,
            8 => VersionMismatch,
            9 => Busy,
            10 => DeviceCopy,
            11 => SourceCopy,
            _ => return None,
        })
    }
}

/// A decoded, validated frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub ty: FrameType,
    pub status: Status,
    pub flags: u8,
    pub payload_len: u32,
    pub id: u64,
    pub addr: u64,
    pub len: u64,
    pub generation: u64,
}

/// Why bytes were refused as a frame. Always the peer's fault (or a
/// corrupting network); the connection is closed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProtoError {
    BadMagic(u8),
    BadCheck,
    UnknownType(u8),
    UnknownStatus(u8),
    Reserved,
    /// Payload longer than the configured bound.
    TooLarge {
        len: u64,
        max: usize,
    },
    /// Fields that contradict each other for this frame type.
    Inconsistent(&'static str),
}

impl fmt::Display for ProtoError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProtoError::BadMagic(b) => write!(f, "bad magic byte {b:#x}"),
            ProtoError::BadCheck => write!(f, "header check mismatch (corrupted header)"),
            ProtoError::UnknownType(t) => write!(f, "unknown frame type {t}"),
            ProtoError::UnknownStatus(s) => write!(f, "unknown status {s}"),
            ProtoError::Reserved => write!(f, "reserved bytes are not zero"),
            ProtoError::TooLarge { len, max } => write!(f, "frame of {len} bytes exceeds the limit of {max}"),
            ProtoError::Inconsistent(why) => write!(f, "inconsistent frame: {why}"),
        }
    }
}

impl std::error::Error for ProtoError {}

pub(crate) fn fnv1a(bytes: &[u8]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for &b in bytes {
        h ^= b as u32;
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

fn u32_at(b: &[u8; HEADER_LEN], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn u64_at(b: &[u8; HEADER_LEN], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

impl Header {
    /// A header with everything but the type zeroed.
    pub fn new(ty: FrameType) -> Self {
        Self { ty, status: Status::Ok, flags: 0, payload_len: 0, id: 0, addr: 0, len: 0, generation: 0 }
    }

    /// The 48 wire bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0] = MAGIC;
        b[1] = self.ty as u8;
        b[2] = self.status as u8;
        b[3] = self.flags;
        b[4..8].copy_from_slice(&self.payload_len.to_le_bytes());
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b[16..24].copy_from_slice(&self.addr.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b[32..40].copy_from_slice(&self.generation.to_le_bytes());
        let check = fnv1a(&b[..40]);
        b[40..44].copy_from_slice(&check.to_le_bytes());
        b
    }

    /// Appends the encoded header to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.encode());
    }

    /// Parses and validates a header: magic, check, known type and status,
    /// status 0 in requests, payload within `max_frame` (a NOTIFY's within
    /// 2..=[`MAX_NOTIFY_PAYLOAD`] instead), and the per-type rules (a
    /// WRITE's length equals its payload; a READ asks for 1..=`max_frame`
    /// bytes and carries none; ...). Never panics.
    pub fn decode(b: &[u8; HEADER_LEN], max_frame: usize) -> Result<Header, ProtoError> {
        if b[0] != MAGIC {
            return Err(ProtoError::BadMagic(b[0]));
        }
        if u32_at(b, 40) != fnv1a(&b[..40]) {
            return Err(ProtoError::BadCheck);
        }
        if u32_at(b, 44) != 0 {
            return Err(ProtoError::Reserved);
        }
        let ty = FrameType::from_u8(b[1]).ok_or(ProtoError::UnknownType(b[1]))?;
        let status = Status::from_u8(b[2]).ok_or(ProtoError::UnknownStatus(b[2]))?;
        let h = Header {
            ty,
            status,
            flags: b[3],
            payload_len: u32_at(b, 4),
            id: u64_at(b, 8),
            addr: u64_at(b, 16),
            len: u64_at(b, 24),
            generation: u64_at(b, 32),
        };
        let payload = h.payload_len as usize;
        // A NOTIFY has its own fixed bound, so a receiver with a small
        // `max_frame` still takes every valid notification.
        let limit = if ty == FrameType::Notify { MAX_NOTIFY_PAYLOAD } else { max_frame };
        if payload > limit {
            return Err(ProtoError::TooLarge { len: payload as u64, max: limit });
        }
        let inconsistent = |why| Err(ProtoError::Inconsistent(why));
        if ty.is_request() && status != Status::Ok {
            // Requests carry status 0 (`Status::Ok`); only answers use it.
            return inconsistent("a request carries status 0");
        }
        match ty {
            FrameType::Hello if payload != 2 + NONCE_LEN => inconsistent("HELLO payload size"),
            FrameType::Challenge if h.flags & EARLY_PROOF != 0 && payload != NONCE_LEN + PROOF_LEN => {
                inconsistent("a CHALLENGE with EARLY_PROOF carries the nonce and the proof")
            }
            FrameType::Challenge if h.flags & EARLY_PROOF == 0 && payload != NONCE_LEN => {
                inconsistent("CHALLENGE payload size")
            }
            FrameType::Auth | FrameType::Ready if payload != 0 && payload != PROOF_LEN => {
                inconsistent("AUTH/READY payload size")
            }
            FrameType::DescReq if payload != 0 => inconsistent("DESC_REQ carries no payload"),
            FrameType::DescResp if payload < 4 => inconsistent("DESC_RESP too short"),
            FrameType::Write if h.flags & SAME_HOST != 0 => {
                if payload != 8 || h.len == 0 || h.len > max_frame as u64 {
                    inconsistent("a same-host WRITE carries an 8-byte source address for 1..=max_frame bytes")
                } else {
                    Ok(h)
                }
            }
            FrameType::Write if h.len != payload as u64 || payload == 0 => {
                inconsistent("WRITE length must equal a non-zero payload")
            }
            FrameType::WriteAck if payload != 0 => inconsistent("WRITE_ACK carries no payload"),
            FrameType::Read if payload != 0 || h.len == 0 || h.len > max_frame as u64 => {
                inconsistent("READ asks for 1..=max_frame bytes and carries none")
            }
            FrameType::ReadResp if h.flags & SAME_HOST != 0 && payload != 0 => {
                inconsistent("a same-host READ_RESP carries no payload")
            }
            FrameType::ReadResp if h.flags & SAME_HOST == 0 && h.status == Status::Ok && h.len != payload as u64 => {
                inconsistent("READ_RESP payload must equal its length")
            }
            FrameType::ReadResp if h.status != Status::Ok && payload != 0 => {
                inconsistent("a failed READ_RESP carries no payload")
            }
            FrameType::Error if payload > MAX_ERROR_MSG => inconsistent("ERROR message too long"),
            FrameType::Notify if payload < 2 => inconsistent("NOTIFY payload shorter than its name length"),
            FrameType::NotifyAck if payload != 0 => inconsistent("NOTIFY_ACK carries no payload"),
            _ => Ok(h),
        }
    }
}

/// One region in a DESC_RESP payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WireRegion {
    pub addr: u64,
    pub len: u64,
    pub read: bool,
    pub write: bool,
}

/// Bytes per region in a DESC_RESP payload.
const REGION_BYTES: usize = 17;

/// Encodes a region list (count, then addr, len, access bits each).
pub fn encode_regions(regions: &[WireRegion]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + regions.len() * REGION_BYTES);
    out.extend_from_slice(&(regions.len() as u32).to_le_bytes());
    for r in regions {
        out.extend_from_slice(&r.addr.to_le_bytes());
        out.extend_from_slice(&r.len.to_le_bytes());
        out.push(u8::from(r.read) | (u8::from(r.write) << 1));
    }
    out
}

/// Decodes a region list; refuses a wrong length, unknown access bits, or a
/// region whose `addr + len` overflows.
pub fn decode_regions(b: &[u8]) -> Result<Vec<WireRegion>, ProtoError> {
    let count_bytes: [u8; 4] =
        b.get(..4).and_then(|s| s.try_into().ok()).ok_or(ProtoError::Inconsistent("region list too short"))?;
    let count = u32::from_le_bytes(count_bytes) as usize;
    let body = &b[4..];
    if count.checked_mul(REGION_BYTES) != Some(body.len()) {
        return Err(ProtoError::Inconsistent("region list length"));
    }
    let mut out = Vec::with_capacity(count);
    for c in body.chunks_exact(REGION_BYTES) {
        let mut a = [0u8; 8];
        a.copy_from_slice(&c[..8]);
        let mut l = [0u8; 8];
        l.copy_from_slice(&c[8..16]);
        let (addr, len, bits) = (u64::from_le_bytes(a), u64::from_le_bytes(l), c[16]);
        if bits > 3 || len == 0 || addr.checked_add(len).is_none() {
            return Err(ProtoError::Inconsistent("region entry"));
        }
        out.push(WireRegion { addr, len, read: bits & 1 != 0, write: bits & 2 != 0 });
    }
    Ok(out)
}

/// Encodes a NOTIFY payload (see the module docs); `None` if the name or
/// the message is longer than allowed.
pub fn encode_notify(from: &str, msg: &[u8]) -> Option<Vec<u8>> {
    if from.len() > MAX_NOTIFY_FROM || msg.len() > MAX_NOTIFY_LEN {
        return None;
    }
    let from_len = u16::try_from(from.len()).ok()?;
    let mut out = Vec::with_capacity(2 + from.len() + msg.len());
    out.extend_from_slice(&from_len.to_le_bytes());
    out.extend_from_slice(from.as_bytes());
    out.extend_from_slice(msg);
    Some(out)
}

/// Decodes a NOTIFY payload into the sender's name and the message.
/// Refuses a name length past the payload or a name that is not UTF-8
/// (`Inconsistent`), and a name or message longer than allowed
/// (`TooLarge`). Never panics.
pub fn decode_notify(b: &[u8]) -> Result<(&str, &[u8]), ProtoError> {
    let len_bytes: [u8; 2] =
        b.get(..2).and_then(|s| s.try_into().ok()).ok_or(ProtoError::Inconsistent("NOTIFY payload too short"))?;
    let from_len = usize::from(u16::from_le_bytes(len_bytes));
    if from_len > MAX_NOTIFY_FROM {
        return Err(ProtoError::TooLarge { len: from_len as u64, max: MAX_NOTIFY_FROM });
    }
    let end = from_len.checked_add(2).ok_or(ProtoError::Inconsistent("NOTIFY name length"))?;
    let from = b.get(2..end).ok_or(ProtoError::Inconsistent("NOTIFY name longer than its payload"))?;
    let msg = b.get(end..).ok_or(ProtoError::Inconsistent("NOTIFY name longer than its payload"))?;
    if msg.len() > MAX_NOTIFY_LEN {
        return Err(ProtoError::TooLarge { len: msg.len() as u64, max: MAX_NOTIFY_LEN });
    }
    let from = std::str::from_utf8(from).map_err(|_| ProtoError::Inconsistent("NOTIFY sender name is not UTF-8"))?;
    Ok((from, msg))
}

/// A sans-io frame decoder: push bytes in, take whole frames out. Holds at
/// most one header plus one payload of `max(max_frame,
/// MAX_NOTIFY_PAYLOAD)` bytes (a NOTIFY has its own bound); anything
/// malformed is an error after which the decoder refuses further input
/// (the connection is closed).
#[derive(Debug)]
pub struct FrameDecoder {
    max_frame: usize,
    buf: Vec<u8>,
    header: Option<Header>,
    failed: bool,
}

impl FrameDecoder {
    /// A decoder accepting payloads up to `max_frame` bytes.
    pub fn new(max_frame: usize) -> Self {
        Self { max_frame, buf: Vec::new(), header: None, failed: false }
    }

    /// Bytes buffered now (never more than a header or a payload).
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Feeds `input`; returns the frames completed by it. Consumes only
    /// what belongs to complete or partial frames; never buffers more than
    /// `max(HEADER_LEN, max_frame, MAX_NOTIFY_PAYLOAD)` bytes.
    pub fn push(&mut self, mut input: &[u8]) -> Result<Vec<(Header, Vec<u8>)>, ProtoError> {
        if self.failed {
            return Err(ProtoError::Inconsistent("decoder already failed"));
        }
        let mut frames = Vec::new();
        while !input.is_empty() {
            let want = match &self.header {
                None => HEADER_LEN,
                Some(h) => h.payload_len as usize,
            };
            let take = (want - self.buf.len()).min(input.len());
            self.buf.extend_from_slice(&input[..take]);
            input = &input[take..];
            if self.buf.len() < want {
                break;
            }
            match self.header.take() {
                None => {
                    let mut hb = [0u8; HEADER_LEN];
                    hb.copy_from_slice(&self.buf);
                    self.buf.clear();
                    let h = Header::decode(&hb, self.max_frame).inspect_err(|_| self.failed = true)?;
                    if h.payload_len == 0 {
                        frames.push((h, Vec::new()));
                    } else {
                        self.header = Some(h);
                    }
                }
                Some(h) => frames.push((h, std::mem::take(&mut self.buf))),
            }
        }
        Ok(frames)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip() {
        let mut h = Header::new(FrameType::Write);
        h.id = 7;
        h.addr = 0x1000;
        h.len = 64;
        h.payload_len = 64;
        h.generation = 99;
        assert_eq!(Header::decode(&h.encode(), 1 << 20), Ok(h));
    }

    #[test]
    fn corruption_and_limits_are_refused() {
        let mut h = Header::new(FrameType::Write);
        h.len = 64;
        h.payload_len = 64;
        let mut b = h.encode();
        b[20] ^= 1;
        assert_eq!(Header::decode(&b, 1 << 20), Err(ProtoError::BadCheck));
        h.len = 2 << 20;
        h.payload_len = 2 << 20;
        assert!(matches!(Header::decode(&h.encode(), 1 << 20), Err(ProtoError::TooLarge { .. })));
        let mut r = Header::new(FrameType::Read);
        r.len = 0;
        assert!(Header::decode(&r.encode(), 1 << 20).is_err());
        let mut d = Header::new(FrameType::DescReq);
        d.status = Status::AuthFailed;
        assert!(matches!(Header::decode(&d.encode(), 1 << 20), Err(ProtoError::Inconsistent(_))));
    }

    /// A CHALLENGE carries the server's proof behind its nonce only with
    /// EARLY_PROOF, and then always; a HELLO's EARLY_PROOF changes nothing
    /// in the HELLO itself (a server from before ignores it).
    #[test]
    fn a_challenge_carries_an_early_proof_exactly_when_flagged() {
        let challenge = |flags: u8, payload: usize| {
            let mut c = Header::new(FrameType::Challenge);
            c.flags = flags;
            c.payload_len = payload as u32;
            Header::decode(&c.encode(), MAX_ERROR_MSG)
        };
        assert!(challenge(1, NONCE_LEN).is_ok());
        assert!(challenge(1 | EARLY_PROOF, NONCE_LEN + PROOF_LEN).is_ok());
        assert!(challenge(1 | EARLY_PROOF, NONCE_LEN).is_err(), "flagged, without the proof");
        assert!(challenge(1, NONCE_LEN + PROOF_LEN).is_err(), "a proof without the flag");
        assert!(challenge(1 | EARLY_PROOF, NONCE_LEN + PROOF_LEN + 1).is_err());
        let mut h = Header::new(FrameType::Hello);
        h.flags = EARLY_PROOF | SAME_HOST;
        h.payload_len = (2 + NONCE_LEN) as u32;
        assert_eq!(Header::decode(&h.encode(), 1 << 20).map(|d| d.flags), Ok(EARLY_PROOF | SAME_HOST));
    }

    #[test]
    fn regions_round_trip_and_refuse_overflow() {
        let rs = vec![WireRegion { addr: 4096, len: 10, read: true, write: false }];
        assert_eq!(decode_regions(&encode_regions(&rs)), Ok(rs));
        let bad = encode_regions(&[WireRegion { addr: u64::MAX, len: 10, read: true, write: true }]);
        assert!(decode_regions(&bad).is_err());
        assert!(decode_regions(&[1, 0, 0, 0]).is_err());
    }

    #[test]
    fn notify_frames_are_bounded_whatever_max_frame() {
        let mut h = Header::new(FrameType::Notify);
        h.payload_len = MAX_NOTIFY_PAYLOAD as u32;
        // Above a small max_frame, but within the NOTIFY bound.
        assert_eq!(Header::decode(&h.encode(), 4096), Ok(h));
        h.payload_len += 1;
        assert!(matches!(Header::decode(&h.encode(), 64 << 20), Err(ProtoError::TooLarge { .. })));
        h.payload_len = 1;
        assert!(matches!(Header::decode(&h.encode(), 1 << 20), Err(ProtoError::Inconsistent(_))));
        let mut s = Header::new(FrameType::Notify);
        s.payload_len = 2;
        s.status = Status::Busy;
        assert!(matches!(Header::decode(&s.encode(), 1 << 20), Err(ProtoError::Inconsistent(_))));
        let mut a = Header::new(FrameType::NotifyAck);
        a.status = Status::Busy;
        assert_eq!(Header::decode(&a.encode(), 1 << 20), Ok(a));
        a.payload_len = 1;
        assert!(Header::decode(&a.encode(), 1 << 20).is_err());
    }

    #[test]
    fn notify_payload_round_trip_and_refusals() {
        let p = encode_notify("127.0.0.1:9", b"hi").unwrap();
        assert_eq!(decode_notify(&p), Ok(("127.0.0.1:9", &b"hi"[..])));
        assert_eq!(decode_notify(&encode_notify("", b"").unwrap()), Ok(("", &b""[..])));
        let longest = encode_notify(&"n".repeat(MAX_NOTIFY_FROM), &[7; MAX_NOTIFY_LEN]).unwrap();
        assert_eq!(longest.len(), MAX_NOTIFY_PAYLOAD);
        assert!(decode_notify(&longest).is_ok());
        assert!(encode_notify(&"n".repeat(MAX_NOTIFY_FROM + 1), b"").is_none());
        assert!(encode_notify("a", &[0; MAX_NOTIFY_LEN + 1]).is_none());
        // A name length past the payload, a truncated length, a name that
        // is not UTF-8, an oversized name or message.
        assert!(matches!(decode_notify(&[9, 0, b'a']), Err(ProtoError::Inconsistent(_))));
        assert!(matches!(decode_notify(&[0xFF, 0xFF]), Err(ProtoError::TooLarge { .. })));
        assert!(decode_notify(&[1]).is_err());
        assert!(matches!(decode_notify(&[1, 0, 0xFF]), Err(ProtoError::Inconsistent(_))));
        let mut big = vec![0u8, 0];
        big.extend_from_slice(&[1; MAX_NOTIFY_LEN + 1]);
        assert!(matches!(decode_notify(&big), Err(ProtoError::TooLarge { .. })));
    }

    #[test]
    fn decoder_splits_frames_across_pushes() {
        let mut h = Header::new(FrameType::Write);
        h.len = 3;
        h.payload_len = 3;
        let mut bytes = h.encode().to_vec();
        bytes.extend_from_slice(b"abc");
        bytes.extend_from_slice(&Header::new(FrameType::DescReq).encode());
        let mut d = FrameDecoder::new(1024);
        let mut frames = Vec::new();
        for chunk in bytes.chunks(5) {
            frames.extend(d.push(chunk).unwrap());
        }
        assert_eq!(frames.len(), 2);
        assert_eq!(frames[0].1, b"abc");
        assert_eq!(frames[1].0.ty, FrameType::DescReq);
    }
}
