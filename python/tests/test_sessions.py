"""Handoff sessions and plain notifications of the Pythonic API between two
processes over TCP: this process is the sender (prefill), a
``sessionpeer.py`` process the receiver (decode)."""

import hashlib
import json
import threading
import time

import numpy as np
import pytest

import kvmove

from conftest import finish_with_decode_stopped
from kvpeer import pattern

LAYER = 1 << 20
ZEROS = hashlib.sha256(bytes(LAYER)).hexdigest()


def sha(a) -> str:
    return hashlib.sha256(a.tobytes() if hasattr(a, "tobytes") else a).hexdigest()


@pytest.fixture
def decode(spawn_peer):
    return spawn_peer(nbytes=4 * LAYER, script="sessionpeer.py")


def test_two_layers_land_on_both_sides(decode):
    kv = pattern(3, 2 * LAYER)
    with kvmove.Engine() as prefill, prefill.register(kv) as src:
        s = prefill.send(decode.session_id, 1)
        assert (s.role, s.peer, s.id, s.state) == ("sender", decode.session_id, 1, "waiting")
        assert s.wait_grant(timeout=0.05) is None
        # No grant yet: nothing may be sent.
        with pytest.raises(kvmove.PermanentError) as info:
            s.write_layer([(src.addr, decode.addr, 16)])
        assert info.value.kind == "invalid_request"

        assert decode.ask(f"grant {prefill.session_id} 1 0 {2 * LAYER}") == "ok"
        g = s.wait_grant(timeout=20)
        assert g == kvmove.Grant([(decode.addr, 2 * LAYER)], 2 * LAYER, 30.0)
        assert s.grant == g
        assert decode.ask("state 1") == "granted"

        writes = [s.write_layer([(src.at(i * LAYER), decode.addr + i * LAYER, LAYER)]) for i in range(2)]
        for w in writes:
            assert w.wait(timeout=30).ok
            assert w.done
        assert s.state == "transferring"
        s.finish()
        assert s.wait(timeout=30) == "landed"
        assert decode.ask("wait 1 30") == "landed"
        assert s.error is None
        assert decode.ask(f"digest 0 {2 * LAYER}") == sha(kv)
        assert decode.ask(f"digest {2 * LAYER} {LAYER}") == ZEROS
        s.release()
        assert s.state == "released"
        assert prefill.stats()["sessions_open"] == 0


def test_receiver_cancel_midway_cancels_both(decode):
    kv = pattern(4, 3 * LAYER)
    with kvmove.Engine() as prefill, prefill.register(kv) as src:
        with prefill.send(decode.session_id, 2) as s:
            assert decode.ask(f"grant {prefill.session_id} 2 0 {3 * LAYER}") == "ok"
            assert s.wait_grant(timeout=20) is not None
            s.write([(src.addr, decode.addr, LAYER)])
            # A second layer may still be in flight when the receiver cancels.
            w = s.write_layer([(src.at(LAYER), decode.addr + LAYER, LAYER)])
            assert decode.ask("cancel 2") == "cancelled"
            assert s.wait(timeout=30) == "cancelled"
            assert isinstance(s.error, kvmove.TransferError) and s.error.kind == "cancelled"
            assert w.wait(timeout=30, check=False) is not None  # quiet once the session is final
            # The session is over: the third layer is refused before a byte
            # moves, and so is finish.
            with pytest.raises(kvmove.TransferError):
                s.write_layer([(src.at(2 * LAYER), decode.addr + 2 * LAYER, LAYER)])
            with pytest.raises(kvmove.TransferError):
                s.finish()
            assert decode.ask(f"digest {2 * LAYER} {LAYER}") == ZEROS
            assert decode.ask("state 2") == "cancelled"


def test_sender_cancel_cancels_both(decode):
    kv = pattern(5, LAYER)
    with kvmove.Engine() as prefill, prefill.register(kv) as src:
        s = prefill.send(decode.session_id, 3)
        assert decode.ask(f"grant {prefill.session_id} 3 0 {LAYER}") == "ok"
        s.wait_grant(timeout=20)
        s.write([(src.addr, decode.addr, LAYER // 2)])
        assert s.cancel() == "cancelled"
        assert decode.ask("wait 3 30") == "cancelled"


def test_write_outside_the_grant_raises_before_a_byte_moves(decode):
    kv = pattern(6, 2 * LAYER)
    with kvmove.Engine() as prefill, prefill.register(kv) as src:
        s = prefill.send(decode.session_id, 4)
        assert decode.ask(f"grant {prefill.session_id} 4 0 {LAYER}") == "ok"
        s.wait_grant(timeout=20)
        outside = [
            [(src.addr, decode.addr + LAYER, LAYER)],  # all of it past the grant
            [(src.addr, decode.addr + LAYER // 2, LAYER)],  # straddling its end
            [(src.addr, decode.addr, 4096), (src.addr, decode.addr + LAYER, 4096)],  # one good, one bad
        ]
        for ops in outside:
            with pytest.raises(kvmove.PermanentError) as info:
                s.write_layer(ops)
            assert info.value.kind == "out_of_bounds"
        assert decode.ask(f"digest 0 {2 * LAYER}") == sha(bytes(2 * LAYER))
        assert s.state == "granted"
        # A write inside the grant still works, and the session lands.
        s.write([(src.addr, decode.addr, LAYER)])
        s.finish()
        assert s.wait(timeout=30) == "landed"
        assert decode.ask("wait 4 30") == "landed"
        assert decode.ask(f"digest 0 {LAYER}") == sha(kv[:LAYER])


def test_a_grant_of_scattered_blocks_lands_in_order(decode):
    """1000 blocks in descending address order (vLLM's freed blocks): more
    ranges than one notification holds, so the grant travels in parts; the
    sender sees every range in the decode's order, and what it writes there
    lands there, the gaps untouched."""
    n, block = 1000, 1024
    kv = pattern(8, n * block)
    with kvmove.Engine() as prefill, prefill.register(kv) as src:
        s = prefill.send(decode.session_id, 9)
        assert decode.ask(f"scattered {prefill.session_id} 9 {n} {block}") == "ok"
        g = s.wait_grant(timeout=20)
        want = [(decode.addr + 2 * i * block, block) for i in reversed(range(n))]
        assert g.ranges == want and g.expected == n * block
        with pytest.raises(kvmove.PermanentError) as info:
            s.write_layer([(src.addr, decode.addr + block, block)])  # a gap
        assert info.value.kind == "out_of_bounds"
        ops = [(src.at(k * block), addr, block) for k, (addr, _) in enumerate(g.ranges)]
        assert s.write_layer(ops).wait(timeout=30).ok
        s.finish()
        assert s.wait(timeout=30) == "landed"
        assert decode.ask("wait 9 30") == "landed"
        image = np.zeros(2 * n * block, dtype=np.uint8)
        for k, (addr, _) in enumerate(g.ranges):
            off = addr - decode.addr
            image[off : off + block] = kv[k * block : (k + 1) * block]
        assert decode.ask(f"digest 0 {2 * n * block}") == sha(image)


def test_deadline_expires_on_both_sides(decode):
    with kvmove.Engine() as prefill:
        s = prefill.send(decode.session_id, 5)
        assert decode.ask(f"grant {prefill.session_id} 5 0 4096 0.5") == "ok"
        assert s.wait(timeout=30) == "expired"
        assert s.error.kind == "timeout" and s.error.is_transient
        assert decode.ask("wait 5 30") == "expired"


def test_plain_notifications_both_ways(decode):
    with kvmove.Engine() as prefill:
        prefill.notify(decode.session_id, b"hello decode")
        assert json.loads(decode.ask("notes 20")) == [[prefill.session_id, "hello decode"]]
        assert prefill.notifications() == []
        assert prefill.wait_notification(timeout=0.01) is False
        assert decode.ask(f"notify {prefill.session_id} hello prefill") == "ok"
        assert prefill.wait_notification(timeout=20)
        assert prefill.notifications() == [kvmove.Notification(decode.session_id, b"hello prefill")]
        with pytest.raises(kvmove.PermanentError):
            prefill.notify(decode.session_id, bytes(5000))
        with pytest.raises(kvmove.PermanentError):
            prefill.notify("no-port", b"x")


def test_close_wakes_blocked_waits():
    with kvmove.Engine() as decode:
        prefill = kvmove.Engine()
        s = prefill.send(decode.session_id, 9)
        ended = []

        def blocked(fn):
            try:
                fn()
                ended.append("returned")
            except kvmove.TransferError as e:
                ended.append(e.kind)

        waits = [s.wait, s.wait_grant, prefill.wait_notification]
        threads = [threading.Thread(target=blocked, args=(f,)) for f in waits]
        for t in threads:
            t.start()
        time.sleep(0.2)
        assert ended == []
        prefill.close()
        for t in threads:
            t.join(timeout=10)
        assert not any(t.is_alive() for t in threads)
        assert ended == ["shutdown"] * 3
        with pytest.raises(kvmove.TransferError):
            prefill.notify(decode.session_id, b"x")
        with pytest.raises(kvmove.TransferError):
            prefill.send(decode.session_id, 10)


def test_killed_receiver_fails_the_sender(decode):
    with kvmove.Engine() as prefill:
        s = prefill.send(decode.session_id, 6)
        assert decode.ask(f"grant {prefill.session_id} 6 0 4096") == "ok"
        assert s.wait_grant(timeout=20) is not None
        decode.kill()
        t0 = time.monotonic()
        # The peer's liveness timeout (5 s by default) ends the session.
        assert s.wait(timeout=30) == "failed"
        assert time.monotonic() - t0 < 20
        assert s.error.is_transient and s.error.kind == "peer_unavailable", s.error


def test_receiver_frozen_across_the_finish_is_never_contradicted(decode):
    """The decode process is stopped (SIGSTOP) before it reads the FINISH,
    for longer than the liveness timeout, then continued. The sender, which
    gave up waiting, reports the outcome as unknown, never as a failure the
    receiver could contradict; the receiver, once resumed, asks the sender
    before it lands (it paused), hears that the sender has ended the session
    and fails it too: it never lands alone (rule 13)."""
    kv = pattern(5, LAYER)
    with kvmove.Engine() as prefill, prefill.register(kv) as src:
        # Past the sender's liveness timeout (5 s): it gives up meanwhile.
        finish_with_decode_stopped(prefill, decode, 8, src, LAYER, 7.0, gives_up=True)
        assert decode.ask("wait 8 30") == "failed"


def test_receiver_paused_briefly_across_the_finish_lands_on_both_sides(decode):
    """A pause the receiver notices (2 s, past a quarter of the liveness
    timeout) but the sender forgives (under 5 s): the receiver asks, the
    sender is still waiting, both report landed."""
    kv = pattern(6, LAYER)
    with kvmove.Engine() as prefill, prefill.register(kv) as src:
        s = finish_with_decode_stopped(prefill, decode, 9, src, LAYER, 2.0)
        assert s.wait(timeout=30) == "landed", s.error
        assert decode.ask("wait 9 30") == "landed"
        assert decode.ask(f"digest 0 {LAYER}") == sha(kv)
