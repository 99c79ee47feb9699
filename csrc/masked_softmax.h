// Argument checks of the C++ masked_softmax ops, shared by masked_softmax_cpu.cpp and
// masked_softmax_cuda.cu (inline here, so that the CUDA file's CPU emulation in the tests runs
// the very same checks).  Contract: the docstring of kernels/masked_softmax.py.
//
// Errors mirror the Triton launchers': a wrong shape / value is a ValueError, a wrong dtype a
// TypeError (TORCH_CHECK_VALUE / TORCH_CHECK_TYPE), each naming the argument.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <optional>

namespace transformer_fast {

inline bool masked_softmax_dtype_ok(c10::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

inline void masked_softmax_check_4d(const at::Tensor& t, const char* name, c10::DeviceType dev,
                                    bool double_ok = false) {
  TORCH_CHECK_VALUE(t.dim() == 4, "masked_softmax: ", name, " must be 4-D (B, H, Lq, Lk), got ",
                    t.sizes());
  TORCH_CHECK_TYPE(masked_softmax_dtype_ok(t.scalar_type()) ||
                       (double_ok && t.scalar_type() == at::kDouble),
                   "masked_softmax: ", name, " must be float16, bfloat16 or float32",
                   double_ok ? " (or float64)" : "", ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device().type() == dev, "masked_softmax: ", name, " must be a ", dev,
                    " tensor, got ", t.device());
  // Rows are indexed with 32-bit row numbers (B*H*Lq) on both backends.
  TORCH_CHECK_VALUE(t.size(0) * t.size(1) * t.size(2) < (int64_t{1} << 31), "masked_softmax: ",
                    name, ": B*H*Lq = ", t.size(0) * t.size(1) * t.size(2),
                    " rows exceeds 2**31 - 1");
}

inline void masked_softmax_check_dropout(double dropout_p, const std::optional<at::Tensor>& rng,
                                         const at::Tensor& like) {
  TORCH_CHECK_VALUE(dropout_p >= 0.0 && dropout_p <= 1.0,
                    "masked_softmax: dropout_p must be in [0, 1], got ", dropout_p);
  if (dropout_p == 0.0) return;
  TORCH_CHECK_VALUE(rng.has_value() && rng->defined(),
                    "masked_softmax: rng (int64 [seed, offset]) is required when dropout_p > 0");
  TORCH_CHECK_VALUE(rng->scalar_type() == at::kLong && rng->numel() >= 2 &&
                        rng->device() == like.device(),
                    "masked_softmax: rng must be an int64 tensor [seed, offset] on ", like.device(),
                    ", got ", rng->scalar_type(), " ", rng->sizes(), " on ", rng->device());
}

inline void check_masked_softmax_fwd_args(const at::Tensor& scores,
                                          const std::optional<at::Tensor>& mask, double scale,
                                          double dropout_p, const std::optional<at::Tensor>& rng,
                                          c10::DeviceType dev, bool double_scores_ok = false) {
  masked_softmax_check_4d(scores, "scores", dev, double_scores_ok);
  TORCH_CHECK_VALUE(std::isfinite(scale), "masked_softmax: scale must be finite, got ", scale);
  if (mask.has_value() && mask->defined()) {
    const at::Tensor& m = *mask;
    TORCH_CHECK_VALUE(m.sizes() == scores.sizes(), "masked_softmax: mask must have shape ",
                      scores.sizes(), " (expanded to the scores), got ", m.sizes());
    TORCH_CHECK_VALUE(m.device() == scores.device(), "masked_softmax: mask must be on ",
                      scores.device(), ", got ", m.device());
    const auto t = m.scalar_type();
    TORCH_CHECK_TYPE(t == at::kBool || masked_softmax_dtype_ok(t) || t == at::kDouble,
                     "masked_softmax: mask must be bool or floating (float16, bfloat16, float32, "
                     "float64), got ", t);
  }
  masked_softmax_check_dropout(dropout_p, rng, scores);
}

inline void check_masked_softmax_bwd_args(const at::Tensor& dout, const at::Tensor& probs,
                                          double scale, double dropout_p,
                                          const std::optional<at::Tensor>& rng,
                                          c10::DeviceType dev) {
  masked_softmax_check_4d(probs, "probs", dev);
  TORCH_CHECK_VALUE(dout.sizes() == probs.sizes(), "masked_softmax: dout must have shape ",
                    probs.sizes(), ", got ", dout.sizes());
  TORCH_CHECK_VALUE(dout.device() == probs.device(), "masked_softmax: dout must be on ",
                    probs.device(), ", got ", dout.device());
  TORCH_CHECK_TYPE(masked_softmax_dtype_ok(dout.scalar_type()),
                   "masked_softmax: dout must be float16, bfloat16 or float32, got ",
                   dout.scalar_type());
  TORCH_CHECK_VALUE(std::isfinite(scale), "masked_softmax: scale must be finite, got ", scale);
  masked_softmax_check_dropout(dropout_p, rng, probs);
}

}  // namespace transformer_fast
