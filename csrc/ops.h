// Prototypes shared between the csrc/ translation units (kept light: ATen/core/Tensor.h only).
//
// Op contract (schemas live in registration.cpp; semantics in transformer_fast/ops/layer_norm.py):
//   add_layer_norm_fwd(x, residual, weight?, bias?, eps, dropout_p, rng?, prenorm)
//       -> (y, h or empty (0,), mean fp32 (M,), rstd fp32 (M,))
//   add_layer_norm_bwd(dy, dh?, x, residual, weight?, bias?, mean, rstd, dropout_p, rng?)
//       -> (dx or empty (0,), dresidual, dweight or empty (0,), dbias or empty (0,))
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <tuple>

namespace transformer_fast {

using Tensor4 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Shared argument validation (add_layer_norm_cpu.cpp); `device_type` is the backend's device.
void check_add_layer_norm_fwd_args(const at::Tensor& x, const at::Tensor& residual,
                                   const std::optional<at::Tensor>& weight,
                                   const std::optional<at::Tensor>& bias, double eps,
                                   double dropout_p, const std::optional<at::Tensor>& rng,
                                   c10::DeviceType device_type);
void check_add_layer_norm_bwd_args(const at::Tensor& dy, const std::optional<at::Tensor>& dh,
                                   const at::Tensor& x, const at::Tensor& residual,
                                   const std::optional<at::Tensor>& weight,
                                   const std::optional<at::Tensor>& bias, const at::Tensor& mean,
                                   const at::Tensor& rstd, double dropout_p,
                                   const std::optional<at::Tensor>& rng,
                                   c10::DeviceType device_type);

Tensor4 add_layer_norm_fwd_cpu(const at::Tensor& x, const at::Tensor& residual,
                               const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& bias, double eps, double dropout_p,
                               const std::optional<at::Tensor>& rng, bool prenorm);
Tensor4 add_layer_norm_bwd_cpu(const at::Tensor& dy, const std::optional<at::Tensor>& dh,
                               const at::Tensor& x, const at::Tensor& residual,
                               const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& bias, const at::Tensor& mean,
                               const at::Tensor& rstd, double dropout_p,
                               const std::optional<at::Tensor>& rng);

#ifdef TF_WITH_CUDA
Tensor4 add_layer_norm_fwd_cuda(const at::Tensor& x, const at::Tensor& residual,
                                const std::optional<at::Tensor>& weight,
                                const std::optional<at::Tensor>& bias, double eps,
                                double dropout_p, const std::optional<at::Tensor>& rng,
                                bool prenorm);
Tensor4 add_layer_norm_bwd_cuda(const at::Tensor& dy, const std::optional<at::Tensor>& dh,
                                const at::Tensor& x, const at::Tensor& residual,
                                const std::optional<at::Tensor>& weight,
                                const std::optional<at::Tensor>& bias, const at::Tensor& mean,
                                const at::Tensor& rstd, double dropout_p,
                                const std::optional<at::Tensor>& rng);
#endif

}  // namespace transformer_fast
