//! A loopback fault proxy: relays TCP between clients and one upstream and
//! can cut every connection (RST), stall traffic (bytes stop moving,
//! connections stay up), blackhole (accept but never forward), corrupt
//! bytes, or die (stop listening and reset everything).
//!
//! A stall models a frozen path: while stalled, nothing is read from
//! either side. When traffic resumes, a side that was reset meanwhile is
//! treated as the peer's kernel would treat the RST: its undelivered bytes
//! die with the connection and the other side is reset too.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

#[derive(Debug, Default)]
struct Flags {
    blackhole: AtomicBool,
    /// Corrupt one byte in every this-many forwarded toward upstream (0 = off).
    corrupt_every: AtomicU64,
}

/// The proxy. Dropping it stops it and resets its connections.
#[derive(Debug)]
pub struct FaultProxy {
    pub addr: SocketAddr,
    upstream: Mutex<SocketAddr>,
    flags: Arc<Flags>,
    stall: watch::Sender<bool>,
    generation: watch::Sender<u64>,
    accept: Mutex<Option<JoinHandle<()>>>,
    conns: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

fn reuse_listener(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let s = socket2::Socket::new(socket2::Domain::for_address(addr), socket2::Type::STREAM, None)?;
    s.set_reuse_address(true)?;
    s.set_nonblocking(true)?;
    s.bind(&addr.into())?;
    s.listen(1024)?;
    TcpListener::from_std(s.into())
}

fn abort_stream(s: &TcpStream) {
    let _ = socket2::SockRef::from(s).set_linger(Some(Duration::ZERO));
}

impl FaultProxy {
    /// A proxy on `listen` (port 0 for any) toward `upstream`.
    pub async fn start(listen: SocketAddr, upstream: SocketAddr) -> std::io::Result<Arc<Self>> {
        let listener = reuse_listener(listen)?;
        let addr = listener.local_addr()?;
        let (stall, _) = watch::channel(false);
        let (generation, _) = watch::channel(0);
        let p = Arc::new(Self {
            addr,
            upstream: Mutex::new(upstream),
            flags: Arc::default(),
            stall,
            generation,
            accept: Mutex::new(None),
            conns: Arc::default(),
        });
        let me = Arc::downgrade(&p);
        let h = tokio::spawn(async move {
            loop {
                let Ok((c, _)) = listener.accept().await else { continue };
                let Some(p) = me.upgrade() else { return };
                p.relay(c);
            }
        });
        *p.accept.lock() = Some(h);
        Ok(p)
    }

    fn relay(&self, client: TcpStream) {
        let upstream = *self.upstream.lock();
        let flags = self.flags.clone();
        let stall = self.stall.subscribe();
        let mut gen_rx = self.generation.subscribe();
        let gen0 = *gen_rx.borrow();
        let h = tokio::spawn(async move {
            let _ = client.set_nodelay(true);
            abort_stream(&client);
            if flags.blackhole.load(Ordering::Relaxed) {
                // Hold the connection, forward nothing, until cut.
                let _ = gen_rx.wait_for(|g| *g != gen0).await;
                return;
            }
            let Ok(server) = TcpStream::connect(upstream).await else { return };
            let _ = server.set_nodelay(true);
            abort_stream(&server);
            let (cr, cw) = client.into_split();
            let (sr, sw) = server.into_split();
            let up = pump(cr, sw, stall.clone(), flags.clone(), true);
            let down = pump(sr, cw, stall, flags, false);
            tokio::select! {
                _ = up => {}
                _ = down => {}
                _ = gen_rx.wait_for(|g| *g != gen0) => {}
            }
            // Dropping both streams (linger 0) resets both sides.
        });
        let mut conns = self.conns.lock();
        conns.retain(|h| !h.is_finished());
        conns.push(h);
    }

    /// Resets every live connection; new ones are accepted.
    pub fn cut(&self) {
        self.generation.send_modify(|g| *g += 1);
        let conns: Vec<JoinHandle<()>> = std::mem::take(&mut *self.conns.lock());
        for h in conns {
            h.abort();
        }
    }

    /// Stops (`true`) or resumes (`false`) all traffic.
    pub fn stall(&self, on: bool) {
        self.stall.send_replace(on);
    }

    /// New connections are accepted but never forwarded.
    pub fn blackhole(&self, on: bool) {
        self.flags.blackhole.store(on, Ordering::Relaxed);
    }

    /// Flip one byte in every `every` bytes sent upstream (0 = off).
    pub fn corrupt(&self, every: u64) {
        self.flags.corrupt_every.store(every, Ordering::Relaxed);
    }

    /// Points new connections at another upstream (a restarted node).
    pub fn set_upstream(&self, up: SocketAddr) {
        *self.upstream.lock() = up;
    }

    /// Stops listening and resets everything (a crashed host).
    pub fn kill(&self) {
        if let Some(h) = self.accept.lock().take() {
            h.abort();
        }
        self.cut();
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.kill();
    }
}

async fn pump(
    mut r: OwnedReadHalf,
    mut w: OwnedWriteHalf,
    mut stall: watch::Receiver<bool>,
    flags: Arc<Flags>,
    upward: bool,
) {
    let mut buf = vec![0u8; 256 << 10];
    let mut count: u64 = 0;
    loop {
        if stall.wait_for(|s| !*s).await.is_err() {
            return;
        }
        let n = match r.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if *stall.borrow() && stall.wait_for(|s| !*s).await.is_err() {
            return;
        }
        // The sender reset while we held its bytes: they die with it.
        if matches!(r.as_ref().take_error(), Ok(Some(_)) | Err(_)) {
            return;
        }
        if upward {
            let every = flags.corrupt_every.load(Ordering::Relaxed);
            if every > 0 {
                for (k, b) in buf[..n].iter_mut().enumerate() {
                    if (count + k as u64) % every == every - 1 {
                        *b ^= 0x5A;
                    }
                }
            }
            count += n as u64;
        }
        if w.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
