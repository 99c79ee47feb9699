#!/usr/bin/env bash
# Everything a GPU is needed for, in one call (a lent GPU machine is scarce: one command does it
# all).  Uses the machine's own python/torch (no network there), builds for the present GPU,
# runs the gpu tests, compute-sanitizer over the CUDA kernels, `verify`, and the benchmarks
# (`python -m benchmarks --quick`).  Every step runs even if an earlier one failed; the summary
# lists each step's exit status and the script exits non-zero if any failed.
#   OUT=dir   where results go (default benchmarks/results/<device>/<date>-<commit>)
#   PYTHON    interpreter (default python)
#   BENCH_ARGS  arguments for the benchmark step instead of --quick (e.g. "" for the full sweep)
# What lands in OUT stays small enough to copy back from a lent machine (at most 8 files, a few
# MB): meta.json, summary.txt, logs.txt (every step's full output, one after the other),
# verify.md, and the benchmarks' results.json, results.md, ops.png, end_to_end.png.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
DIRTY=$(git status --porcelain -- csrc kernels transformer_fast 'benchmarks/*.py' 2>/dev/null | head -1)
[ -n "$DIRTY" ] && COMMIT="$COMMIT-dirty"
# The device slug as benchmarks/common.py's device_slug (runs of both land in one folder).
SLUG=$($PY -c "import re, torch; print(re.sub(r'[^A-Za-z0-9._-]+', '_', torch.cuda.get_device_name(0)).strip('_') if torch.cuda.is_available() else 'cpu')" 2>/dev/null || echo unknown)
OUT=${OUT:-benchmarks/results/$SLUG/$(date -u +%Y-%m-%d)-$COMMIT}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
LOGS="$OUT/logs.txt"
: > "$SUMMARY"
: > "$LOGS"
FAILED=0

step() {  # step NAME COMMAND...: run, append its output to $LOGS, record the exit status
    local name=$1; shift
    local start=$(date +%s)
    local log
    log=$(mktemp)
    echo "=== $name: $*"
    "$@" > "$log" 2>&1
    local rc=$?
    local secs=$(( $(date +%s) - start ))
    tail -n 25 "$log"
    { echo "=================== $name (rc=$rc, ${secs}s): $*"; cat "$log"; echo; } >> "$LOGS"
    rm -f "$log"
    printf '%-28s rc=%-3s %5ss  %s\n' "$name" "$rc" "$secs" "$*" | tee -a "$SUMMARY"
    [ "$rc" -ne 0 ] && FAILED=1
    return 0
}

ARCH=$($PY -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'{m}.{n}' + ('a' if m == 9 else ''))" 2>/dev/null || echo "9.0a")
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$ARCH}
export TRANSFORMER_FAST_CUDA=1

$PY - > "$OUT/meta.json" <<PYEOF
import json, datetime, platform, subprocess, torch
try:
    import triton; tv = triton.__version__
except Exception as e:
    tv = None
p = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None
nvcc = subprocess.run("nvcc --version | tail -2", shell=True, capture_output=True, text=True).stdout.strip()
print(json.dumps({"device": p.name if p else "cpu", "sm_count": p.multi_processor_count if p else None,
  "capability": f"{p.major}.{p.minor}" if p else None, "torch": torch.__version__, "triton": tv,
  "cuda": torch.version.cuda, "nvcc": nvcc, "python": platform.python_version(),
  "commit": "$COMMIT", "date": datetime.datetime.utcnow().isoformat() + "Z",
  "arch_list": "$TORCH_CUDA_ARCH_LIST"}, indent=2))
PYEOF
cat "$OUT/meta.json"

step build env MAX_JOBS=${MAX_JOBS:-16} $PY setup.py build_ext --inplace
step install env TRANSFORMER_FAST_NO_EXT=1 $PY -m pip install --no-deps --no-build-isolation -e .
step info $PY -m transformer_fast info
step pytest_gpu $PY -m pytest tests -m "gpu or triton" -q -p no:cacheprovider
step verify $PY -m transformer_fast verify --output "$OUT/verify.md"
for tool in memcheck racecheck initcheck synccheck; do
    step "sanitizer_$tool" compute-sanitizer --tool "$tool" --error-exitcode 1 \
        --target-processes all $PY benchmarks/sanitize_kernels.py --backend cuda
done
step sanitizer_memcheck_triton compute-sanitizer --tool memcheck --error-exitcode 1 \
    $PY benchmarks/sanitize_kernels.py --backend triton
# Writes results.json, results.md, ops.png and end_to_end.png into OUT.
# shellcheck disable=SC2086
step benchmarks env PYTHONUNBUFFERED=1 $PY -m benchmarks ${BENCH_ARGS---quick} --output "$OUT"

echo; echo "=== summary ($OUT)"; cat "$SUMMARY"
exit $FAILED
