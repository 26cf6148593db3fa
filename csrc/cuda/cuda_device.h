#pragma once

// The CUDA device of Note [Device kernels] (infrastructure/device_kernels.h): the ops' kernels
// hold a guard of their tensors' device, the stable ABI's (whose accelerator is CUDA where the
// kernels run). The test suite's emulation build (tests/cuda_emulation) registers with it too,
// over the emulator's guard, which counts the launches made outside one.

#if defined(DEFORMCONV_CUDA_EMULATION)
// cuda_emulation::DeviceGuard comes with the emulator, which that build includes first.
#else
#include <torch/csrc/stable/accelerator.h>
#endif

namespace deformconv {

struct CudaDevice {
#if defined(DEFORMCONV_CUDA_EMULATION)
  using Guard = ::cuda_emulation::DeviceGuard;
#else
  using Guard = torch::stable::accelerator::DeviceGuard;
#endif
};

}  // namespace deformconv
