// deform_conv2d's schemas and its checks op. Each device registers the kernels in its
// launchers' file (Note [Device kernels], infrastructure/device_kernels.h); the Python package
// the Autograd, Autocast and fake kernels (deformconv/ops/).

#include <torch/csrc/stable/library.h>

#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "../core/deform_conv2d.h"
#include "../infrastructure/op_description.h"

namespace deformconv {
namespace {

// The argument checks as an op of their own, with no tensor data read, so that the Python fake
// kernels (deformconv/ops/) can run them on meta copies of fake tensors: torch.compile and
// torch.export then reject exactly what the op rejects, with the same messages. Returns the
// output shape.
std::vector<int64_t> check_deform_conv2d_arguments_op(
    const std::optional<Tensor>& grad_output, const Tensor& input, const Tensor& offset,
    const Tensor& weight, const std::optional<Tensor>& mask, const std::optional<Tensor>& bias,
    const std::vector<int64_t>& stride, const std::vector<int64_t>& padding,
    const std::vector<int64_t>& dilation, int64_t groups, int64_t offset_groups,
    int64_t im2col_step) {
  const DeformConv2dGeometry g =
      grad_output.has_value()
          ? check_deform_conv2d_backward_arguments(*grad_output, input, offset, weight, mask,
                                                   stride, padding, dilation, groups,
                                                   offset_groups, im2col_step)
          : check_deform_conv2d_arguments(input, offset, weight, mask, bias, stride, padding,
                                          dilation, groups, offset_groups, im2col_step);
  return {input.size(0), g.out_channels, g.out_height, g.out_width};
}

// Its parameters, in type and order, are kChecksSchema's (Note [Op descriptions]).
static_assert(std::is_same_v<decltype(check_deform_conv2d_arguments_op),
                             SchemaSignature<&DeformConv2dOp::kChecksSchema>>);

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(deformconv, m) {
  m.def(DeformConv2dOp::kSchema);
  m.def(DeformConv2dOp::kBackwardSchema);
  m.def(DeformConv2dOp::kChecksSchema);
}

STABLE_TORCH_LIBRARY_IMPL(deformconv, CompositeExplicitAutograd, m) {
  m.impl("_check_deform_conv2d_arguments", TORCH_BOX(&check_deform_conv2d_arguments_op));
}

}  // namespace deformconv
