#!/usr/bin/env bash
# peer-bench.sh: kvmove next to the engines it replaces, on this host
# (python/bench/peers.py says what is measured and how).
#
#   scripts/peer-bench.sh [ROUNDS] [FAULT_ROUNDS]   # default 3 and 2 rounds
#
# The batch and round-trip rows first, then the faults (peers.py --faults:
# the target killed, restarted, frozen; about 5 minutes a round).
#
# The peers and kvmove's wheel are installed into target/peers-venv by
# scripts/peers-venv.sh. iperf3 on loopback
# (installed with apt-get where missing and possible) is the ceiling of a
# single TCP stream, measured before and after the rounds.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
FAULT_ROUNDS=${2:-2}
V=target/peers-venv
scripts/peers-venv.sh

ceiling() {
    if ! command -v iperf3 >/dev/null; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iperf3 >/dev/null 2>&1 || true
        fi
    fi
    if ! command -v iperf3 >/dev/null; then
        echo "iperf3: not installed (no ceiling)"
        return
    fi
    iperf3 -s -1 -p 5299 >/dev/null 2>&1 &
    local srv=$!
    sleep 0.5
    local bps
    bps=$(iperf3 -c 127.0.0.1 -p 5299 -t 4 -J 2>/dev/null |
        "$V/bin/python" -c 'import json,sys; print(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"])')
    wait "$srv" 2>/dev/null || true
    "$V/bin/python" -c "print(f'iperf3 loopback, one TCP stream: {$bps / 8e9:.2f} GB/s')"
}

echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
ceiling
# Run from outside python/ so `import kvmove` is the installed wheel.
(cd target && "../$V/bin/python" ../python/bench/peers.py --rounds "$ROUNDS" --json peer-bench.json)
if [ "$FAULT_ROUNDS" -gt 0 ]; then
    (cd target && "../$V/bin/python" ../python/bench/peers.py --faults "$FAULT_ROUNDS" --json peer-faults.json)
fi
ceiling
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
