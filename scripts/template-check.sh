#!/usr/bin/env bash
# The conformance suite as a transport author outside this repository
# gets it (docs/WRITING_A_TRANSPORT.md):
#
#   0. the template is formatted as the repository is;
#   1. `cargo package` assembles every crate of the workspace, as
#      crates.io would take them (versions on every path dependency,
#      nothing read from outside a crate's directory);
#   2. the template (templates/transport/: an in-process transport and its
#      harness) is copied outside the workspace, linted (clippy -D
#      warnings) and built against the packaged crates themselves,
#      unpacked from target/package: the crates the suite needs
#      (transport-mem, transport-core, kvmove-policy, transport-mock,
#      conformance) are compiled from exactly what would be published,
#      with the suite's self-test feature off;
#   3. the whole suite runs on it: every case it cannot run (no cut or
#      stall hooks in a process without connections) is reported ignored,
#      and every other case must pass.
#
#   scripts/template-check.sh          # all of it
#   TEMPLATE_FILTER=lifecycle:: scripts/template-check.sh   # one group
#
# Uses the workspace's Cargo.lock (the same dependency versions, so the
# third-party crates already built in target/ are reused) and target/.
# TEMPLATE_BUILD_NICE sets the build's niceness; with
# TEMPLATE_BUILD_NICE_WHILE=PID it holds only while that process lives,
# and the build goes on at TEMPLATE_BUILD_NICE_AFTER (default 5) once it
# has ended (scripts/test.sh: nice 19 while the vLLM checks run, its
# builds' own after). The suite itself runs at the caller's niceness.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
target=${CARGO_TARGET_DIR:-$repo/target}
case "$target" in /*) ;; *) target=$repo/$target ;; esac

# The crates the template's Cargo.toml patches in, as packaged.
suite_crates=(transport-mem transport-core kvmove-policy transport-mock conformance)

echo "template-check: the template's formatting (the repository's rustfmt.toml)"
rustfmt --edition 2021 --check templates/transport/src/*.rs templates/transport/tests/*.rs

echo "template-check: cargo package --workspace (no build; the template's build below compiles the suite's crates)"
cargo package --workspace --no-verify --allow-dirty --quiet

work=$(mktemp -d "${TMPDIR:-/tmp}/kvmove-template.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/crates"
version=$(cargo metadata --format-version 1 --no-deps \
  | python3 -c 'import json,sys; print(next(p["version"] for p in json.load(sys.stdin)["packages"] if p["name"] == "transport-core"))')
for c in "${suite_crates[@]}"; do
  tar -xzf "$target/package/$c-$version.crate" -C "$work/crates"
done

cp -r templates/transport "$work/transport"
rm -rf "$work/transport/target"
cp Cargo.lock "$work/transport/Cargo.lock"
python3 - "$work/transport/Cargo.toml" "$work/crates" "$version" "${suite_crates[@]}" <<'PY'
import sys
path, crates, version, names = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
text = open(path).read()
head, sep, _ = text.partition("\n[patch.crates-io]\n")
if not sep:
    sys.exit(f"{path}: no [patch.crates-io] table to point at the packaged crates")
lines = [f'{n} = {{ path = "{crates}/{n}-{version}" }}' for n in names]
open(path, "w").write(head + sep + "\n" + "\n".join(lines) + "\n")
PY

# A process and every descendant to niceness $2 (parent first: a child it
# starts afterwards inherits the new value). Lowering a niceness needs
# CAP_SYS_NICE; without it the build stays where it was.
renice_tree() {
  local pid=$1 n=$2 child
  renice -n "$n" -p "$pid" >/dev/null 2>&1 || return 0
  for child in $(ps -o pid= --ppid "$pid" 2>/dev/null); do
    renice_tree "$child" "$n"
  done
}

# The build, at TEMPLATE_BUILD_NICE; reniced to TEMPLATE_BUILD_NICE_AFTER
# when TEMPLATE_BUILD_NICE_WHILE's process ends. Beside two busy loops a
# build at nice 19 got about 1.5 % of a CPU and ran on for as long as the
# loops did (ci53); at nice 5 it keeps about a third of one.
build() {
  local watch=${TEMPLATE_BUILD_NICE_WHILE:-} n=${TEMPLATE_BUILD_NICE:-0}
  # Set but empty, or a process already gone: the build is past the wait.
  if [ -n "${TEMPLATE_BUILD_NICE_WHILE+set}" ] && { [ -z "$watch" ] || ! kill -0 "$watch" 2>/dev/null; }; then
    n=${TEMPLATE_BUILD_NICE_AFTER:-5}
    watch=
  fi
  nice -n "$n" env CARGO_TARGET_DIR="$target" "$@" &
  local pid=$! rc=0
  if [ -n "$watch" ]; then
    while kill -0 "$pid" 2>/dev/null && kill -0 "$watch" 2>/dev/null; do
      sleep 1
    done
    if kill -0 "$pid" 2>/dev/null; then
      echo "template-check: process $watch ended; the build goes on at nice ${TEMPLATE_BUILD_NICE_AFTER:-5}"
      renice_tree "$pid" "${TEMPLATE_BUILD_NICE_AFTER:-5}"
    fi
  fi
  wait "$pid" || rc=$?
  return "$rc"
}

echo "template-check: the template, out of tree ($work/transport), against the packaged crates"
cd "$work/transport"
build cargo clippy --all-targets --quiet -- -D warnings
build cargo test --test conformance --no-run --quiet
CARGO_TARGET_DIR=$target cargo test --test conformance -- ${TEMPLATE_FILTER:-}
