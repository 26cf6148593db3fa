#pragma once

#include <ATen/core/Tensor.h>

#include <type_traits>

#include "../common/scalar_types.h"

namespace deformconv {

// Note [Input gradient sums in float32]
// col2im adds many terms into each input gradient element (every sample whose bilinear cell
// touches it). In float16 or bfloat16 each add would round the running sum to 11 or 8 bits, and
// on the GPU an atomic add on a 16-bit value is a compare-and-swap loop, slow where many samples
// hit one pixel. So the launchers sum such gradients in a float32 copy (at::opmath_type) and
// round once at the end; float32 and float64 gradients are summed in place.
template <typename scalar_t>
at::Tensor input_gradient_sums(const at::Tensor& grad_input) {
  return std::is_same_v<opmath_type<scalar_t>, scalar_t>
             ? grad_input
             : grad_input.to(c10::CppTypeToScalarType<opmath_type<scalar_t>>::value);
}

// input_gradient_sums for an input gradient that is not initialised: the gradient itself, or
// an uninitialised float32 tensor of its shape, for the launcher to zero.
template <typename scalar_t>
at::Tensor uninitialised_input_gradient_sums(const at::Tensor& grad_input) {
  return std::is_same_v<opmath_type<scalar_t>, scalar_t>
             ? grad_input
             : grad_input.new_empty(grad_input.sizes(),
                                    c10::CppTypeToScalarType<opmath_type<scalar_t>>::value);
}

inline void store_input_gradient_sums(const at::Tensor& sums, at::Tensor& grad_input) {
  if (!sums.is_same(grad_input)) {
    grad_input.copy_(sums);
  }
}

}  // namespace deformconv
