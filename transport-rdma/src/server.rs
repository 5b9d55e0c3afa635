//! The passive side: serves descriptors and accepts QP groups from peers
//! (with the same [`QpGroup`] bring-up the connecting side uses).
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

use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::io::{AsyncReadExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use transport_core::{Error, ErrorKind, Refused, Result};

use crate::config::MAX_QPS_PER_GROUP;
use crate::handshake::{Half, QpGroup};
use crate::state::{Inner, PassiveConn, PeerGroupId, State, Task};
use crate::wire::{self, Reply, Request};

/// Pause after a failed `accept` (out of descriptors, ...).
const ACCEPT_RETRY: Duration = Duration::from_millis(10);
/// Bytes read at a time while holding a peer's QPs (the peer sends nothing
/// more; anything it does send is ignored).
const HOLD_BUF: usize = 256;

pub(crate) async fn listen(weak: Weak<Inner>, listener: TcpListener) {
    loop {
        let (sock, _) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!("side channel accept failed: {e}");
                tokio::time::sleep(ACCEPT_RETRY).await;
                continue;
            }
        };
        let Some(inner) = weak.upgrade() else { return };
        let stop = inner.with_state(|st, _| {
            if st.shutdown {
                return true;
            }
            let id = st.new_peer_id();
            let w = weak.clone();
            let task = Task::spawn(&inner.tasks, async move {
                serve(&w, id, sock).await;
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

async fn serve(weak: &Weak<Inner>, id: PeerGroupId, sock: TcpStream) {
    let _ = sock.set_nodelay(true);
    let mut sock = BufReader::new(sock);
    let timeout = match weak.upgrade() {
        Some(i) => i.cfg.handshake_timeout(),
        None => return,
    };
    let req = match tokio::time::timeout(timeout, wire::recv::<_, Request>(&mut sock)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            let _ = wire::send(sock.get_mut(), &Reply::Error { message: e.to_string() }).await;
            return;
        }
        Err(_) => return,
    };
    let reply = match weak.upgrade() {
        Some(inner) => match req {
            Request::Describe => Reply::Descriptor { descriptor: inner.descriptor() },
            Request::Connect { gid, lid, mtu, qps } => {
                // QP bring-up blocks its thread (see `handshake`): off the
                // runtime. Aborted meanwhile (shutdown), it still ends,
                // and `accept` keeps nothing once shut down.
                let theirs = Half { gid, lid, mtu, qps };
                match crate::handshake::off_runtime(move || accept(&inner, id, &theirs)).await {
                    Ok(Ok(r)) => r,
                    Ok(Err(e)) | Err(e) => Reply::Error { message: e.to_string() },
                }
            }
            first @ (Request::Notify { .. } | Request::Stage { .. } | Request::Unstage { .. }) => {
                drop(inner);
                notes(weak, id, sock, timeout, first).await;
                // Its staging buffers come back with the channel.
                if let Some(inner) = weak.upgrade() {
                    inner.drop_leases(id);
                }
                return;
            }
        },
        None => return,
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
) {
    let _place = {
        let Some(inner) = weak.upgrade() else { return };
        match NotesPlace::take(&inner) {
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

/// A place under `max_passive` taken by a peer's notification channel,
/// given back when its serving task ends (or is aborted).
struct NotesPlace {
    inner: Weak<Inner>,
}

impl NotesPlace {
    fn take(inner: &Arc<Inner>) -> Result<Self> {
        let mut st = inner.state.lock();
        if st.passive_notes >= inner.cfg.max_passive {
            return Err(Error::new(
                ErrorKind::ResourceExhausted,
                format!("notification channels at their limit ({})", inner.cfg.max_passive),
            ));
        }
        st.passive_notes += 1;
        Ok(Self { inner: inner.weak() })
    }
}

impl Drop for NotesPlace {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.upgrade() {
            let mut st = inner.state.lock();
            st.passive_notes = st.passive_notes.saturating_sub(1);
        }
    }
}

fn accept(inner: &Arc<Inner>, id: PeerGroupId, theirs: &Half) -> Result<Reply> {
    let n = theirs.qps.len();
    if n == 0 || n > MAX_QPS_PER_GROUP {
        return Err(Error::new(ErrorKind::HandshakeFailed, format!("{n} QPs requested (1..={MAX_QPS_PER_GROUP})")));
    }
    inner.link_usable()?;
    // The place is taken under the lock before the QPs are created, so
    // concurrent connects never hold more than `max_passive` groups.
    let place = PassivePlace::take(inner)?;
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
    st.passive.insert(id, PassiveConn { qps: group.into_qps(), created });
    Ok(Reply::Connected { gid: mine.gid, lid: mine.lid, mtu: mine.mtu, qps: mine.qps, descriptor })
}

/// A place under `max_passive` taken for a peer group being built: given
/// back on drop unless [`PassivePlace::fill`] turned it into the group.
struct PassivePlace<'a> {
    inner: &'a Inner,
    held: bool,
}

impl<'a> PassivePlace<'a> {
    fn take(inner: &'a Inner) -> Result<Self> {
        let mut st = inner.state.lock();
        if st.passive.len() + st.passive_building >= inner.cfg.max_passive {
            return Err(Error::new(
                ErrorKind::ResourceExhausted,
                format!("peer QP groups at their limit ({})", inner.cfg.max_passive),
            ));
        }
        st.passive_building += 1;
        Ok(Self { inner, held: true })
    }

    /// The group is stored (or dropped) under the lock held as `st`: the
    /// place becomes its entry in `State::passive`.
    fn fill(mut self, st: &mut State) {
        st.passive_building = st.passive_building.saturating_sub(1);
        self.held = false;
    }
}

impl Drop for PassivePlace<'_> {
    fn drop(&mut self) {
        if self.held {
            let mut st = self.inner.state.lock();
            st.passive_building = st.passive_building.saturating_sub(1);
        }
    }
}
