#!/usr/bin/env bash
# Prepare what the device session (issue 16, bench/gpu.py on one H200) carries: run here, where PyPI is reachable.
#
#   bash bench/gpu_wheels.sh            # -> bench/.wheels/core, bench/.gpu-trace
#
# * bench/.wheels/core/   zstandard (CPython 3.12, manylinux x86-64): the device image has none; and deltastore
#                         itself as a CPython 3.12 wheel built here (its kernels are a compiled extension: the
#                         device needs no compiler, and the wheel's package shadows the carried source tree).
#                         Needs a python3.12 here ($PY312, default python3.12). ~7 MB.
# * bench/.gpu-trace/     the weight trace trimmed to what bench/gpu.py --trace-steps $TRACE_STEPS reads (the
#                         ../shared/traces beside the checkout does not travel to the device machine). ~43 MB.
#
# Versions follow pyproject.toml. Both folders are in .gitignore; never commit them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
TRACE_STEPS=${TRACE_STEPS:-8}
TRACES=${DELTASTORE_TRACES:-../shared/traces}
W=bench/.wheels
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64)
dl() {  # dl DEST SPEC...
  local dest=$1; shift
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLAT[@]}" -d "$dest" "$@"
}

rm -rf "$W" bench/.gpu-trace
mkdir -p "$W/core"
dl "$W/core" "zstandard>=0.22"
# deltastore with its compiled kernels, for the device's CPython 3.12 (pip builds it in an isolated environment
# with Cython and numpy's headers from [build-system])
"${PY312:-python3.12}" -m pip wheel -q --no-deps -w "$W/core" .

# the trace, trimmed: loader, base, both runs' metadata and their first $TRACE_STEPS step files
T=bench/.gpu-trace
[ -f "$TRACES/weight_trace.py" ] || { echo "no weight trace at $TRACES (set DELTASTORE_TRACES)" >&2; exit 1; }
mkdir -p "$T/smollm2-135m"
cp "$TRACES/weight_trace.py" "$T/"
cp "$TRACES/smollm2-135m/trace.json" "$TRACES/smollm2-135m/base.safetensors" "$T/smollm2-135m/"
for run in "$TRACES"/smollm2-135m/runs/*/; do
  name=$(basename "$run")
  mkdir -p "$T/smollm2-135m/runs/$name/steps"
  cp "$run/trace.json" "$T/smollm2-135m/runs/$name/"
  for i in $(seq 1 "$TRACE_STEPS"); do
    f=$(printf '%s/steps/%06d.safetensors' "$run" "$i")
    [ -f "$f" ] && cp "$f" "$T/smollm2-135m/runs/$name/steps/"
  done
done
chmod -R u+w "$T"
echo "$TRACE_STEPS" > "$T/TRACE_STEPS"

ls -l "$W"/core
for f in "$W"/core/zstandard-*.whl "$W"/core/deltastore-*cp312*.whl; do
  [ -s "$f" ] || { echo "missing wheel $f" >&2; exit 1; }
done
tree=$(git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
core=$(du -sb "$W/core" | cut -f1); trace=$(du -sb "$T" | cut -f1)
mib() { echo $(( $1 / 1048576 )); }
echo "sizes (MiB): working tree $(mib "$tree"), wheels/core $(mib "$core"), trace $(mib "$trace")"
echo "one call carries: tree + core + trace = $(mib $((tree + core + trace))) MiB of 64"
[ $((tree + core + trace)) -lt $((64 * 1048576)) ] || { echo "too big for one device call" >&2; exit 1; }
