"""kvmove next to the engines it replaces, on one host (issue: peers side by side).

    python bench/peers.py [--rounds N] [--systems a,b,...] [--json FILE]
    python bench/peers.py --rtt PAIRS [--systems a,b,...]

Each *system* runs a target process (it registers a 64 MiB host buffer) and
an initiator process (the same size), both started from this file
(``--serve SYSTEM``), on loopback. The initiator moves KV-shaped batches
into and out of the target and times them:

* ``1MiBx64``, ``64KiBx256``, ``4KiBx1024``: one batch of equal pages,
  written (and read), GB/s over the batch from submit to done (best of a
  few repetitions, after one warm-up); the bytes are verified once per
  configuration (a digest of the target's buffer after the write, of the
  initiator's after the read). The Python lists of addresses each API
  takes are built before the clock starts, as engine benchmarks (nixlbench,
  Mooncake's) prepare their descriptors; every call into the API is timed,
  NIXL's ``get_xfer_descs`` and ``initialize_xfer`` included. Building the
  lists is timed on its own (``prep us write 4KiBx1024``: the 1024 tuples
  or ints each API needs, two lists for NIXL, three for Mooncake);
* ``4KiB rtt``: one 4 KiB write from submit to done, p50 / p99 over 300;
  ``read rtt``: the same with one 4 KiB read;
* CPU seconds of both processes over the timed part (utime + stime).

Systems:

* ``mooncake``: Mooncake's transfer engine from PyPI
  (``mooncake-transfer-engine-non-cuda``), TCP transport, P2PHANDSHAKE;
* ``kvmove-mooncake``: ``kvmove.mooncake.TransferEngine`` (kvmove's default
  path: on one host, same-host copies, the bytes copied from process to
  process, requests and answers over TCP);
* ``nixl``: NIXL from PyPI (``nixl-cu12``, installed ``--no-deps``), UCX
  backend with UCX's own transport choice: on one host that is CMA (a
  kernel copy between the two processes), not a network;
* ``nixl-tcp``: the same with ``UCX_TLS=tcp`` (a network transport);
* ``kvmove-nixl``: ``kvmove.nixl.nixl_agent`` (kvmove's default path);
* ``kvmove``: ``kvmove.Engine`` (kvmove's own API, default path);
* ``kvmove-tcp``: ``kvmove.Engine`` with same-host copies off
  (``[backend.tcp] same_host = false``): every byte through the sockets, as
  between two hosts.

``--rtt PAIRS`` runs only the single write, from PAIRS fresh process pairs
per system alternated pair by pair, and counts the context switches per
write of both processes (every thread). A system named ``NAME@DIR`` runs
NAME with ``DIR`` first on ``PYTHONPATH``: another build of kvmove, its
wheel unpacked there (``--systems kvmove-tcp@/tmp/before,kvmove-tcp``
compares two builds).

``--interleave`` starts every named system at once and alternates them
batch by batch instead (no bytes verified, no rtt): the way to compare two
APIs over one engine, e.g. ``--interleave --systems kvmove-nixl,kvmove``,
on a machine whose speed drifts between rounds. (Not with NIXL's UCX
systems: their idle processes keep CPUs busy.)

Rounds alternate the systems (each round runs every system once, in
order); the table gives min / median / max over the rounds and, per round,
the ratio of each kvmove API to its peer: same-host path to same-host
path (``kvmove / nixl``, ``kvmove-nixl / nixl``), network path to network
path (``kvmove-tcp / nixl-tcp``, ``kvmove-tcp / mooncake``), and each API's
default to its peer's (``kvmove-mooncake / mooncake``: Mooncake's TCP
transport has no same-host path). ``scripts/peer-bench.sh``
installs the peers into a virtualenv of their own and runs this with the
kvmove wheel.
"""

import argparse
import base64
import hashlib
import json
import os
import statistics
import sys
import time

# No linear algebra here: numpy's BLAS worker threads would only spin on
# the CPUs the engines share (seen in profiles); the processes started from
# this file inherit the setting.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from lineproc import LineProc, context_switches

SIZE = 64 << 20
WORKLOADS = [("1MiBx64", 1 << 20, 64), ("64KiBx256", 64 << 10, 256), ("4KiBx1024", 4 << 10, 1024)]
REPEAT = 20
RTT_N = 300
SYSTEMS = ["mooncake", "kvmove-mooncake", "nixl-tcp", "nixl", "kvmove-nixl", "kvmove", "kvmove-tcp"]


def pattern(seed, n):
    return (np.arange(n, dtype=np.uint64) * 2654435761 + seed * 97).astype(np.uint8)


def digest(buf):
    return hashlib.sha256(memoryview(buf)).hexdigest()


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- the two APIs, behind one small interface --------------------------------


class Mooncake:
    def __init__(self, module):
        self.te = module.TransferEngine()
        rc = self.te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise RuntimeError(f"initialize: {rc}")
        self.buf = np.zeros(SIZE, dtype=np.uint8)
        if self.te.register_memory(self.buf.ctypes.data, SIZE) != 0:
            raise RuntimeError("register_memory failed")

    def info(self):
        return {"name": f"127.0.0.1:{self.te.get_rpc_port()}", "addr": self.buf.ctypes.data}

    def connect(self, info):
        self.peer, self.raddr = info["name"], info["addr"]

    def prepare(self, op, page, n):
        base = self.buf.ctypes.data
        locs = [base + i * page for i in range(n)]
        rems = [self.raddr + i * page for i in range(n)]
        lens = [page] * n
        f = self.te.batch_transfer_sync_write if op == "write" else self.te.batch_transfer_sync_read

        def run():
            if f(self.peer, locs, rems, lens) != 0:
                raise RuntimeError(f"batch {op} failed")

        return run

    def close(self):
        pass


class Nixl:
    def __init__(self, module):
        self.api = module
        name = f"bench-{os.getpid()}"
        self.agent = module.nixl_agent(name, module.nixl_agent_config(backends=["UCX"]))
        self.buf = np.zeros(SIZE, dtype=np.uint8)
        self.reg = self.agent.register_memory([(self.buf.ctypes.data, SIZE, 0, "")], "DRAM")

    def info(self):
        meta = self.agent.get_agent_metadata()
        descs = self.agent.get_serialized_descs(self.reg.trim())
        return {
            "meta": base64.b64encode(meta).decode(),
            "descs": base64.b64encode(descs).decode(),
            "addr": self.buf.ctypes.data,
        }

    def connect(self, info):
        self.remote = self.agent.add_remote_agent(base64.b64decode(info["meta"]))
        if isinstance(self.remote, bytes):
            self.remote = self.remote.decode()
        self.raddr = info["addr"]
        # Wait until the connection is usable (NIXL connects lazily).
        self.agent.make_connection(self.remote)

    def prepare(self, op, page, n):
        base, ag = self.buf.ctypes.data, self.agent
        mine = [(base + i * page, page, 0) for i in range(n)]
        theirs = [(self.raddr + i * page, page, 0) for i in range(n)]
        kind = "WRITE" if op == "write" else "READ"

        def run():
            # The descriptor lists and the handle are made per batch, as a
            # caller with fresh addresses makes them.
            local, remote = ag.get_xfer_descs(mine, "DRAM"), ag.get_xfer_descs(theirs, "DRAM")
            h = ag.initialize_xfer(kind, local, remote, self.remote, b"")
            state = ag.transfer(h)
            while state not in ("DONE", "ERR"):
                state = ag.check_xfer_state(h)
            ag.release_xfer_handle(h)
            if state != "DONE":
                raise RuntimeError(f"{op}: {state}")

        return run

    def close(self):
        pass


class Engine:
    """``kvmove.Engine``: kvmove's own Python API."""

    def __init__(self, config=None):
        import kvmove

        self.e = kvmove.Engine(config=config)
        self.buf = np.zeros(SIZE, dtype=np.uint8)
        self.region = self.e.register(self.buf)

    def info(self):
        return {"name": self.e.session_id, "addr": self.region.addr}

    def connect(self, info):
        self.s = self.e.connect(info["name"])
        self.raddr = info["addr"]

    def prepare(self, op, page, n):
        base = self.region.addr
        ops = [(base + i * page, self.raddr + i * page, page) for i in range(n)]
        f = self.s.write_many if op == "write" else self.s.read_many
        return lambda: f(ops)

    def close(self):
        self.e.close()


def make(system):
    if system == "mooncake":
        from mooncake import engine

        return Mooncake(engine)
    if system == "kvmove-mooncake":
        from kvmove import mooncake

        return Mooncake(mooncake)
    if system in ("nixl", "nixl-tcp"):
        try:
            from nixl import _api
        except ImportError:
            from nixl_cu12 import _api
        return Nixl(_api)
    if system == "kvmove-nixl":
        from kvmove import nixl

        return Nixl(nixl)
    if system == "kvmove":
        return Engine()
    if system == "kvmove-tcp":
        return Engine(config="[backend]\nkind = \"tcp\"\n[backend.tcp]\nsame_host = false\n")
    raise SystemExit(f"unknown system {system}")


# ---- a peer process ------------------------------------------------------------


def serve(system):
    """One side, driven one JSON command per line on stdin."""
    e = make(system)
    out = sys.stdout

    def say(obj):
        out.write(json.dumps(obj) + "\n")
        out.flush()

    say({"ready": e.info()})
    ready = None  # the batch "prep" made ready, for "once"
    for line in sys.stdin:
        cmd = json.loads(line)
        c = cmd["cmd"]
        if c == "connect":
            e.connect(cmd["info"])
            say({"ok": True})
        elif c == "fill":
            e.buf[:] = pattern(cmd["seed"], SIZE)
            say({"ok": True})
        elif c == "zero":
            e.buf[:] = 0
            say({"ok": True})
        elif c == "digest":
            say({"digest": digest(e.buf[: cmd["len"]])})
        elif c == "batch":
            # The argument lists (addresses as Python ints) are built before
            # the clock starts, as a benchmark of the engine prepares them;
            # building them is timed on its own ("prep").
            prep = None
            for _ in range(REPEAT):
                t = time.perf_counter()
                run = e.prepare(cmd["op"], cmd["page"], cmd["n"])
                dt = time.perf_counter() - t
                prep = dt if prep is None else min(prep, dt)
            run()  # warm-up
            best = None
            for _ in range(REPEAT):
                t = time.perf_counter()
                run()
                dt = time.perf_counter() - t
                best = dt if best is None else min(best, dt)
            say({"seconds": best, "prep": prep})
        elif c == "prep":
            # --interleave: the batch made ready (and run once, a warm-up),
            # then timed one run at a time ("once").
            ready = e.prepare(cmd["op"], cmd["page"], cmd["n"])
            ready()
            say({"ok": True})
        elif c == "once":
            if ready is None:
                raise SystemExit("'once' before 'prep'")
            t = time.perf_counter()
            ready()
            say({"seconds": time.perf_counter() - t})
        elif c == "rtt":
            lat = []
            run = e.prepare(cmd.get("op", "write"), 4096, 1)
            for i in range(RTT_N + 20):
                t = time.perf_counter()
                run()
                if i >= 20:
                    lat.append(time.perf_counter() - t)
            lat.sort()
            say({"p50_us": lat[len(lat) // 2] * 1e6, "p99_us": lat[int(len(lat) * 0.99)] * 1e6})
        elif c == "quit":
            e.close()
            say({"ok": True})
            return


def Proc(system):
    """The side of ``system``; ``NAME@DIR`` is NAME with ``DIR`` first on
    ``PYTHONPATH`` (another build of kvmove: its wheel unpacked there)."""
    env = dict(os.environ)
    name, _, path = system.partition("@")
    if path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH")) if p)
    if name == "nixl-tcp":
        env["UCX_TLS"] = "tcp"
    return LineProc([os.path.abspath(__file__), "--serve", name], env=env)


def rtt_pairs(systems, pairs):
    """Only the single 4 KiB write, each time from a fresh target and
    initiator (no batches before it), the systems alternated pair by pair:
    p50 / p99 and context switches per write (both processes, every
    thread), then the median over the pairs."""
    got = {s: [] for s in systems}
    for p in range(pairs):
        for s in systems:
            target, init = Proc(s), Proc(s)
            try:
                init.ask(cmd="connect", info=target.ready)
                before = context_switches(target.p.pid) + context_switches(init.p.pid)
                r = init.ask(cmd="rtt")
                per = (context_switches(target.p.pid) + context_switches(init.p.pid) - before) / (RTT_N + 20)
            finally:
                init.stop()
                target.stop()
            got[s].append((r["p50_us"], r["p99_us"], per))
            print(f"pair {p + 1} {s}: p50 {r['p50_us']:.1f} us, p99 {r['p99_us']:.1f} us, {per:.2f} switches/write", flush=True)
    print("\n| system | p50 us, median (min-max) | p99 us, median | switches per write, median |")
    print("|---|---|---|---|")
    for s, v in got.items():
        p50 = [x[0] for x in v]
        print(f"| {s} | {statistics.median(p50):.1f} ({min(p50):.1f}-{max(p50):.1f}) | "
              f"{statistics.median(x[1] for x in v):.1f} | {statistics.median(x[2] for x in v):.2f} |")  # fmt: skip


def run_system(system, verify):
    """One system, every workload: {"write 1MiBx64": GB/s, ..., "rtt p50": us, "cpu": s}."""
    target, init = Proc(system), Proc(system)
    try:
        init.ask(cmd="connect", info=target.ready)
        res = {}
        cpu0 = cpu_seconds(target.p.pid) + cpu_seconds(init.p.pid)
        for name, page, n in WORKLOADS:
            nbytes = page * n
            for op in ("write", "read"):
                if verify:
                    src, dst = (init, target) if op == "write" else (target, init)
                    src.ask(cmd="fill", seed=len(res) + 3)
                    dst.ask(cmd="zero")
                timed = init.ask(cmd="batch", op=op, page=page, n=n)
                res[f"{op} {name}"] = nbytes / timed["seconds"] / 1e9
                if op == "write" and name == WORKLOADS[-1][0]:
                    res[f"prep us {op} {name}"] = timed["prep"] * 1e6
                if verify:
                    want = src.ask(cmd="digest", len=nbytes)["digest"]
                    got = dst.ask(cmd="digest", len=nbytes)["digest"]
                    if want != got:
                        raise RuntimeError(f"{system}: {op} {name} moved wrong bytes")
        r = init.ask(cmd="rtt")
        res["rtt p50 us"], res["rtt p99 us"] = r["p50_us"], r["p99_us"]
        r = init.ask(cmd="rtt", op="read")
        res["read rtt p50 us"], res["read rtt p99 us"] = r["p50_us"], r["p99_us"]
        res["cpu s"] = cpu_seconds(target.p.pid) + cpu_seconds(init.p.pid) - cpu0
        return res
    finally:
        init.stop()
        target.stop()


def interleave(systems, rounds):
    """Every system's two processes up at once; per workload, one batch of
    each system in turn, ``rounds`` x ``REPEAT`` times, so a change in the
    machine's speed (other guests, frequency) falls on all of them alike.
    Prints best and median GB/s and the ratio of each system's median to the
    last system's, taken batch by batch."""
    procs = {}
    try:
        for s in systems:
            target, init = Proc(s), Proc(s)
            procs[s] = (target, init)
            init.ask(cmd="connect", info=target.ready)
        print("\n| workload | " + " | ".join(f"{s} best / median GB/s" for s in systems) + " | median ratio to " + systems[-1] + " |")
        print("|---|" + "---|" * (len(systems) + 1))
        for name, page, n in WORKLOADS:
            for op in ("write", "read"):
                for s in systems:
                    procs[s][1].ask(cmd="prep", op=op, page=page, n=n)
                secs = {s: [] for s in systems}
                for _ in range(rounds * REPEAT):
                    for s in systems:
                        secs[s].append(procs[s][1].ask(cmd="once")["seconds"])
                gbs = {s: page * n / statistics.median(v) / 1e9 for s, v in secs.items()}
                best = {s: page * n / min(v) / 1e9 for s, v in secs.items()}
                cells = [f"{best[s]:.3g} / {gbs[s]:.3g}" for s in systems]
                ratios = " ".join(f"{gbs[s] / gbs[systems[-1]]:.2f}" for s in systems[:-1])
                print(f"| {op} {name} | " + " | ".join(cells) + f" | {ratios} |", flush=True)
    finally:
        for target, init in procs.values():
            init.stop()
            target.stop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--json")
    ap.add_argument("--interleave", action="store_true", help="alternate the systems batch by batch (see interleave)")
    ap.add_argument("--rtt", type=int, metavar="PAIRS", help="only the single write, from PAIRS fresh process pairs per system")
    a = ap.parse_args()
    if a.serve:
        serve(a.serve)
        return
    systems = a.systems.split(",")
    if a.interleave:
        interleave(systems, a.rounds)
        return
    if a.rtt:
        rtt_pairs(systems, a.rtt)
        return
    rounds = []
    for r in range(a.rounds):
        got = {}
        for s in systems:
            got[s] = run_system(s, verify=(r == 0))
            print(f"round {r + 1} {s}: " + ", ".join(f"{k} {v:.3g}" for k, v in got[s].items()), flush=True)
        rounds.append(got)
    keys = list(rounds[0][systems[0]].keys())
    print("\n| metric | " + " | ".join(systems) + " |")
    print("|---|" + "---|" * len(systems))
    for k in keys:
        cells = []
        for s in systems:
            v = sorted(rd[s][k] for rd in rounds)
            cells.append(f"{v[0]:.3g} / {statistics.median(v):.3g} / {v[-1]:.3g}")
        print(f"| {k} | " + " | ".join(cells) + " |")
    pairs = [
        ("kvmove", "nixl"),
        ("kvmove-nixl", "nixl"),
        ("kvmove-tcp", "nixl-tcp"),
        ("kvmove-tcp", "mooncake"),
        ("kvmove-mooncake", "mooncake"),
        ("kvmove-nixl", "kvmove"),
    ]
    print("\nratios per round (ours / theirs; for rtt and cpu lower is better):")
    for ours, theirs in pairs:
        if ours in systems and theirs in systems:
            for k in keys:
                per = [rd[ours][k] / rd[theirs][k] for rd in rounds if rd[theirs][k] > 0]
                print(f"  {ours} / {theirs} {k}: " + " ".join(f"{x:.2f}" for x in per))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rounds, f, indent=1)


if __name__ == "__main__":
    main()
