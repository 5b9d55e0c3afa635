#!/usr/bin/env bash
# Installs what transport-etcd needs on a Debian machine, where missing:
#   - etcd-server       (/usr/bin/etcd): the real server its tests start;
#   - protobuf-compiler (/usr/bin/protoc): etcd-client's build script compiles
#     etcd's .proto files, so building the crate at all needs it;
#   - libprotobuf-dev (/usr/include/google/protobuf/*.proto): the well-known
#     types those files import (only a recommendation of protobuf-compiler,
#     so --no-install-recommends leaves them out).
# Non-interactive and quiet; safe to run again. Needs root (or sudo).
set -euo pipefail

need=()
command -v etcd >/dev/null 2>&1 || [ -x /usr/bin/etcd ] || need+=(etcd-server)
command -v protoc >/dev/null 2>&1 || need+=(protobuf-compiler)
[ -f /usr/include/google/protobuf/descriptor.proto ] || need+=(libprotobuf-dev)
if [ "${#need[@]}" -eq 0 ]; then
    exit 0
fi

sudo=()
if [ "$(id -u)" -ne 0 ]; then
    sudo=(sudo)
fi
echo "install-etcd: installing ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq >/dev/null
# policy-rc.d on containers keeps the packaged etcd service from starting;
# the tests start their own server on free loopback ports either way.
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
# Where systemd runs, the package starts its own etcd on port 2379; the tests
# do not use it, so do not leave an unasked-for daemon behind.
if [[ " ${need[*]} " == *" etcd-server "* ]] && command -v systemctl >/dev/null 2>&1 \
    && systemctl is-active --quiet etcd 2>/dev/null; then
    "${sudo[@]}" systemctl disable --now etcd >/dev/null 2>&1 || true
fi
command -v protoc >/dev/null
[ -x /usr/bin/etcd ] || command -v etcd >/dev/null
echo "install-etcd: $(etcd --version 2>/dev/null | head -n1); $(protoc --version)"
