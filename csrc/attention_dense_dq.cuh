// dQ of the dense backward (no dropout; is_causal, key_padding_mask and attn_mask allowed;
// 16-byte aligned rows, D <= 128): dq_kernel rewritten the way fwd_dense_kernel rewrote
// fwd_kernel.  Included by attention_cuda.cu after attention_dense_fwd.cuh (it uses
// dense_copy_rows, exp2_approx, DensePadBits and dense_score).
//
// One CTA of 4 warps per (b, h, 64 query rows), warp w owning rows 16w..16w+15, as dq_kernel; key
// tiles of 32 rows of K and V double-buffered by cp.async.  Per tile: S = Q K^T and dP = dO V^T
// (ldmatrix.x4 over K / V rows), P = exp2(S * scale * log2 e - lse * log2 e), dS = P (dP - delta),
// dQ += dS K (ldmatrix.x4.trans over K).  Q and dO are staged through shared memory (cp.async +
// ldmatrix) instead of two-byte global loads; copy addresses are computed once; the only
// per-element test (causal diagonal, keys past Lk, padding: DensePadBits as in the forward;
// attn_mask: dense_score) sits behind a warp-uniform branch, and a tile of padding alone is
// skipped.  Rows past Lq, and rows whose lse is -inf (no key visible in the forward), get P = 0
// through an lse of +inf.
// Written without a GPU; checked against the oracle in the CPU emulation.

constexpr int kDenseDqBN = 32;  // keys per tile

// Row i of head bh as the dense dQ kernels use it: lse times log2 e (+inf for a row past Lq or
// whose lse is -inf, i.e. no key visible: P = 0 on the whole row) and delta (0 past Lq).  A row
// whose scores all saturated at +-FLT_MAX (dense_to_log2 of a huge float mask) had that lse; its
// round trip through the natural-log store can land an ulp (2^104) inside, and exp2(s - lse2)
// of the saturated scores would be inf: it is snapped back.
__device__ __forceinline__ void dense_row_stats(const Params& p, int bh, int i, float& lse2, float& delta) {
  const float l = i < p.Lq ? p.lse[static_cast<int64_t>(bh) * p.Lq + i] : -INFINITY;
  lse2 = l == -INFINITY ? INFINITY : dense_to_log2(l);
  if (fabsf(lse2) >= 3.4028e38f && fabsf(lse2) != INFINITY) lse2 = copysignf(kFloatMax, lse2);
  delta = i < p.Lq ? p.delta[static_cast<int64_t>(bh) * p.Lq + i] : 0.0f;
}

template <typename T, int DP, bool kCausal, bool kAttnMask>
__global__ void __launch_bounds__(kThreads, 2) dq_dense_kernel(const Params p) {
  constexpr int BM = kDenseBM, BN = kDenseDqBN, PITCH = DP + kPad;
  constexpr int kBuf = 2 * BN * PITCH;  // K then V of one buffer (halves)
  constexpr int kCh = DP / 8, kRowsPerPass = kThreads / kCh;
  static_assert(BM <= 2 * BN, "Q and dO are staged in one K/V buffer each");
  static_assert(kThreads % kCh == 0 && BN % kRowsPerPass == 0 && BM % kRowsPerPass == 0, "copy mapping");
  extern __shared__ __align__(16) uint16_t smem[];

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const auto [bh, b, h, hk, m0] = dense_query_block<kCausal>(p);

  const int r0 = tid / kCh, c0 = (tid % kCh) * 8;
  const bool col_ok = c0 < p.D;
  const uint16_t* qh = p.q + b * p.q_sb + h * p.q_sh;
  const uint16_t* doh = p.dout + b * p.do_sb + h * p.do_sh;
  const uint16_t* kh = p.k + b * p.k_sb + hk * p.k_sh;
  const uint16_t* vh = p.v + b * p.v_sb + hk * p.v_sh;
  const uint16_t* ksrc = kh + static_cast<int64_t>(r0) * p.k_sm + c0;
  const uint16_t* vsrc = vh + static_cast<int64_t>(r0) * p.v_sm + c0;
  const int64_t k_tile = BN * p.k_sm, v_tile = BN * p.v_sm;
  uint16_t* const sdst = smem + r0 * PITCH + c0;

  // Prologue, part 1: Q into buffer 0, dO into buffer 1, to registers.
  dense_copy_rows<BM, DP>(sdst, qh + static_cast<int64_t>(m0 + r0) * p.q_sm + c0, qh, p.q_sm, r0, p.Lq - m0,
                          col_ok);
  dense_copy_rows<BM, DP>(sdst + kBuf, doh + static_cast<int64_t>(m0 + r0) * p.do_sm + c0, doh, p.do_sm, r0,
                          p.Lq - m0, col_ok);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  uint32_t qf[DP / 16][4], dof[DP / 16][4];
  {
    const int a_lane = dense_a_lane<DP>(lane, warp * 16);
#pragma unroll
    for (int kc = 0; kc < DP / 16; ++kc) {
      ldmatrix<4, false>(qf[kc], smem + a_lane + kc * 16);
      ldmatrix<4, false>(dof[kc], smem + kBuf + a_lane + kc * 16);
    }
  }
  __syncthreads();  // both buffers are free for the key tiles

  const float kLog2e = 1.4426950408889634f;
  const float scale2 = p.scale * kLog2e;
  const int row_a = m0 + warp * 16 + g;  // this thread's rows: row_a, row_a + 8
  constexpr bool has_am = kAttnMask;  // p.am_type != kMaskNone (an instantiation of its own)
  float lse2[2], delta_r[2];
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) dense_row_stats(p, bh, row_a + 8 * rh, lse2[rh], delta_r[rh]);
  float dq[DP / 8][4];
#pragma unroll
  for (int dt = 0; dt < DP / 8; ++dt) dq[dt][0] = dq[dt][1] = dq[dt][2] = dq[dt][3] = 0.0f;

  const int n_end = kCausal ? min(p.Lk, m0 + BM) : p.Lk;
  const int ntiles = (n_end + BN - 1) / BN;
  DensePadBits<BN> pads(p, b, reinterpret_cast<uint32_t*>(smem + 2 * kBuf));
  pads.load(0, p.Lk);
  // Prologue, part 2: key tile 0 into buffer 0.
  dense_copy_rows<BN, DP>(sdst, ksrc, kh, p.k_sm, r0, p.Lk, col_ok);
  dense_copy_rows<BN, DP>(sdst + BN * PITCH, vsrc, vh, p.v_sm, r0, p.Lk, col_ok);
  cp_async_commit();

  // ldmatrix lane offsets inside a tile: K / V rows as B^T (four 8-column slabs of 8 keys), K as
  // B (two 8-key halves x two 8-column groups, transposed).
  const int bt_lane = dense_bt_lane<DP>(lane), b_lane = dense_b_lane<DP>(lane);

  for (int it = 0; it < ntiles; ++it) {
    const uint16_t* Ks = smem + (it & 1) * kBuf;
    const uint16_t* Vs = Ks + BN * PITCH;
    const int n0 = it * BN;
    if (it + 1 < ntiles) {
      uint16_t* dn = sdst + ((it + 1) & 1) * kBuf;
      const int left = p.Lk - (n0 + BN);
      dense_copy_rows<BN, DP>(dn, ksrc + (it + 1) * k_tile, kh, p.k_sm, r0, left, col_ok);
      dense_copy_rows<BN, DP>(dn + BN * PITCH, vsrc + (it + 1) * v_tile, vh, p.v_sm, r0, left, col_ok);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    pads.publish(it);
    __syncthreads();  // tile `it` (and its pad mask) is visible to every warp
    const uint64_t pad = pads.mask(it);
    pads.load(n0 + BN, p.Lk);
    if (dense_tile_all_padding<BN>(pad, n0, p.Lk)) {  // CTA-uniform: P = 0 on the whole tile
      __syncthreads();
      continue;
    }

    // S = Q K^T, dP = dO V^T (raw dots)
    float s[BN / 8][4], dp[BN / 8][4];
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.0f;
    }
#pragma unroll
    for (int kc = 0; kc < DP / 16; kc += 2) {
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt) {
        mma_rows_t<T>(s[nt], qf[kc], qf[kc + 1], Ks + bt_lane + nt * 8 * PITCH + kc * 16);
        mma_rows_t<T>(dp[nt], dof[kc], dof[kc + 1], Vs + bt_lane + nt * 8 * PITCH + kc * 16);
      }
    }

    // dS = P (dP - delta), P recomputed in base 2 from the forward's lse.
    const bool edge = (kCausal && n0 + BN - 1 > m0 + warp * 16) || n0 + BN > p.Lk || pad != 0 || has_am;
    dense_scale_and_mask<kCausal, kAttnMask>(s, p, scale2, edge, pad, b, h, row_a, n0, t);
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pe = exp2_approx(s[nt][e] - lse2[e >> 1]);
        s[nt][e] = pe * (dp[nt][e] - delta_r[e >> 1]);
      }
    }

    // dQ += dS K: dS's accumulators of n-tiles 2kk, 2kk+1 form the A fragment of keys 16kk..16kk+15.
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t a[4];
      acc_to_a<T>(a, s, kk);
      mma_rows<T, DP>(dq, a, Ks + b_lane + kk * 16 * PITCH);
    }
    __syncthreads();  // every warp is done with this buffer before it is refilled
  }

  uint16_t* dqh = p.out + b * p.o_sb + h * p.o_sh;
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    const int i = row_a + 8 * rh;
    if (i >= p.Lq) continue;
    store_row_pairs<T, DP>(dqh + static_cast<int64_t>(i) * p.o_sm + 2 * t, dq, rh, p.scale, p.D, t);
  }
}
