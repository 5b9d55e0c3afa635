//! The passive side: serves descriptors and accepts QP groups from peers
//! (with the same [`QpGroup`] bring-up the connecting side uses).
//!
//! Every connection opens with the handshake (`crate::greet`): counted
//! by phase and address from its accept (`transport_control::admission`:
//! handshake quotas, the one that proved least gives way), refused from
//! other hosts without a secret (protected mode), and answered nothing
//! else before it is done.
//!
//! A peer's QP group lives exactly as long as its side-channel socket:
//! when the peer closes it (endpoint destroyed, process killed), the QPs
//! are moved to ERROR and destroyed here.
//!
//! A connection whose first request is a notification is a notification
//! channel (rule 11; it holds no QPs): the server offers each notification
//! to the transport's inbox and answers it (`notify_ack`, or `busy` when
//! the inbox is full). A malformed one, or any other request, is answered
//! with an error and the channel is closed. Notification channels are
//! bounded by `max_passive` (separately from QP groups).

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use transport_control::admission::{refusal_label, Admit, Proven, Slot};
use transport_core::{Error, ErrorKind, Refused, Result};

use crate::config::MAX_QPS_PER_GROUP;
use crate::greet;
use crate::handshake::{Half, QpGroup};
use crate::state::{Inner, PassiveConn, PeerGroupId, State, Task};
use crate::wire::{self, Reply, Request};

/// Pause after a failed `accept` (out of descriptors, ...).
const ACCEPT_RETRY: Duration = Duration::from_millis(10);
/// Bytes read at a time while holding a peer's QPs (the peer sends nothing
/// more; anything it does send is ignored).
const HOLD_BUF: usize = 256;
/// How long a refused connection is given to take its answer.
const REFUSE_WAIT: Duration = Duration::from_secs(1);
/// Refused connections answered at once (past that, best effort).
const MAX_REFUSING: usize = 64;
/// `describe` requests one connection may make (each may be followed by
/// another request): the initiator makes one, then connects its QP group
/// over the same connection or closes it.
const MAX_DESCRIBES: usize = 4;

pub(crate) async fn listen(weak: Weak<Inner>, listener: TcpListener) {
    loop {
        let (sock, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!("side channel accept failed: {e}");
                tokio::time::sleep(ACCEPT_RETRY).await;
                continue;
            }
        };
        let Some(inner) = weak.upgrade() else { return };
        let ip = peer.ip().to_canonical();
        let here = sock.local_addr().map_or(ip, |a| a.ip());
        if let Err(why) = inner.exposure.admits(ip, here) {
            tracing::warn!(%peer, "side channel: refused: {why}");
            metrics::counter!("kvmove_rdma_side_channel_refused_total", "reason" => "protected_mode").increment(1);
            refuse(&inner, sock, Reply::Denied { message: why.into() });
            continue;
        }
        let proven = if greet::hello_waiting(&sock) { Proven::Hello } else { Proven::Nothing };
        let stop = inner.with_state(|st, _| {
            if st.shutdown {
                return true;
            }
            let id = st.new_peer_id();
            let (slot, evicted) = {
                let mut c = inner.admission.lock();
                match c.admits(&inner.cfg.limits(), ip) {
                    Admit::Yes => (Slot::handshaking(&inner.admission, &mut c, ip, id.0), None),
                    Admit::Evict(old) => {
                        let signal = c.evict_signals.remove(&old);
                        (Slot::handshaking(&inner.admission, &mut c, ip, id.0), signal)
                    }
                    Admit::No(why) => {
                        drop(c);
                        tracing::warn!(%peer, reason = why, "side channel: refused (answered busy)");
                        metrics::counter!("kvmove_rdma_side_channel_refused_total", "reason" => refusal_label(why))
                            .increment(1);
                        refuse(&inner, sock, Reply::Busy);
                        return false;
                    }
                }
            };
            // Its hello came with the connection: silent ones give way
            // before it from the start.
            if proven == Proven::Hello && slot.proved(&inner.cfg.limits(), proven) {
                metrics::counter!("kvmove_rdma_side_channel_refused_total", "reason" => "evicted_handshake")
                    .increment(1);
            }
            if let Some(signal) = evicted {
                // Uncounted already; told so, it answers busy and closes.
                signal.notify_one();
                metrics::counter!("kvmove_rdma_side_channel_refused_total", "reason" => "evicted_handshake")
                    .increment(1);
            }
            let w = weak.clone();
            let task = Task::spawn(&inner.tasks, async move {
                serve(&w, id, sock, slot, ip).await;
                if let Some(inner) = w.upgrade() {
                    inner.with_state(|st, g| {
                        if let Some(me) = st.passive_tasks.remove(&id) {
                            me.ending();
                        }
                        if let Some(p) = st.passive.remove(&id) {
                            g.passive.push(p);
                        }
                    });
                }
            });
            st.passive_tasks.insert(id, task);
            false
        });
        if stop {
            return;
        }
    }
}

/// Answers a refused connection (`reply`: busy, or denied by protected
/// mode) and closes it: the line, a FIN, then what the peer sends (its
/// hello) is read and dropped until it closes, so the close does not reset
/// the connection and discard the answer; within [`REFUSE_WAIT`], for at
/// most [`MAX_REFUSING`] connections at once (past that, best effort).
fn refuse(inner: &Arc<Inner>, mut sock: TcpStream, reply: Reply) {
    let mut line = serde_json::to_vec(&reply).unwrap_or_default();
    line.push(b'\n');
    if inner.refusing.fetch_add(1, Ordering::SeqCst) >= MAX_REFUSING {
        inner.refusing.fetch_sub(1, Ordering::SeqCst);
        let _ = sock.try_write(&line);
        return;
    }
    let w = inner.weak();
    // Counted in the transport's tasks; it ends by itself within
    // `REFUSE_WAIT`.
    let _detached = inner.tasks.spawn(async move {
        let _ = tokio::time::timeout(REFUSE_WAIT, async {
            sock.write_all(&line).await?;
            sock.shutdown().await?;
            let mut sink = [0u8; HOLD_BUF];
            while sock.read(&mut sink).await? != 0 {}
            Ok::<_, std::io::Error>(())
        })
        .await;
        if let Some(inner) = w.upgrade() {
            inner.refusing.fetch_sub(1, Ordering::SeqCst);
        }
    });
}

async fn serve(weak: &Weak<Inner>, id: PeerGroupId, sock: TcpStream, mut slot: Slot, ip: std::net::IpAddr) {
    let _ = sock.set_nodelay(true);
    let mut sock = BufReader::new(sock);
    let (timeout, secret, limits) = match weak.upgrade() {
        Some(i) => (i.cfg.handshake_timeout(), i.cfg.secret.clone(), i.cfg.limits()),
        None => return,
    };
    // The handshake first (nothing is answered before it), bounded by
    // `handshake_timeout`, given up for a newcomer when the quota is full.
    let evicted = slot.evicted.clone();
    let greeted = tokio::select! {
        r = tokio::time::timeout(timeout, greet::answer(&mut sock, secret.as_deref(), &mut slot, &limits)) => r,
        () = evicted.notified() => {
            let _ = tokio::time::timeout(REFUSE_WAIT, wire::send(sock.get_mut(), &Reply::Busy)).await;
            return;
        }
    };
    match greeted {
        Ok(Ok(())) => {}
        Ok(Err(greet::Refused(why))) => {
            tracing::info!(reason = %why, "side channel: handshake refused");
            return;
        }
        Err(_) => {
            tracing::info!("side channel: handshake timed out");
            return;
        }
    }
    // A `describe` leaves the connection open for one more request, at
    // most `handshake_timeout` away (the initiator's first endpoint then
    // connects its QP group over it, without a second TCP connection and
    // handshake: `handshake::connect`); anything else is the last request.
    let mut describes = 0;
    let reply = loop {
        let req = match tokio::time::timeout(timeout, wire::recv::<_, Request>(&mut sock)).await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                let _ = wire::send(sock.get_mut(), &Reply::Error { message: e.to_string() }).await;
                return;
            }
            Err(_) => return,
        };
        let Some(inner) = weak.upgrade() else { return };
        break match req {
            Request::Describe => {
                describes += 1;
                let reply = Reply::Descriptor { descriptor: inner.descriptor() };
                drop(inner);
                if wire::send(sock.get_mut(), &reply).await.is_err() || describes >= MAX_DESCRIBES {
                    return;
                }
                continue;
            }
            Request::Connect { gid, lid, mtu, qps } => {
                // QP bring-up blocks its thread (see `handshake`): off the
                // runtime. Aborted meanwhile (shutdown), it still ends,
                // and `accept` keeps nothing once shut down.
                let theirs = Half { gid, lid, mtu, qps };
                match crate::handshake::off_runtime(move || accept(&inner, id, &theirs, ip)).await {
                    Ok(Ok(r)) => r,
                    Ok(Err(e)) | Err(e) => Reply::Error { message: e.to_string() },
                }
            }
            first @ (Request::Notify { .. } | Request::Stage { .. } | Request::Unstage { .. }) => {
                drop(inner);
                notes(weak, id, sock, timeout, first, ip).await;
                // Its staging buffers come back with the channel.
                if let Some(inner) = weak.upgrade() {
                    inner.drop_leases(id);
                }
                return;
            }
            Request::Hello { .. } | Request::Auth { .. } => {
                Reply::Error { message: "the handshake is over: a request was expected".into() }
            }
        };
    };
    let connected = matches!(reply, Reply::Connected { .. });
    if wire::send(sock.get_mut(), &reply).await.is_err() || !connected {
        return;
    }
    // Hold the QPs until the peer closes the channel (or dies).
    let mut buf = [0u8; HOLD_BUF];
    loop {
        match sock.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

/// A notification channel (rule 11), opened by its first request
/// (`first`): each notification is decoded (bounded), offered to the inbox
/// and answered, each staging request served (leases held by `chan`), in
/// order, until the peer closes the channel. A malformed one or any other
/// request is answered with an error and closes it.
async fn notes(
    weak: &Weak<Inner>,
    chan: PeerGroupId,
    mut sock: BufReader<TcpStream>,
    timeout: Duration,
    first: Request,
    ip: std::net::IpAddr,
) {
    let _place = {
        let Some(inner) = weak.upgrade() else { return };
        match NotesPlace::take(&inner, ip) {
            Ok(p) => p,
            Err(e) => {
                let _ = wire::send(sock.get_mut(), &Reply::bounded_error(&e)).await;
                return;
            }
        }
    };
    let mut req = first;
    loop {
        let reply = match req {
            Request::Notify { from, msg } => match wire::decode_notify(from, &msg) {
                Ok(n) => {
                    let Some(inner) = weak.upgrade() else { return };
                    match inner.inbox.offer(n) {
                        Ok(()) => Reply::NotifyAck,
                        Err(Refused::Full) => Reply::Busy,
                        // Shutting down: the channel closes unanswered (the
                        // sender sees a transient reset).
                        Err(Refused::Closed) => return,
                    }
                }
                Err(e) => {
                    let _ = wire::send(sock.get_mut(), &Reply::bounded_error(&e)).await;
                    return;
                }
            },
            Request::Stage { write, addr, len } => {
                let Some(inner) = weak.upgrade() else { return };
                inner.stage(chan, write, addr, len).await
            }
            Request::Unstage { slot, commit } => {
                let Some(inner) = weak.upgrade() else { return };
                match inner.unstage(chan, slot, commit).await {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = wire::send(sock.get_mut(), &Reply::bounded_error(&e)).await;
                        return;
                    }
                }
            }
            _ => {
                let e = Error::new(ErrorKind::Protocol, "only notifications and staging requests are accepted here");
                let _ = wire::send(sock.get_mut(), &Reply::bounded_error(&e)).await;
                return;
            }
        };
        // A peer that does not read its answers loses the channel.
        match tokio::time::timeout(timeout, wire::send(sock.get_mut(), &reply)).await {
            Ok(Ok(())) => {}
            _ => return,
        }
        req = match wire::recv_limited::<_, Request>(&mut sock, wire::MAX_NOTE_LINE).await {
            Ok(r) => r,
            Err(e) if e.kind() == ErrorKind::Protocol => {
                let _ = wire::send(sock.get_mut(), &Reply::bounded_error(&e)).await;
                return;
            }
            Err(_) => return, // closed, or the socket failed
        };
    }
}

/// A place under `max_passive` (and `max_passive_per_ip` for its
/// address) taken by a peer's notification channel, given back when its
/// serving task ends (or is aborted).
struct NotesPlace {
    inner: Weak<Inner>,
    ip: std::net::IpAddr,
}

impl NotesPlace {
    fn take(inner: &Arc<Inner>, ip: std::net::IpAddr) -> Result<Self> {
        let mut st = inner.state.lock();
        let here = st.notes_by_ip.get(&ip).copied().unwrap_or(0);
        if st.passive_notes >= inner.cfg.max_passive || here >= inner.cfg.max_passive_per_ip {
            let (n, what) = if here >= inner.cfg.max_passive_per_ip {
                (inner.cfg.max_passive_per_ip, "from this address")
            } else {
                (inner.cfg.max_passive, "in all")
            };
            return Err(Error::new(
                ErrorKind::ResourceExhausted,
                format!("notification channels at their limit ({n} {what})"),
            ));
        }
        st.passive_notes += 1;
        *st.notes_by_ip.entry(ip).or_default() += 1;
        Ok(Self { inner: inner.weak(), ip })
    }
}

impl Drop for NotesPlace {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.upgrade() {
            let mut st = inner.state.lock();
            st.passive_notes = st.passive_notes.saturating_sub(1);
            uncount(&mut st.notes_by_ip, self.ip);
        }
    }
}

/// One place of `ip` given back in a per-address count.
fn uncount(by_ip: &mut std::collections::HashMap<std::net::IpAddr, usize>, ip: std::net::IpAddr) {
    if let std::collections::hash_map::Entry::Occupied(mut e) = by_ip.entry(ip) {
        *e.get_mut() = e.get().saturating_sub(1);
        if *e.get() == 0 {
            e.remove();
        }
    }
}

fn accept(inner: &Arc<Inner>, id: PeerGroupId, theirs: &Half, ip: std::net::IpAddr) -> Result<Reply> {
    let n = theirs.qps.len();
    if n == 0 || n > MAX_QPS_PER_GROUP {
        return Err(Error::new(ErrorKind::HandshakeFailed, format!("{n} QPs requested (1..={MAX_QPS_PER_GROUP})")));
    }
    inner.link_usable()?;
    // The place is taken under the lock before the QPs are created, so
    // concurrent connects never hold more than `max_passive` groups.
    let place = PassivePlace::take(inner, ip)?;
    let v = inner.verbs()?;
    let group = QpGroup::new(&v, n, inner.lim.max_outstanding_per_qp)?;
    let mtu = group.connect(&v, theirs, inner.timing())?;
    let mine = group.hello(&v, mtu);
    let descriptor = inner.descriptor();
    let mut st = inner.state.lock();
    place.fill(&mut st);
    if st.shutdown {
        return Err(Error::shut_down());
    }
    let created = group.created;
    st.passive.insert(id, PassiveConn { qps: group.into_qps(), created, ip });
    Ok(Reply::Connected { gid: mine.gid, lid: mine.lid, mtu: mine.mtu, qps: mine.qps, descriptor })
}

/// A place under `max_passive` (and `max_passive_per_ip` for its
/// address) taken for a peer group being built: given back on drop unless
/// [`PassivePlace::fill`] turned it into the group.
struct PassivePlace<'a> {
    inner: &'a Inner,
    ip: std::net::IpAddr,
    held: bool,
}

impl<'a> PassivePlace<'a> {
    fn take(inner: &'a Inner, ip: std::net::IpAddr) -> Result<Self> {
        let mut st = inner.state.lock();
        // At most `max_passive` groups: counting those of one address is a
        // walk over at most that many.
        let here =
            st.passive.values().filter(|p| p.ip == ip).count() + st.building_by_ip.get(&ip).copied().unwrap_or(0);
        if here >= inner.cfg.max_passive_per_ip {
            return Err(Error::new(
                ErrorKind::ResourceExhausted,
                format!("peer QP groups at their limit ({} from this address)", inner.cfg.max_passive_per_ip),
            ));
        }
        if st.passive.len() + st.passive_building >= inner.cfg.max_passive {
            return Err(Error::new(
                ErrorKind::ResourceExhausted,
                format!("peer QP groups at their limit ({})", inner.cfg.max_passive),
            ));
        }
        st.passive_building += 1;
        *st.building_by_ip.entry(ip).or_default() += 1;
        Ok(Self { inner, ip, held: true })
    }

    /// The group is stored (or dropped) under the lock held as `st`: the
    /// place becomes its entry in `State::passive`.
    fn fill(mut self, st: &mut State) {
        st.passive_building = st.passive_building.saturating_sub(1);
        uncount(&mut st.building_by_ip, self.ip);
        self.held = false;
    }
}

impl Drop for PassivePlace<'_> {
    fn drop(&mut self) {
        if self.held {
            let mut st = self.inner.state.lock();
            st.passive_building = st.passive_building.saturating_sub(1);
            uncount(&mut st.building_by_ip, self.ip);
        }
    }
}
