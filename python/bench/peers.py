"""kvmove next to the engines it replaces, on one host (issue: peers side by side).

    python bench/peers.py [--rounds N] [--systems a,b,...] [--json FILE]
    python bench/peers.py --rtt PAIRS [--systems a,b,...]
    python bench/peers.py --faults ROUNDS [--freeze S] [--systems a,b,...]

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
* ``kvmove-nixl-tcp``: the same with same-host copies off (a
  ``KVMOVE_CONFIG`` file with ``kvmove-tcp``'s config): NIXL's API over
  the network path;
* ``kvmove``: ``kvmove.Engine`` (kvmove's own API, default path);
* ``kvmove-tcp``: ``kvmove.Engine`` with same-host copies off
  (``[backend.tcp] same_host = false``): every byte through the sockets, as
  between two hosts.

``--faults ROUNDS`` runs only the faults of the target: SIGKILL, a
restart on the same address, SIGSTOP (at most ``--freeze`` seconds,
default 40), with the initiator making single 4 KiB writes back to back;
time to the first error, a call's time to a dead address, time to the
first success after the restart and the failed tries before it, and what
a freeze does to the calls (``fault_round`` says exactly how).

``--rtt PAIRS`` runs only the single write (``--op read``: read), from
PAIRS fresh process pairs per system alternated pair by pair, and counts
the context switches per call of both processes (every thread). A system named ``NAME@DIR`` runs
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
path (``kvmove-tcp / nixl-tcp``, ``kvmove-nixl-tcp / nixl-tcp``,
``kvmove-tcp / mooncake``), and each API's
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
SYSTEMS = ["mooncake", "kvmove-mooncake", "nixl-tcp", "nixl", "kvmove-nixl", "kvmove-nixl-tcp", "kvmove", "kvmove-tcp"]
# kvmove's network path on one host: every byte through the sockets.
TCP_ONLY = '[backend]\nkind = "tcp"\n[backend.tcp]\nsame_host = false\n'


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
    def __init__(self, module, port=None):
        self.te = module.TransferEngine()
        rc = self.te.initialize(f"127.0.0.1:{port}" if port else "127.0.0.1", "P2PHANDSHAKE", "tcp", "")
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

    def __init__(self, config=None, port=None):
        import kvmove

        self.e = kvmove.Engine(config=config, port=port)
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


def make(system, port=None):
    """``system``'s side; listening on ``port`` of loopback where the API
    lets its caller choose (Mooncake's and kvmove's; NIXL's agents are
    reached by their metadata, handed over again after a restart)."""
    if system == "mooncake":
        from mooncake import engine

        return Mooncake(engine, port)
    if system == "kvmove-mooncake":
        from kvmove import mooncake

        return Mooncake(mooncake, port)
    if system in ("nixl", "nixl-tcp"):
        try:
            from nixl import _api
        except ImportError:
            from nixl_cu12 import _api
        return Nixl(_api)
    if system in ("kvmove-nixl", "kvmove-nixl-tcp"):
        from kvmove import nixl

        return Nixl(nixl)
    if system == "kvmove":
        return Engine(port=port)
    if system == "kvmove-tcp":
        return Engine(config=TCP_ONLY, port=port)
    raise SystemExit(f"unknown system {system}")


# ---- a peer process ------------------------------------------------------------


def serve(system, port=None):
    """One side, driven one JSON command per line on stdin."""
    e = make(system, port)
    out = sys.stdout

    def say(obj):
        out.write(json.dumps(obj) + "\n")
        out.flush()

    say({"ready": e.info()})
    ready = None  # the batch "prep" made ready, for "once"
    call = None  # the single write of "call"
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
        elif c in ("call", "reconnect"):
            # --faults: one 4 KiB write ("reconnect": first connect to the
            # restarted target, whose memory is new), whatever it ends in.
            # CLOCK_MONOTONIC is the host's: the times compare with the
            # parent's.
            t0 = time.monotonic()
            try:
                if c == "reconnect":
                    call = None
                    e.connect(cmd["info"])
                if call is None:
                    call = e.prepare("write", 4096, 1)
                call()
                err = None
            except Exception as x:  # noqa: BLE001 (every API's failure is a result here)
                err = f"{type(x).__name__}: {x}"
            say({"t0": t0, "t1": time.monotonic(), "err": err})
        elif c == "quit":
            e.close()
            say({"ok": True})
            return


def Proc(system, port=None):
    """The side of ``system`` (listening on ``port`` where it can);
    ``NAME@DIR`` is NAME with ``DIR`` first on ``PYTHONPATH`` (another
    build of kvmove: its wheel unpacked there)."""
    env = dict(os.environ)
    name, _, path = system.partition("@")
    if path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH")) if p)
    if name == "nixl-tcp":
        env["UCX_TLS"] = "tcp"
    if name == "kvmove-nixl-tcp":
        # The NIXL stand-in reads its engine's config from a file.
        cfg = os.path.join(os.path.abspath("."), "kvmove-tcp-only.toml")
        with open(cfg, "w") as f:
            f.write(TCP_ONLY)
        env["KVMOVE_CONFIG"] = cfg
    argv = [os.path.abspath(__file__), "--serve", name] + (["--port", str(port)] if port else [])
    return LineProc(argv, env=env)


def rtt_pairs(systems, pairs, op="write"):
    """Only the single 4 KiB ``op`` (write or read), each time from a fresh
    target and initiator (no batches before it), the systems alternated
    pair by pair: p50 / p99 and context switches per call (both processes,
    every thread), then the median over the pairs."""
    got = {s: [] for s in systems}
    for p in range(pairs):
        for s in systems:
            target, init = Proc(s), Proc(s)
            try:
                init.ask(cmd="connect", info=target.ready)
                before = context_switches(target.p.pid) + context_switches(init.p.pid)
                r = init.ask(cmd="rtt", op=op)
                per = (context_switches(target.p.pid) + context_switches(init.p.pid) - before) / (RTT_N + 20)
            finally:
                init.stop()
                target.stop()
            got[s].append((r["p50_us"], r["p99_us"], per))
            print(f"pair {p + 1} {s}: p50 {r['p50_us']:.1f} us, p99 {r['p99_us']:.1f} us, {per:.2f} switches/{op}", flush=True)
    print(f"\n| system, one 4 KiB {op} | p50 us, median (min-max) | p99 us, median | switches per {op}, median |")
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


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ask_within(proc, limit, **cmd):
    """``proc.ask(**cmd)``, or None if no answer came within ``limit`` s
    (the process is then killed: a call blocked on a frozen peer)."""
    import threading

    out = []

    def ask():
        try:
            out.append(proc.ask(**cmd))
        except (RuntimeError, OSError, ValueError):
            pass  # killed below, or died: no answer

    t = threading.Thread(target=ask, daemon=True)
    t.start()
    t.join(limit)
    if t.is_alive():
        proc.kill()
        t.join(5)
        return None
    return out[0] if out else None


def fault_round(system, freeze_s):
    """One system through three faults of its target, the initiator making
    one 4 KiB write at a time (each timed in the initiator), back to back:

    * ``kill``: SIGKILL; ``first error ms`` from the kill to the end of the
      first failed call; ``dead call ms``, the median of the next 5 calls
      (to an address nobody listens on);
    * ``restart``: a new target on the same address (Mooncake's and kvmove's;
      NIXL's agent is reached by its metadata, handed over with each try);
      each try connects to it (its memory is new) and writes; ``first
      success s`` from when it listened to the end of the first try that
      succeeded, ``failed tries`` before it;
    * ``freeze``: SIGSTOP of the new target for up to ``freeze_s``;
      ``frozen error s`` from the stop to the end of the first failed call
      (None: none within ``freeze_s``), ``next call s`` the call after it,
      ``longest call s`` of the freeze (a call still blocked ``freeze_s``
      + 30 s after it began is ended by killing the initiator: ``frozen
      call killed``); then SIGCONT.

    Same-host paths write into a frozen process's memory, so their calls
    keep completing through a freeze.
    """
    import signal

    port = free_port()
    target, init = Proc(system, port), Proc(system)
    res = {}
    try:
        init.ask(cmd="connect", info=target.ready)
        for _ in range(20):
            r = init.ask(cmd="call")
            if r["err"]:
                raise RuntimeError(f"{system}: a write before the faults failed: {r['err']}")
        # kill
        t_kill = time.monotonic()
        target.kill()
        first = None
        for _ in range(100000):
            r = ask_within(init, 60, cmd="call")
            if r is None:
                raise RuntimeError(f"{system}: a call after the kill blocked 60 s")
            if r["err"]:
                first = r
                break
            if time.monotonic() - t_kill > 10:
                break
        res["first error ms"] = (first["t1"] - t_kill) * 1e3 if first else None
        res["kill error"] = first["err"][:160] if first else None
        dead = [init.ask(cmd="call") for _ in range(5)]
        res["dead call ms"] = statistics.median((r["t1"] - r["t0"]) * 1e3 for r in dead)
        # restart on the same address
        target = Proc(system, port)
        t_up = time.monotonic()
        failed, ok = 0, None
        while time.monotonic() - t_up < 20:
            r = ask_within(init, 60, cmd="reconnect", info=target.ready)
            if r is None:
                raise RuntimeError(f"{system}: a try after the restart blocked 60 s")
            if not r["err"]:
                ok = r
                break
            failed += 1
            res["restart error"] = r["err"][:160]
        res["first success s"] = (ok["t1"] - t_up) if ok else None
        res["failed tries"] = failed
        # freeze
        t_stop = time.monotonic()
        os.kill(target.p.pid, signal.SIGSTOP)
        err, longest, nxt = None, 0.0, None
        try:
            while time.monotonic() - t_stop < freeze_s:
                r = ask_within(init, freeze_s + 30, cmd="call")
                if r is None:
                    res["frozen call killed"] = True  # blocked past freeze_s + 30 s
                    longest = freeze_s + 30
                    break
                longest = max(longest, r["t1"] - r["t0"])
                if r["err"]:
                    err = r
                    n = ask_within(init, freeze_s + 30, cmd="call")
                    nxt = (n["t1"] - n["t0"]) if n else None
                    break
        finally:
            os.kill(target.p.pid, signal.SIGCONT)
        res["frozen error s"] = (err["t1"] - t_stop) if err else None
        res["frozen error"] = err["err"][:160] if err else None
        res["next call s"] = nxt
        res["longest call s"] = longest
        return res
    finally:
        for p in (init, target):
            try:
                p.stop()
            except Exception:  # noqa: BLE001 (killed above)
                pass


def faults(systems, rounds, freeze_s):
    """``fault_round`` for every system, alternated, ``rounds`` times; a
    table of min / median / max per number, and each round's errors."""
    got = {s: [] for s in systems}
    for r in range(rounds):
        for s in systems:
            try:
                res = fault_round(s, freeze_s)
            except RuntimeError as e:
                res = {"failed": str(e)}
            got[s].append(res)
            print(f"round {r + 1} {s}: {json.dumps(res)}", flush=True)
    keys = ["first error ms", "dead call ms", "first success s", "failed tries", "frozen error s", "next call s",
            "longest call s"]  # fmt: skip
    print("\n| fault | " + " | ".join(systems) + " |")
    print("|---|" + "---|" * len(systems))
    for k in keys:
        cells = []
        for s in systems:
            v = sorted(x[k] for x in got[s] if x.get(k) is not None)
            none = sum(1 for x in got[s] if x.get(k) is None)
            cell = f"{v[0]:.3g} / {statistics.median(v):.3g} / {v[-1]:.3g}" if v else "-"
            cells.append(cell + (f" ({none} none)" if none and v else ""))
        print(f"| {k} | " + " | ".join(cells) + " |")
    return got


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
    ap.add_argument("--op", default="write", choices=["write", "read"], help="--rtt: the single write or read")
    ap.add_argument("--faults", type=int, metavar="ROUNDS", help="only the faults (kill, restart, freeze), ROUNDS rounds")
    ap.add_argument("--freeze", type=float, default=40.0, help="--faults: how long the target stays frozen at most, s")
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        serve(a.serve, a.port)
        return
    systems = a.systems.split(",")
    if a.interleave:
        interleave(systems, a.rounds)
        return
    if a.rtt:
        rtt_pairs(systems, a.rtt, a.op)
        return
    if a.faults:
        got = faults(systems, a.faults, a.freeze)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(got, f, indent=1)
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
        ("kvmove-nixl-tcp", "nixl-tcp"),
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
