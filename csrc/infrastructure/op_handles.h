#pragma once

// What an op's description gives (each op's header holds its own: DeformConv2dOp in
// core/deform_conv2d.h, Dcnv3Op and Dcnv4Op in core/dcnv3.h, MsDeformAttnOp in
// core/ms_deform_attn.h), for its device kernels (Note [Device kernels]) and, in the LibTorch
// build, for the kernels that call back into the dispatcher (autograd and autocast), whose typed
// handles are looked up here once, on first use.

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

namespace deformconv {

// Each description gives
//   kSchema, kBackwardSchema  the schemas of the op and of its backward op (and, for
//                        deform_conv2d and ms_deform_attn, kChecksSchema: that of the op of
//                        their argument checks, which the fake kernels run);
//   kName                the op's name in the deformconv namespace, and in messages;
//   Signature            the op's C++ signature, in the stable ABI's types;
//   kArgumentNames       its arguments' names, as the schema gives them;
//   BackwardSignature    its backward op's: grad_output, kBackwardArguments, output_mask,
//                        deterministic;
//   kGradientArguments   the places, among the op's arguments, of the tensors whose gradients
//                        the backward op returns, in its output_mask's order;
//   kBackwardArguments   the places of the arguments that the backward op takes after
//                        grad_output, in its order.

// The schemas' tensor arguments, as the C++ signatures take them: Tensor, and Tensor? (absent
// when std::nullopt).
template <typename Argument>
constexpr bool is_tensor_argument = std::is_same_v<std::decay_t<Argument>, at::Tensor>;

template <typename Argument>
constexpr bool is_optional_tensor_argument =
    std::is_same_v<std::decay_t<Argument>, std::optional<at::Tensor>>;

// The signatures in libtorch's C++ types, for the typed handles: a description's signatures in
// the stable ABI's types (torch::stable::Tensor, std::vector<bool> for the output mask,
// std::vector<int64_t> for an int[] or SymInt[], std::string for a str) mapped to the
// dispatcher's (at::Tensor, std::array<bool, N>, c10::IntArrayRef, c10::string_view); the
// others unchanged.
namespace op_handles_detail {

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

}  // namespace op_handles_detail

template <typename Op>
using LibtorchSignature = typename op_handles_detail::Libtorch<Op, typename Op::Signature>::type;

template <typename Op>
using LibtorchBackwardSignature =
    typename op_handles_detail::Libtorch<Op, typename Op::BackwardSignature>::type;

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
