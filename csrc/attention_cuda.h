// Shared by the attention backends (csrc/attention_cpu.cpp, attention_cuda.cu,
// attention_fp32_cuda.cu): the output layout rule and the exact-fp32 CUDA entry points.
// (ops.h holds the op signatures and the argument checks.)
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <utility>

#include "philox.h"

#if defined(__CUDACC__) && !defined(TF_CUDA_EMULATE)
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>
#endif

namespace transformer_fast {

#if defined(__CUDACC__) && !defined(TF_CUDA_EMULATE)
// Head dims past 128 take 100-133 KB a block: more than compute capability 8.6 / 8.9 allows
// (99 KB; 8.0: 163 KB, 9.0: 227 KB).  Said before the launch, not as cudaFuncSetAttribute's
// "invalid argument".
inline void check_block_smem(size_t smem, int64_t head_dim, const char* who) {
  int dev = 0, optin = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  TORCH_CHECK(smem <= static_cast<size_t>(optin), who, ": head dim ", head_dim, " needs ", smem,
              " bytes of shared memory a block; device ", dev, " allows ", optin,
              " (use backend='triton' or 'torch' for it)");
}
#endif

// q's B, H, L dims from outermost to innermost in memory, as torch.empty_like orders a tensor
// that is not dense (ATen's infer_dense_strides; kernels/layout.py's memory_order): an insertion
// sort by stride from the innermost dim, where a broadcast (stride-0) dim compares as a tie, so
// it stays where it is among its neighbours, and of two equal strides the larger dim goes outside.
inline std::array<int64_t, 3> memory_order(const at::Tensor& q) {
  // > 0: dim b belongs inside dim a (swap), < 0: it does not, 0: undecided (look further out)
  const auto inner_first = [&](int64_t a, int64_t b) -> int {
    const int64_t sa = q.stride(a), sb = q.stride(b);
    if (sa == 0 || sb == 0) return 0;
    if (sa != sb) return sa > sb ? 1 : -1;
    return q.size(a) > q.size(b) ? 1 : 0;
  };
  std::array<int64_t, 3> perm = {2, 1, 0};  // innermost first
  for (int i = 1; i < 3; ++i) {
    int moving = i;
    for (int j = i - 1; j >= 0; --j) {
      const int cmp = inner_first(perm[j], perm[moving]);
      if (cmp > 0) {
        std::swap(perm[j], perm[moving]);
        moving = j;
      } else if (cmp < 0) {
        break;
      }
    }
  }
  return {perm[2], perm[1], perm[0]};
}

// An empty (B, H, L, D') tensor whose B, H, L dims lie in memory in the order q's do, D' last
// with unit stride: the rule of kernels/layout.py's empty_in_layout_of (the Triton launcher and
// the fake kernel).  q/k/v viewed from a packed (B, L, 3, H, D) projection
// then give an output whose head merge back to (B, L, H*D) is a view, not a copy; an expanded q
// gives the order torch.empty_like(q) gives, as torch's CPU SDPA does.
inline at::Tensor empty_in_layout_of(const at::Tensor& q, std::array<int64_t, 4> shape,
                                     const at::TensorOptions& options) {
  const std::array<int64_t, 3> order = memory_order(q);
  std::array<int64_t, 3> inverse{};
  for (int64_t pos = 0; pos < 3; ++pos) inverse[order[pos]] = pos;
  const at::Tensor base =
      at::empty({shape[order[0]], shape[order[1]], shape[order[2]], shape[3]}, options);
  return base.permute({inverse[0], inverse[1], inverse[2], 3});
}

// How the CUDA kernels' Params (attention_cuda.cu, attention_fp32_cuda.cu, masked_softmax_cuda.cu)
// encode attn_mask.
enum AttnMaskType : int { kMaskNone = 0, kMaskBool = 1, kMaskHalf = 2, kMaskBf16 = 3, kMaskFloat = 4 };

// The AttnMaskType of a mask tensor of dtype t (bool, fp16, bf16; any other dtype is read as fp32).
inline int attn_mask_type(c10::ScalarType t) {
  switch (t) {
    case at::kBool: return kMaskBool;
    case at::kHalf: return kMaskHalf;
    case at::kBFloat16: return kMaskBf16;
    default: return kMaskFloat;
  }
}

// Kernel arguments of both CUDA kernel families; E is the element type in memory (uint16_t bit
// patterns of fp16/bf16 for attention_cuda.cu, float for attention_fp32_cuda.cu).
template <typename E>
struct AttentionParams {
  const E* q;
  const E* k;
  const E* v;
  const E* dout;        // backward only
  const float* lse;     // backward: (B, H, Lq) contiguous
  const float* delta;   // backward: (B, H, Lq) contiguous
  const float* rinv;    // exact-fp32 backward: 1 / rowsum(exp(s - lse)), (B, H, Lq) contiguous
  E* out;               // forward: out; backward: dq (dq_kernel) / dk (dkdv_kernel)
  E* out2;              // dkdv_kernel: dv
  float* lse_out;       // forward: (B, H, Lq) contiguous; exact-fp32 backward's first pass: rinv
  float* delta_out;     // exact-fp32 backward's first pass: delta
  float* dq_acc;        // dkdv_wgmma_dense_kernel<..., kDq>: fp32 dQ sums, (B, H, Lq, 128) contiguous
  int64_t q_sb, q_sh, q_sm;
  int64_t k_sb, k_sh, k_sm;
  int64_t v_sb, v_sh, v_sm;
  int64_t do_sb, do_sh, do_sm;
  int64_t o_sb, o_sh, o_sm;     // out / dq / dk (unit stride along D)
  int64_t o2_sb, o2_sh, o2_sm;  // dv
  int B, H, Hkv, Lq, Lk, D;
  float scale;
  bool causal;
  const void* am;
  int am_type;
  int64_t am_sb, am_sh, am_sm, am_sn;
  const bool* kpm;
  int64_t kpm_sb, kpm_sn;
  const int64_t* rng;  // device [seed, offset], null without dropout
  bool vec16;  // mma kernels: every q/k/v/dout row start 16-byte aligned, D % 8 == 0
  uint32_t drop_threshold;
  float drop_scale;
};

// Fills the fields both CUDA kernel families' Params share: element pointers (typed as P's),
// strides, sizes, mask and dropout settings.  Inputs are checked already; unit stride along D.
template <typename P>
P fill_attention_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const std::optional<at::Tensor>& attn_mask,
                        const std::optional<at::Tensor>& kpm, bool causal, double scale,
                        double dropout_p, const std::optional<at::Tensor>& rng) {
  P p{};
  p.q = static_cast<decltype(p.q)>(q.const_data_ptr());
  p.k = static_cast<decltype(p.k)>(k.const_data_ptr());
  p.v = static_cast<decltype(p.v)>(v.const_data_ptr());
  p.q_sb = q.stride(0), p.q_sh = q.stride(1), p.q_sm = q.stride(2);
  p.k_sb = k.stride(0), p.k_sh = k.stride(1), p.k_sm = k.stride(2);
  p.v_sb = v.stride(0), p.v_sh = v.stride(1), p.v_sm = v.stride(2);
  p.B = static_cast<int>(q.size(0));
  p.H = static_cast<int>(q.size(1));
  p.Lq = static_cast<int>(q.size(2));
  p.D = static_cast<int>(q.size(3));
  p.Hkv = static_cast<int>(k.size(1));
  TORCH_CHECK(k.size(2) < (int64_t{1} << 30), "attention: key length ", k.size(2),
              " too large for the kernels' 32-bit key indices");
  p.Lk = static_cast<int>(k.size(2));
  p.scale = static_cast<float>(scale);
  p.causal = causal;
  p.am_type = kMaskNone;
  if (attn_mask.has_value() && attn_mask->defined()) {
    const at::Tensor& m = *attn_mask;
    p.am = m.const_data_ptr();
    p.am_type = attn_mask_type(m.scalar_type());
    p.am_sb = m.stride(0), p.am_sh = m.stride(1), p.am_sm = m.stride(2), p.am_sn = m.stride(3);
  }
  if (kpm.has_value() && kpm->defined()) {
    p.kpm = kpm->const_data_ptr<bool>();
    p.kpm_sb = kpm->stride(0), p.kpm_sn = kpm->stride(1);
  }
  if (dropout_p > 0.0) {
    p.rng = rng->const_data_ptr<int64_t>();
    p.drop_threshold = dropout_threshold(dropout_p);
    p.drop_scale = dropout_scale(dropout_p);
  }
  return p;
}

// Exact-fp32 attention kernels (attention_fp32_cuda.cu), called by attention_fwd_cuda /
// attention_bwd_cuda for fp32 inputs after the argument checks.  Every tensor is 4-D with unit
// stride along D (other strides read as given); attn_mask is (B, H, Lq, Lk) (stride-0 dims
// allowed), key_padding_mask (B, Lk) bool; lse (B, H, Lq) contiguous fp32.
void attention_fwd_fp32_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const std::optional<at::Tensor>& attn_mask,
                             const std::optional<at::Tensor>& key_padding_mask, bool is_causal,
                             double scale, double dropout_p, const std::optional<at::Tensor>& rng,
                             at::Tensor& out, at::Tensor& lse);

void attention_bwd_fp32_cuda(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                             const at::Tensor& v, const at::Tensor& lse,
                             const std::optional<at::Tensor>& attn_mask,
                             const std::optional<at::Tensor>& key_padding_mask, bool is_causal,
                             double scale, double dropout_p, const std::optional<at::Tensor>& rng,
                             at::Tensor& dq, at::Tensor& dk, at::Tensor& dv);

}  // namespace transformer_fast
