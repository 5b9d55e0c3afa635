//! The engine's metrics for Python (`kvmove.metrics()`,
//! `kvmove.register_prometheus()`).
//!
//! The engine and the TCP server emit through the `metrics` facade, a no-op
//! until a recorder is installed. The first engine of any of the three
//! Python APIs installs ([`install`], once per process) a recorder that
//! keeps every value in memory: counters and gauges as atomics, histograms
//! as fixed buckets with an exact count and sum (no samples kept, so memory
//! is bounded by the number of series). A snapshot ([`metrics_snapshot`])
//! visits the registry without blocking the data path; the Python side
//! shapes it into a dict or into Prometheus metric families.
//!
//! The recorder is global to this extension module (it links its own copy
//! of the `metrics` crate), so another extension's recorder cannot take its
//! place; if something in this module installed one first, the snapshot
//! says so instead of returning nothing silently.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use metrics::{Counter, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use metrics_util::registry::{Registry, Storage};
use parking_lot::Mutex;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

/// Upper bounds (seconds) of the buckets of every `*_seconds` histogram:
/// 1 us (a stage of a transfer) to a minute (a deadline).
const SECONDS_BOUNDS: &[f64] = &[
    0.000_001,
    0.000_002_5,
    0.000_005,
    0.000_01,
    0.000_025,
    0.000_05,
    0.000_1,
    0.000_25,
    0.000_5,
    0.001,
    0.002_5,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
];

/// Upper bounds of any other histogram (sizes, counts): powers of 4 from 1
/// to 4^16 (about 4.3e9).
const OTHER_BOUNDS: &[f64] = &[
    1.0,
    4.0,
    16.0,
    64.0,
    256.0,
    1024.0,
    4096.0,
    16384.0,
    65536.0,
    262_144.0,
    1_048_576.0,
    4_194_304.0,
    16_777_216.0,
    67_108_864.0,
    268_435_456.0,
    1_073_741_824.0,
    4_294_967_296.0,
];

/// The bucket bounds of the histogram `name`.
fn bounds_for(name: &str) -> &'static [f64] {
    if name.ends_with("_seconds") {
        SECONDS_BOUNDS
    } else {
        OTHER_BOUNDS
    }
}

/// A histogram with fixed buckets: a count per bucket (not cumulative; the
/// last one is `+Inf`) and the sum of the values, all atomics. Recording
/// is a binary search over about 20 bounds and two atomic updates.
#[derive(Debug)]
pub(crate) struct Buckets {
    bounds: &'static [f64],
    counts: Box<[AtomicU64]>,
    sum_bits: AtomicU64,
}

impl Buckets {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_bits: AtomicU64::new(0f64.to_bits()),
        }
    }

    /// `(count, sum, [(upper bound, cumulative count)])`, the last bound
    /// being `+Inf` with the count of every value. The count is the sum of
    /// the buckets, so it always equals the `+Inf` bucket even while values
    /// are being recorded.
    fn read(&self) -> (u64, f64, Vec<(f64, u64)>) {
        let mut cumulative = 0u64;
        let mut out = Vec::with_capacity(self.counts.len());
        for (i, c) in self.counts.iter().enumerate() {
            cumulative = cumulative.saturating_add(c.load(Ordering::Relaxed));
            out.push((self.bounds.get(i).copied().unwrap_or(f64::INFINITY), cumulative));
        }
        (cumulative, f64::from_bits(self.sum_bits.load(Ordering::Relaxed)), out)
    }
}

impl HistogramFn for Buckets {
    fn record(&self, value: f64) {
        // NaN has no bucket and would poison the sum: not recorded.
        if value.is_nan() {
            return;
        }
        // The first bucket whose bound is >= value (Prometheus's `le`).
        let i = self.bounds.partition_point(|&b| b < value);
        if let Some(c) = self.counts.get(i) {
            c.fetch_add(1, Ordering::Relaxed);
        }
        let _ = self
            .sum_bits
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| Some((f64::from_bits(bits) + value).to_bits()));
    }
}

/// Storage of the registry: atomics, and [`Buckets`] for histograms.
#[derive(Debug)]
struct BucketStorage;

impl Storage<Key> for BucketStorage {
    type Counter = Arc<AtomicU64>;
    type Gauge = Arc<AtomicU64>;
    type Histogram = Arc<Buckets>;

    fn counter(&self, _: &Key) -> Self::Counter {
        Arc::new(AtomicU64::new(0))
    }

    fn gauge(&self, _: &Key) -> Self::Gauge {
        Arc::new(AtomicU64::new(0f64.to_bits()))
    }

    fn histogram(&self, key: &Key) -> Self::Histogram {
        Arc::new(Buckets::new(bounds_for(key.name())))
    }
}

/// The recorder: every series in a sharded registry, and the descriptions
/// given with `describe_*!` (the Prometheus `HELP` text).
#[derive(Debug)]
pub(crate) struct Store {
    registry: Registry<Key, BucketStorage>,
    help: Mutex<HashMap<String, String>>,
}

impl Store {
    fn new() -> Self {
        Self { registry: Registry::new(BucketStorage), help: Mutex::new(HashMap::new()) }
    }

    fn describe(&self, key: KeyName, description: SharedString) {
        self.help.lock().insert(key.as_str().to_owned(), description.into_owned());
    }
}

impl Recorder for Store {
    fn describe_counter(&self, key: KeyName, _unit: Option<Unit>, description: SharedString) {
        self.describe(key, description);
    }

    fn describe_gauge(&self, key: KeyName, _unit: Option<Unit>, description: SharedString) {
        self.describe(key, description);
    }

    fn describe_histogram(&self, key: KeyName, _unit: Option<Unit>, description: SharedString) {
        self.describe(key, description);
    }

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        self.registry.get_or_create_counter(key, |c| Counter::from_arc(c.clone()))
    }

    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        self.registry.get_or_create_gauge(key, |g| Gauge::from_arc(g.clone()))
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        self.registry.get_or_create_histogram(key, |h| Histogram::from_arc(h.clone()))
    }
}

static STORE: OnceLock<Store> = OnceLock::new();
static INSTALLED: OnceLock<Result<&'static Store, String>> = OnceLock::new();

/// Installs the in-memory recorder as the global `metrics` recorder, once
/// per process (later calls return the first call's result): the store, or
/// why it could not be installed.
pub(crate) fn install() -> Result<&'static Store, String> {
    INSTALLED
        .get_or_init(|| {
            let store: &'static Store = STORE.get_or_init(Store::new);
            metrics::set_global_recorder(store).map(|()| kvmove::describe_metrics()).map(|()| store).map_err(|_| {
                "kvmove metrics are unavailable: another `metrics` recorder was installed in this \
                 process before kvmove's, so the engine's metrics go to that recorder"
                    .to_owned()
            })
        })
        .clone()
}

type Labels = Vec<(String, String)>;
type Scalars<T> = Vec<(String, Labels, T)>;
type Histograms = Vec<(String, Labels, u64, f64, Vec<(f64, u64)>)>;

fn labels_of(key: &Key) -> Labels {
    key.labels().map(|l| (l.key().to_owned(), l.value().to_owned())).collect()
}

/// Every series now, unsorted: `(counters, gauges, histograms, help)`,
/// counters as `(name, labels, value)`, gauges likewise with a float value,
/// histograms as `(name, labels, count, sum, [(upper bound, cumulative
/// count)])` ending with `+Inf`, and help as `(name, description)` for the
/// names given a description. Installs the recorder if no engine did yet;
/// raises `RuntimeError` if another recorder holds the place.
#[pyfunction]
#[allow(clippy::type_complexity)]
pub(crate) fn metrics_snapshot(
    py: Python<'_>,
) -> PyResult<(Scalars<u64>, Scalars<f64>, Histograms, Vec<(String, String)>)> {
    let store = install().map_err(PyRuntimeError::new_err)?;
    Ok(py.allow_threads(|| snapshot(store)))
}

#[allow(clippy::type_complexity)]
fn snapshot(store: &Store) -> (Scalars<u64>, Scalars<f64>, Histograms, Vec<(String, String)>) {
    let mut counters = Vec::new();
    store.registry.visit_counters(|k, c| {
        counters.push((k.name().to_owned(), labels_of(k), c.load(Ordering::Relaxed)));
    });
    let mut gauges = Vec::new();
    store.registry.visit_gauges(|k, g| {
        gauges.push((k.name().to_owned(), labels_of(k), f64::from_bits(g.load(Ordering::Relaxed))));
    });
    let mut histograms = Vec::new();
    store.registry.visit_histograms(|k, h| {
        let (count, sum, buckets) = h.read();
        histograms.push((k.name().to_owned(), labels_of(k), count, sum, buckets));
    });
    let help = store.help.lock().iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    (counters, gauges, histograms, help)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_count_sum_and_le() {
        let b = Buckets::new(SECONDS_BOUNDS);
        for v in [0.000_01, 0.000_02, 0.003, 100.0, f64::NAN] {
            b.record(v);
        }
        let (count, sum, buckets) = b.read();
        assert_eq!(count, 4, "NaN is not recorded");
        assert!((sum - 100.00303).abs() < 1e-9, "{sum}");
        assert_eq!(buckets.len(), SECONDS_BOUNDS.len() + 1);
        // 10 us is in its own bucket (le is inclusive), 20 us in the next.
        assert_eq!(buckets[2], (0.000_005, 0));
        assert_eq!(buckets[3], (0.000_01, 1));
        assert_eq!(buckets[4], (0.000_025, 2));
        let le_5ms = buckets.iter().find(|(le, _)| *le == 0.005).map(|&(_, n)| n);
        assert_eq!(le_5ms, Some(3));
        assert_eq!(buckets[SECONDS_BOUNDS.len() - 1], (60.0, 3));
        assert_eq!(buckets[SECONDS_BOUNDS.len()], (f64::INFINITY, 4));
    }

    #[test]
    fn bounds_are_increasing() {
        for bounds in [SECONDS_BOUNDS, OTHER_BOUNDS] {
            assert!(bounds.windows(2).all(|w| w[0] < w[1]));
        }
        assert_eq!(bounds_for("kvmove_transfer_seconds"), SECONDS_BOUNDS);
        assert_eq!(bounds_for("kvmove_batch_requests"), OTHER_BOUNDS);
    }

    #[test]
    fn store_keeps_series_by_labels() {
        let store = Store::new();
        metrics::with_local_recorder(&store, || {
            metrics::counter!("t_bytes_total", "op" => "write").increment(4096);
            metrics::counter!("t_bytes_total", "op" => "write").increment(1);
            metrics::counter!("t_bytes_total", "op" => "read").increment(7);
            metrics::gauge!("t_inflight").set(2.5);
            metrics::histogram!("t_seconds").record(0.5);
            metrics::describe_counter!("t_bytes_total", "bytes moved");
        });
        let (mut counters, gauges, histograms, help) = snapshot(&store);
        counters.sort();
        let op = |v: &str| vec![("op".to_owned(), v.to_owned())];
        assert_eq!(
            counters,
            vec![("t_bytes_total".to_owned(), op("read"), 7), ("t_bytes_total".to_owned(), op("write"), 4097)]
        );
        assert_eq!(gauges, vec![("t_inflight".to_owned(), vec![], 2.5)]);
        assert_eq!(histograms.len(), 1);
        assert_eq!((histograms[0].2, histograms[0].3), (1, 0.5));
        assert_eq!(help, vec![("t_bytes_total".to_owned(), "bytes moved".to_owned())]);
    }

    /// The only test that touches the global recorder: one installed first
    /// makes ours refuse with a message, every time.
    #[test]
    fn another_recorder_first_is_reported() {
        let other: &'static Store = Box::leak(Box::new(Store::new()));
        let _ = metrics::set_global_recorder(other);
        let first = install();
        let msg = first.as_ref().err().cloned().unwrap_or_default();
        assert!(msg.contains("another `metrics` recorder"), "{msg}");
        assert_eq!(install().err(), Some(msg));
    }
}
