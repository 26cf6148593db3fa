#include "ms_deform_attn.h"

#include <ATen/ops/empty.h>
#include <c10/core/ScalarType.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "../common/bilinear_sampling.cuh"
#include "../infrastructure/argument_checks.h"

namespace deformconv {

namespace {

constexpr const char* kOp = "ms_deform_attn()";

void check_dtype(const char* name, const at::Tensor& tensor, at::ScalarType expected,
                 const char* what) {
  DEFORMCONV_CHECK_ARGUMENT(tensor.scalar_type() == expected, kOp, ": expected ", name, " to have ",
                            what, " (", expected, "), but got ", tensor.scalar_type());
}

void check_shape(const char* name, const at::Tensor& tensor, c10::IntArrayRef shape,
                 const char* layout) {
  DEFORMCONV_CHECK_ARGUMENT(tensor.sizes() == shape, kOp, ": expected ", name, " of shape ", shape,
                            " ", layout, ", but got ", tensor.sizes());
}

// The levels' sizes and starts against each other and against value's S rows: each level at
// least one pixel, starting where the one before it ends, the last ending at S. Reads the two
// small index tensors (from the GPU too: a synchronisation).
void check_levels(const at::Tensor& spatial_shapes, const at::Tensor& level_start_index,
                  int64_t spatial) {
  const at::Tensor shapes = spatial_shapes.to(at::kCPU).contiguous();
  const at::Tensor starts = level_start_index.to(at::kCPU).contiguous();
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
// its layers, forward and backward. Held weakly, so that a tensor freed and another allocated at
// its address cannot match. Per thread (autograd runs the backward on its own), a few entries
// replaced in turn. Inference tensors keep no version counter and are read every time.
#ifdef DEFORMCONV_CUDA_EMULATION
// The emulated CUDA ops (tests/cuda_emulation) run the CUDA launchers on CPU tensors.
constexpr bool kCpuTensorsStandForDeviceTensors = true;
#else
constexpr bool kCpuTensorsStandForDeviceTensors = false;
#endif

class CheckedLevels {
 public:
  bool contains(const at::Tensor& shapes, const at::Tensor& starts, int64_t spatial) const {
    for (const Entry& entry : entries_) {
      if (entry.spatial == spatial && same(entry.shapes, entry.shapes_version, shapes) &&
          same(entry.starts, entry.starts_version, starts)) {
        return true;
      }
    }
    return false;
  }

  void add(const at::Tensor& shapes, const at::Tensor& starts, int64_t spatial) {
    entries_[next_] = {Weak(shapes.getIntrusivePtr()), Weak(starts.getIntrusivePtr()),
                       shapes._version(), starts._version(), spatial};
    next_ = (next_ + 1) % entries_.size();
  }

  static bool rememberable(const at::Tensor& shapes, const at::Tensor& starts) {
    return (!shapes.is_cpu() || kCpuTensorsStandForDeviceTensors) && !shapes.is_inference() &&
           !starts.is_inference();
  }

 private:
  using Weak = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  struct Entry {
    Weak shapes{c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>()};
    Weak starts{c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>()};
    int64_t shapes_version = 0;
    int64_t starts_version = 0;
    int64_t spatial = -1;
  };

  static bool same(const Weak& held, int64_t version, const at::Tensor& tensor) {
    const auto alive = held.lock();
    return alive.get() == tensor.unsafeGetTensorImpl() && tensor._version() == version;
  }

  std::array<Entry, 4> entries_;
  std::size_t next_ = 0;
};

void check_levels_once(const at::Tensor& spatial_shapes, const at::Tensor& level_start_index,
                       int64_t spatial) {
  if (!CheckedLevels::rememberable(spatial_shapes, level_start_index)) {
    check_levels(spatial_shapes, level_start_index, spatial);
    return;
  }
  thread_local CheckedLevels checked;
  if (!checked.contains(spatial_shapes, level_start_index, spatial)) {
    check_levels(spatial_shapes, level_start_index, spatial);
    checked.add(spatial_shapes, level_start_index, spatial);
  }
}

}  // namespace

MsDeformAttnGeometry check_ms_deform_attn_arguments(
    const std::optional<at::Tensor>& grad_output, const at::Tensor& value,
    const at::Tensor& spatial_shapes, const at::Tensor& level_start_index,
    const at::Tensor& sampling_locations, const at::Tensor& attention_weights,
    int64_t im2col_step) {
  DEFORMCONV_CHECK_ARGUMENT(at::isFloatingType(value.scalar_type()), kOp,
                            ": expected value to have a floating point dtype (float16, bfloat16, "
                            "float32 or float64), but got ",
                            value.scalar_type());
  DEFORMCONV_CHECK_ARGUMENT(value.dim() == 4, kOp,
                            ": expected value to be a 4-D tensor (batch, "
                            "spatial, heads, channels), but got a ",
                            value.dim(), "-D tensor of shape ", value.sizes());
  check_dtype("spatial_shapes", spatial_shapes, at::kLong, "an integer dtype");
  check_dtype("level_start_index", level_start_index, at::kLong, "an integer dtype");
  DEFORMCONV_CHECK_ARGUMENT(
      spatial_shapes.dim() == 2 && spatial_shapes.size(1) == 2 && spatial_shapes.size(0) >= 1, kOp,
      ": expected spatial_shapes to be of shape (levels, 2), at least one "
      "level, but got shape ",
      spatial_shapes.sizes());
  const int64_t levels = spatial_shapes.size(0);
  check_shape("level_start_index", level_start_index, {levels}, "(levels,)");
  const int64_t N = value.size(0), S = value.size(1), M = value.size(2), D = value.size(3);
  check_dtype("sampling_locations", sampling_locations, value.scalar_type(), "the dtype of value");
  check_dtype("attention_weights", attention_weights, value.scalar_type(), "the dtype of value");
  DEFORMCONV_CHECK_ARGUMENT(sampling_locations.dim() == 6, kOp,
                            ": expected sampling_locations to be "
                            "a 6-D tensor (batch, queries, heads, levels, points, 2), but got a ",
                            sampling_locations.dim(), "-D tensor of shape ",
                            sampling_locations.sizes());
  const int64_t Lq = sampling_locations.size(1), P = sampling_locations.size(4);
  check_shape("sampling_locations", sampling_locations, {N, Lq, M, levels, P, 2},
              "(batch, queries, heads, levels, points, 2)");
  check_shape("attention_weights", attention_weights, {N, Lq, M, levels, P},
              "(batch, queries, heads, levels, points)");
  DEFORMCONV_CHECK_ARGUMENT(im2col_step >= 0, kOp,
                            ": expected im2col_step to be at least 0, but got ", im2col_step);
  if (grad_output.has_value()) {
    check_dtype("grad_output", *grad_output, value.scalar_type(), "the dtype of value");
    check_shape("grad_output", *grad_output, {N, Lq, M * D}, "(batch, queries, heads * channels)");
  }
  if (!spatial_shapes.is_meta() && !level_start_index.is_meta()) {
    check_levels_once(spatial_shapes, level_start_index, S);
  }
  return {N, S, M, D, Lq, levels, P};
}

at::Tensor ms_deform_attn_forward(const MsDeformAttnLaunchers& launchers,
                                  const at::Tensor& value, const at::Tensor& spatial_shapes,
                                  const at::Tensor& level_start_index,
                                  const at::Tensor& sampling_locations,
                                  const at::Tensor& attention_weights, int64_t im2col_step) {
  const MsDeformAttnGeometry g =
      check_ms_deform_attn_arguments(std::nullopt, value, spatial_shapes, level_start_index,
                                     sampling_locations, attention_weights, im2col_step);
  at::Tensor output = at::empty({g.batch, g.queries, g.heads * g.channels}, value.options());
  if (output.numel() == 0) {
    return output;
  }
  if (g.points == 0) {
    // No samples: every query's sum is empty.
    return output.zero_();
  }
  launchers.forward(g, value.contiguous(), spatial_shapes.contiguous(),
                    level_start_index.contiguous(), sampling_locations.contiguous(),
                    attention_weights.contiguous(), output);
  return output;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ms_deform_attn_backward(
    const MsDeformAttnLaunchers& launchers, const at::Tensor& grad_output,
    const at::Tensor& value, const at::Tensor& spatial_shapes,
    const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
    const at::Tensor& attention_weights, int64_t im2col_step, std::array<bool, 3> output_mask) {
  const MsDeformAttnGeometry g = check_ms_deform_attn_arguments(
      grad_output, value, spatial_shapes, level_start_index, sampling_locations,
      attention_weights, im2col_step);
  const auto [want_value, want_locations, want_weights] = output_mask;
  // Contiguous whatever the operands' strides: the launchers index them so.
  const auto gradient_like = [](bool wanted, const at::Tensor& operand) {
    return wanted ? at::empty(operand.sizes(), operand.options()) : at::Tensor();
  };
  at::Tensor grad_value = gradient_like(want_value, value);
  at::Tensor grad_locations = gradient_like(want_locations, sampling_locations);
  at::Tensor grad_weights = gradient_like(want_weights, attention_weights);
  if (!(want_value || want_locations || want_weights)) {
    return {grad_value, grad_locations, grad_weights};
  }
  if (grad_output.numel() == 0 || g.points == 0) {
    // No sample, or none that carries a gradient (no channels): every gradient is 0.
    for (at::Tensor* grad : {&grad_value, &grad_locations, &grad_weights}) {
      if (grad->defined()) {
        grad->zero_();
      }
    }
    return {grad_value, grad_locations, grad_weights};
  }
  launchers.gradients(g, grad_output.contiguous(), value.contiguous(), spatial_shapes.contiguous(),
                     level_start_index.contiguous(), sampling_locations.contiguous(),
                     attention_weights.contiguous(), grad_value, grad_locations, grad_weights);
  return {grad_value, grad_locations, grad_weights};
}

}  // namespace deformconv
