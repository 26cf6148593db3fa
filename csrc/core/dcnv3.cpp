#include "dcnv3.h"

#include <torch/csrc/stable/ops.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "../common/output_length.h"
#include "../common/scalar_types.h"
#include "../infrastructure/argument_checks.h"
#include "../infrastructure/tensor_text.h"

namespace deformconv {

namespace {

// The op in messages: dcnv3, or dcnv4 without a mask (Note [DCNv4 is DCNv3 without a mask
// tensor]).
const char* op_name(const Tensor& mask) { return mask.defined() ? "dcnv3()" : "dcnv4()"; }

// A 4-D channels-last tensor of input's dtype whose sizes are those of `shape`: all four, or
// with `any_channels` the first three, its last size (DCNv4's offset_mask channels, checked by
// the caller) left free; `layout` names the dimensions for the message.
void check_nhwc(const char* op, const char* name, const Tensor& tensor, const Tensor& input,
                std::array<int64_t, 4> shape, bool any_channels, const char* layout) {
  DEFORMCONV_CHECK_ARGUMENT(tensor.dim() == 4, op, ": expected ", name, " to be a 4-D tensor ",
                            layout, ", but got a ", tensor.dim(), "-D tensor of shape ",
                            shape_text(tensor.sizes()));
  DEFORMCONV_CHECK_ARGUMENT(tensor.scalar_type() == input.scalar_type(), op, ": expected ", name,
                            " to have the dtype of input (", input.scalar_type(), "), but got ",
                            tensor.scalar_type());
  if (any_channels) {
    shape[3] = tensor.size(3);
  }
  DEFORMCONV_CHECK_ARGUMENT(tensor.sizes() == torch::headeronly::IntHeaderOnlyArrayRef(shape), op,
                            ": expected ", name, " of shape ", shape_text(shape), " ", layout,
                            ", but got ", shape_text(tensor.sizes()));
}

// Where the launchers find the offsets and mask: DCNv3's separate tensors, or DCNv4's packed
// offset_mask (channels per pixel C_pad, 3 P per group).
Dcnv3Fields dcnv3_fields(const Dcnv3Geometry& g, const Tensor& offset, const Tensor& mask) {
  const int64_t P = g.points();
  if (mask.defined()) {
    return {2 * g.groups * P, 2 * P, g.groups * P, P};
  }
  return {offset.size(3), 3 * P, offset.size(3), 3 * P};
}

// What the launchers index as the mask (or, given gradients, as its gradient): DCNv3's own
// tensor, or DCNv4's offset_mask from its first group's mask values on, indexed through
// dcnv3_fields' strides.
Tensor mask_slots(const Dcnv3Geometry& g, Tensor offset, const Tensor& mask) {
  if (mask.defined()) {
    return mask;
  }
  return torch::stable::narrow(offset, 3, 2 * g.points(), offset.size(3) - 2 * g.points());
}

}  // namespace

Dcnv3Geometry check_dcnv3_arguments(const std::optional<Tensor>& grad_output, const Tensor& input,
                                    const Tensor& offset, const Tensor& mask,
                                    const Dcnv3Arguments& a) {
  const char* op = op_name(mask);
  DEFORMCONV_CHECK_ARGUMENT(is_op_dtype(input.scalar_type()), op,
                            ": expected input to have a floating point dtype (float16, bfloat16, "
                            "float32 or float64), but got ",
                            input.scalar_type());
  DEFORMCONV_CHECK_ARGUMENT(input.dim() == 4, op,
                            ": expected input to be a 4-D tensor (batch, "
                            "height, width, channels), but got a ",
                            input.dim(), "-D tensor of shape ", shape_text(input.sizes()));
  const auto at_least = [op](const char* name, int64_t value, int64_t minimum) {
    DEFORMCONV_CHECK_ARGUMENT(value >= minimum, op, ": expected ", name, " to be at least ",
                              minimum, ", but got ", value);
  };
  at_least("kernel_h", a.kernel_h, 1);
  at_least("kernel_w", a.kernel_w, 1);
  at_least("stride_h", a.stride_h, 1);
  at_least("stride_w", a.stride_w, 1);
  at_least("pad_h", a.pad_h, 0);
  at_least("pad_w", a.pad_w, 0);
  at_least("dilation_h", a.dilation_h, 1);
  at_least("dilation_w", a.dilation_w, 1);
  at_least("group", a.group, 1);
  at_least("group_channels", a.group_channels, 1);
  at_least("im2col_step", a.im2col_step, 0);
  DEFORMCONV_CHECK_ARGUMENT(std::isfinite(a.offset_scale), op,
                            ": expected offset_scale to be finite, but got ", a.offset_scale);
  DEFORMCONV_CHECK_ARGUMENT(!a.remove_center || a.kernel_h * a.kernel_w > 1, op,
                            ": remove_center needs a kernel of more than one point, but got ",
                            a.kernel_h, " x ", a.kernel_w);
  DEFORMCONV_CHECK_ARGUMENT(input.size(3) == a.group * a.group_channels, op,
                            ": expected input to have group * group_channels = ", a.group, " * ",
                            a.group_channels, " = ", a.group * a.group_channels,
                            " channels (its last dimension), but got ", input.size(3));

  DEFORMCONV_CHECK_ARGUMENT(input.size(1) <= kMaxImageSide && input.size(2) <= kMaxImageSide, op,
                            ": expected input's height and width to be at most ", kMaxImageSide,
                            ", but got ", input.size(1), " x ", input.size(2));
  Dcnv3Geometry g{};
  g.height = input.size(1);
  g.width = input.size(2);
  g.groups = a.group;
  g.group_channels = a.group_channels;
  g.kernel_h = a.kernel_h;
  g.kernel_w = a.kernel_w;
  g.stride_h = a.stride_h;
  g.stride_w = a.stride_w;
  g.pad_h = a.pad_h;
  g.pad_w = a.pad_w;
  g.dilation_h = a.dilation_h;
  g.dilation_w = a.dilation_w;
  g.remove_center = a.remove_center;
  g.offset_scale = a.offset_scale;
  const int64_t span_h = a.dilation_h * (a.kernel_h - 1) + 1;
  const int64_t span_w = a.dilation_w * (a.kernel_w - 1) + 1;
  DEFORMCONV_CHECK_ARGUMENT(g.height + 2 * a.pad_h >= span_h && g.width + 2 * a.pad_w >= span_w, op,
                            ": expected the padded input (", g.height + 2 * a.pad_h, " x ",
                            g.width + 2 * a.pad_w,
                            ") to be at least as large as the dilated kernel (", span_h, " x ",
                            span_w, "), so that the output is not empty");
  g.out_height = output_length(g.height, a.kernel_h, a.stride_h, a.pad_h, a.dilation_h);
  g.out_width = output_length(g.width, a.kernel_w, a.stride_w, a.pad_w, a.dilation_w);

  const int64_t N = input.size(0);
  const int64_t points = g.groups * g.points();
  if (mask.defined()) {
    check_nhwc(op, "offset", offset, input, {N, g.out_height, g.out_width, 2 * points}, false,
               "(batch, out_height, out_width, group * points * 2)");
    check_nhwc(op, "mask", mask, input, {N, g.out_height, g.out_width, points}, false,
               "(batch, out_height, out_width, group * points)");
  } else {
    check_nhwc(op, "offset_mask", offset, input, {N, g.out_height, g.out_width, 0}, true,
               "(batch, out_height, out_width, channels)");
    DEFORMCONV_CHECK_ARGUMENT(
        offset.size(3) >= 3 * points, op,
        ": expected offset_mask to have at least group * points * 3 = ", a.group, " * ", g.points(),
        " * 3 = ", 3 * points, " channels (its last dimension), but got ", offset.size(3));
  }
  if (grad_output.has_value()) {
    check_nhwc(op, "grad_output", *grad_output, input,
               {N, g.out_height, g.out_width, g.channels()}, false,
               "(batch, out_height, out_width, channels)");
  }
  return g;
}

namespace {

// The drivers over the gathered arguments, mask undefined for DCNv4.
Tensor forward(const Dcnv3Launchers& launchers, const Tensor& input_arg, const Tensor& offset_arg,
               const Tensor& mask_arg, const Dcnv3Arguments& args) {
  const Dcnv3Geometry g =
      check_dcnv3_arguments(std::nullopt, input_arg, offset_arg, mask_arg, args);
  const int64_t batch = input_arg.size(0);
  Tensor output = new_contiguous(input_arg, {batch, g.out_height, g.out_width, g.channels()});
  if (input_arg.numel() == 0) {
    // Nothing to sample (no image pixels, padded to an output): every sample is 0.
    torch::stable::zero_(output);
  } else if (output.numel() > 0) {
    const Tensor offset = as_contiguous(offset_arg);
    const Tensor mask = mask_arg.defined() ? as_contiguous(mask_arg) : Tensor();
    launchers.forward(g, dcnv3_fields(g, offset, mask), batch, as_contiguous(input_arg), offset,
                      mask_slots(g, offset, mask), output);
  }
  return output;
}

std::tuple<Tensor, Tensor, Tensor> backward(const Dcnv3Launchers& launchers,
                                            const Tensor& grad_output_arg, const Tensor& input_arg,
                                            const Tensor& offset_arg, const Tensor& mask_arg,
                                            const Dcnv3Arguments& args,
                                            const std::array<bool, 3>& output_mask,
                                            bool deterministic) {
  const Dcnv3Geometry g =
      check_dcnv3_arguments(grad_output_arg, input_arg, offset_arg, mask_arg, args);
  const bool packed = !mask_arg.defined();
  const auto [want_input, want_offset, want_own_mask] = output_mask;
  const bool want_mask = packed ? want_offset : want_own_mask;
  const int64_t batch = input_arg.size(0);
  const Tensor grad_output = as_contiguous(grad_output_arg);
  const Tensor input = as_contiguous(input_arg);
  const Tensor offset = as_contiguous(offset_arg);
  const Tensor mask = packed ? Tensor() : as_contiguous(mask_arg);
  const Dcnv3Fields fields = dcnv3_fields(g, offset, mask);
  // The launchers zero the input gradient (Dcnv3Launchers::backward). Every sample writes its
  // own offset and mask gradients, so they need no zeroing, except where no sample writes:
  // DCNv4's padding, and everything when nothing is sampled.
  Tensor grad_input = want_input ? new_contiguous(input, input.sizes()) : Tensor();
  Tensor grad_offset = want_offset ? new_contiguous(offset, offset.sizes()) : Tensor();
  Tensor grad_mask = packed || !want_mask ? Tensor() : new_contiguous(mask, mask.sizes());
  if (grad_output.numel() == 0 || input.numel() == 0) {
    for (Tensor* grad : {&grad_input, &grad_offset, &grad_mask}) {
      if (grad->defined()) {
        torch::stable::zero_(*grad);
      }
    }
    return {grad_input, grad_offset, grad_mask};
  }
  if (!(want_input || want_offset || want_mask)) {
    return {grad_input, grad_offset, grad_mask};
  }
  if (packed && want_offset) {
    const int64_t used = 3 * g.groups * g.points();
    Tensor padding = torch::stable::narrow(grad_offset, 3, used, offset.size(3) - used);
    torch::stable::zero_(padding);
  }
  Tensor grad_mask_slots = packed && want_mask ? mask_slots(g, grad_offset, mask) : grad_mask;
  launchers.gradients(g, fields, batch, grad_output, input, offset, mask_slots(g, offset, mask),
                      grad_input, grad_offset, grad_mask_slots, deterministic);
  return {grad_input, grad_offset, grad_mask};
}

}  // namespace

Tensor dcnv3_forward(const Dcnv3Launchers& launchers, const Tensor& input, const Tensor& offset,
                     const Tensor& mask, int64_t kernel_h, int64_t kernel_w, int64_t stride_h,
                     int64_t stride_w, int64_t pad_h, int64_t pad_w, int64_t dilation_h,
                     int64_t dilation_w, int64_t group, int64_t group_channels, double offset_scale,
                     int64_t im2col_step, bool remove_center) {
  return forward(launchers, input, offset, mask,
                 {kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w,
                  group, group_channels, offset_scale, im2col_step, remove_center});
}

std::tuple<Tensor, Tensor, Tensor> dcnv3_backward(
    const Dcnv3Launchers& launchers, const Tensor& grad_output, const Tensor& input,
    const Tensor& offset, const Tensor& mask, int64_t kernel_h, int64_t kernel_w, int64_t stride_h,
    int64_t stride_w, int64_t pad_h, int64_t pad_w, int64_t dilation_h, int64_t dilation_w,
    int64_t group, int64_t group_channels, double offset_scale, int64_t im2col_step,
    bool remove_center, const std::vector<bool>& output_mask, bool deterministic) {
  check_output_mask("dcnv3_backward()", output_mask, 3);
  return backward(launchers, grad_output, input, offset, mask,
                  {kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w,
                   group, group_channels, offset_scale, im2col_step, remove_center},
                  {output_mask[0], output_mask[1], output_mask[2]}, deterministic);
}

Tensor dcnv4_forward(const Dcnv3Launchers& launchers, const Tensor& input,
                     const Tensor& offset_mask, int64_t kernel_h, int64_t kernel_w,
                     int64_t stride_h, int64_t stride_w, int64_t pad_h, int64_t pad_w,
                     int64_t dilation_h, int64_t dilation_w, int64_t group, int64_t group_channels,
                     double offset_scale, int64_t im2col_step, bool remove_center) {
  return forward(launchers, input, offset_mask, Tensor(),
                 {kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w,
                  group, group_channels, offset_scale, im2col_step, remove_center});
}

std::tuple<Tensor, Tensor> dcnv4_backward(
    const Dcnv3Launchers& launchers, const Tensor& grad_output, const Tensor& input,
    const Tensor& offset_mask, int64_t kernel_h, int64_t kernel_w, int64_t stride_h,
    int64_t stride_w, int64_t pad_h, int64_t pad_w, int64_t dilation_h, int64_t dilation_w,
    int64_t group, int64_t group_channels, double offset_scale, int64_t im2col_step,
    bool remove_center, const std::vector<bool>& output_mask, bool deterministic) {
  check_output_mask("dcnv4_backward()", output_mask, 2);
  auto [grad_input, grad_offset_mask, no_mask_gradient] =
      backward(launchers, grad_output, input, offset_mask, Tensor(),
               {kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w, group,
                group_channels, offset_scale, im2col_step, remove_center},
               {output_mask[0], output_mask[1], false}, deterministic);
  return {grad_input, grad_offset_mask};
}

}  // namespace deformconv
