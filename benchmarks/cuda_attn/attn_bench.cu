// Standalone (torch-free) timing of the CUDA attention forward variants, bf16, D = 128.
// build.sh compiles it against the repo's own csrc/ forward kernels (extracted unchanged) plus
// the draft fwd_dense.cuh.  One binary, one command, well under a minute of device time:
//   ./attn_bench            (both shapes, non-causal and causal)
//   ./attn_bench --quick    (B16 H16 L1024 non-causal only)
//   ./attn_bench --quick --once   (one checked launch per variant, no timing: for ncu)
// Per variant: registers, CTAs/SM from the occupancy API, median / p20 / p80 ms over 25 timed
// runs (device events, after 3 warm-ups), TFLOP/s (4 B H L^2 D, halved for causal), max |err|
// against an fp32 reference on two (b, h) slices, and NaN count of the whole output (outputs
// are poisoned with NaN before the checked run, so an unwritten element shows).  Then (not with
// --once) the dense backward pairs, mma.sync (dkdv_dense_kernel + dq_dense_kernel) against wgmma
// (dkdv_wgmma_dense_kernel + dq_wgmma_dense_kernel), from one forward: median ms, TFLOP/s of the
// backward alone, the max |difference| of dQ / dK / dV between the two, NaN count.
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

// The repo's (copied by build.sh, with a torch-free attention_cuda.h cut from the real one).
#include "attention_device.cuh"
#include "fwd_dense.cuh"

namespace transformer_fast {
namespace {
using namespace attn_device;
#include "fwd_extract.inc"  // csrc/attention_cuda.cu from kThreads to the wgmma include, unchanged
#include "wgmma_dense.inc"  // draft: the wgmma kernel with change 1 only
#include "attention_dense_fwd.cuh"  // the package's port of fwd_dense.cuh (4 warps, 2 CTAs/SM)
#include "attention_wgmma_dense.cuh"  // the package's two-warpgroup wgmma forward (plan step 2)
#include "attention_dense_dq.cuh"      // the package's dense backward (mma.sync) ...
#include "attention_dense_dkdv.cuh"
#include "attention_wgmma_dkdv.cuh"    // ... and its wgmma twin
#include "attention_wgmma_dq.cuh"
}  // namespace
}  // namespace transformer_fast

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorName(e_), __FILE__,      \
              __LINE__, cudaGetErrorString(e_));                                           \
      exit(1);                                                                             \
    }                                                                                      \
  } while (0)

using Params = transformer_fast::AttentionParams<uint16_t>;

__global__ void init_kernel(__nv_bfloat16* x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 0x9E3779B1u ^ seed;
    float acc = 0.f;
    for (int r = 0; r < 4; ++r) {
      h ^= h >> 16; h *= 0x7feb352dU; h ^= h >> 15; h *= 0x846ca68bU; h ^= h >> 16;
      acc += (h >> 8) * (1.0f / 16777216.0f);
    }
    x[i] = __float2bfloat16((acc - 2.0f) * 1.7320508f);  // ~N(0, 1)
  }
}

// delta_i = rowsum(dO_i * O_i) in fp32 (one thread per row; the package computes it with ATen).
__global__ void delta_kernel(const __nv_bfloat16* dout, const __nv_bfloat16* out, float* delta, size_t rows, int D) {
  for (size_t r = blockIdx.x * (size_t)blockDim.x + threadIdx.x; r < rows; r += (size_t)gridDim.x * blockDim.x) {
    float acc = 0.f;
    for (int d = 0; d < D; ++d) acc += __bfloat162float(dout[r * D + d]) * __bfloat162float(out[r * D + d]);
    delta[r] = acc;
  }
}

__global__ void max_abs_diff_kernel(const __nv_bfloat16* a, const __nv_bfloat16* b, size_t n, unsigned* out) {
  float m = 0.f;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const float d = fabsf(__bfloat162float(a[i]) - __bfloat162float(b[i]));
    m = isnan(d) ? INFINITY : fmaxf(m, d);
  }
  atomicMax(out, __float_as_uint(m));  // non-negative floats order as their bit patterns
}

// dq = acc * scale in bf16 (the atomic-dQ variant's last step; the package does it with ATen)
__global__ void dq_convert_kernel(const float* acc, __nv_bfloat16* dq, size_t n, float scale) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    dq[i] = __float2bfloat16_rn(acc[i] * scale);
}

__global__ void poison_kernel(uint16_t* x, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) x[i] = 0x7FC1;
}

__global__ void count_nan_kernel(const __nv_bfloat16* x, size_t n, unsigned long long* count) {
  unsigned long long c = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    c += isnan(__bfloat162float(x[i])) ? 1 : 0;
  if (c) atomicAdd(count, c);
}

// fp32 reference: one CTA per query row of slice bh; scores in shared memory (Lk floats).
__global__ void ref_kernel(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                           float* out, int bh, int L, int D, float scale, bool causal) {
  extern __shared__ float sc[];
  __shared__ float red[32];
  const int i = blockIdx.x;
  const size_t base = (size_t)bh * L * D;
  const int nk = causal ? i + 1 : L;
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < nk; j += blockDim.x) {
    float acc = 0.f;
    for (int d = 0; d < D; ++d) acc += __bfloat162float(q[base + (size_t)i * D + d]) * __bfloat162float(k[base + (size_t)j * D + d]);
    sc[j] = acc * scale;
    mx = fmaxf(mx, sc[j]);
  }
  for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = mx;
  __syncthreads();
  mx = -INFINITY;
  for (int w = 0; w < (int)blockDim.x / 32; ++w) mx = fmaxf(mx, red[w]);
  __syncthreads();
  float sum = 0.f;
  for (int j = threadIdx.x; j < nk; j += blockDim.x) {
    sc[j] = expf(sc[j] - mx);
    sum += sc[j];
  }
  for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = sum;
  __syncthreads();
  sum = 0.f;
  for (int w = 0; w < (int)blockDim.x / 32; ++w) sum += red[w];
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0.f;
    for (int j = 0; j < nk; ++j) acc += sc[j] * __bfloat162float(v[base + (size_t)j * D + d]);
    out[(size_t)i * D + d] = acc / sum;
  }
}

struct Variant {
  const char* name;
  const void* func;
  int threads;
  int rows_per_cta;  // query rows per CTA
  size_t smem;
  bool dense;        // needs Lq % rows == 0, Lk % 64 == 0
  bool causal_ok;
  void (*launch)(const Params&, int blocks, size_t smem, cudaStream_t);
};

template <typename K>
static void launch_any(K kernel, const Params& p, int blocks, int threads, size_t smem, cudaStream_t s) {
  kernel<<<blocks, threads, smem, s>>>(p);
}

#define DENSE(W, MB, C)                                                                        \
  [](const Params& p, int blocks, size_t smem, cudaStream_t s) {                               \
    launch_any(tfperf::fwd_dense_kernel<128, W, MB, C>, p, blocks, W * 32, smem, s);          \
  }

int main(int argc, char** argv) {
  bool quick = false, once = false;  // --once: only the checked launch of each variant (for ncu)
  for (int a = 1; a < argc; ++a) {
    quick |= std::strcmp(argv[a], "--quick") == 0;
    once |= std::strcmp(argv[a], "--once") == 0;
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("device: %s, %d SMs, smem/SM %zu KB, L2 %d MB\n", prop.name, prop.multiProcessorCount,
         prop.sharedMemPerMultiprocessor / 1024, prop.l2CacheSize >> 20);

  using namespace transformer_fast;
  const size_t smem_repo = size_t{4} * 64 * (128 + 8) * 2;
  const size_t smem_wg = size_t{64 + 4 * 64} * 128 * 2;
  const size_t smem_dense = tfperf::dense_smem_bytes<128, 4>();
  std::vector<Variant> all = {
      {"repo fwd_kernel (mma.sync)", (const void*)fwd_kernel<__nv_bfloat16, 128>, 128, 64, smem_repo, false, true,
       [](const Params& p, int blocks, size_t smem, cudaStream_t s) { launch_any(fwd_kernel<__nv_bfloat16, 128>, p, blocks, 128, smem, s); }},
      {"repo fwd_wgmma_kernel", (const void*)fwd_wgmma_kernel<__nv_bfloat16, 128>, 128, 64, smem_wg, false, true,
       [](const Params& p, int blocks, size_t smem, cudaStream_t s) { launch_any(fwd_wgmma_kernel<__nv_bfloat16, 128>, p, blocks, 128, smem, s); }},
      {"wgmma dense (change 1 only)", (const void*)fwd_wgmma_dense_kernel<128>, 128, 64, smem_wg, true, false,
       [](const Params& p, int blocks, size_t smem, cudaStream_t s) { launch_any(fwd_wgmma_dense_kernel<128>, p, blocks, 128, smem, s); }},
      {"repo fwd_dense_kernel", (const void*)fwd_dense_kernel<__nv_bfloat16, 128, false, false>, 128, 64, smem_repo, true, false,
       [](const Params& p, int blocks, size_t smem, cudaStream_t s) { launch_any(fwd_dense_kernel<__nv_bfloat16, 128, false, false>, p, blocks, 128, smem, s); }},
      {"repo fwd_dense_kernel causal", (const void*)fwd_dense_kernel<__nv_bfloat16, 128, true, false>, 128, 64, smem_repo, true, true,
       [](const Params& p, int blocks, size_t smem, cudaStream_t s) { launch_any(fwd_dense_kernel<__nv_bfloat16, 128, true, false>, p, blocks, 128, smem, s); }},
      {"repo fwd_wgmma_dense_kernel", (const void*)fwd_wgmma_dense_kernel<__nv_bfloat16, 128, false, false>, kWdThreads, kWdBM,
       wgmma_dense_smem_bytes<128>(), true, false,
       [](const Params& p, int blocks, size_t smem, cudaStream_t s) { launch_any(fwd_wgmma_dense_kernel<__nv_bfloat16, 128, false, false>, p, blocks, kWdThreads, smem, s); }},
      // The key-padding instantiation on a call without a mask: the kernel H100 run 5 measured.
      {"repo fwd_wgmma_dense_kernel kPad", (const void*)fwd_wgmma_dense_kernel<__nv_bfloat16, 128, false, true>, kWdThreads, kWdBM,
       wgmma_dense_smem_bytes<128>(), true, false,
       [](const Params& p, int blocks, size_t smem, cudaStream_t s) { launch_any(fwd_wgmma_dense_kernel<__nv_bfloat16, 128, false, true>, p, blocks, kWdThreads, smem, s); }},
      {"repo fwd_wgmma_dense_kernel causal", (const void*)fwd_wgmma_dense_kernel<__nv_bfloat16, 128, true, false>, kWdThreads, kWdBM,
       wgmma_dense_smem_bytes<128>(), true, true,
       [](const Params& p, int blocks, size_t smem, cudaStream_t s) { launch_any(fwd_wgmma_dense_kernel<__nv_bfloat16, 128, true, false>, p, blocks, kWdThreads, smem, s); }},
      {"dense 4w minB2", (const void*)tfperf::fwd_dense_kernel<128, 4, 2, false>, 128, 64, smem_dense, true, false, DENSE(4, 2, false)},
      {"dense 4w minB3", (const void*)tfperf::fwd_dense_kernel<128, 4, 3, false>, 128, 64, smem_dense, true, false, DENSE(4, 3, false)},
      {"dense 8w (BM128)", (const void*)tfperf::fwd_dense_kernel<128, 8, 1, false>, 256, 128, smem_dense, true, false, DENSE(8, 1, false)},
      {"dense 4w minB2 causal", (const void*)tfperf::fwd_dense_kernel<128, 4, 2, true>, 128, 64, smem_dense, true, true, DENSE(4, 2, true)},
      {"dense 8w causal", (const void*)tfperf::fwd_dense_kernel<128, 8, 1, true>, 256, 128, smem_dense, true, true, DENSE(8, 1, true)},
  };
  for (auto& v : all) {
    CK(cudaFuncSetAttribute(v.func, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)v.smem));
  }
  {
    const int kv_smem = (int)((size_t{2} * kKvBN + size_t{4} * kKvBM) * (128 + kPad) * 2 + size_t{4} * kKvBM * 4);
    const int q_smem = (int)(size_t{4} * kDenseDqBN * (128 + kPad) * 2);
    const std::pair<const void*, int> bwd[] = {
        {(const void*)dkdv_dense_kernel<__nv_bfloat16, 128, false, false>, kv_smem},
        {(const void*)dkdv_dense_kernel<__nv_bfloat16, 128, true, false>, kv_smem},
        {(const void*)dq_dense_kernel<__nv_bfloat16, 128, false, false>, q_smem},
        {(const void*)dq_dense_kernel<__nv_bfloat16, 128, true, false>, q_smem},
        {(const void*)dkdv_wgmma_dense_kernel<__nv_bfloat16, 128, false>, (int)wgmma_dkdv_smem_bytes<128>()},
        {(const void*)dkdv_wgmma_dense_kernel<__nv_bfloat16, 128, true>, (int)wgmma_dkdv_smem_bytes<128>()},
        // dQ by atomics (the kDq instantiations: one more tile, dS): their own attribute, else
        // the launch fails with "invalid argument" (H200 run, 2026-11-29).
        {(const void*)dkdv_wgmma_dense_kernel<__nv_bfloat16, 128, false, true>, (int)wgmma_dkdv_smem_bytes<128, true>()},
        {(const void*)dkdv_wgmma_dense_kernel<__nv_bfloat16, 128, true, true>, (int)wgmma_dkdv_smem_bytes<128, true>()},
        {(const void*)dq_wgmma_dense_kernel<__nv_bfloat16, 128, false>, (int)wgmma_dq_smem_bytes<128>()},
        {(const void*)dq_wgmma_dense_kernel<__nv_bfloat16, 128, true>, (int)wgmma_dq_smem_bytes<128>()}};
    for (const auto& [f, bytes] : bwd) CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  }

  struct Shape { int B, H, L; };
  std::vector<Shape> shapes = {{16, 16, 1024}, {4, 16, 4096}};
  if (quick) shapes.resize(1);
  const int D = 128;
  std::vector<std::string> table;
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));

  for (const Shape& sh : shapes) {
    const size_t n = (size_t)sh.B * sh.H * sh.L * D;
    __nv_bfloat16 *q, *k, *v, *o;
    float *lse, *ref;
    unsigned long long* nan_count;
    CK(cudaMalloc(&q, n * 2)); CK(cudaMalloc(&k, n * 2)); CK(cudaMalloc(&v, n * 2)); CK(cudaMalloc(&o, n * 2));
    CK(cudaMalloc(&lse, (size_t)sh.B * sh.H * sh.L * 4));
    CK(cudaMalloc(&ref, (size_t)2 * sh.L * D * 4));
    CK(cudaMalloc(&nan_count, 8));
    init_kernel<<<1024, 256>>>(q, n, 1u); init_kernel<<<1024, 256>>>(k, n, 2u); init_kernel<<<1024, 256>>>(v, n, 3u);
    CK(cudaGetLastError());
    const float scale = 1.0f / std::sqrt((float)D);
    for (int causal = 0; causal < (quick ? 1 : 2); ++causal) {
      // references for slices 0 and B*H-1
      const int slices[2] = {0, sh.B * sh.H - 1};
      std::vector<float> href((size_t)2 * sh.L * D);
      for (int si = 0; si < 2; ++si) {
        ref_kernel<<<sh.L, 128, sh.L * sizeof(float)>>>(q, k, v, ref + (size_t)si * sh.L * D, slices[si], sh.L, D, scale, causal);
        CK(cudaGetLastError());
      }
      CK(cudaMemcpy(href.data(), ref, href.size() * 4, cudaMemcpyDeviceToHost));
      Params p{};
      p.q = (const uint16_t*)q; p.k = (const uint16_t*)k; p.v = (const uint16_t*)v; p.out = (uint16_t*)o;
      p.lse_out = lse;
      p.q_sb = p.k_sb = p.v_sb = p.o_sb = (int64_t)sh.H * sh.L * D;
      p.q_sh = p.k_sh = p.v_sh = p.o_sh = (int64_t)sh.L * D;
      p.q_sm = p.k_sm = p.v_sm = p.o_sm = D;
      p.B = sh.B; p.H = sh.H; p.Hkv = sh.H; p.Lq = sh.L; p.Lk = sh.L; p.D = D;
      p.scale = scale; p.causal = causal; p.am_type = 0; p.vec16 = true;
      const double flops = 4.0 * sh.B * sh.H * (double)sh.L * sh.L * D * (causal ? 0.5 : 1.0);
      for (const Variant& var : all) {
        if (var.dense) {
          const bool is_causal_kernel = std::strstr(var.name, "causal") != nullptr;
          if (is_causal_kernel != (bool)causal) continue;
          if (sh.L % var.rows_per_cta || sh.L % 64) continue;
        }
        const int blocks = sh.B * sh.H * ((sh.L + var.rows_per_cta - 1) / var.rows_per_cta);
        cudaFuncAttributes fa;
        CK(cudaFuncGetAttributes(&fa, var.func));
        int per_sm = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, var.func, var.threads, var.smem));
        // checked run
        poison_kernel<<<1024, 256, 0, st>>>((uint16_t*)o, n);
        var.launch(p, blocks, var.smem, st);
        CK(cudaGetLastError());
        CK(cudaStreamSynchronize(st));
        CK(cudaMemset(nan_count, 0, 8));
        count_nan_kernel<<<1024, 256>>>(o, n, nan_count);
        unsigned long long nans = 0;
        CK(cudaMemcpy(&nans, nan_count, 8, cudaMemcpyDeviceToHost));
        double max_err = 0;
        std::vector<__nv_bfloat16> hout((size_t)sh.L * D);
        for (int si = 0; si < 2; ++si) {
          CK(cudaMemcpy(hout.data(), o + (size_t)slices[si] * sh.L * D, hout.size() * 2, cudaMemcpyDeviceToHost));
          for (size_t x = 0; x < hout.size(); ++x) {
            const double d = std::fabs((double)__bfloat162float(hout[x]) - href[(size_t)si * sh.L * D + x]);
            max_err = std::isnan(d) ? INFINITY : std::max(max_err, d);
          }
        }
        if (once) {
          printf("| B%d H%d L%d | %s | %s | regs %d | CTAs/SM %d | max err %.4f | NaNs %llu |\n", sh.B, sh.H, sh.L,
                 causal ? "causal" : "none", var.name, fa.numRegs, per_sm, max_err, nans);
          continue;
        }
        // timing
        for (int w = 0; w < 3; ++w) var.launch(p, blocks, var.smem, st);
        std::vector<float> ms;
        for (int r = 0; r < 25; ++r) {
          CK(cudaEventRecord(e0, st));
          var.launch(p, blocks, var.smem, st);
          CK(cudaEventRecord(e1, st));
          CK(cudaEventSynchronize(e1));
          float t;
          CK(cudaEventElapsedTime(&t, e0, e1));
          ms.push_back(t);
        }
        CK(cudaGetLastError());
        std::sort(ms.begin(), ms.end());
        const float med = ms[ms.size() / 2];
        char line[512];
        snprintf(line, sizeof line, "| B%d H%d L%d D%d | %s | %-28s | %3d | %zu KB | %d | %.3f | %.3f-%.3f | %6.1f | %.4f | %llu |",
                 sh.B, sh.H, sh.L, D, causal ? "causal" : "none", var.name, fa.numRegs, var.smem / 1024,
                 per_sm, med, ms[ms.size() / 5], ms[ms.size() * 4 / 5], flops / (med * 1e-3) / 1e12, max_err, nans);
        printf("%s\n", line);
        fflush(stdout);
        table.push_back(line);
      }
    }
    if (!once) {
      // Backward: the dense kernels (mma.sync: dkdv_dense_kernel + dq_dense_kernel) against their
      // wgmma twins (dkdv_wgmma_dense_kernel + dq_wgmma_dense_kernel), from one forward (O, lse
      // by fwd_dense_kernel), dO ~ N(0, 1).  Checked: max |difference| of dQ / dK / dV between the
      // two (bf16 rounding expected, ~1e-2) and NaNs; TFLOP/s at the benchmarks' 2.5x count.
      __nv_bfloat16 *dout, *grads[3][3];
      float* dq_acc;
      float* delta;
      unsigned* diff;
      CK(cudaMalloc(&dout, n * 2)); CK(cudaMalloc(&delta, (size_t)sh.B * sh.H * sh.L * 4)); CK(cudaMalloc(&diff, 4));
      for (auto& gv : grads) for (auto& gp : gv) CK(cudaMalloc(&gp, n * 2));
      CK(cudaMalloc(&dq_acc, n * 4));
      init_kernel<<<1024, 256>>>(dout, n, 4u);
      for (int causal = 0; causal < (quick ? 1 : 2); ++causal) {
        Params p{};
        p.q = (const uint16_t*)q; p.k = (const uint16_t*)k; p.v = (const uint16_t*)v; p.out = (uint16_t*)o;
        p.lse_out = lse;
        p.q_sb = p.k_sb = p.v_sb = p.o_sb = p.do_sb = p.o2_sb = (int64_t)sh.H * sh.L * D;
        p.q_sh = p.k_sh = p.v_sh = p.o_sh = p.do_sh = p.o2_sh = (int64_t)sh.L * D;
        p.q_sm = p.k_sm = p.v_sm = p.o_sm = p.do_sm = p.o2_sm = D;
        p.B = sh.B; p.H = sh.H; p.Hkv = sh.H; p.Lq = sh.L; p.Lk = sh.L; p.D = D;
        p.scale = scale; p.causal = causal; p.am_type = 0; p.vec16 = true;
        const int fwd_blocks = sh.B * sh.H * (sh.L / 64);
        causal ? launch_any(fwd_dense_kernel<__nv_bfloat16, 128, true, false>, p, fwd_blocks, 128, smem_repo, st)
               : launch_any(fwd_dense_kernel<__nv_bfloat16, 128, false, false>, p, fwd_blocks, 128, smem_repo, st);
        delta_kernel<<<1024, 256, 0, st>>>(dout, o, delta, (size_t)sh.B * sh.H * sh.L, D);
        CK(cudaStreamSynchronize(st));
        CK(cudaGetLastError());
        p.dout = (const uint16_t*)dout; p.lse = lse; p.delta = delta;
        const double flops = 2.5 * 4.0 * sh.B * sh.H * (double)sh.L * sh.L * D * (causal ? 0.5 : 1.0);
        for (int wg = 0; wg < 3; ++wg) {  // mma.sync pair, wgmma pair, wgmma dK / dV with dQ by atomics
          Params pkv = p, pq = p;
          pkv.out = (uint16_t*)grads[wg][1]; pkv.out2 = (uint16_t*)grads[wg][2]; pq.out = (uint16_t*)grads[wg][0];
          auto run = [&]() {
            if (wg == 0) {
              const size_t kv_smem = (size_t{2} * kKvBN + size_t{4} * kKvBM) * (128 + kPad) * 2 + size_t{4} * kKvBM * 4;
              const size_t q_smem = size_t{4} * kDenseDqBN * (128 + kPad) * 2;
              const int kvb = sh.B * sh.H * (sh.L / 64), qb = sh.B * sh.H * (sh.L / 64);
              causal ? launch_any(dkdv_dense_kernel<__nv_bfloat16, 128, true, false>, pkv, kvb, 128, kv_smem, st)
                     : launch_any(dkdv_dense_kernel<__nv_bfloat16, 128, false, false>, pkv, kvb, 128, kv_smem, st);
              causal ? launch_any(dq_dense_kernel<__nv_bfloat16, 128, true, false>, pq, qb, 128, q_smem, st)
                     : launch_any(dq_dense_kernel<__nv_bfloat16, 128, false, false>, pq, qb, 128, q_smem, st);
            } else if (wg == 2) {
              const int kvb = sh.B * sh.H * (sh.L / kWkBN);
              pkv.dq_acc = dq_acc;
              CK(cudaMemsetAsync(dq_acc, 0, n * 4, st));
              causal ? launch_any(dkdv_wgmma_dense_kernel<__nv_bfloat16, 128, true, true>, pkv, kvb, kWdThreads, wgmma_dkdv_smem_bytes<128, true>(), st)
                     : launch_any(dkdv_wgmma_dense_kernel<__nv_bfloat16, 128, false, true>, pkv, kvb, kWdThreads, wgmma_dkdv_smem_bytes<128, true>(), st);
              dq_convert_kernel<<<1024, 256, 0, st>>>(dq_acc, grads[wg][0], n, scale);
            } else {
              const int kvb = sh.B * sh.H * (sh.L / kWkBN), qb = sh.B * sh.H * (sh.L / kWqBM);
              causal ? launch_any(dkdv_wgmma_dense_kernel<__nv_bfloat16, 128, true>, pkv, kvb, kWdThreads, wgmma_dkdv_smem_bytes<128>(), st)
                     : launch_any(dkdv_wgmma_dense_kernel<__nv_bfloat16, 128, false>, pkv, kvb, kWdThreads, wgmma_dkdv_smem_bytes<128>(), st);
              causal ? launch_any(dq_wgmma_dense_kernel<__nv_bfloat16, 128, true>, pq, qb, kWdThreads, wgmma_dq_smem_bytes<128>(), st)
                     : launch_any(dq_wgmma_dense_kernel<__nv_bfloat16, 128, false>, pq, qb, kWdThreads, wgmma_dq_smem_bytes<128>(), st);
            }
          };
          for (auto* gp : grads[wg]) poison_kernel<<<1024, 256, 0, st>>>((uint16_t*)gp, n);
          run();
          CK(cudaStreamSynchronize(st));
          CK(cudaGetLastError());
          unsigned long long nans = 0;
          for (auto* gp : grads[wg]) {
            CK(cudaMemset(nan_count, 0, 8));
            count_nan_kernel<<<1024, 256>>>(gp, n, nan_count);
            unsigned long long c = 0;
            CK(cudaMemcpy(&c, nan_count, 8, cudaMemcpyDeviceToHost));
            nans += c;
          }
          float maxdiff[3] = {0, 0, 0};
          if (wg >= 1) {
            for (int gi = 0; gi < 3; ++gi) {
              CK(cudaMemset(diff, 0, 4));
              max_abs_diff_kernel<<<1024, 256>>>(grads[0][gi], grads[wg][gi], n, diff);
              unsigned bits = 0;
              CK(cudaMemcpy(&bits, diff, 4, cudaMemcpyDeviceToHost));
              std::memcpy(&maxdiff[gi], &bits, 4);
            }
          }
          for (int w = 0; w < 3; ++w) run();
          std::vector<float> ms;
          for (int r = 0; r < 25; ++r) {
            CK(cudaEventRecord(e0, st));
            run();
            CK(cudaEventRecord(e1, st));
            CK(cudaEventSynchronize(e1));
            float tms;
            CK(cudaEventElapsedTime(&tms, e0, e1));
            ms.push_back(tms);
          }
          CK(cudaGetLastError());
          std::sort(ms.begin(), ms.end());
          const float med = ms[ms.size() / 2];
          char line[512];
          snprintf(line, sizeof line,
                   "| B%d H%d L%d D%d | %s | backward %-20s | %.3f | %.3f-%.3f | bwd alone %.1f TFLOP/s (1.5x count) | |dq|,|dk|,|dv| diff vs dense %.4f %.4f %.4f | NaNs %llu |",
                   sh.B, sh.H, sh.L, D, causal ? "causal" : "none", wg == 2 ? "wgmma (dkdv+atomic dq)" : wg ? "wgmma (dkdv+dq)" : "dense (dkdv+dq)", med,
                   ms[ms.size() / 5], ms[ms.size() * 4 / 5], flops * 0.6 / (med * 1e-3) / 1e12, maxdiff[0], maxdiff[1],
                   maxdiff[2], nans);
          printf("%s\n", line);
          fflush(stdout);
          table.push_back(line);
        }
      }
      CK(cudaFree(dout)); CK(cudaFree(delta)); CK(cudaFree(diff)); CK(cudaFree(dq_acc));
      for (auto& gv : grads) for (auto& gp : gv) CK(cudaFree(gp));
    }
    CK(cudaFree(q)); CK(cudaFree(k)); CK(cudaFree(v)); CK(cudaFree(o)); CK(cudaFree(lse)); CK(cudaFree(ref)); CK(cudaFree(nan_count));
  }
  printf("\n| shape | mask | variant | regs | smem | CTAs/SM | median ms | p20-p80 | TFLOP/s | max err | NaNs |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (auto& l : table) printf("%s\n", l.c_str());
  return 0;
}
