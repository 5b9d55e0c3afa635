"""The Pythonic API: context managers, batches, layer-by-layer, leaks."""

import gc
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

import pytest

import kvmove

from conftest import wait_until

LAYERS, PAGES, PAGE = 8, 32, 2048


@pytest.fixture
def pair():
    with kvmove.Engine() as prefill, kvmove.Engine() as decode:
        yield prefill, decode


def test_session_write_read_and_context_managers(pair):
    prefill, decode = pair
    base = dict(prefill.stats())
    src = np.random.default_rng(3).integers(0, 256, LAYERS * PAGES * PAGE, dtype=np.uint8)
    dst = np.zeros_like(src)
    with prefill.register(src) as rs, decode.register(dst) as rd:
        with prefill.connect(decode.session_id) as s:
            out = s.write(rs.addr, rd.addr, 4096)
            assert out.ok and out.attempts == 1 and out.requests[0].ok
            assert np.array_equal(dst[:4096], src[:4096])
            s.write_many([(rs.at(i * PAGE), rd.at(i * PAGE), PAGE) for i in range(LAYERS * PAGES)])
            assert np.array_equal(dst, src)
            back = bytearray(PAGE)
            with prefill.register(back) as rb:
                s.read(rb.addr, rd.at(PAGE), PAGE)
            assert bytes(back) == src[PAGE : 2 * PAGE].tobytes()
            assert prefill.stats()["segments"] >= 1
        assert prefill.stats()["regions"] == 1
    after = prefill.stats()
    assert after["regions"] == base["regions"] == 0
    assert after["segments"] == base["segments"]
    assert wait_until(lambda: prefill.stats()["active_transfers"] == 0, timeout=5)


def test_batches_poll_wait_cancel(pair):
    prefill, decode = pair
    src = np.full(1 << 22, 5, dtype=np.uint8)
    dst = np.zeros_like(src)
    with prefill.register(src) as rs, decode.register(dst) as rd, prefill.connect(decode.session_id) as s:
        b = s.submit([(rs.addr, rd.addr, src.nbytes)])
        out = b.wait(timeout=30)
        assert out is not None and out.ok and b.done and b.poll() is out
        assert np.array_equal(dst, src)

        # Many small pages, polled to completion.
        b = s.submit([(rs.at(i * 4096), rd.at(i * 4096), 4096) for i in range(256)])
        deadline = time.monotonic() + 30
        while b.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)
        assert b.poll().ok

        # Cancel: the batch ends (completed or cancelled), never hangs, and
        # is quiet afterwards.
        big = [(rs.at(i * 65536), rd.at(i * 65536), 65536) for i in range(64)]
        b = s.submit(big, write=False)
        out = b.cancel()
        assert out.state in {"completed", "cancelled"}
        assert all(r.state in {"completed", "cancelled"} for r in out.requests)
        assert b.cancel() is out
        assert b.wait(check=False) is out
        # The driver task ends just after it reports the outcome.
        assert wait_until(lambda: prefill.stats()["active_transfers"] == 0, timeout=5)


def test_layerwise_submission(pair):
    prefill, decode = pair
    kv = np.random.default_rng(4).integers(0, 256, (LAYERS, PAGES, PAGE), dtype=np.uint8)
    dst = np.zeros_like(kv)
    with prefill.register(kv) as rs, decode.register(dst) as rd, prefill.connect(decode.session_id) as s:
        layer_bytes = PAGES * PAGE
        with s.layerwise() as lt:
            for layer in range(LAYERS):
                # ... the model computes `layer` here ...
                ops = [(rs.at(layer * layer_bytes + p * PAGE), rd.at(layer * layer_bytes + p * PAGE), PAGE) for p in range(PAGES)]
                lt.submit_layer(ops)
            outs = lt.wait()
        assert len(outs) == LAYERS and all(o.ok for o in outs)
        assert np.array_equal(dst, kv)


def test_gil_is_released_during_transfers(pair):
    """A thread that needs the GIL runs while a write is in progress. Only
    ticks inside a write's own interval count (between writes the
    interpreter hands the GIL over anyway); writes go on until they have
    lasted 0.2 s in all, so a fast path or a loaded machine does not decide
    the outcome (bounded: 400 writes or 20 s)."""
    prefill, decode = pair
    src = np.ones(1 << 24, dtype=np.uint8)
    dst = np.zeros_like(src)
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.0005)

    spans = []
    with prefill.register(src) as rs, decode.register(dst) as rd, prefill.connect(decode.session_id) as s:
        t = threading.Thread(target=ticker)
        t.start()
        until = time.monotonic() + 20
        while len(spans) < 400 and time.monotonic() < until and sum(b - a for a, b in spans) < 0.2:
            a = time.monotonic()
            s.write(rs.addr, rd.addr, src.nbytes)
            spans.append((a, time.monotonic()))
        stop.set()
        t.join()
    inside = [x for x in ticks if any(a < x < b for a, b in spans)]
    # With the GIL held for each whole write, no tick could fall inside one.
    assert len(inside) >= 3, (len(inside), len(spans), sum(b - a for a, b in spans))


def test_concurrent_threads_share_an_engine(pair):
    prefill, decode = pair
    n = 8
    src = np.random.default_rng(5).integers(0, 256, n * 65536, dtype=np.uint8)
    dst = np.zeros_like(src)
    errors = []
    with prefill.register(src) as rs, decode.register(dst) as rd:

        def worker(i):
            try:
                with prefill.connect(decode.session_id) as s:
                    for _ in range(5):
                        s.write(rs.at(i * 65536), rd.at(i * 65536), 65536)
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors
    assert np.array_equal(dst, src)


def test_close_releases_everything():
    eng = kvmove.Engine()
    peer = kvmove.Engine()
    buf = bytearray(8192)
    r = eng.register(buf)
    pr = peer.register(bytearray(8192))
    s = eng.connect(peer.session_id)
    s.write(r.addr, pr.addr, 8192)
    eng.close()
    eng.close()
    buf.extend(b"resizable again: the export was released")
    with pytest.raises(kvmove.TransferError) as info:
        eng.register(bytearray(16))
    assert info.value.kind == "shutdown"
    peer.close()


def test_backend_chosen_by_config(tmp_path):
    cfg = tmp_path / "kvmove.toml"
    cfg.write_text('[backend]\nkind = "tcp"\n[backend.tcp]\nlisten = "127.0.0.1:0"\nlanes = 1\n[policy.retry]\nmax_attempts = 1\n')
    with kvmove.Engine(config=cfg) as a, kvmove.Engine(config=cfg.read_text()) as b:
        assert a.backend == "tcp" and b.session_id.startswith("127.0.0.1:")
        src, dst = bytearray(b"x" * 4096), bytearray(4096)
        with a.register(src) as rs, b.register(dst) as rd, a.connect(b.session_id) as s:
            s.write(rs.addr, rd.addr, 4096)
        assert dst == src
    # A host (and port) given beside a config moves the listener only: the
    # backend stays the one the config names (the SGLang backend passes
    # SGLang's address and KVMOVE_CONFIG's text so).
    with kvmove.Engine(host="127.0.0.1", port=0, config=cfg) as c:
        assert c.backend == "tcp" and c.session_id.startswith("127.0.0.1:")
    try:
        d = kvmove.Engine(host="127.0.0.1", port=0, config='[backend]\nkind = "rdma"\n')
    except kvmove.TransferError as e:
        # A build without RDMA, or no device: refused, naming RDMA.
        assert "rdma" in str(e).lower(), e
    else:
        with d:
            assert d.backend == "rdma"
    with pytest.raises(kvmove.PermanentError) as info:
        kvmove.Engine(config="[backend.tcp]\nlane = 1\n")
    assert info.value.kind == "config" and "lane" in str(info.value)
    with pytest.raises(kvmove.PermanentError) as info:
        kvmove.Engine(protocol="carrier-pigeon")
    assert info.value.kind == "unsupported"


def test_small_writes_with_and_without_polling_and_a_bad_spin_refused(monkeypatch):
    """`KVMOVE_SPIN_US`: how long a transfer polls on the caller's thread
    before it sleeps (0: it never polls); the bytes land either way, and a
    value that is not a number of microseconds from 0 to 10000 is refused
    when the engine starts."""
    for spin in ("0", "50", "10000"):
        monkeypatch.setenv("KVMOVE_SPIN_US", spin)
        with kvmove.Engine() as a, kvmove.Engine() as b:
            src = np.random.default_rng(int(spin)).integers(0, 256, 64 * 4096, dtype=np.uint8)
            dst = np.zeros_like(src)
            with a.register(src) as rs, b.register(dst) as rd, a.connect(b.session_id) as s:
                for i in range(64):
                    assert s.write(rs.at(i * 4096), rd.at(i * 4096), 4096).ok
                back = np.zeros_like(src)
                with a.register(back) as rb:
                    for i in range(64):
                        assert s.read(rb.at(i * 4096), rd.at(i * 4096), 4096).ok
                # Session.submit + Batch.wait: the same polling, then asleep;
                # a wait that gives up at once leaves the batch to a later one.
                again = np.zeros_like(src)
                with b.register(again) as rg:
                    for i in range(64):
                        batch = s.submit([(rs.at(i * 4096), rg.at(i * 4096), 4096)])
                        first = batch.wait(timeout=0) if i % 2 else None
                        out = batch.wait()
                        assert out.ok and (first is None or first is out) and batch.done
            assert np.array_equal(dst, src) and np.array_equal(back, src), f"KVMOVE_SPIN_US={spin}"
            assert np.array_equal(again, src), f"KVMOVE_SPIN_US={spin}"
    for bad in ("-1", "ten", "10001", "1.5"):
        monkeypatch.setenv("KVMOVE_SPIN_US", bad)
        with pytest.raises(kvmove.PermanentError) as info:
            kvmove.Engine()
        assert info.value.kind == "config" and "KVMOVE_SPIN_US" in str(info.value), bad


def test_the_wait_policy_comes_from_the_config_and_kvmove_spin_us_overrides_it(monkeypatch):
    """`[policy.wait]` sets how waits and polls spend their time (the NIXL
    agent's polls follow it too); `KVMOVE_SPIN_US` replaces its `spin_us`;
    a value past its bound is a config error naming the field."""
    monkeypatch.delenv("KVMOVE_SPIN_US", raising=False)
    with kvmove.Engine() as e:
        assert e._native.wait_policy == {"spin_us": 50, "spinning_gap_us": 500, "fresh_us": 250, "spinner_wait_us": 1000}
    cfg = '[backend]\nkind = "tcp"\n[policy.wait]\nspin_us = 7\nspinner_wait_us = 300\n'
    with kvmove.Engine(host="127.0.0.1", port=0, config=cfg) as e:
        w = e._native.wait_policy
        assert (w["spin_us"], w["spinner_wait_us"], w["spinning_gap_us"]) == (7, 300, 500), w
    monkeypatch.setenv("KVMOVE_SPIN_US", "0")
    with kvmove.Engine(host="127.0.0.1", port=0, config=cfg) as e:
        assert e._native.wait_policy["spin_us"] == 0
    with pytest.raises(kvmove.PermanentError) as info:
        kvmove.Engine(host="127.0.0.1", port=0, config='[policy.wait]\nspinner_wait_us = 100001\n')
    assert info.value.kind == "config" and "wait.spinner_wait_us" in str(info.value)


def test_from_env_reads_the_config_then_the_policy_then_the_protocol(tmp_path, monkeypatch):
    """`Engine.from_env` (what the NIXL agent, the vLLM connector and the
    SGLang backend start): the `KVMOVE_CONFIG` file, `KVMOVE_POLICY` in
    place of its policy, `KVMOVE_PROTOCOL` unless a protocol is given; a
    bad value of each is an error that names it."""
    for var in ("KVMOVE_SPIN_US", "KVMOVE_POLICY", "KVMOVE_PROTOCOL", "MC_FORCE_TCP"):
        monkeypatch.delenv(var, raising=False)
    cfg = tmp_path / "kvmove.toml"
    cfg.write_text('[backend]\nkind = "tcp"\n[policy.wait]\nspin_us = 7\n')
    monkeypatch.setenv("KVMOVE_CONFIG", str(cfg))
    with kvmove.Engine.from_env() as e:
        assert e._native.wait_policy["spin_us"] == 7
        assert e.backend == "tcp" and e.session_id.startswith("127.0.0.1:")
    monkeypatch.setenv("KVMOVE_POLICY", json.dumps({"wait": {"spin_us": 9}}))
    with kvmove.Engine.from_env(host="127.0.0.1", port=0) as e:
        assert e._native.wait_policy["spin_us"] == 9
    monkeypatch.setenv("KVMOVE_POLICY", "{")
    with pytest.raises(kvmove.PermanentError) as info:
        kvmove.Engine.from_env()
    assert info.value.kind == "config" and "KVMOVE_POLICY" in str(info.value)
    monkeypatch.delenv("KVMOVE_POLICY")
    monkeypatch.setenv("KVMOVE_PROTOCOL", "carrier-pigeon")
    with pytest.raises(kvmove.PermanentError) as info:
        kvmove.Engine.from_env()
    assert info.value.kind == "unsupported" and "carrier-pigeon" in str(info.value)
    with kvmove.Engine.from_env("tcp") as e:  # the argument wins
        assert e.backend == "tcp"
    monkeypatch.delenv("KVMOVE_PROTOCOL")
    cfg.write_text("[backend.tcp]\nbogus = 2\n")
    with pytest.raises(kvmove.PermanentError) as info:
        kvmove.Engine.from_env()
    assert info.value.kind == "config" and "bogus" in str(info.value)


def test_mooncake_engine_reads_kvmove_config(tmp_path, monkeypatch):
    cfg = tmp_path / "kvmove.toml"
    cfg.write_text("[backend.tcp]\nlanes = 2\n")
    monkeypatch.setenv("KVMOVE_CONFIG", str(cfg))
    e = kvmove.TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    e.close()
    cfg.write_text("[backend.tcp]\nbogus = 2\n")
    e = kvmove.TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1
    assert e.last_error().kind == "config"
    monkeypatch.setenv("KVMOVE_PROTOCOL", "tcp")
    monkeypatch.delenv("KVMOVE_CONFIG")
    e = kvmove.TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "mlx5_0") == 0, "KVMOVE_PROTOCOL overrides rdma"
    e.close()


def _fds():
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_no_descriptor_leak_after_close():
    def cycle():
        with kvmove.Engine() as a, kvmove.Engine() as b:
            src, dst = bytearray(b"y" * 65536), bytearray(65536)
            with a.register(src) as rs, b.register(dst) as rd, a.connect(b.session_id) as s:
                s.write(rs.addr, rd.addr, 65536)
        m = kvmove.TransferEngine()
        assert m.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        m.close()

    cycle()
    gc.collect()
    base = _fds()
    for _ in range(5):
        cycle()
    gc.collect()
    assert _fds() == base


def test_interpreter_exit_with_transfers_in_flight(tmp_path):
    script = tmp_path / "exit.py"
    script.write_text(
        "import kvmove\n"
        "a, b = kvmove.Engine(), kvmove.Engine()\n"
        "src, dst = bytearray(1 << 26), bytearray(1 << 26)\n"
        "rs, rd = a.register(src), b.register(dst)\n"
        "s = a.connect(b.session_id)\n"
        "batch = s.submit([(rs.addr, rd.addr, 1 << 26)])\n"
        "m = kvmove.TransferEngine()\n"
        "assert m.initialize('127.0.0.1', 'P2PHANDSHAKE', 'tcp', '') == 0\n"
        "print('bye')\n"
    )
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "bye" in r.stdout, r.stderr


def test_outcome_says_which_requests_failed(pair):
    """A batch whose middle request is refused by the peer: the outcome
    answers "all completed?" and "which failed?" (indices), and its per-request
    results (made on first use) agree; generators of ops are taken too."""
    prefill, decode = pair
    src = np.arange(3 * PAGE, dtype=np.uint8)
    dst = np.zeros_like(src)
    with prefill.register(src) as rs, decode.register(dst) as rd:
        with prefill.connect(decode.session_id) as s:
            ops = [(rs.at(0), rd.at(0), PAGE), (rs.at(PAGE), rd.addr + (1 << 30), PAGE), (rs.at(2 * PAGE), rd.at(2 * PAGE), PAGE)]
            out = s.submit(iter(ops)).wait(check=False)
            assert not out.ok and out.state == "failed" and len(out) == 3
            assert out.failed == [1]
            assert out.error is not None and out.error.kind == "out_of_bounds"
            assert [r.state for r in out.requests] == ["completed", "failed", "completed"]
            assert out.requests[1].error.kind == "out_of_bounds" and out.requests is out.requests
            with pytest.raises(kvmove.TransferError):
                out.raise_for_status()
            good = s.write_many(op for i, op in enumerate(ops) if i != 1)
            assert good.ok and good.failed == [] and len(good) == 2 and all(r.ok for r in good.requests)
            # Requests as lists or numpy rows are taken too.
            assert s.write_many([list(ops[0]), list(ops[2])]).ok
            assert s.write_many(np.array([ops[0], ops[2]], dtype=np.uint64)).ok
            with pytest.raises(TypeError):
                s.write_many([("not", "an", "address")])
    assert np.array_equal(dst[:PAGE], src[:PAGE]) and np.array_equal(dst[2 * PAGE :], src[2 * PAGE :])
    assert not dst[PAGE : 2 * PAGE].any(), "the refused request wrote nothing"


def test_a_caller_waiting_for_a_frozen_peer_sleeps(spawn_peer):
    """A caller waiting for its answer sleeps (GIL released) rather than
    spinning: a write to a peer frozen for a second costs its thread far
    less CPU than the second, and ends well once the peer runs again. (A
    bounded spin before the sleep was measured and made 4 KiB round trips
    slower on 2 vCPUs: the spinning caller took the CPU the engine's and
    the peer's threads needed; see the closing note of issue 30.)"""
    peer = spawn_peer()
    with kvmove.Engine() as e:
        src = np.full(4096, 3, dtype=np.uint8)
        with e.register(src) as r, e.connect(peer.session_id) as s:
            assert s.write(r.addr, peer.addr, 4096).ok
            got = {}

            def write():
                cpu = time.thread_time()
                got["ok"] = s.write(r.addr, peer.addr, 4096).ok
                got["cpu"] = time.thread_time() - cpu

            peer.pause()
            try:
                t = threading.Thread(target=write)
                start = time.monotonic()
                t.start()
                time.sleep(1.0)
            finally:
                peer.resume()
            t.join(30)
            waited = time.monotonic() - start
    assert got.get("ok"), got
    assert waited >= 1.0 and got["cpu"] < 0.25, f"the waiting thread used {got['cpu']:.3f} s of CPU in {waited:.2f} s"
