//! Notifications (rule 11), the sending side: each segment handle that
//! notifies opens one *notification channel* to the peer's side-channel
//! listener, a TCP connection that holds no QPs (so notifications, like the
//! TCP backend's, need neither an endpoint place nor an active RDMA link:
//! a session's messages keep flowing while a link is cut and its QPs are
//! rebuilt). Its carrier task is the one reader and writer of the socket:
//! it sends what [`Inner::notify`] hands it (at most [`MAX_PIPELINE`]
//! unanswered; the peer answers in order) and hands each answer back. A
//! channel that fails is dropped by its carrier at once and never used
//! again (rule 2); the next notification opens a new one. Closing the
//! handle, shutdown and the idle reaper drop it (rules 3, 4).
//!
//! The message leaves only when `notify` is called: `notify_after` is the
//! trait's, which calls it once the batch completed (see the crate docs
//! for why every byte has landed by then).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use tokio::io::BufReader;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use transport_core::{check_notification, inbox_full, Error, ErrorKind, Result, SegmentId};

use crate::state::{Inner, NoteChannel, Task};
use crate::wire::Ask;
use crate::wire::{self, Reply, Request};

/// Notifications a carrier has sent and not yet seen answered; more wait
/// in its queue.
const MAX_PIPELINE: usize = 16;
/// Notifications queued for one carrier before `notify` waits (within its
/// time limit) for room.
const ASK_QUEUE: usize = 64;

/// Counts one notification in flight on a channel until dropped.
struct InFlight(Arc<AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn channel_gone() -> Error {
    Error::new(ErrorKind::ConnectionReset, "the notification channel closed before the peer answered")
}

fn peer_closed() -> Error {
    Error::new(ErrorKind::ConnectionReset, "the peer closed the notification channel (crashed or shut down)")
}

impl Inner {
    /// Sends notification `msg` to the peer of `seg` (rule 11) over the
    /// handle's notification channel (opened if there is none), and waits
    /// for the peer's answer: `Ok` once the message is in its inbox,
    /// `Backpressure` when the inbox is full. Opening and the answer are
    /// each bounded by `handshake_timeout_ms`.
    pub(crate) async fn notify(&self, seg: SegmentId, msg: Vec<u8>) -> Result<()> {
        if self.state.lock().shutdown {
            return Err(Error::shut_down());
        }
        check_notification(&msg)?;
        let request = wire::notify_request(&self.name, &msg)?;
        match self.ask(seg, request, "notification").await? {
            Reply::NotifyAck => Ok(()),
            Reply::Busy => Err(inbox_full()),
            _ => Err(Error::new(ErrorKind::Protocol, "the peer answered a notification with another reply")),
        }
    }

    /// Sends `request` on the notification channel of `seg` (opened if
    /// there is none) and waits for the peer's answer, each bounded by
    /// `handshake_timeout_ms`. An `error` answer is an error (the channel
    /// is then closed); the others are the caller's to read.
    pub(crate) async fn ask(&self, seg: SegmentId, request: Request, what: &str) -> Result<Reply> {
        let limit = self.cfg.handshake_timeout();
        let (side, inflight, name) = self.channel(seg, limit).await?;
        inflight.fetch_add(1, Ordering::SeqCst);
        let _counted = InFlight(inflight);
        let (answer, answered) = oneshot::channel();
        let exchange = async {
            side.send(Ask { request, answer }).await.map_err(|_| channel_gone())?;
            answered.await.map_err(|_| channel_gone())?
        };
        match tokio::time::timeout(limit, exchange).await {
            Ok(r) => r.map_err(|e| e.with("segment", &name)),
            Err(_) => Err(Error::new(
                ErrorKind::Timeout,
                format!(
                    "the peer did not answer the {what} within handshake_timeout_ms (it may or may not have been done)"
                ),
            )
            .with("segment", &name)),
        }
    }

    /// The live notification channel of `seg` (its sender, its in-flight
    /// count, the peer's name), opened if there is none.
    async fn channel(&self, seg: SegmentId, limit: Duration) -> Result<(mpsc::Sender<Ask>, Arc<AtomicUsize>, String)> {
        let live = |inner: &Inner| {
            let mut st = inner.state.lock();
            if st.shutdown {
                return Err(Error::shut_down());
            }
            if st.device_failed {
                return Err(crate::state::device_failed(&inner.device));
            }
            let s = st.segments.get_mut(&seg).ok_or_else(|| Error::unknown_segment(seg))?;
            let name = s.desc.name.clone();
            Ok(match s.notes.as_mut().filter(|n| !n.side.is_closed()) {
                Some(n) => {
                    n.last_used = Instant::now();
                    Ok((n.side.clone(), n.inflight.clone(), name))
                }
                None => Err((s.notes_lock.clone(), name)),
            })
        };
        let (lock, name) = match live(self)? {
            Ok(found) => return Ok(found),
            Err(open) => open,
        };
        // One bound for all of it: waiting while another caller opens the
        // channel, connecting, the handshake. Without it, callers queued
        // behind an attempt that stalls (a peer frozen, or its traffic
        // stalled; the staged slices of a batch ask at once) each made
        // their own attempt in turn after it, a multiple of the bound.
        // Dropped at the bound, the attempt drops its socket and the lock;
        // nothing was recorded yet.
        let label = name.clone();
        let open = async {
            let _opening = lock.lock().await;
            // Another caller may have opened it meanwhile.
            if let Ok(found) = live(self)? {
                return Ok(found);
            }
            let stream = match tokio::time::timeout(limit, TcpStream::connect(&name)).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => return Err(Error::from(e).with("segment", &name)),
                Err(_) => {
                    return Err(Error::new(
                        ErrorKind::ConnectionRefused,
                        "connecting the notification channel timed out",
                    )
                    .with("segment", &name))
                }
            };
            stream.set_nodelay(true)?;
            let mut stream = BufReader::new(stream);
            match tokio::time::timeout(limit, crate::greet::hello(&mut stream, self.cfg.secret.as_deref(), &name, None))
                .await
            {
                Ok(r) => r?,
                Err(_) => {
                    return Err(Error::new(
                        ErrorKind::HandshakeFailed,
                        "the notification channel's handshake timed out",
                    )
                    .with("segment", &name))
                }
            }
            let (side, asks) = mpsc::channel(ASK_QUEUE);
            let inflight = Arc::new(AtomicUsize::new(0));
            let mut st = self.state.lock();
            if st.shutdown {
                return Err(Error::shut_down());
            }
            let id = st.new_note_id();
            // Closed meanwhile: the stream is dropped (closed) here.
            let s = st.segments.get_mut(&seg).ok_or_else(|| Error::unknown_segment(seg))?;
            let carrier = Task::spawn(&self.tasks, carry(self.weak(), seg, id, stream, asks, limit));
            s.notes = Some(NoteChannel {
                id,
                side: side.clone(),
                carrier: Some(carrier),
                last_used: Instant::now(),
                inflight: inflight.clone(),
            });
            Ok((side, inflight, name))
        };
        match tokio::time::timeout(limit, open).await {
            Ok(r) => r,
            Err(_) => Err(Error::new(
                ErrorKind::ConnectionRefused,
                "the notification channel was not open within handshake_timeout_ms (another caller's attempt, \
                 the connect and the handshake together)",
            )
            .with("segment", &label)),
        }
    }
}

/// The carrier of notification channel `id` of segment handle `seg`: sends
/// the notifications asked for on `asks` and hands each answer to its
/// asker. It ends, and drops the channel (rule 2), when the channel fails:
/// the peer closed it, sent junk, an error or an answer nobody asked for,
/// or a write failed or stalled past `limit`. Askers still waiting then get
/// the error (transient).
async fn carry(
    weak: Weak<Inner>,
    seg: SegmentId,
    id: u64,
    stream: BufReader<TcpStream>,
    mut asks: mpsc::Receiver<Ask>,
    limit: Duration,
) {
    let mut lines = wire::Lines::new(stream, wire::MAX_NOTE_LINE);
    let mut waiting: VecDeque<oneshot::Sender<Result<Reply>>> = VecDeque::new();
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
                    break Error::new(ErrorKind::Protocol, "the peer sent an unasked-for message on the notification channel");
                };
                let e = match reply {
                    Reply::Staged { slot, .. } => {
                        if answer.send(Ok(reply)).is_err() {
                            // Its asker gave up (timed out) before the
                            // peer leased the buffer: nobody will use or
                            // give it back, so the carrier does, or the
                            // channel would hold it until it closes.
                            let (dropped, _) = oneshot::channel();
                            let back = Request::Unstage { slot, commit: false };
                            match tokio::time::timeout(limit, wire::send(lines.get_mut(), &back)).await {
                                Ok(Ok(())) => waiting.push_back(dropped),
                                _ => break Error::new(ErrorKind::ConnectionReset, "notification channel write failed"),
                            }
                        }
                        continue;
                    }
                    Reply::NotifyAck
                    | Reply::Busy
                    | Reply::Unstaged
                    | Reply::StageFailed { .. } => {
                        let _ = answer.send(Ok(reply));
                        continue;
                    }
                    Reply::Error { message } => {
                        Error::new(ErrorKind::Protocol, format!("the peer refused a request on the notification channel: {message}"))
                    }
                    _ => Error::new(ErrorKind::Protocol, "the peer answered on the notification channel with another reply"),
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
                let e = match tokio::time::timeout(limit, wire::send(lines.get_mut(), &ask.request)).await {
                    Ok(Ok(())) => {
                        waiting.push_back(ask.answer);
                        continue;
                    }
                    Ok(Err(e)) => {
                        Error::new(ErrorKind::ConnectionReset, format!("notification channel write failed: {e}"))
                    }
                    Err(_) => Error::new(
                        ErrorKind::ConnectionReset,
                        "notification channel write stalled past handshake_timeout_ms",
                    ),
                };
                let _ = ask.answer.send(Err(e.clone()));
                break e;
            }
        }
    };
    // Never used again: later notifications open a new channel.
    asks.close();
    for answer in waiting {
        let _ = answer.send(Err(why.clone()));
    }
    while let Ok(ask) = asks.try_recv() {
        let _ = ask.answer.send(Err(why.clone()));
    }
    let Some(inner) = weak.upgrade() else { return };
    let mut st = inner.state.lock();
    if let Some(s) = st.segments.get_mut(&seg) {
        if s.notes.as_ref().is_some_and(|n| n.id == id) {
            if let Some(me) = s.notes.take().and_then(|mut n| n.carrier.take()) {
                me.ending();
            }
        }
    }
}
