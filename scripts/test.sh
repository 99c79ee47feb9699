#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the test suite. Extra arguments go to pytest.
# Without a GPU, Triton kernels run through TRITON_INTERPRET=1 on CPU tensors and tests marked
# `gpu` are skipped; `-m slow` runs the big sweeps.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Triton 3.6 (the GPU machines' version) beside the venv's 3.8, for the compile check in
# tests/test_triton_compile.py only (never imported by the package; no dependencies).
if [ ! -d .venv/triton36/triton ]; then
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --target .venv/triton36 \
        triton==3.6.0
fi
set +e
.venv/bin/python -m pytest tests "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: that is a failure here" >&2
    exit 1
fi
exit "$status"
