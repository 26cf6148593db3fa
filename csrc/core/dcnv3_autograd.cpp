// Autograd of dcnv3 and dcnv4: the backward op for the first derivative; differentiating that
// again raises, as for deform_conv2d (deform_conv2d_autograd.cpp).

#include <torch/autograd.h>

#include <utility>

#include "../infrastructure/gradient_slots.h"
#include "../infrastructure/op_handles.h"
#include "autograd.h"
#include "dcnv3.h"

namespace deformconv {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The integer fields of Dcnv3Arguments by name, so that the context keeps each under its own.
constexpr std::pair<const char*, int64_t Dcnv3Arguments::*> kIntegerArguments[] = {
    {"kernel_h", &Dcnv3Arguments::kernel_h},
    {"kernel_w", &Dcnv3Arguments::kernel_w},
    {"stride_h", &Dcnv3Arguments::stride_h},
    {"stride_w", &Dcnv3Arguments::stride_w},
    {"pad_h", &Dcnv3Arguments::pad_h},
    {"pad_w", &Dcnv3Arguments::pad_w},
    {"dilation_h", &Dcnv3Arguments::dilation_h},
    {"dilation_w", &Dcnv3Arguments::dilation_w},
    {"group", &Dcnv3Arguments::group},
    {"group_channels", &Dcnv3Arguments::group_channels},
    {"im2col_step", &Dcnv3Arguments::im2col_step},
};

void save_arguments(AutogradContext* ctx, const Dcnv3Arguments& a) {
  for (const auto& [name, field] : kIntegerArguments) {
    ctx->saved_data[name] = a.*field;
  }
  ctx->saved_data["offset_scale"] = a.offset_scale;
  ctx->saved_data["remove_center"] = a.remove_center;
}

Dcnv3Arguments saved_arguments(AutogradContext* ctx) {
  Dcnv3Arguments a;
  for (const auto& [name, field] : kIntegerArguments) {
    a.*field = ctx->saved_data[name].toInt();
  }
  a.offset_scale = ctx->saved_data["offset_scale"].toDouble();
  a.remove_center = ctx->saved_data["remove_center"].toBool();
  return a;
}

// The op of the call: dcnv3, or dcnv4 without a mask (Note [DCNv4 is DCNv3 without a mask
// tensor]).
at::Tensor call_forward(const at::Tensor& input, const at::Tensor& offset, const at::Tensor& mask,
                        const Dcnv3Arguments& a) {
  if (!mask.defined()) {
    return dcnv4_op().call(input, offset, a.kernel_h, a.kernel_w, a.stride_h, a.stride_w,
                           a.pad_h, a.pad_w, a.dilation_h, a.dilation_w, a.group,
                           a.group_channels, a.offset_scale, a.im2col_step, a.remove_center);
  }
  return dcnv3_op().call(input, offset, mask, a.kernel_h, a.kernel_w, a.stride_h, a.stride_w,
                         a.pad_h, a.pad_w, a.dilation_h, a.dilation_w, a.group,
                         a.group_channels, a.offset_scale, a.im2col_step, a.remove_center);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> call_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& offset,
    const at::Tensor& mask, const Dcnv3Arguments& a, std::array<bool, 3> output_mask) {
  if (!mask.defined()) {
    auto [grad_input, grad_offset_mask] = dcnv4_backward_op().call(
        grad_output, input, offset, a.kernel_h, a.kernel_w, a.stride_h, a.stride_w, a.pad_h,
        a.pad_w, a.dilation_h, a.dilation_w, a.group, a.group_channels, a.offset_scale,
        a.im2col_step, a.remove_center, {output_mask[0], output_mask[1]});
    return {grad_input, grad_offset_mask, at::Tensor()};
  }
  return dcnv3_backward_op().call(grad_output, input, offset, mask, a.kernel_h, a.kernel_w,
                                  a.stride_h, a.stride_w, a.pad_h, a.pad_w, a.dilation_h,
                                  a.dilation_w, a.group, a.group_channels, a.offset_scale,
                                  a.im2col_step, a.remove_center, output_mask);
}

// Function::apply records every tensor argument's device, so an absent mask (DCNv4) is passed
// as std::nullopt rather than as an undefined tensor.
std::optional<at::Tensor> optional_mask(const at::Tensor& mask) {
  return mask.defined() ? std::optional<at::Tensor>(mask) : std::nullopt;
}

class Dcnv3Function : public torch::autograd::Function<Dcnv3Function> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& offset, const std::optional<at::Tensor>& mask,
                            const Dcnv3Arguments& a) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const at::Tensor mask_or_none = mask.value_or(at::Tensor());
    ctx->save_for_backward({input, offset, mask_or_none});
    save_arguments(ctx, a);
    return call_forward(input, offset, mask_or_none, a);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    // An absent mask is no input of the graph, and has no slot to ask about.
    const bool has_mask = saved[2].defined();
    auto [grad_input, grad_offset, grad_mask] = call_backward(
        grad_outputs[0], saved[0], saved[1], saved[2], saved_arguments(ctx),
        {ctx->needs_input_grad(0), ctx->needs_input_grad(1),
         has_mask && ctx->needs_input_grad(2)});
    return {grad_input, grad_offset, grad_mask, at::Tensor()};
  }
};

// Records the backward op in the graph only to refuse a second derivative through it.
class Dcnv3BackwardFunction : public torch::autograd::Function<Dcnv3BackwardFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& grad_output,
                               const at::Tensor& input, const at::Tensor& offset,
                               const std::optional<at::Tensor>& mask, const Dcnv3Arguments& a,
                               std::array<bool, 3> output_mask) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->saved_data["op"] = mask.has_value() ? "dcnv3" : "dcnv4";
    auto [grad_input, grad_offset, grad_mask] =
        call_backward(grad_output, input, offset, mask.value_or(at::Tensor()), a, output_mask);
    return defined_gradients({grad_input, grad_offset, grad_mask});
  }

  static variable_list backward(AutogradContext* ctx, variable_list /*grad_outputs*/) {
    refuse_double_backward(ctx->saved_data["op"].toStringRef().c_str());
  }
};

}  // namespace

at::Tensor dcnv3_autograd(const at::Tensor& input, const at::Tensor& offset,
                          const at::Tensor& mask, const Dcnv3Arguments& a) {
  return Dcnv3Function::apply(input, offset, optional_mask(mask), a);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dcnv3_backward_autograd(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& offset,
    const at::Tensor& mask, const Dcnv3Arguments& a, std::array<bool, 3> output_mask) {
  const bool differentiated =
      at::GradMode::is_enabled() && (grad_output.requires_grad() || input.requires_grad() ||
                                     offset.requires_grad() || mask.requires_grad());
  if (!differentiated) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_backward(grad_output, input, offset, mask, a, output_mask);
  }
  const variable_list computed =
      Dcnv3BackwardFunction::apply(grad_output, input, offset, optional_mask(mask), a,
                                   output_mask);
  const auto grads = gradients_in_slots(computed, output_mask);
  return {grads[0], grads[1], grads[2]};
}

}  // namespace deformconv
