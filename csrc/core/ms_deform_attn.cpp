#include "ms_deform_attn.h"

#include <torch/csrc/stable/ops.h>
#include <torch/headeronly/core/ScalarType.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "../common/bilinear_sampling.cuh"
#include "../common/scalar_types.h"
#include "../infrastructure/argument_checks.h"
#include "../infrastructure/branch_trace.h"
#include "../infrastructure/tensor_text.h"

namespace deformconv {

namespace {

constexpr const char* kOp = "ms_deform_attn()";

using torch::headeronly::ScalarType;

void check_dtype(const char* name, const Tensor& tensor, ScalarType expected, const char* what) {
  DEFORMCONV_CHECK_ARGUMENT(tensor.scalar_type() == expected, kOp, ": expected ", name, " to have ",
                            what, " (", expected, "), but got ", tensor.scalar_type());
}

void check_shape(const char* name, const Tensor& tensor,
                 torch::headeronly::IntHeaderOnlyArrayRef shape, const char* layout) {
  DEFORMCONV_CHECK_ARGUMENT(tensor.sizes() == shape, kOp, ": expected ", name, " of shape ",
                            shape_text(shape), " ", layout, ", but got ",
                            shape_text(tensor.sizes()));
}

// The levels' sizes and starts against each other and against value's S rows: each level at
// least one pixel, starting where the one before it ends, the last ending at S. Reads the two
// small index tensors (from the GPU too: a synchronisation).
void check_levels(const Tensor& spatial_shapes, const Tensor& level_start_index, int64_t spatial) {
  const torch::stable::Device cpu(torch::headeronly::DeviceType::CPU);
  const auto on_the_cpu = [&](const Tensor& tensor) {
    return as_contiguous(tensor.is_cpu() ? tensor : torch::stable::to(tensor, cpu));
  };
  const Tensor shapes = on_the_cpu(spatial_shapes);
  const Tensor starts = on_the_cpu(level_start_index);
  const int64_t* shape = shapes.const_data_ptr<int64_t>();
  const int64_t* start = starts.const_data_ptr<int64_t>();
  int64_t end = 0;
  for (int64_t l = 0; l < shapes.size(0); ++l) {
    const int64_t height = shape[2 * l];
    const int64_t width = shape[2 * l + 1];
    DEFORMCONV_CHECK_ARGUMENT(
        height >= 1 && width >= 1 && height <= kMaxImageSide && width <= kMaxImageSide, kOp,
        ": expected spatial_shapes[", l, "] to be a (height, width) of 1 to ", kMaxImageSide,
        " each, but got (", height, ", ", width, ")");
    DEFORMCONV_CHECK_ARGUMENT(
        start[l] == end, kOp, ": expected level_start_index[", l, "] to be ", end,
        " (the pixels of the levels before it, by spatial_shapes), but got ", start[l]);
    // Both sides at most S before the product: no overflow on the way.
    DEFORMCONV_CHECK_ARGUMENT(
        height <= spatial && width <= spatial && height * width <= spatial - end, kOp,
        ": expected value to have as many rows (dimension 1, ", spatial,
        ") as spatial_shapes' levels have pixels, but level ", l, " (", height, " x ", width,
        ") ends past them");
    end += height * width;
  }
  DEFORMCONV_CHECK_ARGUMENT(end == spatial, kOp,
                            ": expected value to have as many rows (dimension 1, ", spatial,
                            ") as spatial_shapes' levels have pixels (", end, ")");
}

// Levels found valid, remembered for index tensors off the CPU, where reading them is a copy to
// the host that waits for the device: a synchronisation per call, which stalls the queue of
// kernels and which a CUDA graph capture refuses. The same two tensors, unmodified since (their
// version counters), against the same S, need no second look: a model passes one pair to all
// its layers, forward and backward. "The same" is the same memory, viewed alike: each entry
// holds its tensors, so that no other tensor can be allocated where they lie while it is
// remembered. Per thread (autograd runs the backward on its own), a few entries replaced in
// turn. Inference tensors keep no version counter and are read every time.
#ifdef DEFORMCONV_CUDA_EMULATION
// The emulated CUDA ops (tests/cuda_emulation) run the CUDA launchers on CPU tensors.
constexpr bool kCpuTensorsStandForDeviceTensors = true;
#else
constexpr bool kCpuTensorsStandForDeviceTensors = false;
#endif

// A tensor's version counter, or nothing for an inference tensor, which has none: through the
// ops aten::is_inference and aten::_version, the stable ABI having no accessor of either.
std::optional<int64_t> version_of(const Tensor& tensor) {
  const auto call = [&](const char* op) {
    std::array<StableIValue, 1> stack{torch::stable::detail::from(tensor)};
    STABLE_TORCH_ERROR_CODE_CHECK(torch_call_dispatcher(op, "", stack.data(), TORCH_ABI_VERSION));
    return stack[0];
  };
  if (torch::stable::detail::to<bool>(call("aten::is_inference"))) {
    return std::nullopt;
  }
  return torch::stable::detail::to<int64_t>(call("aten::_version"));
}

// The version counters of a pair of index tensors, read once per call.
struct Versions {
  int64_t shapes = 0;
  int64_t starts = 0;
  bool operator==(const Versions&) const = default;
};

class CheckedLevels {
 public:
  bool contains(const Tensor& shapes, const Tensor& starts, int64_t spatial,
                const Versions& versions) const {
    for (const Entry& entry : entries_) {
      if (entry.spatial == spatial && entry.versions == versions &&
          same_memory(entry.shapes, shapes) && same_memory(entry.starts, starts)) {
        return true;
      }
    }
    return false;
  }

  void add(const Tensor& shapes, const Tensor& starts, int64_t spatial, const Versions& versions) {
    entries_[next_] = {shapes, starts, versions, spatial};
    next_ = (next_ + 1) % entries_.size();
  }

  static bool rememberable(const Tensor& shapes) {
    return !shapes.is_cpu() || kCpuTensorsStandForDeviceTensors;
  }

 private:
  struct Entry {
    std::optional<Tensor> shapes;
    std::optional<Tensor> starts;
    Versions versions;
    int64_t spatial = -1;
  };

  static bool same_memory(const std::optional<Tensor>& held, const Tensor& tensor) {
    return held.has_value() && held->const_data_ptr() == tensor.const_data_ptr() &&
           held->device() == tensor.device() && held->sizes() == tensor.sizes() &&
           held->strides() == tensor.strides();
  }

  std::array<Entry, 4> entries_;
  std::size_t next_ = 0;
};

void check_levels_once(const Tensor& spatial_shapes, const Tensor& level_start_index,
                       int64_t spatial) {
  std::optional<int64_t> shapes_version;
  std::optional<int64_t> starts_version;
  if (CheckedLevels::rememberable(spatial_shapes)) {
    shapes_version = version_of(spatial_shapes);
    starts_version = version_of(level_start_index);
  }
  if (!shapes_version.has_value() || !starts_version.has_value()) {
    // On the CPU, or an inference tensor.
    check_levels(spatial_shapes, level_start_index, spatial);
    return;
  }
  const Versions versions{*shapes_version, *starts_version};
  thread_local CheckedLevels checked;
  if (!checked.contains(spatial_shapes, level_start_index, spatial, versions)) {
    check_levels(spatial_shapes, level_start_index, spatial);
    checked.add(spatial_shapes, level_start_index, spatial, versions);
  }
}

// points_per_level, not empty: a count of at least 0 for each of the `levels` levels, at most
// kMaxListedLevels of them; fills g's level_first.
void check_points_per_level(const std::vector<int64_t>& points_per_level, int64_t levels,
                            MsDeformAttnGeometry& g) {
  const int64_t listed = static_cast<int64_t>(points_per_level.size());
  DEFORMCONV_CHECK_ARGUMENT(listed == levels, kOp,
                            ": expected points_per_level to give a count for each of the ",
                            levels, " levels of spatial_shapes, but got ", listed, " counts");
  DEFORMCONV_CHECK_ARGUMENT(levels <= kMaxListedLevels, kOp,
                            ": expected points_per_level to list at most ", kMaxListedLevels,
                            " levels, but got ", levels);
  g.level_first[0] = 0;
  for (int64_t l = 0; l < levels; ++l) {
    const int64_t points = points_per_level[l];
    DEFORMCONV_CHECK_ARGUMENT(points >= 0 && points <= kMaxImageSide, kOp,
                              ": expected points_per_level[", l, "] to be 0 to ", kMaxImageSide,
                              ", but got ", points);
    g.level_first[l + 1] = g.level_first[l] + points;
  }
}

// The launchers' layout of the samples (P points on every level, or a count per level) and
// their sampling.
void record_samples(const MsDeformAttnGeometry& g) {
  record_branch(g.listed ? "ms_deform_attn.points.per_level" : "ms_deform_attn.points.every_level");
  record_branch(g.nearest ? "ms_deform_attn.sampling.nearest" : "ms_deform_attn.sampling.bilinear");
  record_branch(g.softmax ? "ms_deform_attn.weights.softmax" : "ms_deform_attn.weights.given");
}

}  // namespace

MsDeformAttnGeometry check_ms_deform_attn_arguments(
    const std::optional<Tensor>& grad_output, const Tensor& value, const Tensor& spatial_shapes,
    const Tensor& level_start_index, const Tensor& sampling_locations,
    const Tensor& attention_weights, int64_t im2col_step,
    const std::vector<int64_t>& points_per_level, const std::string& sampling, bool softmax) {
  DEFORMCONV_CHECK_ARGUMENT(is_op_dtype(value.scalar_type()), kOp,
                            ": expected value to have a floating point dtype (float16, bfloat16, "
                            "float32 or float64), but got ",
                            value.scalar_type());
  DEFORMCONV_CHECK_ARGUMENT(value.dim() == 4, kOp,
                            ": expected value to be a 4-D tensor (batch, "
                            "spatial, heads, channels), but got a ",
                            value.dim(), "-D tensor of shape ", shape_text(value.sizes()));
  check_dtype("spatial_shapes", spatial_shapes, ScalarType::Long, "an integer dtype");
  check_dtype("level_start_index", level_start_index, ScalarType::Long, "an integer dtype");
  DEFORMCONV_CHECK_ARGUMENT(
      spatial_shapes.dim() == 2 && spatial_shapes.size(1) == 2 && spatial_shapes.size(0) >= 1, kOp,
      ": expected spatial_shapes to be of shape (levels, 2), at least one "
      "level, but got shape ",
      shape_text(spatial_shapes.sizes()));
  const int64_t levels = spatial_shapes.size(0);
  check_shape("level_start_index", level_start_index, {levels}, "(levels,)");
  const int64_t N = value.size(0), S = value.size(1), M = value.size(2), D = value.size(3);
  check_dtype("sampling_locations", sampling_locations, value.scalar_type(), "the dtype of value");
  check_dtype("attention_weights", attention_weights, value.scalar_type(), "the dtype of value");
  MsDeformAttnGeometry g{};
  g.batch = N;
  g.spatial = S;
  g.heads = M;
  g.channels = D;
  g.levels = levels;
  DEFORMCONV_CHECK_ARGUMENT(sampling == "bilinear" || sampling == "nearest", kOp,
                            ": expected sampling to be \"bilinear\" or \"nearest\", but got \"",
                            sampling, "\"");
  g.nearest = sampling == "nearest";
  g.softmax = softmax;
  g.listed = !points_per_level.empty();
  if (g.listed) {
    check_points_per_level(points_per_level, levels, g);
    const int64_t samples = g.head_samples();
    DEFORMCONV_CHECK_ARGUMENT(sampling_locations.dim() == 5, kOp,
                              ": expected sampling_locations to be a 5-D tensor (batch, queries, "
                              "heads, sum of points_per_level, 2) with points_per_level, but got "
                              "a ",
                              sampling_locations.dim(), "-D tensor of shape ",
                              shape_text(sampling_locations.sizes()));
    g.queries = sampling_locations.size(1);
    check_shape("sampling_locations", sampling_locations, {N, g.queries, M, samples, 2},
                "(batch, queries, heads, sum of points_per_level, 2)");
    check_shape("attention_weights", attention_weights, {N, g.queries, M, samples},
                "(batch, queries, heads, sum of points_per_level)");
  } else {
    DEFORMCONV_CHECK_ARGUMENT(sampling_locations.dim() == 6, kOp,
                              ": expected sampling_locations to be "
                              "a 6-D tensor (batch, queries, heads, levels, points, 2), but got a ",
                              sampling_locations.dim(), "-D tensor of shape ",
                              shape_text(sampling_locations.sizes()));
    g.queries = sampling_locations.size(1);
    g.points = sampling_locations.size(4);
    check_shape("sampling_locations", sampling_locations, {N, g.queries, M, levels, g.points, 2},
                "(batch, queries, heads, levels, points, 2)");
    check_shape("attention_weights", attention_weights, {N, g.queries, M, levels, g.points},
                "(batch, queries, heads, levels, points)");
  }
  DEFORMCONV_CHECK_ARGUMENT(im2col_step >= 0, kOp,
                            ": expected im2col_step to be at least 0, but got ", im2col_step);
  if (grad_output.has_value()) {
    check_dtype("grad_output", *grad_output, value.scalar_type(), "the dtype of value");
    check_shape("grad_output", *grad_output, {N, g.queries, M * D},
                "(batch, queries, heads * channels)");
  }
  if (!is_meta(spatial_shapes) && !is_meta(level_start_index)) {
    check_levels_once(spatial_shapes, level_start_index, S);
  }
  return g;
}

Tensor ms_deform_attn_forward(const MsDeformAttnLaunchers& launchers, const Tensor& value,
                              const Tensor& spatial_shapes, const Tensor& level_start_index,
                              const Tensor& sampling_locations, const Tensor& attention_weights,
                              int64_t im2col_step, const std::vector<int64_t>& points_per_level,
                              const std::string& sampling, bool softmax) {
  const MsDeformAttnGeometry g = check_ms_deform_attn_arguments(
      std::nullopt, value, spatial_shapes, level_start_index, sampling_locations,
      attention_weights, im2col_step, points_per_level, sampling, softmax);
  Tensor output = new_contiguous(value, {g.batch, g.queries, g.heads * g.channels});
  if (output.numel() == 0) {
    return output;
  }
  if (g.head_samples() == 0) {
    // No samples: every query's sum is empty.
    return torch::stable::zero_(output);
  }
  record_samples(g);
  launchers.forward(g, as_contiguous(value), as_contiguous(spatial_shapes),
                    as_contiguous(level_start_index), as_contiguous(sampling_locations),
                    as_contiguous(attention_weights), output);
  return output;
}

std::tuple<Tensor, Tensor, Tensor> ms_deform_attn_backward(
    const MsDeformAttnLaunchers& launchers, const Tensor& grad_output, const Tensor& value,
    const Tensor& spatial_shapes, const Tensor& level_start_index, const Tensor& sampling_locations,
    const Tensor& attention_weights, int64_t im2col_step,
    const std::vector<int64_t>& points_per_level, const std::string& sampling, bool softmax,
    const std::vector<bool>& output_mask, bool deterministic) {
  check_output_mask("ms_deform_attn_backward()", output_mask, 3);
  const MsDeformAttnGeometry g = check_ms_deform_attn_arguments(
      grad_output, value, spatial_shapes, level_start_index, sampling_locations,
      attention_weights, im2col_step, points_per_level, sampling, softmax);
  const bool want_value = output_mask[0], want_locations = output_mask[1],
             want_weights = output_mask[2];
  // Contiguous whatever the operands' strides: the launchers index them so.
  const auto gradient_like = [](bool wanted, const Tensor& operand) {
    return wanted ? new_contiguous(operand, operand.sizes()) : Tensor();
  };
  Tensor grad_value = gradient_like(want_value, value);
  Tensor grad_locations = gradient_like(want_locations, sampling_locations);
  Tensor grad_weights = gradient_like(want_weights, attention_weights);
  if (!(want_value || want_locations || want_weights)) {
    return {grad_value, grad_locations, grad_weights};
  }
  if (grad_output.numel() == 0 || g.head_samples() == 0) {
    // No sample, or none that carries a gradient (no channels): every gradient is 0.
    for (Tensor* grad : {&grad_value, &grad_locations, &grad_weights}) {
      if (grad->defined()) {
        torch::stable::zero_(*grad);
      }
    }
    return {grad_value, grad_locations, grad_weights};
  }
  record_samples(g);
  launchers.gradients(g, as_contiguous(grad_output), as_contiguous(value),
                      as_contiguous(spatial_shapes), as_contiguous(level_start_index),
                      as_contiguous(sampling_locations), as_contiguous(attention_weights),
                      grad_value, grad_locations, grad_weights, deterministic);
  return {grad_value, grad_locations, grad_weights};
}

}  // namespace deformconv
