#pragma once

#include "stable_tensors.h"

namespace deformconv {

// Data of an optional operand (undefined: absent or not asked for) as a pointer, null if absent.
template <typename scalar_t>
const scalar_t* data_or_null(const Tensor& tensor) {
  return tensor.defined() ? tensor.const_data_ptr<scalar_t>() : nullptr;
}

template <typename scalar_t>
scalar_t* mutable_data_or_null(Tensor& tensor) {
  return tensor.defined() ? tensor.mutable_data_ptr<scalar_t>() : nullptr;
}

}  // namespace deformconv
