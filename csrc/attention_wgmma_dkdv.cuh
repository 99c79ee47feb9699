// dK / dV of the dense backward on warpgroup MMA (sm_90a): for the calls dkdv_dense_kernel takes
// without an attn_mask (no dropout, is_causal and key_padding_mask allowed, 16-byte aligned rows,
// head dim <= 128) when the wgmma kernels are on (by default on a Hopper with sm_90a code;
// attention_cuda.cu's wgmma_mode).
// Included by attention_cuda.cu after attention_wgmma_dense.cuh (WgCopy, kWdThreads) and
// attention_dense_fwd.cuh (exp2_approx); dQ: attention_wgmma_dq.cuh.  Written without a GPU; its gpu
// tests passed on an H100 (2026-11-26 and -27); the CPU emulation runs it against the oracle.
//
// dkdv_dense_kernel's algorithm in the transposed form, on 4x larger tiles: one CTA = two
// warpgroups per (b, kv head, 128 keys), warpgroup w owning keys 64w..64w+63 (its warps 16 each);
// K and V stay in shared memory; the loop runs over (query head of the GQA group, 64-query tile)
// with the Q and dO tiles and the rows' lse (times log2 e) and delta double-buffered.  Per tile:
//   S^T = K Q^T and dP^T = V dO^T: wgmma m64n64k16 from shared memory (two groups, issued together);
//   once S^T is done (wait_group 1): P^T = exp2(S^T scale log2 e - lse log2 e), and
//     dV += P^T dO (P^T in registers, dO MN-major) is issued while dP^T may still run;
//   once dP^T is done (wait_group 1): dS^T = P^T (dP^T - delta), and dK += dS^T Q is issued
//     while dV's product runs; both waited for before the barrier that ends the tile.
// Queries past Lq and rows whose lse is -inf get P = 0 through an lse of +inf; keys past Lk need
// no mask (their rows are never stored).  key_padding_mask as dkdv_dense_kernel: a thread reads
// its two keys' flags once, the warps owning a padded key take the masking branch on every tile
// (P^T rows of padded keys 0, as the reference), and a CTA whose 128 keys are all padding writes
// zeros without loading a tile.  Every wgmma sits outside branches (ptxas tracks groups in flight
// path-insensitively: see attention_wgmma_dense.cuh).

// Every tile (K, V, Q, dO) in the forward's 128-byte swizzled layout (attention_wgmma_dense.cuh:
// its descriptors and copies), so that the tensor cores read shared memory without bank
// conflicts (the unswizzled core-matrix layout halved the forward's speed on an H100).

constexpr int kWkBN = 128;  // keys per CTA (64 per warpgroup)
constexpr int kWkBM = 64;   // queries per tile

template <int DP, bool kDq = false>
constexpr size_t wgmma_dkdv_smem_bytes() {
  // K, V; 2 x {Q, dO}; (kDq) the dS tile; 2 x {lse2, delta}; 1 KB to start the tiles on a
  // 1024-byte boundary
  return (size_t{2 * kWkBN + 4 * kWkBM} * DP + (kDq ? size_t{kWkBM} * kWkBN : 0)) * sizeof(uint16_t) +
         size_t{4} * kWkBM * sizeof(float) + 1024;
}

// One committed wgmma group over the head dim, d = A B^T (64 x 64, fp32): A the 64 rows a0 ..
// of a swizzled tile of RA rows, B the 64 rows b0 .. of one of RB rows, both K-major, DP
// columns each (the dense backward's S / S^T and dP / dP^T products).
template <typename T, int DP, int RA, int RB>
__device__ __forceinline__ void wgmma_group_64x64(float (&d)[32], const uint16_t* A, int a0, const uint16_t* B,
                                                  int b0) {
#pragma unroll
  for (int kc = 0; kc < DP / 16; ++kc) {
    wgmma_m64n64k16_ss<T>(d, wgmma_desc_sw128(A + sw128_k_slab<RA>(a0, kc), 16),
                          wgmma_desc_sw128(B + sw128_k_slab<RB>(b0, kc), 16), kc);
  }
  wgmma_commit();
}

// kDq (DP 128 only): the kernel also forms each tile's dQ share, dQ_part = dS K (64 queries x
// 128 keys x the head dim: warpgroup w the head-dim columns 64w..), and adds it into p.dq_acc
// (fp32, (B, H, Lq, 128) contiguous) by atomics, so that no dQ kernel recomputes S and dP (5
// products per tile pair instead of 7, FlashAttention-2's schedule).  dS goes through shared
// memory (queries x keys, K-major, swizzled as the other tiles): both warpgroups' keys are the
// product's K.  p.dq_acc is (B, H, Lq, DP): rows DP = 128 wide whatever D.
template <typename T, int DP, bool kCausal, bool kDq = false>
__global__ void __launch_bounds__(kWdThreads, 1) dkdv_wgmma_dense_kernel(const Params p) {
  static_assert(DP == 64 || DP == 128, "head-dim buckets of the wgmma kernels");
  static_assert(!kDq || DP == 128, "dQ by atomics: head dims 65-128 (one 64-column atom per warpgroup)");
#if defined(__CUDA_ARCH__) && !defined(TF_SM90A)
  __trap();  // sm_90a only, as fwd_wgmma_dense_kernel
#else
  constexpr int BN = kWkBN, BM = kWkBM;
  extern __shared__ __align__(16) uint16_t smem[];
  uint16_t* const Ks = sw128_base(smem);
  uint16_t* const Vs = Ks + BN * DP;
  uint16_t* const qo_buf = Vs + BN * DP;                                     // [2][Q, dO][BM x DP]
  uint16_t* const dSs = qo_buf + 4 * BM * DP;                              // (kDq) [BM x BN]
  float* const stat_buf = reinterpret_cast<float*>(dSs + (kDq ? BM * BN : 0));  // [2][lse2, delta][BM]

  const int tid = threadIdx.x, wg = tid / 128, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int warp_in_wg = (tid % 128) / 32;
  const int nnb = (p.Lk + BN - 1) / BN;
  const int nb = blockIdx.x % nnb;
  const int bhk = blockIdx.x / nnb;
  const int b = bhk / p.Hkv, hk = bhk % p.Hkv, group = p.H / p.Hkv;
  const int n0 = nb * BN;
  const int key_w = n0 + 64 * wg + 16 * warp_in_wg;  // this warp's first key
  const int key_a = key_w + g;                       // this thread's keys: key_a, key_a + 8

  int pad_bits = dkdv_pad_bits(p, b, key_a);  // key_padding_mask (attention_dense_dkdv.cuh)
  if constexpr (kDq) {
    // Keys past Lk (zero rows of K and V) feed dQ here: their P must be 0, not exp2(-lse), which
    // overflows for rows of very negative scores (inf x a zero K row = NaN in dQ).  Without dQ
    // they fed only dK / dV rows that are never stored.
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) pad_bits |= (key_a + 8 * rh >= p.Lk ? 1 : 0) << rh;
  }
  if (p.kpm != nullptr) {
    if (__syncthreads_and(pad_bits == 3)) {  // CTA-uniform
      float zero[DP / 2] = {};
      store_dkdv_rows<T, DP>(p, b, hk, key_a, t, reinterpret_cast<const float(*)[4]>(zero),
                             reinterpret_cast<const float(*)[4]>(zero));
      return;
    }
  }
  const bool warp_pad = __any_sync(0xffffffffu, pad_bits != 0);  // warp-uniform

  const WgCopy<BN, DP> copy_kv(tid);
  const WgCopy<BM, DP> copy_qo(tid);
  const bool col_ok = copy_kv.c0 < p.D;  // (the two mappings share c0)
  {
    const uint16_t* kh = p.k + b * p.k_sb + hk * p.k_sh;
    const uint16_t* vh = p.v + b * p.v_sb + hk * p.v_sh;
    copy_kv(Ks, kh + static_cast<int64_t>(n0) * p.k_sm, kh, p.k_sm, p.Lk - n0, col_ok);
    copy_kv(Vs, vh + static_cast<int64_t>(n0) * p.v_sm, vh, p.v_sm, p.Lk - n0, col_ok);
  }

  float dk[DP / 2], dv[DP / 2];  // rows key_a (+8), columns 8 dt + 2 t (+1): [4 dt + e]
#pragma unroll
  for (int i = 0; i < DP / 2; ++i) dk[i] = dv[i] = 0.0f;

  const float kLog2e = 1.4426950408889634f;
  const float scale2 = p.scale * kLog2e;
  const int m_start = kCausal ? n0 : 0;  // queries i < n0 see none of these keys
  const int nm = m_start < p.Lq ? (p.Lq - m_start + BM - 1) / BM : 0;
  const int ntiles = group * nm;
  // Tile `it` (query head, query rows) into buffer `buf`: Q and dO by cp.async (committed with
  // whatever this thread issued before), lse2 and delta by plain loads and stores.
  const auto issue = [&](int it, int buf) {
    const int h = hk * group + it / nm, m0 = m_start + (it % nm) * BM;
    const uint16_t* qh = p.q + b * p.q_sb + h * p.q_sh;
    const uint16_t* doh = p.dout + b * p.do_sb + h * p.do_sh;
    uint16_t* dst = qo_buf + buf * 2 * BM * DP;
    copy_qo(dst, qh + static_cast<int64_t>(m0) * p.q_sm, qh, p.q_sm, p.Lq - m0, col_ok);
    copy_qo(dst + BM * DP, doh + static_cast<int64_t>(m0) * p.do_sm, doh, p.do_sm, p.Lq - m0, col_ok);
    cp_async_commit();
    float* st_ = stat_buf + buf * 2 * BM;
    if (tid < BM) {  // lse2, delta of the tile's rows
      dense_row_stats(p, b * p.H + h, m0 + tid, st_[tid], st_[BM + tid]);
    }
  };

  if (ntiles > 0) {
    issue(0, 0);  // one group with K / V
  } else {
    cp_async_commit();
  }
  for (int it = 0; it < ntiles; ++it) {
    const int m0 = m_start + (it % nm) * BM;
    const int buf = it & 1;
    cp_async_wait<0>();        // this thread's copies of tile `it` (and of K / V) have landed
    fence_proxy_async_smem();  // ... visible to the tensor cores' proxy
    __syncthreads();           // everyone's; everyone is done with buffer buf ^ 1
    if (it + 1 < ntiles) issue(it + 1, buf ^ 1);
    const uint16_t* Qs = qo_buf + buf * 2 * BM * DP;
    const uint16_t* Os = Qs + BM * DP;  // dO tile
    const float* lse_s = stat_buf + buf * 2 * BM;
    const float* delta_s = lse_s + BM;

    float st[BM / 2], dpt[BM / 2];  // S^T, dP^T: rows = keys, columns = queries 8 nt + 2 t (+1)
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) st[i] = dpt[i] = 0.0f;
    pin_registers(st);
    pin_registers(dpt);
    wgmma_fence();
    wgmma_group_64x64<T, DP, BN, BM>(st, Ks, 64 * wg, Qs, 0);
    wgmma_group_64x64<T, DP, BN, BM>(dpt, Vs, 64 * wg, Os, 0);

    // P^T (fp32 in st; packed as the A operand of dV += P^T dO).  Masked behind a warp-uniform
    // test per tile: key j > query i (causal), padded keys (their whole row).
    wgmma_wait<1>();
    pin_registers(st);
    const bool edge = (kCausal && key_w + 15 > m0) || warp_pad;
    uint32_t pa[BM / 16][4];
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) st[i] *= scale2;
    if (edge) {  // a branch of its own, not a select per score (see fwd_dense_kernel)
#pragma unroll
      for (int nt = 0; nt < BM / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (((pad_bits >> (e >> 1)) & 1) || (kCausal && key_a + 8 * (e >> 1) > m0 + nt * 8 + 2 * t + (e & 1))) {
            st[4 * nt + e] = -INFINITY;
          }
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < BM / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) st[4 * nt + e] = exp2_approx(st[4 * nt + e] - lse_s[nt * 8 + 2 * t + (e & 1)]);
    }
    acc_to_a_slabs<T>(pa, st);
    pin_registers(pa);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      wgmma_m64k16_rs<T, DP>(dv, pa[kk], wgmma_desc_sw128(Os + 16 * kk * 64, BM * 128));  // dO MN-major
    }
    wgmma_commit();

    // dS^T = P^T (dP^T - delta), packed as the A operand of dK += dS^T Q.
    wgmma_wait<1>();
    pin_registers(dpt);
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) dpt[i] = st[i] * (dpt[i] - delta_s[8 * (i / 4) + 2 * t + (i & 1)]);
    uint32_t sa[BM / 16][4];
    acc_to_a_slabs<T>(sa, dpt);
    pin_registers(sa);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      wgmma_m64k16_rs<T, DP>(dk, sa[kk], wgmma_desc_sw128(Qs + 16 * kk * 64, BM * 128));  // Q MN-major
    }
    wgmma_commit();
    [[maybe_unused]] float dq[kDq ? 32 : 1];  // dQ_part: rows = queries 16 warp_in_wg + g (+8), columns 64 wg + 8 nt + 2 t (+1)
    if constexpr (kDq) {
      // dS^T as packed for dK (the same rounding) into dS (query, key): sa[kk][r] holds keys
      // key_a (+8 if r odd), queries 16 kk + 2 t + 8 (r >> 1) and the next one.
      const int key_l = key_a - n0;
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int kr = key_l + 8 * (r & 1), qr = 16 * kk + 2 * t + 8 * (r >> 1);
          dSs[sw128_offset<BM>(qr, kr)] = static_cast<uint16_t>(sa[kk][r] & 0xFFFFu);
          dSs[sw128_offset<BM>(qr + 1, kr)] = static_cast<uint16_t>(sa[kk][r] >> 16);
        }
      }
      wgmma_wait<1>();  // dV's product done (dK's may run on): its A registers are free for dQ's
      pin_registers(dv);
      pin_registers(pa);
      fence_proxy_async_smem();  // the generic-proxy stores, visible to the tensor cores
      __syncthreads();           // both warpgroups' keys are written
#pragma unroll
      for (int i = 0; i < 32; ++i) dq[i] = 0.0f;
      pin_registers(dq);
      wgmma_fence();
#pragma unroll
      for (int kc = 0; kc < BN / 16; ++kc) {
        wgmma_m64n64k16_ss<T, true>(dq, wgmma_desc_sw128(dSs + sw128_k_slab<BM>(0, kc), 16),
                                     wgmma_desc_sw128(Ks + wg * (BN * 64) + 16 * kc * 64, BN * 128), kc);
      }
      wgmma_commit();
    }
    wgmma_wait<0>();  // the products done: their A registers and this buffer (and dSs) are free
    pin_registers(dv);
    pin_registers(dk);
    pin_registers(pa);
    pin_registers(sa);
    if constexpr (kDq) {
      pin_registers(dq);
      // p.dq_acc rows are DP wide (columns past D get zeros: K's are), so only rows need a test
      // and each address is one of two row pointers plus a constant.
      const int h = hk * group + it / nm;
      const int q0 = m0 + 16 * warp_in_wg + g;
      float* const row0 = p.dq_acc + (static_cast<int64_t>(b * p.H + h) * p.Lq + q0) * DP + 64 * wg + 2 * t;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (q0 + 8 * (e >> 1) < p.Lq) atomicAdd(row0 + 8 * (e >> 1) * DP + 8 * nt + (e & 1), dq[4 * nt + e]);
        }
      }
    }
  }
  if (ntiles == 0) cp_async_wait<0>();  // K / V copies still owe their completion

  store_dkdv_rows<T, DP>(p, b, hk, key_a, t, reinterpret_cast<const float(*)[4]>(dk),
                         reinterpret_cast<const float(*)[4]>(dv));
#endif
}
