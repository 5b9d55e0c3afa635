"""Loaded by the vLLM servers of pd_check.py (on their PYTHONPATH): gives
logger ``kvmove`` a handler that names it, so the check can tell kvmove's
warnings and errors from vLLM's in the servers' logs.

With ``KVMOVE_BENCH_KEEP_AFFINITY=1`` (kvmove_bench.py, the systems on
vLLM's ``NixlConnector``): the connector's CPU worker pins the thread that
builds it to the last core of each NUMA node ("reserve different cores for
start_load_kv()", ``nixl/base_worker.py``), on this 2-core machine core 1
for the prefill and the decode alike, after the benchmark bound each
worker to a core of its own; both servers then compute on core 1. That
one call is skipped, so every system computes with the same binding."""

import logging
import os
import sys

if os.environ.get("KVMOVE_BENCH_KEEP_AFFINITY") == "1" and hasattr(os, "sched_setaffinity"):
    _set_affinity = os.sched_setaffinity

    def _keep_the_bench_binding(pid, cpus):
        caller = sys._getframe(1).f_code.co_filename
        if pid == 0 and caller.replace(os.sep, "/").endswith("kv_connector/v1/nixl/base_worker.py"):
            return None
        return _set_affinity(pid, cpus)

    os.sched_setaffinity = _keep_the_bench_binding

_handler = logging.StreamHandler(sys.stderr)
_handler.setFormatter(logging.Formatter("[kvmove %(levelname)s] %(name)s: %(message)s"))
_logger = logging.getLogger("kvmove")
_logger.addHandler(_handler)
_logger.setLevel(logging.INFO)
_logger.propagate = False
