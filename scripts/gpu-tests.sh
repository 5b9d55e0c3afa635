#!/usr/bin/env bash
# Device memory against the real CUDA provider, on a machine with an NVIDIA
# GPU (issue 24). CI has no GPU: there the fake device carries the same
# paths (conformance `memory::device_regions`, python/tests/test_device_memory.py).
#
#   scripts/gpu-tests.sh                 # build here and run (needs cargo)
#   scripts/gpu-tests.sh --build DIR     # only build the binaries into DIR
#   scripts/gpu-tests.sh --prebuilt DIR  # run binaries built with --build
#                                        # (a GPU machine without a network)
#
# Runs: the CUDA provider's own tests (pointer classification, copies
# through regions, the process-wide lookup), then device_bench --cuda (64
# MiB device-to-device writes over TCP on loopback against host-to-host,
# verified, with the provider's copy bandwidth), then, where the Python
# virtualenv of scripts/python-tests.sh exists, python/tests/test_cuda.py.
# Prints what it ran. Without a GPU it prints "GPU TESTS NOT RUN" and exits
# 2: it never passes without having run.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
step() { printf '\n==> gpu: %s\n' "$*"; }

mode=run dir=""
case "${1:-}" in
  --build) mode=build dir=${2:?--build DIR} ;;
  --prebuilt) mode=prebuilt dir=${2:?--prebuilt DIR} ;;
  "") ;;
  *) echo "usage: $0 [--build DIR | --prebuilt DIR]" >&2; exit 64 ;;
esac

build() {
  local out=$1
  mkdir -p "$out"
  # The test binary of transport-mem with the CUDA provider, and the bench.
  local bin
  bin=$(cargo test --release -p transport-mem --features cuda --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "transport_mem":
        print(m["executable"])' | tail -n1)
  [ -n "$bin" ] || { echo "cannot find the transport-mem test binary" >&2; exit 1; }
  cp "$bin" "$out/transport-mem-tests"
  cargo build --release -p transport-tcp --features cuda --example device_bench
  cp "${CARGO_TARGET_DIR:-$root/target}/release/examples/device_bench" "$out/device_bench"
  echo "built into $out: transport-mem-tests device_bench"
}

if [ "$mode" = build ]; then
  build "$dir"
  exit 0
fi

gpu=""
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  gpu=$(nvidia-smi -L | head -n 4)
fi
if [ -z "$gpu" ]; then
  echo "GPU TESTS NOT RUN: no NVIDIA GPU or driver here (nvidia-smi -L found none); the CUDA provider was not exercised"
  exit 2
fi
step "GPUs"
echo "$gpu"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

if [ "$mode" = run ]; then
  dir=${CARGO_TARGET_DIR:-$root/target}/gpu-tests
  build "$dir"
fi

step "CUDA provider tests (transport-mem --features cuda, GPU tests included)"
"$dir/transport-mem-tests" --include-ignored --test-threads 1

step "device_bench --cuda: 64 MiB writes over TCP on loopback, host->host vs device->device"
"$dir/device_bench" 3 --cuda
step "device_bench --cuda --staging=16: the same through pinned staging buffers (TcpConfig::staging_buffers)"
"$dir/device_bench" 3 --cuda --staging=16
step "device_bench --cuda --read, unstaged and --staging=16: 64 MiB reads into device memory"
"$dir/device_bench" 3 --cuda --read
"$dir/device_bench" 3 --cuda --read --staging=16

venv=${KVMOVE_PY_VENV:-${CARGO_TARGET_DIR:-$root/target}/python-venv}
if [ -x "$venv/bin/pytest" ]; then
  step "python/tests/test_cuda.py and test_device_memory.py (CUDA memory through both APIs)"
  # A GPU is here: a CUDA test that skips fails instead.
  (cd python && KVMOVE_REQUIRE_CUDA=1 "$venv/bin/pytest" -p no:cacheprovider --timeout 300 -q -rs tests/test_cuda.py tests/test_device_memory.py)
else
  step "python: no virtualenv at $venv (run scripts/python-tests.sh first): Python CUDA tests NOT RUN"
fi
echo
echo "GPU TESTS RAN: CUDA provider tests, device_bench --cuda$([ -x "$venv/bin/pytest" ] && echo ", python test_cuda.py")"
