#pragma once

// The tensors of the drivers and launchers: PyTorch's stable ABI's torch::stable::Tensor, and
// what the drivers ask of them beyond its members.

#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/DeviceType.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/HeaderOnlyArrayRef.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace deformconv {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;
using Sizes = torch::headeronly::IntHeaderOnlyArrayRef;

// `tensor` as the launchers read it, contiguous: itself when it is, without a call into torch.
inline Tensor as_contiguous(const Tensor& tensor) {
  return tensor.is_contiguous() ? tensor : torch::stable::contiguous(tensor);
}

// The strides of a contiguous tensor of `sizes`, as torch gives them.
inline std::vector<int64_t> contiguous_strides(torch::headeronly::IntHeaderOnlyArrayRef sizes) {
  std::vector<int64_t> strides(sizes.size());
  int64_t stride = 1;
  for (size_t dim = sizes.size(); dim-- > 0;) {
    strides[dim] = stride;
    stride *= std::max<int64_t>(sizes[dim], 1);
  }
  return strides;
}

// A new uninitialised contiguous tensor of `sizes` and `dtype` on `like`'s device. Through the C
// shim's empty_strided, which calls torch's allocation directly: the stable ops' new_empty finds
// the op by its name and boxes its arguments on every call, about 9,000 instructions of an
// ms_deform_attn forward of 140,000 at a small shape (callgrind), this about half of that.
inline Tensor new_contiguous(const Tensor& like, torch::headeronly::IntHeaderOnlyArrayRef sizes,
                             torch::headeronly::ScalarType dtype) {
  const std::vector<int64_t> strides = contiguous_strides(sizes);
  int32_t device_type = 0;
  int32_t device_index = 0;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(like.get(), &device_type));
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_index(like.get(), &device_index));
  const auto shim_dtype = torch::stable::detail::to<int32_t>(torch::stable::detail::from(dtype));
  AtenTensorHandle handle = nullptr;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(static_cast<int64_t>(sizes.size()),
                                                         sizes.data(), strides.data(), shim_dtype,
                                                         device_type, device_index, &handle));
  return Tensor(handle);
}

// The same, of `like`'s dtype.
inline Tensor new_contiguous(const Tensor& like, torch::headeronly::IntHeaderOnlyArrayRef sizes) {
  return new_contiguous(like, sizes, like.scalar_type());
}

// Whether `tensor` is on the meta device, where only shapes exist (the fake kernels' checks).
inline bool is_meta(const Tensor& tensor) {
  return tensor.device().type() == torch::headeronly::DeviceType::Meta;
}

}  // namespace deformconv
