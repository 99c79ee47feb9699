// Closes the AVX2 code region opened by csrc/cpu_avx2_begin.h (include it after the kernels, at
// file scope) and gives the run-time check the op entry points make before calling them.
#pragma once

#ifdef TF_CPU_AVX2_PRAGMA
#pragma GCC pop_options
#endif

#include <c10/util/Exception.h>

namespace transformer_fast {
namespace {

inline void check_cpu_avx2() {
#ifdef TF_CPU_AVX2_PRAGMA
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  TORCH_CHECK(ok, "transformer_fast cpu backend: this CPU lacks AVX2/FMA/F16C, which the "
              "compiled CPU kernels need");
#endif
}

}  // namespace
}  // namespace transformer_fast
