#!/bin/bash
# One device call (~1-2 min): build, time every variant, then one ncu pass on the quick shape.
#   bash benchmarks/cuda_attn/run.sh          (from the repo root; results under $OUT or ./out)
# Everything is also printed as it is produced (gpu_suite.sh's step budget may kill this script:
# what was printed stays in its logs.txt).  Exit status: the timing run's.
#   BENCH_TIMEOUT (default 240 s), NCU_TIMEOUT (default 200 s), NO_NCU=1 skips the ncu pass.
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv 2>&1 | tee "$OUT/gpu.txt"
"$HERE/build.sh" > "$OUT/build.txt" 2>&1 || { cat "$OUT/build.txt"; exit 1; }
cp "$HERE/ptxas.txt" "$OUT/"
# Registers and spills per kernel, names demangled.
grep -E "Compiling entry|Used|spill" "$OUT/ptxas.txt" | sed -E "s/.*Compiling entry function '([^']+)'.*/\1/" \
    | { c++filt 2>/dev/null || cat; } | sed -E 's/\(transformer_fast::AttentionParams<[a-z ]+>\)//; s/ptxas info +: //'
timeout "${BENCH_TIMEOUT:-240}" "$HERE/attn_bench" 2>&1 | tee "$OUT/bench.txt"
rc=${PIPESTATUS[0]}
echo "bench rc=$rc" | tee -a "$OUT/bench.txt"
if command -v ncu > /dev/null && [ "${NO_NCU:-0}" != 1 ]; then
  timeout "${NCU_TIMEOUT:-200}" ncu --target-processes all -k regex:'fwd_kernel|fwd_wgmma|fwd_dense' \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section InstructionStats \
      --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
      --metrics smsp__inst_executed.sum,sm__cycles_elapsed.avg,smsp__thread_inst_executed_per_inst_executed.ratio \
      "$HERE/attn_bench" --quick --once > "$OUT/ncu.txt" 2>&1
  echo "ncu rc=$?" >> "$OUT/ncu.txt"
  grep -E "fwd_|Duration|Issue Slots Busy|Executed Ipc Active|Warp Cycles Per Issued|No Instruction|Stall|Achieved Occupancy|Registers Per|inst_executed.sum|cycles_elapsed|ncu rc" "$OUT/ncu.txt" | head -150 | tee "$OUT/ncu_summary.txt"
fi
exit "$rc"
