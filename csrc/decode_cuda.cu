// Attention over a KV cache (incremental decoding) on CUDA: the `cuda` backend of
// attention_with_kv_cache.  Written without a GPU; its tests and verify passed on one in GPU
// runs 1-2 (README's Status).  Its kernels are also tested in CPU emulation (TF_CUDA_EMULATE;
// tests/test_decode_cxx.py) against the oracle; races, the memory model and speed need a GPU
// (tests/test_gpu_decode_cuda.py, benchmarks/sanitize_kernels.py).  The fp32 inputs' double
// dot products, scores and running max and the double log-sum-exp of the splits came after those
// runs: unverified there.
//
// Contract: the docstring of kernels/decode.py, as csrc/decode_cpu.cpp (which holds the shared
// argument checks and split rule, decode.h):
//   q (B, H, L_new, D); k_cache (B, Hkv, L_max, D), v_cache (B, Hkv, L_max, Dv), Hkv | H;
//   cache_seqlens int32 (B,) read on the device only; k_new / v_new (B, Hkv, L_new, D / Dv) or
//   absent, written into the caches at cache_seqlens[b] + t (no host sync); query t of row b sees
//   key j iff j <= n_b - L_new + t, n_b = cache_seqlens[b] + (L_new if k_new).  fp32 / fp16 /
//   bf16, D, Dv <= 256, any strides with unit stride along the head dim (the host makes the
//   others so).  out (B, H, L_new, Dv) contiguous.  Positions outside [0, L_max) are never read or
//   written.
//
// Kernels (SIMT math, so allow_tf32 is unused; fp32 with fp32 inputs' q.k, score and running max
// in double, DotT below):
//   kv_append_kernel   one CTA per (b, kv head, k-or-v, chunk of new positions): copies the rows.
//   kv_decode_kernel   one CTA of 4 warps per (b, kv head, tile of ROWS packed query rows, split).
//                      Packed row r = t * GROUP + g is query head hk * GROUP + g at position t, so
//                      the GROUP query heads of a kv head (and the positions of a short chunk)
//                      share every K/V row the CTA reads: K/V is streamed once per kv head for
//                      decoding.  q (16-bit: pre-scaled by scale * log2 e) sits in shared
//                      memory; warp w takes keys lo + w, lo + w + 4, ...; lane l holds head-dim
//                      elements l, l + 32, ...; a dot product is the lane partial sums reduced
//                      by an xor-shuffle tree (every lane gets the total); each warp keeps its
//                      own online softmax (base 2) per row, and the 4 warps' states are merged
//                      through shared memory in warp order.  ROWS is 1, 4 or 8 (the smallest
//                      that holds L_new * GROUP, capped at 8), D and Dv are padded to 64 / 128 /
//                      256.
//   kv_combine_kernel  split-K (flash-decoding): with nsplit > 1 every CTA writes its normalised
//                      fp32 partial and (double) log2-sum-exp; one warp per (b, h, t) merges
//                      them in split order.  Deterministic (fixed orders, no atomics).
//   kv_hidden_kernel   L_new > 1 only, after the above: one CTA per (b, kv head) checks the values
//                      of the keys hidden from some query of the chunk (the reference's dense
//                      0 * v) and, only if one is non-finite, writes NaN where the reference has it.
// The split count comes from shapes only (kv_num_splits_heuristic over L_max, never the lengths);
// each CTA splits ITS OWN valid key range evenly, so short rows in a long cache spread too; a split
// past the range writes a neutral partial (0, lse -inf).  TRANSFORMER_FAST_KV_SPLITS forces it.
//
// Out of scope for this version: tensor cores for long prefill chunks (a chunk of L_new positions
// runs ceil(L_new * GROUP / 8) CTAs that each re-read the K/V prefix), cp.async pipelining,
// vectorised 16-byte loads.  Correct first; speed unmeasured.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#ifndef TF_CUDA_EMULATE
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_runtime.h>
#define TF_KV_DEVICE at::kCUDA
#else
#define TF_KV_DEVICE at::kCPU
#endif

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "decode.h"
#include "ops.h"

namespace transformer_fast {
namespace {

using at::Tensor;

constexpr int kThreads = 128;  // 4 warps
constexpr int kWarps = kThreads / 32;
constexpr int kSplitBlock = 64;  // keys per unit of the split-K partition
constexpr int kCudaMaxSplits = 128;
constexpr int kAppendRows = 16;  // new positions per append CTA
constexpr float kLog2e = 1.4426950408889634f;

struct Grid {
  int64_t x, y, z;
};

// ---- element conversions (explicit: the build defines the half / bf16 conversions away)

template <typename T>
struct Elem;

template <>
struct Elem<float> {
  static __device__ __forceinline__ float load(const float* p) { return *p; }
  static __device__ __forceinline__ void store(float* p, float x) { *p = x; }
};

template <>
struct Elem<__half> {
  static __device__ __forceinline__ float load(const __half* p) { return __half2float(*p); }
  static __device__ __forceinline__ void store(__half* p, float x) { *p = __float2half_rn(x); }
};

template <>
struct Elem<__nv_bfloat16> {
  static __device__ __forceinline__ float load(const __nv_bfloat16* p) {
    return __bfloat162float(*p);
  }
  static __device__ __forceinline__ void store(__nv_bfloat16* p, float x) {
    *p = __float2bfloat16_rn(x);
  }
};

// ---------------------------------------------------------------------------------------------
// Append k_new / v_new into the caches

struct AppendParams {
  const void* src[2];  // k_new, v_new
  void* dst[2];        // k_cache, v_cache
  int64_t s_sb[2], s_sh[2], s_sm[2], s_sd[2];
  int64_t d_sb[2], d_sh[2], d_sm[2], d_sd[2];
  int width[2];  // D, Dv
  const int32_t* seqlens;
  int Hkv, L_new, L_max;
};

// blockIdx.x = b * Hkv + h, blockIdx.y = 0 (k) / 1 (v), blockIdx.z = chunk of kAppendRows new
// positions (grid-strided).  Element bits are copied as E (uint16_t or float): no conversion.
template <typename E>
__global__ void __launch_bounds__(kThreads) kv_append_kernel(const AppendParams p) {
  const int which = blockIdx.y;
  const int b = blockIdx.x / p.Hkv, h = blockIdx.x % p.Hkv;
  const int W = p.width[which];
  const E* src = static_cast<const E*>(p.src[which]) + b * p.s_sb[which] + h * p.s_sh[which];
  E* dst = static_cast<E*>(p.dst[which]) + b * p.d_sb[which] + h * p.d_sh[which];
  const int64_t start = p.seqlens[b];
  for (int t0 = blockIdx.z * kAppendRows; t0 < p.L_new; t0 += gridDim.z * kAppendRows) {
    const int rows = min(kAppendRows, p.L_new - t0);
    for (int i = threadIdx.x; i < rows * W; i += kThreads) {
      const int t = t0 + i / W, d = i % W;
      const int64_t pos = start + t;
      if (pos < 0 || pos >= p.L_max) continue;  // never outside the cache
      dst[pos * p.d_sm[which] + d * p.d_sd[which]] = src[t * p.s_sm[which] + d * p.s_sd[which]];
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Attention over the cache

struct Params {
  const void* q;
  const void* k;
  const void* v;
  void* out;        // (B, H, L_new, Dv) contiguous, written when nsplit == 1
  float* op;        // (nsplit, B, H, L_new, Dv) fp32 partials, nsplit > 1
  double* lse;      // (nsplit, B, H, L_new) log2-sum-exp, nsplit > 1: in fp32 its rounding
                    // (|lse| * 2^-24) weighed on every split's weight where logits are large
  const int32_t* seqlens;
  int64_t q_sb, q_sh, q_sm, k_sb, k_sh, k_sm, v_sb, v_sh, v_sm;
  int B, H, Hkv, group, L_new, L_max, D, Dv, n_extra, nsplit, n_mt;
  float scale_log2;     // scale * log2(e): scores in base 2
  double scale_log2_d;  // the same in double (fp32 inputs)
};

// The type of a q.k dot product, of the base-2 score and of the running max.  fp32 inputs:
// double, so the score is never rounded and only the differences s - m (small wherever the
// probability matters) go to fp32 for exp2f.  A peaked softmax turns a score's absolute error
// into the output's relative error: fp32 lane partials, shuffle tree and scaling went up to 1.3x
// past the oracle's bound at logit std 34, and the double dot rounded to an fp32 score (error up
// to ulp(s) / 2, |s| in the hundreds) 8.2x at logit std 100.  16-bit inputs, whose own rounding is
// far larger: fp32.
template <typename T>
using DotT = std::conditional_t<std::is_same_v<T, float>, double, float>;

template <typename T, int DP, int ROWS>
constexpr size_t decode_smem_bytes() {
  // q [ROWS][DP] fp32; per warp: m [ROWS] (DotT), l [ROWS], acc [ROWS][DP] fp32
  return sizeof(float) * (ROWS * DP + kWarps * ROWS + kWarps * ROWS * DP) +
         sizeof(DotT<T>) * kWarps * ROWS;
}

// max that keeps a NaN (fmaxf drops it).
__device__ __forceinline__ double nan_max_d(double m, double x) {
  return (x > m || x != x) ? x : m;
}

// One CTA: ROWS packed query rows of kv head hk of batch row b, key split blockIdx.y.  DP: the
// head dims D and Dv padded to 64 / 128 / 256 (E = DP / 32 elements per lane).
template <typename T, int DP, int ROWS>
__global__ void __launch_bounds__(kThreads) kv_decode_kernel(const Params p) {
  constexpr int E = DP / 32;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  using S = DotT<T>;  // the dot, the score and the running max
  float* q_s = reinterpret_cast<float*>(smem_raw);  // [ROWS][DP], zero padded (16-bit: scaled)
  S* m_s = reinterpret_cast<S*>(q_s + ROWS * DP);   // [kWarps][ROWS] (ROWS * DP * 4: 8-aligned)
  float* l_s = reinterpret_cast<float*>(m_s + kWarps * ROWS);  // [kWarps][ROWS]
  float* acc_s = l_s + kWarps * ROWS;                          // [kWarps][ROWS][DP]

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int split = blockIdx.y;
  const int mt = blockIdx.x % p.n_mt, bhk = blockIdx.x / p.n_mt;
  const int b = bhk / p.Hkv, hk = bhk % p.Hkv;
  const int m_total = p.L_new * p.group;
  const int m0 = mt * ROWS;
  const int bm = min(ROWS, m_total - m0);  // real rows of this tile

  const T* qg = static_cast<const T*>(p.q);
  for (int i = threadIdx.x; i < ROWS * DP; i += kThreads) {
    const int r = i / DP, d = i % DP;
    float x = 0.0f;
    if (r < bm && d < p.D) {
      const int pr = m0 + r, t = pr / p.group, h = hk * p.group + pr % p.group;
      x = Elem<T>::load(qg + b * p.q_sb + h * p.q_sh + t * p.q_sm + d);
      if constexpr (!std::is_same_v<S, double>) x *= p.scale_log2;  // else on the total
    }
    q_s[i] = x;
  }

  // Key limits, clamped into [0, L_max] whatever cache_seqlens holds.
  const int64_t n64 = static_cast<int64_t>(p.seqlens[b]) + p.n_extra;
  const int n_keys = static_cast<int>(n64 < 0 ? 0 : (n64 > p.L_max ? p.L_max : n64));
  const int base = n_keys - p.L_new;  // query t sees keys j <= base + t
  const int t_last = (m0 + bm - 1) / p.group;
  const int hi_keys = max(min(base + t_last + 1, n_keys), 0);  // keys [0, hi_keys) are read
  const int n_blk = (hi_keys + kSplitBlock - 1) / kSplitBlock;
  const int per = (n_blk + p.nsplit - 1) / p.nsplit;
  const int blk_lo = min(split * per, n_blk), blk_hi = min(blk_lo + per, n_blk);
  const int k_lo = blk_lo * kSplitBlock, k_hi = min(blk_hi * kSplitBlock, hi_keys);
  int last_vis[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) last_vis[r] = r < bm ? base + (m0 + r) / p.group : -1;
  __syncthreads();  // q_s is complete

  S m[ROWS];
  float l[ROWS], acc[ROWS][E];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[r][e] = 0.0f;
  }
  const T* kh = static_cast<const T*>(p.k) + b * p.k_sb + hk * p.k_sh;
  const T* vh = static_cast<const T*>(p.v) + b * p.v_sb + hk * p.v_sh;
  for (int j = k_lo + warp; j < k_hi; j += kWarps) {  // warp-uniform: shuffles stay converged
    float kr[E], vr[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const int d = lane + 32 * e;
      kr[e] = d < p.D ? Elem<T>::load(kh + j * p.k_sm + d) : 0.0f;
      vr[e] = d < p.Dv ? Elem<T>::load(vh + j * p.v_sm + d) : 0.0f;
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      S s = 0;
#pragma unroll
      for (int e = 0; e < E; ++e) s += static_cast<S>(q_s[r * DP + lane + 32 * e]) * kr[e];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
      if constexpr (std::is_same_v<S, double>) s *= p.scale_log2_d;
      if (j <= last_vis[r]) {
        // A NaN score leaves m alone (fmax) but makes p, l and acc NaN: the row stays NaN.
        const S m_new = fmax(m[r], s);
        const S m_use = m_new == -INFINITY ? S(0) : m_new;
        const float alpha = exp2f(static_cast<float>(m[r] - m_use));
        const float pj = exp2f(static_cast<float>(s - m_use));
        l[r] = l[r] * alpha + pj;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[r][e] = acc[r][e] * alpha + pj * vr[e];
        m[r] = m_new;
      }
    }
  }

  // Merge the warps' states (in warp order) and write.
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    if (lane == 0) {
      m_s[warp * ROWS + r] = m[r];
      l_s[warp * ROWS + r] = l[r];
    }
#pragma unroll
    for (int e = 0; e < E; ++e) acc_s[(warp * ROWS + r) * DP + lane + 32 * e] = acc[r][e];
  }
  __syncthreads();
  const int64_t rows_all = static_cast<int64_t>(p.B) * p.H * p.L_new;
  for (int i = threadIdx.x; i < ROWS * DP; i += kThreads) {
    const int r = i / DP, d = i % DP;
    if (r >= bm || d >= p.Dv) continue;
    S mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmax(mx, m_s[w * ROWS + r]);
    const S m_use = mx == -INFINITY ? S(0) : mx;
    float lsum = 0.0f, o = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      // 0 for a warp that saw no key
      const float c = exp2f(static_cast<float>(m_s[w * ROWS + r] - m_use));
      lsum += l_s[w * ROWS + r] * c;  // NaN * 0 = NaN: a NaN row stays NaN
      o += acc_s[(w * ROWS + r) * DP + d] * c;
    }
    const bool live = lsum != 0.0f;  // true for NaN
    const float out = live ? o / lsum : 0.0f;
    const int pr = m0 + r, t = pr / p.group, h = hk * p.group + pr % p.group;
    const int64_t row = (static_cast<int64_t>(b) * p.H + h) * p.L_new + t;
    if (p.nsplit == 1) {
      Elem<T>::store(static_cast<T*>(p.out) + row * p.Dv + d, out);
    } else {
      p.op[(split * rows_all + row) * p.Dv + d] = out;
      if (d == 0) {
        p.lse[split * rows_all + row] =
            live ? static_cast<double>(m_use) + log2(static_cast<double>(lsum)) : -INFINITY;
      }
    }
  }
}

// One warp per (b, h, t) row: out = sum_s 2^(lse_s - M) / sum_s' 2^(lse_s' - M) * partial_s, in
// split order.  A row no split saw (every lse -inf) gets 0.
template <typename T>
__global__ void __launch_bounds__(kThreads) kv_combine_kernel(const Params p) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t rows_all = static_cast<int64_t>(p.B) * p.H * p.L_new;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (row >= rows_all) return;  // warp-uniform; no barrier follows
  double mx = -INFINITY;
  for (int s = 0; s < p.nsplit; ++s) mx = nan_max_d(mx, p.lse[s * rows_all + row]);
  T* o = static_cast<T*>(p.out) + row * p.Dv;
  if (mx == -INFINITY) {
    for (int d = lane; d < p.Dv; d += 32) Elem<T>::store(o + d, 0.0f);
    return;
  }
  double tot = 0.0;
  for (int s = 0; s < p.nsplit; ++s) tot += exp2(p.lse[s * rows_all + row] - mx);
  const double inv = 1.0 / tot;
  for (int d = lane; d < p.Dv; d += 32) {
    double acc = 0.0;
    for (int s = 0; s < p.nsplit; ++s) {
      const double w = exp2(p.lse[s * rows_all + row] - mx) * inv;
      if (w != 0.0) acc += w * p.op[(s * rows_all + row) * p.Dv + d];  // skips empty splits
    }
    Elem<T>::store(o + d, static_cast<float>(acc));
  }
}

// ---------------------------------------------------------------------------------------------
// Values hidden from a query of the chunk (as decode_cpu.cpp's add_hidden_values)
//
// The reference attends densely over each row's valid keys: a key hidden from query t (causal
// among the new tokens, j > base + t; every key for a query that sees none) still meets it as
// 0 * v, so a NaN / Inf value there makes that query's output NaN in its column.  The decode
// kernel skips hidden keys; this pass, run after it (and after the combine), sets those outputs to
// NaN.  The hidden keys of a row are [max(base + 1, 0), n_keys): at most L_new - 1 of them, none in
// a one-token step (the host launches this only when L_new > 1).  Finite case: one CTA per
// (b, kv head) reads those (L_new - 1) * Dv values once, finds them finite and returns.

__device__ __forceinline__ bool finite_f(float x) { return fabsf(x) < INFINITY; }  // false for NaN

template <typename T>
__global__ void __launch_bounds__(kThreads) kv_hidden_kernel(const Params p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  int* bad_s = reinterpret_cast<int*>(smem_raw);  // [kWarps]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int b = blockIdx.x / p.Hkv, hk = blockIdx.x % p.Hkv;
  const int64_t n64 = static_cast<int64_t>(p.seqlens[b]) + p.n_extra;
  const int n_keys = static_cast<int>(n64 < 0 ? 0 : (n64 > p.L_max ? p.L_max : n64));
  const int base = n_keys - p.L_new;  // query t sees keys j <= base + t
  const int lo = max(base + 1, 0);
  if (lo >= n_keys) return;  // CTA-uniform, before any barrier: nothing hidden
  const T* vh = static_cast<const T*>(p.v) + b * p.v_sb + hk * p.v_sh;
  const int64_t span = static_cast<int64_t>(n_keys - lo) * p.Dv;
  int bad = 0;
  for (int64_t i = threadIdx.x; i < span; i += kThreads) {
    const int j = lo + static_cast<int>(i / p.Dv), d = static_cast<int>(i % p.Dv);
    bad |= finite_f(Elem<T>::load(vh + j * p.v_sm + d)) ? 0 : 1;
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) bad |= __shfl_xor_sync(0xffffffffu, bad, off);
  if (lane == 0) bad_s[warp] = bad;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kWarps; ++w) bad |= bad_s[w];
  if (!bad) return;  // the finite case
  T* out = static_cast<T*>(p.out);
  for (int64_t i = threadIdx.x; i < static_cast<int64_t>(p.L_new) * p.Dv; i += kThreads) {
    const int t = static_cast<int>(i / p.Dv), d = static_cast<int>(i % p.Dv);
    bool poisoned = false;  // sum_j 0 * v[j][d] over the keys hidden from t is NaN
    for (int j = max(base + t + 1, 0); j < n_keys; ++j) {
      poisoned |= !finite_f(Elem<T>::load(vh + j * p.v_sm + d));
    }
    if (!poisoned) continue;
    for (int h = hk * p.group; h < (hk + 1) * p.group; ++h) {
      Elem<T>::store(out + ((static_cast<int64_t>(b) * p.H + h) * p.L_new + t) * p.Dv + d, NAN);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host side

#ifndef TF_CUDA_EMULATE
// Concurrent 4-warp CTAs the split rule assumes: 2 per SM (as kernels/decode.py).
int64_t device_slots(const Tensor& q) {
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, q.get_device()));
  return 2 * static_cast<int64_t>(sms);
}

template <typename Kernel, typename P>
void launch(Kernel kernel, Grid grid, size_t smem, const P& p) {
  TORCH_CHECK(grid.x < (int64_t{1} << 31) && grid.y < 65536 && grid.z < 65536,
              "attention_with_kv_cache (cuda): grid too large (", grid.x, ", ", grid.y, ", ",
              grid.z, ")");
  if (smem > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
  }
  const dim3 g(static_cast<unsigned>(grid.x), static_cast<unsigned>(grid.y),
               static_cast<unsigned>(grid.z));
  kernel<<<g, kThreads, smem, c10::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
#endif  // TF_CUDA_EMULATE (the emulation provides device_slots and launch)

constexpr int64_t kInt32Max = (int64_t{1} << 31) - 1;

// Indices the kernels compute in 32-bit: positions, rows, tiles (element offsets are 64-bit).
void check_sizes_32bit(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache) {
  const int64_t B = q.size(0), H = q.size(1), L_new = q.size(2);
  const int64_t Hkv = k_cache.size(1), L_max = k_cache.size(2);
  TORCH_CHECK(L_max + L_new < kInt32Max && B * H * L_new < kInt32Max && B * Hkv < kInt32Max &&
                  L_new * H < kInt32Max,
              "attention_with_kv_cache (cuda): sizes too large for 32-bit indices (B = ", B,
              ", H = ", H, ", L_new = ", L_new, ", L_max = ", L_max, ")");
  (void)v_cache;
}

int bucket(int64_t w) { return w <= 64 ? 64 : (w <= 128 ? 128 : 256); }
int rows_bucket(int64_t m) { return m <= 1 ? 1 : (m <= 4 ? 4 : 8); }

Tensor unit_last_cuda(const Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

void run_append(const Tensor& k_new, const Tensor& v_new, Tensor& k_cache, Tensor& v_cache,
                const Tensor& seqlens) {
  AppendParams a{};
  const Tensor* srcs[2] = {&k_new, &v_new};
  Tensor* dsts[2] = {&k_cache, &v_cache};
  for (int i = 0; i < 2; ++i) {
    const Tensor& s = *srcs[i];
    const Tensor& d = *dsts[i];
    a.src[i] = s.const_data_ptr();
    a.dst[i] = d.data_ptr();
    a.s_sb[i] = s.stride(0), a.s_sh[i] = s.stride(1), a.s_sm[i] = s.stride(2), a.s_sd[i] = s.stride(3);
    a.d_sb[i] = d.stride(0), a.d_sh[i] = d.stride(1), a.d_sm[i] = d.stride(2), a.d_sd[i] = d.stride(3);
    a.width[i] = static_cast<int>(s.size(3));
  }
  a.seqlens = seqlens.const_data_ptr<int32_t>();
  a.Hkv = static_cast<int>(k_cache.size(1));
  a.L_new = static_cast<int>(k_new.size(2));
  a.L_max = static_cast<int>(k_cache.size(2));
  const int64_t chunks = std::min<int64_t>((a.L_new + kAppendRows - 1) / kAppendRows, 65535);
  const Grid grid{k_new.size(0) * a.Hkv, 2, chunks};
  if (k_new.element_size() == 2) {
    launch(kv_append_kernel<uint16_t>, grid, 0, a);
  } else {
    launch(kv_append_kernel<float>, grid, 0, a);
  }
}

template <typename T, int DP>
void run_decode_dp(const Params& p, int rows) {
  const Grid grid{int64_t{p.B} * p.Hkv * p.n_mt, p.nsplit, 1};
  switch (rows) {
    case 1: launch(kv_decode_kernel<T, DP, 1>, grid, decode_smem_bytes<T, DP, 1>(), p); break;
    case 4: launch(kv_decode_kernel<T, DP, 4>, grid, decode_smem_bytes<T, DP, 4>(), p); break;
    default: launch(kv_decode_kernel<T, DP, 8>, grid, decode_smem_bytes<T, DP, 8>(), p); break;
  }
}

template <typename T>
void run_decode(const Params& p, int dp, int rows) {
  switch (dp) {
    case 64: run_decode_dp<T, 64>(p, rows); break;
    case 128: run_decode_dp<T, 128>(p, rows); break;
    default: run_decode_dp<T, 256>(p, rows); break;
  }
  if (p.nsplit > 1) {
    const int64_t rows_all = int64_t{p.B} * p.H * p.L_new;
    launch(kv_combine_kernel<T>, Grid{(rows_all + kWarps - 1) / kWarps, 1, 1}, 0, p);
  }
  // A one-token step hides no key from its query: no launch on the decoding path.
  if (p.L_new > 1) {
    launch(kv_hidden_kernel<T>, Grid{int64_t{p.B} * p.Hkv, 1, 1}, sizeof(int) * kWarps, p);
  }
}

}  // namespace

Tensor attention_with_kv_cache_fwd_cuda(TF_KV_CACHE_ARGS) {
  (void)allow_tf32;  // SIMT fp32 math: fp32 inputs are computed exactly
  check_kv_cache_args(q, k_cache, v_cache, cache_seqlens, k_new, v_new, scale, TF_KV_DEVICE);
  check_sizes_32bit(q, k_cache, v_cache);
#ifndef TF_CUDA_EMULATE
  const c10::cuda::CUDAGuard guard(q.device());
#endif
  const Tensor seqlens = cache_seqlens.contiguous();
  const bool has_new = k_new.has_value();
  const int64_t B = q.size(0), H = q.size(1), L_new = q.size(2), D = q.size(3);
  const int64_t Hkv = k_cache.size(1), L_max = k_cache.size(2), Dv = v_cache.size(3);

  // 1. Append (through the caches' own strides, any of them).
  if (has_new && L_new > 0 && B * Hkv > 0) run_append(*k_new, *v_new, k_cache, v_cache, seqlens);
  Tensor out = at::empty({B, H, L_new, Dv}, q.options());
  if (out.numel() == 0) return out;
  if (L_max == 0) return out.zero_();

  // 2. Attention (a cache whose last stride is not 1 is read through a contiguous copy).
  const Tensor q_ = unit_last_cuda(q), k_ = unit_last_cuda(k_cache), v_ = unit_last_cuda(v_cache);
  Params p{};
  p.q = q_.const_data_ptr(), p.k = k_.const_data_ptr(), p.v = v_.const_data_ptr();
  p.out = out.data_ptr();
  p.seqlens = seqlens.const_data_ptr<int32_t>();
  p.q_sb = q_.stride(0), p.q_sh = q_.stride(1), p.q_sm = q_.stride(2);
  p.k_sb = k_.stride(0), p.k_sh = k_.stride(1), p.k_sm = k_.stride(2);
  p.v_sb = v_.stride(0), p.v_sh = v_.stride(1), p.v_sm = v_.stride(2);
  p.B = static_cast<int>(B), p.H = static_cast<int>(H), p.Hkv = static_cast<int>(Hkv);
  p.group = static_cast<int>(H / Hkv), p.L_new = static_cast<int>(L_new);
  p.L_max = static_cast<int>(L_max), p.D = static_cast<int>(D), p.Dv = static_cast<int>(Dv);
  p.n_extra = has_new ? p.L_new : 0;
  p.scale_log2 = static_cast<float>(scale) * kLog2e;
  p.scale_log2_d = scale * 1.4426950408889634;
  const int64_t m_total = L_new * p.group;
  const int rows = rows_bucket(m_total);
  p.n_mt = static_cast<int>((m_total + rows - 1) / rows);
  const int64_t programs = B * Hkv * p.n_mt;
  TORCH_CHECK(programs < (int64_t{1} << 31), "attention_with_kv_cache (cuda): too many CTAs (",
              programs, ")");
  const int64_t forced = kv_forced_splits(kCudaMaxSplits);
  p.nsplit = static_cast<int>(
      forced > 0 ? forced
                 : kv_num_splits_heuristic(programs, device_slots(q),
                                           (L_max + kSplitBlock - 1) / kSplitBlock, kCudaMaxSplits));
  Tensor op, lse;
  if (p.nsplit > 1) {
    op = at::empty({p.nsplit, B, H, L_new, Dv}, q.options().dtype(at::kFloat));
    lse = at::empty({p.nsplit, B, H, L_new}, q.options().dtype(at::kDouble));
    p.op = op.mutable_data_ptr<float>();
    p.lse = lse.mutable_data_ptr<double>();
  }
  const int dp = bucket(std::max(D, Dv));
  switch (q.scalar_type()) {
    case at::kFloat: run_decode<float>(p, dp, rows); break;
    case at::kHalf: run_decode<__half>(p, dp, rows); break;
    default: run_decode<__nv_bfloat16>(p, dp, rows); break;
  }
  return out;
}

#ifndef TF_CUDA_EMULATE
TORCH_LIBRARY_IMPL(transformer_fast_C, CUDA, m) {
  m.impl("attention_with_kv_cache_fwd", &attention_with_kv_cache_fwd_cuda);
}
#endif

}  // namespace transformer_fast
