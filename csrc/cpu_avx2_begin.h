// Opens the AVX2 code region of a C++ CPU kernel file; csrc/cpu_avx2_end.h closes it.
//
// at::vec::Vectorized<float> is only truly vectorised when the translation unit is compiled for
// a CPU capability (PyTorch builds its kernels once per capability); the default build of an
// extension is baseline x86-64, where the generic Vectorized compiles to scalar code through
// the stack (measured: ~5x slower here).  So on x86-64 the kernels between the two headers are
// compiled for AVX2+FMA+F16C via a target pragma, in at::vec's own AVX2 namespace, and the op
// entry points call check_cpu_avx2() (cpu_avx2_end.h) at run time before calling them.
//
// Include it after every torch header (nothing shared with other translation units may be
// compiled for AVX2), at file scope, once per file; everything it defines has internal linkage.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(__x86_64__) && !defined(__AVX2__) && (defined(__GNUC__) || defined(__clang__))
#define TF_CPU_AVX2_PRAGMA 1
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#pragma GCC diagnostic ignored "-Wpsabi"  // __m256 by value in header-internal inline helpers
// The ISA macros the headers test (Sleef declares its AVX2 entry points only under them); they
// are true inside this region and undefined again right after the include.
#define __AVX__ 1
#define __AVX2__ 1
#define __FMA__ 1
#define __F16C__ 1
#endif
#include <ATen/cpu/vec/vec.h>
#ifdef TF_CPU_AVX2_PRAGMA
#undef __AVX__
#undef __AVX2__
#undef __FMA__
#undef __F16C__
#endif

#include "dropout_cpu.h"  // inside the AVX2 target region

namespace transformer_fast {
namespace {

// A row sum in fp32 vector lanes, flushed into a double every kFlush vectors: a plain fp32
// running sum over a 64k-wide row drifted past the oracle's bound (measured on add_layer_norm's
// dweight); the flush costs nothing measurable.
struct RowSum {
  using Vec = at::vec::Vectorized<float>;
  static constexpr int kFlush = 32;
  Vec acc{0.0f};
  double total = 0.0;
  int pending = 0;
  void add(const Vec& v) {
    acc = acc + v;
    if (++pending == kFlush) flush();
  }
  void add_product(const Vec& a, const Vec& b) {
    acc = at::vec::fmadd(a, b, acc);
    if (++pending == kFlush) flush();
  }
  void flush() {
    total += at::vec::vec_reduce_all([](Vec& u, Vec& v) { return u + v; }, acc);
    acc = Vec(0.0f);
    pending = 0;
  }
  double value() {
    flush();
    return total;
  }
};

// A row sum in double lanes, for add_layer_norm's mean and variance (and masked_softmax's
// backward delta), where one ulp matters: with
// a large common offset in a row (mean / std ~1e4) RowSum's fp32 lanes put the mean an ulp off,
// shifting every xhat of the row (up to 3.7x past the oracle's bound), where the reference's
// cascaded fp32 sum does not.  Two conversions and two adds per vector (AVX2); these passes are
// bound by memory.
struct RowSumD {
  using Vec = at::vec::Vectorized<float>;
#ifdef CPU_CAPABILITY_AVX2
  __m256d lo, hi;
  // (a written constructor: an implicit one would be compiled without the AVX2 target)
  RowSumD() : lo(_mm256_setzero_pd()), hi(_mm256_setzero_pd()) {}
  void add(const Vec& v) {
    const __m256 f = v;
    lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(f)));
    hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1)));
  }
  // sum of v * v, the squares exact in double.
  void add_square(const Vec& v) {
    const __m256 f = v;
    const __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(f));
    const __m256d b = _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1));
    lo = _mm256_fmadd_pd(a, a, lo);
    hi = _mm256_fmadd_pd(b, b, hi);
  }
  // sum of a * b, the products exact in double.
  void add_product(const Vec& a, const Vec& b) {
    const __m256 fa = a, fb = b;
    lo = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(fa)),
                         _mm256_cvtps_pd(_mm256_castps256_ps128(fb)), lo);
    hi = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(fa, 1)),
                         _mm256_cvtps_pd(_mm256_extractf128_ps(fb, 1)), hi);
  }
  double value() const {
    alignas(32) double t[4];
    _mm256_store_pd(t, _mm256_add_pd(lo, hi));
    return (t[0] + t[1]) + (t[2] + t[3]);
  }
#else
  static constexpr int kN = Vec::size();
  double acc[kN] = {};
  void add(const Vec& v) {
    alignas(64) float t[kN];
    v.store(t);
    for (int i = 0; i < kN; ++i) acc[i] += t[i];
  }
  void add_square(const Vec& v) {
    alignas(64) float t[kN];
    v.store(t);
    for (int i = 0; i < kN; ++i) acc[i] += static_cast<double>(t[i]) * t[i];
  }
  void add_product(const Vec& a, const Vec& b) {
    alignas(64) float ta[kN], tb[kN];
    a.store(ta);
    b.store(tb);
    for (int i = 0; i < kN; ++i) acc[i] += static_cast<double>(ta[i]) * tb[i];
  }
  double value() const {
    double total = 0.0;
    for (int i = 0; i < kN; ++i) total += acc[i];
    return total;
  }
#endif
};

// The fp32 / fp16 / bf16 dispatch of the CPU kernels (inputs checked before): a light
// AT_DISPATCH without double; `op` names the op in the error.
template <typename F>
void dispatch_float_dtype(const char* op, c10::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kHalf: f(c10::Half{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    default: TORCH_CHECK(false, op, ": unsupported dtype ", t);
  }
}

// A row of T as fp32: the row itself for float, else converted into buf.
template <typename T>
const float* row_as_float(const T* src, int64_t n, float* buf) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    at::vec::convert(src, buf, n);
    return buf;
  }
}

// fp32 -> T: a vectorised copy, or rounding to half / bf16.
template <typename T>
void store_row(const float* src, T* dst, int64_t n) {
  at::vec::convert(src, dst, n);
}

// Rows per at::parallel_for task for rows of n elements: ~64 KiB of row data at least, so that
// small problems are not split across threads.
inline int64_t row_grain(int64_t n) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)); }

}  // namespace
}  // namespace transformer_fast
