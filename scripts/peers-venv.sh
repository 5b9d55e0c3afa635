#!/usr/bin/env bash
# peers-venv.sh: the virtualenv target/peers-venv with the engines kvmove
# replaces, from PyPI, next to kvmove's wheel built from this tree: Mooncake's
# transfer engine without CUDA (mooncake-transfer-engine-non-cuda), NIXL with
# UCX (nixl-cu12, --no-deps: it moves host memory without CUDA or torch),
# numpy. A virtualenv of its own, so the real `mooncake` and `nixl` packages
# never shadow kvmove's stand-ins in the test virtualenv.
# Used by scripts/peer-bench.sh and scripts/compat-diff.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
V=target/peers-venv
if [ ! -x "$V/bin/python" ]; then
    if ! python3 -m venv "$V"; then
        rm -rf "$V"
        python3 -m pip install -q --user virtualenv
        python3 -m virtualenv -q "$V"
    fi
fi
pip=("$V/bin/pip" install -q --disable-pip-version-check)
"${pip[@]}" maturin numpy mooncake-transfer-engine-non-cuda==0.3.13.post1
"${pip[@]}" --no-deps nixl-cu12==1.5.1
rm -rf target/peer-wheels
(cd python && "../$V/bin/maturin" build --release --compatibility linux --skip-auditwheel \
    -i "../$V/bin/python" -o ../target/peer-wheels >/dev/null)
"${pip[@]}" --force-reinstall --no-deps target/peer-wheels/kvmove-*.whl
