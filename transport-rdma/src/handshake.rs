//! The QP handshake, written once for both sides: a [`QpGroup`] is created
//! (RESET -> INIT, random PSNs), its half ([`QpGroup::hello`]) travels over
//! the TCP side channel, and [`QpGroup::connect`] brings every QP up
//! (INIT -> RTR -> RTS) toward the other half at the smaller of both
//! ports' MTUs. The connecting side runs [`connect`]; `server.rs` answers
//! with the same group operations.
//!
//! Creating, connecting and destroying QPs block their thread: moving a QP
//! to RTR resolves the peer's GID to a MAC in the kernel
//! (`rdma_addr_find_l2_eth_by_grh`), which waits up to a second for
//! neighbour discovery when the kernel has no entry for the peer (seen in
//! the soft-RoCE VM after a link went down and up, which flushes a
//! netdev's neighbours), and destroying a QP took tens of ms. None of it
//! runs on a runtime worker: a worker blocked that long also holds the
//! task it woke last (tokio's LIFO slot is never stolen), which stalled the
//! session driver's timers and heartbeats past the liveness timeout (issue
//! 31). [`off_runtime`] runs such work on the blocking pool, and
//! [`Bringup`] destroys a group that is given up there too.

use std::borrow::Borrow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::BufReader;
use tokio::net::TcpStream;
use transport_core::{Error, ErrorKind, Result, SegmentDescriptor};

use crate::state::Verbs;
use crate::verbs::{Qp, QpTiming, RemoteQp};
use crate::wire::{self, QpInfo, Reply, Request, Spare};

/// `ibv_mtu` values: 1 = 256 bytes ... 5 = 4096 bytes.
const IBV_MTU_MIN: u32 = 1;
const IBV_MTU_MAX: u32 = 5;
/// PSNs are 24 bits.
const PSN_MASK: u32 = 0x00ff_ffff;

/// One side's half of a QP group, as the side channel carries it.
#[derive(Debug, Clone)]
pub(crate) struct Half {
    /// GID as 32 hex digits.
    pub gid: String,
    pub lid: u16,
    /// `ibv_mtu` value of the side's active MTU.
    pub mtu: u32,
    pub qps: Vec<QpInfo>,
}

/// QPs created for one endpoint or peer group, with their starting PSNs.
#[derive(Debug)]
pub(crate) struct QpGroup {
    qps: Vec<(Qp, u32)>,
    /// When the QPs were created (async events read before are not about them).
    pub created: Instant,
}

/// The path MTU both ports support: the smaller of the two active MTUs
/// (a peer's out-of-range value is clamped into `ibv_mtu`'s range).
pub(crate) fn path_mtu(peer: u32, local: u32) -> u32 {
    peer.clamp(IBV_MTU_MIN, IBV_MTU_MAX).min(local)
}

impl QpGroup {
    /// Creates `n` RC QPs in INIT with random PSNs, each allowing
    /// `max_send_wr` posted work requests.
    pub(crate) fn new(v: &Verbs, n: usize, max_send_wr: usize) -> Result<Self> {
        let max_send_wr = u32::try_from(max_send_wr).unwrap_or(u32::MAX);
        let mut qps = Vec::with_capacity(n);
        for _ in 0..n {
            let qp = Qp::new(&v.pd, &v.cq, v.port.port, max_send_wr)?;
            qps.push((qp, rand::random::<u32>() & PSN_MASK));
        }
        // Stamped once every QP exists: an event read before this cannot be
        // about them (it may be about an older QP that had the same number).
        let created = Instant::now();
        Ok(Self { qps, created })
    }

    /// This side's half, to send to the other side.
    pub(crate) fn hello(&self, v: &Verbs, mtu: u32) -> Half {
        Half {
            gid: wire::gid_hex(&v.port.gid),
            lid: v.port.lid,
            mtu,
            qps: self.qps.iter().map(|(q, psn)| QpInfo { qpn: q.qpn(), psn: *psn }).collect(),
        }
    }

    /// Brings every QP up toward the matching QP of `theirs` (INIT -> RTR
    /// -> RTS). Returns the path MTU used.
    pub(crate) fn connect(&self, v: &Verbs, theirs: &Half, timing: QpTiming) -> Result<u32> {
        if theirs.qps.len() != self.qps.len() {
            return Err(Error::new(ErrorKind::HandshakeFailed, "peer answered with a different QP count"));
        }
        let gid = wire::parse_gid(&theirs.gid)?;
        let mtu = path_mtu(theirs.mtu, v.port.active_mtu);
        for ((qp, psn), r) in self.qps.iter().zip(&theirs.qps) {
            let remote = RemoteQp { qpn: r.qpn, psn: r.psn, gid, lid: theirs.lid };
            qp.connect(*psn, &remote, v.port.port, v.port.gid_index, mtu, v.port.max_rd_atom, timing)
                .map_err(|e| Error::new(ErrorKind::HandshakeFailed, e.to_string()))?;
        }
        Ok(mtu)
    }

    pub(crate) fn into_qps(self) -> Vec<Qp> {
        self.qps.into_iter().map(|(q, _)| q).collect()
    }
}

/// Runs `work` (verbs calls that may block) on tokio's blocking pool, so
/// that no runtime worker waits in the kernel. If the caller's future is
/// dropped meanwhile, `work` still runs to its end and its result is
/// dropped on the pool.
pub(crate) async fn off_runtime<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| Error::new(ErrorKind::Internal, format!("a blocking verbs task failed: {e}")))
}

/// A QP group being brought up, with what must outlive its QPs (`P`: the
/// endpoint place it was built for, given back only once the QPs are
/// destroyed, rule 4). Dropped before [`Bringup::finish`] (a failed or
/// abandoned build), it destroys the QPs and then drops `P`, on the
/// blocking pool when inside a runtime.
pub(crate) struct Bringup<P: Send + 'static> {
    group: Option<QpGroup>,
    place: Option<P>,
}

impl<P: Send + 'static> Bringup<P> {
    /// Creates `n` QPs (as [`QpGroup::new`]) off the runtime, for `place`.
    pub(crate) async fn create(v: Arc<Verbs>, n: usize, max_send_wr: usize, place: P) -> Result<Self> {
        let made = off_runtime(move || {
            let group = QpGroup::new(&v, n, max_send_wr);
            // On failure `place` goes here, after the QPs made so far.
            group.map(|g| Bringup { group: Some(g), place: Some(place) })
        });
        made.await?
    }

    /// The group and the place, the build settled.
    pub(crate) fn finish(mut self) -> (QpGroup, P) {
        match (self.group.take(), self.place.take()) {
            (Some(g), Some(p)) => (g, p),
            // Both are set from `create` until `finish`, which consumes self.
            _ => unreachable!("a Bringup holds its group and place until finished"),
        }
    }
}

impl<P: Send + 'static> Borrow<QpGroup> for Bringup<P> {
    fn borrow(&self) -> &QpGroup {
        match &self.group {
            Some(g) => g,
            None => unreachable!("a Bringup holds its group until finished"),
        }
    }
}

impl<P: Send + 'static> Drop for Bringup<P> {
    fn drop(&mut self) {
        let (group, place) = (self.group.take(), self.place.take());
        if group.is_none() && place.is_none() {
            return;
        }
        // QPs first (ibv_destroy_qp), then the place.
        let destroy = move || {
            drop(group);
            drop(place);
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn_blocking(destroy)),
            Err(_) => destroy(),
        }
    }
}

/// A new connection to `name`: the handshake and `request` (sent with the
/// handshake's last message where it allows), and the reply.
async fn greeted(name: &str, secret: Option<&str>, request: &Request) -> Result<(BufReader<TcpStream>, Reply)> {
    let s = TcpStream::connect(name).await.map_err(|e| Error::from(e).with("segment", name))?;
    s.set_nodelay(true)?;
    let mut s = BufReader::new(s);
    crate::greet::hello(&mut s, secret, name, Some(request)).await?;
    let reply = wire::recv::<_, Reply>(&mut s).await?;
    Ok((s, reply))
}

/// Sends `request` over `s`, past its handshake, and reads the reply.
async fn ask(s: &mut BufReader<TcpStream>, request: &Request) -> Result<Reply> {
    wire::send(s.get_mut(), request).await?;
    wire::recv::<_, Reply>(s).await
}

/// The connecting side: sends `group`'s half to the segment `name` and
/// brings the QPs up toward the reply (off the runtime). Returns the group,
/// the side channel (kept open for the endpoint's life: its close makes
/// the peer destroy its half) and the peer's descriptor as of now. On
/// failure the group is dropped. A fresh `spare` is asked first; if the
/// peer closed it (its timeout passed, or a server that takes one request
/// a connection), a new connection is made, within the same `limit`.
pub(crate) async fn connect<G: Borrow<QpGroup> + Send + 'static>(
    v: Arc<Verbs>,
    group: G,
    name: &str,
    timing: QpTiming,
    limit: Duration,
    secret: Option<&str>,
    spare: Option<Spare>,
) -> Result<(G, TcpStream, SegmentDescriptor)> {
    let hello = group.borrow().hello(&v, v.port.active_mtu);
    let request = Request::Connect { gid: hello.gid, lid: hello.lid, mtu: hello.mtu, qps: hello.qps };
    let work = async {
        if let Some(mut spare) = spare.filter(|s| s.fresh(limit)) {
            match ask(&mut spare.stream, &request).await {
                Ok(reply) => return Ok((spare.stream, reply)),
                // Closed unanswered: the peer never saw the request (it
                // reads nothing once it closed), so asking anew is safe.
                Err(e) => {
                    tracing::debug!(segment = %name, error = %e, "rdma: the kept side channel was closed; connecting anew")
                }
            }
        }
        greeted(name, secret, &request).await
    };
    let (stream, reply) = match tokio::time::timeout(limit, work).await {
        Ok(r) => r?,
        // Nobody answered in time (a peer stopped or frozen still accepts
        // in its backlog): a timeout of the peer, not a failed handshake.
        Err(_) => {
            return Err(Error::new(
                ErrorKind::Timeout,
                format!(
                    "the peer did not complete the side channel's connect within {} ms (stopped, frozen, overloaded \
                     or unreachable?)",
                    limit.as_millis()
                ),
            )
            .with("segment", name))
        }
    };
    let (theirs, desc) = match reply {
        Reply::Connected { gid, lid, mtu, qps, descriptor } => (Half { gid, lid, mtu, qps }, descriptor),
        Reply::Error { message } => return Err(Error::new(ErrorKind::HandshakeFailed, message).with("segment", name)),
        _ => return Err(Error::new(ErrorKind::Protocol, "the peer answered the connect request with another reply")),
    };
    let group = off_runtime(move || group.borrow().connect(&v, &theirs, timing).map(|_| group)).await??;
    Ok((group, stream.into_inner(), desc))
}

/// Asks the peer `name` for its descriptor over the side channel; the
/// connection comes back with it, for the segment's first endpoint.
pub(crate) async fn fetch_descriptor(
    name: &str,
    limit: Duration,
    secret: Option<&str>,
) -> Result<(SegmentDescriptor, Spare)> {
    let work = async {
        let (s, reply) = greeted(name, secret, &Request::Describe).await?;
        match reply {
            Reply::Descriptor { descriptor } => Ok((descriptor, s)),
            Reply::Error { message } => Err(Error::new(ErrorKind::HandshakeFailed, message)),
            other => Err(Error::new(ErrorKind::Protocol, format!("unexpected reply {other:?}"))),
        }
    };
    let (d, stream) = match tokio::time::timeout(limit, work).await {
        Ok(r) => r?,
        Err(_) => {
            return Err(Error::new(
                ErrorKind::Timeout,
                format!("the peer did not answer the descriptor request within {} ms", limit.as_millis()),
            ))
        }
    };
    if d.backend != crate::BACKEND {
        return Err(Error::new(ErrorKind::HandshakeFailed, format!("segment is served by {:?}, not rdma", d.backend))
            .with("segment", name));
    }
    Ok((d, Spare { stream, since: Instant::now() }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_mtu_is_the_smaller_and_clamps_the_peer() {
        assert_eq!(path_mtu(5, 3), 3);
        assert_eq!(path_mtu(2, 5), 2);
        assert_eq!(path_mtu(0, 5), IBV_MTU_MIN);
        assert_eq!(path_mtu(u32::MAX, 5), IBV_MTU_MAX);
    }
}
