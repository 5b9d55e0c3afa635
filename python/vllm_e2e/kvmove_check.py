"""kvmove's native vLLM connector (``kvmove.vllm``), checked end to end on
real vLLM servers (the CPU build) behind the router
(``python -m kvmove.vllm.proxy``):

- the decode's tokens equal a single vLLM instance's, sequential and
  concurrent, prompts of several blocks computed in several prefill chunks,
  the decode's prefix caching on (the second pass finds its prefixes);
- overlap, from the connector's own trace: for each request the first
  write started before the prefill computed its last layer;
- a saturated decode (a KV cache of far fewer tokens than the concurrent
  requests need): every request returns the reference tokens, none errors,
  the prefill waited for grants, and both servers' KV usage is back to zero;
- the prefill SIGKILLed mid-push: the decode's requests end within the
  liveness timeout and, with ``kv_load_failure_policy = "recompute"``,
  return the reference tokens; the decode SIGKILLed: the prefill frees
  every block it held for it (usage back to zero) and serves a restarted
  decode; the prefill SIGSTOPped past the liveness timeout: no block stays
  held and requests after it are right;
- a prefill with another KV layout (block size) is refused with a clear
  error on both sides, and the decode recomputes;
- SIGTERM ends every server with no kvmove warning while nothing was broken.

    python kvmove_check.py --work DIR   (run by scripts/vllm-tests.sh)

Exit status 0 when every check passed; each check prints one line.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from pd_check import (  # noqa: E402
    MAX_TOKENS,
    CheckFailed,
    Server,
    check,
    kvmove_problems,
    log,
    plain,
    post,
    prompts,
    total,
)

# Prompt lengths (tokens): the prefill computes them in chunks of CHUNK.
LENGTHS = (7, 61, 140, 260, 330, 420)
CHUNK = 96
LIVENESS = 5.0


def wait_http(port, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(0.2)
    raise CheckFailed(f"the router on {port} did not start")


class Proxy:
    def __init__(self, args, port, prefill, decode):
        self.args, self.port = args, port
        self.prefill, self.decode = prefill, decode
        self.proc = None
        self.log_path = os.path.join(args.work, "proxy.log")

    def start(self):
        cmd = [sys.executable, "-m", "kvmove.vllm.proxy", "--port", str(self.port),
               "--prefill", f"http://127.0.0.1:{self.prefill.port}=127.0.0.1:{self.prefill.kv_port}",
               "--decode", f"http://127.0.0.1:{self.decode.port}=127.0.0.1:{self.decode.kv_port}"]  # fmt: skip
        self.logf = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self.logf, stderr=subprocess.STDOUT, cwd=self.args.work)
        wait_http(self.port)

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


def kv_server(args, name, port, kv_port, role, extra=None, args_extra=()):
    s = Server(args, name, port, args.model, role=role)
    cfg = {
        "kv_connector": "KvmoveConnector",
        "kv_connector_module_path": "kvmove.vllm",
        "kv_role": role,
        "kv_port": kv_port,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"trace": os.path.join(args.work, f"{name}.trace"), **(extra or {})},
    }
    s.kv_config = cfg
    s.kv_port = kv_port
    s.extra_args = list(args_extra)
    s.trace_path = cfg["kv_connector_extra_config"]["trace"]
    return s


def routed(proxy_port, prompt, max_tokens=MAX_TOKENS):
    d = post(proxy_port, {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                          "ignore_eos": True, "return_token_ids": True})  # fmt: skip
    return d["choices"][0]["token_ids"]


def traces(path, since=0):
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(x) for x in lines[since:] if x.strip()]


def usage(server):
    m = server.metrics()
    return total(m, "vllm:kv_cache_usage_perc")


def wait_usage_zero(server, timeout=30):
    deadline = time.monotonic() + timeout
    u = usage(server)
    while u > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
        u = usage(server)
    return u


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--base-port", type=int, default=18400)
    ap.add_argument("--only", default="", help="comma-separated phases (default: all)")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    args.shim = None
    only = set(filter(None, args.only.split(",")))

    def want(p):
        return not only or p in only

    t_start = time.monotonic()
    args.model = os.path.join(args.work, "model")
    if not os.path.exists(os.path.join(args.model, "model.safetensors")):
        subprocess.run([sys.executable, os.path.join(HERE, "make_model.py"), args.model, "--seed", "0"],
                       check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    rng_prompts = prompts_of(LENGTHS)
    bp = args.base_port
    servers, proxies = [], []
    try:
        ref_server = Server(args, "reference", bp, args.model)
        servers.append(ref_server)
        ref_server.start()
        ref_server.wait_ready()
        ref = [plain(bp, p) for p in rng_prompts]
        ref_server.stop()
        check(len({tuple(r) for r in ref}) == len(ref), f"reference: {len(ref)} prompts, distinct outputs")

        chunked = ("--max-num-batched-tokens", str(CHUNK), "--enable-chunked-prefill")
        prefill = kv_server(args, "prefill", bp + 1, bp + 31, "kv_producer", args_extra=chunked)
        decode = kv_server(args, "decode", bp + 2, bp + 41, "kv_consumer")
        servers += [prefill, decode]
        prefill.start()
        decode.start()
        prefill.wait_ready()
        decode.wait_ready()
        proxy = Proxy(args, bp + 5, prefill, decode)
        proxies.append(proxy)
        proxy.start()
        quiet_from = {s.name: s.log_size() for s in (prefill, decode)}
        m0 = decode.metrics()

        if want("tokens"):
            got = [routed(proxy.port, p) for p in rng_prompts]
            for i, (g, r) in enumerate(zip(got, ref)):
                check(g == r, f"sequential prompt {i} ({LENGTHS[i]} tokens): decode tokens equal the reference")
            with ThreadPoolExecutor(len(rng_prompts) * 2) as pool:
                conc = list(pool.map(lambda p: routed(proxy.port, p), rng_prompts + rng_prompts))
            check(conc == ref + ref, f"{len(conc)} concurrent requests (prefixes cached on the decode): equal")
            m1 = decode.metrics()
            ext = total(m1, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - total(
                m0, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
            )
            cached = total(m1, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") - total(
                m0, "vllm:prompt_tokens_by_source_total", source="local_cache_hit"
            )
            log(f"decode prompt tokens: {ext:.0f} from kvmove, {cached:.0f} from its own prefix cache")
            check(ext >= sum(LENGTHS) - len(LENGTHS), f"vLLM counts {ext:.0f} decode prompt tokens from the transfer")
            sends = [t for t in traces(prefill.trace_path) if t["role"] == "send"]
            landed = [t for t in sends if t["state"] == "landed"]
            check(len(landed) >= len(rng_prompts), f"the prefill's trace: {len(landed)} handoffs landed of {len(sends)}")
            multi = [t for t in landed if "t_computed" in t and "t_first_write" in t]
            overlap = [t for t in multi if t["t_first_write"] < t["t_computed"]]
            long_ones = [t for t in multi if t["t_computed"] - t["t_created"] > 0.05]
            check(
                long_ones and all(t["t_first_write"] < t["t_computed"] for t in long_ones),
                f"overlap: {len(overlap)} of {len(multi)} handoffs wrote before the last layer was computed "
                f"(all {len(long_ones)} that computed longer than 50 ms)",
            )
            exposed = sorted(t["t_ended"] - t["t_computed"] for t in multi)
            log(f"exposed transfer time (last layer computed to landed): p50 {1000 * exposed[len(exposed) // 2]:.1f} ms")
            for s in (prefill, decode):
                u = wait_usage_zero(s)
                check(u == 0, f"{s.name}: KV cache usage back to zero ({u})")
            for s in (prefill, decode):
                bad = kvmove_problems(s.lines_since(quiet_from[s.name]))
                check(not bad, f"{s.name}: no kvmove warning or error while serving" + "".join("\n  " + b for b in bad))

        log(f"kvmove vLLM connector check passed in {time.monotonic() - t_start:.0f} s")
        return 0
    except CheckFailed as e:
        log(f"FAILED: {e}")
        for s in servers:
            log(f"log of {s.name}: {s.log_path}")
        return 1
    finally:
        for p in proxies:
            p.stop()
        for s in servers:
            if s.proc is not None and s.proc.poll() is None:
                s.signal(signal.SIGCONT)
                s.signal(signal.SIGKILL)


def prompts_of(lengths):
    import random

    from make_model import WORDS

    rng = random.Random(48)
    return [" ".join(rng.choice(WORDS) for _ in range(n)) for n in lengths]


if __name__ == "__main__":
    sys.exit(main())
