#!/usr/bin/env bash
# Coverage-guided fuzzing (cargo fuzz, libFuzzer) of the TCP backend's
# security boundary, for a bounded time: the frame decoder and the server's
# request handling over real loopback sockets (fuzz/fuzz_targets/). Each
# target runs from an empty corpus for FUZZ_SECONDS (default 30); a crash,
# a hang (10 s per input) or a broken invariant fails the run and leaves
# the input under fuzz/artifacts/. Called by scripts/test.sh.
#
#   scripts/fuzz.sh                      # both targets, 30 s each
#   FUZZ_SECONDS=600 scripts/fuzz.sh server
#
# Sanitizer: none. The code fuzzed forbids unsafe (transport-tcp); libFuzzer
# still sees every panic, overflow check and assertion.
set -euo pipefail
cd "$(dirname "$0")/.."

secs=${FUZZ_SECONDS:-30}
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(frame_decoder server)

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "installing cargo-fuzz"
  cargo install -q cargo-fuzz --locked --version 0.13.2
fi

for t in "${targets[@]}"; do
  printf '\n==> fuzz %s for %s s\n' "$t" "$secs"
  cargo fuzz build -s none "$t"
  corpus=$(mktemp -d)
  log=$(mktemp)
  status=0
  cargo fuzz run -s none "$t" "$corpus" -- -max_total_time="$secs" -timeout=10 -rss_limit_mb=4096 \
    >"$log" 2>&1 || status=$?
  # The final line of libFuzzer's progress: executions, edges covered
  # ("cov"), features, corpus size, executions per second.
  grep -E '^#[0-9]+[[:space:]]+DONE' "$log" || true
  grep -E '^Done [0-9]+ runs' "$log" || true
  rm -rf "$corpus"
  if [ "$status" -ne 0 ]; then
    tail -n 80 "$log"
    echo "FUZZ TARGET $t FAILED (exit $status); the input is under fuzz/artifacts/$t/" >&2
    exit 1
  fi
  rm -f "$log"
done
