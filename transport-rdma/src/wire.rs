//! The TCP side channel: one JSON object per line, at most [`MAX_LINE`]
//! bytes. A client either asks for the descriptor (`describe`) or connects
//! a QP group (`connect`); in the second case it keeps the socket open for
//! the endpoint's lifetime, and the server destroys its QPs when it closes.

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use transport_core::{Error, ErrorKind, Result, SegmentDescriptor};

/// Longest accepted line; longer input is a protocol error.
pub(crate) const MAX_LINE: usize = 1 << 20;

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
    Describe,
    Connect {
        /// GID as 32 hex digits.
        gid: String,
        lid: u16,
        /// `ibv_mtu` value of the initiator's active MTU.
        mtu: u32,
        qps: Vec<QpInfo>,
    },
}

/// The answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub(crate) enum Reply {
    Descriptor { descriptor: SegmentDescriptor },
    Connected { gid: String, lid: u16, mtu: u32, qps: Vec<QpInfo>, descriptor: SegmentDescriptor },
    Error { message: String },
}

pub(crate) fn gid_hex(gid: &[u8; 16]) -> String {
    gid.iter().map(|b| format!("{b:02x}")).collect()
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
pub(crate) async fn recv<R: AsyncRead + Unpin, T: for<'de> Deserialize<'de>>(r: &mut BufReader<R>) -> Result<T> {
    let mut line = Vec::new();
    loop {
        let buf = r.fill_buf().await?;
        if buf.is_empty() {
            return Err(Error::new(ErrorKind::ConnectionReset, "side channel closed before a complete message"));
        }
        let (take, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (buf.len(), false),
        };
        line.extend_from_slice(&buf[..take]);
        r.consume(take);
        if line.len() > MAX_LINE {
            return Err(Error::new(ErrorKind::Protocol, "side-channel message too long"));
        }
        if done {
            break;
        }
    }
    serde_json::from_slice(&line).map_err(|e| Error::new(ErrorKind::Protocol, format!("bad side-channel message: {e}")))
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
}
