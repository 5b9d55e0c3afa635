//! `FaultyTransport`: a fault-injecting layer around any transport, so TCP
//! and RDMA can be driven through the same scripted faults as the mock.
//!
//! Faults act at the API boundary: a failed request is never passed to the
//! inner transport (so it is quiet by construction), a stalled request is
//! withheld and its batch held until the deadline, when the inner batch is
//! cancelled (and so quiet) before the batch is reported `TimedOut`.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;
use transport_core::{
    Access, BatchId, BatchStatus, Capabilities, Error, ErrorKind, MemoryRegion, RegionId, RequestStatus, ResourceStats,
    Result, SegmentDescriptor, SegmentId, SubmitOptions, TransferRequest, Transport,
};

use crate::plan::{FaultPlan, FaultState, RequestInfo};

/// How a request of a wrapped batch is served.
#[derive(Debug, Clone)]
enum Slot {
    /// Failed by the plan; never sent.
    Injected(Error),
    /// Sent as request `i` of the inner batch.
    Inner(usize),
    /// Stalled by the plan; never sent, ends at the deadline or cancel.
    Withheld,
}

#[derive(Debug)]
struct Entry {
    inner: Option<BatchId>,
    slots: Vec<Slot>,
    /// Set once the layer decided the final status (held batches, kill).
    done: Option<BatchStatus>,
}

impl Entry {
    fn held(&self) -> bool {
        self.slots.iter().any(|s| matches!(s, Slot::Withheld))
    }

    /// The status from the inner one; withheld requests are `ended` if
    /// given, else pending.
    fn merge(&self, inner: Option<&BatchStatus>, ended: Option<&RequestStatus>) -> Result<BatchStatus> {
        let mut out = Vec::with_capacity(self.slots.len());
        for s in &self.slots {
            out.push(match s {
                Slot::Injected(e) => RequestStatus::Failed(e.clone()),
                Slot::Withheld => ended.cloned().unwrap_or(RequestStatus::Pending),
                Slot::Inner(i) => inner
                    .and_then(|st| st.requests.get(*i).cloned())
                    .ok_or_else(|| Error::new(ErrorKind::Internal, "inner status has too few requests"))?,
            });
        }
        Ok(BatchStatus::from_requests(out))
    }
}

type Key = (SegmentId, u64, u64);

#[derive(Debug)]
struct State {
    faults: FaultState,
    killed: bool,
    shut: bool,
    segments: HashMap<SegmentId, String>,
    batches: HashMap<u64, Entry>,
    next: u64,
    seen: HashMap<Key, u32>,
    passed: HashMap<Key, u32>,
}

struct Shared {
    inner: Arc<dyn Transport>,
    state: Mutex<State>,
    events: watch::Sender<u64>,
}

impl Shared {
    fn bump(&self) {
        self.events.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// Cancels the inner batch of a held batch at its deadline and records
    /// the final status: non-completed requests end `TimedOut`.
    async fn expire(&self, id: u64) {
        let inner = match self.state.lock().batches.get(&id) {
            Some(e) if e.done.is_none() => e.inner,
            _ => return,
        };
        let inner_status = match inner {
            Some(ib) => self.inner.cancel(ib).await.ok(),
            None => None,
        };
        let mut st = self.state.lock();
        if let Some(e) = st.batches.get_mut(&id) {
            if e.done.is_none() {
                let timed = inner_status.map(|s| {
                    let reqs = s
                        .requests
                        .into_iter()
                        .map(|r| match r {
                            RequestStatus::Completed | RequestStatus::Failed(_) => r,
                            _ => RequestStatus::TimedOut,
                        })
                        .collect();
                    BatchStatus::from_requests(reqs)
                });
                let merged = e.merge(timed.as_ref(), Some(&RequestStatus::TimedOut));
                e.done =
                    Some(merged.unwrap_or_else(|err| {
                        BatchStatus::from_requests(vec![RequestStatus::Failed(err); e.slots.len()])
                    }));
            }
        }
        drop(st);
        self.bump();
    }
}

/// A [`Transport`] around any `Arc<dyn Transport>` that applies a
/// [`FaultPlan`] at the API boundary (see the table on [`FaultPlan`]):
///
/// - the Nth `open_segment` fails with `HandshakeFailed` (`fail_opens`), and
///   opening past `segment_limit` live segments is `ResourceExhausted`;
/// - matching requests fail with a chosen kind without reaching the inner
///   transport (`requests`, `random`), e.g. "request 2 of every batch, for
///   its first 3 attempts" ([`crate::RequestFault::index`]);
/// - matching requests are withheld and their batch is held until its
///   deadline (`stalls`): the inner batch is then cancelled (quiet) and every
///   non-completed request reported `TimedOut`; without a deadline it is
///   held until cancelled;
/// - [`FaultyTransport::kill`] (or `kill_after`): later `register`,
///   `open_segment` and `submit` fail with `ConnectionRefused`; batches in
///   flight are cancelled inside and reported `Failed(ConnectionReset)`.
///   Handles that free resources (`poll`, `wait`, `cancel`, `release`,
///   `close_segment`, `unregister`, `shutdown`) keep working.
///
/// It keeps its own batch ids, mapped to the inner ones, and counts per
/// `(segment, remote_addr, len)` how often a request was submitted to it and
/// passed on ([`FaultyTransport::submissions_of`]). `stats()` is the inner
/// stats plus the batches it holds without an inner batch and its own
/// timer tasks.
pub struct FaultyTransport {
    shared: Arc<Shared>,
    name: String,
    tasks: Mutex<JoinSet<()>>,
}

impl fmt::Debug for FaultyTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultyTransport").field("backend", &self.name).finish()
    }
}

impl FaultyTransport {
    /// Wraps `inner` with `plan`.
    pub fn new(inner: Arc<dyn Transport>, plan: FaultPlan) -> Result<Arc<Self>> {
        plan.validate()?;
        Ok(Self::build(inner, plan))
    }

    /// Wraps `inner` with no faults (a pass-through that counts).
    pub fn wrap(inner: Arc<dyn Transport>) -> Arc<Self> {
        Self::build(inner, FaultPlan::default())
    }

    fn build(inner: Arc<dyn Transport>, plan: FaultPlan) -> Arc<Self> {
        let name = format!("faulty({})", inner.backend());
        let state = State {
            faults: FaultState::new(plan),
            killed: false,
            shut: false,
            segments: HashMap::new(),
            batches: HashMap::new(),
            next: 1,
            seen: HashMap::new(),
            passed: HashMap::new(),
        };
        let shared = Arc::new(Shared { inner, state: Mutex::new(state), events: watch::channel(0).0 });
        Arc::new(Self { shared, name, tasks: Mutex::new(JoinSet::new()) })
    }

    /// The wrapped transport.
    pub fn inner(&self) -> &Arc<dyn Transport> {
        &self.shared.inner
    }

    /// Replaces the plan; counters and RNG start over (the submission
    /// counts are kept).
    pub fn set_fault_plan(&self, plan: FaultPlan) -> Result<()> {
        plan.validate()?;
        self.shared.state.lock().faults = FaultState::new(plan);
        Ok(())
    }

    /// How many times a request to `(segment, remote_addr, len)` was passed
    /// to the inner transport.
    pub fn submissions_of(&self, segment: SegmentId, remote_addr: u64, len: u64) -> u32 {
        self.shared.state.lock().passed.get(&(segment, remote_addr, len)).copied().unwrap_or(0)
    }

    /// How many times a request to `(segment, remote_addr, len)` was
    /// submitted to this layer (passed on or not).
    pub fn attempts_of(&self, segment: SegmentId, remote_addr: u64, len: u64) -> u32 {
        self.shared.state.lock().seen.get(&(segment, remote_addr, len)).copied().unwrap_or(0)
    }

    /// Requests passed to the inner transport in total.
    pub fn submissions_total(&self) -> u32 {
        self.shared.state.lock().passed.values().sum()
    }

    /// Whether the layer was killed.
    pub fn is_killed(&self) -> bool {
        self.shared.state.lock().killed
    }

    /// Crashes the layer: see the type doc. Returns once the inner batches
    /// are cancelled (quiet).
    pub async fn kill(&self) {
        let pending: Vec<(u64, Option<BatchId>)> = {
            let mut st = self.shared.state.lock();
            st.killed = true;
            st.batches.iter().filter(|(_, e)| e.done.is_none()).map(|(id, e)| (*id, e.inner)).collect()
        };
        let reset = RequestStatus::Failed(Error::new(ErrorKind::ConnectionReset, "injected: the transport was killed"));
        for (id, inner) in pending {
            let inner_status = match inner {
                Some(ib) => self.shared.inner.cancel(ib).await.ok(),
                None => None,
            };
            let mut st = self.shared.state.lock();
            if let Some(e) = st.batches.get_mut(&id) {
                if e.done.is_none() {
                    let killed = inner_status.map(|s| {
                        BatchStatus::from_requests(
                            s.requests.into_iter().map(|r| if r.is_completed() { r } else { reset.clone() }).collect(),
                        )
                    });
                    let merged = e.merge(killed.as_ref(), Some(&reset));
                    e.done = Some(merged.unwrap_or_else(|err| {
                        BatchStatus::from_requests(vec![RequestStatus::Failed(err); e.slots.len()])
                    }));
                }
            }
        }
        self.shared.bump();
    }

    /// Cancels the inner transport's running batches behind the caller's
    /// back, as a backend that ends its own work does (a TCP transport that
    /// shuts down reports its running batches `Cancelled`). The caller's
    /// batches end with the inner statuses; the layer stays usable.
    pub async fn cancel_inner_batches(&self) {
        let running: Vec<BatchId> = {
            let st = self.shared.state.lock();
            st.batches.values().filter(|e| e.done.is_none()).filter_map(|e| e.inner).collect()
        };
        for ib in running {
            let _ = self.shared.inner.cancel(ib).await;
        }
    }

    /// Undoes [`FaultyTransport::kill`] for later calls.
    pub fn revive(&self) {
        self.shared.state.lock().killed = false;
    }

    fn check(&self, refuse_when_killed: bool) -> Result<()> {
        let st = self.shared.state.lock();
        if st.shut {
            return Err(Error::shut_down());
        }
        if refuse_when_killed && st.killed {
            return Err(Error::new(ErrorKind::ConnectionRefused, "injected: the transport was killed"));
        }
        Ok(())
    }

    fn entry_view(&self, batch: BatchId) -> Result<(Option<BatchId>, Option<BatchStatus>, bool)> {
        self.check(false)?;
        let st = self.shared.state.lock();
        let e = st.batches.get(&batch.0).ok_or_else(|| Error::unknown_batch(batch))?;
        Ok((e.inner, e.done.clone(), e.held()))
    }

    fn merged(&self, batch: BatchId, inner: Option<&BatchStatus>) -> Result<BatchStatus> {
        let st = self.shared.state.lock();
        let e = st.batches.get(&batch.0).ok_or_else(|| Error::unknown_batch(batch))?;
        match &e.done {
            Some(d) => Ok(d.clone()),
            None => e.merge(inner, None),
        }
    }
}

impl Drop for FaultyTransport {
    fn drop(&mut self) {
        self.tasks.lock().abort_all();
    }
}

#[async_trait]
impl Transport for FaultyTransport {
    fn backend(&self) -> &str {
        &self.name
    }

    fn capabilities(&self) -> Capabilities {
        self.shared.inner.capabilities()
    }

    fn local_segment_name(&self) -> String {
        self.shared.inner.local_segment_name()
    }

    fn local_descriptor(&self) -> Result<SegmentDescriptor> {
        self.check(false)?;
        self.shared.inner.local_descriptor()
    }

    fn advertise(&self, extra: &str) -> Result<()> {
        self.check(false)?;
        self.shared.inner.advertise(extra)
    }

    fn register(&self, mem: MemoryRegion, access: Access) -> Result<RegionId> {
        self.check(true)?;
        self.shared.inner.register(mem, access)
    }

    async fn unregister(&self, region: RegionId) -> Result<()> {
        self.check(false)?;
        self.shared.inner.unregister(region).await
    }

    async fn open_segment(&self, name: &str) -> Result<SegmentId> {
        self.check(true)?;
        {
            let mut st = self.shared.state.lock();
            let open_now = st.segments.len();
            if let Some(e) = st.faults.on_open(name, open_now) {
                return Err(e);
            }
        }
        let id = self.shared.inner.open_segment(name).await?;
        self.shared.state.lock().segments.insert(id, name.to_string());
        Ok(id)
    }

    async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        self.check(false)?;
        let r = self.shared.inner.close_segment(segment).await;
        if r.is_ok() {
            self.shared.state.lock().segments.remove(&segment);
        }
        r
    }

    fn segment_descriptor(&self, segment: SegmentId) -> Result<SegmentDescriptor> {
        self.check(false)?;
        self.shared.inner.segment_descriptor(segment)
    }

    async fn submit(&self, requests: Vec<TransferRequest>, opts: SubmitOptions) -> Result<BatchId> {
        self.check(true)?;
        if requests.is_empty() {
            return self.shared.inner.submit(requests, opts).await;
        }
        let mut slots = Vec::with_capacity(requests.len());
        let mut pass = Vec::new();
        let mut kill = false;
        {
            let mut st = self.shared.state.lock();
            for (i, r) in requests.iter().enumerate() {
                *st.seen.entry((r.segment, r.remote_addr, r.len)).or_default() += 1;
                let seg = st.segments.get(&r.segment).cloned().unwrap_or_default();
                let d = st.faults.on_request(RequestInfo {
                    segment: &seg,
                    index: i,
                    op: r.op,
                    remote_addr: r.remote_addr,
                    len: r.len,
                });
                kill |= d.kill.is_some();
                slots.push(match (d.fail, d.stall) {
                    (Some(e), _) => Slot::Injected(e.with("request", i)),
                    (None, true) => Slot::Withheld,
                    (None, false) => {
                        pass.push(*r);
                        Slot::Inner(pass.len() - 1)
                    }
                });
            }
        }
        let inner = if pass.is_empty() { None } else { Some(self.shared.inner.submit(pass.clone(), opts).await?) };
        // A timeout past what `Instant` holds never fires (no panic, rule 6).
        let deadline = opts.timeout.and_then(|t| Instant::now().checked_add(t));
        let id = {
            let mut st = self.shared.state.lock();
            for r in &pass {
                *st.passed.entry((r.segment, r.remote_addr, r.len)).or_default() += 1;
            }
            let id = st.next;
            st.next += 1;
            st.batches.insert(id, Entry { inner, slots, done: None });
            let held = st.batches.get(&id).is_some_and(Entry::held);
            (id, held)
        };
        let (id, held) = id;
        if let (true, Some(at)) = (held, deadline) {
            let shared = self.shared.clone();
            let mut tasks = self.tasks.lock();
            while tasks.try_join_next().is_some() {}
            tasks.spawn(async move {
                tokio::time::sleep_until(at).await;
                shared.expire(id).await;
            });
        }
        if kill {
            self.kill().await;
        }
        Ok(BatchId(id))
    }

    fn poll(&self, batch: BatchId) -> Result<BatchStatus> {
        let (inner, done, _) = self.entry_view(batch)?;
        if let Some(d) = done {
            return Ok(d);
        }
        let inner_status = match inner {
            Some(ib) => Some(self.shared.inner.poll(ib)?),
            None => None,
        };
        self.merged(batch, inner_status.as_ref())
    }

    async fn wait(&self, batch: BatchId) -> Result<BatchStatus> {
        let mut events = self.shared.events.subscribe();
        loop {
            events.borrow_and_update();
            let (inner, done, held) = self.entry_view(batch)?;
            if let Some(d) = done {
                return Ok(d);
            }
            if !held {
                let inner_status = match inner {
                    Some(ib) => Some(self.shared.inner.wait(ib).await?),
                    None => None,
                };
                // A kill may have decided the status meanwhile.
                return self.merged(batch, inner_status.as_ref());
            }
            if events.changed().await.is_err() {
                return Err(Error::new(ErrorKind::Internal, "event channel closed"));
            }
        }
    }

    async fn cancel(&self, batch: BatchId) -> Result<BatchStatus> {
        let (inner, done, _) = self.entry_view(batch)?;
        if let Some(d) = done {
            return Ok(d);
        }
        let inner_status = match inner {
            Some(ib) => Some(self.shared.inner.cancel(ib).await?),
            None => None,
        };
        let status = {
            let mut st = self.shared.state.lock();
            let e = st.batches.get_mut(&batch.0).ok_or_else(|| Error::unknown_batch(batch))?;
            if let Some(d) = &e.done {
                d.clone()
            } else {
                let s = e.merge(inner_status.as_ref(), Some(&RequestStatus::Cancelled))?;
                e.done = Some(s.clone());
                s
            }
        };
        self.shared.bump();
        Ok(status)
    }

    fn release(&self, batch: BatchId) -> Result<()> {
        let status = self.poll(batch)?;
        if !status.is_terminal() {
            return Err(Error::batch_in_progress(batch));
        }
        let inner = self.shared.state.lock().batches.get(&batch.0).and_then(|e| e.inner);
        if let Some(ib) = inner {
            self.shared.inner.release(ib)?;
        }
        self.shared.state.lock().batches.remove(&batch.0);
        Ok(())
    }

    fn stats(&self) -> ResourceStats {
        let mut s = self.shared.inner.stats();
        let st = self.shared.state.lock();
        if st.shut {
            return s;
        }
        s.batches += st.batches.values().filter(|e| e.inner.is_none()).count();
        s.inflight += st
            .batches
            .values()
            .filter(|e| e.done.is_none())
            .map(|e| e.slots.iter().filter(|s| matches!(s, Slot::Withheld)).count())
            .sum::<usize>();
        drop(st);
        let mut tasks = self.tasks.lock();
        while tasks.try_join_next().is_some() {}
        s.tasks += tasks.len();
        s
    }

    async fn notify(&self, segment: SegmentId, msg: Vec<u8>) -> Result<()> {
        self.check(true)?;
        self.shared.inner.notify(segment, msg).await
    }

    fn take_notifications(&self, max: usize) -> Result<Vec<transport_core::Notification>> {
        self.check(false)?;
        self.shared.inner.take_notifications(max)
    }

    async fn wait_notification(&self) -> Result<()> {
        self.check(false)?;
        self.shared.inner.wait_notification().await
    }

    async fn shutdown(&self) -> Result<()> {
        let mut tasks = std::mem::take(&mut *self.tasks.lock());
        tasks.abort_all();
        while tasks.join_next().await.is_some() {}
        {
            let mut st = self.shared.state.lock();
            st.shut = true;
            st.batches.clear();
            st.segments.clear();
        }
        self.shared.bump();
        self.shared.inner.shutdown().await
    }
}
