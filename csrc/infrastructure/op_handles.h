#pragma once

// Typed handles of the ops, for kernels that call back into the dispatcher (autograd,
// autocast): looked up once, on first use.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <array>
#include <optional>
#include <tuple>

namespace deformconv {

using DeformConv2dSignature = at::Tensor(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, c10::IntArrayRef, c10::IntArrayRef, c10::IntArrayRef,
    int64_t, int64_t, int64_t);

using DeformConv2dBackwardSignature =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
        const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
        const std::optional<at::Tensor>&, c10::IntArrayRef, c10::IntArrayRef, c10::IntArrayRef,
        int64_t, int64_t, int64_t, std::array<bool, 5>);

inline const c10::TypedOperatorHandle<DeformConv2dSignature>& deform_conv2d_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("deformconv::deform_conv2d", "")
                             .typed<DeformConv2dSignature>();
  return op;
}

inline const c10::TypedOperatorHandle<DeformConv2dBackwardSignature>&
deform_conv2d_backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("deformconv::deform_conv2d_backward", "")
                             .typed<DeformConv2dBackwardSignature>();
  return op;
}

using Dcnv3Signature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                  int64_t, int64_t, int64_t, double, int64_t, bool);

using Dcnv3BackwardSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
    int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double,
    int64_t, bool, std::array<bool, 3>);

inline const c10::TypedOperatorHandle<Dcnv3Signature>& dcnv3_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("deformconv::dcnv3", "")
                             .typed<Dcnv3Signature>();
  return op;
}

inline const c10::TypedOperatorHandle<Dcnv3BackwardSignature>& dcnv3_backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("deformconv::dcnv3_backward", "")
                             .typed<Dcnv3BackwardSignature>();
  return op;
}

using Dcnv4Signature = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                                  int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                  int64_t, double, int64_t, bool);

using Dcnv4BackwardSignature = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t, int64_t,
    int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double, int64_t, bool,
    std::array<bool, 2>);

inline const c10::TypedOperatorHandle<Dcnv4Signature>& dcnv4_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("deformconv::dcnv4", "")
                             .typed<Dcnv4Signature>();
  return op;
}

inline const c10::TypedOperatorHandle<Dcnv4BackwardSignature>& dcnv4_backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("deformconv::dcnv4_backward", "")
                             .typed<Dcnv4BackwardSignature>();
  return op;
}

using MsDeformAttnSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, const at::Tensor&, int64_t);

using MsDeformAttnBackwardSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, int64_t, std::array<bool, 3>);

inline const c10::TypedOperatorHandle<MsDeformAttnSignature>& ms_deform_attn_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("deformconv::ms_deform_attn", "")
                             .typed<MsDeformAttnSignature>();
  return op;
}

inline const c10::TypedOperatorHandle<MsDeformAttnBackwardSignature>&
ms_deform_attn_backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("deformconv::ms_deform_attn_backward", "")
                             .typed<MsDeformAttnBackwardSignature>();
  return op;
}

}  // namespace deformconv
