// Stand-in for csrc/attention_cuda.h without ATen: only what the device code needs
// (AttentionParams, the mask-type enum).  Copied next to the repo's attention_device.cuh /
// philox.h / attention_wgmma.cuh by build.sh so that the repo's own forward kernels compile
// in a standalone (torch-free) benchmark.
#pragma once
#include <cstdint>
#include "philox.h"
namespace transformer_fast {
enum AttnMaskType : int { kMaskNone = 0, kMaskBool = 1, kMaskHalf = 2, kMaskBf16 = 3, kMaskFloat = 4 };
template <typename E>
struct AttentionParams {
  const E* q;
  const E* k;
  const E* v;
  const E* dout;
  const float* lse;
  const float* delta;
  const float* lse_lo;
  E* out;
  E* out2;
  float* lse_out;
  float* delta_out;
  int64_t q_sb, q_sh, q_sm;
  int64_t k_sb, k_sh, k_sm;
  int64_t v_sb, v_sh, v_sm;
  int64_t do_sb, do_sh, do_sm;
  int64_t o_sb, o_sh, o_sm;
  int64_t o2_sb, o2_sh, o2_sm;
  int B, H, Hkv, Lq, Lk, D;
  float scale;
  bool causal;
  const void* am;
  int am_type;
  int64_t am_sb, am_sh, am_sm, am_sn;
  const bool* kpm;
  int64_t kpm_sb, kpm_sn;
  const int64_t* rng;
  bool vec16;
  uint32_t drop_threshold;
  float drop_scale;
};
}  // namespace transformer_fast
