// Masked softmax attention on CUDA tensor cores (mma.sync m16n8k16, sm_80+): flash forward and a
// deterministic flash backward.  Written without a GPU and tested in CPU emulation (TF_CUDA_EMULATE
// below; tests/test_attention_cpu.py -m slow) against the oracle; the gpu tests and
// compute-sanitizer have run it on an H200 and an H100 (README Status says which version, and
// what changed since without a GPU run).
// The algorithm (tiles, online-softmax update, lse, backward decomposition) is the one
// csrc/attention_cpu.cpp runs as the cpu backend.
//
// Contract: transformer_fast/ops/attention.py (the launcher contract of kernels/attention.py),
// for fp16 / bf16 inputs.  fp32 inputs go to the exact-fp32 SIMT kernels of
// attention_fp32_cuda.cu (attention_fwd_cuda / attention_bwd_cuda dispatch on q's dtype; no tf32
// path yet: allow_tf32 is ignored, and exact fp32 is always within the contract, only slower).
//   q (B, H, Lq, D), k/v (B, Hkv, Lk, D), Hkv | H, unit stride along D (other strides read as
//   given), D <= 256 (padded inside the kernel to a bucket of 64, 128 or 256, never by copying);
//   attn_mask (B, H, Lq, Lk) bool (True = takes part) or float (added), read through its strides;
//   key_padding_mask (B, Lk) bool (True = padding); is_causal top-left; dropout via philox.h with
//   element index ((b*H + h)*Lq + i)*Lk + j, [seed, offset] read from device memory.
//   out (B, H, Lq, D) laid out like q (empty_in_layout_of in attention_cuda.h: a (B, L, H, D)
//   transposed q gives a (B, L, H, D) transposed out, so the module's head merge is a view) and
//   written through its strides; dq / dk / dv allocated like q / k / v (empty_like); lse
//   (B, H, Lq) fp32 natural log (-inf for a row with no key).
//
// Kernels (4 warps, 128 threads each; fp32 accumulation, fp32 softmax):
//   fwd_kernel   one CTA per (b, h, 64 query rows); warp w owns rows 16w..16w+15 with Q in
//                registers (A fragments); K/V tiles of 64 keys staged in shared memory; S = QK^T
//                and O += PV on mma.sync; P goes from the S accumulators to A fragments in
//                registers (the m16n8 C layout of two adjacent n-tiles is the m16k16 A layout).
//   dkdv_kernel  one CTA per (b, kv head, 64 keys); warp w owns keys 16w..16w+15; loops over the
//                query heads of the GQA group and over 32-query tiles of Q / dO in shared memory
//                (one flattened loop, so the next tile's copy crosses head boundaries):
//                S^T = K Q^T, dP^T = V dO^T, dV += (P.Z)^T dO, dK += dS^T Q.  No atomics.
//   dq_kernel    one CTA per (b, h, 64 query rows), loops over 32-key tiles: dQ += dS K
//                (K/V double-buffered with cp.async like the forward).
//   delta = rowsum(dO * O) is computed with ATen before the two backward kernels.
//   fwd_dense_kernel (attention_dense_fwd.cuh)  the forward without dropout (causal,
//                key_padding_mask and attn_mask allowed), D <= 128: fwd_kernel's tiles with the
//                generic per-element code out of the loop, behind a warp-uniform branch (3.7x
//                fwd_kernel's speed in benchmarks/cuda_attn on an H200, unmasked).  For the
//                same calls dkdv_dense_kernel / dq_dense_kernel (attention_dense_{dkdv,dq}.cuh) are
//                the backward kernels rewritten like it; where rows are not 16-byte aligned, the
//                generic kernels' kDense instantiations (no mask or dropout code) run instead
//                (the generic ones themselves when there is a mask).
// Fully masked tiles beyond the causal diagonal are outside the loop bounds.
//
// Shared-memory fragments are read with ldmatrix; tiles are copied with 16-byte loads when every
// row start is aligned (2-byte loads otherwise), and then every kernel double-buffers its
// streamed tiles with cp.async (fwd / dq: K and V; dkdv: Q and dO); tiles that need no masking
// (no masks, in bounds, below the causal diagonal) skip the mask code.  On a Hopper GPU with
// sm_90a code (wgmma_mode), the calls fwd_dense_kernel takes without an attn_mask run
// fwd_wgmma_dense_kernel instead (attention_wgmma_dense.cuh: two warpgroups, 128 x 128 tiles,
// 128-byte swizzled shared memory), and their backward dkdv_wgmma_dense_kernel and
// dq_wgmma_dense_kernel (attention_wgmma_{dkdv,dq}.cuh; is_causal and key_padding_mask too);
// TRANSFORMER_FAST_CUDA_WGMMA=0 turns them off, =1 also sends the forwards no dense kernel takes
// to fwd_wgmma_kernel (attention_wgmma.cuh, slower than fwd_kernel).  Out of scope for this
// version (benchmarks/NOTES.md): TMA, warp specialisation and ping-pong scheduling, attn_mask
// and dropout on wgmma.
// Speed: benchmarks/results (H100 2026-11-27: the wgmma dense forward 466 TFLOP/s at
// B4 H16 L4096 D128 bf16; the mma.sync dense one 264).
//
// TF_CUDA_EMULATE: tests/test_attention_cpu.py (slow) compiles this file as host C++ with the
// warp primitives emulated by threads and barriers (mma.sync by its documented fragment layout),
// so that the kernels' indexing, masking and tiling run against the oracle without a GPU.
#include <ATen/Context.h>
#include <ATen/ScalarOps.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/zeros.h>
#ifndef TF_CUDA_EMULATE
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_runtime.h>
#define TF_ATTN_DEVICE at::kCUDA
#else
#define TF_ATTN_DEVICE at::kCPU
#endif

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <type_traits>

#include "attention_cuda.h"
#include "attention_device.cuh"
#include "ops.h"
#include "philox.h"

namespace transformer_fast {
namespace {

using at::Tensor;
using namespace attn_device;

constexpr int kThreads = 128;  // 4 warps
constexpr int kFwdBM = 64;     // forward: query rows per CTA (16 per warp)
constexpr int kFwdBN = 64;     // forward: keys per tile
constexpr int kKvBN = 64;      // dk/dv: keys per CTA (16 per warp)
constexpr int kKvBM = 32;      // dk/dv: queries per tile
constexpr int kDqBM = 64;      // dq: query rows per CTA
constexpr int kDqBN = 32;      // dq: keys per tile
constexpr int kPad = 8;        // shared-memory row padding (halves) against bank conflicts
constexpr int64_t kExactDeltaMaxLk = 128;  // backward: 16-bit delta from an unrounded O up to this Lk

using Params = AttentionParams<uint16_t>;  // fp16/bf16 bit patterns

// ---- fp16 / bf16 traits: packing two fp32 values into one 32-bit register, and the mma.

template <typename T>
struct Traits;

template <>
struct Traits<__half> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  static __device__ __forceinline__ uint16_t bits(float x) {
    __half h = __float2half_rn(x);
    return *reinterpret_cast<uint16_t*>(&h);
  }
  static __device__ __forceinline__ float to_float(uint16_t b) {
    return __half2float(*reinterpret_cast<const __half*>(&b));
  }
  static __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0,
                                             uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#elif defined(TF_CUDA_EMULATE)
    emulated_mma(c, a, b0, b1, /*bf16=*/false);
#else
    __trap();  // sm_80+ only (the host refuses older devices)
#endif
  }
};

template <>
struct Traits<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  static __device__ __forceinline__ uint16_t bits(float x) {
    __nv_bfloat16 h = __float2bfloat16_rn(x);
    return *reinterpret_cast<uint16_t*>(&h);
  }
  static __device__ __forceinline__ float to_float(uint16_t b) {
    return __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(&b));
  }
  static __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0,
                                             uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#elif defined(TF_CUDA_EMULATE)
    emulated_mma(c, a, b0, b1, /*bf16=*/true);
#else
    __trap();  // sm_80+ only (the host refuses older devices)
#endif
  }
};

// ---- Fragment helpers.  Lane = 4 * g + t (g = lane / 4, t = lane % 4).  m16n8k16 layouts:
//   A (16 x 16, row major): reg r holds (row g + 8 * (r & 1), cols 2t + 8 * (r >> 1) + {0, 1})
//   B (16 x 8, k x n):      reg r holds (k 2t + 8 * r + {0, 1}, n g)
//   C (16 x 8, fp32):       c[e] is (row g + 8 * (e >> 1), col 2t + (e & 1))

__device__ __forceinline__ uint32_t pack_bits(uint16_t lo, uint16_t hi) {
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

// A fragment of a 16 x 16 block of a row-major matrix in global memory (rows row0.., cols col0..),
// zero outside rows < nrows and cols < ncols.
__device__ __forceinline__ void load_a_global(uint32_t a[4], const uint16_t* base, int64_t ld,
                                              int row0, int col0, int nrows, int ncols, int g,
                                              int t) {
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int row = row0 + g + 8 * (r & 1);
    const int col = col0 + 2 * t + 8 * (r >> 1);
    uint16_t lo = 0, hi = 0;
    if (row < nrows) {
      if (col < ncols) lo = base[row * ld + col];
      if (col + 1 < ncols) hi = base[row * ld + col + 1];
    }
    a[r] = pack_bits(lo, hi);
  }
}

// ldmatrix.m8n8 (.x2 / .x4, optionally .trans): lane l supplies the address of row l % 8 of
// matrix l / 8 (a 16-byte row in shared memory); register m of lane l receives (row l / 4,
// cols 2 (l % 4) + {0, 1}) of matrix m, or with .trans (rows 2 (l % 4) + {0, 1}, col l / 4).
template <int N, bool TRANS>
__device__ __forceinline__ void ldmatrix(uint32_t* r, const uint16_t* addr) {
  static_assert(N == 4 || N == 2, "instantiated forms only");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(addr));
  if constexpr (N == 4 && TRANS) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
  } else if constexpr (N == 4) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
  } else if constexpr (TRANS) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(a));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(a));
  }
#elif defined(TF_CUDA_EMULATE)
  emulated_ldmatrix(r, N, addr, TRANS);
#else
  __trap();
#endif
}

// The A fragment (16 rows x 16 k) held by the m16n8 fp32 accumulators of n-tiles 2kk and 2kk+1
// (rows x 8 columns each): the C layout of two adjacent n-tiles is the A layout of one 16-wide k
// slab, so P (or dS) goes from one MMA's output to the next MMA's input without shared memory.
template <typename T>
__device__ __forceinline__ void acc_to_a(uint32_t a[4], const float (*acc)[4], int kk) {
  a[0] = Traits<T>::pack(acc[2 * kk][0], acc[2 * kk][1]);
  a[1] = Traits<T>::pack(acc[2 * kk][2], acc[2 * kk][3]);
  a[2] = Traits<T>::pack(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
  a[3] = Traits<T>::pack(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
}

// A fragment of rows row0.., cols col0.. of a shared-memory tile (row pitch `pitch`, zero
// padded): matrices (rows +0 / +8) x (cols +0 / +8) in the order a0..a3.
__device__ __forceinline__ void load_a_smem(uint32_t a[4], const uint16_t* s, int pitch, int row0,
                                            int col0, int g, int t) {
  const int lane = 4 * g + t, m = lane / 8, r = lane % 8;
  ldmatrix<4, false>(a, s + (row0 + r + 8 * (m & 1)) * pitch + col0 + 8 * (m >> 1));
}

// B fragment (k x n) where B[k][n] = S[n0 + n][k0 + k], S a row-major smem tile used transposed
// (K for S = Q K^T): the 8x8 blocks at cols k0 and k0 + 8 of rows n0.., read as stored.
__device__ __forceinline__ void load_bt_smem(uint32_t& b0, uint32_t& b1, const uint16_t* s,
                                             int pitch, int n0, int k0, int g, int t) {
  const int lane = 4 * g + t, m = (lane / 8) & 1, r = lane % 8;  // lanes 16..31: valid, unused
  uint32_t b[2];
  ldmatrix<2, false>(b, s + (n0 + r) * pitch + k0 + 8 * m);
  b0 = b[0];
  b1 = b[1];
}

// B fragment (k x n) where B[k][n] = S[k0 + k][n0 + n] (V for O += P V): the 8x8 blocks at rows
// k0 and k0 + 8, transposed by ldmatrix.trans.
__device__ __forceinline__ void load_b_smem(uint32_t& b0, uint32_t& b1, const uint16_t* s,
                                            int pitch, int k0, int n0, int g, int t) {
  const int lane = 4 * g + t, m = (lane / 8) & 1, r = lane % 8;
  uint32_t b[2];
  ldmatrix<2, true>(b, s + (k0 + r + 8 * m) * pitch + n0);
  b0 = b[0];
  b1 = b[1];
}

// Cooperative copy of rows [0, rows) x cols [0, DP) of a global row-major tile into shared memory,
// zero where row >= nrows or col >= ncols.  vec16: 16-byte chunks (the host checked alignment
// and ncols % 8 == 0, so a chunk is either entirely in or entirely out of [0, ncols)).
struct alignas(16) Chunk16 {
  uint32_t w[4];
};

template <int DP>
__device__ __forceinline__ void load_tile(uint16_t* s, const uint16_t* base, int64_t ld, int rows,
                                          int nrows, int ncols, bool vec16) {
  if (vec16) {
    constexpr int kChunks = DP / 8;
    for (int idx = threadIdx.x; idx < rows * kChunks; idx += kThreads) {
      const int r = idx / kChunks, c = (idx % kChunks) * 8;
      Chunk16 val = {{0u, 0u, 0u, 0u}};
      if (r < nrows && c < ncols) val = *reinterpret_cast<const Chunk16*>(base + r * ld + c);
      *reinterpret_cast<Chunk16*>(s + r * (DP + kPad) + c) = val;
    }
    return;
  }
  for (int idx = threadIdx.x; idx < rows * DP; idx += kThreads) {
    const int r = idx / DP, c = idx % DP;
    s[r * (DP + kPad) + c] = (r < nrows && c < ncols) ? base[r * ld + c] : uint16_t(0);
  }
}

// cp.async (sm_80+): 16-byte global -> shared copies that run while the CTA computes on the
// other buffer.  `valid` false zero-fills (src-size 0: nothing is read; `src` is still a valid
// address).  The emulation and the host pass copy synchronously.
__device__ __forceinline__ void cp_async16(uint16_t* dst, const uint16_t* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(bytes));
#else
  Chunk16 v = {{0u, 0u, 0u, 0u}};
  if (valid) v = *reinterpret_cast<const Chunk16*>(src);
  *reinterpret_cast<Chunk16*>(dst) = v;
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// load_tile's vec16 path issued as cp.async (the caller commits and waits).
template <int DP>
__device__ __forceinline__ void load_tile_async(uint16_t* s, const uint16_t* base, int64_t ld,
                                                int rows, int nrows, int ncols) {
  constexpr int kChunks = DP / 8;
  for (int idx = threadIdx.x; idx < rows * kChunks; idx += kThreads) {
    const int r = idx / kChunks, c = (idx % kChunks) * 8;
    const bool valid = r < nrows && c < ncols;
    cp_async16(s + r * (DP + kPad) + c, valid ? base + r * ld + c : base, valid);
  }
}

// Whether a tile of keys [n0, n0 + bn) needs no masking for any query row >= m0: no masks, all
// keys in bounds, and (causal) every key at or before the first row.  Uniform over the CTA, so
// the branch costs nothing; such tiles only scale (the dense interior of every problem).
__device__ __forceinline__ bool plain_tile(const Params& p, int m0, int n0, int bn) {
  return p.kpm == nullptr && p.am_type == kMaskNone && n0 + bn <= p.Lk &&
         (!p.causal || n0 + bn - 1 <= m0);
}

__device__ __forceinline__ float quad_max(float x) {
  x = nan_max(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return nan_max(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// ---------------------------------------------------------------------------------------------
// Forward

// Where a CTA of either forward kernel works: one CTA per (b, h, BM query rows), blocks ordered
// query block fastest; warp w owns rows m0 + 16w .. m0 + 16w + 15, lane = 4g + t.
struct ForwardRows {
  int bh, b, h, hk, g, t, m0, row0;
};

template <int BM>
__device__ __forceinline__ ForwardRows forward_rows(const Params& p) {
  const int nmb = (p.Lq + BM - 1) / BM;
  const int bh = blockIdx.x / nmb, h = bh % p.H;
  const int lane = threadIdx.x % 32, m0 = (blockIdx.x % nmb) * BM;
  return {bh, bh / p.H, h, h / (p.H / p.Hkv), lane / 4, lane % 4, m0,
          m0 + static_cast<int>(threadIdx.x / 32) * 16};
}

// One key tile of both forward kernels' online softmax, for this thread's rows row0 + g and
// row0 + g + 8: s[4 * nt + e] (the m16n8 accumulator element e of key tile nt) comes in as raw
// q.k dots and leaves scaled and masked; the running max m_i moves to the tile's, l_i is rescaled
// to it, and alpha (the factor for what was summed under the old max) and m_use (the max to
// exponentiate against) come out.
template <int BN>
__device__ __forceinline__ void score_tile_update(const Params& p, int b, int h, int m0, int n0,
                                                  int row0, int g, int t, float* s, float m_i[2],
                                                  float l_i[2], float m_use[2], float alpha[2]) {
  float mx[2] = {-INFINITY, -INFINITY};
  const bool plain = plain_tile(p, m0, n0, BN);  // rows >= Lq are never stored
#pragma unroll
  for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float& x = s[4 * nt + e];
      const int i = row0 + g + 8 * (e >> 1), j = n0 + nt * 8 + 2 * t + (e & 1);
      x = plain ? x * p.scale : masked_score(p, b, h, i, j, x);
      mx[e >> 1] = nan_max(mx[e >> 1], x);
    }
  }
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    const float m_new = nan_max(m_i[rh], quad_max(mx[rh]));
    // All masked so far: exponentiate against 0 (exp(-inf) = 0), nothing to rescale.
    m_use[rh] = m_new == -INFINITY ? 0.0f : m_new;
    alpha[rh] = __expf(m_i[rh] - m_use[rh]);
    m_i[rh] = m_new;
    l_i[rh] *= alpha[rh];
  }
}

// The end of both forward kernels (fwd_kernel, fwd_wgmma_kernel): O / l and lse = m + log(l) for
// this thread's rows row0 + g and row0 + g + 8 (m_i, l_i: their running max and this thread's part
// of their sums; o[4 * dt + e]: the m16n8 accumulator element e of head-dim tile dt); a row with
// nothing visible gets 0 and lse -inf.
template <typename T, int DP>
__device__ __forceinline__ void finish_forward_rows(const Params& p, int bh, int row0, int g, int t,
                                                    const float m_i[2], const float l_i[2],
                                                    const float* o) {
  const int b = bh / p.H, h = bh % p.H;
  float inv[2];
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    const float l = quad_sum(l_i[rh]);
    const int i = row0 + g + 8 * rh;
    const bool dead = l == 0.0f;  // NaN (a NaN / +Inf score) propagates as in the reference
    inv[rh] = dead ? 0.0f : 1.0f / l;
    if (t == 0 && i < p.Lq) {
      p.lse_out[static_cast<int64_t>(bh) * p.Lq + i] = dead ? -INFINITY : m_i[rh] + __logf(l);
    }
  }
  uint16_t* oh = p.out + b * p.o_sb + h * p.o_sh;
#pragma unroll
  for (int dt = 0; dt < DP / 8; ++dt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = row0 + g + 8 * (e >> 1), d = dt * 8 + 2 * t + (e & 1);
      if (i < p.Lq && d < p.D) oh[i * p.o_sm + d] = Traits<T>::bits(o[4 * dt + e] * inv[e >> 1]);
    }
  }
}


template <typename T, int DP>
__global__ void __launch_bounds__(kThreads) fwd_kernel(const Params p) {
  extern __shared__ __align__(16) uint16_t smem[];
  constexpr int pitch = DP + kPad;
  // Two K/V buffers: with vec16 the next tile is copied (cp.async) while this one is computed.
  constexpr int kBuf = 2 * kFwdBN * pitch;  // K then V of one buffer

  const auto [bh, b, h, hk, g, t, m0, row0] = forward_rows<kFwdBM>(p);

  const auto [seed, offset] = dropout_key(p);

  const uint16_t* qh = p.q + b * p.q_sb + h * p.q_sh;
  const uint16_t* kh = p.k + b * p.k_sb + hk * p.k_sh;
  const uint16_t* vh = p.v + b * p.v_sb + hk * p.v_sh;

  uint32_t qf[DP / 16][4];
#pragma unroll
  for (int kc = 0; kc < DP / 16; ++kc) load_a_global(qf[kc], qh, p.q_sm, row0, kc * 16, p.Lq, p.D, g, t);

  float o[DP / 8][4];
#pragma unroll
  for (int dt = 0; dt < DP / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
  float m_i[2] = {-INFINITY, -INFINITY};  // running max of rows g and g + 8
  float l_i[2] = {0.0f, 0.0f};            // this thread's part of the running row sums

  const int n_end = p.causal ? min(p.Lk, m0 + kFwdBM) : p.Lk;
  const int ntiles = (n_end + kFwdBN - 1) / kFwdBN;
  if (p.vec16) {  // prologue: tile 0 into buffer 0
    load_tile_async<DP>(smem, kh, p.k_sm, kFwdBN, p.Lk, p.D);
    load_tile_async<DP>(smem + kFwdBN * pitch, vh, p.v_sm, kFwdBN, p.Lk, p.D);
    cp_async_commit();
  }
  for (int it = 0; it < ntiles; ++it) {
    const int n0 = it * kFwdBN;
    uint16_t* Ks = smem + (it & 1) * kBuf;
    uint16_t* Vs = Ks + kFwdBN * pitch;
    if (p.vec16) {
      if (it + 1 < ntiles) {  // buffer (it+1)&1 was released by the barrier ending iteration it-1
        const int n1 = n0 + kFwdBN;
        uint16_t* Kn = smem + ((it + 1) & 1) * kBuf;
        load_tile_async<DP>(Kn, kh + n1 * p.k_sm, p.k_sm, kFwdBN, p.Lk - n1, p.D);
        load_tile_async<DP>(Kn + kFwdBN * pitch, vh + n1 * p.v_sm, p.v_sm, kFwdBN, p.Lk - n1, p.D);
        cp_async_commit();
        cp_async_wait<1>();  // this thread's copies of tile `it` have landed
      } else {
        cp_async_wait<0>();
      }
    } else {
      load_tile<DP>(Ks, kh + n0 * p.k_sm, p.k_sm, kFwdBN, p.Lk - n0, p.D, false);
      load_tile<DP>(Vs, vh + n0 * p.v_sm, p.v_sm, kFwdBN, p.Lk - n0, p.D, false);
    }
    __syncthreads();  // tile `it` is visible to every warp

    float s[kFwdBN / 8][4];
#pragma unroll
    for (int nt = 0; nt < kFwdBN / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
    for (int kc = 0; kc < DP / 16; ++kc) {
#pragma unroll
      for (int nt = 0; nt < kFwdBN / 8; ++nt) {
        uint32_t b0, b1;
        load_bt_smem(b0, b1, Ks, pitch, nt * 8, kc * 16, g, t);
        Traits<T>::mma(s[nt], qf[kc], b0, b1);
      }
    }
    float m_use[2], alpha[2];
    score_tile_update<kFwdBN>(p, b, h, m0, n0, row0, g, t, &s[0][0], m_i, l_i, m_use, alpha);
#pragma unroll
    for (int dt = 0; dt < DP / 8; ++dt) {
      o[dt][0] *= alpha[0];
      o[dt][1] *= alpha[0];
      o[dt][2] *= alpha[1];
      o[dt][3] *= alpha[1];
    }
#pragma unroll
    for (int nt = 0; nt < kFwdBN / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pe = __expf(s[nt][e] - m_use[e >> 1]);
        l_i[e >> 1] += pe;
        const int i = row0 + g + 8 * (e >> 1), j = n0 + nt * 8 + 2 * t + (e & 1);
        s[nt][e] = s[nt][e] == -INFINITY ? 0.0f : pe * drop_factor(p, seed, offset, b, h, i, j);
      }
    }
    // O += P V: P's accumulators of n-tiles 2kk, 2kk+1 form the A fragment of keys 16kk..16kk+15.
#pragma unroll
    for (int kk = 0; kk < kFwdBN / 16; ++kk) {
      uint32_t a[4];
      acc_to_a<T>(a, s, kk);
#pragma unroll
      for (int dt = 0; dt < DP / 8; ++dt) {
        uint32_t b0, b1;
        load_b_smem(b0, b1, Vs, pitch, kk * 16, dt * 8, g, t);
        Traits<T>::mma(o[dt], a, b0, b1);
      }
    }
    __syncthreads();  // every warp is done with this buffer before it is refilled
  }

  finish_forward_rows<T, DP>(p, bh, row0, g, t, m_i, l_i, &o[0][0]);
}

#include "attention_wgmma.cuh"  // fwd_wgmma_kernel: the generic sm_90a forward (opt-in, =1)
#include "attention_dense_fwd.cuh"  // fwd_dense_kernel: fp16 / bf16 without dropout, masks allowed
#include "attention_dense_dq.cuh"   // dq_dense_kernel: the same calls' dQ
#include "attention_dense_dkdv.cuh" // dkdv_dense_kernel: their dK / dV
#include "attention_wgmma_dense.cuh" // fwd_wgmma_dense_kernel: those without an attn_mask on a Hopper
#include "attention_wgmma_dkdv.cuh"  // dkdv_wgmma_dense_kernel: their dK / dV
#include "attention_wgmma_dq.cuh"    // dq_wgmma_dense_kernel: their dQ

// ---------------------------------------------------------------------------------------------
// Backward: dK, dV

// A backward kernel's score of (query i, key j) from its raw dot product.  kDense (no attn_mask,
// no key_padding_mask, no dropout: attention_bwd_cuda's choice): scaled, -inf past Lk or past the
// causal diagonal, tested only outside `plain` tiles; the compiler then has no mask or dropout
// code in the loop (the forward's measured cost of that code: benchmarks/NOTES.md).  Rows i >= Lq
// need no test: their lse is -inf, so p = 0.
template <bool kDense>
__device__ __forceinline__ float bwd_score(const Params& p, bool plain, int b, int h, int i, int j, float dot) {
  if constexpr (kDense) {
    const float s = dot * p.scale;
    return plain || (j < p.Lk && !(p.causal && j > i)) ? s : -INFINITY;
  } else {
    return plain ? dot * p.scale : masked_score(p, b, h, i, j, dot);
  }
}

// The dropout factor of a kept probability pe (0 where pe is 0); 1 when kDense.
template <bool kDense>
__device__ __forceinline__ float bwd_drop(const Params& p, float pe, uint64_t seed, uint64_t offset, int b, int h,
                                          int i, int j) {
  if constexpr (kDense) {
    return 1.0f;
  } else {
    return pe == 0.0f ? 0.0f : drop_factor(p, seed, offset, b, h, i, j);
  }
}

template <typename T, int DP, bool kDense>
__global__ void __launch_bounds__(kThreads) dkdv_kernel(const Params p) {
  extern __shared__ __align__(16) uint16_t smem[];
  constexpr int pitch = DP + kPad;
  uint16_t* Ks = smem;
  uint16_t* Vs = Ks + kKvBN * pitch;
  // Two buffers of (Q tile, dO tile) and of (lse, delta): the next query tile is copied (cp.async
  // when rows are aligned) while this one is computed.
  uint16_t* qo_buf = Vs + kKvBN * pitch;                                  // [2][Q, dO][kKvBM][pitch]
  float* stat_buf = reinterpret_cast<float*>(qo_buf + 4 * kKvBM * pitch);  // [2][lse, delta][kKvBM]

  const int nnb = (p.Lk + kKvBN - 1) / kKvBN;
  const int nb = blockIdx.x % nnb;
  const int bhk = blockIdx.x / nnb;
  const int b = bhk / p.Hkv, hk = bhk % p.Hkv, group = p.H / p.Hkv;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int n0 = nb * kKvBN;
  const int key0 = warp * 16;  // this warp's first key within the tile

  const auto [seed, offset] = dropout_key(p);
  load_tile<DP>(Ks, p.k + b * p.k_sb + hk * p.k_sh + n0 * p.k_sm, p.k_sm, kKvBN, p.Lk - n0, p.D, p.vec16);
  load_tile<DP>(Vs, p.v + b * p.v_sb + hk * p.v_sh + n0 * p.v_sm, p.v_sm, kKvBN, p.Lk - n0, p.D, p.vec16);

  float dk[DP / 8][4], dv[DP / 8][4];
#pragma unroll
  for (int dt = 0; dt < DP / 8; ++dt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[dt][e] = dv[dt][e] = 0.0f;
  }

  const int m_start = p.causal ? (n0 / kKvBM) * kKvBM : 0;  // rows i < n0 see none of these keys
  // Iterations run over (query head of the group, query tile), flattened so the copy of the next
  // tile can cross from one head to the next.
  const int nm = m_start < p.Lq ? (p.Lq - m_start + kKvBM - 1) / kKvBM : 0;
  const int ntiles = group * nm;
  auto issue = [&](int it, int buf) {  // copy tile `it` into buffer `buf`
    const int h = hk * group + it / nm, m0 = m_start + (it % nm) * kKvBM;
    const int64_t bh = static_cast<int64_t>(b) * p.H + h;
    const uint16_t* qsrc = p.q + b * p.q_sb + h * p.q_sh + m0 * p.q_sm;
    const uint16_t* dsrc = p.dout + b * p.do_sb + h * p.do_sh + m0 * p.do_sm;
    uint16_t* Qd = qo_buf + buf * 2 * kKvBM * pitch;
    if (p.vec16) {
      load_tile_async<DP>(Qd, qsrc, p.q_sm, kKvBM, p.Lq - m0, p.D);
      load_tile_async<DP>(Qd + kKvBM * pitch, dsrc, p.do_sm, kKvBM, p.Lq - m0, p.D);
      cp_async_commit();
    } else {
      load_tile<DP>(Qd, qsrc, p.q_sm, kKvBM, p.Lq - m0, p.D, false);
      load_tile<DP>(Qd + kKvBM * pitch, dsrc, p.do_sm, kKvBM, p.Lq - m0, p.D, false);
    }
    float* st_ = stat_buf + buf * 2 * kKvBM;
    for (int r = threadIdx.x; r < kKvBM; r += kThreads) {
      const bool in = m0 + r < p.Lq;
      st_[r] = in ? p.lse[bh * p.Lq + m0 + r] : -INFINITY;
      st_[kKvBM + r] = in ? p.delta[bh * p.Lq + m0 + r] : 0.0f;
    }
  };
  if (ntiles > 0) issue(0, 0);
  for (int it = 0; it < ntiles; ++it) {
    const int h = hk * group + it / nm, m0 = m_start + (it % nm) * kKvBM;
    const int buf = it & 1;
    if (it + 1 < ntiles) {  // buffer buf^1 was released by the barrier ending iteration it-1
      issue(it + 1, buf ^ 1);
      if (p.vec16) cp_async_wait<1>();  // this thread's copies of tile `it` have landed
    } else if (p.vec16) {
      cp_async_wait<0>();
    }
    __syncthreads();  // tile `it` (and at it = 0 the K/V tiles) is visible to every warp
    {
      const uint16_t* Qs = qo_buf + buf * 2 * kKvBM * pitch;
      const uint16_t* Os = Qs + kKvBM * pitch;  // dO tile
      const float* lse_s = stat_buf + buf * 2 * kKvBM;
      const float* delta_s = lse_s + kKvBM;

      float st[kKvBM / 8][4], dpt[kKvBM / 8][4];  // S^T, dP^T: rows = keys, cols = queries
#pragma unroll
      for (int nt = 0; nt < kKvBM / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) st[nt][e] = dpt[nt][e] = 0.0f;
      }
#pragma unroll
      for (int kc = 0; kc < DP / 16; ++kc) {
        uint32_t ka[4], va[4];
        load_a_smem(ka, Ks, pitch, key0, kc * 16, g, t);
        load_a_smem(va, Vs, pitch, key0, kc * 16, g, t);
#pragma unroll
        for (int nt = 0; nt < kKvBM / 8; ++nt) {
          uint32_t b0, b1;
          load_bt_smem(b0, b1, Qs, pitch, nt * 8, kc * 16, g, t);
          Traits<T>::mma(st[nt], ka, b0, b1);
          load_bt_smem(b0, b1, Os, pitch, nt * 8, kc * 16, g, t);
          Traits<T>::mma(dpt[nt], va, b0, b1);
        }
      }
      // st <- P^T . Z (for dV), dpt <- dS^T (for dK).  Rows i >= Lq have lse -inf: p = 0.
      const bool plain = plain_tile(p, m0, n0, kKvBN);
#pragma unroll
      for (int nt = 0; nt < kKvBM / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = n0 + key0 + g + 8 * (e >> 1);
          const int ii = nt * 8 + 2 * t + (e & 1), i = m0 + ii;
          const float s = bwd_score<kDense>(p, plain, b, h, i, j, st[nt][e]);
          const float l = lse_s[ii];
          const float pe = (s == -INFINITY || l == -INFINITY) ? 0.0f : __expf(s - l);
          const float z = bwd_drop<kDense>(p, pe, seed, offset, b, h, i, j);
          dpt[nt][e] = pe * (dpt[nt][e] * z - delta_s[ii]);
          st[nt][e] = pe * z;
        }
      }
      // dV += (P Z)^T dO and dK += dS^T Q: A from the accumulators, B from the Q / dO tiles.
#pragma unroll
      for (int kk = 0; kk < kKvBM / 16; ++kk) {
        uint32_t pa[4], sa[4];
        acc_to_a<T>(pa, st, kk);
        acc_to_a<T>(sa, dpt, kk);
#pragma unroll
        for (int dt = 0; dt < DP / 8; ++dt) {
          uint32_t b0, b1;
          load_b_smem(b0, b1, Os, pitch, kk * 16, dt * 8, g, t);
          Traits<T>::mma(dv[dt], pa, b0, b1);
          load_b_smem(b0, b1, Qs, pitch, kk * 16, dt * 8, g, t);
          Traits<T>::mma(dk[dt], sa, b0, b1);
        }
      }
    }
    __syncthreads();  // every warp is done with buffer `buf` before it is refilled
  }
  // dk, dv: (B, Hkv, Lk, D) through their strides
  uint16_t* dkh = p.out + b * p.o_sb + hk * p.o_sh;
  uint16_t* dvh = p.out2 + b * p.o2_sb + hk * p.o2_sh;
#pragma unroll
  for (int dt = 0; dt < DP / 8; ++dt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = n0 + key0 + g + 8 * (e >> 1), d = dt * 8 + 2 * t + (e & 1);
      if (j < p.Lk && d < p.D) {
        dkh[j * p.o_sm + d] = Traits<T>::bits(dk[dt][e] * p.scale);
        dvh[j * p.o2_sm + d] = Traits<T>::bits(dv[dt][e]);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward: dQ

template <typename T, int DP, bool kDense>
__global__ void __launch_bounds__(kThreads) dq_kernel(const Params p) {
  extern __shared__ __align__(16) uint16_t smem[];
  constexpr int pitch = DP + kPad;
  constexpr int kBuf = 2 * kDqBN * pitch;  // K then V of one of the two buffers (as fwd_kernel)

  const int nmb = (p.Lq + kDqBM - 1) / kDqBM;
  const int mb = blockIdx.x % nmb;
  const int bh = blockIdx.x / nmb;
  const int b = bh / p.H, h = bh % p.H, hk = h / (p.H / p.Hkv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int m0 = mb * kDqBM;
  const int row0 = m0 + warp * 16;

  const auto [seed, offset] = dropout_key(p);
  const uint16_t* qh = p.q + b * p.q_sb + h * p.q_sh;
  const uint16_t* doh = p.dout + b * p.do_sb + h * p.do_sh;
  const uint16_t* kh = p.k + b * p.k_sb + hk * p.k_sh;
  const uint16_t* vh = p.v + b * p.v_sb + hk * p.v_sh;

  uint32_t qf[DP / 16][4], dof[DP / 16][4];
#pragma unroll
  for (int kc = 0; kc < DP / 16; ++kc) {
    load_a_global(qf[kc], qh, p.q_sm, row0, kc * 16, p.Lq, p.D, g, t);
    load_a_global(dof[kc], doh, p.do_sm, row0, kc * 16, p.Lq, p.D, g, t);
  }
  float lse_r[2], delta_r[2];
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    const int i = row0 + g + 8 * rh;
    lse_r[rh] = i < p.Lq ? p.lse[static_cast<int64_t>(bh) * p.Lq + i] : -INFINITY;
    delta_r[rh] = i < p.Lq ? p.delta[static_cast<int64_t>(bh) * p.Lq + i] : 0.0f;
  }
  float dq[DP / 8][4];
#pragma unroll
  for (int dt = 0; dt < DP / 8; ++dt) dq[dt][0] = dq[dt][1] = dq[dt][2] = dq[dt][3] = 0.0f;

  const int n_end = p.causal ? min(p.Lk, m0 + kDqBM) : p.Lk;
  const int ntiles = (n_end + kDqBN - 1) / kDqBN;
  if (p.vec16) {  // prologue: tile 0 into buffer 0
    load_tile_async<DP>(smem, kh, p.k_sm, kDqBN, p.Lk, p.D);
    load_tile_async<DP>(smem + kDqBN * pitch, vh, p.v_sm, kDqBN, p.Lk, p.D);
    cp_async_commit();
  }
  for (int it = 0; it < ntiles; ++it) {
    const int n0 = it * kDqBN;
    uint16_t* Ks = smem + (it & 1) * kBuf;
    uint16_t* Vs = Ks + kDqBN * pitch;
    if (p.vec16) {
      if (it + 1 < ntiles) {  // buffer (it+1)&1 was released by the barrier ending iteration it-1
        const int n1 = n0 + kDqBN;
        uint16_t* Kn = smem + ((it + 1) & 1) * kBuf;
        load_tile_async<DP>(Kn, kh + n1 * p.k_sm, p.k_sm, kDqBN, p.Lk - n1, p.D);
        load_tile_async<DP>(Kn + kDqBN * pitch, vh + n1 * p.v_sm, p.v_sm, kDqBN, p.Lk - n1, p.D);
        cp_async_commit();
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
    } else {
      load_tile<DP>(Ks, kh + n0 * p.k_sm, p.k_sm, kDqBN, p.Lk - n0, p.D, false);
      load_tile<DP>(Vs, vh + n0 * p.v_sm, p.v_sm, kDqBN, p.Lk - n0, p.D, false);
    }
    __syncthreads();  // tile `it` is visible to every warp
    float s[kDqBN / 8][4], dp[kDqBN / 8][4];
#pragma unroll
    for (int nt = 0; nt < kDqBN / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.0f;
    }
#pragma unroll
    for (int kc = 0; kc < DP / 16; ++kc) {
#pragma unroll
      for (int nt = 0; nt < kDqBN / 8; ++nt) {
        uint32_t b0, b1;
        load_bt_smem(b0, b1, Ks, pitch, nt * 8, kc * 16, g, t);
        Traits<T>::mma(s[nt], qf[kc], b0, b1);
        load_bt_smem(b0, b1, Vs, pitch, nt * 8, kc * 16, g, t);
        Traits<T>::mma(dp[nt], dof[kc], b0, b1);
      }
    }
    const bool plain = plain_tile(p, m0, n0, kDqBN);  // rows >= Lq have lse -inf: p = 0
#pragma unroll
    for (int nt = 0; nt < kDqBN / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = row0 + g + 8 * (e >> 1), j = n0 + nt * 8 + 2 * t + (e & 1);
        const float sc = bwd_score<kDense>(p, plain, b, h, i, j, s[nt][e]);
        const float l = lse_r[e >> 1];
        const float pe = (sc == -INFINITY || l == -INFINITY) ? 0.0f : __expf(sc - l);
        const float z = bwd_drop<kDense>(p, pe, seed, offset, b, h, i, j);
        s[nt][e] = pe * (dp[nt][e] * z - delta_r[e >> 1]);  // dS
      }
    }
#pragma unroll
    for (int kk = 0; kk < kDqBN / 16; ++kk) {
      uint32_t a[4];
      acc_to_a<T>(a, s, kk);
#pragma unroll
      for (int dt = 0; dt < DP / 8; ++dt) {
        uint32_t b0, b1;
        load_b_smem(b0, b1, Ks, pitch, kk * 16, dt * 8, g, t);
        Traits<T>::mma(dq[dt], a, b0, b1);
      }
    }
    __syncthreads();  // every warp is done with this buffer before it is refilled
  }
  uint16_t* dqh = p.out + b * p.o_sb + h * p.o_sh;
#pragma unroll
  for (int dt = 0; dt < DP / 8; ++dt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = row0 + g + 8 * (e >> 1), d = dt * 8 + 2 * t + (e & 1);
      if (i < p.Lq && d < p.D) dqh[i * p.o_sm + d] = Traits<T>::bits(dq[dt][e] * p.scale);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host side

Tensor unit_last(const Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

// Whether every (b, h, row) start of a (B, H, L, D) tensor is 16-byte aligned.
bool rows_vec16(const Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0 && t.stride(0) % 8 == 0 &&
         t.stride(1) % 8 == 0 && t.stride(2) % 8 == 0;
}

Params make_params(const Tensor& q, const Tensor& k, const Tensor& v,
                   const std::optional<Tensor>& attn_mask, const std::optional<Tensor>& kpm,
                   bool causal, double scale, double dropout_p, const std::optional<Tensor>& rng) {
  Params p = fill_attention_params<Params>(q, k, v, attn_mask, kpm, causal, scale, dropout_p, rng);
  p.vec16 = p.D % 8 == 0 && rows_vec16(q) && rows_vec16(k) && rows_vec16(v);
  return p;
}

#ifndef TF_CUDA_EMULATE
// (The dtype was checked by check_attention_fwd_args: fp16 / bf16 run here, fp32 runs the kernels
// of attention_fp32_cuda.cu.)
void check_cuda_inputs(const Tensor& q) {
  const int dev = q.get_device();
  int major = 0, minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  TORCH_CHECK(major >= 8, "attention (cuda): needs compute capability 8.0+ (mma.sync bf16/fp16 "
              "with fp32 accumulation; the extension is built for sm_80 / sm_90a); device ", dev,
              " is ", major, ".", minor);
  const int64_t L = std::max(q.size(2), int64_t{1});
  TORCH_CHECK(q.numel() / L < (int64_t{1} << 31) && q.size(2) < (int64_t{1} << 30),
              "attention (cuda): sizes too large for 32-bit grid/row indices");
}

template <typename Kernel>
void launch_threads(Kernel kernel, int64_t blocks, int threads, size_t smem, const Params& p) {
  TORCH_CHECK(blocks < (int64_t{1} << 31), "attention (cuda): too many CTAs (", blocks, ")");
  check_block_smem(smem, p.D, "attention (cuda)");
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem)));
  kernel<<<static_cast<unsigned>(blocks), threads, smem, c10::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename Kernel>
void launch(Kernel kernel, int64_t blocks, size_t smem, const Params& p) {
  launch_threads(kernel, blocks, kThreads, smem, p);
}
#endif  // TF_CUDA_EMULATE (the emulation provides check_cuda_inputs and launch)

template <typename T, int DP>
void run_fwd(const Params& p) {
  const int64_t blocks = int64_t{p.B} * p.H * ((p.Lq + kFwdBM - 1) / kFwdBM);
  launch(fwd_kernel<T, DP>, blocks, size_t{4} * kFwdBN * (DP + kPad) * sizeof(uint16_t), p);
}

template <typename T, int DP>
void run_fwd_wgmma(const Params& p) {
  const int64_t blocks = int64_t{p.B} * p.H * ((p.Lq + kWgBM - 1) / kWgBM);
  launch(fwd_wgmma_kernel<T, DP>, blocks, size_t{kWgBM + 4 * kWgBN} * DP * sizeof(uint16_t), p);
}

template <typename T, int DP>
void run_fwd_wgmma_dense(const Params& p) {
  const int64_t blocks = int64_t{p.B} * p.H * ((p.Lq + kWdBM - 1) / kWdBM);
  constexpr size_t smem = wgmma_dense_smem_bytes<DP>();
  if (p.kpm != nullptr) {
    p.causal ? launch_threads(fwd_wgmma_dense_kernel<T, DP, true, true>, blocks, kWdThreads, smem, p)
             : launch_threads(fwd_wgmma_dense_kernel<T, DP, false, true>, blocks, kWdThreads, smem, p);
  } else {
    p.causal ? launch_threads(fwd_wgmma_dense_kernel<T, DP, true, false>, blocks, kWdThreads, smem, p)
             : launch_threads(fwd_wgmma_dense_kernel<T, DP, false, false>, blocks, kWdThreads, smem, p);
  }
}

// Calls f(kCausal, kAttnMask) (std::bool_constant values) for the dense mma.sync kernels'
// instantiation that fits a call: causal or not, with an attn_mask or not.
template <typename F>
void with_dense_instance(const Params& p, F&& f) {
  const bool am = p.am_type != kMaskNone;
  if (p.causal) {
    am ? f(std::true_type{}, std::true_type{}) : f(std::true_type{}, std::false_type{});
  } else {
    am ? f(std::false_type{}, std::true_type{}) : f(std::false_type{}, std::false_type{});
  }
}

template <typename T, int DP>
void run_fwd_dense(const Params& p) {
  const int64_t blocks = int64_t{p.B} * p.H * ((p.Lq + kDenseBM - 1) / kDenseBM);
  const size_t smem = size_t{4} * kDenseBN * (DP + kPad) * sizeof(uint16_t) + 2 * kDenseBN / 8;  // + pad bits
  with_dense_instance(p, [&](auto causal, auto am) {
    launch(fwd_dense_kernel<T, DP, decltype(causal)::value, decltype(am)::value>, blocks, smem, p);
  });
}

// Whether the dense kernels may write p.out as 4-byte element pairs (always, for the outputs
// attention_fwd_cuda / attention_bwd_cuda allocate).
bool out_pairs_aligned(const Params& p) {
  const auto even = [](int64_t x) { return x % 2 == 0; };
  return reinterpret_cast<uintptr_t>(p.out) % 4 == 0 && even(p.o_sb) && even(p.o_sh) && even(p.o_sm);
}

// Whether a forward may take fwd_dense_kernel: no dropout (masks are fine), every q/k/v row
// 16-byte aligned with D % 8 == 0 (vec16), D <= 128, at least one key, and an output written in
// pairs.
bool dense_forward_fits(const Params& p) {
  return p.rng == nullptr && p.vec16 && p.D <= 128 && p.Lk >= 1 && out_pairs_aligned(p);
}

// Whether a call has a mask the wgmma dense kernels (and the generic kernels' kDense forms) lack.
bool masked(const Params& p) { return p.am_type != kMaskNone || p.kpm != nullptr; }

// delta[b, h, i] = sum_d dO[b, h, i, d] * O[b, h, i, d] in fp32, the backward's row term: one warp
// per row, dO through p.dout / do strides, O through p.out / o strides, into p.delta_out
// ((B, H, Lq) contiguous).  One pass over dO and O instead of ATen's convert-convert-multiply-sum
// (0.35 ms of a 2.8 ms fwd+bwd at B16 H16 L1024 D128 on the H100, run 3's profile).
constexpr int kDeltaThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kDeltaThreads) delta_kernel(const Params p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kDeltaThreads / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= static_cast<int64_t>(p.B) * p.H * p.Lq) return;  // the whole warp
  const int64_t i = row % p.Lq, bh = row / p.Lq;
  const int64_t b = bh / p.H, h = bh % p.H;
  const uint16_t* a = p.dout + b * p.do_sb + h * p.do_sh + i * p.do_sm;
  const uint16_t* o = p.out + b * p.o_sb + h * p.o_sh + i * p.o_sm;
  float s = 0.0f;
  for (int d = lane; d < p.D; d += 32) s += Traits<T>::to_float(a[d]) * Traits<T>::to_float(o[d]);
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  if (lane == 0) p.delta_out[row] = s;
}

#ifndef TF_CUDA_EMULATE
// TRANSFORMER_FAST_CUDA_DENSE=0 sends the calls the dense kernels would take (fwd_dense_kernel,
// the kDense backward kernels) to the generic ones (for A/B measurements and tests); read per
// call, like TRANSFORMER_FAST_CUDA_WGMMA.
bool dense_kernels_enabled() {
  const char* env = std::getenv("TRANSFORMER_FAST_CUDA_DENSE");
  return env == nullptr || std::strcmp(env, "0") != 0;
}
#else
bool emulate_dense_kernels = false;  // the emulation harness chooses (its older cases test the generic kernels)
bool dense_kernels_enabled() { return emulate_dense_kernels; }
#endif

#ifndef TF_CUDA_EMULATE
// TRANSFORMER_FAST_CUDA_ATOMIC_DQ=1: the wgmma backward at head dims 65-128 forms dQ in its dK / dV
// kernel by fp32 atomics (dkdv_wgmma_dense_kernel<..., kDq>) instead of dq_wgmma_dense_kernel.
// Off by default until a GPU run has checked and timed it (written without a GPU, 2026-11-28);
// never under torch.use_deterministic_algorithms (the atomics' order varies run to run).
bool atomic_dq_enabled() {
  const char* env = std::getenv("TRANSFORMER_FAST_CUDA_ATOMIC_DQ");
  return env != nullptr && std::strcmp(env, "1") == 0 && !at::globalContext().deterministicAlgorithms();
}
#else
bool emulate_atomic_dq = false;  // the emulation harness chooses
bool atomic_dq_enabled() { return emulate_atomic_dq; }
#endif

// Which sm_90a warpgroup-MMA kernels run.  kDense: the two-warpgroup dense kernels for the calls
// the dense kernels take (forward: without an attn_mask; backward: without any mask); every
// other call runs what it runs without wgmma.  kAll: fwd_wgmma_kernel as well, for
// the forwards the dense kernels do not take (slower than fwd_kernel on an H100: 60 against 68
// TFLOP/s, benchmarks/NOTES.md; kept for tests and measurements).
enum class Wgmma { kOff, kDense, kAll };

#ifndef TF_CUDA_EMULATE
// kDense by default, kAll with TRANSFORMER_FAST_CUDA_WGMMA=1, kOff with =0; kOff as well below
// or above compute capability 9.x, and where this build holds no sm_90a code (probed once per
// device: one tiny kernel and one host sync, the first time only).  The dense wgmma kernels
// became the default after their first H100 runs (2026-11-26 and -27: the oracle on fresh draws,
// head dims 16-128, ragged lengths, GQA, causal; forward 466 against mma.sync's 264 TFLOP/s at
// B4 H16 L4096 D128).  Every call reads the variable, so a test or benchmark may switch it.
Wgmma wgmma_mode(const Tensor& q) {
  const char* env = std::getenv("TRANSFORMER_FAST_CUDA_WGMMA");
  if (env != nullptr && std::strcmp(env, "0") == 0) return Wgmma::kOff;
  const Wgmma wanted = env != nullptr && std::strcmp(env, "1") == 0 ? Wgmma::kAll : Wgmma::kDense;
  const int dev = q.get_device();
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  if (major != 9) return Wgmma::kOff;
  static std::mutex mutex;
  static std::map<int, bool> built;
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = built.find(dev);
  if (it == built.end()) {
    // The probe syncs the host: not inside a CUDA graph capture (the mma.sync kernels run there
    // until a call outside one has probed this device).
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(), &capture));
    if (capture != cudaStreamCaptureStatusNone) return Wgmma::kOff;
    Tensor flag = at::zeros({1}, q.options().dtype(at::kInt));
    sm90a_probe_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>(flag.mutable_data_ptr<int>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    it = built.emplace(dev, flag.item<int>() == 1).first;
  }
  return it->second ? wanted : Wgmma::kOff;
}
#else
bool emulate_wgmma_forward = false;  // the emulation harness chooses the kernels (on: kAll)
Wgmma wgmma_mode(const Tensor&) { return emulate_wgmma_forward ? Wgmma::kAll : Wgmma::kOff; }
#endif

// wgmma: the dense dK / dV and dQ on dkdv_wgmma_dense_kernel / dq_wgmma_dense_kernel (the wgmma
// forward's switch, sm_90a; not with an attn_mask).  kDense with a mask: the dense kernels, or where
// they do not fit the generic ones (whose kDense forms drop the masks).
// The dense dK / dV kernels (mma.sync and wgmma) store rows in pairs: 16-byte aligned input
// rows, dK and dV rows whose element pairs are 4-byte aligned.
bool dense_dkdv_fits(const Params& pkv) {
  const auto even = [](int64_t x) { return x % 2 == 0; };
  return pkv.vec16 && out_pairs_aligned(pkv) && reinterpret_cast<uintptr_t>(pkv.out2) % 4 == 0 &&
         even(pkv.o2_sb) && even(pkv.o2_sh) && even(pkv.o2_sm);
}

template <typename T, int DP, bool kDense = false>
void run_bwd(const Params& pkv, const Params& pq, bool wgmma = false) {
  // pkv.dq_acc set: the wgmma dK / dV kernel adds up dQ there, and no dQ kernel runs (the caller
  // set it only where that kernel is taken: wgmma, DP 128, the dkdv conditions below).
  if constexpr (kDense && DP == 128) {
    if (pkv.dq_acc != nullptr) {
      const int64_t blocks = int64_t{pkv.B} * pkv.Hkv * ((pkv.Lk + kWkBN - 1) / kWkBN);
      constexpr size_t smem = wgmma_dkdv_smem_bytes<DP, true>();
      pkv.causal ? launch_threads(dkdv_wgmma_dense_kernel<T, DP, true, true>, blocks, kWdThreads, smem, pkv)
                 : launch_threads(dkdv_wgmma_dense_kernel<T, DP, false, true>, blocks, kWdThreads, smem, pkv);
      return;
    }
  }
  const int64_t kv_blocks = int64_t{pkv.B} * pkv.Hkv * ((pkv.Lk + kKvBN - 1) / kKvBN);
  const size_t kv_smem = (size_t{2} * kKvBN + size_t{4} * kKvBM) * (DP + kPad) * sizeof(uint16_t) +
                         size_t{4} * kKvBM * sizeof(float);
  if constexpr (kDense) {
    const bool dv_pairs = dense_dkdv_fits(pkv);
    if (wgmma && dv_pairs) {  // attention_wgmma_dkdv.cuh
      const int64_t blocks = int64_t{pkv.B} * pkv.Hkv * ((pkv.Lk + kWkBN - 1) / kWkBN);
      constexpr size_t smem = wgmma_dkdv_smem_bytes<DP>();
      pkv.causal ? launch_threads(dkdv_wgmma_dense_kernel<T, DP, true>, blocks, kWdThreads, smem, pkv)
                 : launch_threads(dkdv_wgmma_dense_kernel<T, DP, false>, blocks, kWdThreads, smem, pkv);
    } else if (dv_pairs) {  // dkdv_dense_kernel (attention_dense_dkdv.cuh)
      with_dense_instance(pkv, [&](auto causal, auto am) {
        launch(dkdv_dense_kernel<T, DP, decltype(causal)::value, decltype(am)::value>, kv_blocks, kv_smem, pkv);
      });
    } else if (!masked(pkv)) {
      launch(dkdv_kernel<T, DP, true>, kv_blocks, kv_smem, pkv);
    } else {
      launch(dkdv_kernel<T, DP, false>, kv_blocks, kv_smem, pkv);
    }
  } else {
    launch(dkdv_kernel<T, DP, false>, kv_blocks, kv_smem, pkv);
  }
  if constexpr (kDense) {
    if (wgmma && pq.vec16 && pq.Lk >= 1 && out_pairs_aligned(pq)) {  // attention_wgmma_dq.cuh
      const int64_t blocks = int64_t{pq.B} * pq.H * ((pq.Lq + kWqBM - 1) / kWqBM);
      constexpr size_t smem = wgmma_dq_smem_bytes<DP>();
      pq.causal ? launch_threads(dq_wgmma_dense_kernel<T, DP, true>, blocks, kWdThreads, smem, pq)
                : launch_threads(dq_wgmma_dense_kernel<T, DP, false>, blocks, kWdThreads, smem, pq);
      return;
    }
    if (pq.vec16 && pq.Lk >= 1 && out_pairs_aligned(pq)) {  // dq_dense_kernel (attention_dense_dq.cuh)
      const int64_t blocks = int64_t{pq.B} * pq.H * ((pq.Lq + kDenseBM - 1) / kDenseBM);
      const size_t smem = size_t{4} * kDenseDqBN * (DP + kPad) * sizeof(uint16_t) + 2 * kDenseDqBN / 8;
      with_dense_instance(pq, [&](auto causal, auto am) {
        launch(dq_dense_kernel<T, DP, decltype(causal)::value, decltype(am)::value>, blocks, smem, pq);
      });
      return;
    }
  }
  const int64_t q_blocks = int64_t{pq.B} * pq.H * ((pq.Lq + kDqBM - 1) / kDqBM);
  const size_t q_smem = size_t{4} * kDqBN * (DP + kPad) * sizeof(uint16_t);
  kDense && !masked(pq) ? launch(dq_kernel<T, DP, kDense>, q_blocks, q_smem, pq)
                        : launch(dq_kernel<T, DP, false>, q_blocks, q_smem, pq);
}

// An output the kernels can write: `want` itself when its stride along D is 1 (always for out,
// and for dq / dk / dv unless q / k / v have a non-unit stride along D), else a contiguous
// scratch tensor that finish_output copies into `want`.
Tensor writable(const Tensor& want) { return want.stride(-1) == 1 ? want : at::empty(want.sizes(), want.options()); }

void finish_output(Tensor& want, const Tensor& written) {
  if (!written.is_same(want)) want.copy_(written);
}

void set_out(Params& p, const Tensor& t) {
  p.out = static_cast<uint16_t*>(t.mutable_data_ptr());
  p.o_sb = t.stride(0), p.o_sh = t.stride(1), p.o_sm = t.stride(2);
}

}  // namespace

Tensor2 attention_fwd_cuda(TF_ATTENTION_FWD_ARGS) {
  // fp16 / bf16: mma.sync.  fp32: exact fp32 (attention_fp32_cuda.cu); allow_tf32 is ignored,
  // since exact fp32 is always within the contract (a tf32 mma path is future work).
  (void)allow_tf32;
  check_attention_fwd_args(q, k, v, attn_mask, key_padding_mask, scale, dropout_p, rng, TF_ATTN_DEVICE);
  check_cuda_inputs(q);
#ifndef TF_CUDA_EMULATE
  const c10::cuda::CUDAGuard guard(q.device());
#endif
  const Tensor q_ = unit_last(q), k_ = unit_last(k), v_ = unit_last(v);
  // out in q's memory order (the fake in transformer_fast/ops/attention.py says the same).
  Tensor out = empty_in_layout_of(q, {q.size(0), q.size(1), q.size(2), q.size(3)}, q.options());
  Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  if (out.numel() == 0) return {out, lse};
  if (q.scalar_type() == at::kFloat) {
    attention_fwd_fp32_cuda(q_, k_, v_, attn_mask, key_padding_mask, is_causal, scale, dropout_p,
                            rng, out, lse);
    return {out, lse};
  }
  Params p = make_params(q_, k_, v_, attn_mask, key_padding_mask, is_causal, scale, dropout_p, rng);
  set_out(p, out);
  p.lse_out = lse.mutable_data_ptr<float>();
  const bool half = q.scalar_type() == at::kHalf;
  const bool dense = dense_forward_fits(p) && dense_kernels_enabled();
  const Wgmma wgmma = head_dim_bucket(p.D) <= 128 ? wgmma_mode(q) : Wgmma::kOff;
  if (wgmma != Wgmma::kOff && dense && p.am_type == kMaskNone) {  // no attn_mask code there (key padding: yes)
    if (head_dim_bucket(p.D) == 64) {
      half ? run_fwd_wgmma_dense<__half, 64>(p) : run_fwd_wgmma_dense<__nv_bfloat16, 64>(p);
    } else {
      half ? run_fwd_wgmma_dense<__half, 128>(p) : run_fwd_wgmma_dense<__nv_bfloat16, 128>(p);
    }
    return {out, lse};
  }
  if (wgmma == Wgmma::kAll && !dense) {
    if (head_dim_bucket(p.D) == 64) {
      half ? run_fwd_wgmma<__half, 64>(p) : run_fwd_wgmma<__nv_bfloat16, 64>(p);
    } else {
      half ? run_fwd_wgmma<__half, 128>(p) : run_fwd_wgmma<__nv_bfloat16, 128>(p);
    }
    return {out, lse};
  }
  if (dense) {
    if (head_dim_bucket(p.D) == 64) {
      half ? run_fwd_dense<__half, 64>(p) : run_fwd_dense<__nv_bfloat16, 64>(p);
    } else {
      half ? run_fwd_dense<__half, 128>(p) : run_fwd_dense<__nv_bfloat16, 128>(p);
    }
    return {out, lse};
  }
  switch (head_dim_bucket(p.D)) {
    case 64: half ? run_fwd<__half, 64>(p) : run_fwd<__nv_bfloat16, 64>(p); break;
    case 128: half ? run_fwd<__half, 128>(p) : run_fwd<__nv_bfloat16, 128>(p); break;
    default: half ? run_fwd<__half, 256>(p) : run_fwd<__nv_bfloat16, 256>(p); break;
  }
  return {out, lse};
}

Tensor3 attention_bwd_cuda(TF_ATTENTION_BWD_ARGS) {
  (void)allow_tf32;  // as in attention_fwd_cuda
  check_attention_bwd_args(dout, q, k, v, out, lse, attn_mask, key_padding_mask, scale, dropout_p,
                           rng, TF_ATTN_DEVICE);
  check_cuda_inputs(q);
#ifndef TF_CUDA_EMULATE
  const c10::cuda::CUDAGuard guard(q.device());
#endif
  const Tensor q_ = unit_last(q), k_ = unit_last(k), v_ = unit_last(v), do_ = unit_last(dout);
  // Gradients laid out like their inputs (empty_like: the fake's rule).
  Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  if (q.numel() == 0) return {dq, dk.zero_(), dv.zero_()};
  Tensor dq_ = writable(dq), dk_ = writable(dk), dv_ = writable(dv);
  const Tensor lse_c = lse.contiguous();
  if (q.scalar_type() == at::kFloat) {
    // (delta comes from the kernels' own first pass: attention_fp32_cuda.cu)
    attention_bwd_fp32_cuda(do_, q_, k_, v_, lse_c, attn_mask, key_padding_mask, is_causal,
                            scale, dropout_p, rng, dq_, dk_, dv_);
  } else {
    // delta_i = rowsum(dO_i * O_i) in fp32 (ATen, on the current stream).  O rounded to 16 bits
    // errs in delta by about as much as the low-precision reference's whole gradient when rows have
    // few keys (10-50% of fresh draws failed the oracle at Lk <= 8 on the cpu and triton backends,
    // which share this decomposition); there O is recomputed unrounded by the exact-fp32 forward,
    // cheap at these lengths (same masks, same dropout stream: the keep mask depends on indices only).
    Tensor delta;
    if (k.size(2) <= kExactDeltaMaxLk) {
      const Tensor q32 = q_.to(at::kFloat), k32 = k_.to(at::kFloat), v32 = v_.to(at::kFloat);
      Tensor out32 = at::empty(q32.sizes(), q32.options());
      Tensor lse32 = at::empty_like(lse_c);
      attention_fwd_fp32_cuda(q32, k32, v32, attn_mask, key_padding_mask, is_causal, scale, dropout_p,
                              rng, out32, lse32);
      delta = dout.to(at::kDouble).mul(out32.to(at::kDouble)).sum(-1).to(at::kFloat).contiguous();
    }
    Params p = make_params(q_, k_, v_, attn_mask, key_padding_mask, is_causal, scale, dropout_p, rng);
    p.dout = static_cast<const uint16_t*>(do_.const_data_ptr());
    p.do_sb = do_.stride(0), p.do_sh = do_.stride(1), p.do_sm = do_.stride(2);
    if (!delta.defined()) {  // delta_kernel: rowsum(dO * O) in fp32
      delta = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
      const Tensor o_ = unit_last(out);
      Params pd = p;
      pd.out = const_cast<uint16_t*>(static_cast<const uint16_t*>(o_.const_data_ptr()));  // read only
      pd.o_sb = o_.stride(0), pd.o_sh = o_.stride(1), pd.o_sm = o_.stride(2);
      pd.delta_out = delta.mutable_data_ptr<float>();
      const int64_t rows = int64_t{p.B} * p.H * p.Lq;
      const int64_t blocks = (rows + kDeltaThreads / 32 - 1) / (kDeltaThreads / 32);
      q.scalar_type() == at::kHalf ? launch_threads(delta_kernel<__half>, blocks, kDeltaThreads, 0, pd)
                                   : launch_threads(delta_kernel<__nv_bfloat16>, blocks, kDeltaThreads, 0, pd);
    }
    p.vec16 = p.vec16 && rows_vec16(do_);
    p.lse = lse_c.const_data_ptr<float>();
    p.delta = delta.const_data_ptr<float>();
    Params pkv = p, pq = p;
    set_out(pkv, dk_);
    pkv.out2 = static_cast<uint16_t*>(dv_.mutable_data_ptr());
    pkv.o2_sb = dv_.stride(0), pkv.o2_sh = dv_.stride(1), pkv.o2_sm = dv_.stride(2);
    set_out(pq, dq_);
    const bool half = q.scalar_type() == at::kHalf;
    // No dropout, D <= 128: the dense kernels (as the forward's fwd_dense_kernel; the same switch
    // turns both off), on wgmma too where there is no attn_mask and wgmma_mode allows it.
    const bool dense = p.rng == nullptr && p.D <= 128 && dense_kernels_enabled();
    const bool wg = dense && p.am_type == kMaskNone && wgmma_mode(q) != Wgmma::kOff;
    // dQ by atomics in the wgmma dK / dV kernel: where run_bwd takes that kernel, at head dims
    // 65-128, when switched on (atomic_dq_enabled).
    Tensor dq_acc;
    if (wg && head_dim_bucket(p.D) == 128 && atomic_dq_enabled() && dense_dkdv_fits(pkv)) {
      dq_acc = at::zeros({q.size(0), q.size(1), q.size(2), 128}, q.options().dtype(at::kFloat));
      pkv.dq_acc = dq_acc.mutable_data_ptr<float>();
    }
    if (dense && head_dim_bucket(p.D) == 64) {
      half ? run_bwd<__half, 64, true>(pkv, pq, wg) : run_bwd<__nv_bfloat16, 64, true>(pkv, pq, wg);
    } else if (dense) {
      half ? run_bwd<__half, 128, true>(pkv, pq, wg) : run_bwd<__nv_bfloat16, 128, true>(pkv, pq, wg);
    } else switch (head_dim_bucket(p.D)) {
      case 64: half ? run_bwd<__half, 64>(pkv, pq) : run_bwd<__nv_bfloat16, 64>(pkv, pq); break;
      case 128: half ? run_bwd<__half, 128>(pkv, pq) : run_bwd<__nv_bfloat16, 128>(pkv, pq); break;
      default: half ? run_bwd<__half, 256>(pkv, pq) : run_bwd<__nv_bfloat16, 256>(pkv, pq); break;
    }
    // One pass for the scale and the rounding to dq's dtype: the scale as a wrapped number (as
    // Python passes one) keeps the product fp32, which mul_out then casts into dq_.
    if (dq_acc.defined()) {
      at::mul_out(dq_, dq_acc.narrow(3, 0, p.D),
                  at::native::wrapped_scalar_tensor(c10::Scalar(static_cast<double>(p.scale))));
    }
  }
  finish_output(dq, dq_);
  finish_output(dk, dk_);
  finish_output(dv, dv_);
  return {dq, dk, dv};
}

#ifndef TF_CUDA_EMULATE
TORCH_LIBRARY_IMPL(transformer_fast_C, CUDA, m) {
  m.impl("attention_fwd", &attention_fwd_cuda);
  m.impl("attention_bwd", &attention_bwd_cuda);
}
#endif

}  // namespace transformer_fast
