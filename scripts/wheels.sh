#!/usr/bin/env bash
# wheels.sh: builds kvmove's Python wheel (python/, release) once per
# feature set into target/wheels/<set>/, for every virtualenv of the tests
# (they all run the same CPython, so one wheel fits all of them).
#
#   scripts/wheels.sh [default] [rdma]    (default: both)
#
#   default  the TCP backend, the stand-ins, metrics
#   rdma     the same with the RDMA backend (feature rdma: libibverbs)
#
# Prints the wheel's path last, one line per set. With KVMOVE_WHEELS_BUILT=1
# (scripts/test.sh sets it once it built them in this run) a set whose
# wheel is there is not built again; without it every call rebuilds (cargo
# rebuilds only what changed).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

py=${PYTHON:-python3}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}
out=$CARGO_TARGET_DIR/wheels

sets=("$@")
[ ${#sets[@]} -gt 0 ] || sets=(default rdma)
for s in "${sets[@]}"; do
  case "$s" in
    default) features=() ;;
    rdma) features=(--features rdma) ;;
    *) echo "wheels: unknown set '$s' (default, rdma)" >&2; exit 2 ;;
  esac
  dir=$out/$s
  if [ "${KVMOVE_WHEELS_BUILT:-0}" = 1 ] && compgen -G "$dir/kvmove-*.whl" >/dev/null; then
    ls "$dir"/kvmove-*.whl
    continue
  fi
  # maturin from the test virtualenv (scripts/venvs.sh python).
  scripts/venvs.sh python >&2
  rm -rf "$dir"
  (cd python && PYO3_PYTHON="$py" "${KVMOVE_PY_VENV:-$CARGO_TARGET_DIR/python-venv}/bin/maturin" build --release "${features[@]}" \
    --compatibility linux --skip-auditwheel -i "$py" -o "$dir" >&2)
  ls "$dir"/kvmove-*.whl
done
