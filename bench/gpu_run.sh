#!/usr/bin/env bash
# The device session's one command for issue 16 (one H200, no network): install the carried wheels, run bench/gpu.py.
#
#   bash bench/gpu_run.sh [bench/gpu.py options]   # e.g. nothing (14 GB on cuda), or --size 7 for a shorter rerun
#   bash bench/gpu_run.sh install                  # only install bench/.wheels/**/*.whl into bench/.site, then stop
#
# Prepared here by bench/gpu_wheels.sh; the device call carries bench/.wheels/core and bench/.gpu-trace
# (see docs/benchmarks.md, "GPU (bench/gpu.py)"). Wheels go into bench/.site (pip --target, ignored by git),
# which shadows the image's packages and the carried source tree on PYTHONPATH (deltastore's wheel holds its
# compiled kernels; the source tree has none) and survives between calls on a warm machine.
# Writes $OUT/gpu.json (every figure) and $OUT/gpu.log. Env: PYTHON (default python3), GPU_BUDGET (seconds
# bench/gpu.py plans for, default 330), GPU_TIMEOUT (hard stop, default 390), GPU_PROFILE (functions printed
# from the profiled extra step of each run, default 30; 0: none), WHEELS=none (skip the install).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/deltastore-gpu-out}
mkdir -p "$OUT"
SITE=$PWD/bench/.site
export PYTHONUNBUFFERED=1

mapfile -t WHLS < <(find bench/.wheels -name '*.whl' 2>/dev/null | sort)
if [ "${WHEELS:-}" != none ] && [ ${#WHLS[@]} -gt 0 ]; then
  echo "installing into $SITE: ${WHLS[*]##*/}"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${WHLS[@]}" \
    || { echo "gpu_run.sh: pip install of the carried wheels failed" >&2; exit 3; }
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
[ "${1:-}" = install ] && { echo "installed: $(ls "$SITE" 2>/dev/null | grep -c dist-info) packages in $SITE"; exit 0; }

# What will run: fail in seconds (not minutes) when a dependency is missing or does not fit the numpy there.
"$PY" - <<'EOF' || exit 3
import sys
try:
    import numpy, zstandard, torch, safetensors, fsspec
    import deltastore, deltastore.kernels.diff
except ImportError as e:
    sys.exit(f"gpu_run.sh: {e!r}\n  carry bench/.wheels/core (bash bench/gpu_wheels.sh: zstandard and deltastore's "
             "cp312 wheel with its compiled kernels)")
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (cuda {torch.version.cuda}, available "
      f"{torch.cuda.is_available()}), numpy {numpy.__version__}, zstandard {zstandard.__version__}, "
      f"safetensors {safetensors.__version__}")
print(f"deltastore from {deltastore.__file__}, kernels {deltastore.kernels.diff.diff_items.__module__}")
EOF
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
df -h "${TMPDIR:-/tmp}" | tail -1
nproc

ARGS=()
if [ -z "${DELTASTORE_TRACES:-}" ] && [ -f bench/.gpu-trace/weight_trace.py ]; then
  export DELTASTORE_TRACES=$PWD/bench/.gpu-trace
  ARGS+=(--trace-steps "$(cat bench/.gpu-trace/TRACE_STEPS 2>/dev/null || echo 8)")
fi
echo "trace: ${DELTASTORE_TRACES:-../shared/traces}"
timeout -k 15 "${GPU_TIMEOUT:-390}" "$PY" bench/gpu.py --json "$OUT/gpu.json" --budget "${GPU_BUDGET:-330}" \
  --profile "${GPU_PROFILE:-30}" "${ARGS[@]}" "$@" 2>&1 | tee "$OUT/gpu.log"
rc=${PIPESTATUS[0]}
[ "$rc" = 124 ] && echo "gpu_run.sh: bench/gpu.py was stopped at ${GPU_TIMEOUT:-390} s; $OUT/gpu.json holds the phases it finished"
echo "gpu_run.sh: exit $rc"
exit "$rc"
