"""A decode-like peer process for the tests, driven over stdin/stdout.

Started as ``python kvpeer.py HOST[:PORT] NBYTES [PROTOCOL [DEVICE]]``: it
initializes a Mooncake-style ``TransferEngine`` (default over TCP), registers an ``NBYTES`` numpy
buffer, and prints one JSON line ``{"session_id", "addr", "len"}``. Then it
answers one command per line:

* ``digest`` -> the SHA-256 of the whole buffer;
* ``fill SEED`` -> fills the buffer with the pattern of SEED, prints "ok";
* ``quit`` -> closes the engine and exits.
"""

import hashlib
import json
import sys

import numpy as np

from kvmove.mooncake import TransferEngine


def pattern(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


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
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "digest":
            print(hashlib.sha256(buf.tobytes()).hexdigest(), flush=True)
        elif cmd[0] == "fill":
            buf[:] = pattern(int(cmd[1]), buf.nbytes)
            print("ok", flush=True)
        elif cmd[0] == "quit":
            break
    engine.unregister_memory(addr)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
