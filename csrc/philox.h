// Philox4x32-10 dropout stream shared by the CPU and CUDA kernels.
//
// Must match transformer_fast/philox.py bit for bit:
//   key     (k0, k1)         = (lo32(seed), hi32(seed))
//   counter (c0, c1, c2, c3) = (lo32(n), hi32(n), lo32(offset), hi32(offset)),  n = i / 4
//   10 rounds of
//     c0, c1, c2, c3 = mulhi(B, c2) ^ c1 ^ k0, B * c2, mulhi(A, c0) ^ c3 ^ k1, A * c0
//     k0, k1 += 0x9E3779B9, 0xBB67AE85
//   random word of element i = (c0, c1, c2, c3)[i % 4];
//   keep iff word >= threshold(p) = min(floor(p * 2^32), 2^32 - 1)
// where i is the row-major element index in the op's logical (M, N) layout.  One block serves 4
// consecutive elements: a thread that handles them runs philox_block once (philox_word runs a
// whole block for one element).
#pragma once

#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define TF_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TF_HOST_DEVICE inline
#endif

namespace transformer_fast {

constexpr uint32_t kPhiloxA = 0xD2511F53u;
constexpr uint32_t kPhiloxB = 0xCD9E8D57u;
constexpr uint32_t kPhiloxKeyA = 0x9E3779B9u;
constexpr uint32_t kPhiloxKeyB = 0xBB67AE85u;

TF_HOST_DEVICE uint32_t philox_mulhi(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

struct PhiloxBlock {
  uint32_t w[4];
};

// The four output words of Philox4x32-10 for block `block` of the stream (seed, offset): the
// words of elements 4 * block .. 4 * block + 3.
TF_HOST_DEVICE PhiloxBlock philox_block(uint64_t seed, uint64_t offset, uint64_t block) {
  uint32_t c0 = static_cast<uint32_t>(block);
  uint32_t c1 = static_cast<uint32_t>(block >> 32);
  uint32_t c2 = static_cast<uint32_t>(offset);
  uint32_t c3 = static_cast<uint32_t>(offset >> 32);
  uint32_t k0 = static_cast<uint32_t>(seed);
  uint32_t k1 = static_cast<uint32_t>(seed >> 32);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    const uint32_t hi_b = philox_mulhi(kPhiloxB, c2);
    const uint32_t lo_b = kPhiloxB * c2;
    const uint32_t hi_a = philox_mulhi(kPhiloxA, c0);
    const uint32_t lo_a = kPhiloxA * c0;
    c0 = hi_b ^ c1 ^ k0;
    c1 = lo_b;
    c2 = hi_a ^ c3 ^ k1;
    c3 = lo_a;
    k0 += kPhiloxKeyA;
    k1 += kPhiloxKeyB;
  }
  return PhiloxBlock{{c0, c1, c2, c3}};
}

// The random word of element `index` of the stream (seed, offset).
TF_HOST_DEVICE uint32_t philox_word(uint64_t seed, uint64_t offset, uint64_t index) {
  const PhiloxBlock b = philox_block(seed, offset, index >> 2);
  const uint32_t lane = static_cast<uint32_t>(index & 3);  // selects, not an indexed (local-memory) load
  return lane == 0 ? b.w[0] : lane == 1 ? b.w[1] : lane == 2 ? b.w[2] : b.w[3];
}

// uint32 threshold below which a word drops its element (same as philox.dropout_threshold).
inline uint32_t dropout_threshold(double p) {
  const double t = p * 4294967296.0;
  if (!(t > 0.0)) return 0u;  // p <= 0 (or NaN): keep everything
  if (t >= 4294967295.0) return 0xFFFFFFFFu;
  return static_cast<uint32_t>(t);  // floor for positive values
}

// Scale of a kept element: 1 / (1 - p); p >= 1 drops (almost) everything, so use 0 then.
inline float dropout_scale(double p) { return p < 1.0 ? static_cast<float>(1.0 / (1.0 - p)) : 0.0f; }

}  // namespace transformer_fast
