// The sm_90a forward of fp16 / bf16 attention on warpgroup MMA (wgmma), for H100 / H200.
// Included by attention_cuda.cu inside its anonymous namespace (it uses that file's Params,
// Traits, tile copies and softmax helpers).  It runs only with TRANSFORMER_FAST_CUDA_WGMMA=1 on a
// compute capability 9.x device with the sm_90a kernels built: its gpu tests and memcheck passed
// on an H100 (2026-11-26), but it is slower than fwd_kernel there (60 against 68 TFLOP/s at
// B4 H16 L4096 D128), so the calls it could take stay on the mma.sync kernels.  Its
// indexing, descriptors, masking and online softmax run against the oracle in the CPU emulation
// (tests/cuda_emulation.py states wgmma's fragment and shared-memory layouts independently).
//
// One CTA = one warpgroup (4 warps, 128 threads) per (b, h, 64 query rows), as fwd_kernel, with
// the same 64-key K/V tiles double-buffered by cp.async and the same per-element masking,
// dropout and online softmax (fwd_kernel's comments apply).  What changes:
//   * Q, K and V tiles live in shared memory in wgmma's no-swizzle canonical layout (below);
//   * S = Q K^T is wgmma m64n64k16 with both operands read from shared memory by descriptor;
//   * O += P V is wgmma m64n{64,128}k16 with P in registers (the S accumulators repacked, as in
//     fwd_kernel: the accumulator layout of each warp's 16 rows is mma.sync's C layout, and the
//     register A operand is mma.sync's A layout) and V read MN-major (transposed) by descriptor;
//   * each thread fences its shared-memory writes into the async proxy (fence.proxy.async)
//     before the barrier that hands a tile to the tensor cores.
// Head dims up to 128 (the 64 and 128 buckets); D = 256 stays on fwd_kernel.  Not yet here
// (benchmarks/NOTES.md): TMA bulk copies, swizzled layouts, a producer warp and two consumer
// warpgroups, overlapping the softmax of one tile with the MMAs of the next.

constexpr int kWgBM = 64;  // query rows per CTA (wgmma's M)
constexpr int kWgBN = 64;  // keys per tile

// ---- Shared-memory tiles: 8 x 8 core matrices of 16-bit elements, each 8 rows of 16 contiguous
// bytes (128 B).  A ROWS x DP tile keeps core matrix (row / 8, col / 8) at element
// ((col / 8) * (ROWS / 8) + row / 8) * 64.  One global 16-byte chunk (row, 8c..8c+7) lands whole;
// as a K-major operand (rows = M or N, cols = K) a 16-column slab is two column groups
// ROWS * 16 bytes apart (the descriptor's leading byte offset) of ROWS / 8 row groups 128 bytes
// apart (its stride byte offset); as an MN-major B operand (rows = K, cols = N: V) a 16-row slab
// is two row groups 128 bytes apart along K and DP / 8 column groups ROWS * 16 bytes apart.
template <int ROWS>
__device__ __forceinline__ int cm_offset(int row, int col) {
  return ((col >> 3) * (ROWS / 8) + (row >> 3)) * 64 + (row & 7) * 8 + (col & 7);
}

// Rows [0, ROWS) x cols [0, DP) of a global row-major tile into the core-matrix layout, zero
// where row >= nrows or col >= ncols; vec16 as load_tile (cp.async: the caller commits and
// waits).  Each 8 consecutive threads fill one core matrix (128 contiguous bytes: no bank
// conflicts) from 8 rows, and a warp reads 64 contiguous bytes of each of its rows.
template <int ROWS, int DP>
__device__ __forceinline__ void load_tile_cm(uint16_t* s, const uint16_t* base, int64_t ld,
                                             int nrows, int ncols, bool vec16) {
  constexpr int kChunks = DP / 8;
  if (vec16) {
    for (int idx = threadIdx.x; idx < ROWS * kChunks; idx += kThreads) {
      const int r = (idx / (8 * kChunks)) * 8 + idx % 8, c = ((idx / 8) % kChunks) * 8;
      const bool valid = r < nrows && c < ncols;
      cp_async16(s + cm_offset<ROWS>(r, c), valid ? base + r * ld + c : base, valid);
    }
    return;
  }
  for (int idx = threadIdx.x; idx < ROWS * DP; idx += kThreads) {
    const int r = idx / DP, c = idx % DP;
    s[cm_offset<ROWS>(r, c)] = (r < nrows && c < ncols) ? base[r * ld + c] : uint16_t(0);
  }
}

// ---- wgmma and its fences.  A matrix descriptor (64 bits): start address >> 4 (bits 0-13),
// leading byte offset >> 4 (16-29), stride byte offset >> 4 (32-45), base offset 0 (49-51),
// layout 0 = no swizzle (62-63).  For the no-swizzle layout the leading offset steps along K,
// the stride offset along M / N, for K-major and MN-major operands alike.
__device__ __forceinline__ uint32_t smem_address(const void* ptr) {
#if defined(TF_CUDA_EMULATE)
  return emulated_smem_address(ptr);
#else
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
#endif
}

__device__ __forceinline__ uint64_t wgmma_desc(const uint16_t* start, uint32_t leading_bytes,
                                               uint32_t stride_bytes) {
  return static_cast<uint64_t>((smem_address(start) & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>(leading_bytes >> 4) << 16) |
         (static_cast<uint64_t>(stride_bytes >> 4) << 32);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TF_SM90A 1
// TB: imm-trans-b, "0" for B K-major, "1" for B MN-major.
#define TF_WGMMA_SS_M64N64K16(TY, TB)                                                           \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                     \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {"                     \
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "         \
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
               "}, %32, %33, p, 1, 1, 0, " TB ";\n}\n"                                          \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),        \
                 "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),      \
                 "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),  \
                 "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),  \
                 "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),  \
                 "+f"(d[30]), "+f"(d[31])                                                       \
               : "l"(desc_a), "l"(desc_b), "r"(scale_d) : "memory")

#define TF_WGMMA_SS_M64N128K16(TY)                                                                 \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                        \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {"                       \
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "            \
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "  \
               "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "  \
               "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"    \
               "}, %64, %65, p, 1, 1, 0, 0;\n}\n"                                                 \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),           \
                 "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),         \
                 "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),     \
                 "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),     \
                 "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),     \
                 "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),     \
                 "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),     \
                 "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),     \
                 "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),     \
                 "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),     \
                 "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])                                \
               : "l"(desc_a), "l"(desc_b), "r"(scale_d) : "memory")

#define TF_WGMMA_RS_M64N64K16(TY)                                                                  \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                        \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {"                        \
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "            \
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"    \
               "}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"                                    \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),           \
                 "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),         \
                 "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),     \
                 "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),     \
                 "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),     \
                 "+f"(d[30]), "+f"(d[31])                                                          \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d) : "memory")

#define TF_WGMMA_RS_M64N128K16(TY)                                                                 \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                        \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {"                       \
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "            \
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "  \
               "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "  \
               "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"    \
               "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"                                    \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),           \
                 "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),         \
                 "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),     \
                 "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),     \
                 "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),     \
                 "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),     \
                 "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),     \
                 "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),     \
                 "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),     \
                 "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),     \
                 "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])                                \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d) : "memory")
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// Orders this thread's earlier register writes (the accumulators, P) before the wgmma that
// follows, for the whole warpgroup.
__device__ __forceinline__ void wgmma_fence() {
#if defined(TF_SM90A)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#if defined(TF_SM90A)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_wait_all() {
#if defined(TF_SM90A)
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#endif
}

// Waits until at most N of this warpgroup's committed wgmma groups are pending (they complete in
// commit order, so every group but the last N is done).
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if defined(TF_SM90A)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

// Shared memory written through the generic proxy (stores, cp.async) becomes visible to the
// async proxy that wgmma reads it through (each writing thread, before the barrier).
__device__ __forceinline__ void fence_proxy_async_smem() {
#if defined(TF_SM90A)
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// The compiler sees an asm statement as the writer of its "+f" operands; this pins every read
// of an accumulator after wgmma_wait_all (and every write before wgmma_fence) in program order.
template <int N>
__device__ __forceinline__ void pin_registers(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
#if defined(__CUDA_ARCH__)
    asm volatile("" : "+f"(r[i])::"memory");
#else
    (void)r[i];
#endif
  }
}

// The same for registers an in-flight wgmma reads as its A operand (P): kept alive and unchanged
// until this point, so the compiler reuses none of them before the wait that precedes it.
template <int N>
__device__ __forceinline__ void pin_registers(uint32_t (&r)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#if defined(__CUDA_ARCH__)
      asm volatile("" : "+r"(r[i][j])::"memory");
#else
      (void)r[i][j];
#endif
    }
  }
}

// d (64 x 64 fp32, accumulator layout) = A B (+ d if scale_d): A 64 x 16 K-major and B 16 x 64
// K-major (kBMnMajor: MN-major, as the dK / dV kernel's dQ = dS K reads K) in shared memory.
template <typename T, bool kBMnMajor = false>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t desc_a,
                                                   uint64_t desc_b, int scale_d) {
#if defined(TF_SM90A)
  if constexpr (std::is_same_v<T, __half>) {
    if constexpr (kBMnMajor) { TF_WGMMA_SS_M64N64K16("f16", "1"); } else { TF_WGMMA_SS_M64N64K16("f16", "0"); }
  } else {
    if constexpr (kBMnMajor) { TF_WGMMA_SS_M64N64K16("bf16", "1"); } else { TF_WGMMA_SS_M64N64K16("bf16", "0"); }
  }
#elif defined(TF_CUDA_EMULATE)
  emulated_wgmma(d, 64, desc_a, nullptr, desc_b, kBMnMajor, scale_d != 0, std::is_same_v<T, __nv_bfloat16>);
#else
  __trap();  // sm_90a only (the host runs fwd_wgmma_kernel only where it was built for it)
#endif
}

// d (64 x 128 fp32) = A B (+ d if scale_d): A 64 x 16 and B 16 x 128 both K-major in shared memory.
template <typename T>
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                    int scale_d) {
#if defined(TF_SM90A)
  if constexpr (std::is_same_v<T, __half>) {
    TF_WGMMA_SS_M64N128K16("f16");
  } else {
    TF_WGMMA_SS_M64N128K16("bf16");
  }
#elif defined(TF_CUDA_EMULATE)
  emulated_wgmma(d, 128, desc_a, nullptr, desc_b, /*b_mn_major=*/false, scale_d != 0,
                 std::is_same_v<T, __nv_bfloat16>);
#else
  __trap();
#endif
}

// d (64 x N) += A B: A 64 x 16 in registers (a[4] per thread), B 16 x N MN-major in shared memory.
template <typename T, int N>
__device__ __forceinline__ void wgmma_m64k16_rs(float (&d)[N / 2], const uint32_t a[4],
                                                uint64_t desc_b) {
  static_assert(N == 64 || N == 128, "instantiated widths");
  constexpr int scale_d = 1;
#if defined(TF_SM90A)
  if constexpr (N == 64 && std::is_same_v<T, __half>) {
    TF_WGMMA_RS_M64N64K16("f16");
  } else if constexpr (N == 64) {
    TF_WGMMA_RS_M64N64K16("bf16");
  } else if constexpr (std::is_same_v<T, __half>) {
    TF_WGMMA_RS_M64N128K16("f16");
  } else {
    TF_WGMMA_RS_M64N128K16("bf16");
  }
#elif defined(TF_CUDA_EMULATE)
  emulated_wgmma(d, N, 0, a, desc_b, /*b_mn_major=*/true, scale_d != 0,
                 std::is_same_v<T, __nv_bfloat16>);
#else
  (void)scale_d;
  __trap();
#endif
}

// ---------------------------------------------------------------------------------------------
// Forward

template <typename T, int DP>
__global__ void __launch_bounds__(kThreads) fwd_wgmma_kernel(const Params p) {
  static_assert(DP == 64 || DP == 128, "the wgmma forward covers head dims up to 128");
  extern __shared__ __align__(16) uint16_t smem[];
  constexpr int kTile = kWgBN * DP;    // one K or V tile
  uint16_t* Qs = smem;                 // [kWgBM x DP], core-matrix layout
  uint16_t* kv = smem + kWgBM * DP;    // [2 buffers][K, V][kWgBN x DP]

  // (wgmma's accumulators give warp w of the warpgroup rows 16w.., as fwd_kernel's warps own them)
  const auto [bh, b, h, hk, g, t, m0, row0] = forward_rows<kWgBM>(p);

  const auto [seed, offset] = dropout_key(p);

  const uint16_t* qh = p.q + b * p.q_sb + h * p.q_sh;
  const uint16_t* kh = p.k + b * p.k_sb + hk * p.k_sh;
  const uint16_t* vh = p.v + b * p.v_sb + hk * p.v_sh;

  // Descriptor strides (bytes): Q and K as K-major operands, V as the MN-major B operand.
  constexpr uint32_t kCore = 128;                // next row group (core matrix) of a K-major tile
  constexpr uint32_t kQColGroup = kWgBM * 16;    // next 8 columns of Q
  constexpr uint32_t kKvColGroup = kWgBN * 16;   // next 8 columns of K / V

  float o[DP / 2];  // O accumulators: o[4 * dt + e] is fwd_kernel's o[dt][e]
#pragma unroll
  for (int i = 0; i < DP / 2; ++i) o[i] = 0.0f;
  float m_i[2] = {-INFINITY, -INFINITY};
  float l_i[2] = {0.0f, 0.0f};

  const int n_end = p.causal ? min(p.Lk, m0 + kWgBM) : p.Lk;
  const int ntiles = (n_end + kWgBN - 1) / kWgBN;
  // Prologue: Q and tile 0 (one cp.async group with vec16).
  load_tile_cm<kWgBM, DP>(Qs, qh + static_cast<int64_t>(m0) * p.q_sm, p.q_sm, p.Lq - m0, p.D, p.vec16);
  if (p.vec16 && ntiles > 0) {
    load_tile_cm<kWgBN, DP>(kv, kh, p.k_sm, p.Lk, p.D, true);
    load_tile_cm<kWgBN, DP>(kv + kTile, vh, p.v_sm, p.Lk, p.D, true);
  }
  cp_async_commit();
  for (int it = 0; it < ntiles; ++it) {
    const int n0 = it * kWgBN;
    uint16_t* Ks = kv + (it & 1) * 2 * kTile;
    uint16_t* Vs = Ks + kTile;
    if (p.vec16) {
      if (it + 1 < ntiles) {  // buffer (it+1)&1 was released by the barrier ending iteration it-1
        const int n1 = n0 + kWgBN;
        uint16_t* Kn = kv + ((it + 1) & 1) * 2 * kTile;
        load_tile_cm<kWgBN, DP>(Kn, kh + static_cast<int64_t>(n1) * p.k_sm, p.k_sm, p.Lk - n1, p.D, true);
        load_tile_cm<kWgBN, DP>(Kn + kTile, vh + static_cast<int64_t>(n1) * p.v_sm, p.v_sm, p.Lk - n1, p.D, true);
        cp_async_commit();
        cp_async_wait<1>();  // this thread's copies of Q and tile `it` have landed
      } else {
        cp_async_wait<0>();
      }
    } else {
      load_tile_cm<kWgBN, DP>(Ks, kh + static_cast<int64_t>(n0) * p.k_sm, p.k_sm, p.Lk - n0, p.D, false);
      load_tile_cm<kWgBN, DP>(Vs, vh + static_cast<int64_t>(n0) * p.v_sm, p.v_sm, p.Lk - n0, p.D, false);
    }
    fence_proxy_async_smem();
    __syncthreads();  // tile `it` (and Q) visible to the tensor cores of every warp

    // S = Q K^T over DP / 16 slabs of 16 columns (scale_d 0 on the first: no zeroing needed).
    float s[kWgBN / 2];
#pragma unroll
    for (int i = 0; i < kWgBN / 2; ++i) s[i] = 0.0f;
    pin_registers(s);
    wgmma_fence();
#pragma unroll
    for (int kc = 0; kc < DP / 16; ++kc) {
      wgmma_m64n64k16_ss<T>(s, wgmma_desc(Qs + cm_offset<kWgBM>(0, 16 * kc), kQColGroup, kCore),
                            wgmma_desc(Ks + cm_offset<kWgBN>(0, 16 * kc), kKvColGroup, kCore), kc);
    }
    wgmma_commit();
    wgmma_wait_all();
    pin_registers(s);

    float m_use[2], alpha[2];
    score_tile_update<kWgBN>(p, b, h, m0, n0, row0, g, t, s, m_i, l_i, m_use, alpha);
#pragma unroll
    for (int i = 0; i < DP / 2; ++i) o[i] *= alpha[(i >> 1) & 1];
    uint32_t pa[kWgBN / 16][4];  // P as the register A operand of keys 16kk..16kk+15
#pragma unroll
    for (int nt = 0; nt < kWgBN / 8; ++nt) {
      float pe[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float x = s[4 * nt + e];
        const float ex = __expf(x - m_use[e >> 1]);
        l_i[e >> 1] += ex;
        const int i = row0 + g + 8 * (e >> 1), j = n0 + nt * 8 + 2 * t + (e & 1);
        pe[e] = x == -INFINITY ? 0.0f : ex * drop_factor(p, seed, offset, b, h, i, j);
      }
      pa[nt / 2][2 * (nt & 1)] = Traits<T>::pack(pe[0], pe[1]);
      pa[nt / 2][2 * (nt & 1) + 1] = Traits<T>::pack(pe[2], pe[3]);
    }
    pin_registers(o);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kWgBN / 16; ++kk) {
      wgmma_m64k16_rs<T, DP>(o, pa[kk], wgmma_desc(Vs + cm_offset<kWgBN>(16 * kk, 0), kCore, kKvColGroup));
    }
    wgmma_commit();
    wgmma_wait_all();
    pin_registers(o);
    __syncthreads();  // every warp is done with this buffer before it is refilled
  }
  cp_async_wait<0>();  // (no tile: Q's group, never read)
  finish_forward_rows<T, DP>(p, bh, row0, g, t, m_i, l_i, o);
}

// Reports whether this build holds sm_90a device code (TORCH_CUDA_ARCH_LIST "9.0a"): an sm_90
// build runs on the same GPUs without wgmma.
__global__ void sm90a_probe_kernel(int* built) {
#if defined(TF_SM90A)
  *built = 1;
#else
  *built = 0;
#endif
}
