// Dropout factors for the C++ CPU kernels: keep/(1-p) per element from philox.h's stream, 16
// Philox blocks (64 elements) at a time with AVX-512F where the CPU has it (chosen at run time),
// else 8 blocks (32 elements) with AVX2.  Included by csrc/cpu_avx2_begin.h, inside the AVX2
// target region; without that region it compiles to the scalar loop alone.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "philox.h"

#ifdef TF_CPU_AVX2_PRAGMA
#include <immintrin.h>
#endif

namespace transformer_fast {
namespace {  // internal linkage: each translation unit keeps its own target-specific copy

#ifdef TF_CPU_AVX2_PRAGMA
// (lo, hi) 32-bit halves of the 8 products a * b[lane] (AVX2 multiplies even lanes only:
// the odd lanes go through a 32-bit shift).
inline void mulhilo8(__m256i a, __m256i b, __m256i& lo, __m256i& hi) {
  const __m256i even = _mm256_mul_epu32(a, b);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), _mm256_srli_epi64(b, 32));
  lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

// GCC 12's AVX-512 intrinsics pass their own self-initialised "undefined" operand and warn about
// it wherever they are inlined.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
// Philox4x32-10 on 16 consecutive blocks (block0 + lane, AVX-512F), then the 64 words in element
// order: out[4 l + w] = word w of block l, i.e. elements 4 block0 .. 4 block0 + 63.  The
// multipliers are broadcast constants, so their odd 32-bit lanes need no shift:
// _mm512_mul_epu32 reads the low half of each 64-bit lane.
__attribute__((target("avx512f,avx2,fma,f16c"))) inline void philox_words64_avx512(
    uint64_t seed, uint64_t offset, uint64_t block0, __m512i out[4]) {
  const __m512i va = _mm512_set1_epi32(static_cast<int>(kPhiloxA));
  const __m512i vb = _mm512_set1_epi32(static_cast<int>(kPhiloxB));
  constexpr __mmask16 kOdd = 0xAAAA;
  const __m512i lo0 = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(block0)));
  __m512i c0 = _mm512_add_epi32(lo0, _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  // a lane whose low word wrapped carries into the high word
  __m512i c1 = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(block0 >> 32)));
  c1 = _mm512_mask_add_epi32(c1, _mm512_cmplt_epu32_mask(c0, lo0), c1, _mm512_set1_epi32(1));
  __m512i c2 = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset)));
  __m512i c3 = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset >> 32)));
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    // (lo, hi) halves of B * c2 and A * c0, lane by lane
    const __m512i eb = _mm512_mul_epu32(vb, c2), ob = _mm512_mul_epu32(vb, _mm512_srli_epi64(c2, 32));
    const __m512i ea = _mm512_mul_epu32(va, c0), oa = _mm512_mul_epu32(va, _mm512_srli_epi64(c0, 32));
    const __m512i hi_b = _mm512_mask_blend_epi32(kOdd, _mm512_srli_epi64(eb, 32), ob);
    const __m512i hi_a = _mm512_mask_blend_epi32(kOdd, _mm512_srli_epi64(ea, 32), oa);
    c0 = _mm512_xor_si512(_mm512_xor_si512(hi_b, c1), _mm512_set1_epi32(static_cast<int>(k0)));
    c2 = _mm512_xor_si512(_mm512_xor_si512(hi_a, c3), _mm512_set1_epi32(static_cast<int>(k1)));
    c1 = _mm512_mask_blend_epi32(kOdd, eb, _mm512_slli_epi64(ob, 32));  // lo(B * c2)
    c3 = _mm512_mask_blend_epi32(kOdd, ea, _mm512_slli_epi64(oa, 32));  // lo(A * c0)
    k0 += kPhiloxKeyA;
    k1 += kPhiloxKeyB;
  }
  // Transpose (word, block) -> element order: a 4x4 transpose of 32-bit words inside each
  // 128-bit lane (r_k's lane q = the 4 words of block 4q + k), then one of the 128-bit lanes.
  const __m512i t0 = _mm512_unpacklo_epi32(c0, c1), t1 = _mm512_unpackhi_epi32(c0, c1);
  const __m512i t2 = _mm512_unpacklo_epi32(c2, c3), t3 = _mm512_unpackhi_epi32(c2, c3);
  const __m512i r0 = _mm512_unpacklo_epi64(t0, t2), r1 = _mm512_unpackhi_epi64(t0, t2);
  const __m512i r2 = _mm512_unpacklo_epi64(t1, t3), r3 = _mm512_unpackhi_epi64(t1, t3);
  const __m512i u0 = _mm512_shuffle_i32x4(r0, r1, 0x44), u1 = _mm512_shuffle_i32x4(r2, r3, 0x44);
  const __m512i u2 = _mm512_shuffle_i32x4(r0, r1, 0xEE), u3 = _mm512_shuffle_i32x4(r2, r3, 0xEE);
  out[0] = _mm512_shuffle_i32x4(u0, u1, 0x88);
  out[1] = _mm512_shuffle_i32x4(u0, u1, 0xDD);
  out[2] = _mm512_shuffle_i32x4(u2, u3, 0x88);
  out[3] = _mm512_shuffle_i32x4(u2, u3, 0xDD);
}

// dropout_factors' elements [0, n - n % 64) from element first_index (a multiple of 4).
__attribute__((target("avx512f,avx2,fma,f16c"))) inline int64_t dropout_factors_avx512(
    uint64_t seed, uint64_t offset, uint64_t first_index, int64_t n, uint32_t threshold, float scale,
    float* out) {
  const __m512i vthr = _mm512_set1_epi32(static_cast<int>(threshold));
  const __m512 vscale = _mm512_set1_ps(scale);
  int64_t j = 0;
  for (; j + 64 <= n; j += 64) {
    __m512i words[4];
    philox_words64_avx512(seed, offset, (first_index + static_cast<uint64_t>(j)) >> 2, words);
    for (int q = 0; q < 4; ++q) {
      _mm512_storeu_ps(out + j + 16 * q, _mm512_maskz_mov_ps(_mm512_cmpge_epu32_mask(words[q], vthr), vscale));
    }
  }
  return j;
}
#pragma GCC diagnostic pop

// The same for 8 consecutive blocks (32 elements) with AVX2.
inline void philox_words32_avx2(uint64_t seed, uint64_t offset, uint64_t block0, __m256i out[4]) {
  const __m256i va = _mm256_set1_epi32(static_cast<int>(kPhiloxA));
  const __m256i vb = _mm256_set1_epi32(static_cast<int>(kPhiloxB));
  const __m256i lo0 = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(block0)));
  __m256i c0 = _mm256_add_epi32(lo0, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  // carry where the low word wrapped (c0 < lo0, unsigned): max(c0, lo0) != c0; cmpeq is -1 where
  // it did not wrap, so hi + 1 + cmpeq adds 1 exactly where it did
  const __m256i no_wrap = _mm256_cmpeq_epi32(_mm256_max_epu32(c0, lo0), c0);
  __m256i c1 = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(block0 >> 32) + 1u)), no_wrap);
  __m256i c2 = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset)));
  __m256i c3 = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset >> 32)));
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    __m256i lo_b, hi_b, lo_a, hi_a;
    mulhilo8(vb, c2, lo_b, hi_b);
    mulhilo8(va, c0, lo_a, hi_a);
    c0 = _mm256_xor_si256(_mm256_xor_si256(hi_b, c1), _mm256_set1_epi32(static_cast<int>(k0)));
    c1 = lo_b;
    c2 = _mm256_xor_si256(_mm256_xor_si256(hi_a, c3), _mm256_set1_epi32(static_cast<int>(k1)));
    c3 = lo_a;
    k0 += kPhiloxKeyA;
    k1 += kPhiloxKeyB;
  }
  // r_k's 128-bit lane q = the 4 words of block 4q + k (as in the AVX-512 version)
  const __m256i t0 = _mm256_unpacklo_epi32(c0, c1), t1 = _mm256_unpackhi_epi32(c0, c1);
  const __m256i t2 = _mm256_unpacklo_epi32(c2, c3), t3 = _mm256_unpackhi_epi32(c2, c3);
  const __m256i r0 = _mm256_unpacklo_epi64(t0, t2), r1 = _mm256_unpackhi_epi64(t0, t2);
  const __m256i r2 = _mm256_unpacklo_epi64(t1, t3), r3 = _mm256_unpackhi_epi64(t1, t3);
  out[0] = _mm256_permute2x128_si256(r0, r1, 0x20);  // blocks 0, 1
  out[1] = _mm256_permute2x128_si256(r2, r3, 0x20);  // blocks 2, 3
  out[2] = _mm256_permute2x128_si256(r0, r1, 0x31);  // blocks 4, 5
  out[3] = _mm256_permute2x128_si256(r2, r3, 0x31);  // blocks 6, 7
}

inline bool cpu_has_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") &&
                         std::getenv("TRANSFORMER_FAST_CPU_NO_AVX512") == nullptr;
  return ok;
}
#endif

// out[j] = scale if element first_index + j is kept (philox_word >= threshold), else 0.  One
// Philox block serves 4 consecutive elements (philox.h), so the vector paths run 16 (AVX-512F) or
// 8 (AVX2) consecutive blocks per step and use all four words of each; the scalar loop covers
// the elements before the first multiple of 4 and the tail.  Bit-identical to
// transformer_fast/philox.py (tests/test_cpu_dropout_isa.py).
inline void dropout_factors(uint64_t seed, uint64_t offset, uint64_t first_index, int64_t n,
                            uint32_t threshold, float scale, float* out) {
  int64_t j = 0;
  const auto scalar_until = [&](int64_t stop) {
    while (j < stop) {
      const uint64_t index = first_index + static_cast<uint64_t>(j);
      const PhiloxBlock b = philox_block(seed, offset, index >> 2);
      for (uint32_t w = static_cast<uint32_t>(index & 3); w < 4 && j < stop; ++w, ++j) {
        out[j] = b.w[w] >= threshold ? scale : 0.0f;
      }
    }
  };
#ifdef TF_CPU_AVX2_PRAGMA
  scalar_until(std::min<int64_t>(n, static_cast<int64_t>((4 - (first_index & 3)) & 3)));
  if (cpu_has_avx512()) j += dropout_factors_avx512(seed, offset, first_index + j, n - j, threshold, scale, out + j);
  const __m256i vthr = _mm256_set1_epi32(static_cast<int>(threshold));
  const __m256 vscale = _mm256_set1_ps(scale);
  for (; j + 32 <= n; j += 32) {
    __m256i words[4];
    philox_words32_avx2(seed, offset, (first_index + static_cast<uint64_t>(j)) >> 2, words);
    for (int q = 0; q < 4; ++q) {
      // keep iff word >= threshold (unsigned): max(word, thr) == word
      const __m256i keep = _mm256_cmpeq_epi32(_mm256_max_epu32(words[q], vthr), words[q]);
      _mm256_storeu_ps(out + j + 8 * q, _mm256_and_ps(_mm256_castsi256_ps(keep), vscale));
    }
  }
#endif
  scalar_until(n);
}

}  // namespace
}  // namespace transformer_fast
