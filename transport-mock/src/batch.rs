//! One submitted batch: its validated requests and their statuses.
//!
//! Statuses change only under the batch lock, and copies run under the
//! same lock after checking their request is still pending, so marking a
//! request terminal (cancel, deadline, close, unregister) makes it quiet at
//! once.

use std::sync::Arc;

use parking_lot::Mutex;
use tokio::time::Instant;
use transport_core::{BatchStatus, RequestStatus, TransferRequest};

use crate::region::RegionEntry;
use crate::segment::SegmentEntry;

#[derive(Debug)]
pub(crate) struct Planned {
    pub req: TransferRequest,
    pub local: Arc<RegionEntry>,
    pub segment: Arc<SegmentEntry>,
}

#[derive(Debug)]
pub(crate) struct Batch {
    pub requests: Vec<Planned>,
    pub deadline: Option<Instant>,
    pub statuses: Mutex<Vec<RequestStatus>>,
}

impl Batch {
    pub fn new(requests: Vec<Planned>, deadline: Option<Instant>) -> Self {
        let statuses = Mutex::new(vec![RequestStatus::Pending; requests.len()]);
        Self { requests, deadline, statuses }
    }

    /// Ends pending requests `TimedOut` if the deadline passed.
    pub fn expire_if_due(&self, statuses: &mut [RequestStatus]) {
        if self.deadline.is_some_and(|d| Instant::now() >= d) {
            for s in statuses.iter_mut().filter(|s| !s.is_terminal()) {
                *s = RequestStatus::TimedOut;
            }
        }
    }

    /// A snapshot, with the deadline applied.
    pub fn status(&self) -> BatchStatus {
        let mut st = self.statuses.lock();
        self.expire_if_due(&mut st);
        BatchStatus::from_requests(st.clone())
    }

    /// The status of one request, with the deadline applied.
    pub fn status_of(&self, i: usize) -> RequestStatus {
        let mut st = self.statuses.lock();
        self.expire_if_due(&mut st);
        st.get(i).cloned().unwrap_or(RequestStatus::Cancelled)
    }

    /// Sets request `i` if it is still pending.
    pub fn finish(&self, i: usize, status: RequestStatus) {
        if let Some(s) = self.statuses.lock().get_mut(i) {
            if !s.is_terminal() {
                *s = status;
            }
        }
    }

    /// Ends every pending request for which `pick` holds with `status`;
    /// returns how many.
    pub fn end_pending(&self, mut pick: impl FnMut(&Planned) -> bool, status: &RequestStatus) -> usize {
        let mut st = self.statuses.lock();
        let mut n = 0;
        for (s, p) in st.iter_mut().zip(&self.requests) {
            if !s.is_terminal() && pick(p) {
                *s = status.clone();
                n += 1;
            }
        }
        n
    }

    pub fn pending(&self) -> usize {
        self.statuses.lock().iter().filter(|s| !s.is_terminal()).count()
    }
}
