"""kvmove.sglang against SGLang 0.5.23's own code (the PyPI wheel, no GPU).

Run by scripts/sglang-tests.sh in the virtualenv it builds (SGLang without
the CUDA packages it cannot use here). ``peer.py`` says, for the process
tests, what is SGLang's code and what stands in for its scheduler.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List

HERE = Path(__file__).resolve().parent
# Waits are multiplied by KVMOVE_TEST_SLOW (scripts/sglang-rdma-vm.sh: the
# soft-RoCE VM's emulated CPU imports SGLang in minutes); the bounds on
# failure detection after a kill are not.
SLOW = max(1.0, float(os.environ.get("KVMOVE_TEST_SLOW", "1")))


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


class Rank:
    """One peer.py process; its JSON events read as they come."""

    def __init__(self, role: str, cfg: dict, env: dict = None):
        self.role = role
        self.p = subprocess.Popen(
            [sys.executable, str(HERE / "peer.py"), role, json.dumps(cfg)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, **(env or {})),
        )
        self.events: "queue.Queue[dict]" = queue.Queue()
        self.err: List[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self.err.extend(self.p.stderr), daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            if line.startswith("{"):
                try:
                    self.events.put(json.loads(line))
                except ValueError:
                    pass
        self.events.put({"event": "exit"})

    def wait_for(self, name: str, timeout: float = 180) -> dict:
        timeout *= SLOW
        end = time.monotonic() + timeout
        while True:
            try:
                ev = self.events.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                self.kill()
                raise AssertionError(f"{self.role}: no {name!r} event in {timeout} s: {''.join(self.err)[-6000:]}")
            if ev.get("event") == name or (name == "result" and "result" in ev):
                return ev
            if ev.get("event") == "exit":
                self.p.wait(10)
                raise AssertionError(
                    f"{self.role} exited (rc {self.p.returncode}) before {name!r}: {''.join(self.err)[-6000:]}"
                )

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(10)


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
    }
    cfg.update(over)
    cfg["timeout"] = cfg["timeout"] * SLOW
    return cfg


# room, pages: one empty request (the aux row alone), odd sizes, a room id
# near the top of SGLang's range.
ROOMS = [[1001, 7], [1002, 1], [1003, 0], [1004, 20], [0x7FFF_FFFF_FFFF_FFF1, 11]]


def assert_all_landed(p: dict, d: dict, rooms) -> None:
    names = {str(r) for r, _ in rooms}
    assert set(p["rooms"]) == names and set(d["rooms"]) == names, (p, d)
    for room in names:
        pr, dr = p["rooms"][room], d["rooms"][room]
        assert pr["state"] == "success", (room, pr)
        assert dr["state"] == "success", (room, dr)
        assert dr["bad"] == [], (room, dr["bad"])
        # Bootstrapping -> WaitingForInput -> (Transferring) -> Success,
        # never back. A sender whose decode had granted before its first
        # poll (a decode already waiting for this prefill) starts at
        # WaitingForInput.
        assert pr["states"][0] in (1, 2) and pr["states"][-1] == 4, pr["states"]
        assert pr["states"] == sorted(set(pr["states"])), pr["states"]


def test_prefill_and_decode_processes_move_kv_pages_byte_exact():
    """Two processes, each one SGLang rank with kvmove's manager: the
    prefill runs SGLang's bootstrap server and registers with it, the
    decode discovers the prefill rank through it and grants its pages (in
    another order than the prefill's), its auxiliary rows and a state slot
    of two buffers (as Mamba's); the prefill writes in chunks of three
    pages, the state with the last. Every request succeeds on both sides,
    every page of every layer, the auxiliary rows and the state land
    byte-exact, and the prefill's states only move forward. One request has
    a prefix the decode already holds (3 pages, announced before the
    grant): only the rest is granted and sent."""
    prefix = {str(ROOMS[3][0]): 3}
    cfg = base_config(state_slots=8, state_item=96, decode_prefix=prefix)
    prefill = Rank("prefill", dict(cfg, phases=[ROOMS]))
    decode = Rank("decode", dict(cfg, phases=[{"bootstrap_port": cfg["bootstrap_port"], "rooms": ROOMS}]))
    try:
        p, d = prefill.wait_for("result")["result"], decode.wait_for("result")["result"]
    finally:
        prefill.kill()
        decode.kill()
    assert_all_landed(p["phases"][0], d["phases"][0], ROOMS)


def test_an_abort_on_either_side_ends_the_request_on_both():
    """The decode aborts a request right after granting it, the prefill
    aborts another right after init (SGLang's abort() on each side): both
    end failed on both sides (kvmove cancels the session, so neither waits
    for a deadline), within seconds; the other requests land."""
    d_abort, p_abort = ROOMS[0][0], ROOMS[3][0]
    cfg = base_config(decode_abort=[d_abort], prefill_abort=[p_abort], timeout=60)
    prefill = Rank("prefill", dict(cfg, phases=[ROOMS]))
    decode = Rank("decode", dict(cfg, phases=[{"bootstrap_port": cfg["bootstrap_port"], "rooms": ROOMS}]))
    try:
        p, d = prefill.wait_for("result")["result"], decode.wait_for("result")["result"]
    finally:
        prefill.kill()
        decode.kill()
    pr, dr = p["phases"][0]["rooms"], d["phases"][0]["rooms"]
    for room, _ in ROOMS:
        a, b = pr[str(room)], dr[str(room)]
        if room in (d_abort, p_abort):
            assert a["state"] == "failed" and b["state"] == "failed", (room, a, b)
            # The decode may reuse the pages (SGLang's deferred release
            # asks), once the session ended on both sides.
            assert b["release_safe"] is True and b["release_safe_after"] < 10, b
        else:
            assert a["state"] == "success" and b["state"] == "success" and b["bad"] == [], (room, a, b)
    assert "Aborted by AbortReq" in pr[str(p_abort)]["error"], pr[str(p_abort)]
    assert "cancel" in dr[str(p_abort)]["error"], dr[str(p_abort)]
    assert "Aborted by AbortReq" in dr[str(d_abort)]["error"], dr[str(d_abort)]
    # The session cancelled, or (not yet claimed here) the decode's word.
    err = pr[str(d_abort)]["error"]
    assert "cancel" in err or "the decode ended the request" in err, err


HELD = [[2001, 9], [2002, 12], [2003, 5], [2004, 30]]
LIVENESS = 5.0  # kvmove's default liveness timeout (SessionLimits)


def test_a_decode_killed_mid_transfer_fails_its_requests_and_the_prefill_serves_on():
    """The decode is SIGKILLed while every request is mid-transfer (the
    prefill wrote the first chunk of each and holds the rest): the
    prefill's requests all fail, within kvmove's liveness timeout, with
    kvmove's error in SGLang's KVTransferError; its kvmove sockets return
    to the baseline (none); then a new decode is served by the same
    prefill, byte-exact."""
    cfg = base_config(settle_to={"0": 0})
    port = cfg["bootstrap_port"]
    prefill = Rank("prefill", dict(cfg, phases=[HELD, ROOMS], hold_phase=0))
    decode = Rank("decode", dict(cfg, phases=[{"bootstrap_port": port, "rooms": HELD}]))
    second = None
    try:
        assert prefill.wait_for("ready")["links"] == 0
        prefill.wait_for("transferring")
        killed = time.monotonic()
        decode.kill()
        first = prefill.wait_for("phase", timeout=120)
        for room, r in first["rooms"].items():
            assert r["state"] == "failed", (room, r)
            assert "kvmove handoff failed" in r["error"], r["error"]
            assert "kind=peer_unavailable, transient=True" in r["error"], r["error"]
            assert r["t"] - killed < LIVENESS + 10, (room, r["t"] - killed)
        assert first["links"] == 0, first
        second = Rank("decode", dict(cfg, phases=[{"bootstrap_port": port, "rooms": ROOMS}]))
        p, d = prefill.wait_for("result")["result"], second.wait_for("result")["result"]
    finally:
        for r in (prefill, decode, second):
            if r is not None:
                r.kill()
    assert_all_landed(p["phases"][1], d["phases"][0], ROOMS)


def test_a_prefill_killed_mid_transfer_fails_its_requests_and_the_decode_serves_on():
    """The prefill is SIGKILLed mid-transfer: the decode's requests all
    fail within kvmove's liveness timeout, its kvmove sockets to the dead
    prefill close; then the decode is served by a new prefill (a new
    bootstrap server), byte-exact."""
    cfg = base_config(settle_to={"0": 0})
    port2 = free_port()
    prefill = Rank("prefill", dict(cfg, phases=[HELD], hold_phase=0))
    decode = Rank(
        "decode",
        dict(
            cfg,
            phases=[
                {"bootstrap_port": cfg["bootstrap_port"], "rooms": HELD},
                {"bootstrap_port": port2, "rooms": ROOMS},
            ],
        ),
    )
    second = None
    try:
        prefill.wait_for("transferring")
        killed = time.monotonic()
        prefill.kill()
        first = decode.wait_for("phase", timeout=120)
        for room, r in first["rooms"].items():
            assert r["state"] == "failed", (room, r)
            assert "kvmove handoff" in r["error"] and "kind=" in r["error"], r["error"]
            assert r["t"] - killed < LIVENESS + 10, (room, r["t"] - killed)
        assert first["links"] == 0, first
        second = Rank("prefill", dict(cfg, bootstrap_port=port2, phases=[ROOMS]))
        p, d = second.wait_for("result")["result"], decode.wait_for("result")["result"]
    finally:
        for r in (prefill, decode, second):
            if r is not None:
                r.kill()
    assert_all_landed(p["phases"][0], d["phases"][1], ROOMS)


BOOTSTRAP_TIMEOUT = 2  # seconds: SGLang's default is 300
KVPoll_Failed = 0  # SGLang's KVPoll.Failed (the tests import no SGLang)


def queue_pair(decode_role: str, requests, env=None, timer_control=False, **over):
    """A prefill through SGLang's PrefillBootstrapQueue (``prefill-queue``)
    and a decode (``decode_role``) with 8 metadata rows serving
    ``requests``; ``over`` sets ``decode_pages``, ``decode_seconds`` (how
    long a landed request holds its pages) and ``timeout``. Both results."""
    cfg = base_config(pages=256, aux_rows=8, requests=requests, chunk_pages=2, **over)
    # The prefill stays up after its own requests ended (as a server does).
    prefill = Rank("prefill-queue", dict(cfg, gloo_port=free_port(), timer_control=timer_control, linger=30), env)
    decode = Rank(decode_role, dict(cfg, gloo_port=free_port()), env)
    try:
        wait = 2 * cfg["timeout"]
        return prefill.wait_for("result", wait)["result"], decode.wait_for("result", wait)["result"]
    finally:
        prefill.kill()
        decode.kill()


def replay(timer_control: bool):
    """Runs the field report's prefill/decode pair (see the tests below)."""
    # 24 requests of 1 to 8 pages; the decode has 24 pages and 8 metadata
    # rows, and holds each request's pages 1 s after it landed.
    requests = [[3000 + i, 16 * (1 + (i * 5) % 8) - (i % 3)] for i in range(24)]
    env = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(BOOTSTRAP_TIMEOUT)}
    p, d = queue_pair(
        "decode-queue", requests, env, timer_control, decode_pages=24, decode_seconds=1.0, timeout=120
    )
    return requests, p, d


def test_field_report_replay_a_saturated_decode_stalls_no_request_and_crashes_no_queue():
    """The field report, through SGLang's own PrefillBootstrapQueue (add,
    pop_bootstrapped: the state check that killed schedulers) and its poll
    reductions, with SGLang's bootstrap timeout at 2 s: a decode with few
    free pages and many requests grants them a few at a time, for longer
    than that timeout. No queue raises, no request fails while it waits
    for its grant, every request lands byte-exact (pages and SGLang's
    auxiliary row, checked by SGLang's metadata gate), and the prefill's
    states for each request only move forward. Stubbed (peer.py says
    which): the schedulers, the requests, the forward pass."""
    requests, p, d = replay(timer_control=False)
    assert p["crash"] is None and d["crash"] is None, (p["crash"], d["crash"])
    late = [r["granted_after"] for r in d["rooms"].values() if r.get("granted_after") is not None]
    assert max(late) > BOOTSTRAP_TIMEOUT + 1, f"the decode never made a request wait past the timeout: {late}"
    for room, _ in requests:
        pr, dr = p["rooms"][str(room)], d["rooms"][str(room)]
        assert pr["state"] == "success", (room, pr)
        assert dr["state"] == "success" and dr["bad"] == [], (room, dr)
        assert KVPoll_Failed not in pr["states"], (room, pr["states"])
        assert pr["states"][0] == 1 and pr["states"] == sorted(pr["states"]), (room, pr["states"])



def test_field_report_replay_fails_with_a_timer_counted_from_arrival():
    """The control of the replay above: the same run with a sender that
    also applies SGLang's bootstrap timeout from the request's arrival (as
    SGLang's own senders do) fails requests that were only waiting for the
    decode's pages; so the replay can fail, and kvmove's sender passes it
    because it reports the session's state instead."""
    requests, p, d = replay(timer_control=True)
    assert p["crash"] is None, p["crash"]
    timed_out = [r for r in p["rooms"].values() if "in KVPoll.Bootstrapping" in r.get("error", "")]
    assert timed_out, p["rooms"]
    # The decode's grants for those requests were refused at once (the
    # prefill cancels a grant whose request ended): the decode got its
    # pages back within a second or two, not at the session's deadline.
    refused = [r for r in d["rooms"].values() if r["state"] == "failed"]
    assert len(refused) == len(timed_out), d["rooms"]
    for r in refused:
        assert "cancel" in r["error"], r["error"]
        assert r["failed_after"] - r["granted_after"] < 3, r


def test_field_report_replay_with_two_prefill_pipeline_stages():
    """The field report with pipeline parallelism: two prefill stages (two
    processes, SGLang's own distributed groups on gloo and its PP
    GroupCoordinator), each holding half the layers, each with its own
    kvmove engine and session per request; SGLang's pop_bootstrapped with
    its PP consensus (stage 0 polls, forwards its verdicts); SGLang's PP
    release rule for the inflight requests (a request leaves once every
    stage's own poll is final, then each stage acts on its own poll); the
    decode grants each stage its layers' pages, the last stage also the
    auxiliary row. With the bootstrap timeout at 2 s and a decode short of
    pages: no queue raises, every request lands on both stages and on the
    decode (both stages report the same outcome for every request), none
    fails while waiting, every layer's pages arrive byte-exact."""
    port, dist_port = free_port(), free_port()
    requests = [[4000 + i, 16 * (1 + (i * 3) % 6) - (i % 2)] for i in range(20)]
    cfg = base_config(
        bootstrap_port=port,
        layers=5,  # stages of 2 and 3 layers (SGLang's partition)
        pages=256,
        decode_pages=12,
        aux_rows=6,
        decode_seconds=1.0,
        requests=requests,
        chunk_pages=2,
        timeout=120,
        pp_size=2,
        dist_port=dist_port,
    )
    env = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(BOOTSTRAP_TIMEOUT)}
    stages = [Rank("prefill-queue", dict(cfg, pp_rank=r, linger=30), env) for r in range(2)]
    decode = Rank("decode-queue", dict(cfg, pp_size=1, gloo_port=free_port()), env)
    try:
        p0, p1 = (s.wait_for("result", 240)["result"] for s in stages)
        d = decode.wait_for("result", 240)["result"]
    finally:
        for r in stages + [decode]:
            r.kill()
    assert p0["crash"] is None and p1["crash"] is None and d["crash"] is None, (p0["crash"], p1["crash"], d["crash"])
    late = [r["granted_after"] for r in d["rooms"].values() if r.get("granted_after") is not None]
    assert max(late) > BOOTSTRAP_TIMEOUT + 1, f"the decode never made a request wait past the timeout: {late}"
    for room, _ in requests:
        a, b, dr = p0["rooms"][str(room)], p1["rooms"][str(room)], d["rooms"][str(room)]
        assert a["state"] == b["state"] == "success", (room, a, b)
        assert dr["state"] == "success" and dr["bad"] == [], (room, dr)
        for st in (a, b):
            assert KVPoll_Failed not in st["states"] and st["states"] == sorted(st["states"]), (room, st["states"])


def test_pipeline_stages_fail_alike_when_the_decode_is_killed_and_serve_a_new_one():
    """Two prefill stages as above; the decode grants its first four
    requests and is SIGKILLed at once. Those four fail on both stages
    alike, within kvmove's liveness timeout of the kill; the others, still
    waiting for their grants (no timer runs), wait on; a restarted decode
    grants them and every one lands on both stages, byte-exact; neither
    stage keeps a kvmove socket to the dead decode."""
    port, dist_port = free_port(), free_port()
    requests = [[5000 + i, 16 * (1 + (i * 3) % 6)] for i in range(12)]
    cfg = base_config(
        bootstrap_port=port,
        layers=5,
        pages=256,
        decode_pages=40,
        aux_rows=8,
        decode_seconds=0.2,
        requests=requests,
        chunk_pages=2,
        timeout=120,
        pp_size=2,
        dist_port=dist_port,
    )
    stages = [Rank("prefill-queue", dict(cfg, pp_rank=r, linger=30)) for r in range(2)]
    first = Rank("decode-queue", dict(cfg, pp_size=1, gloo_port=free_port(), die_after_grants=4))
    second = None
    try:
        dead_port = int(first.wait_for("ready")["engine"].rsplit(":", 1)[1])
        killed = first.wait_for("dying")["t"]
        first.p.wait(30)
        second = Rank("decode-queue", dict(cfg, pp_size=1, gloo_port=free_port(), first_request=4))
        p0, p1 = (s.wait_for("result", 240)["result"] for s in stages)
        d = second.wait_for("result", 240)["result"]
    finally:
        for r in stages + [first] + ([second] if second else []):
            r.kill()
    assert p0["crash"] is None and p1["crash"] is None and d["crash"] is None, (p0["crash"], p1["crash"], d["crash"])
    for i, (room, _) in enumerate(requests):
        a, b = p0["rooms"][str(room)], p1["rooms"][str(room)]
        assert a["state"] == b["state"], (room, a, b)
        if i < 4:
            assert a["state"] == "failed", (room, a)
            for st in (a, b):
                assert st["t"] - killed < LIVENESS + 10, (room, st["t"] - killed, st)
        else:
            assert a["state"] == "success", (room, a, b)
            dr = d["rooms"][str(room)]
            assert dr["state"] == "success" and dr["bad"] == [], (room, dr)
    for p in (p0, p1):
        assert p["links"].get(str(dead_port), 0) == 0, p["links"]


def test_the_decode_survives_a_prefill_with_pipeline_stages_killed_mid_transfer():
    """Two prefill stages; the decode grants its first four requests, then
    both stage processes are SIGKILLed (a prefill instance dies whole).
    Every request of that prefill ends on the decode (none waits for ever):
    those that had not landed fail within kvmove's liveness timeout of the
    kill; the decode's kvmove sockets to the dead stages close; then the
    decode serves a new two-stage prefill (a new bootstrap server), every
    request byte-exact."""
    port, port2 = free_port(), free_port()
    first_reqs = [[6000 + i, 16 * (1 + (i * 3) % 6)] for i in range(8)]
    second_reqs = [[7000 + i, 16 * (1 + (i * 5) % 6)] for i in range(8)]
    cfg = base_config(
        bootstrap_port=port,
        layers=5,
        pages=256,
        decode_pages=40,
        aux_rows=8,
        decode_seconds=0.2,
        chunk_pages=1,
        timeout=120,
        pp_size=2,
    )
    phases = [
        {"bootstrap_port": port, "requests": first_reqs, "announce_after_grants": 4, "settle_to": 0},
        {"bootstrap_port": port2, "requests": second_reqs},
    ]
    dist1, dist2 = free_port(), free_port()
    stages = [Rank("prefill-queue", dict(cfg, pp_rank=r, dist_port=dist1, requests=first_reqs)) for r in range(2)]
    decode = Rank("decode-queue", dict(cfg, pp_size=1, gloo_port=free_port(), decode_phases=phases))
    second = []
    try:
        killed = decode.wait_for("granted")["t"]
        for s in stages:
            s.kill()
        killed = max(killed, time.monotonic())
        first = decode.wait_for("phase", timeout=120)
        cfg2 = dict(cfg, bootstrap_port=port2, requests=second_reqs)
        second = [Rank("prefill-queue", dict(cfg2, pp_rank=r, dist_port=dist2, linger=30)) for r in range(2)]
        d = decode.wait_for("result", 240)["result"]
    finally:
        for r in stages + second + [decode]:
            r.kill()
    assert d["crash"] is None, d["crash"]
    for room, _ in first_reqs:
        r = first["rooms"][str(room)]
        assert r["state"] in ("success", "failed"), (room, r)
        if r["state"] == "failed":
            assert r["t"] - killed < LIVENESS + 10, (room, r["t"] - killed, r)
    assert any(r["state"] == "failed" for r in first["rooms"].values()), first["rooms"]
    assert first["links"] == 0, first
    later = d["phases"][1]["rooms"]
    for room, _ in second_reqs:
        assert later[str(room)]["state"] == "success" and later[str(room)]["bad"] == [], (room, later[str(room)])


def test_sglang_decode_queues_preallocate_and_receive_kv_byte_exact():
    """Both sides through SGLang's own queues: the prefill's
    PrefillBootstrapQueue (``prefill-queue``) and the decode's
    DecodePreallocQueue and DecodeTransferQueue driven by SGLang's
    process_decode_queue (``decode-sglang-queues``), over SGLang's real CPU
    pools (MHATokenToKVPool, its paged allocator, DecodeReqToTokenPool, the
    tree cache, MetadataBuffers) and real Req objects; the decode's
    manager is built by SGLang's _init_kv_manager. The decode has 12 pages
    for 16 requests needing 58 (each held 0.5 s after it landed), so
    requests wait in the prealloc queue for pages SGLang's own release
    frees. No queue raises, none fails, every request lands byte-exact in
    the pages SGLang's allocator chose (read from req_to_token) and its
    first token, committed from the auxiliary row by SGLang, is the
    prefill's. Stubbed (peer.py says which): the schedulers, the forward
    passes, the prefill's requests."""
    requests = [[8000 + i, 16 * (1 + (i * 5) % 6) - (i % 3)] for i in range(16)]
    decode_pages = 12
    p, d = queue_pair("decode-sglang-queues", requests, decode_pages=decode_pages, decode_seconds=0.5, timeout=60)
    assert p["crash"] is None and d["crash"] is None, (p["crash"], d["crash"])
    assert d["max_waiting"] > 0, "no request ever waited for pages: the decode was not short of them"
    # Every request finished and SGLang's release gave everything back.
    assert d["free_pages_end"] == decode_pages, f"pages not given back: {d['free_pages_end']}"
    # queue_pair's 8 metadata rows (the request pool has twice as many).
    assert d["free_rows_end"] == 16 and d["free_slots_end"] == 8, d
    for room, ntok in requests:
        pr, dr = p["rooms"][str(room)], d["rooms"][str(room)]
        assert pr["state"] == "success", (room, pr)
        assert KVPoll_Failed not in pr["states"] and pr["states"] == sorted(pr["states"]), (room, pr["states"])
        assert dr["state"] == "success", (room, dr)
        assert KVPoll_Failed not in dr["states"] and dr["states"] == sorted(dr["states"]), (room, dr["states"])
        assert len(dr["pages"]) == -(-ntok // base_config()["page_size"]), (room, dr)
        assert dr["bad"] == [], f"request {room}: pages or aux row not the prefill's: {dr['bad']}"


def test_kvmove_config_picks_the_backend_of_the_manager_s_engine(tmp_path):
    """``KVMOVE_CONFIG`` (a kvmove TOML file) picks the backend of the
    engine kvmove's manager starts, while the engine still listens on
    SGLang's address: a file naming RDMA is honoured (this build has no
    RDMA, so the decode rank fails at start naming it, where it silently
    ran TCP before), and one naming TCP with its own secret serves the
    rank. What runs: SGLang's configuration and kvmove's manager, made by
    ``peer.py``'s setup as in the other tests."""
    rdma = tmp_path / "rdma.toml"
    rdma.write_text('[backend]\nkind = "rdma"\n')
    decode = Rank("decode", base_config(phases=[]), env={"KVMOVE_CONFIG": str(rdma)})
    try:
        decode.p.wait(120)
    finally:
        decode.kill()
    err = "".join(decode.err)
    assert decode.p.returncode != 0, "the decode rank started with KVMOVE_CONFIG naming RDMA in a build without it"
    assert "rdma" in err.lower(), err[-3000:]
    tcp = tmp_path / "tcp.toml"
    tcp.write_text('[backend]\nkind = "tcp"\n[backend.tcp]\nsecret = "from-the-file"\nlanes = 1\n')
    decode = Rank("decode", base_config(phases=[]), env={"KVMOVE_CONFIG": str(tcp)})
    try:
        ready = decode.wait_for("ready", 120)
        assert ready["engine"].startswith("127.0.0.1:"), ready
    finally:
        decode.kill()
