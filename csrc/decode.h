// Shared between decode_cpu.cpp (the cpu backend of attention_with_kv_cache, and the home of the
// checks) and decode_cuda.cu.  Contract: the docstring of kernels/decode.py.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>

namespace transformer_fast {

// Validates the arguments of attention_with_kv_cache_fwd (shapes, dtypes, devices, head dims,
// unit last stride of the tensors the kernels read); `dev` is the backend's device type.
void check_kv_cache_args(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& k_new,
                         const std::optional<at::Tensor>& v_new, double scale, c10::DeviceType dev);

// FlashAttention-2's split rule (the one kernels/decode.py uses): no split when `programs`
// already fill ~80% of `slots`; else the smallest split count whose wave efficiency is within 85%
// of the best, among counts that change the number of key blocks per split.  Shapes only: the
// caller passes n_blocks from L_max, never from cache_seqlens (no host sync on a GPU).
int64_t kv_num_splits_heuristic(int64_t programs, int64_t slots, int64_t n_blocks,
                                int64_t max_splits);

// Split count forced through the environment (tests): TRANSFORMER_FAST_KV_SPLITS=<n >= 1>,
// clamped to [1, max_splits]; 0 when unset or not a positive integer.
int64_t kv_forced_splits(int64_t max_splits);

}  // namespace transformer_fast
