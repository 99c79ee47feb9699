// dQ of the dense backward on warpgroup MMA (sm_90a): for the calls dq_dense_kernel takes without
// an attn_mask (no dropout, is_causal and key_padding_mask allowed, 16-byte aligned rows, head dim
// <= 128) when the wgmma kernels are on (by default on a Hopper with sm_90a code;
// attention_cuda.cu's wgmma_mode).
// Included by attention_cuda.cu after attention_wgmma_dkdv.cuh.  Written without a GPU; its gpu
// tests passed on an H100 (2026-11-26 and -27); the CPU emulation runs it against the oracle.
//
// dq_dense_kernel's algorithm on 2x larger tiles: one CTA = two warpgroups per (b, h, 128 query
// rows), warpgroup w owning rows 64w..64w+63; Q and dO stay in shared memory; 64-key tiles of K
// and V double-buffered by cp.async; every tile 128-byte swizzled (attention_wgmma_dense.cuh).  Per tile: S = Q K^T and dP = dO V^T as two wgmma
// m64n64k16 groups from shared memory; once S is done (wait_group 1), P = exp2(S scale log2 e -
// lse log2 e) while dP runs; then dS = P (dP - delta) and dQ += dS K (dS in registers, K
// MN-major), waited for before the barrier that ends the tile (the next refill overwrites it).
// Rows past Lq and rows whose lse is -inf get P = 0 through an lse of +inf; keys past Lk and
// (causal) past the row are masked behind a warp-uniform test.  key_padding_mask as the wgmma
// forward: each tile's 64 pad bits (DensePadBits, loaded a tile ahead) send the tiles with
// padding through that test, and the tiles past the row's last valid key (wg_kpm_end) are
// neither loaded nor computed.

constexpr int kWqBM = 128;  // query rows per CTA (64 per warpgroup)
constexpr int kWqBN = 64;   // keys per tile

template <int DP>
constexpr size_t wgmma_dq_smem_bytes() {
  // Q, dO, 2 x {K, V} (128-byte swizzled, as the dK / dV kernel's), 1 KB for their alignment, and
  // the key_padding_mask's words: 2 x 2 tile masks, 8 for the end-of-row reduction.
  return size_t{2 * kWqBM + 4 * kWqBN} * DP * sizeof(uint16_t) + 1024 + 12 * sizeof(uint32_t);
}

template <typename T, int DP, bool kCausal>
__global__ void __launch_bounds__(kWdThreads, 1) dq_wgmma_dense_kernel(const Params p) {
  static_assert(DP == 64 || DP == 128, "head-dim buckets of the wgmma kernels");
#if defined(__CUDA_ARCH__) && !defined(TF_SM90A)
  __trap();  // sm_90a only, as fwd_wgmma_dense_kernel
#else
  constexpr int BM = kWqBM, BN = kWqBN, kTile = BN * DP;
  extern __shared__ __align__(16) uint16_t smem[];
  uint16_t* const Qs = sw128_base(smem);
  uint16_t* const Os = Qs + BM * DP;      // dO
  uint16_t* const kv = Os + BM * DP;      // [2 buffers][K, V][BN x DP]
  uint32_t* const pad_words = reinterpret_cast<uint32_t*>(kv + 4 * kTile);  // [2][BN / 32] masks, [8]

  const int tid = threadIdx.x, wg = tid / 128, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int warp_in_wg = (tid % 128) / 32;
  const auto [bh, b, h, hk, m0] = dense_query_block<kCausal, BM>(p);  // causal: longest blocks first
  const int row_w = m0 + 64 * wg + 16 * warp_in_wg;  // this warp's first row
  const int row_a = row_w + g;                       // this thread's rows: row_a, row_a + 8

  const WgCopy<BM, DP> copy_qo(tid);
  const WgCopy<BN, DP> copy_kv(tid);
  const bool col_ok = copy_qo.c0 < p.D;  // (the two mappings share c0)
  const uint16_t* qh = p.q + b * p.q_sb + h * p.q_sh;
  const uint16_t* doh = p.dout + b * p.do_sb + h * p.do_sh;
  const uint16_t* kh = p.k + b * p.k_sb + hk * p.k_sh;
  const uint16_t* vh = p.v + b * p.v_sb + hk * p.v_sh;

  static_assert(BN == 64, "two 32-bit pad words per tile");
  DensePadBits<BN> pads(p, b, pad_words);
  int n_end = kCausal ? min(p.Lk, m0 + BM) : p.Lk;
  if (pads.kpm != nullptr) n_end = min(n_end, wg_kpm_end(pads.kpm, pads.stride, p.Lk, pad_words + 2 * (BN / 32)));
  const int ntiles = (n_end + BN - 1) / BN;  // 0: every key padding, dQ = 0
  pads.load(0, p.Lk);
  // Prologue: Q, dO and key tile 0 (buffer 0), one group.
  copy_qo(Qs, qh + static_cast<int64_t>(m0) * p.q_sm, qh, p.q_sm, p.Lq - m0, col_ok);
  copy_qo(Os, doh + static_cast<int64_t>(m0) * p.do_sm, doh, p.do_sm, p.Lq - m0, col_ok);
  copy_kv(kv, kh, kh, p.k_sm, p.Lk, col_ok);
  copy_kv(kv + kTile, vh, vh, p.v_sm, p.Lk, col_ok);
  cp_async_commit();

  const float kLog2e = 1.4426950408889634f;
  const float scale2 = p.scale * kLog2e;
  float lse2[2], delta_r[2];
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) dense_row_stats(p, bh, row_a + 8 * rh, lse2[rh], delta_r[rh]);
  float dq[DP / 2];  // rows row_a (+8), columns 8 dt + 2 t (+1): [4 dt + e]
#pragma unroll
  for (int i = 0; i < DP / 2; ++i) dq[i] = 0.0f;

  for (int it = 0; it < ntiles; ++it) {
    const int n0 = it * BN;
    pads.publish(it);          // (the mask buffer it % 2 was last read before the previous barrier)
    cp_async_wait<0>();        // this thread's copies of tile `it` (and of Q / dO) have landed
    fence_proxy_async_smem();  // ... visible to the tensor cores' proxy
    __syncthreads();           // everyone's; everyone is done with buffer (it + 1) % 2
    pads.load(n0 + BN, p.Lk);
    if (it + 1 < ntiles) {
      uint16_t* nb = kv + ((it + 1) & 1) * 2 * kTile;
      const int n1 = n0 + BN;
      copy_kv(nb, kh + static_cast<int64_t>(n1) * p.k_sm, kh, p.k_sm, p.Lk - n1, col_ok);
      copy_kv(nb + kTile, vh + static_cast<int64_t>(n1) * p.v_sm, vh, p.v_sm, p.Lk - n1, col_ok);
      cp_async_commit();
    }
    const uint16_t* Ks = kv + (it & 1) * 2 * kTile;
    const uint16_t* Vs = Ks + kTile;

    float s[BN / 2], dp[BN / 2];  // S, dP: this thread's rows, keys n0 + 8 nt + 2 t (+1)
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) s[i] = dp[i] = 0.0f;
    pin_registers(s);
    pin_registers(dp);
    wgmma_fence();
    wgmma_group_64x64<T, DP, BM, BN>(s, Qs, 64 * wg, Ks, 0);
    wgmma_group_64x64<T, DP, BM, BN>(dp, Os, 64 * wg, Vs, 0);

    wgmma_wait<1>();  // S done: P while dP runs
    pin_registers(s);
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) s[i] *= scale2;
    wg_mask_tile<kCausal, BN>(s, pads, it, n0, row_w, row_a, p.Lk, t);
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) s[i] = exp2_approx(s[i] - lse2[(i >> 1) & 1]);
    wgmma_wait<0>();
    pin_registers(dp);
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) dp[i] = s[i] * (dp[i] - delta_r[(i >> 1) & 1]);  // dS
    uint32_t sa[BN / 16][4];  // dS as the A operand of keys 16kk..16kk+15
    acc_to_a_slabs<T>(sa, dp);
    pin_registers(sa);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      wgmma_m64k16_rs<T, DP>(dq, sa[kk], wgmma_desc_sw128(Ks + 16 * kk * 64, BN * 128));  // K MN-major
    }
    wgmma_commit();
    wgmma_wait<0>();  // before the next barrier lets this buffer be refilled
    pin_registers(dq);
    pin_registers(sa);
  }
  if (ntiles == 0) cp_async_wait<0>();

  uint16_t* dqh = p.out + b * p.o_sb + h * p.o_sh;
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    const int i = row_a + 8 * rh;
    if (i >= p.Lq) continue;
    store_row_pairs<T, DP>(dqh + static_cast<int64_t>(i) * p.o_sm + 2 * t, reinterpret_cast<const float(*)[4]>(dq),
                           rh, p.scale, p.D, t);
  }
#endif
}
