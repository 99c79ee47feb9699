// Attention over a KV cache (incremental decoding) on the CPU: the `cpu` backend of
// attention_with_kv_cache, and the home of the argument checks and split rule shared with
// decode_cuda.cu (prototypes in decode.h).
//
// Contract: the docstring of kernels/decode.py (the Triton launcher), implemented identically:
//   q (B, H, L_new, D); k_cache (B, Hkv, L_max, D), v_cache (B, Hkv, L_max, Dv), Hkv | H (query
//   head h reads kv head h / (H / Hkv)); cache_seqlens int32 (B,); k_new / v_new (B, Hkv, L_new,
//   D / Dv) or both absent.  k_new / v_new are written into the caches in place at positions
//   cache_seqlens[b] + t (through the caches' strides, any strides); then row b has
//   n_b = cache_seqlens[b] + (L_new if k_new else 0) valid keys and query t sees key j iff
//   j <= n_b - L_new + t (bottom-right causal).  A query with no visible key returns 0.
//   out (B, H, L_new, Dv) contiguous in q's dtype.  Positions outside [0, L_max) are never read
//   or written, whatever cache_seqlens holds (the functional layer rejects such values).
//
// Plan (decoding is bandwidth bound: the floor is reading each row's valid K/V prefix once):
//   * one task per (batch row, kv head, tile of up to kBlockM packed query rows, key split); the
//     packed rows r = t * GROUP + g are the GROUP query heads of the kv head at position t, so a
//     decoding step (L_new = 1) streams each K/V block once for all the heads that share it;
//   * keys in blocks of kBlockN: K / V rows are read in place (fp32) or converted once per block
//     into an fp32 scratch (fp16 / bf16); only keys below each row's visibility limit are touched;
//   * online softmax in fp32 (scores, max, probabilities) with the row sums and the P@V
//     accumulator carried across key blocks in double; each block's P@V is an fp32 sum of
//     <= kBlockN terms and q.k an fp32 SIMD reduction over D (8 / 4 lanes, then a tree), or for
//     tiles of >= kGemmRows rows a GEMM-like loop over a transposed K block (sums over D blocked
//     in chunks of 16): no long sequential fp32 sum, and the DESIGN 6 oracle holds up to
//     D = 256 and long caches;
//   * split-K when there are few tasks: the key range of each tile is split evenly over the
//     splits, each writes a normalised fp32 partial and its lse, and a combine pass merges them
//     in split order.  The split count comes from the shapes only (kv_num_splits_heuristic with a
//     FIXED slot count, not the thread count), so the result does not depend on the number of
//     threads; TRANSFORMER_FAST_KV_SPLITS forces it (tests).
// The hot loops (scores, max, exp, P@V) are compiled twice (x86-64-v3 = AVX2 + FMA, and baseline
// x86-64; GCC's target_clones picks one at load time) because the build targets baseline x86-64.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "decode.h"
#include "ops.h"

namespace transformer_fast {

using at::Tensor;

// --------------------------------------------------------------------------------------------
// Argument checks and the split rule (also used by decode_cuda.cu)

namespace {

bool kv_dtype_ok(c10::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

void check_kv_device(const Tensor& t, const char* name, const Tensor& q, c10::DeviceType dev) {
  TORCH_CHECK(t.device().type() == dev, "attention_with_kv_cache: ", name, " must be on ",
              c10::DeviceTypeName(dev), ", got ", t.device());
  TORCH_CHECK(t.device() == q.device(), "attention_with_kv_cache: ", name, " is on ", t.device(),
              " but q is on ", q.device());
}

}  // namespace

void check_kv_cache_args(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                         const Tensor& cache_seqlens, const std::optional<Tensor>& k_new,
                         const std::optional<Tensor>& v_new, double scale, c10::DeviceType dev) {
  TORCH_CHECK(q.dim() == 4, "attention_with_kv_cache: q must be 4-D (B, H, L_new, D), got ",
              q.dim(), "-D");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4,
              "attention_with_kv_cache: k_cache / v_cache must be 4-D (B, Hkv, L_max, D), got ",
              k_cache.dim(), "-D / ", v_cache.dim(), "-D");
  TORCH_CHECK(kv_dtype_ok(q.scalar_type()),
              "attention_with_kv_cache: q must be float32, float16 or bfloat16, got ",
              q.scalar_type());
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "attention_with_kv_cache: q, k_cache, v_cache must share one dtype, got ",
              q.scalar_type(), ", ", k_cache.scalar_type(), ", ", v_cache.scalar_type());
  check_kv_device(q, "q", q, dev);
  check_kv_device(k_cache, "k_cache", q, dev);
  check_kv_device(v_cache, "v_cache", q, dev);
  check_kv_device(cache_seqlens, "cache_seqlens", q, dev);
  const int64_t B = q.size(0), H = q.size(1), L_new = q.size(2), D = q.size(3);
  const int64_t Hkv = k_cache.size(1), L_max = k_cache.size(2), Dv = v_cache.size(3);
  TORCH_CHECK(k_cache.size(0) == B && k_cache.size(3) == D,
              "attention_with_kv_cache: k_cache must be (B, Hkv, L_max, D) with q's B = ", B,
              " and D = ", D, ", got ", k_cache.sizes());
  TORCH_CHECK(v_cache.size(0) == B && v_cache.size(1) == Hkv && v_cache.size(2) == L_max,
              "attention_with_kv_cache: v_cache must be (B, Hkv, L_max, Dv) like k_cache ",
              k_cache.sizes(), ", got ", v_cache.sizes());
  TORCH_CHECK(Hkv >= 1 && H % Hkv == 0, "attention_with_kv_cache: kv heads ", Hkv,
              " must divide the query heads ", H);
  TORCH_CHECK(D >= 1 && D <= 256 && Dv >= 1 && Dv <= 256,
              "attention_with_kv_cache: head dims must be in 1..256, got D = ", D, ", Dv = ", Dv);
  TORCH_CHECK(cache_seqlens.dim() == 1 && cache_seqlens.size(0) == B &&
                  cache_seqlens.scalar_type() == at::kInt,
              "attention_with_kv_cache: cache_seqlens must be int32 (B,) = (", B, ",), got ",
              cache_seqlens.scalar_type(), " ", cache_seqlens.sizes());
  TORCH_CHECK(k_new.has_value() == v_new.has_value(),
              "attention_with_kv_cache: k_new and v_new must be given together");
  if (k_new.has_value()) {
    const Tensor& kn = *k_new;
    const Tensor& vn = *v_new;
    TORCH_CHECK(kn.dim() == 4 && kn.size(0) == B && kn.size(1) == Hkv && kn.size(2) == L_new &&
                    kn.size(3) == D,
                "attention_with_kv_cache: k_new must be (B, Hkv, L_new, D) = (", B, ", ", Hkv,
                ", ", L_new, ", ", D, "), got ", kn.sizes());
    TORCH_CHECK(vn.dim() == 4 && vn.size(0) == B && vn.size(1) == Hkv && vn.size(2) == L_new &&
                    vn.size(3) == Dv,
                "attention_with_kv_cache: v_new must be (B, Hkv, L_new, Dv) = (", B, ", ", Hkv,
                ", ", L_new, ", ", Dv, "), got ", vn.sizes());
    TORCH_CHECK(kn.scalar_type() == q.scalar_type() && vn.scalar_type() == q.scalar_type(),
                "attention_with_kv_cache: k_new / v_new must have q's dtype ", q.scalar_type(),
                ", got ", kn.scalar_type(), " / ", vn.scalar_type());
    TORCH_CHECK(L_new <= L_max, "attention_with_kv_cache: L_new = ", L_new,
                " exceeds the cache length L_max = ", L_max);
    check_kv_device(kn, "k_new", q, dev);
    check_kv_device(vn, "v_new", q, dev);
  }
  TORCH_CHECK(std::isfinite(scale), "attention_with_kv_cache: scale must be finite, got ", scale);
}

int64_t kv_num_splits_heuristic(int64_t programs, int64_t slots, int64_t n_blocks,
                                int64_t max_splits) {
  if (static_cast<double>(programs) >= 0.8 * static_cast<double>(slots) || n_blocks <= 1) return 1;
  max_splits = std::max<int64_t>(1, std::min({max_splits, slots, n_blocks}));
  auto cdiv = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  auto eligible = [&](int64_t s) { return s == 1 || cdiv(n_blocks, s) != cdiv(n_blocks, s - 1); };
  std::vector<double> eff(max_splits + 1, 0.0);
  double best = 0.0;
  for (int64_t s = 1; s <= max_splits; ++s) {
    if (!eligible(s)) continue;
    const double waves = static_cast<double>(programs * s) / static_cast<double>(slots);
    eff[s] = waves / std::ceil(waves);
    best = std::max(best, eff[s]);
  }
  for (int64_t s = 1; s <= max_splits; ++s) {
    if (eligible(s) && eff[s] >= 0.85 * best) return s;
  }
  return 1;
}

int64_t kv_forced_splits(int64_t max_splits) {
  const char* env = std::getenv("TRANSFORMER_FAST_KV_SPLITS");
  if (env == nullptr || *env == '\0') return 0;
  char* end = nullptr;
  const long long n = std::strtoll(env, &end, 10);
  if (end == env || *end != '\0' || n < 1) return 0;
  return std::min<int64_t>(n, max_splits);
}

// --------------------------------------------------------------------------------------------
// The CPU kernel

namespace {

constexpr int64_t kBlockM = 128;    // packed query rows per task tile
constexpr int64_t kBlockN = 64;     // keys per block (also the split granularity)
constexpr int64_t kMaxSplits = 128;
constexpr int64_t kGemmRows = 16;  // tiles of at least this many rows take block_scores_t
constexpr int64_t kPanel = 16;     // keys per panel of block_scores_t's K^T
// "Slots" the split rule assumes on the CPU: fixed (not the thread count) so that the split
// count, and with it the rounding of the result, does not depend on the number of threads.
constexpr int64_t kCpuSlots = 16;

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define TF_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
// The q.k loops multiply fp32 values in double, where the product is exact: a fused
// multiply-add rounds exactly as the separate add, so contracting them changes no result (the
// build's -ffp-contract=off is for the rest).
#define TF_EXACT_PRODUCTS __attribute__((optimize("fp-contract=fast")))
#else
#define TF_SIMD_CLONES
#define TF_EXACT_PRODUCTS
#endif

// s[r * kBlockN + c] = scale * q_r . k_c for keys c < cnt[r] of the block.  q: (bm, D) fp32
// contiguous; k: bn rows of D fp32 with row pitch ldk.  The dot is a SIMD reduction in double,
// and the score stays double (so does the running max): only s - m, small wherever the
// probability matters, goes to fp32 for the exponential.  In fp32 (8 lanes of D / 8 sequential
// terms) the dot's error passed the oracle's bound (up to 3.7x, in 1 draw of 8) where the logits
// are large (a standard deviation of ~30: a peaked softmax turns a score's absolute error into
// the output's relative error), and a score rounded to fp32 (up to ulp(s) / 2) 3.9x at logit std
// 100.  The double dot costs a step 5-62% on one thread (benchmarks/NOTES.md, "CPU decoding
// step: q.k in double").
TF_SIMD_CLONES TF_EXACT_PRODUCTS void block_scores(const float* q, int64_t bm, int64_t D, const float* k,
                                 int64_t ldk, const int64_t* cnt, double scale, double* s) {
  for (int64_t r = 0; r < bm; ++r) {
    const float* qr = q + r * D;
    int64_t c = 0;
    // Four keys at a time: four independent FMA chains (one chain is latency bound) that share
    // the loads of q.
    for (; c + 4 <= cnt[r]; c += 4) {
      const float* k0 = k + c * ldk;
      const float* k1 = k0 + ldk;
      const float* k2 = k1 + ldk;
      const float* k3 = k2 + ldk;
      double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
      for (int64_t d = 0; d < D; ++d) {
        const double qd = qr[d];
        a0 += qd * k0[d];
        a1 += qd * k1[d];
        a2 += qd * k2[d];
        a3 += qd * k3[d];
      }
      s[r * kBlockN + c] = scale * a0;
      s[r * kBlockN + c + 1] = scale * a1;
      s[r * kBlockN + c + 2] = scale * a2;
      s[r * kBlockN + c + 3] = scale * a3;
    }
    for (; c < cnt[r]; ++c) {
      const float* kc = k + c * ldk;
      double acc = 0.0;
#pragma omp simd reduction(+ : acc)
      for (int64_t d = 0; d < D; ++d) acc += static_cast<double>(qr[d]) * kc[d];
      s[r * kBlockN + c] = scale * acc;
    }
  }
}

// The same scores for many rows (prefill chunks, large GQA groups) as a GEMM-like loop: K^T of
// the block (kT, D x kBlockN, widened to double once per block) is broadcast against each q
// element, so the inner loop is an axpy over keys with no horizontal reductions.  In double
// like block_scores: fp32 sums of 16 terms (error ~ 16 + D / 16 roundings) went up to 10x past
// the oracle's bound with large logits (GQA group 16, D 64).  Scores of keys c >= cnt[r] are
// computed but never used.
TF_SIMD_CLONES TF_EXACT_PRODUCTS void block_scores_t(const float* q, int64_t bm, int64_t D,
                                                     const double* kT, double scale, double* s) {
  // Two rows x kPanel keys of double accumulators at a time (8 AVX2 registers): each k element
  // loaded serves two rows, and nothing spills.  Every score is the same ordered sum over d.
  int64_t r = 0;
  for (; r + 2 <= bm; r += 2) {
    const float* q0 = q + r * D;
    const float* q1 = q0 + D;
    for (int64_t c0 = 0; c0 < kBlockN; c0 += kPanel) {
      const double* kp = kT + c0 * D;  // this panel's (D, kPanel)
      double a0[kPanel], a1[kPanel];
#pragma omp simd
      for (int64_t c = 0; c < kPanel; ++c) a0[c] = a1[c] = 0.0;
      for (int64_t d = 0; d < D; ++d) {
        const double x0 = q0[d], x1 = q1[d];
        const double* kd = kp + d * kPanel;
#pragma omp simd
        for (int64_t c = 0; c < kPanel; ++c) {
          a0[c] += x0 * kd[c];
          a1[c] += x1 * kd[c];
        }
      }
      double* s0 = s + r * kBlockN + c0;
      double* s1 = s0 + kBlockN;
#pragma omp simd
      for (int64_t c = 0; c < kPanel; ++c) {
        s0[c] = scale * a0[c];
        s1[c] = scale * a1[c];
      }
    }
  }
  for (; r < bm; ++r) {
    const float* q0 = q + r * D;
    for (int64_t c0 = 0; c0 < kBlockN; c0 += kPanel) {
      const double* kp = kT + c0 * D;
      double a0[kPanel];
#pragma omp simd
      for (int64_t c = 0; c < kPanel; ++c) a0[c] = 0.0;
      for (int64_t d = 0; d < D; ++d) {
        const double x0 = q0[d];
#pragma omp simd
        for (int64_t c = 0; c < kPanel; ++c) a0[c] += x0 * kp[d * kPanel + c];
      }
      double* s0 = s + r * kBlockN + c0;
#pragma omp simd
      for (int64_t c = 0; c < kPanel; ++c) s0[c] = scale * a0[c];
    }
  }
}

// max(m, s[0:n]) ignoring NaN (vectorised); the caller handles all-NaN rows.
TF_SIMD_CLONES double block_max(const double* s, int64_t n, double m) {
#pragma omp simd reduction(max : m)
  for (int64_t c = 0; c < n; ++c) m = s[c] > m ? s[c] : m;
  return m;
}

// p[c] = exp(s[c] - m) for c < n (s[c] <= m or NaN), returns sum p in double.  Cephes' expf
// polynomial (~1 ulp) so that the loop vectorises; NaN propagates, x < -87.3 gives 0.
TF_SIMD_CLONES double block_exp(const double* s, double m, int64_t n, float* p) {
  double sum = 0.0;
#pragma omp simd reduction(+ : sum)
  for (int64_t c = 0; c < n; ++c) {
    const float x0 = static_cast<float>(s[c] - m);
    const float x1 = x0 < -87.3f ? -87.3f : x0;  // keeps NaN (the comparison is false)
    const float fn = std::floor(x1 * 1.44269504088896341f + 0.5f);
    const float r = (x1 - fn * 0.693359375f) + fn * 2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    // 2^fn from its exponent bits (fn in [-126, 0] here; NaN gives garbage times NaN = NaN).
    const int32_t bits = (static_cast<int32_t>(fn) + 127) << 23;
    float pow2;
    std::memcpy(&pow2, &bits, sizeof(pow2));
    const float e = x0 < -87.3f ? 0.0f : y * pow2;
    p[c] = e;
    sum += e;
  }
  return sum;
}

// acc[0:Dv] = acc * alpha + sum_{c < n} p[c] * v_c: the block's sum in fp32 (n <= kBlockN
// terms), accumulated across blocks in double.
TF_SIMD_CLONES void block_pv(double* acc, double alpha, const float* p, int64_t n, const float* v,
                             int64_t ldv, int64_t Dv) {
  constexpr int64_t kW = 32;  // columns per register tile
  int64_t d0 = 0;
  for (; d0 + kW <= Dv; d0 += kW) {
    float t[kW];
#pragma omp simd
    for (int64_t j = 0; j < kW; ++j) t[j] = 0.0f;
    for (int64_t c = 0; c < n; ++c) {
      // No skip for p == 0: 0 * v keeps a NaN / Inf in v visible, as the reference's p @ v does.
      const float w = p[c];
      const float* vc = v + c * ldv + d0;
#pragma omp simd
      for (int64_t j = 0; j < kW; ++j) t[j] += w * vc[j];
    }
#pragma omp simd
    for (int64_t j = 0; j < kW; ++j) acc[d0 + j] = acc[d0 + j] * alpha + t[j];
  }
  for (int64_t d = d0; d < Dv; ++d) {  // the last Dv % kW columns
    float t = 0.0f;
    for (int64_t c = 0; c < n; ++c) t += p[c] * v[c * ldv + d];
    acc[d] = acc[d] * alpha + t;
  }
}

// max that propagates NaN (std::max(m, NaN) would drop it and turn a NaN row into a dead row).
template <typename F>
inline F nan_max(F m, F x) { return (x > m || std::isnan(x)) ? x : m; }

inline float to_f32(float x) { return x; }
inline float to_f32(c10::Half x) { return static_cast<float>(x); }
inline float to_f32(c10::BFloat16 x) { return static_cast<float>(x); }

// n rows of `width` elements at `base` (row pitch `ld`) as fp32: in place for fp32, else
// converted into `buf` (pitch `width`).  Returns the pointer and sets the pitch.
template <typename T>
const float* rows_f32(const T* base, int64_t ld, int64_t n, int64_t width, float* buf,
                      int64_t& pitch) {
  if constexpr (std::is_same_v<T, float>) {
    (void)n, (void)width, (void)buf;
    pitch = ld;
    return base;
  } else {
    for (int64_t i = 0; i < n; ++i)
      for (int64_t d = 0; d < width; ++d) buf[i * width + d] = to_f32(base[i * ld + d]);
    pitch = width;
    return buf;
  }
}

struct Problem {
  int64_t B, H, Hkv, group, L_new, L_max, D, Dv, n_extra, nsplit, n_mt;
  double scale;  // double like the scores (an fp32 1 / sqrt(D) would move a score by ~2^-25 |s|)
  // element strides (unit stride along the head dim)
  int64_t q_sb, q_sh, q_sm, k_sb, k_sh, k_sm, v_sb, v_sh, v_sm;
};

// One task = (b, hk, query tile mt, split).  Writes out (nsplit == 1) or the split's partial
// (op (nsplit, B, H, L_new, Dv) fp32, lse (nsplit, B, H, L_new) double, natural log: with large
// logits an fp32 lse carried |lse| * 2^-24 into the split's weight, past the oracle's bound).
template <typename T>
void decode_kernel(const Problem& p, const T* q, const T* k, const T* v, const int32_t* seqlens,
                   T* out, float* op, double* lse) {
  const int64_t m_total = p.L_new * p.group;
  const int64_t tasks = p.B * p.Hkv * p.n_mt * p.nsplit;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qbuf(kBlockM * p.D), kbuf(kBlockN * p.D), vbuf(kBlockN * p.Dv),
        pbuf(kBlockN);
    std::vector<double> s(kBlockM * kBlockN), acc(kBlockM * p.Dv), l_i(kBlockM),
        kT(p.D * kBlockN, 0.0), m_i(kBlockM);
    std::vector<int64_t> last_vis(kBlockM), cnt(kBlockM);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t split = task % p.nsplit;
      int64_t rest = task / p.nsplit;
      const int64_t mt = rest % p.n_mt;
      rest /= p.n_mt;
      const int64_t hk = rest % p.Hkv, b = rest / p.Hkv;
      const int64_t m0 = mt * kBlockM, bm = std::min(kBlockM, m_total - m0);

      // Packed rows -> fp32 q rows; key limits (clamped into [0, L_max] whatever seqlens holds).
      const int64_t n_keys =
          std::min<int64_t>(std::max<int64_t>(int64_t{seqlens[b]} + p.n_extra, 0), p.L_max);
      const int64_t base = n_keys - p.L_new;  // query t sees keys j <= base + t
      for (int64_t r = 0; r < bm; ++r) {
        const int64_t t = (m0 + r) / p.group, h = hk * p.group + (m0 + r) % p.group;
        const T* qr = q + b * p.q_sb + h * p.q_sh + t * p.q_sm;
        for (int64_t d = 0; d < p.D; ++d) qbuf[r * p.D + d] = to_f32(qr[d]);
        last_vis[r] = base + t;
      }
      const int64_t t_last = (m0 + bm - 1) / p.group;
      const int64_t hi_keys = std::max<int64_t>(std::min(base + t_last + 1, n_keys), 0);
      const int64_t n_blk = (hi_keys + kBlockN - 1) / kBlockN;
      const int64_t per = (n_blk + p.nsplit - 1) / p.nsplit;
      const int64_t blk_lo = std::min(split * per, n_blk), blk_hi = std::min(blk_lo + per, n_blk);

      std::fill(acc.begin(), acc.begin() + bm * p.Dv, 0.0);
      std::fill(l_i.begin(), l_i.begin() + bm, 0.0);
      std::fill(m_i.begin(), m_i.begin() + bm, -HUGE_VAL);
      const T* kh = k + b * p.k_sb + hk * p.k_sh;
      const T* vh = v + b * p.v_sb + hk * p.v_sh;
      for (int64_t nb = blk_lo; nb < blk_hi; ++nb) {
        const int64_t n0 = nb * kBlockN, bn = std::min(kBlockN, hi_keys - n0);
        for (int64_t r = 0; r < bm; ++r)  // visible keys of the block form a prefix per row
          cnt[r] = std::max<int64_t>(0, std::min(bn, last_vis[r] - n0 + 1));
        int64_t ldk = 0, ldv = 0;
        const float* kb = rows_f32(kh + n0 * p.k_sm, p.k_sm, bn, p.D, kbuf.data(), ldk);
        const float* vb = rows_f32(vh + n0 * p.v_sm, p.v_sm, bn, p.Dv, vbuf.data(), ldv);
        if (bm >= kGemmRows) {
          for (int64_t c = 0; c < bn; ++c)  // panels of kPanel keys, each (D, kPanel)
            for (int64_t d = 0; d < p.D; ++d)
              kT[(c - c % kPanel) * p.D + d * kPanel + c % kPanel] = kb[c * ldk + d];
          block_scores_t(qbuf.data(), bm, p.D, kT.data(), p.scale, s.data());
        } else {
          block_scores(qbuf.data(), bm, p.D, kb, ldk, cnt.data(), p.scale, s.data());
        }
        for (int64_t r = 0; r < bm; ++r) {
          if (cnt[r] == 0) continue;
          const double* sr = s.data() + r * kBlockN;
          double m_new = block_max(sr, cnt[r], m_i[r]);
          if (m_new == -HUGE_VAL) {
            // Nothing but -inf / NaN scores so far: a NaN must still poison the row (it does
            // through p = exp(NaN - m) when m is finite); a row of -inf has nothing to add yet.
            for (int64_t c = 0; c < cnt[r]; ++c) m_new = nan_max(m_new, sr[c]);
            if (m_new == -HUGE_VAL) continue;
          }
          const double alpha = std::exp(m_i[r] - m_new);  // exp(-inf) = 0 on the first block
          l_i[r] = l_i[r] * alpha + block_exp(sr, m_new, cnt[r], pbuf.data());
          m_i[r] = m_new;
          block_pv(acc.data() + r * p.Dv, alpha, pbuf.data(), cnt[r], vb, ldv, p.Dv);
        }
      }

      for (int64_t r = 0; r < bm; ++r) {
        const int64_t t = (m0 + r) / p.group, h = hk * p.group + (m0 + r) % p.group;
        const int64_t row = (b * p.H + h) * p.L_new + t;  // (b, h, t) of (B, H, L_new)
        const double* ar = acc.data() + r * p.Dv;
        const bool live = l_i[r] != 0.0;  // NaN (a NaN / +Inf score) propagates like softmax
        const double inv = live ? 1.0 / l_i[r] : 0.0;
        if (p.nsplit == 1) {
          T* o = out + row * p.Dv;
          for (int64_t d = 0; d < p.Dv; ++d) o[d] = static_cast<T>(static_cast<float>(ar[d] * inv));
        } else {
          float* o = op + (split * p.B * p.H * p.L_new + row) * p.Dv;
          for (int64_t d = 0; d < p.Dv; ++d) o[d] = static_cast<float>(ar[d] * inv);
          lse[split * p.B * p.H * p.L_new + row] =
              live ? m_i[r] + std::log(l_i[r]) : -HUGE_VAL;
        }
      }
    }
  });
}

// Merges the splits of every (b, h, t) row in split order (log-sum-exp weights, double sums).
template <typename T>
void combine_kernel(const Problem& p, const float* op, const double* lse, T* out) {
  const int64_t rows = p.B * p.H * p.L_new, S = p.nsplit;
  // Grain: one thread unless there are many rows (a decoding step has B * H of them).
  const int64_t grain = std::max<int64_t>(16, (int64_t{1} << 16) / std::max<int64_t>(1, S * p.Dv));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<double> acc(p.Dv), w(S);
    for (int64_t row = begin; row < end; ++row) {
      double m = -HUGE_VAL;
      for (int64_t s = 0; s < S; ++s) m = nan_max(m, lse[s * rows + row]);
      T* o = out + row * p.Dv;
      if (m == -HUGE_VAL) {  // no split saw a key: a dead row
        for (int64_t d = 0; d < p.Dv; ++d) o[d] = static_cast<T>(0.0f);
        continue;
      }
      double tot = 0.0;
      for (int64_t s = 0; s < S; ++s) {
        w[s] = std::exp(lse[s * rows + row] - m);
        tot += w[s];
      }
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t s = 0; s < S; ++s) {
        if (w[s] == 0.0) continue;  // an empty split (its partial is 0, lse -inf)
        const double ws = w[s] / tot;
        const float* part = op + (s * rows + row) * p.Dv;
        for (int64_t d = 0; d < p.Dv; ++d) acc[d] += ws * part[d];
      }
      for (int64_t d = 0; d < p.Dv; ++d) o[d] = static_cast<T>(static_cast<float>(acc[d]));
    }
  });
}

// Writes src (B, Hkv, L_new, W) into dst (B, Hkv, L_max, W) at rows seqlens[b] + t (any strides;
// positions outside [0, L_max) are skipped).
void append_rows(const Tensor& src, const Tensor& dst, const int32_t* seqlens) {
  const int64_t B = src.size(0), Hkv = src.size(1), L_new = src.size(2), W = src.size(3);
  const int64_t L_max = dst.size(2), es = src.element_size();
  const char* s = static_cast<const char*>(src.const_data_ptr());
  char* d = static_cast<char*>(dst.mutable_data_ptr());
  const auto ss = src.strides(), ds = dst.strides();
  const bool rows_contig = ss[3] == 1 && ds[3] == 1;
  // A decoding step appends a few KB: one thread (a parallel region costs more than the copy, and
  // far more when a worker thread is descheduled on a busy machine).
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, L_new * W * es));
  at::parallel_for(0, B * Hkv, grain, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / Hkv, h = bh % Hkv;
      for (int64_t t = 0; t < L_new; ++t) {
        const int64_t pos = int64_t{seqlens[b]} + t;
        if (pos < 0 || pos >= L_max) continue;
        const char* from = s + (b * ss[0] + h * ss[1] + t * ss[2]) * es;
        char* to = d + (b * ds[0] + h * ds[1] + pos * ds[2]) * es;
        if (rows_contig) {
          std::memcpy(to, from, W * es);
        } else {
          for (int64_t i = 0; i < W; ++i) std::memcpy(to + i * ds[3] * es, from + i * ss[3] * es, es);
        }
      }
    }
  });
}

Tensor unit_last(const Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

// The reference attends densely over each row's valid keys: a key hidden from a query of the
// chunk (causal among the new tokens; every key for a query that sees none) still meets it as
// 0 * v, so a NaN / Inf value there makes that query's output NaN in its column.  The kernels
// skip hidden keys; this adds their 0 * v terms when one of them is non-finite (otherwise it
// only checks them: none in a one-token decoding step).
template <typename T>
void add_hidden_values(const Problem& p, const T* v, const int32_t* seqlens, T* out) {
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t n_keys =
        std::min<int64_t>(std::max<int64_t>(int64_t{seqlens[b]} + p.n_extra, 0), p.L_max);
    const int64_t base = n_keys - p.L_new;  // query t sees keys j <= base + t
    for (int64_t hk = 0; hk < p.Hkv; ++hk) {
      const T* vh = v + b * p.v_sb + hk * p.v_sh;
      bool bad = false;
      for (int64_t j = std::max<int64_t>(base + 1, 0); j < n_keys; ++j) {
        for (int64_t d = 0; d < p.Dv; ++d) bad |= !std::isfinite(to_f32(vh[j * p.v_sm + d]));
      }
      if (!bad) continue;
      for (int64_t t = 0; t < p.L_new; ++t) {
        for (int64_t d = 0; d < p.Dv; ++d) {
          float z = 0.0f;
          for (int64_t j = std::max<int64_t>(base + t + 1, 0); j < n_keys; ++j) z += 0.0f * to_f32(vh[j * p.v_sm + d]);
          if (z == 0.0f) continue;  // 0, or NaN below
          for (int64_t h = hk * p.group; h < (hk + 1) * p.group; ++h) {
            T& o = out[((b * p.H + h) * p.L_new + t) * p.Dv + d];
            o = static_cast<T>(to_f32(o) + z);
          }
        }
      }
    }
  }
}

template <typename T>
void run(const Problem& p, const Tensor& q, const Tensor& k, const Tensor& v,
         const Tensor& seqlens, Tensor& out) {
  Tensor op, lse;
  if (p.nsplit > 1) {
    op = at::empty({p.nsplit, p.B, p.H, p.L_new, p.Dv}, q.options().dtype(at::kFloat));
    lse = at::empty({p.nsplit, p.B, p.H, p.L_new}, q.options().dtype(at::kDouble));
  }
  decode_kernel<T>(p, static_cast<const T*>(q.const_data_ptr()),
                   static_cast<const T*>(k.const_data_ptr()),
                   static_cast<const T*>(v.const_data_ptr()), seqlens.const_data_ptr<int32_t>(),
                   static_cast<T*>(out.mutable_data_ptr()),
                   p.nsplit > 1 ? op.mutable_data_ptr<float>() : nullptr,
                   p.nsplit > 1 ? lse.mutable_data_ptr<double>() : nullptr);
  if (p.nsplit > 1) {
    combine_kernel<T>(p, op.const_data_ptr<float>(), lse.const_data_ptr<double>(),
                      static_cast<T*>(out.mutable_data_ptr()));
  }
  add_hidden_values<T>(p, static_cast<const T*>(v.const_data_ptr()), seqlens.const_data_ptr<int32_t>(),
                       static_cast<T*>(out.mutable_data_ptr()));
}

}  // namespace

Tensor attention_with_kv_cache_fwd_cpu(TF_KV_CACHE_ARGS) {
  (void)allow_tf32;  // the CPU computes exact fp32 (tf32 is a GPU tensor-core format)
  check_kv_cache_args(q, k_cache, v_cache, cache_seqlens, k_new, v_new, scale, at::kCPU);
  const Tensor seqlens = cache_seqlens.contiguous();
  const bool has_new = k_new.has_value();
  const int64_t B = q.size(0), H = q.size(1), L_new = q.size(2);
  const int64_t Hkv = k_cache.size(1), L_max = k_cache.size(2), Dv = v_cache.size(3);

  // 1. Append the new keys / values (through the caches' own strides).
  if (has_new && L_new > 0 && B * Hkv > 0) {
    append_rows(*k_new, k_cache, seqlens.const_data_ptr<int32_t>());
    append_rows(*v_new, v_cache, seqlens.const_data_ptr<int32_t>());
  }
  Tensor out = at::empty({B, H, L_new, Dv}, q.options());
  if (out.numel() == 0) return out;
  if (L_max == 0) return out.zero_();

  // 2. Attention (a cache whose last stride is not 1 is read through a contiguous copy).
  const Tensor q_ = unit_last(q), k_ = unit_last(k_cache), v_ = unit_last(v_cache);
  Problem p{};
  p.B = B, p.H = H, p.Hkv = Hkv, p.group = H / Hkv, p.L_new = L_new, p.L_max = L_max;
  p.D = q.size(3), p.Dv = Dv, p.n_extra = has_new ? L_new : 0;
  p.scale = scale;
  p.q_sb = q_.stride(0), p.q_sh = q_.stride(1), p.q_sm = q_.stride(2);
  p.k_sb = k_.stride(0), p.k_sh = k_.stride(1), p.k_sm = k_.stride(2);
  p.v_sb = v_.stride(0), p.v_sh = v_.stride(1), p.v_sm = v_.stride(2);
  p.n_mt = (L_new * p.group + kBlockM - 1) / kBlockM;
  const int64_t forced = kv_forced_splits(kMaxSplits);
  p.nsplit = forced > 0 ? forced
                        : kv_num_splits_heuristic(B * Hkv * p.n_mt, kCpuSlots,
                                                  (L_max + kBlockN - 1) / kBlockN, kMaxSplits);
  switch (q.scalar_type()) {
    case at::kFloat: run<float>(p, q_, k_, v_, seqlens, out); break;
    case at::kHalf: run<c10::Half>(p, q_, k_, v_, seqlens, out); break;
    default: run<c10::BFloat16>(p, q_, k_, v_, seqlens, out); break;
  }
  return out;
}

// tests/test_decode_cxx.py's CUDA emulation includes this file for the shared checks: no
// registration there (the real _C may be loaded in the same process).
#ifndef TF_KV_CACHE_NO_CPU_REGISTRATION
TORCH_LIBRARY_IMPL(transformer_fast_C, CPU, m) {
  m.impl("attention_with_kv_cache_fwd", &attention_with_kv_cache_fwd_cpu);
}
#endif

}  // namespace transformer_fast
