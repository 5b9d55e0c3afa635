"""The engine's metrics from Python: ``kvmove.metrics()`` and the
``prometheus_client`` collector (issue 15).

The metrics are process-wide and other tests of this process move bytes
too, so every check compares a value after the transfers with the value
before them."""

import logging
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kvmove
from kvmove.mooncake import TransferEngine
from kvmove.nixl import nixl_agent

# Installed by scripts/python-tests.sh: a missing package fails, not skips.
import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

PAGE = 2048


def series(m, name, **labels):
    """The series of ``name`` with exactly ``labels`` (None if absent)."""
    for s in m.get(name, []):
        if s["labels"] == labels:
            return s
    return None


def value(m, name, **labels):
    s = series(m, name, **labels)
    return 0 if s is None else s["value"]


def hcount(m, name, **labels):
    s = series(m, name, **labels)
    return 0 if s is None else s["count"]


def delta(before, after, name, **labels):
    return value(after, name, **labels) - value(before, name, **labels)


def hdelta(before, after, name, **labels):
    return hcount(after, name, **labels) - hcount(before, name, **labels)


def move(prefill, decode):
    """Three completed transfers (a write, a batch of 8 pages, a read) and
    one failed write (remote range outside the peer's region); returns the
    peer label and the bytes and requests by operation."""
    src = np.random.default_rng(15).integers(0, 256, 16 * PAGE, dtype=np.uint8)
    dst = np.zeros_like(src)
    back = bytearray(1000)
    with prefill.register(src) as rs, decode.register(dst) as rd, prefill.register(back) as rb:
        with prefill.connect(decode.session_id) as s:
            assert s.write(rs.addr, rd.addr, 4096).ok
            assert s.write_many([(rs.at(i * PAGE), rd.at(i * PAGE), PAGE) for i in range(8, 16)]).ok
            assert s.read(rb.addr, rd.at(100), len(back)).ok
            out = s.submit([(rs.addr, rd.addr + (1 << 30), 512)]).wait(check=False)
            assert out.state == "failed" and out.requests[0].error.kind == "out_of_bounds"
    assert np.array_equal(dst[:4096], src[:4096]) and np.array_equal(dst[8 * PAGE :], src[8 * PAGE :])
    assert bytes(back) == src[100:1100].tobytes()
    return decode.session_id, {"write": 4096 + 8 * PAGE, "read": len(back)}, {"write": 1 + 8, "read": 1}


@pytest.fixture
def pair():
    with kvmove.Engine() as prefill, kvmove.Engine() as decode:
        yield prefill, decode


SOCKETS_ONLY = "[backend]\nkind = \"tcp\"\n[backend.tcp]\nsame_host = false\n"


@pytest.mark.parametrize("same_host", [True, False])
def test_engines_on_one_host_pick_same_host_copies_and_say_so(same_host):
    """The facade's default for two engines of one host: their lanes agree
    to same-host copies (counted by path), and the served bytes are counted
    as moved that way; with ``same_host = false`` on the initiator its lanes
    carry the bytes (path ``socket``) and none is moved by copies."""
    config = None if same_host else SOCKETS_ONLY
    with kvmove.Engine(config=config) as prefill, kvmove.Engine() as decode:
        before = prefill.metrics()
        _, nbytes, _ = move(prefill, decode)
        after = kvmove.metrics()
    lanes = {p: delta(before, after, "kvmove_tcp_lanes_total", path=p) for p in ("same_host", "socket")}
    if same_host:
        assert lanes["same_host"] >= 1 and lanes["socket"] == 0, lanes
    else:
        assert lanes["socket"] >= 1 and lanes["same_host"] == 0, lanes
    for op in ("write", "read"):
        moved = delta(before, after, "kvmove_tcp_same_host_bytes_total", op=op)
        assert moved == (nbytes[op] if same_host else 0), (op, moved)


def test_metrics_count_bytes_requests_and_transfers_exactly(pair):
    prefill, decode = pair
    before = prefill.metrics()
    peer, nbytes, nreqs = move(prefill, decode)
    after = kvmove.metrics()

    for op in ("write", "read"):
        assert delta(before, after, "kvmove_bytes_total", op=op, peer=peer) == nbytes[op]
        assert delta(before, after, "kvmove_requests_total", op=op, peer=peer, state="completed") == nreqs[op]
        # The decode engine's TCP server served the same bytes.
        assert delta(before, after, "kvmove_tcp_served_bytes_total", op=op) == nbytes[op]
    assert delta(before, after, "kvmove_requests_total", op="write", peer=peer, state="failed") == 1
    assert delta(before, after, "kvmove_requests_total", op="read", peer=peer, state="failed") == 0
    assert delta(before, after, "kvmove_transfers_total", state="completed") == 3
    assert delta(before, after, "kvmove_transfers_total", state="failed") == 1
    assert delta(before, after, "kvmove_errors_total", kind="out_of_bounds") == 1
    assert delta(before, after, "kvmove_retries_total") == 0
    assert value(after, "kvmove_inflight_bytes") == 0.0
    assert value(after, "kvmove_inflight_requests") == 0.0

    # One latency per transfer, by final state.
    assert hdelta(before, after, "kvmove_transfer_seconds", state="completed") == 3
    assert hdelta(before, after, "kvmove_transfer_seconds", state="failed") == 1
    h = series(after, "kvmove_transfer_seconds", state="completed")
    old = series(before, "kvmove_transfer_seconds", state="completed")
    assert h["sum"] > (old["sum"] if old else 0.0)
    bounds = [le for le, _ in h["buckets"]]
    counts = [n for _, n in h["buckets"]]
    assert bounds == sorted(bounds) and bounds[-1] == math.inf
    assert counts == sorted(counts) and counts[-1] == h["count"]


def test_metrics_shape(pair):
    prefill, decode = pair
    move(prefill, decode)
    m = kvmove.metrics()
    assert list(m) == sorted(m)
    for name, samples in m.items():
        assert name.startswith("kvmove_") and samples
        keys = [tuple(sorted(s["labels"].items())) for s in samples]
        assert keys == sorted(keys) and len(set(keys)) == len(keys), name
        for s in samples:
            assert all(isinstance(k, str) and isinstance(v, str) for k, v in s["labels"].items())
            if "buckets" in s:  # a histogram
                assert set(s) == {"labels", "count", "sum", "buckets"}, name
                assert isinstance(s["count"], int) and isinstance(s["sum"], float)
                assert not name.endswith("_total"), name
            else:  # a counter (int) or a gauge (float)
                assert set(s) == {"labels", "value"}, name
                assert isinstance(s["value"], int if name.endswith("_total") else float), name
    assert isinstance(m["kvmove_bytes_total"][0]["value"], int)
    assert isinstance(m["kvmove_inflight_bytes"][0]["value"], float)
    assert "buckets" in m["kvmove_transfer_seconds"][0]
    # The same dict from every API.
    assert set(m) <= set(prefill.metrics())


def test_mooncake_and_nixl_engines_report_metrics():
    a, b = TransferEngine(), TransferEngine()
    try:
        assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        src = np.arange(8192, dtype=np.uint8)
        dst = np.zeros_like(src)
        assert a.register_memory(src.ctypes.data, src.nbytes) == 0
        assert b.register_memory(dst.ctypes.data, dst.nbytes) == 0
        peer = b.get_session_id()
        before = a.metrics()
        assert a.transfer_sync_write(peer, src.ctypes.data, dst.ctypes.data, 8192) == 0
        assert a.transfer_sync_read(peer, src.ctypes.data, dst.ctypes.data, 100) == 0
        after = a.metrics()
        assert np.array_equal(dst, src)
        assert delta(before, after, "kvmove_bytes_total", op="write", peer=peer) == 8192
        assert delta(before, after, "kvmove_bytes_total", op="read", peer=peer) == 100
        assert delta(before, after, "kvmove_requests_total", op="write", peer=peer, state="completed") == 1
    finally:
        a.close()
        b.close()
    agent = nixl_agent("metrics-test")
    try:
        m = agent.metrics()
        assert value(m, "kvmove_bytes_total", op="write", peer=peer) == value(after, "kvmove_bytes_total", op="write", peer=peer)
    finally:
        agent.close()


def test_engines_install_the_recorder_without_asking(tmp_path):
    # A fresh process: nothing calls kvmove.metrics() before the transfer,
    # so the bytes are counted only if creating an engine installed the
    # recorder.
    code = textwrap.dedent(
        """
        import numpy as np, kvmove
        with kvmove.Engine() as a, kvmove.Engine() as b:
            src = np.ones(4096, dtype=np.uint8); dst = np.zeros_like(src)
            with a.register(src) as rs, b.register(dst) as rd, a.connect(b.session_id) as s:
                s.write(rs.addr, rd.addr, 4096)
            m = kvmove.metrics()
            got = [x["value"] for x in m["kvmove_bytes_total"] if x["labels"] == {"op": "write", "peer": b.session_id}]
            assert got == [4096], m
            # (An engine registers its series at zero when it is made.)
            moved = [x for x in m["kvmove_transfers_total"] if x["value"]]
            assert moved == [{"labels": {"state": "completed"}, "value": 1}], m
            print("ok")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def test_metrics_addr_serves_each_process_once(tmp_path):
    # A serving engine's worker process: KVMOVE_METRICS_ADDR in its
    # environment, engines made by the connector. Each API's first engine
    # starts the server; a second engine (and a second process on the same
    # port) does not fail; a bad value is a clear error.
    code = textwrap.dedent(
        """
        import os, sys, urllib.request, numpy as np, kvmove
        from kvmove.mooncake import TransferEngine
        import kvmove._metrics as km
        which = sys.argv[1]
        if which == "mooncake":
            TransferEngine()
        with kvmove.Engine() as a, kvmove.Engine() as b:
            served = km._served
            assert served and not served.endswith(":0"), served
            src = np.ones(8192, dtype=np.uint8); dst = np.zeros_like(src)
            with a.register(src) as rs, b.register(dst) as rd, a.connect(b.session_id) as s:
                s.write(rs.addr, rd.addr, 8192)
            text = urllib.request.urlopen(f"http://{served}/metrics", timeout=10).read().decode()
            line = f'kvmove_bytes_total{{op="write",peer="{b.session_id}"}} 8192.0'
            assert line in text, text
            assert "python_gc_objects" not in text, "only kvmove's series"
            # A second process asking for the same port logs, then works.
            os.environ["KVMOVE_METRICS_ADDR"] = served
            import subprocess
            r = subprocess.run([sys.executable, "-c", "import kvmove; e = kvmove.Engine(); e.close(); print('second ok')"],
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 0 and "second ok" in r.stdout, r.stdout + r.stderr
            assert "kvmove metrics not served on" in r.stderr, r.stderr
            print("ok")
        """
    )
    env = {**os.environ, "KVMOVE_METRICS_ADDR": "127.0.0.1:0"}
    for which in ("engine", "mooncake"):
        r = subprocess.run(
            [sys.executable, "-c", code, which], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env
        )
        assert r.returncode == 0 and r.stdout.strip() == "ok", which + r.stdout + r.stderr
    bad = {**os.environ, "KVMOVE_METRICS_ADDR": "localhost:http"}
    r = subprocess.run(
        [sys.executable, "-c", "import kvmove; kvmove.Engine()"], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=bad
    )
    assert r.returncode != 0 and "KVMOVE_METRICS_ADDR='localhost:http'" in r.stderr, r.stderr


def scrape(registry):
    """``{(sample name, labels): value}`` of the kvmove series, and the
    family types by name, from the text exposition."""
    text = generate_latest(registry).decode()
    samples, types = {}, {}
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith("kvmove_"):
            continue
        assert fam.name not in types, f"family {fam.name} twice"
        types[fam.name] = fam.type
        for s in fam.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in samples, f"sample {key} twice"
            samples[key] = s.value
    return text, samples, types


def test_register_prometheus_exposes_the_same_values(pair):
    prefill, decode = pair
    peer, nbytes, nreqs = move(prefill, decode)
    registry = CollectorRegistry()
    c1 = kvmove.register_prometheus(registry)
    c2 = kvmove.register_prometheus(registry)
    assert c1 is c2
    text, samples, types = scrape(registry)
    m = kvmove.metrics()  # nothing moves between the scrape and this, but the server's idle polls

    assert text.count("# TYPE kvmove_bytes_total counter") == 1
    # Descriptions come from the engine (Rust's describe_metrics), one per
    # family, never the placeholder.
    assert "# HELP kvmove_bytes_total Bytes of completed requests, by operation and peer." in text
    assert "# HELP kvmove_tcp_lanes_total TCP lanes this engine connected" in text
    for line in text.splitlines():
        if line.startswith("# HELP kvmove_"):
            assert "kvmove metric kvmove_" not in line, line
    assert types["kvmove_bytes"] == "counter"  # the parser drops `_total`
    assert types["kvmove_inflight_bytes"] == "gauge"
    assert types["kvmove_transfer_seconds"] == "histogram"
    wl = (("op", "write"), ("peer", peer))
    assert samples[("kvmove_bytes_total", wl)] == value(m, "kvmove_bytes_total", op="write", peer=peer) >= nbytes["write"]
    rl = (("op", "read"), ("peer", peer), ("state", "completed"))
    assert samples[("kvmove_requests_total", rl)] == value(m, "kvmove_requests_total", op="read", peer=peer, state="completed")

    # Every series of the dict, with the same value.
    n = 0
    for name, series_ in m.items():
        for s in series_:
            labels = tuple(sorted(s["labels"].items()))
            if "buckets" in s:
                assert samples[(name + "_count", labels)] == s["count"]
                assert samples[(name + "_sum", labels)] == pytest.approx(s["sum"], rel=1e-12)
                for le, cum in s["buckets"]:
                    le_s = prometheus_client.utils.floatToGoString(le)
                    assert samples[(name + "_bucket", tuple(sorted(labels + (("le", le_s),))))] == cum
                n += 2 + len(s["buckets"])
            elif name == "kvmove_tcp_server_polls_total":
                # Counts the server's own idle polls, which go on between
                # the scrape and the dict (ci45: 90, then 91): the dict,
                # read after, is never behind.
                assert samples[(name, labels)] <= s["value"], (name, labels)
                n += 1
            else:
                assert samples[(name, labels)] == s["value"], (name, labels)
                n += 1
    assert n == len(samples), "the scrape has series the dict lacks"

    registry.unregister(c1)
    assert "kvmove_" not in generate_latest(registry).decode()
    kvmove.register_prometheus(registry)
    assert "kvmove_bytes_total" in generate_latest(registry).decode()


def test_register_prometheus_default_registry_twice(pair):
    prefill, decode = pair
    peer, _, _ = move(prefill, decode)
    kvmove.register_prometheus()
    kvmove.register_prometheus()
    _, samples, _ = scrape(prometheus_client.REGISTRY)
    wl = (("op", "write"), ("peer", peer))
    assert samples[("kvmove_bytes_total", wl)] == value(kvmove.metrics(), "kvmove_bytes_total", op="write", peer=peer)


def test_scrape_survives_unavailable_metrics(monkeypatch, caplog):
    def refused():
        raise RuntimeError("kvmove metrics are unavailable: another `metrics` recorder was installed")

    registry = CollectorRegistry()
    collector = kvmove.register_prometheus(registry)
    monkeypatch.setattr(collector, "_warned", False)  # warns once per process
    monkeypatch.setattr(kvmove._native, "metrics_snapshot", refused)
    with pytest.raises(RuntimeError, match="another `metrics` recorder"):
        kvmove.metrics()
    with caplog.at_level(logging.WARNING, logger="kvmove"):
        assert "kvmove_" not in generate_latest(registry).decode()
        generate_latest(registry)
    warned = [r for r in caplog.records if "not exported" in r.getMessage()]
    assert len(warned) == 1


def test_register_prometheus_without_prometheus_client(tmp_path):
    code = textwrap.dedent(
        """
        import sys
        sys.modules["prometheus_client"] = None
        import kvmove
        try:
            kvmove.register_prometheus()
        except ImportError as e:
            assert "pip install prometheus_client" in str(e), e
            print("ok")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
