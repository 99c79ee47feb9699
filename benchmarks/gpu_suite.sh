#!/usr/bin/env bash
# Everything a GPU is needed for, in one call (a lent GPU machine is scarce: one command does it
# all).  Uses the machine's own python/torch (no network there), builds for the present GPU,
# runs the gpu tests, compute-sanitizer over the CUDA kernels, `verify`, and the benchmarks
# (`python -m benchmarks --quick`).  Every step runs even if an earlier one failed; the summary
# lists each step's exit status and the script exits non-zero if any failed.
#   OUT=dir   where results go (default benchmarks/results/<device>/<date>-<commit>)
#   PYTHON    interpreter (default: python3, else python; the lent GPU machines' torch is python3)
#   TRANSFORMER_FAST_COMMIT  the commit measured, where the tree has no .git (a copy sent to a lent
#             GPU machine): e.g. TRANSFORMER_FAST_COMMIT=$(git rev-parse --short HEAD) in the command
#   BENCH_ARGS  arguments for the benchmark step instead of --quick (e.g. "" for the full sweep)
#   PROFILE_ARGS  arguments for the profile step (benchmarks/profile_ops.py; default: the FFN and
#             attention cases, torch / triton / cuda, with the 12 Python functions of most own time)
#   PROFILE_MODEL_ARGS  arguments for the profile_model step (benchmarks/profile_model.py; default:
#             the training step, torch.nn against ours:auto / torch / cuda)
#   STEPS     run only these steps: each word is a step name, or a prefix ending in '*'
#             ("sanitizer*" runs every sanitizer step; "verify" runs verify, not verify_mma_sync),
#             (benchmarks/results/README.md has the two calls planned for 15 minutes of device
#             time; one device call may run 10 minutes, and all of it may not fit)
#   PYTEST_PAR  pytest's flags for the gpu tests (default "-n 16 -vv --timeout=120" when
#             pytest-xdist is importable: the lent machines' image has it; elsewhere wheels
#             carried in .gpu_wheels/ by scripts/fetch_gpu_wheels.sh are installed first).
#             Each failure's traceback, and each test slower than TF_SLOW_LOG_S (default 10 s),
#             is appended to logs.txt as it happens (TF_FAILURE_LOG, tests/conftest.py), so a
#             step killed at its time limit still reports them
#   SANITIZER_SHARDS  sanitized processes side by side in each Triton sanitizer step (default 8)
#   STEP_TIMEOUT  seconds per step before it is killed (default 420 for build, pytest_gpu and
#             benchmarks, 240 for the others); STEP_TIMEOUT_<step> sets one step's budget
# What lands in OUT stays small enough to copy back from a lent machine (at most 8 files, a few
# MB): meta.json, summary.txt, logs.txt (every step's full output, one after the other),
# verify.md, and the benchmarks' results.json, results.md, ops.png, end_to_end.png.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3 || command -v python)}
if [ -n "${TRANSFORMER_FAST_COMMIT:-}" ]; then
    COMMIT=$TRANSFORMER_FAST_COMMIT
else
    COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
    DIRTY=$(git status --porcelain -- csrc kernels transformer_fast 'benchmarks/*.py' 2>/dev/null | head -1)
    [ -n "$DIRTY" ] && COMMIT="$COMMIT-dirty"
fi
export TRANSFORMER_FAST_COMMIT=$COMMIT  # benchmarks/common.py records the same commit
# The device slug as benchmarks/common.py's device_slug (runs of both land in one folder).
SLUG=$($PY -c "import re, torch; print(re.sub(r'[^A-Za-z0-9._-]+', '_', torch.cuda.get_device_name(0)).strip('_') if torch.cuda.is_available() else 'cpu')" 2>/dev/null || echo unknown)
OUT=${OUT:-benchmarks/results/$SLUG/$(date -u +%Y-%m-%d)-$COMMIT}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
LOGS="$OUT/logs.txt"
: > "$SUMMARY"
: > "$LOGS"
FAILED=0

step_budget() {  # seconds a step may run before it is killed (a hung step must not eat the call)
    local own="STEP_TIMEOUT_$1"  # e.g. STEP_TIMEOUT_pytest_gpu=200 overrides one step's budget
    if [ -n "${!own:-}" ]; then echo "${!own}"; return; fi
    case "$1" in
        build|pytest_gpu|benchmarks) echo "${STEP_TIMEOUT:-420}" ;;
        *) echo "${STEP_TIMEOUT:-240}" ;;
    esac
}

selected() {  # whether step NAME is in STEPS (a word is a name, or a prefix ending in '*'; empty = all)
    [ -z "${STEPS:-}" ] && return 0
    local w
    set -f  # the words' '*' is ours, not a glob
    for w in $STEPS; do
        if [[ "$w" == *'*' ]]; then [[ "$1" == "${w%\*}"* ]] && { set +f; return 0; }
        elif [[ "$1" == "$w" ]]; then set +f; return 0; fi
    done
    set +f
    return 1
}

step() {  # step NAME COMMAND...: run (output straight into $LOGS, so a killed call keeps it), record rc
    local name=$1; shift
    selected "$name" || return 0
    local start=$(date +%s)
    echo "=== $name: $*"
    echo "=================== $name: $*" >> "$LOGS"
    local mark
    mark=$(wc -l < "$LOGS")
    timeout --kill-after=10 "$(step_budget "$name")" "$@" >> "$LOGS" 2>&1
    local rc=$?
    local secs=$(( $(date +%s) - start ))
    tail -n +"$((mark + 1))" "$LOGS" | tail -n 25
    echo "------------------- $name: rc=$rc, ${secs}s" >> "$LOGS"
    printf '%-28s rc=%-3s %5ss  %s\n' "$name" "$rc" "$secs" "$*" | tee -a "$SUMMARY"
    [ "$rc" -ne 0 ] && FAILED=1
    return 0
}

ARCH=$($PY -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'{m}.{n}' + ('a' if m == 9 else ''))" 2>/dev/null || echo "9.0a")
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$ARCH}
# TRANSFORMER_FAST_CUDA=0 builds _C without its CUDA sources (CPU kernels only, seconds instead of
# two minutes): for a short call that needs only the triton / torch backends (train_demo, the
# end-to-end benchmarks' ours:triton rows).
export TRANSFORMER_FAST_CUDA=${TRANSFORMER_FAST_CUDA:-1}
# A step killed at its budget keeps what it printed (Python block-buffers a redirected stdout).
export PYTHONUNBUFFERED=1

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
# Whether a C++ error thrown inside _C reaches Python (three CUDA bad-argument tests segfaulted on
# the first GPU run): how each child ended, a cuda-gdb backtrace of a crash, the compilers used.
step exceptions $PY benchmarks/diagnose_exceptions.py
# Numerics and memory-safety steps take the first config of each Triton autotune list instead of
# timing them all (kernels/common.py, first_config_unless_tuning): compile time dominates them.
# The benchmarks tune (and report each row's error against float64, so tuned configs are checked).
NO_TUNE="env TRANSFORMER_FAST_AUTOTUNE=0"
# pytest-xdist where the machine has it (Triton compiles on 16 cores instead of one); wheels
# carried in .gpu_wheels/ (scripts/fetch_gpu_wheels.sh) are installed first.  PYTEST_PAR="" runs
# the tests in one process.
if ls .gpu_wheels/*.whl > /dev/null 2>&1; then
    $PY -m pip install --no-index --no-deps .gpu_wheels/*.whl >> "$LOGS" 2>&1 \
        || echo "installing .gpu_wheels failed (logs.txt); the gpu tests run in one process"
fi
PYTEST_PAR=${PYTEST_PAR-$($PY -c "import xdist" 2>/dev/null && echo "-n 16 -vv --timeout=120" || echo "")}
export TF_FAILURE_LOG=$LOGS
# The tests that failed on the last GPU run first (benchmarks/gpu_recheck.txt), then all of them.
RECHECK=$(grep -v '^#' benchmarks/gpu_recheck.txt 2>/dev/null | tr '\n' ' ')
if [ -n "$RECHECK" ]; then
    set -f  # node ids hold [...]: not globs
    # shellcheck disable=SC2086
    step recheck $NO_TUNE $PY -m pytest -q -p no:cacheprovider -m "" $PYTEST_PAR $RECHECK
    set +f
fi
# The whole training step under the profiler, torch.nn against ours (benchmarks/profile_model.py;
# early: issue 5's largest open gap, ~60 s):
# wall against host time per step, device busy time, idle gaps, kernels by kind, the operations
# that synchronised the host; output to logs.txt.  Untuned Triton configs (no autotuning's
# compiles; `ours:torch` and `ours:cuda` run no Triton kernel).
# shellcheck disable=SC2086
step profile_model $NO_TUNE $PY benchmarks/profile_model.py ${PROFILE_MODEL_ARGS---op train_step --python-top 15}
# Every op x backend x dtype against the oracle, its cases in parallel processes (verify --jobs,
# one per core up to 16 on CUDA): the widest coverage per second, so before the long test run.
step verify $NO_TUNE $PY -m transformer_fast verify --output "$OUT/verify.md"
# The test files the last run did not reach go first (benchmarks/gpu_first.txt, TF_TEST_FIRST).
TF_TEST_FIRST=$(grep -v '^#' benchmarks/gpu_first.txt 2>/dev/null | paste -sd, -)
export TF_TEST_FIRST
# shellcheck disable=SC2086
step pytest_gpu $NO_TUNE $PY -m pytest tests -m "gpu or triton" -q -p no:cacheprovider $PYTEST_PAR
# On a Hopper the cuda attention's unmasked calls run the sm_90a wgmma kernels by default: its
# mma.sync kernels (what other GPUs run) again with TRANSFORMER_FAST_CUDA_WGMMA=0; table to logs.txt.
step verify_mma_sync $NO_TUNE env TRANSFORMER_FAST_CUDA_WGMMA=0 $PY -m transformer_fast verify \
    --op scaled_dot_product_attention --backend cuda
# racecheck over our CUDA kernels alone (all in namespace transformer_fast; the filter matches a
# substring of the kernel's name): unfiltered it also instruments every PyTorch kernel the cases
# launch (randn, the finiteness checks), and runs 4 and 5 killed it at 50-60 s before its first
# report.  Only where this compute-sanitizer has the option (checked, so an older one still runs).
RACE_OURS=()
if compute-sanitizer --help 2>/dev/null | grep -q -- '--kernel-name '; then
    RACE_OURS=(--kernel-name kns=transformer_fast)
fi
for tool in memcheck racecheck initcheck synccheck; do
    filter=()
    [ "$tool" = racecheck ] && filter=("${RACE_OURS[@]}")
    step "sanitizer_$tool" $NO_TUNE compute-sanitizer --tool "$tool" "${filter[@]}" --error-exitcode 1 \
        --target-processes all $PY benchmarks/sanitize_kernels.py --backend cuda --verbose
done
# The sdpa cases alone under racecheck (on a Hopper the wgmma kernels: the whole-backend racecheck
# was killed at 50-60 s in runs 4 and 5 before reaching them); --verbose names each case as it
# starts, so a step killed at its limit still shows how far it got.
step sanitizer_sdpa_racecheck $NO_TUNE compute-sanitizer --tool racecheck "${RACE_OURS[@]}" --error-exitcode 1 \
    $PY benchmarks/sanitize_kernels.py --backend cuda --only sdpa --verbose
# Where the GPU is a Hopper (the steps above ran its wgmma kernels): the sdpa cases again on the
# mma.sync kernels (TRANSFORMER_FAST_CUDA_WGMMA=0; elsewhere a repeat of the steps above).
for tool in memcheck racecheck initcheck; do
    filter=()
    [ "$tool" = racecheck ] && filter=("${RACE_OURS[@]}")
    step "sanitizer_mma_sync_$tool" $NO_TUNE env TRANSFORMER_FAST_CUDA_WGMMA=0 compute-sanitizer \
        --tool "$tool" "${filter[@]}" --error-exitcode 1 $PY benchmarks/sanitize_kernels.py --backend cuda --only sdpa
done
# Triton: before the first sanitized run, the cases run once in 16 processes without the sanitizer
# (sanitize_kernels.py --shard), so that every sanitized run loads its kernels from Triton's cache
# instead of compiling them one at a time (the first run's memcheck over Triton was killed at
# 240 s).  The marker keeps the later tools from repeating that warm-up.
# Each tool then runs as SANITIZER_SHARDS sanitized processes side by side, each every n-th case,
# its lines prefixed "[i] ": the tools instrument each kernel as it loads, on the host, and one
# process got through add_layer_norm's cases alone in run 6's 80 s of memcheck.  The step fails
# if any shard does.
TRITON_WARM_MARK="${TMPDIR:-/tmp}/tf_sanitize_triton_warm.$$"
for tool in memcheck racecheck initcheck synccheck; do
    step "sanitizer_${tool}_triton" $NO_TUNE env PY="$PY" TOOL="$tool" MARK="$TRITON_WARM_MARK" \
        SHARDS="${SANITIZER_SHARDS:-8}" bash -c '
        if [ ! -e "$MARK" ]; then
            for i in $(seq 0 15); do
                "$PY" benchmarks/sanitize_kernels.py --backend triton --shard "$i/16" > /dev/null 2>&1 &
            done
            wait
            touch "$MARK"
        fi
        pids=()
        for i in $(seq 0 $((SHARDS - 1))); do
            compute-sanitizer --tool "$TOOL" --error-exitcode 1 "$PY" benchmarks/sanitize_kernels.py \
                --backend triton --verbose --shard "$i/$SHARDS" > >(sed -u "s/^/[$i] /") 2>&1 &
            pids+=($!)
        done
        rc=0
        for p in "${pids[@]}"; do wait "$p" || rc=1; done
        wait  # the prefixing sed processes
        exit $rc'
done
rm -f "$TRITON_WARM_MARK"
# The torch-free CUDA attention forward harness (benchmarks/cuda_attn: the current kernels and the
# drafted dense fast paths, timed and checked; one ncu pass where ncu works); output to logs.txt.
step cuda_attn env OUT=/tmp/tf_cuda_attn bash benchmarks/cuda_attn/run.sh
# Issue 8's training demo on the GPU (its CPU run is tested in CI): loss and held-out exact match
# go to logs.txt; no loss-curve PNG (OUT holds at most 8 files).
step train_demo $PY -m transformer_fast train-demo --device cuda --no-progress --out ""
# Writes results.json, results.md, ops.png and end_to_end.png into OUT.
# shellcheck disable=SC2086
step benchmarks $PY -m benchmarks ${BENCH_ARGS---quick} --output "$OUT"
# Host time against kernel time per call for the FFN and attention cases (benchmarks/profile_ops.py;
# after the benchmarks, whose compiles it reuses from Triton's cache); output to logs.txt.
# shellcheck disable=SC2086
step profile $PY benchmarks/profile_ops.py ${PROFILE_ARGS---op feed_forward scaled_dot_product_attention --providers torch,triton,cuda --python-top 12}
# Nsight Compute over one launch each of the Triton FFN GEMM, the Triton attention forward and the
# CUDA dense / wgmma forwards (benchmarks/ncu_kernels.sh; after the benchmarks, whose Triton
# compiles it reuses); summaries to logs.txt.
step ncu_kernels env PY="$PY" bash benchmarks/ncu_kernels.sh

echo; echo "=== summary ($OUT)"; cat "$SUMMARY"
exit $FAILED
