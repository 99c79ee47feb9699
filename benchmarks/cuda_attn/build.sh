#!/bin/bash
# Builds attn_bench against the repo's csrc/ forward kernels (extracted unchanged, and the
# package's attention_dense_fwd.cuh / attention_wgmma_dense.cuh), the dense backward kernels
# (attention_dense_{dq,dkdv}.cuh, attention_wgmma_{dkdv,dq}.cuh) + the draft fwd_dense.cuh.
# Usage: REPO=/path/to/repo ./build.sh   (default REPO: two levels up, i.e. benchmarks/cuda_attn/..)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="${REPO:-$(cd "$HERE/../.." && pwd)}"
GEN="$HERE/gen"
mkdir -p "$GEN"
cp "$REPO/csrc/attention_device.cuh" "$REPO/csrc/philox.h" "$REPO/csrc/attention_wgmma.cuh" \
   "$REPO/csrc/attention_dense_fwd.cuh" "$REPO/csrc/attention_dense_dq.cuh" "$REPO/csrc/attention_dense_dkdv.cuh" \
   "$REPO/csrc/attention_wgmma_dense.cuh" "$REPO/csrc/attention_wgmma_dkdv.cuh" "$REPO/csrc/attention_wgmma_dq.cuh" "$GEN/"
# A torch-free attention_cuda.h: the mask enum and AttentionParams taken from the repo's header
# (the rest of it needs ATen), so the harness compiles against the kernels' real Params.
{
  printf '#pragma once\n#include <cstdint>\n#include "philox.h"\nnamespace transformer_fast {\n'
  grep -E '^enum AttnMaskType' "$REPO/csrc/attention_cuda.h"
  awk '/^template <typename E>$/{t=$0; next} /^struct AttentionParams \{/{print t; f=1} f{print} f&&/^\};/{exit}' \
      "$REPO/csrc/attention_cuda.h"
  printf '}  // namespace transformer_fast\n'
} > "$GEN/attention_cuda.h"
grep -q "struct AttentionParams" "$GEN/attention_cuda.h" || { echo "AttentionParams extraction failed"; exit 1; }
awk '/^constexpr int kThreads = 128;/{f=1} f{print} /#include "attention_wgmma.cuh"/{if(f) exit}' \
    "$REPO/csrc/attention_cuda.cu" > "$GEN/fwd_extract.inc"
grep -q "fwd_kernel" "$GEN/fwd_extract.inc" || { echo "extraction failed"; exit 1; }
NVCC="${NVCC:-nvcc}"
"$NVCC" -std=c++17 -O3 -lineinfo -gencode=arch=compute_90a,code=sm_90a -I"$GEN" -I"$HERE" \
    -Xptxas -v "$HERE/attn_bench.cu" -o "$HERE/attn_bench" 2> "$HERE/ptxas.txt" || { cat "$HERE/ptxas.txt"; exit 1; }
