#!/usr/bin/env bash
# Coverage-guided fuzzing (cargo fuzz, libFuzzer) of the TCP backend's
# security boundary, for a bounded time (fuzz/fuzz_targets/): the frame
# decoder; the server's request machine in process (transport-tcp's
# requests.rs, driven against real memory and a model of it, thousands of
# inputs a second); and the whole server over real loopback sockets. The
# targets run side by side, each from an empty corpus for FUZZ_SECONDS
# (default 30) of wall-clock time; a crash,
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
[ ${#targets[@]} -gt 0 ] || targets=(frame_decoder requests server)

# FUZZ_BUILD_NICE: the niceness of the builds (scripts/test.sh builds at a
# lower priority than the suites running beside them).
build=(nice -n "${FUZZ_BUILD_NICE:-0}")

# The targets are built the way `cargo fuzz build -s none` (cargo-fuzz
# 0.13) builds them, without installing cargo-fuzz (a minute and a half of
# compiling on this machine, in every fresh CI run): release with line
# tables, debug assertions and overflow checks on, one codegen unit, and
# LLVM's SanitizerCoverage instrumentation that libFuzzer (libfuzzer-sys)
# reads. Same flags, same target dir: `cargo fuzz run` reuses this build.
triple=$(rustc -vV | sed -n 's/^host: //p')
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing \
-Cllvm-args=-simplifycfg-branch-fold-threshold=0 -Cllvm-args=-sanitizer-coverage-stack-depth \
-Cdebug-assertions -Ccodegen-units=1"
bins=()
for t in "${targets[@]}"; do bins+=(--bin "$t"); done
"${build[@]}" cargo build --manifest-path fuzz/Cargo.toml --target "$triple" --release \
  --config 'profile.release.debug="line-tables-only"' "${bins[@]}"
unset RUSTFLAGS
out=fuzz/target/$triple/release

# Build every target first, then fuzz them side by side (each libFuzzer
# process is single-threaded; FUZZ_SECONDS is each one's wall-clock bound).
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
pids=()
for t in "${targets[@]}"; do
  mkdir -p "$dir/$t.corpus"
  mkdir -p "fuzz/artifacts/$t"
  "$out/$t" -artifact_prefix="fuzz/artifacts/$t/" -max_total_time="$secs" -timeout=10 -rss_limit_mb=4096 "$dir/$t.corpus" \
    >"$dir/$t.log" 2>&1 &
  pids+=($!)
done
failed=0
for i in "${!targets[@]}"; do
  t=${targets[$i]} status=0
  wait "${pids[$i]}" || status=$?
  printf '\n==> fuzz %s for %s s\n' "$t" "$secs"
  # The final line of libFuzzer's progress: executions, edges covered
  # ("cov"), features, corpus size, executions per second.
  grep -E '^#[0-9]+[[:space:]]+DONE' "$dir/$t.log" || true
  grep -E '^Done [0-9]+ runs' "$dir/$t.log" || true
  if [ "$status" -ne 0 ]; then
    tail -n 80 "$dir/$t.log"
    echo "FUZZ TARGET $t FAILED (exit $status); the input is under fuzz/artifacts/$t/" >&2
    failed=1
  fi
done
exit "$failed"
