#!/usr/bin/env bash
# Runs every test of the project: formatting, lints, the Rust test suites
# (unit, conformance over mock and real loopback TCP, etcd against a real
# server), coverage-guided fuzzing of the TCP server for a bounded time,
# the RDMA suite (directly on an RDMA device, else in a soft-RoCE VM),
# the Python package's tests, the same calls on the real Mooncake and NIXL
# and on kvmove's stand-ins (scripts/compat-diff.sh), and real vLLM servers
# doing prefill/decode disaggregation over kvmove (scripts/vllm-tests.sh).
#
#   scripts/test.sh            # everything
#   SKIP_RDMA=1 scripts/test.sh  # everything but the RDMA VM (local iteration only)
#   SKIP_VLLM=1 scripts/test.sh  # everything but the vLLM check (local iteration only)
#   SKIP_PEERS=1 scripts/test.sh # everything but the real Mooncake / NIXL comparison (local only)
#   SKIP_CLUSTER=1 scripts/test.sh # everything but the PD cluster in network namespaces (local only)
set -euo pipefail
cd "$(dirname "$0")/.."

# Each step says how much disk is left: a full run needs about 12 GB more
# than the checkout (with .ci/run's settings), most of it the vLLM virtualenv.
step() { printf '\n==> %s   [disk: %s free]\n' "$*" "$(df -h --output=avail . | tail -1 | tr -d ' ')"; }

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy --all-targets -- -D warnings"
cargo clippy --workspace --all-targets -- -D warnings

step "the crates' layering and no module cycles (scripts/check-layers)"
scripts/check-layers

step "the CUDA provider builds and lints without CUDA (feature cuda; its GPU tests: scripts/gpu-tests.sh)"
cargo clippy -p transport-mem -p transport-tcp --features transport-mem/cuda,transport-tcp/cuda --all-targets -- -D warnings
cargo test -p transport-mem --features cuda

step "cargo test --workspace"
# Plain `cargo test`, not nextest: the conformance runner reports a case a
# backend cannot run as "ignored" at run time, which only libtest's output
# shows (nextest would list it as passed).
cargo test --workspace --no-fail-fast

step "fuzz the TCP server and frame decoder (bounded: FUZZ_SECONDS each, default 30)"
scripts/fuzz.sh

# A suite that a local run may skip with its SKIP_ variable (never in CI):
# suite VAR SCRIPT TITLE
suite() {
  local var=$1 script=$2 title=$3
  [ -x "$script" ] || return 0
  if [ "${!var:-0}" = 1 ] && [ "${CI:-}" != true ]; then
    echo "$title SKIPPED: $var=1 (never allowed in CI)"
    return 0
  fi
  step "$title"
  "$script"
}

suite SKIP_CLUSTER scripts/pd-cluster-tests.sh "a PD cluster on one machine: 6 engines in network namespaces, 3-member etcd, one of each fault"

suite SKIP_RDMA scripts/rdma-tests.sh "RDMA tests"

if [ -x scripts/python-tests.sh ]; then
  step "Python package tests"
  scripts/python-tests.sh
fi

suite SKIP_PEERS scripts/compat-diff.sh "the same calls on the real Mooncake and NIXL (PyPI) and on kvmove's stand-ins"

# In CI, the debug build is not needed past this point (the vLLM check
# builds its wheel in release) and its disk goes to the vLLM virtualenv.
if [ "${CI:-}" = true ]; then
  rm -rf "${CARGO_TARGET_DIR:-target}/debug"
fi

suite SKIP_VLLM scripts/vllm-tests.sh "vLLM prefill/decode over kvmove (real vLLM servers, CPU build)"

step "all tests passed"
