#pragma once

// Emulation shim (tests/cuda_emulation): the launch check raises the pending error of the last
// launch, as the real one raises what cudaGetLastError returns.

#include <c10/util/Exception.h>

#include "../../../cuda_emulation.h"

#define C10_CUDA_KERNEL_LAUNCH_CHECK()                                               \
  do {                                                                               \
    const std::string launch_error = ::cuda_emulation::take_launch_error();          \
    TORCH_CHECK(launch_error.empty(), "CUDA error (emulated): ", launch_error);      \
  } while (false)
