// ms_deform_attn's schemas and its checks op. Each device registers the kernels in its
// launchers' file (Note [Device kernels], infrastructure/device_kernels.h); the Python package
// the Autograd, Autocast and fake kernels (deformconv/ops/).

#include <torch/csrc/stable/library.h>

#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "../core/ms_deform_attn.h"
#include "../infrastructure/op_description.h"

namespace deformconv {
namespace {

// The argument checks of ms_deform_attn as an op of their own, for the fake kernels
// (deform_conv2d_registration.cpp says why): on meta tensors, the shapes only
// (check_ms_deform_attn_arguments). Returns the output shape.
std::vector<int64_t> check_ms_deform_attn_arguments_op(
    const std::optional<Tensor>& grad_output, const Tensor& value, const Tensor& spatial_shapes,
    const Tensor& level_start_index, const Tensor& sampling_locations,
    const Tensor& attention_weights, int64_t im2col_step,
    const std::vector<int64_t>& points_per_level, const std::string& sampling, bool softmax) {
  const MsDeformAttnGeometry g = check_ms_deform_attn_arguments(
      grad_output, value, spatial_shapes, level_start_index, sampling_locations,
      attention_weights, im2col_step, points_per_level, sampling, softmax);
  return {g.batch, g.queries, g.heads * g.channels};
}

// Its parameters, in type and order, are kChecksSchema's (Note [Op descriptions]).
static_assert(std::is_same_v<decltype(check_ms_deform_attn_arguments_op),
                             SchemaSignature<&MsDeformAttnOp::kChecksSchema>>);

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(deformconv, m) {
  m.def(MsDeformAttnOp::kSchema);
  m.def(MsDeformAttnOp::kBackwardSchema);
  m.def(MsDeformAttnOp::kChecksSchema);
}

STABLE_TORCH_LIBRARY_IMPL(deformconv, CompositeExplicitAutograd, m) {
  m.impl("_check_ms_deform_attn_arguments", TORCH_BOX(&check_ms_deform_attn_arguments_op));
}

}  // namespace deformconv
