#!/usr/bin/env bash
# Tests of the Python package (python/, the standalone crate kvmove-py):
# fmt and clippy of its Rust code, its Rust unit tests, then the release
# wheel (scripts/wheels.sh) in the test virtualenv (scripts/venvs.sh) and
# the pytest suite (every test with a timeout), then the RDMA exchange with
# the RDMA wheel (on a device, else in the soft-RoCE VM). Called by
# scripts/test.sh.
#
#   scripts/python-tests.sh              # everything
#   scripts/python-tests.sh --no-rdma    # everything but the RDMA exchange
#   scripts/python-tests.sh --rdma-only  # only the RDMA exchange
#
# scripts/test.sh splits the exchange so it runs in the RDMA suites' VM,
# after them, with no VM of its own:
#   scripts/python-tests.sh --rdma-install MARKER  # here: the RDMA wheel into
#                                    # its virtualenv, then MARKER says so
#   scripts/python-tests.sh --rdma-after MARKER    # on the device (in the
#                                    # VM): waits for MARKER (at most 30 min),
#                                    # then the exchange
#   PYTHON=python3.12 scripts/python-tests.sh
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

step() { printf '\n==> python: %s\n' "$*"; }

mode=all marker=
case "${1:-}" in
  --no-rdma) mode=no-rdma ;;
  --rdma-only) mode=rdma-only ;;
  --rdma-install|--rdma-after)
    mode=${1#--}
    marker=${2:?"usage: $0 $1 MARKER"}
    ;;
  "") ;;
  *) echo "usage: $0 [--no-rdma | --rdma-only | --rdma-install MARKER | --rdma-after MARKER]" >&2; exit 64 ;;
esac

py=${PYTHON:-python3}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}
venv=${KVMOVE_PY_VENV:-$CARGO_TARGET_DIR/python-venv}
# pyo3 builds against the interpreter the tests use.
export PYO3_PYTHON=$py

# fmt, clippy and unit tests of python/, then the pytest suite.
host_tests() {
step "cargo fmt --check (python/)"
(cd python && cargo fmt -- --check)

step "cargo clippy --all-targets -- -D warnings (python/)"
(cd python && cargo clippy --all-targets -- -D warnings)

step "cargo test (python/)"
libdir=$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR") or "")')
ldlib=$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("LDLIBRARY") or "")')
if [ -n "$libdir" ] && [ -e "$libdir/$ldlib" ] && [[ "$ldlib" == *.so* ]]; then
  (cd python && LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" cargo test)
else
  echo "!!! RUST UNIT TESTS OF python/ SKIPPED: no shared libpython ($libdir/$ldlib) to link them against"
  echo "!!! (install the python dev package); the pytest suite below still covers the same code"
fi

step "virtualenv $venv"
scripts/venvs.sh python

step "the release wheel (scripts/wheels.sh) into $venv"
wheel=$(scripts/wheels.sh default | tail -n 1)
"$venv/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$wheel"

step "pytest python/tests"
# From inside python/ with the pytest script (not `python -m pytest`), so
# `import kvmove` is the installed wheel, not the source directory.
(cd python && "$venv/bin/pytest" -p no:cacheprovider --timeout 120 -q tests)

step "python/tests/test_cuda.py against the CUDA driver double (CUDA DRIVER DOUBLE, NOT A GPU)"
# The double (transport-mem/cuda-double) found as libcuda.so.1 on the
# library path, as the real driver is: CUDA device memory through both
# Python APIs and the real CUDA provider; a skip fails (KVMOVE_REQUIRE_CUDA).
double=$(cargo build -q -p kvmove-cuda-double --message-format=json |
  "$venv/bin/python" -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "build-script-executed" and "cuda-double" in m.get("package_id", ""):
        print(m["out_dir"] + "/libkvmove_cuda_double.so")' | tail -n 1)
[ -f "$double" ] || { echo "the CUDA driver double was not built" >&2; exit 1; }
cudalib=$(mktemp -d)
ln -s "$double" "$cudalib/libcuda.so.1"
ln -s "$double" "$cudalib/libcuda.so"
(cd python && LD_LIBRARY_PATH="$cudalib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" KVMOVE_REQUIRE_CUDA=1 \
  "$venv/bin/pytest" -p no:cacheprovider --timeout 120 -q -rs tests/test_cuda.py) || { rm -rf "$cudalib"; exit 1; }
rm -rf "$cudalib"
}

# The same prefill/decode exchange over RDMA: on this machine's RDMA device,
# else in a soft-RoCE VM (scripts/rxe-vm), with a build that has the RDMA
# backend. In CI (or with RDMA_STRICT=1) it never skips.
rvenv=${KVMOVE_PY_VENV:-$CARGO_TARGET_DIR/python-venv}-rdma
run_rdma=("$rvenv/bin/pytest" -p no:cacheprovider --timeout 300 -q -rs tests/test_rdma.py)

# (Each line checked: called as an `if` condition it runs without errexit.)
install_rdma() {
  scripts/venvs.sh rdma || return 1
  rwheel=$(scripts/wheels.sh rdma | tail -n 1) || return 1
  "$rvenv/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$rwheel" || return 1
  # Bytecode now, here: the soft-RoCE VM sees this tree read-only, so
  # without .pyc files every Python process in it (pytest, each peer it
  # starts) compiles numpy, pytest and kvmove from source again, in an
  # emulated CPU. A failure here costs time, not the exchange.
  local site
  site=$("$rvenv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') &&
    "$rvenv/bin/python" -m compileall -q -j 0 "$site" python/tests > /dev/null ||
    echo "python-tests: compiling the RDMA virtualenv's bytecode failed; the VM compiles it each time" >&2
}

# --rdma-after: the exchange on the device here once MARKER says the wheel
# is installed ("ok"; anything else, or no word within 30 minutes, fails).
rdma_after() {
  step "RDMA exchange (python/tests/test_rdma.py), once $marker says the wheel is in"
  local waited=0
  while [ ! -s "$marker" ]; do
    if [ "$waited" -ge 1800 ]; then
      echo "PYTHON RDMA TESTS FAILED TO RUN: $marker never appeared (30 min)" >&2
      exit 1
    fi
    sleep 2
    waited=$(( waited + 2 ))
  done
  if [ "$(cat "$marker")" != ok ]; then
    echo "PYTHON RDMA TESTS FAILED TO RUN: the RDMA wheel was not installed ($marker: $(cat "$marker"))" >&2
    exit 1
  fi
  echo "(waited ${waited} s for the wheel)"
  compgen -G "/sys/class/infiniband/*" >/dev/null || { echo "PYTHON RDMA TESTS FAILED TO RUN: no RDMA device here" >&2; exit 1; }
  cd python && RDMA_REQUIRED=1 exec "${run_rdma[@]}"
}

rdma_exchange() {
step "RDMA exchange (python/tests/test_rdma.py)"
rdma_skip() {
  if [ "${CI:-}" = true ] || [ "${RDMA_STRICT:-0}" = 1 ]; then
    echo "PYTHON RDMA TESTS FAILED TO RUN: $*" >&2
    exit 1
  fi
  echo "!!! PYTHON RDMA TESTS SKIPPED: $*"
}
if [ "${SKIP_RDMA:-0}" = 1 ] && [ "${CI:-}" != true ]; then
  echo "!!! PYTHON RDMA TESTS SKIPPED: SKIP_RDMA=1 (never allowed in CI)"
elif [ ! -e /usr/include/infiniband/verbs.h ]; then
  rdma_skip "libibverbs headers missing (scripts/rdma-tests.sh --install-deps installs them)"
else
  install_rdma
  if compgen -G "/sys/class/infiniband/*" >/dev/null; then
    (cd python && RDMA_REQUIRED=1 "${run_rdma[@]}")
  elif [[ "$rvenv/" == /tmp/* && "$rvenv/" != "$root/"* ]]; then
    # The guest gets a fresh tmpfs on /tmp with only the checkout mounted
    # in it: a venv elsewhere under /tmp is invisible there.
    rdma_skip "CARGO_TARGET_DIR is under /tmp outside the checkout, which the soft-RoCE VM cannot see"
  elif scripts/rxe-vm --check >/dev/null 2>&1; then
    # Share the whole checkout (not only python/): the venv lives in target/.
    RXE_VM_PASS_ENV="RDMA_REQUIRED" RDMA_REQUIRED=1 \
      scripts/rxe-vm --timeout "${RDMA_VM_TIMEOUT:-900}" -- sh -c 'cd python && exec "$@"' sh "${run_rdma[@]}"
  else
    rdma_skip "no RDMA device and no soft-RoCE VM here ($(scripts/rxe-vm --check 2>&1 | tail -1))"
  fi
fi
}

# (In an if, not after || : a function called as the left side of || runs
# with errexit off.)
case "$mode" in
  rdma-install)
    step "the RDMA wheel into $rvenv (then $marker says so)"
    # Written whole (rename), so the waiting side never reads half of it.
    if install_rdma; then word=ok; else word=failed; fi
    echo "$word" > "$marker.new" && mv "$marker.new" "$marker"
    [ "$word" = ok ]
    ;;
  rdma-after) rdma_after ;;
  *)
    if [ "$mode" != rdma-only ]; then host_tests; fi
    if [ "$mode" != no-rdma ]; then rdma_exchange; fi
    ;;
esac
