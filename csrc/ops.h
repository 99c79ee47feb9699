// Prototypes shared between the csrc/ translation units (kept light: ATen/core/Tensor.h only).
//
// Op contract (schemas live in registration.cpp; semantics in transformer_fast/ops/layer_norm.py):
//   add_layer_norm_fwd(x, residual, weight?, bias?, eps, dropout_p, rng?, prenorm)
//       -> (y, h or empty (0,), mean fp32 (M,), rstd fp32 (M,))
//   add_layer_norm_bwd(dy, dh?, x, residual, weight?, bias?, mean, rstd, dropout_p, rng?)
//       -> (dx or empty (0,), dresidual, dweight or empty (0,), dbias or empty (0,))
//   ffn_linear_fwd / ffn_linear_dgrad / ffn_linear_wgrad / ffn_act_bwd: the FFN primitives,
//       contract in kernels/ffn.py (each returns (result, dbias-or-pre or empty (0,))).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>

#include <tuple>

namespace transformer_fast {

using Tensor4 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using Tensor2 = std::tuple<at::Tensor, at::Tensor>;

// ---- attention (attention_cpu.cpp holds the checks shared with attention_cuda.cu; contract in
//      transformer_fast/ops/attention.py)
using Tensor3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
void check_attention_fwd_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const std::optional<at::Tensor>& attn_mask,
                              const std::optional<at::Tensor>& key_padding_mask, double scale,
                              double dropout_p, const std::optional<at::Tensor>& rng,
                              c10::DeviceType dev);
void check_attention_bwd_args(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                              const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                              const std::optional<at::Tensor>& attn_mask,
                              const std::optional<at::Tensor>& key_padding_mask, double scale,
                              double dropout_p, const std::optional<at::Tensor>& rng,
                              c10::DeviceType dev);
#define TF_ATTENTION_FWD_ARGS                                                               \
  const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,                            \
      const std::optional<at::Tensor>&attn_mask,                                            \
      const std::optional<at::Tensor>&key_padding_mask, bool is_causal, double scale,       \
      double dropout_p, const std::optional<at::Tensor>&rng, bool allow_tf32
#define TF_ATTENTION_BWD_ARGS                                                               \
  const at::Tensor &dout, const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,    \
      const at::Tensor &out, const at::Tensor &lse, const std::optional<at::Tensor>&attn_mask, \
      const std::optional<at::Tensor>&key_padding_mask, bool is_causal, double scale,       \
      double dropout_p, const std::optional<at::Tensor>&rng, bool allow_tf32
Tensor2 attention_fwd_cpu(TF_ATTENTION_FWD_ARGS);
Tensor3 attention_bwd_cpu(TF_ATTENTION_BWD_ARGS);
#ifdef TF_WITH_CUDA
Tensor2 attention_fwd_cuda(TF_ATTENTION_FWD_ARGS);
Tensor3 attention_bwd_cuda(TF_ATTENTION_BWD_ARGS);
#endif

// ---- masked softmax (masked_softmax_cpu.cpp holds the checks shared with masked_softmax_cuda.cu;
//      contract in kernels/masked_softmax.py)
#define TF_MASKED_SOFTMAX_FWD_ARGS                                                          \
  const at::Tensor &scores, const std::optional<at::Tensor>&mask, double scale, bool is_causal, \
      double dropout_p, const std::optional<at::Tensor>&rng
#define TF_MASKED_SOFTMAX_BWD_ARGS \
  const at::Tensor &dout, const at::Tensor &probs, double scale, double dropout_p,           \
      const std::optional<at::Tensor>&rng
Tensor2 masked_softmax_fwd_cpu(TF_MASKED_SOFTMAX_FWD_ARGS);
at::Tensor masked_softmax_bwd_cpu(TF_MASKED_SOFTMAX_BWD_ARGS);
#ifdef TF_WITH_CUDA
Tensor2 masked_softmax_fwd_cuda(TF_MASKED_SOFTMAX_FWD_ARGS);
at::Tensor masked_softmax_bwd_cuda(TF_MASKED_SOFTMAX_BWD_ARGS);
#endif

// ---- attention over a KV cache (decode_cpu.cpp holds the checks shared with decode_cuda.cu;
//      contract in kernels/decode.py)
#define TF_KV_CACHE_ARGS                                                                     \
  const at::Tensor &q, at::Tensor &k_cache, at::Tensor &v_cache, const at::Tensor &cache_seqlens, \
      const std::optional<at::Tensor>&k_new, const std::optional<at::Tensor>&v_new, double scale, \
      bool allow_tf32
at::Tensor attention_with_kv_cache_fwd_cpu(TF_KV_CACHE_ARGS);
#ifdef TF_WITH_CUDA
at::Tensor attention_with_kv_cache_fwd_cuda(TF_KV_CACHE_ARGS);
#endif

// ---- FFN (argument checks shared by both devices: ffn_checks.cpp)
enum class FfnAct { kNone = 0, kRelu = 1, kGelu = 2, kGeluTanh = 3 };
FfnAct parse_ffn_activation(c10::string_view activation);
void check_ffn_dropout(double dropout_p, const std::optional<at::Tensor>& rng, const at::Tensor& like);
void check_ffn_linear_fwd_args(const at::Tensor& x, const at::Tensor& w,
                               const std::optional<at::Tensor>& b, c10::DeviceType device_type);
void check_ffn_aux(const std::optional<at::Tensor>& aux, FfnAct act, int64_t m, int64_t n,
                   const at::Tensor& like, c10::DeviceType device_type);
void check_ffn_dgrad_args(const at::Tensor& dy, const at::Tensor& w, c10::DeviceType device_type);
void check_ffn_wgrad_args(const at::Tensor& dy, const at::Tensor& x, c10::DeviceType device_type);
void check_ffn_act_bwd_args(const at::Tensor& dy, c10::DeviceType device_type);

Tensor2 ffn_linear_fwd_cpu(const at::Tensor& x, const at::Tensor& w,
                           const std::optional<at::Tensor>& b, c10::string_view activation,
                           double dropout_p, const std::optional<at::Tensor>& rng, bool store_pre,
                           bool allow_tf32);
Tensor2 ffn_linear_dgrad_cpu(const at::Tensor& dy, const at::Tensor& w,
                             const std::optional<at::Tensor>& aux, c10::string_view activation,
                             double dropout_p, const std::optional<at::Tensor>& rng,
                             bool want_dbias, bool allow_tf32);
Tensor2 ffn_linear_wgrad_cpu(const at::Tensor& dy, const at::Tensor& x, bool want_dbias,
                             bool allow_tf32);
Tensor2 ffn_act_bwd_cpu(const at::Tensor& dy, const std::optional<at::Tensor>& aux,
                        c10::string_view activation, double dropout_p,
                        const std::optional<at::Tensor>& rng, bool want_dbias);

// Shared argument validation (add_layer_norm_checks.cpp); `device_type` is the backend's device.
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

Tensor2 ffn_linear_fwd_cuda(const at::Tensor& x, const at::Tensor& w,
                            const std::optional<at::Tensor>& b, c10::string_view activation,
                            double dropout_p, const std::optional<at::Tensor>& rng, bool store_pre,
                            bool allow_tf32);
Tensor2 ffn_linear_dgrad_cuda(const at::Tensor& dy, const at::Tensor& w,
                              const std::optional<at::Tensor>& aux, c10::string_view activation,
                              double dropout_p, const std::optional<at::Tensor>& rng,
                              bool want_dbias, bool allow_tf32);
Tensor2 ffn_linear_wgrad_cuda(const at::Tensor& dy, const at::Tensor& x, bool want_dbias,
                              bool allow_tf32);
Tensor2 ffn_act_bwd_cuda(const at::Tensor& dy, const std::optional<at::Tensor>& aux,
                         c10::string_view activation, double dropout_p,
                         const std::optional<at::Tensor>& rng, bool want_dbias);
#endif

}  // namespace transformer_fast
