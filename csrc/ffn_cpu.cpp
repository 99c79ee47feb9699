// Position-wise FFN building blocks on the CPU: at::mm for the GEMMs, one fused pass for the
// epilogues.  The four primitives and their contract are documented in kernels/ffn.py
// (ffn_linear_fwd, ffn_linear_dgrad, ffn_linear_wgrad, ffn_act_bwd; schemas in registration.cpp).
//
//   forward   relu / none (pre not kept): mm = x @ w^T (at::mm, the BLAS / oneDNN path torch
//             itself uses), then ONE in-place pass over mm that adds the bias, applies the
//             activation and the Philox dropout.  gelu / gelu_tanh (state kept for backward):
//             pre = at::addmm(b, x, w^T), then ONE pass pre -> dropout(act(pre)) that in fp32
//             also replaces pre with act'(pre) (aux_holds_grad).  torch eager makes one more
//             pass (dropout's mask and multiply) and keeps the mask tensor.
//   dgrad     dh = dy @ w (at::mm), then one in-place pass d = dh * act'(pre) * keep * scale.
//   wgrad     dw = dy^T @ x (at::mm), db = sum of dy's rows (own column-sum pass, double
//             accumulators).
//   act_bwd   the same elementwise pass as dgrad's, from dy.
// fp16 GEMMs run in fp32 (cpu_gemm says why); dgrad's pass then reads the fp32 product.  Small
// fp32 GEMMs (<= kExactMaxFlops) are summed in double and rounded once, by small_gemm_f64
// (the weight read in place) where they have few rows or few terms per sum.
// The argument checks shared with ffn_cuda.cu are in ffn_checks.cpp.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/Parallel.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include "ops.h"
#include "philox.h"

namespace transformer_fast {

using at::Tensor;

namespace {

bool present(const std::optional<Tensor>& t) { return t.has_value() && t->defined(); }

}  // namespace

}  // namespace transformer_fast

// Kernels compiled for AVX2/FMA/F16C on x86-64 (csrc/cpu_avx2_begin.h says why).
#include "cpu_avx2_begin.h"

namespace transformer_fast {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kV = Vec::size();
constexpr float kSqrt1_2 = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;
constexpr float kSqrt2OverPi = 0.79788456080286536f;
constexpr float kGeluC = 0.044715f;

struct Drop {
  bool on = false;
  uint64_t seed = 0, offset = 0;
  uint32_t threshold = 0;
  float scale = 1.0f;
};

// out[j] = scale if element first + j is kept, else 0 (csrc/dropout_cpu.h).
void keep_factors(const Drop& dr, uint64_t first, int64_t n, float* out) {
  dropout_factors(dr.seed, dr.offset, first, n, dr.threshold, dr.scale, out);
}

// The standard normal cdf Phi(x) = (1 + erf(x / sqrt2)) / 2, torch's own gelu formula.  erf is
// Sleef's erff u10 on AVX2 (within 1 ulp; what torch.erf computes on AVX-512), not at::vec's
// polynomial .erf(), which errs up to 4.7e-7 (8 ulp near 1) and doubled the worst grad-w1 error
// against the oracle's bound (0.48 -> 0.97 over 300 fp32 draws).  Until 2026-11-29 Phi was
// 1 - erfc(|x| / sqrt2) / 2, free of cancellation for negative x, but Sleef's AVX2 erfc costs
// 15-18 ms per 2M floats on one Xeon core against ~7 for erff: it made the gelu epilogue cost
// more than the GEMM before it (benchmarks/NOTES.md "CPU gelu: erf, not erfc").
inline Vec erf_within_1ulp(Vec x) {
#if defined(CPU_CAPABILITY_AVX2)
  return Vec(Sleef_erff8_u10(x));
#else
  return x.erf();  // generic Vectorized: std::erf per lane
#endif
}

inline Vec normal_cdf_vec(Vec x) {
  return Vec(0.5f) * (Vec(1.0f) + erf_within_1ulp(x * Vec(kSqrt1_2)));
}

inline float normal_cdf_scalar(float x) { return 0.5f * (1.0f + std::erf(x * kSqrt1_2)); }

// tanh(u) from e = exp(-2|u|) (returned in e, which the gradient reuses): (1 - e) / (1 + e) with
// u's sign.  Sleef's AVX2 tanh costs 6.1 ms per 2M floats against 1.4 ms for at::vec's exp.
inline Vec tanh_via_exp(Vec u, Vec& e) {
  e = (Vec(-2.0f) * u.abs()).exp();
  const Vec one(1.0f);
  const Vec t_abs = (one - e) / (one + e);
  return Vec::blendv(t_abs, Vec(0.0f) - t_abs, u < Vec(0.0f));
}

inline Vec act_vec(Vec v, FfnAct act) {
  switch (act) {
    case FfnAct::kRelu: return at::vec::maximum(v, Vec(0.0f));
    case FfnAct::kGelu: return v * normal_cdf_vec(v);
    case FfnAct::kGeluTanh: {
      const Vec u = Vec(kSqrt2OverPi) * (v + Vec(kGeluC) * v * v * v);
      Vec e;
      return Vec(0.5f) * v * (Vec(1.0f) + tanh_via_exp(u, e));
    }
    default: return v;
  }
}

inline float act_scalar(float v, FfnAct act) {
  switch (act) {
    case FfnAct::kRelu: return v < 0.0f ? 0.0f : v;  // NaN stays NaN, as torch.relu
    case FfnAct::kGelu: return v * normal_cdf_scalar(v);
    case FfnAct::kGeluTanh:
      return 0.5f * v * (1.0f + std::tanh(kSqrt2OverPi * (v + kGeluC * v * v * v)));
    default: return v;
  }
}

// act(x) with act'(x) in grad (gelu, gelu_tanh; relu's gradient is taken from y), sharing erf /
// exp between the two.  For gelu_tanh, 1 - tanh(u)^2 is taken as sech^2(u) = 4e / (1 + e)^2 with
// e = exp(-2|u|): 1 - t*t cancels where t -> +-1 (an error of ~1e-7 times x * du/dx ~ 30 at
// |x| ~ 8; measured 2e-6 in fp32, past the oracle's bound).
inline Vec act_and_grad_vec(Vec x, FfnAct act, Vec& grad) {
  const Vec one(1.0f);
  if (act == FfnAct::kGelu) {
    const Vec cdf = normal_cdf_vec(x);
    grad = cdf + x * (Vec(-0.5f) * x * x).exp() * Vec(kInvSqrt2Pi);
    return x * cdf;
  }
  // u rounded as act_vec's, so that y is the same whichever of the two computes it
  const Vec u = Vec(kSqrt2OverPi) * (x + Vec(kGeluC) * x * x * x);
  Vec e;
  const Vec t = tanh_via_exp(u, e);
  const Vec sech2 = Vec(4.0f) * e / ((one + e) * (one + e));
  grad = Vec(0.5f) * (one + t) + Vec(0.5f) * x * sech2 * Vec(kSqrt2OverPi) * (one + Vec(3.0f * kGeluC) * (x * x));
  return Vec(0.5f) * x * (one + t);
}

inline Vec act_grad_vec(Vec x, FfnAct act) {
  Vec grad;
  act_and_grad_vec(x, act, grad);
  return grad;
}

inline float act_grad_scalar(float x, FfnAct act) {
  if (act == FfnAct::kGelu) {
    return normal_cdf_scalar(x) + x * std::exp(-0.5f * x * x) * kInvSqrt2Pi;
  }
  const float u = kSqrt2OverPi * (x + kGeluC * x * x * x);
  const float e = std::exp(-2.0f * std::fabs(u));
  const float t = std::copysign((1.0f - e) / (1.0f + e), u);
  const float sech2 = 4.0f * e / ((1.0f + e) * (1.0f + e));
  return 0.5f * (1.0f + t) + 0.5f * x * sech2 * kSqrt2OverPi * (1.0f + 3.0f * kGeluC * x * x);
}

// The row tails' scalar form of act_and_grad_vec (y exactly as act_scalar computes it).
inline float act_and_grad_scalar(float x, FfnAct act, float& grad) {
  grad = act_grad_scalar(x, act);
  return act_scalar(x, act);
}

// What the saved activation state (linear_fwd's second output, dgrad's and act_bwd's aux) holds
// for gelu / gelu_tanh: in fp32, act'(pre), computed by the forward beside act(pre) from the same
// erf / exp, so backward only multiplies (the gelu' pass cost ~4 ms of a 60 ms fp32 FFN step on
// 2 cores, benchmarks/NOTES.md); in fp16 / bf16, pre itself, as the other backends keep it,
// because act' rounded to 16 bits would be a second rounding the reference does not make.
template <typename T>
constexpr bool aux_holds_grad(FfnAct act) {
  return std::is_same_v<T, float> && (act == FfnAct::kGelu || act == FfnAct::kGeluTanh);
}

// Forward epilogue over mm (M, N) contiguous: pre = mm + b, y = dropout(act(pre)) into y (which
// may be mm itself); when keep_pre, mm becomes the activation state in place (pre, or act'(pre):
// aux_holds_grad; without a bias mm already is pre).  TM: mm's element type, T or (for a 16-bit
// y from the unrounded fp32 GEMM output, which then holds pre already) float.
template <typename T, typename TM = T>
void fwd_epilogue(Tensor& mm, const float* bias, FfnAct act, const Drop& dr, bool keep_pre, Tensor& y) {
  const int64_t M = mm.size(0), N = mm.size(1);
  TM* mp = mm.mutable_data_ptr<TM>();
  T* yp = y.mutable_data_ptr<T>();
  const bool keep_grad = keep_pre && aux_holds_grad<T>(act);
  const bool write_pre = keep_pre && !keep_grad && bias != nullptr;
  TORCH_INTERNAL_ASSERT((std::is_same_v<T, TM>) || !(keep_grad || write_pre), "ffn: an fp32 mm is pre already");
  at::parallel_for(0, M, row_grain(N), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(static_cast<size_t>(N) * 3);
    float* vbuf = buf.data();  // pre (fp32)
    float* obuf = vbuf + N;    // y (fp32)
    float* fbuf = obuf + N;    // dropout factors
    for (int64_t i = begin; i < end; ++i) {
      TM* mrow = mp + i * N;
      T* yrow = yp + i * N;
      const float* in = row_as_float(mrow, N, vbuf);
      if (dr.on) keep_factors(dr, static_cast<uint64_t>(i) * N, N, fbuf);
      float* pre_out = std::is_same_v<TM, float> ? reinterpret_cast<float*>(mrow) : vbuf;
      float* y_out = std::is_same_v<T, float> ? reinterpret_cast<float*>(yrow) : obuf;
      int64_t j = 0;
      for (; j + kV <= N; j += kV) {
        Vec v = Vec::loadu(in + j);
        if (bias) v = v + Vec::loadu(bias + j);
        Vec o;
        if (keep_grad) {
          Vec grad;
          o = act_and_grad_vec(v, act, grad);
          grad.store(pre_out + j);
        } else {
          if (write_pre) v.store(pre_out + j);
          o = act_vec(v, act);
        }
        if (dr.on) o = o * Vec::loadu(fbuf + j);
        o.store(y_out + j);
      }
      for (; j < N; ++j) {
        float v = in[j];
        if (bias) v += bias[j];
        float o;
        if (keep_grad) {
          o = act_and_grad_scalar(v, act, pre_out[j]);
        } else {
          if (write_pre) pre_out[j] = v;
          o = act_scalar(v, act);
        }
        if (dr.on) o *= fbuf[j];
        y_out[j] = o;
      }
      if constexpr (!std::is_same_v<T, float>) {
        if constexpr (std::is_same_v<T, TM>) {
          if (write_pre) at::vec::convert(vbuf, mrow, N);
        }
        at::vec::convert(obuf, yrow, N);
      }
    }
  });
}

// d = g * act'(pre) * keep * scale, row by row; g (M, N) any row stride, in d's dtype or fp32
// (G), d (M, N) contiguous (d may be g itself).  aux: the forward's activation state (gelu /
// gelu_tanh: act'(pre) or pre, see aux_holds_grad) or y (relu), unit column stride.  d32, when
// given for a 16-bit d, receives the same rows before their rounding (for db, see
// dact_with_dbias); it may be g's own fp32 rows (each is read before it is written).
template <typename T, typename G>
void dact_pass(const Tensor& g, const Tensor* aux, FfnAct act, const Drop& dr, Tensor& d, float* d32) {
  const int64_t M = g.size(0), N = g.size(1);
  const int64_t sg = g.stride(0), sa = aux ? aux->stride(0) : 0;
  const G* gp = g.const_data_ptr<G>();
  const T* ap = aux ? aux->const_data_ptr<T>() : nullptr;
  T* dp = d.mutable_data_ptr<T>();
  const bool aux_is_grad = aux_holds_grad<T>(act);
  at::parallel_for(0, M, row_grain(N), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(static_cast<size_t>(N) * 4);
    float* gbuf = buf.data();
    float* abuf = gbuf + N;
    float* fbuf = abuf + N;
    float* obuf = fbuf + N;
    for (int64_t i = begin; i < end; ++i) {
      const float* gr = row_as_float(gp + i * sg, N, gbuf);
      // fp32: straight into d's row (d may be g itself: each vector is read before it is
      // written); 16-bit: through obuf and one conversion.
      float* orow = std::is_same_v<T, float> ? reinterpret_cast<float*>(dp + i * N) : obuf;
      const float* ar = ap ? row_as_float(ap + i * sa, N, abuf) : nullptr;
      const bool mask = dr.on && act != FfnAct::kRelu;  // relu: y > 0 already implies kept
      if (mask) keep_factors(dr, static_cast<uint64_t>(i) * N, N, fbuf);
      int64_t j = 0;
      for (; j + kV <= N; j += kV) {
        Vec v = Vec::loadu(gr + j);
        if (act == FfnAct::kRelu) {
          // y > 0 iff kept and pre > 0; "not y <= 0" lets a NaN pass its gradient (as torch).
          const Vec y = Vec::loadu(ar + j);
          v = Vec::blendv(v * Vec(dr.scale), Vec(0.0f), y <= Vec(0.0f));
        } else {
          if (aux_is_grad) {
            v = v * Vec::loadu(ar + j);
          } else if (act != FfnAct::kNone) {
            v = v * act_grad_vec(Vec::loadu(ar + j), act);
          }
          if (mask) v = v * Vec::loadu(fbuf + j);
        }
        v.store(orow + j);
      }
      for (; j < N; ++j) {
        float v = gr[j];
        if (act == FfnAct::kRelu) {
          v = ar[j] <= 0.0f ? 0.0f : v * dr.scale;
        } else {
          if (aux_is_grad) {
            v *= ar[j];
          } else if (act != FfnAct::kNone) {
            v *= act_grad_scalar(ar[j], act);
          }
          if (mask) v *= fbuf[j];
        }
        orow[j] = v;
      }
      if constexpr (!std::is_same_v<T, float>) {
        at::vec::convert(obuf, dp + i * N, N);
        if (d32) std::copy(obuf, obuf + N, d32 + i * N);
      }
    }
  });
}

// out[j] = sum_i t[i, j] (t: unit column stride), every element added into a double
// accumulator (AVX2: 4 lanes of cvtps_pd + add_pd): db carries only the final rounding.  An fp32
// sum is about as inexact as the reference's own and failed the oracle's 2x bound now and then;
// at::sum with a double accumulator took 56 ms against 8 ms for fp32 at 4096 x 2048 (measured).
template <typename T>
void col_sum_kernel(const Tensor& t, Tensor& out) {
  const int64_t M = t.size(0), N = t.size(1), ld = t.stride(0);
  const T* tp = t.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  at::parallel_for(0, N, 256, [&](int64_t c0, int64_t c1) {
    const int64_t n = c1 - c0;
    std::vector<double> acc(static_cast<size_t>(n), 0.0);
    std::vector<float> rowbuf(static_cast<size_t>(n));
    double* a = acc.data();
    for (int64_t r = 0; r < M; ++r) {
      const float* row = row_as_float(tp + r * ld + c0, n, rowbuf.data());
      int64_t j = 0;
#ifdef TF_CPU_AVX2_PRAGMA
      for (; j + 4 <= n; j += 4) {
        _mm256_storeu_pd(a + j, _mm256_add_pd(_mm256_loadu_pd(a + j), _mm256_cvtps_pd(_mm_loadu_ps(row + j))));
      }
#endif
      for (; j < n; ++j) a[j] += row[j];
    }
    for (int64_t j = 0; j < n; ++j) rowbuf[j] = static_cast<float>(a[j]);
    at::vec::convert(rowbuf.data(), op + c0, n);
  });
}

// out (M, N) = a (M, K) @ b (K, N) (+ bias) for fp32 GEMMs of few rows, every sum in double and
// rounded once (cpu_gemm's exact small GEMMs), without widening b: b is usually a weight of
// K x N >> M x K, and its widened copy (8 bytes an element, written then read) made the call
// 5-10x torch's fp32 linear at M = 2 (a decoding step).  a64 is a's double copy (M x K,
// contiguous); b is read in its fp32 storage, once per block of kMaxRows rows of a, through one of
// two layouts: columns contiguous along K (b = w^T of a row-major weight: dots) or rows contiguous
// along N (axpys).  R rows x C four-wide column vectors of accumulators stay in registers
// (R * C = 8).  Products of fp32 values are exact in double, so an FMA rounds as the separate
// add would; each output is one sum over K in double (the vector lanes' partial sums added at
// the end, in a fixed order).
constexpr int kMaxRows = 4;
// The register blocks' loops fully unrolled before GCC decides where v[R][C] lives (without it,
// every accumulator was stored to the stack on each iteration: 2x slower).
#define TF_UNROLL _Pragma("GCC unroll 8")

#ifdef TF_CPU_AVX2_PRAGMA
inline double hsum(__m256d v) {
  const __m128d lo = _mm256_castpd256_pd128(v), hi = _mm256_extractf128_pd(v, 1);
  const __m128d s = _mm_add_pd(lo, hi);
  return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}
#endif

// Columns n0 .. n0 + C of rows m0 .. m0 + R, dot layout: b column n at b + n * ldb.
template <int R, int C>
void dot_block(const double* a64, int64_t K, const float* b, int64_t ldb, const float* bias, int64_t N,
               int64_t m0, int64_t n0, float* out) {
  double s[R][C] = {};
  int64_t k = 0;
#ifdef TF_CPU_AVX2_PRAGMA
  __m256d v[R][C];
  TF_UNROLL
  for (int r = 0; r < R; ++r)
    TF_UNROLL
    for (int c = 0; c < C; ++c) v[r][c] = _mm256_setzero_pd();
  for (; k + 4 <= K; k += 4) {
    __m256d bk[C];
    TF_UNROLL
    for (int c = 0; c < C; ++c) bk[c] = _mm256_cvtps_pd(_mm_loadu_ps(b + (n0 + c) * ldb + k));
    TF_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m256d ak = _mm256_loadu_pd(a64 + (m0 + r) * K + k);
      TF_UNROLL
      for (int c = 0; c < C; ++c) v[r][c] = _mm256_fmadd_pd(ak, bk[c], v[r][c]);
    }
  }
  TF_UNROLL
  for (int r = 0; r < R; ++r)
    TF_UNROLL
    for (int c = 0; c < C; ++c) s[r][c] = hsum(v[r][c]);
#endif
  for (; k < K; ++k) {
    TF_UNROLL
    for (int r = 0; r < R; ++r) {
      TF_UNROLL
      for (int c = 0; c < C; ++c) s[r][c] = std::fma(a64[(m0 + r) * K + k], b[(n0 + c) * ldb + k], s[r][c]);
    }
  }
  TF_UNROLL
  for (int r = 0; r < R; ++r) {
    TF_UNROLL
    for (int c = 0; c < C; ++c) {
      const double bias_n = bias ? static_cast<double>(bias[n0 + c]) : 0.0;
      out[(m0 + r) * N + n0 + c] = static_cast<float>(s[r][c] + bias_n);
    }
  }
}

// Columns j0 .. j0 + 4 * C of rows m0 .. m0 + R, axpy layout (b row k at b + k * ldb): adds the
// terms k0 <= k < k1 to the running sums acc (column j0 of row m0; rows of pitch lda), or where
// out is given (the last terms), writes the rounded sums + bias there instead.
template <int R, int C>
void axpy_block(const double* a64, int64_t K, const float* b, int64_t ldb, int64_t k0, int64_t k1, int64_t m0,
                int64_t j0, double* acc, int64_t lda, const float* bias, float* out, int64_t N) {
#ifdef TF_CPU_AVX2_PRAGMA
  __m256d v[R][C];
  TF_UNROLL
  for (int r = 0; r < R; ++r)
    TF_UNROLL
    for (int c = 0; c < C; ++c) v[r][c] = k0 > 0 ? _mm256_loadu_pd(acc + r * lda + 4 * c) : _mm256_setzero_pd();
  for (int64_t k = k0; k < k1; ++k) {
    const float* bk = b + k * ldb + j0;
    __m256d bv[C];
    TF_UNROLL
    for (int c = 0; c < C; ++c) bv[c] = _mm256_cvtps_pd(_mm_loadu_ps(bk + 4 * c));
    TF_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m256d ak = _mm256_broadcast_sd(a64 + (m0 + r) * K + k);
      TF_UNROLL
      for (int c = 0; c < C; ++c) v[r][c] = _mm256_fmadd_pd(ak, bv[c], v[r][c]);
    }
  }
  if (out == nullptr) {
    TF_UNROLL
    for (int r = 0; r < R; ++r)
      TF_UNROLL
      for (int c = 0; c < C; ++c) _mm256_storeu_pd(acc + r * lda + 4 * c, v[r][c]);
    return;
  }
  TF_UNROLL
  for (int c = 0; c < C; ++c) {
    const __m256d bias_c = bias ? _mm256_cvtps_pd(_mm_loadu_ps(bias + j0 + 4 * c)) : _mm256_setzero_pd();
    TF_UNROLL
    for (int r = 0; r < R; ++r) {
      _mm_storeu_ps(out + (m0 + r) * N + j0 + 4 * c, _mm256_cvtpd_ps(_mm256_add_pd(v[r][c], bias_c)));
    }
  }
#else
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4 * C; ++j) {
      double s = k0 > 0 ? acc[r * lda + j] : 0.0;
      for (int64_t k = k0; k < k1; ++k) s = std::fma(a64[(m0 + r) * K + k], b[k * ldb + j0 + j], s);
      if (out == nullptr) {
        acc[r * lda + j] = s;
      } else {
        out[(m0 + r) * N + j0 + j] = static_cast<float>(s + (bias ? static_cast<double>(bias[j0 + j]) : 0.0));
      }
    }
  }
#endif
}

// Rows m0 .. m0 + R of out, columns [c0, c1).  Dots: blocks of 8 / R columns, then single ones.
// Axpys: kAxpyRowsK rows of b at a time across all of the task's columns (the running sums of a
// longer K in a double buffer, R x (c1 - c0), in L1), so that b is read in row segments (walking
// each narrow column tile down all K rows, through a new page every row or two, was 1.3x slower
// at M 2, K 2048 -> 512; 16 and 64 rows measured alike).
constexpr int64_t kAxpyRowsK = 16;

template <int R>
void small_gemm_rows(bool dot, const double* a64, int64_t K, const float* b, int64_t ldb, const float* bias,
                     int64_t N, int64_t m0, int64_t c0, int64_t c1, float* out, std::vector<double>& acc) {
  constexpr int C = 8 / R;
  if (dot) {
    int64_t n = c0;
    for (; n + C <= c1; n += C) dot_block<R, C>(a64, K, b, ldb, bias, N, m0, n, out);
    for (; n < c1; ++n) dot_block<R, 1>(a64, K, b, ldb, bias, N, m0, n, out);
    return;
  }
  const int64_t w = c1 - c0;
  if (K > kAxpyRowsK || w % 4 != 0) acc.resize(static_cast<size_t>(R * w));
  for (int64_t k0 = 0; k0 < K; k0 += kAxpyRowsK) {
    const int64_t k1 = std::min(K, k0 + kAxpyRowsK);
    float* last = k1 == K ? out : nullptr;
    int64_t j = c0;
    for (; j + 4 * C <= c1; j += 4 * C) {
      axpy_block<R, C>(a64, K, b, ldb, k0, k1, m0, j, acc.data() + (j - c0), w, bias, last, N);
    }
    for (; j + 4 <= c1; j += 4) axpy_block<R, 1>(a64, K, b, ldb, k0, k1, m0, j, acc.data() + (j - c0), w, bias, last, N);
    for (; j < c1; ++j) {  // the last < 4 columns, one sum at a time
      for (int r = 0; r < R; ++r) {
        double& s = acc[r * w + (j - c0)];
        if (k0 == 0) s = 0.0;
        for (int64_t k = k0; k < k1; ++k) s = std::fma(a64[(m0 + r) * K + k], b[k * ldb + j], s);
        if (last) out[(m0 + r) * N + j] = static_cast<float>(s + (bias ? static_cast<double>(bias[j]) : 0.0));
      }
    }
  }
}

void small_gemm_f64(bool dot, const double* a64, int64_t M, int64_t K, const float* b, int64_t ldb,
                    const float* bias, int64_t N, float* out) {
  // Tasks of 32-column chunks, ~32k FMAs or more each (a column costs M x K).
  const int64_t chunks = std::max<int64_t>(1, 1024 / std::max<int64_t>(M * K, 1));
  at::parallel_for(0, (N + 31) / 32, chunks, [&](int64_t t0, int64_t t1) {
    const int64_t c0 = t0 * 32, c1 = std::min(N, t1 * 32);
    std::vector<double> acc;
    int64_t m = 0;
    for (; m + kMaxRows <= M; m += kMaxRows) small_gemm_rows<kMaxRows>(dot, a64, K, b, ldb, bias, N, m, c0, c1, out, acc);
    if (M - m >= 2) {
      small_gemm_rows<2>(dot, a64, K, b, ldb, bias, N, m, c0, c1, out, acc);
      m += 2;
    }
    if (M - m == 1) small_gemm_rows<1>(dot, a64, K, b, ldb, bias, N, m, c0, c1, out, acc);
  });
}

void run_col_sum(const Tensor& t, Tensor& out) {
  dispatch_float_dtype("ffn", t.scalar_type(), [&](auto tag) { col_sum_kernel<decltype(tag)>(t, out); });
}

void run_fwd_epilogue(Tensor& mm, const float* bias, FfnAct act, const Drop& dr, bool keep_pre, Tensor& y) {
  dispatch_float_dtype("ffn", y.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    if (mm.scalar_type() == at::kFloat) {
      fwd_epilogue<T, float>(mm, bias, act, dr, keep_pre, y);
    } else {
      fwd_epilogue<T>(mm, bias, act, dr, keep_pre, y);
    }
  });
}

void run_dact(const Tensor& g, const Tensor* aux, FfnAct act, const Drop& dr, Tensor& d, float* d32 = nullptr) {
  dispatch_float_dtype("ffn", d.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    if (g.scalar_type() == at::kFloat) {
      dact_pass<T, float>(g, aux, act, dr, d, d32);
    } else {
      dact_pass<T, T>(g, aux, act, dr, d, d32);
    }
  });
}

}  // namespace
}  // namespace transformer_fast

#include "cpu_avx2_end.h"

namespace transformer_fast {
namespace {

Drop make_drop(double p, const std::optional<Tensor>& rng) {
  Drop dr;
  if (p > 0.0) {
    const Tensor r = rng->contiguous();
    const int64_t* v = r.const_data_ptr<int64_t>();
    dr.on = true;
    dr.seed = static_cast<uint64_t>(v[0]);
    dr.offset = static_cast<uint64_t>(v[1]);
    dr.threshold = dropout_threshold(p);
    dr.scale = dropout_scale(p);
  }
  return dr;
}

Tensor empty0(const Tensor& like) { return at::empty({0}, like.options()); }

Tensor unit_cols(const Tensor& t) { return t.size(1) <= 1 || t.stride(1) == 1 ? t : t.contiguous(); }

// Column sums (N,) of t in its dtype (see col_sum_kernel for the accumulation).
Tensor col_sum(const Tensor& t_in) {
  const Tensor t = unit_cols(t_in);
  Tensor out = at::empty({t.size(1)}, t.options());
  if (t.size(0) == 0) return out.zero_();
  if (t.size(1) > 0) run_col_sum(t, out);
  return out;
}

// d = dact(g) (into d, which may be g) and, when asked, db = column sums of d.  For a 16-bit d,
// db sums d's fp32 values before their rounding, so db carries one rounding as in fp32: summing
// the rounded d adds M rounding errors that the low-precision reference's own db does not always
// have, and failed the oracle's 2x bound now and then (fp16, 38 rows, dropout 0.3: 1.03x).
Tensor2 dact_with_dbias(const Tensor& g, const Tensor* aux, FfnAct act, const Drop& dr, Tensor& d,
                        bool want_dbias) {
  if (!want_dbias) {
    run_dact(g, aux, act, dr, d);
    return {d, empty0(d)};
  }
  if (d.scalar_type() == at::kFloat) {
    run_dact(g, aux, act, dr, d);
    return {d, col_sum(d)};
  }
  // An fp32 g with a 16-bit d is our own GEMM output (fp16_gemm): its rows take the fp32 values.
  Tensor d32 = g.scalar_type() == at::kFloat ? g : at::empty(d.sizes(), d.options().dtype(at::kFloat));
  run_dact(g, aux, act, dr, d, d32.mutable_data_ptr<float>());
  return {d, col_sum(d32).to(d.scalar_type())};
}

// a @ b (+ bias on every row) on the CPU.  fp16 runs in fp32: PyTorch's CPU fp16 matmul has no
// fast kernel (1024 x 512 x 2048 measured 3.7 s, against 60 ms in fp32 and 7.6 ms for bf16
// through oneDNN here), and an fp32 accumulation rounded once is what a half GEMM computes
// anyway.  The result is in a's dtype, or for fp16 with keep_fp32 the fp32 product itself.
bool fp16_gemm(const Tensor& a) { return a.scalar_type() == at::kHalf; }

// x @ w^T (+ bias) in fp32 through oneDNN (forward, and dgrad as dy @ (w^T)^T) (the
// mkldnn::_linear_pointwise op PyTorch registers for inductor), or an undefined tensor where that
// does not apply.  Why: PyTorch's fp32 CPU matmul is MKL, and MKL runs its AVX-512 code only on
// Intel CPUs: on an AMD EPYC with full-width AVX-512 it ran AVX2 code (0.16 TFLOP/s on 2 cores),
// and oneDNN's AVX-512 linear took 4.9 ms against MKL's 13.4-15.5 ms at 1024 x 512 -> 2048
// (0.44 TFLOP/s: more than two cores of a Zen 4 can issue, so a Zen 5).  On an Intel Xeon MKL
// itself is the faster one (8.2 ms against 25 ms for the chunks below; the FFN 18 ms on MKL
// against 39 ms on oneDNN, torch 23 ms), and so it is on a Zen 4 EPYC (CPU family 25), whose
// AVX-512 runs on 256-bit units at AVX2's rate: oneDNN 9.8 ms in one piece and 15.6 ms in the
// chunks below against MKL's 10.8.  So the path is taken on AMD CPUs of family 26 (Zen 5) and
// later with AVX-512 only (benchmarks/NOTES.md, FFN).  oneDNN sums K in one sequential chain:
// 2.5x MKL's error there, past the oracle's 2x.  Chunks of kOneDnnK along K added in fp32 measured 2.3e-5
// against MKL's 4.8e-5 (6.6 ms).  Chunks are contiguous copies: on strided views oneDNN fell to
// a path ~2000x slower (measured).  Small GEMMs stay on MKL (a oneDNN call costs tens of
// microseconds).  TRANSFORMER_FAST_CPU_ONEDNN=1 takes the path on any CPU, =0 (or the older
// TRANSFORMER_FAST_CPU_NO_ONEDNN=1) on none.
constexpr int64_t kOneDnnK = 64;
constexpr double kOneDnnMinFlops = 1e8;

#if defined(__x86_64__) || defined(__i386__)
constexpr unsigned kZen5Family = 0x1A;  // Zen 4 is 0x19

// CPUID leaf 1's display family (base family, plus the extended family when the base is 0xF).
unsigned x86_cpu_family() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return 0;
  const unsigned base = (eax >> 8) & 0xFu;
  return base == 0xFu ? base + ((eax >> 20) & 0xFFu) : base;
}
#endif

bool onednn_gemm_wanted() {
  const char* force = std::getenv("TRANSFORMER_FAST_CPU_ONEDNN");
  if (force != nullptr && force[0] != '\0') return std::strcmp(force, "0") != 0;
  if (std::getenv("TRANSFORMER_FAST_CPU_NO_ONEDNN") != nullptr) return false;
#if defined(__x86_64__) || defined(__i386__)
  static const bool amd_full_avx512 =
      __builtin_cpu_is("amd") && __builtin_cpu_supports("avx512f") && x86_cpu_family() >= kZen5Family;
  return amd_full_avx512;
#else
  return false;
#endif
}

const c10::OperatorHandle* onednn_linear_op() {
  static const std::optional<c10::OperatorHandle> op =
      c10::Dispatcher::singleton().findOp({"mkldnn::_linear_pointwise", ""});
  return op.has_value() && onednn_gemm_wanted() ? &*op : nullptr;
}

Tensor onednn_linear_chunk(const c10::OperatorHandle& op, const Tensor& x, const Tensor& w,
                           const std::optional<Tensor>& bias) {
  torch::jit::Stack stack;
  stack.emplace_back(x);
  stack.emplace_back(w);
  stack.emplace_back(present(bias) ? c10::IValue(*bias) : c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<c10::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return std::move(stack[0]).toTensor();
}

Tensor linear_onednn_fp32(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  if (x.scalar_type() != at::kFloat || w.scalar_type() != at::kFloat ||
      (present(bias) && bias->scalar_type() != at::kFloat) ||
      2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K) < kOneDnnMinFlops) {
    return Tensor();
  }
  const c10::OperatorHandle* op = onednn_linear_op();
  if (op == nullptr) return Tensor();
  Tensor out;
  for (int64_t k0 = 0; k0 < K; k0 += kOneDnnK) {
    const int64_t kc = std::min(kOneDnnK, K - k0);
    Tensor part = onednn_linear_chunk(*op, x.narrow(1, k0, kc).contiguous(),
                                      w.narrow(1, k0, kc).contiguous(),
                                      k0 == 0 ? bias : std::nullopt);
    if (k0 == 0) {
      out = part.is_contiguous() ? part : part.contiguous();
    } else {
      out.add_(part);
    }
  }
  return out;
}

// fp32 GEMMs of at most this many flops run in fp64 and round once.  The oracle judges a small
// GEMM on its few largest outputs, each with the rounding of one fp32 reduction chain, against
// torch's own fp32 GEMM of slightly different inputs (its gelu's): two draws of the same random
// error, which a 1-ulp change of any input redraws, and fresh draws put ours past twice torch's
// now and then (slow fuzz finds: x (100, 1), d_ff 1, grad w2 at 1.9x the bound; x (100, 32),
// d_ff 87, grad w2 3.5e-5 against torch's 1.4e-5 for |dW2| up to 65, where both fp32 chains err
// ~2-4 ulps).  In fp64 the sums carry no error of their own; what is left is the shared-rounding
// class of benchmarks/NOTES.md ("The oracle's flakes").  Cost here: 0.02 -> 0.07 ms at 0.56 MFLOP,
// ~0.1 ms more at the 4.2 MFLOP limit; larger GEMMs are as before.
constexpr double kExactMaxFlops = 4.2e6;

// With at most this many rows of a, or terms per sum, the exact small GEMM reads b in place
// (small_gemm_f64) instead of widening both operands to double for at::mm: at M = 2, K = 512,
// N = 2048 (an FFN in a decoding step of batch 2) the widened copies made the call 1.3 ms, ~8x
// torch's fp32 linear, and the weight gradient of 2 rows (K = 2: a 2048 x 512 result widened,
// then narrowed) 3 ms.
constexpr int64_t kExactInPlaceMax = 16;

// The exact small GEMM without widening b, or an undefined tensor where b's layout has no unit
// stride (the caller then widens both operands).
Tensor exact_small_gemm_in_place(const Tensor& a, const Tensor& b, const std::optional<Tensor>& bias) {
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  const bool dot = b.stride(0) == 1, axpy = b.stride(1) == 1;
  if ((M > kExactInPlaceMax && K > kExactInPlaceMax) || K == 0 || b.scalar_type() != at::kFloat || !(dot || axpy) ||
      (present(bias) && bias->scalar_type() != at::kFloat)) {
    return Tensor();
  }
  check_cpu_avx2();
  const Tensor a64 = a.to(at::kDouble).contiguous();
  const Tensor bias_c = present(bias) ? bias->contiguous() : Tensor();
  Tensor out = at::empty({M, N}, a.options());
  small_gemm_f64(dot, a64.const_data_ptr<double>(), M, K, b.const_data_ptr<float>(), dot ? b.stride(1) : b.stride(0),
                 bias_c.defined() ? bias_c.const_data_ptr<float>() : nullptr, N, out.mutable_data_ptr<float>());
  return out;
}

// Whether a (M, K) @ (K, n) is a small GEMM: <= kExactMaxFlops.
bool small_gemm(const Tensor& a, int64_t n) {
  return 2.0 * static_cast<double>(a.size(0)) * static_cast<double>(a.size(1)) * static_cast<double>(n) <= kExactMaxFlops;
}

// Whether cpu_gemm(a, b) with b of n columns sums in double (kExactMaxFlops says why).
bool exact_gemm(const Tensor& a, int64_t n) { return a.scalar_type() == at::kFloat && small_gemm(a, n); }

// a @ b (+ bias) for 16-bit a, b: the fp32 product, unrounded.
Tensor gemm_in_fp32(const Tensor& a, const Tensor& b, const std::optional<Tensor>& bias) {
  const Tensor a32 = a.to(at::kFloat), b32 = b.to(at::kFloat);
  return present(bias) ? at::addmm(bias->to(at::kFloat), a32, b32) : at::mm(a32, b32);
}

Tensor cpu_gemm(const Tensor& a, const Tensor& b, const std::optional<Tensor>& bias = std::nullopt,
                bool keep_fp32 = false) {
  if (exact_gemm(a, b.size(1))) {
    if (Tensor out = exact_small_gemm_in_place(a, b, bias); out.defined()) return out;
    const Tensor a64 = a.to(at::kDouble), b64 = b.to(at::kDouble);
    return (present(bias) ? at::addmm(bias->to(at::kDouble), a64, b64) : at::mm(a64, b64)).to(at::kFloat);
  }
  if (!fp16_gemm(a)) return present(bias) ? at::addmm(*bias, a, b) : at::mm(a, b);
  Tensor r = gemm_in_fp32(a, b, bias);
  return keep_fp32 ? r : r.to(a.scalar_type());
}

// Whether the forward of 16-bit x (M, K) against N outputs reads its GEMM's fp32 product: fp16
// (its GEMM runs in fp32 anyway, cpu_gemm) and bf16 GEMMs of <= kExactMaxFlops.  The epilogue
// then rounds y = dropout(act(pre)) once, as the Triton epilogue does from its accumulator,
// instead of after pre's own rounding (torch rounds after its linear, act and dropout).  With
// few outputs the oracle's bound (twice the bf16 reference's largest error) is set by a handful
// of roundings: x (1, 16), d_ff 24, relu, dropout 0.1 missed it on grad w2 in 16 of 4000 draws
// with pre rounded first, 0 with one rounding (worst 1.75x -> 0.85x the bound; a float64 model
// of this path, benchmarks/NOTES.md).  Larger bf16 GEMMs keep oneDNN's bf16 path (2x fp32's
// speed), and so do weights of more than kWidenMaxWeight elements: their fp32 copy would cost
// more than a GEMM of a few rows (a decoding step's 2048 x 512 weight: ~1M conversions).
constexpr int64_t kWidenMaxWeight = int64_t{1} << 16;
bool forward_from_fp32(const Tensor& x, int64_t n) {
  return fp16_gemm(x) ||
         (x.scalar_type() == at::kBFloat16 && x.size(1) * n <= kWidenMaxWeight && small_gemm(x, n));
}

}  // namespace

Tensor2 ffn_linear_fwd_cpu(const Tensor& x, const Tensor& w, const std::optional<Tensor>& b,
                           c10::string_view activation, double dropout_p,
                           const std::optional<Tensor>& rng, bool store_pre, bool allow_tf32) {
  (void)allow_tf32;  // no tf32 on the CPU
  check_ffn_linear_fwd_args(x, w, b, c10::DeviceType::CPU);
  const FfnAct act = parse_ffn_activation(activation);
  check_ffn_dropout(dropout_p, rng, x);
  check_cpu_avx2();
  const int64_t M = x.size(0), N = w.size(0);
  if (M == 0 || N == 0 || x.size(1) == 0) {
    // at::mm of an empty reduction is zeros; the epilogue still adds the bias.
    Tensor mm = at::zeros({M, N}, x.options());
    Tensor y = store_pre ? at::empty({M, N}, x.options()) : mm;
    if (M > 0 && N > 0) {
      const Tensor b32 = present(b) ? b->to(at::kFloat).contiguous() : Tensor();
      run_fwd_epilogue(mm, b32.defined() ? b32.const_data_ptr<float>() : nullptr, act,
                       make_drop(dropout_p, rng), store_pre, y);
    }
    return {y, store_pre ? mm : empty0(x)};
  }
  const Drop dr = make_drop(dropout_p, rng);
  if (forward_from_fp32(x, N)) {
    Tensor mm32 = gemm_in_fp32(x, w.t(), b);  // (M, N) fp32, the bias added: pre, unrounded
    Tensor y = at::empty({M, N}, x.options());
    run_fwd_epilogue(mm32, nullptr, act, dr, false, y);
    return {y, store_pre ? mm32.to(x.scalar_type()) : empty0(x)};  // 16-bit state: pre itself
  }
  if (store_pre) {
    // pre is kept (gelu): the GEMM adds the bias (addmm writes pre once) and the one pass reads
    // pre and writes y (and, in fp32, act'(pre) over pre).  Adding the bias in the pass instead
    // would write pre twice (measured ~5 ms slower than torch's linear + gelu at 4096 x 2048 fp32).
    Tensor pre = linear_onednn_fp32(x, w, b);  // (M, N)
    if (!pre.defined()) pre = cpu_gemm(x, w.t(), b);
    if (!pre.is_contiguous()) pre = pre.contiguous();
    Tensor y = at::empty({M, N}, x.options());
    run_fwd_epilogue(pre, nullptr, act, dr, true, y);
    return {y, pre};
  }
  // Nothing kept but y: the GEMM adds the bias (addmm, as torch's linear), then one in-place
  // pass over mm applies the activation and the dropout, and no pass when there is neither.
  // (Until 2026-12-01 fp32 GEMMs on MKL left the bias to that pass, to save addmm's copy of it:
  // A/B on a Zen 4 EPYC, no difference above the noise in the FFN, and linear2 then made a pass
  // for its bias alone; benchmarks/NOTES.md, FFN.)
  Tensor mm = linear_onednn_fp32(x, w, b);  // (M, N), the bias added
  if (!mm.defined()) mm = cpu_gemm(x, w.t(), b);  // (M, N), contiguous
  if (!mm.is_contiguous()) mm = mm.contiguous();
  if (act != FfnAct::kNone || dr.on) run_fwd_epilogue(mm, nullptr, act, dr, false, mm);
  return {mm, empty0(x)};
}

Tensor2 ffn_linear_dgrad_cpu(const Tensor& dy, const Tensor& w, const std::optional<Tensor>& aux,
                             c10::string_view activation, double dropout_p,
                             const std::optional<Tensor>& rng, bool want_dbias, bool allow_tf32) {
  (void)allow_tf32;
  check_ffn_dgrad_args(dy, w, c10::DeviceType::CPU);
  const FfnAct act = parse_ffn_activation(activation);
  const int64_t M = dy.size(0), N = w.size(1);
  check_ffn_aux(aux, act, M, N, dy, c10::DeviceType::CPU);
  check_ffn_dropout(dropout_p, rng, dy);
  check_cpu_avx2();
  const bool dact = (act != FfnAct::kNone || dropout_p > 0.0) && M > 0 && N > 0;
  const bool empty = dy.size(1) == 0 || M == 0 || N == 0;
  // fp16 with an activation / dropout: act' and the mask apply to the fp32 GEMM output (one
  // rounding, in place of two) and d is written once, in fp16.
  Tensor g = empty ? at::zeros({M, N}, dy.options()) : linear_onednn_fp32(dy, w.t(), std::nullopt);
  if (!g.defined()) g = cpu_gemm(dy, w, std::nullopt, dact);
  if (!g.is_contiguous()) g = g.contiguous();
  if (dact) {
    const Tensor a = act != FfnAct::kNone ? unit_cols(*aux) : Tensor();
    Tensor d = g.scalar_type() == dy.scalar_type() ? g : at::empty({M, N}, dy.options());
    return dact_with_dbias(g, a.defined() ? &a : nullptr, act, make_drop(dropout_p, rng), d, want_dbias);
  }
  return {g, want_dbias ? col_sum(g) : empty0(dy)};
}

Tensor2 ffn_linear_wgrad_cpu(const Tensor& dy, const Tensor& x, bool want_dbias, bool allow_tf32) {
  (void)allow_tf32;
  check_ffn_wgrad_args(dy, x, c10::DeviceType::CPU);
  const int64_t M = dy.size(0), N = dy.size(1), K = x.size(1);
  Tensor dw = (M == 0 || N == 0 || K == 0) ? at::zeros({N, K}, dy.options()) : cpu_gemm(dy.t(), x);
  if (!dw.is_contiguous()) dw = dw.contiguous();
  return {dw, want_dbias ? col_sum(dy) : empty0(dy)};
}

Tensor2 ffn_act_bwd_cpu(const Tensor& dy, const std::optional<Tensor>& aux,
                        c10::string_view activation, double dropout_p,
                        const std::optional<Tensor>& rng, bool want_dbias) {
  check_ffn_act_bwd_args(dy, c10::DeviceType::CPU);
  const FfnAct act = parse_ffn_activation(activation);
  const int64_t M = dy.size(0), N = dy.size(1);
  check_ffn_aux(aux, act, M, N, dy, c10::DeviceType::CPU);
  check_ffn_dropout(dropout_p, rng, dy);
  check_cpu_avx2();
  Tensor d = at::empty({M, N}, dy.options());
  if (M > 0 && N > 0) {
    const Tensor g = unit_cols(dy);
    const Tensor a = act != FfnAct::kNone ? unit_cols(*aux) : Tensor();
    return dact_with_dbias(g, a.defined() ? &a : nullptr, act, make_drop(dropout_p, rng), d, want_dbias);
  }
  return {d, want_dbias ? col_sum(d) : empty0(dy)};
}

// The dropout factors (keep / (1 - p), or 0) of elements first_index .. first_index + n - 1 of
// the stream rng = [seed, offset]: the CPU kernels' own generator, for the tests, which cannot
// reach element indices past 2^34 (the counter's high word) through a real tensor.
Tensor dropout_factors_cpu(const Tensor& rng, int64_t first_index, int64_t n, double dropout_p) {
  TORCH_CHECK(rng.scalar_type() == at::kLong && rng.numel() == 2,
              "dropout_factors: rng must be an int64 [seed, offset] pair");
  TORCH_CHECK(first_index >= 0 && n >= 0, "dropout_factors: first_index and n must be >= 0, got ", first_index,
              " and ", n);
  TORCH_CHECK(dropout_p > 0.0 && dropout_p < 1.0, "dropout_factors: dropout_p must be in (0, 1), got ", dropout_p);
  check_cpu_avx2();
  Tensor out = at::empty({n}, rng.options().dtype(at::kFloat));
  keep_factors(make_drop(dropout_p, rng), static_cast<uint64_t>(first_index), n, out.mutable_data_ptr<float>());
  return out;
}

TORCH_LIBRARY_IMPL(transformer_fast_C, CPU, m) {
  m.impl("dropout_factors", &dropout_factors_cpu);
  m.impl("ffn_linear_fwd", &ffn_linear_fwd_cpu);
  m.impl("ffn_linear_dgrad", &ffn_linear_dgrad_cpu);
  m.impl("ffn_linear_wgrad", &ffn_linear_wgrad_cpu);
  m.impl("ffn_act_bwd", &ffn_act_bwd_cpu);
}

}  // namespace transformer_fast
