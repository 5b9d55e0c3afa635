"""kvmove's native vLLM connector (``kvmove.vllm``), checked end to end on
real vLLM servers (the CPU build) behind the router
(``python -m kvmove.vllm.proxy``):

- the decode's tokens equal the prefill's own (a plain vLLM instance), sequential and
  concurrent, prompts of several blocks computed in several prefill chunks,
  the decode's prefix caching on (the second pass finds its prefixes);
- overlap, from the connector's own trace: every request granted before
  the prefill computed its last layer had its first write start before
  that (at least two of the sequential ones are);
- a saturated decode (a KV cache of far fewer tokens than the concurrent
  requests need): every request returns the reference tokens, none errors,
  the decode's scheduler held some back, step after step, until it had
  their blocks, and both servers' KV usage is back to zero;
- vLLM's own connector stats: ``vllm:kvmove_sessions_total`` and
  ``vllm:kvmove_bytes_total`` on both servers' ``/metrics`` count exactly
  the handoffs of the traces, and the bytes sent equal the bytes received;
- the prefill SIGKILLed mid-push: with ``kv_load_failure_policy =
  "recompute"`` the decode's requests return the reference tokens; the
  decode SIGKILLed: the prefill frees every block it held for it (usage
  back to zero) and serves a restarted decode, which runs with
  ``kv_load_failure_policy = "fail"`` from then on; the prefill SIGKILLed
  mid-push again: each request whose handoff the decode saw fail errors,
  within the liveness timeout of the kill, the others return the reference
  tokens;
- the restarted prefill runs with backpressure ``"hold"``: a request is
  scheduled only once the decode granted it;
- the prefill SIGSTOPped past the liveness timeout, then the decode: every
  request ends, with the reference tokens or (``"fail"``) an error, one
  error for each handoff the decode saw fail; no block stays held; and
  requests after it are right;
- both ends agree: every handoff in both traces landed on both or on
  neither;
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
    report_failure,
    total,
)

# Prompt lengths (tokens): the prefill computes them in chunks of CHUNK.
LENGTHS = (7, 61, 140, 260, 330, 420)
CHUNK = 96
LIVENESS = 5.0
# The decode's KV cache, in blocks of 128 tokens: the concurrent requests
# need several times more.
DECODE_BLOCKS = 10
CONC_ROUNDS = 2
# Extra sequential rounds of fresh prompts when the first gave fewer than
# two handoffs granted before their last layer (phase_tokens).
EXTRA_OVERLAP_ROUNDS = 2


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
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)


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
    # The checks read the whole trace against this run's /metrics.
    if os.path.exists(s.trace_path):
        os.remove(s.trace_path)
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


def sends_ended(path, since, n, timeout=30):
    """The prefill's send entries after ``since``, once ``n`` are there (or
    the deadline passed): a send ends when the decode's ACK reaches the
    prefill, which may be after the decode has answered the request."""
    deadline = time.monotonic() + timeout
    while True:
        got = [t for t in traces(path, since) if t["role"] == "send"]
        if len(got) >= n or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def ends_agree(prefill, decode, what):
    """Every handoff both traces hold landed on both sides or on neither
    (docs/CONTRACT.md, rule 12)."""
    sends = {t["handoff"]: t["state"] for t in traces(prefill.trace_path) if t["role"] == "send"}
    recvs = {t["handoff"]: t["state"] for t in traces(decode.trace_path) if t["role"] == "recv"}
    both = sorted(sends.keys() & recvs.keys())
    split = [(h, sends[h], recvs[h]) for h in both if (sends[h] == "landed") != (recvs[h] == "landed")]
    check(
        both and not split,
        f"{what}: both ends agree on each of the {len(both)} handoffs they share {split[:3]}",
    )


def kvmove_counts(server, role):
    """``(sessions by outcome, bytes)`` from ``server``'s ``/metrics``."""
    m = server.metrics()
    by = {}
    for (name, labels), v in m.items():
        ls = dict(labels)
        if name == "vllm:kvmove_sessions_total" and ls.get("role") == role:
            by[ls.get("outcome")] = by.get(ls.get("outcome"), 0) + v
    return by, total(m, "vllm:kvmove_bytes_total", role=role)


def busy(server):
    """Requests the server runs or holds."""
    m = server.metrics()
    return total(m, "vllm:num_requests_running") + total(m, "vllm:num_requests_waiting")


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
    # Stopped by the test command (SIGTERM, when another step failed):
    # leave through the `finally` below, which stops the servers; by
    # default Python would die at once and leave them running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
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
    ps = prompts_of(LENGTHS)
    bp = args.base_port
    servers, proxies = [], []
    try:
        # The prefill (prompts in chunks of CHUNK tokens; no prefix cache,
        # so every handoff computes) and the decode (prefix caching on, a KV
        # cache of DECODE_BLOCKS blocks: far fewer tokens than the
        # concurrent requests need) start together. The reference is the
        # prefill generating by itself (no kvmove parameters: a plain
        # vLLM instance), before any handoff.
        chunked = ("--max-num-batched-tokens", str(CHUNK), "--enable-chunked-prefill", "--no-enable-prefix-caching")
        small = ("--num-gpu-blocks-override", str(DECODE_BLOCKS))
        # vLLM binds each worker to the cores it did not reserve (here both
        # to core 0) and kvmove's threads go to the reserved one: a thread
        # beside a worker's spin (vLLM's shared-memory queue yields in a
        # loop for a second after each step) hardly runs on this kernel.
        prefill = kv_server(args, "prefill", bp + 1, bp + 31, "kv_producer", args_extra=chunked)
        decode = kv_server(args, "decode", bp + 2, bp + 41, "kv_consumer", args_extra=small)
        servers += [prefill, decode]
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready()
        ref = [plain(prefill.port, p) for p in ps]
        check(len({tuple(r) for r in ref}) == len(ref), f"reference: {len(ref)} prompts, distinct outputs")
        proxy = Proxy(args, bp + 5, prefill, decode)
        proxies.append(proxy)
        proxy.start()
        quiet_from = {s.name: s.log_size() for s in (prefill, decode)}

        if want("tokens"):
            phase_tokens(prefill, decode, proxy, ps, ref)
        for s in (prefill, decode):
            bad = kvmove_problems(s.lines_since(quiet_from[s.name]))
            check(not bad, f"{s.name}: no kvmove warning or error while serving" + "".join("\n  " + b for b in bad))
        if want("kill"):
            phase_kill_prefill(prefill, decode, proxy, ps, ref)  # "recompute"
            phase_kill_decode(prefill, decode, proxy, ps, ref)  # the decode back with "fail"
            phase_kill_prefill(prefill, decode, proxy, ps, ref)  # "fail"
        if want("stop"):
            phase_stop(prefill, decode, proxy, ps, ref, prefill)
            phase_stop(prefill, decode, proxy, ps, ref, decode)
        # The router first (as a deployment shuts down), then each server
        # once it runs nothing: a prefill request the router still held
        # (its answer unused, the decode's already sent) would keep the
        # API server waiting for that connection after its engine stopped.
        for p in proxies:
            p.stop()
        for s in (prefill, decode):
            idle_by = time.monotonic() + 60
            while time.monotonic() < idle_by and busy(s) > 0:
                time.sleep(0.5)
        for s in (prefill, decode):
            offset = s.log_size()
            took = s.stop()
            check(took is not None, f"{s.name}: SIGTERM ended every process" + (f" in {took:.1f} s" if took else ""))
            bad = kvmove_problems(s.lines_since(offset))
            check(not bad, f"{s.name}: no kvmove warning or error at shutdown" + "".join("\n  " + b for b in bad))
        log(f"kvmove vLLM connector check passed in {time.monotonic() - t_start:.0f} s")
        return 0
    except CheckFailed as e:
        report_failure(e, servers)
        return 1
    finally:
        for p in proxies:
            p.stop()
        # Each server's whole process group (its own session: the engine
        # core and the workers too), even when its first process already
        # ended: a group left behind keeps the ports (ci29 found ci28's).
        for s in servers:
            if s.proc is not None:
                s.signal(signal.SIGCONT)
                s.signal(signal.SIGKILL)


def phase_tokens(prefill, decode, proxy, ps, ref):
    m0 = decode.metrics()
    n0 = len(traces(prefill.trace_path))
    got = [routed(proxy.port, p) for p in ps]
    for i, (g, r) in enumerate(zip(got, ref)):
        check(g == r, f"sequential prompt {i} ({LENGTHS[i]} tokens): decode tokens equal the reference")
    seq = sends_ended(prefill.trace_path, n0, len(ps))
    check(
        len(seq) == len(ps) and all(t["state"] == "landed" for t in seq),
        f"the prefill's trace: the {len(ps)} sequential handoffs landed ({[t['state'] for t in seq]})",
    )
    # Layer by layer: a handoff granted before its last layer was computed
    # has its first write start before that too (the grant's arrival
    # depends on the decode's step loop and the machine's load; at least
    # two must qualify: prompts of several chunks give the decode time).
    multi = [t for t in seq if "t_computed" in t and "t_first_write" in t]
    early_grant = [t for t in multi if t.get("t_granted", 1e30) < t["t_computed"]]
    # The longest prompt again, alone: the decode's prefix cache holds its
    # whole blocks from a moment ago (here, before the extra rounds below,
    # whose prompts may evict them), so only its last, partial block is
    # asked of the prefill. (The concurrent pass below may find prefixes
    # too, but how many depends on which blocks its eviction kept: 768 to
    # 0 prompt tokens over five runs.)
    n = len(traces(prefill.trace_path))
    again = routed(proxy.port, ps[-1])
    check(again == ref[-1], f"the {LENGTHS[-1]}-token prompt again: decode tokens equal the reference")
    sends_ended(prefill.trace_path, n, 1)  # its send traced before the extra rounds count theirs

    # Under load the decode's step loop may grant late (ci of d91cf14: one
    # early grant of six): then fresh prompts of the three longest lengths
    # (nothing of them cached on either side; their reference computed
    # after), up to EXTRA_OVERLAP_ROUNDS times, until two were granted early.
    for k in range(1, EXTRA_OVERLAP_ROUNDS + 1):
        if len(early_grant) >= 2:
            break
        fresh = prompts_of(LENGTHS[-3:], seed=48 + k)
        n = len(traces(prefill.trace_path))
        got = [routed(proxy.port, p) for p in fresh]
        want = [plain(prefill.port, p) for p in fresh]
        check(got == want, f"overlap, extra round {k}: the decode's tokens equal the prefill's own")
        more = sends_ended(prefill.trace_path, n, len(fresh))
        check(
            len(more) == len(fresh) and all(t["state"] == "landed" for t in more),
            f"overlap, extra round {k}: the {len(fresh)} handoffs landed ({[t['state'] for t in more]})",
        )
        multi += [t for t in more if "t_computed" in t and "t_first_write" in t]
        early_grant = [t for t in multi if t.get("t_granted", 1e30) < t["t_computed"]]
        log(f"overlap: {len(early_grant)} handoffs granted before their last layer after extra round {k}")
    early = [t for t in early_grant if t["t_first_write"] < t["t_computed"]]
    check(
        len(early_grant) >= 2 and len(early) == len(early_grant),
        f"overlap: of the {len(early_grant)} handoffs granted before their last layer was computed, "
        f"{len(early)} had their first write start before it (all must, at least two)",
    )
    exposed = sorted(1000 * (t["t_ended"] - t["t_computed"]) for t in multi if "t_computed" in t)
    if exposed:
        log(f"exposed transfer time (last layer computed to landed), sequential: median {exposed[len(exposed) // 2]:.1f} ms")

    # Concurrent, twice each prompt, far more than the decode's KV cache
    # holds at once.
    n1 = len(traces(prefill.trace_path))
    nd1 = len(traces(decode.trace_path))
    reqs = ps * CONC_ROUNDS
    with ThreadPoolExecutor(len(reqs)) as pool:
        t0 = time.monotonic()
        conc = list(pool.map(lambda p: attempt(proxy.port, p), reqs))
        took = time.monotonic() - t0
    errors = [c for c in conc if isinstance(c, str)]
    check(not errors, f"{len(reqs)} concurrent requests on a decode of {DECODE_BLOCKS} blocks: none failed {errors[:3]}")
    check(conc == ref * CONC_ROUNDS, f"{len(reqs)} concurrent requests: every decode equals the reference ({took:.1f} s)")
    m1 = decode.metrics()

    def delta(name, **labels):
        return total(m1, name, **labels) - total(m0, name, **labels)

    ext = delta("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    cached = delta("vllm:prompt_tokens_by_source_total", source="local_cache_hit")
    log(f"decode prompt tokens: {ext:.0f} from kvmove, {cached:.0f} from its own prefix cache")
    check(cached > 0, f"the decode's prefix cache served {cached:.0f} prompt tokens (not asked of the prefill)")
    # Every send is traced before its blocks are freed: usage back to zero
    # means the trace holds all of them.
    for s in (prefill, decode):
        u = wait_usage_zero(s)
        check(u == 0, f"{s.name}: KV cache usage back to zero ({u})")
    conc_t = [t for t in traces(prefill.trace_path, n1) if t["role"] == "send"]
    # Backpressure, from the decode's scheduler: its 10 blocks hold fewer
    # requests than the burst (each of the 12 needs its own last, partial
    # block, the longer ones up to 4: 20 or more), so some waited for
    # blocks, asked again step after step, and only then granted. (Whether
    # the prefill had computed a request before its grant came depends on
    # how fast each server runs on a loaded machine: 0 of 12 in ci39, so it
    # is reported, not checked.)
    burst = [t for t in traces(decode.trace_path, nd1) if t["role"] == "recv"]
    # Each of those landed: the prefill's session waited for its grant, no
    # timer counted from the request's arrival failed it.
    held = [t for t in burst if t.get("waited", 0) > 0]
    check(
        held and all(t["state"] == "landed" for t in held),
        f"backpressure: {len(held)} of the decode's {len(burst)} handoffs in the burst waited for its blocks "
        f"(steps: {sorted((t.get('waited', 0) for t in burst), reverse=True)}) and landed "
        f"({sorted({t['state'] for t in held})}): the prefill waited for their grants",
    )
    waited = [t for t in conc_t if "t_granted" in t and "t_computed" in t and t["t_granted"] > t["t_computed"]]
    log(f"the prefill computed {len(waited)} of its {len(conc_t)} handoffs in the burst before their grant came")
    outcomes = sorted({t["state"] for t in conc_t})
    log(f"concurrent handoffs: {len(conc_t)}, outcomes {outcomes}")
    ends_agree(prefill, decode, "sequential and concurrent")

    # vLLM's stats: everything both sides traced, counted on /metrics.
    sent, sent_bytes = kvmove_counts(prefill, "send")
    got, got_bytes = kvmove_counts(decode, "recv")
    want_sent = {}
    for t in traces(prefill.trace_path):
        if t["role"] == "send":
            want_sent[t["state"]] = want_sent.get(t["state"], 0) + 1
    check(
        sent == want_sent,
        f"prefill /metrics: vllm:kvmove_sessions_total {sent} counts the trace's sends {want_sent}",
    )
    landed = sum(1 for t in traces(decode.trace_path) if t["role"] == "recv" and t["state"] == "landed")
    check(got.get("landed") == landed, f"decode /metrics: {got.get('landed')} landed, the trace {landed}")
    check(
        sent_bytes > 0 and sent_bytes == got_bytes,
        f"vllm:kvmove_bytes_total: the prefill sent {sent_bytes:.0f}, the decode received {got_bytes:.0f}",
    )


def attempt(port, prompt):
    try:
        return routed(port, prompt)
    except Exception as e:  # noqa: BLE001 (an HTTP error is what the check looks for)
        return f"{type(e).__name__}: {e}"


def storm(proxy, ps, n, during):
    """``n`` requests at once (the longest prompts), ``during()`` called once
    the prefill is pushing; returns ``(result, seconds)`` per request."""
    out = [None] * n

    def one(i):
        t0 = time.monotonic()
        out[i] = (attempt(proxy.port, ps[-1 - i % 3]), time.monotonic() - t0)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    during()
    for t in threads:
        t.join(300)
    return out


def wait_pushing(prefill, since, timeout=60):
    """Until the prefill has started writing a new handoff (its first
    write is in the worker; the trace is written at each end: one landed
    handoff after ``since`` means the storm is flowing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(t["role"] == "send" for t in traces(prefill.trace_path, since)):
            return True
        time.sleep(0.02)
    return False


def phase_kill_prefill(prefill, decode, proxy, ps, ref):
    """The prefill SIGKILLed mid-push, then restarted. What the decode's
    requests return depends on its ``kv_load_failure_policy``: with
    ``"recompute"`` every one the reference tokens; with ``"fail"`` an
    error for each handoff the decode saw fail (and at least one: the kill
    hit the push), within the liveness timeout of the kill, and the
    reference tokens for the others."""
    refs = {p: r for p, r in zip(ps, ref)}
    n0 = len(traces(prefill.trace_path))
    d0 = len(traces(decode.trace_path))
    policy = decode.kv_config["kv_load_failure_policy"]
    killed = {}

    def kill():
        check(wait_pushing(prefill, n0), "the prefill pushes the storm's KV")
        killed["at"] = time.monotonic()
        prefill.kill(grace=120)

    t0 = time.monotonic()
    out = storm(proxy, ps, 8, kill)
    results = [(r, refs[ps[-1 - i % 3]], took) for (r, took), i in zip(out, range(8))]
    wrong = [r for r, want, _ in results if not isinstance(r, str) and r != want]
    errors = [(r, t0 + took - killed["at"]) for r, _, took in results if isinstance(r, str)]
    slowest = max(took for _, _, took in results)
    what = f"prefill SIGKILLed mid-push (kv_load_failure_policy {policy!r})"
    check(not wrong, f"{what}: no request returned other tokens than the reference {[str(w)[:200] for w in wrong[:2]]}")
    if policy == "fail":
        failed = [t for t in traces(decode.trace_path, d0) if t["role"] == "recv" and t["state"] != "landed"]
        late = max((after for _, after in errors), default=0.0)
        check(
            errors and len(errors) == len(failed) and late < LIVENESS + 15,
            f"{what}: {len(errors)} requests failed, {late:.1f} s after the kill at the latest; the decode saw "
            f"{len(failed)} handoffs fail ({sorted({t['state'] for t in failed})}) {[e[:120] for e, _ in errors[:2]]}",
        )
    else:
        check(
            not errors,
            f"{what}: the decode recomputed, all 8 requests equal the reference (slowest {slowest:.1f} s) "
            f"{[e[:200] for e, _ in errors[:3]]}",
        )
    d = decode.metrics()
    log(f"decode: {total(d, 'vllm:prompt_tokens_by_source_total', source='local_compute'):.0f} prompt tokens computed locally so far")
    u = wait_usage_zero(decode)
    check(u == 0, f"decode: KV cache usage back to zero after the prefill died ({u})")
    # From here on the prefill holds each request until the decode granted
    # (backpressure "hold"; the phases before pushed once computed).
    prefill.kv_config["kv_connector_extra_config"]["backpressure"] = "hold"
    restarted(prefill, proxy, ps, ref, "the restarted prefill serves the decode")


def phase_kill_decode(prefill, decode, proxy, ps, ref):
    n0 = len(traces(prefill.trace_path))

    def kill():
        check(wait_pushing(prefill, n0), "the prefill pushes the storm's KV")
        decode.kill(grace=120)

    storm(proxy, ps, 8, kill)
    u = wait_usage_zero(prefill, timeout=3 * LIVENESS + 30)
    check(u == 0, f"decode SIGKILLed mid-push: the prefill freed every block it held for it ({u})")
    ends = [t["state"] for t in traces(prefill.trace_path, n0) if t["role"] == "send"]
    log(f"the prefill's handoffs in that storm ended: {sorted(set(ends))}")
    # From here on the decode fails a request whose KV failed.
    decode.kv_config["kv_load_failure_policy"] = "fail"
    restarted(decode, proxy, ps, ref, "a restarted decode is served")


def restarted(server, proxy, ps, ref, what):
    server.start()
    server.wait_ready()
    got = [routed(proxy.port, p) for p in ps[-2:]]
    check(got == ref[-2:], f"{what}: tokens equal the reference")


def phase_stop(prefill, decode, proxy, ps, ref, stopped):
    """``stopped`` (the prefill or the decode) SIGSTOPped past the liveness
    timeout mid-push, on a decode whose policy is ``"fail"``."""
    n0 = len(traces(prefill.trace_path))
    d0 = len(traces(decode.trace_path))
    stop_for = 2 * LIVENESS

    def pause():
        check(wait_pushing(prefill, n0), "the prefill pushes the storm's KV")
        stopped.signal(signal.SIGSTOP)
        time.sleep(stop_for)
        stopped.signal(signal.SIGCONT)

    out = storm(proxy, ps, 6, pause)
    refs = {p: r for p, r in zip(ps, ref)}
    results = [(r, refs[ps[-1 - i % 3]]) for (r, _), i in zip(out, range(6))]
    wrong = [r for r, want in results if not isinstance(r, str) and r != want]
    errors = [r for r, _ in results if isinstance(r, str)]
    what = f"{stopped.name} SIGSTOPped {stop_for:.0f} s mid-push"
    check(not wrong, f"{what}: no request returned other tokens than the reference {wrong[:2]}")
    for s in (prefill, decode):
        u = wait_usage_zero(s, timeout=3 * LIVENESS + 30)
        check(u == 0, f"after the {stopped.name}'s pause: {s.name}'s KV cache usage back to zero ({u})")
    failed = [t for t in traces(decode.trace_path, d0) if t["role"] == "recv" and t["state"] != "landed"]
    policy = decode.kv_config["kv_load_failure_policy"]
    # "recompute": none fails; "fail": exactly the requests whose KV failed.
    want = len(failed) if policy == "fail" else 0
    check(
        len(errors) == want,
        f"{what}: with kv_load_failure_policy {policy!r}, {len(errors)} requests failed; the decode saw "
        f"{len(failed)} handoffs fail ({sorted({t['state'] for t in failed})}) {errors[:2]}",
    )
    ends_agree(prefill, decode, f"after the {stopped.name}'s pause")
    if prefill.kv_config["kv_connector_extra_config"].get("backpressure") == "hold":
        sends = [t for t in traces(prefill.trace_path, n0) if t["role"] == "send" and "t_granted" in t and "t_scheduled" in t]
        early = [t["req"] for t in sends if t["t_scheduled"] < t["t_granted"]]
        check(
            sends and not early,
            f"backpressure \"hold\": each of the {len(sends)} handoffs computed was scheduled after its grant {early[:3]}",
        )
    got = [routed(proxy.port, p) for p in ps[-2:]]
    check(got == ref[-2:], f"after the {stopped.name}'s pause: tokens equal the reference")


def prompts_of(lengths, seed=48):
    import random

    from make_model import WORDS

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(n)) for n in lengths]


if __name__ == "__main__":
    sys.exit(main())
