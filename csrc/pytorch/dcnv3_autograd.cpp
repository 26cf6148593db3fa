// Autograd of dcnv3: the backward op for the first derivative; differentiating that again
// raises, as for deform_conv2d (autograd.cpp).

#include <torch/autograd.h>
#include <torch/library.h>

#include "dcnv3.h"
#include "op_handles.h"

namespace deformconv {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

void save_arguments(AutogradContext* ctx, const Dcnv3Arguments& a) {
  ctx->saved_data["ints"] = std::vector<int64_t>{
      a.kernel_h, a.kernel_w, a.stride_h,  a.stride_w,       a.pad_h,      a.pad_w,
      a.dilation_h, a.dilation_w, a.group, a.group_channels, a.im2col_step};
  ctx->saved_data["offset_scale"] = a.offset_scale;
  ctx->saved_data["remove_center"] = a.remove_center;
}

Dcnv3Arguments saved_arguments(AutogradContext* ctx) {
  const std::vector<int64_t> i = ctx->saved_data["ints"].toIntVector();
  return {i[0], i[1], i[2], i[3], i[4], i[5], i[6], i[7], i[8], i[9],
          ctx->saved_data["offset_scale"].toDouble(), i[10],
          ctx->saved_data["remove_center"].toBool()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> call_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& offset,
    const at::Tensor& mask, const Dcnv3Arguments& a, std::array<bool, 3> output_mask) {
  return dcnv3_backward_op().call(grad_output, input, offset, mask, a.kernel_h, a.kernel_w,
                                  a.stride_h, a.stride_w, a.pad_h, a.pad_w, a.dilation_h,
                                  a.dilation_w, a.group, a.group_channels, a.offset_scale,
                                  a.im2col_step, a.remove_center, output_mask);
}

class Dcnv3Function : public torch::autograd::Function<Dcnv3Function> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& offset, const at::Tensor& mask,
                            const Dcnv3Arguments& a) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward({input, offset, mask});
    save_arguments(ctx, a);
    return dcnv3_op().call(input, offset, mask, a.kernel_h, a.kernel_w, a.stride_h, a.stride_w,
                           a.pad_h, a.pad_w, a.dilation_h, a.dilation_w, a.group,
                           a.group_channels, a.offset_scale, a.im2col_step, a.remove_center);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    auto [grad_input, grad_offset, grad_mask] = call_backward(
        grad_outputs[0], saved[0], saved[1], saved[2], saved_arguments(ctx),
        {ctx->needs_input_grad(0), ctx->needs_input_grad(1), ctx->needs_input_grad(2)});
    return {grad_input, grad_offset, grad_mask, at::Tensor()};
  }
};

// Records the backward op in the graph only to refuse a second derivative through it.
class Dcnv3BackwardFunction : public torch::autograd::Function<Dcnv3BackwardFunction> {
 public:
  static variable_list forward(AutogradContext* /*ctx*/, const at::Tensor& grad_output,
                               const at::Tensor& input, const at::Tensor& offset,
                               const at::Tensor& mask, const Dcnv3Arguments& a,
                               std::array<bool, 3> output_mask) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [grad_input, grad_offset, grad_mask] =
        call_backward(grad_output, input, offset, mask, a, output_mask);
    // A custom Function's outputs must be defined tensors: only the computed gradients.
    variable_list computed;
    for (const at::Tensor& grad : {grad_input, grad_offset, grad_mask}) {
      if (grad.defined()) {
        computed.push_back(grad);
      }
    }
    return computed;
  }

  static variable_list backward(AutogradContext* /*ctx*/, variable_list /*grad_outputs*/) {
    TORCH_CHECK_NOT_IMPLEMENTED(
        false,
        "dcnv3: double backward is not supported (the gradients of dcnv3 were themselves "
        "differentiated, e.g. after backward(create_graph=True) or "
        "torch.autograd.grad(..., create_graph=True))");
  }
};

at::Tensor dcnv3_autograd(const at::Tensor& input, const at::Tensor& offset,
                          const at::Tensor& mask, int64_t kernel_h, int64_t kernel_w,
                          int64_t stride_h, int64_t stride_w, int64_t pad_h, int64_t pad_w,
                          int64_t dilation_h, int64_t dilation_w, int64_t group,
                          int64_t group_channels, double offset_scale, int64_t im2col_step,
                          bool remove_center) {
  return Dcnv3Function::apply(input, offset, mask,
                              Dcnv3Arguments{kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w,
                                           dilation_h, dilation_w, group, group_channels,
                                           offset_scale, im2col_step, remove_center});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dcnv3_backward_autograd(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& offset,
    const at::Tensor& mask, int64_t kernel_h, int64_t kernel_w, int64_t stride_h,
    int64_t stride_w, int64_t pad_h, int64_t pad_w, int64_t dilation_h, int64_t dilation_w,
    int64_t group, int64_t group_channels, double offset_scale, int64_t im2col_step,
    bool remove_center, std::array<bool, 3> output_mask) {
  const Dcnv3Arguments a{kernel_h,   kernel_w, stride_h, stride_w,       pad_h,
                         pad_w,      dilation_h, dilation_w, group,    group_channels,
                         offset_scale, im2col_step, remove_center};
  const bool differentiated =
      at::GradMode::is_enabled() && (grad_output.requires_grad() || input.requires_grad() ||
                                     offset.requires_grad() || mask.requires_grad());
  if (!differentiated) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_backward(grad_output, input, offset, mask, a, output_mask);
  }
  const variable_list computed =
      Dcnv3BackwardFunction::apply(grad_output, input, offset, mask, a, output_mask);
  std::array<at::Tensor, 3> grads;
  size_t next = 0;
  for (size_t slot = 0; slot < grads.size(); ++slot) {
    if (output_mask[slot]) {
      grads[slot] = computed.at(next++);
    }
  }
  return {grads[0], grads[1], grads[2]};
}

}  // namespace

TORCH_LIBRARY_IMPL(deformconv, Autograd, m) {
  m.impl("dcnv3", TORCH_FN(dcnv3_autograd));
  m.impl("dcnv3_backward", TORCH_FN(dcnv3_backward_autograd));
}

}  // namespace deformconv
