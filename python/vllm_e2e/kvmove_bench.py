"""Time to first token through kvmove's own vLLM connector and through
vLLM's ``NixlConnector`` with the real NIXL (UCX over TCP), alternated in
rounds on the same machine.

A benchmark, not part of the test command. Systems (``--systems``):

- ``nixl``: ``NixlConnector`` on the real NIXL, vLLM's two-step flow (the
  prefill computes and returns, then the decode pulls every block);
- ``standin``: the same on kvmove's NIXL stand-in;
- ``layer``: ``KvmoveConnector``, the prefill pushing each layer into the
  blocks the decode granted while it computes (the default);
- ``whole``: ``KvmoveConnector`` writing a request's KV only after its last
  layer (``layerwise: false``): what overlap is worth;
- ``hold``: ``KvmoveConnector`` with backpressure ``"hold"`` (a prefill
  request scheduled once granted).

For each: TTFT (a request for one token: through the router for kvmove,
prefill then decode for NIXL, timed at the client) of sequential requests
of each prompt length; the exposed transfer time (kvmove: from the
prefill's trace, last layer computed to landed; NIXL: vLLM's own
``vllm:nixl_xfer_time_seconds``, all of it after the prefill); then a burst
of twice the decode's KV capacity at once (``--burst-len`` tokens each):
requests per second and p99 TTFT.

    target/vllm-venv/bin/pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1  # for nixl
    mkdir -p target/vllm-e2e/bench && cd target/vllm-e2e/bench
    ../../vllm-venv/bin/python ../../../python/vllm_e2e/kvmove_bench.py --work . \\
        --shim "$(../../vllm-venv/bin/python -m kvmove.shims nixl)"

The model is ``make_model.py --bench`` (8 layers of 256, random weights).
Run it on a quiet machine; it prints one line per system and round, then
the medians over the rounds.
"""

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import pd_check as c  # noqa: E402
from kvmove_check import Proxy, traces  # noqa: E402
from make_model import WORDS  # noqa: E402

BLOCK = 128  # vLLM's CPU block size, tokens


def prompt(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


class System:
    def __init__(self, args, name, rnd):
        self.args, self.name = args, name
        bp = args.base_port
        common = ("--max-model-len", str(args.max_len), "--max-num-batched-tokens", str(args.max_len),
                  "--max-num-seqs", "64", "--no-enable-prefix-caching")  # fmt: skip
        decode_blocks = ("--num-gpu-blocks-override", str(args.decode_blocks))
        if name == "standin" and not args.shim:
            raise SystemExit("--systems standin needs --shim (python -m kvmove.shims nixl)")
        # (Only "standin" puts the shim first on the path; the others replace it.)
        a = argparse.Namespace(work=args.work, shim=args.shim or os.path.join(HERE, "site"))
        tag = f"bench-{rnd}-{name}"
        kv = name in ("layer", "whole", "hold")
        self.prefill = c.Server(a, f"{tag}-prefill", bp + 1, args.model, side_port=None if kv else bp + 11,
                                role="kv_producer")  # fmt: skip
        self.decode = c.Server(a, f"{tag}-decode", bp + 2, args.model, side_port=None if kv else bp + 12,
                               role="kv_consumer")  # fmt: skip
        self.prefill.extra_args = list(common)
        self.decode.extra_args = list(common + decode_blocks)
        # NIXL's systems: one core each for the two workers (as
        # pd_bench.py): unbound, the real NIXL's UCX progress threads spun
        # beside both workers (load 31) and its release notifications came
        # after the prefill's 30 s lease, one request in 30 s. kvmove's:
        # vLLM's own binding (both workers on the last core, kvmove's
        # threads on the other); bound apart, each worker's spinning loop
        # sits on the other server's kvmove threads (a handshake timed out).
        # ``--kv-bind own`` or ``cross`` binds kvmove's systems apart too,
        # with kvmove's threads on the worker's own core (as NIXL's UCX
        # threads, which the worker starts) or on the other one.
        apart = not kv or args.kv_bind in ("own", "cross")
        if apart:
            for s, core in ((self.prefill, "0"), (self.decode, "1")):
                s.extra_env = {"VLLM_CPU_OMP_THREADS_BIND": core}
        self.proxy = None
        self.trace = None
        if kv:
            extra = {"layer": {}, "whole": {"layerwise": False}, "hold": {"backpressure": "hold"}}[name]
            self.trace = os.path.join(args.work, f"{tag}.trace")
            sides = ((self.prefill, "kv_producer", bp + 31, 0), (self.decode, "kv_consumer", bp + 41, 1))
            for s, role, port, core in sides:
                cpus = {"own": {"cpus": [core]}, "cross": {"cpus": [1 - core]}}.get(args.kv_bind, {})
                s.kv_port = port
                s.kv_config = {
                    "kv_connector": "KvmoveConnector", "kv_connector_module_path": "kvmove.vllm",
                    "kv_role": role, "kv_port": port, "kv_load_failure_policy": "fail",
                    "kv_connector_extra_config": {"trace": self.trace, **extra, **cpus},
                }  # fmt: skip
        elif name == "nixl":
            # The real NIXL: no stand-in on the path; UCX over TCP, a
            # network transport as kvmove's.
            for s in (self.prefill, self.decode):
                s.extra_env.update(PYTHONPATH=os.path.join(HERE, "site"), UCX_TLS="tcp")
                if not args.nixl_defaults:
                    # UCX's knobs for its TCP transport, the same on both
                    # ends: a mutex for the worker lock (NIXL's progress
                    # thread and vLLM's polling share it; a preempted
                    # holder of the default spinlock left the other
                    # spinning), each 64 KiB block in one fragment instead
                    # of eight, 4 MiB socket buffers (this kernel's most).
                    s.extra_env.update(UCX_USE_MT_MUTEX="y", UCX_TCP_TX_SEG_SIZE="256k", UCX_TCP_RX_SEG_SIZE="1m",
                                       UCX_TCP_SNDBUF="4m", UCX_TCP_RCVBUF="4m")  # fmt: skip
                    # No thread pool: only batches of 1024 descriptors or
                    # more use it (a 4000-token request is 256).
                    s.kv_config = {"kv_connector": "NixlConnector", "kv_role": s.role, "kv_buffer_device": "cpu",
                                   "kv_connector_extra_config": {"num_threads": 0}}  # fmt: skip
        if args.pin_servers:
            # Every process of each server (API server, engine core,
            # worker) on its core, as two machines would be: the decode's
            # engine loop, which steps while a request waits for its KV,
            # then never runs on the prefill's core.
            self.prefill.cpus, self.decode.cpus = "0", "1"
        if not kv and not args.vllm_repin:
            for s in (self.prefill, self.decode):
                s.extra_env["KVMOVE_BENCH_KEEP_AFFINITY"] = "1"

    def start(self):
        for s in (self.prefill, self.decode):
            s.start()
        for s in (self.prefill, self.decode):
            s.wait_ready()
        if self.trace is not None:
            self.proxy = Proxy(argparse.Namespace(work=self.args.work), self.args.base_port + 5,
                               self.prefill, self.decode)  # fmt: skip
            self.proxy.start()

    def stop(self):
        if self.proxy is not None:
            self.proxy.stop()
        for s in (self.prefill, self.decode):
            if s.proc is not None and s.proc.poll() is None:
                s.stop()

    def ttft(self, text):
        """Seconds to the first token of ``text`` (one token asked for)."""
        t0 = time.monotonic()
        if self.proxy is not None:
            c.post(self.proxy.port, {"model": "tiny", "prompt": text, "max_tokens": 1, "temperature": 0})
        else:
            c.pd(self.prefill, self.decode, text, max_tokens=1)
        return time.monotonic() - t0

    def exposed(self, since_trace, m0):
        """Mean exposed transfer seconds since the marks."""
        if self.trace is not None:
            ts = [t for t in traces(self.trace, since_trace) if t["role"] == "send" and t["state"] == "landed"]
            xs = [t["t_ended"] - t["t_computed"] for t in ts if "t_computed" in t]
            return statistics.median(xs) if xs else float("nan")
        m1 = self.decode.metrics()
        n = c.total(m1, "vllm:nixl_xfer_time_seconds_count") - c.total(m0, "vllm:nixl_xfer_time_seconds_count")
        s = c.total(m1, "vllm:nixl_xfer_time_seconds_sum") - c.total(m0, "vllm:nixl_xfer_time_seconds_sum")
        return s / n if n else float("nan")

    def marks(self):
        return (len(traces(self.trace)) if self.trace else 0), self.decode.metrics()


def run(args, name, rnd, rng):
    sysm = System(args, name, rnd)
    res = {}
    try:
        sysm.start()
        for _ in range(2):  # warm-up: connections, first allocations
            sysm.ttft(prompt(rng, 64))
        for n in args.lengths:
            mark = sysm.marks()
            xs, failed = [], []
            for _ in range(args.requests):
                try:
                    xs.append(sysm.ttft(prompt(rng, n)))
                except Exception as e:  # noqa: BLE001 (counted, and the first one shown)
                    failed.append(f"{type(e).__name__}: {e}")
            res[n] = {"p50": statistics.median(xs) if xs else float("nan"), "p99": pct(xs, 0.99),
                      "exposed": sysm.exposed(*mark), "failed": len(failed)}  # fmt: skip
            if failed:
                print(f"  {name} {n} tokens: {len(failed)} of {args.requests} failed; first: {failed[0]}", flush=True)
        # The burst: twice what the decode's KV cache holds, at once.
        per = -(-(args.burst_len + 1) // BLOCK)
        k = 2 * max(1, args.decode_blocks // per)
        texts = [prompt(rng, args.burst_len) for _ in range(k)]
        out = [None] * k

        def one(i):
            try:
                out[i] = sysm.ttft(texts[i])
            except Exception as e:  # noqa: BLE001
                out[i] = f"{type(e).__name__}: {e}"

        t0 = time.monotonic()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(k)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        took = time.monotonic() - t0
        ok = [x for x in out if isinstance(x, float)]
        res["burst"] = {"n": k, "failed": k - len(ok), "rps": len(ok) / took, "p99": pct(ok, 0.99)}
    finally:
        sysm.stop()
    return res


def line(name, res, lengths):
    parts = [f"{n}: TTFT p50 {1e3 * res[n]['p50']:.0f} p99 {1e3 * res[n]['p99']:.0f} ms, "
             f"exposed {1e3 * res[n]['exposed']:.1f} ms" + (f", {res[n]['failed']:g} failed" if res[n].get("failed") else "")
             for n in lengths]  # fmt: skip
    b = res["burst"]
    parts.append(f"burst of {b['n']}: {b['rps']:.2f} req/s, p99 TTFT {1e3 * b['p99']:.0f} ms, {b['failed']} failed")
    return f"{name:8s} " + "; ".join(parts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--shim", default=None, help="the NIXL stand-in's directory (for standin)")
    ap.add_argument("--systems", default="nixl,layer,whole,hold")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--lengths", default="128,1024,4000")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--burst-len", type=int, default=1024)
    ap.add_argument("--decode-blocks", type=int, default=64)
    ap.add_argument("--base-port", type=int, default=18500)
    ap.add_argument("--nixl-defaults", action="store_true",
                    help="nixl: UCX's and NIXL's defaults (else UCX's TCP knobs tuned and no thread pool)")
    ap.add_argument("--pin-servers", action="store_true",
                    help="every process of the prefill on core 0 and of the decode on core 1 (taskset)")
    ap.add_argument("--vllm-repin", action="store_true",
                    help="nixl, standin: let NixlConnector re-pin each worker to the last core (both on core 1 here)")
    ap.add_argument("--kv-bind", choices=("vllm", "own", "cross"), default="vllm",
                    help="kvmove's systems: vLLM's own binding (both workers on the last core), or each worker on "
                         "a core of its own as NIXL's, kvmove's threads on that core (own) or the other (cross)")  # fmt: skip
    args = ap.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.max_len = max(args.lengths + [args.burst_len]) + 64
    systems = args.systems.split(",")
    args.model = os.path.join(args.work, "bench-model")
    if not os.path.exists(os.path.join(args.model, "model.safetensors")):
        import subprocess

        subprocess.run([sys.executable, os.path.join(HERE, "make_model.py"), args.model, "--bench"], check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
    load = os.getloadavg()[0]
    print(f"load average at the start: {load:.2f}; {os.cpu_count()} cores", flush=True)
    rows = {s: [] for s in systems}
    rng = random.Random(7)
    for r in range(args.rounds):
        order = systems if r % 2 == 0 else systems[::-1]
        for name in order:
            res = run(args, name, r, rng)
            rows[name].append(res)
            print(f"round {r + 1} " + line(name, res, args.lengths), flush=True)
    print("medians over the rounds:")
    for name in systems:
        med = {}
        for n in args.lengths:
            med[n] = {k: statistics.median(x[n].get(k, 0) for x in rows[name]) for k in ("p50", "p99", "exposed", "failed")}
        med["burst"] = {k: statistics.median(x["burst"][k] for x in rows[name]) for k in ("n", "failed", "rps", "p99")}
        print(line(name, med, args.lengths), flush=True)
    with open(os.path.join(args.work, "bench.json"), "w") as f:
        json.dump({"load": load, "rows": rows}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
