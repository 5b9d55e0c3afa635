"""The engine's metrics: ``kvmove.metrics()`` and ``kvmove.register_prometheus()``.

The Rust engine emits its metrics through the ``metrics`` facade; the first
engine of any API (``kvmove.Engine``, the Mooncake ``TransferEngine``, the
NIXL agent) installs an in-memory recorder, once per process. The values
are process-wide: every engine of the process adds to the same series
(``peer`` labels tell the peers apart).
"""

import logging
import os
import threading
import weakref
from typing import Any, Dict, List, Optional

from . import _native

logger = logging.getLogger("kvmove")


def _labels_key(labels: Dict[str, str]):
    return tuple(sorted(labels.items()))


def _snapshot():
    """``(families, help)``: ``families`` maps each name to ``(type,
    samples)`` sorted by labels, ``type`` one of counter, gauge, histogram."""
    counters, gauges, histograms, described = _native.metrics_snapshot()
    families: Dict[str, Any] = {}
    for name, labels, value in counters:
        families.setdefault(name, ("counter", []))[1].append({"labels": dict(labels), "value": value})
    for name, labels, value in gauges:
        families.setdefault(name, ("gauge", []))[1].append({"labels": dict(labels), "value": value})
    for name, labels, count, total, buckets in histograms:
        families.setdefault(name, ("histogram", []))[1].append(
            {"labels": dict(labels), "count": count, "sum": total, "buckets": buckets}
        )
    for _, samples in families.values():
        samples.sort(key=lambda s: _labels_key(s["labels"]))
    return dict(sorted(families.items())), dict(described)


def metrics() -> Dict[str, List[Dict[str, Any]]]:
    """The engine's metrics now (process-wide), by metric name, sorted::

        {
            "kvmove_bytes_total": [
                {"labels": {"op": "write", "peer": "127.0.0.1:40123"}, "value": 4096},
            ],
            "kvmove_inflight_bytes": [{"labels": {}, "value": 0.0}],
            "kvmove_transfer_seconds": [
                {"labels": {"state": "completed"}, "count": 3, "sum": 0.00042,
                 "buckets": [(1e-05, 0), (2.5e-05, 1), ..., (inf, 3)]},
            ],
        }

    Each name maps to its series, one dict per label set (``labels``: label
    name to value, ``{}`` for none), sorted by labels. Counters (names
    ending ``_total``) have an exact integer ``value``; gauges a float
    ``value``; histograms (names ending ``_seconds``) a ``count`` (int), a
    ``sum`` (float) and ``buckets``: ``(upper bound, cumulative count)``
    pairs, Prometheus's ``le`` buckets, the last bound ``math.inf`` with
    ``count``. A series appears once it was first touched.

    Installs kvmove's recorder if no engine did yet. Raises
    ``RuntimeError`` if another ``metrics`` recorder was installed in this
    process first (the engine then reports to that one).
    """
    families, _ = _snapshot()
    return {name: samples for name, (_, samples) in families.items()}


class _Collector:
    """A ``prometheus_client`` collector: the engine's metrics as metric
    families on each scrape."""

    def __init__(self, prometheus_client):
        from prometheus_client.metrics_core import Metric
        from prometheus_client.utils import floatToGoString

        self._metric = Metric
        self._le = floatToGoString  # as prometheus_client writes `le`
        self._warned = False

    def describe(self):
        # The series appear as the engine runs: nothing to check at
        # registration (an empty describe keeps the registry from calling
        # collect() then).
        return []

    def collect(self):
        Metric, le_str = self._metric, self._le
        try:
            families, described = _snapshot()
        except RuntimeError as e:
            # A scrape must not fail because of kvmove: say it once, show nothing.
            if not self._warned:
                self._warned = True
                logger.warning("kvmove metrics are not exported: %s", e)
            return
        for name, (kind, samples) in families.items():
            # The engine describes every name it emits (Rust, `describe_metrics`).
            doc = described.get(name) or f"kvmove metric {name}."
            if kind == "counter":
                # A counter family is named without `_total`, its samples
                # with it (as prometheus_client's CounterMetricFamily).
                family = name[: -len("_total")] if name.endswith("_total") else name
                m = Metric(family, doc, kind)
                for s in samples:
                    m.add_sample(family + "_total", s["labels"], float(s["value"]))
            elif kind == "gauge":
                m = Metric(name, doc, kind)
                for s in samples:
                    m.add_sample(name, s["labels"], float(s["value"]))
            else:
                m = Metric(name, doc, kind)
                for s in samples:
                    for le, n in s["buckets"]:
                        m.add_sample(name + "_bucket", {**s["labels"], "le": le_str(le)}, float(n))
                    m.add_sample(name + "_count", s["labels"], float(s["count"]))
                    m.add_sample(name + "_sum", s["labels"], float(s["sum"]))
            yield m


_lock = threading.Lock()
_collector: Optional[_Collector] = None
_registered: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _import_prometheus_client():
    try:
        import prometheus_client
    except ImportError as e:
        raise ImportError(
            "kvmove.register_prometheus() needs the prometheus_client package: pip install prometheus_client"
        ) from e
    return prometheus_client


def register_prometheus(registry=None):
    """Registers a ``prometheus_client`` collector that shows the engine's
    metrics on each scrape: counters as counters, gauges as gauges,
    histograms as histograms (same names and labels as :func:`metrics`).

    ``registry`` defaults to ``prometheus_client.REGISTRY``, the one a
    serving engine's ``/metrics`` (``generate_latest()``,
    ``start_http_server``, ``make_asgi_app``) exposes. Registering again
    with the same registry does nothing. Returns the collector (for
    ``registry.unregister``). Raises ``ImportError`` if prometheus_client is
    not installed. If another ``metrics`` recorder holds the place (see
    :func:`metrics`), a scrape logs a warning once and shows no kvmove
    series.
    """
    global _collector
    pc = _import_prometheus_client()
    if registry is None:
        registry = pc.REGISTRY
    with _lock:
        if _collector is None:
            _collector = _Collector(pc)
        # prometheus_client's registry knows its collectors (a private
        # table); else remember the registries registered with here.
        known = getattr(registry, "_collector_to_names", None)
        try:
            already = _collector in known if known is not None else registry in _registered
        except TypeError:
            already = registry in _registered
        if not already:
            registry.register(_collector)
            try:
                _registered.add(registry)
            except TypeError:
                pass
        return _collector


_served: Optional[str] = None


def _parse_addr(value: str):
    """``(host, port)`` from ``host:port``, ``[v6]:port`` or ``port``."""
    text = value.strip()
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", text
    host = host.strip("[]") or "127.0.0.1"
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not 0 <= number <= 65535:
        raise ValueError(f"KVMOVE_METRICS_ADDR={value!r}: expected host:port or port (0-65535)")
    return host, number


def serve_metrics(addr: str) -> Optional[str]:
    """Serves the engine's metrics in Prometheus's text format on
    ``http://addr/metrics`` from a daemon thread (prometheus_client's own
    server, on a registry holding only kvmove's series), once per process.

    ``addr`` is ``host:port`` or ``port`` (host ``127.0.0.1``); port 0 picks
    a free one. Returns the address served (``host:port``), the one of the
    first call if the process already serves, or ``None`` when the server
    could not start (logged on logger ``kvmove``: another process of the
    same server may hold the port). Raises ``ValueError`` for an address
    that is not one, ``ImportError`` without prometheus_client.

    Serving engines run their transfer engine in a worker process whose
    metrics their own ``/metrics`` does not show; setting
    ``KVMOVE_METRICS_ADDR`` makes the first kvmove engine of each process
    call this (see the README).
    """
    global _served
    host, port = _parse_addr(addr)
    pc = _import_prometheus_client()
    with _lock:
        if _served is not None:
            return _served
        registry = pc.CollectorRegistry(auto_describe=False)
        registry.register(_Collector(pc))
        try:
            started = pc.start_http_server(port, addr=host, registry=registry)
        except OSError as e:
            logger.warning("kvmove metrics not served on %s:%d: %s", host, port, e)
            return None
        # prometheus_client >= 0.17 returns (server, thread): the bound port.
        if isinstance(started, tuple) and hasattr(started[0], "server_address"):
            port = started[0].server_address[1]
        _served = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        logger.info("kvmove metrics on http://%s/metrics (pid %d)", _served, os.getpid())
        return _served


def serve_metrics_from_env() -> Optional[str]:
    """Calls :func:`serve_metrics` with ``KVMOVE_METRICS_ADDR`` when it is
    set (every engine's constructor calls this); ``None`` when it is not."""
    value = os.environ.get("KVMOVE_METRICS_ADDR", "").strip()
    if not value:
        return None
    return serve_metrics(value)
