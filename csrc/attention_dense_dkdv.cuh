// dK / dV of the dense backward (no dropout; is_causal, key_padding_mask and attn_mask allowed;
// 16-byte aligned rows, D <= 128): dkdv_kernel rewritten the way fwd_dense_kernel rewrote
// fwd_kernel.  Included by
// attention_cuda.cu after attention_dense_dq.cuh (it uses dense_copy_rows and exp2_approx).
//
// One CTA of 4 warps per (b, kv head, 64 keys), warp w owning keys 16w..16w+15, as dkdv_kernel:
// K and V stay in shared memory; the loop runs over (query head of the GQA group, 32-query tile)
// with the Q and dO tiles and the rows' lse and delta double-buffered (cp.async for the tiles).
// Per tile, in the transposed form: S^T = K Q^T and dP^T = V dO^T (K / V A fragments and Q / dO
// B fragments by ldmatrix.x4), P^T = exp2(S^T * scale * log2 e - lse * log2 e), dS^T = P^T (dP^T -
// delta), dV += P^T dO and dK += dS^T Q (dO / Q by ldmatrix.x4.trans).  Copy pointers are
// computed once per tile (not per 16-byte chunk); the causal test is behind a warp-uniform
// branch; keys past Lk need none (their rows are never stored); queries past Lq and rows whose
// lse is -inf get P = 0 through an lse of +inf.  key_padding_mask: a thread reads its two keys'
// flags once; the warps owning a padded key mask its P^T row to 0 (as the reference does, so that
// NaN / Inf propagate alike: zeroing the finished rows instead would not), and a CTA whose keys
// are all padding writes zeros without loading a tile.  Written without a GPU; checked against the
// oracle in the CPU emulation.

constexpr int kDenseKvBN = 16 * kThreads / 32;  // 64 keys per CTA
constexpr int kDenseKvBM = 32;                   // queries per tile


// The end of the dense dK / dV kernels (dkdv_dense_kernel, dkdv_wgmma_dense_kernel): this thread's
// key rows key_a and key_a + 8 of dk (times scale) and dv into (B, Hkv, Lk, D) through their
// strides, in element pairs; dk / dv in the mma accumulator layout, [DP / 8][4].
template <typename T, int DP>
__device__ __forceinline__ void store_dkdv_rows(const Params& p, int b, int hk, int key_a, int t,
                                                const float (*dk)[4], const float (*dv)[4]) {
  uint16_t* dkh = p.out + b * p.o_sb + hk * p.o_sh;
  uint16_t* dvh = p.out2 + b * p.o2_sb + hk * p.o2_sh;
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    const int j = key_a + 8 * rh;
    if (j >= p.Lk) continue;
    store_row_pairs<T, DP>(dkh + static_cast<int64_t>(j) * p.o_sm + 2 * t, dk, rh, p.scale, p.D, t);
    store_row_pairs<T, DP>(dvh + static_cast<int64_t>(j) * p.o2_sm + 2 * t, dv, rh, 1.0f, p.D, t);
  }
}

// key_padding_mask of this thread's keys key_a, key_a + 8 in the dense dK / dV kernels: bit rh
// set if key key_a + 8 rh is padding (keys past Lk count as padding: never stored); 0 without
// a mask.
__device__ __forceinline__ int dkdv_pad_bits(const Params& p, int b, int key_a) {
  int bits = 0;
  if (p.kpm != nullptr) {
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      const int j = key_a + 8 * rh;
      if (j >= p.Lk || p.kpm[b * p.kpm_sb + j * p.kpm_sn]) bits |= 1 << rh;
    }
  }
  return bits;
}

template <typename T, int DP, bool kCausal, bool kAttnMask>
__global__ void __launch_bounds__(kThreads, 2) dkdv_dense_kernel(const Params p) {
  constexpr int BN = kDenseKvBN, BM = kDenseKvBM, PITCH = DP + kPad;
  constexpr int kCh = DP / 8, kRowsPerPass = kThreads / kCh;
  static_assert(kThreads % kCh == 0 && BN % kRowsPerPass == 0 && BM % kRowsPerPass == 0, "copy mapping");
  extern __shared__ __align__(16) uint16_t smem[];
  uint16_t* const Ks = smem;
  uint16_t* const Vs = Ks + BN * PITCH;
  uint16_t* const qo_buf = Vs + BN * PITCH;                              // [2][Q, dO][BM][PITCH]
  float* const stat_buf = reinterpret_cast<float*>(qo_buf + 4 * BM * PITCH);  // [2][lse2, delta][BM]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int nnb = (p.Lk + BN - 1) / BN;
  const int nb = blockIdx.x % nnb;
  const int bhk = blockIdx.x / nnb;
  const int b = bhk / p.Hkv, hk = bhk % p.Hkv, group = p.H / p.Hkv;
  const int n0 = nb * BN;
  const int key_a = n0 + warp * 16 + g;  // this thread's keys: key_a, key_a + 8

  const int pad_bits = dkdv_pad_bits(p, b, key_a);
  if (p.kpm != nullptr) {
    if (__syncthreads_and(pad_bits == 3)) {  // CTA-uniform
      float zero[DP / 8][4] = {};
      store_dkdv_rows<T, DP>(p, b, hk, key_a, t, zero, zero);
      return;
    }
  }
  const bool warp_pad = __any_sync(0xffffffffu, pad_bits != 0);  // warp-uniform
  constexpr bool has_am = kAttnMask;  // p.am_type != kMaskNone (an instantiation of its own)

  const int r0 = tid / kCh, c0 = (tid % kCh) * 8;
  const bool col_ok = c0 < p.D;
  uint16_t* const sdst = r0 * PITCH + c0 + smem;  // + the tile's offset
  {
    const uint16_t* kh = p.k + b * p.k_sb + hk * p.k_sh;
    const uint16_t* vh = p.v + b * p.v_sb + hk * p.v_sh;
    dense_copy_rows<BN, DP>(sdst, kh + static_cast<int64_t>(n0 + r0) * p.k_sm + c0, kh, p.k_sm, r0, p.Lk - n0,
                            col_ok);
    dense_copy_rows<BN, DP>(sdst + BN * PITCH, vh + static_cast<int64_t>(n0 + r0) * p.v_sm + c0, vh, p.v_sm, r0,
                            p.Lk - n0, col_ok);
    cp_async_commit();  // waited for with the first query tile's group
  }

  float dk[DP / 8][4], dv[DP / 8][4];
#pragma unroll
  for (int dt = 0; dt < DP / 8; ++dt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[dt][e] = dv[dt][e] = 0.0f;
  }

  const float kLog2e = 1.4426950408889634f;
  const float scale2 = p.scale * kLog2e;
  const int m_start = kCausal ? (n0 / BM) * BM : 0;  // queries i < n0 see none of these keys
  const int nm = m_start < p.Lq ? (p.Lq - m_start + BM - 1) / BM : 0;
  const int ntiles = group * nm;
  auto issue = [&](int it, int buf) {  // tile `it` (query head, query rows) into buffer `buf`
    const int h = hk * group + it / nm, m0 = m_start + (it % nm) * BM;
    const uint16_t* qh = p.q + b * p.q_sb + h * p.q_sh;
    const uint16_t* doh = p.dout + b * p.do_sb + h * p.do_sh;
    uint16_t* dst = sdst + BN * PITCH * 2 + buf * 2 * BM * PITCH;
    dense_copy_rows<BM, DP>(dst, qh + static_cast<int64_t>(m0 + r0) * p.q_sm + c0, qh, p.q_sm, r0, p.Lq - m0,
                            col_ok);
    dense_copy_rows<BM, DP>(dst + BM * PITCH, doh + static_cast<int64_t>(m0 + r0) * p.do_sm + c0, doh, p.do_sm,
                            r0, p.Lq - m0, col_ok);
    cp_async_commit();
    float* st_ = stat_buf + buf * 2 * BM;
    if (tid < BM) {  // lse2, delta of the tile's rows
      dense_row_stats(p, b * p.H + h, m0 + tid, st_[tid], st_[BM + tid]);
    }
  };

  // ldmatrix lane offsets (elements): A fragments (16 rows x 16 cols), Q / dO rows as B^T (four
  // 8-column slabs of 8 queries), Q / dO as B (two 8-query halves x two 8-column groups, .trans).
  const int a_lane = dense_a_lane<DP>(lane, warp * 16);
  const int bt_lane = dense_bt_lane<DP>(lane), b_lane = dense_b_lane<DP>(lane);

  if (ntiles > 0) issue(0, 0);
  for (int it = 0; it < ntiles; ++it) {
    const int m0 = m_start + (it % nm) * BM;
    const int buf = it & 1;
    if (it + 1 < ntiles) {  // buffer buf^1 was released by the barrier ending iteration it-1
      issue(it + 1, buf ^ 1);
      cp_async_wait<1>();  // this thread's copies of tile `it` (and of K / V) have landed
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // tile `it` (and at it = 0 the K / V tiles) is visible to every warp
    const uint16_t* Qs = qo_buf + buf * 2 * BM * PITCH;
    const uint16_t* Os = Qs + BM * PITCH;  // dO tile
    const float* lse_s = stat_buf + buf * 2 * BM;
    const float* delta_s = lse_s + BM;

    float st[BM / 8][4], dpt[BM / 8][4];  // S^T, dP^T: rows = keys, cols = queries
#pragma unroll
    for (int nt = 0; nt < BM / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) st[nt][e] = dpt[nt][e] = 0.0f;
    }
#pragma unroll
    for (int kc = 0; kc < DP / 16; kc += 2) {
      uint32_t ka[2][4], va[2][4];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        ldmatrix<4, false>(ka[u], Ks + a_lane + (kc + u) * 16);
        ldmatrix<4, false>(va[u], Vs + a_lane + (kc + u) * 16);
      }
#pragma unroll
      for (int nt = 0; nt < BM / 8; ++nt) {
        mma_rows_t<T>(st[nt], ka[0], ka[1], Qs + bt_lane + nt * 8 * PITCH + kc * 16);
        mma_rows_t<T>(dpt[nt], va[0], va[1], Os + bt_lane + nt * 8 * PITCH + kc * 16);
      }
    }

    // st <- P^T, dpt <- dS^T.  Masked (warp-uniform test per tile): key j > query i (causal),
    // padded keys, attn_mask (every tile).  Keys past Lk need no mask (never stored) but must
    // not read one: dense_score gives them -inf.
    const bool edge = (kCausal && n0 + warp * 16 + 15 > m0) || warp_pad || has_am;
    const int h = hk * group + it / nm;
#pragma unroll
    for (int nt = 0; nt < BM / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) st[nt][e] *= scale2;
    }
    if (edge) {  // a branch of its own, not a select per score (see fwd_dense_kernel)
#pragma unroll
      for (int nt = 0; nt < BM / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          st[nt][e] = dense_score<kCausal, kAttnMask>(p, st[nt][e], true, b, h, m0 + nt * 8 + 2 * t + (e & 1),
                                                      key_a + 8 * (e >> 1), (pad_bits >> (e >> 1)) & 1);
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < BM / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int ii = nt * 8 + 2 * t + (e & 1);
        const float pe = exp2_approx(st[nt][e] - lse_s[ii]);
        dpt[nt][e] = pe * (dpt[nt][e] - delta_s[ii]);
        st[nt][e] = pe;
      }
    }

    // dV += P^T dO, dK += dS^T Q: A from the accumulators (keys x 16 queries), B from the tiles.
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      uint32_t pa[4], sa[4];
      acc_to_a<T>(pa, st, kk);
      acc_to_a<T>(sa, dpt, kk);
      mma_rows<T, DP>(dv, pa, Os + b_lane + kk * 16 * PITCH);
      mma_rows<T, DP>(dk, sa, Qs + b_lane + kk * 16 * PITCH);
    }
    __syncthreads();  // every warp is done with buffer `buf` before it is refilled
  }
  if (ntiles == 0) cp_async_wait<0>();  // K / V copies still owe their completion

  store_dkdv_rows<T, DP>(p, b, hk, key_a, t, dk, dv);
}
