#!/bin/bash
# One device call (~1-2 min): build, time every variant, then one ncu pass on the quick shape.
#   bash benchmarks/cuda_attn/run.sh          (from the repo root; results under $OUT or ./out)
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
"$HERE/build.sh" > "$OUT/build.txt" 2>&1 || { cat "$OUT/build.txt"; exit 1; }
cp "$HERE/ptxas.txt" "$OUT/"
timeout 240 "$HERE/attn_bench" > "$OUT/bench.txt" 2>&1; echo "bench rc=$?" >> "$OUT/bench.txt"
if command -v ncu > /dev/null && [ "${NO_NCU:-0}" != 1 ]; then
  timeout 200 ncu --target-processes all -k regex:'fwd_kernel|fwd_wgmma|fwd_dense' \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section InstructionStats \
      --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
      --metrics smsp__inst_executed.sum,sm__cycles_elapsed.avg,smsp__thread_inst_executed_per_inst_executed.ratio \
      "$HERE/attn_bench" --quick --once > "$OUT/ncu.txt" 2>&1
  echo "ncu rc=$?" >> "$OUT/ncu.txt"
  grep -E "fwd_|Duration|Issue Slots Busy|Executed Ipc Active|Warp Cycles Per Issued|No Instruction|Stall|Achieved Occupancy|Registers Per|inst_executed.sum|cycles_elapsed" "$OUT/ncu.txt" | head -150 > "$OUT/ncu_summary.txt"
fi
cat "$OUT/gpu.txt"; tail -30 "$OUT/bench.txt"
