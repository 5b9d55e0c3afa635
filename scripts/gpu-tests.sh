#!/usr/bin/env bash
# Device memory against the real CUDA provider, on a machine with an NVIDIA
# GPU (issue 24), or against the CUDA driver double (issue 51).
#
#   scripts/gpu-tests.sh                 # build here and run (needs cargo)
#   scripts/gpu-tests.sh --build DIR     # only build the binaries into DIR
#   scripts/gpu-tests.sh --prebuilt DIR  # run binaries built with --build
#                                        # (a GPU machine without a network)
#   scripts/gpu-tests.sh --double        # everything below against the
#                                        # CUDA driver double, on any machine
#
# Runs: the CUDA provider's tests (transport-mem/cuda-double/tests/
# provider.rs: pointer classification, expandable segments, copies through
# regions, contexts, dma-buf, the process-wide lookup), the conformance
# suite's device runs over TCP with CUDA memory, then device_bench
# --cuda (64 MiB device-to-device writes over TCP on loopback against
# host-to-host, verified, with the provider's copy bandwidth), then, where
# the Python virtualenv of scripts/python-tests.sh exists,
# python/tests/test_cuda.py. Prints what it ran. Without a GPU (and
# without --double) it prints "GPU TESTS NOT RUN" and exits 2: it never
# passes without having run. With --double its first and last lines say
# "CUDA DRIVER DOUBLE, NOT A GPU": the double proves the provider's driver
# calls, their order and contexts, its error handling and what it gives
# back; only a GPU proves real copies, GPUDirect and speed.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
step() { printf '\n==> gpu: %s\n' "$*"; }

mode=run dir="" double=0
case "${1:-}" in
  --build) mode=build dir=${2:?--build DIR} ;;
  --prebuilt) mode=prebuilt dir=${2:?--prebuilt DIR} ;;
  --double) double=1 ;;
  "") ;;
  *) echo "usage: $0 [--build DIR | --prebuilt DIR | --double]" >&2; exit 64 ;;
esac

build() {
  local out=$1
  mkdir -p "$out"
  # The provider's test binary (kvmove-cuda-double's tests), the double
  # itself (the tests load it when not on a GPU), and the bench.
  local found bin lib
  found=$(cargo test --release -p kvmove-cuda-double --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "provider":
        print("bin", m["executable"])
    if m.get("reason") == "build-script-executed" and "cuda-double" in m.get("package_id", ""):
        print("lib", m["out_dir"] + "/libkvmove_cuda_double.so")')
  bin=$(echo "$found" | sed -n 's/^bin //p' | tail -n1)
  lib=$(echo "$found" | sed -n 's/^lib //p' | tail -n1)
  [ -n "$bin" ] && [ -f "$lib" ] || { echo "cannot find the CUDA provider's test binary or the double" >&2; exit 1; }
  cp "$bin" "$out/cuda-provider-tests"
  cp "$lib" "$out/"
  # The conformance suite's device runs over TCP with CUDA memory.
  bin=$(cargo test --release -p transport-tcp --test conformance_cuda --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "conformance_cuda":
        print(m["executable"])' | tail -n1)
  [ -n "$bin" ] || { echo "cannot find the TCP conformance binary for CUDA" >&2; exit 1; }
  cp "$bin" "$out/conformance-cuda-tcp"
  cargo build --release -p transport-tcp --features cuda --example device_bench
  cp "${CARGO_TARGET_DIR:-$root/target}/release/examples/device_bench" "$out/device_bench"
  echo "built into $out: cuda-provider-tests conformance-cuda-tcp libkvmove_cuda_double.so device_bench"
}

if [ "$mode" = build ]; then
  build "$dir"
  exit 0
fi

banner=""
if [ "$double" = 1 ]; then
  banner="CUDA DRIVER DOUBLE, NOT A GPU"
  echo "$banner: scripts/gpu-tests.sh --double runs the GPU tests against kvmove's CUDA driver double"
else
  gpu=""
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    gpu=$(nvidia-smi -L | head -n 4)
  fi
  if [ -z "$gpu" ]; then
    echo "GPU TESTS NOT RUN: no NVIDIA GPU or driver here (nvidia-smi -L found none); the CUDA provider was not exercised"
    echo "(scripts/gpu-tests.sh --double runs them against the CUDA driver double)"
    exit 2
  fi
  step "GPUs"
  echo "$gpu"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
fi

if [ "$mode" = run ]; then
  dir=${CARGO_TARGET_DIR:-$root/target}/gpu-tests
  build "$dir"
fi

if [ "$double" = 1 ]; then
  # Every process below finds the double as the driver, as a real one is
  # found: libcuda.so.1 (and libcuda.so) on the library path.
  lib=$(mktemp -d)
  trap 'rm -rf "$lib"' EXIT
  ln -s "$dir/libkvmove_cuda_double.so" "$lib/libcuda.so.1"
  ln -s "$dir/libkvmove_cuda_double.so" "$lib/libcuda.so"
  export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  step "CUDA provider tests against the double (each in a process of its own)"
  KVMOVE_CUDA_DOUBLE_LIB="$dir/libkvmove_cuda_double.so" "$dir/cuda-provider-tests" --test-threads 1
  step "the conformance suite's device runs over TCP with CUDA memory, against the double"
  KVMOVE_CUDA_DOUBLE_LIB="$dir/libkvmove_cuda_double.so" "$dir/conformance-cuda-tcp"
else
  step "CUDA provider tests against the GPU"
  KVMOVE_CUDA_TESTS=gpu "$dir/cuda-provider-tests" --test-threads 1
  step "the conformance suite's device runs over TCP with CUDA memory on the GPU"
  KVMOVE_CUDA_TESTS=gpu "$dir/conformance-cuda-tcp"
fi

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
  # A GPU (or the double) is here: a CUDA test that skips fails instead.
  (cd python && KVMOVE_REQUIRE_CUDA=1 "$venv/bin/pytest" -p no:cacheprovider --timeout 300 -q -rs tests/test_cuda.py tests/test_device_memory.py)
else
  step "python: no virtualenv at $venv (run scripts/python-tests.sh first): Python CUDA tests NOT RUN"
fi
echo
ran="CUDA provider tests, TCP device conformance runs, device_bench --cuda$([ -x "$venv/bin/pytest" ] && echo ", python test_cuda.py")"
if [ "$double" = 1 ]; then
  echo "$banner: ran $ran against the CUDA driver double"
else
  echo "GPU TESTS RAN: $ran"
fi
