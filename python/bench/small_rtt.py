"""One 4 KiB write at a time from Python (issue: small transfers from
Python with no thread hop).

    python bench/small_rtt.py [--rounds 3] [--n 2000]

For each API (``kvmove.Engine``'s ``Session.write``, the same engine's
``Session.submit`` then ``Batch.wait``, kvmove's Mooncake API) a target process
registers 1 MiB and an initiator process writes one 4 KiB page ``n`` times,
each from submit to done, on loopback TCP. Reports p50 / p99 in
microseconds and the context switches per write of each process (all its
threads: ``getrusage`` in the initiator, ``/proc/PID/task/*/status`` for
the target). The APIs alternate within each round. Extra environment
(``KVMOVE_POLICY``, ...) reaches both processes.

On a VM whose idle vCPUs halt, the result depends on where the threads
run: a hand-off to a thread on the other (halted) vCPU costs tens of
microseconds. ``taskset -c 0 python bench/small_rtt.py`` keeps every
thread of both processes on one vCPU (the floor of this path).
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

# No linear algebra here: numpy's BLAS worker threads would only spin on
# the CPUs the engines share (seen in profiles); the processes started from
# this file inherit the setting.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from lineproc import context_switches  # noqa: E402

SIZE = 1 << 20
PAGE = 4096


def side(api):
    buf = np.zeros(SIZE, dtype=np.uint8)
    if api in ("engine", "batch"):
        import kvmove

        e = kvmove.Engine()
        r = e.register(buf)
        return e, {"name": e.session_id, "addr": r.addr}, buf
    from kvmove import mooncake

    te = mooncake.TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert te.register_memory(buf.ctypes.data, SIZE) == 0
    return te, {"name": te.get_session_id(), "addr": buf.ctypes.data}, buf


def serve(api, role):
    obj, info, buf = side(api)
    print(json.dumps({"ready": info, "pid": os.getpid()}), flush=True)
    cmd = json.loads(sys.stdin.readline())
    if role == "target":
        sys.stdin.readline()  # until told to quit
        os._exit(0)
    n, peer, raddr = cmd["n"], cmd["name"], cmd["addr"]
    base = buf.ctypes.data
    if api == "engine":
        s = obj.connect(peer)

        def one():
            s.write(base, raddr, PAGE)
    elif api == "batch":
        s = obj.connect(peer)

        def one():
            s.submit([(base, raddr, PAGE)]).wait()
    else:

        def one():
            if obj.transfer_sync_write(peer, base, raddr, PAGE) != 0:
                raise RuntimeError("write failed")

    for _ in range(200):
        one()
    lat = []
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(n):
        t = time.perf_counter()
        one()
        lat.append(time.perf_counter() - t)
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    cs = (ru1.ru_nvcsw - ru0.ru_nvcsw) + (ru1.ru_nivcsw - ru0.ru_nivcsw)
    lat.sort()
    print(json.dumps({"p50": lat[n // 2] * 1e6, "p99": lat[int(n * 0.99)] * 1e6, "ctx": cs / n}), flush=True)
    os._exit(0)


def proc(api, role):
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", api, role], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)  # fmt: skip
    return p, json.loads(p.stdout.readline())


def run(api, n):
    t, tr = proc(api, "target")
    i, _ = proc(api, "init")
    c0 = context_switches(tr["pid"])
    i.stdin.write(json.dumps({"n": n, **tr["ready"]}) + "\n")
    i.stdin.flush()
    out = json.loads(i.stdout.readline())
    out["target_ctx"] = (context_switches(tr["pid"]) - c0) / (n + 200)
    i.wait()
    t.stdin.write("{}\n{}\n")
    t.stdin.flush()
    t.wait()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n", type=int, default=2000)
    a = ap.parse_args()
    if a.serve:
        serve(*a.serve)
        return
    print(f"load: {open('/proc/loadavg').read().split()[:3]}")
    res = {}
    for r in range(a.rounds):
        for api in ("engine", "batch", "mooncake"):
            o = run(api, a.n)
            res.setdefault(api, []).append(o)
            print(f"round {r}: {api:8s} p50 {o['p50']:6.1f} p99 {o['p99']:7.1f} us, "
                  f"ctx switches per write: initiator {o['ctx']:.2f}, target {o['target_ctx']:.2f}", flush=True)  # fmt: skip
    print("medians over rounds:")
    for api, os_ in res.items():
        med = {k: statistics.median(o[k] for o in os_) for k in ("p50", "p99", "ctx", "target_ctx")}
        print(f"  {api:8s} p50 {med['p50']:6.1f} p99 {med['p99']:7.1f} us, ctx/write "
              f"initiator {med['ctx']:.2f} target {med['target_ctx']:.2f}")  # fmt: skip
    print(f"load: {open('/proc/loadavg').read().split()[:3]}")


if __name__ == "__main__":
    main()
