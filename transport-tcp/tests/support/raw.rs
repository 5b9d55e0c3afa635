//! Speaking the wire protocol by hand, as an attacker or a scripted peer
//! would: raw sockets from chosen loopback addresses, the client side of a
//! handshake without a secret, whole frames, and waiting for the server to
//! close.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::time::Instant;
use transport_tcp::wire::{FrameType, Header, HEADER_LEN, NONCE_LEN, VERSION};

/// How long the helpers wait for the server when the caller does not say.
pub const WAIT: Duration = Duration::from_secs(5);

/// A raw connection to `to` from the loopback address `from` (all of
/// 127.0.0.0/8 is loopback on Linux), so one test can play peers on
/// several addresses.
pub async fn connect_from(from: Ipv4Addr, to: SocketAddr) -> TcpStream {
    let s = TcpSocket::new_v4().unwrap();
    s.bind(SocketAddr::new(IpAddr::V4(from), 0)).unwrap();
    s.connect(to).await.unwrap()
}

/// Sends a HELLO (the first step of a handshake); errors are ignored (the
/// server may already have refused the connection).
pub async fn send_hello(s: &mut TcpStream) {
    send_hello_as(s, Header::new(FrameType::Hello), &[7u8; NONCE_LEN]).await;
}

/// Sends `h` (a HELLO header: its flags and fields as the caller set them)
/// with the protocol version and `nonce` as payload; errors are ignored.
async fn send_hello_as(s: &mut TcpStream, mut h: Header, nonce: &[u8; NONCE_LEN]) {
    let mut p = VERSION.to_le_bytes().to_vec();
    p.extend_from_slice(nonce);
    h.payload_len = p.len() as u32;
    let _ = s.write_all(&h.encode()).await;
    let _ = s.write_all(&p).await;
}

/// Runs the client side of a handshake without a secret; returns the
/// server's generation.
pub async fn hello(s: &mut TcpStream) -> u64 {
    hello_as(s, Header::new(FrameType::Hello), &[7u8; NONCE_LEN]).await.generation
}

/// Runs the client side of a handshake without a secret, opening with the
/// HELLO header `h` and `nonce`; returns the server's CHALLENGE.
pub async fn hello_as(s: &mut TcpStream, h: Header, nonce: &[u8; NONCE_LEN]) -> Header {
    send_hello_as(s, h, nonce).await;
    let (c, _) = next_frame(s, WAIT).await.expect("a CHALLENGE");
    assert_eq!(c.ty, FrameType::Challenge);
    s.write_all(&Header::new(FrameType::Auth).encode()).await.unwrap();
    let (r, _) = next_frame(s, WAIT).await.expect("READY");
    assert_eq!(r.ty, FrameType::Ready);
    c
}

/// Reads one whole frame, or `None` if the connection ended first or
/// nothing came within `wait`.
pub async fn next_frame(s: &mut TcpStream, wait: Duration) -> Option<(Header, Vec<u8>)> {
    tokio::time::timeout(wait, async {
        let mut b = [0u8; HEADER_LEN];
        s.read_exact(&mut b).await.ok()?;
        let h = Header::decode(&b, 1 << 20).unwrap();
        let mut p = vec![0u8; h.payload_len as usize];
        s.read_exact(&mut p).await.ok()?;
        Some((h, p))
    })
    .await
    .ok()
    .flatten()
}

/// Reads until the server closes; the time it took, or `None` if it did
/// not close within `wait`.
pub async fn closed_within(s: &mut TcpStream, wait: Duration) -> Option<Duration> {
    let start = Instant::now();
    let mut sink = vec![0u8; 1 << 16];
    loop {
        match tokio::time::timeout_at(start + wait, s.read(&mut sink)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(start.elapsed()),
            Ok(Ok(_)) => {}
        }
    }
}

/// Whether the server closes the connection within [`WAIT`].
pub async fn closed(s: &mut TcpStream) -> bool {
    closed_within(s, WAIT).await.is_some()
}
