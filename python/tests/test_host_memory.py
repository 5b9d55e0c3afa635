"""Memory this process cannot read (GPU memory, as the serving engines'
connectors register by default; unmapped or PROT_NONE pages) is refused at
registration with a clear error, by every API, and nothing is registered
(issue 16). Without the check such a range would be registered and the
first transfer from it would crash the process."""

import ctypes
import logging
import mmap
import re
import time

import numpy as np
import pytest

import kvmove
from kvmove.nixl import nixl_agent, nixlNotSupportedError

PAGE = mmap.PAGESIZE
PROT_NONE = getattr(mmap, "PROT_NONE", 0)  # mmap.PROT_NONE is new in Python 3.13
MESSAGE = "not host memory this process can read (GPU memory?)"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

# Addresses never mapped in a user process: below mmap_min_addr, and the
# kernel's half of the address space.
UNMAPPED = [0x1000, 0xFFFF_8000_0000_0000]


class Pages:
    """`n` anonymous pages; the ones in `unreadable` are PROT_NONE."""

    def __init__(self, n: int, unreadable=()):
        self.len = n * PAGE
        addr = _libc.mmap(None, self.len, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        self.addr = addr
        for i in unreadable:
            assert _libc.mprotect(addr + i * PAGE, PAGE, PROT_NONE) == 0, ctypes.get_errno()

    def close(self):
        _libc.munmap(self.addr, self.len)


def registered(e) -> int:
    return dict(e.stats())["registered"]


def test_prot_none_memory_from_python_mmap_is_refused(mooncake, caplog):
    m = mmap.mmap(-1, 2 * PAGE, prot=PROT_NONE)
    view = np.frombuffer(m, dtype=np.uint8)  # the address, without touching the bytes
    addr = view.ctypes.data
    with caplog.at_level(logging.WARNING, logger="kvmove"):
        assert mooncake.register_memory(addr, 2 * PAGE) == -1
    err = mooncake.last_error()
    assert err.kind == "unsupported" and MESSAGE in str(err), err
    assert re.search(r"installed: (none|cuda)\)", str(err)), err  # no device provider claimed it either
    assert registered(mooncake) == 0
    # Seen even by a caller that ignores the return code (SGLang does).
    warned = [r.getMessage() for r in caplog.records if r.name == "kvmove" and r.levelno == logging.WARNING]
    assert any("register_memory refused" in w and MESSAGE in w for w in warned), warned
    del view
    m.close()


def test_mooncake_refuses_unreadable_ranges_and_registers_nothing(mooncake):
    good = Pages(2)
    none = Pages(2, unreadable=[0, 1])
    tail = Pages(2, unreadable=[1])  # first byte readable, last byte not
    try:
        for addr, n in [(none.addr, none.len), (tail.addr, tail.len)] + [(a, 4096) for a in UNMAPPED]:
            assert mooncake.register_memory(addr, n) == -1, hex(addr)
            err = mooncake.last_error()
            assert err.kind == "unsupported" and MESSAGE in str(err), err
        assert registered(mooncake) == 0
        # The readable first page of `tail` alone is fine.
        assert mooncake.register_memory(tail.addr, PAGE) == 0, mooncake.last_error()
        assert mooncake.unregister_memory(tail.addr) == 0

        # A batch is all or nothing: the readable range is not registered.
        assert mooncake.batch_register_memory([good.addr, none.addr], [good.len, none.len]) == -1
        assert mooncake.last_error().kind == "unsupported"
        assert registered(mooncake) == 0
        assert mooncake.batch_register_memory([good.addr], [good.len]) == 0, mooncake.last_error()
        assert registered(mooncake) == 1

        # Still alive and working: a loopback write between good pages.
        me = mooncake.get_session_id()
        ctypes.memset(good.addr, 0x5A, PAGE)
        assert mooncake.transfer_sync_write(me, good.addr, good.addr + PAGE, PAGE) == 0, mooncake.last_error()
        assert ctypes.string_at(good.addr + PAGE, PAGE) == b"\x5a" * PAGE
        assert mooncake.batch_unregister_memory([good.addr]) == 0
        # Engine-owned buffers pass the check.
        managed = mooncake.allocate_managed_buffer(1 << 20)
        assert managed != 0, mooncake.last_error()
        assert mooncake.free_managed_buffer(managed, 1 << 20) == 0
    finally:
        for p in (good, none, tail):
            p.close()


def test_nixl_register_memory_refuses_unreadable_memory():
    good, bad = Pages(1), Pages(1, unreadable=[0])
    agent = nixl_agent("host-only")
    try:
        with pytest.raises(nixlNotSupportedError, match=r"GPU memory\?"):
            agent.register_memory([(bad.addr, bad.len, 0, "")], "DRAM")
        # All or nothing: the readable descriptor before it is unregistered.
        with pytest.raises(nixlNotSupportedError):
            agent.register_memory([(good.addr, good.len, 0, ""), (bad.addr, bad.len, 0, "")], "DRAM")
        assert agent._engine.stats()["registered"] == 0
        agent.register_memory([(good.addr, good.len, 0, "")], "DRAM")
        assert agent._engine.stats()["registered"] == 1
    finally:
        agent.close()
        good.close()
        bad.close()


def test_pythonic_register_address_refuses_unreadable_memory():
    bad = Pages(1, unreadable=[0])
    try:
        with kvmove.Engine() as eng:
            for addr in [bad.addr, *UNMAPPED]:
                with pytest.raises(kvmove.TransferError, match=r"nor device memory of an installed device provider") as info:
                    eng.register_address(addr, PAGE)
                assert info.value.kind == "unsupported"
                assert not info.value.is_transient
            assert eng.stats()["registered"] == 0
            buf = bytearray(PAGE)
            with eng.register(buf):
                assert eng.stats()["registered"] == 1
    finally:
        bad.close()


def test_repeated_registrations_stay_exact(mooncake):
    """Register + unregister of one page, many times, and as many refused
    registrations: every answer is exact (the check is two one-byte
    syscalls; the cost per round is printed, not asserted: see the note)."""
    p = Pages(1)
    try:
        rounds = 2000
        t0 = time.perf_counter()
        for _ in range(rounds):
            assert mooncake.register_memory(p.addr, PAGE) == 0
            assert mooncake.unregister_memory(p.addr) == 0
        per = (time.perf_counter() - t0) / rounds
        t0 = time.perf_counter()
        for _ in range(rounds):
            assert mooncake.register_memory(UNMAPPED[0], PAGE) == -1
        refused = (time.perf_counter() - t0) / rounds
        print(f"register+unregister: {per * 1e6:.1f} us per round; a refused registration: {refused * 1e6:.1f} us")
    finally:
        p.close()
