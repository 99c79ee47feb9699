#!/usr/bin/env bash
# The main job: set up, build, print what is available, verify every kernel against the
# float64 oracle on the present device (CUDA when there is one, else CPU), then run the quick
# benchmarks there (python -m benchmarks --quick: results.json, results.md and plots under
# benchmarks/results/<device>/<date>-<commit>/, or under $OUT when set).
# Extra arguments go to verify.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m transformer_fast verify "$@"
.venv/bin/python -m benchmarks --quick
