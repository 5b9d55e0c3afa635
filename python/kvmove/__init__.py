"""kvmove: a KV-cache transfer engine for LLM inference (TCP or RDMA).

Three APIs over one Rust engine (retry, deadlines, circuit breaker,
backpressure and memory checks built in):

* ``kvmove.TransferEngine`` (also ``kvmove.mooncake.TransferEngine``) answers
  the calls SGLang and vLLM make on Mooncake's
  ``mooncake.engine.TransferEngine``, with its integer return codes.
* ``kvmove.nixl.nixl_agent`` answers the calls vLLM's and SGLang's NIXL
  connectors make on NIXL's ``nixl._api.nixl_agent`` (host memory).
* ``kvmove.Engine`` is the Pythonic API: context managers that unregister
  memory and close sessions, batches with ``poll`` / ``wait`` / ``cancel``,
  layer-by-layer submission, and exceptions with ``.kind`` and
  ``.is_transient``; notifications (``Engine.notify``) and handoff
  sessions between a sender and a receiver (``Engine.send`` /
  ``Engine.receive``).

Memory is host memory or device (GPU) memory: every API finds which at
registration and moves device memory through its provider
(``kvmove.devices``: CUDA, or ``kvmove.devices.FakeDevice`` in tests).

``kvmove.metrics()`` returns the engine's metrics (bytes, requests,
transfers, latency histograms; process-wide) as a dict, and
``kvmove.register_prometheus()`` shows them on a ``prometheus_client``
registry's ``/metrics``; ``kvmove.serve_metrics(addr)``, or
``KVMOVE_METRICS_ADDR`` in the environment of a process whose engines are
created by a serving engine, serves them on an HTTP port of their own.
"""

from ._native import PermanentError, TransferError, TransientError
from ._engine import (
    Batch,
    Engine,
    Grant,
    LayerwiseTransfer,
    Notification,
    Outcome,
    ReceiveSession,
    Region,
    RequestResult,
    SendSession,
    Session,
    SessionWrite,
)
from . import devices
from ._metrics import metrics, register_prometheus, serve_metrics
from .mooncake import TransferEngine, TransferNotify, TransferOpcode

__all__ = [
    "Batch",
    "Engine",
    "Grant",
    "LayerwiseTransfer",
    "Notification",
    "Outcome",
    "PermanentError",
    "ReceiveSession",
    "Region",
    "RequestResult",
    "SendSession",
    "Session",
    "SessionWrite",
    "TransferEngine",
    "TransferError",
    "TransferNotify",
    "TransferOpcode",
    "TransientError",
    "metrics",
    "register_prometheus",
    "serve_metrics",
]
