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
