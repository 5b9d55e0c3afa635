"""kvmove's native vLLM connector: the prefill pushes each layer's KV into
blocks the decode granted, while it computes; both ends agree on each
request's outcome (docs/CONTRACT.md, rules 12 and 13).

How one request goes (the router, :mod:`kvmove.vllm.proxy`, sends it to a
prefill and a decode at once, with one handoff id and each side's kvmove
address in ``kv_transfer_params["kvmove"]``):

- **Decode.** ``get_num_new_matched_tokens`` asks for every prompt token
  its own prefix cache does not hold, asynchronously: vLLM allocates the
  blocks (only when it has them free: a saturated decode grants nothing,
  which is the backpressure) and parks the request. The worker then grants
  the prefill exactly those blocks' byte ranges, layer by layer
  (contiguous blocks merged), with the byte count it expects and a deadline
  counted from the grant (``Engine.receive``). A landed session is reported
  in ``finished_recving``; a failed, expired or cancelled one in
  ``failed_recving`` too, so vLLM's ``kv_load_failure_policy`` applies
  (``"recompute"`` prefills the request again on the decode). A request the
  decode aborts cancels its session; vLLM frees its blocks once it is
  reported.
- **Prefill.** ``save_kv_layer`` (called after each layer's attention, whose
  KV the CPU backend has written by then) starts the writes of the
  request's blocks that layer completed and returns at once; a layer
  computed before the grant came is written when it comes. On a GPU the
  layer's kernels may still be running when it is called: it records an
  event on the compute stream, and the layer's blocks are written once the
  event completed (:mod:`kvmove.vllm.pending`; tested with kvmove's fake
  device, not yet run on a GPU). Both of vLLM's KV layouts are read:
  blocks first (the CPU backend, FlashInfer) and keys and values apart
  (FlashAttention); any other is refused at start. A block is
  written once, when it is whole (the last, partly filled one after the
  last chunk), so chunked prefill never writes a block twice. After the
  last layer of the last chunk, once every write completed, the session is
  finished and the decode decides. ``request_finished`` keeps the blocks
  until the session has ended, whatever the end, and they are freed once
  (``finished_sending``).
- **First contact.** Before each grant the decode sends the prefill its
  fingerprint (model, dtype, block size, layers, heads, head size, block
  bytes, the CPU attention kernel's instruction set): a prefill that
  differs cancels the session and answers with its own, and both log the
  difference. No block is written between different configurations.

Every kvmove call that can wait (connecting, granting, finishing,
cancelling) runs on one thread of the worker (the *pump*), never on the
forward pass; the forward pass only starts writes.

Tensor parallelism: rank ``r`` listens on ``kv_port + r`` and pairs with
the other side's rank ``r``; vLLM's scheduler waits for every worker's
report, so a request lands when every rank's session landed.

Options (``kv_connector_extra_config``): ``host`` (``"127.0.0.1"``, what
this side's engines listen on), ``grant_deadline_s`` (120: how long the
decode gives the prefill from its grant), ``grant_wait_s`` (600: how long a
prefill waits for a grant), ``backpressure`` (``"push"``: compute at once,
push when granted; ``"hold"``: schedule a prefill request only once it is
granted), ``layerwise`` (true; false writes a request's KV only after its
last layer, for comparison), ``trace`` (a path: one JSON line per finished
session with its timestamps; a decode's line also has ``waited``, the
scheduler steps the request waited for its blocks), ``protocol`` (default:
``KVMOVE_PROTOCOL``, else the ``KVMOVE_CONFIG`` file's backend, else
``"tcp"``), ``cpus``. The engines read ``KVMOVE_CONFIG`` (backend options,
the shared secret) and ``KVMOVE_POLICY`` as every kvmove surface does
(:meth:`kvmove.Engine.from_env`); ``host`` moves their listener.

Stats: :mod:`kvmove.vllm.stats` (vLLM's ``KVConnectorStats`` and
``/metrics``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

from .pending import PendingLayers, kv_layout, plan_writes

logger = logging.getLogger("kvmove.vllm")

PARAMS_KEY = "kvmove"
# Plain notifications between the two sides' workers (the session messages
# are kvmove's own): "<MAGIC> <verb> <json>".
MAGIC = b"KVMOVE-VLLM/1"
FINAL = ("landed", "failed", "cancelled", "expired", "released")


# --------------------------------------------------------------------------
# What the scheduler tells the workers each step


@dataclass
class SendPlan:
    """Prefill: a request scheduled this step (its prompt tokens
    ``start..end`` computed now)."""

    req_id: str
    handoff: int
    peer: str
    block_ids: list[int]
    start: int
    end: int
    prompt: int


@dataclass
class RecvPlan:
    """Decode: blocks vLLM allocated for a request's remote KV."""

    req_id: str
    handoff: int
    peer: str
    block_ids: list[int]
    prompt: int
    # Scheduler steps it waited for its blocks before vLLM allocated them
    # (0: at once; more: the decode's KV cache was full, its backpressure).
    waited: int = 0


@dataclass
class KvmoveConnectorMetadata(KVConnectorMetadata):
    sends: list[SendPlan] = field(default_factory=list)
    recvs: list[RecvPlan] = field(default_factory=list)
    # Prefill requests that ended (their blocks wait for the session):
    # (req_id, handoff, decode address).
    ended_sends: list[tuple[str, int, str]] = field(default_factory=list)
    # Requests vLLM preempted this step (their blocks go back).
    preempted: list[str] = field(default_factory=list)
    # Decode requests aborted while their KV was on its way.
    cancel_recvs: list[str] = field(default_factory=list)
    # Handoffs the decode will never grant: (handoff, prefill address).
    skips: list[tuple[int, str]] = field(default_factory=list)
    # Prefill, backpressure "hold": requests whose session opens now; they
    # are scheduled once every worker has their grant.
    opens: list[tuple[str, int, str, int]] = field(default_factory=list)


@dataclass
class KvmoveWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, each step: held prefill requests that may be
    scheduled now (their grant came, or their session ended without one),
    each with how many workers say so."""

    go: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVConnectorWorkerMetadata":
        for rid, n in getattr(other, "go", {}).items():
            self.go[rid] = self.go.get(rid, 0) + n
        return self


def handoff_params(request: "Request") -> Optional[dict]:
    """The request's kvmove parameters (``role``, ``handoff``, ``peer``), or
    None. Malformed ones are refused with a warning (the request then runs
    without a transfer)."""
    p = request.kv_transfer_params
    if not isinstance(p, dict):
        return None
    k = p.get(PARAMS_KEY)
    if k is None:
        return None
    ok = (
        isinstance(k, dict)
        and k.get("role") in ("send", "recv")
        and isinstance(k.get("handoff"), int)
        and 0 <= k["handoff"] < 1 << 63
        and isinstance(k.get("peer"), str)
        and ":" in k["peer"]
    )
    if not ok:
        logger.warning("kvmove: request %s: ignoring malformed kv_transfer_params %r", request.request_id, k)
        return None
    return k


def peer_of(base: str, rank: int) -> str:
    """The address of rank ``rank`` of the side whose rank 0 is ``base``."""
    host, _, port = base.rpartition(":")
    return f"{host}:{int(port) + rank}"


# --------------------------------------------------------------------------
# Scheduler side


BACKPRESSURE = ("push", "hold")


class _Scheduler:
    def __init__(self, vllm_config: "VllmConfig"):
        self.block_size = vllm_config.cache_config.block_size
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        mode = extra.get("backpressure", "push")
        if mode not in BACKPRESSURE:
            raise ValueError(f"kvmove: kv_connector_extra_config.backpressure is {mode!r}; it is one of {BACKPRESSURE}")
        self.hold = mode == "hold"
        self.workers = max(1, int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1))
        # "hold": requests whose session is open, waiting for every
        # worker's go (rid -> workers that said so).
        self.holding: dict[str, int] = {}
        # req_id -> [handoff, peer, block ids, prompt tokens]
        self.sending: dict[str, list] = {}
        # req_id -> (handoff, peer), until its KV landed or failed
        self.receiving: dict[str, tuple[int, str]] = {}
        # prefill requests whose blocks wait for their session
        self.delayed: set[str] = set()
        self.meta = KvmoveConnectorMetadata()

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[Optional[int], bool]:
        k = handoff_params(request)
        if k is not None and k["role"] == "send" and self.hold and not k.get("_go"):
            # Not scheduled until the decode granted (on every worker).
            rid = request.request_id
            if rid not in self.holding:
                self.holding[rid] = 0
                self.meta.opens.append((rid, k["handoff"], k["peer"], request.num_prompt_tokens))
            if self.holding[rid] < self.workers:
                return None, False
            del self.holding[rid]
            k["_go"] = True
            return 0, False
        # Asked again each step until vLLM has the blocks (a full decode
        # allocates nothing and grants nothing: backpressure); once they
        # were allocated (a preempted request comes back), computed here.
        if k is None or k["role"] != "recv" or k.get("_allocated") or k.get("_skipped"):
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        if count <= 0:
            # The decode's own cache holds the whole prompt.
            k["_skipped"] = True
            self.meta.skips.append((k["handoff"], k["peer"]))
            return 0, False
        k["_asks"] = k.get("_asks", 0) + 1
        return count, True

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        k = handoff_params(request)
        if k is None:
            return
        rid = request.request_id
        if k["role"] == "send":
            self.sending.setdefault(rid, [k["handoff"], k["peer"], [], request.num_prompt_tokens])
            return
        if k.get("_allocated"):
            return
        k["_allocated"] = True
        if num_external_tokens <= 0:
            if not k.get("_skipped"):
                k["_skipped"] = True
                self.meta.skips.append((k["handoff"], k["peer"]))
            return
        prompt = request.num_prompt_tokens
        start = prompt - num_external_tokens
        bs = self.block_size
        ids = list(blocks.get_block_ids()[0])
        first, last = start // bs, -(-prompt // bs)
        if last > len(ids):
            logger.error("kvmove: request %s: %d blocks allocated for %d prompt tokens", rid, len(ids), prompt)
            return
        waited = max(k.get("_asks", 1) - 1, 0)
        self.meta.recvs.append(RecvPlan(rid, k["handoff"], k["peer"], ids[first:last], prompt, waited))
        self.receiving[rid] = (k["handoff"], k["peer"])

    def build_connector_meta(self, so: "SchedulerOutput") -> KvmoveConnectorMetadata:
        meta, self.meta = self.meta, KvmoveConnectorMetadata()
        meta.preempted = sorted(so.preempted_req_ids or ())
        if self.sending:
            for nr in so.scheduled_new_reqs:
                s = self.sending.get(nr.req_id)
                if s is not None:
                    s[2] = list(nr.block_ids[0])
                    n = so.num_scheduled_tokens.get(nr.req_id, 0)
                    self._plan(meta, nr.req_id, s, nr.num_computed_tokens, n)
            c = so.scheduled_cached_reqs
            for i, rid in enumerate(c.req_ids):
                s = self.sending.get(rid)
                if s is None:
                    continue
                new = c.new_block_ids[i]
                if new is not None:
                    if rid in c.resumed_req_ids:
                        s[2] = list(new[0])
                    else:
                        s[2].extend(new[0])
                self._plan(meta, rid, s, c.num_computed_tokens[i], so.num_scheduled_tokens.get(rid, 0))
        return meta

    @staticmethod
    def _plan(meta: KvmoveConnectorMetadata, rid: str, s: list, start: int, n: int):
        handoff, peer, ids, prompt = s
        if n > 0 and start < prompt:
            meta.sends.append(SendPlan(rid, handoff, peer, list(ids), start, min(start + n, prompt), prompt))

    def request_finished(self, request: "Request", block_ids) -> tuple[bool, Optional[dict]]:
        rid = request.request_id
        k = handoff_params(request)
        if k is None:
            return False, None
        if k["role"] == "send":
            self.holding.pop(rid, None)
            self.sending.pop(rid, None)
            self.meta.ended_sends.append((rid, k["handoff"], k["peer"]))
            self.delayed.add(rid)
            return True, None
        if rid in self.receiving:
            # Aborted while its KV was on its way: vLLM frees the blocks
            # once the worker reports the (cancelled) session.
            self.meta.cancel_recvs.append(rid)
        elif not k.get("_allocated") and not k.get("_skipped"):
            # Never granted: the prefill must not wait for it.
            k["_skipped"] = True
            self.meta.skips.append((k["handoff"], k["peer"]))
        return False, None

    def update_connector_output(self, out) -> None:
        for rid in out.finished_sending or ():
            self.delayed.discard(rid)
        for rid in out.finished_recving or ():
            self.receiving.pop(rid, None)
        meta = getattr(out, "kv_connector_worker_meta", None)
        for rid, n in getattr(meta, "go", {}).items():
            if rid in self.holding:
                self.holding[rid] += n

    def has_pending_push_work(self) -> bool:
        return bool(self.delayed or self.sending)


# --------------------------------------------------------------------------
# Worker side


class _Send:
    """Prefill: one request's handoff."""

    def __init__(self, req_id: str, handoff: int, peer: str, prompt: int):
        self.req_id, self.handoff, self.peer, self.prompt = req_id, handoff, peer, prompt
        self.session = None  # kvmove.SendSession, made by the pump
        self.block_ids: list[int] = []
        # Blocks of the request already planned (written or pending), per
        # step: blocks below this index are whole.
        self.next_block = 0
        self.step_blocks: list[int] = []
        self.last_step = False
        # Per plane: blocks computed, not yet written (waiting for the grant
        # or, on a GPU, for the layer's kernels).
        self.pending = PendingLayers()
        self.remote: Optional[list[list[int]]] = None  # [plane][j - first] -> address
        self.first = 0
        self.expected = 0  # bytes the grant asks for
        self.writes: list = []
        self.computed = False  # the last layer of the last chunk is saved
        self.ended = False  # vLLM finished the request (its blocks wait)
        self.finishing = False
        self.cancel = False
        self.hold = False  # backpressure "hold": the scheduler waits for our go
        self.state: Optional[str] = None
        self.error: Optional[str] = None
        self.t = {"created": time.time()}


class _Recv:
    """Decode: one request's handoff."""

    def __init__(self, plan: RecvPlan, peer: str):
        self.plan, self.peer = plan, peer
        self.expected = 0  # bytes granted
        self.session = None
        self.state: Optional[str] = None
        self.error: Optional[str] = None
        self.cancel = False
        self.reported = False
        self.t = {"created": time.time()}


class _Worker:
    def __init__(self, vllm_config: "VllmConfig", kv_cache_config=None):
        cfg = vllm_config.kv_transfer_config
        # How many blocks each layer's tensor holds (tells vLLM's two KV
        # layouts apart: pending.kv_layout).
        self.num_blocks = getattr(kv_cache_config, "num_blocks", None)
        extra = dict(cfg.kv_connector_extra_config or {})
        self.vllm_config = vllm_config
        self.host = str(extra.get("host", "127.0.0.1"))
        self.base_port = int(cfg.kv_port)
        self.protocol = extra.get("protocol")
        self.deadline = float(extra.get("grant_deadline_s", 120.0))
        # A prefill gives up a handoff whose grant has not come in this long
        # (a decode that never got the request: its blocks would stay held).
        # Backpressure waits are far shorter; 0 waits forever.
        self.grant_wait = float(extra.get("grant_wait_s", 600.0))
        self.trace_path = extra.get("trace")
        self.cpus = extra.get("cpus")
        # False: a request's KV is written once its last layer is computed
        # (whole requests, as a pull-based connector moves them; for
        # comparison), not layer by layer.
        self.layerwise = bool(extra.get("layerwise", True))
        self.block_size = vllm_config.cache_config.block_size
        self.engine = None
        self.rank = 0
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.sends: dict[str, _Send] = {}
        self.recvs: dict[str, _Recv] = {}
        self.skips: list[tuple[int, str]] = []
        self.new_sends: list[_Send] = []
        self.new_recvs: list[_Recv] = []
        self.finished_ids: set[str] = set()
        self.go: set[str] = set()  # held requests the scheduler may run
        self.peer_fp: dict[str, dict] = {}
        self.bad_peers: dict[str, str] = {}
        self.layer_index: dict[str, int] = {}
        # A layer's blocks lie in one plane (blocks first: the CPU backend)
        # or two (keys, then values: FlashAttention); pending writes, grants
        # and remote addresses are per plane.
        self.layer_planes: list[list[int]] = []
        self.plane_addr: list[int] = []
        self.block_bytes = 0
        self.device = None  # the torch device of a GPU's KV cache (None: CPU)
        self.fingerprint: dict[str, Any] = {}
        self.stop = False
        self.thread: Optional[threading.Thread] = None
        # Calls that can wait (made by the pump's thread, so its threads
        # run where the pump does).
        self.calls = ThreadPoolExecutor(max_workers=16, thread_name_prefix="kvmove-vllm-call")
        self.in_calls: set = set()
        from .stats import KvmoveConnectorStats

        self.stats = KvmoveConnectorStats()

    # ---- setup ----

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]):
        import torch

        import kvmove

        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.rank = get_tensor_model_parallel_rank()
        except Exception:  # noqa: BLE001 (no parallel state: one rank)
            self.rank = 0
        names = list(kv_caches)
        tensors = [kv_caches[n] for n in names]
        where = {str(t.device) if isinstance(t, torch.Tensor) else type(t).__name__ for t in tensors}
        if len(where) != 1 or not all(isinstance(t, torch.Tensor) and t.device.type in ("cpu", "cuda") for t in tensors):
            raise RuntimeError(
                "kvmove's vLLM connector moves one tensor per layer, every one on the CPU or every one on one "
                f"CUDA device; these are on {sorted(where)}"
            )
        kind = "host"
        if tensors[0].device.type == "cuda":
            self.device = tensors[0].device
            kind = f"device:{self.device.index or 0}"
        block_bytes = set()
        spans = []
        for t in tensors:
            try:
                planes, bb, nbytes = kv_layout(t.shape, t.stride(), t.element_size(), t.data_ptr(), self.num_blocks)
            except ValueError as e:
                raise RuntimeError(f"kvmove: {e}") from None
            self.layer_planes.append(list(range(len(self.plane_addr), len(self.plane_addr) + len(planes))))
            self.plane_addr.extend(planes)
            block_bytes.add(bb)
            spans.append((t.data_ptr(), t.data_ptr() + nbytes))
        if len(block_bytes) != 1:
            raise RuntimeError(f"kvmove: the layers' blocks differ in size: {sorted(block_bytes)}")
        self.block_bytes = block_bytes.pop()
        self.layer_index = {n: i for i, n in enumerate(names)}
        # One region per run of touching tensors (the CPU backend's layers
        # are views of one allocation: one region; a GPU's may be apart).
        regions: list[list[int]] = []
        for a, b in sorted(spans):
            if regions and a <= regions[-1][1]:
                regions[-1][1] = max(regions[-1][1], b)
            else:
                regions.append([a, b])
        mc = self.vllm_config.model_config
        t0 = tensors[0]
        try:
            if self.device is not None:
                isa = "cuda sm_%d%d" % torch.cuda.get_device_capability(self.device)
            else:
                isa = torch.backends.cpu.get_cpu_capability()
        except Exception:  # noqa: BLE001
            isa = "unknown"
        hf = getattr(mc, "hf_config", None)
        self.fingerprint = {
            # What the KV's bytes depend on (not where the weights were read
            # from: two machines may mount them at different paths).
            "model": str(getattr(mc, "served_model_name", None) or mc.model),
            "model_type": str(getattr(hf, "model_type", "")),
            "hidden_size": int(mc.get_hidden_size()),
            "head_size": int(mc.get_head_size()),
            "dtype": str(mc.dtype),
            "kv_dtype": str(t0.dtype),
            "block_size": self.block_size,
            "layers": len(names),
            "planes": len(self.plane_addr),
            "block_shape": list(t0.shape[1:]),
            "block_bytes": self.block_bytes,
            "isa": isa,
            "tp_rank": self.rank,
        }
        port = self.base_port + self.rank
        # vLLM's CPU worker binds its thread (and every thread it starts
        # from then on) to the cores of its OpenMP threads, which spin:
        # kvmove's threads made there would hardly ever run (a peer's
        # handshake timed out). They are made on the cores vLLM reserved
        # (``VLLM_CPU_NUM_OF_RESERVED_CPU``) or on those ``cpus`` names.
        bound = _affinity()
        cpus = _transfer_cpus(self.cpus, bound)
        if cpus and bound is not None:
            try:
                os.sched_setaffinity(0, cpus)
            except OSError as e:
                logger.warning("kvmove: cannot run its threads on cores %s (%s): they share the worker's", sorted(cpus), e)
                cpus = None
        try:
            self.engine = kvmove.Engine.from_env(self.protocol, host=self.host, port=port)
            for a, b in regions:
                self.engine.register_address(a, b - a, kind)
            self.me = self.engine.session_id
            self.thread = threading.Thread(target=self._pump, name="kvmove-vllm", daemon=True)
            self.thread.start()
        finally:
            if cpus and bound is not None:
                os.sched_setaffinity(0, bound)
        logger.info(
            "kvmove: rank %d listens on %s; %d layers (%d planes of blocks), %d bytes a block, %s memory",
            self.rank,
            self.me,
            len(names),
            len(self.plane_addr),
            self.block_bytes,
            kind,
        )
        if cpus:
            logger.info("kvmove: its threads run on cores %s (the forward pass on %s)", sorted(cpus), sorted(bound or ()))

    # ---- each step (forward thread) ----

    def bind(self, meta: KvmoveConnectorMetadata):
        if self.engine is None:
            return
        bs = self.block_size
        with self.lock:
            for handoff, peer in meta.skips:
                self.skips.append((handoff, peer_of(peer, self.rank)))
            for rid, handoff, peer, prompt in meta.opens:
                if rid not in self.sends:
                    s = _Send(rid, handoff, peer_of(peer, self.rank), prompt)
                    s.hold = True
                    self.sends[rid] = s
                    self.new_sends.append(s)
            for plan in meta.recvs:
                r = _Recv(plan, peer_of(plan.peer, self.rank))
                self.recvs[plan.req_id] = r
                self.new_recvs.append(r)
            for rid in meta.cancel_recvs:
                r = self.recvs.get(rid)
                if r is not None:
                    r.cancel = True
            for s in self.sends.values():
                s.step_blocks = []
                s.last_step = False
            for plan in meta.sends:
                s = self.sends.get(plan.req_id)
                if s is None:
                    s = _Send(plan.req_id, plan.handoff, peer_of(plan.peer, self.rank), plan.prompt)
                    self.sends[plan.req_id] = s
                    self.new_sends.append(s)
                s.t.setdefault("scheduled", time.time())
                s.block_ids = plan.block_ids
                whole = plan.end // bs
                if plan.end >= plan.prompt:
                    whole = -(-plan.prompt // bs)
                    s.last_step = True
                s.step_blocks = list(range(s.next_block, min(whole, len(plan.block_ids))))
                s.next_block = max(s.next_block, whole)
            for rid, handoff, peer in meta.ended_sends:
                s = self.sends.get(rid)
                if s is None:
                    # Ended before it was ever scheduled: nothing to send;
                    # the session is opened to be cancelled, so the decode
                    # learns it at once.
                    s = _Send(rid, handoff, peer_of(peer, self.rank), 0)
                    self.sends[rid] = s
                    self.new_sends.append(s)
                s.ended = True
                if not s.computed:
                    s.cancel = True
            self.wake.notify()

    def save_kv_layer(self, layer_name: str, kv_layer=None):
        i = self.layer_index.get(layer_name)
        if i is None or not self.sends:
            return
        last_layer = i == len(self.layer_planes) - 1
        now = time.time()
        ready = None
        with self.lock:
            for s in self.sends.values():
                if s.state is not None:
                    continue
                if s.step_blocks:
                    if ready is None and self.device is not None:
                        ready = self._layer_done(kv_layer)
                    for p in self.layer_planes[i]:
                        base = self.plane_addr[p]
                        s.pending.add(p, [(j, base + s.block_ids[j] * self.block_bytes) for j in s.step_blocks], ready)
                    if s.remote is not None:
                        self._flush(s, now)
                if last_layer and s.last_step and not s.computed:
                    s.computed = True
                    s.t["computed"] = now
                    if not self.layerwise and s.remote is not None:
                        self._flush(s, now)
                    self.wake.notify()

    def _layer_done(self, kv_layer):
        """On a GPU: an event recorded on the stream computing the layer, so
        its blocks are written only once its kernels finished
        (:mod:`kvmove.vllm.pending`). Never waited here: the forward pass
        goes on."""
        import torch

        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def _flush(self, s: _Send, now: float):
        """Starts the writes of ``s``'s pending blocks whose bytes are
        complete (lock held; grant in)."""
        if s.session is None or s.remote is None or (not self.layerwise and not s.computed):
            return
        layers = s.pending.take()
        if not layers:
            return
        ops, error = plan_writes(layers, s.first, s.remote, self.block_bytes)
        if error is not None:
            s.error = error
            s.cancel = True
            return
        if not ops:
            return
        try:
            w = s.session.write_layer(ops)
        except Exception as e:  # noqa: BLE001 (the session failed: its end is reported)
            s.error = str(e)
            return
        s.writes.append(w)
        s.t.setdefault("first_write", now)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults()
        if self.engine is None:
            return out
        with self.lock:
            # Only this connector's handoffs (the others would pile up).
            self.finished_ids |= {rid for rid in finished_req_ids if rid in self.sends}
            for rid, s in list(self.sends.items()):
                # Only ids vLLM said are finished (its blocks wait for us).
                if s.state is not None and rid in self.finished_ids:
                    out.finished_sending.add(rid)
                    self.finished_ids.discard(rid)
                    del self.sends[rid]
            for rid, r in list(self.recvs.items()):
                if r.state is not None and not r.reported:
                    r.reported = True
                    out.finished_recving.add(rid)
                    if r.state != "landed":
                        out.failed_recving.add(rid)
                    del self.recvs[rid]
            if self.sends or self.recvs:
                self.wake.notify()
        return out

    def _let_go(self, s: _Send):
        """A held request may be scheduled (lock held): granted, or its
        session ended (it then computes without a transfer)."""
        if s.hold:
            s.hold = False
            self.go.add(s.req_id)

    def worker_meta(self) -> Optional[KvmoveWorkerMetadata]:
        with self.lock:
            if not self.go:
                return None
            go, self.go = self.go, set()
        return KvmoveWorkerMetadata({rid: 1 for rid in go})

    def take_stats(self):
        with self.lock:
            return self.stats.take()

    def handle_preemptions(self, preempted: set[str]):
        # A preempted prefill request's blocks go back to vLLM: writes
        # still reading them are waited for, and its handoff is cancelled
        # (the decode recomputes or fails it; vLLM recomputes the prefill).
        waits = []
        with self.lock:
            for rid in preempted:
                s = self.sends.get(rid)
                if s is not None and s.state is None:
                    s.cancel = True
                    s.pending.clear()
                    s.step_blocks = []
                    waits.extend(s.writes)
            self.wake.notify()
        for w in waits:
            try:
                w.wait(timeout=30, check=False)
            except Exception:  # noqa: BLE001
                pass

    # ---- the pump (its own thread): every call that can wait ----

    def _pump(self):
        while True:
            with self.lock:
                busy = self.sends or self.recvs or self.new_sends or self.new_recvs or self.skips
                if self.stop:
                    return
                if not busy:
                    self.wake.wait(0.05)
                    continue
                new_sends, self.new_sends = self.new_sends, []
                new_recvs, self.new_recvs = self.new_recvs, []
                skips, self.skips = self.skips, []
            try:
                self._pump_once(new_sends, new_recvs, skips)
            except Exception:  # noqa: BLE001 (never let the pump die)
                logger.exception("kvmove: the connector's pump failed; going on")
            with self.lock:
                if not self.stop:
                    self.wake.wait(0.001)

    def _offload(self, key, fn):
        """Runs ``fn`` on the call pool, unless a call for ``key`` runs: a
        call that waits on one peer (a dead one's handshake, an agreement)
        holds up no other request."""
        with self.lock:
            if key in self.in_calls:
                return
            self.in_calls.add(key)

        def run():
            try:
                fn()
            except Exception:  # noqa: BLE001
                logger.exception("kvmove: %s failed", key[0])
            finally:
                with self.lock:
                    self.in_calls.discard(key)
                    self.wake.notify()

        self.calls.submit(run)

    def _open_send(self, s: _Send):
        try:
            sess = self.engine.send(s.peer, s.handoff)
        except Exception as e:  # noqa: BLE001
            s.error = f"cannot open the handoff: {e}"
            self._ended(s, "failed", None)
            return
        with self.lock:
            s.session = sess

    def _pump_once(self, new_sends, new_recvs, skips):
        for handoff, peer in skips:
            self._offload(("skip", handoff, peer), lambda h=handoff, p=peer: self._notify(p, "skip", {"handoff": h}))
        for s in new_sends:
            self._offload(("open", s.req_id), lambda s=s: self._open_send(s))
        for r in new_recvs:
            self._offload(("grant", r.plan.req_id), lambda r=r: self._start_recv(r))
        # Grants seen before the notifications are read: the hello sent
        # before a grant is then surely read below (per-pair order).
        with self.lock:
            waiting = [s for s in self.sends.values() if s.session is not None and s.remote is None and s.state is None]
        granted = []
        for s in waiting:
            try:
                g = s.session.grant
            except Exception:  # noqa: BLE001
                g = None
            if g is not None:
                granted.append((s, g))
        self._read_notes()
        now = time.time()
        for s, g in granted:
            why = self._check_grant(s, g)
            with self.lock:
                if why is None:
                    s.t["granted"] = now
                    self._flush(s, now)
                    self._let_go(s)
                else:
                    s.error = why
                    s.cancel = True
        # Layers held back by their kernels (a GPU) whose events completed.
        if self.device is not None:
            with self.lock:
                for s in self.sends.values():
                    if s.pending and s.remote is not None and s.state is None and not s.cancel:
                        self._flush(s, now)
        # Sends: finish, cancel, see the end.
        with self.lock:
            sends = list(self.sends.values())
            recvs = list(self.recvs.values())
        for s in sends:
            self._drive_send(s)
        for r in recvs:
            self._drive_recv(r)

    def _start_recv(self, r: _Recv):
        bad = self.bad_peers.get(r.peer)
        if bad is not None:
            r.error = bad
            self._recv_state(r, "failed")
            return
        plan = r.plan
        ranges = []
        bb = self.block_bytes
        for base in self.plane_addr:
            for b in plan.block_ids:
                a = base + b * bb
                if ranges and ranges[-1][0] + ranges[-1][1] == a:
                    ranges[-1][1] += bb
                else:
                    ranges.append([a, bb])
        try:
            self._notify(r.peer, "hello", self.fingerprint, raise_=True)
            sess = self.engine.receive(r.peer, plan.handoff, [tuple(x) for x in ranges], deadline=self.deadline)
        except Exception as e:  # noqa: BLE001
            r.error = f"cannot grant the prefill {r.peer}: {e}"
            self._recv_state(r, "failed")
            # The prefill (if it hears) need not hold the blocks until its
            # grant wait runs out.
            self._notify(r.peer, "skip", {"handoff": plan.handoff})
            return
        with self.lock:
            r.session = sess
            r.expected = sum(n for _, n in ranges)
            r.t["granted"] = time.time()
            if r.cancel:
                pass  # cancelled below by _drive_recv

    def _check_grant(self, s: _Send, g) -> Optional[str]:
        fp = self.peer_fp.get(s.peer)
        mine = dict(self.fingerprint)
        if fp is None:
            return f"the decode {s.peer} granted without its fingerprint"
        theirs = dict(fp)
        if theirs != mine:
            diff = {k: (mine.get(k), theirs.get(k)) for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k)}
            return f"the decode {s.peer} has another KV layout (here, there): {diff}"
        planes = len(self.plane_addr)
        bb = self.block_bytes
        total = sum(n for _, n in g.ranges)
        nblocks = -(-s.prompt // self.block_size)
        if total % (bb * planes):
            return f"the grant's {total} bytes are not whole blocks of {planes} planes"
        needed = total // (bb * planes)
        if needed > nblocks or needed == 0:
            return f"the grant asks for {needed} blocks of a {nblocks}-block prompt"
        remote: list[list[int]] = [[] for _ in range(planes)]
        plane = 0
        for addr, n in g.ranges:
            if n % bb:
                return "a granted range is not whole blocks"
            for k in range(n // bb):
                if len(remote[plane]) == needed:
                    plane += 1
                remote[plane].append(addr + k * bb)
        s.first = nblocks - needed
        s.remote = remote
        s.expected = total
        return None

    def _drive_send(self, s: _Send):
        if s.session is None or s.state is not None:
            return
        state = s.session.poll()
        if state in FINAL:
            self._ended(s, state, s.session.error)
            return
        if (
            not s.cancel
            and s.remote is None
            and self.grant_wait > 0
            and time.time() - s.t["created"] > self.grant_wait
        ):
            with self.lock:
                s.error = f"no grant from the decode {s.peer} in {self.grant_wait:.0f} s"
                s.cancel = True
        if s.cancel:
            self._offload(("cancel", s.req_id), lambda: self._cancel_send(s))
            return
        with self.lock:
            ready = s.computed and s.remote is not None and not s.pending and not s.finishing
            writes = list(s.writes)
        if ready and all(w.done for w in writes):
            with self.lock:
                s.finishing = True
            try:
                for w in writes:
                    w.wait(timeout=0, check=True)
                s.session.finish()
                s.t["finished"] = time.time()
            except Exception as e:  # noqa: BLE001 (the session fails on both sides)
                s.error = str(e)

    def _cancel_send(self, s: _Send):
        why = s.error or "the prefill request ended before its KV was computed"
        logger.warning("kvmove: request %s: handoff %d cancelled: %s", s.req_id, s.handoff, why)
        self._send_note_if_mismatch(s)
        try:
            state = s.session.cancel()
        except Exception as e:  # noqa: BLE001
            state = "failed"
            s.error = str(e)
        self._ended(s, state, s.session.error)

    def _send_note_if_mismatch(self, s: _Send):
        if s.error and "another KV layout" in s.error:
            self._notify(s.peer, "mismatch", {"handoff": s.handoff, "fingerprint": self.fingerprint, "why": s.error})

    def _ended(self, s: _Send, state: str, err):
        with self.lock:
            if s.state is not None:
                return
            s.state = state
            if err is not None and s.error is None:
                s.error = str(err)
            s.t["ended"] = time.time()
            self.stats.record("send", state, s.expected, s.t)
            self._let_go(s)
        self._trace("send", s.req_id, s.handoff, s.peer, state, s.error, s.t)
        if s.session is not None:
            try:
                s.session.release()
            except Exception:  # noqa: BLE001
                pass

    def _drive_recv(self, r: _Recv):
        if r.session is None or r.state is not None:
            return
        state = r.session.poll()
        if state not in FINAL and r.cancel:
            self._offload(("cancel", r.plan.req_id), lambda: self._cancel_recv(r))
            return
        self._recv_state(r, state)

    def _cancel_recv(self, r: _Recv):
        try:
            state = r.session.cancel()
        except Exception as e:  # noqa: BLE001
            state, r.error = "failed", str(e)
        self._recv_state(r, state)

    def _recv_state(self, r: _Recv, state: str):
        if state in FINAL:
            err = r.session.error if r.session is not None else None
            with self.lock:
                if r.state is not None:
                    return
                r.state = state
                if err is not None and r.error is None:
                    r.error = str(err)
                r.t["ended"] = time.time()
                self.stats.record("recv", state, r.expected, r.t)
            if state != "landed":
                logger.warning("kvmove: request %s: KV from %s %s: %s", r.plan.req_id, r.peer, state, r.error)
            self._trace("recv", r.plan.req_id, r.plan.handoff, r.peer, state, r.error, r.t, waited=r.plan.waited)
            if r.session is not None:
                try:
                    r.session.release()
                except Exception:  # noqa: BLE001
                    pass

    def _notify(self, peer: str, verb: str, body: dict, raise_: bool = False):
        msg = MAGIC + b" " + verb.encode() + b" " + json.dumps(body, sort_keys=True).encode()
        try:
            self.engine.notify(peer, msg)
        except Exception as e:  # noqa: BLE001
            if raise_:
                raise
            logger.warning("kvmove: could not tell %s %s: %s", peer, verb, e)

    def _read_notes(self):
        for n in self.engine.notifications():
            parts = n.msg.split(b" ", 2)
            if len(parts) != 3 or parts[0] != MAGIC:
                continue
            try:
                body = json.loads(parts[2])
            except ValueError:
                continue
            verb = parts[1]
            if verb == b"hello" and isinstance(body, dict):
                self.peer_fp[n.peer] = body
            elif verb == b"skip" and isinstance(body, dict):
                with self.lock:
                    for s in self.sends.values():
                        if s.peer == n.peer and s.handoff == body.get("handoff") and s.state is None:
                            s.cancel = True
                            s.error = "the decode needs none of this request's KV"
            elif verb == b"mismatch" and isinstance(body, dict):
                why = f"the prefill {n.peer} has another KV layout: {body.get('why')}"
                logger.error("kvmove: %s", why)
                self.bad_peers[n.peer] = why

    def _trace(self, role, req_id, handoff, peer, state, error, t, **more):
        if not self.trace_path:
            return
        line = json.dumps(
            {"role": role, "req": req_id, "handoff": handoff, "peer": peer, "state": state, "error": error,
             "rank": self.rank, **more, **{f"t_{k}": v for k, v in t.items()}}  # fmt: skip
        )
        try:
            with open(self.trace_path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
        except OSError as e:
            logger.warning("kvmove: cannot write the trace %s: %s", self.trace_path, e)

    def shutdown(self):
        with self.lock:
            self.stop = True
            self.wake.notify_all()
        if self.thread is not None:
            self.thread.join(timeout=5)
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def _affinity() -> Optional[set]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def _transfer_cpus(wanted, bound: Optional[set]) -> Optional[set]:
    """Where kvmove's threads go: ``wanted`` (a list of core numbers), else
    the cores the worker is not bound to, else None (where it is)."""
    if wanted:
        return {int(c) for c in wanted}
    if bound is None:
        return None
    try:
        online = set(range(os.cpu_count() or 1))
    except (TypeError, ValueError):
        return None
    free = online - bound
    return free or None


# --------------------------------------------------------------------------
# The connector vLLM loads


class KvmoveConnector(KVConnectorBase_V1):
    """vLLM's connector interface over kvmove handoff sessions (see the
    module's documentation)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._sched: Optional[_Scheduler] = None
        self._worker: Optional[_Worker] = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = _Scheduler(vllm_config)
        else:
            self._worker = _Worker(vllm_config, kv_cache_config)

    # ---- worker ----

    def register_kv_caches(self, kv_caches):
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KvmoveConnectorMetadata):
            self._worker.bind(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata) -> None:
        if self._worker is None:
            return
        ids = getattr(kv_connector_metadata, "preempted", None)
        if ids:
            self._worker.handle_preemptions(set(ids))

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        # The decode's loads are pushed by the prefill: nothing to start.
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.save_kv_layer(layer_name, kv_layer)

    def wait_for_save(self):
        # Writes go on after the forward pass; the session's end frees the
        # blocks (request_finished kept them).
        return

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        return self._worker.get_transfer_results(finished_req_ids)

    def get_finished(self, finished_req_ids: set[str]):
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def shutdown(self):
        if self._worker is not None:
            self._worker.shutdown()

    def build_connector_worker_meta(self):
        return None if self._worker is None else self._worker.worker_meta()

    def get_kv_connector_stats(self):
        return None if self._worker is None else self._worker.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict] = None):
        from .stats import KvmoveConnectorStats

        return KvmoveConnectorStats(data=data) if data is not None else KvmoveConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from .stats import KvmovePromMetrics

        return KvmovePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- scheduler ----

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int):
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build_connector_meta(scheduler_output)

    def request_finished(self, request: "Request", block_ids) -> tuple[bool, Optional[dict]]:
        assert self._sched is not None
        return self._sched.request_finished(request, block_ids)

    def update_connector_output(self, connector_output) -> None:
        if self._sched is not None:
            self._sched.update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.has_pending_push_work()

