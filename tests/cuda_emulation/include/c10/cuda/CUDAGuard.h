#pragma once

// Emulation shim (tests/cuda_emulation): the guard only counts how deep launches sit in guards.

#include <c10/core/Device.h>

#include "../../../cuda_emulation.h"

namespace c10::cuda {

class CUDAGuard {
 public:
  explicit CUDAGuard(c10::Device /*device*/) { ++::cuda_emulation::device_guard_depth; }
  ~CUDAGuard() { --::cuda_emulation::device_guard_depth; }
  CUDAGuard(const CUDAGuard&) = delete;
  CUDAGuard& operator=(const CUDAGuard&) = delete;
};

}  // namespace c10::cuda
