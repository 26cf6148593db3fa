#pragma once

// Multi-scale deformable attention (common/ms_deform_attn_kernel.cuh): argument checks, the
// launcher table that cpu/ and cuda/ fill in, and the device-neutral driver. Like DCNv3, the op
// has no columns: memory beyond the outputs is the float32 value-gradient sums of half
// precision only, and im2col_step (kept for the originals' signature) changes nothing.

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "../common/ms_deform_attn_kernel.cuh"
#include "../infrastructure/stable_tensors.h"

namespace deformconv {

// Every tensor is contiguous and on the launchers' device; spatial_shapes and
// level_start_index are int64 and checked consistent with value (each level inside its rows).
// The output and the gradients are never empty here: the driver answers those cases itself.
struct MsDeformAttnLaunchers {
  void (*forward)(const MsDeformAttnGeometry& geometry, const Tensor& value,
                  const Tensor& spatial_shapes, const Tensor& level_start_index,
                  const Tensor& sampling_locations, const Tensor& attention_weights,
                  Tensor& output);
  // Any of the gradients may be undefined (not asked for), not all. grad_value comes
  // uninitialised: the launcher writes all of it, zero where no sample reaches; the other two
  // are written in full, a value per sample. With `deterministic`, the results are the same
  // bits from run to run (Note [Gathered input gradients], cuda/gathered_input_gradient.cuh); a
  // device that is so anyway ignores it.
  void (*gradients)(const MsDeformAttnGeometry& geometry, const Tensor& grad_output,
                    const Tensor& value, const Tensor& spatial_shapes,
                    const Tensor& level_start_index, const Tensor& sampling_locations,
                    const Tensor& attention_weights, Tensor& grad_value,
                    Tensor& grad_sampling_locations, Tensor& grad_attention_weights,
                    bool deterministic);
};

// Checks the operands of ms_deform_attn (and grad_output, when given, of its backward); raises
// ValueError naming the argument. The levels' sizes and starts are read and checked against
// value's S unless the tensors are on the meta device (the fake kernels' case), where only
// shapes exist; off the CPU, where reading them waits for the device, once for a pair of index
// tensors as long as neither is modified. Returns the geometry.
MsDeformAttnGeometry check_ms_deform_attn_arguments(
    const std::optional<Tensor>& grad_output, const Tensor& value, const Tensor& spatial_shapes,
    const Tensor& level_start_index, const Tensor& sampling_locations,
    const Tensor& attention_weights, int64_t im2col_step,
    const std::vector<int64_t>& points_per_level, const std::string& sampling, bool softmax);

Tensor ms_deform_attn_forward(const MsDeformAttnLaunchers& launchers, const Tensor& value,
                              const Tensor& spatial_shapes, const Tensor& level_start_index,
                              const Tensor& sampling_locations, const Tensor& attention_weights,
                              int64_t im2col_step, const std::vector<int64_t>& points_per_level,
                              const std::string& sampling, bool softmax);

// Gradients of (value, sampling_locations, attention_weights), those not selected by
// output_mask undefined.
std::tuple<Tensor, Tensor, Tensor> ms_deform_attn_backward(
    const MsDeformAttnLaunchers& launchers, const Tensor& grad_output, const Tensor& value,
    const Tensor& spatial_shapes, const Tensor& level_start_index, const Tensor& sampling_locations,
    const Tensor& attention_weights, int64_t im2col_step,
    const std::vector<int64_t>& points_per_level, const std::string& sampling, bool softmax,
    const std::vector<bool>& output_mask, bool deterministic);

// The op's description (Note [Op descriptions], infrastructure/op_description.h).
struct MsDeformAttnOp {
  // Multi-scale deformable attention (Deformable DETR), in the original MSDeformAttnFunction's
  // order: value (N, S, M, D), the levels' pixels stacked along S; spatial_shapes (L, 2) int64,
  // each level's (H, W); level_start_index (L,) int64, where each level starts in S;
  // sampling_locations (N, Lq, M, L, P, 2), normalised (x, y); attention_weights (N, Lq, M, L, P),
  // used as given. Output (N, Lq, M * D). im2col_step is accepted for the originals' signature
  // and changes nothing. points_per_level, where not empty, gives each level's number of
  // points (transformers' multi_scale_deformable_attention_v2): sampling_locations is then
  // (N, Lq, M, sum of the points, 2) and attention_weights (N, Lq, M, sum), level 0's first.
  // sampling: "bilinear", or "nearest" (ms_deform_attn_nearest_pixel). softmax: the weights are
  // logits, normalised over each (query, head)'s samples in the op (SoftmaxNormaliser); their
  // gradient is the logits'.
  static constexpr const char* kSchema =
      "ms_deform_attn(Tensor value, Tensor spatial_shapes, Tensor level_start_index, "
      "Tensor sampling_locations, Tensor attention_weights, int im2col_step, "
      "int[] points_per_level=[], str sampling=\"bilinear\", bool softmax=False) -> Tensor";
  // Gradients of (value, sampling_locations, attention_weights); output_mask selects which are
  // computed.
  static constexpr const char* kBackwardSchema =
      "ms_deform_attn_backward(Tensor grad_output, Tensor value, Tensor spatial_shapes, "
      "Tensor level_start_index, Tensor sampling_locations, Tensor attention_weights, "
      "int im2col_step, int[] points_per_level, str sampling, bool softmax, bool[3] output_mask, "
      "bool deterministic=False) -> (Tensor, Tensor, Tensor)";
  // The checks of ms_deform_attn (grad_output absent) or its backward (present) that read no
  // floating-point data: on meta tensors, the shapes only; on others, spatial_shapes and
  // level_start_index too. Returns the output shape. For the fake kernels.
  static constexpr const char* kChecksSchema =
      "_check_ms_deform_attn_arguments(Tensor? grad_output, Tensor value, Tensor spatial_shapes, "
      "Tensor level_start_index, Tensor sampling_locations, Tensor attention_weights, "
      "int im2col_step, int[] points_per_level, str sampling, bool softmax) -> int[]";
  static constexpr const char* kName = "ms_deform_attn";
  // spatial_shapes and level_start_index are integer tensors, without gradients.
  static constexpr std::array<size_t, 3> kGradientArguments = {0, 3, 4};
};

}  // namespace deformconv
