#!/usr/bin/env bash
# The TCP backend's benchmark next to iperf3 (single stream, loopback):
# each bandwidth measurement runs right after an iperf3 run of the same
# length, three rounds, medians and ratios printed; 4 KiB write latency
# (transport and Engine) next to a plain ping-pong in the same run.
#
# Usage: transport-tcp/bench.sh
#        HALT_POLL_NS=200000 transport-tcp/bench.sh
#
# On a KVM guest with the haltpoll cpuidle driver and guest_halt_poll_ns 0
# (this development machine), every idle vCPU halts and waking it costs
# tens of microseconds: a quiet machine's ping-pong is then 60-80 us and
# swings with load, and any latency ratio measures wake-ups, not software.
# HALT_POLL_NS sets the guest's halt polling for the run (root only) and
# restores the old value on exit; the bench prints the setting in force.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v iperf3 >/dev/null; then
    (apt-get install -y iperf3 || (apt-get update && apt-get install -y iperf3)) >/dev/null
fi
knob=/sys/module/haltpoll/parameters/guest_halt_poll_ns
if [ -n "${HALT_POLL_NS:-}" ]; then
    if [ -w "$knob" ]; then
        old=$(cat "$knob")
        trap 'echo "$old" > "$knob"' EXIT
        echo "$HALT_POLL_NS" > "$knob"
    else
        echo "# HALT_POLL_NS ignored: $knob is not writable here" >&2
    fi
fi
echo "# load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
cargo bench -q -p transport-tcp --bench tcp_bench 2>/dev/null
echo "# load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
