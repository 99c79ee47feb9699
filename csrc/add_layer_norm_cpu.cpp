// Fused residual-add (+ dropout) + LayerNorm on the CPU: forward and backward.
//
// Layout: x, residual, dy, dh are (M, N) with unit column stride and any row stride.  Rows are
// split across threads with at::parallel_for; each row is first gathered into a per-thread fp32
// buffer (the row then sits in L1/L2), so the statistics are an exact two-pass mean/variance in
// fp32 without touching memory twice.  All arithmetic is fp32, vectorised with
// at::vec::Vectorized<float>; fp16/bf16 rows are converted on load/store.
//
// The argument checks shared with the CUDA backend are in add_layer_norm_checks.cpp.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "philox.h"

namespace transformer_fast {
using at::Tensor;
}  // namespace transformer_fast

// Kernels compiled for AVX2/FMA/F16C on x86-64 (csrc/cpu_avx2_begin.h says why).
#include "cpu_avx2_begin.h"

namespace transformer_fast {
namespace {

using Vec = at::vec::Vectorized<float>;

constexpr int64_t kV = Vec::size();

// h = r + x (* m) into hbuf; returns sum(h).
double residual_add(const float* x, const float* r, const float* m, float* h, int64_t n) {
  RowSumD s;
  int64_t j = 0;
  for (; j + kV <= n; j += kV) {
    Vec a = Vec::loadu(x + j);
    if (m) a = a * Vec::loadu(m + j);
    a = a + Vec::loadu(r + j);
    a.store(h + j);
    s.add(a);
  }
  double tail = 0.0;
  for (; j < n; ++j) {
    h[j] = r[j] + (m ? x[j] * m[j] : x[j]);
    tail += h[j];
  }
  return s.value() + tail;
}

// sum((h - mean)^2), exact two-pass on the cached row, the mean being mu + mu_lo (see
// normalize_row): centred on mu alone, a row whose mean is far from fp32's grid against its
// spread (2^-15 off at 1000 for a spread of 2^-13) had its variance inflated by mu_lo^2.
template <bool kLo>
double centered_sq_sum(const float* h, float mu, float mu_lo, int64_t n) {
  const Vec vm(mu), vlo(mu_lo);
  RowSumD s;
  int64_t j = 0;
  for (; j + kV <= n; j += kV) {
    Vec d = Vec::loadu(h + j) - vm;
    if constexpr (kLo) d = d - vlo;
    s.add_square(d);
  }
  double tail = 0.0;
  for (; j < n; ++j) {
    const double d = kLo ? (h[j] - mu) - mu_lo : h[j] - mu;
    tail += d * d;
  }
  return s.value() + tail;
}

// Non-temporal (streaming) stores for fp32 output rows when the op moves more bytes than the
// last-level cache holds: the output would leave the cache before anyone reads it, and a
// streaming store skips the read for ownership of each line (one of the forward's four memory
// streams).  Below that size the output stays cached for the next op, as a plain store keeps it.
bool stream_output(int64_t bytes_moved) {
  // Linux's sysfs size of the L3 (a VM's own view: glibc's sysconf reported the host's 320 MiB
  // on a VM that has 32 MiB), else 32 MiB.
  static const int64_t llc = [] {
    long long kib = 0;
    if (FILE* f = std::fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r")) {
      if (std::fscanf(f, "%lldK", &kib) != 1) kib = 0;
      std::fclose(f);
    }
    return kib > 0 ? static_cast<int64_t>(kib) << 10 : int64_t{32} << 20;
  }();
  return bytes_moved > llc;
}

inline void store_vec(float* p, const Vec& v, bool stream) {
#ifdef TF_CPU_AVX2_PRAGMA
  if (stream && reinterpret_cast<uintptr_t>(p) % 32 == 0) {
    _mm256_stream_ps(p, v);
    return;
  }
#endif
  v.store(p);
}

inline void stream_fence(bool stream) {
#ifdef TF_CPU_AVX2_PRAGMA
  if (stream) _mm_sfence();  // the streamed lines are visible before the threads join
#endif
}

struct Params {
  const float* w;  // fp32 copies, nullptr when absent
  const float* b;
};

// y = (h - mean) * rstd (* w) (+ b) for one row (by-value arguments: see bwd_row).  With kLo the
// mean is mu + mu_lo: mu is the saved fp32 mean, mu_lo what rounding the double mean to it
// dropped.  h - mu is exact where h is within a factor 2 of mu, so a row whose mean is large
// against its spread (where mu's rounding, times rstd, shifts every output by ulps or more)
// keeps its mean to ~2^-48 instead of to half an ulp (benchmarks/NOTES.md, "The modules under a
// fuzzer").
template <bool kLo>
inline void normalize_row(const float* h, const float* w, const float* b, float mu, float mu_lo,
                          float rs, int64_t N, float* y, bool stream) {
  const Vec vmu(mu), vlo(mu_lo), vrs(rs);
  int64_t j = 0;
  for (; j + kV <= N; j += kV) {
    Vec v = Vec::loadu(h + j) - vmu;
    if constexpr (kLo) v = v - vlo;
    v = v * vrs;
    if (w) v = v * Vec::loadu(w + j);
    if (b) v = v + Vec::loadu(b + j);
    store_vec(y + j, v, stream);
  }
  for (; j < N; ++j) {
    float v = kLo ? ((h[j] - mu) - mu_lo) * rs : (h[j] - mu) * rs;
    if (w) v *= w[j];
    if (b) v += b[j];
    y[j] = v;
  }
}

template <typename T>
void fwd_kernel(const Tensor& x, const Tensor& r, Params p, double eps, double dropout_p,
                const int64_t* rng, Tensor& y, Tensor* h_out, Tensor& mean, Tensor& rstd) {
  const int64_t M = x.size(0), N = x.size(1);
  const int64_t sx = x.stride(0), sr = r.stride(0);
  const T* xp = x.const_data_ptr<T>();
  const T* rp = r.const_data_ptr<T>();
  T* yp = y.mutable_data_ptr<T>();
  T* hp = h_out ? h_out->mutable_data_ptr<T>() : nullptr;
  float* meanp = mean.mutable_data_ptr<float>();
  float* rstdp = rstd.mutable_data_ptr<float>();
  const bool drop = dropout_p > 0.0;
  const uint64_t seed = drop ? static_cast<uint64_t>(rng[0]) : 0;
  const uint64_t offset = drop ? static_cast<uint64_t>(rng[1]) : 0;
  const uint32_t threshold = dropout_threshold(dropout_p);
  const float scale = dropout_scale(dropout_p);
  const bool stream = std::is_same_v<T, float> && stream_output(M * N * 3 * sizeof(T));
  at::parallel_for(0, M, row_grain(N), [&](int64_t begin, int64_t end) {
    const bool reduced = !std::is_same_v<T, float>;
    std::vector<float> buf(static_cast<size_t>(N) * (2 + (reduced ? 2 : 0) + (drop ? 1 : 0)));
    float* hbuf = buf.data();
    float* ybuf = hbuf + N;
    float* xbuf = ybuf + N;
    float* rbuf = reduced ? xbuf + N : nullptr;
    float* mbuf = drop ? (reduced ? rbuf + N : xbuf) : nullptr;
    for (int64_t i = begin; i < end; ++i) {
      const float* xf = row_as_float(xp + i * sx, N, xbuf);
      const float* rf = row_as_float(rp + i * sr, N, rbuf);
      if (drop) dropout_factors(seed, offset, static_cast<uint64_t>(i) * N, N, threshold, scale, mbuf);
      const double mean = residual_add(xf, rf, mbuf, hbuf, N) / N;
      const float mu = static_cast<float>(mean);
      const float mu_lo = static_cast<float>(mean - mu);
      double var = centered_sq_sum<false>(hbuf, mu, mu_lo, N) / N;
      float rs = static_cast<float>(1.0 / std::sqrt(var + eps));
      // Rows where mu's rounding shows at fp32's resolution (|mean| a few times the spread or
      // more): centred on mu + mu_lo (on mu alone the variance also gained mu_lo^2); the others,
      // nearly every row of a network's activations, skip the extra subtractions.
      const bool far = std::abs(mu_lo) * rs > 0x1p-26f;
      if (far) {
        var = centered_sq_sum<true>(hbuf, mu, mu_lo, N) / N;
        rs = static_cast<float>(1.0 / std::sqrt(var + eps));
      }
      meanp[i] = mu;
      rstdp[i] = rs;
      // fp32 output rows are written in place; others go through ybuf and one conversion.
      float* yrow = ybuf;
      if constexpr (std::is_same_v<T, float>) yrow = yp + i * N;
      if (far) {
        normalize_row<true>(hbuf, p.w, p.b, mu, mu_lo, rs, N, yrow, stream);
      } else {
        normalize_row<false>(hbuf, p.w, p.b, mu, mu_lo, rs, N, yrow, stream);
      }
      if constexpr (!std::is_same_v<T, float>) store_row(ybuf, yp + i * N, N);
      if (hp) store_row(hbuf, hp + i * N, N);
    }
    stream_fence(stream);
  });
}

// dw[j..j+kV) += dy * xh and db[j..j+kV) += dy in double (dw or db may be null): the products
// are exact, and each column adds its rows one after the other in row order.
//
// Where this runs was measured (4096 x 1024 fp32, benchmarks/NOTES.md): in the pass that streams
// the row in from memory it costs ~0.3 ms on 2 threads; in the second pass, or staged through
// block buffers for a separate update in registers (the previous design), 0.8-1.4 ms, because
// the extra stores pushed the row out of L1 before the second pass read it again.
inline void accumulate_param_grads(const Vec& d, const Vec& xh, double* dw, double* db) {
#ifdef TF_CPU_AVX2_PRAGMA
  static_assert(kV == 8, "two halves of four doubles");
  const __m256 d8 = d, xh8 = xh;
  const __m256d dlo = _mm256_cvtps_pd(_mm256_castps256_ps128(d8));
  const __m256d dhi = _mm256_cvtps_pd(_mm256_extractf128_ps(d8, 1));
  if (dw) {
    const __m256d xlo = _mm256_cvtps_pd(_mm256_castps256_ps128(xh8));
    const __m256d xhi = _mm256_cvtps_pd(_mm256_extractf128_ps(xh8, 1));
    _mm256_storeu_pd(dw, _mm256_fmadd_pd(dlo, xlo, _mm256_loadu_pd(dw)));
    _mm256_storeu_pd(dw + 4, _mm256_fmadd_pd(dhi, xhi, _mm256_loadu_pd(dw + 4)));
  }
  if (db) {
    _mm256_storeu_pd(db, _mm256_add_pd(_mm256_loadu_pd(db), dlo));
    _mm256_storeu_pd(db + 4, _mm256_add_pd(_mm256_loadu_pd(db + 4), dhi));
  }
#else
  float dv[kV], xv[kV];
  d.store(dv);
  xh.store(xv);
  for (int64_t k = 0; k < kV; ++k) {
    if (dw) dw[k] += static_cast<double>(dv[k]) * xv[k];  // exact product: as the FMA rounds
    if (db) db[k] += dv[k];
  }
#endif
}

// One row of the backward.  Everything is a by-value argument so that it stays in registers
// across the intrinsic stores, which may alias anything (the lambda's captures were reloaded
// from memory after each one).
inline void bwd_row(const float* xf, const float* rf, const float* dyf, const float* m,
                    const float* dhf, const float* w, float mu, float rs, int64_t N, float* orow,
                    float* dxrow, double* dwp, double* dbp, bool stream) {
  const Vec vmu(mu), vrs(rs);
  // Pass 1: xhat = (r + x*m - mean) * rstd and g = dy*w: sum(g), sum(g*xhat), sum(xhat), and
  // the row's dweight / dbias terms.
  RowSum sg, sgx, sx;
  int64_t j = 0;
  for (; j + kV <= N; j += kV) {
    Vec hv = Vec::loadu(xf + j);
    if (m) hv = hv * Vec::loadu(m + j);
    const Vec xh = (hv + Vec::loadu(rf + j) - vmu) * vrs;
    const Vec d = Vec::loadu(dyf + j);
    const Vec gv = w ? d * Vec::loadu(w + j) : d;
    if (dwp || dbp) accumulate_param_grads(d, xh, dwp ? dwp + j : nullptr, dbp ? dbp + j : nullptr);
    sg.add(gv);
    sgx.add_product(gv, xh);
    sx.add(xh);
  }
  double sum_g = sg.value(), sum_gx = sgx.value(), sum_x = sx.value();
  for (; j < N; ++j) {
    const float xh = (rf[j] + (m ? xf[j] * m[j] : xf[j]) - mu) * rs;
    const float gv = w ? dyf[j] * w[j] : dyf[j];
    if (dwp) dwp[j] += static_cast<double>(dyf[j]) * xh;
    if (dbp) dbp[j] += dyf[j];
    sum_g += gv;
    sum_gx += static_cast<double>(gv) * xh;
    sum_x += xh;
  }
  // Pass 2: dresidual = rstd * (g - a - (xhat - xbar) * b) (+ dh), dx = dresidual * m, with
  // a = mean(g), b = mean(g * (xhat - xbar)).  xbar = mean(xhat) is 0 in exact arithmetic; the
  // computed xhat carries the fp32 mean's rounding e as a shift e * rstd shared by the whole row,
  // which the usual formula turns into a first-order error of dresidual (the reference's
  // autograd re-centres its result and does not).  Where |mean| >> the row's spread (a 2-wide
  // row of two close values) that error was up to 12x the oracle's bound in 6% of fresh draws;
  // centring xhat removes it.  Rounding a and xbar to fp32 would shift every element alike
  // again (the exact result sums to zero): off is that shift, from the double sums.
  const double xbar = sum_x / N, a_d = sum_g / N, b_d = sum_gx / N - xbar * a_d;
  const float a = static_cast<float>(a_d), b = static_cast<float>(b_d);
  const float xbar_f = static_cast<float>(xbar);
  const float off = static_cast<float>((a_d - a) - b * (xbar - xbar_f));
  const Vec va(a), vb(b), vxbar(xbar_f), voff(off);
  // dweight = sum over rows of dy * (xhat - xbar): pass 1 added dy * xhat, so rows whose shift
  // matters (|xbar| above 2^-24, where |mean| is about twice the spread or more) take back
  // dy * xbar here; below that it is under the sums' own rounding.
  const bool unshift_dw = dwp != nullptr && std::abs(xbar) > 0x1p-24;
  const Vec vneg_xbar(-xbar_f);
  j = 0;
  for (; j + kV <= N; j += kV) {
    Vec hv = Vec::loadu(xf + j);
    if (m) hv = hv * Vec::loadu(m + j);
    const Vec xh = (hv + Vec::loadu(rf + j) - vmu) * vrs;
    const Vec d = Vec::loadu(dyf + j);
    const Vec gv = w ? d * Vec::loadu(w + j) : d;
    Vec v = (gv - va - (xh - vxbar) * vb - voff) * vrs;
    if (unshift_dw) accumulate_param_grads(d, vneg_xbar, dwp + j, nullptr);
    if (dhf) v = v + Vec::loadu(dhf + j);
    store_vec(orow + j, v, stream);
    if (dxrow) store_vec(dxrow + j, v * Vec::loadu(m + j), stream);
  }
  // The tail in double, rounded once (a row narrower than a vector is all tail): a 7-wide fp32
  // row's six roundings here (two more for dh and dx) put single elements of size ~8 two ulps
  // off, 1.07x the oracle's bound at `verify --seed 1105801729`; fresh 2-wide draws without
  // dropout missed 28 -> 11 times in 3000 (benchmarks/NOTES.md "... backward's tail in double").
  for (; j < N; ++j) {
    const float xh = (rf[j] + (m ? xf[j] * m[j] : xf[j]) - mu) * rs;
    const float gv = w ? dyf[j] * w[j] : dyf[j];
    double vd = (gv - a_d - (xh - xbar) * b_d) * rs;
    if (unshift_dw) dwp[j] -= static_cast<double>(dyf[j]) * xbar_f;
    if (dhf) vd += dhf[j];
    orow[j] = static_cast<float>(vd);
    if (dxrow) dxrow[j] = static_cast<float>(vd * m[j]);
  }
}

template <typename T>
void bwd_kernel(const Tensor& dy, const Tensor* dh, const Tensor& x, const Tensor& r, Params p,
                const Tensor& mean, const Tensor& rstd, double dropout_p, const int64_t* rng,
                Tensor* dx, Tensor& dres, double* dw_part, double* db_part, int64_t groups) {
  const int64_t M = x.size(0), N = x.size(1);
  const int64_t sx = x.stride(0), sr = r.stride(0), sdy = dy.stride(0);
  const int64_t sdh = dh ? dh->stride(0) : 0;
  const T* xp = x.const_data_ptr<T>();
  const T* rp = r.const_data_ptr<T>();
  const T* dyp = dy.const_data_ptr<T>();
  const T* dhp = dh ? dh->const_data_ptr<T>() : nullptr;
  const float* meanp = mean.const_data_ptr<float>();
  const float* rstdp = rstd.const_data_ptr<float>();
  T* dxp = dx ? dx->mutable_data_ptr<T>() : nullptr;
  T* drp = dres.mutable_data_ptr<T>();
  const bool drop = dropout_p > 0.0;
  const uint64_t seed = drop ? static_cast<uint64_t>(rng[0]) : 0;
  const uint64_t offset = drop ? static_cast<uint64_t>(rng[1]) : 0;
  const uint32_t threshold = dropout_threshold(dropout_p);
  const float scale = dropout_scale(dropout_p);
  constexpr bool kFloat = std::is_same_v<T, float>;
  const bool stream = kFloat && stream_output(M * N * 4 * sizeof(T));

  // Fixed row groups (one partial dweight/dbias row each), summed in a fixed order afterwards:
  // deterministic for a given thread count, no atomics.
  at::parallel_for(0, groups, 1, [&](int64_t gbegin, int64_t gend) {
    // Per-row fp32 scratch: x, residual, dy, dh as fp32 (16-bit dtypes), the dropout factors,
    // the outputs before their conversion (16-bit).
    std::vector<float> buf(static_cast<size_t>(N) * 7);
    float* xbuf = buf.data();
    float* rbuf = xbuf + N;
    float* dybuf = rbuf + N;
    float* dhbuf = dybuf + N;
    float* mbuf = dhbuf + N;
    float* obuf = mbuf + N;    // dresidual
    float* dxbuf = obuf + N;   // dx
    for (int64_t g = gbegin; g < gend; ++g) {
      double* dwp = dw_part ? dw_part + g * N : nullptr;
      double* dbp = db_part ? db_part + g * N : nullptr;
      if (dwp) std::fill(dwp, dwp + N, 0.0);
      if (dbp) std::fill(dbp, dbp + N, 0.0);
      const int64_t rbegin = M * g / groups, rend = M * (g + 1) / groups;
      for (int64_t i = rbegin; i < rend; ++i) {
        const float* xf = row_as_float(xp + i * sx, N, xbuf);
        const float* rf = row_as_float(rp + i * sr, N, rbuf);
        const float* dyf = row_as_float(dyp + i * sdy, N, dybuf);
        const float* m = drop ? mbuf : nullptr;
        if (drop) dropout_factors(seed, offset, static_cast<uint64_t>(i) * N, N, threshold, scale, mbuf);
        const float* dhf = dhp ? row_as_float(dhp + i * sdh, N, dhbuf) : nullptr;
        float* orow = kFloat ? reinterpret_cast<float*>(drp + i * N) : obuf;
        float* dxrow = dxp ? (kFloat ? reinterpret_cast<float*>(dxp + i * N) : dxbuf) : nullptr;
        bwd_row(xf, rf, dyf, m, dhf, p.w, meanp[i], rstdp[i], N, orow, dxrow, dwp, dbp, stream);
        if constexpr (!kFloat) {
          store_row(obuf, drp + i * N, N);
          if (dxp) store_row(dxbuf, dxp + i * N, N);
        }
      }
    }
    stream_fence(stream);
  });
}

// out[j] = sum_g part[g, j] in a fixed order, written in out's dtype.
void reduce_partials(const double* part, int64_t groups, int64_t N, Tensor& out) {
  dispatch_float_dtype("add_layer_norm", out.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, N, 4096, [&](int64_t begin, int64_t end) {
      std::vector<double> acc(static_cast<size_t>(end - begin), 0.0);
      for (int64_t g = 0; g < groups; ++g) {
        const double* src = part + g * N + begin;
        for (int64_t j = 0; j < end - begin; ++j) acc[j] += src[j];
      }
      std::vector<float> acc32(acc.begin(), acc.end());
      at::vec::convert(acc32.data(), o + begin, end - begin);
    });
  });
}

// Non-template launchers, defined inside the target region (so the kernels instantiate there).
void run_fwd(const Tensor& x, const Tensor& r, Params p, double eps, double dropout_p,
             const int64_t* rng, Tensor& y, Tensor* h_out, Tensor& mean, Tensor& rstd) {
  dispatch_float_dtype("add_layer_norm", x.scalar_type(), [&](auto tag) {
    fwd_kernel<decltype(tag)>(x, r, p, eps, dropout_p, rng, y, h_out, mean, rstd);
  });
}

void run_bwd(const Tensor& dy, const Tensor* dh, const Tensor& x, const Tensor& r, Params p,
             const Tensor& mean, const Tensor& rstd, double dropout_p, const int64_t* rng,
             Tensor* dx, Tensor& dres, double* dw_part, double* db_part, int64_t groups) {
  dispatch_float_dtype("add_layer_norm", x.scalar_type(), [&](auto tag) {
    bwd_kernel<decltype(tag)>(dy, dh, x, r, p, mean, rstd, dropout_p, rng, dx, dres, dw_part,
                              db_part, groups);
  });
}

}  // namespace
}  // namespace transformer_fast

#include "cpu_avx2_end.h"

namespace transformer_fast {
namespace {

bool has(const std::optional<Tensor>& t) { return t.has_value() && t->defined(); }

Tensor as_float_param(const std::optional<Tensor>& t) {
  if (!has(t)) return Tensor();
  return t->to(at::kFloat).contiguous();
}

Tensor empty0(const Tensor& like) { return at::empty({0}, like.options()); }

}  // namespace

Tensor4 add_layer_norm_fwd_cpu(const Tensor& x, const Tensor& residual,
                               const std::optional<Tensor>& weight,
                               const std::optional<Tensor>& bias, double eps, double dropout_p,
                               const std::optional<Tensor>& rng, bool prenorm) {
  check_add_layer_norm_fwd_args(x, residual, weight, bias, eps, dropout_p, rng, c10::DeviceType::CPU);
  check_cpu_avx2();
  const int64_t M = x.size(0), N = x.size(1);
  Tensor y = at::empty({M, N}, x.options());
  Tensor h = prenorm ? at::empty({M, N}, x.options()) : empty0(x);
  Tensor mean = at::empty({M}, x.options().dtype(at::kFloat));
  Tensor rstd = at::empty({M}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) {
    if (N == 0) {  // LayerNorm of an empty row: mean 0, variance 0
      mean.fill_(0.0);
      rstd.fill_(1.0 / std::sqrt(eps));
    }
    return {y, h, mean, rstd};
  }
  const Tensor w32 = as_float_param(weight), b32 = as_float_param(bias);
  const Params p{w32.defined() ? w32.const_data_ptr<float>() : nullptr,
                 b32.defined() ? b32.const_data_ptr<float>() : nullptr};
  Tensor rng_c = dropout_p > 0.0 ? rng->contiguous() : Tensor();
  const int64_t* rngp = rng_c.defined() ? rng_c.const_data_ptr<int64_t>() : nullptr;
  run_fwd(x, residual, p, eps, dropout_p, rngp, y, prenorm ? &h : nullptr, mean, rstd);
  return {y, h, mean, rstd};
}

Tensor4 add_layer_norm_bwd_cpu(const Tensor& dy, const std::optional<Tensor>& dh,
                               const Tensor& x, const Tensor& residual,
                               const std::optional<Tensor>& weight,
                               const std::optional<Tensor>& bias, const Tensor& mean,
                               const Tensor& rstd, double dropout_p,
                               const std::optional<Tensor>& rng) {
  check_add_layer_norm_bwd_args(dy, dh, x, residual, weight, bias, mean, rstd, dropout_p, rng,
                                c10::DeviceType::CPU);
  check_cpu_avx2();
  const int64_t M = x.size(0), N = x.size(1);
  const bool drop = dropout_p > 0.0;
  Tensor dres = at::empty({M, N}, x.options());
  Tensor dx = drop ? at::empty({M, N}, x.options()) : empty0(x);
  Tensor dw = has(weight) ? at::empty({N}, weight->options()) : empty0(x);
  Tensor db = has(bias) ? at::empty({N}, bias->options()) : empty0(x);
  if (M == 0 || N == 0) {
    dw.zero_();
    db.zero_();
    return {dx, dres, dw, db};
  }
  const Tensor w32 = as_float_param(weight);
  const Params p{w32.defined() ? w32.const_data_ptr<float>() : nullptr, nullptr};
  Tensor rng_c = drop ? rng->contiguous() : Tensor();
  const int64_t* rngp = rng_c.defined() ? rng_c.const_data_ptr<int64_t>() : nullptr;
  const Tensor mean_c = mean.contiguous(), rstd_c = rstd.contiguous();
  const int64_t groups = std::max<int64_t>(1, std::min<int64_t>(M, at::get_num_threads()));
  std::vector<double> dw_buf(has(weight) ? static_cast<size_t>(groups * N) : 0);
  std::vector<double> db_buf(has(bias) ? static_cast<size_t>(groups * N) : 0);
  double* dw_part = has(weight) ? dw_buf.data() : nullptr;
  double* db_part = has(bias) ? db_buf.data() : nullptr;
  const Tensor* dhp = has(dh) ? &*dh : nullptr;
  run_bwd(dy, dhp, x, residual, p, mean_c, rstd_c, dropout_p, rngp, drop ? &dx : nullptr, dres,
          dw_part, db_part, groups);
  if (dw_part) reduce_partials(dw_part, groups, N, dw);
  if (db_part) reduce_partials(db_part, groups, N, db);
  return {dx, dres, dw, db};
}

TORCH_LIBRARY_IMPL(transformer_fast_C, CPU, m) {
  m.impl("add_layer_norm_fwd", &add_layer_norm_fwd_cpu);
  m.impl("add_layer_norm_bwd", &add_layer_norm_bwd_cpu);
}

}  // namespace transformer_fast
