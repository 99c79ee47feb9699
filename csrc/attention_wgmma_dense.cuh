// The sm_90a dense forward on warpgroup MMA, laid out after FlashAttention-3 (step 2 of the plan in
// benchmarks/NOTES.md): for the calls fwd_dense_kernel takes without an attn_mask (fp16 / bf16,
// no dropout, is_causal and key_padding_mask allowed, 16-byte aligned rows, head dim <= 128) when
// the wgmma kernels are on (by default on a Hopper GPU with sm_90a code; TRANSFORMER_FAST_CUDA_WGMMA=0
// turns them off; attention_cuda.cu's wgmma_mode).  Included by attention_cuda.cu inside its anonymous
// namespace after attention_wgmma.cuh (descriptors, core-matrix layout, wgmma wrappers) and
// attention_dense_fwd.cuh (exp2_approx).  Written without a GPU; its gpu tests (the oracle, head
// dims 16-128, ragged lengths, GQA, causal) passed on an H100 (2026-11-26 and -27; the
// key_padding_mask since, emulation only), and the CPU emulation runs its indexing,
// descriptors, masking and online softmax against the oracle.
//
// One CTA = two warpgroups (256 threads) per (b, h, 128 query rows); warpgroup w owns rows
// 64w..64w+63 (its warps 16 rows each, as wgmma's accumulators give them).  Keys in tiles of 128:
//   * S = Q K^T is wgmma m64n128k16 with Q and K read from shared memory (K-major);
//   * O += P V is wgmma m64n{64,128}k16 with P in registers and V read MN-major;
//   * Q, K and V tiles in the 128-byte swizzled layout (below);
//   * iteration j issues S_j and then the P_{j-1} V_{j-1} product of the previous tile, then the
//     copies of the next tile, waits for S_j only (wait_group 1), runs the softmax of S_j, waits
//     for the product and rescales O (ptxas moves that second wait up to the row max, so only
//     part of the softmax overlaps the product: benchmarks/NOTES.md, 2026-11-27);
//   * shared memory: Q (128 rows) and two buffers of {K_j, V_{j-1}}: iteration j reads buffer
//     j % 2 while cp.async fills buffer (j + 1) % 2 with K_{j+1} and V_j, one barrier per tile
//     (161 KB at head dim 128, one CTA per SM).
// Not here yet (plan step 3): TMA, a producer warp with setmaxnreg, and ping-pong scheduling of
// the two warpgroups' softmax against each other's MMAs.

constexpr int kWdThreads = 256;  // two warpgroups
constexpr int kWdBM = 128;       // query rows per CTA
constexpr int kWdBN = 128;       // keys per tile

template <int DP>
constexpr size_t wgmma_dense_smem_bytes() {
  // Q, 2 x {K, V}, 1 KB to start them on a 1024-byte boundary (the swizzle pattern's), and the
  // key_padding_mask's words: 2 x 4 tile masks, 8 for the end-of-row reduction.
  return size_t{kWdBM + 4 * kWdBN} * DP * sizeof(uint16_t) + 1024 + 16 * sizeof(uint32_t);
}

// One past the last key of a key_padding_mask row that is not padding (0: all padding), over the
// CTA: each thread scans keys tid, tid + 256, ..., then the warps' maxima meet in `red` (8
// words).  A right-padded row's tiles past it are then never loaded nor computed.
__device__ __forceinline__ int wg_kpm_end(const bool* kpm, int64_t stride, int Lk, uint32_t* red) {
  const int tid = static_cast<int>(threadIdx.x);
  int end = 0;
  for (int j = tid; j < Lk; j += kWdThreads) {
    if (!kpm[j * stride]) end = j + 1;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const int other = __shfl_xor_sync(0xffffffffu, end, o);
    end = other > end ? other : end;
  }
  if (tid % 32 == 0) red[tid / 32] = static_cast<uint32_t>(end);
  __syncthreads();
  int r = 0;
#pragma unroll
  for (int w = 0; w < kWdThreads / 32; ++w) r = static_cast<int>(red[w]) > r ? static_cast<int>(red[w]) : r;
  return r;
}

// The masking of one tile of scaled scores in a wgmma accumulator (m64nBN: this thread's s[i] is
// key n0 + 8 (i / 4) + 2 t + (i & 1) of row row_a + 8 ((i >> 1) & 1)), shared by the forward and
// dQ: only tiles that cross the causal diagonal or Lk or hold padding (tile `it`'s pad words) run
// the per-score test, in a warp-uniform branch (a select per score would be if-converted into
// every tile: BN / 2 compares and selects per thread).
template <bool kCausal, int BN>
__device__ __forceinline__ void wg_mask_tile(float (&s)[BN / 2], const DensePadBits<BN>& pads, int it, int n0,
                                             int row_w, int row_a, int Lk, int t) {
  uint32_t pw[BN / 32] = {};  // key n0 + 32 w + c is bit c of pw[w]
  if (pads.kpm != nullptr) {
#pragma unroll
    for (int w = 0; w < BN / 32; ++w) pw[w] = pads.word(it, w);
  }
  uint32_t any_pad = 0;
#pragma unroll
  for (int w = 0; w < BN / 32; ++w) any_pad |= pw[w];
  if ((kCausal && n0 + BN - 1 > row_w) || n0 + BN > Lk || any_pad != 0) {
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) {
      // The key's column c: word c / 32 = i / 16 and bit c % 32, written so that the word's index
      // is a constant (with c / 32, t < 4 is unknown to the compiler: pw indexed at run time).
      const int c = 8 * (i / 4) + 2 * t + (i & 1);
      s[i] = (pw[i / 16] >> (8 * ((i / 4) % 4) + 2 * t + (i & 1))) & 1u
                 ? -INFINITY
                 : dense_masked<kCausal>(s[i], true, n0 + c, row_a + 8 * ((i >> 1) & 1), Lk);
    }
  }
}

// ---- 128-byte swizzled tiles, the layout TMA writes and FlashAttention-3 / CUTLASS feed wgmma
// (the no-swizzle core-matrix layout of attention_wgmma.cuh ran at 240 TFLOP/s in H100 run 3,
// below the mma.sync kernels; benchmarks/NOTES.md).  A ROWS x DP tile of 16-bit elements is
// DP / 64 atoms of ROWS rows x 64 columns (128 bytes a row), one after the other; inside a row
// the 16-byte chunk c of the atom sits at chunk c ^ (row % 8): what the hardware's 128B mode
// does to an address (bits 4-6 ^= bits 7-9), so a tile must start on a 1024-byte boundary.
// As a K-major operand (Q, K: rows = M / N) one 16-column slab is the 32 bytes at column
// 16 (kc % 4) of atom kc / 4 (descriptor: stride byte offset 1024 between 8-row groups, leading
// offset unused); as an MN-major operand (V: rows = keys = K) a 16-key slab starts at its first
// row (stride byte offset 1024 between 8-key groups, leading byte offset ROWS * 128 between the
// 64-column atoms).  The PTX ISA's canonical layouts: K-major ((8,m),(T,2k)):((8T,SBO),(1,T)),
// MN-major ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO)), both under Swizzle<3,4,3>.
template <int ROWS>
__device__ __forceinline__ int sw128_offset(int row, int col) {
  return (col >> 6) * (ROWS * 64) + row * 64 + ((((col >> 3) & 7) ^ (row & 7)) << 3) + (col & 7);
}

// The first element of K-major slab kc (columns 16 kc .. 16 kc + 15) of rows row0 .. (row0 % 8 == 0).
template <int ROWS>
__device__ __forceinline__ int sw128_k_slab(int row0, int kc) {
  return (kc >> 2) * (ROWS * 64) + row0 * 64 + (kc & 3) * 16;
}

__device__ __forceinline__ uint64_t wgmma_desc_sw128(const uint16_t* start, uint32_t leading_bytes) {
  return wgmma_desc(start, leading_bytes, 1024) | (uint64_t{1} << 62);
}

// The first 1024-byte boundary of the dynamic shared memory (each launch allocates 1 KB more
// than its tiles need): a GPU promises 16-byte alignment, the 128B swizzle needs 1024.
__device__ __forceinline__ uint16_t* sw128_base(uint16_t* smem) {
  return smem + ((1024u - (smem_address(smem) & 1023u)) & 1023u) / 2;
}

// This thread's share of a ROWS x DP tile copy over 256 threads into the 128-byte swizzled
// layout, rows r0 + i * kRowsPerPass, chunk column c0: consecutive threads take consecutive
// 16-byte chunks of a row (a warp reads whole rows; each 8 threads store one 128-byte atom row,
// its chunks permuted: no bank conflicts).
template <int ROWS, int DP>
struct WgCopy {
  static constexpr int kChunks = DP / 8;
  static constexpr int kRowsPerPass = kWdThreads / kChunks;
  static constexpr int kPasses = ROWS / kRowsPerPass;
  // Shared-memory elements from one pass to the next (a row keeps its position in its 8-row
  // group, which the swizzle depends on).
  static constexpr int kPassElems = kRowsPerPass * 64;
  static_assert(ROWS % kRowsPerPass == 0 && kRowsPerPass % 8 == 0, "whole passes of whole 8-row groups");
  int r0, c0, dst;  // first row, first column, shared-memory element offset of pass 0
  __device__ __forceinline__ explicit WgCopy(int tid)
      : r0(tid / kChunks), c0((tid % kChunks) * 8), dst(sw128_offset<ROWS>(r0, c0)) {}

  // Rows [0, ROWS) of a tile whose row 0 is `tile` (rows `ld` apart), zero-filled from row
  // `nrows` and (col_ok false) in this thread's columns >= D; `base` is any valid address.
  __device__ __forceinline__ void operator()(uint16_t* s, const uint16_t* tile, const uint16_t* base, int64_t ld,
                                             int nrows, bool col_ok) const {
    if (nrows >= ROWS) {
      // Every row exists (all tiles but a sequence's last): no per-row test, an add per copy
      // (as dense_copy_rows).
      const uint16_t* from = col_ok ? tile + static_cast<int64_t>(r0) * ld + c0 : base;
      const int64_t step = col_ok ? kRowsPerPass * ld : 0;
#pragma unroll
      for (int i = 0; i < kPasses; ++i) cp_async16(s + dst + i * kPassElems, from + i * step, col_ok);
      return;
    }
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int r = r0 + i * kRowsPerPass;
      const bool valid = col_ok && r < nrows;
      cp_async16(s + dst + i * kPassElems, valid ? tile + static_cast<int64_t>(r) * ld + c0 : base, valid);
    }
  }
};

// A warpgroup accumulator block (8 K columns per m16n8 C-layout group) as the register A operand
// of its K 16-wide k slabs: acc_to_a per slab.
template <typename T, int K>
__device__ __forceinline__ void acc_to_a_slabs(uint32_t (&a)[K][4], const float (&acc)[8 * K]) {
#pragma unroll
  for (int kk = 0; kk < K; ++kk) acc_to_a<T>(a[kk], reinterpret_cast<const float(*)[4]>(acc), kk);
}

// kPad: whether the call has a key_padding_mask.  The unmasked instantiation has the main loop of
// H100 run 4 (466 TFLOP/s at B4 H16 L4096 D128); with the key-padding code in the same kernel,
// branched over at run time, run 5 measured 418 (benchmarks/NOTES.md, fifth GPU run).
template <typename T, int DP, bool kCausal, bool kPad>
__global__ void __launch_bounds__(kWdThreads, 1) fwd_wgmma_dense_kernel(const Params p) {
  static_assert(DP == 64 || DP == 128, "head-dim buckets of the wgmma forward");
#if defined(__CUDA_ARCH__) && !defined(TF_SM90A)
  __trap();  // sm_90a only (the host runs it only where the build holds sm_90a code); no body
             // for the other architectures' compile
#else
  constexpr int BM = kWdBM, BN = kWdBN, kTile = BN * DP;
  extern __shared__ __align__(16) uint16_t smem[];
  uint16_t* const Qs = sw128_base(smem);  // [BM x DP]
  uint16_t* const kv = Qs + kTile;  // [2 buffers][K, V][BN x DP]
  uint32_t* const pad_words = reinterpret_cast<uint32_t*>(kv + 4 * kTile);  // [2][BN / 32] masks, [8]

  const int tid = threadIdx.x, wg = tid / 128, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int warp_in_wg = (tid % 128) / 32;
  const auto [bh, b, h, hk, m0] = dense_query_block<kCausal, BM>(p);  // causal: longest blocks first

  static_assert(BM == BN, "Q and the K / V tiles share one copy mapping");
  static_assert(BN == 128, "four 32-bit pad words per tile");
  const WgCopy<BN, DP> copy(tid);
  const bool col_ok = copy.c0 < p.D;
  const uint16_t* qh = p.q + b * p.q_sb + h * p.q_sh;
  const uint16_t* kh = p.k + b * p.k_sb + hk * p.k_sh;
  const uint16_t* vh = p.v + b * p.v_sb + hk * p.v_sh;

  // Prologue: Q and K_0 (buffer 0), one group.
  copy(Qs, qh + static_cast<int64_t>(m0) * p.q_sm, qh, p.q_sm, p.Lq - m0, col_ok);
  copy(kv, kh, kh, p.k_sm, p.Lk, col_ok);
  cp_async_commit();

  // key_padding_mask (row b): the tiles end after the row's last valid key (right padding costs
  // nothing), and each tile's 128 pad bits (fwd_dense_kernel's ballot, loaded a tile ahead)
  // send the tiles with padding through the masking branch.  A row of padding only still runs
  // tile 0, all of it masked: output 0, lse -inf.
  DensePadBits<BN> pads(p, b, pad_words);
  if constexpr (!kPad) pads.kpm = nullptr;  // a constant: every pad branch folds away
  int n_end = kCausal ? min(p.Lk, m0 + BM) : p.Lk;
  if (pads.kpm != nullptr) n_end = min(n_end, wg_kpm_end(pads.kpm, pads.stride, p.Lk, pad_words + 2 * (BN / 32)));
  const int ntiles = n_end > 0 ? (n_end + BN - 1) / BN : 1;
  pads.load(0, p.Lk);

  float o[DP / 2];  // o[4 * dt + e]: rows g + 8 (e >> 1), columns 8 dt + 2 t + (e & 1)
#pragma unroll
  for (int i = 0; i < DP / 2; ++i) o[i] = 0.0f;
  float m_i[2] = {-INFINITY, -INFINITY}, l_i[2] = {0.0f, 0.0f};  // base-2 running max, sums
  uint32_t pa[BN / 16][4];  // P of the previous tile: the register A operand of its PV product
  const float scale2 = p.scale * 1.4426950408889634f;
  const int row_w = m0 + 64 * wg + 16 * warp_in_wg;  // this warp's first row
  const int row_a = row_w + g;                       // this thread's rows: row_a, row_a + 8

  // Iteration j waits for buffer j % 2 ({K_j, V_{j-1}}: this thread's copies landed, fenced
  // into the async proxy, then everyone's) ...
  const auto wait_tile = [&](int j) {
    pads.publish(j);  // (the mask buffer j % 2 was last read before the previous barrier)
    cp_async_wait<0>();
    fence_proxy_async_smem();
    __syncthreads();
    pads.load((j + 1) * BN, p.Lk);
    return kv + (j & 1) * 2 * kTile;  // K_j; V_{j-1} follows it
  };
  // ... and, since everyone has also finished iteration j - 1 at that barrier, refills buffer
  // (j + 1) % 2 with K_{j+1} and V_j.  Called after iteration j's MMAs are issued, so that the
  // tensor cores work while the copies' addresses are computed and issued (before, the copies
  // came first: ~400 instructions per thread of each tile with no MMA in flight, SASS).
  const auto prefetch = [&](int j) {
    uint16_t* nb = kv + ((j + 1) & 1) * 2 * kTile;
    const int n1 = (j + 1) * BN;
    if (j + 1 < ntiles) copy(nb, kh + static_cast<int64_t>(n1) * p.k_sm, kh, p.k_sm, p.Lk - n1, col_ok);
    copy(nb + kTile, vh + static_cast<int64_t>(j * BN) * p.v_sm, vh, p.v_sm, p.Lk - j * BN, col_ok);
    cp_async_commit();
  };
  // S = Q K^T for the keys of tile Ks, issued as one wgmma group (not waited for).
  const auto issue_s = [&](float (&s)[BN / 2], const uint16_t* Ks) {
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) s[i] = 0.0f;
    pin_registers(s);
    wgmma_fence();
#pragma unroll
    for (int kc = 0; kc < DP / 16; ++kc) {
      wgmma_m64n128k16_ss<T>(s, wgmma_desc_sw128(Qs + sw128_k_slab<BM>(64 * wg, kc), 16),
                             wgmma_desc_sw128(Ks + sw128_k_slab<BN>(0, kc), 16), kc);
    }
    wgmma_commit();
  };
  // O += P V for the previous tile (P in pa, V at Vs), one wgmma group (not waited for).
  const auto issue_pv = [&](const uint16_t* Vs) {
    pin_registers(o);  // the rescaled O and the new P are written before the fence (not sunk past it)
    pin_registers(pa);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      wgmma_m64k16_rs<T, DP>(o, pa[kk], wgmma_desc_sw128(Vs + 16 * kk * 64, BN * 128));
    }
    wgmma_commit();
  };
  // Online softmax (base 2) of the finished S of keys n0..: the new running max and sums, the
  // factor alpha that rescales O, and P in place of S (fp32; acc_to_a_slabs packs it as the
  // A operand of keys 16kk..16kk+15 once the previous P V product has released the registers).
  const auto softmax = [&](float (&s)[BN / 2], int n0, float (&alpha)[2]) {
    pin_registers(s);
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) s[i] *= scale2;
    wg_mask_tile<kCausal, BN>(s, pads, n0 / BN, n0, row_w, row_a, p.Lk, t);
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) {
      mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s[i]);  // a NaN score propagates through p, not the max
    }
    float m_use[2];
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      float m = fmaxf(mx[rh], __shfl_xor_sync(0xffffffffu, mx[rh], 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      const float m_new = fmaxf(m_i[rh], m);
      m_use[rh] = m_new == -INFINITY ? 0.0f : m_new;  // nothing visible yet: exp2(-inf) = 0
      alpha[rh] = exp2_approx(m_i[rh] - m_use[rh]);
      m_i[rh] = m_new;
      l_i[rh] *= alpha[rh];
    }
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) {
      s[i] = exp2_approx(s[i] - m_use[(i >> 1) & 1]);  // -inf -> +0
      l_i[(i >> 1) & 1] += s[i];
    }
  };

  // Tile 0: S only (O is still zero: nothing to rescale).
  {
    const uint16_t* Ks = wait_tile(0);
    float s[BN / 2], alpha[2];
    issue_s(s, Ks);
    prefetch(0);
    wgmma_wait<0>();
    softmax(s, 0, alpha);
    acc_to_a_slabs<T>(pa, s);
  }
  // Tiles 1 .. ntiles - 1, straight-line (ptxas tracks the two groups in flight only without
  // branches around them): S_j and P_{j-1} V_{j-1} issued, the softmax of S_j while the second runs.
  for (int j = 1; j < ntiles; ++j) {
    const uint16_t* Ks = wait_tile(j);
    float s[BN / 2], alpha[2];
    issue_s(s, Ks);
    issue_pv(Ks + kTile);
    prefetch(j);
    wgmma_wait<1>();  // S_j done
    // P stays in s (fp32) until the wait: the old P's registers are in flight.  (ptxas places
    // this wait right after the row max whatever the source order: benchmarks/NOTES.md,
    // 2026-11-27; a second warpgroup's MMAs are what can fill that gap.)
    softmax(s, j * BN, alpha);
    wgmma_wait<0>();  // P_{j-1} V_{j-1} done: O and the old P are free
    pin_registers(o);
    pin_registers(pa);
#pragma unroll
    for (int i = 0; i < DP / 2; ++i) o[i] *= alpha[(i >> 1) & 1];
    acc_to_a_slabs<T>(pa, s);
  }
  // The last tile's P V.
  issue_pv(wait_tile(ntiles) + kTile);
  wgmma_wait<0>();
  pin_registers(o);

  finish_dense_rows<T, DP>(p, bh, p.out + b * p.o_sb + h * p.o_sh, row_a, t, m_i, l_i,
                           reinterpret_cast<const float(*)[4]>(o));
#endif
}
