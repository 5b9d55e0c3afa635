"""The connector's numbers in vLLM's own stats and Prometheus metrics.

Each worker records every handoff session that ended (its role, its
outcome, the bytes it moved when it landed) and, on the prefill, how long
it waited for the decode's grant and the *exposed transfer time*: from the
last layer computed to the session landed, the part of the transfer the
prefill's compute did not hide. vLLM collects them after each step
(``get_kv_connector_stats``), sums them over the workers, logs them with
its throughput line and exports them on ``/metrics``:

- ``vllm:kvmove_sessions_total{role, outcome}``: handoffs ended
  (``role`` is ``send`` or ``recv``; ``outcome`` is landed, failed,
  cancelled, expired);
- ``vllm:kvmove_bytes_total{role}``: bytes of the handoffs that landed;
- ``vllm:kvmove_grant_wait_seconds``: prefill, session opened to grant;
- ``vllm:kvmove_exposed_transfer_seconds``: prefill, last layer computed
  to landed.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

# Observations are lists (vLLM sends the dict between processes); counts
# are "role:outcome" -> n.
_LISTS = ("grant_wait_s", "exposed_s")
_COUNTS = ("sessions", "bytes")

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)


@dataclass
class KvmoveConnectorStats(KVConnectorStats):
    """What the workers observed since the last collection."""

    def __post_init__(self):
        if not self.data:
            self.reset()
        for k in _LISTS:
            self.data.setdefault(k, [])
        for k in _COUNTS:
            self.data.setdefault(k, {})

    def reset(self):
        self.data = {**{k: [] for k in _LISTS}, **{k: {} for k in _COUNTS}}

    def record(self, role: str, outcome: str, nbytes: int, t: dict[str, float]):
        """One session ended (``t``: its timestamps, as the trace has them)."""
        key = f"{role}:{outcome}"
        self.data["sessions"][key] = self.data["sessions"].get(key, 0) + 1
        if outcome == "landed" and nbytes > 0:
            self.data["bytes"][role] = self.data["bytes"].get(role, 0) + int(nbytes)
        if role == "send":
            if "granted" in t and "created" in t:
                self.data["grant_wait_s"].append(max(0.0, t["granted"] - t["created"]))
            if outcome == "landed" and "computed" in t and "ended" in t:
                self.data["exposed_s"].append(max(0.0, t["ended"] - t["computed"]))

    def take(self) -> "KvmoveConnectorStats | None":
        """The observations so far (None when there are none), then empty."""
        if self.is_empty():
            return None
        old = copy.copy(self)
        self.reset()
        return old

    def is_empty(self) -> bool:
        return not self.data["sessions"] and not any(self.data[k] for k in _LISTS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k in _LISTS:
            self.data[k].extend(other.data.get(k, ()))
        for k in _COUNTS:
            mine = self.data[k]
            for key, n in other.data.get(k, {}).items():
                mine[key] = mine.get(key, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for key, n in sorted(self.data["sessions"].items()):
            out[f"kvmove {key}"] = n
        for role, n in sorted(self.data["bytes"].items()):
            out[f"kvmove {role} MB"] = round(n / 2**20, 3)
        for k, name in (("grant_wait_s", "grant wait"), ("exposed_s", "exposed transfer")):
            xs = sorted(self.data[k])
            if xs:
                out[f"kvmove {name} p50 (ms)"] = round(1e3 * xs[len(xs) // 2], 3)
                out[f"kvmove {name} max (ms)"] = round(1e3 * xs[-1], 3)
        return out


class KvmovePromMetrics(KVConnectorPromMetrics):
    """The stats above as Prometheus metrics, one child per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.sessions = self._counter_cls(
            name="vllm:kvmove_sessions",
            documentation="kvmove handoff sessions ended, by role (send, recv) and outcome.",
            labelnames=[*labelnames, "role", "outcome"],
        )
        self.bytes = self._counter_cls(
            name="vllm:kvmove_bytes",
            documentation="Bytes of the kvmove handoffs that landed, by role.",
            labelnames=[*labelnames, "role"],
        )
        self.grant_wait = self._histogram_cls(
            name="vllm:kvmove_grant_wait_seconds",
            documentation="Prefill: from a handoff's session opened to the decode's grant.",
            buckets=list(_SECONDS),
            labelnames=labelnames,
        )
        self.exposed = self._histogram_cls(
            name="vllm:kvmove_exposed_transfer_seconds",
            documentation="Prefill: from a request's last layer computed to its handoff landed.",
            buckets=list(_SECONDS),
            labelnames=labelnames,
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        engine = list(self.per_engine_labelvalues.get(engine_idx, ()))
        for key, n in transfer_stats_data.get("sessions", {}).items():
            role, _, outcome = key.partition(":")
            self.sessions.labels(*engine, role, outcome).inc(n)
        for role, n in transfer_stats_data.get("bytes", {}).items():
            self.bytes.labels(*engine, role).inc(n)
        for x in transfer_stats_data.get("grant_wait_s", ()):
            self.grant_wait.labels(*engine).observe(x)
        for x in transfer_stats_data.get("exposed_s", ()):
            self.exposed.labels(*engine).observe(x)
