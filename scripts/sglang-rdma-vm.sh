#!/usr/bin/env bash
# kvmove.sglang over the RDMA backend, in the soft-RoCE VM (scripts/rxe-vm):
# the kill tests of python/sglang_tests (a decode killed mid-transfer, a
# prefill killed mid-transfer; TCP runs them in the test command), with
# KVMOVE_CONFIG naming `kind = "rdma"`, and the kernel's QPs (`rdma res show
# qp`) counted before and after: they must be back at their baseline.
#
# Not part of the test command: the VM's emulated CPU (TCG) runs Python
# about 30x slower, so each SGLang rank takes minutes to import and the run
# takes about 30 minutes. Waits are stretched by KVMOVE_TEST_SLOW (default
# 20 here); the bounds on failure detection after a kill are not.
#
#   scripts/sglang-rdma-vm.sh [pytest -k expression]
#   (default: "killed_mid_transfer and not pipeline")
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}
case "$CARGO_TARGET_DIR" in
  "$root"/*) ;;
  *) echo "sglang-rdma-vm: CARGO_TARGET_DIR must be inside the checkout (the VM sees only it read-write)" >&2; exit 3 ;;
esac
tests=${1:-killed_mid_transfer and not pipeline}
venv=$CARGO_TARGET_DIR/sglang-venv
site=$CARGO_TARGET_DIR/sglang-rdma-site
work=$CARGO_TARGET_DIR/sglang-rdma-e2e

step() { printf '\n==> sglang-rdma-vm: %s\n' "$*"; }

step "virtualenv $venv (scripts/venvs.sh sglang)"
scripts/venvs.sh sglang
step "kvmove's RDMA wheel (scripts/wheels.sh rdma) into $site, ahead of any other kvmove"
wheel=$(scripts/wheels.sh rdma | tail -n 1)
rm -rf "$site"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --target "$site" "$wheel"
rm -rf "$work"
mkdir -p "$work"

step "the VM (2 soft-RoCE devices): QPs before, pytest -k '$tests', QPs after"
# The guest's part as a file: rxe-vm quotes its command for bash, and a
# multi-line `sh -c` string would reach the guest's sh in bash's $'...'.
cat > "$work/guest.sh" <<'GUEST'
set -u
work=$1 venv=$2 site=$3 root=$4 tests=$5
# The guest sees the host's root read-only: caches (torch's, Hugging
# Face's) go to the guest's tmpfs.
export HOME=/tmp/home XDG_CACHE_HOME=/tmp/cache TORCHINDUCTOR_CACHE_DIR=/tmp/cache/inductor
mkdir -p "$HOME" "$XDG_CACHE_HOME"
printf '[backend]\nkind = "rdma"\n' > /tmp/kvmove-rdma.toml
qps() { rdma res show qp | grep -c . || true; }
before=$(qps)
echo "QPs before: $before"; rdma res show qp
# The most QPs seen while the tests run (every 2 s): more than the
# baseline shows the transfers went over RDMA.
( peak=0; while :; do n=$(qps); [ "$n" -gt "$peak" ] && peak=$n && echo "$peak" > /tmp/qp-peak; sleep 2; done ) &
sampler=$!
cd "$work" && KVMOVE_CONFIG=/tmp/kvmove-rdma.toml PYTHONPATH=$site KVMOVE_TEST_SLOW=${KVMOVE_TEST_SLOW:-20} \
  "$venv/bin/python" -m pytest -p no:cacheprovider -q -rA --timeout 3000 -k "$tests" "$root/python/sglang_tests/test_backend.py"
rc=$?
kill "$sampler" 2>/dev/null
echo "QPs at most while the tests ran: $(cat /tmp/qp-peak 2>/dev/null || echo "$before")"
after=$(qps)
echo "QPs after: $after"; rdma res show qp
if [ "$after" != "$before" ]; then
  echo "sglang-rdma-vm: QPs not back at their baseline ($before before, $after after)"
  [ "$rc" = 0 ] && rc=1
fi
exit $rc
GUEST
scripts/rxe-vm --devices 2 --mem 6144 --timeout "${SGLANG_RDMA_VM_TIMEOUT:-3300}" -- \
  sh "$work/guest.sh" "$work" "$venv" "$site" "$root" "$tests"
