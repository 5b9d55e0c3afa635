#!/usr/bin/env bash
# The PD cluster check of scripts/test.sh: 6 real `kvmove pd` engines in
# network namespaces, a 3-member etcd cluster, one of each fault; fails on
# a session whose two ends disagree, wrong bytes, a failure no fault
# explains (a request between live engines during an etcd member restart
# or leader partition), or anything left behind. Needs root, ip, tc, etcd.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
  if [ "${CI:-}" = true ]; then
    echo "pd-cluster: needs root (network namespaces)" >&2
    exit 1
  fi
  echo "PD CLUSTER TESTS SKIPPED: not root (network namespaces need it)"
  exit 0
fi
# The `kvmove` binary the test build made (target/debug/kvmove, with etcd:
# kvmove-cli's dependency on kvmove has it), not `cargo build -p
# kvmove-cli`: a build of that one package resolves its dependencies'
# features without the other members' and their dev-dependencies', and
# rebuilt 48 crates (tokio, tonic, etcd-client, ...) in every CI run (two
# minutes of CPU, four of wall beside the VM and vLLM). In scripts/test.sh
# this finds everything built; alone it builds the test binaries.
cargo test -q --workspace --no-run
scripts/pd-cluster --clean >/dev/null
scripts/pd-cluster --engines "${PD_ENGINES:-6}" --duration "${PD_DURATION:-60}" --seed "${PD_SEED:-1}" \
  --out target/pd-cluster --check
