"""vLLM's NixlConnector over kvmove's stand-in and over the real NIXL (UCX
over TCP), alternated in rounds: the time per KV transfer from vLLM's own
metrics (``vllm:nixl_xfer_time_seconds``) and the decode request's latency.

A benchmark, not part of the test command. It needs the vLLM virtualenv
that scripts/vllm-tests.sh makes (and the models in its work directory),
plus the real NIXL in it::

    target/vllm-venv/bin/pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1
    cd target/vllm-e2e && ../vllm-venv/bin/python ../../python/vllm_e2e/pd_bench.py \\
        --work . --shim "$(../vllm-venv/bin/python -m kvmove.shims nixl)"

(The ``nixl`` package picks the variant that matches torch's CUDA major;
PyPI's torch 2.13 is CUDA 13.) Without the stand-in on PYTHONPATH, vLLM
imports the real ``nixl``.
"""

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import pd_check as c  # noqa: E402


def run(args, system, round_no, ps):
    bp = args.base_port
    servers = []
    for role, off, core in (("kv_producer", 1, "0"), ("kv_consumer", 2, "1")):
        a = argparse.Namespace(work=args.work, shim=args.shim)
        name = f"bench-{round_no}-{system}-{'prefill' if off == 1 else 'decode'}"
        s = c.Server(a, name, bp + off, os.path.join(args.work, "model"), side_port=bp + 10 + off,
                     metrics_port=bp + 20 + off, role=role)  # fmt: skip
        # One core each for the workers (UCX's progress threads poll).
        s.extra_env = {"VLLM_CPU_OMP_THREADS_BIND": core}
        if system == "nixl":
            # The real NIXL: no stand-in on the path; UCX over TCP, a
            # network transport as kvmove's (UCX's default here is CMA).
            s.extra_env.update(PYTHONPATH=os.path.join(HERE, "site"), UCX_TLS="tcp")
        servers.append(s)
    prefill, decode = servers
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready()
        for p in ps:  # warm-up: the handshake and first connections
            c.pd(prefill, decode, p)
        v0 = decode.metrics()
        lat = []
        for i in range(args.requests):
            times = []
            c.pd(prefill, decode, ps[i % len(ps)], times)
            lat.append(times[0][1])
        v1 = decode.metrics()

        def d(name):
            return c.total(v1, name) - c.total(v0, name)

        n = d("vllm:nixl_xfer_time_seconds_count")
        return {
            "xfer_ms": 1000 * d("vllm:nixl_xfer_time_seconds_sum") / n if n else float("nan"),
            "post_ms": 1000 * d("vllm:nixl_post_time_seconds_sum") / n if n else float("nan"),
            "transfers": n,
            "kib": d("vllm:nixl_bytes_transferred_sum") / n / 1024 if n else 0,
            "decode_p50_ms": 1000 * statistics.median(lat),
        }
    finally:
        for s in servers:
            if s.proc is not None and s.proc.poll() is None:
                s.stop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--shim", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--base-port", type=int, default=18400)
    args = ap.parse_args()
    ps = c.prompts()
    rows = {"kvmove": [], "nixl": []}
    for r in range(args.rounds):
        for system in ("kvmove", "nixl") if r % 2 == 0 else ("nixl", "kvmove"):
            res = run(args, system, r, ps)
            rows[system].append(res)
            print(f"round {r + 1} {system:6s}: vLLM xfer {res['xfer_ms']:.2f} ms (post {res['post_ms']:.2f} ms) "
                  f"per transfer, {res['transfers']:.0f} transfers of {res['kib']:.0f} KiB; "
                  f"decode request p50 {res['decode_p50_ms']:.1f} ms", flush=True)  # fmt: skip
        k, n = rows["kvmove"][-1], rows["nixl"][-1]
        print(f"round {r + 1} ratio kvmove/nixl: xfer time {k['xfer_ms'] / n['xfer_ms']:.2f}, "
              f"decode p50 {k['decode_p50_ms'] / n['decode_p50_ms']:.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
