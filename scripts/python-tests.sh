#!/usr/bin/env bash
# Tests of the Python package (python/, the standalone crate kvmove-py):
# fmt and clippy of its Rust code, its Rust unit tests, then a fresh
# virtualenv with `pip install ./python` and the pytest suite (every test
# with a timeout). Called by scripts/test.sh.
#
#   scripts/python-tests.sh            # everything
#   PYTHON=python3.12 scripts/python-tests.sh
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

step() { printf '\n==> python: %s\n' "$*"; }

py=${PYTHON:-python3}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}
venv=${KVMOVE_PY_VENV:-$CARGO_TARGET_DIR/python-venv}
# pyo3 builds against the interpreter the tests use.
export PYO3_PYTHON=$py

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
if [ ! -x "$venv/bin/python" ]; then
  if ! "$py" -m venv "$venv"; then
    rm -rf "$venv"
    "$py" -m pip install -q --user virtualenv
    "$py" -m virtualenv -q "$venv"
  fi
fi
vpy=$venv/bin/python
"$vpy" -m pip install -q --disable-pip-version-check maturin pytest pytest-timeout numpy prometheus_client

step "pip install ./python"
PATH="$venv/bin:$PATH" "$vpy" -m pip install -q --disable-pip-version-check --no-build-isolation --force-reinstall --no-deps ./python

step "pytest python/tests"
# From inside python/ with the pytest script (not `python -m pytest`), so
# `import kvmove` is the installed wheel, not the source directory.
(cd python && "$venv/bin/pytest" -p no:cacheprovider --timeout 120 -q tests)

# The same prefill/decode exchange over RDMA: on this machine's RDMA device,
# else in a soft-RoCE VM (scripts/rxe-vm), with a build that has the RDMA
# backend. In CI (or with RDMA_STRICT=1) it never skips.
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
  rvenv=$CARGO_TARGET_DIR/python-venv-rdma
  wheels=$CARGO_TARGET_DIR/python-wheels-rdma
  [ -x "$rvenv/bin/python" ] || "$py" -m venv "$rvenv" || "$py" -m virtualenv -q "$rvenv"
  "$rvenv/bin/python" -m pip install -q --disable-pip-version-check maturin pytest pytest-timeout numpy prometheus_client
  rm -rf "$wheels"
  (cd python && "$rvenv/bin/maturin" build --release --features rdma --compatibility linux --skip-auditwheel \
    -i "$rvenv/bin/python" -o "$wheels")
  "$rvenv/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$wheels"/*.whl
  run_rdma=("$rvenv/bin/pytest" -p no:cacheprovider --timeout 300 -q -rs tests/test_rdma.py)
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
