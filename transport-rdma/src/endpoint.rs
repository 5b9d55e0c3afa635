//! Endpoints to opened segments, through the lifecycle core's
//! [`EndpointPool`]: the bound on endpoints with LRU eviction of idle ones
//! (rule 4), a place reserved before the QPs are created and given back
//! only after they are destroyed ([`Inner::with_state`]).
//!
//! [`EndpointPool`]: transport_core::lifecycle::EndpointPool

use std::collections::VecDeque;
use std::sync::Weak;
use std::time::{Duration, Instant};

use tokio::io::BufReader;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use transport_core::lifecycle::{Acquire, EndpointId};
use transport_core::{check_notification, inbox_full, Error, ErrorKind, Result, SegmentId};

use crate::handshake::{self, QpGroup};
use crate::state::{Endpoint, Inner, QpSlot, Task};
use crate::verbs::QpTiming;
use crate::wire::{self, Reply, Request};

/// How long a caller waits before asking the pool again when every place
/// is busy or waits for its QPs to be destroyed.
const FULL_RETRY: Duration = Duration::from_millis(1);
/// Notifications a watcher has sent and not yet seen answered; more wait
/// in its queue.
const MAX_PIPELINE: usize = 16;
/// Notifications queued for one endpoint's watcher before `notify` waits
/// (within its time limit) for room.
const ASK_QUEUE: usize = 64;

/// A notification for an endpoint's watcher to send, and where its
/// answer goes (`Ok` once it is in the peer's inbox).
#[derive(Debug)]
pub(crate) struct Ask {
    request: Request,
    answer: oneshot::Sender<Result<()>>,
}

/// One use of an endpoint held by `notify` (keeps it from idle reclaim and
/// eviction while the message is on its way), given back on drop.
struct Use<'a> {
    inner: &'a Inner,
    ep: EndpointId,
}

impl Drop for Use<'_> {
    fn drop(&mut self) {
        let mut st = self.inner.state.lock();
        let now = st.now();
        st.pool.release(self.ep, now);
    }
}

fn side_channel_gone() -> Error {
    Error::new(ErrorKind::ConnectionReset, "the endpoint's side channel closed before the peer answered")
}

fn peer_closed() -> Error {
    Error::new(ErrorKind::ConnectionReset, "the peer closed the side channel (crashed or shut down)")
}

/// A place the pool reserved for a build: given back on drop unless the
/// build settled it (`id` taken).
struct Reservation<'a> {
    inner: &'a Inner,
    id: Option<EndpointId>,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            self.inner.with_state(|st, _| st.pool.build_failed(id));
        }
    }
}

/// What the pool said, after the driver did its part under the lock.
enum Step {
    Ready(EndpointId),
    Build(EndpointId, String),
    Again,
    Wait,
}

impl Inner {
    pub(crate) fn timing(&self) -> QpTiming {
        QpTiming { timeout: self.cfg.ack_timeout, retry_cnt: self.cfg.retry_count }
    }

    /// The live endpoint of `seg`, with one use of it counted in the pool
    /// for the caller (which keeps it from eviction and idle reclaim until
    /// the caller queues work on it or gives the use back): builds one if
    /// needed. The bool says the peer restarted (its generation changed)
    /// since the handle's descriptor was read; the descriptor has been
    /// refreshed.
    pub(crate) async fn endpoint(&self, seg: SegmentId) -> Result<(EndpointId, bool)> {
        let lock = self.with_state(|st, _| {
            if st.shutdown {
                return Err(Error::shut_down());
            }
            let s = st.segments.get(&seg).ok_or_else(|| Error::unknown_segment(seg))?;
            let lock = s.connect_lock.clone();
            let now = st.now();
            match st.pool.live(&seg) {
                Some(id) if st.pool.use_again(id, now) => Ok(Err(id)),
                _ => Ok(Ok(lock)),
            }
        })?;
        let lock = match lock {
            Ok(lock) => lock,
            Err(id) => return Ok((id, false)),
        };
        let _guard = lock.lock().await;
        let start = Instant::now();
        let (id, name) = loop {
            let step = self.with_state(|st, g| {
                if st.shutdown {
                    return Err(Error::shut_down());
                }
                let name = st.segments.get(&seg).ok_or_else(|| Error::unknown_segment(seg))?.desc.name.clone();
                // Flushed broken endpoints give their places back once
                // destroyed (when this closure's graveyard is emptied).
                st.reap(&self.lim, false, g);
                let now = st.now();
                Ok(match st.pool.acquire(&seg, now) {
                    Acquire::Use(id) => Step::Ready(id),
                    Acquire::Build(id) => Step::Build(id, name),
                    Acquire::Evict(id) => {
                        st.destroy_endpoint_now(id, g);
                        Step::Again
                    }
                    // Busy endpoints go idle when their work completes,
                    // broken ones when they have flushed, dying ones when
                    // their QPs are destroyed: wait, bounded.
                    Acquire::Building(_) | Acquire::Full { .. } => Step::Wait,
                })
            })?;
            match step {
                Step::Ready(id) => return Ok((id, false)),
                Step::Build(id, name) => break (id, name),
                Step::Again => {}
                Step::Wait if start.elapsed() < self.cfg.handshake_timeout() => tokio::time::sleep(FULL_RETRY).await,
                Step::Wait => return Err(Error::endpoints_exhausted(seg, self.cfg.max_endpoints)),
            }
        };
        // Until the build is settled, the place goes back if this future
        // is dropped or the build fails (the QPs built so far are dropped
        // first, inside `build`).
        let mut reserved = Reservation { inner: self, id: Some(id) };
        self.link_usable()?;
        let (group, stream, peer) = self.build(&name).await?;
        reserved.id = None;
        let created = group.created;
        let (side, asks) = mpsc::channel(ASK_QUEUE);
        let mut ep = Endpoint {
            segment: seg,
            qps: group.into_qps().into_iter().map(|qp| QpSlot { qp, outstanding: 0 }).collect(),
            pending: Default::default(),
            next_qp: 0,
            busy: false,
            created,
            broken_at: None,
            watcher: None,
            side,
        };
        self.with_state(|st, g| {
            let now = st.now();
            if st.shutdown || !st.pool.built(id, now) {
                // Closed or shut down meanwhile: the pool retired it.
                g.endpoints.push((id, ep));
                return Err(if st.shutdown { Error::shut_down() } else { Error::unknown_segment(seg) });
            }
            let Some(s) = st.segments.get_mut(&seg) else {
                st.pool.broken(id);
                g.endpoints.push((id, ep));
                return Err(Error::unknown_segment(seg));
            };
            let restarted = peer.generation != s.desc.generation;
            s.desc = peer;
            let limit = self.cfg.handshake_timeout();
            ep.watcher = Some(Task::spawn(&self.tasks, watch(self.weak(), id, stream, asks, limit)));
            st.endpoints.insert(id, ep);
            Ok((id, restarted))
        })
    }

    /// Creates the QPs and connects them to the segment `name`.
    async fn build(&self, name: &str) -> Result<(QpGroup, BufReader<TcpStream>, transport_core::SegmentDescriptor)> {
        let v = self.verbs()?;
        let group = QpGroup::new(&v, self.cfg.qps_per_endpoint, self.lim.max_outstanding_per_qp)?;
        let (stream, desc) = handshake::connect(&v, &group, name, self.timing(), self.cfg.handshake_timeout()).await?;
        Ok((group, stream, desc))
    }

    /// Sends notification `msg` to the peer of `seg` (rule 11) over the
    /// side channel of the segment's endpoint (built as a transfer would
    /// build it), and waits (at most `handshake_timeout_ms`) for the peer's
    /// answer: `Ok` once the message is in its inbox, `Backpressure` when
    /// the inbox is full. The endpoint's watcher does the I/O.
    pub(crate) async fn notify(&self, seg: SegmentId, msg: Vec<u8>) -> Result<()> {
        if self.state.lock().shutdown {
            return Err(Error::shut_down());
        }
        check_notification(&msg)?;
        let request = wire::notify_request(&self.name, &msg)?;
        let limit = self.cfg.handshake_timeout();
        let (ep, restarted) = self.endpoint(seg).await?;
        let _use = Use { inner: self, ep };
        let (side, name) = {
            let st = self.state.lock();
            let name = st.segments.get(&seg).map(|s| s.desc.name.clone()).unwrap_or_default();
            if restarted {
                // As for a transfer: the handle's peer is gone; a message
                // meant for it is not handed to its successor.
                return Err(crate::submit::peer_restarted(seg));
            }
            (st.endpoints.get(&ep).filter(|e| e.broken_at.is_none()).map(|e| e.side.clone()), name)
        };
        let side = side.ok_or_else(|| {
            Error::new(ErrorKind::ConnectionReset, "the endpoint broke before the notification was sent")
                .with("segment", seg)
        })?;
        let (answer, answered) = oneshot::channel();
        let exchange = async {
            side.send(Ask { request, answer }).await.map_err(|_| side_channel_gone())?;
            answered.await.map_err(|_| side_channel_gone())?
        };
        match tokio::time::timeout(limit, exchange).await {
            Ok(r) => r.map_err(|e| e.with("segment", &name)),
            Err(_) => Err(Error::new(
                ErrorKind::Timeout,
                "the peer did not answer the notification within handshake_timeout_ms (it may or may not be delivered)",
            )
            .with("segment", &name)),
        }
    }
}

/// Whether endpoint `ep` still exists and is not broken.
fn usable(weak: &Weak<Inner>, ep: EndpointId) -> bool {
    weak.upgrade().is_some_and(|i| i.state.lock().endpoints.get(&ep).is_some_and(|e| e.broken_at.is_none()))
}

/// The one task that reads endpoint `ep`'s side channel. It sends the
/// notifications asked for on `asks` (at most [`MAX_PIPELINE`] unanswered;
/// the peer answers in order) and hands each answer to its asker; it breaks
/// the endpoint (rule 2) when the channel fails: the peer closed it (crash,
/// shutdown), sent junk, an error or an answer nobody asked for, or a write
/// failed or stalled past `limit`. Askers still waiting then get the error.
async fn watch(
    weak: Weak<Inner>,
    ep: EndpointId,
    stream: BufReader<TcpStream>,
    mut asks: mpsc::Receiver<Ask>,
    limit: Duration,
) {
    let mut lines = wire::Lines::new(stream, wire::MAX_HELD_LINE);
    let mut waiting: VecDeque<oneshot::Sender<Result<()>>> = VecDeque::new();
    let mut open = true;
    let why = loop {
        tokio::select! {
            got = lines.next::<Reply>() => {
                let reply = match got {
                    Ok(r) => r,
                    Err(e) if e.kind() == ErrorKind::Protocol => break e,
                    Err(_) => break peer_closed(),
                };
                let Some(answer) = waiting.pop_front() else {
                    break Error::new(ErrorKind::Protocol, "the peer sent an unasked-for message on the side channel");
                };
                let e = match reply {
                    Reply::NotifyAck => {
                        let _ = answer.send(Ok(()));
                        continue;
                    }
                    Reply::Busy => {
                        let _ = answer.send(Err(inbox_full()));
                        continue;
                    }
                    Reply::Error { message } => {
                        Error::new(ErrorKind::Protocol, format!("the peer refused the notification: {message}"))
                    }
                    _ => Error::new(ErrorKind::Protocol, "the peer answered a notification with another reply"),
                };
                let _ = answer.send(Err(e.clone()));
                break e;
            }
            ask = asks.recv(), if open && waiting.len() < MAX_PIPELINE => {
                let Some(ask) = ask else {
                    open = false;
                    continue;
                };
                if ask.answer.is_closed() {
                    continue; // its caller gave up: not sent
                }
                if !usable(&weak, ep) {
                    let e = Error::new(ErrorKind::ConnectionReset, "the endpoint broke before the notification was sent");
                    let _ = ask.answer.send(Err(e));
                    continue;
                }
                let e = match tokio::time::timeout(limit, wire::send(lines.get_mut(), &ask.request)).await {
                    Ok(Ok(())) => {
                        waiting.push_back(ask.answer);
                        continue;
                    }
                    Ok(Err(e)) => Error::new(ErrorKind::ConnectionReset, format!("side channel write failed: {e}")),
                    Err(_) => Error::new(ErrorKind::ConnectionReset, "side channel write stalled past handshake_timeout_ms"),
                };
                let _ = ask.answer.send(Err(e.clone()));
                break e;
            }
        }
    };
    for answer in waiting {
        let _ = answer.send(Err(why.clone()));
    }
    asks.close();
    while let Ok(ask) = asks.try_recv() {
        let _ = ask.answer.send(Err(why.clone()));
    }
    let Some(inner) = weak.upgrade() else { return };
    inner.with_state(|st, g| {
        if let Some(e) = st.endpoints.get_mut(&ep) {
            if let Some(me) = e.watcher.take() {
                me.ending();
            }
            st.break_endpoint(ep, why, g);
        }
    });
}
