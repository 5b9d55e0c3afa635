//! The driver's tasks: one sender per peer (in order, one message at a
//! time), the reader of the engine's inbox, and the timer that ticks the
//! table.

use super::*;

/// Delivers `peer`'s queued messages in order; a message that cannot be
/// delivered for the liveness timeout is dropped (the table's liveness
/// check ends the sessions). Aborted with the other tasks.
pub(super) async fn send_loop(inner: Arc<Inner>, peer: String) {
    let mut ready: VecDeque<Vec<u8>> = VecDeque::new();
    loop {
        if ready.is_empty() {
            // Everything queued meanwhile goes together (bundled, in order).
            let queued: Vec<Vec<u8>> = {
                let mut peers = inner.peers.lock();
                let Some(link) = peers.get_mut(&peer) else { return };
                if link.queue.is_empty() {
                    link.sending = false;
                    return;
                }
                link.queue.drain(..).collect()
            };
            ready.extend(crate::session::wire::bundle(queued));
        }
        let Some(msg) = ready.pop_front() else { continue };
        if !inner.running().await {
            return;
        }
        let give_up = inner.table.lock().limits().liveness_timeout;
        let started = inner.clock.now();
        let mut backoff = Duration::from_millis(5);
        loop {
            let sent = match inner.use_segment(&peer).await {
                Ok(seg) => inner.engine.transport().notify(seg.id, msg.clone()).await,
                Err(e) => Err(e),
            };
            let e = match sent {
                Ok(()) => {
                    let took = inner.clock.now().saturating_sub(started);
                    if took >= SLOW_DELIVERY {
                        tracing::debug!(peer = %peer, took_ms = took.as_millis() as u64, "session message delivered late");
                    } else {
                        tracing::trace!(peer = %peer, took_ms = took.as_millis() as u64, "session message delivered");
                    }
                    break;
                }
                Err(e) if e.kind() == ErrorKind::Shutdown => return,
                Err(e) => e,
            };
            if !e.is_transient() || inner.clock.now().saturating_sub(started) >= give_up {
                tracing::debug!(peer = %peer, error = %e, "session message dropped");
                break;
            }
            tracing::debug!(peer = %peer, error = %e, "session message not delivered yet; retrying");
            // The segment stays open: writes share it, and closing it would
            // cancel them (rule 3). Backends rebuild broken endpoints and
            // refresh a restarted peer's descriptor on their own.
            inner.clock.sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_millis(200));
        }
    }
}

/// [`Inner::running`] for a task that holds the engine weakly.
async fn running(weak: &std::sync::Weak<Inner>) -> bool {
    let gate = match weak.upgrade() {
        Some(i) => i.running(),
        None => return false,
    };
    gate.await
}

pub(super) async fn read_loop(weak: std::sync::Weak<Inner>) {
    loop {
        let transport = match weak.upgrade() {
            Some(i) => i.engine.transport().clone(),
            None => return,
        };
        if transport.wait_notification().await.is_err() {
            return;
        }
        if !running(&weak).await {
            return;
        }
        let Some(inner) = weak.upgrade() else { return };
        if !read_inbox(&inner) {
            return;
        }
    }
}

/// Takes what the transport's inbox holds (up to [`TAKE_BATCH`]) and
/// applies it: session messages to the table, the others to the plain
/// inbox. `false` once the transport refuses (shut down). The reader task
/// calls it when woken, and the timer before each tick, so a peer is never
/// judged silent while its messages wait unread (the reader may be late on
/// a busy runtime). One caller at a time, so messages apply in the order
/// they arrived.
pub(super) fn read_inbox(inner: &Arc<Inner>) -> bool {
    {
        let _one = inner.reading.lock();
        if *inner.held.borrow() {
            // Held ([`Sessions::hold`]): messages wait unread.
            return true;
        }
        let Ok(batch) = inner.engine.transport().take_notifications(TAKE_BATCH) else { return false };
        if batch.is_empty() {
            return true;
        }
        let now = inner.clock.now();
        {
            let mut t = inner.table.lock();
            for n in &batch {
                if is_session_message(&n.msg) {
                    tracing::trace!(from = %n.from, len = n.msg.len(), "session message received");
                    t.on_message(&n.from, &n.msg, now);
                }
            }
        }
        for n in batch {
            if !is_session_message(&n.msg) && inner.plain.offer(n).is_err() {
                inner.dropped_plain.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
    }
    inner.pump();
    true
}

pub(super) async fn tick_loop(weak: std::sync::Weak<Inner>, every: Duration) {
    loop {
        let sleep = match weak.upgrade() {
            Some(i) => i.clock.sleep(every),
            None => return,
        };
        let asked = Instant::now();
        sleep.await;
        if !running(&weak).await {
            return;
        }
        let late = asked.elapsed().saturating_sub(every);
        if late >= SLOW_DELIVERY {
            tracing::debug!(late_ms = late.as_millis() as u64, "session timer ran late");
        }
        let Some(inner) = weak.upgrade() else { return };
        // What peers sent is read before they are judged (a transport
        // that refuses is the reader's to notice; the timer goes on).
        let _ = read_inbox(&inner);
        let now = inner.clock.now();
        let paused = {
            let mut t = inner.table.lock();
            let before = t.pauses();
            t.tick(now);
            t.pauses() > before
        };
        if paused {
            // The table did not count the gap against any peer.
            tracing::info!(
                late_ms = late.as_millis() as u64,
                "session engine: this process did not run for a while; peers are not blamed for it"
            );
            metrics::counter!("kvmove_session_pauses_total").increment(1);
        }
        inner.pump();
        // Stop signals of sessions that ended or were forgotten; waiters of
        // forgotten sessions are woken (they answer "unknown"), and channels
        // nobody waits on are dropped.
        {
            let t = inner.table.lock();
            inner.writes.lock().retain(|k, _| t.state(k).is_some_and(|s| !s.is_final()));
            inner.waiters.lock().retain(|k, tx| {
                if t.state(k).is_none() {
                    tx.send_modify(|v| *v = v.wrapping_add(1));
                }
                tx.receiver_count() > 0
            });
        }
        // Segments of peers with no session, nothing queued and no user,
        // unused for SEGMENT_IDLE, are closed.
        let idle: Vec<(String, SegmentId)> = {
            let t = inner.table.lock();
            let known: std::collections::HashSet<String> = t.known_peers();
            let mut peers = inner.peers.lock();
            let gone: Vec<String> = peers
                .iter()
                .filter(|(p, l)| {
                    !known.contains(*p)
                        && l.queue.is_empty()
                        && !l.sending
                        && l.users == 0
                        && now.saturating_sub(l.last_used) >= SEGMENT_IDLE
                })
                .map(|(p, _)| p.clone())
                .collect();
            gone.into_iter().filter_map(|p| peers.remove(&p).and_then(|l| l.segment.map(|s| (p, s)))).collect()
        };
        for (_, s) in idle {
            let _ = inner.engine.transport().close_segment(s).await;
        }
    }
}
