"""Run the CUDA kernels of csrc/ on the CPU, for machines without a GPU.

A .cu file is compiled as host C++ after PRELUDE, which defines the CUDA qualifiers away and
emulates what a kernel uses of the CUDA programming model:
  * a CTA is its block's std::threads (1-, 2- or 3-D; warps from the linear thread id) started
    together; CTAs of the grid run one after another, on one set of threads per launch (so
    function-local state shared by a CTA may be a `static` variable: a kernel's static
    `__shared__` arrays are, via TF_STATIC_SHARED);
  * __syncthreads is a barrier over the CTA (its _and / _or / _count forms reduce a predicate
    too), __syncwarp one over the warp; warp votes (__ballot_sync, __any_sync, __all_sync);
  * warp shuffles (__shfl_sync / _xor / _down / _up, any trivially copyable 4- or 8-byte type)
    exchange values through a per-warp buffer between two warp barriers;
  * mma.sync m16n8k16 (fp16 / bf16 -> fp32) and ldmatrix.m8n8 (.x2 / .x4, .trans) are computed
    from the PTX ISA fragment layouts, an independent statement of the layouts a kernel assumes;
  * wgmma m64nNk16 (fp16 / bf16 -> fp32; A from shared memory or registers, B from shared
    memory, K-major or MN-major, no-swizzle descriptors only) likewise, over the warpgroup's 128
    threads, decoding its matrix descriptors against the CTA's shared memory;
  * dynamic shared memory is a buffer of the harness's choosing, filled with 0xFF (NaN bit
    patterns) before every CTA so that reads of unwritten shared memory show up; it sits at
    shared-window address 0 unless a test sets emu::smem_window (a GPU promises 16-byte
    alignment only: a kernel that needs 1024-byte aligned tiles must align them itself).
A kernel file guards what the emulation provides itself (its launch function, its device checks)
with `#ifndef TF_CUDA_EMULATE`.  The harness (`build(...)`) then defines the launch and the
bindings the test calls.

It runs a kernel's own indexing, masking, tiling and arithmetic against the oracle; it cannot see
timing, the memory model, or real-hardware behaviour: compute-sanitizer and the `gpu` tests on a
GPU still decide.
"""
from __future__ import annotations

import glob
import hashlib
import os

import pytest

CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")

PRELUDE = r"""
#define TF_CUDA_EMULATE 1
#include <torch/extension.h>

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstring>
#include <functional>
#include <thread>
#include <type_traits>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__
#define __align__(x)
#define __restrict__

// A rounded product nvcc must not contract into an FMA; the host build does not contract (no -mfma).
inline float __fmul_rn(float a, float b) { return a * b; }

struct EmuDim3 { unsigned x = 0, y = 0, z = 0; };
thread_local EmuDim3 threadIdx, blockIdx;
EmuDim3 blockDim, gridDim;

namespace emu {
struct Warp {
  std::barrier<> bar{32};
  uint64_t raw[32];
  uint32_t a[32][4];
  uint32_t b[32][2];
  const uint16_t* ptr[32];
};
Warp* warps = nullptr;
struct WarpGroup {
  std::barrier<> bar{128};
  const uint32_t* a[128];
};
WarpGroup* warpgroups = nullptr;
char* smem_base = nullptr;  // the launch's dynamic shared memory, at address smem_window of the
size_t smem_size = 0;       // shared window (0 unless a test moves it: a GPU only promises 16-byte
uint32_t smem_window = 0;   // alignment, which kernels that need more must restore themselves)
std::barrier<>* block_bar = nullptr;

inline float bits_to_float(uint16_t h, bool bf16) {
  if (bf16) {
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  __half x;
  std::memcpy(&x, &h, 2);
  return __half2float(x);
}
inline uint16_t half_of(uint32_t r, int which) { return which ? uint16_t(r >> 16) : uint16_t(r & 0xffff); }
// Warps are formed from the linear thread id (x fastest), as CUDA forms them.
inline unsigned linear_tid() { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }
inline Warp& my_warp() { return warps[linear_tid() / 32]; }
inline int my_lane() { return linear_tid() % 32; }

// Every lane publishes x, then reads the value of lane src(lane) (its own when out of range).
template <typename T, typename Src>
T exchange(T x, Src src) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "4- or 8-byte shuffle types");
  Warp& w = my_warp();
  const int lane = my_lane();
  uint64_t bits = 0;
  std::memcpy(&bits, &x, sizeof(T));
  w.raw[lane] = bits;
  w.bar.arrive_and_wait();
  int from = src(lane);
  if (from < 0 || from >= 32) from = lane;
  T r;
  std::memcpy(&r, &w.raw[from], sizeof(T));
  w.bar.arrive_and_wait();
  return r;
}

// Runs body() as block.x * block.y * block.z threads per CTA over the grid, CTA after CTA (x
// fastest, then y, then z).  One set of threads serves every CTA of the launch (starting a thread
// costs far more than a CTA's barrier): each thread runs its CTA, then waits at a barrier whose
// completion re-poisons the shared memory, so no thread starts the next CTA before every thread
// has left this one, as if each CTA had threads of its own.
inline void run_grid(EmuDim3 grid, EmuDim3 block, void* smem, size_t smem_capacity, size_t smem_bytes,
                     const std::function<void()>& body) {
  const unsigned bx = std::max(block.x, 1u), by = std::max(block.y, 1u), bz = std::max(block.z, 1u);
  const int threads = static_cast<int>(bx * by * bz);
  TORCH_CHECK(threads % 32 == 0 && threads > 0 && threads <= 1024, "emulated CTA: bad thread count ", threads);
  TORCH_CHECK(smem_bytes <= smem_capacity, "emulated shared memory too small: ", smem_bytes, " > ", smem_capacity);
  gridDim = grid;
  blockDim = EmuDim3{bx, by, bz};
  const uint64_t gx = grid.x, gy = std::max(grid.y, 1u), gz = std::max(grid.z, 1u);
  const uint64_t ctas = gx * gy * gz;
  if (ctas == 0) return;
  auto poison = [smem, smem_capacity]() noexcept {
    if (smem != nullptr) std::memset(smem, 0xFF, smem_capacity);
  };
  poison();
  std::vector<Warp> ws(threads / 32);
  warps = ws.data();
  std::vector<WarpGroup> wgs((threads + 127) / 128);
  warpgroups = wgs.data();
  smem_base = static_cast<char*>(smem);
  smem_size = smem_capacity;
  std::barrier<> bar(threads);
  block_bar = &bar;
  std::barrier cta_done(threads, poison);
  std::vector<std::thread> pool;
  pool.reserve(threads);
  for (int tid = 0; tid < threads; ++tid) {
    pool.emplace_back([&, tid] {
      const unsigned u = static_cast<unsigned>(tid);
      threadIdx = EmuDim3{u % bx, (u / bx) % by, u / (bx * by)};
      for (uint64_t c = 0; c < ctas; ++c) {
        blockIdx = EmuDim3{static_cast<unsigned>(c % gx), static_cast<unsigned>(c / gx % gy),
                           static_cast<unsigned>(c / (gx * gy))};
        body();
        cta_done.arrive_and_wait();
      }
    });
  }
  for (auto& th : pool) th.join();
}

// Runs body() as `threads` threads per CTA (a 1-D block).
inline void run_grid(EmuDim3 grid, int threads, void* smem, size_t smem_capacity, size_t smem_bytes,
                     const std::function<void()>& body) {
  run_grid(grid, EmuDim3{static_cast<unsigned>(threads), 1, 1}, smem, smem_capacity, smem_bytes, body);
}
}  // namespace emu

inline void __syncthreads() { emu::block_bar->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::my_warp().bar.arrive_and_wait(); }
inline void __trap() { std::abort(); }
// atomicAdd on fp32 global memory (its result unused by the kernels: a reduction)
inline float atomicAdd(float* address, float v) { return std::atomic_ref<float>(*address).fetch_add(v); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }  // the device one is approximate (<= 2 ulp)

// Warp votes: every lane publishes its predicate between two warp barriers.
inline unsigned __ballot_sync(unsigned, int pred) {
  emu::Warp& w = emu::my_warp();
  w.raw[emu::my_lane()] = pred != 0;
  w.bar.arrive_and_wait();
  unsigned bits = 0;
  for (int l = 0; l < 32; ++l) bits |= static_cast<unsigned>(w.raw[l] != 0) << l;
  w.bar.arrive_and_wait();
  return bits;
}
inline int __any_sync(unsigned m, int pred) { return __ballot_sync(m, pred) != 0; }
inline int __all_sync(unsigned m, int pred) { return __ballot_sync(m, pred) == 0xffffffffu; }
// __syncthreads_and / _or: a CTA barrier that also reduces a predicate (CTAs run one at a time, so
// one counter serves; the first barrier keeps a reset from overtaking the previous call's reads).
inline int emulated_syncthreads_count(int pred) {
  static std::atomic<int> count{0};
  emu::block_bar->arrive_and_wait();
  if (emu::linear_tid() == 0) count.store(0);
  emu::block_bar->arrive_and_wait();
  if (pred) count.fetch_add(1);
  emu::block_bar->arrive_and_wait();
  return count.load();
}
inline int __syncthreads_count(int pred) { return emulated_syncthreads_count(pred); }
inline int __syncthreads_or(int pred) { return emulated_syncthreads_count(pred) != 0; }
inline int __syncthreads_and(int pred) {
  const int n = static_cast<int>(blockDim.x * blockDim.y * blockDim.z);
  return emulated_syncthreads_count(pred) == n;
}

template <typename T> T __shfl_sync(unsigned, T x, int src, int width = 32) {
  return emu::exchange(x, [&](int lane) { return (lane / width) * width + src % width; });
}
template <typename T> T __shfl_xor_sync(unsigned, T x, int m, int width = 32) {
  return emu::exchange(x, [&](int lane) { return (lane ^ m) / width == lane / width ? lane ^ m : lane; });
}
template <typename T> T __shfl_down_sync(unsigned, T x, unsigned d, int width = 32) {
  return emu::exchange(x, [&](int lane) { return (lane % width) + int(d) < width ? lane + int(d) : lane; });
}
template <typename T> T __shfl_up_sync(unsigned, T x, unsigned d, int width = 32) {
  return emu::exchange(x, [&](int lane) { return (lane % width) >= int(d) ? lane - int(d) : lane; });
}

// D = A (16x16) B (16x8) + C for the calling lane's four C elements.
inline void emulated_mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1, bool bf16) {
  emu::Warp& w = emu::my_warp();
  const int lane = emu::my_lane();
  for (int r = 0; r < 4; ++r) w.a[lane][r] = a[r];
  w.b[lane][0] = b0;
  w.b[lane][1] = b1;
  w.bar.arrive_and_wait();
  auto A = [&](int row, int k) {  // a_i: row g + 8*(i&1), col 2t + 8*(i>>1) + {0,1}
    const int ln = 4 * (row % 8) + (k % 8) / 2, reg = (row / 8) + 2 * (k / 8);
    return emu::bits_to_float(emu::half_of(w.a[ln][reg], k % 2), bf16);
  };
  auto B = [&](int k, int n) {  // b_i: k 2t + 8*i + {0,1}, n g
    const int ln = 4 * n + (k % 8) / 2, reg = k / 8;
    return emu::bits_to_float(emu::half_of(w.b[ln][reg], k % 2), bf16);
  };
  const int g = lane / 4, t = lane % 4;
  float d[4];
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
    float acc = c[e];
    for (int k = 0; k < 16; ++k) acc += A(row, k) * B(k, col);
    d[e] = acc;
  }
  w.bar.arrive_and_wait();
  for (int e = 0; e < 4; ++e) c[e] = d[e];
}

// The shared-window address of ptr (what __cvta_generic_to_shared gives on a GPU).
inline uint32_t emulated_smem_address(const void* ptr) {
  const char* c = static_cast<const char*>(ptr);
  if (emu::smem_base == nullptr || c < emu::smem_base || c >= emu::smem_base + emu::smem_size) std::abort();
  return static_cast<uint32_t>(c - emu::smem_base) + emu::smem_window;
}

// wgmma.mma_async m64nNk16 .f32 (fp16 / bf16 inputs), issued by the calling thread's warpgroup:
// d = A B (+ d when scale_d).  Accumulators: warp w of the group owns rows 16w..16w+15, d[4i + e]
// is (row 16w + g + 8 (e >> 1), col 8i + 2t + (e & 1)).  A from registers (a_regs, descriptor
// unused): warp w holds rows 16w.. as mma.m16n8k16's A fragment; else A from shared memory, K-major.
// Descriptors, no swizzle (layout 0): element (mn, k) of a 16-deep slab is at start + (mn / 8) *
// SBO + (k / 8) * LBO + within the 8 x 16-byte core matrix (mn % 8) * 16 + (k % 8) * 2 (K-major)
// or (k % 8) * 16 + (mn % 8) * 2 (MN-major).  128-byte swizzle (layout 1), the PTX ISA's
// canonical layouts: K-major start + (mn / 8) * SBO + (mn % 8) * 128 + k * 2 (LBO unused);
// MN-major start + (mn / 64) * LBO + (mn % 64) * 2 + (k / 8) * SBO + (k % 8) * 128; then the
// address's bits 4-6 are XORed with its bits 7-9 (Swizzle<3,4,3>, base offset 0: patterns start
// at 1024-byte boundaries of the shared window).  Other layouts abort.
inline void emulated_wgmma(float* d, int n, uint64_t desc_a, const uint32_t* a_regs, uint64_t desc_b,
                           bool b_mn_major, bool scale_d, bool bf16) {
  const unsigned tid = emu::linear_tid();
  emu::WarpGroup& wg = emu::warpgroups[tid / 128];
  const int r = static_cast<int>(tid % 128);
  wg.a[r] = a_regs;
  wg.bar.arrive_and_wait();
  auto check = [](uint64_t desc) {  // base offset 0; no swizzle or 128-byte swizzle
    if (((desc >> 49) & 7) != 0 || (desc >> 62) > 1 || ((desc >> 14) & 3) != 0) std::abort();
  };
  auto field = [](uint64_t desc, int lo) { return static_cast<size_t>((desc >> lo) & 0x3FFF) << 4; };
  auto element = [&](uint64_t desc, int mn, int k, bool mn_major) {
    size_t at;
    if ((desc >> 62) == 1) {
      at = field(desc, 0) + (mn_major ? (mn / 64) * field(desc, 16) + (mn % 64) * 2 + (k / 8) * field(desc, 32) +
                                            (k % 8) * 128
                                      : (mn / 8) * field(desc, 32) + (mn % 8) * 128 + k * 2);
      at ^= ((at >> 7) & 7) << 4;
    } else {
      at = field(desc, 0) + (mn / 8) * field(desc, 32) + (k / 8) * field(desc, 16) +
           (mn_major ? (k % 8) * 16 + (mn % 8) * 2 : (mn % 8) * 16 + (k % 8) * 2);
    }
    if (at < emu::smem_window || at - emu::smem_window + 2 > emu::smem_size) std::abort();
    uint16_t bits;
    std::memcpy(&bits, emu::smem_base + (at - emu::smem_window), 2);
    return emu::bits_to_float(bits, bf16);
  };
  auto A = [&](int row, int k) {
    if (a_regs == nullptr) return element(desc_a, row, k, false);
    const int w = row / 16, rr = row % 16, ln = 4 * (rr % 8) + (k % 8) / 2, reg = (rr / 8) + 2 * (k / 8);
    return emu::bits_to_float(emu::half_of(wg.a[32 * w + ln][reg], k % 2), bf16);
  };
  if (a_regs == nullptr) check(desc_a);
  check(desc_b);
  const int warp = r / 32, lane = r % 32, g = lane / 4, t = lane % 4;
  std::vector<float> out(n / 2);
  for (int i = 0; i < n / 8; ++i) {
    for (int e = 0; e < 4; ++e) {
      const int row = 16 * warp + g + 8 * (e >> 1), col = 8 * i + 2 * t + (e & 1);
      float acc = scale_d ? d[4 * i + e] : 0.0f;
      for (int k = 0; k < 16; ++k) acc += A(row, k) * element(desc_b, col, k, b_mn_major);
      out[4 * i + e] = acc;
    }
  }
  wg.bar.arrive_and_wait();
  for (int i = 0; i < n / 2; ++i) d[i] = out[i];
}

// ldmatrix.m8n8 (.x2 / .x4, .trans): row addresses from lanes 8m..8m+7 for matrix m.
inline void emulated_ldmatrix(uint32_t* r, int n, const uint16_t* addr, bool trans) {
  emu::Warp& w = emu::my_warp();
  const int lane = emu::my_lane();
  if (reinterpret_cast<uintptr_t>(addr) % 16 != 0) std::abort();  // ldmatrix needs 16-byte rows
  w.ptr[lane] = addr;
  w.bar.arrive_and_wait();
  const int g = lane / 4, t = lane % 4;
  for (int m = 0; m < n; ++m) {
    uint16_t lo, hi;
    if (!trans) {
      lo = w.ptr[8 * m + g][2 * t];
      hi = w.ptr[8 * m + g][2 * t + 1];
    } else {
      lo = w.ptr[8 * m + 2 * t][g];
      hi = w.ptr[8 * m + 2 * t + 1][g];
    }
    r[m] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  }
  w.bar.arrive_and_wait();
}
"""


def cuda_include_dir():
    """A folder with cuda_fp16.h and cuda_bf16.h (the CUDA toolkit's or an nvidia wheel's)."""
    from torch.utils import cpp_extension

    roots = [os.path.join(cpp_extension.CUDA_HOME or "/nonexistent", "include")]
    roots += sorted(glob.glob("/usr/local/cuda*/include"), reverse=True)
    try:
        import nvidia

        roots += [os.path.join(p, sub, "include") for p in nvidia.__path__ for sub in ("cu13", "cu12", "cuda_runtime")]
    except ImportError:
        pass
    for root in roots:
        if os.path.exists(os.path.join(root, "cuda_fp16.h")) and os.path.exists(os.path.join(root, "cuda_bf16.h")):
            return root
    return None


def _remove_stale_lock(name: str, max_age_s: float = 3600.0) -> None:
    """torch's JIT build waits, without a timeout, for a ``lock`` file that a killed build leaves
    behind: every later run of the same sources then hangs at 0% CPU.  A lock older than any build
    here (minutes) is such a leftover."""
    import time

    from torch.utils import cpp_extension

    try:
        lock = os.path.join(cpp_extension._get_build_directory(name, False), "lock")
        if time.time() - os.path.getmtime(lock) > max_age_s:
            os.remove(lock)
    except (AttributeError, OSError):  # no lock (the usual case), or a torch without the helper
        pass


# The GPU's expf / exp2f (CUDA's are within 2 ulp; the host's are nearly correctly rounded):
# each value moved by a full 2 ulp relative, the sign a hash of the argument's bits (one value
# per argument, as the hardware gives), exact at 0 (exp2f: at integers).  A harness puts it
# before it includes a kernel file, whose expf / exp2f calls then take it.
GPU_EXP_MODEL = r"""
inline float tf_gpu_exp_off(float x, double y) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  const double sign = ((uint64_t{b} * 2654435761ull) >> 13) & 1 ? -1.0 : 1.0;
  return static_cast<float>(y * (1.0 + sign * 0x1p-22));
}
inline float tf_gpu_expf(float x) {
  return x == 0.0f || !std::isfinite(x) ? std::exp(x) : tf_gpu_exp_off(x, std::exp(static_cast<double>(x)));
}
inline float tf_gpu_exp2f(float x) {
  return x == std::nearbyint(x) || !std::isfinite(x) ? std::exp2(x)
                                                      : tf_gpu_exp_off(x, std::exp2(static_cast<double>(x)));
}
#define expf tf_gpu_expf
#define exp2f tf_gpu_exp2f
"""


def build(name: str, harness: str, csrc_files, functions):
    """Compiles PRELUDE + harness (which #includes the kernel file) as a host extension module.

    torch's JIT cache hashes the inline source only, not the files it includes: the build is named
    after the csrc/ files it includes, so that an edited kernel is recompiled.  Skips the calling
    test when the CUDA fp16/bf16 headers are not on this machine.
    """
    from torch.utils.cpp_extension import load_inline

    inc = cuda_include_dir()
    if inc is None:
        pytest.skip("cuda_fp16.h / cuda_bf16.h not found (no CUDA toolkit headers)")
    digest = hashlib.sha1((PRELUDE + harness).encode())
    for file in csrc_files:
        with open(os.path.join(CSRC, file), "rb") as f:
            digest.update(f.read())
    full_name = f"{name}_{digest.hexdigest()[:12]}"
    _remove_stale_lock(full_name)
    return load_inline(full_name, cpp_sources=[PRELUDE + harness],
                       functions=list(functions), extra_include_paths=[CSRC, inc],
                       extra_cflags=["-O1", "-std=c++20"])
