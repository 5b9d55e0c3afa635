"""SGLang's transfer-backend classes over kvmove's handoff sessions.

One kvmove engine per scheduler process (one per prefill or decode rank),
made by :class:`KvmoveKVManager`. SGLang's own bootstrap server, prefill
registration and decode-side rank discovery are reused (subclasses of
SGLang's ``Common*`` classes); the prefill rank registers its kvmove
engine's address as its ``rank_ip:rank_port``, so the decode finds it there.

Per request (``bootstrap_room`` is the session id on both sides):

- decode, ``send_metadata``: the pages it allocated (and the request's
  auxiliary row and extra state) become one kvmove grant to the prefill
  rank, ``Engine.receive(prefill, room, ranges, deadline)``; the deadline is
  SGLang's waiting timeout, counted from the grant. A decode prefix length
  other than 0 is sent first as a notification (kvmove delivers a pair's
  notifications before a later grant).
- prefill: the sender claims the grant for its room (``Engine.send``) when
  it arrives; ``init`` maps the grant onto its pages, each ``send`` writes
  that chunk's pages (a session write in the background, never blocking the
  scheduler), the last one adds the auxiliary row and state, and the session
  is finished once every write completed. The decode then decides the
  outcome (``landed`` only if every granted byte was written), which both
  sides report.

Pipeline stages on the prefill: each stage is a rank with its own engine
and its own session per request. The decode grants each stage its layers'
pages (SGLang's own layer partition; the last stage also gets the
auxiliary row and the state). Each stage publishes its state into SGLang's
PP consensus store, and stage 0 answers ``poll_pp_consensus`` from it
(SGLang forwards that answer to the others while requests bootstrap). A
stage whose session landed reports ``Success`` only once the decode's
verdict on the whole request says every stage's landed (a notification the
decode sends each stage when it decides), so the stages never disagree;
without a verdict within ``VERDICT_WAIT`` the request fails.

A decode that ends a request (abort, failure) cancels its sessions and
tells each prefill rank, so a rank that had not claimed its grant yet (or
never got one) fails the request too instead of waiting for a grant.

Notifications between the two sides (``kvmove-sglang/1 KIND ROOM VALUE``):
``p`` the decode's prefix length (before the grant), ``v`` the verdict,
``a`` the request ended on the decode.

Grant layout (both sides build it in this order; the prefill checks that
the grant has exactly the size its own layout needs, else the request fails
with a message naming both sizes): for each KV buffer (``kv_data_ptrs``),
the destination pages in ``send_metadata``'s order (runs of consecutive
pages as one range); then one row of each auxiliary buffer; then, for each
state component and each of its buffers, its indices in order.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import requests

from sglang.srt.disaggregation.base.conn import (
    BaseKVSender,
    KVArgs,
    KVPoll,
    KVTransferDestination,
    KVTransferMetric,
)
from sglang.srt.disaggregation.common.conn import (
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    KVTransferError,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.environ import envs
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.network import get_local_ip_auto

import kvmove

logger = logging.getLogger(__name__)

#: Session state -> SGLang's poll value, once the session exists.
_POLL = {
    "waiting": KVPoll.WaitingForInput,
    "granted": KVPoll.WaitingForInput,
    "transferring": KVPoll.Transferring,
    "landed": KVPoll.Success,
    "failed": KVPoll.Failed,
    "cancelled": KVPoll.Failed,
    "expired": KVPoll.Failed,
}

_META = b"kvmove-sglang/1 "

#: The most ranges one grant may hold (kvmove's MAX_GRANT_RANGES).
MAX_GRANT_RANGES = 65536


def _describe(err: Optional[BaseException], state: str) -> str:
    """kvmove's error as SGLang's failure reason: what ended the session,
    why, its context, its kind and whether it is transient."""
    if err is None:
        return f"kvmove handoff {state}"
    message = getattr(err, "message", None) or str(err)
    context = getattr(err, "context", None) or {}
    facts = [f"{k}: {v}" for k, v in context.items()]
    facts.append(f"kind={getattr(err, 'kind', type(err).__name__)}")
    facts.append(f"transient={bool(getattr(err, 'is_transient', False))}")
    return f"kvmove handoff {state}: {message} ({', '.join(facts)})"


def _peer_name(ip: str, port) -> str:
    return f"[{ip}]:{int(port)}" if ":" in ip and not ip.startswith("[") else f"{ip}:{int(port)}"


def _runs(indices: Sequence[int]) -> List[Tuple[int, int]]:
    """``(first, count)`` for each run of consecutive integers, in order."""
    out: List[Tuple[int, int]] = []
    for i in indices:
        i = int(i)
        if out and out[-1][0] + out[-1][1] == i:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out


def _ranges(ptr: int, item: int, indices: Sequence[int]) -> List[Tuple[int, int]]:
    return [(ptr + first * item, count * item) for first, count in _runs(indices)]


def _state_groups(kv_args: KVArgs, state_indices) -> List[Tuple[int, int, List[int]]]:
    """``(ptr, item_len, indices)`` for each state buffer that has indices,
    in the grant's order."""
    out = []
    if not state_indices:
        return out
    ptrs = getattr(kv_args, "state_data_ptrs", None) or []
    items = getattr(kv_args, "state_item_lens", None) or []
    for comp, idx in enumerate(state_indices):
        if idx is None or comp >= len(ptrs):
            continue
        flat = [int(x) for x in np.asarray(idx).reshape(-1)]
        if not flat:
            continue
        for ptr, item in zip(ptrs[comp], items[comp]):
            out.append((int(ptr), int(item), flat))
    return out


def grant_ranges(
    kv_args: KVArgs,
    kv_indices,
    aux_index: Optional[int],
    state_indices,
    layers: Optional[Tuple[int, int]] = None,
    of_buffer: Optional[List[Optional[int]]] = None,
) -> List[Tuple[int, int]]:
    """The decode's grant for one request (see the module's doc); with
    ``layers`` (``start, end``), only the KV buffers of those layers (one
    prefill pipeline stage's), ``of_buffer`` giving each buffer's layer."""
    pages = [int(p) for p in np.asarray(kv_indices).reshape(-1)]
    out: List[Tuple[int, int]] = []
    for b, (ptr, item) in enumerate(zip(kv_args.kv_data_ptrs, kv_args.kv_item_lens)):
        if layers is not None:
            layer = of_buffer[b] if of_buffer is not None and b < len(of_buffer) else None
            if layer is None or not layers[0] <= layer < layers[1]:
                continue
        out.extend(_ranges(int(ptr), int(item), pages))
    if aux_index is not None:
        for ptr, item in zip(kv_args.aux_data_ptrs, kv_args.aux_item_lens):
            out.append((int(ptr) + int(aux_index) * int(item), int(item)))
    for ptr, item, idx in _state_groups(kv_args, state_indices):
        out.extend(_ranges(ptr, item, idx))
    return out


class _Cursor:
    """Walks a grant's ranges item by item: the destination address of each
    item of a given size, in the grant's order."""

    def __init__(self, ranges: Sequence[Tuple[int, int]]):
        self.ranges = list(ranges)
        self.i = 0
        self.off = 0

    def take(self, item: int, count: int) -> List[int]:
        out = []
        while len(out) < count:
            if self.i >= len(self.ranges):
                raise ValueError("the grant is smaller than this rank's layout")
            addr, length = self.ranges[self.i]
            if length - self.off < item or (length - self.off) % item:
                raise ValueError(
                    f"a granted range of {length} bytes does not split into items of {item} bytes"
                )
            out.append(addr + self.off)
            self.off += item
            if self.off == length:
                self.i += 1
                self.off = 0
        return out

    def rest(self) -> List[Tuple[int, int]]:
        """What is left, from the current position."""
        if self.i >= len(self.ranges):
            return []
        head = self.ranges[self.i]
        return [(head[0] + self.off, head[1] - self.off)] + self.ranges[self.i + 1 :]


def _merge_ops(ops: List[Tuple[int, int, int]]) -> List[Tuple[int, int, int]]:
    """Joins writes that continue each other on both sides."""
    out: List[Tuple[int, int, int]] = []
    for src, dst, n in ops:
        if out and out[-1][0] + out[-1][2] == src and out[-1][1] + out[-1][2] == dst:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((src, dst, n))
    return out


def _bounded_put(table: dict, key, value, limit: int = 65536) -> None:
    """``table[key] = value``, the oldest entries dropped past ``limit``."""
    table.pop(key, None)
    table[key] = value
    while len(table) > limit:
        table.pop(next(iter(table)))


def buffer_layers(kv_args: KVArgs, is_mla: bool) -> List[Optional[int]]:
    """The model layer of each KV buffer, as SGLang lays them out: MHA,
    K of every layer then V of every layer; MLA, one per layer; draft
    model buffers (``num_draft_entries``, at the end) have none."""
    n = len(kv_args.kv_data_ptrs)
    draft = int(getattr(kv_args, "num_draft_entries", 0) or 0)
    main = n - draft
    per_layer = 1 if is_mla else 2
    layers = main // per_layer
    out: List[Optional[int]] = [b % layers if layers else None for b in range(main)]
    return out + [None] * draft


def _regions(spans: Sequence[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """Overlapping or touching ``(addr, length)`` spans joined."""
    out: List[List[int]] = []
    for a, n in sorted((int(a), int(n)) for a, n in spans if int(n) > 0):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], a + n)
        else:
            out.append([a, a + n])
    return [(a, b - a) for a, b in out]


class KvmoveKVManager(CommonKVManager):
    """One per scheduler process: the rank's kvmove engine, its registered
    KV, auxiliary and state buffers, and (prefill) the grants not yet
    claimed by a sender."""

    # The decode holds a failed request's pages until every session of it
    # is final: a receiver's session is final only once its sender is quiet
    # (rule 13 of kvmove's contract), so no write can land after SGLang
    # reuses them.
    supports_deferred_decode_kv_release = True

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: ServerArgs,
        is_mla_backend: Optional[bool] = False,
    ):
        # The engine first: the prefill registers its address with the
        # bootstrap server inside CommonKVManager.__init__.
        host = get_local_ip_auto()
        # KVMOVE_CONFIG (a kvmove TOML file) picks the backend (TCP by
        # default, RDMA) and its options, KVMOVE_POLICY the policy (read by
        # the engine); it listens on SGLang's address whatever the file
        # says, as SGLang registers that one.
        self.engine = kvmove.Engine.from_env(host=host, port=0)
        self.engine_port = int(self.engine.session_id.rsplit(":", 1)[1])
        spans = list(zip(args.kv_data_ptrs, args.kv_data_lens))
        spans += list(zip(args.aux_data_ptrs or [], args.aux_data_lens or []))
        for ptrs, lens in zip(getattr(args, "state_data_ptrs", None) or [], getattr(args, "state_data_lens", None) or []):
            spans += list(zip(ptrs, lens))
        for addr, length in _regions(spans):
            self.engine.register_address(addr, length)
        self._lock = threading.Lock()
        # Cancels and releases that wait on the peer run here, never on the
        # scheduler's thread.
        self._background = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="kvmove-sglang")
        # Prefill: grants seen and not yet claimed (room -> peer), decode
        # prefix lengths announced ((peer, room) -> tokens), rooms whose
        # request ended before its grant came (a grant for them is refused).
        self._grants: Dict[int, str] = {}
        self._prefix: Dict[Tuple[str, int], int] = {}
        self._abandoned: Dict[int, float] = {}
        # Rooms whose grant a sender (or a refusal) took: the engine lists a
        # claimed grant until its first write, so a scan must skip them.
        self._claimed: set = set()
        self._last_scan = 0.0
        # Prefill with pipeline stages: rooms whose grant this rank still
        # awaits (the watch thread publishes it to SGLang's PP consensus),
        # and the decode's verdicts on whole requests ((peer, room) ->
        # landed?), kept for the rooms whose verdict is awaited.
        self._awaiting: set = set()
        self._verdicts: Dict[Tuple[str, int], bool] = {}
        self._waiting_verdict: set = set()
        # Rooms the decode ended before this side's session existed.
        self._ended: Dict[int, float] = {}
        # Prefill with pipeline stages: sessions this stage opened for a
        # grant before its sender asked (SGLang polls only stage 0's senders
        # while requests bootstrap; an opened session notices a dead decode).
        self._opened: Dict[int, "kvmove.SendSession"] = {}
        # Decode: each room's sessions, until SGLang released its pages.
        self._room_sessions: Dict[int, list] = {}
        self._stopping = threading.Event()
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        # CommonKVManager binds a ZeroMQ socket for its own protocol, which
        # kvmove does not use: the engine's port is this rank's port.
        try:
            self.server_socket.close(linger=0)
        except Exception:  # noqa: BLE001
            pass
        self.rank_port = self.engine_port
        self.deadline = float(envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get())
        self.unsupported = self._unsupported_layout()
        if self.unsupported:
            logger.error("kvmove: %s; every request will fail", self.unsupported)
        if disaggregation_mode == DisaggregationMode.PREFILL:
            threading.Thread(target=self._watch, name="kvmove-sglang-grants", daemon=True).start()
        logger.info(
            "kvmove: %s rank listens on %s (%s)",
            disaggregation_mode.value,
            self.engine.session_id,
            self.engine.backend,
        )

    def _unsupported_layout(self) -> Optional[str]:
        if self.attn_cp_size != 1:
            return "kvmove's SGLang backend does not support context parallelism yet"
        return None

    # ---- decode: SGLang's deferred release of a failed request's pages ----

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int = 0) -> bool:
        """Whether the pages of ``bootstrap_room`` may be reused: every
        session of it is final (its sender quiet)."""
        sessions = self._room_sessions.get(bootstrap_room)
        return sessions is None or all(s.done for _, s in sessions)

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        self._room_sessions.pop(bootstrap_room, None)

    @property
    def staged(self) -> bool:
        """A prefill with several pipeline stages (one kvmove session per
        stage and request, and the decode's verdict on the whole request)."""
        return self.disaggregation_mode == DisaggregationMode.PREFILL and self.pp_size > 1

    def register_to_bootstrap(self):
        # The decode reaches this rank's kvmove engine at rank_ip:rank_port.
        self.rank_port = self.engine_port
        super().register_to_bootstrap()

    # ---- prefill: grants that arrive before or after their sender ----

    def claim(self, room: int) -> Optional[str]:
        """The peer that granted ``room``, if its grant came (and is not yet
        claimed). Never blocks."""
        with self._lock:
            if room not in self._grants and time.monotonic() - self._last_scan >= 0.002:
                self._scan_locked()
            peer = self._grants.pop(room, None)
            if peer is not None:
                self._claimed.add(room)
                self._awaiting.discard(room)
            return peer

    def _scan_locked(self) -> None:
        """Reads the grants the engine holds unclaimed: each is a sender's
        to claim, or refused at once if its request already ended."""
        self._last_scan = time.monotonic()
        seen = self.engine.grant_keys()
        # A pair's notifications come before its later grants: read them
        # now, so a prefix length sent before this grant is in.
        for n in self.engine.notifications():
            self._note(n.peer, n.msg)
        # Rebuilt from what the engine holds: a grant that expired unclaimed
        # leaves no entry behind.
        grants = {}
        for peer_name, gid in seen:
            gid = int(gid)
            if gid in self._claimed:
                continue
            if gid in self._abandoned:
                del self._abandoned[gid]
                self._claimed.add(gid)
                self.later(self._refuse, peer_name, gid)
            else:
                grants.setdefault(gid, peer_name)
        self._grants = grants
        if self._awaiting:
            # This stage has the grant: SGLang's PP consensus may let the
            # request on once every stage has its own. The session is opened
            # now (its sender takes it), so a decode that dies meanwhile
            # fails the request on every stage.
            for room in [r for r in self._awaiting if r in grants]:
                self._awaiting.discard(room)
                peer = self._grants.pop(room)
                self._claimed.add(room)
                try:
                    self._opened[room] = self.engine.send(peer, room)
                except kvmove.TransferError as e:
                    logger.debug("kvmove: opening room %s: %s", room, e)
                    self.update_status(room, KVPoll.Failed)
                    self._claimed.discard(room)
                    continue
                self.update_status(room, KVPoll.WaitingForInput)
        for room, sess in list(self._opened.items()):
            if _POLL.get(sess.poll(), KVPoll.Failed) == KVPoll.Failed:
                self.update_status(room, KVPoll.Failed)

    def take_opened(self, room: int):
        """The session the watch thread opened for ``room``, if any."""
        with self._lock:
            return self._opened.pop(room, None)

    def _verdicts_awaited(self) -> bool:
        return self.staged and bool(self._waiting_verdict)

    def _watch(self) -> None:
        """Prefill: refuses the grants of ended requests even when no sender
        polls (the decode frees those pages at once, not at its deadline)."""
        while not self._stopping.wait(0.02 if self.staged else 0.05):
            with self._lock:
                # A grant for an ended request comes soon or never: after
                # the decode's deadline it can no longer come.
                old = time.monotonic() - self.deadline - 60
                for room in [r for r, t in self._abandoned.items() if t < old]:
                    del self._abandoned[room]
                if self._abandoned or self._awaiting or self._opened or self._verdicts_awaited():
                    try:
                        self._scan_locked()
                    except Exception as e:  # noqa: BLE001 (engine closed)
                        logger.debug("kvmove: scanning grants: %s", e)

    def unclaim(self, room: int) -> None:
        """The sender of ``room`` is done with its grant."""
        with self._lock:
            self._claimed.discard(room)

    def _note(self, peer: str, msg: bytes) -> None:
        """A notification from a decode: ``p ROOM TOKENS`` (its prefix
        length, before the grant), ``v ROOM 0|1`` (its verdict on the whole
        request, with pipeline stages) or ``a ROOM 0`` (it ended the
        request). A prefix and a verdict count only from the peer whose
        grant the request's sender claims; each table is bounded (the
        oldest entries go)."""
        if not msg.startswith(_META):
            return
        try:
            kind, room, value = msg[len(_META) :].split(b" ")
            room, value = int(room), int(value)
        except ValueError:
            return
        if kind == b"p" and value >= 0:
            _bounded_put(self._prefix, (peer, room), value)
        elif kind == b"v" and room in self._waiting_verdict:
            _bounded_put(self._verdicts, (peer, room), bool(value))
        elif kind == b"a":
            _bounded_put(self._ended, room, time.monotonic())

    def ended(self, room: int) -> bool:
        """Whether the decode ended ``room``'s request before this side's
        session existed (then no grant comes, or it was withdrawn)."""
        with self._lock:
            return self._ended.pop(room, None) is not None

    def verdict(self, peer: str, room: int) -> Optional[bool]:
        """The decode ``peer``'s verdict on the request of ``room``, if it
        came."""
        with self._lock:
            got = self._verdicts.pop((peer, room), None)
            if got is not None:
                self._waiting_verdict.discard(room)
            return got

    def forget(self, room: int, peer: Optional[str]) -> None:
        """A sender is done with ``room`` (success or failure)."""
        with self._lock:
            self._waiting_verdict.discard(room)
            self._awaiting.discard(room)
            opened = self._opened.pop(room, None)
            if opened is not None:
                self.later(self.end, opened, room)
            if peer is not None:
                self._verdicts.pop((peer, room), None)
                self._prefix.pop((peer, room), None)
        if self.staged:
            self.request_status.pop(room, None)

    def decode_prefix_len(self, peer: Optional[str], room: int) -> int:
        with self._lock:
            return self._prefix.pop((peer, room), 0)

    def abandon(self, room: int) -> None:
        """The request of ``room`` ended before its grant was claimed: a
        grant that comes for it is cancelled, so the decode frees its pages."""
        with self._lock:
            opened = self._opened.pop(room, None)
            if opened is not None:
                self.later(self.end, opened, room)
                return
            peer = self._grants.pop(room, None)
            if peer is None:
                if room in self._claimed:
                    return
                self._abandoned[room] = time.monotonic()
                # Bounded: the oldest go (their grants then expire at the
                # decode's deadline instead).
                while len(self._abandoned) > 65536:
                    self._abandoned.pop(next(iter(self._abandoned)))
                return
            self._claimed.add(room)
        self.later(self._refuse, peer, room)

    def _refuse(self, peer: str, room: int) -> None:
        try:
            s = self.engine.send(peer, room)
            s.cancel()
            s.release()
        except Exception as e:  # noqa: BLE001
            logger.debug("kvmove: refusing the grant of room %s from %s: %s", room, peer, e)
        finally:
            self.unclaim(room)

    def end(self, session, room: int) -> None:
        """Cancels a sender's session (waits for the peer's answer: on the
        background thread), then forgets its room."""
        _cancel_quietly(session)
        self.unclaim(room)

    def later(self, fn, *args) -> None:
        """Runs ``fn(*args)`` on the manager's background thread."""
        try:
            self._background.submit(fn, *args)
        except RuntimeError:  # shut down
            pass

    def close(self) -> None:
        self._stopping.set()
        self._background.shutdown(wait=False)
        self.engine.close()


#: How long a stage of a staged prefill waits, after its own session
#: landed, for the decode's verdict on the whole request before it fails
#: the request (the decode is gone, or cannot reach this stage).
VERDICT_WAIT = 30.0


class KvmoveKVSender(BaseKVSender):
    """Prefill side of one request (see the module's doc)."""

    def __init__(
        self,
        mgr: KvmoveKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ):
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room)
        self.session: Optional[kvmove.SendSession] = None
        self.reason: Optional[str] = None
        self.error: Optional[BaseException] = None
        self.num_kv_indices: Optional[int] = None
        self.aux_index: Optional[int] = None
        self.mapped = False
        self.curr_idx = 0
        self.dst_pages: List[List[int]] = []
        self.aux_dst: List[int] = []
        self.cursor: Optional[_Cursor] = None
        # Sends not written yet: made before the grant was mapped, or
        # waiting for the forward pass that fills their pages (SGLang's
        # early send of a cached prefix hands a CUDA event for that).
        self.pending: List[tuple] = []
        self.writes: List[kvmove.SessionWrite] = []
        self.last_sent = False
        self.finished = False
        self.conclude: Optional[int] = None
        self.published: Optional[int] = None
        self.bytes = 0
        self.first_write: Optional[float] = None
        self.landed_at: Optional[float] = None
        if mgr.staged:
            # SGLang's PP consensus (a store replicated to stage 0) holds
            # each stage's state of the request; the watch thread marks it
            # granted, this sender the rest.
            mgr.update_status(self.bootstrap_room, KVPoll.Bootstrapping)
            with mgr._lock:
                mgr._awaiting.add(self.bootstrap_room)
                # A verdict may come before this stage sees its own landing.
                mgr._waiting_verdict.add(self.bootstrap_room)
        if mgr.unsupported:
            self._fail(mgr.unsupported)
        elif mgr.disaggregation_mode == DisaggregationMode.PREFILL:
            self._place_dp_rank(req_has_disagg_prefill_dp_rank)

    def _place_dp_rank(self, given: bool) -> None:
        """With several data-parallel prefill ranks, the decode must learn
        which one took the request (as SGLang's own senders do): the router
        said so, the room says so (``follow_bootstrap_room``), or this rank
        registers it with the bootstrap server."""
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        if parallel.num_dp_ranks <= 1 or given:
            return
        if (
            parallel.load_balance_method != "follow_bootstrap_room"
            or envs.SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK.get()
        ):
            try:
                r = requests.post(
                    f"http://{self.bootstrap_addr}/register_dp_rank",
                    json={"bootstrap_room": self.bootstrap_room, "dp_rank": self.kv_mgr.attn_dp_rank},
                    timeout=5,
                )
                if r.status_code != 200:
                    logger.error("kvmove: registering the prefill dp rank: %s %s", r.status_code, r.text)
            except Exception as e:  # noqa: BLE001
                logger.error("kvmove: registering the prefill dp rank: %s", e)
        elif self.kv_mgr.attn_dp_rank != self.bootstrap_room % parallel.num_dp_ranks:
            self._fail(
                f"follow_bootstrap_room conflict: dispatched to dp_rank {self.kv_mgr.attn_dp_rank} but "
                f"bootstrap_room {self.bootstrap_room} implies dp_rank "
                f"{self.bootstrap_room % parallel.num_dp_ranks}; set "
                "SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK=1 to allow mixed routing"
            )

    # ---- helpers ----

    def _publish(self, value: int) -> None:
        if self.kv_mgr.staged and value != self.published:
            self.published = value
            self.kv_mgr.update_status(self.bootstrap_room, value)

    def _fail(self, reason: str, err: Optional[BaseException] = None, refuse_grant: bool = True) -> None:
        if self.conclude is not None:
            return
        self.reason = reason
        self.error = err
        self.conclude = KVPoll.Failed
        self._publish(KVPoll.Failed)
        session = self.session
        if session is not None:
            # The decode frees its pages at once (the session ends on both
            # sides); the cancel waits for the peer, so not here.
            self.kv_mgr.later(self.kv_mgr.end, session, self.bootstrap_room)
        elif refuse_grant:
            self.kv_mgr.abandon(self.bootstrap_room)

    def _claim(self) -> None:
        if self.session is not None or self.conclude is not None:
            return
        opened = self.kv_mgr.take_opened(self.bootstrap_room)
        if opened is not None:
            self.session = opened
            return
        peer = self.kv_mgr.claim(self.bootstrap_room)
        if peer is None:
            return
        try:
            self.session = self.kv_mgr.engine.send(peer, self.bootstrap_room)
        except kvmove.TransferError as e:
            self.kv_mgr.unclaim(self.bootstrap_room)
            self._fail(_describe(e, "could not be opened"), e, refuse_grant=False)

    def _map(self) -> None:
        """Maps the grant onto this rank's layout, once init() said how many
        pages go, then sends what was sent before."""
        if self.mapped or self.conclude is not None or self.session is None or self.num_kv_indices is None:
            return
        grant = self.session.grant
        if grant is None:
            return
        args = self.kv_mgr.kv_args
        cursor = _Cursor(grant.ranges)
        total = sum(n for _, n in grant.ranges)
        kv_need = self.num_kv_indices * sum(int(i) for i in args.kv_item_lens)
        aux_need = sum(int(i) for i in args.aux_item_lens) if self.aux_index is not None else 0
        try:
            if total < kv_need:
                raise ValueError("the grant is smaller than this rank's pages")
            self.dst_pages = [cursor.take(int(item), self.num_kv_indices) for item in args.kv_item_lens]
            # With pipeline stages the decode grants the auxiliary row (and
            # the state) to the last stage only.
            if aux_need and total - kv_need >= aux_need:
                self.aux_dst = [cursor.take(int(item), 1)[0] for item in args.aux_item_lens]
        except ValueError as e:
            self._fail(
                f"kvmove: the decode's grant for room {self.bootstrap_room} does not match this prefill "
                f"rank's layout ({e}; the grant has {total} bytes in {len(grant.ranges)} ranges, "
                f"{self.num_kv_indices} pages take {kv_need}, the auxiliary row {aux_need}): the two sides "
                "must run the same model with the same page size and attention TP size"
            )
            return
        self.cursor = cursor
        self.mapped = True
        self._flush()

    def _flush(self) -> None:
        """Writes the pending sends, in order, as far as their pages are
        ready."""
        while self.pending and self.mapped and self.conclude is None:
            pages, state_indices, event = self.pending[0]
            if event is not None and not _event_done(event):
                return
            self.pending.pop(0)
            self._write(pages, state_indices)

    # ---- BaseKVSender ----

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None):
        self.num_kv_indices = int(num_kv_indices)
        self.aux_index = aux_index
        if self.num_kv_indices < 0:
            self._fail(f"kvmove: room {self.bootstrap_room} has {self.num_kv_indices} pages to send (a decode prefix longer than the prompt)")
            return
        # With pipeline stages, SGLang's consensus lets every stage on once
        # all had their grant: this one may not have claimed it yet.
        self._claim()
        self._map()

    def send(self, kv_indices, state_indices: Optional[List] = None, num_kv_tokens: Optional[int] = None, **_):
        # SGLang's early send of a cached prefix, under overlap scheduling,
        # leaves an event the forward stream records once those pages are
        # final; the write waits for it (poll() checks it), never the caller.
        event = getattr(self, "_early_send_wait_event", None)
        self._early_send_wait_event = None
        if self.conclude is not None or self.num_kv_indices is None:
            return
        pages = [int(p) for p in np.asarray(kv_indices).reshape(-1)]
        self.pending.append((pages, state_indices, event))
        if not self.mapped:
            self._claim()
            self._map()
            return
        self._flush()

    def _write(self, pages: List[int], state_indices) -> None:
        args = self.kv_mgr.kv_args
        end = self.curr_idx + len(pages)
        if end > self.num_kv_indices:
            self._fail(
                f"kvmove: room {self.bootstrap_room} sent {end} pages, more than the {self.num_kv_indices} of init()"
            )
            return
        ops = []
        for b, (ptr, item) in enumerate(zip(args.kv_data_ptrs, args.kv_item_lens)):
            ptr, item = int(ptr), int(item)
            dst = self.dst_pages[b]
            ops.extend((ptr + p * item, dst[self.curr_idx + k], item) for k, p in enumerate(pages))
        self.curr_idx = end
        last = end == self.num_kv_indices
        if last:
            for (ptr, item), dst in zip(zip(args.aux_data_ptrs, args.aux_item_lens), self.aux_dst):
                ops.append((int(ptr) + int(self.aux_index) * int(item), dst, int(item)))
            try:
                if self.cursor.rest():
                    for ptr, item, idx in _state_groups(args, state_indices):
                        dsts = self.cursor.take(item, len(idx))
                        ops.extend((ptr + i * item, d, item) for i, d in zip(idx, dsts))
            except ValueError as e:
                self._fail(f"kvmove: the decode's grant for room {self.bootstrap_room} has no room for the state: {e}")
                return
            left = sum(n for _, n in self.cursor.rest())
            if left:
                self._fail(
                    f"kvmove: the decode granted {left} bytes more than room {self.bootstrap_room} has to send "
                    "(the two sides' layouts differ)"
                )
                return
        ops = _merge_ops(ops)
        if ops:
            try:
                self.writes.append(self.session.write_layer(ops))
            except kvmove.TransferError as e:
                self._fail(_describe(e, "write refused"), e)
                return
            if self.first_write is None:
                self.first_write = time.monotonic()
            self.bytes += sum(n for _, _, n in ops)
        self.last_sent = last
        self._maybe_finish()

    def _maybe_finish(self) -> None:
        if not self.last_sent or self.finished or self.conclude is not None:
            return
        if not all(w.done for w in self.writes):
            return
        for w in self.writes:
            out = w.wait(0, check=False)
            if out is not None and not out.ok:
                self._fail(_describe(out.error, "write failed"), out.error)
                return
        try:
            self.session.finish()
        except kvmove.TransferError as e:
            self._fail(_describe(e, "finish refused"), e)
            return
        self.finished = True

    def poll(self) -> KVPoll:
        if self.conclude is not None:
            return self.conclude
        if self.session is None:
            self._claim()
            if self.session is None:
                if self.kv_mgr.ended(self.bootstrap_room):
                    # No grant comes now (or it was withdrawn): none to refuse.
                    self._fail(
                        "kvmove: the decode ended the request before its transfer began (aborted or failed there)",
                        refuse_grant=False,
                    )
                    return KVPoll.Failed
                # Waiting for the decode's grant: no timer runs here; the
                # session's deadline starts at the grant.
                return self.conclude if self.conclude is not None else KVPoll.Bootstrapping
        self._map()
        self._flush()
        self._maybe_finish()
        if self.conclude is not None:
            return self.conclude
        state = self.session.poll()
        value = _POLL.get(state, KVPoll.Failed)
        if value == KVPoll.Failed:
            self._fail(_describe(self.session.error, state), self.session.error)
            return KVPoll.Failed
        if value == KVPoll.Success:
            if self.landed_at is None:
                self.landed_at = time.monotonic()
            if self.kv_mgr.staged:
                # This stage's bytes landed; the request did once the decode
                # says every stage's did.
                verdict = self.kv_mgr.verdict(self.session.peer, self.bootstrap_room)
                if verdict is None:
                    if time.monotonic() - self.landed_at > VERDICT_WAIT:
                        self._fail(
                            f"kvmove: the decode's verdict on room {self.bootstrap_room} did not come within "
                            f"{VERDICT_WAIT:.0f} s of this stage's landing"
                        )
                        return KVPoll.Failed
                    value = KVPoll.Transferring
                elif not verdict:
                    self._fail(
                        f"kvmove handoff failed: the decode failed room {self.bootstrap_room} "
                        "(another pipeline stage's transfer did not land)"
                    )
                    return KVPoll.Failed
            if value == KVPoll.Success:
                self.conclude = value
                self.kv_mgr.unclaim(self.bootstrap_room)
        self._publish(value)
        return value

    def poll_pp_consensus(self) -> KVPoll:
        """Stage 0 answers for every stage (SGLang forwards its answer to
        the others): the least advanced of the stages' states, Bootstrapping
        until every stage has a grant."""
        value = self.poll()
        if not self.kv_mgr.staged:
            return value
        return self.kv_mgr.check_status_pp_consensus(self.bootstrap_room)

    def pop_decode_prefix_len(self) -> int:
        # Called once the grant is claimed: the prefix its decode announced.
        peer = self.session.peer if self.session is not None else None
        return self.kv_mgr.decode_prefix_len(peer, self.bootstrap_room)

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        # The last chunk always goes: it carries the auxiliary row and ends
        # the session, even with no new page.
        return num_pages > 0 or last_chunk

    def get_transfer_metric(self) -> KVTransferMetric:
        latency = None
        if self.first_write is not None and self.landed_at is not None:
            latency = self.landed_at - self.first_write
        return KVTransferMetric(transfer_latency_s=latency, transfer_total_bytes=self.bytes or None)

    def failure_exception(self):
        # SGLang also asks a rank whose own session did not fail (another
        # rank's poll, reduced, said Failed): the request ends here too, so
        # this rank's session ends (or its grant is refused) at once.
        from_another_rank = self.conclude is None
        self._fail("the request failed on another rank")
        reason = self.reason or "kvmove: the request failed on another rank"
        # SGLang drops a failed sender without clear(): this is its end.
        self.clear()
        e = KVTransferError(self.bootstrap_room, reason, is_from_another_rank=from_another_rank)
        e.kvmove_error = self.error
        raise e

    def clear(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            self.kv_mgr.later(_release_quietly, session)
        self.pending = []
        self.kv_mgr.forget(self.bootstrap_room, session.peer if session is not None else None)

    def abort(self):
        self._fail("Aborted by AbortReq.")


class KvmoveKVReceiver(CommonKVReceiver):
    """Decode side of one request: SGLang's rank discovery (``init``), then
    the grants (``send_metadata``: one session per prefill stage) and the
    sessions' states."""

    def __init__(self, mgr: KvmoveKVManager, bootstrap_addr: str, bootstrap_room: Optional[int] = None):
        self.sessions: List[Tuple[str, kvmove.ReceiveSession]] = []
        self.targets: List[Tuple[dict, int]] = []
        self.told = False
        # The grants go out on the manager's threads (a grant may wait on a
        # slow or dead prefill's connection; the scheduler never does).
        self._grant_running = False
        self._grant_error: Optional[str] = None
        self._cleared = False
        self._guard = threading.Lock()
        super().__init__(mgr, bootstrap_addr, bootstrap_room)

    def _fail(self, reason: str) -> None:
        if self.conclude_state == KVPoll.Failed:
            return
        self.kv_mgr.record_failure(self.bootstrap_room, reason)
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
        self.conclude_state = KVPoll.Failed
        self._end(False)

    def _end(self, landed: bool) -> None:
        """The request is decided: sessions still open are cancelled, and a
        prefill with pipeline stages hears the verdict on every stage."""
        with self._guard:
            if self.told:
                return
            self.told = True
            sessions = list(self.sessions)
        staged = getattr(getattr(self, "prefill_info", None), "pp_size", 1) > 1
        for peer, s in sessions:
            if not landed:
                self.kv_mgr.later(_cancel_quietly, s)
            if staged:
                msg = _META + b"v %d %d" % (self.bootstrap_room, 1 if landed else 0)
                self.kv_mgr.later(_notify_quietly, self.kv_mgr.engine, peer, msg)
        if not landed:
            # A prefill rank that has not claimed its grant yet (or got
            # none) learns it from this; the cancel ends a claimed one.
            msg = _META + b"a %d 0" % self.bootstrap_room
            infos = [i for i, _ in self.targets] or [
                i for i in (getattr(self, "bootstrap_infos", None) or []) if not i.get("is_dummy")
            ]
            for info in infos:
                peer = _peer_name(info["rank_ip"], info["rank_port"])
                self.kv_mgr.later(_notify_quietly, self.kv_mgr.engine, peer, msg)

    def init(self, prefill_dp_rank: int):
        if self.kv_mgr.unsupported:
            self._fail(self.kv_mgr.unsupported)
            return
        super().init(prefill_dp_rank)
        if self.conclude_state == KVPoll.Failed:
            return
        infos = [i for i in (self.bootstrap_infos or []) if not i.get("is_dummy")]
        # SGLang fetched one info per target stage, the last stage first.
        stages = list(reversed(self.target_pp_ranks))
        if (
            len(self.target_tp_ranks) != 1
            or len(self.target_cp_ranks) != 1
            or len(infos) != len(stages)
            or self.required_dst_info_num != 1
            or self.prefill_info.attn_tp_size != self.kv_mgr.attn_tp_size
        ):
            self._fail(
                f"kvmove's SGLang backend needs one prefill rank per decode rank and stage (found {len(infos)} "
                f"for {len(self.target_tp_ranks)} TP ranks and stages {stages}; prefill attention TP "
                f"{self.prefill_info.attn_tp_size}, decode {self.kv_mgr.attn_tp_size}): run prefill and decode "
                "with the same attention TP size, no CP"
            )
            return
        args = self.kv_mgr.kv_args
        if len(stages) > 1 and (int(getattr(args, "num_draft_entries", 0) or 0) or getattr(args, "kv_layer_ids", None)):
            # Draft models' KV, and hybrid pools (whose buffers are only
            # some layers'), are not yet split by stage.
            self._fail(
                "kvmove's SGLang backend does not yet move a draft model's KV, or a hybrid model's, from a "
                "prefill with pipeline stages to a decode with fewer"
            )
            return
        self.targets = list(zip(infos, stages))

    def _register_kv_args(self) -> bool:
        # kvmove needs no registration: the grant carries the addresses.
        return True

    def _layers_of(self, stage: int):
        """The layers the prefill's pipeline stage ``stage`` holds, or None
        when this decode rank's buffers are that stage's already."""
        info = self.prefill_info
        if info.pp_size == self.kv_mgr.pp_size:
            return None
        from sglang.srt.distributed.utils import get_pp_indices

        # SGLang's own partition of the layers into stages (honouring
        # SGLANG_PP_LAYER_PARTITION: set it alike on both sides; a prefill
        # stage whose grant does not fit its layers fails the request).
        layers = sum(1 for x in buffer_layers(self.kv_mgr.kv_args, self.kv_mgr.is_mla_backend) if x is not None)
        layers //= 1 if self.kv_mgr.is_mla_backend else 2
        return get_pp_indices(layers, stage, info.pp_size)

    def send_metadata(
        self,
        kv_indices,
        aux_index: Optional[int] = None,
        state_indices: Optional[List] = None,
        decode_prefix_len: Optional[int] = None,
        destination: KVTransferDestination = KVTransferDestination.DEVICE,
        device_kv_indices=None,
    ):
        if self.conclude_state == KVPoll.Failed:
            return
        if destination != KVTransferDestination.DEVICE:
            raise NotImplementedError("Host KV destinations are not supported")
        if not self.targets:
            self._fail(f"kvmove: no prefill rank to grant room {self.bootstrap_room} to")
            return
        args = self.kv_mgr.kv_args
        last = max(stage for _, stage in self.targets)
        of_buffer = buffer_layers(args, self.kv_mgr.is_mla_backend)
        plans = []
        for info, stage in self.targets:
            peer = _peer_name(info["rank_ip"], info["rank_port"])
            layers = self._layers_of(stage)
            mine = (aux_index, state_indices) if layers is None or stage == last else (None, None)
            ranges = grant_ranges(args, kv_indices, *mine, layers=layers, of_buffer=of_buffer)
            if len(ranges) > MAX_GRANT_RANGES:
                self._fail(
                    f"kvmove: room {self.bootstrap_room}'s pages make {len(ranges)} ranges "
                    f"({len(args.kv_data_ptrs)} KV buffers times the runs of consecutive pages), more than a grant "
                    f"holds ({MAX_GRANT_RANGES}): a larger --page-size makes fewer"
                )
                return
            plans.append((peer, ranges))
        # SGLang's deferred release asks the manager about this room.
        self.kv_mgr._room_sessions[self.bootstrap_room] = self.sessions
        with self._guard:
            self._grant_running = True
        try:
            self.kv_mgr._background.submit(self._grant_all, plans, int(decode_prefix_len or 0))
        except RuntimeError:  # the manager is closing
            with self._guard:
                self._grant_running = False
            self._fail("kvmove: the engine is closing")

    def _grant_all(self, plans, prefix: int) -> None:
        """On a manager thread: one grant per prefill stage (the prefix
        length first, if any)."""
        engine = self.kv_mgr.engine
        sessions = self.sessions
        try:
            for peer, ranges in plans:
                with self._guard:
                    if self.told:
                        break
                try:
                    if prefix:
                        engine.notify(peer, _META + b"p %d %d" % (self.bootstrap_room, prefix))
                    s = engine.receive(peer, self.bootstrap_room, ranges, deadline=self.kv_mgr.deadline)
                except kvmove.TransferError as e:
                    self._grant_error = _describe(e, f"grant to {peer} refused")
                    break
                with self._guard:
                    sessions.append((peer, s))
                    late = self.told
                if late:
                    # The request ended while this grant went out.
                    _cancel_quietly(s)
        finally:
            with self._guard:
                self._grant_running = False
                cleared = self._cleared
            if cleared:
                _retire(self.kv_mgr, self.bootstrap_room, sessions)

    def _poll(self) -> KVPoll:
        if self.conclude_state is not None:
            return self.conclude_state
        if self._grant_running:
            return KVPoll.WaitingForInput
        if self._grant_error is not None:
            self._fail(self._grant_error)
            return KVPoll.Failed
        with self._guard:
            sessions = list(self.sessions)
        if not sessions:
            # Before the grant: SGLang's discovery state (no waiting timer
            # here: init_time stays unset, the session's deadline replaces it).
            return super()._poll()
        values = []
        for _, s in sessions:
            state = s.poll()
            value = _POLL.get(state, KVPoll.Failed)
            if value == KVPoll.Failed:
                self._fail(_describe(s.error, state))
                return KVPoll.Failed
            values.append(value)
        value = min(values)
        if value == KVPoll.Success:
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Success)
            self.conclude_state = KVPoll.Success
            self._end(True)
        return value

    def abort(self):
        self._fail("Aborted by AbortReq.")
        self.ensure_abort_notified()

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        # The prefill learns it from the sessions: cancelled on both sides.
        # SGLang then holds the pages until is_abort_release_safe (every
        # session final, its sender quiet).
        if self.abort_notified:
            return
        self.abort_notified = True
        self._end(False)

    def failure_exception(self):
        # A failure SGLang learned elsewhere (another rank's poll) ends this
        # rank's sessions too, and tells a staged prefill.
        self._end(self.conclude_state == KVPoll.Success)
        super().failure_exception()

    def _clear(self) -> None:
        super()._clear()
        with self._guard:
            self._cleared = True
            sessions, self.sessions = self.sessions, []
            busy = self._grant_running
        if busy:
            # The grant task retires the sessions when it ends.
            return
        if sessions:
            self.kv_mgr.later(_retire, self.kv_mgr, self.bootstrap_room, sessions)
        elif self.kv_mgr._room_sessions.get(self.bootstrap_room) is sessions:
            # Granted nothing: nothing to wait for.
            self.kv_mgr._room_sessions.pop(self.bootstrap_room, None)


class KvmoveKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's own bootstrap server: prefill ranks register their kvmove
    engine's address with it; decodes look them up."""


def _cancel_quietly(session) -> None:
    try:
        if not session.done:
            session.cancel()
    except Exception as e:  # noqa: BLE001
        logger.debug("kvmove: cancelling %r: %s", session, e)


def _event_done(event) -> bool:
    try:
        return bool(event.query())
    except Exception:  # noqa: BLE001 (not an event: nothing to wait for)
        return True


def _notify_quietly(engine, peer: str, msg: bytes) -> None:
    try:
        engine.notify(peer, msg)
    except Exception as e:  # noqa: BLE001 (the peer is gone: its sessions fail)
        logger.debug("kvmove: notifying %s: %s", peer, e)


def _retire(mgr, room: int, sessions: list) -> None:
    """Ends (if need be) and forgets a cleared receiver's sessions, then
    the room's entry for the deferred release (every session is final by
    then, so the pages are safe to reuse)."""
    for _, s in sessions:
        _release_quietly(s)
    if mgr._room_sessions.get(room) is sessions:
        mgr._room_sessions.pop(room, None)


def _release_quietly(session) -> None:
    try:
        if not session.done:
            session.cancel()
        session.release()
    except Exception as e:  # noqa: BLE001
        logger.debug("kvmove: releasing %r: %s", session, e)
