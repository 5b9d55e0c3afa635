#!/usr/bin/env bash
# vLLM prefill/decode disaggregation over kvmove, with real vLLM servers
# (the CPU build from PyPI) on loopback: vLLM's NixlConnector on kvmove's
# stand-in (python/vllm_e2e/pd_check.py) and kvmove's own connector,
# kvmove.vllm, behind its router (python/vllm_e2e/kvmove_check.py); each
# script says what it checks. Called by scripts/test.sh; takes about 11
# minutes once the virtualenv exists (scripts/venvs.sh vllm: about 3
# minutes, 6 GB).
#
#   scripts/vllm-tests.sh
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
# Bytecode is written (into the virtualenv, in target/): each server start
# imports torch and vLLM in three processes (see scripts/test.sh).
unset PYTHONDONTWRITEBYTECODE

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}
venv=${KVMOVE_VLLM_VENV:-$CARGO_TARGET_DIR/vllm-venv}
work=$CARGO_TARGET_DIR/vllm-e2e

step() { printf '\n==> vllm: %s\n' "$*"; }

step "virtualenv $venv (scripts/venvs.sh vllm)"
scripts/venvs.sh vllm

step "kvmove's release wheel (scripts/wheels.sh) into the vLLM virtualenv"
wheel=$(scripts/wheels.sh default | tail -n 1)
"$venv/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$wheel"

step "prefill/decode check (python/vllm_e2e/pd_check.py; logs in $work)"
rm -rf "$work"
mkdir -p "$work"
# From outside python/, so `import kvmove` is the installed wheel.
shim=$(cd "$work" && "$venv/bin/python" -m kvmove.shims nixl)
(cd "$work" && "$venv/bin/python" "$root/python/vllm_e2e/pd_check.py" --work "$work" --shim "$shim")

# One after the other: side by side, their four spinning servers starved
# the PD cluster's engines beside them (an unexplained failure there).
step "kvmove's own connector (python/vllm_e2e/kvmove_check.py; logs in $work/native)"
mkdir -p "$work/native"
(cd "$work/native" && "$venv/bin/python" "$root/python/vllm_e2e/kvmove_check.py" --work "$work/native")
