// Fused residual-add (+ dropout) + LayerNorm on CUDA: forward and backward.
//
// Shapes: x, residual, dy, dh are (M, N) with unit column stride and any row stride; outputs are
// contiguous.  All statistics and accumulations are fp32.  Dropout follows philox.h exactly
// (element index = row * N + col), with [seed, offset] read from device memory in the kernel.
//
// Kernels
//   fwd_reg / bwd_reg  "register" path: a team of `tpr` threads (a multiple of 32, <= 512) owns
//                      one row at a time and keeps the whole row in registers: each thread holds
//                      NV chunks of VEC contiguous elements, chunk k of thread t at vector index
//                      t + k * tpr (so a warp's loads are contiguous 16-byte chunks).  Several
//                      teams share a block when rows are short.  Teams walk rows grid-stride.
//                      VEC = 16 bytes / sizeof(T) when every row pointer, row stride, N and the
//                      weight/bias pointers allow 16-byte accesses; otherwise VEC = 1 (scalar).
//   fwd_loop/bwd_loop  rows too long for registers: one block per row, several passes over the
//                      row (the re-reads mostly hit L2).  Forward statistics: the mean, then the
//                      mean of (h - mean)^2 (exact two-pass); backward: two passes.
//   bwd_dwdb_cols      the long-row path's dweight/dbias partials (column-parallel).
//   reduce_cols        stage 2 of dweight/dbias: sum of the (P, N) fp32 partials over P in a
//                      fixed order (no atomics anywhere: the backward is deterministic).
//
// GPU runs 1-5 ran its gpu tests (README's Status; the forward's up-to-16-warps rows and its
// statistics summed in double, two-pass on long rows, came after run 5 and were timed in run 6;
// the register forward's fp32 sums for 16-bit rows came after run 6: unverified).  TF_CUDA_EMULATE:
// tests/test_add_layer_norm_cuda_emulated.py compiles this file as host C++
// (tests/cuda_emulation.py: CTAs of std::threads, warp shuffles, static shared arrays) and runs
// the kernels through the real host-side dispatch against the float64 oracle; races, the memory
// model and speed need a GPU (compute-sanitizer, gpu tests).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#ifndef TF_CUDA_EMULATE
#include <c10/cuda/CUDAException.h>
#endif

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <type_traits>
#include <unordered_map>

#include "cuda_launch.h"  // DeviceScope, launch
#include "ops.h"
#include "philox.h"

namespace transformer_fast {
namespace {

using at::Tensor;

constexpr int kMaxThreads = 512;     // block size cap of every row kernel (__launch_bounds__)
constexpr int kFwdMaxElems = 32;     // fp32 values per thread kept in registers, forward
constexpr int kBwdMaxElems = 16;     // backward holds ~4x that (xhat, g, two accumulators)
constexpr int kBwdMaxElemsScalar = 8;  // scalar loads: 16 would hit the 128-register cap and spill
// Threads per row the register path aims for (it takes the fewest vectors per thread that reach
// it).  Backward: <= 4 warps per row (cheap reductions, more ILP).  Forward: up to 16 warps, 8
// elements per thread at N 4096 (56 registers, 2 blocks of 512 per SM), as the Triton kernel that
// ran at 97% of the copy bandwidth in H100 run 3; with 4 warps a row took 32 elements per thread,
// 125 registers and 2 blocks of 256 per SM, and ran at 66% (benchmarks/NOTES.md, add_layer_norm).
constexpr int kBwdTargetTpr = 128;
constexpr int kFwdTargetTpr = 512;

#ifdef TF_CUDA_EMULATE
// The emulation runs one CTA at a time: a static array is the CTA's shared memory.
#define TF_STATIC_SHARED static
using std::min;
#else
#define TF_STATIC_SHARED __shared__
#endif

// ------------------------------------------------------------------------------------------
// Device helpers

template <typename T>
__device__ __forceinline__ float to_f(T v) { return static_cast<float>(v); }

template <typename T>
__device__ __forceinline__ T from_f(float v) { return static_cast<T>(v); }

// Loads VEC contiguous elements as floats.  VEC == 1: a scalar access; otherwise VEC * sizeof(T)
// is a multiple of 16 and p is 16-byte aligned (checked on the host): 128-bit accesses.
// 1 / sqrt(v) correctly rounded twice (IEEE sqrt and division; nvcc's defaults without
// fast-math), as the Triton kernel's div_rn(1, sqrt_rn) and the reference's division by sqrt:
// rsqrtf is approximate (up to 2 ulps), and that error scales every xhat of a row, which put the
// fp32 dweight of a (67, 1000) case 1.02x past the oracle's bound on an H100 (2026-11-27).
__device__ __forceinline__ float rstd_rn(float v) { return __frcp_rn(__fsqrt_rn(v)); }

template <typename T, int VEC>
__device__ __forceinline__ void load_f(const T* __restrict__ p, float (&out)[VEC]) {
  if constexpr (VEC == 1) {
    out[0] = to_f(p[0]);
  } else {
    constexpr int kPer = 16 / sizeof(T);
    static_assert(VEC % kPer == 0, "vector loads are whole 16-byte chunks");
#pragma unroll
    for (int c = 0; c < VEC / kPer; ++c) {
      const uint4 raw = *reinterpret_cast<const uint4*>(p + c * kPer);
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int k = 0; k < kPer; ++k) out[c * kPer + k] = to_f(e[k]);
    }
  }
}

template <typename T, int VEC>
__device__ __forceinline__ void store_f(T* __restrict__ p, const float (&in)[VEC]) {
  if constexpr (VEC == 1) {
    p[0] = from_f<T>(in[0]);
  } else {
    constexpr int kPer = 16 / sizeof(T);
    static_assert(VEC % kPer == 0, "vector stores are whole 16-byte chunks");
#pragma unroll
    for (int c = 0; c < VEC / kPer; ++c) {
      uint4 raw;
      T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int k = 0; k < kPer; ++k) e[k] = from_f<T>(in[c * kPer + k]);
      *reinterpret_cast<uint4*>(p + c * kPer) = raw;
    }
  }
}

// weight/bias are x's dtype T or float32 (a runtime, block-uniform choice).
template <typename T, int VEC>
__device__ __forceinline__ void load_param(const void* p, bool is_f32, int64_t col, float (&out)[VEC]) {
  if (is_f32) {
    load_f<float, VEC>(static_cast<const float*>(p) + col, out);
  } else {
    load_f<T, VEC>(static_cast<const T*>(p) + col, out);
  }
}

struct Dropout {
  uint64_t seed, offset;
  uint32_t threshold;
  float scale;
  bool on;
  // keep/(1-p) for element `index`: 0 when dropped.
  __device__ __forceinline__ float factor(uint64_t index) const {
    return philox_word(seed, offset, index) >= threshold ? scale : 0.0f;
  }
  // factor() of the VEC elements first .. first + VEC - 1.  With VEC a multiple of 4, `first` is
  // too (the vector paths: N % VEC == 0, col % VEC == 0), so each 4 share one Philox block
  // (philox.h) instead of running one each.
  template <int VEC>
  __device__ __forceinline__ void factors(uint64_t first, float (&f)[VEC]) const {
    if constexpr (VEC % 4 == 0) {
#pragma unroll
      for (int g = 0; g < VEC; g += 4) {
        const PhiloxBlock w = philox_block(seed, offset, (first + g) >> 2);
#pragma unroll
        for (int k = 0; k < 4; ++k) f[g + k] = w.w[k] >= threshold ? scale : 0.0f;
      }
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) f[e] = factor(first + e);
    }
  }
};

__device__ __forceinline__ Dropout make_dropout(const int64_t* rng, uint32_t threshold, float scale, bool on) {
  Dropout d{0, 0, threshold, scale, on};
  if (on) {  // read [seed, offset] on the device: no host synchronisation
    d.seed = static_cast<uint64_t>(rng[0]);
    d.offset = static_cast<uint64_t>(rng[1]);
  }
  return d;
}

// Sum of v (a row statistic's partial: double, or float for 16-bit rows in fwd_reg_kernel) over
// the `wpt` warps of a team starting at warp `first_warp`; every thread of the team gets the
// result.  Must be called by all threads of the block (block-uniform wpt).  red: >= blockDim.x
// / 32 values of S in shared memory.
template <typename S>
__device__ __forceinline__ S team_sum1(S v, S* red, int wpt, int first_warp) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  if (wpt == 1) return v;
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  S s = 0;
  for (int w = 0; w < wpt; ++w) s += red[first_warp + w];  // fixed order: deterministic
  __syncthreads();  // red may be reused right after
  return s;
}

// team_sum1 of three values at once (two barriers, not six).  red: >= 3 * blockDim.x / 32.
template <typename S>
__device__ __forceinline__ void team_sum3(S& a, S& b, S& c, S* red, int wpt, int first_warp) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, off);
    b += __shfl_xor_sync(0xffffffffu, b, off);
    c += __shfl_xor_sync(0xffffffffu, c, off);
  }
  if (wpt == 1) return;
  if ((threadIdx.x & 31) == 0) {
    S* slot = red + 3 * (threadIdx.x >> 5);
    slot[0] = a;
    slot[1] = b;
    slot[2] = c;
  }
  __syncthreads();
  a = b = c = 0;
  for (int w = 0; w < wpt; ++w) {  // fixed order: deterministic
    const S* slot = red + 3 * (first_warp + w);
    a += slot[0];
    b += slot[1];
    c += slot[2];
  }
  __syncthreads();  // red may be reused right after
}

// The backward's row statistics from a team's (or block's) partial sums of g, g * xhat and xhat
// (S: double, or float for 16-bit rows and wide fp32 register rows; red: >= 3 * blockDim.x / 32):
// ca = mean(g), cc = mean(xhat), cb = mean(g * (xhat - cc)), rounded to fp32, and off, the
// common shift that the rounding of ca and cc leaves in g - ca - (xhat - cc) * cb (the exact
// result sums to zero over the row; 0 for S = float).  As the cpu kernel's bwd_row: with fp32
// sums and a rounded 1/N, 7-wide fp32 rows missed the oracle in 2-3 of 300 fresh draws in
// emulation (benchmarks/NOTES.md "The cpu add_layer_norm backward's tail in double").
struct BwdStats {
  float ca, cb, cc, off;
};

template <typename S>
__device__ __forceinline__ BwdStats bwd_stats(S sg, S sgx, S sx, S* red, int wpt, int first_warp, int N) {
  team_sum3<S>(sg, sgx, sx, red, wpt, first_warp);
  const S n = static_cast<S>(N);
  const S cc_s = sx / n, ca_s = sg / n;
  const S cb_s = sgx / n - cc_s * ca_s;
  BwdStats st;
  st.ca = static_cast<float>(ca_s);
  st.cb = static_cast<float>(cb_s);
  st.cc = static_cast<float>(cc_s);
  st.off = static_cast<float>((ca_s - st.ca) - st.cb * (cc_s - st.cc));
  return st;
}

// ------------------------------------------------------------------------------------------
// Kernel arguments

struct FwdArgs {
  const void* x;
  const void* r;
  const void* w;  // nullptr when absent
  const void* b;
  void* y;
  void* h;  // nullptr unless prenorm
  float* mean;
  float* rstd;
  const int64_t* rng;
  int64_t M;
  int64_t sx, sr;  // row strides (elements)
  int N;
  int tpr;  // threads per row (register path)
  float eps;
  uint32_t threshold;
  float scale;
  bool drop, w_f32, b_f32;
};

struct BwdArgs {
  const void* dy;
  const void* dh;  // nullptr when absent
  const void* x;
  const void* r;
  const void* w;  // nullptr when absent
  const float* mean;
  const float* rstd;
  const int64_t* rng;
  void* dx;  // nullptr unless dropout
  void* dres;
  double* dw_part;  // (num_teams, N) partials; nullptr when not wanted
  double* db_part;
  float* xbar;  // (M,) each row's mean(xhat), for the long-row dweight kernel; else nullptr
  int64_t M;
  int64_t sdy, sdh, sx, sr;
  int N;
  int tpr;
  uint32_t threshold;
  float scale;
  bool drop, w_f32;
};

// ------------------------------------------------------------------------------------------
// Forward, register path

template <typename T, int VEC, int NV>
__global__ void __launch_bounds__(kMaxThreads) fwd_reg_kernel(FwdArgs a) {
  using Stat = typename std::conditional<std::is_same<T, float>::value, double, float>::type;
  TF_STATIC_SHARED float2 red[kMaxThreads / 32];
  const int tpr = a.tpr;
  const int teams = blockDim.x / tpr;
  const int team = threadIdx.x / tpr;
  const int t = threadIdx.x - team * tpr;
  const int wpt = tpr >> 5;
  const int N = a.N;
  const Dropout drop = make_dropout(a.rng, a.threshold, a.scale, a.drop);
  const T* __restrict__ xp = static_cast<const T*>(a.x);
  const T* __restrict__ rp = static_cast<const T*>(a.r);

  // The loop bound is block-uniform (rows beyond M idle through the reductions).
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * teams; base < a.M;
       base += static_cast<int64_t>(gridDim.x) * teams) {
    const int64_t row = base + team;
    const bool valid = row < a.M;
    float h[NV][VEC];
    // fp32 rows: the statistics' sums in double, each rounded once: with an fp32 sum times
    // fp32(1 / N) a constant row's mean came out an ulp off its value, so the row normalised to
    // +-ulp * rstd (0.5 off at 1e4) instead of 0, and rows with a large offset lost their mean.
    // 16-bit rows: fp32 sums divided by N (correctly rounded: a constant row's mean is exact),
    // as the Triton kernel, whose forward ran at 89% of the copy bandwidth at 16384 x 4096 bf16
    // in H200 run 6 where this one, summing in double, ran at 44% (benchmarks/NOTES.md).
    Stat sum = 0;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int col = (t + k * tpr) * VEC;
      // col < N implies col + VEC <= N: VEC > 1 only when N % VEC == 0.
      if (valid && col < N) {
        float xv[VEC], rv[VEC];
        load_f<T, VEC>(xp + row * a.sx + col, xv);
        load_f<T, VEC>(rp + row * a.sr + col, rv);
        float fac[VEC];
        if (drop.on) drop.factors<VEC>(static_cast<uint64_t>(row) * N + col, fac);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          float v = xv[e];
          if (drop.on) v *= fac[e];
          h[k][e] = rv[e] + v;
          sum += h[k][e];
        }
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) h[k][e] = 0.0f;
      }
    }
    Stat* red_s = reinterpret_cast<Stat*>(red);  // a float2 per warp: room for a double
    const Stat mean = team_sum1<Stat>(sum, red_s, wpt, team * wpt) / static_cast<Stat>(N);
    const float mu = static_cast<float>(mean);
    // What rounding the mean to fp32 dropped (fp32 rows; 0 for 16-bit ones, summed in fp32): the
    // outputs centre on mu + mu_lo, so a row whose mean is large against its spread keeps it
    // (the saved mean stays fp32; backward centres xhat on its row mean instead).
    // (a constant 0 for 16-bit rows, so that their subtractions of it fold away)
    const float mu_lo = std::is_same<Stat, double>::value ? static_cast<float>(mean - static_cast<Stat>(mu)) : 0.0f;
    // Exact two-pass variance on the registers.
    Stat sq = 0;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int col = (t + k * tpr) * VEC;
      if (valid && col < N) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float d = (h[k][e] - mu) - mu_lo;  // on mu alone the variance gained mu_lo^2
          sq += static_cast<Stat>(d) * d;
        }
      }
    }
    const float var = static_cast<float>(team_sum1<Stat>(sq, red_s, wpt, team * wpt) / static_cast<Stat>(N));
    const float rs = rstd_rn(var + a.eps);
    if (valid) {
      if (t == 0) {
        a.mean[row] = mu;
        a.rstd[row] = rs;
      }
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const int col = (t + k * tpr) * VEC;
        if (col < N) {
          float yv[VEC], wv[VEC], bv[VEC];
          if (a.w) load_param<T, VEC>(a.w, a.w_f32, col, wv);
          if (a.b) load_param<T, VEC>(a.b, a.b_f32, col, bv);
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            float v = ((h[k][e] - mu) - mu_lo) * rs;
            if (a.w) v *= wv[e];
            if (a.b) v += bv[e];
            yv[e] = v;
          }
          store_f<T, VEC>(static_cast<T*>(a.y) + row * N + col, yv);
          if (a.h) store_f<T, VEC>(static_cast<T*>(a.h) + row * N + col, h[k]);
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------
// Forward, long rows: one block per row; pass 1 the mean, pass 2 the variance as the mean of
// (h - mean)^2, both summed in double, pass 3 normalise.  With a large common offset in a row
// (mean 1e3-1e4, std 1) fp32 Welford merges of the running means lost the variance (up to 4.7x
// past the oracle's bound in CPU emulation) and an fp32 block sum the mean (1.25x): the
// reference's fp32 sums are cascaded, far more accurate than a thread's sequential ones.  A row
// is read once more per pass (from L2, mostly); the double adds are ~N / blockDim per thread.

// h = residual + dropout(x) for VEC elements of row `row` from column `col`.
template <typename T, int VEC>
__device__ __forceinline__ void load_h(const T* xr, const T* rr, int64_t row, int N, int col,
                                       const Dropout& drop, float (&hv)[VEC]) {
  float xv[VEC], rv[VEC], fac[VEC];
  load_f<T, VEC>(xr + col, xv);
  load_f<T, VEC>(rr + col, rv);
  if (drop.on) drop.factors<VEC>(static_cast<uint64_t>(row) * N + col, fac);
#pragma unroll
  for (int e = 0; e < VEC; ++e) hv[e] = rv[e] + (drop.on ? xv[e] * fac[e] : xv[e]);
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kMaxThreads) fwd_loop_kernel(FwdArgs a) {
  TF_STATIC_SHARED double red[kMaxThreads / 32];
  const int N = a.N;
  const int nvec = N / VEC;  // VEC > 1 only when N % VEC == 0
  const int wpt = blockDim.x >> 5;
  const Dropout drop = make_dropout(a.rng, a.threshold, a.scale, a.drop);
  const T* __restrict__ xp = static_cast<const T*>(a.x);
  const T* __restrict__ rp = static_cast<const T*>(a.r);
  for (int64_t row = blockIdx.x; row < a.M; row += gridDim.x) {  // block-uniform
    const T* xr = xp + row * a.sx;
    const T* rr = rp + row * a.sr;
    double sum = 0.0;
    for (int v = threadIdx.x; v < nvec; v += blockDim.x) {
      float hv[VEC];
      load_h<T, VEC>(xr, rr, row, N, v * VEC, drop, hv);
#pragma unroll
      for (int e = 0; e < VEC; ++e) sum += hv[e];
    }
    const double mean = team_sum1<double>(sum, red, wpt, 0) / N;
    const float mu = static_cast<float>(mean);
    const float mu_lo = static_cast<float>(mean - mu);  // as the register path
    double sq = 0.0;
    for (int v = threadIdx.x; v < nvec; v += blockDim.x) {
      float hv[VEC];
      load_h<T, VEC>(xr, rr, row, N, v * VEC, drop, hv);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float d = (hv[e] - mu) - mu_lo;  // as the normalisation below computes it
        sq += static_cast<double>(d) * d;
      }
    }
    const float rs = rstd_rn(static_cast<float>(team_sum1<double>(sq, red, wpt, 0) / N) + a.eps);
    if (threadIdx.x == 0) {
      a.mean[row] = mu;
      a.rstd[row] = rs;
    }
    for (int v = threadIdx.x; v < nvec; v += blockDim.x) {
      const int col = v * VEC;
      float wv[VEC], bv[VEC], hv[VEC], yv[VEC];
      load_h<T, VEC>(xr, rr, row, N, col, drop, hv);
      if (a.w) load_param<T, VEC>(a.w, a.w_f32, col, wv);
      if (a.b) load_param<T, VEC>(a.b, a.b_f32, col, bv);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        float y = ((hv[e] - mu) - mu_lo) * rs;
        if (a.w) y *= wv[e];
        if (a.b) y += bv[e];
        yv[e] = y;
      }
      store_f<T, VEC>(static_cast<T*>(a.y) + row * N + col, yv);
      if (a.h) store_f<T, VEC>(static_cast<T*>(a.h) + row * N + col, hv);
    }
  }
}

// ------------------------------------------------------------------------------------------
// Backward, register path.  Per row: xhat = (h - mean) * rstd, g = dy * w,
//   dsum = rstd * (g - mean(g) - (xhat - cc) * mean(g * (xhat - cc))) (+ dh), cc = mean(xhat);
//   dres = dsum;  dx = dsum * m.
// Each team also accumulates dy * (xhat - cc) and dy for its own columns over all the rows it
// visits, and writes them once at the end as row `team_id` of the (num_teams, N) partials.

template <typename T, int VEC, int NV>
__global__ void __launch_bounds__(kMaxThreads) bwd_reg_kernel(BwdArgs a) {
  static_assert(NV * VEC <= 32, "one keep bit per element in a uint32");
  // fp32 rows read one value at a time, at most two a thread (odd or unaligned rows of up to
  // 256): the row sums' cross-thread reduction, the statistics and the dweight / dbias column
  // sums over the rows a team visits in double.  With fp32 there and a rounded 1/N, a 7-wide
  // row's dweight and dresidual missed the oracle at 1.1-1.4x in 4 of 900 emulated draws
  // (benchmarks/NOTES.md "... backward's tail in double").  The other kernels keep fp32: doubles
  // took the fp32 VEC 4 x NV 1 kernel (rows of 512) from 64 to 70 registers and VEC 4 x NV 4 to
  // 232 bytes of spills.
  constexpr bool kDoubleSums = std::is_same<T, float>::value && NV * VEC <= 2;
  using Stat = typename std::conditional<kDoubleSums, double, float>::type;
  TF_STATIC_SHARED Stat red[3 * kMaxThreads / 32];
  const int tpr = a.tpr;
  const int teams = blockDim.x / tpr;
  const int team = threadIdx.x / tpr;
  const int t = threadIdx.x - team * tpr;
  const int wpt = tpr >> 5;
  const int N = a.N;
  const Dropout drop = make_dropout(a.rng, a.threshold, a.scale, a.drop);
  const T* __restrict__ xp = static_cast<const T*>(a.x);
  const T* __restrict__ rp = static_cast<const T*>(a.r);
  const T* __restrict__ dyp = static_cast<const T*>(a.dy);
  const T* __restrict__ dhp = static_cast<const T*>(a.dh);

  Stat acc_w[NV][VEC], acc_b[NV][VEC];
#pragma unroll
  for (int k = 0; k < NV; ++k)
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc_w[k][e] = acc_b[k][e] = 0;

  for (int64_t base = static_cast<int64_t>(blockIdx.x) * teams; base < a.M;
       base += static_cast<int64_t>(gridDim.x) * teams) {
    const int64_t row = base + team;
    const bool valid = row < a.M;
    const float mu = valid ? a.mean[row] : 0.0f;
    const float rs = valid ? a.rstd[row] : 0.0f;
    float xh[NV][VEC], dys[NV][VEC];  // xhat and dy (g = dy * w is recomputed after the sums)
    uint32_t keep = 0;  // bit k * VEC + e: element kept by dropout
    float sg = 0.0f, sgx = 0.0f, sx = 0.0f;  // a thread's <= 16 values: fp32 (registers)
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int col = (t + k * tpr) * VEC;
      if (valid && col < N) {
        float xv[VEC], rv[VEC], dv[VEC], wv[VEC];
        load_f<T, VEC>(xp + row * a.sx + col, xv);
        load_f<T, VEC>(rp + row * a.sr + col, rv);
        load_f<T, VEC>(dyp + row * a.sdy + col, dv);
        if (a.w) load_param<T, VEC>(a.w, a.w_f32, col, wv);
        float fac[VEC];
        if (drop.on) drop.factors<VEC>(static_cast<uint64_t>(row) * N + col, fac);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          float xe = xv[e];
          if (drop.on) {
            const float f = fac[e];
            keep |= (f != 0.0f ? 1u : 0u) << (k * VEC + e);
            xe *= f;
          }
          const float xhat = (rv[e] + xe - mu) * rs;
          const float gv = a.w ? dv[e] * wv[e] : dv[e];
          xh[k][e] = xhat;
          dys[k][e] = dv[e];
          sg += gv;
          sgx += gv * xhat;
          sx += xhat;
          acc_b[k][e] += dv[e];
        }
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) xh[k][e] = dys[k][e] = 0.0f;
      }
    }
    // xhat centred on its row mean (0 in exact arithmetic; the fp32 mean's rounding shifts the
    // whole row, which the uncentred formula turns into a first-order dres error on narrow rows
    // far from zero; benchmarks/NOTES.md): cb = mean(g * (xhat - cc)).
    const BwdStats st = bwd_stats<Stat>(sg, sgx, sx, red, wpt, team * wpt, N);
    if (valid) {
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const int col = (t + k * tpr) * VEC;
        if (col < N) {
          float ds[VEC], dhv[VEC], wv[VEC];
          if (dhp) load_f<T, VEC>(dhp + row * a.sdh + col, dhv);
          if (a.w) load_param<T, VEC>(a.w, a.w_f32, col, wv);
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            const float gv = a.w ? dys[k][e] * wv[e] : dys[k][e];
            const float xc = xh[k][e] - st.cc;
            ds[e] = (gv - st.ca - xc * st.cb - st.off) * rs;
            if (dhp) ds[e] += dhv[e];
            acc_w[k][e] += static_cast<Stat>(dys[k][e]) * xc;
          }
          store_f<T, VEC>(static_cast<T*>(a.dres) + row * N + col, ds);
          if (a.dx) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) ds[e] = ((keep >> (k * VEC + e)) & 1u) ? ds[e] * drop.scale : 0.0f;
            store_f<T, VEC>(static_cast<T*>(a.dx) + row * N + col, ds);
          }
        }
      }
    }
  }
  // Stage 1 of dweight/dbias: this team's column sums (plain stores, one writer per element).
  const int64_t team_id = static_cast<int64_t>(blockIdx.x) * teams + team;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int col = (t + k * tpr) * VEC;
    if (col < N) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        if (a.dw_part) a.dw_part[team_id * N + col + e] = acc_w[k][e];
        if (a.db_part) a.db_part[team_id * N + col + e] = acc_b[k][e];
      }
    }
  }
}

// ------------------------------------------------------------------------------------------
// Backward, long rows: one block per row, two passes (sums, then outputs).

template <typename T, int VEC>
__global__ void __launch_bounds__(kMaxThreads) bwd_loop_kernel(BwdArgs a) {
  using Stat = typename std::conditional<std::is_same<T, float>::value, double, float>::type;
  TF_STATIC_SHARED Stat red[3 * kMaxThreads / 32];
  const int N = a.N;
  const int nvec = N / VEC;
  const int wpt = blockDim.x >> 5;
  const Dropout drop = make_dropout(a.rng, a.threshold, a.scale, a.drop);
  for (int64_t row = blockIdx.x; row < a.M; row += gridDim.x) {  // block-uniform
    const T* xr = static_cast<const T*>(a.x) + row * a.sx;
    const T* rr = static_cast<const T*>(a.r) + row * a.sr;
    const T* dyr = static_cast<const T*>(a.dy) + row * a.sdy;
    const float mu = a.mean[row], rs = a.rstd[row];
    Stat sg = 0, sgx = 0, sx = 0;
    for (int v = threadIdx.x; v < nvec; v += blockDim.x) {
      const int col = v * VEC;
      float xv[VEC], rv[VEC], dv[VEC], wv[VEC];
      load_f<T, VEC>(xr + col, xv);
      load_f<T, VEC>(rr + col, rv);
      load_f<T, VEC>(dyr + col, dv);
      if (a.w) load_param<T, VEC>(a.w, a.w_f32, col, wv);
      float fac[VEC];
      if (drop.on) drop.factors<VEC>(static_cast<uint64_t>(row) * N + col, fac);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        float xe = xv[e];
        if (drop.on) xe *= fac[e];
        const float xhat = (rv[e] + xe - mu) * rs;
        const float gv = a.w ? dv[e] * wv[e] : dv[e];
        sg += gv;
        sgx += static_cast<Stat>(gv) * xhat;
        sx += xhat;
      }
    }
    const BwdStats st = bwd_stats<Stat>(sg, sgx, sx, red, wpt, 0, N);  // as the register path
    if (a.xbar && threadIdx.x == 0) a.xbar[row] = st.cc;
    for (int v = threadIdx.x; v < nvec; v += blockDim.x) {
      const int col = v * VEC;
      float xv[VEC], rv[VEC], dv[VEC], wv[VEC], dhv[VEC], ds[VEC], dxv[VEC];
      load_f<T, VEC>(xr + col, xv);
      load_f<T, VEC>(rr + col, rv);
      load_f<T, VEC>(dyr + col, dv);
      if (a.w) load_param<T, VEC>(a.w, a.w_f32, col, wv);
      if (a.dh) load_f<T, VEC>(static_cast<const T*>(a.dh) + row * a.sdh + col, dhv);
      float fac[VEC];
      if (drop.on) drop.factors<VEC>(static_cast<uint64_t>(row) * N + col, fac);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        float xe = xv[e];
        float f = 1.0f;
        if (drop.on) {
          f = fac[e];
          xe *= f;
        }
        const float xhat = (rv[e] + xe - mu) * rs;
        const float gv = a.w ? dv[e] * wv[e] : dv[e];
        ds[e] = (gv - st.ca - (xhat - st.cc) * st.cb - st.off) * rs;
        if (a.dh) ds[e] += dhv[e];
        dxv[e] = ds[e] * f;
      }
      store_f<T, VEC>(static_cast<T*>(a.dres) + row * N + col, ds);
      if (a.dx) store_f<T, VEC>(static_cast<T*>(a.dx) + row * N + col, dxv);
    }
  }
}

#ifndef TF_LN_MAX_COL_GROUPS
#define TF_LN_MAX_COL_GROUPS 65535  // grid.y (the CPU emulation's tests set it small)
#endif

// dweight/dbias partials of the long-row path: block (32 columns x 8 row lanes) sums rows
// [blockIdx.y * rows_per_group, ...) of its 32 columns; partial row blockIdx.y.
constexpr int kColsX = 32, kColsY = 8;

template <typename T>
__global__ void __launch_bounds__(kColsX * kColsY) bwd_dwdb_cols_kernel(BwdArgs a, int64_t rows_per_group) {
  TF_STATIC_SHARED double sw[kColsY][kColsX + 1], sb[kColsY][kColsX + 1];
  const int N = a.N;
  const int col = blockIdx.x * kColsX + threadIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_group;
  const int64_t r1 = min(a.M, r0 + rows_per_group);
  const Dropout drop = make_dropout(a.rng, a.threshold, a.scale, a.drop);
  double aw = 0.0, ab = 0.0;
  if (col < N) {
    for (int64_t row = r0 + threadIdx.y; row < r1; row += kColsY) {
      float xe = to_f(static_cast<const T*>(a.x)[row * a.sx + col]);
      if (drop.on) xe *= drop.factor(static_cast<uint64_t>(row) * N + col);
      const float hv = to_f(static_cast<const T*>(a.r)[row * a.sr + col]) + xe;
      const float d = to_f(static_cast<const T*>(a.dy)[row * a.sdy + col]);
      // centred, as the register path (a.xbar is set whenever dweight is wanted)
      if (a.dw_part) aw += static_cast<double>(d) * ((hv - a.mean[row]) * a.rstd[row] - a.xbar[row]);
      ab += d;
    }
  }
  sw[threadIdx.y][threadIdx.x] = aw;
  sb[threadIdx.y][threadIdx.x] = ab;
  __syncthreads();
  if (threadIdx.y == 0 && col < N) {
    for (int i = 1; i < kColsY; ++i) {
      aw += sw[i][threadIdx.x];
      ab += sb[i][threadIdx.x];
    }
    if (a.dw_part) a.dw_part[static_cast<int64_t>(blockIdx.y) * N + col] = aw;
    if (a.db_part) a.db_part[static_cast<int64_t>(blockIdx.y) * N + col] = ab;
  }
}

// Stage 2: out[c] = sum_p part[p, c] (fixed order), block (32 columns x 16 row lanes).
constexpr int kRedX = 32, kRedY = 16;

template <typename OT>
__global__ void __launch_bounds__(kRedX * kRedY) reduce_cols_kernel(const double* __restrict__ part, int64_t P, int N, OT* __restrict__ out) {
  TF_STATIC_SHARED double s[kRedY][kRedX + 1];
  const int col = blockIdx.x * kRedX + threadIdx.x;
  double acc = 0.0;
  if (col < N) {
    for (int64_t p = threadIdx.y; p < P; p += kRedY) acc += part[p * N + col];
  }
  s[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && col < N) {
    for (int i = 1; i < kRedY; ++i) acc += s[i][threadIdx.x];
    out[col] = from_f<OT>(static_cast<float>(acc));
  }
}

// ------------------------------------------------------------------------------------------
// Host side: configuration and dispatch

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

#ifndef TF_CUDA_EMULATE  // the emulation provides kLnDevice, DeviceScope, sm_count, blocks_per_sm, launch
constexpr c10::DeviceType kLnDevice = c10::DeviceType::CUDA;

int sm_count(int device) {
  static int cache[128] = {0};
  if (device < 0 || device >= 128) device = 0;
  if (cache[device] == 0) {
    int n = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    cache[device] = std::max(n, 1);
  }
  return cache[device];
}

// Resident blocks per SM of `kernel` at `threads` threads (cached; a host-only query).
int blocks_per_sm(const void* kernel, int threads, int device) {
  static std::mutex mu;
  static std::unordered_map<uint64_t, int> cache;
  const uint64_t key = reinterpret_cast<uintptr_t>(kernel) ^ (static_cast<uint64_t>(threads) << 48) ^
                       (static_cast<uint64_t>(device) << 58);
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  int n = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, 0));
  n = std::max(n, 1);
  cache.emplace(key, n);
  return n;
}
#endif  // TF_CUDA_EMULATE

struct RowCfg {
  bool loop;  // long rows: fwd_loop / bwd_loop
  int vec;    // elements per access (1 or 16 / sizeof(T))
  int nv;     // vectors per thread (register path)
  int tpr;    // threads per row (register path)
  int teams;  // rows per block (register path)
};

RowCfg choose_cfg(int64_t N, int vec, int max_elems, int target_tpr) {
  const int64_t nvec = ceil_div(N, vec);
  int best_nv = 0, best_tpr = 0;
  for (int nv = 1; nv <= 16 && nv * vec <= max_elems; nv *= 2) {
    const int64_t tpr = ceil_div(ceil_div(nvec, nv), 32) * 32;
    best_nv = nv;
    best_tpr = static_cast<int>(std::min<int64_t>(tpr, 1 << 30));
    if (tpr <= target_tpr) break;  // the smallest nv within the target
  }
  RowCfg c{};
  c.vec = vec;
  if (best_nv == 0 || best_tpr > kMaxThreads) {
    c.loop = true;
    return c;
  }
  c.nv = best_nv;
  c.tpr = best_tpr;
  c.teams = std::max(1, 256 / c.tpr);
  return c;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// 16-byte accesses are legal when N is a multiple of the vector width and every row of every
// (M, N) operand starts 16-byte aligned, as do weight and bias (their column offsets are then
// multiples of 16 bytes for float and for T).
bool can_vectorize(int64_t N, int vec, std::initializer_list<const Tensor*> rows,
                   std::initializer_list<const void*> params) {
  if (N % vec != 0) return false;
  for (const Tensor* t : rows) {
    if (!t || !t->defined()) continue;
    if (!aligned16(t->data_ptr()) || (t->size(0) > 1 && t->stride(0) % vec != 0)) return false;
  }
  for (const void* p : params)
    if (p && !aligned16(p)) return false;
  return true;
}

template <typename F>
void dispatch_dtype(c10::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kHalf: f(c10::Half{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    default: TORCH_CHECK(false, "add_layer_norm (cuda): unsupported dtype ", t);
  }
}

// Calls f(std::integral_constant<int, NV>) for nv in {1, 2, 4, 8, 16} with NV * VEC <= kMax.
template <int VEC, int kMax, typename F>
void dispatch_nv(int nv, F&& f) {
  switch (nv) {
    case 1: if constexpr (VEC * 1 <= kMax) { f(std::integral_constant<int, 1>{}); return; } break;
    case 2: if constexpr (VEC * 2 <= kMax) { f(std::integral_constant<int, 2>{}); return; } break;
    case 4: if constexpr (VEC * 4 <= kMax) { f(std::integral_constant<int, 4>{}); return; } break;
    case 8: if constexpr (VEC * 8 <= kMax) { f(std::integral_constant<int, 8>{}); return; } break;
    case 16: if constexpr (VEC * 16 <= kMax) { f(std::integral_constant<int, 16>{}); return; } break;
    default: break;
  }
  TORCH_CHECK(false, "add_layer_norm (cuda): internal error, no kernel for nv=", nv, " vec=", VEC);
}

template <typename F>
void dispatch_vec(bool vectorized, int vec_width, F&& f) {
  // vec_width is 16 / sizeof(T): 4 for float, 8 for half/bfloat16.
  if (!vectorized) return f(std::integral_constant<int, 1>{});
  if (vec_width == 4) return f(std::integral_constant<int, 4>{});
  return f(std::integral_constant<int, 8>{});
}

bool has(const std::optional<Tensor>& t) { return t.has_value() && t->defined(); }

Tensor empty0(const Tensor& like) { return at::empty({0}, like.options()); }

template <typename T>
void launch_fwd(FwdArgs a, bool vectorized, int device, cudaStream_t stream) {
  constexpr int kVecWidth = 16 / sizeof(T);
  dispatch_vec(vectorized, kVecWidth, [&](auto vec_c) {
    constexpr int VEC = decltype(vec_c)::value;
    if constexpr (VEC == 1 || VEC == kVecWidth) {
      const RowCfg c = choose_cfg(a.N, VEC, kFwdMaxElems, kFwdTargetTpr);
      const int sms = sm_count(device);
      if (c.loop) {
        const void* k = reinterpret_cast<const void*>(&fwd_loop_kernel<T, VEC>);
        const int64_t grid = std::min<int64_t>(a.M, int64_t{sms} * blocks_per_sm(k, kMaxThreads, device));
        launch(fwd_loop_kernel<T, VEC>, dim3(static_cast<unsigned>(grid)), dim3(kMaxThreads), stream, a);
        return;
      }
      a.tpr = c.tpr;
      dispatch_nv<VEC, kFwdMaxElems>(c.nv, [&](auto nv_c) {
        constexpr int NV = decltype(nv_c)::value;
        const int threads = c.tpr * c.teams;
        // A block per team of rows, not a grid-stride walk over the resident blocks: a block
        // retiring makes room for one that starts loading while the others reduce, as the
        // Triton kernel's one program per row (89% of the copy bandwidth where this kernel's
        // walk, with 2 resident blocks of 512 per SM, ran at 44%; H200 run 6).
        const int64_t grid = std::min<int64_t>(ceil_div(a.M, c.teams), int64_t{INT32_MAX});
        launch(fwd_reg_kernel<T, VEC, NV>, dim3(static_cast<unsigned>(grid)), dim3(threads), stream, a);
      });
    }
  });
}

// Runs the row kernels; fills the (P, N) partials when a.dw_part / a.db_part are wanted and
// returns P.  `alloc_partials(P, long_rows)` allocates them once P is known (and a.xbar for the
// long-row path's dweight when dweight is wanted).
template <typename T, typename Alloc>
int64_t launch_bwd(BwdArgs& a, bool vectorized, int device, cudaStream_t stream, Alloc&& alloc_partials) {
  constexpr int kVecWidth = 16 / sizeof(T);
  int64_t P = 0;
  dispatch_vec(vectorized, kVecWidth, [&](auto vec_c) {
    constexpr int VEC = decltype(vec_c)::value;
    if constexpr (VEC == 1 || VEC == kVecWidth) {
      constexpr int kMax = VEC == 1 ? kBwdMaxElemsScalar : kBwdMaxElems;
      const RowCfg c = choose_cfg(a.N, VEC, kMax, kBwdTargetTpr);
      const int sms = sm_count(device);
      if (c.loop) {
        const void* k = reinterpret_cast<const void*>(&bwd_loop_kernel<T, VEC>);
        const int64_t grid = std::min<int64_t>(a.M, int64_t{sms} * blocks_per_sm(k, kMaxThreads, device));
        // dweight/dbias: column kernel over groups of >= 256 rows (partials ~1/128 of dy's
        // bytes), more rows a group where the groups would pass grid.y's limit
        const int64_t rows_per_group = std::max<int64_t>(256, ceil_div(a.M, int64_t{TF_LN_MAX_COL_GROUPS}));
        P = ceil_div(a.M, rows_per_group);
        alloc_partials(P, true);
        launch(bwd_loop_kernel<T, VEC>, dim3(static_cast<unsigned>(grid)), dim3(kMaxThreads), stream, a);
        if (a.dw_part || a.db_part) {
          const dim3 grid2(static_cast<unsigned>(ceil_div(a.N, kColsX)), static_cast<unsigned>(P));
          launch(bwd_dwdb_cols_kernel<T>, grid2, dim3(kColsX, kColsY), stream, a, rows_per_group);
        }
        return;
      }
      a.tpr = c.tpr;
      dispatch_nv<VEC, kMax>(c.nv, [&](auto nv_c) {
        constexpr int NV = decltype(nv_c)::value;
        const int threads = c.tpr * c.teams;
        const void* k = reinterpret_cast<const void*>(&bwd_reg_kernel<T, VEC, NV>);
        // One wave of resident blocks: the number of partial rows stays ~ SMs * resident teams.
        const int64_t grid = std::min<int64_t>(ceil_div(a.M, c.teams),
                                               int64_t{sms} * blocks_per_sm(k, threads, device));
        P = grid * c.teams;
        alloc_partials(P, false);
        launch(bwd_reg_kernel<T, VEC, NV>, dim3(static_cast<unsigned>(grid)), dim3(threads), stream, a);
      });
    }
  });
  return P;
}

void launch_reduce(const Tensor& part, int64_t P, int N, Tensor& out, cudaStream_t stream) {
  dispatch_dtype(out.scalar_type(), [&](auto tag) {
    using OT = decltype(tag);
    const unsigned grid = static_cast<unsigned>(ceil_div(N, kRedX));
    launch(reduce_cols_kernel<OT>, dim3(grid), dim3(kRedX, kRedY), stream, part.const_data_ptr<double>(), P, N,
           out.mutable_data_ptr<OT>());
  });
}

}  // namespace

Tensor4 add_layer_norm_fwd_cuda(const Tensor& x, const Tensor& residual,
                                const std::optional<Tensor>& weight,
                                const std::optional<Tensor>& bias, double eps, double dropout_p,
                                const std::optional<Tensor>& rng, bool prenorm) {
  check_add_layer_norm_fwd_args(x, residual, weight, bias, eps, dropout_p, rng, kLnDevice);
  const DeviceScope scope(x);
  const int64_t M = x.size(0), N = x.size(1);
  TORCH_CHECK(N <= std::numeric_limits<int>::max() / 2, "add_layer_norm (cuda): N too large: ", N);
  Tensor y = at::empty({M, N}, x.options());
  Tensor h = prenorm ? at::empty({M, N}, x.options()) : empty0(x);
  Tensor mean = at::empty({M}, x.options().dtype(at::kFloat));
  Tensor rstd = at::empty({M}, x.options().dtype(at::kFloat));
  if (M == 0) return {y, h, mean, rstd};
  if (N == 0) {  // LayerNorm of an empty row: mean 0, variance 0
    mean.fill_(0.0);
    rstd.fill_(1.0 / std::sqrt(eps));
    return {y, h, mean, rstd};
  }
  const Tensor w = has(weight) ? weight->contiguous() : Tensor();
  const Tensor b = has(bias) ? bias->contiguous() : Tensor();
  const bool drop = dropout_p > 0.0;
  const Tensor rng_c = drop ? rng->contiguous() : Tensor();

  FwdArgs a{};
  a.x = x.const_data_ptr();
  a.r = residual.const_data_ptr();
  a.w = w.defined() ? w.const_data_ptr() : nullptr;
  a.b = b.defined() ? b.const_data_ptr() : nullptr;
  a.y = y.mutable_data_ptr();
  a.h = prenorm ? h.mutable_data_ptr() : nullptr;
  a.mean = mean.mutable_data_ptr<float>();
  a.rstd = rstd.mutable_data_ptr<float>();
  a.rng = drop ? rng_c.const_data_ptr<int64_t>() : nullptr;
  a.M = M;
  a.sx = x.stride(0);
  a.sr = residual.stride(0);
  a.N = static_cast<int>(N);
  a.eps = static_cast<float>(eps);
  a.threshold = dropout_threshold(dropout_p);
  a.scale = dropout_scale(dropout_p);
  a.drop = drop;
  a.w_f32 = w.defined() && w.scalar_type() == at::kFloat;
  a.b_f32 = b.defined() && b.scalar_type() == at::kFloat;

  const int device = scope.device;
  const cudaStream_t stream = scope.stream;
  dispatch_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const bool vec = can_vectorize(N, 16 / sizeof(T), {&x, &residual, &y, &h}, {a.w, a.b});
    launch_fwd<T>(a, vec, device, stream);
  });
  return {y, h, mean, rstd};
}

Tensor4 add_layer_norm_bwd_cuda(const Tensor& dy, const std::optional<Tensor>& dh,
                                const Tensor& x, const Tensor& residual,
                                const std::optional<Tensor>& weight,
                                const std::optional<Tensor>& bias, const Tensor& mean,
                                const Tensor& rstd, double dropout_p,
                                const std::optional<Tensor>& rng) {
  check_add_layer_norm_bwd_args(dy, dh, x, residual, weight, bias, mean, rstd, dropout_p, rng,
                                kLnDevice);
  const DeviceScope scope(x);
  const int64_t M = x.size(0), N = x.size(1);
  TORCH_CHECK(N <= std::numeric_limits<int>::max() / 2, "add_layer_norm (cuda): N too large: ", N);
  const bool drop = dropout_p > 0.0;
  Tensor dres = at::empty({M, N}, x.options());
  Tensor dx = drop ? at::empty({M, N}, x.options()) : empty0(x);
  Tensor dw = has(weight) ? at::empty({N}, weight->options()) : empty0(x);
  Tensor db = has(bias) ? at::empty({N}, bias->options()) : empty0(x);
  if (M == 0 || N == 0) {  // no rows: zero parameter gradients, nothing to launch otherwise
    if (dw.numel()) dw.zero_();
    if (db.numel()) db.zero_();
    return {dx, dres, dw, db};
  }
  const Tensor w = has(weight) ? weight->contiguous() : Tensor();
  const Tensor rng_c = drop ? rng->contiguous() : Tensor();
  const Tensor mean_c = mean.contiguous(), rstd_c = rstd.contiguous();
  const Tensor dh_t = has(dh) ? *dh : Tensor();

  BwdArgs a{};
  a.dy = dy.const_data_ptr();
  a.dh = dh_t.defined() ? dh_t.const_data_ptr() : nullptr;
  a.x = x.const_data_ptr();
  a.r = residual.const_data_ptr();
  a.w = w.defined() ? w.const_data_ptr() : nullptr;
  a.mean = mean_c.const_data_ptr<float>();
  a.rstd = rstd_c.const_data_ptr<float>();
  a.rng = drop ? rng_c.const_data_ptr<int64_t>() : nullptr;
  a.dx = drop ? dx.mutable_data_ptr() : nullptr;
  a.dres = dres.mutable_data_ptr();
  a.M = M;
  a.sdy = dy.stride(0);
  a.sdh = dh_t.defined() ? dh_t.stride(0) : 0;
  a.sx = x.stride(0);
  a.sr = residual.stride(0);
  a.N = static_cast<int>(N);
  a.threshold = dropout_threshold(dropout_p);
  a.scale = dropout_scale(dropout_p);
  a.drop = drop;
  a.w_f32 = w.defined() && w.scalar_type() == at::kFloat;

  const bool want_dw = has(weight), want_db = has(bias);
  Tensor dw_part, db_part, xbar;
  auto alloc_partials = [&](int64_t P, bool long_rows) {
    const auto opts = x.options().dtype(at::kFloat);
    if (want_dw) dw_part = at::empty({P, N}, opts.dtype(at::kDouble));
    if (want_db) db_part = at::empty({P, N}, opts.dtype(at::kDouble));
    if (want_dw && long_rows) xbar = at::empty({M}, opts);
    a.dw_part = want_dw ? dw_part.mutable_data_ptr<double>() : nullptr;
    a.db_part = want_db ? db_part.mutable_data_ptr<double>() : nullptr;
    a.xbar = xbar.defined() ? xbar.mutable_data_ptr<float>() : nullptr;
  };

  const int device = scope.device;
  const cudaStream_t stream = scope.stream;
  int64_t P = 0;
  dispatch_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const bool vec = can_vectorize(N, 16 / sizeof(T), {&dy, &dh_t, &x, &residual, &dres, &dx}, {a.w});
    P = launch_bwd<T>(a, vec, device, stream, alloc_partials);
  });
  if (want_dw) launch_reduce(dw_part, P, static_cast<int>(N), dw, stream);
  if (want_db) launch_reduce(db_part, P, static_cast<int>(N), db, stream);
  return {dx, dres, dw, db};
}

#ifndef TF_CUDA_EMULATE
TORCH_LIBRARY_IMPL(transformer_fast_C, CUDA, m) {
  m.impl("add_layer_norm_fwd", &add_layer_norm_fwd_cuda);
  m.impl("add_layer_norm_bwd", &add_layer_norm_bwd_cuda);
}
#endif

}  // namespace transformer_fast
