// Fused scale + mask + softmax (+ dropout) on the CPU: the `cpu` backend of
// transformer_fast.functional.masked_softmax, forward and backward.
//
// Contract (identical to the Triton launchers; docstring of kernels/masked_softmax.py):
//   masked_softmax_fwd(scores, mask?, scale, is_causal, dropout_p, rng?) -> (out, probs)
//   masked_softmax_bwd(dout, probs, scale, dropout_p, rng?) -> dscores
// scores / dout / probs (B, H, Lq, Lk) fp32/fp16/bf16, any strides with unit last stride (else
// copied); on the CPU also float64 scores, whose outputs are fp32 (the cpu attention's exact fp32
// path: ops/cpu_attention.py); mask (B, H, Lq, Lk) read through all four strides (stride-0 dims of an expanded mask
// included), bool True = takes part, float added after scaling; top-left causal.  Outputs are
// contiguous.  A row with nothing allowed (or only -inf) is zeros; NaN / +inf scores give a NaN
// row, as in the reference.  Dropout keeps element ((b*H + h)*Lq + i)*Lk + j iff its Philox word
// (philox.h) is >= the threshold; kept values are scaled by 1/(1-p).
//
// Algorithm, one row at a time (rows split over threads with at::parallel_for; every row is
// independent, so the result does not depend on the thread count):
//   forward   pass 1  s = scores * scale, masked (-inf) / + float mask, into a per-thread fp32
//                     buffer (the row then sits in L1/L2), and its max m;
//             pass 2  e = exp(s - m) in place and l = sum(e) (fp32 lanes flushed to double);
//             pass 3  p = e / l (zeros when l == 0: a dead row), dropout, store.
//             float64 scores: passes 1 and 2 in double, each p rounded to fp32 once.
//             Entries past the causal diagonal are neither read nor computed.
//   backward  dp = dout (* keep / (1-p)); delta = sum(dp * probs); ds = scale * probs * (dp - delta),
//             delta and ds in double.
// fp32 arithmetic otherwise, vectorised with at::vec::Vectorized<float> (AVX2 on x86-64, see below).
//
// The argument checks shared with masked_softmax_cuda.cu are in masked_softmax.h.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "masked_softmax.h"
#include "ops.h"
#include "philox.h"

// Kernels compiled for AVX2/FMA/F16C on x86-64 (csrc/cpu_avx2_begin.h says why).
#include "cpu_avx2_begin.h"

namespace transformer_fast {
namespace {

using at::Tensor;
using Vec = at::vec::Vectorized<float>;

constexpr int64_t kV = Vec::size();
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

enum MaskKind : int { kMaskNone = 0, kMaskBool = 1, kMaskFloat = 2 };

struct FwdArgs {
  const void* s;  // scores, (B, H, Lq, Lk) with unit last stride
  int64_t s_sb, s_sh, s_sm;
  const void* am;  // mask or nullptr
  c10::ScalarType am_type;
  int kind;
  int64_t am_sb, am_sh, am_sm, am_sn;
  void* out;    // (B, H, Lq, Lk) contiguous
  void* probs;  // idem, only with dropout
  int64_t H, Lq, Lk;
  float scale;
  double scale_d;  // the same, unrounded (float64 scores are scaled in double)
  bool causal;
  bool drop;
  uint64_t seed, offset;
  uint32_t threshold;
  float drop_scale;
};

struct BwdArgs {
  const void* dout;
  int64_t d_sb, d_sh, d_sm;
  const void* probs;
  int64_t p_sb, p_sh, p_sm;
  void* ds;  // contiguous
  int64_t H, Lq, Lk;
  double scale_d;
  bool drop;
  uint64_t seed, offset;
  uint32_t threshold;
  float drop_scale;
};

// Element offset of the start of row `row` (= (b*H + h)*Lq + i) in a tensor with strides
// (sb, sh, sm, 1).
inline int64_t row_offset(int64_t row, int64_t H, int64_t Lq, int64_t sb, int64_t sh, int64_t sm) {
  const int64_t i = row % Lq, bh = row / Lq;
  return (bh / H) * sb + (bh % H) * sh + i * sm;
}

// The mask's entries [0, n) of one row as fp32: 1/0 (takes part / removed) for a bool mask, the
// additive value for a float one.  A contiguous fp32 mask row is used in place.
const float* mask_row(const FwdArgs& a, int64_t row, int64_t n, float* buf) {
  const int64_t off = row_offset(row, a.H, a.Lq, a.am_sb, a.am_sh, a.am_sm);
  const int64_t sn = a.am_sn;
  auto gather = [&](auto* m) {
    if (sn == 1 && a.kind == kMaskFloat) {
      at::vec::convert(m, buf, n);
    } else if (sn == 1) {  // bool, contiguous: bytes 0/1 -> 0.f/1.f (a loop the compiler vectorises)
      const uint8_t* u = reinterpret_cast<const uint8_t*>(m);
      for (int64_t j = 0; j < n; ++j) buf[j] = static_cast<float>(u[j] != 0);
    } else if (sn == 0) {  // one value along the row (e.g. a (B, H, Lq, 1) mask expanded)
      const float v = a.kind == kMaskBool ? (m[0] ? 1.0f : 0.0f) : static_cast<float>(m[0]);
      std::fill(buf, buf + n, v);
    } else {
      for (int64_t j = 0; j < n; ++j) {
        const auto v = m[j * sn];
        buf[j] = a.kind == kMaskBool ? (v ? 1.0f : 0.0f) : static_cast<float>(v);
      }
    }
    return static_cast<const float*>(buf);
  };
  switch (a.am_type) {
    case at::kBool: return gather(static_cast<const bool*>(a.am) + off);
    case at::kHalf: return gather(static_cast<const c10::Half*>(a.am) + off);
    case at::kBFloat16: return gather(static_cast<const c10::BFloat16*>(a.am) + off);
    default: {  // float32 (float64 masks are converted on the host)
      const float* m = static_cast<const float*>(a.am) + off;
      return sn == 1 ? m : gather(m);
    }
  }
}

// Pass 1 of a row: s = x * scale, masked (-inf where a bool mask is 0, + a float mask), into
// `s`; returns the row max (NaN if any).  S = float for fp32 / 16-bit scores, double for float64
// ones (the mask row then converted to double).
template <typename S>
inline S scale_mask_max(int kind, const S* x, const S* m, int64_t n, S* s, S scale) {
  using VecS = at::vec::Vectorized<S>;
  constexpr int64_t kVS = VecS::size();
  constexpr S kNegInfS = -std::numeric_limits<S>::infinity();
  const VecS vscale(scale), vninf(kNegInfS), vzero(S(0));
  VecS vmax(kNegInfS);
  int64_t j = 0;
  for (; j + kVS <= n; j += kVS) {
    VecS v = VecS::loadu(x + j) * vscale;
    if (kind == kMaskBool) {
      v = VecS::blendv(vninf, v, VecS::loadu(m + j) != vzero);
    } else if (kind == kMaskFloat) {
      v = v + VecS::loadu(m + j);
    }
    v.store(s + j);
    vmax = at::vec::maximum(vmax, v);  // propagates NaN
  }
  S mx = at::vec::vec_reduce_all([](VecS& u, VecS& v) { return at::vec::maximum(u, v); }, vmax);
  for (; j < n; ++j) {
    S v = x[j] * scale;
    if (kind == kMaskBool) {
      v = m[j] != S(0) ? v : kNegInfS;
    } else if (kind == kMaskFloat) {
      v += m[j];
    }
    s[j] = v;
    mx = (v > mx || v != v) ? v : mx;
  }
  return mx;
}

// The probabilities of a row of float64 scores (fp32 attention's q.k summed in double by the
// caller), the whole softmax in double (scale, masks, max, exp, sum), each p rounded to fp32 once
// into `s`.  A score of ~60 rounded to fp32 before its max is subtracted moves its p by up to
// 60 x 2^-24, and an fp32 exp and sum add a few ulps more: either is as much as the fp32
// reference's own error (the flash kernel keeps its scores in double for the same reason).
// Returns the factor pass 3 applies to `s`: 1, or NaN for a NaN row (a NaN or +inf score).
inline float softmax_row_double(const FwdArgs& a, const double* x, const float* m, int64_t n,
                                float* s, double* d, double* md) {
  using VecD = at::vec::Vectorized<double>;
  constexpr int64_t kVD = VecD::size();
  constexpr double kNegInfD = -std::numeric_limits<double>::infinity();
  if (m != nullptr) at::vec::convert(m, md, n);
  const double mx = scale_mask_max<double>(a.kind, x, md, n, d, a.scale_d);
  const double shift = mx == kNegInfD ? 0.0 : mx;  // a dead row: exp(-inf) = 0 everywhere
  const VecD vshift(shift);
  VecD vsum(0.0);
  int64_t j = 0;
  for (; j + kVD <= n; j += kVD) {
    const VecD e = (VecD::loadu(d + j) - vshift).exp();
    e.store(d + j);
    vsum = vsum + e;
  }
  double l = at::vec::vec_reduce_all([](VecD& u, VecD& v) { return u + v; }, vsum);
  for (; j < n; ++j) {
    d[j] = std::exp(d[j] - shift);
    l += d[j];
  }
  const double inv = l == 0.0 ? 0.0 : 1.0 / l;
  const VecD vinv(inv);
  for (j = 0; j + kVD <= n; j += kVD) (VecD::loadu(d + j) * vinv).store(d + j);
  for (; j < n; ++j) d[j] *= inv;
  at::vec::convert(d, s, n);
  return l != l ? std::numeric_limits<float>::quiet_NaN() : 1.0f;
}

// TIn: the scores' type; T: the outputs' (TIn itself, or float for float64 scores).
template <typename TIn, typename T>
void fwd_rows(const FwdArgs& a, int64_t begin, int64_t end) {
  constexpr bool kDoubleScores = std::is_same_v<TIn, double>;
  const int64_t Lk = a.Lk;
  std::vector<float> buf(static_cast<size_t>(2 * Lk));
  float* s = buf.data();   // the row: scores -> masked scaled scores -> exp -> probabilities
  float* mb = s + Lk;      // the mask row, then the dropout factors
  std::vector<double> dbuf(kDoubleScores ? static_cast<size_t>(2 * Lk) : 0);  // the row; the mask
  const TIn* scores = static_cast<const TIn*>(a.s);
  T* out = static_cast<T*>(a.out);
  T* probs = static_cast<T*>(a.probs);

  for (int64_t row = begin; row < end; ++row) {
    const int64_t i = row % a.Lq;
    // Top-left causal: query i sees keys j <= i; entries j >= n are removed.
    const int64_t n = a.causal ? std::min(Lk, i + 1) : Lk;
    const TIn* x = scores + row_offset(row, a.H, a.Lq, a.s_sb, a.s_sh, a.s_sm);
    const float* m = a.kind != kMaskNone ? mask_row(a, row, n, mb) : nullptr;

    float inv;  // pass 3's factor
    if constexpr (kDoubleScores) {
      inv = softmax_row_double(a, x, m, n, s, dbuf.data(), dbuf.data() + Lk);
    } else {
      // pass 1: s = x * scale, masked; the row max
      const float mx = scale_mask_max<float>(a.kind, row_as_float(x, n, s), m, n, s, a.scale);

      // pass 2: e = exp(s - m), l = sum(e).  A dead row has m = -inf: shift by 0 instead, so
      // that exp gives 0 everywhere (never exp(-inf + inf) = NaN) and l = 0.  A NaN or +inf
      // score makes l NaN, and the whole row NaN, like the reference.
      const float shift = mx == kNegInf ? 0.0f : mx;
      const Vec vshift(shift);
      RowSum sum;
      int64_t j = 0;
      for (; j + kV <= n; j += kV) {
        const Vec e = (Vec::loadu(s + j) - vshift).exp();
        e.store(s + j);
        sum.add(e);
      }
      double l = sum.value();
      for (; j < n; ++j) {
        s[j] = std::exp(s[j] - shift);
        l += s[j];
      }
      inv = l == 0.0 ? 0.0f : static_cast<float>(1.0 / l);
    }

    // pass 3: p = e * inv (+ dropout).  Entries past the causal diagonal are exp(-inf) * inv:
    // 0, or NaN in a NaN row (as the reference's 0 / NaN; dropout keeps NaN * 0 = NaN too).
    const Vec vinv(inv);
    const T tail(0.0f * inv);
    T* orow = out + row * Lk;
    if (!a.drop && std::is_same_v<T, float>) {
      float* o = reinterpret_cast<float*>(orow);
      int64_t j = 0;
      for (; j + kV <= n; j += kV) (Vec::loadu(s + j) * vinv).store(o + j);
      for (; j < n; ++j) o[j] = s[j] * inv;
    } else {
      int64_t j = 0;
      for (; j + kV <= n; j += kV) (Vec::loadu(s + j) * vinv).store(s + j);
      for (; j < n; ++j) s[j] *= inv;
      if (a.drop) {
        store_row(s, probs + row * Lk, n);
        std::fill(probs + row * Lk + n, probs + (row + 1) * Lk, tail);
        dropout_factors(a.seed, a.offset, static_cast<uint64_t>(row) * Lk, n, a.threshold,
                        a.drop_scale, mb);
        j = 0;
        for (; j + kV <= n; j += kV) (Vec::loadu(s + j) * Vec::loadu(mb + j)).store(s + j);
        for (; j < n; ++j) s[j] *= mb[j];
      }
      store_row(s, orow, n);
    }
    std::fill(orow + n, orow + Lk, tail);
  }
}

template <typename T>
void bwd_rows(const BwdArgs& a, int64_t begin, int64_t end) {
  const int64_t Lk = a.Lk;
  std::vector<float> buf(static_cast<size_t>(3 * Lk));
  float* pbuf = buf.data();
  float* dbuf = pbuf + Lk;
  float* fbuf = dbuf + Lk;  // dropout factors; then dscores
  const T* dout = static_cast<const T*>(a.dout);
  const T* probs = static_cast<const T*>(a.probs);
  T* ds = static_cast<T*>(a.ds);

  for (int64_t row = begin; row < end; ++row) {
    const float* p = row_as_float(probs + row_offset(row, a.H, a.Lq, a.p_sb, a.p_sh, a.p_sm), Lk, pbuf);
    const float* d = row_as_float(dout + row_offset(row, a.H, a.Lq, a.d_sb, a.d_sh, a.d_sm), Lk, dbuf);
    if (a.drop) {  // dp = dout * keep / (1 - p), the forward's mask regenerated
      dropout_factors(a.seed, a.offset, static_cast<uint64_t>(row) * Lk, Lk, a.threshold,
                      a.drop_scale, fbuf);
      int64_t j = 0;
      for (; j + kV <= Lk; j += kV) (Vec::loadu(d + j) * Vec::loadu(fbuf + j)).store(dbuf + j);
      for (; j < Lk; ++j) dbuf[j] = d[j] * fbuf[j];
      d = dbuf;
    }
    // delta and ds in double, rounded once: where dp ~ delta, an fp32 delta's rounding is as
    // large as the difference (the fp32 attention's peaked rows missed the oracle by it).
    // delta is taken over the saved probabilities' own sum: rounded, they sum to 1 +- a few
    // ulps, and sum(p * dp) alone then carries that excess times dp's common part into every ds
    // (the in-memory attention's peaked rows with dropout missed by up to 8x).  Divided by
    // sum(p), delta is exact for a constant dp, as the true gradient's (dp + c gives the same ds).
    RowSumD sum, psum;
    int64_t j = 0;
    for (; j + kV <= Lk; j += kV) {
      const Vec pv = Vec::loadu(p + j);
      sum.add_product(Vec::loadu(d + j), pv);
      psum.add(pv);
    }
    double delta = sum.value(), total = psum.value();
    for (; j < Lk; ++j) {
      delta += static_cast<double>(d[j]) * p[j];
      total += p[j];
    }
    if (total > 0.0) delta /= total;  // (a dead row's p are 0: its ds stays 0 * (dp - delta))
    float* o = std::is_same_v<T, float> ? reinterpret_cast<float*>(ds + row * Lk) : fbuf;
    for (j = 0; j < Lk; ++j) {  // (vectorised by the compiler: no reduction)
      o[j] = static_cast<float>(a.scale_d * (static_cast<double>(p[j]) * (static_cast<double>(d[j]) - delta)));
    }
    if constexpr (!std::is_same_v<T, float>) store_row(fbuf, ds + row * Lk, Lk);
  }
}

// Non-template launchers, defined inside the target region (so the kernels instantiate there).
void run_fwd(const FwdArgs& a, c10::ScalarType dtype, int64_t M) {
  if (dtype == at::kDouble) {
    at::parallel_for(0, M, row_grain(a.Lk), [&](int64_t begin, int64_t end) {
      fwd_rows<double, float>(a, begin, end);
    });
    return;
  }
  dispatch_float_dtype("masked_softmax", dtype, [&](auto tag) {
    at::parallel_for(0, M, row_grain(a.Lk), [&](int64_t begin, int64_t end) {
      fwd_rows<decltype(tag), decltype(tag)>(a, begin, end);
    });
  });
}

void run_bwd(const BwdArgs& a, c10::ScalarType dtype, int64_t M) {
  dispatch_float_dtype("masked_softmax", dtype, [&](auto tag) {
    at::parallel_for(0, M, row_grain(a.Lk), [&](int64_t begin, int64_t end) {
      bwd_rows<decltype(tag)>(a, begin, end);
    });
  });
}

}  // namespace
}  // namespace transformer_fast

#include "cpu_avx2_end.h"

namespace transformer_fast {
namespace {

Tensor unit_last(const Tensor& t) { return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous(); }

// [seed, offset] from a CPU int64 tensor.
void read_rng(const std::optional<Tensor>& rng, uint64_t& seed, uint64_t& offset) {
  const Tensor r = rng->reshape({-1}).contiguous();
  const int64_t* v = r.const_data_ptr<int64_t>();
  seed = static_cast<uint64_t>(v[0]);
  offset = static_cast<uint64_t>(v[1]);
}

}  // namespace

Tensor2 masked_softmax_fwd_cpu(TF_MASKED_SOFTMAX_FWD_ARGS) {
  // float64 scores (the cpu attention's exact fp32 path) give fp32 outputs.
  check_masked_softmax_fwd_args(scores, mask, scale, dropout_p, rng, c10::DeviceType::CPU,
                                /*double_scores_ok=*/true);
  check_cpu_avx2();
  const int64_t B = scores.size(0), H = scores.size(1), Lq = scores.size(2), Lk = scores.size(3);
  const bool drop = dropout_p > 0.0;
  const auto options = scores.scalar_type() == at::kDouble ? scores.options().dtype(at::kFloat)
                                                           : scores.options();
  Tensor out = at::empty({B, H, Lq, Lk}, options);
  Tensor probs = drop ? at::empty({B, H, Lq, Lk}, options) : at::empty({0}, options);
  const int64_t M = B * H * Lq;
  if (M == 0 || Lk == 0) return {out, probs};

  const Tensor s = unit_last(scores);
  FwdArgs a{};
  a.s = s.const_data_ptr();
  a.s_sb = s.stride(0), a.s_sh = s.stride(1), a.s_sm = s.stride(2);
  a.kind = kMaskNone;
  Tensor m;
  if (mask.has_value() && mask->defined()) {
    m = mask->scalar_type() == at::kDouble ? mask->to(at::kFloat) : *mask;
    a.am = m.const_data_ptr();
    a.am_type = m.scalar_type();
    a.kind = a.am_type == at::kBool ? kMaskBool : kMaskFloat;
    a.am_sb = m.stride(0), a.am_sh = m.stride(1), a.am_sm = m.stride(2), a.am_sn = m.stride(3);
  }
  a.out = out.mutable_data_ptr();
  a.probs = drop ? probs.mutable_data_ptr() : nullptr;
  a.H = H, a.Lq = Lq, a.Lk = Lk;
  a.scale = static_cast<float>(scale);
  a.scale_d = scale;
  a.causal = is_causal;
  a.drop = drop;
  if (drop) {
    read_rng(rng, a.seed, a.offset);
    a.threshold = dropout_threshold(dropout_p);
    a.drop_scale = dropout_scale(dropout_p);
  }
  run_fwd(a, scores.scalar_type(), M);
  return {out, probs};
}

Tensor masked_softmax_bwd_cpu(TF_MASKED_SOFTMAX_BWD_ARGS) {
  check_masked_softmax_bwd_args(dout, probs, scale, dropout_p, rng, c10::DeviceType::CPU);
  check_cpu_avx2();
  const int64_t B = probs.size(0), H = probs.size(1), Lq = probs.size(2), Lk = probs.size(3);
  const int64_t M = B * H * Lq;
  // Mixed dtypes (not produced by the op layer): compute on fp32 copies.
  const bool mixed = dout.scalar_type() != probs.scalar_type();
  const auto dtype = mixed ? at::kFloat : dout.scalar_type();
  Tensor ds = at::empty({B, H, Lq, Lk}, dout.options().dtype(dtype));
  if (M > 0 && Lk > 0) {
    const Tensor d = unit_last(mixed ? dout.to(at::kFloat) : dout);
    const Tensor p = unit_last(mixed ? probs.to(at::kFloat) : probs);
    BwdArgs a{};
    a.dout = d.const_data_ptr();
    a.d_sb = d.stride(0), a.d_sh = d.stride(1), a.d_sm = d.stride(2);
    a.probs = p.const_data_ptr();
    a.p_sb = p.stride(0), a.p_sh = p.stride(1), a.p_sm = p.stride(2);
    a.ds = ds.mutable_data_ptr();
    a.H = H, a.Lq = Lq, a.Lk = Lk;
    a.scale_d = scale;
    a.drop = dropout_p > 0.0;
    if (a.drop) {
      read_rng(rng, a.seed, a.offset);
      a.threshold = dropout_threshold(dropout_p);
      a.drop_scale = dropout_scale(dropout_p);
    }
    run_bwd(a, dtype, M);
  }
  return mixed ? ds.to(dout.scalar_type()) : ds;
}

TORCH_LIBRARY_IMPL(transformer_fast_C, CPU, m) {
  m.impl("masked_softmax_fwd", &masked_softmax_fwd_cpu);
  m.impl("masked_softmax_bwd", &masked_softmax_bwd_cpu);
}

}  // namespace transformer_fast
