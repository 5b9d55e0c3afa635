//! The rails' shared state: the rails and their paths, regions, open
//! segments and batches, behind one lock; small helpers over it.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use transport_core::Epoch;

use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use transport_core::lifecycle::{BatchLedger, BatchLimits, BatchTable, DeadlineKey, DeadlineQueue, OwnedTask, TaskSet};
use transport_core::{BatchId, Capabilities, Error, ErrorKind, RegionId, SegmentId, TransferRequest, Transport};

use crate::paths::{NearList, PathHealth, RailList, RailsConfig, Reachability};
use crate::topology::Topology;

pub(crate) struct Inner {
    /// The rails, then the fallback (index `rails.len()`), if any.
    pub(crate) all: Vec<Arc<dyn Transport>>,
    pub(crate) rails: usize,
    pub(crate) cfg: RailsConfig,
    pub(crate) name: String,
    pub(crate) epoch: Epoch,
    /// Per transport: the most requests one of its batches may hold.
    pub(crate) max_batch: Vec<usize>,
    /// Where each rail's NIC sits, when regions keep to their nearest.
    pub(crate) topology: Option<Topology>,
    /// The rails (and fallback) rail 0 advertises, when it advertises
    /// (more than one rail, or a fallback).
    pub(crate) list: Option<RailList>,
    /// Set once more regions kept to some rails than rail 0 can list.
    pub(crate) near_capped: std::sync::atomic::AtomicBool,
    pub(crate) state: Mutex<State>,
    pub(crate) tasks: TaskSet,
    /// Woken whenever a driver accounted for finished work.
    pub(crate) settled: Notify,
    /// Woken when an earlier deadline enters the queue, and at shutdown.
    pub(crate) earlier: Arc<Notify>,
    /// The one deadline timer (`drive::timer`); dropped (aborted) at
    /// shutdown and with the rails.
    pub(crate) timer: Mutex<Option<OwnedTask>>,
    /// Paths that could not be used, per peer (logged once each).
    pub(crate) reach: Mutex<Reachability>,
}

pub(crate) struct State {
    pub(crate) shutdown: bool,
    pub(crate) regions: BTreeMap<RegionId, Region>,
    pub(crate) segments: HashMap<SegmentId, Seg>,
    pub(crate) batches: BatchTable<Batch>,
    /// The deadlines of live batches: the timer wakes a batch's driver when
    /// its deadline comes (rule 5), one timer for every batch.
    pub(crate) deadlines: DeadlineQueue<BatchId>,
    pub(crate) next_region: u64,
    pub(crate) next_segment: u64,
}

pub(crate) struct Region {
    /// Its id on every transport (rails, then the fallback).
    pub(crate) ids: Vec<RegionId>,
    pub(crate) addr: u64,
    pub(crate) len: u64,
    /// The rails its bytes go over while one of their paths is up: bit
    /// `k` for rail `k` (every bit without a topology).
    pub(crate) near: u32,
    /// Whether peers may reach it (then rail 0 advertises its `near`).
    pub(crate) remote: bool,
}

pub(crate) struct Seg {
    /// The peer's name (as opened).
    pub(crate) name: String,
    /// Rail 0's handle used for the descriptor and notifications.
    pub(crate) control: SegmentId,
    pub(crate) paths: Vec<Path>,
    pub(crate) closing: bool,
    /// Rail 0's control handle is being opened again (the peer restarted:
    /// [`Inner::refresh_control`]).
    pub(crate) refreshing: bool,
    /// The rails of the peer nearest each of its regions, as its rail 0
    /// descriptor last said ([`NearList`]), and that descriptor's address.
    pub(crate) peer_near: NearList,
    pub(crate) peer_address: String,
}

pub(crate) struct Path {
    /// Transport index (`rails` for the fallback).
    pub(crate) k: usize,
    pub(crate) peer: Option<usize>,
    pub(crate) seg: SegmentId,
    pub(crate) fallback: bool,
    pub(crate) health: PathHealth,
    /// Sub-batches of every batch in flight on it, and their bytes.
    pub(crate) subs: usize,
    pub(crate) inflight: u64,
    pub(crate) bytes: u64,
    pub(crate) failures: u64,
}

pub(crate) struct Batch {
    pub(crate) ledger: BatchLedger,
    /// Per request: its segment and local region.
    pub(crate) targets: Vec<(SegmentId, RegionId)>,
    pub(crate) wake: Arc<Notify>,
    pub(crate) done: Arc<Notify>,
    /// Set by cancel / shutdown: the driver cancels what is on the rails.
    pub(crate) stop: bool,
    pub(crate) driver: Option<JoinHandle<()>>,
    /// Its place in [`State::deadlines`], until the timer took it out.
    pub(crate) deadline: Option<DeadlineKey>,
}

/// A piece of a request, handed to one path at a time.
#[derive(Debug, Clone)]
pub(crate) struct Slice {
    pub(crate) req: usize,
    pub(crate) off: u64,
    pub(crate) len: u64,
    pub(crate) tries: u32,
}

/// A sub-batch planned for one path.
pub(crate) struct Sub {
    pub(crate) seg: SegmentId,
    pub(crate) path: usize,
    pub(crate) k: usize,
    pub(crate) slices: Vec<Slice>,
    pub(crate) bytes: u64,
}

pub(crate) struct Plan {
    pub(crate) sub: Sub,
    pub(crate) requests: Vec<TransferRequest>,
    pub(crate) timeout: Option<Duration>,
}

/// What a step of a driver decided under the lock.
pub(crate) struct Step {
    pub(crate) plans: Vec<Plan>,
    pub(crate) terminal: bool,
    /// Cancel what is on the rails (stop or deadline).
    pub(crate) cancel: bool,
}

/// Whether a rail's failure is the path's, so its slices may go over
/// another path: a peer or link failure (not a peer restart: the caller
/// must re-read the peer), or a rail that shut itself down (a device that
/// failed for good). When `Rails` itself shuts down its requests are
/// already decided, so nothing is reposted.
pub(crate) fn transient_path_failure(e: &Error) -> bool {
    (e.kind().is_peer_failure() && e.kind() != ErrorKind::PeerRestarted) || e.kind() == ErrorKind::Shutdown
}

/// Describes the rails' metric to the installed recorder.
pub fn describe_metrics() {
    metrics::describe_counter!(
        "kvmove_rail_events_total",
        "Rail events, by event: paused (a path paused after failures), resumed (a path back after its probe), \
         fallback (traffic moved over the fallback), unreachable (a path to a peer found unusable at its \
         opening: no route, or no shared subnet; once until it works again)."
    );
    metrics::describe_gauge!(
        "kvmove_rail_paths_unreachable",
        "Paths (a local rail to a peer's rail) not used because they could not be, over every peer, as of each \
         peer's last opening."
    );
}

impl Inner {
    /// One opening of `peer`: its candidate paths and why each that cannot
    /// be used cannot. Each such path is logged once (until it works
    /// again) with its reason; the metrics count them.
    pub(crate) fn reached(&self, peer: &str, paths: &[(usize, usize, Option<String>)]) {
        let mut reach = self.reach.lock();
        for (rail, peer_rail, why) in reach.opened(peer, paths) {
            let why = why.as_deref().unwrap_or_default();
            tracing::warn!(%peer, rail, peer_rail, reason = why, "rails: a path to the peer is not used (logged once)");
            rail_event("unreachable");
        }
        metrics::gauge!("kvmove_rail_paths_unreachable").set(reach.unusable_total() as f64);
    }
}

pub(crate) fn rail_event(event: &'static str) {
    metrics::counter!("kvmove_rail_events_total", "event" => event).increment(1);
}

impl Inner {
    pub(crate) fn now(&self) -> Duration {
        self.epoch.now()
    }

    pub(crate) fn limits(&self) -> BatchLimits {
        let caps = self.caps();
        BatchLimits { max_batch_len: caps.max_batch_len, max_request_len: caps.max_request_len }
    }

    pub(crate) fn caps(&self) -> Capabilities {
        let mut c = self.all[0].capabilities();
        for t in &self.all[1..] {
            let o = t.capabilities();
            c.max_endpoints = c.max_endpoints.saturating_add(o.max_endpoints);
            c.max_request_len = c.max_request_len.min(o.max_request_len);
            c.read &= o.read;
            c.write &= o.write;
            c.device_memory &= o.device_memory;
            c.device_memory_remote &= o.device_memory_remote;
        }
        c
    }

    pub(crate) fn label(&self, p: &Path) -> String {
        match p.peer {
            _ if p.fallback => "tcp fallback".to_string(),
            Some(j) => format!("rail {} -> peer rail {j}", p.k),
            None => format!("rail {}", p.k),
        }
    }
}
