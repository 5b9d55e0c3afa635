//! Sockets: options, connecting, the client side of the handshake, and
//! frame I/O helpers shared by both sides.

use std::net::SocketAddr;
use std::sync::Arc;

use socket2::{SockRef, TcpKeepalive};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use transport_core::{Error, ErrorKind, Result};
use transport_mem::window::{WindowView, WINDOW_NONCE_LEN};

use crate::config::TcpConfig;
use crate::proto::{
    self, FrameType, Header, ProtoError, Status, WireRegion, HEADER_LEN, NONCE_LEN, PROOF_LEN, VERSION,
};
use crate::samehost::{self, SameHost};
use transport_control::auth;
use transport_control::handshake;

/// Names the socket option and its allowed values in an OS error, which
/// otherwise says only "Invalid argument".
fn sockopt<T>(name: &str, value: impl std::fmt::Display, allowed: &str, r: std::io::Result<T>) -> std::io::Result<T> {
    r.map_err(|e| std::io::Error::new(e.kind(), format!("setting {name} to {value} (allowed: {allowed}) failed: {e}")))
}

/// Applies the configured socket options. Lanes also get `SO_LINGER 0`,
/// so destroying an endpoint resets its connections (RST) and discards
/// bytes not yet delivered, rather than flushing them. An OS error names
/// the option and its allowed range.
pub(crate) fn apply_options(s: &TcpStream, cfg: &TcpConfig, abortive: bool) -> std::io::Result<()> {
    sockopt("TCP_NODELAY (tcp.nodelay)", cfg.nodelay, "true or false", s.set_nodelay(cfg.nodelay))?;
    let r = SockRef::from(s);
    if let Some(n) = cfg.send_buffer {
        sockopt("SO_SNDBUF (tcp.send_buffer)", n, BUFFER_ALLOWED, r.set_send_buffer_size(n))?;
    }
    if let Some(n) = cfg.recv_buffer {
        sockopt("SO_RCVBUF (tcp.recv_buffer)", n, BUFFER_ALLOWED, r.set_recv_buffer_size(n))?;
    }
    if let Some(t) = cfg.keepalive {
        sockopt(
            "SO_KEEPALIVE/TCP_KEEPIDLE (tcp.keepalive)",
            format_args!("{} s", t.as_secs()),
            KEEPALIVE_ALLOWED,
            r.set_tcp_keepalive(&TcpKeepalive::new().with_time(t)),
        )?;
    }
    if abortive {
        sockopt("SO_LINGER (lanes)", "0 s", "0 s", r.set_linger(Some(std::time::Duration::ZERO)))?;
    }
    Ok(())
}

const BUFFER_ALLOWED: &str = "1..=2147483647 bytes, clamped by net.core.wmem_max/rmem_max";
const KEEPALIVE_ALLOWED: &str = "1..=32767 s";

/// Maps a protocol error to the public error (transient: a new connection
/// may work).
pub(crate) fn proto_err(e: ProtoError, peer: &str) -> Error {
    Error::new(ErrorKind::Protocol, format!("peer sent a malformed frame: {e}")).with("peer", peer)
}

/// Maps a status from the peer to the public error.
pub(crate) fn status_err(s: Status, peer: &str) -> Error {
    let (kind, msg) = match s {
        Status::Ok => (ErrorKind::Internal, "ok status treated as an error"),
        Status::OutOfBounds => (ErrorKind::OutOfBounds, "the range is not inside one region the peer exposes"),
        Status::AccessDenied => (ErrorKind::AccessDenied, "the peer's region does not allow this access"),
        Status::Unregistered => (ErrorKind::Unregistered, "the peer unregistered the region"),
        Status::StaleGeneration => (ErrorKind::PeerRestarted, "the peer restarted (generation changed)"),
        Status::AuthFailed => (ErrorKind::AuthFailed, "the peer refused our authentication"),
        Status::TooLarge => (ErrorKind::InvalidRequest, "the peer refused an oversized frame"),
        Status::VersionMismatch => (ErrorKind::HandshakeFailed, "the peer speaks another protocol version"),
        Status::Busy => (ErrorKind::ConnectionRefused, "the peer is busy (at its connection limit or shutting down)"),
        Status::Protocol => (ErrorKind::Protocol, "the peer could not parse our frames"),
        Status::DeviceCopy => (ErrorKind::Io, "the peer could not copy to or from its device memory"),
        Status::SourceCopy => (ErrorKind::Io, "the peer could not copy the bytes from this process's memory"),
    };
    Error::new(kind, msg).with("peer", peer)
}

/// [`status_err`] for an ERROR frame, with the reason the peer gave in
/// its payload (protected mode says what to set), if any.
fn refused(s: Status, said: &[u8], peer: &str) -> Error {
    let e = status_err(s, peer);
    match std::str::from_utf8(said) {
        Ok(m) if !m.is_empty() => Error::new(e.kind(), format!("{}: {m}", e.message())).with("peer", peer),
        _ => e,
    }
}

/// Reads and validates one frame header.
async fn read_header<R: AsyncRead + Unpin>(r: &mut R, max_frame: usize, peer: &str) -> Result<Header> {
    let mut b = [0u8; HEADER_LEN];
    r.read_exact(&mut b).await.map_err(|e| Error::from(e).with("peer", peer))?;
    Header::decode(&b, max_frame).map_err(|e| proto_err(e, peer))
}

/// Reads a whole small frame (header + payload).
async fn read_frame<R: AsyncRead + Unpin>(r: &mut R, max_frame: usize, peer: &str) -> Result<(Header, Vec<u8>)> {
    let h = read_header(r, max_frame, peer).await?;
    let mut p = vec![0u8; h.payload_len as usize];
    r.read_exact(&mut p).await.map_err(|e| Error::from(e).with("peer", peer))?;
    Ok((h, p))
}

/// Writes a header and a payload.
pub(crate) async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, h: Header, payload: &[u8]) -> std::io::Result<()> {
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    encode_frame(&mut out, h, payload);
    w.write_all(&out).await
}

/// Appends a header (its payload length set) and its payload to `out`.
pub(crate) fn encode_frame(out: &mut Vec<u8>, mut h: Header, payload: &[u8]) {
    h.payload_len = payload.len() as u32;
    h.encode_into(out);
    out.extend_from_slice(payload);
}

/// What the client learns from a handshake.
#[derive(Debug, Clone)]
pub(crate) struct Hello {
    pub generation: u64,
    /// What the lane may move by same-host copies.
    pub same_host: SameHost,
    /// The server's window of direct writes, if it offered one and it
    /// checked out.
    pub direct: Option<Arc<WindowView>>,
    /// Whether the request given to [`connect`] went with the AUTH.
    pub first_sent: bool,
}

/// Connects one lane: TCP connect, options, handshake (version, optional
/// mutual authentication). Bounded by `connect_timeout`. `first`, a
/// request frame (header and payload), goes right behind the AUTH when
/// the handshake allows it (the server proved itself early, or no secret
/// is set: `Hello::first_sent`); the caller sends it otherwise.
pub(crate) async fn connect(
    addr: SocketAddr,
    cfg: &TcpConfig,
    peer: &str,
    first: Option<(Header, &[u8])>,
) -> Result<(TcpStream, Hello)> {
    let fut = async {
        let sock = if addr.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
        // Validated to fit a C int; a value that does not fit u32 is
        // passed on as u32::MAX, for the OS to refuse by name.
        if let Some(n) = cfg.send_buffer {
            let v = u32::try_from(n).unwrap_or(u32::MAX);
            sockopt("SO_SNDBUF (tcp.send_buffer)", n, BUFFER_ALLOWED, sock.set_send_buffer_size(v))?;
        }
        if let Some(n) = cfg.recv_buffer {
            let v = u32::try_from(n).unwrap_or(u32::MAX);
            sockopt("SO_RCVBUF (tcp.recv_buffer)", n, BUFFER_ALLOWED, sock.set_recv_buffer_size(v))?;
        }
        let s = sock.connect(addr).await?;
        apply_options(&s, cfg, true)?;
        Ok::<_, std::io::Error>(s)
    };
    let mut s = tokio::time::timeout(cfg.connect_timeout, fut)
        .await
        .map_err(|_| Error::new(ErrorKind::ConnectionRefused, "connect timed out").with("peer", peer))?
        .map_err(|e| Error::from(e).with("peer", peer))?;
    // The kernel accepted the connection and the engine said nothing: a
    // peer stopped (SIGSTOP) or frozen keeps accepting in its backlog, so
    // this is a timeout of the peer, not a failed handshake.
    let hello =
        tokio::time::timeout(cfg.connect_timeout, handshake(&mut s, cfg, peer, first)).await.map_err(|_| {
            Error::new(
                ErrorKind::Timeout,
                format!(
                    "the peer accepted the connection but did not answer the handshake within {} ms \
                 (stopped, frozen or overloaded?)",
                    cfg.connect_timeout.as_millis()
                ),
            )
            .with("peer", peer)
        })??;
    Ok((s, hello))
}

async fn handshake(s: &mut TcpStream, cfg: &TcpConfig, peer: &str, first: Option<(Header, &[u8])>) -> Result<Hello> {
    let io = |e: std::io::Error| Error::from(e).with("peer", peer);
    // Boxed: with a same-host offer the server reads it from this
    // process's memory (at this address) before it answers.
    let mut hs = handshake::Client::new(auth::TCP, cfg.secret.as_deref().map(str::as_bytes));
    let mut hello = Vec::with_capacity(2 + NONCE_LEN);
    hello.extend_from_slice(&VERSION.to_le_bytes());
    hello.extend_from_slice(hs.nonce());
    let mut hh = Header::new(FrameType::Hello);
    hh.flags = proto::EARLY_PROOF;
    if cfg.same_host {
        hh.flags |= proto::SAME_HOST;
        hh.addr = u64::from(samehost::my_pid());
        hh.len = hs.nonce().as_ptr() as u64;
    }
    write_frame(s, hh, &hello).await.map_err(io)?;
    let (h, payload) =
        read_frame(s, proto::MAX_ERROR_MSG.max(NONCE_LEN + PROOF_LEN), peer).await.map_err(handshake_kind)?;
    if h.ty == FrameType::Error {
        return Err(refused(h.status, &payload, peer));
    }
    if h.ty != FrameType::Challenge {
        return Err(Error::new(ErrorKind::HandshakeFailed, "expected CHALLENGE").with("peer", peer));
    }
    // The decoder held the payload to NONCE_LEN, or NONCE_LEN + PROOF_LEN
    // with EARLY_PROOF: the nonce, then the server's early proof if any.
    let (sn, early_proof) = payload.split_at(NONCE_LEN.min(payload.len()));
    let auth_required = h.flags & 1 != 0;
    let same_host = if cfg.same_host { check_server(s, &h, sn) } else { SameHost::default() };
    let a = hs.challenge(sn, auth_required, early_proof).map_err(|e| e.with("peer", peer))?;
    // AUTH and, when the server is proven (or no secret is set), the first
    // request with it in one write: the server reads the request only after
    // it checked the AUTH, and this side reads the answer after READY.
    let mut out = Vec::with_capacity(2 * HEADER_LEN + a.proof.len());
    encode_frame(&mut out, Header::new(FrameType::Auth), &a.proof);
    let first_sent = match first {
        Some((f, p)) if a.early => {
            encode_frame(&mut out, f, p);
            true
        }
        _ => false,
    };
    s.write_all(&out).await.map_err(io)?;
    let (r, server_proof) = read_frame(s, proto::MAX_ERROR_MSG.max(NONCE_LEN), peer).await.map_err(|e| {
        // A server that refuses our proof closes after an ERROR frame; a
        // reset while reading the answer means the same.
        if auth_required && e.kind() == ErrorKind::ConnectionReset {
            Error::new(ErrorKind::AuthFailed, "the peer closed the connection after our proof").with("peer", peer)
        } else {
            handshake_kind(e)
        }
    })?;
    match r.ty {
        FrameType::Ready => {}
        FrameType::Error => return Err(status_err(r.status, peer)),
        _ => return Err(Error::new(ErrorKind::HandshakeFailed, "expected READY").with("peer", peer)),
    }
    // With a secret the server proves it too, so an impostor listening on
    // the address is never sent data.
    hs.ready(&server_proof).map_err(|e| e.with("peer", peer))?;
    let direct = if r.flags & proto::DIRECT_WRITES != 0 { attach_window(cfg, same_host, &r, sn, peer) } else { None };
    Ok(Hello { generation: h.generation, same_host, direct, first_sent })
}

/// The direct-copy window a READY offered, mapped: only from a server
/// whose process this side verified (`same.read_from`), with direct writes
/// or reads configured. A window that does not check out is logged and
/// not used (the lane's writes and reads go through the server).
fn attach_window(cfg: &TcpConfig, same: SameHost, ready: &Header, sn: &[u8], peer: &str) -> Option<Arc<WindowView>> {
    if !(cfg.same_host && (cfg.direct_writes || cfg.direct_reads)) {
        return None;
    }
    let pid = same.read_from?;
    let nonce: &[u8; WINDOW_NONCE_LEN] = sn.try_into().ok()?;
    let attached = i32::try_from(ready.id)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "descriptor number out of range"))
        .and_then(|fd| WindowView::attach(pid, fd, nonce));
    match attached {
        Ok(v) => Some(Arc::new(v)),
        Err(e) => {
            tracing::info!(
                peer,
                pid,
                "the peer's direct-copy window is not used ({e}): writes and reads go through the peer"
            );
            None
        }
    }
}

/// What a CHALLENGE allows by same-host copies: writes if the server
/// verified this process; reads if the server offered its own process and
/// it passes the same checks here (`samehost::peer_process`).
fn check_server(s: &TcpStream, h: &Header, sn: &[u8]) -> SameHost {
    SameHost { writes: h.flags & proto::PULL_WRITES != 0, read_from: samehost::peer_process(s, h, sn, "its reads") }
}

fn handshake_kind(e: Error) -> Error {
    if e.kind() == ErrorKind::Protocol {
        Error::new(ErrorKind::HandshakeFailed, e.message().to_owned())
    } else {
        e
    }
}

/// A DESC_REQ with request id `id`.
pub(crate) fn desc_req(id: u64) -> Header {
    let mut h = Header::new(FrameType::DescReq);
    h.id = id;
    h
}

/// Fetches the descriptor over a freshly handshaken connection: sends the
/// DESC_REQ `id` unless the handshake already did (`sent`), then reads the
/// answer.
pub(crate) async fn fetch_regions(
    s: &mut TcpStream,
    cfg: &TcpConfig,
    id: u64,
    sent: bool,
    peer: &str,
) -> Result<(u64, Vec<WireRegion>)> {
    if !sent {
        write_frame(s, desc_req(id), &[]).await.map_err(|e| Error::from(e).with("peer", peer))?;
    }
    let (r, p) = tokio::time::timeout(cfg.connect_timeout, read_frame(s, cfg.max_frame, peer))
        .await
        .map_err(|_| Error::new(ErrorKind::Timeout, "descriptor fetch timed out").with("peer", peer))??;
    if r.ty != FrameType::DescResp || r.id != id {
        return Err(Error::new(ErrorKind::Protocol, "expected DESC_RESP").with("peer", peer));
    }
    let regions = proto::decode_regions(&p).map_err(|e| proto_err(e, peer))?;
    Ok((r.generation, regions))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_os_error_on_a_socket_option_names_it_and_its_range() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let s = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        // Not validated: what the OS says about a keepalive it refuses.
        let cfg = TcpConfig { keepalive: Some(std::time::Duration::from_secs(40_000)), ..TcpConfig::default() };
        let e = apply_options(&s, &cfg, false).unwrap_err();
        let m = e.to_string();
        assert!(m.contains("TCP_KEEPIDLE") && m.contains("tcp.keepalive") && m.contains("1..=32767 s"), "{m}");
        apply_options(&s, &TcpConfig::default(), true).unwrap();
    }
}
