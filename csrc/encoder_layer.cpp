// One TransformerEncoderLayer's inference forward as a single C++ op: the replayed call of a
// layer (transformer_fast/modules/_native.py decides when) without Python between its ops.
//
// A replayed layer call still spends ~130-210 us of host time in Python (benchmarks/NOTES.md,
// "A layer's host time"), about what the GPU needs for the paper's base layer at B 64, L 128.
// This runs the same sequence of ops as the Python path, on the same backends, so the result is
// the same bit for bit (tests/test_native_layer.py): for each op either PyTorch's own (the
// `torch` backend: the exact ATen calls transformer_fast/functional.py makes) or our fused
// kernel (the `cpu` / `cuda` backends: the transformer_fast_C op, which dispatches on the
// tensors' device).  Only what inference needs: no dropout, no autograd, a bool key padding
// mask or the causal hint; everything else stays on the Python path.
#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/List.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <vector>

#include "ops.h"

namespace transformer_fast {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// Backend codes of the `backends` argument (modules/_native.py's _CODES).
constexpr int64_t kTorch = 0;  // PyTorch's own ops
constexpr int64_t kFused = 1;  // our transformer_fast_C op (cpu or cuda kernel by device)

// Indices into the `params` list (modules/_native.py's _params builds it in this order).
enum Param {
  kInW, kInB, kOutW, kOutB, kW1, kB1, kW2, kB2, kNorm1W, kNorm1B, kNorm2W, kNorm2B, kNextW, kNextB,
  kNumParams
};

bool cudnn_enabled() { return at::globalContext().userEnabledCuDNN(); }

// ---- add + LayerNorm: functional.run_add_layer_norm(name, sub, residual, ...), dropout 0.
// Returns (norm(residual + sub), residual + sub when prenorm).

// ops/layer_norm.py's _rows: (..., N) -> (M, N) with unit stride along N.
Tensor norm_rows(const Tensor& t, int64_t n) {
  Tensor t2 = t.reshape({-1, n});
  if (t2.stride(1) == 1 || n == 1) return t2;
  return t2.numel() ? t2.contiguous() : at::empty(t2.sizes(), t2.options());
}

Tensor2 add_norm(int64_t backend, const Tensor& sub, const Tensor& residual, const OptTensor& w,
                 const OptTensor& b, double eps, bool prenorm) {
  if (backend == kTorch) {  // functional._torch_add_layer_norm (parameters in x's dtype)
    Tensor summed = residual.add(sub);
    Tensor out = at::layer_norm(summed, {sub.size(-1)}, w, b, eps, cudnn_enabled());
    return {out, prenorm ? summed : Tensor()};
  }
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("transformer_fast_C::add_layer_norm_fwd", "")
                       .typed<Tensor4(const Tensor&, const Tensor&, const OptTensor&, const OptTensor&,
                                      double, double, const OptTensor&, bool)>();
  const int64_t n = sub.size(-1);
  auto out = op.call(norm_rows(sub, n), norm_rows(residual, n), w, b, eps, 0.0, std::nullopt, prenorm);
  // The (M, N) results in sub's shape as tensors of their own, not views (as ops.own_reshaped):
  // a layer's output may be changed in place.
  Tensor y = std::get<0>(out).resize_(sub.sizes());
  return {y, prenorm ? std::get<1>(out).resize_(sub.sizes()) : Tensor()};
}

// ---- self-attention: MultiheadAttention._attend(x, x, x, need_weights=False), no dropout.

Tensor heads_view(const Tensor& t, bool batch_first) {  // (.., H, D) projection -> (N, H, L, D)
  return batch_first ? t.transpose(1, 2) : t.permute({1, 2, 0, 3});
}

Tensor self_attention(const Tensor& x, const c10::List<OptTensor>& p, int64_t heads, bool batch_first,
                      bool causal, const OptTensor& padding, int64_t backend, bool allow_tf32) {
  const int64_t e = x.size(2), d = e / heads;
  const int64_t bsz = x.size(batch_first ? 0 : 1), len = x.size(batch_first ? 1 : 0);
  // One GEMM; q, k, v are views of its output (.., 3, H, D).
  std::vector<Tensor> qkv = at::linear(x, *p.get(kInW), p.get(kInB)).unflatten(-1, {3, heads, d}).unbind(-3);
  const Tensor q = heads_view(qkv[0], batch_first), k = heads_view(qkv[1], batch_first),
               v = heads_view(qkv[2], batch_first);  // (N, H, L, D)
  Tensor out;
  if (backend == kTorch) {  // functional._torch_sdpa
    if (!padding.has_value()) {
      out = at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, causal);
    } else {
      // masks.combine -> one bool "allowed" mask (B, 1, L|1, S); dead rows opened, then zeroed.
      Tensor allowed = padding->reshape({bsz, 1, 1, len}).bitwise_not();
      if (causal) {
        const Tensor rows = at::arange(len, x.options().dtype(at::kLong)).unsqueeze(-1);
        const Tensor cols = at::arange(len, x.options().dtype(at::kLong));
        allowed = allowed.bitwise_and(cols.le(rows));
      }
      const Tensor dead = allowed.any(-1, /*keepdim=*/true).bitwise_not();
      out = at::scaled_dot_product_attention(q, k, v, allowed.bitwise_or(dead), 0.0, false);
      out = out.masked_fill(dead, 0.0);
    }
  } else {  // functional._fused_sdpa: the kernel takes the (B, S) padding mask itself
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("transformer_fast_C::attention_fwd", "")
                         .typed<Tensor2(const Tensor&, const Tensor&, const Tensor&, const OptTensor&,
                                        const OptTensor&, bool, double, double, const OptTensor&, bool)>();
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    out = std::get<0>(op.call(q, k, v, std::nullopt, padding, causal, scale, 0.0, std::nullopt, allow_tf32));
  }
  // Heads merged back into the input layout, then the out-projection.
  const Tensor merged = batch_first ? out.transpose(1, 2).reshape({bsz, len, e})
                                    : out.permute({2, 0, 1, 3}).reshape({len, bsz, e});
  return at::linear(merged, *p.get(kOutW), p.get(kOutB));
}

// ---- feed-forward: functional.run_feed_forward(name, x, ...), dropout 0.

Tensor feed_forward(const Tensor& x, const c10::List<OptTensor>& p, c10::string_view activation,
                    int64_t backend, bool allow_tf32) {
  const Tensor w1 = *p.get(kW1), w2 = *p.get(kW2);
  if (backend == kTorch) {  // functional._torch_feed_forward
    Tensor hidden = at::linear(x, w1, p.get(kB1));
    if (activation == "relu") {
      hidden = at::relu(hidden);
    } else if (activation == "gelu") {
      hidden = at::gelu(hidden);
    } else if (activation == "gelu_tanh") {
      hidden = at::gelu(hidden, "tanh");
    }
    return at::linear(hidden, w2, p.get(kB2));
  }
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("transformer_fast_C::ffn_linear_fwd", "")
                       .typed<Tensor2(const Tensor&, const Tensor&, const OptTensor&, c10::string_view,
                                      double, const OptTensor&, bool, bool)>();
  const int64_t k = x.size(-1);
  const bool store_pre = activation == "gelu" || activation == "gelu_tanh";  // as ops/ffn.py
  const Tensor hidden =
      std::get<0>(op.call(x.reshape({x.numel() / k, k}), w1, p.get(kB1), activation, 0.0, std::nullopt,
                          store_pre, allow_tf32));
  const Tensor out = std::get<0>(op.call(hidden, w2, p.get(kB2), "none", 0.0, std::nullopt, false, allow_tf32));
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = w2.size(0);
  return out.view(shape);
}

// ---- the layer: TransformerEncoderLayer._fused(x, mask, padding, is_causal, normed, next_norm).
// backends: (attention, first add+norm, feed-forward, second add+norm), kTorch or kFused.
// Returns [out] or, with next_norm, [out, next_norm(out)] (a pre-LN stack's chain).
std::vector<Tensor> encoder_layer_infer(const Tensor& x, const OptTensor& normed,
                                        const OptTensor& key_padding_mask,
                                        const c10::List<OptTensor>& params, at::ArrayRef<double> eps,
                                        at::IntArrayRef backends, int64_t num_heads, bool batch_first,
                                        bool norm_first, bool is_causal, bool next_norm,
                                        c10::string_view activation, bool allow_tf32) {
  TORCH_CHECK(params.size() == kNumParams, "encoder_layer_infer: params must hold ", kNumParams,
              " entries; got ", params.size());
  TORCH_CHECK(eps.size() == 3 && backends.size() == 4,
              "encoder_layer_infer: eps must hold 3 values and backends 4");
  TORCH_CHECK(x.dim() == 3, "encoder_layer_infer: x must be 3-D; got ", x.dim(), "-D");
  for (const int64_t code : backends) {
    TORCH_CHECK(code == kTorch || code == kFused, "encoder_layer_infer: unknown backend code ", code);
  }
  const auto& p = params;
  if (norm_first) {
    const Tensor h = normed.has_value()
                         ? *normed
                         : at::layer_norm(x, {x.size(-1)}, p.get(kNorm1W), p.get(kNorm1B), eps[0],
                                          cudnn_enabled());
    const Tensor a = self_attention(h, p, num_heads, batch_first, is_causal, key_padding_mask,
                                    backends[0], allow_tf32);
    auto [h2, x2] = add_norm(backends[1], a, x, p.get(kNorm2W), p.get(kNorm2B), eps[1], true);
    const Tensor f = feed_forward(h2, p, activation, backends[2], allow_tf32);
    if (!next_norm) return {x2.add(f)};  // _residual_out: x + f
    auto [normed_out, out] = add_norm(backends[3], f, x2, p.get(kNextW), p.get(kNextB), eps[2], true);
    return {out, normed_out};
  }
  const Tensor a = self_attention(x, p, num_heads, batch_first, is_causal, key_padding_mask, backends[0],
                                  allow_tf32);
  const Tensor x1 = std::get<0>(add_norm(backends[1], a, x, p.get(kNorm1W), p.get(kNorm1B), eps[0], false));
  const Tensor f = feed_forward(x1, p, activation, backends[2], allow_tf32);
  return {std::get<0>(add_norm(backends[3], f, x1, p.get(kNorm2W), p.get(kNorm2B), eps[1], false))};
}

}  // namespace

// One function for every device: the ops it calls dispatch on the tensors' device themselves.
TORCH_LIBRARY_IMPL(transformer_fast_C, CompositeExplicitAutograd, m) {
  m.impl("encoder_layer_infer", TORCH_FN(encoder_layer_infer));
}

}  // namespace transformer_fast
