// Autograd of ms_deform_attn: the backward op for the first derivative; differentiating that
// again raises, as for the other ops. spatial_shapes and level_start_index are integer
// tensors, which have no gradient.

#include <torch/autograd.h>

#include "../infrastructure/gradient_slots.h"
#include "../infrastructure/op_handles.h"
#include "autograd.h"

namespace deformconv {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class MsDeformAttnFunction : public torch::autograd::Function<MsDeformAttnFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& value,
                            const at::Tensor& spatial_shapes, const at::Tensor& level_start_index,
                            const at::Tensor& sampling_locations,
                            const at::Tensor& attention_weights, int64_t im2col_step) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward(
        {value, spatial_shapes, level_start_index, sampling_locations, attention_weights});
    ctx->saved_data["im2col_step"] = im2col_step;
    return ms_deform_attn_op().call(value, spatial_shapes, level_start_index, sampling_locations,
                                    attention_weights, im2col_step);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    auto [grad_value, grad_locations, grad_weights] = ms_deform_attn_backward_op().call(
        grad_outputs[0], saved[0], saved[1], saved[2], saved[3], saved[4],
        ctx->saved_data["im2col_step"].toInt(),
        {ctx->needs_input_grad(0), ctx->needs_input_grad(3), ctx->needs_input_grad(4)});
    return {grad_value, at::Tensor(), at::Tensor(), grad_locations, grad_weights, at::Tensor()};
  }
};

// Records the backward op in the graph only to refuse a second derivative through it.
class MsDeformAttnBackwardFunction
    : public torch::autograd::Function<MsDeformAttnBackwardFunction> {
 public:
  static variable_list forward(AutogradContext* /*ctx*/, const at::Tensor& grad_output,
                               const at::Tensor& value, const at::Tensor& spatial_shapes,
                               const at::Tensor& level_start_index,
                               const at::Tensor& sampling_locations,
                               const at::Tensor& attention_weights, int64_t im2col_step,
                               std::array<bool, 3> output_mask) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [grad_value, grad_locations, grad_weights] = ms_deform_attn_backward_op().call(
        grad_output, value, spatial_shapes, level_start_index, sampling_locations,
        attention_weights, im2col_step, output_mask);
    return defined_gradients({grad_value, grad_locations, grad_weights});
  }

  static variable_list backward(AutogradContext* /*ctx*/, variable_list /*grad_outputs*/) {
    refuse_double_backward("ms_deform_attn");
  }
};

}  // namespace

at::Tensor ms_deform_attn_autograd(const at::Tensor& value, const at::Tensor& spatial_shapes,
                                   const at::Tensor& level_start_index,
                                   const at::Tensor& sampling_locations,
                                   const at::Tensor& attention_weights, int64_t im2col_step) {
  return MsDeformAttnFunction::apply(value, spatial_shapes, level_start_index,
                                     sampling_locations, attention_weights, im2col_step);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ms_deform_attn_backward_autograd(
    const at::Tensor& grad_output, const at::Tensor& value, const at::Tensor& spatial_shapes,
    const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
    const at::Tensor& attention_weights, int64_t im2col_step, std::array<bool, 3> output_mask) {
  const bool differentiated =
      at::GradMode::is_enabled() &&
      (grad_output.requires_grad() || value.requires_grad() ||
       sampling_locations.requires_grad() || attention_weights.requires_grad());
  if (!differentiated) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return ms_deform_attn_backward_op().call(grad_output, value, spatial_shapes,
                                             level_start_index, sampling_locations,
                                             attention_weights, im2col_step, output_mask);
  }
  const variable_list computed = MsDeformAttnBackwardFunction::apply(
      grad_output, value, spatial_shapes, level_start_index, sampling_locations,
      attention_weights, im2col_step, output_mask);
  const auto grads = gradients_in_slots(computed, output_mask);
  return {grads[0], grads[1], grads[2]};
}

}  // namespace deformconv
