#pragma once

#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <type_traits>

#include "../common/scalar_types.h"
#include "stable_tensors.h"

namespace deformconv {

// Note [Input gradient sums in float32]
// col2im adds many terms into each input gradient element (every sample whose bilinear cell
// touches it). In float16 or bfloat16 each add would round the running sum to 11 or 8 bits, and
// on the GPU an atomic add on a 16-bit value is a compare-and-swap loop, slow where many samples
// hit one pixel. So the launchers sum such gradients in a float32 copy (opmath_type) and round
// once at the end; float32 and float64 gradients are summed in place.
template <typename scalar_t>
Tensor input_gradient_sums(const Tensor& grad_input) {
  if constexpr (std::is_same_v<opmath_type<scalar_t>, scalar_t>) {
    return grad_input;
  } else {
    return torch::stable::to(grad_input, ScalarType::Float);
  }
}

// input_gradient_sums for an input gradient that is not initialised: the gradient itself, or
// an uninitialised float32 tensor of its shape, for the launcher to zero.
template <typename scalar_t>
Tensor uninitialised_input_gradient_sums(const Tensor& grad_input) {
  if constexpr (std::is_same_v<opmath_type<scalar_t>, scalar_t>) {
    return grad_input;
  } else {
    return new_contiguous(grad_input, grad_input.sizes(), ScalarType::Float);
  }
}

// The sums into the gradient, unless they are the gradient itself (the same memory: a tensor of
// its own would have been allocated apart).
inline void store_input_gradient_sums(const Tensor& sums, Tensor& grad_input) {
  if (sums.const_data_ptr() != grad_input.const_data_ptr()) {
    torch::stable::copy_(grad_input, sums);
  }
}

}  // namespace deformconv
