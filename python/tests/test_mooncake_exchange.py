"""Prefill (this process) and decode (a second Python process) exchanging
KV-cache-shaped pages over TCP through the Mooncake-compatible API."""

import hashlib

import numpy as np

from kvmove.mooncake import TransferEngine, TransferOpcode

from kvpeer import pattern

# A small model's KV cache: layers x (K, V) x pages x page size.
LAYERS, KV, PAGES, PAGE = 4, 2, 16, 4096
TOTAL = LAYERS * KV * PAGES * PAGE


def make_engine() -> TransferEngine:
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, e.last_error()
    assert e.get_rpc_port() > 0
    return e


def page_offsets():
    """(local_offset, remote_offset) per page; decode stores pages in a
    shuffled order, as a paged KV cache does."""
    n = LAYERS * KV * PAGES
    slots = np.random.default_rng(7).permutation(n)
    return [(i * PAGE, int(s) * PAGE) for i, s in enumerate(slots)]


def test_batch_write_every_byte_lands(spawn_peer):
    decode = spawn_peer(nbytes=TOTAL)
    prefill = make_engine()
    kv = pattern(1, TOTAL)
    base = kv.ctypes.data
    assert prefill.register_memory(base, kv.nbytes) == 0

    pages = page_offsets()
    ret = prefill.batch_transfer_sync_write(
        decode.session_id,
        [base + lo for lo, _ in pages],
        [decode.addr + ro for _, ro in pages],
        [PAGE] * len(pages),
    )
    assert ret == 0, prefill.last_error()

    expected = np.empty_like(kv)
    for lo, ro in pages:
        expected[ro : ro + PAGE] = kv[lo : lo + PAGE]
    assert decode.ask("digest") == hashlib.sha256(expected.tobytes()).hexdigest()

    # Reading everything back page by page gives the original bytes.
    back = np.zeros_like(kv)
    assert prefill.register_memory(back.ctypes.data, back.nbytes) == 0
    for lo, ro in pages[:8]:
        assert prefill.transfer_sync_read(decode.session_id, back.ctypes.data + lo, decode.addr + ro, PAGE) == 0
        assert np.array_equal(back[lo : lo + PAGE], kv[lo : lo + PAGE])
    assert prefill.unregister_memory(back.ctypes.data) == 0
    assert prefill.unregister_memory(base) == 0
    prefill.close()


def test_async_layer_by_layer_and_status(spawn_peer):
    decode = spawn_peer(nbytes=TOTAL)
    prefill = make_engine()
    kv = pattern(2, TOTAL)
    base = kv.ctypes.data
    assert prefill.batch_register_memory([base], [kv.nbytes]) == 0

    layer_bytes = KV * PAGES * PAGE
    ids = []
    for layer in range(LAYERS):
        off = layer * layer_bytes
        bufs = [base + off + p * PAGE for p in range(KV * PAGES)]
        peers = [decode.addr + off + p * PAGE for p in range(KV * PAGES)]
        bid = prefill.batch_transfer_async_write(decode.session_id, bufs, peers, [PAGE] * len(bufs))
        assert bid > 0, prefill.last_error()
        ids.append(bid)
    assert prefill.get_batch_transfer_status(ids) == 0
    assert decode.ask("digest") == hashlib.sha256(kv.tobytes()).hexdigest()
    # Finished ids are forgotten, as in Mooncake.
    assert prefill.get_batch_transfer_status(ids[:1]) == -1

    # Async read, polled with transfer_check_status semantics via submit_write.
    assert decode.ask("fill 9") == "ok"
    back = np.zeros(TOTAL, dtype=np.uint8)
    assert prefill.register_memory(back.ctypes.data, back.nbytes) == 0
    bid = prefill.batch_transfer_async_read(decode.session_id, [back.ctypes.data], [decode.addr], [TOTAL])
    assert bid > 0
    assert prefill.get_batch_transfer_status([bid]) == 0
    assert np.array_equal(back, pattern(9, TOTAL))

    bid = prefill.transfer_submit_write(decode.session_id, base, decode.addr, PAGE)
    assert bid > 0
    import time

    deadline = time.monotonic() + 20
    status = 0
    while status == 0 and time.monotonic() < deadline:
        status = prefill.transfer_check_status(bid)
    assert status == 1

    # Opcode variants.
    assert prefill.transfer_sync(decode.session_id, base, decode.addr, PAGE, TransferOpcode.Write) == 0
    assert prefill.batch_transfer_sync(decode.session_id, [back.ctypes.data], [decode.addr], [PAGE], TransferOpcode.Read) == 0
    assert np.array_equal(back[:PAGE], kv[:PAGE])

    assert prefill.batch_unregister_memory([base, back.ctypes.data]) == 0
    assert prefill.send_probe(decode.session_id) == 0
    prefill.close()


def test_keyword_arguments_and_defaults(spawn_peer):
    """The keyword names SGLang, vLLM and Mooncake's docs use."""
    decode = spawn_peer(nbytes=1 << 16)
    e = TransferEngine()
    assert e.initialize(local_hostname="127.0.0.1", metadata_server="P2PHANDSHAKE", protocol="tcp", device_name="") == 0
    buf = np.arange(1 << 16, dtype=np.uint32).view(np.uint8)[: 1 << 16].copy()
    assert e.register_memory(buffer_addr=buf.ctypes.data, capacity=buf.nbytes, location="cpu:0") == 0
    assert (
        e.transfer_sync_write(
            target_hostname=decode.session_id,
            buffer=buf.ctypes.data,
            peer_buffer_address=decode.addr,
            length=buf.nbytes,
        )
        == 0
    )
    assert decode.ask("digest") == hashlib.sha256(buf.tobytes()).hexdigest()
    assert (
        e.batch_transfer_sync_write(
            target_hostname=decode.session_id,
            buffers=[buf.ctypes.data],
            peer_buffer_addresses=[decode.addr],
            lengths=[16],
            transport_hint="",
        )
        == 0
    )
    assert e.get_first_buffer_address(decode.session_id) == decode.addr
    assert e.send_probe(peer_server_name=decode.session_id) == 0
    assert e.unregister_memory(buf.ctypes.data) == 0
    e.close()


def test_host_with_port_and_managed_buffers():
    a, b = TransferEngine(), TransferEngine()
    assert a.initialize("127.0.0.1:0", "P2PHANDSHAKE", "tcp", "") == 0
    # "host:port" with a fixed port: bind a free one found by the OS.
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    assert b.initialize(f"127.0.0.1:{port}", "P2PHANDSHAKE", "tcp", "") == 0
    assert b.get_rpc_port() == port
    assert b.get_session_id() == f"127.0.0.1:{port}"

    src = a.allocate_managed_buffer(8192)
    dst = b.allocate_managed_buffer(8192)
    assert src and dst
    assert a.write_bytes_to_buffer(src, b"kv" * 4096, 8192) == 0
    assert a.transfer_sync_write(f"127.0.0.1:{port}", src, dst, 8192) == 0
    assert b.read_bytes_from_buffer(dst, 8192) == b"kv" * 4096
    assert a.free_managed_buffer(src, 8192) == 0
    assert b.free_managed_buffer(dst, 8192) == 0
    a.close()
    b.close()
