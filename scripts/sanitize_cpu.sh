#!/usr/bin/env bash
# The C++ CPU kernels under AddressSanitizer + UndefinedBehaviorSanitizer (no GPU needed).
# Builds a sanitized, CPU-only transformer_fast._C (TRANSFORMER_FAST_SANITIZE=1, setup.py) in a
# copy of the tree under $OUT (default /tmp/tf_sanitize; the main build is left alone, the copy's
# build/ is kept for the next run), then runs the tests that reach the C++ CPU kernels (not the
# Triton-interpreter or CUDA-emulation ones) with python preloading libasan and libubsan.
# A report from either sanitizer fails the run; the reports are $OUT/asan.* / $OUT/ubsan.*.
# Needs the .venv of scripts/setup.sh.  Extra arguments go to pytest (e.g. one test file).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=$ROOT/.venv/bin/python
OUT=${OUT:-/tmp/tf_sanitize}
WORK=$OUT/tree
mkdir -p "$WORK"
rm -f "$OUT"/asan.* "$OUT"/ubsan.*

# The tracked files as they are in the working tree (edits included).
git ls-files -z | tar --null -T - -cf - | tar -xf - -C "$WORK"
(cd "$WORK" && TRANSFORMER_FAST_CUDA=0 TRANSFORMER_FAST_SANITIZE=1 MAX_JOBS="${MAX_JOBS:-$(nproc)}" \
    "$PY" setup.py -q build_ext --inplace)

CXX=${CXX:-c++}
preload="$($CXX -print-file-name=libasan.so) $($CXX -print-file-name=libubsan.so)"
export LD_PRELOAD="$preload"
# Leaks: the interpreter's own; alloc/dealloc mismatches: libraries outside this project.
export ASAN_OPTIONS="detect_leaks=0:alloc_dealloc_mismatch=0:log_path=$OUT/asan"
export UBSAN_OPTIONS="print_stacktrace=1:log_path=$OUT/ubsan"
export PYTHONPATH="$WORK" OMP_NUM_THREADS=1
cd "$WORK"
"$PY" - <<'EOF'
import os, transformer_fast._C as C
assert C.__file__.startswith(os.environ["PYTHONPATH"]), C.__file__
assert b"__asan_report" in open(C.__file__, "rb").read(), "the extension is not instrumented"
print("sanitized extension:", C.__file__)
EOF
workers=${TF_TEST_WORKERS:-$(nproc)}
parallel=()
if [ "$workers" -gt 1 ]; then parallel=(-n "$workers"); fi
tests=(tests/test_attention_cpu.py tests/test_decode_cxx.py tests/test_add_layer_norm.py
       tests/test_ffn.py tests/test_masked_softmax_cxx.py tests/test_hostile_inputs.py
       tests/test_cpu_dropout_isa.py tests/test_functional_*.py tests/test_native_layer.py
       tests/test_csrc_smoke.py tests/test_modules_*.py tests/test_models*.py tests/test_audit6.py
       tests/test_fuzz.py tests/test_decoding.py tests/test_swap.py tests/test_determinism.py
       tests/test_reliability_audit.py tests/test_fused_loss.py tests/test_ops_eager_path.py
       tests/test_double_backward.py)
if [ "$#" -gt 0 ]; then tests=("$@"); fi
set +e
"$PY" -m pytest -q -p no:cacheprovider "${parallel[@]}" -k "not triton and not emul" "${tests[@]}"
status=$?
set -e
reports=$(ls "$OUT"/asan.* "$OUT"/ubsan.* 2>/dev/null || true)
if [ -n "$reports" ]; then
    echo "sanitizer reports:" >&2
    echo "$reports" >&2
    head -50 $reports >&2
    exit 1
fi
echo "no sanitizer reports (pytest exit status $status)"
exit "$status"
