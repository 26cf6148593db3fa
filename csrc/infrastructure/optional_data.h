#pragma once

namespace deformconv {

// Data of an optional operand (undefined: absent or not asked for) as a pointer, null if absent;
// of a torch::stable::Tensor, or of an at::Tensor in the drivers still on libtorch's C++ ABI.
template <typename scalar_t, typename Tensor>
const scalar_t* data_or_null(const Tensor& tensor) {
  return tensor.defined() ? tensor.template const_data_ptr<scalar_t>() : nullptr;
}

template <typename scalar_t, typename Tensor>
scalar_t* mutable_data_or_null(Tensor& tensor) {
  return tensor.defined() ? tensor.template mutable_data_ptr<scalar_t>() : nullptr;
}

}  // namespace deformconv
