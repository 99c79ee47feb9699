#!/usr/bin/env bash
# Wheels that the lent GPU machines lack (they have no network): pytest-xdist and execnet, so that
# benchmarks/gpu_suite.sh runs the gpu tests on 8 workers (Triton compiles on 16 cores, not one).
# Run it here, then name the folder in the device call's carry list: carry=[".gpu_wheels"].
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -m pip download --no-deps --only-binary=:all: -d .gpu_wheels pytest-xdist execnet
