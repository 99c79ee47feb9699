// Host-side helpers shared by the .cu files: the inputs' device made current with its stream, and
// a kernel launch checked for errors.  Under TF_CUDA_EMULATE (tests/cuda_emulation.py) a test
// harness supplies its own DeviceScope and launch (CTAs of std::threads on the CPU).
#pragma once

#ifndef TF_CUDA_EMULATE
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

namespace transformer_fast {

struct DeviceScope {
  c10::cuda::CUDAGuard guard;
  int device;
  cudaStream_t stream;
  explicit DeviceScope(const at::Tensor& t)
      : guard(t.device()), device(t.get_device()), stream(c10::cuda::getCurrentCUDAStream(device).stream()) {}
};

template <typename Kernel, typename... Args>
void launch(Kernel kernel, dim3 grid, dim3 block, cudaStream_t stream, Args... args) {
  kernel<<<grid, block, 0, stream>>>(args...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace transformer_fast
#endif  // TF_CUDA_EMULATE
