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
#   --lanes         (or RDMA_TEST_LANES=1) in the VM, run the suites in two
#                   lanes side by side on devices of their own (see the
#                   runner below), both from the start: for iteration.
#                   CI runs them one after the other: with both lanes
#                   from the start, the VM's two busy CPUs starved the
#                   host's builds (ci34: the VM 18 minutes instead of 34,
#                   the run no shorter), and with the second started once
#                   the host's builds were done (RDMA_LANE_B_AFTER, ci47)
#                   the VM was no shorter (26:21) and the host's steps
#                   after the builds ended 5 minutes later;
#   --bench         afterwards run scripts/rdma-bench.sh (our write bandwidth
#                   and latency next to ib_write_bw / ib_write_lat on the same
#                   device in one VM run; prints ratios; never fails the suite).
#
# Environment: RDMA_VM_TIMEOUT (seconds, default 4200) bounds the VM run;
# RDMA_TESTS_THEN (at --build-only) is a shell command the runner runs after
# the suites, in the same VM (scripts/test.sh: the Python RDMA exchange);
# RDMA_LANE_B_AFTER (at --prebuilt, in the VM) is a file: the two lanes run
# on devices of their own, and the second starts once the file exists (or
# the first lane ended), so it runs beside the first only once the host
# that made the file has finished its builds (scripts/test.sh);
# CARGO_TARGET_DIR is honoured; tests are built --release (the VM emulates
# the CPU), RDMA_TESTS_DEBUG=1 builds them unoptimised. Inside the tests, RDMA_REQUIRED=1 makes a
# missing device a failure instead of a skip.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_PKGS="clang libclang-dev pkg-config libibverbs-dev librdmacm-dev"
INSTALL=0 BENCH=0 PHASE=all LANES=${RDMA_TEST_LANES:-0}
while [ $# -gt 0 ]; do
  case "$1" in
    --lanes) LANES=1; shift ;;
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
# Two lanes, each on devices of its own (in the VM, eight: rxe0-rxe3 for
# lane a, rxe4-rxe7 for lane b), so one lane's link faults never touch
# the other's QPs; the kernel counts the suites check are per process.
# The VM mostly waits on timers and emulated links: the two conformance
# passes, one after the other, took 330 + 530 s on a quiet machine
# (ci31); side by side, 369 and 403 s (same CPU time). Lane a: the
# process-heavy churn suite (rdma: a peer process SIGKILLed and restarted
# 200 times) first, while the host mostly builds at a lower priority,
# then the conformance suite on one device per node, the rails,
# notification and side-channel suites, the unit tests, then the caller's
# command (RDMA_TESTS_THEN). Lane b: the conformance suite with two
# devices per node driven as rails (transport_rails::Rails, cases named
# rdma_rails2::...), the longest suite (about 10 minutes). With --lanes
# both start at once; with RDMA_LANE_B_AFTER lane b waits for that file
# or for lane a's end. Without eight faultable links (a real device) the
# lanes run one after the other, on the devices the environment names.
lane_of() {
  case "$(basename "$1")" in
    rdma-*) echo a0 ;; conformance-*) echo a1 ;;
    rails-*) echo a2 ;; notify-*) echo a3 ;; side_channel-*) echo a4 ;; *) echo a5 ;;
  esac
}
mapfile -t bins < <(for b in "${bins[@]}"; do printf '%s %s\n' "$(lane_of "$b")" "$b"; done | sort -k1,1 -s | cut -d" " -f2-)
for b in "${bins[@]}"; do echo "rdma-tests: lane $(lane_of "$b" | cut -c1): $b"; done

# One test binary of a lane (see run() below), with the caller's filters.
emit_run() { # LANE LABEL COMMAND...
  printf '  run %s %q' "$1" "$2"; shift 2
  printf ' %q' "$@" --test-threads=1 "${FILTER[@]}"
  echo
}
{
  echo 'set -u'
  # The conformance hooks here are link flaps and netem in a VM that
  # emulates its CPU and shares the host: a cut (two flaps, each waited
  # for) took over 20 s, the suite's default hang limit, beside two busy
  # loops (ci28). A slower limit for them (CONFORMANCE_WAIT_S; cases get
  # three of it).
  echo "export RDMA_REQUIRED=1 RUST_BACKTRACE=1 CONFORMANCE_WAIT_S=${CONFORMANCE_WAIT_S:-40}"
  cat <<'RUNNER'
rdma link 2>/dev/null; ibv_devices 2>/dev/null
logs=$(mktemp -d /tmp/rdma-lanes.XXXXXX)
start=$(date +%s)
# The lanes' deadline (RDMA_LANE_TIMEOUT seconds; scripts/rdma-tests.sh
# sets it inside the VM's own bound): a suite that hangs is stopped and
# reported, and every lane's log is still printed.
deadline=$(( start + ${RDMA_LANE_TIMEOUT:-86400} ))
exec 3>&1
# run LANE LABEL COMMAND...: one suite; every failure is reported, and one
# line on the console says how it ended (the lanes' logs follow at the end).
run() {
  lane=$1 label=$2; shift 2
  echo "==> $label"
  s=$(date +%s); left=$(( deadline - s )); [ "$left" -gt 1 ] || left=1
  timeout -k 10 "$left" "$@"; r=$?
  took=$(( $(date +%s) - s ))
  case $r in
    0) what=passed ;;
    124) what="FAILED (stopped at the lanes' deadline, RDMA_LANE_TIMEOUT=${RDMA_LANE_TIMEOUT:-})" ;;
    137)
      if [ "$took" -ge "$left" ]; then
        what="FAILED (stopped at the lanes' deadline, RDMA_LANE_TIMEOUT=${RDMA_LANE_TIMEOUT:-})"
      else
        # Killed before its deadline: the VM's memory, most likely.
        oom=$(dmesg 2>/dev/null | grep -i "out of memory" | tail -n 1)
        what="FAILED (SIGKILL before the deadline; the kernel's last word on memory: ${oom:-none})"
      fi ;;
    *) what="FAILED (exit $r)" ;;
  esac
  [ "$r" = 0 ] || echo "$label" >> "$logs/failed"
  echo "rdma-tests: lane $lane: $label $what in $took s, $(( $(date +%s) - start )) s into the run" >&3
}
set -- ${RDMA_TEST_FAULT_LINKS:-}
split=0
if [ $# -ge 8 ]; then
  split=1
  links_a="$1 $2 $3 $4" links_b="$5 $6 $7 $8" dev_a=${1%%:*} dev_b=${5%%:*}
fi
RUNNER
  echo 'lane_a() {'
  echo '  [ "$split" = 0 ] || export RDMA_TEST_FAULT_LINKS="$links_a" RDMA_TEST_DEVICE="$dev_a"'
  for b in "${bins[@]}"; do
    case "$(lane_of "$b")" in a*) emit_run a "$(basename "$b")" "$b" ;; esac
    # Then its device runs about data and device memory with CUDA memory
    # through the real CUDA provider over the CUDA driver double (35 s).
    case "$(basename "$b")" in conformance-*)
      emit_run a "$(basename "$b") (CUDA over the driver double)" env RDMA_CONFORMANCE_CUDA=1 "$b" ;;
    esac
  done
  # A command of the caller's after the suites, on the same devices (or
  # in the same VM); its failure is the run's failure.
  if [ -n "${RDMA_TESTS_THEN:-}" ]; then
    printf '  run a %q sh -c %q\n' "$RDMA_TESTS_THEN" "$RDMA_TESTS_THEN"
  fi
  echo '}'
  echo 'lane_b() {'
  echo '  [ "$split" = 0 ] || export RDMA_TEST_FAULT_LINKS="$links_b" RDMA_TEST_DEVICE="$dev_b"'
  for b in "${bins[@]}"; do
    case "$(basename "$b")" in conformance-*)
      emit_run b "$(basename "$b") (two rails per node)" env RDMA_CONFORMANCE_RAILS=2 "$b" ;;
    esac
  done
  echo '}'
  cat <<'RUNNER'
if [ "$split" = 1 ]; then
  echo "rdma-tests: two lanes side by side: a on $links_a, b on $links_b"
  ( lane_a; touch "$logs/a.done" ) > "$logs/a.log" 2>&1 &
  (
    if [ -n "${RDMA_LANE_B_AFTER:-}" ]; then
      echo "rdma-tests: lane b waits for $RDMA_LANE_B_AFTER or lane a's end" >&3
      while [ ! -e "$RDMA_LANE_B_AFTER" ] && [ ! -e "$logs/a.done" ] && [ "$(date +%s)" -lt "$deadline" ]; do
        sleep 2
      done
      echo "rdma-tests: lane b starts, $(( $(date +%s) - start )) s into the run" >&3
    fi
    lane_b
  ) > "$logs/b.log" 2>&1 &
  wait
  for l in a b; do echo "==> lane $l's log"; cat "$logs/$l.log"; done
else
  ( lane_a ); ( lane_b )
fi
# The kernel's soft-RoCE has a known bug (Debian 6.1: rxe_completer can
# end a READ with IBV_WC_SUCCESS before its bytes landed, then break the
# QP; scripts/rxe-vm keeps the emulated network from dropping, so its
# retransmit path is rarely taken). If it fired, say so next to any failure.
if dmesg 2>/dev/null | grep -q "WARNING.*rxe_comp"; then
  echo "rdma-tests: the kernel soft-RoCE (rdma_rxe) reported an internal error in this run:"
  dmesg | grep -A2 "WARNING.*rxe_comp" | head -3
fi
if [ -s "$logs/failed" ]; then
  echo "rdma-tests: failed: $(tr '\n' ';' < "$logs/failed")"
  exit 1
fi
exit 0
RUNNER
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
  # With two lanes (--lanes, RDMA_LANE_B_AFTER), eight: four for each, and
  # 4 GiB (the two conformance passes side by side peaked at 1.6 GiB used;
  # at 2 GiB one of them was killed for memory). The bound: about 26
  # minutes one lane after the other on a quiet machine; beside two busy
  # loops (ci28) the VM got about half a core and its suites ended just
  # past 3300 s. The lanes stop two minutes before it, so their logs are
  # printed.
  vm=(--devices 4)
  if [ "$LANES" = 1 ] || [ -n "${RDMA_LANE_B_AFTER:-}" ]; then
    vm=(--devices 8 --mem 4096)
  fi
  [ "$LANES" = 1 ] && unset RDMA_LANE_B_AFTER
  vm_timeout=${RDMA_VM_TIMEOUT:-4200}
  export RDMA_LANE_TIMEOUT=$(( vm_timeout > 300 ? vm_timeout - 120 : vm_timeout ))
  RXE_VM_PASS_ENV="${RXE_VM_PASS_ENV:-} RDMA_LANE_TIMEOUT RDMA_LANE_B_AFTER" \
    scripts/rxe-vm "${vm[@]}" --timeout "$vm_timeout" -- sh "$runner" || rc=$?
  echo "rdma-tests: VM run took $(( $(date +%s) - start )) s"
fi
if [ "$rc" = 0 ]; then echo "rdma-tests: RDMA suite passed"; else echo "rdma-tests: RDMA suite FAILED (exit $rc)" >&2; fi
if [ "$BENCH" = 1 ]; then
  scripts/rdma-bench.sh || echo "rdma-tests: benchmark failed (not counted)" >&2
fi
exit "$rc"
