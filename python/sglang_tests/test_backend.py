"""kvmove.sglang against SGLang 0.5.23's own code (the PyPI wheel, no GPU).

Run by scripts/sglang-tests.sh in the virtualenv it builds (SGLang without
the CUDA packages it cannot use here). ``peer.py`` says, for the process
tests, what is SGLang's code and what stands in for its scheduler.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_plugin_makes_kvmove_a_transfer_backend():
    """SGLang's plugin loader finds kvmove's entry point (no SGLang edit,
    no SGLANG_PLUGINS needed); the flag takes ``kvmove`` and still refuses
    an unknown name; ``get_kv_class`` answers kvmove's classes for it and
    SGLang's own for the others, in modules imported before and after."""
    code = r"""
import sglang.srt.disaggregation.prefill as prefill_mod
from sglang.srt.plugins import load_plugins
load_plugins()
import sglang.srt.disaggregation.decode as decode_mod
from sglang.srt.disaggregation.utils import TransferBackend, KVClassType, get_kv_class
from sglang.srt.server_args import prepare_server_args
import kvmove.sglang.conn as conn
tb = TransferBackend("kvmove")
want = {KVClassType.MANAGER: conn.KvmoveKVManager, KVClassType.SENDER: conn.KvmoveKVSender,
        KVClassType.RECEIVER: conn.KvmoveKVReceiver, KVClassType.BOOTSTRAP_SERVER: conn.KvmoveKVBootstrapServer}
for fn in (get_kv_class, prefill_mod.get_kv_class, decode_mod.get_kv_class):
    for k, cls in want.items():
        assert fn(tb, k) is cls, (fn, k, fn(tb, k))
from sglang.srt.disaggregation.base.conn import KVArgs
assert get_kv_class(tb, KVClassType.KVARGS) is KVArgs
from sglang.srt.disaggregation.fake.conn import FakeKVSender
assert get_kv_class(TransferBackend.FAKE, KVClassType.SENDER) is FakeKVSender
sa = prepare_server_args(["--model-path", "dummy", "--disaggregation-transfer-backend", "kvmove"])
assert sa.disaggregation_transfer_backend == "kvmove", sa.disaggregation_transfer_backend
try:
    prepare_server_args(["--model-path", "dummy", "--disaggregation-transfer-backend", "nosuch"])
except SystemExit:
    pass
else:
    raise AssertionError("an unknown backend name was accepted")
load_plugins()  # again: nothing changes
assert list(TransferBackend).count(tb) == 1
print("OK")
"""
    env = dict(os.environ, SGLANG_PLUGINS="")
    env.pop("SGLANG_PLUGINS")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout[-3000:] + r.stderr[-5000:]


def spawn(role: str, cfg: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(HERE / "peer.py"), role, json.dumps(cfg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def result_of(p: subprocess.Popen, timeout: float) -> dict:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"the {p.args[2]} process did not end: {out[-2000:]}\n{err[-4000:]}")
    for line in reversed(out.splitlines()):
        if line.startswith('{"result"'):
            return json.loads(line)["result"]
    raise AssertionError(f"no result from {p.args[2]} (rc {p.returncode}): {out[-2000:]}\n{err[-6000:]}")


def base_config(**over) -> dict:
    cfg = {
        "bootstrap_port": free_port(),
        "layers": 4,
        "pages": 96,
        "item": 512,
        "page_size": 16,
        "aux_rows": 16,
        "aux_items": [64, 8],
        "chunk_pages": 3,
        "timeout": 90,
        # room, pages: one empty request (the aux row alone), odd sizes.
        "rooms": [[1001, 7], [1002, 1], [1003, 0], [1004, 20], [0x7FFF_FFFF_FFFF_FFF1, 11]],
    }
    cfg.update(over)
    return cfg


def test_prefill_and_decode_processes_move_kv_pages_byte_exact():
    """Two processes, each one SGLang rank with kvmove's manager: the
    prefill runs SGLang's bootstrap server and registers with it, the
    decode discovers the prefill rank through it and grants its pages (in
    another order than the prefill's); the prefill writes in chunks of
    three pages. Every request succeeds on both sides, every page of every
    layer and the auxiliary rows land byte-exact, and the prefill's states
    go Bootstrapping -> WaitingForInput -> ... -> Success, never back."""
    cfg = base_config()
    prefill = spawn("prefill", cfg)
    decode = spawn("decode", cfg)
    p, d = result_of(prefill, 240), result_of(decode, 240)
    rooms = {str(r) for r, _ in cfg["rooms"]}
    assert set(p["rooms"]) == rooms and set(d["rooms"]) == rooms, (p, d)
    for room in rooms:
        pr, dr = p["rooms"][room], d["rooms"][room]
        assert pr["state"] == "success", (room, pr)
        assert dr["state"] == "success", (room, dr)
        assert dr["bad"] == [], (room, dr["bad"])
        assert pr["states"][0] == 1 and pr["states"][-1] == 4, pr["states"]
        assert pr["states"] == sorted(pr["states"]), pr["states"]
