#!/usr/bin/env bash
# The main job: set up, build, print what is available, verify every kernel against the
# float64 oracle on the present device (CUDA when there is one, else CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m transformer_fast verify "$@"
