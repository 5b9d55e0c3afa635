//! Connections read by polling, without the kernel also waking a runtime
//! thread for every frame that arrives.
//!
//! A thread polling a socket (a server connection waiting for its next
//! request, `crate::busypoll`; a caller spinning on its own transfer,
//! `crate::rx`) reads the bytes itself. Yet the socket is in the runtime's
//! reactor, and every arrival wakes the runtime thread sleeping in it: on
//! machines whose idle CPUs halt (VMs) each wake costs tens of
//! microseconds and preempts the very thread that polls (the README's
//! single 4 KiB write over the network path has the measurements: about
//! one such wake per transfer on each side, and what removing it gave).
//!
//! While a connection is polled it is *hushed*: its receive low-water
//! mark (`SO_RCVLOWAT`) is raised to [`MARK`] at most, so arrivals smaller
//! than that wake nobody (a non-blocking read still returns them). Before
//! anyone waits on the runtime for the connection again it is made *loud*
//! (mark 1), which wakes a waiter at once if bytes are already there. A
//! peer's close, a reset or memory pressure wake the reactor at any mark.
//!
//! The mark stays at most a quarter of the socket's receive buffer: Linux
//! grows the buffer (and clamps the advertised window) to fit a larger
//! mark, which must not happen to a connection that carries bulk data.

use std::os::fd::AsFd;
use std::sync::Arc;

use tokio::net::tcp::OwnedReadHalf;

/// The largest mark a hushed connection gets.
const MARK: u32 = 32 << 10;

/// How far a connection can be hushed, found once when it opens.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Hush {
    /// The low-water mark while hushed: 0 when the connection is never
    /// hushed (its receive buffer is too small to tell).
    mark: u32,
}

impl Hush {
    /// For a connection just opened: a mark of at most a quarter of its
    /// receive buffer now (buffers only grow from here).
    pub fn new(sock: &impl AsFd) -> Self {
        let rcvbuf = socket2::SockRef::from(sock).recv_buffer_size().unwrap_or(0);
        let mark = u32::try_from(rcvbuf / 4).unwrap_or(u32::MAX).min(MARK);
        Self { mark: if mark < 2 { 0 } else { mark } }
    }

    /// Tries to hush `sock`: whether it is now. A refused option
    /// leaves it loud (it then wakes the runtime as before, which costs
    /// time, never correctness).
    pub fn hush(self, sock: &impl AsFd) -> bool {
        if self.mark == 0 {
            return false;
        }
        match transport_mem::sock::set_recv_lowat(sock.as_fd(), self.mark) {
            Ok(()) => true,
            Err(e) => {
                tracing::debug!(error = %e, "SO_RCVLOWAT refused: the connection stays loud");
                false
            }
        }
    }

    /// Makes a hushed `sock` loud again, so arrivals wake the runtime (at
    /// once, if bytes are already there). An error (the descriptor is
    /// gone) is the connection's: nothing could wake a waiter for it.
    pub fn loud(self, sock: &impl AsFd) -> std::io::Result<()> {
        transport_mem::sock::set_recv_lowat(sock.as_fd(), 1)
    }
}

/// A lane's answers side as callers spinning on their transfers hush it
/// (`Transport::polling`): hushed while at least one caller polls it.
#[derive(Debug, Default)]
pub(crate) struct LaneHush {
    /// The lane's socket while it is connected.
    sock: Option<(Arc<OwnedReadHalf>, Hush)>,
    /// Callers polling the lane now.
    callers: u32,
    hushed: bool,
}

impl LaneHush {
    /// A new lane's socket.
    pub fn attach(&mut self, sock: Arc<OwnedReadHalf>) {
        let q = Hush::new(stream(&sock));
        self.sock = Some((sock, q));
    }

    /// Lets go of the socket (the teardown): nothing is hushed after.
    pub fn detach(&mut self) {
        self.sock = None;
        self.hushed = false;
    }

    /// One more caller polls the lane: the first one hushes it.
    pub fn enter(&mut self) {
        self.callers = self.callers.saturating_add(1);
        if self.callers == 1 && !self.hushed {
            if let Some((s, q)) = &self.sock {
                self.hushed = q.hush(stream(s));
            }
        }
    }

    /// A caller stopped polling the lane: the last one makes it loud
    /// again (an error: the socket is gone).
    pub fn leave(&mut self) -> std::io::Result<()> {
        self.callers = self.callers.saturating_sub(1);
        if self.callers == 0 && std::mem::take(&mut self.hushed) {
            if let Some((s, q)) = &self.sock {
                q.loud(stream(s))?;
            }
        }
        Ok(())
    }
}

fn stream(half: &Arc<OwnedReadHalf>) -> &tokio::net::TcpStream {
    (**half).as_ref()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::io::AsyncWriteExt;

    /// A lane stays hushed while any caller polls it: arrivals below the
    /// mark do not report it readable; the last caller's leave makes it
    /// loud, which reports the bytes already there at once.
    #[tokio::test]
    async fn a_lane_is_hushed_until_its_last_caller_leaves() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut c = tokio::net::TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (s, _) = l.accept().await.unwrap();
        let (rd, _wr) = s.into_split();
        let rd = Arc::new(rd);
        let mut lane = LaneHush::default();
        lane.attach(rd.clone());
        lane.enter();
        lane.enter();
        // A new socket's first readiness may be stale: a read that would
        // block clears it (as the lane's reader does).
        let e = rd.try_read(&mut [0u8; 16]).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock);
        c.write_all(b"answer").await.unwrap();
        let wait = Duration::from_millis(100);
        assert!(tokio::time::timeout(wait, rd.readable()).await.is_err(), "hushed: no wake for 6 bytes");
        lane.leave().unwrap();
        assert!(tokio::time::timeout(wait, rd.readable()).await.is_err(), "one caller still polls");
        lane.leave().unwrap();
        tokio::time::timeout(Duration::from_secs(5), rd.readable()).await.expect("loud: woken at once").unwrap();
        lane.leave().unwrap();
        lane.detach();
        lane.enter();
        lane.leave().unwrap();
    }
}
