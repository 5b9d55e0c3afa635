//! `submit`, deadlines and stopping a batch: validation through the core
//! ([`validate_batch`]), remote ranges against the segment's descriptor
//! (refreshed once if stale), a [`BatchLedger`] per batch (units are the
//! requests' slices), then each segment's slices queued on its endpoint.

use std::collections::HashSet;
use std::sync::{Arc, Weak};

use transport_core::lifecycle::{validate_batch, BatchLedger, BatchLimits, EndReason, EndpointId};
use transport_core::{BatchId, BatchStatus, Error, ErrorKind, Result, SegmentId, SubmitOptions, TransferRequest};

use crate::handshake;
use crate::state::{Batch, Graveyard, Inner, Slice, State, Target};

/// How many times a segment's requests are offered a fresh endpoint when
/// the one just obtained broke before they were queued on it (a peer
/// reset, a cancel of other work on it).
const START_ATTEMPTS: usize = 5;

/// Whether a released batch, or one with nothing posted, is quiet.
fn batch_quiet(st: &State, batch: BatchId) -> bool {
    st.batches.get(batch).map_or(true, |b| b.ledger.on_wire() == 0)
}

fn peer_restarted(seg: SegmentId) -> Error {
    Error::new(ErrorKind::PeerRestarted, "the peer restarted; re-read its descriptor").with("segment", seg)
}

/// The remote key for request `r` (`Some(None)`: the range is the peer's
/// staged device memory, reached through its staging buffers), or `None` if
/// its remote range is in no region of the handle's descriptor (which may
/// be stale).
fn remote_key(st: &State, r: &TransferRequest) -> Result<Option<Option<u32>>> {
    let seg = st.segments.get(&r.segment).ok_or_else(|| Error::unknown_segment(r.segment))?;
    let Some(info) = seg.desc.region_for(r.remote_addr, r.len) else {
        return Ok(None);
    };
    if !info.access.allows(r.op) {
        return Err(Error::new(ErrorKind::AccessDenied, format!("remote region does not allow {:?}", r.op))
            .with("segment", r.segment));
    }
    if info.key == crate::staging::STAGED_KEY {
        return Ok(Some(None));
    }
    u32::try_from(info.key)
        .map(|k| Some(Some(k)))
        .map_err(|_| Error::new(ErrorKind::Protocol, "remote key does not fit an rkey"))
}

/// How far the locked part of `submit` got.
enum Started {
    /// Created and queued on its one segment's live endpoint.
    Queued(BatchId),
    /// Created; its segments are still to be started.
    Created(BatchId),
    /// Request `i`'s remote range is unknown to segment `seg` (named `name`).
    Stale(usize, SegmentId, String),
}

/// The outcome of validating a batch under the lock.
enum Checked {
    Keys,
    /// Request `i`'s remote range is unknown to segment `seg` (named `name`).
    Stale(usize, SegmentId, String),
}

impl State {
    /// The live endpoint of `seg` with one more use counted for the caller,
    /// if there is one (no clock read: see [`EndpointPool::use_again`]).
    ///
    /// [`EndpointPool::use_again`]: transport_core::lifecycle::EndpointPool::use_again
    pub(crate) fn use_live_endpoint(&mut self, seg: SegmentId) -> Option<EndpointId> {
        self.pool.live(&seg).filter(|&ep| self.pool.use_again(ep))
    }

    /// Fails every request of `batch` on segment `seg` with `e`.
    fn fail_segment(&mut self, batch: BatchId, seg: SegmentId, requests: &[TransferRequest], e: &Error) {
        for (i, _) in requests.iter().enumerate().filter(|(_, r)| r.segment == seg) {
            self.end_request(batch, i, EndReason::Failed(e.clone()));
        }
    }

    /// Queues `batch`'s slices for segment `seg` on endpoint `ep`, which
    /// holds a use for the caller: the use becomes the endpoint's "busy"
    /// use (or is given back if it already had one). Returns `false`, the
    /// use given back, if the endpoint broke since.
    #[allow(clippy::too_many_arguments)]
    fn queue(
        &mut self,
        batch: BatchId,
        seg: SegmentId,
        ep: EndpointId,
        requests: &[TransferRequest],
        slice: u64,
        lim: &crate::state::Limits,
        grave: &mut Graveyard,
    ) -> bool {
        // The clock is read only where a use is given back: the common
        // path (an idle endpoint becoming busy) reads none.
        let Some(e) = self.endpoints.get_mut(&ep).filter(|e| e.broken_at.is_none()) else {
            let now = self.now();
            self.pool.release(ep, now);
            return false;
        };
        // Requests into the peer's staged device memory go to a driver of
        // their own (crate::staging), the rest to the endpoint's queue.
        let staged =
            |i: usize| self.batches.get(batch).is_ok_and(|b| b.targets.get(i).is_some_and(|t| t.rkey.is_none()));
        let mut driven = Vec::new();
        for (i, r) in requests.iter().enumerate().filter(|(_, r)| r.segment == seg) {
            let to_driver = staged(i);
            let mut off = 0;
            while off < r.len {
                // At most `slice` (a u32) bytes: the cast cannot truncate.
                let len = (r.len - off).min(slice) as u32;
                let s = Slice { batch, req: i, offset: off, len };
                if to_driver {
                    driven.push(s);
                } else {
                    e.pending.push_back(s);
                }
                off += u64::from(len);
            }
        }
        if !driven.is_empty() {
            e.drivers += 1;
            grave.drives.push(crate::staging::Drive { seg, ep, slices: driven });
        }
        if std::mem::replace(&mut e.busy, true) {
            let now = self.now();
            self.pool.release(ep, now);
        }
        self.after_work(ep, lim, grave);
        true
    }
}

impl Inner {
    fn limits(&self) -> BatchLimits {
        BatchLimits { max_batch_len: self.cfg.max_batch_len, max_request_len: self.cfg.max_request_len }
    }

    /// Validates `requests` and collects them with their remote keys into
    /// `targets`.
    fn check(
        &self,
        st: &State,
        requests: &[TransferRequest],
        refreshed: &[SegmentId],
        targets: &mut Vec<Target>,
    ) -> Result<Checked> {
        if st.shutdown {
            return Err(Error::shut_down());
        }
        validate_batch(
            requests,
            self.limits(),
            |id| st.regions.get(&id).map(|r| ((), r.mem.len() as u64)),
            |s| st.segments.contains_key(&s),
        )?;
        targets.clear();
        for (i, r) in requests.iter().enumerate() {
            match remote_key(st, r).map_err(|e| e.with("request", i))? {
                Some(rkey) => targets.push(Target { spec: *r, rkey }),
                None if !refreshed.contains(&r.segment) => {
                    let name = st.segments.get(&r.segment).map(|s| s.desc.name.clone()).unwrap_or_default();
                    return Ok(Checked::Stale(i, r.segment, name));
                }
                None => {
                    return Err(Error::new(
                        ErrorKind::OutOfBounds,
                        format!("remote range {:#x}+{} is in no region of the segment", r.remote_addr, r.len),
                    )
                    .with("segment", r.segment)
                    .with("request", i))
                }
            }
        }
        Ok(Checked::Keys)
    }

    pub(crate) async fn submit(
        self: &Arc<Self>,
        requests: Vec<TransferRequest>,
        opts: SubmitOptions,
    ) -> Result<BatchId> {
        // Validate; refresh stale descriptors once if a remote range is unknown.
        let mut targets = Vec::with_capacity(requests.len());
        // Segments whose descriptor was re-read (a handful at most).
        let mut refreshed = Vec::new();
        let slice = u64::from(self.cfg.slice_size);
        // Validate, create the batch and, when every request goes to one
        // segment whose endpoint is live (the common case), queue it: all
        // under one lock. Otherwise refresh a stale descriptor once, or
        // start the segments one by one below.
        let id = loop {
            let started = self.with_state(|st, g| {
                if let Checked::Stale(i, seg, name) = self.check(st, &requests, &refreshed, &mut targets)? {
                    return Ok(Started::Stale(i, seg, name));
                }
                let id = self.create(st, std::mem::take(&mut targets), slice, &opts);
                let seg = requests.first().map(|r| r.segment);
                if let Some(seg) = seg.filter(|&s| requests.iter().all(|r| r.segment == s)) {
                    if let Some(ep) = st.use_live_endpoint(seg) {
                        if st.queue(id, seg, ep, &requests, slice, &self.lim, g) {
                            return Ok(Started::Queued(id));
                        }
                    }
                }
                Ok::<_, Error>(Started::Created(id))
            })?;
            match started {
                Started::Queued(id) => return Ok(id),
                Started::Created(id) => break id,
                Started::Stale(i, seg, name) => {
                    refreshed.push(seg);
                    let (d, spare) =
                        handshake::fetch_descriptor(&name, self.cfg.handshake_timeout(), self.cfg.secret.as_deref())
                            .await
                            .map_err(|e| e.with("request", i))?;
                    let mut st = self.state.lock();
                    let s = st.segments.get_mut(&seg).ok_or_else(|| Error::unknown_segment(seg).with("request", i))?;
                    let restarted = d.generation != s.desc.generation;
                    s.desc = d;
                    st.keep_spare(seg, spare);
                    if restarted {
                        return Err(peer_restarted(seg).with("request", i));
                    }
                }
            }
        };
        // Start each segment's requests on its endpoint. If this future is
        // dropped meanwhile, the batch is cancelled and removed once quiet.
        let mut orphan = Orphan { inner: self, batch: Some(id) };
        let mut seen = HashSet::new();
        for seg in requests.iter().map(|r| r.segment) {
            if seen.insert(seg) {
                self.start_segment(id, seg, &requests, slice).await;
            }
        }
        orphan.batch = None;
        Ok(id)
    }

    /// Creates the batch of `targets` (validated requests with their remote
    /// keys), entered in the deadline queue if `opts` has a timeout (one
    /// past what the clock holds never comes due).
    fn create(&self, st: &mut State, targets: Vec<Target>, slice: u64, opts: &SubmitOptions) -> BatchId {
        let ledger = BatchLedger::new(targets.iter().map(|t| t.spec.len.div_ceil(slice)), None);
        let id = st.batches.insert(Batch::new(ledger, targets));
        if let Some(at) = opts.timeout.and_then(|after| st.now().checked_add(after)) {
            let (key, earliest) = st.deadlines.add(at, id);
            if let Ok(b) = st.batches.get_mut(id) {
                b.deadline = Some(key);
            }
            if earliest {
                self.earlier_deadline.notify_one();
            }
        }
        id
    }

    /// Queues the requests of `batch` to `seg` on its endpoint; if that is
    /// impossible they fail with the reason.
    async fn start_segment(&self, batch: BatchId, seg: SegmentId, requests: &[TransferRequest], slice: u64) {
        for attempt in 1..=START_ATTEMPTS {
            let got = self.endpoint(seg).await;
            let queued = self.with_state(|st, g| {
                let e = match got {
                    Err(e) => e,
                    Ok((ep, true)) => {
                        let now = st.now();
                        st.pool.release(ep, now);
                        peer_restarted(seg)
                    }
                    Ok((ep, false)) => {
                        if st.queue(batch, seg, ep, requests, slice, &self.lim, g) {
                            return true;
                        }
                        if attempt < START_ATTEMPTS {
                            return false;
                        }
                        Error::new(ErrorKind::ConnectionReset, "endpoint broke while starting")
                    }
                };
                st.fail_segment(batch, seg, requests, &e);
                true
            });
            if queued {
                return;
            }
        }
    }

    /// Ends the live requests of `batch` with `reason`, flushes its posted
    /// work and waits until the batch is quiet.
    pub(crate) async fn stop_batch(&self, batch: BatchId, reason: EndReason) -> Result<BatchStatus> {
        self.with_state(|st, g| {
            st.batches.get(batch)?;
            st.end_requests(|b, _| b == batch, &reason, g);
            Ok::<_, Error>(())
        })?;
        self.settle(|st| batch_quiet(st, batch)).await;
        self.state.lock().batches.get(batch).map(|b| b.ledger.status())
    }
}

/// A batch whose id `submit` has not returned yet: if the submit future is
/// dropped, its requests are cancelled (posted work is flushed) and the
/// batch is marked orphaned, so the reaper removes it once terminal
/// instead of leaving it in the table for good.
struct Orphan<'a> {
    inner: &'a Inner,
    batch: Option<BatchId>,
}

impl Drop for Orphan<'_> {
    fn drop(&mut self) {
        let Some(id) = self.batch.take() else { return };
        self.inner.with_state(|st, g| {
            st.end_requests(|b, _| b == id, &EndReason::Cancelled, g);
            if let Ok(b) = st.batches.get_mut(id) {
                b.orphaned = true;
            }
            st.remove_orphans(g);
        });
    }
}

/// The transport's one deadline timer: sleeps until the earliest deadline
/// in `State::deadlines` (or until an earlier one is entered) and times out
/// every batch due that is still live, each stopped in a task of its own so
/// one slow flush never delays another deadline. Ends with the transport.
pub(crate) async fn timer(weak: Weak<Inner>) {
    loop {
        let Some(inner) = weak.upgrade() else { return };
        let signal = inner.earlier_deadline.clone();
        let earlier = signal.notified();
        tokio::pin!(earlier);
        earlier.as_mut().enable();
        let (due, wake) = {
            let mut st = inner.state.lock();
            let now = st.now();
            let due: Vec<BatchId> = st
                .deadlines
                .due(now)
                .into_iter()
                .map(|(_, id)| id)
                .filter(|&id| {
                    st.batches.get_mut(id).is_ok_and(|b| b.deadline.take().is_some() && !b.ledger.is_terminal())
                })
                .collect();
            (due, (st.deadlines.arm(), st.epoch))
        };
        for id in due {
            let w = weak.clone();
            // Counted while it runs; it holds the transport only weakly.
            drop(inner.tasks.spawn(async move {
                let Some(i) = w.upgrade() else { return };
                let _ = i.stop_batch(id, EndReason::TimedOut).await;
            }));
        }
        drop(inner);
        let (next, epoch) = wake;
        epoch.sleep_until_or(next, earlier).await;
    }
}
