// The argument checks of add_layer_norm, shared by add_layer_norm_cpu.cpp and
// add_layer_norm_cuda.cu (and by the CUDA emulation, tests/test_add_layer_norm_cuda_emulated.py,
// which compiles this file in one unit with add_layer_norm_cuda.cu: hence internal helpers with
// names of their own).
#include <ATen/core/Tensor.h>

#include <optional>

#include "ops.h"

namespace transformer_fast {

using at::Tensor;

static bool ln_dtype_ok(c10::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

static void check_ln_rows(const Tensor& t, const char* name, const Tensor& x, c10::DeviceType dev) {
  TORCH_CHECK(t.dim() == 2, "add_layer_norm: ", name, " must be 2-D (M, N), got ", t.dim(), "-D");
  TORCH_CHECK(t.sizes() == x.sizes(), "add_layer_norm: ", name, " must have the shape of x ",
              x.sizes(), ", got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), "add_layer_norm: ", name,
              " must have x's dtype ", x.scalar_type(), ", got ", t.scalar_type());
  TORCH_CHECK(t.device().type() == dev && t.device() == x.device(), "add_layer_norm: ", name,
              " must be on x's device ", x.device(), ", got ", t.device());
  TORCH_CHECK(t.size(1) <= 1 || t.stride(1) == 1, "add_layer_norm: ", name,
              " must have unit stride along N (stride(1) == 1), got strides ", t.strides());
  TORCH_CHECK(t.stride(0) >= 0, "add_layer_norm: ", name, " must have a non-negative row stride");
}

static void check_ln_param(const std::optional<Tensor>& p, const char* name, const Tensor& x) {
  if (!p.has_value() || !p->defined()) return;
  TORCH_CHECK(p->dim() == 1 && p->size(0) == x.size(1), "add_layer_norm: ", name,
              " must have shape (N,) = (", x.size(1), ",), got ", p->sizes());
  TORCH_CHECK(p->scalar_type() == x.scalar_type() || p->scalar_type() == at::kFloat,
              "add_layer_norm: ", name, " must be ", x.scalar_type(), " or float32, got ",
              p->scalar_type());
  TORCH_CHECK(p->device() == x.device(), "add_layer_norm: ", name, " must be on x's device ",
              x.device(), ", got ", p->device());
}

static void check_ln_dropout(double dropout_p, const std::optional<Tensor>& rng, const Tensor& x) {
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p <= 1.0, "add_layer_norm: dropout_p must be in [0, 1], got ",
              dropout_p);
  if (dropout_p > 0.0) {
    TORCH_CHECK(rng.has_value() && rng->defined(),
                "add_layer_norm: rng ([seed, offset] int64) is required when dropout_p > 0");
    TORCH_CHECK(rng->scalar_type() == at::kLong && rng->dim() == 1 && rng->numel() == 2,
                "add_layer_norm: rng must be an int64 tensor of shape (2,) [seed, offset], got ",
                rng->scalar_type(), " of shape ", rng->sizes());
    TORCH_CHECK(rng->device() == x.device(), "add_layer_norm: rng must be on x's device ",
                x.device(), ", got ", rng->device());
  }
}

static bool ln_present(const std::optional<Tensor>& t) { return t.has_value() && t->defined(); }

void check_add_layer_norm_fwd_args(const Tensor& x, const Tensor& residual,
                                   const std::optional<Tensor>& weight,
                                   const std::optional<Tensor>& bias, double eps,
                                   double dropout_p, const std::optional<Tensor>& rng,
                                   c10::DeviceType dev) {
  TORCH_CHECK(x.dim() == 2, "add_layer_norm: x must be 2-D (M, N), got ", x.dim(), "-D");
  TORCH_CHECK(ln_dtype_ok(x.scalar_type()),
              "add_layer_norm: x must be float32, float16 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.device().type() == dev, "add_layer_norm: x must be a ", dev, " tensor, got ",
              x.device());
  check_ln_rows(x, "x", x, dev);
  check_ln_rows(residual, "residual", x, dev);
  check_ln_param(weight, "weight", x);
  check_ln_param(bias, "bias", x);
  TORCH_CHECK(eps >= 0.0, "add_layer_norm: eps must be >= 0, got ", eps);
  check_ln_dropout(dropout_p, rng, x);
}

void check_add_layer_norm_bwd_args(const Tensor& dy, const std::optional<Tensor>& dh,
                                   const Tensor& x, const Tensor& residual,
                                   const std::optional<Tensor>& weight,
                                   const std::optional<Tensor>& bias, const Tensor& mean,
                                   const Tensor& rstd, double dropout_p,
                                   const std::optional<Tensor>& rng, c10::DeviceType dev) {
  check_add_layer_norm_fwd_args(x, residual, weight, bias, 0.0, dropout_p, rng, dev);
  check_ln_rows(dy, "dy", x, dev);
  if (ln_present(dh)) check_ln_rows(*dh, "dh", x, dev);
  for (const Tensor* s : {&mean, &rstd}) {
    const char* name = s == &mean ? "mean" : "rstd";
    TORCH_CHECK(s->scalar_type() == at::kFloat, "add_layer_norm: ", name, " must be float32, got ",
                s->scalar_type());
    TORCH_CHECK(s->dim() == 1 && s->size(0) == x.size(0), "add_layer_norm: ", name,
                " must have shape (M,) = (", x.size(0), ",), got ", s->sizes());
    TORCH_CHECK(s->device() == x.device(), "add_layer_norm: ", name, " must be on x's device ",
                x.device(), ", got ", s->device());
  }
}

}  // namespace transformer_fast
