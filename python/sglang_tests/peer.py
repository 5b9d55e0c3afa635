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
bytes of one page). It prints one JSON line: what happened to each room.
"""

from __future__ import annotations

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


def aux_fill(room: int, buf: int, item: int) -> bytes:
    head = b"%d:%d:" % (buf, room)
    return (head + bytes((room + buf + i) % 253 for i in range(item)))[:item]


def setup(role: str, cfg: dict):
    import torch

    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    from sglang.srt.disaggregation.utils import (
        DisaggregationMode,
        KVClassType,
        TransferBackend,
        get_kv_class,
    )

    server_args = ServerArgs(
        model_path="dummy",
        disaggregation_mode=role,
        disaggregation_transfer_backend="kvmove",
        host="127.0.0.1",
        disaggregation_bootstrap_port=cfg["bootstrap_port"],
    )
    publish(server_args, role="test", ranks=SpawnRanks(world_rank=0))
    # A scheduler builds torch.distributed's groups; one rank with one
    # pipeline stage has none to build (CommonKVManager only keeps it).
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(pp_group=None)
    backend = TransferBackend(server_args.disaggregation_transfer_backend)
    classes = {k: get_kv_class(backend, k) for k in KVClassType}

    layers, pages, item = cfg["layers"], cfg["pages"], cfg["item"]
    aux_rows, aux_items = cfg["aux_rows"], cfg["aux_items"]
    kv = [torch.zeros(pages * item, dtype=torch.uint8) for _ in range(2 * layers)]
    aux = [torch.zeros(aux_rows * n, dtype=torch.uint8) for n in aux_items]
    args = classes[KVClassType.KVARGS]()
    args.engine_rank = 0
    args.kv_data_ptrs = [t.data_ptr() for t in kv]
    args.kv_data_lens = [t.numel() for t in kv]
    args.kv_item_lens = [item] * len(kv)
    args.kv_layer_ids = list(range(layers)) * 2
    args.aux_data_ptrs = [t.data_ptr() for t in aux]
    args.aux_data_lens = [t.numel() for t in aux]
    args.aux_item_lens = list(aux_items)
    args.state_types = []
    args.state_data_ptrs = []
    args.state_data_lens = []
    args.state_item_lens = []
    args.page_size = cfg["page_size"]
    args.kv_cache_dtype_str = "bfloat16"
    args.kv_layout = None
    args.pp_rank = 0
    args.prefill_start_layer = 0
    args.system_dp_rank = 0
    args.gpu_id = 0
    args.ib_device = None
    mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
    server = None
    if role == "prefill":
        server = classes[KVClassType.BOOTSTRAP_SERVER](host="127.0.0.1", port=cfg["bootstrap_port"])
    mgr = classes[KVClassType.MANAGER](args, mode, server_args, False)
    return classes, mgr, kv, aux, server


def run_prefill(cfg: dict) -> dict:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType

    classes, mgr, kv, aux, _server = setup("prefill", cfg)
    item, chunk = cfg["item"], cfg["chunk_pages"]
    # The prefill's own page for each position of each request, disjoint.
    free = list(range(cfg["pages"]))[::-1]
    reqs = {}
    for room, npages in cfg["rooms"]:
        src = [free.pop() for _ in range(npages)]
        for pos, p in enumerate(src):
            for b, t in enumerate(kv):
                t[p * item : (p + 1) * item] = torch_bytes(fill(room, pos, b, item))
        aux_row = len(reqs)
        for b, (t, n) in enumerate(zip(aux, cfg["aux_items"])):
            t[aux_row * n : (aux_row + 1) * n] = torch_bytes(aux_fill(room, b, n))
        sender = classes[KVClassType.SENDER](
            mgr=mgr, bootstrap_addr=f"127.0.0.1:{cfg['bootstrap_port']}", bootstrap_room=room
        )
        reqs[room] = {"sender": sender, "src": src, "aux": aux_row, "sent": 0, "inited": False, "states": []}
    print(json.dumps({"ready": True}), flush=True)
    deadline = time.monotonic() + cfg["timeout"]
    done = {}
    while len(done) < len(reqs) and time.monotonic() < deadline:
        for room, r in reqs.items():
            if room in done:
                continue
            s = r["sender"]
            poll = int(s.poll())
            if not r["states"] or r["states"][-1] != poll:
                r["states"].append(poll)
            if poll == KVPoll.Failed:
                try:
                    s.failure_exception()
                except Exception as e:  # noqa: BLE001
                    done[room] = {"state": "failed", "error": str(e), "states": r["states"]}
                continue
            if poll == KVPoll.Success:
                s.clear()
                done[room] = {"state": "success", "states": r["states"]}
                continue
            if poll == KVPoll.WaitingForInput and not r["inited"]:
                prefix = s.pop_decode_prefix_len()
                s.init(len(r["src"]) - prefix // cfg["page_size"], r["aux"])
                r["inited"] = True
            if r["inited"] and not r.get("last"):
                import numpy as np

                part = r["src"][r["sent"] : r["sent"] + chunk]
                r["sent"] += len(part)
                last = r["last"] = r["sent"] == len(r["src"])
                if s.should_send_kv_chunk(len(part), last):
                    s.send(np.array(part, dtype=np.int32), None, num_kv_tokens=len(part) * cfg["page_size"])
        time.sleep(0.005)
    for room in reqs:
        done.setdefault(room, {"state": "timeout", "states": reqs[room]["states"]})
    return {"role": "prefill", "rooms": {str(k): v for k, v in done.items()}, "sessions": mgr.engine.stats()}


def torch_bytes(b: bytes):
    import torch

    return torch.frombuffer(bytearray(b), dtype=torch.uint8)


def run_decode(cfg: dict) -> dict:
    import numpy as np

    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType

    classes, mgr, kv, aux, _ = setup("decode", cfg)
    addr = f"127.0.0.1:{cfg['bootstrap_port']}"
    deadline = time.monotonic() + cfg["timeout"]
    while not mgr.try_ensure_parallel_info(addr):
        if time.monotonic() > deadline:
            return {"role": "decode", "error": "the prefill never registered"}
        time.sleep(0.2)
    item = cfg["item"]
    # Decode pages in a different order from the prefill's, interleaved.
    free = list(range(cfg["pages"]))
    free = free[1::2] + free[0::2]
    reqs = {}
    for i, (room, npages) in enumerate(cfg["rooms"]):
        recv = classes[KVClassType.RECEIVER](mgr=mgr, bootstrap_addr=addr, bootstrap_room=room)
        recv.init(0)
        dst = [free.pop() for _ in range(npages)]
        reqs[room] = {"recv": recv, "dst": dst, "aux": i, "granted": False, "states": []}
    done = {}
    while len(done) < len(reqs) and time.monotonic() < deadline:
        for room, r in reqs.items():
            if room in done:
                continue
            recv = r["recv"]
            poll = int(recv.poll())
            if not r["states"] or r["states"][-1] != poll:
                r["states"].append(poll)
            if poll == KVPoll.WaitingForInput and not r["granted"]:
                recv.send_metadata(np.array(r["dst"], dtype=np.int32), r["aux"], None, decode_prefix_len=0)
                r["granted"] = True
            elif poll == KVPoll.Failed:
                try:
                    recv.failure_exception()
                except Exception as e:  # noqa: BLE001
                    done[room] = {"state": "failed", "error": str(e), "states": r["states"]}
            elif poll == KVPoll.Success:
                bad = []
                for pos, p in enumerate(r["dst"]):
                    for b, t in enumerate(kv):
                        got = bytes(t[p * item : (p + 1) * item].numpy())
                        if got != fill(room, pos, b, item):
                            bad.append([pos, b])
                for b, (t, n) in enumerate(zip(aux, cfg["aux_items"])):
                    got = bytes(t[r["aux"] * n : (r["aux"] + 1) * n].numpy())
                    if got != aux_fill(room, b, n):
                        bad.append(["aux", b])
                recv.clear()
                done[room] = {"state": "success", "bad": bad[:10], "states": r["states"]}
        time.sleep(0.005)
    for room in reqs:
        done.setdefault(room, {"state": "timeout", "states": reqs[room]["states"]})
    return {"role": "decode", "rooms": {str(k): v for k, v in done.items()}, "sessions": mgr.engine.stats()}


def main() -> None:
    role, cfg = sys.argv[1], json.loads(sys.argv[2])
    signal.signal(signal.SIGTERM, lambda *_: os._exit(3))
    result = run_prefill(cfg) if role == "prefill" else run_decode(cfg)
    print(json.dumps({"result": result}, default=str), flush=True)
    if cfg.get("linger"):
        time.sleep(cfg["linger"])
    os._exit(0)


if __name__ == "__main__":
    main()
