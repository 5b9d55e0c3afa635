"""A Mooncake-style notification target for the tests, in its own process.

Started as ``python notifypeer.py HOST NBYTES [PROTOCOL [DEVICE]]``: it
initializes a ``kvmove.mooncake.TransferEngine``, registers an ``NBYTES``
zeroed buffer and prints one JSON line ``{"session_id", "addr", "len"}``.
Then it polls ``get_notifies()`` until ``quit`` (or end of input) arrives on
stdin. Whenever it sees a notification it hashes the whole buffer at once
and prints ``{"name", "msg", "digest", "complete"}``, ``complete`` meaning
the SHA-256 of the buffer equals ``msg``: a sender that puts the digest of
the bytes it wrote in ``msg`` learns whether every byte had landed when the
notification was delivered.
"""

import hashlib
import json
import sys
import threading
import time

import numpy as np

from kvmove.mooncake import TransferEngine, TransferNotify

#: The longest this process lives, whatever its parent does.
LIFETIME = 300.0


def main() -> int:
    host, nbytes = sys.argv[1], int(sys.argv[2])
    protocol = sys.argv[3] if len(sys.argv) > 3 else "tcp"
    device = sys.argv[4] if len(sys.argv) > 4 else ""
    engine = TransferEngine()
    if engine.initialize(host, "P2PHANDSHAKE", protocol, device) != 0:
        print(json.dumps({"error": str(engine.last_error())}), flush=True)
        return 1
    buf = np.zeros(nbytes, dtype=np.uint8)
    addr = buf.ctypes.data
    if engine.register_memory(addr, buf.nbytes) != 0:
        print(json.dumps({"error": str(engine.last_error())}), flush=True)
        return 1
    host_only = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    session_id = f"{host_only}:{engine.get_rpc_port()}"
    print(json.dumps({"session_id": session_id, "addr": addr, "len": buf.nbytes}), flush=True)

    stop = threading.Event()

    def watch_stdin() -> None:
        for line in sys.stdin:
            if line.strip() == "quit":
                break
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    end = time.monotonic() + LIFETIME
    while not stop.is_set() and time.monotonic() < end:
        notes = engine.get_notifies()
        for n in notes:
            assert isinstance(n, TransferNotify), type(n)
            digest = hashlib.sha256(buf.tobytes()).hexdigest()
            print(
                json.dumps({"name": n.name, "msg": n.msg, "digest": digest, "complete": digest == n.msg}),
                flush=True,
            )
        if not notes:
            time.sleep(0.0005)
    engine.unregister_memory(addr)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
