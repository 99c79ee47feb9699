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
# One pytest process per core (pytest-xdist; TF_TEST_WORKERS=1 for a single process), each with
# one intra-op thread: two workers' OpenMP teams of two threads on two cores would oversubscribe
# them (benchmarks/NOTES.md measured 10-30x slowdowns of oversubscribed OpenMP).  Tests that need
# several threads set them themselves.
workers=${TF_TEST_WORKERS:-$(nproc)}
parallel=()
if [ "$workers" -gt 1 ] && .venv/bin/python -c "import xdist" 2>/dev/null; then
    parallel=(-n "$workers")
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
set +e
.venv/bin/python -m pytest tests "${parallel[@]}" "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: that is a failure here" >&2
    exit 1
fi
exit "$status"
