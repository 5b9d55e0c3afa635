//! The background work of a transport: the CQ poller (and the CQ draining
//! that busy-polling waiters share with it), the reaper (flushed and idle
//! endpoints, kept side channels past their use), and the async events
//! (read on a thread of their own, applied on a task). All of it holds only
//! a weak reference to [`Inner`] and is counted in its
//! [`TaskSet`](transport_core::lifecycle::TaskSet).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};
use transport_core::{Error, ErrorKind};

use crate::state::{device_failed, link_down, Inner};
use crate::verbs::{AsyncEvent, CompChannel, Context, Cq, POLL_BATCH};

/// How long the async-event thread waits for an event before it checks
/// whether it should stop.
pub(crate) const EVENT_POLL: Duration = Duration::from_millis(100);
/// Consecutive read errors after which the async-event thread gives up.
const EVENT_ERRORS_MAX: u32 = 10;
/// The poller re-arms and drains the CQ at least this often, even if the
/// completion channel stays silent.
const POLLER_REARM: Duration = Duration::from_millis(50);
/// The poller's period when the completion channel cannot be polled.
const POLLER_FALLBACK: Duration = Duration::from_millis(1);
/// How long an error completion that a cut link also produces ("remote
/// invalid request": soft-RoCE answers a link going down with it) waits for
/// the port to be reported down before it is taken at its word. The NAK can
/// be read before the port state flips; without the wait a batch cut by a
/// link failure would end with a permanent error instead of the transient
/// link-down one. Only error completions wait, in steps of
/// [`LINK_SETTLE_STEP`].
const LINK_SETTLE: Duration = Duration::from_millis(50);
const LINK_SETTLE_STEP: Duration = Duration::from_millis(5);
/// The reaper runs every idle_timeout / 4, within these bounds.
const REAPER_MIN: Duration = Duration::from_millis(5);
const REAPER_MAX: Duration = Duration::from_millis(200);

/// How much of the CQ a call of [`Inner::drain_cq`] takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Drain {
    All,
    Chunk,
}

/// An async event and when it was read.
pub(crate) type StampedEvent = (AsyncEvent, Instant);

pub(crate) async fn poller(weak: Weak<Inner>, cq: Arc<Cq>, chan: Arc<CompChannel>) {
    let afd = match chan.async_fd() {
        Ok(a) => Some(a),
        Err(e) => {
            tracing::error!("completion channel cannot be polled ({e}); falling back to a timer");
            None
        }
    };
    // One timer for the whole loop, reset only when it fires: a completion
    // event costs no clock read and no timer-wheel update.
    let rearm = tokio::time::sleep(POLLER_REARM);
    tokio::pin!(rearm);
    loop {
        if let Err(e) = cq.arm() {
            tracing::warn!("{e}");
        }
        {
            let Some(inner) = weak.upgrade() else { return };
            inner.drain_cq(Drain::All);
        }
        match &afd {
            Some(afd) => {
                tokio::select! {
                    r = afd.readable() => {
                        if let Ok(mut g) = r {
                            while chan.take_event().unwrap_or(false) {}
                            g.clear_ready();
                        }
                    }
                    () = rearm.as_mut() => {
                        rearm.as_mut().reset(tokio::time::Instant::now() + POLLER_REARM);
                    }
                }
            }
            None => tokio::time::sleep(POLLER_FALLBACK).await,
        }
    }
}

pub(crate) async fn reaper(weak: Weak<Inner>) {
    let period = {
        let Some(inner) = weak.upgrade() else { return };
        (inner.lim.idle_timeout / 4).clamp(REAPER_MIN, REAPER_MAX)
    };
    loop {
        tokio::time::sleep(period).await;
        let Some(inner) = weak.upgrade() else { return };
        let limit = inner.cfg.handshake_timeout();
        inner.with_state(|st, g| {
            st.reap(&inner.lim, false, g);
            // Kept side channels the peer no longer waits on are closed.
            st.reap_spares(limit);
        });
    }
}

/// The async-event thread: reads, acknowledges and forwards events until
/// told to stop or nobody listens. Each event is stamped with the time it
/// was read, so that it only touches objects that existed then (a late
/// PORT_ERR must not break an endpoint built after the link came back).
/// The thread ends after a device failure, or when the device's event
/// file stops working.
pub(crate) fn read_async_events(ctx: &Context, stop: &AtomicBool, tx: &UnboundedSender<StampedEvent>) {
    let mut errors = 0;
    let wait_ms = i32::try_from(EVENT_POLL.as_millis()).unwrap_or(i32::MAX);
    while !stop.load(Ordering::Relaxed) && !tx.is_closed() {
        match ctx.next_async_event(wait_ms) {
            Ok(Some(ev)) => {
                if tx.send((ev, Instant::now())).is_err() || ev == AsyncEvent::DeviceFatal {
                    return;
                }
                errors = 0;
            }
            Ok(None) => {}
            Err(e) => {
                errors += 1;
                if errors == 1 {
                    tracing::error!("reading async events of {}: {e}", ctx.name());
                }
                if matches!(e.errno, libc::EIO | libc::ENODEV) || errors >= EVENT_ERRORS_MAX {
                    tracing::error!("{}: no more async events will be read ({e})", ctx.name());
                    return;
                }
                std::thread::sleep(EVENT_POLL);
            }
        }
    }
}

/// Applies async events as the thread forwards them.
pub(crate) async fn on_async_events(weak: Weak<Inner>, mut rx: UnboundedReceiver<StampedEvent>) {
    while let Some((ev, at)) = rx.recv().await {
        let Some(inner) = weak.upgrade() else { return };
        inner.on_async_event(ev, at);
    }
}

impl Inner {
    /// Applies `ev`, read at `at`, to the objects that existed then: a
    /// failed QP breaks its endpoint (or peer group); the port going down
    /// breaks everything on it (new endpoints are refused while the port is
    /// not active, see [`Inner::link_usable`]); a device failure ends all
    /// work for good.
    fn on_async_event(&self, ev: AsyncEvent, at: Instant) {
        let dev = &self.device;
        let port = self.cfg.port;
        self.with_state(|st, g| match ev {
            AsyncEvent::QpError { qpn, what } => {
                tracing::warn!("{dev}: queue pair {qpn} failed ({what})");
                let why = Error::new(ErrorKind::ConnectionReset, format!("queue pair {qpn} failed ({what})"));
                st.break_qp(qpn, at, why, g);
            }
            AsyncEvent::PortError { port: p } if p == port => {
                tracing::warn!("{dev}: port {p} went down; breaking every endpoint on it");
                st.break_all(at, &link_down(dev, port), g);
            }
            AsyncEvent::CqError => {
                tracing::error!("{dev}: completion queue overrun; breaking every endpoint");
                let why = Error::new(ErrorKind::ConnectionReset, "completion queue overrun (completions lost)");
                st.break_all(at, &why, g);
            }
            AsyncEvent::DeviceFatal => {
                tracing::error!("{dev}: device failed (IBV_EVENT_DEVICE_FATAL)");
                st.device_failed = true;
                st.break_all(at, &device_failed(dev), g);
            }
            other => tracing::debug!("{dev}: async event {other:?}"),
        });
    }

    /// The link-down error if `chunk` holds an error completion and the
    /// port is down (or cannot be asked); `None` on a chunk of successes
    /// without asking. A "remote invalid request" gives the port up to
    /// [`LINK_SETTLE`] to be reported down.
    fn port_down_after(&self, ctx: &Context, chunk: &[crate::verbs::Completion]) -> Option<Error> {
        use rdma_sys::ibv_wc_status as S;
        if chunk.iter().all(|c| c.status == S::IBV_WC_SUCCESS) {
            return None;
        }
        let settle = chunk.iter().any(|c| c.status == S::IBV_WC_REM_INV_REQ_ERR);
        let until = Instant::now() + if settle { LINK_SETTLE } else { Duration::ZERO };
        loop {
            if !matches!(ctx.port_active(self.cfg.port), Ok(true)) {
                return Some(link_down(&self.device, self.cfg.port));
            }
            if Instant::now() >= until {
                return None;
            }
            std::thread::sleep(LINK_SETTLE_STEP);
        }
    }

    /// Polls the CQ and applies what it finds, in CQ order: the poll and
    /// the apply happen under `cq_lock`, so a busy-polling waiter and the
    /// poller never apply completions out of order (a flush completion
    /// must not overtake the error that caused it). `Drain::All` (the
    /// poller) waits for the lock and empties the CQ; `Drain::Chunk` (a
    /// busy-polling waiter) takes at most one chunk, and nothing if the
    /// poller is at it. Returns how many completions were applied.
    pub(crate) fn drain_cq(&self, how: Drain) -> usize {
        let Some(v) = self.state.lock().verbs.clone() else { return 0 };
        let mut buf = match how {
            Drain::All => self.cq_lock.lock(),
            Drain::Chunk => match self.cq_lock.try_lock() {
                Some(g) => g,
                None => return 0,
            },
        };
        let mut total = 0;
        loop {
            match v.cq.poll(&mut buf, POLL_BATCH) {
                Ok(0) => return total,
                Ok(n) => {
                    total += n;
                    // A work request that fails while its port is down
                    // failed because of the link, whatever status the
                    // provider gave it (soft-RoCE can answer a cut link
                    // with "remote invalid request"): reported as the
                    // transient link-down error. Asked only when a chunk
                    // holds an error, never on the success path.
                    let down = self.port_down_after(&v.ctx, &buf);
                    self.with_state(|st, g| {
                        for c in buf.iter() {
                            st.on_completion(c, down.as_ref(), &self.lim, g);
                        }
                    });
                    if how == Drain::Chunk {
                        return total;
                    }
                }
                Err(e) => {
                    tracing::error!("{e}");
                    return total;
                }
            }
        }
    }
}
