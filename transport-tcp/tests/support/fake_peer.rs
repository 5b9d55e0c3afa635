//! A fake TCP peer speaking the wire protocol (handshake without a secret,
//! DESC_REQ) whose answers to READ and WRITE a test scripts: it can answer
//! too early, stop mid-answer, or close every lane once it is up.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use transport_tcp::wire::{encode_regions, FrameType, Header, WireRegion, HEADER_LEN, NONCE_LEN, SAME_HOST};

/// What the peer does with a connection once the handshake is done.
pub type Script = Arc<dyn Fn(TcpStream) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// The generation the fake peer announces.
pub const GENERATION: u64 = 0x5eed;
/// The one region it exposes.
pub const REGION: WireRegion = WireRegion { addr: 1 << 20, len: 1 << 30, read: true, write: true };

/// The peer; dropping it stops it and its connections.
pub struct FakePeer {
    pub addr: SocketAddr,
    tasks: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl FakePeer {
    /// A peer on loopback that handshakes every connection, then runs
    /// `script` on it.
    pub async fn start(script: Script) -> Self {
        Self::start_on(script, false).await
    }

    /// As [`FakePeer::start`], with `same_host` offering this process for
    /// same-host READs at the handshake (the client's checks pass: this
    /// process holds the socket, and its memory has the nonce). Its script
    /// answers descriptor requests with [`next_request_on`].
    pub async fn start_on(script: Script, same_host: bool) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let tasks: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let t = tasks.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((mut s, _)) = listener.accept().await else { continue };
                let script = script.clone();
                t.lock().push(tokio::spawn(async move {
                    if handshake(&mut s, same_host).await.is_some() {
                        script(s).await;
                    }
                }));
            }
        });
        tasks.lock().push(accept);
        Self { addr, tasks }
    }

    pub fn name(&self) -> String {
        self.addr.to_string()
    }
}

impl Drop for FakePeer {
    fn drop(&mut self) {
        for t in self.tasks.lock().drain(..) {
            t.abort();
        }
    }
}

/// The CHALLENGE's nonce, in this process's memory for a client's
/// same-host probe.
static NONCE: [u8; NONCE_LEN] = [9u8; NONCE_LEN];

async fn handshake(s: &mut TcpStream, same_host: bool) -> Option<()> {
    let mut b = [0u8; HEADER_LEN];
    s.read_exact(&mut b).await.ok()?;
    let h = Header::decode(&b, 1 << 20).ok()?;
    let mut p = vec![0u8; h.payload_len as usize];
    s.read_exact(&mut p).await.ok()?;
    let mut c = Header::new(FrameType::Challenge);
    c.generation = GENERATION;
    c.payload_len = NONCE_LEN as u32;
    if same_host {
        c.flags = SAME_HOST;
        c.addr = u64::from(std::process::id());
        c.len = NONCE.as_ptr() as u64;
    }
    s.write_all(&c.encode()).await.ok()?;
    s.write_all(&NONCE).await.ok()?;
    s.read_exact(&mut b).await.ok()?;
    let a = Header::decode(&b, 1 << 20).ok()?;
    let mut proof = vec![0u8; a.payload_len as usize];
    s.read_exact(&mut proof).await.ok()?;
    s.write_all(&Header::new(FrameType::Ready).encode()).await.ok()?;
    Some(())
}

/// Reads the next header on `s`, answering DESC_REQs on the way. `None`
/// once the connection is gone.
pub async fn next_request(s: &mut TcpStream) -> Option<Header> {
    next_request_on(s, REGION).await
}

/// As [`next_request`], describing `region` as the peer's memory.
pub async fn next_request_on(s: &mut TcpStream, region: WireRegion) -> Option<Header> {
    loop {
        let mut b = [0u8; HEADER_LEN];
        s.read_exact(&mut b).await.ok()?;
        let h = Header::decode(&b, 64 << 20).ok()?;
        if h.ty != FrameType::DescReq {
            return Some(h);
        }
        send_desc_of(s, h.id, region).await?;
    }
}

/// Answers one DESC_REQ on `s` (lane 0 of a build asks for it first).
pub async fn answer_desc(s: &mut TcpStream) -> Option<()> {
    let mut b = [0u8; HEADER_LEN];
    s.read_exact(&mut b).await.ok()?;
    let h = Header::decode(&b, 64 << 20).ok()?;
    if h.ty != FrameType::DescReq {
        return None;
    }
    send_desc_of(s, h.id, REGION).await
}

/// Sends a descriptor of `region` as the answer to request `id`.
async fn send_desc_of(s: &mut TcpStream, id: u64, region: WireRegion) -> Option<()> {
    let regions = encode_regions(&[region]);
    let mut a = Header::new(FrameType::DescResp);
    a.id = id;
    a.generation = GENERATION;
    a.payload_len = regions.len() as u32;
    s.write_all(&a.encode()).await.ok()?;
    s.write_all(&regions).await.ok()
}
