"""A peer process whose KV cache is device memory (a ``kvmove.devices.FakeDevice``
the host cannot touch), for the two-process device-memory tests.

Started as ``python devpeer.py HOST NBYTES PROTOCOL API`` (API ``mooncake``
or ``nixl``): registers NBYTES of fake-device memory (device 1) through that
API, which finds the kind from the pointer (Mooncake) or is told ``"VRAM"``
with ``dev_id`` 1 (NIXL), and prints one JSON line ``{"session_id", "addr",
"len", "providers"}`` (NIXL adds ``"name"`` and ``"metadata"`` in hex).
Then it answers one command per line:

* ``digest`` -> the SHA-256 of the device memory, read through the device;
* ``fill SEED`` -> writes the pattern of SEED into the device memory, "ok";
* ``notifs N TIMEOUT`` -> (NIXL) the notifications that came, as JSON;
* ``quit`` -> closes the engine and exits.

Any host access to the device memory kills this process with SIGSEGV, so
a test that sees it answer knows its engine reached the memory through the
provider only.
"""

import hashlib
import json
import os
import sys
import time
import uuid

import numpy as np

from kvmove.devices import FakeDevice, device_providers

DEVICE = 1


def pattern(seed: int, n: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8).tobytes()


def main() -> int:
    host, nbytes, protocol, api = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dev = FakeDevice(DEVICE, nbytes)
    addr = dev.alloc(nbytes)
    info = {"addr": addr, "len": nbytes}
    try:
        if api == "mooncake":
            from kvmove.mooncake import TransferEngine

            engine = TransferEngine()
            if engine.initialize(host, "P2PHANDSHAKE", protocol, "") != 0:
                raise RuntimeError(engine.last_error())
            if engine.register_memory(addr, nbytes, "cuda:1") != 0:
                raise RuntimeError(engine.last_error())
            info["session_id"] = f"{host}:{engine.get_rpc_port()}"
        else:
            from kvmove.nixl import nixl_agent, nixl_agent_config

            os.environ["KVMOVE_NIXL_HOST"] = host
            name = f"devpeer-{uuid.uuid4()}"
            engine = nixl_agent(name, nixl_agent_config())
            engine.register_memory(engine.get_reg_descs([(addr, nbytes, DEVICE, "")], "VRAM"))
            info["session_id"] = engine.backend_options["UCX"]["session_id"]
            info["name"] = name
            info["metadata"] = engine.get_agent_metadata().hex()
    except Exception as e:  # reported to the test, which fails with it
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return 1
    info["providers"] = device_providers()
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "digest":
            print(hashlib.sha256(dev.read(addr, nbytes)).hexdigest(), flush=True)
        elif cmd[0] == "fill":
            dev.write(addr, pattern(int(cmd[1]), nbytes))
            print("ok", flush=True)
        elif cmd[0] == "notifs":
            want, limit = int(cmd[1]), time.monotonic() + float(cmd[2])
            got = []
            while len(got) < want and time.monotonic() < limit:
                for who, msgs in engine.get_new_notifs().items():
                    got.extend([who, m.decode()] for m in msgs)
                time.sleep(0.002)
            print(json.dumps(got), flush=True)
        elif cmd[0] == "quit":
            break
    if api == "mooncake":
        engine.unregister_memory(addr)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
