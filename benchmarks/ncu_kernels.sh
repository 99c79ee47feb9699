#!/usr/bin/env bash
# Nsight Compute over one launch of each kernel whose speed the GPU runs so far left unexplained
# (benchmarks/NOTES.md, third GPU run): the Triton FFN GEMM (43% of cuBLAS at issue 6's shape),
# the Triton attention forward, the CUDA dense mma.sync forward and the sm_90a wgmma forward (240
# TFLOP/s against a 380-520 prediction).  One ncu process per kernel (`-k regex:NAME -c 1`: its
# first launch in a profile_ops.py run of the case), so that one kernel's failure or time-out
# costs only its own line.  Run from the repository root on a GPU machine (gpu_suite.sh's
# `ncu_kernels` step); prints a short summary per kernel (the full report is long).
#   PY (default python3), NCU_EACH (seconds per kernel, default 75)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$(command -v python3 || command -v python)}
if ! command -v ncu > /dev/null; then
    echo "ncu not found: nothing profiled"
    exit 0
fi
# Tensor pipes (gmma = wgmma, hmma = mma.sync), shared-memory bank conflicts of LSU accesses
# (wgmma's own operand reads are not among them), L2 and DRAM bytes.
METRICS=sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active
METRICS+=,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
METRICS+=,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum
METRICS+=,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum
METRICS+=,lts__t_bytes.sum,dram__bytes_read.sum,dram__bytes_write.sum
PROFILE=(benchmarks/profile_ops.py --iters 1 --max-cases 1)
status=0

one() {  # one KERNEL_REGEX [ENV=VALUE ...] -- profile_ops arguments
    local name=$1; shift
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    echo "=== ncu: $name (${envs[*]} ${*})"
    timeout "${NCU_EACH:-75}" env "${envs[@]}" ncu --target-processes all -k "regex:$name" -c 1 \
        --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
        --metrics "$METRICS" "$PY" "${PROFILE[@]}" "$@" > /tmp/tf_ncu_one.txt 2>&1
    local rc=$?
    grep -E "^  [A-Za-z_].*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|L2 Cache Throughput|Registers Per|Shared Memory Config|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|Executed Ipc Active|Warp Cycles Per Issued|Stall|pipe_tensor|bank_conflicts|lts__t_bytes|dram__bytes|Block Size|Grid Size|==ERROR==|==WARNING==" \
        /tmp/tf_ncu_one.txt | head -60
    echo "ncu $name rc=$rc"
    [ "$rc" -eq 0 ] || status=1
}

AT=TRANSFORMER_FAST_AUTOTUNE=0  # the first config of each Triton list: no autotuning launches
one _gemm_kernel $AT -- --op feed_forward --match "d_ff=4096" --providers triton
one _attn_fwd_kernel $AT -- --op scaled_dot_product_attention --match "L=1024 D=128 none" --providers triton
one fwd_dense_kernel $AT -- --op scaled_dot_product_attention --match "L=1024 D=128 none" --providers cuda
one fwd_wgmma_dense_kernel $AT TRANSFORMER_FAST_CUDA_WGMMA=1 -- \
    --op scaled_dot_product_attention --match "L=1024 D=128 none" --providers cuda
exit $status
