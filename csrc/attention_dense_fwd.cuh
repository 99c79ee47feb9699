// The dense fast path of the fp16 / bf16 forward: no dropout (is_causal, key_padding_mask and
// attn_mask allowed), 16-byte aligned rows, head dim <= 128.  Included by attention_cuda.cu
// inside its anonymous namespace (it uses that file's Params, Traits, ldmatrix and cp.async
// helpers); attention_fwd_cuda sends every other forward to fwd_kernel.
//
// Same algorithm and tiles as fwd_kernel (one CTA of 4 warps per (b, h, 64 query rows), 16 rows
// per warp, 64-key K/V tiles double-buffered by cp.async, mma.sync m16n8k16, P kept in
// registers), with what is per element and run-time generic taken out of the loop:
//   * no dropout code, and the 32 scores a thread owns per tile are straight-line code; the
//     per-element test (causal diagonal, keys past Lk, padding, attn_mask: dense_score) sits
//     behind a warp-uniform branch taken by the tiles that need it alone;
//   * scores scaled once by scale * log2(e) and exponentiated with ex2.approx.ftz (the running
//     max is kept in base-2 units; lse is converted back to the natural log at the end);
//   * ldmatrix.x4 for K and V (two n-tiles or two k-slabs per instruction), Q staged through
//     shared memory by cp.async + ldmatrix instead of two-byte global loads;
//   * copy addresses computed once per CTA (one add per tile), O written as packed 4-byte pairs;
//   * causal: the CTAs with the most key tiles are scheduled first;
//   * key_padding_mask: a tile's 64 pad flags become one 64-bit mask in shared memory (a ballot
//     by warps 0-1 over flags loaded one tile ahead, so the load's latency hides behind a tile's
//     MMAs); a tile with padding takes the masked branch, a tile of padding alone is skipped;
//   * attn_mask: every tile takes the masked branch, which reads the mask per score through its
//     strides (as the generic kernels do; no tile can be skipped without reading it).
// Measured before it was ported (benchmarks/cuda_attn, the same kernel outside the package,
// NVIDIA H200, bf16, D = 128): 0.544 ms (252 TFLOP/s) at B16 H16 L1024 against fwd_kernel's
// 2.04 ms (67), 2.01 ms (273) at B4 H16 L4096; causal 211-254 TFLOP/s; 216 registers, no
// spills, 2 CTAs per SM (benchmarks/NOTES.md, second GPU run).  As ported here (fp16 too, head
// dims below the bucket, ragged Lq / Lk) it passed its gpu tests on an H100 (run 3, 253 TFLOP/s
// at B16 H16 L1024); the mask paths, added since, have run in the CPU emulation only.

constexpr int kDenseBM = 16 * kThreads / 32;  // 64 query rows per CTA
constexpr int kDenseBN = 64;                   // keys per tile

// ex2.approx.ftz: the softmax's exponent in base 2 (one MUFU instruction, no range fix-up).
__device__ __forceinline__ float exp2_approx(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
#else
  return std::exp2(x);
#endif
}

// ROWS rows of a (rows, DP) tile into shared memory (row pitch DP + kPad): this thread copies
// the 16-byte chunk at column c0 of rows r0, r0 + kRowsPerPass, ...; `src` points at its row r0,
// chunk c0, rows `ld` elements apart.  Rows >= nrows and columns >= D (col_ok false) are zero
// filled without being read (cp.async with source size 0, from the always valid `base`).
// The MMA steps the dense kernels share (fwd_dense_kernel, dq_dense_kernel, dkdv_dense_kernel).
// Lane offsets, in elements inside a tile of row pitch DP + kPad:
//   dense_bt_lane: the tile's rows as B^T (B[k][n] = tile[n][k]), four 8-column slabs of 8 rows
//                  per ldmatrix.x4, i.e. two 16-wide k slabs of one n-tile;
//   dense_b_lane:  the tile as B (B[k][n] = tile[k][n]), two 8-row halves x two 8-column groups
//                  per ldmatrix.x4.trans, i.e. one 16-row k slab of two n-tiles;
//   dense_a_lane:  rows row0..row0+15 as an A fragment per ldmatrix.x4.
template <int DP>
__device__ __forceinline__ int dense_bt_lane(int lane) { return (lane % 8) * (DP + kPad) + 8 * (lane / 8); }
template <int DP>
__device__ __forceinline__ int dense_b_lane(int lane) {
  return ((lane % 8) + 8 * ((lane / 8) & 1)) * (DP + kPad) + 8 * (lane / 16);
}
template <int DP>
__device__ __forceinline__ int dense_a_lane(int lane, int row0) { return dense_b_lane<DP>(lane) + row0 * (DP + kPad); }

// acc (one m16n8 tile) += A (16 x 32: the k slabs a0, a1) . B, B^T = the 8 tile rows at `rows`
// (+ dense_bt_lane), columns from the slab pair's first.
template <typename T>
__device__ __forceinline__ void mma_rows_t(float acc[4], const uint32_t a0[4], const uint32_t a1[4],
                                           const uint16_t* rows) {
  uint32_t bf[4];
  ldmatrix<4, false>(bf, rows);
  Traits<T>::mma(acc, a0, bf[0], bf[1]);
  Traits<T>::mma(acc, a1, bf[2], bf[3]);
}

// acc (DP / 8 m16n8 tiles) += A (16 x 16) . B, B = the 16 tile rows at `rows` (+ dense_b_lane).
template <typename T, int DP>
__device__ __forceinline__ void mma_rows(float (*acc)[4], const uint32_t a[4], const uint16_t* rows) {
#pragma unroll
  for (int dt = 0; dt < DP / 8; dt += 2) {
    uint32_t bf[4];
    ldmatrix<4, true>(bf, rows + dt * 8);
    Traits<T>::mma(acc[dt], a, bf[0], bf[1]);
    Traits<T>::mma(acc[dt + 1], a, bf[2], bf[3]);
  }
}

// Writes accumulator row half rh (this thread's columns 2t, 2t + 1 of each n-tile) times `mul`
// to `row` (this thread's first column; unit stride) in 4-byte pairs, columns < D only.
template <typename T, int DP>
__device__ __forceinline__ void store_row_pairs(uint16_t* row, const float (*acc)[4], int rh, float mul, int D,
                                                int t) {
#pragma unroll
  for (int dt = 0; dt < DP / 8; ++dt) {
    if (dt * 8 + 2 * t < D) {
      *reinterpret_cast<uint32_t*>(row + dt * 8) = Traits<T>::pack(acc[dt][2 * rh] * mul, acc[dt][2 * rh + 1] * mul);
    }
  }
}

// Score (times scale * log2 e) of key j for this thread's row of row half rh, -inf where the key
// is past Lk or (causal) past the row; `edge` (warp-uniform) says whether the tile needs the
// test.  (The wgmma dense kernels, which take no masks.)
template <bool kCausal>
__device__ __forceinline__ float dense_masked(float x, bool edge, int j, int row, int Lk) {
  return edge && (j >= Lk || (kCausal && j > row)) ? -INFINITY : x;
}

constexpr float kFloatMax = 3.402823466e+38f;

// x * log2 e for x in natural units, a finite x saturating at +-FLT_MAX instead of overflowing
// to +-inf (kernels/attention.py's _to_log2): a row masked with a huge finite float bias
// (torch.finfo(dtype).min) stays finite and uniform, as torch's, instead of dead.
__device__ __forceinline__ float dense_to_log2(float x) {
  const float y = x * 1.4426950408889634f;
  return fabsf(x) <= kFloatMax ? fminf(fmaxf(y, -kFloatMax), kFloatMax) : y;
}

// attn_mask (p.am, read through its strides) applied to the base-2 score x of (query i, key j)
// of head (b, h), i < Lq and j < Lk: a bool mask's False gives -inf, a float mask is added
// (times log2 e, the scores' unit; fp16 cannot overflow there).  The type switch is uniform over
// the grid.
__device__ __forceinline__ float dense_attn_masked(const Params& p, float x, int b, int h, int i, int j) {
  const int64_t off = b * p.am_sb + h * p.am_sh + static_cast<int64_t>(i) * p.am_sm + static_cast<int64_t>(j) * p.am_sn;
  switch (p.am_type) {
    case kMaskBool: return static_cast<const bool*>(p.am)[off] ? x : -INFINITY;
    case kMaskHalf: return x + __half2float(static_cast<const __half*>(p.am)[off]) * 1.4426950408889634f;
    case kMaskBf16: return x + dense_to_log2(__bfloat162float(static_cast<const __nv_bfloat16*>(p.am)[off]));
    default: return x + dense_to_log2(static_cast<const float*>(p.am)[off]);
  }
}

// The dense mma.sync kernels' score (times scale * log2 e) of (query i, key j) of head (b, h) in
// a tile that needs the per-element test (`edge`, warp-uniform; else x as it is): -inf where the
// key is past Lk, (causal) past the query or padding (`padded`: its key_padding_mask bit); else
// with attn_mask applied, where a query past Lq (never stored) gets -inf instead of a read
// (kAttnMask: the kernels' instantiations for calls with one, so that those without keep the
// registers and schedule they had).
template <bool kCausal, bool kAttnMask>
__device__ __forceinline__ float dense_score(const Params& p, float x, bool edge, int b, int h, int i, int j,
                                             bool padded) {
  if (!edge) return x;
  if (j >= p.Lk || (kCausal && j > i) || padded) return -INFINITY;
  if constexpr (kAttnMask) return i < p.Lq ? dense_attn_masked(p, x, b, h, i, j) : -INFINITY;
  return x;
}

// A warp's 16 x BN raw scores (this thread's rows row_a, row_a + 8; keys n0 + 8 nt + 2 t (+1))
// scaled to base 2, then, on the tiles that need it (edge, warp-uniform), the per-score test
// (causal diagonal, keys past Lk, padding bits `pad`, attn_mask).  The test is a branch of its
// own: written as one select per score, ptxas if-converted it into every tile (compares, bit
// tests and selects per score in the SASS; benchmarks/NOTES.md, 2026-11-27).
template <bool kCausal, bool kAttnMask, int NT>
__device__ __forceinline__ void dense_scale_and_mask(float (&s)[NT][4], const Params& p, float scale2, bool edge,
                                                     uint64_t pad, int b, int h, int row_a, int n0, int t) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) s[nt][e] *= scale2;
  }
  if (edge) {
    const uint64_t pad_t = pad >> (2 * t);  // bit nt * 8 + (e & 1): this thread's key of (nt, e)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[nt][e] = dense_score<kCausal, kAttnMask>(p, s[nt][e], true, b, h, row_a + 8 * (e >> 1),
                                                   n0 + nt * 8 + 2 * t + (e & 1), (pad_t >> (nt * 8 + (e & 1))) & 1);
      }
    }
  }
}

// key_padding_mask in the dense kernels over key tiles (fwd_dense_kernel, dq_dense_kernel): the
// tile's BN pad flags as one bit mask (bit c: key n0 + c is padding).  The first BN threads each
// load the flag of their key one tile ahead (`next`), and at a tile's start publish it by a warp
// ballot into `bits` (one 32-bit word per warp, BN / 32 words per buffer, two buffers), before
// the barrier that makes the tile visible.  Without a mask (kpm null) every call is a no-op and
// the mask is 0.
template <int BN>
struct DensePadBits {
  static_assert(BN % 32 == 0, "one ballot word per warp");
  const bool* kpm;  // row b of key_padding_mask, or null
  int64_t stride;
  uint32_t* bits;   // [2][BN / 32] in shared memory
  bool next = false;

  __device__ __forceinline__ DensePadBits(const Params& p, int b, uint32_t* smem_bits)
      : kpm(p.kpm == nullptr ? nullptr : p.kpm + b * p.kpm_sb), stride(p.kpm_sn), bits(smem_bits) {}
  __device__ __forceinline__ bool flag(int j, int Lk) const { return j < Lk && kpm[j * stride]; }
  // Loads the flag of key n0 + tid of the tile starting at n0 (threads tid < BN).
  __device__ __forceinline__ void load(int n0, int Lk) {
    const int tid = static_cast<int>(threadIdx.x);
    if (kpm != nullptr && tid < BN) next = flag(n0 + tid, Lk);
  }
  // Publishes the loaded flags as tile `it`'s mask (before the barrier that opens tile `it`).
  __device__ __forceinline__ void publish(int it) {
    const int tid = static_cast<int>(threadIdx.x);
    if (kpm != nullptr && tid < BN) {  // whole warps
      const uint32_t w = __ballot_sync(0xffffffffu, next);
      if (tid % 32 == 0) bits[(it & 1) * (BN / 32) + tid / 32] = w;
    }
  }
  // Word w (keys n0 + 32 w ..) of tile `it`'s mask (after that barrier; kpm not null).
  __device__ __forceinline__ uint32_t word(int it, int w) const { return bits[(it & 1) * (BN / 32) + w]; }
  // Tile `it`'s mask (after that barrier).
  __device__ __forceinline__ uint64_t mask(int it) const {
    if (kpm == nullptr) return 0;
    const uint32_t* w = bits + (it & 1) * (BN / 32);
    return BN == 32 ? uint64_t{w[0]} : (uint64_t{w[1]} << 32) | w[0];
  }
};

// Whether a tile whose first key is n0 holds keys past Lk or padding only (pad: its mask).
template <int BN>
__device__ __forceinline__ bool dense_tile_all_padding(uint64_t pad, int n0, int Lk) {
  const int n = min(BN, Lk - n0);
  const uint64_t live = n >= 64 ? ~uint64_t{0} : (uint64_t{1} << n) - 1;
  return pad != 0 && (pad & live) == live;
}

template <int ROWS, int DP>
__device__ __forceinline__ void dense_copy_rows(uint16_t* dst, const uint16_t* src, const uint16_t* base,
                                                int64_t ld, int r0, int nrows, bool col_ok) {
  constexpr int kRowsPerPass = kThreads / (DP / 8);
  if (nrows >= ROWS) {
    // Every row exists (all tiles but a sequence's last): no per-row test, an add per copy
    // (the tested form cost ~10 instructions per copy in the SASS: ~100 per tile and thread).
    const uint16_t* from = col_ok ? src : base;
    const int64_t step = col_ok ? kRowsPerPass * ld : 0;
#pragma unroll
    for (int i = 0; i < ROWS / kRowsPerPass; ++i) cp_async16(dst + i * kRowsPerPass * (DP + kPad), from + i * step, col_ok);
    return;
  }
#pragma unroll
  for (int i = 0; i < ROWS / kRowsPerPass; ++i) {
    const bool valid = col_ok && r0 + i * kRowsPerPass < nrows;
    cp_async16(dst + i * kRowsPerPass * (DP + kPad), valid ? src + i * kRowsPerPass * ld : base, valid);
  }
}

// Where a CTA of the dense kernels over query blocks (fwd_dense_kernel, dq_dense_kernel) works:
// head (b, h) with its kv head hk, and its first query row m0.  Causal: the blocks with the most
// key tiles are scheduled first.
struct DenseQueryBlock {
  int bh, b, h, hk, m0;
};
template <bool kCausal, int BM = kDenseBM>
__device__ __forceinline__ DenseQueryBlock dense_query_block(const Params& p) {
  const int nmb = (p.Lq + BM - 1) / BM;
  const int bh = blockIdx.x / nmb, h = bh % p.H;
  const int mb = kCausal ? nmb - 1 - static_cast<int>(blockIdx.x % nmb) : static_cast<int>(blockIdx.x % nmb);
  return {bh, bh / p.H, h, h / (p.H / p.Hkv), mb * BM};
}

// The end of the dense forwards (fwd_dense_kernel, fwd_wgmma_dense_kernel) for this thread's rows
// row_a and row_a + 8 of head bh (output rows at oh): O / l, and lse (natural log) = m ln 2 +
// log(l) from the base-2 running max m; a row with nothing visible gets 0 and -inf.  The row sums
// are completed over the quad here (every lane must call it).
template <typename T, int DP>
__device__ __forceinline__ void finish_dense_rows(const Params& p, int bh, uint16_t* oh, int row_a, int t,
                                                  const float (&m_i)[2], const float (&l_i)[2], const float (*o)[4]) {
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    float l = l_i[rh];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int i = row_a + 8 * rh;
    if (i >= p.Lq) continue;  // no barrier or shuffle follows
    const bool dead = l == 0.0f;
    const float inv = dead ? 0.0f : 1.0f / l;
    if (t == 0) {
      p.lse_out[static_cast<int64_t>(bh) * p.Lq + i] = dead ? -INFINITY : m_i[rh] * 0.6931471805599453f + __logf(l);
    }
    store_row_pairs<T, DP>(oh + static_cast<int64_t>(i) * p.o_sm + 2 * t, o, rh, inv, p.D, t);
  }
}

template <typename T, int DP, bool kCausal, bool kAttnMask>
__global__ void __launch_bounds__(kThreads, 2) fwd_dense_kernel(const Params p) {
  constexpr int BM = kDenseBM, BN = kDenseBN, PITCH = DP + kPad;
  constexpr int kBuf = 2 * BN * PITCH;  // K then V of one buffer (halves)
  constexpr int kCh = DP / 8, kRowsPerPass = kThreads / kCh;
  static_assert(BM <= 2 * BN, "Q is staged in the second K/V buffer");
  static_assert(kThreads % kCh == 0 && BN % kRowsPerPass == 0 && BM % kRowsPerPass == 0, "copy mapping");
  extern __shared__ __align__(16) uint16_t smem[];

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const auto [bh, b, h, hk, m0] = dense_query_block<kCausal>(p);

  // This thread's copy coordinates: chunk column c0 of rows r0 + i * kRowsPerPass.
  const int r0 = tid / kCh, c0 = (tid % kCh) * 8;
  const bool col_ok = c0 < p.D;  // D % 8 == 0 (vec16): a chunk is wholly in or out
  const uint16_t* qh = p.q + b * p.q_sb + h * p.q_sh;
  const uint16_t* kh = p.k + b * p.k_sb + hk * p.k_sh;
  const uint16_t* vh = p.v + b * p.v_sb + hk * p.v_sh;
  const uint16_t* ksrc = kh + static_cast<int64_t>(r0) * p.k_sm + c0;
  const uint16_t* vsrc = vh + static_cast<int64_t>(r0) * p.v_sm + c0;
  const int64_t k_tile = BN * p.k_sm, v_tile = BN * p.v_sm;
  uint16_t* const sdst = smem + r0 * PITCH + c0;  // + buffer * kBuf (+ BN * PITCH for V)

  const int n_end = kCausal ? min(p.Lk, m0 + BM) : p.Lk;
  const int ntiles = (n_end + BN - 1) / BN;
  DensePadBits<BN> pads(p, b, reinterpret_cast<uint32_t*>(smem + 2 * kBuf));
  pads.load(0, p.Lk);

  // Prologue: Q into buffer 1, key tile 0 into buffer 0, as one group.
  dense_copy_rows<BM, DP>(sdst + kBuf, qh + static_cast<int64_t>(m0 + r0) * p.q_sm + c0, qh, p.q_sm,
                          r0, p.Lq - m0, col_ok);
  dense_copy_rows<BN, DP>(sdst, ksrc, kh, p.k_sm, r0, p.Lk, col_ok);
  dense_copy_rows<BN, DP>(sdst + BN * PITCH, vsrc, vh, p.v_sm, r0, p.Lk, col_ok);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  uint32_t qf[DP / 16][4];
  {
    const uint16_t* qs = smem + kBuf + dense_a_lane<DP>(lane, warp * 16);
#pragma unroll
    for (int kc = 0; kc < DP / 16; ++kc) ldmatrix<4, false>(qf[kc], qs + kc * 16);
  }
  __syncthreads();  // buffer 1 is free for tile 1

  float o[DP / 8][4];
#pragma unroll
  for (int dt = 0; dt < DP / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
  float m_i[2] = {-INFINITY, -INFINITY}, l_i[2] = {0.0f, 0.0f};  // base-2 running max, sums
  const float scale2 = p.scale * 1.4426950408889634f;           // scale * log2(e)
  const int row_a = m0 + warp * 16 + g;                          // this thread's rows: row_a, row_a + 8
  constexpr bool has_am = kAttnMask;  // p.am_type != kMaskNone (an instantiation of its own)

  // ldmatrix lane offsets (elements) inside a tile: K as four 8-column slabs of 8 keys, V as
  // two 8-key halves x two 8-column groups (transposed).
  const int k_lane = dense_bt_lane<DP>(lane), v_lane = dense_b_lane<DP>(lane);

  for (int it = 0; it < ntiles; ++it) {
    const uint16_t* Ks = smem + (it & 1) * kBuf;
    const uint16_t* Vs = Ks + BN * PITCH;
    const int n0 = it * BN;
    if (it + 1 < ntiles) {  // buffer (it+1)&1 was released by the barrier ending iteration it-1
      uint16_t* dn = sdst + ((it + 1) & 1) * kBuf;
      const int left = p.Lk - (n0 + BN);
      dense_copy_rows<BN, DP>(dn, ksrc + (it + 1) * k_tile, kh, p.k_sm, r0, left, col_ok);
      dense_copy_rows<BN, DP>(dn + BN * PITCH, vsrc + (it + 1) * v_tile, vh, p.v_sm, r0, left, col_ok);
      cp_async_commit();
      cp_async_wait<1>();  // this thread's copies of tile `it` have landed
    } else {
      cp_async_wait<0>();
    }
    pads.publish(it);
    __syncthreads();  // tile `it` (and its pad mask) is visible to every warp
    const uint64_t pad = pads.mask(it);
    pads.load(n0 + BN, p.Lk);
    if (dense_tile_all_padding<BN>(pad, n0, p.Lk)) {  // CTA-uniform: nothing to add
      __syncthreads();
      continue;
    }

    // S = Q K^T (raw dots)
    float s[BN / 8][4];
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
    for (int kc = 0; kc < DP / 16; kc += 2) {
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt) {
        mma_rows_t<T>(s[nt], qf[kc], qf[kc + 1], Ks + k_lane + nt * 8 * PITCH + kc * 16);
      }
    }

    // Online softmax in base 2.  Masking (warp-uniform): the causal diagonal, keys past Lk,
    // padding, attn_mask (every tile).
    const bool edge = (kCausal && n0 + BN - 1 > m0 + warp * 16) || n0 + BN > p.Lk || pad != 0 || has_am;
    dense_scale_and_mask<kCausal, kAttnMask>(s, p, scale2, edge, pad, b, h, row_a, n0, t);
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);  // a NaN score propagates through p
    }
    float m_use[2];
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      float m = fmaxf(mx[rh], __shfl_xor_sync(0xffffffffu, mx[rh], 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      const float m_new = fmaxf(m_i[rh], m);
      m_use[rh] = m_new == -INFINITY ? 0.0f : m_new;  // nothing visible yet: exp2(-inf) = 0
      const float alpha = exp2_approx(m_i[rh] - m_use[rh]);
      m_i[rh] = m_new;
      l_i[rh] *= alpha;
#pragma unroll
      for (int dt = 0; dt < DP / 8; ++dt) {
        o[dt][2 * rh] *= alpha;
        o[dt][2 * rh + 1] *= alpha;
      }
    }
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pe = exp2_approx(s[nt][e] - m_use[e >> 1]);  // -inf -> +0
        l_i[e >> 1] += pe;
        s[nt][e] = pe;
      }
    }

    // O += P V: P's accumulators of n-tiles 2kk, 2kk+1 form the A fragment of keys 16kk..16kk+15.
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t a[4];
      acc_to_a<T>(a, s, kk);
      mma_rows<T, DP>(o, a, Vs + v_lane + kk * 16 * PITCH);
    }
    __syncthreads();  // every warp is done with this buffer before it is refilled
  }

  finish_dense_rows<T, DP>(p, bh, p.out + b * p.o_sb + h * p.o_sh, row_a, t, m_i, l_i, o);
}
