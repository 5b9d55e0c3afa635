//! The TCP side channel: one JSON object per line, at most [`MAX_LINE`]
//! bytes. A client either asks for the descriptor (`describe`) or connects
//! a QP group (`connect`); in the second case it keeps the socket open for
//! the endpoint's lifetime, and the server destroys its QPs when it closes.
//!
//! A connection whose first request is a notification (rule 11) is a
//! notification channel (it holds no QPs): `{"op":"notify","from":NAME,
//! "msg":HEX}`, as many as the client sends, each answered in order with
//! `notify_ack` (queued in the inbox), `busy` (the inbox is full, nothing
//! queued) or `error` (malformed: the server then closes the channel).
//! Lines after the first are bounded by [`MAX_NOTE_LINE`], enough for the
//! largest notification and no more.
//!
//! The same channel carries staging of device memory peers cannot reach
//! directly (see `crate::staging`): `{"op":"stage","write":BOOL,"addr":A,
//! "len":N}` leases one of the server's pinned staging buffers for the
//! range `A .. A+N` of a staged region (for a read, after copying the range
//! into it) and is answered `staged` (`slot`, the buffer's `addr` and
//! `rkey`), `busy` (no buffer free) or `stage_failed` (`kind`, `message`:
//! out of range, access, a failed device copy); `{"op":"unstage","slot":S,
//! "commit":BOOL}` gives the buffer back, after copying it into the leased
//! range if `commit` (a write), answered `unstaged` or `stage_failed`.
//! Leases are the channel's: its close frees them.
//!
//! Every connection opens with the handshake of `crate::greet` (version 2
//! of the side channel): nothing above is answered before it.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use transport_core::{
    check_received, Error, ErrorKind, Notification, Result, SegmentDescriptor, MAX_NOTIFY_FROM, MAX_NOTIFY_LEN,
};

/// Longest accepted line; longer input is a protocol error.
pub(crate) const MAX_LINE: usize = 1 << 20;
/// Longest line on a notification channel (both directions): a notification with
/// the largest message (two hex digits a byte) and the longest sender name
/// (JSON may escape a byte as six), plus the object around them.
pub(crate) const MAX_NOTE_LINE: usize = 2 * MAX_NOTIFY_LEN + 6 * MAX_NOTIFY_FROM + 256;
/// Longest error text the server puts in a reply on a notification channel.
const MAX_ERROR_TEXT: usize = 512;

/// One side's QP.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct QpInfo {
    pub qpn: u32,
    pub psn: u32,
}

/// A request from the initiator.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub(crate) enum Request {
    /// Opens every connection (`crate::greet`): the side channel's
    /// version and the client's nonce (hex).
    Hello {
        version: u32,
        nonce: String,
    },
    /// The client's proof of the shared secret (hex; empty without one).
    Auth {
        proof: String,
    },
    Describe,
    Connect {
        /// GID as 32 hex digits.
        gid: String,
        lid: u16,
        /// `ibv_mtu` value of the initiator's active MTU.
        mtu: u32,
        qps: Vec<QpInfo>,
    },
    /// A notification; as a first request it opens a notification channel.
    Notify {
        /// The sender's segment name, at most `MAX_NOTIFY_FROM` bytes.
        from: String,
        /// The message as lowercase hex, at most `2 * MAX_NOTIFY_LEN` digits.
        msg: String,
    },
    /// Lease a staging buffer for `addr .. addr + len` of a staged region.
    Stage {
        write: bool,
        addr: u64,
        len: u32,
    },
    /// Give a leased buffer back, committing a write first.
    Unstage {
        slot: u32,
        commit: bool,
    },
}

/// The answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub(crate) enum Reply {
    /// The answer to `hello`: the server's nonce (hex), whether it wants a
    /// proof of the shared secret, and (with a secret) its own proof, the
    /// same as `ready` carries: a client that checked it may send its
    /// first request right behind its `auth` (`greet::hello`). Absent from
    /// servers before it was added (the client then waits for `ready`).
    Challenge {
        nonce: String,
        auth: bool,
        #[serde(default, skip_serializing_if = "String::is_empty")]
        proof: String,
    },
    /// The handshake is done: the server's proof (hex; empty without a
    /// secret).
    Ready {
        proof: String,
    },
    /// Refused for who the peer is: a wrong or missing proof, or protected
    /// mode (the message says which, and what to set).
    Denied {
        message: String,
    },
    Descriptor {
        descriptor: SegmentDescriptor,
    },
    Connected {
        gid: String,
        lid: u16,
        mtu: u32,
        qps: Vec<QpInfo>,
        descriptor: SegmentDescriptor,
    },
    Error {
        message: String,
    },
    /// The notification is in the peer's inbox.
    NotifyAck,
    /// The peer's inbox is full (or, for `stage`, no buffer is free):
    /// nothing was done.
    Busy,
    /// A staging buffer is leased: `slot`, reachable at `addr` with `rkey`.
    Staged {
        slot: u32,
        addr: u64,
        rkey: u32,
    },
    /// The buffer is back (and a write committed).
    Unstaged,
    /// A staging request failed without harm to the channel.
    StageFailed {
        kind: String,
        message: String,
    },
}

impl Reply {
    /// An error reply for a notification channel: its text cut to a bounded length
    /// (the peer reads it with the [`MAX_NOTE_LINE`] bound).
    pub(crate) fn bounded_error(e: &Error) -> Self {
        let mut message = e.to_string();
        if message.len() > MAX_ERROR_TEXT {
            let mut cut = MAX_ERROR_TEXT;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
        }
        Reply::Error { message }
    }
}

/// The request carrying notification `msg` from `from`. Refuses what the
/// peer would refuse (`check_received`).
pub(crate) fn notify_request(from: &str, msg: &[u8]) -> Result<Request> {
    check_received(from, msg)?;
    Ok(Request::Notify { from: from.to_string(), msg: hex(msg) })
}

/// Decodes a received notification, bounded: the sender name and the hex
/// text are checked against their limits before anything is decoded. Any
/// violation is `InvalidRequest` (the server answers it and closes).
pub(crate) fn decode_notify(from: String, hex: &str) -> Result<Notification> {
    let bad = |why: &str| Error::new(ErrorKind::InvalidRequest, format!("malformed notification: {why}"));
    if from.len() > MAX_NOTIFY_FROM {
        return Err(bad("sender name too long"));
    }
    let max_digits = MAX_NOTIFY_LEN.checked_mul(2).ok_or_else(|| bad("limit overflows"))?;
    if hex.len() > max_digits {
        return Err(bad("message too long"));
    }
    if !hex.len().is_multiple_of(2) {
        return Err(bad("odd number of hex digits"));
    }
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    };
    let msg = hex
        .as_bytes()
        .chunks_exact(2)
        .map(|p| match p {
            [hi, lo] => Some(digit(*hi)? << 4 | digit(*lo)?),
            _ => None,
        })
        .collect::<Option<Vec<u8>>>()
        .ok_or_else(|| bad("not hex"))?;
    check_received(&from, &msg)?;
    Ok(Notification { from, msg })
}

pub(crate) fn gid_hex(gid: &[u8; 16]) -> String {
    hex(gid)
}

/// Bytes as lowercase hex (GIDs, the handshake's nonces and proofs).
pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

pub(crate) fn parse_gid(s: &str) -> Result<[u8; 16]> {
    let bad = || Error::new(ErrorKind::Protocol, format!("bad GID {s:?}"));
    if s.len() != 32 || !s.is_ascii() {
        return Err(bad());
    }
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
    }
    Ok(out)
}

/// Writes one message as a line.
pub(crate) async fn send<W: AsyncWrite + Unpin, T: Serialize>(w: &mut W, msg: &T) -> Result<()> {
    let mut line = serde_json::to_vec(msg).map_err(|e| Error::new(ErrorKind::Internal, e.to_string()))?;
    line.push(b'\n');
    w.write_all(&line).await?;
    w.flush().await?;
    Ok(())
}

/// Reads one line-delimited message, bounded by [`MAX_LINE`]. EOF before a
/// line is `ConnectionReset`; junk is `Protocol`.
pub(crate) async fn recv<R: AsyncRead + Unpin, T: DeserializeOwned>(r: &mut BufReader<R>) -> Result<T> {
    recv_limited(r, MAX_LINE).await
}

/// Like [`recv`], bounded by `limit` bytes (newline included).
pub(crate) async fn recv_limited<R: AsyncRead + Unpin, T: DeserializeOwned>(
    r: &mut BufReader<R>,
    limit: usize,
) -> Result<T> {
    let mut line = Vec::new();
    loop {
        if read_some(r, &mut line, limit).await? {
            return parse(&line);
        }
    }
}

/// Moves the bytes `r` has buffered (reading if it has none) into `line`,
/// up to and including a newline. Returns whether the line is complete.
/// Cancel-safe: nothing is consumed from `r` unless it is in `line`.
async fn read_some<R: AsyncRead + Unpin>(r: &mut BufReader<R>, line: &mut Vec<u8>, limit: usize) -> Result<bool> {
    let buf = r.fill_buf().await?;
    if buf.is_empty() {
        return Err(Error::new(ErrorKind::ConnectionReset, "side channel closed before a complete message"));
    }
    let (take, done) = match buf.iter().position(|&b| b == b'\n') {
        Some(i) => (i + 1, true),
        None => (buf.len(), false),
    };
    if line.len().checked_add(take).is_none_or(|n| n > limit) {
        return Err(Error::new(ErrorKind::Protocol, "side-channel message too long"));
    }
    line.extend_from_slice(&buf[..take]);
    r.consume(take);
    Ok(done)
}

fn parse<T: DeserializeOwned>(line: &[u8]) -> Result<T> {
    serde_json::from_slice(line).map_err(|e| Error::new(ErrorKind::Protocol, format!("bad side-channel message: {e}")))
}

/// A reader of line-delimited messages whose [`Lines::next`] is
/// cancel-safe (a partial line is kept between calls), for a task that
/// reads in a `select!`.
#[derive(Debug)]
pub(crate) struct Lines<R> {
    r: BufReader<R>,
    line: Vec<u8>,
    limit: usize,
}

impl<R: AsyncRead + Unpin> Lines<R> {
    /// Reads lines of at most `limit` bytes from `r`.
    pub(crate) fn new(r: BufReader<R>, limit: usize) -> Self {
        Self { r, line: Vec::new(), limit }
    }

    /// The next message. EOF is `ConnectionReset`; junk or an overlong
    /// line is `Protocol` (the stream is then unusable).
    pub(crate) async fn next<T: DeserializeOwned>(&mut self) -> Result<T> {
        while !read_some(&mut self.r, &mut self.line, self.limit).await? {}
        let line = std::mem::take(&mut self.line);
        parse(&line)
    }

    /// The stream, to write to.
    pub(crate) fn get_mut(&mut self) -> &mut R {
        self.r.get_mut()
    }
}

/// A request for a carrier to send (a notification, or a staging request),
/// and where the peer's answer goes.
#[derive(Debug)]
pub(crate) struct Ask {
    pub request: Request,
    pub answer: tokio::sync::oneshot::Sender<transport_core::Result<Reply>>,
}

/// A side-channel connection past its handshake and a `describe`, kept
/// by a segment handle so that its first endpoint connects over it
/// (`handshake::connect`): the server waits `handshake_timeout` for that
/// next request (`server.rs`), so an open segment's first transfer costs
/// one TCP connection and one handshake, not two of each.
#[derive(Debug)]
pub(crate) struct Spare {
    pub stream: BufReader<tokio::net::TcpStream>,
    pub since: std::time::Instant,
}

impl Spare {
    /// Whether the peer is still waiting on it, with a margin of half the
    /// timeout (`limit`) both sides are configured with.
    pub(crate) fn fresh(&self, limit: std::time::Duration) -> bool {
        self.since.elapsed() < limit / 2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gid_round_trip() {
        let g: [u8; 16] = core::array::from_fn(|i| i as u8 * 17);
        assert_eq!(parse_gid(&gid_hex(&g)).unwrap(), g);
        assert!(parse_gid("zz").is_err());
        assert!(parse_gid(&"é".repeat(16)).is_err());
    }

    #[tokio::test]
    async fn junk_and_eof_are_errors() {
        let mut r = BufReader::new(&b"{not json}\n"[..]);
        assert_eq!(recv::<_, Request>(&mut r).await.unwrap_err().kind(), ErrorKind::Protocol);
        let mut r = BufReader::new(&b""[..]);
        assert_eq!(recv::<_, Request>(&mut r).await.unwrap_err().kind(), ErrorKind::ConnectionReset);
        let mut r = BufReader::new(&br#"{"op":"describe"}"#[..]);
        assert_eq!(recv::<_, Request>(&mut r).await.unwrap_err().kind(), ErrorKind::ConnectionReset);
    }

    fn line<T: Serialize>(msg: &T) -> Vec<u8> {
        let mut l = serde_json::to_vec(msg).unwrap();
        l.push(b'\n');
        l
    }

    #[tokio::test]
    async fn notify_round_trip_and_the_largest_fits_a_note_line() {
        let msg: Vec<u8> = (0..=255u8).cycle().take(MAX_NOTIFY_LEN).collect();
        // The worst sender name: every byte escaped by JSON as \u00XX.
        let from = "\u{1}".repeat(MAX_NOTIFY_FROM);
        let l = line(&notify_request(&from, &msg).unwrap());
        assert!(l.len() <= MAX_NOTE_LINE, "{} > {MAX_NOTE_LINE}", l.len());
        let mut r = BufReader::new(&l[..]);
        let Request::Notify { from: f, msg: m } = recv_limited::<_, Request>(&mut r, MAX_NOTE_LINE).await.unwrap()
        else {
            panic!("not a notify")
        };
        assert_eq!(decode_notify(f, &m).unwrap(), Notification { from, msg });
        let l = line(&notify_request("10.0.0.1:7000", b"").unwrap());
        let mut r = BufReader::new(&l[..]);
        let Request::Notify { from, msg } = recv::<_, Request>(&mut r).await.unwrap() else { panic!("not a notify") };
        assert_eq!(decode_notify(from, &msg).unwrap(), Notification { from: "10.0.0.1:7000".into(), msg: vec![] });
        for r in [Reply::NotifyAck, Reply::Busy] {
            let l = line(&r);
            let back: Reply = recv(&mut BufReader::new(&l[..])).await.unwrap();
            assert_eq!(format!("{back:?}"), format!("{r:?}"));
        }
    }

    #[test]
    fn malformed_notifications_are_refused_without_panics() {
        let refused = |from: &str, hex: &str| decode_notify(from.into(), hex).unwrap_err().kind();
        assert_eq!(refused(&"x".repeat(MAX_NOTIFY_FROM + 1), ""), ErrorKind::InvalidRequest);
        assert_eq!(refused("p", &"00".repeat(MAX_NOTIFY_LEN + 1)), ErrorKind::InvalidRequest);
        assert_eq!(refused("p", "abc"), ErrorKind::InvalidRequest);
        assert_eq!(refused("p", "zz"), ErrorKind::InvalidRequest);
        assert_eq!(refused("p", "é"), ErrorKind::InvalidRequest);
        assert_eq!(refused("p", "+1"), ErrorKind::InvalidRequest);
        assert_eq!(decode_notify("p".into(), "00fFA9").unwrap().msg, vec![0, 0xff, 0xa9]);
        assert!(decode_notify("x".repeat(MAX_NOTIFY_FROM), &"00".repeat(MAX_NOTIFY_LEN)).is_ok());
        // The sender refuses what the receiver would.
        assert_eq!(notify_request("p", &[0; MAX_NOTIFY_LEN + 1]).unwrap_err().kind(), ErrorKind::InvalidRequest);
    }

    #[tokio::test]
    async fn note_lines_are_bounded() {
        let long = vec![b'x'; MAX_NOTE_LINE + 1];
        let mut r = BufReader::new(&long[..]);
        assert_eq!(recv_limited::<_, Request>(&mut r, MAX_NOTE_LINE).await.unwrap_err().kind(), ErrorKind::Protocol);
        let mut lines = Lines::new(BufReader::new(&long[..]), MAX_NOTE_LINE);
        assert_eq!(lines.next::<Reply>().await.unwrap_err().kind(), ErrorKind::Protocol);
        let e = Error::new(ErrorKind::Protocol, "é".repeat(MAX_LINE));
        let Reply::Error { message } = Reply::bounded_error(&e) else { panic!("not an error") };
        assert!(message.len() <= MAX_ERROR_TEXT && message.starts_with("é"));
        assert!(line(&Reply::bounded_error(&e)).len() <= MAX_NOTE_LINE);
    }

    /// A `Lines::next` dropped halfway through a line (a `select!` took
    /// another branch) loses nothing: the next call returns the message.
    #[tokio::test]
    async fn lines_next_is_cancel_safe() {
        let (mut w, r) = tokio::io::duplex(64);
        let mut lines = Lines::new(BufReader::new(r), MAX_NOTE_LINE);
        let l = line(&Reply::Busy);
        let (a, b) = l.split_at(5);
        w.write_all(a).await.unwrap();
        let cut = tokio::time::timeout(std::time::Duration::from_millis(20), lines.next::<Reply>()).await;
        assert!(cut.is_err(), "half a line is not a message");
        w.write_all(b).await.unwrap();
        w.write_all(&line(&Reply::NotifyAck)).await.unwrap();
        assert!(matches!(lines.next::<Reply>().await.unwrap(), Reply::Busy));
        assert!(matches!(lines.next::<Reply>().await.unwrap(), Reply::NotifyAck));
        drop(w);
        assert_eq!(lines.next::<Reply>().await.unwrap_err().kind(), ErrorKind::ConnectionReset);
    }
}
