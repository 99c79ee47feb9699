// Dropout factors for the C++ CPU kernels: keep/(1-p) per element from philox.h's stream, 16
// Philox streams at a time with AVX-512F where the CPU has it (chosen at run time), else 8 with
// AVX2.  Included by csrc/cpu_avx2_begin.h, inside the AVX2 target region; without that region it
// compiles to the scalar loop alone.
#pragma once

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
#endif

#ifdef TF_CPU_AVX2_PRAGMA
// Philox on 16 lanes (AVX-512F), for the elements [0, n - n % 16) of dropout_factors' range;
// returns how many it did.  The multiplier is a broadcast constant, so its odd 32-bit lanes need
// no shift: _mm512_mul_epu32 reads the low half of each 64-bit lane.
__attribute__((target("avx512f,avx2,fma,f16c"))) inline int64_t dropout_factors_avx512(
    uint64_t seed, uint64_t offset, uint64_t first_index, int64_t n, uint32_t threshold, float scale,
    float* out) {
  const __m512i va = _mm512_set1_epi32(static_cast<int>(kPhiloxA));
  const __m512i vb = _mm512_set1_epi32(static_cast<int>(kPhiloxB));
  const __m512i c2_init = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset)));
  const __m512i c3_init = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset >> 32)));
  const __m512i vthr = _mm512_set1_epi32(static_cast<int>(threshold));
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  constexpr __mmask16 kOdd = 0xAAAA;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const uint64_t base = first_index + static_cast<uint64_t>(j);
    // Lane l: element base + l, block (base + l) / 4, word (base + l) % 4.
    __m512i c0, c1, sel;
    if (static_cast<uint32_t>(base) <= 0xFFFFFFFFu - 15u) {  // no carry into the high word
      const __m512i v = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(base))), lane);
      c0 = _mm512_or_si512(_mm512_srli_epi32(v, 2),
                           _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(base >> 32) << 30)));
      c1 = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(base >> 34)));
      sel = _mm512_and_si512(v, _mm512_set1_epi32(3));
    } else {
      alignas(64) uint32_t lo[16], hi[16], sl[16];
      for (int l = 0; l < 16; ++l) {
        lo[l] = static_cast<uint32_t>((base + l) >> 2);
        hi[l] = static_cast<uint32_t>((base + l) >> 34);
        sl[l] = static_cast<uint32_t>((base + l) & 3);
      }
      c0 = _mm512_load_si512(lo);
      c1 = _mm512_load_si512(hi);
      sel = _mm512_load_si512(sl);
    }
    __m512i c2 = c2_init, c3 = c3_init;
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
    __m512i word = c0;
    word = _mm512_mask_mov_epi32(word, _mm512_cmpeq_epi32_mask(sel, _mm512_set1_epi32(1)), c1);
    word = _mm512_mask_mov_epi32(word, _mm512_cmpeq_epi32_mask(sel, _mm512_set1_epi32(2)), c2);
    word = _mm512_mask_mov_epi32(word, _mm512_cmpeq_epi32_mask(sel, _mm512_set1_epi32(3)), c3);
    const __mmask16 keep = _mm512_cmpge_epu32_mask(word, vthr);
    _mm512_storeu_ps(out + j, _mm512_maskz_mov_ps(keep, vscale));
  }
  return j;
}

inline bool cpu_has_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") &&
                         std::getenv("TRANSFORMER_FAST_CPU_NO_AVX512") == nullptr;
  return ok;
}
#endif

// out[j] = scale if element first_index + j is kept (philox_word >= threshold), else 0; each
// lane runs its element's whole block and keeps its word (as philox_word does);
// bit-identical to philox_word (checked against transformer_fast/philox.py by the tests).
inline void dropout_factors(uint64_t seed, uint64_t offset, uint64_t first_index, int64_t n,
                            uint32_t threshold, float scale, float* out) {
  int64_t j = 0;
#ifdef TF_CPU_AVX2_PRAGMA
  if (cpu_has_avx512()) j = dropout_factors_avx512(seed, offset, first_index, n, threshold, scale, out);
  const __m256i va = _mm256_set1_epi32(static_cast<int>(kPhiloxA));
  const __m256i vb = _mm256_set1_epi32(static_cast<int>(kPhiloxB));
  const __m256i c2_init = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset)));
  const __m256i c3_init = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset >> 32)));
  const __m256i vthr = _mm256_set1_epi32(static_cast<int>(threshold));
  const __m256 vscale = _mm256_set1_ps(scale);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (; j + 8 <= n; j += 8) {
    const uint64_t base = first_index + static_cast<uint64_t>(j);
    __m256i c0, c1, sel;  // lane l: block (base + l) / 4, word (base + l) % 4
    if (static_cast<uint32_t>(base) <= 0xFFFFFFFFu - 7u) {  // no carry into the high word
      const __m256i v = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(base))), lane);
      c0 = _mm256_or_si256(_mm256_srli_epi32(v, 2),
                           _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(base >> 32) << 30)));
      c1 = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(base >> 34)));
      sel = _mm256_and_si256(v, _mm256_set1_epi32(3));
    } else {
      alignas(32) uint32_t lo[8], hi[8], sl[8];
      for (int l = 0; l < 8; ++l) {
        lo[l] = static_cast<uint32_t>((base + l) >> 2);
        hi[l] = static_cast<uint32_t>((base + l) >> 34);
        sl[l] = static_cast<uint32_t>((base + l) & 3);
      }
      c0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(lo));
      c1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(hi));
      sel = _mm256_load_si256(reinterpret_cast<const __m256i*>(sl));
    }
    __m256i c2 = c2_init, c3 = c3_init;
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
    __m256i word = c0;
    word = _mm256_blendv_epi8(word, c1, _mm256_cmpeq_epi32(sel, _mm256_set1_epi32(1)));
    word = _mm256_blendv_epi8(word, c2, _mm256_cmpeq_epi32(sel, _mm256_set1_epi32(2)));
    word = _mm256_blendv_epi8(word, c3, _mm256_cmpeq_epi32(sel, _mm256_set1_epi32(3)));
    // keep iff word >= threshold (unsigned): max(word, thr) == word
    const __m256i keep = _mm256_cmpeq_epi32(_mm256_max_epu32(word, vthr), word);
    _mm256_storeu_ps(out + j, _mm256_and_ps(_mm256_castsi256_ps(keep), vscale));
  }
#endif
  for (; j < n; ++j) {
    out[j] = philox_word(seed, offset, first_index + static_cast<uint64_t>(j)) >= threshold ? scale : 0.0f;
  }
}

}  // namespace
}  // namespace transformer_fast
