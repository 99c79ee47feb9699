// The argument checks of the FFN primitives, shared by ffn_cpu.cpp and ffn_cuda.cu (and by the
// CUDA emulation in tests/test_ffn_cuda_emulated.py, which compiles this file with ffn_cuda.cu).
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

#include "ops.h"

namespace transformer_fast {

using at::Tensor;

// (Internal linkage, and names of their own: the emulation compiles this file in one unit with
// ffn_cuda.cu.)
static bool ffn_dtype_ok(c10::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

static bool ffn_present(const std::optional<Tensor>& t) { return t.has_value() && t->defined(); }

static void check_ffn_matrix(const Tensor& t, const char* name, const Tensor& like, c10::DeviceType dev) {
  TORCH_CHECK(t.dim() == 2, "ffn: ", name, " must be 2-D, got ", t.dim(), "-D");
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), "ffn: ", name, " must have dtype ",
              like.scalar_type(), ", got ", t.scalar_type());
  TORCH_CHECK(t.device().type() == dev && t.device() == like.device(), "ffn: ", name,
              " must be on ", like.device(), ", got ", t.device());
}

FfnAct parse_ffn_activation(c10::string_view activation) {
  if (activation == "none") return FfnAct::kNone;
  if (activation == "relu") return FfnAct::kRelu;
  if (activation == "gelu") return FfnAct::kGelu;
  if (activation == "gelu_tanh") return FfnAct::kGeluTanh;
  TORCH_CHECK(false, "ffn: activation must be one of none, relu, gelu, gelu_tanh; got '",
              std::string(activation.data(), activation.size()), "'");
}

void check_ffn_dropout(double dropout_p, const std::optional<Tensor>& rng, const Tensor& like) {
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "ffn: dropout_p must be in [0, 1), got ",
              dropout_p);
  if (dropout_p > 0.0) {
    TORCH_CHECK(ffn_present(rng), "ffn: rng ([seed, offset] int64) is required when dropout_p > 0");
    TORCH_CHECK(rng->scalar_type() == at::kLong && rng->dim() == 1 && rng->numel() == 2,
                "ffn: rng must be an int64 tensor of shape (2,), got ", rng->scalar_type(), " ",
                rng->sizes());
    TORCH_CHECK(rng->device() == like.device(), "ffn: rng must be on ", like.device(), ", got ",
                rng->device());
  }
}

void check_ffn_linear_fwd_args(const Tensor& x, const Tensor& w, const std::optional<Tensor>& b,
                               c10::DeviceType dev) {
  TORCH_CHECK(ffn_dtype_ok(x.scalar_type()), "ffn: x must be float32, float16 or bfloat16, got ",
              x.scalar_type());
  check_ffn_matrix(x, "x", x, dev);
  check_ffn_matrix(w, "w", x, dev);
  TORCH_CHECK(w.size(1) == x.size(1), "ffn: w must have shape (N, ", x.size(1), "), got ", w.sizes());
  if (ffn_present(b)) {
    TORCH_CHECK(b->dim() == 1 && b->size(0) == w.size(0), "ffn: b must have shape (", w.size(0),
                ",), got ", b->sizes());
    TORCH_CHECK(b->scalar_type() == x.scalar_type() && b->device() == x.device(),
                "ffn: b must be a ", x.scalar_type(), " tensor on ", x.device());
  }
}

void check_ffn_aux(const std::optional<Tensor>& aux, FfnAct act, int64_t m, int64_t n,
                   const Tensor& like, c10::DeviceType dev) {
  if (act == FfnAct::kNone) return;
  TORCH_CHECK(ffn_present(aux), "ffn: aux (pre-activation, or y for relu) is required for this activation");
  check_ffn_matrix(*aux, "aux", like, dev);
  TORCH_CHECK(aux->size(0) == m && aux->size(1) == n, "ffn: aux must have shape (", m, ", ", n,
              "), got ", aux->sizes());
}

// dy of any backward primitive (act_bwd checks only this).
void check_ffn_act_bwd_args(const Tensor& dy, c10::DeviceType dev) {
  TORCH_CHECK(ffn_dtype_ok(dy.scalar_type()), "ffn: dy must be float32, float16 or bfloat16, got ",
              dy.scalar_type());
  check_ffn_matrix(dy, "dy", dy, dev);
}

void check_ffn_dgrad_args(const Tensor& dy, const Tensor& w, c10::DeviceType dev) {
  check_ffn_act_bwd_args(dy, dev);
  check_ffn_matrix(w, "w", dy, dev);
  TORCH_CHECK(w.size(0) == dy.size(1), "ffn: w must have shape (", dy.size(1), ", N), got ", w.sizes());
}

void check_ffn_wgrad_args(const Tensor& dy, const Tensor& x, c10::DeviceType dev) {
  check_ffn_act_bwd_args(dy, dev);
  check_ffn_matrix(x, "x", dy, dev);
  TORCH_CHECK(x.size(0) == dy.size(0), "ffn: x must have ", dy.size(0), " rows, got ", x.sizes());
}

}  // namespace transformer_fast
