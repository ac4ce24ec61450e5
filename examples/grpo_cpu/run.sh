#!/usr/bin/env bash
# Start the subscriber (background) and the trainer (foreground) on one local store.
#   STEPS=200 STORE=./grpo-store SERVE_MS=0 MAX_LAG=0 PYTHON=python3 examples/grpo_cpu/run.sh [train.py options]
# Exit status: non-zero if the trainer failed or the subscriber did not reach the last step bit-exactly.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
STEPS=${STEPS:-200}
STORE=${STORE:-./grpo-store}
SERVE_MS=${SERVE_MS:-0}
MAX_LAG=${MAX_LAG:-0}

rm -rf "$STORE"
"$PYTHON" "$HERE/subscriber.py" --store "$STORE" --steps "$STEPS" --serve-ms "$SERVE_MS" --max-lag "$MAX_LAG" \
  > >(sed -u 's/^/[subscriber] /') 2>&1 &
SUB=$!
trap 'kill "$SUB" 2>/dev/null || true' INT TERM
"$PYTHON" "$HERE/train.py" --store "$STORE" --steps "$STEPS" "$@" 2>&1 | sed -u 's/^/[trainer]    /'
wait "$SUB"
