#!/usr/bin/env bash
# peers-venv.sh: the virtualenv target/peers-venv with the engines kvmove
# replaces, from PyPI (scripts/venvs.sh peers: Mooncake's transfer engine
# without CUDA, NIXL with UCX, numpy), and kvmove's release wheel built from
# this tree (scripts/wheels.sh). A virtualenv of its own, so the real
# `mooncake` and `nixl` packages never shadow kvmove's stand-ins in the test
# virtualenv. Used by scripts/peer-bench.sh and scripts/compat-diff.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/venvs.sh peers
wheel=$(scripts/wheels.sh default | tail -n 1)
target/peers-venv/bin/python -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$wheel"
