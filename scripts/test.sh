#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the test suite. Extra arguments go to pytest.
# Without a GPU, Triton kernels run through TRITON_INTERPRET=1 on CPU tensors and tests marked
# `gpu` are skipped; `-m slow` runs the big sweeps.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
set +e
.venv/bin/python -m pytest tests "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: that is a failure here" >&2
    exit 1
fi
exit "$status"
