//! A submitted batch: its requests, their local regions, and its
//! [`BatchLedger`] (units = slices), which alone decides statuses: sticky,
//! reported terminal only when no slice of the request is on the wire.
//!
//! A lane calls [`Batch::start`] (the ledger's `start`) before a slice
//! touches memory and [`Batch::slice_done`] once the slice has ended:
//! answered by the peer, or failed when its endpoint was destroyed (after
//! the lane tasks were joined and the sockets closed). Slices never started
//! need no accounting: a decided request is terminal once its started
//! slices have ended. So once a request is reported terminal no task still
//! copies into or out of its buffer.

use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::watch;
use transport_core::lifecycle::{BatchLedger, EndReason, Progress};
use transport_core::{BatchStatus, Error, Result, TransferRequest};

use transport_core::lifecycle::DeadlineKey;

use crate::deadlines::Deadlines;
use crate::regions::Region;

/// One batch.
#[derive(Debug)]
pub(crate) struct Batch {
    pub reqs: Vec<TransferRequest>,
    /// The local region of each request (kept alive; copies go through its
    /// gate).
    pub locals: Vec<Arc<Region>>,
    ledger: Mutex<BatchLedger>,
    terminal: watch::Sender<bool>,
    /// Its entry in the transport's deadline table while it is live.
    deadline: Mutex<Option<(Weak<Deadlines<Batch>>, DeadlineKey)>>,
    /// Names of the endpoints that carry its slices.
    pub peers: Vec<String>,
    /// The endpoints its slices went to, for a caller polling it
    /// ([`Batch::progress`]).
    carriers: Mutex<Vec<Weak<dyn Carrier>>>,
    /// Callers polling it now, and the lanes they hushed ([`Batch::polling`]).
    polled: Mutex<Polled>,
}

/// Who polls a batch ([`Batch::polling`]).
#[derive(Debug, Default)]
struct Polled {
    callers: u32,
    /// The lanes hushed for them, per carrier (a bit per lane).
    hushed: Vec<(Weak<dyn Carrier>, u64)>,
}

impl Polled {
    /// Makes the hushed lanes loud again.
    fn end(&mut self) {
        self.callers = 0;
        for (c, lanes) in self.hushed.drain(..) {
            if let Some(ep) = c.upgrade() {
                ep.loud(lanes);
            }
        }
    }
}

impl Drop for Polled {
    /// A batch forgotten while a caller said it polls (released between
    /// its `polling` calls) leaves no lane hushed.
    fn drop(&mut self) {
        self.end();
    }
}

/// What carries a batch's slices (an endpoint): it can apply their
/// answers on the caller's thread.
pub(crate) trait Carrier: Send + Sync {
    /// Reads and applies what has already arrived, without waiting. Must
    /// be called inside the transport's tokio runtime.
    fn progress(self: Arc<Self>);

    /// A caller starts polling: the lanes with answers outstanding stop
    /// waking the runtime (`crate::hush`). Returns them, a bit per lane,
    /// for [`Carrier::loud`].
    fn hush(&self) -> u64;

    /// The caller that hushed `lanes` stopped polling.
    fn loud(&self, lanes: u64);
}

impl Batch {
    /// A batch whose request `i` is cut into `slices[i]` slices; `deadline`
    /// on the transport's clock.
    pub fn new(
        reqs: Vec<TransferRequest>,
        locals: Vec<Arc<Region>>,
        slices: impl IntoIterator<Item = u64>,
        deadline: Option<Duration>,
        peers: Vec<String>,
    ) -> Arc<Self> {
        let (terminal, _) = watch::channel(false);
        Arc::new(Self {
            reqs,
            locals,
            ledger: Mutex::new(BatchLedger::new(slices, deadline)),
            terminal,
            deadline: Mutex::new(None),
            peers,
            carriers: Mutex::new(Vec::new()),
            polled: Mutex::default(),
        })
    }

    /// Records that some of its slices go to `ep`.
    pub fn carried_by(&self, ep: Weak<dyn Carrier>) {
        self.carriers.lock().push(ep);
    }

    /// Reads the answers that have already arrived for it (and for
    /// whatever shares its endpoints' lanes) on the caller's thread,
    /// without waiting (see [`Carrier::progress`]). Must be called inside
    /// the transport's tokio runtime.
    pub fn progress(&self) {
        if self.is_terminal() {
            return;
        }
        // Polled in a caller's spin: no allocation. Nothing a carrier does
        // here takes this lock.
        for ep in self.carriers.lock().iter().filter_map(Weak::upgrade) {
            ep.progress();
        }
    }

    /// A caller starts (`true`) or stops polling the batch
    /// (`Transport::polling`): the first hushes the lanes that carry its
    /// answers, the last makes them loud again.
    pub fn polling(&self, on: bool) {
        let mut p = self.polled.lock();
        if on {
            p.callers = p.callers.saturating_add(1);
            if p.callers == 1 && !self.is_terminal() {
                // As in `progress`: no carrier takes either lock here.
                for c in self.carriers.lock().iter() {
                    if let Some(ep) = c.upgrade() {
                        let lanes = ep.hush();
                        p.hushed.push((c.clone(), lanes));
                    }
                }
            }
        } else if p.callers > 0 {
            p.callers -= 1;
            if p.callers == 0 {
                p.end();
            }
        }
    }

    /// Ends every caller's polling at once (the batch is released: a
    /// later `polling(false)` would not find it).
    pub fn polling_ends(&self) {
        self.polled.lock().end();
    }

    /// Runs `f` on the ledger; wakes waiters when the batch became terminal.
    fn apply(&self, f: impl FnOnce(&mut BatchLedger) -> Progress) -> Progress {
        let p = f(&mut self.ledger.lock());
        if p.batch_terminal {
            // Terminal first: a `set_deadline` racing this sees it after
            // entering the batch and takes it out itself.
            self.terminal.send_replace(true);
            self.forget_deadline();
        }
        p
    }

    /// Enters the batch in `deadlines`, due `at` (once, at submit). A batch
    /// already terminal is not entered.
    pub fn set_deadline(self: &Arc<Self>, deadlines: &Arc<Deadlines<Batch>>, at: Duration) {
        let mut d = self.deadline.lock();
        if self.is_terminal() {
            return;
        }
        *d = Some((Arc::downgrade(deadlines), deadlines.add(at, Arc::downgrade(self))));
        drop(d);
        // Terminal meanwhile (it took the lock after us and found nothing
        // to take out): take it out here.
        if self.is_terminal() {
            self.forget_deadline();
        }
    }

    /// Takes the batch out of the deadline table (terminal, or the
    /// transport is going away).
    pub fn forget_deadline(&self) {
        let entry = self.deadline.lock().take();
        if let Some((table, key)) = entry {
            if let Some(t) = table.upgrade() {
                t.remove(key);
            }
        }
    }

    /// A lane is about to put one slice of request `i` on the wire: `false`
    /// if the request is not live (the slice must not touch memory).
    pub fn start(&self, i: usize) -> bool {
        self.ledger.lock().start(i)
    }

    /// Whether request `i` is still live (a started slice streaming its
    /// payload stops early once it is not).
    pub fn is_live(&self, i: usize) -> bool {
        self.ledger.lock().is_live(i)
    }

    /// Whether any request is still live.
    pub fn any_live(&self) -> bool {
        self.ledger.lock().any_live()
    }

    /// A started slice of request `i` ended.
    pub fn slice_done(&self, i: usize, result: Result<()>) {
        let _ = self.apply(|l| l.unit_done(i, result));
    }

    /// A started slice of request `i` was not sent after all and may be
    /// started again (a direct write the peer's window declined).
    pub fn slice_back(&self, i: usize) {
        let _ = self.apply(|l| l.unit_back(i));
    }

    /// Ends request `i` with `reason` (first decision wins).
    pub fn end_one(&self, i: usize, reason: EndReason) {
        let _ = self.apply(|l| l.end(i, reason));
    }

    /// Ends the live requests `pick` selects; returns how many were decided
    /// by this call.
    pub fn end(&self, reason: &EndReason, mut pick: impl FnMut(&TransferRequest) -> bool) -> usize {
        let mut n = 0;
        let _ = self.apply(|l| {
            let (k, p) = l.end_where(reason, |i| self.reqs.get(i).is_some_and(&mut pick));
            n = k;
            p
        });
        n
    }

    /// Times out live requests if `now` is at or past the deadline.
    pub fn expire(&self, now: Duration) {
        let _ = self.apply(|l| l.expire(now));
    }

    /// Slices on the wire.
    pub fn on_wire(&self) -> u64 {
        self.ledger.lock().on_wire()
    }

    pub fn is_terminal(&self) -> bool {
        *self.terminal.borrow()
    }

    pub fn status(&self) -> BatchStatus {
        self.ledger.lock().status()
    }

    /// Waits until every request is terminal.
    pub async fn wait_terminal(&self) {
        let mut rx = self.terminal.subscribe();
        let _ = rx.wait_for(|t| *t).await;
    }

    /// Fails request `i` with `err` (none of its slices was started, or the
    /// ones started end on their own).
    pub fn fail(&self, i: usize, err: Error) {
        self.end_one(i, EndReason::Failed(err));
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        self.forget_deadline();
    }
}
