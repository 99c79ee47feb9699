// Dropout factors for the C++ CPU kernels: keep/(1-p) per element from philox.h's stream, 8
// Philox streams at a time with AVX2.  Included by csrc/cpu_avx2_begin.h, inside the AVX2 target
// region; without that region it compiles to the scalar loop alone.
#pragma once

#include <cstdint>

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

// out[j] = scale if element first_index + j is kept (philox_word >= threshold), else 0;
// bit-identical to philox_word (checked against transformer_fast/philox.py by the tests).
inline void dropout_factors(uint64_t seed, uint64_t offset, uint64_t first_index, int64_t n,
                            uint32_t threshold, float scale, float* out) {
  int64_t j = 0;
#ifdef TF_CPU_AVX2_PRAGMA
  const __m256i va = _mm256_set1_epi32(static_cast<int>(kPhiloxA));
  const __m256i vb = _mm256_set1_epi32(static_cast<int>(kPhiloxB));
  const __m256i c2_init = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset)));
  const __m256i c3_init = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset >> 32)));
  const __m256i vthr = _mm256_set1_epi32(static_cast<int>(threshold));
  const __m256 vscale = _mm256_set1_ps(scale);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (; j + 8 <= n; j += 8) {
    const uint64_t base = first_index + static_cast<uint64_t>(j);
    __m256i c0, c1;
    if (static_cast<uint32_t>(base) <= 0xFFFFFFFFu - 7u) {  // no carry into the high word
      c0 = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(base))), lane);
      c1 = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(base >> 32)));
    } else {
      alignas(32) uint32_t lo[8], hi[8];
      for (int l = 0; l < 8; ++l) {
        lo[l] = static_cast<uint32_t>(base + l);
        hi[l] = static_cast<uint32_t>((base + l) >> 32);
      }
      c0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(lo));
      c1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(hi));
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
    // keep iff c0 >= threshold (unsigned): max(c0, thr) == c0
    const __m256i keep = _mm256_cmpeq_epi32(_mm256_max_epu32(c0, vthr), c0);
    _mm256_storeu_ps(out + j, _mm256_and_ps(_mm256_castsi256_ps(keep), vscale));
  }
#endif
  for (; j < n; ++j) {
    out[j] = philox_word(seed, offset, first_index + static_cast<uint64_t>(j)) >= threshold ? scale : 0.0f;
  }
}

}  // namespace
}  // namespace transformer_fast
