#!/usr/bin/env bash
# Runs every test of the project: formatting, lints, the Rust test suites
# (unit, conformance over mock and real loopback TCP, etcd against a real
# server), coverage-guided fuzzing of the TCP server for a bounded time,
# the RDMA suite (directly on an RDMA device, else in a soft-RoCE VM),
# the Python package's tests, the same calls on the real Mooncake and NIXL
# and on kvmove's stand-ins (scripts/compat-diff.sh), and real vLLM servers
# doing prefill/decode disaggregation over kvmove (scripts/vllm-tests.sh),
# kvmove's SGLang backend on SGLang's own code (scripts/sglang-tests.sh),
# and the template transport built outside the workspace against the
# crates as `cargo package` makes them (scripts/template-check.sh).
#
#   scripts/test.sh            # everything (what CI runs)
#   scripts/test.sh --quick    # for iteration, never CI: fmt, clippy, the
#                              # unit and conformance suites of the core,
#                              # policy, mock and TCP, Python without the VM
#   SKIP_RDMA=1 scripts/test.sh  # everything but the RDMA VM (local iteration only)
#   SKIP_VLLM=1 scripts/test.sh  # everything but the vLLM check (local iteration only)
#   SKIP_PEERS=1 scripts/test.sh # everything but the real Mooncake / NIXL comparison (local only)
#   SKIP_CLUSTER=1 scripts/test.sh # everything but the PD cluster in network namespaces (local only)
#   SKIP_SGLANG=1 scripts/test.sh  # everything but kvmove.sglang on SGLang's code (local only)
#
# The machine has 2 cores and the whole run is CPU-bound: the soft-RoCE VM
# runs its RDMA suites on about one core for about 25 minutes, the builds
# take both cores, and the conformance suites mostly wait on their faults'
# timers. So the RDMA test binaries are built first and the VM runs in the
# background under everything else, the Python RDMA exchange in the same VM
# after the suites; the wheels are built next (once for every virtualenv,
# scripts/wheels.sh), while the VM boots; builds and installs run niced
# (`quiet`), so the VM and the timing-sensitive suites get the CPU first;
# the test binaries run three at a time (scripts/test-binaries) while the
# fuzz targets build; the vLLM checks run in the background once the
# builds are done; the virtualenvs install in the background from the
# start. Every run ends, pass or fail, with a table of each step's wall and
# CPU time (scripts/lib/steps.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

quick=0
case "${1:-}" in
  --quick) quick=1 ;;
  "") ;;
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "usage: $0 [--quick]" >&2; exit 64 ;;
esac
if [ "$quick" = 1 ] && [ "${CI:-}" = true ]; then
  echo "scripts/test.sh: --quick is for iteration; CI runs everything" >&2
  exit 64
fi

. scripts/lib/steps.sh
steps_init

# Python writes bytecode, whatever the machine's environment says: every
# vLLM server start imports torch and vLLM in three processes, and without
# .pyc files (the virtualenvs are installed --no-compile) each compiles
# them from source again (vLLM's API server import: 21.8 s without, 10.3 s
# with, on this 2-core machine). The virtualenvs live in target/.
unset PYTHONDONTWRITEBYTECODE

# A build or an install: at a lower priority than the VM and the suites.
# Nice 5, not more: a CPU shared with strangers (two busy loops beside the
# run, ci26) left builds at nice 10 about a twentieth of a core, the wheel
# still compiling 24 minutes in; at 5 they keep a third of one, and on a
# quiet machine the VM and the suites still come first (weight 1024 to 335).
build_nice=5
quiet() { nice -n "$build_nice" "$@"; }

# Whether a suite that a local run may skip with its SKIP_ variable runs
# (never skipped in CI).
runs() {
  local var=$1 title=$2
  if [ "${!var:-0}" = 1 ] && [ "${CI:-}" != true ]; then
    echo "$title SKIPPED: $var=1 (never allowed in CI)"
    return 1
  fi
  return 0
}

if [ "$quick" = 1 ]; then
  step "cargo fmt --check" cargo fmt --all -- --check
  step "cargo clippy --all-targets -- -D warnings" cargo clippy --workspace --all-targets -- -D warnings
  step "cargo test: core, policy, mock and TCP (unit + conformance, three binaries at a time)" \
    scripts/test-binaries -p transport-mem -p transport-core -p kvmove-policy -p transport-mock -p conformance -p transport-tcp
  step "Python package tests without the VM" scripts/python-tests.sh --no-rdma
  step "quick tests passed (scripts/test.sh without --quick runs everything)" true
  exit 0
fi

rdma=0 cluster=0 peers=0 vllm=0 sglang=0
runs SKIP_RDMA "RDMA tests" && rdma=1
runs SKIP_CLUSTER "the PD cluster" && cluster=1
runs SKIP_PEERS "the real Mooncake / NIXL comparison" && peers=1
runs SKIP_VLLM "the vLLM check" && vllm=1
runs SKIP_SGLANG "kvmove.sglang on SGLang's code" && sglang=1

# Network-bound: every virtualenv's packages from PyPI, while the CPU
# builds. Two at once: the small ones the wheels' tests need (ready within
# a minute or two), and the peers' and vLLM's (the vLLM one is 6 GB).
small=(python)
[ "$rdma" = 1 ] && small+=(rdma)
big=()
[ "$peers" = 1 ] && big+=(peers)
[ "$vllm" = 1 ] && big+=(vllm)
# On top of the vLLM one (scripts/venvs.sh makes that first).
[ "$sglang" = 1 ] && big+=(sglang)
small_step="Python virtualenvs for kvmove's wheels (scripts/venvs.sh ${small[*]})"
big_step="Python virtualenvs of the peers and vLLM (scripts/venvs.sh ${big[*]})"
spawn "$small_step" quiet scripts/venvs.sh "${small[@]}"
[ ${#big[@]} -gt 0 ] && spawn "$big_step" quiet scripts/venvs.sh "${big[@]}"

step "cargo fmt --check" cargo fmt --all -- --check

vm_step="RDMA suites, then the Python RDMA exchange, in the soft-RoCE VM (background; scripts/rdma-tests.sh)"
# Written by the RDMA wheel's install below, read in the VM: the Python
# exchange runs there after the suites, with no VM of its own.
py_rdma_marker=${CARGO_TARGET_DIR:-target}/python-rdma-wheel.ready
if [ "$rdma" = 1 ]; then
  rm -f "$py_rdma_marker"
  # First, so the VM (about 25 minutes, about one core) runs under
  # everything that follows. (Not niced: the VM waits for it.)
  step "RDMA test binaries, release (scripts/rdma-tests.sh --build-only)" \
    env RDMA_TESTS_THEN="scripts/python-tests.sh --rdma-after $py_rdma_marker" scripts/rdma-tests.sh --build-only
  # One lane after the other: the two-rail pass in a second lane once the
  # host's builds were done (rdma-tests.sh RDMA_LANE_B_AFTER, ci47) took
  # CPU from the fuzz build and the test binaries, started the vLLM checks
  # 5:30 later and ended the run at 35:20; the VM itself was no shorter
  # (26:21, its two lanes slowing each other).
  spawn "$vm_step" scripts/rdma-tests.sh --prebuilt
fi

# The wheels early, while the VM boots and the vLLM virtualenv installs:
# the RDMA wheel is then in place long before the VM's Python exchange.
join "$small_step"
wheel_sets=(default)
[ "$rdma" = 1 ] && wheel_sets+=(rdma)
step "kvmove's Python wheels, release, once for every virtualenv (scripts/wheels.sh ${wheel_sets[*]})" \
  quiet scripts/wheels.sh "${wheel_sets[@]}"
export KVMOVE_WHEELS_BUILT=1
if [ "$rdma" = 1 ]; then
  step "the RDMA wheel into its virtualenv, for the VM's Python exchange (scripts/python-tests.sh --rdma-install)" \
    scripts/python-tests.sh --rdma-install "$py_rdma_marker"
fi

step "cargo clippy --all-targets -- -D warnings" quiet cargo clippy --workspace --all-targets -- -D warnings

step "the crates' layering and no module cycles (scripts/check-layers)" scripts/check-layers

# The provider's tests run with the workspace's (kvmove-cuda-double's
# tests, against the CUDA driver double; on a GPU: scripts/gpu-tests.sh);
# here the CUDA build of the TCP backend's device benchmark is linted.
step "the CUDA provider builds and lints without CUDA (feature cuda)" \
  quiet cargo clippy -p transport-mem -p transport-tcp --features transport-mem/cuda,transport-tcp/cuda --all-targets -- -D warnings

# The test binaries are built here, then run in the background, three at
# a time (scripts/test-binaries: libtest's own output per binary, so a case
# a backend cannot run still shows as "ignored", which nextest would list
# as passed), while the fuzzing targets build.
step "cargo test --workspace --no-run (build the test binaries)" quiet cargo test --workspace --no-run
tests_step="cargo test --workspace: every test binary and the doc tests, three at a time (background; scripts/test-binaries)"
spawn "$tests_step" scripts/test-binaries --jobs 3

step "fuzz the TCP server and frame decoder (bounded: FUZZ_SECONDS each, default 30)" env FUZZ_BUILD_NICE="$build_nice" scripts/fuzz.sh

[ ${#big[@]} -gt 0 ] && join "$big_step"
vllm_step="vLLM prefill/decode over kvmove (background; real vLLM servers, CPU build)"
if [ "$vllm" = 1 ]; then
  # After the builds: vLLM's CPU servers spin (a second of busy-waiting
  # after each step), which starved every build beside them (clippy took
  # 13 minutes instead of 4). Its ports, 18300-18441, are its own.
  spawn "$vllm_step" scripts/vllm-tests.sh
fi

step "Python package tests (scripts/python-tests.sh --no-rdma)" scripts/python-tests.sh --no-rdma

join "$tests_step"

# Beside the vLLM checks and the VM, so its build at the lowest priority
# while the vLLM checks run: built at the builds' own (nice 5) beside them
# (ci38), it left a decode answering in 6.3 s with its prefill frozen (the
# check allowed 5). At the end, alone, it was the run's last 1:52 (ci44).
# Once they end, at the builds' own: at 19 beside two busy loops it got
# 1.5 % of a CPU and would have run as long as the loops did (ci53).
step "the template transport out of tree, on the crates as cargo package makes them (scripts/template-check.sh)" \
  env TEMPLATE_BUILD_NICE=19 TEMPLATE_BUILD_NICE_WHILE="$(step_pid "$vllm_step")" \
  TEMPLATE_BUILD_NICE_AFTER="$build_nice" scripts/template-check.sh

if [ "$peers" = 1 ]; then
  step "the same calls on the real Mooncake and NIXL (PyPI) and on kvmove's stand-ins" scripts/compat-diff.sh
fi

# After the vLLM checks' spinning servers, while the VM runs on: the run
# waits for the VM here anyway. The SGLang tests' rank processes time their
# polls; the PD cluster's engines judge each other by a 1 s liveness
# timeout, and beside the vLLM servers one decode went silent to one
# prefill for 1.02 s with no fault on either (CI of stop 72; the stall
# probe saw no host stall).
if [ "$vllm" = 1 ] && { [ "$sglang" = 1 ] || [ "$cluster" = 1 ]; }; then
  join "$vllm_step"
  vllm_joined=1
fi
if [ "$cluster" = 1 ]; then
  step "a PD cluster on one machine: 6 engines in network namespaces, 3-member etcd, one of each fault" \
    scripts/pd-cluster-tests.sh
fi
if [ "$sglang" = 1 ]; then
  step "kvmove's SGLang backend on SGLang 0.5.23's own code (scripts/sglang-tests.sh)" scripts/sglang-tests.sh
fi

if [ "$rdma" = 1 ]; then
  join "$vm_step"
fi

# The debug build is not needed past this point (the vLLM check uses the
# release wheel): on a machine short of disk, in CI, it goes (the vLLM
# virtualenv alone is 6 GB), else it stays for the next --quick.
if [ "${CI:-}" = true ] && [ "$(df -k --output=avail . | tail -1)" -lt $(( 20 * 1024 * 1024 )) ]; then
  echo "less than 20 GB free: removing the debug build"
  rm -rf "${CARGO_TARGET_DIR:-target}/debug"
fi

if [ "$vllm" = 1 ] && [ "${vllm_joined:-0}" != 1 ]; then
  join "$vllm_step"
fi

step "all tests passed" true
