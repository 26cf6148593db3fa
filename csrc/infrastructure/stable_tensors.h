#pragma once

// The tensors of the drivers and launchers: PyTorch's stable ABI's torch::stable::Tensor, and
// what the drivers ask of them beyond its members.

#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/DeviceType.h>

namespace deformconv {

using torch::stable::Tensor;

// `tensor` as the launchers read it, contiguous: itself when it is, without a call into torch.
inline Tensor as_contiguous(const Tensor& tensor) {
  return tensor.is_contiguous() ? tensor : torch::stable::contiguous(tensor);
}

// Whether `tensor` is on the meta device, where only shapes exist (the fake kernels' checks).
inline bool is_meta(const Tensor& tensor) {
  return tensor.device().type() == torch::headeronly::DeviceType::Meta;
}

}  // namespace deformconv
