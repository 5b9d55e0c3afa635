"""NIXL's API around the agent's calls, as NIXL's own tests use it: the
bindings' enums, descriptor lists, ``nixlAgentConfig`` and ``nixlAgent``
(made by ``nixl_agent`` through ``nixl._bindings``), the answers to
descriptors NIXL cannot read (None) and to unknown names (``KeyError``,
``nixlNotFoundError``), telemetry on and off as NIXL 1.5.1 decides it, and
the stand-in package's ``nixl._bindings``, ``nixl._utils`` and
``nixl.logging``."""

import logging
import os
import pickle
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from kvmove.nixl import (
    _bindings,
    nixl_agent,
    nixl_agent_config,
    nixl_thread_sync_t,
    nixlInvalidParamError,
    nixlNoTelemetryError,
    nixlNotFoundError,
    nixlNotPostedError,
    nixlNotSupportedError,
    nixlRegDList,
    nixlXferDList,
)

from conftest import wait_until
from nixlflows import wait_state

HERE = Path(__file__).resolve().parent


@pytest.fixture
def agents():
    made = []

    def make(conf=None):
        a = nixl_agent(str(uuid.uuid4()), conf)
        made.append(a)
        return a

    yield make
    for a in made:
        a.close()


def test_enums_have_nixls_values():
    assert [(m.name, int(m)) for m in _bindings.nixl_mem_t] == [
        ("DRAM_SEG", 0), ("VRAM_SEG", 1), ("BLK_SEG", 2), ("OBJ_SEG", 3), ("FILE_SEG", 4),
    ]  # fmt: skip
    assert _bindings.DRAM_SEG is _bindings.nixl_mem_t.DRAM_SEG and _bindings.FILE_SEG == 4
    # As in NIXL's bindings, the default mode is none; nixl_thread_sync_t's
    # values are the bindings' modes.
    assert (_bindings.NIXL_THREAD_SYNC_NONE, _bindings.NIXL_THREAD_SYNC_STRICT, _bindings.NIXL_THREAD_SYNC_RW) == (0, 1, 2)
    assert _bindings.NIXL_THREAD_SYNC_DEFAULT is _bindings.NIXL_THREAD_SYNC_NONE
    assert [m.value for m in nixl_thread_sync_t] == [
        _bindings.NIXL_THREAD_SYNC_NONE, _bindings.NIXL_THREAD_SYNC_STRICT, _bindings.NIXL_THREAD_SYNC_RW,
    ]  # fmt: skip
    assert nixl_thread_sync_t.NIXL_THREAD_SYNC_DEFAULT is nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE


def test_descriptor_lists_made_as_nixls_bindings_make_them():
    empty = nixlXferDList(_bindings.DRAM_SEG)
    assert len(empty) == 0 and empty.getType() == "DRAM" and empty == nixlXferDList(_bindings.DRAM_SEG, [])
    assert list(nixlXferDList(_bindings.VRAM_SEG, 2)) == [(0, 0, 0)] * 2
    x = nixlXferDList(_bindings.DRAM_SEG, [(1, 2, 3), (4, 5, 6)])
    assert list(x) == [(1, 2, 3), (4, 5, 6)]
    assert nixlXferDList(_bindings.DRAM_SEG, np.array([[1, 2, 3], [4, 5, 6]], dtype=np.uint64)) == x
    r = nixlRegDList(_bindings.VRAM_SEG, [(1, 2, 3, "meta")])
    assert r.getType() == "VRAM" and list(r) == [(1, 2, 3)]
    assert pickle.loads(pickle.dumps(r)) == r
    # Tuples of the other list's size, as NIXL's bindings refuse them.
    with pytest.raises(ValueError, match="tuple of 3"):
        nixlXferDList(_bindings.DRAM_SEG, [(1, 2, 3, "meta")])
    with pytest.raises(ValueError, match="tuple of 4"):
        nixlRegDList(_bindings.DRAM_SEG, [(1, 2, 3)])
    with pytest.raises(ValueError, match="N x 3"):
        nixlXferDList(_bindings.DRAM_SEG, np.zeros((1, 4), dtype=np.uint64))
    with pytest.raises(TypeError, match="nixl_mem_t"):
        nixlXferDList(0)
    with pytest.raises(nixlNotSupportedError, match="FILE_SEG"):
        nixlXferDList(_bindings.FILE_SEG)


def test_the_agent_is_made_through_the_bindings(monkeypatch):
    """``nixl_agent`` fills a ``nixlAgentConfig`` and calls
    ``nixlAgent`` looked up in the bindings when called, as NIXL's does;
    sync mode STRICT with the listen thread, NONE without, unless given."""
    seen = []
    real = _bindings.nixlAgent

    def spy(name, config):
        seen.append((name, config.syncMode, config.useListenThread, config.captureTelemetry))
        return real(name, config)

    monkeypatch.setattr(_bindings, "nixlAgent", spy)
    cases = [
        (dict(enable_listen_thread=True), _bindings.NIXL_THREAD_SYNC_STRICT),
        (dict(), _bindings.NIXL_THREAD_SYNC_NONE),
        (dict(enable_listen_thread=True, sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_RW), _bindings.NIXL_THREAD_SYNC_RW),
        (dict(sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT, capture_telemetry=True), _bindings.NIXL_THREAD_SYNC_STRICT),
    ]
    for kw, mode in cases:
        a = nixl_agent("spied", nixl_agent_config(backends=[], **kw))
        assert seen.pop() == ("spied", mode, kw.get("enable_listen_thread", False), kw.get("capture_telemetry", False))
        assert a.agent.name == "spied" and a.agent.config.syncMode == mode
        a.close()
    with pytest.raises(TypeError, match="sync_mode must be a nixl_thread_sync_t"):
        nixl_agent_config(sync_mode=1)


def test_agent_names_are_checked_as_nixls():
    with pytest.raises(ValueError, match="non-empty name"):
        nixl_agent("")
    with pytest.raises(TypeError, match="str"):
        nixl_agent(None)
    # Bytes are a name too, as NIXL's bindings take them.
    a = nixl_agent(b"bytes", nixl_agent_config(backends=[]))
    assert a.name == "bytes" and a.agent.name == "bytes"
    a.close()
    with pytest.raises(nixlInvalidParamError, match="1024"):
        nixl_agent("x" * 1025, nixl_agent_config(backends=[]))


def test_unknown_names(agents):
    a = agents(nixl_agent_config(backends=["UCX"]))
    empty = nixlXferDList(_bindings.DRAM_SEG)
    # An unknown operation: a KeyError before anything else is looked at.
    with pytest.raises(KeyError, match="READ"):
        a.make_prepped_xfer("RD", 0, [], 0, [])
    with pytest.raises(KeyError, match="WRITE"):
        a.initialize_xfer("WR", empty, empty, "nobody")
    # Unknown backends: nothing about them, and one cannot be made.
    assert a.get_plugin_mem_types("UVX") == [] and a.get_plugin_params("UVX") == {}
    assert a.get_backend_mem_types("UVX") == [] and a.get_backend_params("UVX") == {}
    with pytest.raises(nixlNotFoundError, match="UVX"):
        a.create_backend("UVX")
    # An unknown memory type; NIXL's other names are not served.
    with pytest.raises(KeyError, match="V-RAM"):
        a.get_xfer_descs([(1, 2, 3)], mem_type="V-RAM")
    with pytest.raises(KeyError, match="BLK"):
        a.get_reg_descs([(1, 2, 3, "")], mem_type="BLK")
    with pytest.raises(nixlNotSupportedError, match="BLOCK"):
        a.get_reg_descs([(1, 2, 3, "")], mem_type="BLOCK")


class FakeTensor:
    """What the agent reads of a CPU ``torch.Tensor``."""

    __module__ = "torch"

    def __init__(self, addr: int, nbytes: int, contiguous: bool):
        self.addr, self.nbytes, self.contiguous = addr, nbytes, contiguous

    def data_ptr(self):
        return self.addr

    def get_device(self):
        return -1

    def is_contiguous(self):
        return self.contiguous

    def numel(self):
        return self.nbytes

    def element_size(self):
        return 1


def test_descriptors_nixl_cannot_read_give_none(agents, caplog):
    """As NIXL: logged, and None; the calls that take them raise."""
    a = agents(nixl_agent_config(backends=[]))
    xfer, reg = nixlXferDList(_bindings.DRAM_SEG), nixlRegDList(_bindings.DRAM_SEG)
    cases = [
        (a.get_xfer_descs, [(1, 2, 3, 4)], "DRAM", "descriptor 0"),
        (a.get_xfer_descs, [(1, 2, 3)], None, "memory type"),
        (a.get_xfer_descs, reg, None, "registration list"),
        (a.get_xfer_descs, np.zeros((1, 3), dtype=np.uint64), None, "memory type"),
        (a.get_xfer_descs, "garbage", "DRAM", "expected a list"),
        (a.get_xfer_descs, FakeTensor(4096, 64, False), None, "not contiguous"),
        (a.get_reg_descs, [(1, 2)], "DRAM", "descriptor 0"),
        (a.get_reg_descs, [(1, 2, 3, 4)], None, "memory type"),
        (a.get_reg_descs, xfer, None, "transfer list"),
        (a.get_reg_descs, [FakeTensor(4096, 64, True), FakeTensor(8192, 64, False)], None, "tensor 1 is not contiguous"),
    ]
    for call, descs, mem_type, words in cases:
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="kvmove.nixl"):
            assert call(descs, mem_type) is None, (descs, mem_type)
        assert words in caplog.text, (descs, caplog.text)
    assert list(a.get_xfer_descs(FakeTensor(4096, 64, True))) == [(4096, 64, 0)]
    with pytest.raises(nixlInvalidParamError, match="transfer list"):
        a.register_memory(xfer)


def test_an_empty_tag_takes_any_notification(agents):
    a, b = agents(), agents()
    a.add_remote_agent(b.get_agent_metadata())
    b.add_remote_agent(a.get_agent_metadata())
    a.send_notif(b.name, b"whatever")
    assert wait_until(lambda: b.check_remote_xfer_done(a.name, b""), timeout=10)
    assert b.notifs[a.name] == [], "the notification found is taken"


def written(a, b, expect_telemetry: bool):
    """A 128-byte WRITE from ``a`` to ``b`` in two descriptors: its
    telemetry, or the exception asking for it raised."""
    src, dst = np.arange(128, dtype=np.uint8), np.zeros(128, dtype=np.uint8)
    a.register_memory([(src.ctypes.data, 128, 0, "")], "DRAM")
    b.register_memory([(dst.ctypes.data, 128, 0, "")], "DRAM")
    a.add_remote_agent(b.get_agent_metadata())
    local = a.get_xfer_descs([(src.ctypes.data, 64, 0), (src.ctypes.data + 64, 64, 0)], "DRAM")
    remote = a.get_xfer_descs([(dst.ctypes.data, 64, 0), (dst.ctypes.data + 64, 64, 0)], "DRAM")
    h = a.initialize_xfer("WRITE", local, remote, b.name, b"telem")
    with pytest.raises(nixlNoTelemetryError if not expect_telemetry else nixlNotPostedError):
        a.get_xfer_telemetry(h)
    a.transfer(h)
    assert wait_state(a, h) == "DONE" and np.array_equal(src, dst)
    try:
        return a.get_xfer_telemetry(h)
    except nixlNoTelemetryError as e:
        return e
    finally:
        a.release_xfer_handle(h)


@pytest.mark.parametrize(
    "env, capture, on",
    [
        (None, False, False),
        (None, True, True),
        ("y", False, True),
        ("ON", False, True),
        ("enable", False, True),
        ("no", True, False),
        ("0", True, False),
        ("Disable", True, False),
    ],
)
def test_telemetry_is_on_as_nixl_decides(agents, monkeypatch, env, capture, on):
    """``NIXL_TELEMETRY_ENABLE`` when the agent is made, if set; else the
    config's ``capture_telemetry`` (NIXL 1.5.1)."""
    if env is None:
        monkeypatch.delenv("NIXL_TELEMETRY_ENABLE", raising=False)
    else:
        monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", env)
    a = agents(nixl_agent_config(capture_telemetry=capture))
    b = agents()
    # Read when the agent is made, not later.
    monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", "n" if on else "y")
    t = written(a, b, on)
    if not on:
        assert isinstance(t, nixlNoTelemetryError)
        return
    assert (t.descCount, t.totalBytes, t.backendName) == (2, 128, "UCX")
    assert abs(t.startTime / 1e6 - time.time()) < 60, "microseconds since the epoch"
    assert t.xferDuration >= t.postDuration > 0


def test_an_unknown_telemetry_setting_is_refused(monkeypatch):
    monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", "maybe")
    with pytest.raises(RuntimeError, match="NIXL_TELEMETRY_ENABLE='maybe'"):
        nixl_agent("refused", nixl_agent_config(backends=[]))


SHIM_CLIENT = """
import logging, ctypes
import nixl._bindings as bindings
import nixl._utils as utils
import nixl.logging
from nixl._api import nixl_agent, nixl_agent_config, nixlBind

import kvmove.nixl._bindings

# One module: what a program replaces in nixl._bindings, the agent calls.
assert bindings is kvmove.nixl._bindings and nixlBind is bindings
made = []
real = bindings.nixlAgent
bindings.nixlAgent = lambda name, config: made.append(name) or real(name, config)
nixl_agent("shimmed", nixl_agent_config(backends=[])).close()
assert made == ["shimmed"], made

addr = utils.malloc_passthru(64)
assert addr
utils.ba_buf(addr, 64)
assert ctypes.string_at(addr, 64) == b"\\xba" * 64
utils.free_passthru(addr)

log = nixl.logging.get_logger("_api")
assert log.name == "nixl.api" and logging.getLogger("nixl").level == logging.WARNING
log.warning("shim logging works")
log.info("not shown")
print("ok")
"""


def test_shim_bindings_utils_and_logging(tmp_path):
    env = dict(os.environ, NIXL_LOG_LEVEL="warn")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(HERE.parent / "nixl-shim"), env.get("PYTHONPATH", "")] if p)
    # From an empty directory, so `kvmove` is the installed package.
    out = subprocess.run(
        [sys.executable, "-c", SHIM_CLIENT], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1] == "ok" and "shim logging works" in lines[0] and "not shown" not in out.stdout
