// Exact-fp32 masked softmax attention on CUDA: SIMT fp32 FMA flash forward (with lse) and a
// deterministic flash backward, for the fp32 inputs of the `cuda` backend (attention_cuda.cu's
// mma.sync kernels take fp16 / bf16 only).  Written without a GPU: it has NEVER RUN ON ONE.  Its
// kernels are tested in CPU emulation (TF_CUDA_EMULATE; tests/test_attention_cpu.py) against the
// oracle; races, memory-model issues and speed are unverified until a GPU run.
//
// Numerics: exact fp32 always (no tensor cores, so no tf32 even where torch's allow_tf32 would
// permit it; exact fp32 is always within the DESIGN 6 contract, only slower).  The oracle bound is
// tightest for fp32, so the arithmetic follows kernels/attention.py's PRECISE mode:
//   * the scores' dots q.k are summed in double, the same way in every pass; the forward rounds
//     them once to fp32, the backward keeps them in double until the lse is subtracted (a score
//     of ~60 rounded to fp32 moves its p by up to 2^-24 x 60: 1 of 600 emulated draws at scale 2
//     missed the oracle on dQ / dK, as ~1% of the Triton kernel's did); do.v is summed in three
//     fp32 levels (8-wide chunks, 32-wide groups, the groups; a plain sequential FMA dot over
//     D = 256 errs ~2x more than torch's CPU matmul);
//   * every tile's contribution to an accumulator over the sequence (O += P V, dQ += dS K,
//     dK += dS^T Q, dV += (P Z)^T dO) and to the row sum l is summed on its own, then added
//     (two-level summation);
//   * exponentials are expf of the difference (s - m), taken first;
//   * backward renormalises every row: the fp32 lse = m + log(l) errs by up to |lse| x 2^-24,
//     which each recomputed p of the row inherits (with large logits, scale 2 and D 64, 12 of 30
//     fresh draws failed the oracle in emulation, mostly on dV).  A first pass of the dq kernel
//     sums exp(s - lse) per row in double; p = exp(s - lse) x rinv, rinv = 1 / that sum in fp32,
//     and delta = rowsum(p * dp) for those p, each product exact in double (a row's only key
//     then gets dS = p (dp - delta) = 0 exactly).
// NaN / Inf propagate like the reference's (a NaN score makes its row NaN; masked probabilities
// are 0 and still multiply V, as the reference's p @ v does).
//
// Layout of every kernel (128 threads = 4 warps; `lane` = one of 32 streamed columns):
//   fwd_kernel   one CTA per (b, h, BM query rows); warp w owns rows w*RW .. w*RW + RW - 1 (RW =
//                1024 / DP) in every phase, so the softmax needs no CTA barrier: scores with lane
//                = key of a 32-key tile, the row max / sum by one lane per row from shared
//                memory, O (RW rows x DP / 32 columns per lane) += P V with lane = column.
//   dkdv_kernel  one CTA per (b, kv head, BN keys, BN = 4 * 512 / DP): loops over the query heads
//                of the GQA group and over 32-query tiles (lane = query): S^T, dP^T, then
//                dV += (P Z)^T dO and dK += dS^T Q with lane = column.  No atomics.
//   dq_kernel    one CTA per (b, h, BM query rows), runs first; loops over 32-key tiles twice:
//                the rows' rinv and delta (kept, and stored for dkdv_kernel), then dQ += dS K.
// Q / K / V / dO tiles live in shared memory with an odd row pitch (DP + 1 floats), so a warp
// reading one column of 32 rows hits 32 banks; the head dim is padded (zero-filled) to a bucket
// DP of 64, 128 or 256 (accumulator sizes are compile-time), and query tiles shrink as D grows
// so that D = 256 fits: per-thread accumulators stay at 32 floats (fwd, dq) or 2 x 16 (dkdv).
// Tiles are loaded with scalar coalesced loads and not double-buffered: this path exists for
// correctness of fp32 inputs; its speed has not been measured.
//
// Contract (transformer_fast/ops/attention.py): attention_cuda.h.  Dropout keeps (b, h, i, j) iff
// philox_word(seed, offset, ((b*H + h)*Lq + i)*Lk + j) >= threshold (philox.h), as every backend.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#ifndef TF_CUDA_EMULATE
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <cuda_runtime.h>
#endif

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "attention_cuda.h"
#include "attention_device.cuh"
#include "philox.h"

namespace transformer_fast {
namespace attn_fp32 {
namespace {

using at::Tensor;
using namespace attn_device;

constexpr int kThreads = 128;  // 4 warps
constexpr int kWarps = 4;
constexpr int kTile = 32;   // streamed tile: keys (fwd, dq) or queries (dkdv), one per lane
constexpr int kChunk = 8;   // head-dim chunk of the dot products (chunked_dots)
constexpr int kGroup = 32;  // chunks summed within 32-wide groups first

// Rows a warp owns: RW = 1024 / DP query rows (fwd, dq: RW * DP / 32 = 32 accumulators per
// lane), RWK = 512 / DP keys (dkdv: 16 per lane for each of dK and dV).
template <int DP>
constexpr int rows_q() { return 1024 / DP; }
template <int DP>
constexpr int rows_kv() { return 512 / DP; }

using Params = AttentionParams<float>;

// Copies rows [0, rows) x cols [0, DP) of a row-major global tile (row stride ld, unit column
// stride) into shared memory (row pitch DP + 1), zero where row >= nrows or col >= D.
template <int DP>
__device__ __forceinline__ void load_rows(float* s, const float* src, int64_t ld, int rows,
                                          int nrows, int D) {
  for (int idx = threadIdx.x; idx < rows * DP; idx += kThreads) {
    const int r = idx / DP, c = idx % DP;
    s[r * (DP + 1) + c] = (r < nrows && c < D) ? src[r * ld + c] : 0.0f;
  }
}

// dots[a] = x . y_a over the head dim, for NR rows y_a = ys + a * pitch and one row x (both in
// shared memory), summed in three levels: 8-wide chunks (sequential FMAs), their sums within
// 32-wide groups, then the groups.  Sequential fp32 FMA dots err ~2x torch's CPU matmul at
// D = 256 (and a single 32-wide level still ~1.1x the oracle's bound at D = 32 in 1 of 200
// draws); three levels keep every sequential run at <= 8 terms.  Used for dp = dO . v.
template <int NR>
__device__ __forceinline__ void chunked_dots(float dots[NR], const float* x, const float* ys,
                                             int pitch, int D) {
#pragma unroll
  for (int a = 0; a < NR; ++a) dots[a] = 0.0f;
  for (int g0 = 0; g0 < D; g0 += kGroup) {
    const int ge = min(D, g0 + kGroup);
    float group[NR];
#pragma unroll
    for (int a = 0; a < NR; ++a) group[a] = 0.0f;
    for (int c0 = g0; c0 < ge; c0 += kChunk) {
      const int ce = min(ge, c0 + kChunk);
      float part[NR];
#pragma unroll
      for (int a = 0; a < NR; ++a) part[a] = 0.0f;
      for (int d = c0; d < ce; ++d) {
        const float xd = x[d];
#pragma unroll
        for (int a = 0; a < NR; ++a) part[a] = fmaf(xd, ys[a * pitch + d], part[a]);
      }
#pragma unroll
      for (int a = 0; a < NR; ++a) group[a] += part[a];
    }
#pragma unroll
    for (int a = 0; a < NR; ++a) dots[a] += group[a];
  }
}

// The scores' dots q . k: as chunked_dots, but summed in double (the fp32 products are exact
// there), left unrounded.  An error in s is a relative error in p = exp(s - lse), which dS =
// p (dp - delta) and dV = p dO carry: with fp32 scores as accurate as the fp32 reference's, the
// oracle's 2x margin failed 2 of 30 fresh draws at scale 2 (D 64, Lk 7) on dQ / dK; 0 of 60 in
// double.  The kernels are bound by shared-memory loads (one per FMA), not by the FMA unit, on
// GPUs with half-rate fp64 (A100, H100); where fp64 runs at 1/32-1/64 (GeForce, L4) this path
// is slower (it is the opt-in `cuda` backend's fp32 path; auto takes triton).  The sum order
// depends on d only (and fma is commutative), so q_i . k_j is bit-identical whichever side is
// `x`: the forward and all backward kernels recompute the same scores.
template <int NR>
__device__ __forceinline__ void score_dots(double dots[NR], const float* x, const float* ys,
                                           int pitch, int D) {
  double acc[NR];
#pragma unroll
  for (int a = 0; a < NR; ++a) acc[a] = 0.0;
  for (int d = 0; d < D; ++d) {
    const double xd = x[d];
#pragma unroll
    for (int a = 0; a < NR; ++a) acc[a] = fma(xd, static_cast<double>(ys[a * pitch + d]), acc[a]);
  }
#pragma unroll
  for (int a = 0; a < NR; ++a) dots[a] = acc[a];
}

// t[c] = sum_jj row[jj] * tile[jj][lane + 32 c] over the kTile rows of a shared-memory tile
// (row pitch `pitch`): one row of a (kTile-wide) probability / dS tile times V / K, summed on
// its own before the caller adds it to its accumulator.
template <int NC>
__device__ __forceinline__ void row_times_tile(float t[NC], const float* row, const float* tile,
                                               int pitch, int lane) {
#pragma unroll
  for (int c = 0; c < NC; ++c) t[c] = 0.0f;
  for (int jj = 0; jj < kTile; ++jj) {
    const float w = row[jj];
#pragma unroll
    for (int c = 0; c < NC; ++c) t[c] = fmaf(w, tile[jj * pitch + lane + 32 * c], t[c]);
  }
}

// p = exp(s - lse) x rinv of a recomputed (double) score: 0 for a masked score and for a dead
// row (lse -inf).  The difference is taken in double and rounded once; rinv (1 in the pass that
// computes it) renormalises the row by a product, not by exp(s - lse - log(rowsum)): expf is
// within 2 ulp on a GPU but one value per argument, so a row's lone key gets e x fl(1 / e) = 1
// exactly, where the log form left it exp(-expf's error), up to 4 ulp off 1, and dV that much
// (1.4x the oracle's bound with an emulated 2-ulp expf; benchmarks/NOTES.md 2026-12-02).
__device__ __forceinline__ float recompute_p(double s, float lse, float rinv) {
  return (s == -INFINITY || lse == -INFINITY) ? 0.0f : expf(static_cast<float>(s - lse)) * rinv;
}

// ---------------------------------------------------------------------------------------------
// Forward

template <int DP>
__global__ void __launch_bounds__(kThreads) fwd_kernel(const Params p) {
  constexpr int RW = rows_q<DP>(), BM = kWarps * RW, NC = DP / 32, pitch = DP + 1;
  extern __shared__ __align__(16) uint16_t smem[];
  float* Qs = reinterpret_cast<float*>(smem);  // [BM][pitch]
  float* Ks = Qs + BM * pitch;                  // [kTile][pitch]
  float* Vs = Ks + kTile * pitch;               // [kTile][pitch]
  float* Ps = Vs + kTile * pitch;               // [BM][kTile] scores, then P * Z (dropped)
  float* Us = Ps + BM * kTile;                  // [BM][kTile] P (for the row sum)
  float* Ms = Us + BM * kTile;                  // [BM] the row's exponent base m, then its l
  float* As = Ms + BM;                          // [BM] the row's rescale factor alpha

  const int nmb = (p.Lq + BM - 1) / BM;
  const int mb = blockIdx.x % nmb, bh = blockIdx.x / nmb;
  const int b = bh / p.H, h = bh % p.H, hk = h / (p.H / p.Hkv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int m0 = mb * BM, r0 = warp * RW;  // r0: this warp's first row within the CTA

  const auto [seed, offset] = dropout_key(p);
  const float* kh = p.k + b * p.k_sb + hk * p.k_sh;
  const float* vh = p.v + b * p.v_sb + hk * p.v_sh;
  load_rows<DP>(Qs, p.q + b * p.q_sb + h * p.q_sh + m0 * p.q_sm, p.q_sm, BM, p.Lq - m0, p.D);

  float o[RW][NC];  // O of rows r0 + a, columns lane + 32 c
#pragma unroll
  for (int a = 0; a < RW; ++a) {
#pragma unroll
    for (int c = 0; c < NC; ++c) o[a][c] = 0.0f;
  }
  // Running max and sum of row r0 + lane, kept by lanes < RW.
  float m_run = -INFINITY, l_run = 0.0f;

  const int n_end = p.causal ? min(p.Lk, m0 + BM) : p.Lk;  // causal: nothing past the last row
  for (int n0 = 0; n0 < n_end; n0 += kTile) {
    __syncthreads();  // every warp is done with the previous K / V tile
    load_rows<DP>(Ks, kh + n0 * p.k_sm, p.k_sm, kTile, p.Lk - n0, p.D);
    load_rows<DP>(Vs, vh + n0 * p.v_sm, p.v_sm, kTile, p.Lk - n0, p.D);
    __syncthreads();  // the tile (and at n0 = 0 the Q rows) is visible to every warp

    // Scores: lane = key n0 + lane against the warp's RW rows (rounded to fp32 once).
    double s[RW];
    score_dots<RW>(s, Ks + lane * pitch, Qs + r0 * pitch, pitch, p.D);
    const int j = n0 + lane;
#pragma unroll
    for (int a = 0; a < RW; ++a) {
      Ps[(r0 + a) * kTile + lane] = masked_score(p, b, h, m0 + r0 + a, j, static_cast<float>(s[a]));
    }
    __syncwarp();
    if (lane < RW) {  // one lane per row: the new max, the exponent base, the rescale factor
      const float* row = Ps + (r0 + lane) * kTile;
      float m_new = m_run;
      for (int c = 0; c < kTile; ++c) m_new = nan_max(m_new, row[c]);
      // All masked so far: exponentiate against 0 (exp(-inf) = 0), nothing to rescale.
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;
      Ms[r0 + lane] = m_use;
      As[r0 + lane] = expf(m_run - m_use);
      m_run = m_new;
    }
    __syncwarp();
#pragma unroll
    for (int a = 0; a < RW; ++a) {
      const int r = r0 + a;
      const float sc = Ps[r * kTile + lane];
      const float pe = sc == -INFINITY ? 0.0f : expf(sc - Ms[r]);
      Us[r * kTile + lane] = pe;  // the softmax denominator counts dropped elements too
      Ps[r * kTile + lane] = pe == 0.0f ? pe : pe * drop_factor(p, seed, offset, b, h, m0 + r, j);
    }
    __syncwarp();
    if (lane < RW) {  // l = l * alpha + (this tile's row sum, summed on its own)
      const float* row = Us + (r0 + lane) * kTile;
      float tile_sum = 0.0f;
      for (int c = 0; c < kTile; ++c) tile_sum += row[c];
      l_run = fmaf(l_run, As[r0 + lane], tile_sum);
    }
    // O = O * alpha + P V (the tile's product summed on its own).  No skip of p == 0: a NaN / Inf
    // in V stays visible, as in the reference's p @ v.
#pragma unroll
    for (int a = 0; a < RW; ++a) {
      float t[NC];
      row_times_tile<NC>(t, Ps + (r0 + a) * kTile, Vs, pitch, lane);
      const float alpha = As[r0 + a];
#pragma unroll
      for (int c = 0; c < NC; ++c) o[a][c] = fmaf(o[a][c], alpha, t[c]);
    }
  }

  // Finalise: O / l and lse = m + log(l); a row with nothing visible (l = 0) gets 0 and -inf.
  // (A NaN / +Inf score makes l NaN: the row is NaN, as in the reference.)
  __syncwarp();  // every lane has read As / Ms of the last tile
  if (lane < RW) {
    const int i = m0 + r0 + lane;
    Ms[r0 + lane] = l_run;
    if (i < p.Lq) {
      p.lse_out[static_cast<int64_t>(bh) * p.Lq + i] = l_run == 0.0f ? -INFINITY : m_run + logf(l_run);
    }
  }
  __syncwarp();
  float* oh = p.out + b * p.o_sb + h * p.o_sh;
#pragma unroll
  for (int a = 0; a < RW; ++a) {
    const int i = m0 + r0 + a;
    const float l = Ms[r0 + a];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int d = lane + 32 * c;
      if (i < p.Lq && d < p.D) oh[i * p.o_sm + d] = l == 0.0f ? 0.0f : o[a][c] / l;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward: dK, dV

template <int DP>
__global__ void __launch_bounds__(kThreads) dkdv_kernel(const Params p) {
  constexpr int RW = rows_kv<DP>(), BN = kWarps * RW, NC = DP / 32, pitch = DP + 1;
  extern __shared__ __align__(16) uint16_t smem[];
  float* Ks = reinterpret_cast<float*>(smem);  // [BN][pitch]
  float* Vs = Ks + BN * pitch;                  // [BN][pitch]
  float* Qs = Vs + BN * pitch;                  // [kTile][pitch] query tile
  float* Os = Qs + kTile * pitch;               // [kTile][pitch] dO tile
  float* Zs = Os + kTile * pitch;               // [BN][kTile] (P Z)^T
  float* Ss = Zs + BN * kTile;                  // [BN][kTile] dS^T
  float* Ls = Ss + BN * kTile;                  // [kTile] lse of the query tile
  float* Ds = Ls + kTile;                       // [kTile] delta of the query tile
  float* Rs = Ds + kTile;                       // [kTile] rinv of the query tile

  const int nnb = (p.Lk + BN - 1) / BN;
  const int nb = blockIdx.x % nnb, bhk = blockIdx.x / nnb;
  const int b = bhk / p.Hkv, hk = bhk % p.Hkv, group = p.H / p.Hkv;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n0 = nb * BN, r0 = warp * RW;

  const auto [seed, offset] = dropout_key(p);
  load_rows<DP>(Ks, p.k + b * p.k_sb + hk * p.k_sh + n0 * p.k_sm, p.k_sm, BN, p.Lk - n0, p.D);
  load_rows<DP>(Vs, p.v + b * p.v_sb + hk * p.v_sh + n0 * p.v_sm, p.v_sm, BN, p.Lk - n0, p.D);

  float dk[RW][NC], dv[RW][NC];  // keys n0 + r0 + a, columns lane + 32 c
#pragma unroll
  for (int a = 0; a < RW; ++a) {
#pragma unroll
    for (int c = 0; c < NC; ++c) dk[a][c] = dv[a][c] = 0.0f;
  }
  const int m_start = p.causal ? (n0 / kTile) * kTile : 0;  // rows i < n0 see none of these keys
  for (int h = hk * group; h < (hk + 1) * group; ++h) {
    const int64_t bh = static_cast<int64_t>(b) * p.H + h;
    const float* qh = p.q + b * p.q_sb + h * p.q_sh;
    const float* doh = p.dout + b * p.do_sb + h * p.do_sh;
    for (int m0 = m_start; m0 < p.Lq; m0 += kTile) {
      __syncthreads();  // every warp is done with the previous query tile
      load_rows<DP>(Qs, qh + m0 * p.q_sm, p.q_sm, kTile, p.Lq - m0, p.D);
      load_rows<DP>(Os, doh + m0 * p.do_sm, p.do_sm, kTile, p.Lq - m0, p.D);
      for (int r = threadIdx.x; r < kTile; r += kThreads) {  // rows >= Lq: lse -inf, so p = 0
        const bool in = m0 + r < p.Lq;
        Ls[r] = in ? p.lse[bh * p.Lq + m0 + r] : -INFINITY;
        Ds[r] = in ? p.delta[bh * p.Lq + m0 + r] : 0.0f;
        Rs[r] = in ? p.rinv[bh * p.Lq + m0 + r] : 1.0f;
      }
      __syncthreads();  // the tile (and at the start the K / V rows) is visible to every warp

      // lane = query m0 + lane against the warp's RW keys.
      double s[RW];
      float dp[RW];
      score_dots<RW>(s, Qs + lane * pitch, Ks + r0 * pitch, pitch, p.D);
      chunked_dots<RW>(dp, Os + lane * pitch, Vs + r0 * pitch, pitch, p.D);
      const int i = m0 + lane;
      const float l = Ls[lane], dl = Ds[lane], rinv = Rs[lane];
#pragma unroll
      for (int a = 0; a < RW; ++a) {
        const int j = n0 + r0 + a;
        const float pe = recompute_p(masked_score(p, b, h, i, j, s[a]), l, rinv);
        const float z = pe == 0.0f ? 0.0f : drop_factor(p, seed, offset, b, h, i, j);
        Zs[(r0 + a) * kTile + lane] = pe * z;
        Ss[(r0 + a) * kTile + lane] = pe * (__fmul_rn(dp[a], z) - dl);  // no FMA: as delta's pass
      }
      __syncwarp();
      // dV += (P Z)^T dO, dK += dS^T Q (each tile's product summed on its own), lane = column.
#pragma unroll
      for (int a = 0; a < RW; ++a) {
        const float* zrow = Zs + (r0 + a) * kTile;
        const float* srow = Ss + (r0 + a) * kTile;
        float tv[NC], tk[NC];
#pragma unroll
        for (int c = 0; c < NC; ++c) tv[c] = tk[c] = 0.0f;
        for (int ii = 0; ii < kTile; ++ii) {
          const float zi = zrow[ii], si = srow[ii];
#pragma unroll
          for (int c = 0; c < NC; ++c) {
            tv[c] = fmaf(zi, Os[ii * pitch + lane + 32 * c], tv[c]);
            tk[c] = fmaf(si, Qs[ii * pitch + lane + 32 * c], tk[c]);
          }
        }
#pragma unroll
        for (int c = 0; c < NC; ++c) {
          dv[a][c] += tv[c];
          dk[a][c] += tk[c];
        }
      }
    }
  }
  float* dkh = p.out + b * p.o_sb + hk * p.o_sh;
  float* dvh = p.out2 + b * p.o2_sb + hk * p.o2_sh;
#pragma unroll
  for (int a = 0; a < RW; ++a) {
    const int j = n0 + r0 + a;
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int d = lane + 32 * c;
      if (j < p.Lk && d < p.D) {
        dkh[j * p.o_sm + d] = dk[a][c] * p.scale;
        dvh[j * p.o2_sm + d] = dv[a][c];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward: dQ

template <int DP>
__global__ void __launch_bounds__(kThreads) dq_kernel(const Params p) {
  constexpr int RW = rows_q<DP>(), BM = kWarps * RW, NC = DP / 32, pitch = DP + 1;
  extern __shared__ __align__(16) uint16_t smem[];
  float* Qs = reinterpret_cast<float*>(smem);  // [BM][pitch]
  float* Os = Qs + BM * pitch;                  // [BM][pitch] dO rows
  float* Ks = Os + BM * pitch;                  // [kTile][pitch]
  float* Vs = Ks + kTile * pitch;               // [kTile][pitch]
  float* Ss = Vs + kTile * pitch;               // [BM][kTile] dS (first pass: p)
  float* Ws = Ss + BM * kTile;                  // [BM][kTile] first pass: z dp
  float* Ls = Ws + BM * kTile;                  // [BM] lse
  float* Ds = Ls + BM;                          // [BM] delta
  float* Rs = Ds + BM;                          // [BM] rinv

  const int nmb = (p.Lq + BM - 1) / BM;
  const int mb = blockIdx.x % nmb, bh = blockIdx.x / nmb;
  const int b = bh / p.H, h = bh % p.H, hk = h / (p.H / p.Hkv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int m0 = mb * BM, r0 = warp * RW;

  const auto [seed, offset] = dropout_key(p);
  const float* kh = p.k + b * p.k_sb + hk * p.k_sh;
  const float* vh = p.v + b * p.v_sb + hk * p.v_sh;
  load_rows<DP>(Qs, p.q + b * p.q_sb + h * p.q_sh + m0 * p.q_sm, p.q_sm, BM, p.Lq - m0, p.D);
  load_rows<DP>(Os, p.dout + b * p.do_sb + h * p.do_sh + m0 * p.do_sm, p.do_sm, BM, p.Lq - m0, p.D);
  for (int r = threadIdx.x; r < BM; r += kThreads) {  // rows >= Lq: lse -inf, so p = 0
    Ls[r] = m0 + r < p.Lq ? p.lse[static_cast<int64_t>(bh) * p.Lq + m0 + r] : -INFINITY;
  }
  const int n_end = p.causal ? min(p.Lk, m0 + BM) : p.Lk;
  // Both passes below: keys n0.. into shared memory, then lane = key n0 + lane against the warp's
  // RW rows: s (scores, double-summed) and dp (dO . v).
  auto tile_dots = [&](int n0, double (&s)[RW], float (&dp)[RW]) {
    __syncthreads();  // every warp is done with the previous K / V tile (and Rs / Ds are set)
    load_rows<DP>(Ks, kh + n0 * p.k_sm, p.k_sm, kTile, p.Lk - n0, p.D);
    load_rows<DP>(Vs, vh + n0 * p.v_sm, p.v_sm, kTile, p.Lk - n0, p.D);
    __syncthreads();  // the tile (and at n0 = 0 the Q / dO rows and lse) is visible
    score_dots<RW>(s, Ks + lane * pitch, Qs + r0 * pitch, pitch, p.D);
    chunked_dots<RW>(dp, Vs + lane * pitch, Os + r0 * pitch, pitch, p.D);
  };

  // First pass: per row, with p = exp(s - lse) (before dropout, the softmax's denominator),
  // rinv = 1 / sum p (dead rows: 1) and delta = sum p' z dp for the renormalised p' = p /
  // sum p, both summed in double, into Rs / Ds and, for the dK / dV kernel that runs after this
  // one, p.lse_out / p.delta_out.  (delta = rowsum(dO * O) from the fp32 O failed 3 of 30 fresh
  // draws at scale 2 on dQ / dK.)
  double psum = 0.0, pdp = 0.0;  // of row r0 + lane, kept by lanes < RW
  for (int n0 = 0; n0 < n_end; n0 += kTile) {
    double s[RW];
    float dp[RW];
    tile_dots(n0, s, dp);
    const int j = n0 + lane;
#pragma unroll
    for (int a = 0; a < RW; ++a) {
      const int r = r0 + a, i = m0 + r;
      const float pe = recompute_p(masked_score(p, b, h, i, j, s[a]), Ls[r], 1.0f);
      const float z = pe == 0.0f ? 0.0f : drop_factor(p, seed, offset, b, h, i, j);
      Ss[r * kTile + lane] = pe;
      Ws[r * kTile + lane] = __fmul_rn(dp[a], z);  // rounded, as the second pass forms it
    }
    __syncwarp();
    if (lane < RW) {
      const int r = r0 + lane;
      for (int c = 0; c < kTile; ++c) {
        psum += Ss[r * kTile + c];
        pdp += static_cast<double>(Ss[r * kTile + c]) * Ws[r * kTile + c];  // exact product
      }
    }
    __syncwarp();  // the row sums have read Ss / Ws before the next tile overwrites them
  }
  if (lane < RW) {  // a dead row (every p 0) gets rinv 1 and delta 0; a NaN stays NaN
    const int r = r0 + lane;
    Rs[r] = psum == 0.0 ? 1.0f : static_cast<float>(1.0 / psum);
    Ds[r] = psum == 0.0 ? 0.0f : static_cast<float>(pdp / psum);
    if (m0 + r < p.Lq) {
      p.lse_out[static_cast<int64_t>(bh) * p.Lq + m0 + r] = Rs[r];
      p.delta_out[static_cast<int64_t>(bh) * p.Lq + m0 + r] = Ds[r];
    }
  }

  float dq[RW][NC];
#pragma unroll
  for (int a = 0; a < RW; ++a) {
#pragma unroll
    for (int c = 0; c < NC; ++c) dq[a][c] = 0.0f;
  }
  for (int n0 = 0; n0 < n_end; n0 += kTile) {
    double s[RW];
    float dp[RW];
    tile_dots(n0, s, dp);
    const int j = n0 + lane;
#pragma unroll
    for (int a = 0; a < RW; ++a) {
      const int r = r0 + a, i = m0 + r;
      const float pe = recompute_p(masked_score(p, b, h, i, j, s[a]), Ls[r], Rs[r]);
      const float z = pe == 0.0f ? 0.0f : drop_factor(p, seed, offset, b, h, i, j);
      Ss[r * kTile + lane] = pe * (__fmul_rn(dp[a], z) - Ds[r]);  // no FMA: as delta's pass
    }
    __syncwarp();
    // dQ += dS K (the tile's product summed on its own), lane = column.
#pragma unroll
    for (int a = 0; a < RW; ++a) {
      float t[NC];
      row_times_tile<NC>(t, Ss + (r0 + a) * kTile, Ks, pitch, lane);
#pragma unroll
      for (int c = 0; c < NC; ++c) dq[a][c] += t[c];
    }
  }
  float* dqh = p.out + b * p.o_sb + h * p.o_sh;
#pragma unroll
  for (int a = 0; a < RW; ++a) {
    const int i = m0 + r0 + a;
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int d = lane + 32 * c;
      if (i < p.Lq && d < p.D) dqh[i * p.o_sm + d] = dq[a][c] * p.scale;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host side

// Shared-memory bytes of each kernel (float counts as laid out at the top of the kernels).
template <int DP>
size_t fwd_smem() {
  constexpr int BM = kWarps * rows_q<DP>();
  return sizeof(float) * ((BM + 2 * kTile) * (DP + 1) + 2 * BM * kTile + 2 * BM);
}
template <int DP>
size_t dkdv_smem() {
  constexpr int BN = kWarps * rows_kv<DP>();
  return sizeof(float) * ((2 * BN + 2 * kTile) * (DP + 1) + 2 * BN * kTile + 3 * kTile);
}
template <int DP>
size_t dq_smem() {
  constexpr int BM = kWarps * rows_q<DP>();
  return sizeof(float) * ((2 * BM + 2 * kTile) * (DP + 1) + 2 * BM * kTile + 3 * BM);
}

#ifndef TF_CUDA_EMULATE
template <typename Kernel>
void launch(Kernel kernel, int64_t blocks, size_t smem, const Params& p) {
  TORCH_CHECK(blocks < (int64_t{1} << 31), "attention (cuda, fp32): too many CTAs (", blocks, ")");
  check_block_smem(smem, p.D, "attention (cuda, fp32)");  // D > 128: 101-103 KB, past sm_86 / sm_89's 99 KB
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem)));
  kernel<<<static_cast<unsigned>(blocks), kThreads, smem, c10::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
#endif  // TF_CUDA_EMULATE (the emulation harness provides launch)


template <int DP>
void run_fwd(const Params& p) {
  constexpr int BM = kWarps * rows_q<DP>();
  launch(fwd_kernel<DP>, int64_t{p.B} * p.H * ((p.Lq + BM - 1) / BM), fwd_smem<DP>(), p);
}

template <int DP>
void run_bwd(const Params& pkv, const Params& pq) {
  constexpr int BN = kWarps * rows_kv<DP>(), BM = kWarps * rows_q<DP>();
  // dQ first: its first pass writes the row statistics the dK / dV kernel reads.
  launch(dq_kernel<DP>, int64_t{pq.B} * pq.H * ((pq.Lq + BM - 1) / BM), dq_smem<DP>(), pq);
  launch(dkdv_kernel<DP>, int64_t{pkv.B} * pkv.Hkv * ((pkv.Lk + BN - 1) / BN), dkdv_smem<DP>(), pkv);
}

}  // namespace
}  // namespace attn_fp32

void attention_fwd_fp32_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const std::optional<at::Tensor>& attn_mask,
                             const std::optional<at::Tensor>& key_padding_mask, bool is_causal,
                             double scale, double dropout_p, const std::optional<at::Tensor>& rng,
                             at::Tensor& out, at::Tensor& lse) {
  auto p = fill_attention_params<attn_fp32::Params>(q, k, v, attn_mask, key_padding_mask, is_causal, scale,
                                                    dropout_p, rng);
  p.out = out.mutable_data_ptr<float>();
  p.o_sb = out.stride(0), p.o_sh = out.stride(1), p.o_sm = out.stride(2);
  p.lse_out = lse.mutable_data_ptr<float>();
  switch (attn_device::head_dim_bucket(p.D)) {
    case 64: attn_fp32::run_fwd<64>(p); break;
    case 128: attn_fp32::run_fwd<128>(p); break;
    default: attn_fp32::run_fwd<256>(p); break;
  }
}

void attention_bwd_fp32_cuda(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& lse, const std::optional<at::Tensor>& attn_mask,
                             const std::optional<at::Tensor>& key_padding_mask, bool is_causal,
                             double scale, double dropout_p, const std::optional<at::Tensor>& rng,
                             at::Tensor& dq, at::Tensor& dk, at::Tensor& dv) {
  auto p = fill_attention_params<attn_fp32::Params>(q, k, v, attn_mask, key_padding_mask, is_causal, scale,
                                                    dropout_p, rng);
  p.dout = dout.const_data_ptr<float>();
  p.do_sb = dout.stride(0), p.do_sh = dout.stride(1), p.do_sm = dout.stride(2);
  p.lse = lse.const_data_ptr<float>();
  // Written by the dq kernel's first pass, read by the dK / dV kernel.
  at::Tensor rinv = at::empty_like(lse), delta = at::empty_like(lse);
  p.rinv = rinv.const_data_ptr<float>();
  p.delta = delta.const_data_ptr<float>();
  attn_fp32::Params pkv = p, pq = p;
  pq.lse_out = rinv.mutable_data_ptr<float>();
  pq.delta_out = delta.mutable_data_ptr<float>();
  pkv.out = dk.mutable_data_ptr<float>();
  pkv.o_sb = dk.stride(0), pkv.o_sh = dk.stride(1), pkv.o_sm = dk.stride(2);
  pkv.out2 = dv.mutable_data_ptr<float>();
  pkv.o2_sb = dv.stride(0), pkv.o2_sh = dv.stride(1), pkv.o2_sm = dv.stride(2);
  pq.out = dq.mutable_data_ptr<float>();
  pq.o_sb = dq.stride(0), pq.o_sh = dq.stride(1), pq.o_sm = dq.stride(2);
  switch (attn_device::head_dim_bucket(p.D)) {
    case 64: attn_fp32::run_bwd<64>(pkv, pq); break;
    case 128: attn_fp32::run_bwd<128>(pkv, pq); break;
    default: attn_fp32::run_bwd<256>(pkv, pq); break;
  }
}

}  // namespace transformer_fast
