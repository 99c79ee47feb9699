// One TransformerEncoderLayer's / TransformerDecoderLayer's inference forward as a single C++ op:
// the replayed call of a layer (transformer_fast/modules/_native.py decides when) without Python
// between its ops.
//
// A replayed layer call still spends ~130-210 us of host time in Python (benchmarks/NOTES.md,
// "A layer's host time"), about what the GPU needs for the paper's base layer at B 64, L 128.
// This runs the same sequence of ops as the Python path, on the same backends, so the result is
// the same bit for bit (tests/test_native_layer.py): for each op either PyTorch's own (the
// `torch` backend: the exact ATen calls transformer_fast/functional.py makes) or our fused
// kernel (the `cpu` / `cuda` backends: the transformer_fast_C op, which dispatches on the
// tensors' device).  Only what inference needs: no dropout, no autograd, bool key padding masks
// or the causal hint; everything else stays on the Python path.
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

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>
#include <vector>

#include "ops.h"

namespace transformer_fast {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// Backend codes of the `backends` argument (modules/_native.py's _CODES).
constexpr int64_t kTorch = 0;  // PyTorch's own ops
constexpr int64_t kFused = 1;  // our transformer_fast_C op (cpu or cuda kernel by device)

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

// ---- attention: MultiheadAttention._attend(query, kv, kv, need_weights=False), no dropout.

Tensor heads_view(const Tensor& t, bool batch_first) {  // (.., H, D) projection -> (N, H, L, D)
  return batch_first ? t.transpose(1, 2) : t.permute({1, 2, 0, 3});
}

struct AttentionParams {
  Tensor in_w;  // (3E, E) packed q, k, v projections
  OptTensor in_b;
  Tensor out_w;
  OptTensor out_b;
};

// Valid tokens only (a padded batch whose padded positions' outputs are not needed): the
// query is the (N, E) valid rows, `rows` their (N,) indices into the batch's B * L positions,
// `buffer` a (B, L, 3E) tensor holding zeros at the padded positions.
struct Packed {
  OptTensor rows;
  OptTensor buffer;
};

// Self-attention when kv is undefined (one GEMM; q, k, v views of its (.., 3, H, D) output), else
// encoder-decoder attention: q from query, k and v from one GEMM of kv (.., 2, H, D)
// (MultiheadAttention._in_projection's `key is value` branch).  Packed (self-attention, batch
// first): the projection of the valid rows goes into the buffer, whose padded keys stay zero
// (finite: masked keys still meet their values in P @ V), and the valid rows come back out.
Tensor attention(const Tensor& query, const Tensor& kv, const AttentionParams& p, int64_t heads,
                 bool batch_first, bool causal, const OptTensor& padding, int64_t backend,
                 bool allow_tf32, const Packed& packed = {}) {
  const int64_t e = query.size(-1), d = e / heads;
  const int bdim = batch_first ? 0 : 1, ldim = batch_first ? 1 : 0;
  const Tensor& shaped = packed.buffer ? *packed.buffer : query;  // (B, L, ..) / (L, B, ..)
  const int64_t bsz = shaped.size(bdim), lq = shaped.size(ldim);
  Tensor q, k, v;
  if (packed.rows) {
    packed.buffer->view({bsz * lq, 3 * e}).index_copy_(0, *packed.rows, at::linear(query, p.in_w, p.in_b));
    std::vector<Tensor> qkv = packed.buffer->unflatten(-1, {3, heads, d}).unbind(-3);
    q = qkv[0], k = qkv[1], v = qkv[2];
  } else if (!kv.defined()) {
    std::vector<Tensor> qkv = at::linear(query, p.in_w, p.in_b).unflatten(-1, {3, heads, d}).unbind(-3);
    q = qkv[0], k = qkv[1], v = qkv[2];
  } else {
    const OptTensor bq = p.in_b ? OptTensor(p.in_b->narrow(0, 0, e)) : std::nullopt;
    const OptTensor bkv = p.in_b ? OptTensor(p.in_b->slice(0, e)) : std::nullopt;
    q = at::linear(query, p.in_w.narrow(0, 0, e), bq).unflatten(-1, {heads, d});
    std::vector<Tensor> kv2 = at::linear(kv, p.in_w.slice(0, e), bkv).unflatten(-1, {2, heads, d}).unbind(-3);
    k = kv2[0], v = kv2[1];
  }
  q = heads_view(q, batch_first), k = heads_view(k, batch_first), v = heads_view(v, batch_first);
  const int64_t lk = k.size(2);  // (N, H, L|S, D)
  Tensor out;
  if (backend == kTorch) {  // functional._torch_sdpa
    if (!padding.has_value()) {
      out = at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, causal);
    } else {
      // masks.combine -> one bool "allowed" mask (B, 1, 1|L, S); dead rows opened, then zeroed.
      Tensor allowed = padding->reshape({bsz, 1, 1, lk}).bitwise_not();
      if (causal) {
        const Tensor rows = at::arange(lq, query.options().dtype(at::kLong)).unsqueeze(-1);
        const Tensor cols = at::arange(lk, query.options().dtype(at::kLong));
        allowed = allowed.bitwise_and(cols.le(rows));
      }
      const Tensor dead = allowed.any(-1, /*keepdim=*/true).bitwise_not();
      // On the CPU, where reading it costs no device sync, a mask without dead rows skips the
      // fix-up (the same values: nothing to open, nothing to zero; ~15-20 us of ~550 for an
      // encoder layer of d_model 128 at B 4, L 32).
      if (dead.is_cpu() && !dead.any().item<bool>()) {
        out = at::scaled_dot_product_attention(q, k, v, allowed, 0.0, false);
      } else {
        out = at::scaled_dot_product_attention(q, k, v, allowed.bitwise_or(dead), 0.0, false);
        out = out.masked_fill(dead, 0.0);
      }
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
  Tensor merged = batch_first ? out.transpose(1, 2).reshape({bsz, lq, e})
                              : out.permute({2, 0, 1, 3}).reshape({lq, bsz, e});
  if (packed.rows) merged = merged.reshape({bsz * lq, e}).index_select(0, *packed.rows);
  return at::linear(merged, p.out_w, p.out_b);
}

// ---- feed-forward: functional.run_feed_forward(name, x, ...), dropout 0.

struct FfnParams {
  Tensor w1;
  OptTensor b1;
  Tensor w2;
  OptTensor b2;
};

Tensor feed_forward(const Tensor& x, const FfnParams& p, c10::string_view activation, int64_t backend,
                    bool allow_tf32) {
  if (backend == kTorch) {  // functional._torch_feed_forward
    Tensor hidden = at::linear(x, p.w1, p.b1);
    if (activation == "relu") {
      hidden = at::relu(hidden);
    } else if (activation == "gelu") {
      hidden = at::gelu(hidden);
    } else if (activation == "gelu_tanh") {
      hidden = at::gelu(hidden, "tanh");
    }
    return at::linear(hidden, p.w2, p.b2);
  }
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("transformer_fast_C::ffn_linear_fwd", "")
                       .typed<Tensor2(const Tensor&, const Tensor&, const OptTensor&, c10::string_view,
                                      double, const OptTensor&, bool, bool)>();
  const int64_t k = x.size(-1);
  const int64_t rows = x.numel() / k, d_ff = p.w1.size(0), d_out = p.w2.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = d_out;
  // ops/ffn.py's _fp32_forward on the cpu backend: a small 16-bit problem with small weights runs
  // on fp32 copies and rounds out once (the hidden layer is not rounded to 16 bits).
  const bool half = x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16;
  if (half && x.device().is_cpu() && p.w1.numel() + p.w2.numel() <= (int64_t{1} << 16) &&
      rows * d_ff * std::max(k, d_out) <= (int64_t{1} << 22)) {
    const auto f32 = [](const OptTensor& t) -> OptTensor {
      return t.has_value() ? OptTensor(t->to(at::kFloat)) : std::nullopt;
    };
    const FfnParams wide{p.w1.to(at::kFloat), f32(p.b1), p.w2.to(at::kFloat), f32(p.b2)};
    return feed_forward(x.to(at::kFloat), wide, activation, backend, false).to(x.scalar_type());
  }
  const bool store_pre = activation == "gelu" || activation == "gelu_tanh";  // as ops/ffn.py
  const Tensor hidden = std::get<0>(op.call(x.reshape({rows, k}), p.w1, p.b1, activation, 0.0,
                                            std::nullopt, store_pre, allow_tf32));
  const Tensor out = std::get<0>(op.call(hidden, p.w2, p.b2, "none", 0.0, std::nullopt, false, allow_tf32));
  return out.view(shape);
}

// ---- the layers.  `params` lists the layer's tensors in modules/_native.py's order: each
// attention's (in_proj_weight, in_proj_bias, out_proj.weight, out_proj.bias), the FFN's
// (linear1.weight, linear1.bias, linear2.weight, linear2.bias), each norm's (weight, bias),
// last the next norm's (a pre-LN stack's chain: the next layer's norm1, or the final norm).
// `backends` has one code per recorded op, in the order the Python path runs them.

struct Params {
  const c10::List<OptTensor>& list;
  size_t at = 0;
  OptTensor optional() { return list.get(at++); }
  Tensor tensor() { return *list.get(at++); }
  AttentionParams attention() {
    AttentionParams p;
    p.in_w = tensor(), p.in_b = optional(), p.out_w = tensor(), p.out_b = optional();
    return p;
  }
  FfnParams ffn() {
    FfnParams p;
    p.w1 = tensor(), p.b1 = optional(), p.w2 = tensor(), p.b2 = optional();
    return p;
  }
  std::pair<OptTensor, OptTensor> norm() {
    OptTensor w = optional();
    return {w, optional()};
  }
};

void check_layer_args(const char* op, const Tensor& x, const c10::List<OptTensor>& params,
                      size_t num_params, at::ArrayRef<double> eps, size_t num_eps,
                      at::IntArrayRef backends, size_t num_backends, int64_t x_dim = 3) {
  TORCH_CHECK(params.size() == num_params, op, ": params must hold ", num_params, " entries; got ",
              params.size());
  TORCH_CHECK(eps.size() == num_eps && backends.size() == num_backends, op, ": eps must hold ", num_eps,
              " values and backends ", num_backends);
  TORCH_CHECK(x.dim() == x_dim, op, ": x must be ", x_dim, "-D; got ", x.dim(), "-D");
  for (const int64_t code : backends) {
    TORCH_CHECK(code == kTorch || code == kFused, op, ": unknown backend code ", code);
  }
}

// The last residual add of a pre-LN layer (modules' _residual_out): x + f, or with next_norm
// fused into it, [x + f, next_norm(x + f)].
std::vector<Tensor> residual_out(int64_t backend, const Tensor& f, const Tensor& x, bool next_norm,
                                 const std::pair<OptTensor, OptTensor>& next, double eps) {
  if (!next_norm) return {x.add(f)};
  auto [normed_out, out] = add_norm(backend, f, x, next.first, next.second, eps, true);
  return {out, normed_out};
}

Tensor first_norm(const Tensor& x, const OptTensor& normed, const std::pair<OptTensor, OptTensor>& norm,
                  double eps) {  // a pre-LN layer's norm1 (modules' _layer_norm), unless chained
  return normed.has_value() ? *normed
                            : at::layer_norm(x, {x.size(-1)}, norm.first, norm.second, eps, cudnn_enabled());
}

// TransformerEncoderLayer._fused(x, mask, padding, is_causal, normed, next_norm).
// backends: (attention, add+norm, feed-forward, add+norm), the last absent for a pre-LN layer
// without next_norm.  Returns [out] or, with next_norm, [out, next_norm(out)].  With `rows` and
// `qkv_buffer` (a post-LN, batch-first layer): x is the (N, E) valid rows (see Packed).
std::vector<Tensor> encoder_layer_infer(const Tensor& x, const OptTensor& normed,
                                        const OptTensor& key_padding_mask,
                                        const c10::List<OptTensor>& params, at::ArrayRef<double> eps,
                                        at::IntArrayRef backends, int64_t num_heads, bool batch_first,
                                        bool norm_first, bool is_causal, bool next_norm,
                                        c10::string_view activation, bool allow_tf32,
                                        const OptTensor& rows, const OptTensor& qkv_buffer) {
  const Packed packed{rows, qkv_buffer};
  TORCH_CHECK(rows.has_value() == qkv_buffer.has_value(),
              "encoder_layer_infer: rows and qkv_buffer go together");
  TORCH_CHECK(!rows || (batch_first && !norm_first && qkv_buffer->dim() == 3),
              "encoder_layer_infer: packed rows need a post-LN, batch-first layer and a 3-D qkv_buffer");
  check_layer_args("encoder_layer_infer", x, params, 14, eps, 3, backends, 4, rows ? 2 : 3);
  Params p{params};
  const AttentionParams sa = p.attention();
  const FfnParams ffn = p.ffn();
  const auto norm1 = p.norm(), norm2 = p.norm(), next = p.norm();
  const Tensor none;
  if (norm_first) {
    const Tensor h = first_norm(x, normed, norm1, eps[0]);
    const Tensor a = attention(h, none, sa, num_heads, batch_first, is_causal, key_padding_mask,
                               backends[0], allow_tf32);
    auto [h2, x2] = add_norm(backends[1], a, x, norm2.first, norm2.second, eps[1], true);
    const Tensor f = feed_forward(h2, ffn, activation, backends[2], allow_tf32);
    return residual_out(backends[3], f, x2, next_norm, next, eps[2]);
  }
  const Tensor a = attention(x, none, sa, num_heads, batch_first, is_causal, key_padding_mask, backends[0],
                             allow_tf32, packed);
  const Tensor x1 = std::get<0>(add_norm(backends[1], a, x, norm1.first, norm1.second, eps[0], false));
  const Tensor f = feed_forward(x1, ffn, activation, backends[2], allow_tf32);
  return {std::get<0>(add_norm(backends[3], f, x1, norm2.first, norm2.second, eps[1], false))};
}

// TransformerDecoderLayer._fused(x, memory, tgt_mask, memory_mask, tgt_padding, memory_padding,
// tgt_is_causal, memory_is_causal, normed, next_norm).  backends: (self-attention, add+norm,
// cross-attention, add+norm, feed-forward, add+norm), the last absent for a pre-LN layer without
// next_norm.  Returns [out] or, with next_norm, [out, next_norm(out)].
std::vector<Tensor> decoder_layer_infer(const Tensor& x, const Tensor& memory, const OptTensor& normed,
                                        const OptTensor& tgt_key_padding_mask,
                                        const OptTensor& memory_key_padding_mask,
                                        const c10::List<OptTensor>& params, at::ArrayRef<double> eps,
                                        at::IntArrayRef backends, int64_t num_heads, bool batch_first,
                                        bool norm_first, bool tgt_is_causal, bool memory_is_causal,
                                        bool next_norm, c10::string_view activation, bool allow_tf32) {
  check_layer_args("decoder_layer_infer", x, params, 20, eps, 4, backends, 6);
  TORCH_CHECK(memory.dim() == 3, "decoder_layer_infer: memory must be 3-D; got ", memory.dim(), "-D");
  Params p{params};
  const AttentionParams sa = p.attention(), ca = p.attention();
  const FfnParams ffn = p.ffn();
  const auto norm1 = p.norm(), norm2 = p.norm(), norm3 = p.norm(), next = p.norm();
  const Tensor none;
  if (norm_first) {
    const Tensor h = first_norm(x, normed, norm1, eps[0]);
    const Tensor a = attention(h, none, sa, num_heads, batch_first, tgt_is_causal, tgt_key_padding_mask,
                               backends[0], allow_tf32);
    auto [h2, x2] = add_norm(backends[1], a, x, norm2.first, norm2.second, eps[1], true);
    const Tensor c = attention(h2, memory, ca, num_heads, batch_first, memory_is_causal,
                               memory_key_padding_mask, backends[2], allow_tf32);
    auto [h3, x3] = add_norm(backends[3], c, x2, norm3.first, norm3.second, eps[2], true);
    const Tensor f = feed_forward(h3, ffn, activation, backends[4], allow_tf32);
    return residual_out(backends[5], f, x3, next_norm, next, eps[3]);
  }
  const Tensor a = attention(x, none, sa, num_heads, batch_first, tgt_is_causal, tgt_key_padding_mask,
                             backends[0], allow_tf32);
  const Tensor x1 = std::get<0>(add_norm(backends[1], a, x, norm1.first, norm1.second, eps[0], false));
  const Tensor c = attention(x1, memory, ca, num_heads, batch_first, memory_is_causal,
                             memory_key_padding_mask, backends[2], allow_tf32);
  const Tensor x2 = std::get<0>(add_norm(backends[3], c, x1, norm2.first, norm2.second, eps[1], false));
  const Tensor f = feed_forward(x2, ffn, activation, backends[4], allow_tf32);
  return {std::get<0>(add_norm(backends[5], f, x2, norm3.first, norm3.second, eps[2], false))};
}

}  // namespace

// One function for every device: the ops they call dispatch on the tensors' device themselves.
TORCH_LIBRARY_IMPL(transformer_fast_C, CompositeExplicitAutograd, m) {
  m.impl("encoder_layer_infer", TORCH_FN(encoder_layer_infer));
  m.impl("decoder_layer_infer", TORCH_FN(decoder_layer_infer));
}

}  // namespace transformer_fast
