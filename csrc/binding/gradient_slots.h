#pragma once

// Helpers of the LibTorch build's autograd kernels (op_autograd.h): a backward op returns a
// fixed set of gradient slots, some undefined (not asked for), while a custom autograd
// Function's outputs must all be defined tensors.

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>

#include <array>
#include <cstddef>
#include <initializer_list>

namespace deformconv {

// The defined gradients, in slot order: a Function's outputs.
inline torch::autograd::variable_list defined_gradients(std::initializer_list<at::Tensor> slots) {
  torch::autograd::variable_list computed;
  for (const at::Tensor& grad : slots) {
    if (grad.defined()) {
      computed.push_back(grad);
    }
  }
  return computed;
}

// The inverse: back into the slots, slot i taking the next computed gradient where filled[i].
template <size_t slots>
std::array<at::Tensor, slots> gradients_in_slots(const torch::autograd::variable_list& computed,
                                                 const std::array<bool, slots>& filled) {
  std::array<at::Tensor, slots> grads;
  size_t next = 0;
  for (size_t slot = 0; slot < slots; ++slot) {
    if (filled[slot]) {
      grads[slot] = computed.at(next++);
    }
  }
  return grads;
}

// The gradients are not differentiable themselves: double backward would need the second
// derivatives of bilinear sampling, which no kernel here computes. With create_graph=True the
// first backward still works; differentiating its results stops here with a message that names
// the op, instead of an error from deep inside the kernels.
[[noreturn]] inline void refuse_double_backward(const char* op) {
  C10_THROW_ERROR(NotImplementedError,
                  c10::str(op, ": double backward is not supported (the gradients of ", op,
                           " were themselves differentiated, e.g. after "
                           "backward(create_graph=True) or torch.autograd.grad(..., "
                           "create_graph=True))"));
}

}  // namespace deformconv
