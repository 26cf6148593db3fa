#pragma once

// Emulation shim (tests/cuda_emulation): streams are ids, the current one set by the test.

#include <c10/core/Device.h>

#include "../../../cuda_emulation.h"

namespace c10::cuda {

using CUDAStream = ::cuda_emulation::Stream;

inline CUDAStream getCurrentCUDAStream(c10::DeviceIndex = -1) {
  return CUDAStream(::cuda_emulation::settings().current_stream);
}

}  // namespace c10::cuda
