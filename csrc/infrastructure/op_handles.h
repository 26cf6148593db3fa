#pragma once

// What an op's description gives (each op's header holds its own: DeformConv2dOp in
// core/deform_conv2d.h, Dcnv3Op and Dcnv4Op in core/dcnv3.h, MsDeformAttnOp in
// core/ms_deform_attn.h), for its registrations and for the kernels that call back into the
// dispatcher (the LibTorch build's autograd and autocast), whose typed handles are looked up
// once, on first use.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <array>
#include <cstddef>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>

namespace deformconv {

// Each description gives
//   kSchema, kBackwardSchema  the schemas of the op and of its backward op (and, for
//                        deform_conv2d and ms_deform_attn, kChecksSchema: that of the op of
//                        their argument checks, which the fake kernels run);
//   kName                the op's name in the deformconv namespace, and in messages;
//   Signature            the op's C++ signature;
//   kArgumentNames       its arguments' names, as the schema gives them;
//   BackwardSignature    its backward op's: grad_output, kBackwardArguments, output_mask;
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

template <typename Op>
const c10::TypedOperatorHandle<typename Op::Signature>& forward_handle() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow((std::string("deformconv::") + Op::kName).c_str(), "")
          .template typed<typename Op::Signature>();
  return op;
}

template <typename Op>
const c10::TypedOperatorHandle<typename Op::BackwardSignature>& backward_handle() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow((std::string("deformconv::") + Op::kName + "_backward").c_str(), "")
          .template typed<typename Op::BackwardSignature>();
  return op;
}

}  // namespace deformconv
