#pragma once

// The LibTorch build's typed handles of each op and its backward op, for the kernels that call
// back into the dispatcher (autograd and autocast: libtorch_kernels.h), looked up once, on first
// use, with the signatures of the op's description (Note [Op descriptions],
// infrastructure/op_description.h) in libtorch's types.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/stable/tensor.h>

#include <array>
#include <cstddef>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../infrastructure/op_description.h"

namespace deformconv {

// The schemas' tensor arguments, as the C++ signatures take them: Tensor, and Tensor? (absent
// when std::nullopt).
template <typename Argument>
constexpr bool is_tensor_argument = std::is_same_v<std::decay_t<Argument>, at::Tensor>;

template <typename Argument>
constexpr bool is_optional_tensor_argument =
    std::is_same_v<std::decay_t<Argument>, std::optional<at::Tensor>>;

// The signatures in libtorch's C++ types, for the typed handles: an op's signatures in the
// stable ABI's types (torch::stable::Tensor, std::vector<bool> for the output mask,
// std::vector<int64_t> for an int[] or SymInt[], std::string for a str) mapped to the
// dispatcher's (at::Tensor, std::array<bool, N>, c10::IntArrayRef, c10::string_view); the
// others unchanged.
namespace libtorch_handles_detail {

template <typename Op, typename Type>
struct Libtorch {
  using type = Type;
};

template <typename Op>
struct Libtorch<Op, torch::stable::Tensor> {
  using type = at::Tensor;
};

template <typename Op>
struct Libtorch<Op, const torch::stable::Tensor&> {
  using type = const at::Tensor&;
};

template <typename Op>
struct Libtorch<Op, const std::optional<torch::stable::Tensor>&> {
  using type = const std::optional<at::Tensor>&;
};

template <typename Op>
struct Libtorch<Op, const std::vector<bool>&> {
  using type = std::array<bool, Op::kGradientArguments.size()>;
};

template <typename Op>
struct Libtorch<Op, const std::vector<int64_t>&> {
  using type = c10::IntArrayRef;
};

template <typename Op>
struct Libtorch<Op, const std::string&> {
  using type = c10::string_view;
};

template <typename Op, typename... Types>
struct Libtorch<Op, std::tuple<Types...>> {
  using type = std::tuple<typename Libtorch<Op, Types>::type...>;
};

template <typename Op, typename Result, typename... Arguments>
struct Libtorch<Op, Result(Arguments...)> {
  using type = typename Libtorch<Op, Result>::type(typename Libtorch<Op, Arguments>::type...);
};

}  // namespace libtorch_handles_detail

template <typename Op>
using LibtorchSignature = typename libtorch_handles_detail::Libtorch<Op, OpSignature<Op>>::type;

template <typename Op>
using LibtorchBackwardSignature =
    typename libtorch_handles_detail::Libtorch<Op, OpBackwardSignature<Op>>::type;

template <typename Op>
const c10::TypedOperatorHandle<LibtorchSignature<Op>>& forward_handle() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow((std::string("deformconv::") + Op::kName).c_str(), "")
          .template typed<LibtorchSignature<Op>>();
  return op;
}

template <typename Op>
const c10::TypedOperatorHandle<LibtorchBackwardSignature<Op>>& backward_handle() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow((std::string("deformconv::") + Op::kName + "_backward").c_str(), "")
          .template typed<LibtorchBackwardSignature<Op>>();
  return op;
}

}  // namespace deformconv
