//! Running passes of a workload against a target and checking the bytes.
//!
//! One pass moves the whole plan once in one of three ways:
//!
//! - **all-at-end**: wait for every layer's compute (`layers x delay`),
//!   then submit one batch per layer, `concurrency` in flight;
//! - **layerwise**: after each layer's compute, submit that layer's batch
//!   at once (queued behind `concurrency` batches in flight) while the next
//!   layer computes;
//! - **per-request**: every request as its own transfer, `concurrency` in
//!   flight, for per-request latency and requests per second.
//!
//! For both layer modes the pass records when the last layer was ready and
//! when the last byte landed; the difference (the tail) is what layer-by-
//! layer sending shortens. Every pass is verified (see [`Session::verify`]).
//!
//! With sessions (`--sessions true`, see [`crate::sessions`]) each unit of a
//! pass is one session: the layer passes' whole plan (one session, written
//! layer by layer; asked for when the pass starts, so the grant comes while
//! the layers compute) or each request of the per-request pass. A unit is
//! done when the initiator learns it Landed, and that is when its bytes
//! count as landed in the latencies, the tail and the bandwidth.

use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use kvmove::{Buffer, Engine, Error, ErrorKind, RegionId, SegmentId, TransferRequest};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::data::{self, Side, Verification};
use crate::plan::{Plan, Req};
use crate::sessions::{self as flow, Receiver, Sender, Unit, UnitTimes};
use crate::settings::Op;

/// The three ways a pass can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PassKind {
    AllAtEnd,
    Layerwise,
    PerRequest,
}

impl PassKind {
    pub fn name(self) -> &'static str {
        match self {
            PassKind::AllAtEnd => "all-at-end",
            PassKind::Layerwise => "layerwise",
            PassKind::PerRequest => "per-request",
        }
    }
}

/// What one pass measured.
#[derive(Debug, Clone)]
pub struct PassResult {
    pub bytes: u64,
    pub requests: u64,
    /// Latency of each batch (per-request pass: of each request), from
    /// leaving the queue to the last byte.
    pub latencies: Vec<Duration>,
    /// First submit to last byte.
    pub transfer: Duration,
    /// Last layer ready to last byte (layer modes).
    pub tail: Option<Duration>,
    /// Start of the first layer's compute to the last byte (layer modes).
    pub end_to_end: Option<Duration>,
    pub verdict: Verification,
    /// With sessions: what each unit's session measured.
    pub units: Vec<UnitTimes>,
    /// With sessions in one process (bench): the initiator's finish to the
    /// target seeing Landed, per unit (one clock).
    pub notify_delays: Vec<Duration>,
}

/// An initiator connected to a target's memory.
pub struct Session {
    pub engine: Engine,
    pub segment: SegmentId,
    pub local: RegionId,
    pub local_buf: Buffer,
    /// Where read-back lands to verify writes into a remote target.
    pub check: Option<(RegionId, Buffer)>,
    /// Address of the target's buffer in the target's address space.
    pub remote_base: u64,
    /// The target's buffer when the target lives in this process (bench):
    /// verified by reading it directly.
    pub target_buf: Option<Buffer>,
    pub op: Op,
    pub concurrency: usize,
    pub compute_delay: Duration,
    /// With sessions: the initiator's session side.
    pub flow: Option<Arc<Sender>>,
    /// With sessions in one process (bench): the target's side, which
    /// records when each session landed.
    pub receiver: Option<Receiver>,
}

impl Session {
    fn request(&self, r: &Req, op: Op, local: RegionId, segment: SegmentId) -> TransferRequest {
        let remote = self.remote_base + r.remote_off;
        match op {
            Op::Write => TransferRequest::write(local, r.local_off, segment, remote, r.len),
            Op::Read => TransferRequest::read(local, r.local_off, segment, remote, r.len),
        }
    }

    fn batch(&self, reqs: &[Req], op: Op, local: RegionId, segment: SegmentId) -> Vec<TransferRequest> {
        reqs.iter().map(|r| self.request(r, op, local, segment)).collect()
    }

    /// Moves every layer's batch with `op` between `local` and the target,
    /// `concurrency` batches at a time, unmeasured (setup and read-back).
    async fn move_all(&self, plan: &Plan, op: Op, local: RegionId) -> kvmove::Result<()> {
        let sem = Arc::new(Semaphore::new(self.concurrency));
        let mut set = JoinSet::new();
        for reqs in &plan.by_layer {
            set.spawn(send(self.engine.clone(), sem.clone(), self.batch(reqs, op, local, self.segment)));
        }
        while let Some(r) = set.join_next().await {
            joined(r)?;
        }
        Ok(())
    }

    /// Puts fresh data of `seed` at the source of the measured transfers
    /// and returns the checksum of every request's source bytes.
    pub async fn prepare(&self, plan: &Plan, seed: u64) -> kvmove::Result<Vec<u64>> {
        match (self.op, &self.target_buf) {
            (Op::Write, _) => {
                data::fill(&self.local_buf, seed)?;
                data::checksums(&self.local_buf, plan.requests(), Side::Local)
            }
            (Op::Read, Some(target)) => {
                data::fill(target, seed)?;
                data::checksums(target, plan.requests(), Side::Remote)
            }
            (Op::Read, None) => {
                // Put the data there first (unmeasured), then clear the local
                // copy so only bytes that were really read can verify.
                data::fill(&self.local_buf, seed)?;
                let expected = data::checksums(&self.local_buf, plan.requests(), Side::Local)?;
                self.move_all(plan, Op::Write, self.local).await?;
                self.local_buf.fill(0);
                Ok(expected)
            }
        }
    }

    /// Checksums the destination of every request, after the pass, and
    /// compares them with the source checksums from [`Session::prepare`].
    /// A write into a remote target is read back into a separate buffer
    /// first (unmeasured); the target's memory in this process is read
    /// directly.
    pub async fn verify(&self, plan: &Plan, expected: &[u64]) -> kvmove::Result<Verification> {
        let actual = match (self.op, &self.target_buf, &self.check) {
            (Op::Write, Some(target), _) => data::checksums(target, plan.requests(), Side::Remote)?,
            (Op::Write, None, Some((check, buf))) => {
                buf.fill(0);
                self.move_all(plan, Op::Read, *check).await?;
                data::checksums(buf, plan.requests(), Side::Local)?
            }
            (Op::Write, None, None) => {
                return Err(Error::new(ErrorKind::Internal, "no read-back buffer to verify writes with"));
            }
            (Op::Read, _, _) => data::checksums(&self.local_buf, plan.requests(), Side::Local)?,
        };
        Ok(data::compare(expected, &actual, plan.requests()))
    }

    /// Runs one measured pass (after preparing its data) and verifies it.
    pub async fn pass(&self, plan: &Plan, kind: PassKind, seed: u64, bar: &ProgressBar) -> kvmove::Result<PassResult> {
        let expected = self.prepare(plan, seed).await?;
        let mut result = match kind {
            PassKind::AllAtEnd | PassKind::Layerwise => self.layers(plan, kind, bar).await?,
            PassKind::PerRequest => self.per_request(plan, bar).await?,
        };
        if let Some(rx) = &self.receiver {
            let ids: Vec<u64> = result.units.iter().map(|u| u.id).collect();
            let seen = rx.landed_at(&ids, Duration::from_secs(1)).await;
            result.notify_delays = result
                .units
                .iter()
                .zip(seen)
                .filter_map(|(u, at)| at.map(|at| at.saturating_duration_since(u.finished_at)))
                .collect();
        }
        result.verdict = self.verify(plan, &expected).await?;
        Ok(result)
    }

    async fn layers(&self, plan: &Plan, kind: PassKind, bar: &ProgressBar) -> kvmove::Result<PassResult> {
        let sem = Arc::new(Semaphore::new(self.concurrency));
        let mut set = JoinSet::new();
        // Layer `l` is ready at `start + (l + 1) x delay` on a fixed
        // schedule: the simulated compute runs on another device (the GPU)
        // and is not slowed when this process is busy sending.
        let start = Instant::now();
        // Settings bound the delay and the layers; still, no overflow here.
        let at = |l: u32| {
            self.compute_delay.checked_mul(l).and_then(|d| start.checked_add(d)).ok_or_else(|| {
                Error::new(
                    ErrorKind::Config,
                    format!("workload.compute_delay_ms x layers is too long ({:?} x {l})", self.compute_delay),
                )
            })
        };
        let last_ready = at(plan.layers)?;
        let ready_at = |l: u32| at(l).map(tokio::time::Instant::from_std);
        // With sessions, the pass's one session is asked for now: the
        // grant comes while the layers compute.
        let mut unit = match &self.flow {
            Some(f) => Some(f.open(flow::unit_id(f.next_pass(), Unit::Plan), true).await?),
            None => None,
        };
        if kind == PassKind::AllAtEnd {
            tokio::time::sleep_until(ready_at(plan.layers)?).await;
        }
        let mut first_submit = None;
        let mut segment = self.segment;
        for (l, reqs) in (1u32..).zip(&plan.by_layer) {
            if kind == PassKind::Layerwise {
                tokio::time::sleep_until(ready_at(l)?).await;
            }
            // Waiting for a late grant counts in the transfer time.
            first_submit.get_or_insert_with(Instant::now);
            if let (Some(f), Some(u)) = (&self.flow, unit.as_mut()) {
                if !Sender::is_granted(u) {
                    segment = f.granted(u).await?;
                }
            }
            let bytes: u64 = reqs.iter().map(|r| r.len).sum();
            let batch = self.batch(reqs, self.op, self.local, segment);
            let sem = sem.clone();
            match (&self.flow, &unit) {
                (Some(f), Some(u)) => {
                    let (f, id) = (f.clone(), u.id);
                    set.spawn(async move { send_in(f, id, sem, batch).await.map(|t| (t, bytes)) });
                }
                _ => {
                    let engine = self.engine.clone();
                    set.spawn(async move { send(engine, sem, batch).await.map(|t| (t, bytes)) });
                }
            }
        }
        let first_submit = first_submit.unwrap_or(last_ready);
        let mut latencies = Vec::with_capacity(plan.by_layer.len());
        let mut last_done = last_ready;
        while let Some(r) = set.join_next().await {
            let ((began, done), bytes) = joined(r)?;
            latencies.push(done.saturating_duration_since(began));
            last_done = last_done.max(done);
            bar.inc(bytes);
        }
        let mut units = Vec::new();
        if let (Some(f), Some(u)) = (&self.flow, unit) {
            let t = f.land(u).await?;
            last_done = last_done.max(t.landed_at);
            units.push(t);
        }
        Ok(PassResult {
            bytes: plan.total_bytes,
            requests: plan.total_requests as u64,
            latencies,
            transfer: last_done.saturating_duration_since(first_submit),
            tail: Some(last_done.saturating_duration_since(last_ready)),
            end_to_end: Some(last_done.saturating_duration_since(start)),
            verdict: Verification::default(),
            units,
            notify_delays: Vec::new(),
        })
    }

    async fn per_request(&self, plan: &Plan, bar: &ProgressBar) -> kvmove::Result<PassResult> {
        let sem = Arc::new(Semaphore::new(self.concurrency));
        let mut set = JoinSet::new();
        let start = Instant::now();
        let serial = self.flow.as_ref().map(|f| f.next_pass()).unwrap_or(0);
        for (i, r) in plan.requests().enumerate() {
            let (sem, len) = (sem.clone(), r.len);
            match &self.flow {
                Some(f) => {
                    let (f, id, r, local, base) =
                        (f.clone(), flow::unit_id(serial, Unit::Request(i)), *r, self.local, self.remote_base);
                    set.spawn(async move {
                        let _permit = sem
                            .acquire_owned()
                            .await
                            .map_err(|_| Error::new(ErrorKind::Internal, "the in-flight limit was closed"))?;
                        let began = Instant::now();
                        let mut u = f.open(id, false).await?;
                        let seg = f.granted(&mut u).await?;
                        let req = TransferRequest::write(local, r.local_off, seg, base + r.remote_off, r.len);
                        f.write(id, vec![req]).await?;
                        let t = f.land(u).await?;
                        Ok(((began, t.landed_at), len, Some(t)))
                    });
                }
                None => {
                    let batch = vec![self.request(r, self.op, self.local, self.segment)];
                    let engine = self.engine.clone();
                    set.spawn(async move { send(engine, sem, batch).await.map(|t| (t, len, None)) });
                }
            }
        }
        let mut latencies = Vec::with_capacity(plan.total_requests);
        let mut units = Vec::new();
        let mut last_done = start;
        while let Some(r) = set.join_next().await {
            let ((began, done), bytes, unit) = joined(r)?;
            latencies.push(done.saturating_duration_since(began));
            last_done = last_done.max(done);
            bar.inc(bytes);
            units.extend(unit);
        }
        Ok(PassResult {
            bytes: plan.total_bytes,
            requests: plan.total_requests as u64,
            latencies,
            transfer: last_done.saturating_duration_since(start),
            tail: None,
            end_to_end: None,
            verdict: Verification::default(),
            units,
            notify_delays: Vec::new(),
        })
    }
}

/// Waits for a slot, runs one transfer to the end and returns when it left
/// the queue and when it finished. Any request that did not complete is
/// an error (the engine already retried what was transient).
async fn send(engine: Engine, sem: Arc<Semaphore>, batch: Vec<TransferRequest>) -> kvmove::Result<(Instant, Instant)> {
    let _permit =
        sem.acquire_owned().await.map_err(|_| Error::new(ErrorKind::Internal, "the in-flight limit was closed"))?;
    let began = Instant::now();
    engine.submit(batch).await?.wait().await?.into_result()?;
    Ok((began, Instant::now()))
}

/// [`send`] as a write of the session `id` (checked against its grant).
async fn send_in(
    flow: Arc<Sender>,
    id: u64,
    sem: Arc<Semaphore>,
    batch: Vec<TransferRequest>,
) -> kvmove::Result<(Instant, Instant)> {
    let _permit =
        sem.acquire_owned().await.map_err(|_| Error::new(ErrorKind::Internal, "the in-flight limit was closed"))?;
    let began = Instant::now();
    flow.write(id, batch).await?;
    Ok((began, Instant::now()))
}

/// A task's result, with a panic or abort turned into an error.
fn joined<T>(r: Result<kvmove::Result<T>, tokio::task::JoinError>) -> kvmove::Result<T> {
    match r {
        Ok(r) => r,
        Err(e) => Err(Error::new(ErrorKind::Internal, format!("a transfer task stopped: {e}"))),
    }
}
