// The argument checks of deformable convolution's ops (declared in deform_conv2d.h).

#include <vector>

#include "../common/bilinear_sampling.cuh"
#include "../common/output_length.h"
#include "../common/scalar_types.h"
#include "../infrastructure/argument_checks.h"
#include "../infrastructure/tensor_text.h"
#include "deform_conv2d.h"

namespace deformconv {

namespace {

void check_pair(const char* name, const std::vector<int64_t>& values, int64_t minimum) {
  DEFORMCONV_CHECK_ARGUMENT(values.size() == 2, "deform_conv2d(): expected ", name,
                            " to have 2 values (height, width), but got ", values.size());
  DEFORMCONV_CHECK_ARGUMENT(values[0] >= minimum && values[1] >= minimum,
                            "deform_conv2d(): expected ", name, " to be at least ", minimum,
                            ", but got ", shape_text(values));
}

void check_tensor(const char* name, const Tensor& tensor, int64_t dims, const char* layout,
                  const Tensor& input) {
  DEFORMCONV_CHECK_ARGUMENT(tensor.dim() == dims, "deform_conv2d(): expected ", name, " to be a ",
                            dims, "-D tensor ", layout, ", but got a ", tensor.dim(),
                            "-D tensor of shape ", shape_text(tensor.sizes()));
  DEFORMCONV_CHECK_ARGUMENT(tensor.scalar_type() == input.scalar_type(),
                            "deform_conv2d(): expected ", name, " to have the dtype of input (",
                            input.scalar_type(), "), but got ", tensor.scalar_type());
}

// The tensors' ranks and dtypes.
void check_tensors(const Tensor& input, const Tensor& offset, const Tensor& weight,
                   const std::optional<Tensor>& mask, const std::optional<Tensor>& bias) {
  DEFORMCONV_CHECK_ARGUMENT(is_op_dtype(input.scalar_type()),
                            "deform_conv2d(): expected input to have a floating point dtype "
                            "(float16, bfloat16, float32 or float64), but got ",
                            input.scalar_type());
  check_tensor("input", input, 4, "(batch, in_channels, height, width)", input);
  check_tensor("offset", offset, 4,
               "(batch, 2 * offset_groups * kernel_h * kernel_w, out_height, out_width)", input);
  check_tensor("weight", weight, 4,
               "(out_channels, in_channels / groups, kernel_h, kernel_w)", input);
  if (mask.has_value()) {
    check_tensor("mask", *mask, 4,
                 "(batch, offset_groups * kernel_h * kernel_w, out_height, out_width)", input);
  }
  if (bias.has_value()) {
    check_tensor("bias", *bias, 1, "(out_channels,)", input);
  }
}

void check_scalars(const std::vector<int64_t>& stride, const std::vector<int64_t>& padding,
                   const std::vector<int64_t>& dilation, int64_t groups, int64_t offset_groups,
                   int64_t im2col_step) {
  check_pair("stride", stride, 1);
  check_pair("padding", padding, 0);
  check_pair("dilation", dilation, 1);
  DEFORMCONV_CHECK_ARGUMENT(groups >= 1,
                            "deform_conv2d(): expected groups to be at least 1, but got ", groups);
  DEFORMCONV_CHECK_ARGUMENT(offset_groups >= 1,
                            "deform_conv2d(): expected offset_groups to be at least 1, but got ",
                            offset_groups);
  DEFORMCONV_CHECK_ARGUMENT(
      im2col_step >= 0,
      "deform_conv2d(): expected im2col_step to be positive, or 0 for automatic, "
      "but got ",
      im2col_step);
}

// The geometry of input and weight's sizes, checked, with the output's size.
DeformConv2dGeometry checked_geometry(const Tensor& input, const Tensor& weight,
                                      const std::vector<int64_t>& stride,
                                      const std::vector<int64_t>& padding,
                                      const std::vector<int64_t>& dilation, int64_t groups,
                                      int64_t offset_groups) {
  DeformConv2dGeometry g{};
  g.in_channels = input.size(1);
  g.in_height = input.size(2);
  g.in_width = input.size(3);
  g.out_channels = weight.size(0);
  g.kernel_h = weight.size(2);
  g.kernel_w = weight.size(3);
  g.stride_h = stride[0];
  g.stride_w = stride[1];
  g.pad_h = padding[0];
  g.pad_w = padding[1];
  g.dilation_h = dilation[0];
  g.dilation_w = dilation[1];
  g.groups = groups;
  g.offset_groups = offset_groups;

  DEFORMCONV_CHECK_ARGUMENT(g.in_channels > 0 && g.in_height > 0 && g.in_width > 0,
                            "deform_conv2d(): expected input to have non-zero channels, height and "
                            "width, but got shape ",
                            shape_text(input.sizes()));
  DEFORMCONV_CHECK_ARGUMENT(g.in_height <= kMaxImageSide && g.in_width <= kMaxImageSide,
                            "deform_conv2d(): expected input's height and width to be at most ",
                            kMaxImageSide, ", but got ", g.in_height, " x ", g.in_width);
  DEFORMCONV_CHECK_ARGUMENT(
      g.kernel_h > 0 && g.kernel_w > 0,
      "deform_conv2d(): expected weight to have a non-empty kernel, but got shape ",
      shape_text(weight.sizes()));
  DEFORMCONV_CHECK_ARGUMENT(g.in_channels % groups == 0, "deform_conv2d(): expected in_channels (",
                            g.in_channels, ") to be divisible by groups (", groups, ")");
  DEFORMCONV_CHECK_ARGUMENT(g.out_channels % groups == 0,
                            "deform_conv2d(): expected out_channels (", g.out_channels,
                            ", weight.size(0)) to be divisible by groups (", groups, ")");
  DEFORMCONV_CHECK_ARGUMENT(weight.size(1) * groups == g.in_channels,
                            "deform_conv2d(): expected weight to have ", g.in_channels / groups,
                            " input channels (in_channels / groups = ", g.in_channels, " / ",
                            groups, "), but got ", weight.size(1));
  DEFORMCONV_CHECK_ARGUMENT(g.in_channels % offset_groups == 0,
                            "deform_conv2d(): expected in_channels (", g.in_channels,
                            ") to be divisible by offset_groups (", offset_groups, ")");

  const int64_t dilated_kernel_h = g.dilation_h * (g.kernel_h - 1) + 1;
  const int64_t dilated_kernel_w = g.dilation_w * (g.kernel_w - 1) + 1;
  DEFORMCONV_CHECK_ARGUMENT(
      g.in_height + 2 * g.pad_h >= dilated_kernel_h && g.in_width + 2 * g.pad_w >= dilated_kernel_w,
      "deform_conv2d(): expected the padded input (", g.in_height + 2 * g.pad_h, " x ",
      g.in_width + 2 * g.pad_w, ") to be at least as large as the dilated kernel (",
      dilated_kernel_h, " x ", dilated_kernel_w, "), so that the output is not empty");
  g.out_height = output_length(g.in_height, g.kernel_h, g.stride_h, g.pad_h, g.dilation_h);
  g.out_width = output_length(g.in_width, g.kernel_w, g.stride_w, g.pad_w, g.dilation_w);
  return g;
}

// A field of the output's pixels (offset, mask): its batch, channels and size.
void check_field(const DeformConv2dGeometry& g, int64_t batch, const char* name,
                 const Tensor& field, int64_t channels, const char* formula) {
  DEFORMCONV_CHECK_ARGUMENT(field.size(0) == batch, "deform_conv2d(): expected ", name,
                            " to have the batch size of input (", batch, "), but got ",
                            field.size(0));
  DEFORMCONV_CHECK_ARGUMENT(field.size(1) == channels, "deform_conv2d(): expected ", name,
                            " to have ", channels, " channels (", formula, "), but got ",
                            field.size(1));
  DEFORMCONV_CHECK_ARGUMENT(field.size(2) == g.out_height && field.size(3) == g.out_width,
                            "deform_conv2d(): expected ", name, " to have the output size ",
                            g.out_height, " x ", g.out_width, ", but got ", field.size(2), " x ",
                            field.size(3));
}

}  // namespace

// In this order, so that a call gets the error of its first fault: the tensors' ranks and
// dtypes, the scalars, the geometry, then the sizes of offset, mask and bias against it.
DeformConv2dGeometry check_deform_conv2d_arguments(
    const Tensor& input, const Tensor& offset, const Tensor& weight,
    const std::optional<Tensor>& mask, const std::optional<Tensor>& bias,
    const std::vector<int64_t>& stride, const std::vector<int64_t>& padding,
    const std::vector<int64_t>& dilation, int64_t groups, int64_t offset_groups,
    int64_t im2col_step) {
  check_tensors(input, offset, weight, mask, bias);
  check_scalars(stride, padding, dilation, groups, offset_groups, im2col_step);
  const DeformConv2dGeometry g =
      checked_geometry(input, weight, stride, padding, dilation, groups, offset_groups);
  const int64_t batch = input.size(0);
  check_field(g, batch, "offset", offset, 2 * offset_groups * g.taps(),
              "2 * offset_groups * kH * kW");
  if (mask.has_value()) {
    check_field(g, batch, "mask", *mask, offset_groups * g.taps(), "offset_groups * kH * kW");
  }
  if (bias.has_value()) {
    DEFORMCONV_CHECK_ARGUMENT(bias->size(0) == g.out_channels,
                              "deform_conv2d(): expected bias to have ", g.out_channels,
                              " elements (out_channels), but got ", bias->size(0));
  }
  return g;
}

DeformConv2dGeometry check_deform_conv2d_backward_arguments(
    const Tensor& grad_output, const Tensor& input, const Tensor& offset, const Tensor& weight,
    const std::optional<Tensor>& mask, const std::vector<int64_t>& stride,
    const std::vector<int64_t>& padding, const std::vector<int64_t>& dilation, int64_t groups,
    int64_t offset_groups, int64_t im2col_step) {
  const DeformConv2dGeometry g =
      check_deform_conv2d_arguments(input, offset, weight, mask, std::nullopt, stride, padding,
                                    dilation, groups, offset_groups, im2col_step);
  const std::vector<int64_t> output_shape = {input.size(0), g.out_channels, g.out_height,
                                             g.out_width};
  const torch::headeronly::IntHeaderOnlyArrayRef grad_output_shape = grad_output.sizes();
  DEFORMCONV_CHECK_ARGUMENT(
      std::vector<int64_t>(grad_output_shape.begin(), grad_output_shape.end()) == output_shape,
      "deform_conv2d_backward(): expected grad_output of shape ", shape_text(output_shape),
      ", but got ", shape_text(grad_output_shape));
  DEFORMCONV_CHECK_ARGUMENT(
      grad_output.scalar_type() == input.scalar_type(),
      "deform_conv2d_backward(): expected grad_output to have the dtype of input (",
      input.scalar_type(), "), but got ", grad_output.scalar_type());
  DEFORMCONV_CHECK_ARGUMENT(grad_output.device() == input.device(),
                            "deform_conv2d_backward(): expected grad_output to be on the device of "
                            "input (",
                            device_text(input.device()), "), but got ",
                            device_text(grad_output.device()));
  return g;
}

}  // namespace deformconv
