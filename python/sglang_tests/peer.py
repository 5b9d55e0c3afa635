"""One SGLang rank (prefill or decode) for the tests of kvmove.sglang, run
as its own process: ``python peer.py ROLE CONFIG_JSON``.

What runs for real: SGLang 0.5.23's configuration (``ServerArgs``,
``publish``), its plugin loader (which finds kvmove's entry point), its
``get_kv_class``, its bootstrap server (prefill), its prefill registration
and decode-side discovery (``CommonKVManager``/``CommonKVReceiver``, through
kvmove's subclasses), and kvmove's sender and receiver. What is stubbed: the
scheduler and its queues: this script calls the sender's and receiver's
methods in the order SGLang's queues do (``prefill.py``: ``poll`` until
``WaitingForInput``, ``init``, ``send`` per chunk, ``poll`` until
``Success``; ``decode.py``: ``try_ensure_parallel_info``, ``init``,
``send_metadata``, ``poll``), and the KV pools are plain CPU tensors laid
out as SGLang's (one buffer per layer for K and one for V, ``item_len`` the
bytes of one page). The ``prefill-queue`` role runs SGLang's own
``PrefillBootstrapQueue`` and the ``decode-sglang-queues`` role SGLang's
own decode queues over its real CPU pools (each function's docstring lists
what stands in for the rest). It prints one JSON line: what happened to
each room.
"""

from __future__ import annotations

import array
import json
import os
import signal
import sys
import time

os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")


def fill(room: int, pos: int, buf: int, item: int) -> bytes:
    """The bytes of page ``pos`` of a request in KV buffer ``buf``."""
    head = b"%d:%d:%d:" % (room, pos, buf)
    body = bytes(((room * 31 + pos * 7 + buf * 13 + i) % 251) for i in range(item))
    return (head + body)[:item]


def bad_pages(kv, dst, room: int, item: int, first: int = 0) -> list:
    """``[position, buffer]`` of each landed page (``dst``: the decode's
    page of each position from ``first`` on) whose bytes are not the
    prefill's."""
    bad = []
    for k, p in enumerate(dst):
        for b, t in enumerate(kv):
            if bytes(t[p * item : (p + 1) * item].numpy()) != fill(room, first + k, b, item):
                bad.append([first + k, b])
    return bad


def state_fill(room: int, buf: int, item: int) -> bytes:
    head = b"state:%d:%d:" % (buf, room)
    return (head + bytes((room * 3 + buf + i) % 241 for i in range(item)))[:item]


def aux_fill(room: int, buf: int, item: int) -> bytes:
    head = b"%d:%d:" % (buf, room)
    return (head + bytes((room + buf + i) % 253 for i in range(item)))[:item]


def stage_layers(cfg: dict) -> int:
    """The layers this rank holds: all, or its pipeline stage's (SGLang's
    own partition), with ``cfg["first_layer"]`` set to the first."""
    pp_size = cfg.get("pp_size", 1)
    if pp_size == 1:
        cfg["first_layer"] = 0
        return cfg["layers"]
    from sglang.srt.distributed.utils import get_pp_indices

    start, end = get_pp_indices(cfg["layers"], cfg["pp_rank"], pp_size)
    cfg["first_layer"] = start
    return end - start


def global_buffer(cfg: dict, b: int, local_layers: int) -> int:
    """The model-wide index of this rank's KV buffer ``b`` (K of every
    layer, then V of every layer), so both sides fill and check the same
    bytes whatever the stages."""
    start = cfg.get("first_layer", 0)
    if b < local_layers:
        return start + b
    return cfg["layers"] + start + (b - local_layers)


def sglang_server_args(role: str, cfg: dict):
    """SGLang's plugin loader (kvmove's entry point) and its configuration
    for this rank (``ServerArgs``, ``publish``), as a scheduler process
    starts."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    server_args = ServerArgs(
        model_path="dummy",
        disaggregation_mode=role.split("-")[0],
        disaggregation_transfer_backend="kvmove",
        host="127.0.0.1",
        disaggregation_bootstrap_port=cfg["bootstrap_port"],
        pp_size=cfg.get("pp_size", 1),
    )
    publish(server_args, role="test", ranks=SpawnRanks(world_rank=cfg.get("pp_rank", 0)))
    return server_args


def setup(role: str, cfg: dict):
    import torch

    server_args = sglang_server_args(role, cfg)
    from sglang.srt.disaggregation.utils import (
        DisaggregationMode,
        KVClassType,
        TransferBackend,
        get_kv_class,
    )

    pp_size, pp_rank = cfg.get("pp_size", 1), cfg.get("pp_rank", 0)
    from sglang.srt.runtime_context import get_parallel

    if pp_size == 1:
        # A scheduler builds torch.distributed's groups; one rank with one
        # pipeline stage has none to build (CommonKVManager only keeps it).
        get_parallel().override_permanently(pp_group=None)
    else:
        # SGLang's own distributed setup, on gloo: the world of the stages,
        # and the pipeline group (SGLang's GroupCoordinator; built directly
        # because SGLang's initialize_model_parallel wants CUDA for NCCL).
        from sglang.srt.distributed import parallel_state

        parallel_state.init_distributed_environment(
            world_size=pp_size,
            rank=pp_rank,
            distributed_init_method=f"tcp://127.0.0.1:{cfg['dist_port']}",
            local_rank=pp_rank,
            backend="gloo",
        )
        group = parallel_state.init_model_parallel_group(
            [list(range(pp_size))], pp_rank, "gloo", use_pynccl=False, use_custom_allreduce=False, group_name="pp"
        )
        get_parallel().override_permanently(pp_group=group)
    backend = TransferBackend(server_args.disaggregation_transfer_backend)
    classes = {k: get_kv_class(backend, k) for k in KVClassType}

    layers, pages, item = stage_layers(cfg), cfg["pages"], cfg["item"]
    aux_rows, aux_items = cfg["aux_rows"], cfg["aux_items"]
    kv = [torch.zeros(pages * item, dtype=torch.uint8) for _ in range(2 * layers)]
    if cfg.get("metadata_buffers"):
        # SGLang's own auxiliary rows (first token, bootstrap room, ...).
        from sglang.srt.disaggregation.utils import MetadataBuffers

        aux = MetadataBuffers(aux_rows, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=0)
        aux_ptrs, aux_lens, aux_item_lens = aux.get_buf_infos()
    else:
        aux = [torch.zeros(aux_rows * n, dtype=torch.uint8) for n in aux_items]
        aux_ptrs, aux_lens, aux_item_lens = [t.data_ptr() for t in aux], [t.numel() for t in aux], list(aux_items)
    args = classes[KVClassType.KVARGS]()
    args.engine_rank = 0
    args.kv_data_ptrs = [t.data_ptr() for t in kv]
    args.kv_data_lens = [t.numel() for t in kv]
    args.kv_item_lens = [item] * len(kv)
    start = cfg.get("first_layer", 0)
    # What SGLang's build_kv_layer_ids gives for an ordinary pool: no ids
    # (the buffers are K of each layer, then V of each layer).
    args.kv_layer_ids = []
    args.aux_data_ptrs = list(aux_ptrs)
    args.aux_data_lens = list(aux_lens)
    args.aux_item_lens = list(aux_item_lens)
    state = []
    if cfg.get("state_slots"):
        # One state component with two buffers (as Mamba's conv and
        # temporal states): one slot of each per request.
        from sglang.srt.disaggregation.base.conn import StateType

        state = [torch.zeros(cfg["state_slots"] * cfg["state_item"], dtype=torch.uint8) for _ in range(2)]
        args.state_types = [StateType.MAMBA]
        args.state_data_ptrs = [[t.data_ptr() for t in state]]
        args.state_data_lens = [[t.numel() for t in state]]
        args.state_item_lens = [[cfg["state_item"]] * 2]
    else:
        args.state_types = []
        args.state_data_ptrs = []
        args.state_data_lens = []
        args.state_item_lens = []
    cfg["_state"] = state
    args.page_size = cfg["page_size"]
    args.kv_cache_dtype_str = "bfloat16"
    args.kv_layout = None
    args.pp_rank = pp_rank
    args.prefill_start_layer = start
    args.system_dp_rank = 0
    args.gpu_id = 0
    args.ib_device = None
    mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
    server = None
    if role == "prefill" and pp_rank == 0:
        server = classes[KVClassType.BOOTSTRAP_SERVER](host="127.0.0.1", port=cfg["bootstrap_port"])
    mgr = classes[KVClassType.MANAGER](args, mode, server_args, False)
    return classes, mgr, kv, aux, server


def emit(**event) -> None:
    print(json.dumps(event, default=str), flush=True)


def tcp_links(own: int, peers) -> int:
    """This process's TCP sockets (any state but TIME_WAIT and LISTEN) on
    its kvmove engine's port or to a peer engine's port: the kernel sockets
    of kvmove's connections, SGLang's own (bootstrap HTTP) left out."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    peers = {int(p) for p in peers}
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            local, remote, state, inode = cols[1], cols[2], cols[3], cols[9]
            if state in ("06", "0A") or inode not in inodes:  # TIME_WAIT, LISTEN
                continue
            lport, rport = int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16)
            if lport == own or rport in peers:
                n += 1
    return n


def settle(count, want: int, limit: float = 30.0):
    """Polls ``count()`` until it is ``want`` or ``limit`` seconds passed:
    ``(last value, seconds taken)``."""
    t0 = time.monotonic()
    while True:
        v = count()
        if want < 0:
            return v, 0.0
        if v == want or time.monotonic() - t0 > limit:
            return v, round(time.monotonic() - t0, 2)
        time.sleep(0.1)


def note_state(r: dict, poll: int) -> None:
    if not r["states"] or r["states"][-1] != poll:
        r["states"].append(poll)


def run_prefill(cfg: dict) -> dict:
    import numpy as np

    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType

    classes, mgr, kv, aux, _server = setup("prefill", cfg)
    item, chunk = cfg["item"], cfg["chunk_pages"]
    port = mgr.engine_port
    peers = set()  # the decodes' engine ports seen
    emit(event="ready", links=tcp_links(port, peers), engine=mgr.engine.session_id)
    phases = []
    for phase, rooms in enumerate(cfg["phases"]):
        hold = cfg.get("hold_phase") == phase
        # The prefill's own page for each position of each request, disjoint.
        free = list(range(cfg["pages"]))[::-1]
        reqs = {}
        for room, npages in rooms:
            src = [free.pop() for _ in range(npages)]
            for pos, p in enumerate(src):
                for b, t in enumerate(kv):
                    t[p * item : (p + 1) * item] = torch_bytes(fill(room, pos, b, item))
            aux_row = len(reqs) % cfg["aux_rows"]
            for b, (t, n) in enumerate(zip(aux, cfg["aux_items"])):
                t[aux_row * n : (aux_row + 1) * n] = torch_bytes(aux_fill(room, b, n))
            slot = len(reqs) % cfg["state_slots"] if cfg.get("state_slots") else None
            if slot is not None:
                si = cfg["state_item"]
                for b, t in enumerate(cfg["_state"]):
                    t[slot * si : (slot + 1) * si] = torch_bytes(state_fill(room, b, si))
            sender = classes[KVClassType.SENDER](
                mgr=mgr, bootstrap_addr=f"127.0.0.1:{cfg['bootstrap_port']}", bootstrap_room=room
            )
            reqs[room] = {"sender": sender, "src": src, "aux": aux_row, "sent": 0, "inited": False, "states": [], "slot": slot}
        deadline = time.monotonic() + cfg["timeout"]
        done = {}
        held = False
        while len(done) < len(reqs) and time.monotonic() < deadline:
            for room, r in reqs.items():
                if room in done:
                    continue
                s = r["sender"]
                poll = int(s.poll())
                note_state(r, poll)
                if s.session is not None:
                    peers.add(int(s.session.peer.rsplit(":", 1)[1]))
                if poll == KVPoll.Failed:
                    try:
                        s.failure_exception()
                    except Exception as e:  # noqa: BLE001
                        done[room] = {"state": "failed", "error": str(e), "states": r["states"], "t": time.monotonic()}
                    continue
                if poll == KVPoll.Success:
                    s.clear()
                    done[room] = {"state": "success", "states": r["states"], "t": time.monotonic()}
                    continue
                if poll == KVPoll.WaitingForInput and not r["inited"]:
                    # As finalize_bootstrap: the decode's cached prefix is
                    # not sent (start_send_idx).
                    prefix = s.pop_decode_prefix_len() // cfg["page_size"]
                    r["prefix"] = prefix
                    s.init(len(r["src"]) - prefix, r["aux"])
                    r["sent"] = prefix
                    r["inited"] = True
                    if room in cfg.get("prefill_abort", []):
                        s.abort()
                        continue
                if r["inited"] and not r.get("last") and not (hold and r["sent"] > r.get("prefix", 0)):
                    part = r["src"][r["sent"] : r["sent"] + chunk]
                    r["sent"] += len(part)
                    last = r["last"] = r["sent"] == len(r["src"])
                    st = [np.array([r["slot"]], dtype=np.int64)] if last and r["slot"] is not None else None
                    if s.should_send_kv_chunk(len(part), last):
                        s.send(np.array(part, dtype=np.int32), st, num_kv_tokens=len(part) * cfg["page_size"])
            if hold and not held and all(KVPoll.Transferring in r["states"] for r in reqs.values()):
                held = True
                emit(event="transferring", phase=phase)
            time.sleep(0.005)
        for room in reqs:
            done.setdefault(room, {"state": "timeout", "states": reqs[room]["states"]})
        links, took = settle(lambda: tcp_links(port, peers), cfg.get("settle_to", {}).get(str(phase), -1))
        out = {"rooms": {str(k): v for k, v in done.items()}, "links": links, "settled_in": took, "stats": mgr.engine.stats()}
        emit(event="phase", phase=phase, **out)
        phases.append(out)
    return {"role": "prefill", "phases": phases}


def torch_bytes(b: bytes):
    import torch

    return torch.frombuffer(bytearray(b), dtype=torch.uint8)


def run_decode(cfg: dict) -> dict:
    import numpy as np

    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType

    classes, mgr, kv, aux, _ = setup("decode", cfg)
    item = cfg["item"]
    emit(event="ready", links=tcp_links(mgr.engine_port, []), engine=mgr.engine.session_id)
    phases = []
    for phase, spec in enumerate(cfg["phases"]):
        addr = f"127.0.0.1:{spec['bootstrap_port']}"
        deadline = time.monotonic() + cfg["timeout"]
        while not mgr.try_ensure_parallel_info(addr):
            if time.monotonic() > deadline:
                return {"role": "decode", "error": f"the prefill at {addr} never registered"}
            time.sleep(0.2)
        # Decode pages in a different order from the prefill's, interleaved.
        free = list(range(cfg["pages"]))
        free = free[1::2] + free[0::2]
        reqs = {}
        prefill_port = None
        for i, (room, npages) in enumerate(spec["rooms"]):
            recv = classes[KVClassType.RECEIVER](mgr=mgr, bootstrap_addr=addr, bootstrap_room=room)
            recv.init(0)
            if prefill_port is None and getattr(recv, "bootstrap_infos", None):
                prefill_port = int(recv.bootstrap_infos[0]["rank_port"])
            # A decode-side cached prefix is not granted (nor sent).
            prefix = cfg.get("decode_prefix", {}).get(str(room), 0)
            dst = [free.pop() for _ in range(npages - prefix)]
            slot = (cfg["state_slots"] - 1 - i % cfg["state_slots"]) if cfg.get("state_slots") else None
            reqs[room] = {
                "recv": recv,
                "dst": dst,
                "aux": i % cfg["aux_rows"],
                "granted": False,
                "states": [],
                "prefix": prefix,
                "slot": slot,
            }
        done = {}
        while len(done) < len(reqs) and time.monotonic() < deadline:
            for room, r in reqs.items():
                if room in done:
                    continue
                recv = r["recv"]
                poll = int(recv.poll())
                note_state(r, poll)
                if poll == KVPoll.WaitingForInput and not r["granted"]:
                    st = [np.array([r["slot"]], dtype=np.int64)] if r["slot"] is not None else None
                    recv.send_metadata(
                        np.array(r["dst"], dtype=np.int32),
                        r["aux"],
                        st,
                        decode_prefix_len=r["prefix"] * cfg["page_size"],
                    )
                    r["granted"] = True
                    if room in cfg.get("decode_abort", []):
                        recv.abort()
                elif poll == KVPoll.Failed:
                    try:
                        recv.failure_exception()
                    except Exception as e:  # noqa: BLE001
                        done[room] = {"state": "failed", "error": str(e), "states": r["states"], "t": time.monotonic()}
                    # SGLang's deferred release: the pages are reused only
                    # once the backend says no write can reach them.
                    t0 = time.monotonic()
                    while not mgr.is_abort_release_safe(room) and time.monotonic() - t0 < 15:
                        time.sleep(0.01)
                    done[room]["release_safe"] = mgr.is_abort_release_safe(room)
                    done[room]["release_safe_after"] = round(time.monotonic() - t0, 3)
                elif poll == KVPoll.Success:
                    bad = bad_pages(kv, r["dst"], room, item, first=r["prefix"])
                    for b, (t, n) in enumerate(zip(aux, cfg["aux_items"])):
                        got = bytes(t[r["aux"] * n : (r["aux"] + 1) * n].numpy())
                        if got != aux_fill(room, b, n):
                            bad.append(["aux", b])
                    if r["slot"] is not None:
                        si = cfg["state_item"]
                        for b, t in enumerate(cfg["_state"]):
                            if bytes(t[r["slot"] * si : (r["slot"] + 1) * si].numpy()) != state_fill(room, b, si):
                                bad.append(["state", b])
                    recv.clear()
                    done[room] = {"state": "success", "bad": bad[:10], "states": r["states"], "t": time.monotonic()}
            if all(r["granted"] for r in reqs.values()) and not any(r.get("told") for r in reqs.values()):
                for r in reqs.values():
                    r["told"] = True
                emit(event="granted", phase=phase)
            time.sleep(0.005)
        for room in reqs:
            done.setdefault(room, {"state": "timeout", "states": reqs[room]["states"]})
        want = cfg.get("settle_to", {}).get(str(phase), -1)
        links, took = settle(lambda: tcp_links(mgr.engine_port, [prefill_port] if prefill_port else []), want)
        out = {"rooms": {str(k): v for k, v in done.items()}, "links": links, "settled_in": took, "stats": mgr.engine.stats()}
        emit(event="phase", phase=phase, **out)
        phases.append(out)
    return {"role": "decode", "phases": phases}


class Stub:
    """Stands in for an SGLang object the code under test only reads
    attributes of (a scheduler, a request)."""

    def __init__(self, **attrs):
        self.__dict__.update(attrs)


def init_gloo(port: int) -> None:
    """torch.distributed's default group, one rank: SGLang's poll
    reductions (``all_reduce_flags``) run for real and reduce nothing."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def logged_polls(sender, log: list):
    """Records each new value the sender's ``poll`` answers, whoever asks."""
    poll = sender.poll

    def wrapper():
        v = int(poll())
        if not log or log[-1] != v:
            log.append(v)
        return v

    sender.poll = wrapper


def run_prefill_queue(cfg: dict) -> dict:
    """The prefill side of the field-report replay, through SGLang's own
    ``PrefillBootstrapQueue.add`` and ``pop_bootstrapped`` (the method
    whose state check killed schedulers) and its poll reduction for the
    inflight requests. Stubbed: the scheduler (the attributes those methods
    read; ``handle_bootstrap_failure`` reduced to recording the failure
    through ``failure_exception``), the requests (the fields they read),
    the forward pass (the KV bytes and SGLang's auxiliary row written
    directly)."""
    import numpy as np

    from sglang.srt.disaggregation import prefill as prefill_mod
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import (
        ReqToMetadataIdxAllocator,
        TransferBackend,
        poll_and_all_reduce_attn_cp_tp_group,
    )
    from sglang.srt.mem_cache.common import kv_to_page_num

    cfg = dict(cfg, metadata_buffers=True)
    pp_size, pp_rank = cfg.get("pp_size", 1), cfg.get("pp_rank", 0)
    if pp_size == 1:
        init_gloo(cfg["gloo_port"])
    classes, mgr, kv, mb, _server = setup("prefill", cfg)
    # Each stage's attention TP group has one rank (SGLang builds them
    # from torch.distributed groups; new_group is collective, so every
    # stage makes every one).
    import torch.distributed as dist

    groups = [dist.new_group([r]) for r in range(pp_size)] if pp_size > 1 else [None]
    mine = groups[pp_rank]
    pp_group = mgr.pp_group if pp_size > 1 else None
    last_stage = pp_rank == pp_size - 1
    if cfg.get("timer_control"):
        use_timer_sender(cfg)
    item, ps = cfg["item"], cfg["page_size"]
    failed, done = {}, {}
    logs: dict = {}

    def handle_bootstrap_failure(req):
        try:
            req.disagg_kv_sender.failure_exception()
        except Exception as e:  # noqa: BLE001
            failed[req.bootstrap_room] = {"state": "failed", "error": str(e), "where": "bootstrap", "t": time.monotonic()}
        q.req_to_metadata_buffer_idx_allocator.free(req.metadata_buffer_index) if req.metadata_buffer_index >= 0 else None
        req.metadata_buffer_index = -1

    sched = Stub(
        attn_cp_cpu_group=mine,
        attn_tp_cpu_group=mine,
        pp_group=pp_group,
        processed_tokens_counter=0,
        token_to_kv_pool_allocator=Stub(page_size=ps),
        tree_cache=None,
        handle_bootstrap_failure=handle_bootstrap_failure,
        retire_unadmitted_request=lambda req: None,
    )
    q = object.__new__(prefill_mod.PrefillBootstrapQueue)
    q.queue = []
    q.pp_size, q.pp_rank, q.tp_rank = pp_size, pp_rank, 0
    q.pp_poll_sync_work_list = []
    q.scheduler = sched
    q.scheduler_stage_metrics = None
    q.kv_manager = mgr
    q.metadata_buffers = mb
    q.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(cfg["aux_rows"])
    q.bootstrap_port = cfg["bootstrap_port"]
    q.transfer_backend = TransferBackend("kvmove")
    q.max_input_len = 1 << 30
    free_pages = list(range(cfg["pages"]))[::-1]
    reqs = {}
    for room, tokens in cfg["requests"]:
        req = Stub(
            rid=f"r{room}",
            bootstrap_room=room,
            bootstrap_host="127.0.0.1",
            disagg_prefill_dp_rank=None,
            origin_input_ids=[7] * tokens,
            sampling_params=Stub(max_new_tokens=16),
            is_retracted=False,
            prefill_attempt_count=0,
            metadata_buffer_index=-1,
            pending_bootstrap=False,
            kv=Stub(holds_kv=False, holds_mamba=False, cache_protected_len=0),
            swa_branching_seqlen=None,
            to_finish=None,
            finished_reason=None,
            time_stats=Stub(set_bootstrap_done_time=lambda *a: None, set_wait_queue_entry_time=lambda *a: None),
        )
        q.add(req, 1)
        logs[room] = []
        logged_polls(req.disagg_kv_sender, logs[room])
        reqs[room] = req
    emit(event="ready", queued=len(q.queue))
    peers = set()  # the decodes' engine ports seen
    inflight = []
    deadline = time.monotonic() + cfg["timeout"]
    crash = None
    while len(done) + len(failed) < len(reqs) and time.monotonic() < deadline:
        try:
            ready = q.pop_bootstrapped()
        except Exception as e:  # noqa: BLE001 (the field report's crash)
            crash = f"{type(e).__name__}: {e}"
            break
        for req in ready:
            # The forward pass: this request's KV pages and auxiliary row.
            n = kv_to_page_num(len(req.origin_input_ids), ps)
            req.src = [free_pages.pop() for _ in range(n)]
            for pos, p in enumerate(req.src):
                for b, t in enumerate(kv):
                    gb = global_buffer(cfg, b, len(kv) // 2)
                    t[p * item : (p + 1) * item] = torch_bytes(fill(req.bootstrap_room, pos, gb, item))
            idx = req.metadata_buffer_index
            if last_stage:
                # The last stage computes the first token.
                mb.output_ids[idx, 0] = req.bootstrap_room % 100000
                mb.bootstrap_room[idx, 0] = req.bootstrap_room
            s = req.disagg_kv_sender
            for i in range(0, max(n, 1), cfg["chunk_pages"]):
                part = req.src[i : i + cfg["chunk_pages"]]
                last = i + cfg["chunk_pages"] >= n
                if s.should_send_kv_chunk(len(part), last):
                    s.send(np.array(part, dtype=np.int32), None, num_kv_tokens=len(part) * ps)
            inflight.append(req)
        for req in inflight:
            sess = req.disagg_kv_sender.session
            if sess is not None:
                peers.add(int(sess.peer.rsplit(":", 1)[1]))
        if inflight or pp_size > 1:
            polls = poll_and_all_reduce_attn_cp_tp_group([r.disagg_kv_sender for r in inflight], mine, mine)
            if pp_size > 1:
                # SGLang's PP release (_pp_pd_get_prefill_transferred_ids):
                # a request leaves the inflight queue once every stage's
                # own poll is final; each stage then acts on its own poll.
                final = [r.rid for r, v in zip(inflight, polls) if v in (KVPoll.Success, KVPoll.Failed)]
                if pp_rank > 0:
                    final = sorted(set(final) & set(pp_group.recv_object(src=pp_rank - 1)))
                if pp_rank + 1 < pp_size:
                    pp_group.send_object(final, dst=pp_rank + 1)
                if pp_rank == pp_size - 1 and pp_size > 1:
                    pp_group.send_object(final, dst=0)
                if pp_rank == 0:
                    final = pp_group.recv_object(src=pp_size - 1)
                final = set(final)
            keep = []
            for req, poll in zip(inflight, polls):
                if pp_size > 1 and req.rid not in final:
                    keep.append(req)
                    continue
                if poll == KVPoll.Success:
                    req.disagg_kv_sender.clear()
                    done[req.bootstrap_room] = {"state": "success"}
                elif poll == KVPoll.Failed:
                    try:
                        req.disagg_kv_sender.failure_exception()
                    except Exception as e:  # noqa: BLE001
                        failed[req.bootstrap_room] = {
                            "state": "failed",
                            "error": str(e),
                            "where": "inflight",
                            "t": time.monotonic(),
                        }
                elif poll in (KVPoll.WaitingForInput, KVPoll.Transferring):
                    keep.append(req)
                    continue
                else:
                    crash = f"RuntimeError: Unexpected poll state {poll} for req {req.rid} in inflight queue"
                    break
                free_pages.extend(req.src)
                q.req_to_metadata_buffer_idx_allocator.free(req.metadata_buffer_index)
            inflight = keep
            if crash:
                break
        time.sleep(0.005)
    rooms = {}
    for room in reqs:
        r = done.get(room) or failed.get(room) or {"state": "timeout"}
        rooms[str(room)] = dict(r, states=logs[room])
    links = {str(port): tcp_links(-1, [port]) for port in sorted(peers)}
    return {"role": "prefill", "crash": crash, "rooms": rooms, "links": links}


def use_timer_sender(cfg: dict) -> None:
    """The control: the sender also fails a request still waiting for its
    grant after SGLang's bootstrap timeout counted from its arrival, as
    SGLang's own senders do (``CommonKVSender._check_bootstrap_timeout``).
    The replay must then fail (so it can)."""
    from sglang.srt.disaggregation import prefill as prefill_mod
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.environ import envs

    import kvmove.sglang.conn as conn

    limit = envs.SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT.get()

    class TimerSender(conn.KvmoveKVSender):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.arrived = time.monotonic()

        def poll(self):
            v = super().poll()
            if v == KVPoll.Bootstrapping and time.monotonic() - self.arrived >= limit:
                self._fail(f"Request {self.bootstrap_room} timed out after {limit}s in KVPoll.Bootstrapping")
                return KVPoll.Failed
            return v

    orig = prefill_mod.get_kv_class

    def get_kv_class(backend, class_type):
        got = orig(backend, class_type)
        return TimerSender if got is conn.KvmoveKVSender else got

    prefill_mod.get_kv_class = get_kv_class


def run_decode_queue(cfg: dict) -> dict:
    """The decode side of the replay: few free pages, so requests wait for
    them (SGLang's ``pop_preallocated`` stops at the first request that does
    not fit: here, FIFO on a page budget, stubbed), each granted once its
    pages are allocated, its pages held a while after landing (the decode
    running), and SGLang's own poll reduction with its metadata gate (a
    request is done only once its auxiliary row, written by the prefill,
    carries its bootstrap room) deciding when a request has landed. With
    ``decode_phases``, one prefill after the other (the next once every
    request of the one before ended)."""
    init_gloo(cfg["gloo_port"])
    classes, mgr, kv, mb, _ = setup("decode", dict(cfg, metadata_buffers=True))
    phases = cfg.get("decode_phases") or [
        {"bootstrap_port": cfg["bootstrap_port"], "requests": cfg["requests"][cfg.get("first_request", 0) :]}
    ]
    emit(event="ready", engine=mgr.engine.session_id)
    results = []
    for phase, spec in enumerate(phases):
        got = serve_decode(cfg, classes, mgr, kv, mb, spec)
        if got.get("crash") or got.get("error"):
            return dict(got, role="decode")
        results.append(got)
        emit(event="phase", phase=phase, **got)
    if len(results) == 1:
        return dict(results[0], role="decode")
    return {"role": "decode", "crash": None, "phases": results}


def serve_decode(cfg: dict, classes, mgr, kv, mb, spec: dict) -> dict:
    """One prefill's requests (``spec``) through the decode: see
    run_decode_queue."""
    import numpy as np

    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType, ReqToMetadataIdxAllocator, poll_and_all_reduce
    from sglang.srt.mem_cache.common import kv_to_page_num

    item, ps = cfg["item"], cfg["page_size"]
    addr = f"127.0.0.1:{spec['bootstrap_port']}"
    deadline = time.monotonic() + cfg["timeout"]
    while not mgr.try_ensure_parallel_info(addr):
        if time.monotonic() > deadline:
            return {"error": f"the prefill at {addr} never registered"}
        time.sleep(0.2)
    slots = ReqToMetadataIdxAllocator(cfg["aux_rows"])
    free_pages = list(range(cfg["decode_pages"]))
    free_pages = free_pages[1::2] + free_pages[0::2]
    waiting, transfer, running = [], [], []
    reqs = {}
    stage_ports = set()
    for room, tokens in spec["requests"]:
        recv = classes[KVClassType.RECEIVER](mgr=mgr, bootstrap_addr=addr, bootstrap_room=room)
        recv.init(0)
        stage_ports.update(int(info["rank_port"]) for info, _ in recv.targets)
        r = Stub(room=room, recv=recv, pages=kv_to_page_num(tokens, ps), dst=None, metadata_buffer_index=-1,
                 req=Stub(bootstrap_host="127.0.0.1"), states=[], log=[], granted_at=None)
        logged_polls(recv, r.log)
        reqs[room] = r
        waiting.append(r)
    started = time.monotonic()
    granted = 0
    out = {}
    max_in_flight = 0
    while len(out) < len(reqs) and time.monotonic() < deadline:
        # Allocation, in order, stopping at the first request that does not fit.
        while waiting and len(free_pages) >= waiting[0].pages and slots.available_size() > 0:
            r = waiting.pop(0)
            r.dst = [free_pages.pop() for _ in range(r.pages)]
            r.metadata_buffer_index = slots.alloc()
            r.recv.send_metadata(np.array(r.dst, dtype=np.int32), r.metadata_buffer_index, None, decode_prefix_len=0)
            r.granted_at = time.monotonic() - started
            transfer.append(r)
            granted += 1
            if granted in (cfg.get("die_after_grants"), spec.get("announce_after_grants")):
                # The grants go out on the manager's threads: wait until
                # they did (each receiver holds its sessions), at most 5 s.
                t0 = time.monotonic()
                while time.monotonic() - t0 < 5 and not all(len(x.recv.sessions) == len(x.recv.targets) for x in transfer):
                    time.sleep(0.001)
            if granted == cfg.get("die_after_grants"):
                # Killed mid-transfer: the prefill has these grants and is
                # writing (or about to).
                time.sleep(cfg.get("die_delay", 0.0))
                emit(event="dying", t=time.monotonic())
                os.kill(os.getpid(), signal.SIGKILL)
            if granted == spec.get("announce_after_grants"):
                # The test kills the prefill now.
                emit(event="granted", n=granted, t=time.monotonic())
        max_in_flight = max(max_in_flight, len(transfer))
        if transfer:
            polls = poll_and_all_reduce([r.recv for r in transfer], None, decode_reqs=transfer, metadata_buffers=mb)
            keep = []
            for r, poll in zip(transfer, polls):
                if poll == KVPoll.Success:
                    bad = bad_pages(kv, r.dst, r.room, item)
                    idx = r.metadata_buffer_index
                    if int(mb.bootstrap_room[idx, 0]) != r.room or int(mb.output_ids[idx, 0]) != r.room % 100000:
                        bad.append(["aux", int(mb.bootstrap_room[idx, 0])])
                    r.recv.clear()
                    out[r.room] = {"state": "success", "bad": bad[:10]}
                    running.append((time.monotonic() + cfg["decode_seconds"], r))
                elif poll == KVPoll.Failed:
                    try:
                        r.recv.failure_exception()
                    except Exception as e:  # noqa: BLE001
                        out[r.room] = {
                            "state": "failed",
                            "error": str(e),
                            "failed_after": time.monotonic() - started,
                            "t": time.monotonic(),
                        }
                    running.append((0.0, r))
                elif poll in (KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring):
                    keep.append(r)
                else:
                    return {"crash": f"ValueError: Unexpected poll case: {poll}"}
            transfer = keep
        # Requests that finished decoding give their pages and slot back
        # (SGLang's clear_slot resets the row's bootstrap room).
        now = time.monotonic()
        for until, r in [x for x in running if x[0] <= now]:
            running.remove((until, r))
            free_pages.extend(r.dst)
            mb.bootstrap_room[r.metadata_buffer_index, 0] = 0
            slots.free(r.metadata_buffer_index)
        time.sleep(0.005)
    rooms = {}
    for room, r in reqs.items():
        rooms[str(room)] = dict(out.get(room, {"state": "timeout"}), states=r.log, granted_after=r.granted_at)
    links, took = settle(lambda: tcp_links(mgr.engine_port, stage_ports), spec.get("settle_to", -1))
    return {
        "crash": None,
        "rooms": rooms,
        "max_in_flight": max_in_flight,
        "links": links,
        "settled_in": took,
        "stage_ports": sorted(stage_ports),
    }


def run_decode_sglang_queues(cfg: dict) -> dict:
    """The decode side through SGLang's own decode queues: requests enter
    ``DecodePreallocQueue.add`` (which makes kvmove's receiver and calls its
    ``init``), and each scheduler step is SGLang's ``process_decode_queue``
    (``pop_preallocated``: the handshake poll, the admission budget, the
    page allocation from the real pool and the grant through the receiver's
    ``send_metadata``; ``DecodeTransferQueue.pop_transferred``: SGLang's
    poll reduction with its metadata gate, ``_commit_transfer_to_req``
    reading the auxiliary row into the request and checking its bootstrap
    room, the metadata slot cleared and freed). The manager is made by
    ``DecodePreallocQueue._init_kv_manager`` from the real pool's buffers.
    A request that arrived is held ``decode_seconds`` in the running batch
    (its tokens count as retractable in SGLang's budget), then finished as
    SGLang finishes a request whose only token is the prefill's
    (``process_batch_result_prebuilt``: ``update_finish_state``,
    ``release_kv_cache`` back to the tree cache and pools), so waiting
    requests get its pages. What is SGLang's, real on CPU: the KV pool
    (``MHATokenToKVPool``, device "cpu"), its paged allocator
    (``PagedTokenToKVPoolAllocator``), ``DecodeReqToTokenPool``, the tree
    cache (``UnifiedRadixCache``, disabled as a decode's is by default),
    ``MetadataBuffers``, ``ReqToMetadataIdxAllocator``, ``Req`` (with
    ``SamplingParams``), the attention TP group (``GroupCoordinator`` on
    gloo, one rank). Stubbed: the scheduler (a ``Stub`` with the attributes
    those methods read: no model, so ``tp_worker``/``model_config`` give
    the pool's dtype and layer count; features off: LoRA, HiSparse,
    HiCache, priority, metrics; ``output_streamer`` takes the requests
    SGLang streams to the client, of which an aborted one ends here as
    failed; the reasoning-token hook does nothing), the forward pass (the
    decode's tokens are not computed: a request runs for ``decode_seconds``
    and stops at its length). Each request's pages are read from
    ``req_to_token_pool`` as SGLang addresses them and compared with the
    prefill's bytes."""
    import torch

    from sglang.srt.distributed import parallel_state
    from sglang.srt.disaggregation import decode as decode_mod
    from sglang.srt.disaggregation.utils import MetadataBuffers, ReqToMetadataIdxAllocator, TransferBackend
    from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.common import kv_to_page_indices
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    server_args = sglang_server_args("decode", cfg)
    parallel_state.init_distributed_environment(
        world_size=1,
        rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{cfg['gloo_port']}",
        local_rank=0,
        backend="gloo",
    )
    attn_tp = parallel_state.init_model_parallel_group(
        [[0]], 0, "gloo", use_pynccl=False, use_custom_allreduce=False, group_name="attn_tp"
    )
    get_parallel().override_permanently(pp_group=None, attn_tp_group=attn_tp)

    ps, item, layers = cfg["page_size"], cfg["item"], cfg["layers"]
    tokens = cfg["decode_pages"] * ps
    # One KV head of item/(2*ps) bf16 values: a page is ``item`` bytes in
    # each buffer, as the prefill's.
    pool = MHATokenToKVPool(
        tokens, ps, torch.bfloat16, head_num=1, head_dim=item // (2 * ps), layer_num=layers,
        device="cpu", enable_memory_saver=False,
    )
    allocator = PagedTokenToKVPoolAllocator(tokens, ps, torch.bfloat16, "cpu", pool, need_sort=False)
    rows = cfg["aux_rows"]
    req_to_token = decode_mod.DecodeReqToTokenPool(
        size=rows, max_context_len=cfg.get("max_context", 4096), device="cpu", enable_memory_saver=False,
        pre_alloc_size=rows,
    )
    params = CacheInitParams(disable=True, req_to_token_pool=req_to_token, token_to_kv_pool_allocator=allocator, page_size=ps)
    params.tree_components = (ComponentType.FULL,)
    tree = UnifiedRadixCache(params)
    mb = MetadataBuffers(rows, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=0)
    slots = ReqToMetadataIdxAllocator(rows)
    streamed = []
    sched = Stub(
        server_args=server_args,
        disaggregation_mode=decode_mod.DisaggregationMode.DECODE,
        tp_worker=Stub(is_hybrid_swa=False, model_runner=Stub(kv_cache_dtype_str="bfloat16")),
        model_config=Stub(num_hidden_layers=layers),
        random_seed=0,
        enable_hisparse=False,
        enable_lora=False,
        enable_priority_scheduling=False,
        enable_decode_hicache=False,
        spec_algorithm=SpeculativeAlgorithm.NONE,
        metrics_reporter=Stub(enable_metrics=False),
        scheduler_stage_metrics=None,
        output_streamer=Stub(stream_output=lambda reqs, *a, **k: streamed.extend(reqs)),
        batch_result_processor=Stub(_maybe_update_reasoning_tokens=lambda req, tok: None),
        retire_unadmitted_request=lambda req: streamed.append(req),
        running_batch=Stub(reqs=[]),
        waiting_queue=[],
        last_batch=None,
        tree_cache=tree,
        token_to_kv_pool_allocator=allocator,
        disagg_decode_prealloc_queue=None,
    )
    transfer = decode_mod.DecodeTransferQueue(slots, mb, sched, tree)
    prealloc = decode_mod.DecodePreallocQueue(
        req_to_token, allocator, None, slots, mb, sched, transfer, tree,
        gpu_id=0, bootstrap_port=cfg["bootstrap_port"], max_total_num_tokens=tokens,
        num_reserved_decode_tokens=cfg.get("reserved_decode_tokens", ps), transfer_backend=TransferBackend("kvmove"),
    )
    sched.disagg_decode_prealloc_queue = prealloc
    sched.disagg_decode_transfer_queue = transfer
    mgr = prealloc.kv_manager
    kv = [t.view(torch.uint8).reshape(-1) for t in list(pool.k_buffer) + list(pool.v_buffer)]
    assert [t.data_ptr() for t in kv] == mgr.kv_args.kv_data_ptrs, "the pool's buffers are not the ones registered"
    emit(event="ready", engine=mgr.engine.session_id)

    deadline = time.monotonic() + cfg["timeout"]
    reqs, logs, out = {}, {}, {}
    for room, ntok in cfg["requests"]:
        # One new token: the prefill's; the request is then finished.
        sampling = SamplingParams(max_new_tokens=1)
        sampling.normalize(None)  # as SGLang's tokenizer manager does
        req = Req(
            f"r{room}", "", array.array("q", [7] * ntok), sampling,
            bootstrap_host="127.0.0.1", bootstrap_port=cfg["bootstrap_port"], bootstrap_room=room,
        )
        prealloc.add(req)
        reqs[room] = req
    # SGLang makes the receivers in add (the fast path resolves the prefill
    # once its parallel info is cached, else pop_preallocated does).
    for dr in prealloc.queue:
        logs[dr.req.bootstrap_room] = []
        logged_polls(dr.kv_receiver, logs[dr.req.bootstrap_room])
    started = time.monotonic()
    running = []  # (finish at, req)
    max_in_flight = max_waiting = 0
    crash = None

    def crashed(e: Exception) -> str:
        import traceback

        return f"{type(e).__name__}: {e} at {traceback.format_exc().splitlines()[-3].strip()}"

    while (len(out) < len(reqs) or running) and time.monotonic() < deadline:
        try:
            decode_mod.SchedulerDisaggregationDecodeMixin.process_decode_queue(sched)
        except Exception as e:  # noqa: BLE001 (a queue that raises kills a scheduler)
            crash = crashed(e)
            break
        waiting = sum(1 for dr in prealloc.queue if dr.waiting_for_input)
        max_waiting = max(max_waiting, waiting)
        max_in_flight = max(max_in_flight, len(transfer.queue))
        for dr in transfer.queue:
            r = dr.req
            if getattr(r, "granted_after", None) is None:
                r.granted_after = time.monotonic() - started
        for req in sched.waiting_queue:
            # Arrived: SGLang committed the auxiliary row to the request;
            # its pages are those its row of req_to_token names.
            room = req.bootstrap_room
            n = len(req.origin_input_ids)
            idx = req_to_token.req_to_token[req.kv.req_pool_idx][:n]
            dst = [int(p) for p in kv_to_page_indices(idx, ps)] if n else []
            bad = bad_pages(kv, dst, room, item)
            if list(req.output_ids) != [room % 100000]:
                bad.append(["aux", list(req.output_ids)])
            out[room] = {"state": "success", "bad": bad[:10], "pages": dst}
            running.append((time.monotonic() + cfg["decode_seconds"], req))
            sched.running_batch.reqs.append(req)
        sched.waiting_queue = []
        for req in streamed:
            if isinstance(req.finished_reason, FINISH_ABORT) and req.bootstrap_room not in out:
                out[req.bootstrap_room] = {"state": "failed", "error": req.finished_reason.message}
        streamed.clear()
        now = time.monotonic()
        done = [r for t, r in running if t <= now]
        if done:
            # The decode finished them: SGLang's own release.
            running = [(t, r) for t, r in running if t > now]
            sched.running_batch.reqs = [r for _, r in running]
            try:
                SchedulerBatchResultProcessor.process_batch_result_prebuilt(sched, Stub(reqs=done, return_logprob=False))
            except Exception as e:  # noqa: BLE001
                crash = crashed(e)
                break
        time.sleep(0.005)
    rooms = {}
    for room, req in reqs.items():
        rooms[str(room)] = dict(out.get(room, {"state": "timeout"}), states=logs.get(room, []),
                                granted_after=getattr(req, "granted_after", None))
    return {
        "role": "decode",
        "crash": crash,
        "rooms": rooms,
        "max_in_flight": max_in_flight,
        "max_waiting": max_waiting,
        # What SGLang's release gave back once every request finished.
        "free_pages_end": allocator.available_size() // ps,
        "free_rows_end": req_to_token.available_size(),
        "free_slots_end": slots.available_size(),
    }


def main() -> None:
    role, cfg = sys.argv[1], json.loads(sys.argv[2])
    signal.signal(signal.SIGTERM, lambda *_: os._exit(3))
    run = {
        "prefill": run_prefill,
        "decode": run_decode,
        "prefill-queue": run_prefill_queue,
        "decode-queue": run_decode_queue,
        "decode-sglang-queues": run_decode_sglang_queues,
    }[role]
    result = run(cfg)
    print(json.dumps({"result": result}, default=str), flush=True)
    if cfg.get("linger"):
        time.sleep(cfg["linger"])
    os._exit(0)


if __name__ == "__main__":
    main()
