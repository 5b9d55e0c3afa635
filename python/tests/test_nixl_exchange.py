"""Two-process tests of kvmove's ``nixl_agent`` (issue 16) in the call
orders of vLLM's and SGLang's NIXL connectors, over TCP on loopback: every
byte checked, notifications checked against the data when they arrive, a
peer killed and restarted, bad descriptors."""

import json
import logging
import os
import subprocess
import threading
import time
import uuid

import numpy as np
import pytest

from kvmove.nixl import (
    nixl_agent,
    nixl_agent_config,
    nixlInvalidParamError,
    nixlNotFoundError,
    nixlNotSupportedError,
    nixlRemoteDisconnectError,
    nixlError,
)

from nixlflows import (
    BLOCK,
    BLOCKS,
    LAYERS,
    NBYTES,
    REGION,
    desc_ids,
    expect_read,
    pairs_arg,
    register_kv,
    sglang_write,
    vllm_handshake,
    vllm_read,
    wait_state,
)
from nixlpeer import pattern


@pytest.fixture
def agents():
    made = []

    def make(*args, **kw):
        a = nixl_agent(*args, **kw)
        made.append(a)
        return a

    yield make
    for a in made:
        a.close()


def nixl_peer(spawn_peer):
    return spawn_peer(nbytes=NBYTES, script="nixlpeer.py")


def filled_pair(spawn_peer, agents, seed):
    """A prefill peer whose memory holds pattern ``seed`` and a decode
    agent (fresh name, made as vLLM makes it) with its KV registered and
    the prefill's metadata loaded: ``(prefill, decode, kv, local handle,
    agent name, remote handle)``."""
    prefill = nixl_peer(spawn_peer)
    assert prefill.ask(f"fill {seed}") == "ok"
    decode = agents(str(uuid.uuid4()), nixl_agent_config(num_threads=4, capture_telemetry=True))
    kv = np.zeros(NBYTES, dtype=np.uint8)
    _, local = register_kv(decode, kv)
    name, remote = vllm_handshake(decode, prefill)
    return prefill, decode, kv, local, name, remote


def test_vllm_decode_reads_from_prefill(spawn_peer, agents):
    """vLLM: decode registers, loads prefill's metadata, prepares both block
    lists, READs a request's blocks of every layer with the notification
    "req:tp", polls to DONE; prefill sees the notification keyed by decode's
    agent name. Then a full prefix hit: send_notif only."""
    prefill = nixl_peer(spawn_peer)
    assert prefill.ask("fill 11") == "ok"
    decode = agents(str(uuid.uuid4()), nixl_agent_config(num_threads=4, capture_telemetry=True))
    kv = np.zeros(NBYTES, dtype=np.uint8)
    _, local = register_kv(decode, kv)
    name, remote = vllm_handshake(decode, prefill)
    assert name == prefill.info["name"].encode() and decode.check_remote_metadata(name)

    local_blocks, remote_blocks = [0, 1, 2, 3, 7], [3, 5, 6, 9, 15]
    want = expect_read(kv, 11, local_blocks, remote_blocks)
    st, tel = vllm_read(decode, local, remote, local_blocks, remote_blocks, b"req-1:1")
    assert st == "DONE"
    assert np.array_equal(kv, want), "every byte of the READ landed, nothing else changed"
    assert tel.totalBytes == len(local_blocks) * 2 * LAYERS * BLOCK
    assert tel.descCount == len(local_blocks) * 2 * LAYERS
    assert tel.xferDuration >= tel.postDuration >= 0 and tel.startTime > 0
    assert json.loads(prefill.ask("notifs 1 10")) == [[decode.name, "req-1:1"]]

    # Full prefix-cache hit: nothing to read, just tell prefill.
    decode.send_notif(name, notif_msg=b"req-2:1")
    # A second request reads other blocks; prefill frees on its notification.
    want = expect_read(kv, 11, [8, 9], [0, 1])
    st, _ = vllm_read(decode, local, remote, [8, 9], [0, 1], b"req-3:1")
    assert st == "DONE" and np.array_equal(kv, want)
    assert json.loads(prefill.ask("notifs 2 10")) == [[decode.name, "req-2:1"], [decode.name, "req-3:1"]]

    # vLLM's shutdown order.
    decode.release_dlist_handle(local)
    decode.release_dlist_handle(remote)
    decode.remove_remote_agent(name)
    assert not decode.check_remote_metadata(name)


def test_sglang_prefill_writes_layer_by_layer(spawn_peer, agents):
    """SGLang: prefill loads decode's metadata and, chunk by chunk (one per
    layer here), initialize_xfer("WRITE", ..., notif) + transfer without
    waiting; decode checks each layer's pages the moment its notification
    is seen; prefill polls check_xfer_state until every handle is DONE."""
    decode = nixl_peer(spawn_peer)
    prefill = agents(str(uuid.uuid4()))  # SGLang passes no config: backend "UCX"
    kv = pattern(21, NBYTES)
    register_kv(prefill, kv)
    name = prefill.add_remote_agent(bytes.fromhex(decode.info["metadata"]))
    pairs = [(0, 5), (1, 6), (2, 7), (9, 0), (15, 15)]
    for room in (1001, 1002):
        decode.proc.stdin.write(f"watch {LAYERS} 20 21 {pairs_arg(pairs)}\n")
        decode.proc.stdin.flush()
        states = sglang_write(prefill, kv, name, decode, room, pairs)
        assert states == ["DONE"] * LAYERS
        seen = json.loads(decode.read_line())
        # Transfers posted together may finish (and notify) in any order:
        # SGLang keeps the chunks it received in a set.
        assert sorted(m for _, m, _ in seen) == [f"{room}_kv_{l}_{int(l == LAYERS - 1)}" for l in range(LAYERS)]
        assert all(who == prefill.name for who, _, _ in seen)
        assert all(ok for _, _, ok in seen), f"a notification arrived before its layer's bytes: {seen}"


def test_peer_killed_and_restarted(spawn_peer, agents, monkeypatch):
    """Prefill is killed: decode's READ fails with an error (no hang, no
    DONE); after remove_remote_agent and add_remote_agent of the restarted
    prefill's metadata, reads work again and notifications reach it."""
    monkeypatch.setenv("KVMOVE_POLICY", json.dumps({"retry": {"max_attempts": 2}}))
    prefill, decode, kv, local, name, remote = filled_pair(spawn_peer, agents, 3)
    st, _ = vllm_read(decode, local, remote, [0], [1], b"a:1")
    assert st == "DONE"
    assert json.loads(prefill.ask("notifs 1 10")) == [[decode.name, "a:1"]]

    prefill.kill()
    start = time.monotonic()
    with pytest.raises(nixlError) as info:
        vllm_read(decode, local, remote, [1], [2], b"b:1")
    assert time.monotonic() - start < 60
    assert isinstance(info.value, nixlRemoteDisconnectError), repr(info.value)
    decode.release_dlist_handle(remote)
    decode.remove_remote_agent(name)

    again = nixl_peer(spawn_peer)
    assert again.ask("fill 4") == "ok"
    name2, remote2 = vllm_handshake(decode, again)
    assert name2 != name
    want = expect_read(kv, 4, [2, 3], [10, 11])
    st, _ = vllm_read(decode, local, remote2, [2, 3], [10, 11], b"c:1")
    assert st == "DONE" and np.array_equal(kv, want)
    assert json.loads(again.ask("notifs 1 10")) == [[decode.name, "c:1"]]


def test_bad_descriptors(spawn_peer, agents):
    """Descriptors outside registered memory, bad indices and lengths are
    refused with clear errors before anything moves; a transfer against
    stale metadata fails and sends no notification; memory types other than
    DRAM and VRAM are refused."""
    prefill = nixl_peer(spawn_peer)
    decode = agents(str(uuid.uuid4()))
    kv = np.zeros(NBYTES, dtype=np.uint8)
    _, local = register_kv(decode, kv)
    name, remote = vllm_handshake(decode, prefill)
    end = prefill.info["regions"][-1] + REGION

    with pytest.raises(nixlNotFoundError, match="not inside memory agent"):
        decode.prep_xfer_dlist(name, decode.get_xfer_descs([(end - 8, 16, 0)], "DRAM"))
    with pytest.raises(nixlNotFoundError, match="not inside registered memory"):
        decode.prep_xfer_dlist("NIXL_INIT_AGENT", [(kv.ctypes.data + NBYTES - 8, 16, 0)], "DRAM")
    with pytest.raises(nixlNotFoundError):
        decode.initialize_xfer(
            "WRITE",
            decode.get_xfer_descs([(kv.ctypes.data, 16, 0)], "DRAM"),
            decode.get_xfer_descs([(4096, 16, 0)], "DRAM"),
            name,
            b"never",
        )
    with pytest.raises(nixlNotFoundError, match="unknown remote agent"):
        decode.prep_xfer_dlist("nobody", [(end - 16, 16, 0)], "DRAM")
    with pytest.raises(nixlInvalidParamError, match="outside the prepared list"):
        decode.make_prepped_xfer("READ", local, [0], remote, [REGIONS_TOTAL], b"never")
    with pytest.raises(KeyError, match="READ"):
        decode.make_prepped_xfer("COPY", local, [0], remote, [0])
    short = decode.prep_xfer_dlist(name, [(prefill.info["addr"], BLOCK // 2, 0)], "DRAM")
    with pytest.raises(nixlInvalidParamError, match="length"):
        decode.make_prepped_xfer("READ", local, [0], short, [0])
    with pytest.raises(nixlNotSupportedError, match="OBJ"):
        decode.register_memory([(kv.ctypes.data, 16, 0, "")], "OBJ")
    with pytest.raises(nixlNotSupportedError, match="BLOCK"):
        decode.get_xfer_descs([(kv.ctypes.data, 16, 0)], "BLOCK")
    with pytest.raises(KeyError, match="BLK"):
        decode.get_xfer_descs([(kv.ctypes.data, 16, 0)], "BLK")

    # Stale metadata: prefill deregistered region 0 after sending it. The
    # READ is refused by prefill's engine; no notification is sent.
    assert prefill.ask("dereg 0") == "ok"
    h = decode.make_prepped_xfer("READ", local, [0], remote, [0], b"stale:1")
    with pytest.raises(nixlError) as info:
        decode.transfer(h)
        while decode.check_xfer_state(h) == "PROC":
            time.sleep(0.001)
    assert info.value.kind in ("out_of_bounds", "unregistered", "not_found"), repr(info.value)
    decode.release_xfer_handle(h)
    # A good transfer still works, and its notification is the only one.
    assert prefill.ask("fill 8") == "ok"
    h = decode.make_prepped_xfer("READ", local, [BLOCKS + 1], remote, [BLOCKS + 2], b"good:1")
    assert decode.transfer(h) in ("PROC", "DONE")
    assert wait_state(decode, h) == "DONE"
    decode.release_xfer_handle(h)
    assert np.array_equal(kv[REGION + BLOCK : REGION + 2 * BLOCK], pattern(8, NBYTES)[REGION + 2 * BLOCK : REGION + 3 * BLOCK])
    assert json.loads(prefill.ask("notifs 2 1.5")) == [[decode.name, "good:1"]]


REGIONS_TOTAL = 2 * LAYERS * BLOCKS


# The calls NIXL makes non-blocking must return in far less than the
# peer's timeouts (handshake 2-5 s, notification 30 s) while it is frozen.
AT_ONCE = 1.0


def timed(fn):
    start = time.monotonic()
    r = fn()
    return r, time.monotonic() - start


def test_calls_to_a_frozen_peer_return_at_once(spawn_peer, agents):
    """Prefill is frozen (SIGSTOP, as a hung or swapping server is) before
    decode has connected to it. ``make_connection``, ``send_notif``,
    ``transfer`` and ``check_xfer_state`` return at once, as NIXL's do (vLLM
    calls them from its engine thread); once prefill runs again the queued
    work is done in order: the READ lands, every notification arrives."""
    prefill, decode, kv, local, name, remote = filled_pair(spawn_peer, agents, 5)
    want = expect_read(kv, 5, [0, 1], [4, 5])

    prefill.pause()
    try:
        took = {}
        _, took["make_connection"] = timed(lambda: decode.make_connection(name))
        _, took["send_notif"] = timed(lambda: decode.send_notif(name, b"hb:1"))
        h = decode.make_prepped_xfer("READ", local, desc_ids([0, 1]), remote, desc_ids([4, 5]), notif_msg=b"done:1")
        st, took["transfer"] = timed(lambda: decode.transfer(h))
        assert st == "PROC"
        st, took["check_xfer_state"] = timed(lambda: decode.check_xfer_state(h))
        assert st == "PROC"
        _, took["send_notif again"] = timed(lambda: decode.send_notif(name, b"hb:2"))
        slow = {k: round(v, 3) for k, v in took.items() if v > AT_ONCE}
        assert not slow, f"calls blocked on the frozen peer (seconds): {slow}"
        time.sleep(0.3)
        st = decode.check_xfer_state(h)
        if st != "PROC":
            state = [l for l in open(f"/proc/{prefill.proc.pid}/status") if l.startswith("State:")]
            port = prefill.session_id.rsplit(":", 1)[1]
            ss = subprocess.run(["ss", "-tanp"], capture_output=True, text=True).stdout
            mine = [l for l in ss.splitlines() if f":{port} " in l]
            r, session = h._session
            raise AssertionError(
                f"the READ finished while its source was frozen ({state}); peer {prefill.session_id} pid "
                f"{prefill.proc.pid}, remote {r.session_id if r else None}, this engine {decode._engine.session_id}, "
                f"pytest pid {os.getpid()}; sockets on the port: {mine}"
            )
    finally:
        prefill.resume()
    assert wait_state(decode, h) == "DONE"
    assert np.array_equal(kv, want)
    got = json.loads(prefill.ask("notifs 3 20"))
    assert sorted(m for _, m in got) == ["done:1", "hb:1", "hb:2"], got
    assert {who for who, _ in got} == {decode.name}
    heartbeats = [m for _, m in got if m.startswith("hb:")]
    assert heartbeats == ["hb:1", "hb:2"], got  # in the order sent
    decode.release_xfer_handle(h)


def test_work_queued_for_a_frozen_peer_does_not_wait_for_it_forever(spawn_peer, agents, monkeypatch):
    """A notification to a frozen peer holds its agent's courier until the
    engine gives up on the answer (30 s), and transfers posted meanwhile
    queue behind it, in order (vLLM sends a heartbeat to its prefill every
    5 s: in the vLLM check a READ queued so never ended until the prefill
    resumed, 78 s later). Such queued work fails at once when the peer is
    found gone (a transfer to it failed so), and a transfer queued longer
    than ``_QUEUE_LIMIT`` fails unposted; the peer, once it runs again,
    serves a new READ."""
    prefill, decode, kv, local, name, remote = filled_pair(spawn_peer, agents, 6)
    st, _ = vllm_read(decode, local, remote, [0], [0], b"warm")
    assert st == "DONE"

    def queued_read(blocks):
        h = decode.make_prepped_xfer("READ", local, desc_ids(blocks), remote, desc_ids(blocks), notif_msg=b"r")
        assert decode.transfer(h) == "PROC"
        assert h._pending is not None, "the READ was posted, not queued behind the notification"
        return h

    def failure(h, limit):
        """The error ``check_xfer_state(h)`` raises within ``limit`` s."""
        end = time.monotonic() + limit
        while time.monotonic() < end:
            try:
                decode.check_xfer_state(h)
            except nixlRemoteDisconnectError as e:
                return e
            time.sleep(0.01)
        raise AssertionError(f"the queued READ still waits after {limit} s")

    prefill.pause()
    try:
        decode.send_notif(name, b"hb:1")  # holds the courier: the peer is frozen
        time.sleep(0.2)
        # Found gone (as check_xfer_state does for a transfer that failed
        # so; called directly: a frozen peer fails nothing on cue).
        h = queued_read([1])
        r = decode._remote(name)
        _, took = timed(lambda: decode._forget_session(r, r.session))
        assert took < AT_ONCE
        e, took = timed(lambda: failure(h, AT_ONCE))
        assert "found gone" in str(e) and h._native is None, e
        # Queued past the limit: fails, never posted.
        monkeypatch.setattr("kvmove.nixl._agent._QUEUE_LIMIT", 1.0)
        h2 = queued_read([2])
        e = failure(h2, 1.0 + 3 * AT_ONCE)
        assert "waited" in str(e) and h2._native is None, e
        time.sleep(0.5)
        assert h2._native is None, "the READ that gave up was posted later"
    finally:
        prefill.resume()
    monkeypatch.setattr("kvmove.nixl._agent._QUEUE_LIMIT", 30.0)
    want = expect_read(kv, 6, [3], [3])
    st, _ = vllm_read(decode, local, remote, [3], [3], b"after")
    assert st == "DONE"
    assert np.array_equal(kv, want), "a READ after the peer resumed lands"
    for x in (h, h2):
        decode.release_xfer_handle(x)


def test_a_call_that_holds_its_caller_is_logged(agents, monkeypatch, caplog):
    """A call NIXL makes non-blocking that waits longer than ``_HOLD_WARN``
    (here for the agent's lock, which another thread holds) is logged with
    its name and duration: how a hold of vLLM's engine thread shows in the
    server's log (the vLLM check fails on such a line). One that does not
    wait is not."""
    monkeypatch.setattr("kvmove.nixl._base._HOLD_WARN", 0.1)
    a = agents(str(uuid.uuid4()))
    a.get_new_notifs()  # the engine started
    caplog.set_level(logging.WARNING, logger="kvmove.nixl")
    a.get_new_notifs()
    assert not [r for r in caplog.records if "held its caller" in r.getMessage()]
    taken, release = threading.Event(), threading.Event()

    def hold():
        with a._lock:
            taken.set()
            release.wait(5)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert taken.wait(5)
        threading.Timer(0.3, release.set).start()
        a.get_new_notifs()
    finally:
        release.set()
        t.join()
    held = [r.getMessage() for r in caplog.records if "held its caller" in r.getMessage()]
    assert len(held) == 1 and held[0].startswith("get_new_notifs held its caller 0."), held


def tcp_config(monkeypatch, tmp_path, option: str):
    """The agents and peers made after this run kvmove's TCP backend on
    loopback with ``option`` in its ``[backend.tcp]`` table."""
    cfg = tmp_path / "kvmove.toml"
    cfg.write_text(f'[backend]\nkind = "tcp"\n[backend.tcp]\nlisten = "127.0.0.1:0"\n{option}\n')
    monkeypatch.setenv("KVMOVE_CONFIG", str(cfg))


def read_block(agent, local, remote, block: int):
    """One READ of ``block`` of every region into the same local block,
    polled until DONE, then released."""
    h = agent.make_prepped_xfer("READ", local, desc_ids([block]), remote, desc_ids([block]))
    agent.transfer(h)
    assert wait_state(agent, h) == "DONE"
    agent.release_xfer_handle(h)


def spin(agent, h, n=300):
    """Polls ``h`` ``n`` times back to back: (states seen, wall s, CPU s)."""
    wall, cpu = time.monotonic(), time.process_time()
    states = {agent.check_xfer_state(h) for _ in range(n)}
    return states, time.monotonic() - wall, time.process_time() - cpu


def test_a_caller_spinning_on_check_xfer_state_sleeps(spawn_peer, agents, monkeypatch, tmp_path):
    """NIXL's callers loop on ``check_xfer_state`` (with UCX the loop is
    the progress engine). Here the engine's threads move the bytes, so a
    caller polling one unfinished transfer back to back is made to wait
    (GIL released) for its end instead of taking a CPU from them. With the
    source frozen: 300 polls in a loop cost at least the time of their
    waits and little CPU, for a transfer posted on a live connection and
    for one still waiting to connect; polls a step apart answer at once;
    a loop over two handles in turn never waits; once the peers run again
    the loops see DONE and the bytes are right. (Small reads from a same-host
    peer are copied straight out of its memory, frozen or not: they are
    turned off here, so the transfers need the peers.)"""
    tcp_config(monkeypatch, tmp_path, "direct_reads = false")
    connected, unconnected = nixl_peer(spawn_peer), nixl_peer(spawn_peer)
    for i, p in enumerate((connected, unconnected)):
        assert p.ask(f"fill {7 + i}") == "ok"
    decode = agents(str(uuid.uuid4()))
    kv = np.zeros(NBYTES, dtype=np.uint8)
    _, local = register_kv(decode, kv)
    name, remote = vllm_handshake(decode, connected)
    read_block(decode, local, remote, 1)
    name2, remote2 = vllm_handshake(decode, unconnected)
    want = expect_read(expect_read(kv, 7, [1, 2], [1, 3]), 8, [4], [5])
    handles = []
    connected.pause()
    unconnected.pause()
    try:
        h = decode.make_prepped_xfer("READ", local, desc_ids([2]), remote, desc_ids([3]))
        h2 = decode.make_prepped_xfer("READ", local, desc_ids([4]), remote2, desc_ids([5]))
        handles = [h, h2]
        for x in handles:
            assert decode.transfer(x) == "PROC"
        assert h._pending is None and h2._pending is not None  # posted / waiting to connect
        for x in handles:
            # Polled now and then, as a serving engine's step does.
            for _ in range(3):
                time.sleep(0.05)
                st, took = timed(lambda: decode.check_xfer_state(x))
                assert (st, took < AT_ONCE) == ("PROC", True), took
            states, wall, cpu = spin(decode, x)
            assert states == {"PROC"}
            assert wall >= 0.25, f"300 polls of a running transfer took {wall:.4f} s: they did not wait"
            assert cpu < 0.5 * wall, f"300 polls took {cpu:.3f} s of CPU in {wall:.3f} s: the caller spun"
        # A loop over both handles in turn (as a step over pending
        # transfers) is never made to wait: far quicker than one handle's.
        start = time.monotonic()
        states = {decode.check_xfer_state(handles[k % 2]) for k in range(300)}
        turns = time.monotonic() - start
        assert states == {"PROC"}
        assert turns < 0.5 * wall, f"300 polls over two handles took {turns:.3f} s, over one {wall:.3f} s"
    finally:
        connected.resume()
        unconnected.resume()
    for x in handles:
        st, took = timed(lambda: next(s for s in iter(lambda: decode.check_xfer_state(x), None) if s != "PROC"))
        assert (st, took < 30) == ("DONE", True), took
        decode.release_xfer_handle(x)
    assert np.array_equal(kv, want)


def test_a_caller_polling_at_once_gets_done_at_its_first_poll(spawn_peer, agents, monkeypatch, tmp_path):
    """Issue 55 item 2: a caller that polls a small transfer right after
    posting it (the loop NIXL's own examples and benchmarks run) spins on
    its own thread until the answer comes, at most until the transfer is
    250 us old, with the transport told that it polls, as
    ``kvmove.Engine``'s calls do: over the network path the answer is
    applied on that thread and the first ``check_xfer_state`` says DONE,
    no engine thread woken for it. Without the spin the first poll said
    DONE for 0.4-8 % of 3000 such writes and a write took 43-46 us, with
    it 99.97 % and 23-29 us (2 vCPUs, p50). One READ at a time, one block
    of every region each, bytes checked."""
    tcp_config(monkeypatch, tmp_path, "same_host = false")
    prefill = nixl_peer(spawn_peer)
    assert prefill.ask("fill 11") == "ok"
    decode = agents(str(uuid.uuid4()))
    kv = np.zeros(NBYTES, dtype=np.uint8)
    _, local = register_kv(decode, kv)
    name, remote = vllm_handshake(decode, prefill)
    read_block(decode, local, remote, 0)  # the connection is made by the first transfer
    want = expect_read(kv, 11, [0], [0])
    firsts, rounds = [], 40
    for k in range(rounds):
        block = 1 + k % (BLOCKS - 1)
        h = decode.make_prepped_xfer("READ", local, desc_ids([block]), remote, desc_ids([block]))
        assert decode.transfer(h) == "PROC"
        st, took = timed(lambda: decode.check_xfer_state(h))
        firsts.append(st)
        assert took < 1.0, f"a poll held its caller {took:.3f} s"
        while st == "PROC":
            st = decode.check_xfer_state(h)
        assert st == "DONE"
        decode.release_xfer_handle(h)
        want = expect_read(want, 11, [block], [block])
    assert np.array_equal(kv, want)
    done = firsts.count("DONE")
    assert done >= rounds // 2, f"the first poll said DONE for {done} of {rounds} small READs"


def test_work_waiting_for_a_frozen_peer_is_bounded(spawn_peer, agents, monkeypatch):
    """Nothing queues without bound (rule 8): at most ``_Courier.LIMIT``
    operations wait for a peer that does not answer; one more raises at
    once, and once the peer runs again what waited is delivered in order."""
    from kvmove import nixl as nixl_mod

    monkeypatch.setattr(nixl_mod._Courier, "LIMIT", 8)
    prefill = nixl_peer(spawn_peer)
    decode = agents(str(uuid.uuid4()))
    name = decode.add_remote_agent(bytes.fromhex(prefill.info["metadata"]))
    prefill.pause()
    try:
        for i in range(8):
            decode.send_notif(name, f"n:{i}".encode())
        with pytest.raises(nixlError, match="already wait"):
            decode.send_notif(name, b"one too many")
    finally:
        prefill.resume()
    got = json.loads(prefill.ask("notifs 8 20"))
    assert [m for _, m in got] == [f"n:{i}" for i in range(8)], got


@pytest.mark.parametrize("drop", ["forget", "remove"])
def test_dropping_a_frozen_peer_does_not_hold_the_caller(spawn_peer, agents, monkeypatch, tmp_path, drop):
    """When a transfer to a peer fails as gone, ``check_xfer_state`` (and
    ``transfer``) drop its session (``_forget_session``; called here
    directly, as those calls do, since a frozen peer never fails a READ on
    cue); ``remove_remote_agent`` drops it too (vLLM's cleanup of a peer it
    gave up on). Closing that session ends its other transfers and waits
    for their answers, up to the engine's drain timeout when the peer is
    frozen: that wait is not the caller's, who returns at once (vLLM makes
    these calls on its engine thread). The transfers still in flight end,
    and once the peer runs again a new READ goes through a fresh session
    (after the agent's metadata is loaded again, once removed)."""
    # A drain timeout of 3 s (default 250 ms) makes the close's wait on the
    # frozen peer plain to see (the decode's engine reads it).
    cfg = tmp_path / "kvmove.toml"
    cfg.write_text("[backend.tcp]\ndrain_timeout = 3000\n")
    monkeypatch.setenv("KVMOVE_CONFIG", str(cfg))
    prefill, decode, kv, local, name, remote = filled_pair(spawn_peer, agents, 9)
    st, _ = vllm_read(decode, local, remote, [0], [0], b"warm")
    assert st == "DONE"  # connected: the READs below are posted at once
    prefill.pause()
    handles = []
    try:
        # 9 blocks of every region a READ: 72 requests, past what a
        # same-host read copies directly (64), so they wait on the wire.
        for k in range(8):
            blocks = list(range(9))
            h = decode.make_prepped_xfer("READ", local, desc_ids(blocks), remote, desc_ids([b + k for b in blocks]))
            assert decode.transfer(h) == "PROC"
            handles.append(h)
        # Every one posted (on the wire, not waiting in the courier), none
        # ended.
        limit = time.monotonic() + 10
        while any(h._native is None for h in handles) and time.monotonic() < limit:
            time.sleep(0.01)
        assert all(decode.check_xfer_state(h) == "PROC" for h in handles)
        time.sleep(0.5)  # their requests written to the frozen peer's sockets
        r, session = handles[0]._session
        if drop == "forget":
            _, took = timed(lambda: decode._forget_session(r, session))
        else:
            _, took = timed(lambda: decode.remove_remote_agent(name))
        assert took < AT_ONCE, f"dropping the frozen peer's session ({drop}) held the caller {took:.2f} s"
        assert r.session is None, "the next transfer opens a fresh session"
        # The session's transfers end (cancelled by the close) while the
        # peer is still frozen.
        ended = 0
        deadline = time.monotonic() + 30
        while ended < len(handles) and time.monotonic() < deadline:
            ended = 0
            for h in handles:
                try:
                    ended += decode.check_xfer_state(h) != "PROC"
                except nixlError:
                    ended += 1
            time.sleep(0.05)
        assert ended == len(handles), "the closed session's transfers ended"
    finally:
        prefill.resume()
    if drop == "remove":
        name, remote = vllm_handshake(decode, prefill)
    want = expect_read(kv, 9, [3], [5])
    # The transfers reset by the close count against the peer: its breaker
    # may be open for a moment, and the next request tries again.
    limit = time.monotonic() + 10
    while True:
        try:
            st, _ = vllm_read(decode, local, remote, [3], [5], b"after")
            break
        except nixlRemoteDisconnectError:
            if time.monotonic() > limit:
                raise
            time.sleep(0.1)
    assert st == "DONE"
    assert np.array_equal(kv, want), "a READ after the peer resumed lands through a fresh session"
    for h in handles:
        decode.release_xfer_handle(h)
