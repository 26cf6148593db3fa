#pragma once

// register_device_kernels (Note [Device kernels]) in a TORCH_LIBRARY_IMPL block, for the ops
// whose drivers still take at::Tensor, until they move to PyTorch's stable ABI.

#include <torch/library.h>

#include <string>

#include "device_kernels.h"

namespace deformconv {

template <typename Op, typename Device, auto forward, auto backward, auto launchers>
void register_device_kernels(torch::Library& m) {
  using device_kernels_detail::DeviceKernel;
  m.impl(Op::kName,
         TORCH_FN(
             (DeviceKernel<Op, false, Device, forward, launchers, typename Op::Signature>::call)));
  m.impl((std::string(Op::kName) + "_backward").c_str(),
         TORCH_FN((DeviceKernel<Op, true, Device, backward, launchers,
                                typename Op::BackwardSignature>::call)));
}

}  // namespace deformconv
