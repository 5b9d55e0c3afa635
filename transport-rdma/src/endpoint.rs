//! Endpoints to opened segments, through the lifecycle core's
//! [`EndpointPool`]: the bound on endpoints with LRU eviction of idle ones
//! (rule 4), a place reserved before the QPs are created and given back
//! only after they are destroyed ([`Inner::with_state`]).
//!
//! [`EndpointPool`]: transport_core::lifecycle::EndpointPool

use std::sync::Weak;
use std::time::{Duration, Instant};

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use transport_core::lifecycle::{reach, Acquire, EndpointId, Found, Reached};
use transport_core::{Error, ErrorKind, Result, SegmentId};

use crate::counters::endpoint_event;
use crate::handshake::{self, Bringup};
use crate::state::{Endpoint, Inner, QpSlot, Task};
use crate::verbs::QpTiming;

/// How long a caller waits before asking the pool again when every place
/// is busy or waits for its QPs to be destroyed.
const FULL_RETRY: Duration = Duration::from_millis(1);
/// Bytes the side-channel watcher reads at a time (the peer sends nothing;
/// anything it does send is ignored).
const WATCH_BUF: usize = 64;

/// A place the pool reserved for a build: given back on drop unless the
/// build settled it (`id` taken). It travels with the QPs being built
/// ([`Bringup`]), so it is given back only after they are destroyed.
struct Reservation {
    inner: Weak<Inner>,
    id: Option<EndpointId>,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if let (Some(id), Some(inner)) = (self.id.take(), self.inner.upgrade()) {
            inner.with_state(|st, _| st.pool.build_failed(id));
        }
    }
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
            match st.use_live_endpoint(seg) {
                Some(id) => Ok(Err(id)),
                None => Ok(Ok(lock)),
            }
        })?;
        let lock = match lock {
            Ok(lock) => lock,
            Err(id) => return Ok((id, false)),
        };
        let _guard = lock.lock().await;
        // The segment's name as of the last time the pool was asked.
        let mut name = String::new();
        let reached = reach(
            &seg.to_string(),
            self.cfg.max_endpoints,
            self.cfg.handshake_timeout(),
            || {
                self.with_state(|st, g| {
                    if st.shutdown {
                        return Err(Error::shut_down());
                    }
                    name.clone_from(&st.segments.get(&seg).ok_or_else(|| Error::unknown_segment(seg))?.desc.name);
                    // Flushed broken endpoints give their places back once
                    // destroyed (when this closure's graveyard is emptied).
                    st.reap(&self.lim, false, g);
                    let now = st.now();
                    Ok(match st.pool.acquire(&seg, now) {
                        Acquire::Use(id) => Found::Use(id),
                        Acquire::Build(id) => Found::Build(id),
                        // Destroyed here, under the lock: ask again.
                        Acquire::Evict(id) => {
                            endpoint_event("evicted", 1);
                            st.destroy_endpoint_now(id, g);
                            Found::Again
                        }
                        // Busy endpoints go idle when their work completes,
                        // broken ones when they have flushed, dying ones
                        // when their QPs are destroyed: wait, bounded.
                        Acquire::Building(_) => Found::Building,
                        Acquire::Full { .. } => Found::Full,
                    })
                })
            },
            |_: EndpointId| async {},
            || tokio::time::sleep(FULL_RETRY),
        )
        .await?;
        let id = match reached {
            Reached::Use(id) => return Ok((id, false)),
            Reached::Build(id) => id,
        };
        // Until the build is settled, the place goes back if this future
        // is dropped or the build fails, once the QPs built so far are
        // destroyed (it travels with them).
        let reserved = Reservation { inner: self.weak(), id: Some(id) };
        self.link_usable()?;
        let building = Instant::now();
        // The side channel that read the descriptor, if no endpoint took it.
        let spare = self.with_state(|st, _| st.take_spare(seg));
        let built = self.build(&name, reserved, spare).await;
        tracing::debug!(segment = %name, took_ms = building.elapsed().as_millis() as u64, ok = built.is_ok(), "rdma: endpoint build");
        let (bringup, stream, peer) = built?;
        let (group, mut reserved) = bringup.finish();
        reserved.id = None;
        let created = group.created;
        let mut ep = Endpoint {
            segment: seg,
            qps: group.into_qps().into_iter().map(|qp| QpSlot { qp, outstanding: 0 }).collect(),
            pending: Default::default(),
            ready: Default::default(),
            copying: 0,
            drivers: 0,
            next_qp: 0,
            busy: false,
            created,
            broken_at: None,
            watcher: None,
        };
        self.with_state(|st, g| {
            let now = st.now();
            if st.shutdown || !st.pool.built(id, now) {
                // Closed or shut down meanwhile: the pool retired it.
                g.endpoints.push((id, ep));
                return Err(if st.shutdown { Error::shut_down() } else { Error::unknown_segment(seg) });
            }
            endpoint_event("built", 1);
            let Some(s) = st.segments.get_mut(&seg) else {
                st.pool.broken(id);
                g.endpoints.push((id, ep));
                return Err(Error::unknown_segment(seg));
            };
            let restarted = peer.generation != s.desc.generation;
            s.desc = peer;
            ep.watcher = Some(Task::spawn(&self.tasks, watch(self.weak(), id, stream)));
            st.endpoints.insert(id, ep);
            Ok((id, restarted))
        })
    }

    /// Creates the QPs for the place `reserved` and connects them to the
    /// segment `name`, every verbs call off the runtime.
    async fn build(
        &self,
        name: &str,
        reserved: Reservation,
        spare: Option<crate::wire::Spare>,
    ) -> Result<(Bringup<Reservation>, TcpStream, transport_core::SegmentDescriptor)> {
        let v = self.verbs()?;
        let group =
            Bringup::create(v.clone(), self.cfg.qps_per_endpoint, self.lim.max_outstanding_per_qp, reserved).await?;
        let secret = self.cfg.secret.as_deref();
        handshake::connect(v, group, name, self.timing(), self.cfg.handshake_timeout(), secret, spare).await
    }
}

/// Breaks endpoint `ep` when the peer closes its side channel.
async fn watch(weak: std::sync::Weak<Inner>, ep: EndpointId, mut stream: TcpStream) {
    let mut buf = [0u8; WATCH_BUF];
    loop {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
    }
    let Some(inner) = weak.upgrade() else { return };
    inner.with_state(|st, g| {
        if let Some(e) = st.endpoints.get_mut(&ep) {
            if let Some(me) = e.watcher.take() {
                me.ending();
            }
            let why = Error::new(ErrorKind::ConnectionReset, "the peer closed the side channel (crashed or shut down)");
            st.break_endpoint(ep, why, g);
        }
    });
}
