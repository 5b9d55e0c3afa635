"""A NIXL agent in its own process for the two-process tests, driven over
stdin/stdout.

Started as ``python nixlpeer.py HOST NBYTES [PROTOCOL [DEVICE]]``: creates a
``kvmove.nixl.nixl_agent`` (backend "UCX" over TCP, or "RDMA" on DEVICE),
registers an NBYTES buffer as ``REGIONS`` equal regions (a KV cache: K and V
of each layer), and prints one JSON line ``{"session_id", "addr", "len",
"name", "metadata" (hex), "regions"}``. Then it answers one command per
line:

* ``fill SEED`` -> fills the buffer with the pattern of SEED, prints "ok";
* ``digest`` -> the SHA-256 of the whole buffer;
* ``notifs N TIMEOUT`` -> waits until N notifications came (or TIMEOUT
  seconds passed) and prints them as JSON ``[[agent, message], ...]``;
* ``watch N TIMEOUT SEED MAP`` -> the receiving side of SGLang's order:
  prefill writes layer L's pages and notifies ``{room}_kv_{L}_{last}``.
  For each notification, at the moment it is seen, checks layer L's pages
  (MAP: ``src:dst`` page pairs, comma-separated) against the sender's
  pattern SEED; prints ``[[agent, message, matched], ...]`` after N;
* ``dereg I`` -> deregisters region I (its metadata goes stale), "ok";
* ``quit`` -> closes the agent and exits.
"""

import hashlib
import json
import sys
import time
import uuid

import numpy as np

from kvmove.nixl import nixl_agent, nixl_agent_config

REGIONS = 8  # 4 layers, K and V
PAGE = 4096


def pattern(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


def main() -> int:
    host, nbytes = sys.argv[1], int(sys.argv[2])
    protocol = sys.argv[3] if len(sys.argv) > 3 else "tcp"
    device = sys.argv[4] if len(sys.argv) > 4 else ""
    import os

    os.environ["KVMOVE_NIXL_HOST"] = host
    name = f"peer-{uuid.uuid4()}"
    try:
        if protocol == "rdma":
            agent = nixl_agent(name, nixl_agent_config(backends=[]))
            agent.create_backend("RDMA", {"device": device})
        else:
            agent = nixl_agent(name, nixl_agent_config(num_threads=4, capture_telemetry=True))
        buf = np.zeros(nbytes, dtype=np.uint8)
        region = nbytes // REGIONS
        base = buf.ctypes.data
        caches = [(base + i * region, region, 0, "") for i in range(REGIONS)]
        regs = agent.get_reg_descs(caches, "DRAM")
        agent.register_memory(regs, backends=list(agent.backends))
    except Exception as e:  # reported to the test, which fails with it
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return 1
    info = {
        "session_id": agent.backend_options[next(iter(agent.backends))]["session_id"],
        "addr": base,
        "len": nbytes,
        "name": name,
        "metadata": agent.get_agent_metadata().hex(),
        "regions": [base + i * region for i in range(REGIONS)],
    }
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "fill":
            buf[:] = pattern(int(cmd[1]), nbytes)
            print("ok", flush=True)
        elif cmd[0] == "digest":
            print(hashlib.sha256(buf.tobytes()).hexdigest(), flush=True)
        elif cmd[0] == "notifs":
            want, limit = int(cmd[1]), time.monotonic() + float(cmd[2])
            got = []
            while len(got) < want and time.monotonic() < limit:
                for who, msgs in agent.get_new_notifs().items():
                    got.extend([who, m.decode()] for m in msgs)
                time.sleep(0.002)
            print(json.dumps(got), flush=True)
        elif cmd[0] == "watch":
            want, limit = int(cmd[1]), time.monotonic() + float(cmd[2])
            src = pattern(int(cmd[3]), nbytes)
            pairs = [tuple(int(x) for x in p.split(":")) for p in cmd[4].split(",")]
            pages = region // PAGE
            got = []
            while len(got) < want and time.monotonic() < limit:
                for who, msgs in agent.get_new_notifs().items():
                    for m in msgs:
                        text = m.decode()
                        layer = int(text.split("_")[2])
                        ok = True
                        for r in (2 * layer, 2 * layer + 1):
                            for s, d in pairs:
                                a, b = r * pages + s, r * pages + d
                                ok &= bool(np.array_equal(buf[b * PAGE : (b + 1) * PAGE], src[a * PAGE : (a + 1) * PAGE]))
                        got.append([who, text, ok])
                time.sleep(0.0005)
            print(json.dumps(got), flush=True)
        elif cmd[0] == "dereg":
            i = int(cmd[1])
            agent.deregister_memory(agent.get_reg_descs([(base + i * region, region, 0, "")], "DRAM"))
            print("ok", flush=True)
        elif cmd[0] == "quit":
            break
    agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
