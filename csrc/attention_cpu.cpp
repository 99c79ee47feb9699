// Masked softmax attention on the CPU, flash style: forward and backward.
//
// This is both the `cpu` backend of scaled_dot_product_attention and the tested reference of the
// tiling that csrc/attention_cuda.cu runs on tensor cores: the same BLOCK_M x BLOCK_N tiles, the
// same online-softmax update (running row max m and row sum l in fp32 units, the output
// accumulator rescaled by exp(m_old - m_new)), the same natural-log lse saved for backward, and the
// same backward decomposition (delta = rowsum(dO * O); one pass over key blocks for dK/dV that
// loops over the query heads of its GQA group, one pass over query blocks for dQ; no atomics, so
// the result is deterministic and independent of the thread count).
//
// Contract: transformer_fast/ops/attention.py (the launcher contract of kernels/attention.py).
//   q (B, H, Lq, D), k/v (B, Hkv, Lk, D), Hkv divides H; attn_mask None or (B, H, Lq, Lk)
//   (stride-0 broadcast dims allowed), bool (True = takes part) or floating (added);
//   key_padding_mask None or (B, Lk) bool (True = padding); is_causal top-left (key j <= query i).
//   Dropout keeps (b, h, i, j) iff philox_word(seed, offset, ((b*H + h)*Lq + i)*Lk + j) >=
//   threshold(p), kept values scaled by 1/(1-p) (philox.h; rng = int64 [seed, offset]).
//
// Numerics: inputs are converted once to contiguous fp32 (O(L*D) memory, never O(Lq*Lk)); for
// fp32 inputs the scores (scale * q.k + mask) and the running max stay in double until the max or
// lse is subtracted (a score of ~60 rounded to fp32 moves its p by up to 2^-24 x 60: 0.1% of
// fresh draws at scale 1.5-2 missed the oracle on dq), 16-bit inputs' are rounded to fp32; the
// probabilities and lse are fp32 as on the GPU (exp: Sleef's u10 in vector lanes, as torch's
// CPU softmax); the reductions (q.k and do.v over D, the row sums, the P@V / dS@K / dS^T@Q
// accumulators) are summed in double, as small GEMMs of each tile (gemm_abt, gemm_acc), so the
// result carries about one fp32 rounding and meets the DESIGN 6 oracle for D = 256 too
// (sequential fp32 sums over D = 256 err ~2x torch's blocked matmul, the failure mode
// kernels/attention.py found).
//
// Outputs: out laid out like q (empty_in_layout_of, attention_cuda.h: a (B, L, H, D)-transposed q
// gives an out whose head merge is a view), dq / dk / dv like q / k / v (empty_like), as the fake
// op in transformer_fast/ops/attention.py says; the kernels write them through their strides,
// rounding once from the fp32 results.
//
// The argument checks shared with the CUDA backend live here (check_attention_*_args).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "attention_cuda.h"
#include "ops.h"
#include "philox.h"

namespace transformer_fast {

using at::Tensor;

// --------------------------------------------------------------------------------------------
// Argument checks (also used by attention_cuda.cu)

namespace {

bool attn_dtype_ok(c10::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

void check_device(const Tensor& t, const char* name, const Tensor& q, c10::DeviceType dev) {
  TORCH_CHECK(t.device().type() == dev, "attention: ", name, " must be on ",
              c10::DeviceTypeName(dev), ", got ", t.device());
  TORCH_CHECK(t.device() == q.device(), "attention: ", name, " is on ", t.device(),
              " but q is on ", q.device());
}

}  // namespace

void check_attention_fwd_args(const Tensor& q, const Tensor& k, const Tensor& v,
                              const std::optional<Tensor>& attn_mask,
                              const std::optional<Tensor>& key_padding_mask, double scale,
                              double dropout_p, const std::optional<Tensor>& rng,
                              c10::DeviceType dev) {
  TORCH_CHECK(q.dim() == 4, "attention: q must be 4-D (B, H, Lq, D), got ", q.dim(), "-D");
  TORCH_CHECK(k.dim() == 4, "attention: k must be 4-D (B, Hkv, Lk, D), got ", k.dim(), "-D");
  TORCH_CHECK(v.dim() == 4, "attention: v must be 4-D (B, Hkv, Lk, D), got ", v.dim(), "-D");
  TORCH_CHECK(attn_dtype_ok(q.scalar_type()),
              "attention: q must be float32, float16 or bfloat16, got ", q.scalar_type());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "attention: q, k, v must share one dtype, got ", q.scalar_type(), ", ",
              k.scalar_type(), ", ", v.scalar_type());
  check_device(q, "q", q, dev);
  check_device(k, "k", q, dev);
  check_device(v, "v", q, dev);
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Lk = k.size(2);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B, "attention: batch of k ", k.size(0), " / v ",
              v.size(0), " must equal q's ", B);
  TORCH_CHECK(v.size(1) == Hkv && v.size(2) == Lk, "attention: v must be (B, Hkv, Lk, D) like k ",
              k.sizes(), ", got ", v.sizes());
  TORCH_CHECK(Hkv >= 1 && H % Hkv == 0, "attention: kv heads ", Hkv,
              " must divide the query heads ", H);
  TORCH_CHECK(k.size(3) == D && v.size(3) == D, "attention: head dims of q (", D, "), k (",
              k.size(3), ") and v (", v.size(3), ") must be equal");
  TORCH_CHECK(D >= 1 && D <= 256, "attention: head dim must be in 1..256, got ", D);
  TORCH_CHECK(Lk >= 1, "attention: needs at least one key (Lk = 0)");
  TORCH_CHECK(std::isfinite(scale), "attention: scale must be finite, got ", scale);
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "attention: dropout_p must be in [0, 1), got ",
              dropout_p);
  if (dropout_p > 0.0) {
    TORCH_CHECK(rng.has_value() && rng->defined(),
                "attention: dropout_p > 0 needs rng (int64 [seed, offset])");
    TORCH_CHECK(rng->scalar_type() == at::kLong && rng->numel() >= 2,
                "attention: rng must be int64 [seed, offset], got ", rng->scalar_type(), " of ",
                rng->numel(), " elements");
    check_device(*rng, "rng", q, dev);
  }
  if (attn_mask.has_value() && attn_mask->defined()) {
    const Tensor& m = *attn_mask;
    TORCH_CHECK(m.dim() == 4 && m.size(0) == B && m.size(1) == H && m.size(2) == Lq &&
                    m.size(3) == Lk,
                "attention: attn_mask must be (B, H, Lq, Lk) = (", B, ", ", H, ", ", Lq, ", ", Lk,
                ") (expand a broadcastable mask), got ", m.sizes());
    TORCH_CHECK(m.scalar_type() == at::kBool || attn_dtype_ok(m.scalar_type()),
                "attention: attn_mask must be bool or float32/float16/bfloat16, got ",
                m.scalar_type());
    check_device(m, "attn_mask", q, dev);
  }
  if (key_padding_mask.has_value() && key_padding_mask->defined()) {
    const Tensor& m = *key_padding_mask;
    TORCH_CHECK(m.dim() == 2 && m.size(0) == B && m.size(1) == Lk,
                "attention: key_padding_mask must be (B, Lk) = (", B, ", ", Lk, "), got ",
                m.sizes());
    TORCH_CHECK(m.scalar_type() == at::kBool, "attention: key_padding_mask must be bool, got ",
                m.scalar_type());
    check_device(m, "key_padding_mask", q, dev);
  }
}

void check_attention_bwd_args(const Tensor& dout, const Tensor& q, const Tensor& k,
                              const Tensor& v, const Tensor& out, const Tensor& lse,
                              const std::optional<Tensor>& attn_mask,
                              const std::optional<Tensor>& key_padding_mask, double scale,
                              double dropout_p, const std::optional<Tensor>& rng,
                              c10::DeviceType dev) {
  check_attention_fwd_args(q, k, v, attn_mask, key_padding_mask, scale, dropout_p, rng, dev);
  TORCH_CHECK(dout.sizes() == q.sizes() && dout.scalar_type() == q.scalar_type(),
              "attention: dout must be ", q.sizes(), " ", q.scalar_type(), " like q, got ",
              dout.sizes(), " ", dout.scalar_type());
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(),
              "attention: out must be ", q.sizes(), " ", q.scalar_type(), " like q, got ",
              out.sizes(), " ", out.scalar_type());
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1) &&
                  lse.size(2) == q.size(2) && lse.scalar_type() == at::kFloat,
              "attention: lse must be float32 (B, H, Lq), got ", lse.sizes(), " ",
              lse.scalar_type());
  check_device(dout, "dout", q, dev);
  check_device(out, "out", q, dev);
  check_device(lse, "lse", q, dev);
}

}  // namespace transformer_fast

// --------------------------------------------------------------------------------------------
// The tiled CPU kernels, compiled for AVX2/FMA/F16C on x86-64 (csrc/cpu_avx2_begin.h says why;
// here the tiles' double-precision GEMMs run in 4 x 8 register blocks and exp in vector lanes).
// The GEMMs give the bits of their scalar loops: every product is of two floats, exact in
// double, and each sum keeps its order.

#include "cpu_avx2_begin.h"

namespace transformer_fast {
namespace {

// Tile sizes of attention_cuda.cu: forward 64 x 64; dK/dV 64 keys against 32-query tiles; dQ 64
// query rows against 32-key tiles.  kBlockN is also the row pitch of the score tile.
constexpr int64_t kBlockM = 64;    // forward / dQ: query rows per tile
constexpr int64_t kBlockN = 64;    // forward / dK dV: keys per tile
constexpr int64_t kKvBlockM = 32;  // dK/dV pass: queries per tile
constexpr int64_t kDqBlockN = 32;  // dQ pass: keys per tile
constexpr int64_t kExactDeltaMaxLk = 128;  // backward: 16-bit delta from p * dp up to this Lk
// dQ: the first pass's score tiles kept for the second up to this Lk (64 x Lk doubles a thread)
constexpr int64_t kKeptScoresMaxLk = 4096;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Everything a tile needs to know besides the data: sizes, masks (read through their strides,
// so stride-0 broadcast dims cost nothing), scale and dropout.
struct Problem {
  int64_t B, H, Hkv, Lq, Lk, D;
  float scale;
  bool causal;
  // fp32 inputs: scores kept in double (tile_scores); 16-bit inputs round them to fp32, as their
  // backward (without the lse refinement) needs p = exp(s - lse) of a row's only key to be 1.
  bool exact_scores = false;
  // attn_mask (B, H, Lq, Lk): bool or floating, any strides
  const char* am = nullptr;
  c10::ScalarType am_type = at::kBool;
  int64_t am_sb = 0, am_sh = 0, am_sm = 0, am_sn = 0, am_esize = 1;
  // key_padding_mask (B, Lk) bool
  const bool* kpm = nullptr;
  int64_t kpm_sb = 0, kpm_sn = 0;
  // q or k holds a NaN / Inf: a float mask's -inf then still meets the score it is added to, as
  // the reference's scores + mask does (NaN + -inf = NaN); else such keys skip their dot.
  bool qk_nonfinite = false;
  // q / k hold a NaN / Inf: the gradient kernels add 0 * q_i (dK) and 0 * k_j (dQ) of every pair
  // they skip (masked, p = 0), as the reference's dense dS^T @ Q and dS @ K do.
  bool q_nonfinite = false, k_nonfinite = false;
  // dropout
  bool dropout = false;
  uint64_t seed = 0, offset = 0;
  uint32_t threshold = 0;
  float drop_scale = 1.0f;
};

Problem make_problem(const Tensor& q, const Tensor& k, const std::optional<Tensor>& attn_mask,
                     const std::optional<Tensor>& kpm, bool causal, double scale,
                     double dropout_p, const std::optional<Tensor>& rng) {
  Problem p;
  p.B = q.size(0);
  p.H = q.size(1);
  p.Lq = q.size(2);
  p.D = q.size(3);
  p.Hkv = k.size(1);
  p.Lk = k.size(2);
  p.scale = static_cast<float>(scale);
  p.causal = causal;
  p.exact_scores = q.scalar_type() == at::kFloat;
  if (attn_mask.has_value() && attn_mask->defined()) {
    const Tensor& m = *attn_mask;
    p.am = static_cast<const char*>(m.const_data_ptr());
    p.am_type = m.scalar_type();
    p.am_esize = m.element_size();
    p.am_sb = m.stride(0);
    p.am_sh = m.stride(1);
    p.am_sm = m.stride(2);
    p.am_sn = m.stride(3);
  }
  if (kpm.has_value() && kpm->defined()) {
    p.kpm = kpm->const_data_ptr<bool>();
    p.kpm_sb = kpm->stride(0);
    p.kpm_sn = kpm->stride(1);
  }
  if (dropout_p > 0.0) {
    const Tensor r = rng->to(at::kCPU);  // a no-op on CPU tensors
    const int64_t* rp = r.const_data_ptr<int64_t>();
    p.dropout = true;
    p.seed = static_cast<uint64_t>(rp[0]);
    p.offset = static_cast<uint64_t>(rp[1]);
    p.threshold = dropout_threshold(dropout_p);
    p.drop_scale = dropout_scale(dropout_p);
  }
  return p;
}

// Dropout factors of row i's keys n0 .. n0 + n - 1 of head (b, h): z[c] = 0 when dropped,
// 1/(1-p) when kept, 1 without dropout (dropout_cpu.h: one Philox block per 4 keys).
void drop_factors(const Problem& p, int64_t b, int64_t h, int64_t i, int64_t n0, int64_t n, float* z) {
  if (!p.dropout) {
    std::fill(z, z + n, 1.0f);
    return;
  }
  const uint64_t first = static_cast<uint64_t>(((b * p.H + h) * p.Lq + i) * p.Lk + n0);
  dropout_factors(p.seed, p.offset, first, n, p.threshold, p.drop_scale, z);
}

// A 4-D output tensor (fp32, fp16 or bf16, any strides) written element by element.
struct OutView {
  char* base;
  c10::ScalarType type;
  int64_t esize, s0, s1, s2, s3;
  explicit OutView(const Tensor& t)
      : base(static_cast<char*>(t.mutable_data_ptr())), type(t.scalar_type()),
        esize(t.element_size()), s0(t.stride(0)), s1(t.stride(1)), s2(t.stride(2)),
        s3(t.stride(3)) {}
  // Element (b, h, row, d) = x rounded to the output dtype (nearest even, as Tensor.to does).
  void store(int64_t b, int64_t h, int64_t row, int64_t d, float x) const {
    char* e = base + (b * s0 + h * s1 + row * s2 + d * s3) * esize;
    switch (type) {
      case at::kFloat: *reinterpret_cast<float*>(e) = x; break;
      case at::kHalf: *reinterpret_cast<c10::Half*>(e) = c10::Half(x); break;
      default: *reinterpret_cast<c10::BFloat16*>(e) = c10::BFloat16(x); break;
    }
  }
};

// Keys a query tile [m0, m0 + bm) can see: causal rows i see j <= i, so nothing from m0 + bm on.
int64_t key_end(const Problem& p, int64_t m0, int64_t bm) {
  return p.causal ? std::min(p.Lk, m0 + bm) : p.Lk;
}

// ---- Tile products in double.
//
// Every product the kernels sum is of two floats (inputs converted to fp32; p, p * z and dS
// rounded to fp32), exact in double, so a sum in double rounds once per addition and never a
// product.  The sums of a tile run as small GEMMs on operands packed once per tile as doubles,
// in 4 x 8 blocks held in registers (AVX2: 8 accumulators of 4 doubles); each element is one
// chain summed in index order, where the FMA rounds only the sum (exact product), so the AVX2
// and the scalar loops give the same bits.  Pairs a kernel skips (masked, p = 0) take part
// with a weight of 0: for finite operands that adds +0 (no change), and a NaN / Inf operand
// then reaches the sum as 0 * NaN, as the reference's dense products carry it.
// (Before these, each pair ran its own D-long dot and axpy: ~2.5x slower; benchmarks/NOTES.md.)

constexpr int64_t kRowStep = 4;  // rows of a register block
constexpr int64_t kColStep = 8;  // columns of a register block

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// y[c] = exp(x[c]) for c < n, 8 (float) or 4 (double) lanes at a time: Sleef's u10 (within 1
// ulp, as at::vec's exp and torch's own CPU softmax); y may be x.  exp(-inf) = 0.
void exp_in_lanes(const float* x, float* y, int64_t n) {
  using VecF = at::vec::Vectorized<float>;
  int64_t c = 0;
  for (; c + VecF::size() <= n; c += VecF::size()) VecF::loadu(x + c).exp().store(y + c);
  if (c < n) VecF::loadu(x + c, n - c).exp().store(y + c, n - c);
}

void exp_in_lanes(const double* x, double* y, int64_t n) {
  using VecD = at::vec::Vectorized<double>;
  int64_t c = 0;
  for (; c + VecD::size() <= n; c += VecD::size()) VecD::loadu(x + c).exp().store(y + c);
  if (c < n) VecD::loadu(x + c, n - c).exp().store(y + c, n - c);
}

// dst (rows_padded x ld, double) = src (rows x D, fp32, contiguous), zero in columns [D, ld)
// and rows [rows, rows_padded).
void pack_rows(const float* src, int64_t rows, int64_t D, int64_t rows_padded, int64_t ld,
               double* dst) {
  for (int64_t r = 0; r < rows_padded; ++r) {
    double* out = dst + r * ld;
    int64_t d = 0;
    if (r < rows) {
      const float* in = src + r * D;
      for (; d < D; ++d) out[d] = in[d];
    }
    for (; d < ld; ++d) out[d] = 0.0;
  }
}

// dst[d * ld + c] = src[c * D + d] (src: cols x D, fp32, contiguous) for d < D, zero for c in
// [cols, cols_padded).
void pack_transposed(const float* src, int64_t cols, int64_t D, int64_t cols_padded, int64_t ld,
                     double* dst) {
  for (int64_t d = 0; d < D; ++d) {
    double* out = dst + d * ld;
    for (int64_t c = 0; c < cols; ++c) out[c] = src[c * D + d];
    for (int64_t c = cols; c < cols_padded; ++c) out[c] = 0.0;
  }
}

// Acc[i * ldacc + d] += sum_{k < K, in order} W[i * wsi + k * wsk] * X[k * ldx + d] for i < m,
// d < n (m a multiple of kRowStep, n of kColStep).  W's strides let one function take a weight
// tile or its transpose (dK, dV: sums over the query rows of a (query, key) tile).
void gemm_acc(const double* W, int64_t wsi, int64_t wsk, const double* X, int64_t ldx, int64_t K,
              int64_t m, int64_t n, double* Acc, int64_t ldacc) {
  for (int64_t i = 0; i < m; i += kRowStep) {
    const double* w = W + i * wsi;
    for (int64_t d = 0; d < n; d += kColStep) {
      double* acc = Acc + i * ldacc + d;
      const double* x = X + d;
#if defined(__x86_64__) && (defined(TF_CPU_AVX2_PRAGMA) || defined(__AVX2__))
      __m256d a00 = _mm256_loadu_pd(acc), a01 = _mm256_loadu_pd(acc + 4);
      __m256d a10 = _mm256_loadu_pd(acc + ldacc), a11 = _mm256_loadu_pd(acc + ldacc + 4);
      __m256d a20 = _mm256_loadu_pd(acc + 2 * ldacc), a21 = _mm256_loadu_pd(acc + 2 * ldacc + 4);
      __m256d a30 = _mm256_loadu_pd(acc + 3 * ldacc), a31 = _mm256_loadu_pd(acc + 3 * ldacc + 4);
      for (int64_t k = 0; k < K; ++k) {
        const __m256d x0 = _mm256_loadu_pd(x + k * ldx), x1 = _mm256_loadu_pd(x + k * ldx + 4);
        const double* wk = w + k * wsk;
        __m256d y = _mm256_broadcast_sd(wk);
        a00 = _mm256_fmadd_pd(y, x0, a00);
        a01 = _mm256_fmadd_pd(y, x1, a01);
        y = _mm256_broadcast_sd(wk + wsi);
        a10 = _mm256_fmadd_pd(y, x0, a10);
        a11 = _mm256_fmadd_pd(y, x1, a11);
        y = _mm256_broadcast_sd(wk + 2 * wsi);
        a20 = _mm256_fmadd_pd(y, x0, a20);
        a21 = _mm256_fmadd_pd(y, x1, a21);
        y = _mm256_broadcast_sd(wk + 3 * wsi);
        a30 = _mm256_fmadd_pd(y, x0, a30);
        a31 = _mm256_fmadd_pd(y, x1, a31);
      }
      _mm256_storeu_pd(acc, a00);
      _mm256_storeu_pd(acc + 4, a01);
      _mm256_storeu_pd(acc + ldacc, a10);
      _mm256_storeu_pd(acc + ldacc + 4, a11);
      _mm256_storeu_pd(acc + 2 * ldacc, a20);
      _mm256_storeu_pd(acc + 2 * ldacc + 4, a21);
      _mm256_storeu_pd(acc + 3 * ldacc, a30);
      _mm256_storeu_pd(acc + 3 * ldacc + 4, a31);
#else
      for (int64_t r = 0; r < kRowStep; ++r) {
        for (int64_t col = 0; col < kColStep; ++col) {
          double sum = acc[r * ldacc + col];
          for (int64_t k = 0; k < K; ++k) sum += w[r * wsi + k * wsk] * x[k * ldx + col];
          acc[r * ldacc + col] = sum;
        }
      }
#endif
    }
  }
}

// C[i * ldc + j] = sum_{k < K} A[i * lda + k] * Bt[k * ldb + j] for i < m, j < n (m a multiple
// of kRowStep, n of kColStep): gemm_acc from zero.
void gemm_abt(const double* A, int64_t lda, const double* Bt, int64_t ldb, int64_t K, int64_t m,
              int64_t n, double* C, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i) std::fill(C + i * ldc, C + i * ldc + n, 0.0);
  gemm_acc(A, lda, 1, Bt, ldb, K, m, n, C, ldc);
}

// c ? x : y, as bit operations: whether a key is masked is data, and the compiler's branch on
// it mispredicted (a random bool mask cost ~1.5x the unmasked call).
inline double pick(bool c, double x, double y) {
  const uint64_t m = 0 - static_cast<uint64_t>(c);
  uint64_t xb, yb;
  std::memcpy(&xb, &x, sizeof xb);
  std::memcpy(&yb, &y, sizeof yb);
  const uint64_t r = (xb & m) | (yb & ~m);
  double out;
  std::memcpy(&out, &r, sizeof out);
  return out;
}

inline double keep_or_neg_inf(bool keep, double x) { return pick(keep, x, kNegInf); }

// Scores of one tile: s[r * kBlockN + c] for query rows m0 + r (r < bm) and keys n0 + c (c < bn),
// in double (unrounded for fp32 inputs: see Numerics), masked to -inf.  qp: the tile's query
// rows packed (pack_rows, pitch ldq, rows padded to kRowStep); kt: its keys packed transposed
// (pack_transposed, pitch kBlockN, columns padded to kColStep).  Forward and both backward
// passes call this one function on the same packing, so the backward recomputes bit-identical
// scores and p = exp(s - lse) is consistent with the forward's sums.
void tile_scores(const Problem& p, int64_t b, int64_t h, const double* qp, int64_t ldq,
                 const double* kt, int64_t m0, int64_t bm, int64_t n0, int64_t bn, double* s) {
  gemm_abt(qp, ldq, kt, kBlockN, p.D, round_up(bm, kRowStep), round_up(bn, kColStep), s, kBlockN);
  bool padded[kBlockN];  // the tile's keys' padding, read once for all its rows
  for (int64_t c = 0; c < bn; ++c) {
    padded[c] = p.kpm != nullptr && p.kpm[b * p.kpm_sb + (n0 + c) * p.kpm_sn];
  }
  for (int64_t r = 0; r < bm; ++r) {
    const int64_t i = m0 + r;
    double* sr = s + r * kBlockN;
    // keys c < visible pass the causal test (j <= i)
    const int64_t visible = p.causal ? std::clamp<int64_t>(i - n0 + 1, 0, bn) : bn;
    if (p.exact_scores) {
      for (int64_t c = 0; c < bn; ++c) sr[c] = p.scale * sr[c];
    } else {
      for (int64_t c = 0; c < bn; ++c) sr[c] = static_cast<float>(p.scale * sr[c]);
    }
    if (p.am == nullptr) {
      for (int64_t c = 0; c < bn; ++c) sr[c] = keep_or_neg_inf((c < visible) & !padded[c], sr[c]);
      continue;
    }
    // attn_mask's row i from key n0 on, through its strides, in its own dtype
    const char* row = p.am + (b * p.am_sb + h * p.am_sh + i * p.am_sm + n0 * p.am_sn) * p.am_esize;
    const auto masked_row = [&](auto tag, auto unit_stride) {
      using M = decltype(tag);
      const M* mr = reinterpret_cast<const M*>(row);
      const int64_t sn = decltype(unit_stride)::value ? 1 : p.am_sn;  // (1: the loop vectorises)
      for (int64_t c = 0; c < bn; ++c) {
        const bool open = (c < visible) & !padded[c];
        if constexpr (std::is_same_v<M, bool>) {
          sr[c] = keep_or_neg_inf(open & mr[c * sn], sr[c]);
        } else {
          const float bias = static_cast<float>(mr[c * sn]);
          const double x = p.exact_scores ? sr[c] + bias
                                          : static_cast<double>(static_cast<float>(sr[c]) + bias);
          sr[c] = keep_or_neg_inf(open & (bias != kNegInf || p.qk_nonfinite), x);
        }
      }
    };
    const auto by_stride = [&](auto tag) {
      if (p.am_sn == 1) {
        masked_row(tag, std::true_type{});
      } else {
        masked_row(tag, std::false_type{});
      }
    };
    switch (p.am_type) {
      case at::kBool: by_stride(bool{}); break;
      case at::kFloat: by_stride(float{}); break;
      case at::kHalf: by_stride(c10::Half{}); break;
      default: by_stride(c10::BFloat16{}); break;
    }
  }
}

// max(m, x[0..n)), NaN if m or any x[c] is NaN (a max that dropped it would turn a NaN row into
// a dead row).
double row_max(double m, const double* x, int64_t n) {
  bool nan = std::isnan(m);
  int64_t c = 0;
#if defined(__x86_64__) && (defined(TF_CPU_AVX2_PRAGMA) || defined(__AVX2__))
  __m256d mx = _mm256_set1_pd(m), unordered = _mm256_setzero_pd();
  for (; c + 4 <= n; c += 4) {
    const __m256d v = _mm256_loadu_pd(x + c);
    mx = _mm256_max_pd(mx, v);
    unordered = _mm256_or_pd(unordered, _mm256_cmp_pd(v, v, _CMP_UNORD_Q));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, mx);
  m = std::max(std::max(lanes[0], lanes[1]), std::max(lanes[2], lanes[3]));
  nan |= _mm256_movemask_pd(unordered) != 0;
#endif
  for (; c < n; ++c) {
    m = std::max(m, x[c]);
    nan |= std::isnan(x[c]);
  }
  return nan ? std::numeric_limits<double>::quiet_NaN() : m;
}

// Forward.  q32 (B, H, Lq, D), k32/v32 (B, Hkv, Lk, D) contiguous fp32; out (B, H, Lq, D);
// lse (B, H, Lq) contiguous.  One task per (b, h, query block).
//
// With `v_nonfinite` (v holds a NaN or an Inf somewhere), every key a row does not attend to still
// adds 0 * v_j to the row, as the reference's dense p @ v does: a NaN / Inf value at a masked,
// padded or causally hidden key then gives that row NaN in its column, never a finite output
// that hides it.  Inside the tiles the P @ V product does that (weight 0); the keys past the
// causal limit of the whole tile go to a separate per-row sum, only then (O(Lq * Lk * D)).
void fwd_kernel(const Problem& p, const float* q32, const float* k32, const float* v32,
                const OutView& out, float* lse, bool v_nonfinite) {
  const int64_t nmb = (p.Lq + kBlockM - 1) / kBlockM;
  const int64_t group = p.H / p.Hkv, D = p.D, D8 = round_up(D, kColStep);
  at::parallel_for(0, p.B * p.H * nmb, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> s(kBlockM * kBlockN), w(kBlockM * kBlockN, 0.0);
    std::vector<double> qp(kBlockM * D8), kt(D * kBlockN), vp(kBlockN * D8), acc(kBlockM * D8);
    std::vector<float> hidden(v_nonfinite ? kBlockM * D : 0);  // sum of 0 * v over unseen keys
    std::vector<float> pt(kBlockN), zt(kBlockN);  // one row's p and dropout factors
    double m_i[kBlockM];
    double l_i[kBlockM];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t mb = task % nmb, bh = task / nmb, h = bh % p.H, b = bh / p.H;
      const int64_t hk = h / group;
      const float* q = q32 + bh * p.Lq * D;
      const float* k = k32 + (b * p.Hkv + hk) * p.Lk * D;
      const float* v = v32 + (b * p.Hkv + hk) * p.Lk * D;
      const int64_t m0 = mb * kBlockM, bm = std::min(kBlockM, p.Lq - m0);
      const int64_t m4 = round_up(bm, kRowStep);
      pack_rows(q + m0 * D, bm, D, m4, D8, qp.data());
      std::fill(acc.begin(), acc.end(), 0.0);
      std::fill(hidden.begin(), hidden.end(), 0.0f);
      std::fill(w.begin() + bm * kBlockN, w.begin() + m4 * kBlockN, 0.0);  // padding rows
      std::fill(m_i, m_i + kBlockM, kNegInf);
      std::fill(l_i, l_i + kBlockM, 0.0);
      const int64_t n_end = key_end(p, m0, bm);
      for (int64_t n0 = 0; n0 < n_end; n0 += kBlockN) {
        const int64_t bn = std::min(kBlockN, n_end - n0);
        pack_transposed(k + n0 * D, bn, D, round_up(bn, kColStep), kBlockN, kt.data());
        pack_rows(v + n0 * D, bn, D, bn, D8, vp.data());
        tile_scores(p, b, h, qp.data(), D8, kt.data(), m0, bm, n0, bn, s.data());
        for (int64_t r = 0; r < bm; ++r) {
          const double* sr = s.data() + r * kBlockN;
          double* wr = w.data() + r * kBlockN;
          const double m_new = row_max(m_i[r], sr, bn);
          if (m_new == kNegInf) {  // nothing visible yet in this row
            std::fill(wr, wr + bn, 0.0);
            continue;
          }
          // Rescale what was summed under the old max (exp(-inf) = 0 on the first visible tile).
          const float alpha = std::exp(static_cast<float>(m_i[r] - m_new));
          if (alpha != 1.0f) {
            double* ar = acc.data() + r * D8;
            l_i[r] *= alpha;
            for (int64_t d = 0; d < D; ++d) ar[d] *= alpha;
          }
          // A masked score gives p = exp(-inf) = 0: l unchanged, weight 0 (and 0 * v still carries
          // a NaN / Inf of v, as the reference's p @ v does; so does a dropped element's).  The
          // softmax denominator counts dropped elements too.
          float* pr = pt.data();
          for (int64_t c = 0; c < bn; ++c) pr[c] = static_cast<float>(sr[c] - m_new);
          exp_in_lanes(pr, pr, bn);
          drop_factors(p, b, h, m0 + r, n0, bn, zt.data());
          double l = l_i[r];
          for (int64_t c = 0; c < bn; ++c) {
            l += pr[c];
            wr[c] = pr[c] * zt[c];
          }
          l_i[r] = l;
          m_i[r] = m_new;
        }
        gemm_acc(w.data(), kBlockN, 1, vp.data(), D8, bn, m4, D8, acc.data(), D8);
      }
      if (v_nonfinite) {  // the keys past the causal limit of the whole tile
        for (int64_t r = 0; r < bm; ++r) {
          float* hr = hidden.data() + r * D;
          for (int64_t j = n_end; j < p.Lk; ++j) {
            for (int64_t d = 0; d < D; ++d) hr[d] += 0.0f * v[j * D + d];
          }
        }
      }
      for (int64_t r = 0; r < bm; ++r) {
        const int64_t i = m0 + r;
        const double* ar = acc.data() + r * D8;
        const float* hr = v_nonfinite ? hidden.data() + r * D : nullptr;
        if (l_i[r] != 0.0) {  // NaN (a NaN / +Inf score) propagates like the reference's softmax
          const double inv = 1.0 / l_i[r];
          for (int64_t d = 0; d < D; ++d) {
            const float o = static_cast<float>(ar[d] * inv);
            out.store(b, h, i, d, hr ? o + hr[d] : o);
          }
          lse[bh * p.Lq + i] = static_cast<float>(m_i[r] + std::log(l_i[r]));
        } else {  // a row with no key to attend to: output 0 (0 * v of the keys it skipped), lse -inf
          for (int64_t d = 0; d < D; ++d) {
            const float o = static_cast<float>(ar[d]);
            out.store(b, h, i, d, hr ? o + hr[d] : o);
          }
          lse[bh * p.Lq + i] = kNegInf;
        }
      }
    }
  });
}

// pr[c] = exp(s[c] - lse) of one row's recomputed scores, c < n (0 for masked scores and for a
// dead row, lse = -inf; also in a NaN row, lse NaN), lse given as lse + lse_lo: s - lse is exact
// near the row's maximum, so lse_lo keeps the bits of the normaliser that the fp32 lse rounded
// away.
void recompute_p(const double* s, float lse, float lse_lo, int64_t n, float* pr) {
  if (lse == kNegInf) {
    std::fill(pr, pr + n, 0.0f);
    return;
  }
  if (std::isnan(lse)) {  // (-inf - NaN would be NaN, not 0)
    for (int64_t c = 0; c < n; ++c) pr[c] = s[c] == kNegInf ? kNegInf : std::numeric_limits<float>::quiet_NaN();
  } else {  // (-inf - lse - lse_lo = -inf: masked scores need no test)
    for (int64_t c = 0; c < n; ++c) pr[c] = static_cast<float>((s[c] - lse) - lse_lo);
  }
  exp_in_lanes(pr, pr, n);
}

// dK, dV: one task per (b, kv head, key block), looping over the query heads of its group and
// over the query blocks that can see the key block (causal: rows i >= n0 only).
void bwd_dkdv_kernel(const Problem& p, const float* q32, const float* k32, const float* v32,
                     const float* do32, const float* lse, const float* lse_lo, const float* delta,
                     const OutView& dk_out, const OutView& dv_out) {
  const int64_t nnb = (p.Lk + kBlockN - 1) / kBlockN;
  const int64_t group = p.H / p.Hkv, D = p.D, D8 = round_up(D, kColStep);
  at::parallel_for(0, p.B * p.Hkv * nnb, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> s(kBlockM * kBlockN), dps(kBlockM * kBlockN);
    // (query, key) weights of dV (p * z) and dK (dS).  Columns past a short key block (bn up to
    // its multiple of kRowStep) may hold an earlier task's weights: they feed only dK / dV rows
    // past bn, which are never written out.
    std::vector<double> wdv(kKvBlockM * kBlockN, 0.0), wdk(kKvBlockM * kBlockN, 0.0);
    std::vector<double> qp(kKvBlockM * D8), dop(kKvBlockM * D8), kt(D * kBlockN), vt(D * kBlockN);
    std::vector<double> dk(kBlockN * D8), dv(kBlockN * D8);
    std::vector<float> hidden(p.q_nonfinite ? kBlockN * D : 0);  // 0 * q_i of rows before the tiles
    std::vector<float> pt(kBlockN), zt(kBlockN);  // one row's p and dropout factors
    for (int64_t task = begin; task < end; ++task) {
      const int64_t nb = task % nnb, bhk = task / nnb, hk = bhk % p.Hkv, b = bhk / p.Hkv;
      const float* k = k32 + bhk * p.Lk * D;
      const float* v = v32 + bhk * p.Lk * D;
      const int64_t n0 = nb * kBlockN, bn = std::min(kBlockN, p.Lk - n0);
      const int64_t n4 = round_up(bn, kRowStep), n8 = round_up(bn, kColStep);
      pack_transposed(k + n0 * D, bn, D, n8, kBlockN, kt.data());
      pack_transposed(v + n0 * D, bn, D, n8, kBlockN, vt.data());
      std::fill(dk.begin(), dk.end(), 0.0);
      std::fill(dv.begin(), dv.end(), 0.0);
      std::fill(hidden.begin(), hidden.end(), 0.0f);
      const int64_t m_start = p.causal ? (n0 / kKvBlockM) * kKvBlockM : 0;
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        const int64_t bh = b * p.H + h;
        const float* q = q32 + bh * p.Lq * D;
        const float* dO = do32 + bh * p.Lq * D;
        if (p.q_nonfinite) {  // the rows before the first query block that can see these keys
          for (int64_t i = 0; i < m_start; ++i) {
            for (int64_t c = 0; c < bn; ++c) {
              float* hc = hidden.data() + c * D;
              for (int64_t d = 0; d < D; ++d) hc[d] += 0.0f * q[i * D + d];
            }
          }
        }
        for (int64_t m0 = m_start; m0 < p.Lq; m0 += kKvBlockM) {
          const int64_t bm = std::min(kKvBlockM, p.Lq - m0), m4 = round_up(bm, kRowStep);
          pack_rows(q + m0 * D, bm, D, m4, D8, qp.data());
          pack_rows(dO + m0 * D, bm, D, m4, D8, dop.data());
          tile_scores(p, b, h, qp.data(), D8, kt.data(), m0, bm, n0, bn, s.data());
          gemm_abt(dop.data(), D8, vt.data(), kBlockN, D, m4, n8, dps.data(), kBlockN);
          for (int64_t r = 0; r < bm; ++r) {
            const int64_t i = m0 + r;
            const float l = lse[bh * p.Lq + i], l_lo = lse_lo[bh * p.Lq + i], dl = delta[bh * p.Lq + i];
            double* wv = wdv.data() + r * kBlockN;
            double* wk = wdk.data() + r * kBlockN;
            recompute_p(s.data() + r * kBlockN, l, l_lo, bn, pt.data());
            // Where p = 0 the weights are 0 (0 * q_i still carries a NaN / Inf of q into dK).  A
            // NaN row (a NaN / Inf score, lse NaN; its p = 0 exactly at its masked keys): the
            // reference's softmax is NaN at its masked keys too, so their dV gets NaN; its dS
            // there stays 0 (masked_fill).  Selects, not branches: the mask is data.
            const double dv_at_zero = std::isnan(l) ? static_cast<double>(l) : 0.0;
            drop_factors(p, b, h, i, n0, bn, zt.data());
            for (int64_t c = 0; c < bn; ++c) {
              const float pij = pt[c];
              const float z = zt[c];
              const float dp = static_cast<float>(dps[r * kBlockN + c]);
              const double pz = pij * z, ds = pij * (dp * z - dl);
              wv[c] = pick(pij == 0.0f, dv_at_zero, pz);
              wk[c] = pick(pij == 0.0f, 0.0, ds);
            }
          }
          // dV[c] += sum_r (p * z)[r, c] dO[r];  dK[c] += sum_r dS[r, c] q[r]  (rows r < bm)
          gemm_acc(wdv.data(), 1, kBlockN, dop.data(), D8, bm, n4, D8, dv.data(), D8);
          gemm_acc(wdk.data(), 1, kBlockN, qp.data(), D8, bm, n4, D8, dk.data(), D8);
        }
      }
      for (int64_t c = 0; c < bn; ++c) {
        for (int64_t d = 0; d < D; ++d) {
          const float dkd = static_cast<float>(dk[c * D8 + d] * p.scale);
          dk_out.store(b, hk, n0 + c, d, p.q_nonfinite ? dkd + hidden[c * D + d] : dkd);
          dv_out.store(b, hk, n0 + c, d, static_cast<float>(dv[c * D8 + d]));
        }
      }
    }
  });
}

// dQ: one task per (b, h, query block), looping over the key blocks it sees.  Before it, one pass
// over the same keys writes, for the dK/dV kernel (which runs after this one): with refine_lse,
// lse_lo_i = log(sum_j exp(s_ij - lse_i)) in double (the part of the normaliser the fp32 lse
// rounded away); with exact_delta, delta_i = sum_j p_ij * dp_ij.
void bwd_dq_kernel(const Problem& p, const float* q32, const float* k32, const float* v32,
                   const float* do32, const float* lse, float* lse_lo, bool refine_lse, float* delta,
                   bool exact_delta, const OutView& dq_out) {
  const int64_t nmb = (p.Lq + kBlockM - 1) / kBlockM;
  const int64_t group = p.H / p.Hkv, D = p.D, D8 = round_up(D, kColStep);
  at::parallel_for(0, p.B * p.H * nmb, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> s(kBlockM * kBlockN), dps(kBlockM * kBlockN), w(kBlockM * kBlockN, 0.0);
    std::vector<double> qp(kBlockM * D8), dop(kBlockM * D8), kt(D * kBlockN), vt(D * kBlockN);
    std::vector<double> kp(kDqBlockN * D8), dq(kBlockM * D8), psum(kBlockM), pdp(kBlockM);
    std::vector<float> hidden(p.k_nonfinite ? kBlockM * D : 0);  // 0 * k_j of keys past the tiles
    std::vector<float> pt(kBlockN), zt(kBlockN);  // one row's p and dropout factors
    std::vector<double> et(kBlockN);  // one row's e = exp(s - lse) in double
    // The first pass's tiles (scores; dP too with exact_delta), kDqBlockN-wide, reused by the
    // second pass instead of recomputed (the same values: one GEMM pass of the backward's ~8).
    const bool keep = (refine_lse || exact_delta) && p.Lk <= kKeptScoresMaxLk;
    const int64_t kept_tiles = keep ? (p.Lk + kDqBlockN - 1) / kDqBlockN : 0;
    std::vector<double> kept_s(kept_tiles * kBlockM * kDqBlockN);
    std::vector<double> kept_dp(exact_delta ? kept_s.size() : 0);
    // rows [0, bm) of a kBlockN-pitched tile into tile t of a kept buffer
    const auto keep_tile = [&](const std::vector<double>& tile, std::vector<double>& kept,
                               int64_t t, int64_t bm, int64_t bn) {
      double* dst = kept.data() + t * kBlockM * kDqBlockN;
      for (int64_t r = 0; r < bm; ++r) {
        std::copy(tile.data() + r * kBlockN, tile.data() + r * kBlockN + bn, dst + r * kDqBlockN);
      }
    };
    for (int64_t task = begin; task < end; ++task) {
      const int64_t mb = task % nmb, bh = task / nmb, h = bh % p.H, b = bh / p.H;
      const int64_t hk = h / group;
      const float* q = q32 + bh * p.Lq * D;
      const float* dO = do32 + bh * p.Lq * D;
      const float* k = k32 + (b * p.Hkv + hk) * p.Lk * D;
      const float* v = v32 + (b * p.Hkv + hk) * p.Lk * D;
      const int64_t m0 = mb * kBlockM, bm = std::min(kBlockM, p.Lq - m0);
      const int64_t m4 = round_up(bm, kRowStep);
      const int64_t n_end = key_end(p, m0, bm);
      pack_rows(q + m0 * D, bm, D, m4, D8, qp.data());
      pack_rows(dO + m0 * D, bm, D, m4, D8, dop.data());
      std::fill(w.begin() + bm * kBlockN, w.begin() + m4 * kBlockN, 0.0);  // padding rows
      if (refine_lse || exact_delta) {
        // One pass for both: e_ij = exp(s_ij - lse_i) in double, psum_i = sum_j e_ij (1 up to the
        // rounding of the fp32 lse) and pdp_i = sum_j e_ij * dp_ij.
        std::fill(psum.begin(), psum.end(), 0.0);
        std::fill(pdp.begin(), pdp.end(), 0.0);
        for (int64_t n0 = 0; n0 < n_end; n0 += kDqBlockN) {
          const int64_t bn = std::min(kDqBlockN, n_end - n0), n8 = round_up(bn, kColStep);
          pack_transposed(k + n0 * D, bn, D, n8, kBlockN, kt.data());
          tile_scores(p, b, h, qp.data(), D8, kt.data(), m0, bm, n0, bn, s.data());
          if (exact_delta) {
            pack_transposed(v + n0 * D, bn, D, n8, kBlockN, vt.data());
            gemm_abt(dop.data(), D8, vt.data(), kBlockN, D, m4, n8, dps.data(), kBlockN);
          }
          if (keep) {
            keep_tile(s, kept_s, n0 / kDqBlockN, bm, bn);
            if (exact_delta) keep_tile(dps, kept_dp, n0 / kDqBlockN, bm, bn);
          }
          for (int64_t r = 0; r < bm; ++r) {
            const int64_t i = m0 + r;
            const float l = lse[bh * p.Lq + i];
            if (l == kNegInf) continue;
            const double* sr = s.data() + r * kBlockN;
            if (refine_lse) {
              for (int64_t c = 0; c < bn; ++c) et[c] = sr[c] - l;  // exp(-inf) = 0 where masked
              exp_in_lanes(et.data(), et.data(), bn);
            } else {
              recompute_p(sr, l, 0.0f, bn, pt.data());
            }
            if (exact_delta) drop_factors(p, b, h, i, n0, bn, zt.data());
            double ps = psum[r], pd = pdp[r];  // (in registers: the vectors' elements were reloaded)
            // A masked score adds nothing (e = 0; no 0 * dp, which a NaN / Inf in dO would make
            // NaN); selects, not branches: the mask is data.
            for (int64_t c = 0; c < bn; ++c) {
              const double e = refine_lse ? et[c] : static_cast<double>(pt[c]);
              ps += e;
              if (exact_delta) {  // with the float p and dp the gradients use (below, bwd_dkdv_kernel)
                const float dp = static_cast<float>(dps[r * kBlockN + c]) * zt[c];
                const double term = e * dp;
                pd += pick(sr[c] == kNegInf, 0.0, term);
              }
            }
            psum[r] = ps;
            pdp[r] = pd;
          }
        }
        for (int64_t r = 0; r < bm; ++r) {
          const int64_t row = bh * p.Lq + m0 + r;
          if (refine_lse) lse_lo[row] = psum[r] > 0.0 ? static_cast<float>(std::log(psum[r])) : 0.0f;
          // delta of the p the gradients use (renormalised by psum when refine_lse)
          if (exact_delta) delta[row] = static_cast<float>(refine_lse && psum[r] > 0.0 ? pdp[r] / psum[r] : pdp[r]);
        }
      }
      std::fill(dq.begin(), dq.end(), 0.0);
      std::fill(hidden.begin(), hidden.end(), 0.0f);
      if (p.k_nonfinite) {  // the keys past the causal limit of the whole tile
        for (int64_t r = 0; r < bm; ++r) {
          float* hr = hidden.data() + r * D;
          for (int64_t j = n_end; j < p.Lk; ++j) {
            for (int64_t d = 0; d < D; ++d) hr[d] += 0.0f * k[j * D + d];
          }
        }
      }
      for (int64_t n0 = 0; n0 < n_end; n0 += kDqBlockN) {
        const int64_t bn = std::min(kDqBlockN, n_end - n0), n8 = round_up(bn, kColStep);
        pack_rows(k + n0 * D, bn, D, bn, D8, kp.data());
        // this tile's scores and dP (row pitches): kept by the first pass, or computed here
        const double* st = s.data();
        const double* dpt = dps.data();
        int64_t s_pitch = kBlockN, dp_pitch = kBlockN;
        if (keep) {
          st = kept_s.data() + (n0 / kDqBlockN) * kBlockM * kDqBlockN;
          s_pitch = kDqBlockN;
        } else {
          pack_transposed(k + n0 * D, bn, D, n8, kBlockN, kt.data());
          tile_scores(p, b, h, qp.data(), D8, kt.data(), m0, bm, n0, bn, s.data());
        }
        if (keep && exact_delta) {
          dpt = kept_dp.data() + (n0 / kDqBlockN) * kBlockM * kDqBlockN;
          dp_pitch = kDqBlockN;
        } else {
          pack_transposed(v + n0 * D, bn, D, n8, kBlockN, vt.data());
          gemm_abt(dop.data(), D8, vt.data(), kBlockN, D, m4, n8, dps.data(), kBlockN);
        }
        for (int64_t r = 0; r < bm; ++r) {
          const int64_t i = m0 + r;
          const float l = lse[bh * p.Lq + i], l_lo = lse_lo[bh * p.Lq + i], dl = delta[bh * p.Lq + i];
          double* wr = w.data() + r * kBlockN;
          recompute_p(st + r * s_pitch, l, l_lo, bn, pt.data());
          drop_factors(p, b, h, i, n0, bn, zt.data());
          for (int64_t c = 0; c < bn; ++c) {  // (selects, not branches: the mask is data)
            const float pij = pt[c];
            const float z = zt[c];
            const float dp = static_cast<float>(dpt[r * dp_pitch + c]);
            const double ds = pij * (dp * z - dl);
            wr[c] = pick(pij == 0.0f, 0.0, ds);  // 0 where p = 0: 0 * k_j still carries a NaN / Inf of k
          }
        }
        gemm_acc(w.data(), kBlockN, 1, kp.data(), D8, bn, m4, D8, dq.data(), D8);
      }
      for (int64_t r = 0; r < bm; ++r) {
        for (int64_t d = 0; d < D; ++d) {
          const float dqd = static_cast<float>(dq[r * D8 + d] * p.scale);
          dq_out.store(b, h, m0 + r, d, p.k_nonfinite ? dqd + hidden[r * D + d] : dqd);
        }
      }
    }
  });
}

Tensor as_f32(const Tensor& t) { return t.to(at::kFloat).contiguous(); }

bool any_nonfinite(const Tensor& t32) {
  const float* x = t32.const_data_ptr<float>();
  bool bad = false;
  for (int64_t i = 0, n = t32.numel(); i < n; ++i) bad |= !std::isfinite(x[i]);
  return bad;
}

}  // namespace
}  // namespace transformer_fast

#include "cpu_avx2_end.h"

namespace transformer_fast {

Tensor2 attention_fwd_cpu(const Tensor& q, const Tensor& k, const Tensor& v,
                          const std::optional<Tensor>& attn_mask,
                          const std::optional<Tensor>& key_padding_mask, bool is_causal,
                          double scale, double dropout_p, const std::optional<Tensor>& rng,
                          bool allow_tf32) {
  (void)allow_tf32;  // the CPU computes exact fp32 (tf32 is a GPU tensor-core format)
  check_attention_fwd_args(q, k, v, attn_mask, key_padding_mask, scale, dropout_p, rng, at::kCPU);
  check_cpu_avx2();
  Problem p = make_problem(q, k, attn_mask, key_padding_mask, is_causal, scale, dropout_p, rng);
  const Tensor q32 = as_f32(q), k32 = as_f32(k), v32 = as_f32(v);
  p.qk_nonfinite = p.am != nullptr && (any_nonfinite(q32) || any_nonfinite(k32));
  Tensor out = empty_in_layout_of(q, {p.B, p.H, p.Lq, p.D}, q.options());
  Tensor lse = at::empty({p.B, p.H, p.Lq}, q.options().dtype(at::kFloat));
  if (out.numel() > 0) {
    fwd_kernel(p, q32.const_data_ptr<float>(), k32.const_data_ptr<float>(),
               v32.const_data_ptr<float>(), OutView(out), lse.mutable_data_ptr<float>(),
               any_nonfinite(v32));
  }
  return {out, lse};
}

Tensor3 attention_bwd_cpu(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                          const Tensor& out, const Tensor& lse,
                          const std::optional<Tensor>& attn_mask,
                          const std::optional<Tensor>& key_padding_mask, bool is_causal,
                          double scale, double dropout_p, const std::optional<Tensor>& rng,
                          bool allow_tf32) {
  (void)allow_tf32;
  check_attention_bwd_args(dout, q, k, v, out, lse, attn_mask, key_padding_mask, scale, dropout_p,
                           rng, at::kCPU);
  check_cpu_avx2();
  Problem p = make_problem(q, k, attn_mask, key_padding_mask, is_causal, scale, dropout_p, rng);
  const Tensor q32 = as_f32(q), k32 = as_f32(k), v32 = as_f32(v), do32 = as_f32(dout);
  p.q_nonfinite = any_nonfinite(q32);
  p.k_nonfinite = any_nonfinite(k32);
  p.qk_nonfinite = p.am != nullptr && (p.q_nonfinite || p.k_nonfinite);  // as the forward's
  const Tensor lse_c = lse.contiguous();
  // delta_i = rowsum(dO_i * O_i) = sum_j p_ij * dp_ij.  From O as the forward stored it (summed in
  // double) unless the rows are short: O rounded to 16 bits then errs by about as much as the
  // low-precision reference's whole gradient (10-50% of fresh draws failed the oracle at Lk <= 8),
  // and in fp32 with large logits O's rounding still showed (1 in 30 draws at scale 2, Lk <= 40),
  // so the dQ kernel sums p * dp itself (kernels/attention.py: the same cut, 16-bit only).
  // A NaN / Inf value makes the forward's O non-finite in the rows that attend it or hide it
  // (fwd_kernel); rowsum(dO * O) then carries that into dS as the reference's autograd does,
  // where sum_j p_ij * dp_ij over the attended keys would not.
  const bool exact_delta = p.Lk <= kExactDeltaMaxLk && !any_nonfinite(v32);
  Tensor delta = exact_delta
      ? at::empty({p.B, p.H, p.Lq}, q.options().dtype(at::kFloat))
      : do32.to(at::kDouble).mul(out.to(at::kDouble)).sum(-1).to(at::kFloat).contiguous();
  // fp32: the fp32 lse carries |lse| x 2^-24 of error into every recomputed p, where the fp32
  // reference's softmax (exp(s - max) / sum) is exact to a few ulps; with large logits (scale 2,
  // D 64: |lse| ~ 50) 10-50% of fresh draws failed the oracle on grad value.  The dQ kernel first
  // recovers the rounded-away part (one more q.k pass; 16-bit inputs do not need it).
  const bool refine_lse = q.scalar_type() == at::kFloat;
  Tensor lse_lo = at::empty_like(lse_c);
  if (!refine_lse) lse_lo.zero_();
  // Gradients laid out like their inputs (empty_like: the fake's rule), written in place.
  Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  if (q32.numel() > 0) {
    bwd_dq_kernel(p, q32.const_data_ptr<float>(), k32.const_data_ptr<float>(),
                  v32.const_data_ptr<float>(), do32.const_data_ptr<float>(),
                  lse_c.const_data_ptr<float>(), lse_lo.mutable_data_ptr<float>(), refine_lse,
                  delta.mutable_data_ptr<float>(), exact_delta, OutView(dq));
    bwd_dkdv_kernel(p, q32.const_data_ptr<float>(), k32.const_data_ptr<float>(),
                    v32.const_data_ptr<float>(), do32.const_data_ptr<float>(),
                    lse_c.const_data_ptr<float>(), lse_lo.const_data_ptr<float>(),
                    delta.const_data_ptr<float>(), OutView(dk), OutView(dv));
  } else {  // no queries: keys and values get no gradient
    dk.zero_();
    dv.zero_();
  }
  return {dq, dk, dv};
}

TORCH_LIBRARY_IMPL(transformer_fast_C, CPU, m) {
  m.impl("attention_fwd", &attention_fwd_cpu);
  m.impl("attention_bwd", &attention_bwd_cpu);
}

}  // namespace transformer_fast
