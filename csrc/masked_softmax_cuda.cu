// Fused scale + mask + softmax (+ dropout) on CUDA: the `cuda` backend of
// transformer_fast.functional.masked_softmax, forward and backward.
//
// Written without a GPU: it has NEVER RUN ON ONE.  It compiles for sm_80 / sm_90a, and its kernels
// and host code are tested in CPU emulation (TF_CUDA_EMULATE below; tests/test_masked_softmax_cxx.py
// compiles this file as host C++ with CTAs as threads and emulated shuffles / __syncthreads)
// against the oracle (the emulation also aborts on a group access that is not aligned to its
// width).  Races, memory-model issues and speed are unverified until a GPU run
// (tests/test_gpu_masked_softmax_cuda.py, benchmarks/sanitize_kernels.py).
//
// Contract: identical to the Triton launchers (docstring of kernels/masked_softmax.py) and to
// masked_softmax_cpu.cpp:
//   masked_softmax_fwd(scores, mask?, scale, is_causal, dropout_p, rng?) -> (out, probs)
//   masked_softmax_bwd(dout, probs, scale, dropout_p, rng?) -> dscores
// scores / dout / probs (B, H, Lq, Lk) fp32/fp16/bf16 read through their strides (unit last
// stride, else copied); mask (B, H, Lq, Lk) through all four strides (stride-0 dims included),
// bool True = takes part, float (fp32/fp16/bf16; fp64 converted) added after scaling; top-left
// causal.  Outputs contiguous.  Dead rows (nothing allowed, or only -inf) are zeros; NaN / +inf
// scores make the row NaN, like the reference.  Dropout: Philox (philox.h) over the element index
// ((b*H + h)*Lq + i)*Lk + j, [seed, offset] read from device memory, kept values * 1/(1-p).
// fp32 math; deterministic (fixed reduction orders, no atomics).
//
// Kernels (a row is (b, h, i); rows are numbered (b*H + h)*Lq + i):
//   *_warp_kernel   Lk <= 1024: one warp per row, kRowsPerCta rows per CTA, the row in registers
//                   (ITEMS = 4..32 values per lane, in groups of G contiguous elements so that a
//                   group is one 8- or 16-byte access when aligned).  One read of the inputs, one
//                   write of the outputs; reductions by xor shuffles.
//   *_block_kernel  longer rows (any length): one CTA of kBlockThreads per row, a loop over
//                   chunks.  Forward: pass 1 keeps a per-thread online max / rescaled sum, merged
//                   over the CTA in a fixed order; pass 2 re-reads (mostly from L2) and writes.
//                   Backward: pass 1 delta = sum(dp * probs), pass 2 writes.
// Entries past the causal diagonal are not read.  Out of scope for this version: splitting one
// very long row over several CTAs when there are fewer rows than SMs (the Triton backend's looped
// path does it), packing several tiny rows into one warp.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#ifndef TF_CUDA_EMULATE
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_runtime.h>
#define TF_MS_DEVICE at::kCUDA
#else
#define TF_MS_DEVICE at::kCPU
#endif

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "attention_cuda.h"  // AttnMaskType, attn_mask_type
#include "masked_softmax.h"
#include "ops.h"
#include "philox.h"

namespace transformer_fast {
namespace {

using at::Tensor;

constexpr int kRowsPerCta = 4;                   // warp kernels: 4 warps, one row each
constexpr int kWarpThreads = 32 * kRowsPerCta;
constexpr int kMaxItems = 32;                    // warp kernels: values per lane (Lk <= 1024)
constexpr int kBlockThreads = 256;               // block kernels
constexpr int kBlockWarps = kBlockThreads / 32;
constexpr float kLog2e = 1.4426950408889634f;

struct FwdParams {
  const void* s;  // scores
  int64_t s_sb, s_sh, s_sm;
  const void* am;  // mask
  int am_type;
  int64_t am_sb, am_sh, am_sm, am_sn;
  void* out;           // (M, Lk) contiguous
  void* probs;         // (M, Lk) contiguous, with dropout only
  const int64_t* rng;  // device [seed, offset]; null without dropout
  int M, H, Lq, Lk;
  float scale;
  bool causal;
  bool vec_in;   // scores' row starts allow group-wide loads
  bool vec_out;  // Lk % G == 0: group-wide stores
  uint32_t drop_threshold;
  float drop_scale;
};

struct BwdParams {
  const void* dout;
  int64_t d_sb, d_sh, d_sm;
  const void* probs;
  int64_t p_sb, p_sh, p_sm;
  void* ds;  // (M, Lk) contiguous
  const int64_t* rng;
  int M, H, Lq, Lk;
  float scale;
  bool vec_in;  // dout's and probs' row starts allow group-wide loads
  bool vec_out;
  uint32_t drop_threshold;
  float drop_scale;
};

// ---- element conversions (the build defines __CUDA_NO_HALF_CONVERSIONS__: explicit calls)

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// G contiguous elements moved as one access (8 or 16 bytes) when aligned.
template <typename T, int G>
struct alignas(sizeof(T) * G) Pack {
  T v[G];
};

constexpr int cmin(int a, int b) { return a < b ? a : b; }

// Group size of a type: 16 bytes, or fewer elements when a lane holds fewer.
template <typename T, int ITEMS>
constexpr int group_of() { return cmin(ITEMS, static_cast<int>(16 / sizeof(T))); }

// Loads elements [j0, j0 + G) of a row as floats; those at or past n read as `fill`.
template <typename T, int G>
__device__ __forceinline__ void load_group(const T* row, int64_t j0, int64_t n, bool vec, float fill,
                                           float (&x)[G]) {
  if (vec && j0 + G <= n) {
#ifdef TF_CUDA_EMULATE
    if (reinterpret_cast<uintptr_t>(row + j0) % sizeof(Pack<T, G>) != 0) std::abort();  // host bug
#endif
    const Pack<T, G> pk = *reinterpret_cast<const Pack<T, G>*>(row + j0);
#pragma unroll
    for (int g = 0; g < G; ++g) x[g] = to_f(pk.v[g]);
  } else {
#pragma unroll
    for (int g = 0; g < G; ++g) x[g] = j0 + g < n ? to_f(row[j0 + g]) : fill;
  }
}

// Stores elements [j0, j0 + G) of a row (those at or past n are skipped).
template <typename T, int G>
__device__ __forceinline__ void store_group(T* row, int64_t j0, int64_t n, bool vec, const float (&x)[G]) {
  if (vec && j0 + G <= n) {
    Pack<T, G> pk;
#pragma unroll
    for (int g = 0; g < G; ++g) pk.v[g] = from_f<T>(x[g]);
#ifdef TF_CUDA_EMULATE
    if (reinterpret_cast<uintptr_t>(row + j0) % sizeof(Pack<T, G>) != 0) std::abort();  // host bug
#endif
    *reinterpret_cast<Pack<T, G>*>(row + j0) = pk;
  } else {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (j0 + g < n) row[j0 + g] = from_f<T>(x[g]);
    }
  }
}

__device__ __forceinline__ int64_t row_offset(int row, int H, int Lq, int64_t sb, int64_t sh, int64_t sm) {
  const int i = row % Lq, bh = row / Lq;
  return static_cast<int64_t>(bh / H) * sb + static_cast<int64_t>(bh % H) * sh + static_cast<int64_t>(i) * sm;
}

// Masked, scaled scores of the group [j0, j0 + G): -inf where removed (mask False, float mask
// -inf, past the causal limit n, or past Lk).  `x` holds the raw scores (read for j < n only).
template <int G>
__device__ __forceinline__ void mask_group(const FwdParams& p, int64_t am_row, int64_t j0, int64_t n,
                                           float (&x)[G]) {
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const int64_t j = j0 + g;
    float s = x[g] * p.scale;
    if (j >= n) {
      s = -INFINITY;
    } else if (p.am_type != kMaskNone) {
      const int64_t off = am_row + j * p.am_sn;
      switch (p.am_type) {
        case kMaskBool:
          if (!static_cast<const bool*>(p.am)[off]) s = -INFINITY;
          break;
        case kMaskHalf: s += __half2float(static_cast<const __half*>(p.am)[off]); break;
        case kMaskBf16: s += __bfloat162float(static_cast<const __nv_bfloat16*>(p.am)[off]); break;
        default: s += static_cast<const float*>(p.am)[off]; break;
      }
    }
    x[g] = s;
  }
}

// max that propagates NaN (fmaxf drops it).
__device__ __forceinline__ float nan_max(float m, float x) { return (x > m || x != x) ? x : m; }

// The xor butterflies leave the same bits in every lane (the combining operations are commutative).
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// Shift of the exponentials: the row max, or 0 for a dead row (m = -inf), so that exp gives 0
// there instead of exp(-inf + inf) = NaN.
__device__ __forceinline__ float safe_shift(float m) { return m == -INFINITY ? 0.0f : m; }

__device__ __forceinline__ float exp_shifted(float s, float shift) { return exp2f((s - shift) * kLog2e); }

// 1 / l; 0 for a dead row (l == 0).  A NaN l (NaN or +inf score) stays NaN, as in the reference.
__device__ __forceinline__ float inv_sum(float l) { return l == 0.0f ? 0.0f : 1.0f / l; }

// Online (max, sum of exp) pairs merged: (m1, l1) + (m2, l2).
__device__ __forceinline__ void merge_stats(float& m, float& l, float m2, float l2) {
  const float mn = nan_max(m, m2);
  const float sh = safe_shift(mn);
  l = l * exp_shifted(m, sh) + l2 * exp_shifted(m2, sh);
  m = mn;
}

struct Dropout {
  uint64_t seed = 0, offset = 0;
  uint32_t threshold = 0;
  float scale = 1.0f;
  bool on = false;
  __device__ __forceinline__ float factor(uint64_t index) const {
    return philox_word(seed, offset, index) >= threshold ? scale : 0.0f;
  }
};

__device__ __forceinline__ Dropout make_dropout(const int64_t* rng, uint32_t threshold, float scale) {
  Dropout d;
  if (rng != nullptr) {  // [seed, offset] read on the device: no host synchronisation
    d.seed = static_cast<uint64_t>(rng[0]);
    d.offset = static_cast<uint64_t>(rng[1]);
    d.threshold = threshold;
    d.scale = scale;
    d.on = true;
  }
  return d;
}

// Writes probabilities [j0, j0 + G) of row `row` (p = e * inv), with dropout into out and the
// pre-dropout values into probs.
template <typename T, int G>
__device__ __forceinline__ void write_probs(const FwdParams& p, const Dropout& drop, int row, int64_t j0,
                                            float (&v)[G]) {
  const int64_t base = static_cast<int64_t>(row) * p.Lk;
  if (drop.on) {
    store_group<T, G>(static_cast<T*>(p.probs) + base, j0, p.Lk, p.vec_out, v);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (j0 + g < p.Lk) v[g] *= drop.factor(static_cast<uint64_t>(base + j0 + g));
    }
  }
  store_group<T, G>(static_cast<T*>(p.out) + base, j0, p.Lk, p.vec_out, v);
}

// ---------------------------------------------------------------------------------------------
// Forward

template <typename T, int ITEMS>
__global__ void __launch_bounds__(kWarpThreads) fwd_warp_kernel(const FwdParams p) {
  constexpr int G = group_of<T, ITEMS>();
  constexpr int NG = ITEMS / G;
  const int lane = threadIdx.x % 32;
  const int row = static_cast<int>(blockIdx.x) * kRowsPerCta + static_cast<int>(threadIdx.x / 32);
  if (row >= p.M) return;  // the whole warp: no CTA-wide barrier in this kernel
  const int i = row % p.Lq;
  const int64_t n = p.causal ? cmin(p.Lk, i + 1) : p.Lk;
  const T* srow = static_cast<const T*>(p.s) + row_offset(row, p.H, p.Lq, p.s_sb, p.s_sh, p.s_sm);
  const int64_t am_row = p.am_type != kMaskNone ? row_offset(row, p.H, p.Lq, p.am_sb, p.am_sh, p.am_sm) : 0;

  float x[NG][G];
  float m = -INFINITY;
#pragma unroll
  for (int k = 0; k < NG; ++k) {
    const int64_t j0 = static_cast<int64_t>(k * 32 + lane) * G;
    load_group<T, G>(srow, j0, n, p.vec_in, 0.0f, x[k]);
    mask_group<G>(p, am_row, j0, n, x[k]);
#pragma unroll
    for (int g = 0; g < G; ++g) m = nan_max(m, x[k][g]);
  }
  const float shift = safe_shift(warp_max(m));
  float l = 0.0f;
#pragma unroll
  for (int k = 0; k < NG; ++k) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      x[k][g] = exp_shifted(x[k][g], shift);
      l += x[k][g];
    }
  }
  const float inv = inv_sum(warp_sum(l));
  const Dropout drop = make_dropout(p.rng, p.drop_threshold, p.drop_scale);
#pragma unroll
  for (int k = 0; k < NG; ++k) {
    const int64_t j0 = static_cast<int64_t>(k * 32 + lane) * G;
    if (j0 >= p.Lk) continue;
#pragma unroll
    for (int g = 0; g < G; ++g) x[k][g] *= inv;
    write_probs<T, G>(p, drop, row, j0, x[k]);
  }
}

// Merges per-thread (m, l) over the CTA in a fixed order; every thread gets the same result.
__device__ __forceinline__ void block_merge_stats(float& m, float& l, float* red) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, off);
    const float l2 = __shfl_xor_sync(0xffffffffu, l, off);
    merge_stats(m, l, m2, l2);
  }
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) {
    red[2 * warp] = m;
    red[2 * warp + 1] = l;
  }
  __syncthreads();
  m = red[0];
  l = red[1];
  for (int w = 1; w < kBlockWarps; ++w) merge_stats(m, l, red[2 * w], red[2 * w + 1]);
}

__device__ __forceinline__ float block_sum(float v, float* red) {
  v = warp_sum(v);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  float total = red[0];
  for (int w = 1; w < kBlockWarps; ++w) total += red[w];
  return total;
}

constexpr size_t kBlockSmem = 2 * kBlockWarps * sizeof(float);

template <typename T>
__global__ void __launch_bounds__(kBlockThreads) fwd_block_kernel(const FwdParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* red = reinterpret_cast<float*>(smem_raw);
  constexpr int G = 16 / sizeof(T);
  constexpr int64_t kStride = static_cast<int64_t>(kBlockThreads) * G;
  const int row = static_cast<int>(blockIdx.x);
  const int i = row % p.Lq;
  const int64_t n = p.causal ? cmin(p.Lk, i + 1) : p.Lk;
  const T* srow = static_cast<const T*>(p.s) + row_offset(row, p.H, p.Lq, p.s_sb, p.s_sh, p.s_sm);
  const int64_t am_row = p.am_type != kMaskNone ? row_offset(row, p.H, p.Lq, p.am_sb, p.am_sh, p.am_sm) : 0;
  const int64_t first = static_cast<int64_t>(threadIdx.x) * G;

  // pass 1: per-thread online max / rescaled sum over the groups j0 = first + c * kStride
  float m = -INFINITY, l = 0.0f;
  for (int64_t j0 = first; j0 < n; j0 += kStride) {
    float x[G];
    load_group<T, G>(srow, j0, n, p.vec_in, 0.0f, x);
    mask_group<G>(p, am_row, j0, n, x);
    float gm = -INFINITY;
#pragma unroll
    for (int g = 0; g < G; ++g) gm = nan_max(gm, x[g]);
    const float mn = nan_max(m, gm);
    const float sh = safe_shift(mn);
    float gl = 0.0f;
#pragma unroll
    for (int g = 0; g < G; ++g) gl += exp_shifted(x[g], sh);
    l = l * exp_shifted(m, sh) + gl;
    m = mn;
  }
  block_merge_stats(m, l, red);
  const float shift = safe_shift(m);
  const float inv = inv_sum(l);

  // pass 2: probabilities over the whole row (past the causal limit: exp(-inf) * inv)
  const Dropout drop = make_dropout(p.rng, p.drop_threshold, p.drop_scale);
  for (int64_t j0 = first; j0 < p.Lk; j0 += kStride) {
    float x[G];
    load_group<T, G>(srow, j0, n, p.vec_in, 0.0f, x);
    mask_group<G>(p, am_row, j0, n, x);
#pragma unroll
    for (int g = 0; g < G; ++g) x[g] = exp_shifted(x[g], shift) * inv;
    write_probs<T, G>(p, drop, row, j0, x);
  }
}

// ---------------------------------------------------------------------------------------------
// Backward: ds = scale * probs * (dp - sum(dp * probs)), dp = dout (* keep / (1-p))

template <typename T, int G>
__device__ __forceinline__ void load_p_dp(const BwdParams& p, const Dropout& drop, const T* prow,
                                          const T* drow, int row, int64_t j0, float (&pv)[G],
                                          float (&dv)[G]) {
  load_group<T, G>(prow, j0, p.Lk, p.vec_in, 0.0f, pv);
  load_group<T, G>(drow, j0, p.Lk, p.vec_in, 0.0f, dv);
  if (drop.on) {
    const int64_t base = static_cast<int64_t>(row) * p.Lk + j0;
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (j0 + g < p.Lk) dv[g] *= drop.factor(static_cast<uint64_t>(base + g));
    }
  }
}

template <typename T, int G>
__device__ __forceinline__ void store_ds(const BwdParams& p, int row, int64_t j0, float delta,
                                         const float (&pv)[G], const float (&dv)[G]) {
  float o[G];
#pragma unroll
  for (int g = 0; g < G; ++g) o[g] = p.scale * (pv[g] * (dv[g] - delta));
  store_group<T, G>(static_cast<T*>(p.ds) + static_cast<int64_t>(row) * p.Lk, j0, p.Lk, p.vec_out, o);
}

template <typename T, int ITEMS>
__global__ void __launch_bounds__(kWarpThreads) bwd_warp_kernel(const BwdParams p) {
  constexpr int G = group_of<T, ITEMS>();
  constexpr int NG = ITEMS / G;
  const int lane = threadIdx.x % 32;
  const int row = static_cast<int>(blockIdx.x) * kRowsPerCta + static_cast<int>(threadIdx.x / 32);
  if (row >= p.M) return;
  const T* prow = static_cast<const T*>(p.probs) + row_offset(row, p.H, p.Lq, p.p_sb, p.p_sh, p.p_sm);
  const T* drow = static_cast<const T*>(p.dout) + row_offset(row, p.H, p.Lq, p.d_sb, p.d_sh, p.d_sm);
  const Dropout drop = make_dropout(p.rng, p.drop_threshold, p.drop_scale);
  float pv[NG][G], dv[NG][G];
  float acc = 0.0f;
#pragma unroll
  for (int k = 0; k < NG; ++k) {
    const int64_t j0 = static_cast<int64_t>(k * 32 + lane) * G;
    load_p_dp<T, G>(p, drop, prow, drow, row, j0, pv[k], dv[k]);
#pragma unroll
    for (int g = 0; g < G; ++g) acc += pv[k][g] * dv[k][g];
  }
  const float delta = warp_sum(acc);
#pragma unroll
  for (int k = 0; k < NG; ++k) {
    const int64_t j0 = static_cast<int64_t>(k * 32 + lane) * G;
    if (j0 < p.Lk) store_ds<T, G>(p, row, j0, delta, pv[k], dv[k]);
  }
}

template <typename T>
__global__ void __launch_bounds__(kBlockThreads) bwd_block_kernel(const BwdParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* red = reinterpret_cast<float*>(smem_raw);
  constexpr int G = 16 / sizeof(T);
  constexpr int64_t kStride = static_cast<int64_t>(kBlockThreads) * G;
  const int row = static_cast<int>(blockIdx.x);
  const T* prow = static_cast<const T*>(p.probs) + row_offset(row, p.H, p.Lq, p.p_sb, p.p_sh, p.p_sm);
  const T* drow = static_cast<const T*>(p.dout) + row_offset(row, p.H, p.Lq, p.d_sb, p.d_sh, p.d_sm);
  const Dropout drop = make_dropout(p.rng, p.drop_threshold, p.drop_scale);
  const int64_t first = static_cast<int64_t>(threadIdx.x) * G;
  float acc = 0.0f;
  for (int64_t j0 = first; j0 < p.Lk; j0 += kStride) {
    float pv[G], dv[G];
    load_p_dp<T, G>(p, drop, prow, drow, row, j0, pv, dv);
#pragma unroll
    for (int g = 0; g < G; ++g) acc += pv[g] * dv[g];
  }
  const float delta = block_sum(acc, red);
  for (int64_t j0 = first; j0 < p.Lk; j0 += kStride) {
    float pv[G], dv[G];
    load_p_dp<T, G>(p, drop, prow, drow, row, j0, pv, dv);
    store_ds<T, G>(p, row, j0, delta, pv, dv);
  }
}

// ---------------------------------------------------------------------------------------------
// Host side

Tensor unit_last(const Tensor& t) { return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous(); }

// Whether every row start of a (B, H, L, Lk) tensor is aligned to `bytes`.
bool rows_aligned(const Tensor& t, int64_t bytes) {
  const int64_t e = bytes / static_cast<int64_t>(t.element_size());
  return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % bytes == 0 && t.stride(0) % e == 0 &&
         t.stride(1) % e == 0 && t.stride(2) % e == 0;
}

// Values per lane of the warp kernels for a row of Lk: a power of two in [4, kMaxItems]; 0 means
// the row is too long (block kernel).
int warp_items(int64_t Lk) {
  int items = 4;
  while (items * 32 < Lk) items *= 2;
  return items <= kMaxItems ? items : 0;
}

template <typename T>
int group_bytes(int items) {
  const int g = items > 0 ? std::min<int>(items, 16 / sizeof(T)) : 16 / sizeof(T);
  return g * static_cast<int>(sizeof(T));
}

#ifndef TF_CUDA_EMULATE
void check_cuda_device(const Tensor& t) {
  int major = 0, minor = 0;
  const int dev = t.get_device();
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  TORCH_CHECK(major >= 8, "masked_softmax (cuda): compiled for compute capability 8.0+ (sm_80, "
              "sm_90a); device ", dev, " is ", major, ".", minor, ": use the triton or torch backend");
}

template <typename Kernel, typename P>
void launch(Kernel kernel, int64_t blocks, int threads, size_t smem, const P& p) {
  TORCH_CHECK(blocks > 0 && blocks < (int64_t{1} << 31), "masked_softmax (cuda): bad grid size ", blocks);
  kernel<<<static_cast<unsigned>(blocks), threads, smem, c10::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
#endif  // TF_CUDA_EMULATE (the emulation provides check_cuda_device and launch)

template <typename T>
void run_fwd(const FwdParams& p, int items) {
  switch (items) {
    case 4: launch(fwd_warp_kernel<T, 4>, (p.M + kRowsPerCta - 1) / kRowsPerCta, kWarpThreads, 0, p); break;
    case 8: launch(fwd_warp_kernel<T, 8>, (p.M + kRowsPerCta - 1) / kRowsPerCta, kWarpThreads, 0, p); break;
    case 16: launch(fwd_warp_kernel<T, 16>, (p.M + kRowsPerCta - 1) / kRowsPerCta, kWarpThreads, 0, p); break;
    case 32: launch(fwd_warp_kernel<T, 32>, (p.M + kRowsPerCta - 1) / kRowsPerCta, kWarpThreads, 0, p); break;
    default: launch(fwd_block_kernel<T>, p.M, kBlockThreads, kBlockSmem, p); break;
  }
}

template <typename T>
void run_bwd(const BwdParams& p, int items) {
  switch (items) {
    case 4: launch(bwd_warp_kernel<T, 4>, (p.M + kRowsPerCta - 1) / kRowsPerCta, kWarpThreads, 0, p); break;
    case 8: launch(bwd_warp_kernel<T, 8>, (p.M + kRowsPerCta - 1) / kRowsPerCta, kWarpThreads, 0, p); break;
    case 16: launch(bwd_warp_kernel<T, 16>, (p.M + kRowsPerCta - 1) / kRowsPerCta, kWarpThreads, 0, p); break;
    case 32: launch(bwd_warp_kernel<T, 32>, (p.M + kRowsPerCta - 1) / kRowsPerCta, kWarpThreads, 0, p); break;
    default: launch(bwd_block_kernel<T>, p.M, kBlockThreads, kBlockSmem, p); break;
  }
}

template <typename F>
void dispatch_dtype(c10::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kHalf: f(__half{}); break;
    case at::kBFloat16: f(__nv_bfloat16{}); break;
    default: TORCH_CHECK(false, "masked_softmax (cuda): unsupported dtype ", t);
  }
}

}  // namespace

Tensor2 masked_softmax_fwd_cuda(TF_MASKED_SOFTMAX_FWD_ARGS) {
  check_masked_softmax_fwd_args(scores, mask, scale, dropout_p, rng, TF_MS_DEVICE);
  check_cuda_device(scores);
#ifndef TF_CUDA_EMULATE
  const c10::cuda::CUDAGuard guard(scores.device());
#endif
  const int64_t B = scores.size(0), H = scores.size(1), Lq = scores.size(2), Lk = scores.size(3);
  const bool drop = dropout_p > 0.0;
  Tensor out = at::empty({B, H, Lq, Lk}, scores.options());
  Tensor probs = drop ? at::empty({B, H, Lq, Lk}, scores.options()) : at::empty({0}, scores.options());
  const int64_t M = B * H * Lq;
  if (M == 0 || Lk == 0) return {out, probs};
  TORCH_CHECK_VALUE(Lk < (int64_t{1} << 31) && Lq < (int64_t{1} << 30),
                    "masked_softmax (cuda): Lk = ", Lk, " / Lq = ", Lq, " too large for 32-bit indices");

  const Tensor s = unit_last(scores);
  Tensor m, rng_c;
  FwdParams p{};
  p.s = s.const_data_ptr();
  p.s_sb = s.stride(0), p.s_sh = s.stride(1), p.s_sm = s.stride(2);
  p.am_type = kMaskNone;
  if (mask.has_value() && mask->defined()) {
    m = mask->scalar_type() == at::kDouble ? mask->to(at::kFloat) : *mask;
    p.am = m.const_data_ptr();
    p.am_type = attn_mask_type(m.scalar_type());
    p.am_sb = m.stride(0), p.am_sh = m.stride(1), p.am_sm = m.stride(2), p.am_sn = m.stride(3);
  }
  p.out = out.mutable_data_ptr();
  p.probs = drop ? probs.mutable_data_ptr() : nullptr;
  if (drop) {
    rng_c = rng->reshape({-1}).contiguous();
    p.rng = rng_c.const_data_ptr<int64_t>();
    p.drop_threshold = dropout_threshold(dropout_p);
    p.drop_scale = dropout_scale(dropout_p);
  }
  p.M = static_cast<int>(M), p.H = static_cast<int>(H), p.Lq = static_cast<int>(Lq), p.Lk = static_cast<int>(Lk);
  p.scale = static_cast<float>(scale);
  p.causal = is_causal;
  const int items = warp_items(Lk);
  dispatch_dtype(scores.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const int bytes = group_bytes<T>(items);
    p.vec_in = rows_aligned(s, bytes);
    p.vec_out = Lk % (bytes / static_cast<int>(sizeof(T))) == 0;
    run_fwd<T>(p, items);
  });
  return {out, probs};
}

Tensor masked_softmax_bwd_cuda(TF_MASKED_SOFTMAX_BWD_ARGS) {
  check_masked_softmax_bwd_args(dout, probs, scale, dropout_p, rng, TF_MS_DEVICE);
  check_cuda_device(probs);
#ifndef TF_CUDA_EMULATE
  const c10::cuda::CUDAGuard guard(probs.device());
#endif
  const int64_t B = probs.size(0), H = probs.size(1), Lq = probs.size(2), Lk = probs.size(3);
  const int64_t M = B * H * Lq;
  // Mixed dtypes (not produced by the op layer): compute on fp32 copies.
  const bool mixed = dout.scalar_type() != probs.scalar_type();
  const auto dtype = mixed ? at::kFloat : dout.scalar_type();
  Tensor ds = at::empty({B, H, Lq, Lk}, dout.options().dtype(dtype));
  if (M == 0 || Lk == 0) return mixed ? ds.to(dout.scalar_type()) : ds;
  TORCH_CHECK_VALUE(Lk < (int64_t{1} << 31) && Lq < (int64_t{1} << 30),
                    "masked_softmax (cuda): Lk = ", Lk, " / Lq = ", Lq, " too large for 32-bit indices");
  const Tensor d = unit_last(mixed ? dout.to(at::kFloat) : dout);
  const Tensor pr = unit_last(mixed ? probs.to(at::kFloat) : probs);
  Tensor rng_c;
  BwdParams p{};
  p.dout = d.const_data_ptr();
  p.d_sb = d.stride(0), p.d_sh = d.stride(1), p.d_sm = d.stride(2);
  p.probs = pr.const_data_ptr();
  p.p_sb = pr.stride(0), p.p_sh = pr.stride(1), p.p_sm = pr.stride(2);
  p.ds = ds.mutable_data_ptr();
  if (dropout_p > 0.0) {
    rng_c = rng->reshape({-1}).contiguous();
    p.rng = rng_c.const_data_ptr<int64_t>();
    p.drop_threshold = dropout_threshold(dropout_p);
    p.drop_scale = dropout_scale(dropout_p);
  }
  p.M = static_cast<int>(M), p.H = static_cast<int>(H), p.Lq = static_cast<int>(Lq), p.Lk = static_cast<int>(Lk);
  p.scale = static_cast<float>(scale);
  const int items = warp_items(Lk);
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const int bytes = group_bytes<T>(items);
    p.vec_in = rows_aligned(d, bytes) && rows_aligned(pr, bytes);
    p.vec_out = Lk % (bytes / static_cast<int>(sizeof(T))) == 0;
    run_bwd<T>(p, items);
  });
  return mixed ? ds.to(dout.scalar_type()) : ds;
}

#ifndef TF_CUDA_EMULATE
TORCH_LIBRARY_IMPL(transformer_fast_C, CUDA, m) {
  m.impl("masked_softmax_fwd", &masked_softmax_fwd_cuda);
  m.impl("masked_softmax_bwd", &masked_softmax_bwd_cuda);
}
#endif

}  // namespace transformer_fast
