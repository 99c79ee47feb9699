// Per-element pieces both CUDA attention kernel families share (attention_cuda.cu's mma.sync
// kernels and attention_fp32_cuda.cu's SIMT kernels): a score's masking and its dropout factor,
// written once against any Params with the fields fill_attention_params (attention_cuda.h) sets.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "attention_cuda.h"
#include "philox.h"

namespace transformer_fast {
namespace attn_device {

// Score of (query i, key j) given the raw dot product: scaled, masked (-inf), float mask added,
// in the dot's type (float; double for attention_fp32_cuda.cu's backward, whose scores stay
// unrounded until the lse is subtracted).
template <typename P, typename S>
__device__ __forceinline__ S masked_score(const P& p, int b, int h, int i, int j, S dot) {
  if (j >= p.Lk || i >= p.Lq) return -INFINITY;
  if (p.causal && j > i) return -INFINITY;
  if (p.kpm != nullptr && p.kpm[b * p.kpm_sb + j * p.kpm_sn]) return -INFINITY;
  S s = dot * p.scale;
  if (p.am_type != kMaskNone) {
    const int64_t off = b * p.am_sb + h * p.am_sh + i * p.am_sm + j * p.am_sn;
    switch (p.am_type) {
      case kMaskBool:
        if (!static_cast<const bool*>(p.am)[off]) return -INFINITY;
        break;
      case kMaskHalf:
        s += __half2float(static_cast<const __half*>(p.am)[off]);
        break;
      case kMaskBf16:
        s += __bfloat162float(static_cast<const __nv_bfloat16*>(p.am)[off]);
        break;
      default:
        s += static_cast<const float*>(p.am)[off];
        break;
    }
  }
  return s;
}

// The dropout stream's (seed, offset), read from the device [seed, offset] pair; (0, 0) without
// dropout, where drop_factor does not use them.
struct DropoutKey {
  uint64_t seed, offset;
};
template <typename P>
__device__ __forceinline__ DropoutKey dropout_key(const P& p) {
  if (p.rng == nullptr) return {0, 0};
  return {static_cast<uint64_t>(p.rng[0]), static_cast<uint64_t>(p.rng[1])};
}

// 1/(1-p) if element (b, h, i, j) is kept by the dropout stream, else 0 (1 without dropout).
template <typename P>
__device__ __forceinline__ float drop_factor(const P& p, uint64_t seed, uint64_t offset, int b,
                                             int h, int i, int j) {
  if (p.rng == nullptr) return 1.0f;
  const uint64_t idx = ((static_cast<uint64_t>(b) * p.H + h) * p.Lq + i) * p.Lk + j;
  return philox_word(seed, offset, idx) >= p.drop_threshold ? p.drop_scale : 0.0f;
}

// max that propagates NaN (fmaxf drops it, which would turn a NaN row into a dead row instead
// of the NaN row the reference gives).
__device__ __forceinline__ float nan_max(float m, float x) { return (x > m || x != x) ? x : m; }

// Head-dim bucket: the padded width the kernels are instantiated for.
inline int head_dim_bucket(int64_t D) { return D <= 64 ? 64 : (D <= 128 ? 128 : 256); }

}  // namespace attn_device
}  // namespace transformer_fast
