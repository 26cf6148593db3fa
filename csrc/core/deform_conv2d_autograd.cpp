// Autograd for deform_conv2d as a C++ kernel at the Autograd key, so that the op is
// differentiable from Python, TorchScript and LibTorch C++ alike. The gradients come from the
// deform_conv2d_backward op, which computes only those that are needed.

#include <torch/autograd.h>

#include "../infrastructure/gradient_slots.h"
#include "../infrastructure/op_handles.h"
#include "autograd.h"

namespace deformconv {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::optional<at::Tensor> optional_if_defined(const at::Tensor& tensor) {
  return tensor.defined() ? std::optional<at::Tensor>(tensor) : std::nullopt;
}

// Autograd numbers only the tensors that are present: input 0, offset 1, weight 2, then mask
// and bias when given. An absent optional takes no slot in needs_input_grad, but still takes
// one (an undefined gradient) in the list that backward returns.
class DeformConv2dFunction : public torch::autograd::Function<DeformConv2dFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& offset, const at::Tensor& weight,
                            const std::optional<at::Tensor>& mask,
                            const std::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                            c10::IntArrayRef padding, c10::IntArrayRef dilation, int64_t groups,
                            int64_t offset_groups, int64_t im2col_step) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    at::Tensor output = deform_conv2d_op().call(input, offset, weight, mask, bias, stride,
                                                padding, dilation, groups, offset_groups,
                                                im2col_step);
    ctx->save_for_backward({input, offset, weight, mask.value_or(at::Tensor())});
    ctx->saved_data["has_mask"] = mask.has_value();
    ctx->saved_data["has_bias"] = bias.has_value();
    ctx->saved_data["stride"] = stride.vec();
    ctx->saved_data["padding"] = padding.vec();
    ctx->saved_data["dilation"] = dilation.vec();
    ctx->saved_data["groups"] = groups;
    ctx->saved_data["offset_groups"] = offset_groups;
    ctx->saved_data["im2col_step"] = im2col_step;
    return output;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const bool has_mask = ctx->saved_data["has_mask"].toBool();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const int64_t bias_slot = has_mask ? 4 : 3;
    const std::array<bool, 5> output_mask = {
        ctx->needs_input_grad(0), ctx->needs_input_grad(1), ctx->needs_input_grad(2),
        has_mask && ctx->needs_input_grad(3), has_bias && ctx->needs_input_grad(bias_slot)};
    auto [grad_input, grad_offset, grad_weight, grad_mask, grad_bias] =
        deform_conv2d_backward_op().call(
            grad_outputs[0], saved[0], saved[1], saved[2], optional_if_defined(saved[3]),
            ctx->saved_data["stride"].toIntVector(), ctx->saved_data["padding"].toIntVector(),
            ctx->saved_data["dilation"].toIntVector(), ctx->saved_data["groups"].toInt(),
            ctx->saved_data["offset_groups"].toInt(), ctx->saved_data["im2col_step"].toInt(),
            output_mask);
    // One entry per forward argument; the six non-tensor arguments get none.
    return {grad_input, grad_offset, grad_weight, grad_mask, grad_bias, at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Records the backward op in the graph only to refuse a second derivative through it
// (refuse_double_backward).
class DeformConv2dBackwardFunction
    : public torch::autograd::Function<DeformConv2dBackwardFunction> {
 public:
  static variable_list forward(AutogradContext* /*ctx*/, const at::Tensor& grad_output,
                               const at::Tensor& input, const at::Tensor& offset,
                               const at::Tensor& weight, const std::optional<at::Tensor>& mask,
                               c10::IntArrayRef stride, c10::IntArrayRef padding,
                               c10::IntArrayRef dilation, int64_t groups, int64_t offset_groups,
                               int64_t im2col_step, std::array<bool, 5> output_mask) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [grad_input, grad_offset, grad_weight, grad_mask, grad_bias] =
        deform_conv2d_backward_op().call(grad_output, input, offset, weight, mask, stride,
                                         padding, dilation, groups, offset_groups, im2col_step,
                                         output_mask);
    return defined_gradients({grad_input, grad_offset, grad_weight, grad_mask, grad_bias});
  }

  static variable_list backward(AutogradContext* /*ctx*/, variable_list /*grad_outputs*/) {
    refuse_double_backward("deform_conv2d");
  }
};

}  // namespace

at::Tensor deform_conv2d_autograd(const at::Tensor& input, const at::Tensor& offset,
                                  const at::Tensor& weight, const std::optional<at::Tensor>& mask,
                                  const std::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                                  c10::IntArrayRef padding, c10::IntArrayRef dilation,
                                  int64_t groups, int64_t offset_groups, int64_t im2col_step) {
  return DeformConv2dFunction::apply(input, offset, weight, mask, bias, stride, padding,
                                     dilation, groups, offset_groups, im2col_step);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
deform_conv2d_backward_autograd(const at::Tensor& grad_output, const at::Tensor& input,
                                const at::Tensor& offset, const at::Tensor& weight,
                                const std::optional<at::Tensor>& mask, c10::IntArrayRef stride,
                                c10::IntArrayRef padding, c10::IntArrayRef dilation,
                                int64_t groups, int64_t offset_groups, int64_t im2col_step,
                                std::array<bool, 5> output_mask) {
  const bool differentiated =
      at::GradMode::is_enabled() &&
      (grad_output.requires_grad() || input.requires_grad() || offset.requires_grad() ||
       weight.requires_grad() || (mask.has_value() && mask->requires_grad()));
  if (!differentiated) {  // the usual backward: no graph of the gradients to record
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return deform_conv2d_backward_op().call(grad_output, input, offset, weight, mask, stride,
                                            padding, dilation, groups, offset_groups,
                                            im2col_step, output_mask);
  }
  const variable_list computed = DeformConv2dBackwardFunction::apply(
      grad_output, input, offset, weight, mask, stride, padding, dilation, groups,
      offset_groups, im2col_step, output_mask);
  // The backward op computes a gradient iff output_mask asks for it, except the mask's, which
  // needs a mask.
  std::array<bool, 5> filled = output_mask;
  filled[3] = filled[3] && mask.has_value();
  const auto grads = gradients_in_slots(computed, filled);
  return {grads[0], grads[1], grads[2], grads[3], grads[4]};
}

}  // namespace deformconv
