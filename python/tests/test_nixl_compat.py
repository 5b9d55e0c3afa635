"""kvmove's ``nixl_agent`` (issue 16): NIXL's call shapes and errors,
notifications never seen before their data, the opt-in ``nixl`` stand-in
for unmodified programs, and the README's compatibility table."""

import json
import logging
import os
import pickle
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import kvmove.nixl
from kvmove.nixl import (
    nixl_agent,
    nixl_agent_config,
    nixlError,
    nixlInvalidParamError,
    nixlMismatchError,
    nixlNotAllowedError,
    nixlNotFoundError,
    nixlNotPostedError,
    nixlNotSupportedError,
    nixlRegDList,
    nixlRepostActiveError,
    nixlXferDList,
)

from conftest import wait_until
from nixlflows import wait_state

HERE = Path(__file__).resolve().parent


@pytest.fixture
def pair():
    a, b = nixl_agent("A"), nixl_agent("B")
    yield a, b
    a.close()
    b.close()


@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_notification_never_before_data(pair, op):
    """The remote agent's watcher checks the destination bytes the moment
    each notification is seen (one process, so it can look at both sides):
    they must already be the transfer's. Big transfers, so a notification
    sent early would be seen before the bytes land."""
    a, b = pair
    n = 8 << 20
    mine, theirs = np.zeros(n, dtype=np.uint8), np.zeros(n, dtype=np.uint8)
    a.register_memory([(mine.ctypes.data, n, 0, "")], "DRAM")
    b.register_memory([(theirs.ctypes.data, n, 0, "")], "DRAM")
    a.add_remote_agent(b.get_agent_metadata())
    src, dst = (mine, theirs) if op == "WRITE" else (theirs, mine)
    rounds, seen, stop = 8, [], threading.Event()

    def watch():
        while not stop.is_set() and len(seen) < rounds:
            for who, msgs in b.get_new_notifs().items():
                for m in msgs:
                    k = int(m.decode())
                    seen.append((who, k, bool(dst[0] == k % 251 + 1 and dst[-1] == k % 251 + 1 and np.all(dst == k % 251 + 1))))
            time.sleep(0.0002)

    t = threading.Thread(target=watch)
    t.start()
    try:
        local = a.get_xfer_descs([(mine.ctypes.data, n, 0)], "DRAM")
        remote = a.get_xfer_descs([(theirs.ctypes.data, n, 0)], "DRAM")
        for k in range(rounds):
            src[:] = k % 251 + 1
            h = a.initialize_xfer(op, local, remote, "B", str(k).encode())
            assert a.transfer(h) in ("PROC", "DONE")
            assert wait_state(a, h) == "DONE"
            a.release_xfer_handle(h)
            deadline = time.monotonic() + 10
            while len(seen) <= k and time.monotonic() < deadline:
                time.sleep(0.001)
    finally:
        stop.set()
        t.join(10)
    assert [(w, k) for w, k, _ in seen] == [("A", k) for k in range(rounds)]
    assert all(ok for _, _, ok in seen), f"a notification was seen before its data: {seen}"


def test_config_backends_and_metadata():
    conf = nixl_agent_config()
    assert conf.backends == ["UCX"] and conf.num_threads == 0 and not conf.capture_telemetry
    with pytest.raises(TypeError):
        nixl_agent_config(backends="UCX")
    # vLLM's and SGLang's agent creation.
    a = nixl_agent("vllm", nixl_agent_config(num_threads=4, capture_telemetry=True))
    b = nixl_agent("sglang")
    bare = nixl_agent("bare", nixl_agent_config(backends=[]))
    try:
        assert list(a.backends) == ["UCX"] and a.get_backend_mem_types("UCX") == ["DRAM", "VRAM"]
        assert "UCX" in a.get_plugin_list() and "TCP" in a.get_plugin_list()
        assert a.name == "vllm"
        with pytest.raises(nixlNotFoundError, match="not served by kvmove"):
            a.create_backend("GDS")
        if "RDMA" in a.get_plugin_list():
            with pytest.raises(nixlNotAllowedError, match="one protocol per agent"):
                a.create_backend("RDMA")
        a.create_backend("TCP", {"num_threads": "4"})  # same protocol: shares the engine
        assert list(a.backends) == ["UCX", "TCP"]
        with pytest.raises(nixlInvalidParamError, match="already created"):
            a.create_backend("TCP")
        with pytest.raises(nixlNotAllowedError, match="no backend"):
            bare.get_agent_metadata()
        bare.create_backend("TCP")
        assert bare.get_agent_metadata().startswith(b"KVMOVE-NIXL/1\n")
        assert a.add_remote_agent(b.get_agent_metadata()) == b"sglang", "bytes, as NIXL"
        assert a.add_remote_agent(b.get_agent_metadata()) == b"sglang", "the same metadata again: fine"
        assert a.check_remote_metadata("sglang") and a.check_remote_metadata(b"sglang")
        assert not a.check_remote_metadata("nobody")
        for junk in (b"", b"{}", b"KVMOVE-NIXL/1\n{", b"KVMOVE-NIXL/1\n{}"):
            with pytest.raises(nixlMismatchError):
                a.add_remote_agent(junk)
        with pytest.raises(nixlInvalidParamError):
            a.add_remote_agent("not bytes")
        a.remove_remote_agent("sglang")
        a.remove_remote_agent("sglang")  # unknown: ignored, as NIXL does
        with pytest.raises(nixlNotFoundError):
            a.send_notif("sglang", b"x")
    finally:
        for x in (a, b, bare):
            x.close()


def unread(caplog, call, words: str) -> None:
    """``call()`` gives None, NIXL's answer to descriptors it cannot read,
    and logs an error that says ``words``."""
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="kvmove.nixl"):
        assert call() is None
    assert re.search(words, caplog.text), caplog.text


def test_descriptor_inputs_and_registration(pair, caplog):
    a, _ = pair
    buf = np.zeros(1 << 16, dtype=np.uint8)
    p = buf.ctypes.data
    arr = np.array([[p, 4096, 0], [p + 8192, 4096, 0]], dtype=np.uint64)
    x = a.get_xfer_descs(arr, "DRAM")
    assert isinstance(x, nixlXferDList) and len(x) == 2 and x[1] == (p + 8192, 4096, 0)
    assert a.get_xfer_descs(x) is x
    assert pickle.loads(a.get_serialized_descs(x)) == x
    assert a.deserialize_descs(a.get_serialized_descs(x)) == x
    r = a.get_reg_descs([(p, buf.nbytes, 0, "")], "cpu")
    assert isinstance(r, nixlRegDList) and r.getType() == "DRAM"
    # As NIXL's examples serialize a registration for the peer.
    t = r.trim()
    assert isinstance(t, nixlXferDList) and t.getType() == "DRAM" and list(t) == [(p, buf.nbytes, 0)]
    # Input NIXL cannot read is logged and gives None, as there.
    unread(caplog, lambda: a.get_xfer_descs([(p, 16, 0)]), "memory type")
    unread(caplog, lambda: a.get_xfer_descs(np.zeros((2, 2), dtype=np.uint64), "DRAM"), "N x 3")
    unread(caplog, lambda: a.get_xfer_descs([(p, 16, 0), (p,)], "DRAM"), "descriptor 1")
    unread(caplog, lambda: a.get_xfer_descs(r), "registration list")
    # The agent's calls that take descriptors raise for them.
    with pytest.raises(nixlInvalidParamError, match="memory type"):
        a.prep_xfer_dlist("", [(p, 16, 0)])
    with pytest.raises(nixlInvalidParamError, match="registration list"):
        a.prep_xfer_dlist("", r)
    with pytest.raises(nixlNotSupportedError, match="FILE"):
        a.get_reg_descs([(p, 16, 0, "")], "FILE")
    assert a.get_reg_descs([(p, 16, 0, "")], "cuda").getType() == "VRAM"

    def loopback_xfer():
        x = a.get_xfer_descs([(p, 16, 0)], "DRAM"), a.get_xfer_descs([(p + 64, 16, 0)], "DRAM")
        a.release_xfer_handle(a.initialize_xfer("WRITE", *x, a.name))

    # Checked against what is registered at each call (the bounds an agent
    # keeps are made again whenever a registration comes or goes).
    with pytest.raises(nixlNotFoundError, match="not inside registered memory"):
        loopback_xfer()
    before = a._engine.stats()["registered"]
    a.register_memory(r, backends=["UCX"])
    assert a._engine.stats()["registered"] == before + 1
    loopback_xfer()
    with pytest.raises(nixlError):
        a.register_memory([(p + 100, 16, 0, "")], "DRAM")  # overlaps
    with pytest.raises(nixlNotFoundError):
        a.register_memory(r, backends=["LIBFABRIC"])
    loopback_xfer()
    a.deregister_memory(r)
    assert a._engine.stats()["registered"] == before
    with pytest.raises(nixlNotFoundError, match="not inside registered memory"):
        loopback_xfer()
    with pytest.raises(nixlNotFoundError):
        a.deregister_memory(r)


class Liar(tuple):
    """A tuple whose len() says something else."""

    def __len__(self):
        return 5


class Huge(list):
    """A list that claims to be enormous."""

    def __len__(self):
        return 2**58


def test_descriptor_lists_read_in_rust_and_in_python_agree(pair, caplog):
    """Lists of descriptors are read by a Rust fast path; whatever it does
    not take (another shape, a value that is no integer in range) goes to
    the checked Python path, so the rows, and the errors, are the same
    either way."""
    from kvmove import _native
    from kvmove.nixl import _rows

    a, _ = pair
    p = 1 << 40
    many = [(p + i * 4096, 4096, i % 3) for i in range(1000)]
    fast = a.get_xfer_descs(many, "DRAM")
    assert list(fast) == many
    assert fast == a.get_xfer_descs(np.array(many, dtype=np.uint64), "DRAM")
    assert list(a.get_xfer_descs([list(d) for d in many[:3]], "DRAM")) == many[:3]
    numpy_ints = [tuple(np.uint64(v) for v in d) for d in many[:2]]
    assert list(a.get_xfer_descs(numpy_ints, "DRAM")) == many[:2]
    assert _native.nixl_desc_rows(numpy_ints, 3) is not None
    # The whole range of a u64, on both sides of 2^63 (read two ways).
    top = [(2**64 - 1, 2**63, 2**63 - 1), (2**63, 0, 1)]
    assert list(a.get_xfer_descs(top, "DRAM")) == top
    assert _native.nixl_desc_rows(top, 3) is not None
    # Taken by the Python path only, with the same result as before.
    for odd in ([(p, 16.0, 0)], [(p, True, 0)], [(p, "16", 0)]):
        assert _native.nixl_desc_rows(odd, 3) is None or odd[0][1] is True
        assert list(a.get_xfer_descs(odd, "DRAM")) == [(p, int(odd[0][1]), 0)]
    # Refused, by the Python path's own words.
    for bad, words in (
        ([(p, 16, 0), (p,)], "descriptor 1 must be a tuple"),
        ([(p, 16, 0), (p, 16, 0, "m")], "descriptor 1 must be a tuple"),
        ([(p, -1, 0)], "negative or too large"),
        ([(2**64, 1, 0)], "negative or too large"),
        ([(p, None, 0)], "non-integer"),
        ([(p, 16, 0), 7], "descriptor 1 must be a tuple"),
        ([(p, 16, 2**64)], "negative or too large"),
        ([(p, float("inf"), 0)], "non-integer"),
        ([Liar((p, 16, 0))], "descriptor 0 must be a tuple"),
    ):
        assert _native.nixl_desc_rows(bad, 3) is None
        unread(caplog, lambda: a.get_xfer_descs(bad, "DRAM"), words)
    # What a list claims to hold is not trusted for sizes.
    assert list(a.get_xfer_descs(Huge(many[:2]), "DRAM")) == many[:2]
    # Registration lists may carry a fourth item; transfer lists may not.
    assert _native.nixl_desc_rows([(p, 16, 0, "meta")], 4) is not None
    assert list(a.get_reg_descs([(p, 16, 0, "meta")], "DRAM")) == [(p, 16, 0)]
    # Rows are kept as Rust takes them: native-endian u64s, row after row.
    assert _rows([(p, 16, 0)], "DRAM", "x", 3)[1] == np.array([(p, 16, 0)], dtype=np.uint64).tobytes()
    assert list(fast.addrs[:2]) == [p, p + 4096] and list(fast.lens[-1:]) == [4096]


def test_bounds_check_agrees_with_a_plain_reading_of_the_rule():
    """The bounds check (one call into Rust) against a plain Python reading
    of the rule: a descriptor belongs to the last region starting at or
    before it and must end inside it; a zero-length one at a region's end
    is inside, one whose end passes 2^64 is not. Edges, an empty region,
    one up to the top of the address space; the first bad index counts."""
    import bisect

    from kvmove.nixl import _uncovered

    def plain(starts, ends, rows):
        for k, (a, n, _) in enumerate(rows):
            i = bisect.bisect_right(starts, a) - 1
            if i < 0 or a + n >= 2**64 or a + n > ends[i]:
                return k
        return -1

    rng = np.random.default_rng(5)
    starts, ends = [1000, 5000, 9000], [2000, 5000, 2**64 - 1]
    edges = [0, 999, 1000, 1500, 1999, 2000, 2001, 4999, 5000, 5001, 8999, 9000, 2**64 - 2, 2**64 - 1]
    seen = set()
    for _ in range(3000):
        k = int(rng.integers(1, 40))
        rows = [(edges[int(j)], int(n), 0) for j, n in zip(rng.integers(0, len(edges), k), rng.choice([0, 1, 500, 1000, 2**63], k))]
        want = plain(starts, ends, rows)
        got = _uncovered(np.array(starts, dtype=np.uint64), np.array(ends, dtype=np.uint64), np.array(rows, dtype=np.uint64))
        assert got == want, rows
        seen.add(want >= 0)
    assert seen == {True, False}
    # No regions: the first descriptor is outside; no descriptors: none is.
    empty = np.zeros(0, dtype=np.uint64)
    assert _uncovered(empty, empty, np.array([(1, 1, 0)], dtype=np.uint64)) == 0
    assert _uncovered(np.array(starts, dtype=np.uint64), np.array(ends, dtype=np.uint64), np.zeros((0, 3), dtype=np.uint64)) == -1


def test_handles_notifications_and_loopback(pair):
    a, b = pair
    src, dst = np.arange(1 << 16, dtype=np.uint32).view(np.uint8), np.zeros(1 << 18, dtype=np.uint8)
    a.register_memory([(src.ctypes.data, src.nbytes, 0, ""), (dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    # Loopback: the agent's own name as the remote side.
    local = a.prep_xfer_dlist("NIXL_INIT_AGENT", [(src.ctypes.data, src.nbytes, 0)], "DRAM")
    remote = a.prep_xfer_dlist("A", [(dst.ctypes.data, dst.nbytes, 0)], "DRAM")
    h = a.make_prepped_xfer("WRITE", local, [0], remote, [0], "to myself")
    with pytest.raises(nixlNotPostedError):
        a.check_xfer_state(h)
    assert a.transfer(h) in ("PROC", "DONE")
    assert wait_state(a, h) == "DONE" and np.array_equal(src, dst)
    assert a.query_xfer_backend(h) == "UCX"
    # A finished handle can be posted again, with a new message.
    dst[:] = 0
    assert a.transfer(h, b"again") in ("PROC", "DONE")
    assert wait_state(a, h) == "DONE" and np.array_equal(src, dst)
    # As in NIXL, a post stays active until a call reported its end, even
    # when it finished in the background meanwhile.
    if a.transfer(h, b"unseen") == "PROC":
        deadline = time.monotonic() + 10
        while h._native.state() == "PROC" and time.monotonic() < deadline:
            time.sleep(0.001)
        with pytest.raises(nixlRepostActiveError):
            a.transfer(h)
        assert a.check_xfer_state(h) == "DONE"
    # DONE: the message is in the agent's inbox; the engine's reader
    # hands it to the agent's notifications a moment later.
    assert wait_until(lambda: a.check_remote_xfer_done("A", b"unseen"), timeout=10)
    assert a.check_remote_xfer_done("A", b"to my")
    assert a.check_remote_xfer_done("A", b"gai", tag_is_prefix=False)
    assert not a.check_remote_xfer_done("A", b"to my")
    a.release_xfer_handle(h)
    with pytest.raises(nixlInvalidParamError, match="released"):
        a.transfer(h)

    a.add_remote_agent(b.get_agent_metadata())
    with pytest.raises(nixlInvalidParamError, match="too long"):
        a.send_notif("B", b"x" * 4096)
    a.send_notif("B", "text is sent as UTF-8")
    a.send_notif("B", b"\x00binary")
    got = {}
    deadline = time.monotonic() + 10
    while sum(map(len, got.values())) < 2 and time.monotonic() < deadline:
        got = dict(b.update_notifs())
        time.sleep(0.001)
    assert got == {"A": [b"text is sent as UTF-8", b"\x00binary"]}


def test_pairs_by_index_and_lengths_that_differ(pair, monkeypatch):
    """``make_prepped_xfer`` pairs local descriptor ``li[k]`` with remote
    descriptor ``ri[k]`` (indices repeated and out of order),
    ``initialize_xfer`` pairs them in order, and zero-length pairs move
    nothing; a pair whose two lengths differ is refused before anything
    moves, naming the pair and both lengths."""
    a, b = pair
    # Every page different, no byte zero.
    src = (np.arange(1 << 14) // 7 % 251 + 1).astype(np.uint8)
    dst = np.zeros(1 << 14, dtype=np.uint8)
    a.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
    b.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    peer = a.add_remote_agent(b.get_agent_metadata())
    page = 1024
    local = a.prep_xfer_dlist("NIXL_INIT_AGENT", [(src.ctypes.data + i * page, page, 0) for i in range(16)], "DRAM")
    rdescs = [(dst.ctypes.data + i * page, page, 0) for i in range(15)] + [(dst.ctypes.data, 0, 0)]
    remote = a.prep_xfer_dlist(peer, rdescs, "DRAM")
    li, ri = [3, 0, 7, 3], [1, 9, 4, 12]
    h = a.make_prepped_xfer("WRITE", local, li, remote, ri)
    assert a.transfer(h) in ("PROC", "DONE") and wait_state(a, h) == "DONE"
    want = np.zeros_like(dst)
    for l, r in zip(li, ri):
        want[r * page : (r + 1) * page] = src[l * page : (l + 1) * page]
    assert np.array_equal(dst, want)
    with pytest.raises(nixlInvalidParamError, match="descriptor pair 2: local length 1024 != remote length 0"):
        a.make_prepped_xfer("WRITE", local, [1, 2, 5], remote, [1, 2, 15])
    # Integer arrays (vLLM's connector passes them) go to Rust unchecked:
    # the same pairs, and the same refusals in the same words.
    for dt_l, dt_r in ((np.int64, np.int32), (np.uint64, np.int16)):
        dst[:] = 0
        li2, ri2 = np.array([5, 2, 11, 5], dtype=dt_l), np.array([3, 14, 0, 8], dtype=dt_r)
        h = a.make_prepped_xfer("WRITE", local, li2, remote, ri2)
        assert a.transfer(h) in ("PROC", "DONE") and wait_state(a, h) == "DONE"
        want[:] = 0
        for l, r in zip(li2.tolist(), ri2.tolist()):
            want[r * page : (r + 1) * page] = src[l * page : (l + 1) * page]
        assert np.array_equal(dst, want)
    # Lists of ints go to Rust as words too, never through the checked
    # Python path (here made to fail); a list holding a numpy integer
    # takes that path: the same pairs either way.
    import kvmove.nixl._agent as agent_mod

    checked = agent_mod._indices
    for li3, ri3 in (([5, 2, 11, 5], [3, 14, 0, 8]), ([5, np.int64(2), 11, 5], [3, 14, 0, 8])):
        fast = all(type(i) is int for i in li3 + ri3)
        if fast:
            monkeypatch.setattr(agent_mod, "_indices", lambda *a: pytest.fail("a list of ints took the checked path"))
        dst[:] = 0
        h = a.make_prepped_xfer("WRITE", local, li3, remote, ri3)
        monkeypatch.setattr(agent_mod, "_indices", checked)
        assert a.transfer(h) in ("PROC", "DONE") and wait_state(a, h) == "DONE"
        assert np.array_equal(dst, want)
    with pytest.raises(nixlInvalidParamError, match="local_indices: index -1 is outside the prepared list of 16"):
        a.make_prepped_xfer("WRITE", local, [1, -1], remote, [1, 2])
    with pytest.raises(nixlInvalidParamError, match="remote_indices: index 16 is outside the prepared list of 16"):
        a.make_prepped_xfer("WRITE", local, [1, 2], remote, [1, 16])
    with pytest.raises(nixlInvalidParamError, match="descriptor pair 2: local length 1024 != remote length 0"):
        a.make_prepped_xfer("WRITE", local, [1, 2, 5], remote, [1, 2, 15])
    arr = lambda *v: np.array(v, dtype=np.int64)  # noqa: E731
    with pytest.raises(nixlInvalidParamError, match="descriptor pair 2: local length 1024 != remote length 0"):
        a.make_prepped_xfer("WRITE", local, arr(1, 2, 5), remote, arr(1, 2, 15))
    with pytest.raises(nixlInvalidParamError, match="remote_indices: index 16 is outside the prepared list of 16"):
        a.make_prepped_xfer("WRITE", local, arr(1, 2), remote, arr(1, 16))
    with pytest.raises(nixlInvalidParamError, match="local_indices: index -1 is outside the prepared list of 16"):
        a.make_prepped_xfer("WRITE", local, arr(1, -1), remote, arr(1, 2))
    # Every local index is checked before the remote ones (as NIXL's own
    # check reads them), and an index is named by its value as given.
    with pytest.raises(nixlInvalidParamError, match="local_indices: index 17 is outside the prepared list of 16"):
        a.make_prepped_xfer("WRITE", local, arr(1, 17), remote, arr(99, 2))
    huge = np.array([1, 2**64 - 1], dtype=np.uint64)
    with pytest.raises(nixlInvalidParamError, match=f"remote_indices: index {2**64 - 1} is outside"):
        a.make_prepped_xfer("WRITE", local, arr(1, 2), remote, huge)
    with pytest.raises(nixlInvalidParamError, match="2 local indices but 3 remote indices"):
        a.make_prepped_xfer("WRITE", local, arr(1, 2), remote, arr(1, 2, 3))
    with pytest.raises(nixlInvalidParamError, match="at least one descriptor"):
        a.make_prepped_xfer("WRITE", local, arr(), remote, arr())
    # In order, with a zero-length pair at the end.
    dst[:] = 0
    ld = a.get_xfer_descs([(src.ctypes.data + page, page, 0), (src.ctypes.data, 0, 0)], "DRAM")
    rd = a.get_xfer_descs([(dst.ctypes.data, page, 0), (dst.ctypes.data + page, 0, 0)], "DRAM")
    h = a.initialize_xfer("WRITE", ld, rd, peer)
    assert a.transfer(h) in ("PROC", "DONE") and wait_state(a, h) == "DONE"
    assert np.array_equal(dst[:page], src[page : 2 * page]) and not dst[page:].any()
    bad = a.get_xfer_descs([(dst.ctypes.data, page, 0), (dst.ctypes.data + page, 8, 0)], "DRAM")
    with pytest.raises(nixlInvalidParamError, match="descriptor pair 1: local length 0 != remote length 8"):
        a.initialize_xfer("WRITE", ld, bad, peer)


def test_initialize_xfer_checks_both_lists_before_pairing(pair):
    """``initialize_xfer`` checks every local descriptor against this
    agent's registrations, then every remote one against the remote
    agent's, then the pairs' lengths (all in the one call into Rust that
    pairs them): the first failure is the one reported, named by its index,
    and nothing moves."""
    a, b = pair
    src = (np.arange(1 << 12) % 251 + 1).astype(np.uint8)
    dst = np.zeros(1 << 12, dtype=np.uint8)
    a.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
    b.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    peer = a.add_remote_agent(b.get_agent_metadata())
    s, d = src.ctypes.data, dst.ctypes.data

    def xfer(local, remote):
        return a.initialize_xfer("WRITE", a.get_xfer_descs(local, "DRAM"), a.get_xfer_descs(remote, "DRAM"), peer)

    good_l = [(s, 32, 0), (s + 64, 64, 0), (s + 4032, 64, 0)]
    good_r = [(d, 32, 0), (d + 64, 64, 0), (d + 4032, 64, 0)]
    # Local row 2 ends one byte past the region; remote row 1 starts at the
    # remote region's end with one byte; pair 0's lengths differ.
    out_l = good_l[:2] + [(s + 4033, 64, 0)]
    out_r = good_r[:1] + [(d + 4096, 1, 0), good_r[2]]
    short_l = [(s, 16, 0)] + good_l[1:]
    with pytest.raises(nixlNotFoundError, match=rf"^local descriptor 2 \({s + 4033:#x}, 64 bytes\)"):
        xfer(out_l, out_r)
    with pytest.raises(nixlNotFoundError, match=rf"^remote descriptor 1 \({d + 4096:#x}, 1 bytes\) is not inside memory agent"):
        xfer(short_l, out_r)
    with pytest.raises(nixlInvalidParamError, match="descriptor pair 0: local length 16 != remote length 32"):
        xfer(short_l, good_r)
    assert not dst.any()
    h = xfer(good_l, good_r)
    assert a.transfer(h) in ("PROC", "DONE") and wait_state(a, h) == "DONE"
    want = np.zeros_like(dst)
    for (la, n, _), (ra, _, _) in zip(good_l, good_r):
        want[ra - d : ra - d + n] = src[la - s : la - s + n]
    assert np.array_equal(dst, want)


UNMODIFIED_CLIENT = """
import time
import numpy as np
from nixl._api import nixl_agent, nixl_agent_config
from nixl._bindings import nixlXferTelemetry

import kvmove.nixl

assert nixl_agent is kvmove.nixl.nixl_agent and nixlXferTelemetry is kvmove.nixl.nixlXferTelemetry
decode = nixl_agent("decode", nixl_agent_config(num_threads=4, capture_telemetry=True))
prefill = nixl_agent("prefill", nixl_agent_config(capture_telemetry=True))
src, dst = np.arange(8192, dtype=np.uint8), np.zeros(8192, dtype=np.uint8)
prefill.register_memory(prefill.get_reg_descs([(src.ctypes.data, 8192, 0, "")], "DRAM"))
decode.register_memory(decode.get_reg_descs([(dst.ctypes.data, 8192, 0, "")], "DRAM"))
peer = prefill.add_remote_agent(decode.get_agent_metadata())
h = prefill.initialize_xfer("WRITE", prefill.get_xfer_descs([(src.ctypes.data, 8192, 0)], "DRAM"),
                            prefill.get_xfer_descs([(dst.ctypes.data, 8192, 0)], "DRAM"), peer, b"room_kv_0_1")
assert prefill.transfer(h) != "ERR"
while prefill.check_xfer_state(h) == "PROC":
    time.sleep(0.001)
assert isinstance(prefill.get_xfer_telemetry(h), nixlXferTelemetry)
got = {}
for _ in range(5000):
    got = decode.get_new_notifs()
    if got:
        break
    time.sleep(0.001)
assert got == {"prefill": [b"room_kv_0_1"]}, got
assert np.array_equal(src, dst)
prefill.close(); decode.close()
print("ok")
"""


def test_posts_land_and_end_without_being_polled(monkeypatch):
    """A post the caller's polls may finish themselves (submitted at once,
    no notification) starts no task until a poll, a wait or its handle's
    drop needs one. Such posts left unpolled must never starve the next
    ones: with room for two in flight per peer, eight unpolled posts all
    land, then each reports DONE; a handle dropped unpolled lands too."""
    monkeypatch.setenv("KVMOVE_POLICY", json.dumps({"backpressure": {"per_peer_inflight_requests": 2}}))
    a, b = nixl_agent("PA", nixl_agent_config(capture_telemetry=True)), nixl_agent("PB")
    try:
        n, page = 8, 4096
        src = np.random.default_rng(5).integers(0, 256, n * page, dtype=np.uint8)
        dst = np.zeros_like(src)
        a.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
        b.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
        a.add_remote_agent(b.get_agent_metadata())
        a.make_connection("PB")

        def post(i):
            local = a.get_xfer_descs([(src.ctypes.data + i * page, page, 0)], "DRAM")
            remote = a.get_xfer_descs([(dst.ctypes.data + i * page, page, 0)], "DRAM")
            h = a.initialize_xfer("WRITE", local, remote, "PB", b"")
            assert a.transfer(h) == "PROC"
            return h

        handles = [post(i) for i in range(n - 1)]
        post(n - 1)  # dropped at once, never polled
        assert wait_until(lambda: np.array_equal(src, dst), timeout=10), "every post landed"
        for h in handles:
            assert wait_state(a, h) == "DONE"
            assert a.get_xfer_telemetry(h).postDuration > 0
            a.release_xfer_handle(h)
    finally:
        a.close()
        b.close()


def test_unmodified_nixl_import_gets_kvmove(tmp_path):
    shim = HERE.parent / "nixl-shim"
    env = dict(os.environ)
    env.pop("KVMOVE_PROTOCOL", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(shim), env.get("PYTHONPATH", "")] if p)
    # From an empty directory, so `kvmove` is the installed package.
    out = subprocess.run(
        [sys.executable, "-c", UNMODIFIED_CLIENT], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# Every method of NIXL's nixl_agent (src/api/python/_api.py), in its order.
NIXL_METHODS = [
    "get_plugin_list", "get_plugin_mem_types", "get_plugin_params", "get_backend_mem_types",
    "get_backend_params", "create_backend", "register_memory", "deregister_memory", "query_memory",
    "make_connection", "prep_xfer_dlist", "estimate_xfer_cost", "make_prepped_xfer", "initialize_xfer",
    "transfer", "check_xfer_state", "get_xfer_telemetry", "query_xfer_backend", "release_xfer_handle",
    "release_dlist_handle", "prep_mem_view", "release_mem_view", "get_new_notifs", "update_notifs",
    "check_remote_xfer_done", "send_notif", "get_agent_metadata", "get_partial_agent_metadata",
    "add_remote_agent", "remove_remote_agent", "send_local_metadata", "send_partial_agent_metadata",
    "fetch_remote_metadata", "invalidate_local_metadata", "check_remote_metadata", "get_xfer_descs",
    "get_remote_descs", "get_reg_descs", "get_serialized_descs", "deserialize_descs",
]  # fmt: skip


def nixl_table():
    """{method: status} from the README's NIXL compatibility table."""
    import re

    text = (HERE.parent / "README.md").read_text()
    section = text.split("## NIXL compatibility", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or cells[1] not in ("supported", "differs", "not supported"):
            continue
        for name in re.findall(r"`(\w+)", cells[0]):
            rows.setdefault(name, cells[1])
    return rows


def test_readme_compat_table_lists_every_nixl_method():
    table = nixl_table()
    for name in NIXL_METHODS:
        assert name in table, f"{name} is missing from python/README.md's NIXL compatibility table"
        provided = hasattr(kvmove.nixl.nixl_agent, name)
        assert provided == (table[name] != "not supported"), f"{name}: table says {table[name]!r}"
