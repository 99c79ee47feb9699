#!/usr/bin/env bash
# Sets up a fresh machine: a virtual environment with the pinned requirements, the C++/CUDA
# extension built in place (incremental), and the package installed in editable mode.
#   VENV=path        the virtual environment (default .venv in the repository)
#   PYTHON=python3   the interpreter that creates it
# The CUDA sources are compiled when torch is a CUDA build and nvcc is found (CI forces it with
# TRANSFORMER_FAST_CUDA=1); TORCH_CUDA_ARCH_LIST defaults to "8.0;9.0a".
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
# torch's CUDA build with its nvidia-* wheels takes ~6 GB in the venv: warn up front rather
# than leave only pip's bare "[Errno 28] No space left on device" half way through the install.
if ! "$PY" -c "import torch" 2>/dev/null; then
    free_kb=$(df -Pk "$VENV" | awk 'NR == 2 {print $4}')
    if [ "${free_kb:-0}" -lt $((7 * 1024 * 1024)) ]; then
        echo "setup: warning: only $((free_kb / 1024)) MB free where $VENV lives; the" \
             "requirements (torch's CUDA build) take about 6.5 GB" >&2
    fi
fi
start=$(date +%s)
"$PY" -m pip install -q --disable-pip-version-check -r requirements.txt
echo "setup: requirements installed in $(( $(date +%s) - start )) s"

start=$(date +%s)
MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" setup.py -q build_ext --inplace
echo "setup: extension built in $(( $(date +%s) - start )) s"
# The package itself (kernels/ maps to transformer_fast.kernels); the extension is built above.
TRANSFORMER_FAST_NO_EXT=1 "$PY" -m pip install -q --disable-pip-version-check --no-deps \
    --no-build-isolation -e .
"$PY" -m transformer_fast info
