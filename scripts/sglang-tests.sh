#!/usr/bin/env bash
# kvmove.sglang against SGLang's own code: SGLang 0.5.23 from PyPI (no GPU,
# no model), its plugin loader, bootstrap server, registration, discovery
# and queues, with kvmove's transfer backend (python/sglang_tests; each test
# says what is SGLang's code and what stands in for the rest). Called by
# scripts/test.sh; about 2 minutes once the virtualenv exists
# (scripts/venvs.sh sglang: on top of the vLLM one, a few MB more).
#
#   scripts/sglang-tests.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
unset PYTHONDONTWRITEBYTECODE

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}
venv=$CARGO_TARGET_DIR/sglang-venv
work=$CARGO_TARGET_DIR/sglang-e2e

step() { printf '\n==> sglang: %s\n' "$*"; }

step "virtualenv $venv (scripts/venvs.sh sglang)"
scripts/venvs.sh sglang

step "kvmove's release wheel (scripts/wheels.sh) into the SGLang virtualenv"
wheel=$(scripts/wheels.sh default | tail -n 1)
"$venv/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$wheel"

step "pytest python/sglang_tests"
rm -rf "$work"
mkdir -p "$work"
# From outside python/, so `import kvmove` is the installed wheel; SGLang's
# plugin loader finds kvmove through the wheel's entry point.
(cd "$work" && "$venv/bin/python" -m pytest -p no:cacheprovider -q -rs --timeout 600 "$root/python/sglang_tests" "$@")
