#!/usr/bin/env bash
# The TCP backend's benchmark next to iperf3 (single stream, loopback):
# each bandwidth measurement runs right after an iperf3 run of the same
# length, three rounds, medians and ratios printed. Usage: transport-tcp/bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v iperf3 >/dev/null; then
    (apt-get install -y iperf3 || (apt-get update && apt-get install -y iperf3)) >/dev/null
fi
echo "# load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
cargo bench -q -p transport-tcp --bench tcp_bench 2>/dev/null
echo "# load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
