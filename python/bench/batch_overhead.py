"""Per-call cost of kvmove.Engine batches from Python (issue: drop-in
fidelity, results without per-item objects).

    python bench/batch_overhead.py [--n 1024] [--page 4096] [--reps 30]

Two engines in this process on loopback TCP; one batch of ``n`` pages
written with ``Session.write_many`` (median and best of ``reps``), next to
the same batch through the Mooncake API's ``batch_transfer_sync_write``
(both kvmove; the difference is what each API does in Python per request).
"""

import argparse
import statistics
import time

import numpy as np

import kvmove
from kvmove import mooncake


def timed(fn, reps):
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts), min(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--page", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    size = a.n * a.page
    src, dst = np.ones(size, dtype=np.uint8), np.zeros(size, dtype=np.uint8)

    with kvmove.Engine() as e1, kvmove.Engine() as e2:
        r1, r2 = e1.register(src), e2.register(dst)
        s = e1.connect(e2.session_id)
        ops = [(r1.addr + i * a.page, r2.addr + i * a.page, a.page) for i in range(a.n)]
        med, best = timed(lambda: s.write_many(ops), a.reps)
        print(f"kvmove.Engine write_many {a.n} x {a.page}: median {med * 1e3:.3f} ms, best {best * 1e3:.3f} ms")

    t1, t2 = mooncake.TransferEngine(), mooncake.TransferEngine()
    for t in (t1, t2):
        assert t.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert t1.register_memory(src.ctypes.data, size) == 0 and t2.register_memory(dst.ctypes.data, size) == 0
    peer = t2.get_session_id()
    locs = [src.ctypes.data + i * a.page for i in range(a.n)]
    rems = [dst.ctypes.data + i * a.page for i in range(a.n)]
    lens = [a.page] * a.n

    def mc():
        assert t1.batch_transfer_sync_write(peer, locs, rems, lens) == 0

    med, best = timed(mc, a.reps)
    print(f"kvmove Mooncake API batch_transfer_sync_write {a.n} x {a.page}: median {med * 1e3:.3f} ms, best {best * 1e3:.3f} ms")
    t1.close()
    t2.close()


if __name__ == "__main__":
    main()
