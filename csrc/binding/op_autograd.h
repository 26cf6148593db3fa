#pragma once

// Note [One autograd kernel for every op]
// Each op's Autograd kernel is OpAutograd<Op>::forward, and its backward op's is
// OpAutograd<Op>::backward, where Op is the op's description (Note [Op descriptions]). The
// forward runs the op below autograd and saves its arguments; the gradient calls the backward op
// with grad_output, the arguments it takes and an output_mask of the gradients that autograd
// needs, so that only those are computed. The gradients are not differentiable themselves: the
// backward op's kernel records it in the graph only to refuse a second derivative
// (refuse_double_backward), and runs it directly when no graph is being recorded.

#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>

#include <array>
#include <cstddef>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "gradient_slots.h"
#include "../infrastructure/op_description.h"
#include "libtorch_handles.h"

namespace deformconv {
namespace op_autograd_detail {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

template <typename Argument>
bool requires_grad(const Argument& argument) {
  if constexpr (is_tensor_argument<Argument>) {
    return argument.requires_grad();
  } else if constexpr (is_optional_tensor_argument<Argument>) {
    return argument.has_value() && argument->requires_grad();
  } else {
    return false;
  }
}

inline std::string saved_argument_key(size_t index) {
  return "argument " + std::to_string(index);
}

// Tensors go to save_for_backward (an absent one as an undefined tensor, to keep the places),
// the rest to saved_data as IValues.
template <typename Argument>
void save_argument(AutogradContext* ctx, variable_list& tensors, size_t index,
                   const Argument& argument) {
  if constexpr (is_tensor_argument<Argument>) {
    tensors.push_back(argument);
  } else if constexpr (is_optional_tensor_argument<Argument>) {
    tensors.push_back(argument.value_or(at::Tensor()));
  } else {
    ctx->saved_data[saved_argument_key(index)] = c10::IValue(argument);
  }
}

// The forward op as an autograd Function over its schema's arguments.
template <typename Op, typename Signature = LibtorchSignature<Op>>
class ForwardFunction;

template <typename Op, typename... Arguments>
class ForwardFunction<Op, at::Tensor(Arguments...)>
    : public torch::autograd::Function<ForwardFunction<Op, at::Tensor(Arguments...)>> {
  static constexpr size_t kArguments = sizeof...(Arguments);
  static constexpr std::array<bool, kArguments> kTensorArguments = {
      (is_tensor_argument<Arguments> || is_optional_tensor_argument<Arguments>)...};

 public:
  static at::Tensor forward(AutogradContext* ctx, Arguments... arguments) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    variable_list tensors;
    size_t index = 0;
    (save_argument(ctx, tensors, index++, arguments), ...);
    ctx->save_for_backward(tensors);
    return forward_handle<Op>().call(arguments...);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    // The forward's arguments boxed again, each absent tensor as None; and the place of each
    // present one among the graph's inputs, which needs_input_grad counts.
    std::array<c10::IValue, kArguments> arguments;
    std::array<std::optional<size_t>, kArguments> graph_input;
    size_t next_saved = 0;
    size_t next_graph_input = 0;
    for (size_t index = 0; index < kArguments; ++index) {
      if (!kTensorArguments[index]) {
        arguments[index] = ctx->saved_data[saved_argument_key(index)];
        continue;
      }
      const at::Tensor& tensor = saved[next_saved++];
      if (tensor.defined()) {
        arguments[index] = tensor;
        graph_input[index] = next_graph_input++;
      }
    }
    constexpr size_t kGradients = Op::kGradientArguments.size();
    c10::List<bool> output_mask;
    for (size_t slot = 0; slot < kGradients; ++slot) {
      const auto& input = graph_input[Op::kGradientArguments[slot]];
      output_mask.push_back(input.has_value() && ctx->needs_input_grad(*input));
    }
    torch::jit::Stack stack;
    stack.reserve(3 + kBackwardArguments<Op>.size());
    stack.emplace_back(grad_outputs[0]);
    for (const size_t index : kBackwardArguments<Op>) {
      stack.push_back(arguments[index]);
    }
    stack.emplace_back(std::move(output_mask));
    // PyTorch's deterministic mode, as the Python package's autograd passes it
    // (deformconv/ops/_autograd.py): on CUDA it takes the input gradient's gathered path.
    stack.emplace_back(at::globalContext().deterministicAlgorithms());
    backward_handle<Op>().callBoxed(&stack);
    // One gradient per forward argument, undefined for those that have none.
    variable_list gradients(kArguments);
    for (size_t slot = 0; slot < kGradients; ++slot) {
      if (stack[slot].isTensor()) {
        gradients[Op::kGradientArguments[slot]] = stack[slot].toTensor();
      }
    }
    return gradients;
  }
};

// The backward op as an autograd Function whose own backward refuses.
template <typename Op, typename Signature = LibtorchBackwardSignature<Op>>
class BackwardFunction;

template <typename Op, typename Gradients, typename... Arguments>
class BackwardFunction<Op, Gradients(Arguments...)>
    : public torch::autograd::Function<BackwardFunction<Op, Gradients(Arguments...)>> {
 public:
  static constexpr size_t kGradients = std::tuple_size_v<Gradients>;

  // A Function's outputs are defined tensors only: `filled` receives which gradient slots the
  // outputs fill, for gradients_in_slots to put them back.
  static variable_list forward(AutogradContext* /*ctx*/, std::array<bool, kGradients>* filled,
                               Arguments... arguments) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const Gradients gradients = backward_handle<Op>().call(arguments...);
    variable_list computed;
    std::apply(
        [&](const auto&... gradient) {
          size_t slot = 0;
          (((*filled)[slot++] = gradient.defined()), ...);
          computed = defined_gradients({gradient...});
        },
        gradients);
    return computed;
  }

  static variable_list backward(AutogradContext* /*ctx*/, variable_list /*grad_outputs*/) {
    refuse_double_backward(Op::kName);
  }
};

template <typename Op, typename Signature = LibtorchBackwardSignature<Op>>
struct BackwardKernel;

template <typename Op, typename Gradients, typename... Arguments>
struct BackwardKernel<Op, Gradients(Arguments...)> {
  static Gradients call(Arguments... arguments) {
    if (!at::GradMode::is_enabled() || !(requires_grad(arguments) || ...)) {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      return backward_handle<Op>().call(arguments...);
    }
    using Function = BackwardFunction<Op, Gradients(Arguments...)>;
    std::array<bool, Function::kGradients> filled{};
    const variable_list computed = Function::apply(&filled, arguments...);
    return std::apply([](auto... gradient) { return Gradients{gradient...}; },
                      gradients_in_slots(computed, filled));
  }
};

}  // namespace op_autograd_detail

template <typename Op>
struct OpAutograd {
  template <typename Signature = LibtorchSignature<Op>>
  struct Forward;

  template <typename... Arguments>
  struct Forward<at::Tensor(Arguments...)> {
    static at::Tensor call(Arguments... arguments) {
      return op_autograd_detail::ForwardFunction<Op>::apply(arguments...);
    }
  };

  static constexpr auto forward = &Forward<>::call;
  static constexpr auto backward = &op_autograd_detail::BackwardKernel<Op>::call;
};

}  // namespace deformconv
