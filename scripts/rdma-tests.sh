#!/usr/bin/env bash
# rdma-tests.sh: runs the RDMA backend's tests (transport-rdma) against real
# kernel RDMA.
#
#   scripts/rdma-tests.sh [--install-deps] [--bench] [-- TEST-FILTER...]
#   scripts/rdma-tests.sh --build-only [-- TEST-FILTER...]  # build, write the runner
#   scripts/rdma-tests.sh --prebuilt                        # run what --build-only left
#
# * If this machine has an RDMA device (/sys/class/infiniband/* exists) the
#   test binaries run here, directly.
# * Otherwise they are built here (cargo test --no-run) and run inside a
#   soft-RoCE VM by scripts/rxe-vm (qemu TCG; rdma_rxe devices rxe0..rxe3 on
#   veth links joined by a bridge, which the tests fault: link down, netem
#   stalls).
# * If neither is possible it prints "RDMA SUITE SKIPPED: <reason>" and
#   exits 0, unless CI=true or RDMA_STRICT=1: then it exits 1 (CI never
#   skips).
#
# Options:
#   --install-deps  apt-get install what building and the VM need (root):
#                   build: clang libclang-dev pkg-config libibverbs-dev
#                          librdmacm-dev
#                   VM:    see scripts/rxe-vm (qemu, kernel, busybox, rdma-core,
#                          perftest, ...)
#                   CI=true implies it.
#   --build-only    only build the test binaries and write the script that
#                   runs them (target/rdma-tests-run.sh), so the build can
#                   take the CPU while something else runs, and the run
#                   (mostly emulation) overlap with other suites;
#   --prebuilt      run target/rdma-tests-run.sh as --build-only left it;
#   --bench         afterwards run scripts/rdma-bench.sh (our write bandwidth
#                   and latency next to ib_write_bw / ib_write_lat on the same
#                   device in one VM run; prints ratios; never fails the suite).
#
# Environment: RDMA_VM_TIMEOUT (seconds, default 4200) bounds the VM run;
# RDMA_TESTS_THEN (at --build-only) is a shell command the runner runs after
# the suites, in the same VM (scripts/test.sh: the Python RDMA exchange);
# CARGO_TARGET_DIR is honoured; tests are built --release (the VM emulates
# the CPU), RDMA_TESTS_DEBUG=1 builds them unoptimised. Inside the tests, RDMA_REQUIRED=1 makes a
# missing device a failure instead of a skip.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_PKGS="clang libclang-dev pkg-config libibverbs-dev librdmacm-dev"
INSTALL=0 BENCH=0 PHASE=all
while [ $# -gt 0 ]; do
  case "$1" in
    --install-deps) INSTALL=1; shift ;;
    --bench) BENCH=1; shift ;;
    --build-only) PHASE=build; shift ;;
    --prebuilt) PHASE=run; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) break ;;
  esac
done
FILTER=("$@")

strict=0
if [ "${CI:-}" = true ] || [ "${RDMA_STRICT:-0}" = 1 ]; then strict=1; fi
[ "${CI:-}" = true ] && INSTALL=1

skip() {
  echo
  echo "=================================================================="
  echo "RDMA SUITE SKIPPED: $*"
  echo "=================================================================="
  if [ "$strict" = 1 ]; then
    echo "rdma-tests: skipping is not allowed here (CI=true or RDMA_STRICT=1)" >&2
    exit 1
  fi
  exit 0
}

if [ "$INSTALL" = 1 ]; then
  missing=()
  for p in $BUILD_PKGS; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
      echo "rdma-tests: installing ${missing[*]}"
      apt-get update -qq >/dev/null
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    else
      echo "rdma-tests: cannot install ${missing[*]} (not root)" >&2
    fi
  fi
fi

have_device=0
if compgen -G "/sys/class/infiniband/*" >/dev/null; then have_device=1; fi

if [ "$have_device" = 0 ]; then
  vm_args=()
  [ "$INSTALL" = 1 ] && vm_args+=(--install)
  if ! why=$(scripts/rxe-vm "${vm_args[@]}" --check 2>&1); then
    skip "no RDMA device and no soft-RoCE VM possible: $why"
  fi
fi

command -v cargo >/dev/null || skip "cargo not found"
if ! pkg-config --exists libibverbs 2>/dev/null; then
  skip "libibverbs-dev is not installed (run scripts/rdma-tests.sh --install-deps)"
fi

# The runner lives in the target dir, inside the checkout the VM mounts.
runner=${CARGO_TARGET_DIR:-target}/rdma-tests-run.sh
build() {
echo "rdma-tests: building the transport-rdma test binaries"
# Release build: the VM emulates the CPU (TCG), and the suites' own
# checking code (models, canaries) is many times slower unoptimised.
profile=(--release)
[ "${RDMA_TESTS_DEBUG:-0}" = 1 ] && profile=()
# No debug info (the workspace's release profile has some, for profiling):
# the Python wheels (scripts/wheels.sh, release, none) then reuse most of
# these dependencies from the same target dir. A panic still names its
# file and line.
export CARGO_PROFILE_RELEASE_DEBUG=${CARGO_PROFILE_RELEASE_DEBUG:-0}
json=$(cargo test "${profile[@]}" --manifest-path transport-rdma/Cargo.toml --no-run --message-format=json 2>/dev/null) || {
  cargo test "${profile[@]}" --manifest-path transport-rdma/Cargo.toml --no-run >&2 || true
  echo "rdma-tests: build failed" >&2
  exit 1
}
mapfile -t bins < <(printf '%s\n' "$json" | grep '"reason":"compiler-artifact"' \
  | grep '"test":true' | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | sort -u)
[ ${#bins[@]} -gt 0 ] || { echo "rdma-tests: no test binaries were built" >&2; exit 1; }
# The order they run in: the process-heavy suite first (rdma: its churn
# test SIGKILLs and restarts a peer process 200 times), while the host
# mostly builds at a lower priority; in scripts/test.sh the end of the run
# has the vLLM servers beside the VM, and there the churn crawled (ci21:
# 174 cycles in its 780 s window, 0.8 s a cycle on a quiet machine), while
# the conformance cases mostly wait on their own timers.
rank() {
  case "$(basename "$1")" in
    rdma-*) echo 0 ;; side_channel-*) echo 1 ;; transport_rdma-*) echo 2 ;;
    conformance-*) echo 3 ;; notify-*) echo 4 ;; *) echo 5 ;;
  esac
}
mapfile -t bins < <(for b in "${bins[@]}"; do printf '%s %s\n' "$(rank "$b")" "$b"; done | sort -n -k1,1 -s | cut -d' ' -f2-)
printf 'rdma-tests: %s\n' "${bins[@]}"

# The runner (same for both places): every binary, one test thread (the
# kernel-count tests read process-wide counts), all failures reported.
{
  echo 'set -u; rc=0'
  # The conformance hooks here are link flaps and netem in a VM that
  # emulates its CPU and shares the host: a cut (two flaps, each waited
  # for) took over 20 s, the suite's default hang limit, beside two busy
  # loops (ci28). A slower limit for them (CONFORMANCE_WAIT_S; cases get
  # three of it).
  echo "export RDMA_REQUIRED=1 RUST_BACKTRACE=1 CONFORMANCE_WAIT_S=${CONFORMANCE_WAIT_S:-40}"
  echo 'rdma link 2>/dev/null; ibv_devices 2>/dev/null'
  for b in "${bins[@]}"; do
    printf 'echo "==> %s"\n' "$(basename "$b")"
    printf '%q --test-threads=1' "$b"
    for f in "${FILTER[@]}"; do printf ' %q' "$f"; done
    echo ' || rc=1'
    # The conformance suite again with two devices per node driven as
    # rails (transport_rails::Rails), cases named rdma_rails2::...
    case "$(basename "$b")" in conformance-*)
      printf 'echo "==> %s (two rails per node)"\n' "$(basename "$b")"
      printf 'RDMA_CONFORMANCE_RAILS=2 %q --test-threads=1' "$b"
      for f in "${FILTER[@]}"; do printf ' %q' "$f"; done
      echo ' || rc=1'
    esac
  done
  # A command of the caller's after the suites, on the same device (or in
  # the same VM); its failure is the run's failure.
  if [ -n "${RDMA_TESTS_THEN:-}" ]; then
    printf 'echo %q\n' "==> $RDMA_TESTS_THEN"
    printf '%s || rc=1\n' "$RDMA_TESTS_THEN"
  fi
  # The kernel's soft-RoCE has a known bug (Debian 6.1: rxe_completer can
  # end a READ with IBV_WC_SUCCESS before its bytes landed, then break the
  # QP; scripts/rxe-vm keeps the emulated network from dropping, so its retransmit
  # path is rarely taken). If it fired, say so next to any failure.
  echo 'if dmesg 2>/dev/null | grep -q "WARNING.*rxe_comp"; then echo "rdma-tests: the kernel soft-RoCE (rdma_rxe) reported an internal error in this run:"; dmesg | grep -A2 "WARNING.*rxe_comp" | head -3; fi'
  echo 'exit $rc'
} > "$runner.new"
mv "$runner.new" "$runner"
}
if [ "$PHASE" = run ]; then
  [ -s "$runner" ] || { echo "rdma-tests: no $runner (run with --build-only first)" >&2; exit 1; }
else
  build
  [ "$PHASE" = build ] && { echo "rdma-tests: built; run with --prebuilt"; exit 0; }
fi

rc=0
if [ "$have_device" = 1 ]; then
  echo "rdma-tests: RDMA device present; running on this machine"
  sh "$runner" || rc=$?
else
  echo "rdma-tests: no RDMA device; running in a soft-RoCE VM (scripts/rxe-vm)"
  start=$(date +%s)
  # Four devices: the rails tests give each of two nodes two of its own.
  # The bound: about 26 minutes on a quiet machine; beside two busy loops
  # (ci28) the VM got about half a core and its suites ended just past
  # 3300 s.
  scripts/rxe-vm --devices 4 --timeout "${RDMA_VM_TIMEOUT:-4200}" -- sh "$runner" || rc=$?
  echo "rdma-tests: VM run took $(( $(date +%s) - start )) s"
fi
if [ "$rc" = 0 ]; then echo "rdma-tests: RDMA suite passed"; else echo "rdma-tests: RDMA suite FAILED (exit $rc)" >&2; fi
if [ "$BENCH" = 1 ]; then
  scripts/rdma-bench.sh || echo "rdma-tests: benchmark failed (not counted)" >&2
fi
exit "$rc"
