#!/usr/bin/env bash
# compat-diff.sh: the same calls on the real Mooncake / NIXL (from PyPI) and
# on kvmove's stand-ins, outcomes compared (python/difftest/compat_diff.py
# says what is called and what must match). Part of scripts/test.sh.
#
#   scripts/compat-diff.sh [--verbose] [--only mooncake|nixl]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/peers-venv.sh
# From outside python/, so `import kvmove` is the installed wheel.
cd target && ../target/peers-venv/bin/python ../python/difftest/compat_diff.py "$@"
