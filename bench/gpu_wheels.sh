#!/usr/bin/env bash
# Prepare what the device session (issue 16, bench/gpu.py on one H200) carries: run here, where PyPI is reachable.
#
#   bash bench/gpu_wheels.sh            # -> bench/.wheels/core, bench/.wheels/numba, bench/.gpu-trace
#
# * bench/.wheels/core/   zstandard (CPython 3.12, manylinux x86-64): the device image has none. ~5.5 MB.
# * bench/.wheels/numba/  numba + the llvmlite it pins, in case the device's own numba is missing or too old
#                         (the image's package list names numba and llvmlite; bench/gpu_run.sh checks). ~64 MB:
#                         llvmlite alone is ~60 MB, so this folder cannot travel in the same call as the trace
#                         (64 MiB per call); see docs/benchmarks.md "GPU (bench/gpu.py)" for the two-call plan.
# * bench/.gpu-trace/     the weight trace trimmed to what bench/gpu.py --trace-steps $TRACE_STEPS reads (the
#                         ../shared/traces beside the checkout does not travel to the device machine). ~43 MB.
#
# Versions follow pyproject.toml (zstandard>=0.22, numba>=0.60; llvmlite as numba's metadata pins it).
# numba's wheels are tagged manylinux_2_27/2_28 only, so manylinux2014 alone finds no numba: every tag is asked.
# All three folders are in .gitignore; never commit them.
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
req() {  # the Requires-Dist lines of a wheel
  "$PY" - "$1" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            print(line.split(":", 1)[1].strip())
EOF
}

rm -rf "$W" bench/.gpu-trace
mkdir -p "$W/core" "$W/numba"
dl "$W/core" "zstandard>=0.22"
dl "$W/numba" "numba>=0.60"
NUMBA_WHL=$(ls "$W"/numba/numba-*.whl)
LLVM_SPEC=$(req "$NUMBA_WHL" | grep '^llvmlite' | tr -d ' ')
NUMPY_SPEC=$(req "$NUMBA_WHL" | grep '^numpy' | tr -d ' ')
dl "$W/numba" "$LLVM_SPEC"
echo "numba wheel: $(basename "$NUMBA_WHL") needs $LLVM_SPEC and $NUMPY_SPEC"
echo "  (the device image's numpy was 2.5.2 in 2026-11; a fresh 'pip install torch numpy' takes the newest numpy:"
echo "   check it is inside $NUMPY_SPEC; bench/gpu_run.sh checks the numpy it finds against this at run time)"

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

ls -l "$W"/core "$W"/numba
for f in "$W"/core/*.whl "$W"/numba/*.whl; do [ -s "$f" ] || { echo "missing wheel $f" >&2; exit 1; }; done
tree=$(git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
core=$(du -sb "$W/core" | cut -f1); numba=$(du -sb "$W/numba" | cut -f1); trace=$(du -sb "$T" | cut -f1)
mib() { echo $(( $1 / 1048576 )); }
echo "sizes (MiB): working tree $(mib "$tree"), wheels/core $(mib "$core"), wheels/numba $(mib "$numba"), trace $(mib "$trace")"
echo "one call carries: tree + core + trace = $(mib $((tree + core + trace))) MiB of 64"
echo "                  (tree + numba = $(mib $((tree + numba))) MiB: only as a separate first call)"
[ $((tree + core + trace)) -lt $((64 * 1048576)) ] || { echo "too big for one device call" >&2; exit 1; }
