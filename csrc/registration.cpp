// The one place that declares the schemas of transformer_fast._C's operators, plus the Python
// module init so that `import transformer_fast._C` loads this library (running the static
// registrations of every csrc/ file).  Kernels register per device in their own files with
// TORCH_LIBRARY_IMPL(transformer_fast_C, <CPU|CUDA>, m).
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(transformer_fast_C, m) {
  m.def(
      "add_layer_norm_fwd(Tensor x, Tensor residual, Tensor? weight, Tensor? bias, float eps, "
      "float dropout_p, Tensor? rng, bool prenorm) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "add_layer_norm_bwd(Tensor dy, Tensor? dh, Tensor x, Tensor residual, Tensor? weight, "
      "Tensor? bias, Tensor mean, Tensor rstd, float dropout_p, Tensor? rng) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  // Flash attention (contract: transformer_fast/ops/attention.py; kernels: attention_{cpu,cuda}).
  m.def(
      "attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? key_padding_mask, "
      "bool is_causal, float scale, float dropout_p, Tensor? rng, bool allow_tf32) -> (Tensor, Tensor)");
  m.def(
      "attention_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor? attn_mask, Tensor? key_padding_mask, bool is_causal, float scale, float dropout_p, "
      "Tensor? rng, bool allow_tf32) -> (Tensor, Tensor, Tensor)");
  // Fused masked softmax (contract: kernels/masked_softmax.py; kernels: masked_softmax_{cpu,cuda}).
  m.def(
      "masked_softmax_fwd(Tensor scores, Tensor? mask, float scale, bool is_causal, float dropout_p, "
      "Tensor? rng) -> (Tensor, Tensor)");
  m.def("masked_softmax_bwd(Tensor dout, Tensor probs, float scale, float dropout_p, Tensor? rng) -> Tensor");
  // Attention over a KV cache (contract: kernels/decode.py; kernels: decode_{cpu,cuda}). Appends
  // k_new / v_new into the caches in place.
  m.def(
      "attention_with_kv_cache_fwd(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor cache_seqlens, Tensor? k_new, Tensor? v_new, float scale, bool allow_tf32) -> Tensor");
  // FFN primitives (contract: kernels/ffn.py; autograd: transformer_fast/ops/ffn.py).
  m.def(
      "ffn_linear_fwd(Tensor x, Tensor w, Tensor? b, str activation, float dropout_p, Tensor? rng, "
      "bool store_pre, bool allow_tf32) -> (Tensor, Tensor)");
  m.def(
      "ffn_linear_dgrad(Tensor dy, Tensor w, Tensor? aux, str activation, float dropout_p, "
      "Tensor? rng, bool want_dbias, bool allow_tf32) -> (Tensor, Tensor)");
  // One encoder / decoder layer's inference forward (csrc/layer_inference.cpp; called by
  // transformer_fast/modules/_native.py for replayed layer calls).
  m.def(
      "encoder_layer_infer(Tensor x, Tensor? normed, Tensor? key_padding_mask, Tensor?[] params, "
      "float[] eps, int[] backends, int num_heads, bool batch_first, bool norm_first, bool is_causal, "
      "bool next_norm, str activation, bool allow_tf32, Tensor? rows=None, Tensor? qkv_buffer=None) "
      "-> Tensor[]");
  m.def(
      "decoder_layer_infer(Tensor x, Tensor memory, Tensor? normed, Tensor? tgt_key_padding_mask, "
      "Tensor? memory_key_padding_mask, Tensor?[] params, float[] eps, int[] backends, int num_heads, "
      "bool batch_first, bool norm_first, bool tgt_is_causal, bool memory_is_causal, bool next_norm, "
      "str activation, bool allow_tf32) -> Tensor[]");
  // CPU only: the dropout stream's factors at any element index (csrc/ffn_cpu.cpp; for the tests).
  m.def("dropout_factors(Tensor rng, int first_index, int n, float dropout_p) -> Tensor");
  m.def("ffn_linear_wgrad(Tensor dy, Tensor x, bool want_dbias, bool allow_tf32) -> (Tensor, Tensor)");
  m.def(
      "ffn_act_bwd(Tensor dy, Tensor? aux, str activation, float dropout_p, Tensor? rng, "
      "bool want_dbias) -> (Tensor, Tensor)");
}

extern "C" {
// An empty module: the operators are reached through torch.ops.transformer_fast_C.*.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", "transformer_fast C++/CUDA operators (see torch.ops.transformer_fast_C)",
      -1, nullptr, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module_def);
}
}
