#pragma once

// The CUDA device of Note [Device kernels] (infrastructure/device_kernels.h): the ops' kernels
// hold the CUDA guard of their tensors' device. The test suite's emulation build (tests/cuda_emulation) registers with it
// too, over its own CUDAGuard, which counts the launches made outside one.

#include <c10/cuda/CUDAGuard.h>

namespace deformconv {

struct CudaDevice {
  using Guard = c10::cuda::CUDAGuard;
};

}  // namespace deformconv
