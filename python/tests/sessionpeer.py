"""A decode-like peer with the Pythonic API for the session tests, in its
own process, driven over stdin/stdout.

Started as ``python sessionpeer.py HOST NBYTES [PROTOCOL [DEVICE]]``: it
starts a ``kvmove.Engine``, registers an ``NBYTES`` zeroed buffer and prints
one JSON line ``{"session_id", "addr", "len"}``. Then it answers one command
per line:

* ``grant PEER ID OFFSET LENGTH [DEADLINE]`` -> grants ``PEER`` the buffer's
  ``OFFSET .. OFFSET + LENGTH`` for session ``ID``; ``ok`` or ``error KIND``;
* ``scattered PEER ID N BLOCK`` -> grants ``N`` blocks of ``BLOCK`` bytes
  with a block-sized gap after each, in descending address order (a KV
  cache's freed blocks), for session ``ID``; ``ok`` or ``error KIND``;
* ``state ID`` -> the receiving session's state now;
* ``wait ID TIMEOUT`` -> its final state, or ``timeout``;
* ``cancel ID`` -> cancels it; the final state;
* ``digest OFFSET LENGTH`` -> the SHA-256 of that part of the buffer;
* ``notify PEER TEXT`` -> sends a plain notification; ``ok``;
* ``notes TIMEOUT`` -> waits up to TIMEOUT for notifications, prints them as
  a JSON list of ``[peer, text]``;
* ``quit`` -> closes the engine and exits.
"""

import hashlib
import json
import sys

import numpy as np

import kvmove


def main() -> int:
    host, nbytes = sys.argv[1], int(sys.argv[2])
    protocol = sys.argv[3] if len(sys.argv) > 3 else "tcp"
    device = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] else None
    try:
        engine = kvmove.Engine(protocol=protocol, host=host, device=device)
        buf = np.zeros(nbytes, dtype=np.uint8)
        region = engine.register(buf)
    except kvmove.TransferError as e:
        print(json.dumps({"error": str(e)}), flush=True)
        return 1
    print(json.dumps({"session_id": engine.session_id, "addr": region.addr, "len": region.length}), flush=True)
    sessions = {}

    def answer(cmd):
        op = cmd[0]
        if op == "grant":
            peer, sid, off, length = cmd[1], int(cmd[2]), int(cmd[3]), int(cmd[4])
            deadline = float(cmd[5]) if len(cmd) > 5 else 30.0
            sessions[sid] = engine.receive(peer, sid, [(region.addr + off, length)], deadline=deadline)
            return "ok"
        if op == "scattered":
            peer, sid, n, block = cmd[1], int(cmd[2]), int(cmd[3]), int(cmd[4])
            ranges = [(region.addr + 2 * i * block, block) for i in reversed(range(n))]
            sessions[sid] = engine.receive(peer, sid, ranges, deadline=30.0)
            return "ok"
        if op == "state":
            return sessions[int(cmd[1])].state
        if op == "wait":
            return sessions[int(cmd[1])].wait(timeout=float(cmd[2])) or "timeout"
        if op == "cancel":
            return sessions[int(cmd[1])].cancel()
        if op == "digest":
            off, length = int(cmd[1]), int(cmd[2])
            return hashlib.sha256(buf[off : off + length].tobytes()).hexdigest()
        if op == "notify":
            engine.notify(cmd[1], " ".join(cmd[2:]).encode())
            return "ok"
        if op == "notes":
            engine.wait_notification(timeout=float(cmd[1]))
            return json.dumps([[n.peer, n.msg.decode()] for n in engine.notifications()])
        return f"unknown command {op}"

    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "quit":
            break
        try:
            out = answer(cmd)
        except kvmove.TransferError as e:
            out = f"error {e.kind}"
        print(out, flush=True)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
