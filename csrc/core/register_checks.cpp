// Registration of the checks ops (_check_deform_conv2d_arguments and the others'), apart from
// the drivers so that a test build can link them without registering anything
// (tests/cuda_emulation).

#include <torch/library.h>

#include "dcnv3.h"
#include "deform_conv2d.h"
#include "ms_deform_attn.h"

namespace deformconv {

namespace {

// The argument checks as an op of their own, with no tensor data read, so that the Python fake
// kernels (deformconv/ops/) can run them on meta copies of fake tensors: torch.compile and
// torch.export then reject exactly what the op rejects, with the same messages. Returns the
// output shape.
std::vector<int64_t> check_deform_conv2d_arguments_op(
    const std::optional<at::Tensor>& grad_output, const at::Tensor& input,
    const at::Tensor& offset, const at::Tensor& weight, const std::optional<at::Tensor>& mask,
    const std::optional<at::Tensor>& bias, c10::IntArrayRef stride, c10::IntArrayRef padding,
    c10::IntArrayRef dilation, int64_t groups, int64_t offset_groups, int64_t im2col_step) {
  const DeformConv2dGeometry g =
      grad_output.has_value()
          ? check_deform_conv2d_backward_arguments(*grad_output, input, offset, weight, mask,
                                                   stride, padding, dilation, groups,
                                                   offset_groups, im2col_step)
          : check_deform_conv2d_arguments(input, offset, weight, mask, bias, stride, padding,
                                          dilation, groups, offset_groups, im2col_step);
  return {input.size(0), g.out_channels, g.out_height, g.out_width};
}

// The same for dcnv3, or dcnv4 without a mask.
std::vector<int64_t> check_dcnv3_arguments_op(
    const std::optional<at::Tensor>& grad_output, const at::Tensor& input,
    const at::Tensor& offset, const std::optional<at::Tensor>& mask, int64_t kernel_h, int64_t kernel_w,
    int64_t stride_h, int64_t stride_w, int64_t pad_h, int64_t pad_w, int64_t dilation_h,
    int64_t dilation_w, int64_t group, int64_t group_channels, double offset_scale,
    int64_t im2col_step, bool remove_center) {
  const Dcnv3Geometry g = check_dcnv3_arguments(
      grad_output, input, offset, mask.value_or(at::Tensor()),
      {kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w, group,
       group_channels, offset_scale, im2col_step, remove_center});
  return {input.size(0), g.out_height, g.out_width, g.channels()};
}

// The same for ms_deform_attn: on meta tensors, the shapes only (check_ms_deform_attn_arguments).
std::vector<int64_t> check_ms_deform_attn_arguments_op(
    const std::optional<at::Tensor>& grad_output, const at::Tensor& value,
    const at::Tensor& spatial_shapes, const at::Tensor& level_start_index,
    const at::Tensor& sampling_locations, const at::Tensor& attention_weights,
    int64_t im2col_step) {
  const MsDeformAttnGeometry g =
      check_ms_deform_attn_arguments(grad_output, value, spatial_shapes, level_start_index,
                                     sampling_locations, attention_weights, im2col_step);
  return {g.batch, g.queries, g.heads * g.channels};
}

}  // namespace

TORCH_LIBRARY_IMPL(deformconv, CompositeExplicitAutograd, m) {
  m.impl("_check_deform_conv2d_arguments", TORCH_FN(check_deform_conv2d_arguments_op));
  m.impl("_check_dcnv3_arguments", TORCH_FN(check_dcnv3_arguments_op));
  m.impl("_check_ms_deform_attn_arguments", TORCH_FN(check_ms_deform_attn_arguments_op));
}

}  // namespace deformconv
