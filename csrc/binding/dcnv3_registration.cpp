// DCNv3's and DCNv4's schemas and their checks op. Each device registers the kernels in its
// launchers' file (Note [Device kernels], infrastructure/device_kernels.h); the Python package
// the Autograd, Autocast and fake kernels (deformconv/ops/).

#include <torch/csrc/stable/library.h>

#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "../core/dcnv3.h"
#include "../infrastructure/op_description.h"

namespace deformconv {
namespace {

// The argument checks of dcnv3, or of dcnv4 without a mask, as an op of their own that reads
// no tensor data, for the fake kernels (deform_conv2d_registration.cpp says why). Returns the
// output shape.
std::vector<int64_t> check_dcnv3_arguments_op(const std::optional<Tensor>& grad_output,
                                              const Tensor& input, const Tensor& offset,
                                              const std::optional<Tensor>& mask, int64_t kernel_h,
                                              int64_t kernel_w, int64_t stride_h, int64_t stride_w,
                                              int64_t pad_h, int64_t pad_w, int64_t dilation_h,
                                              int64_t dilation_w, int64_t group,
                                              int64_t group_channels, double offset_scale,
                                              int64_t im2col_step, bool remove_center) {
  const Dcnv3Geometry g = check_dcnv3_arguments(
      grad_output, input, offset, mask.value_or(Tensor()),
      {kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w, group,
       group_channels, offset_scale, im2col_step, remove_center});
  return {input.size(0), g.out_height, g.out_width, g.channels()};
}

// Its parameters, in type and order, are kChecksSchema's (Note [Op descriptions]).
static_assert(std::is_same_v<decltype(check_dcnv3_arguments_op),
                             SchemaSignature<&Dcnv3Op::kChecksSchema>>);

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(deformconv, m) {
  m.def(Dcnv3Op::kSchema);
  m.def(Dcnv3Op::kBackwardSchema);
  m.def(Dcnv4Op::kSchema);
  m.def(Dcnv4Op::kBackwardSchema);
  m.def(Dcnv3Op::kChecksSchema);
}

STABLE_TORCH_LIBRARY_IMPL(deformconv, CompositeExplicitAutograd, m) {
  m.impl("_check_dcnv3_arguments", TORCH_BOX(&check_dcnv3_arguments_op));
}

}  // namespace deformconv
