#!/usr/bin/env bash
# The TCP backend's benchmark next to iperf3 (single stream, loopback),
# measured in the same run; prints the ratios. Usage: transport-tcp/bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v iperf3 >/dev/null; then
    (apt-get install -y iperf3 || (apt-get update && apt-get install -y iperf3)) >/dev/null
fi
iperf3 -s -1 -p 5299 >/dev/null 2>&1 &
sleep 0.5
ipf=$(iperf3 -c 127.0.0.1 -p 5299 -t 5 -J | python3 -c 'import json,sys; print("%.2f" % (json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"]/1e9))')
wait || true
out=$(cargo bench -q -p transport-tcp --bench tcp_bench 2>/dev/null)
echo "$out"
echo "iperf3_single_stream_gbps $ipf"
echo "$out" | awk -v ipf="$ipf" '/^bw_/ { printf "%s_ratio_to_iperf3 %.2f\n", $1, $2/ipf }'
