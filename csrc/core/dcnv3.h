#pragma once

// DCNv3 (InternImage's core op) and DCNv4 (FlashInternImage's), docs/dcnv3_dcnv4.md:
// argument checks, the launcher table that cpu/ and cuda/ fill in, and the device-neutral
// driver. The ops have no columns and no GEMMs: each launcher walks samples or pixels
// directly, so memory beyond the outputs is the float32 input-gradient sums of half precision
// only, whatever the batch, and im2col_step (kept for the originals' signature) changes
// nothing.
//
// Note [DCNv4 is DCNv3 without a mask tensor]
// DCNv4 computes what DCNv3 computes, its offsets and mask packed in one tensor offset_mask.
// DCNv4's drivers (dcnv4_forward, dcnv4_backward) and the checks take offset_mask in DCNv3's
// offset slot and an undefined mask; the launchers read both through Dcnv3Fields and never
// see the difference.

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "../common/dcnv3_kernel.cuh"
#include "../infrastructure/stable_tensors.h"

namespace deformconv {

// Every tensor is contiguous and channels-last, on the launchers' device; offsets and mask are
// read through `fields`. Gradients to be filled are allocated by the driver: grad_input zeroed
// (launchers add into it), grad_offset and grad_mask written in full. Any of the three may be
// undefined (not asked for), not all; the launchers choose whether to compute those asked for
// in one pass or several. The input and the output are never empty: the driver answers those
// cases itself (an image of no pixels has none for a launcher to read a corner's row at).
struct Dcnv3Launchers {
  void (*forward)(const Dcnv3Geometry& geometry, const Dcnv3Fields& fields, int64_t batch,
                  const Tensor& input, const Tensor& offset, const Tensor& mask, Tensor& output);
  // grad_input, where asked for, comes uninitialised: the launcher writes all of it, zero
  // where no sample reaches (the CPU's, image by image just before the samples add into it,
  // while it is in the cache). With `deterministic`, the results are the same bits from run to
  // run (Note [Gathered input gradients], cuda/gathered_input_gradient.cuh); a device that is
  // so anyway ignores it.
  void (*gradients)(const Dcnv3Geometry& geometry, const Dcnv3Fields& fields, int64_t batch,
                    const Tensor& grad_output, const Tensor& input, const Tensor& offset,
                    const Tensor& mask, Tensor& grad_input, Tensor& grad_offset, Tensor& grad_mask,
                    bool deterministic);
};

// The scalar arguments of the op, in the originals' order.
struct Dcnv3Arguments {
  int64_t kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w;
  int64_t group, group_channels;
  double offset_scale;
  int64_t im2col_step;
  bool remove_center;
};

// Checks the operands of dcnv3, or of dcnv4 when mask is undefined (and grad_output, when
// given, of the backward) without reading tensor data; raises ValueError naming the argument.
// Returns the geometry.
Dcnv3Geometry check_dcnv3_arguments(const std::optional<Tensor>& grad_output, const Tensor& input,
                                    const Tensor& offset, const Tensor& mask,
                                    const Dcnv3Arguments& args);

// The drivers, over the schemas' arguments (Dcnv3Op, Dcnv4Op), which each device registers
// with its launchers (Note [Device kernels], infrastructure/device_kernels.h). DCNv4's take
// offset_mask where DCNv3's take offset, and no mask; their offset gradient is offset_mask's,
// zero in its padding. Gradients not selected by output_mask come back undefined.
Tensor dcnv3_forward(const Dcnv3Launchers& launchers, const Tensor& input, const Tensor& offset,
                     const Tensor& mask, int64_t kernel_h, int64_t kernel_w, int64_t stride_h,
                     int64_t stride_w, int64_t pad_h, int64_t pad_w, int64_t dilation_h,
                     int64_t dilation_w, int64_t group, int64_t group_channels, double offset_scale,
                     int64_t im2col_step, bool remove_center);

std::tuple<Tensor, Tensor, Tensor> dcnv3_backward(
    const Dcnv3Launchers& launchers, const Tensor& grad_output, const Tensor& input,
    const Tensor& offset, const Tensor& mask, int64_t kernel_h, int64_t kernel_w, int64_t stride_h,
    int64_t stride_w, int64_t pad_h, int64_t pad_w, int64_t dilation_h, int64_t dilation_w,
    int64_t group, int64_t group_channels, double offset_scale, int64_t im2col_step,
    bool remove_center, const std::vector<bool>& output_mask, bool deterministic);

Tensor dcnv4_forward(const Dcnv3Launchers& launchers, const Tensor& input,
                     const Tensor& offset_mask, int64_t kernel_h, int64_t kernel_w,
                     int64_t stride_h, int64_t stride_w, int64_t pad_h, int64_t pad_w,
                     int64_t dilation_h, int64_t dilation_w, int64_t group, int64_t group_channels,
                     double offset_scale, int64_t im2col_step, bool remove_center);

std::tuple<Tensor, Tensor> dcnv4_backward(
    const Dcnv3Launchers& launchers, const Tensor& grad_output, const Tensor& input,
    const Tensor& offset_mask, int64_t kernel_h, int64_t kernel_w, int64_t stride_h,
    int64_t stride_w, int64_t pad_h, int64_t pad_w, int64_t dilation_h, int64_t dilation_w,
    int64_t group, int64_t group_channels, double offset_scale, int64_t im2col_step,
    bool remove_center, const std::vector<bool>& output_mask, bool deterministic);

// The op's description (Note [Op descriptions], infrastructure/op_description.h).
struct Dcnv3Op {
  // DCNv3 (InternImage), arguments in the original DCNv3Function's order; channels-last shapes:
  // input (N, H, W, group * group_channels); offset (N, H_out, W_out, group * P * 2), x before y
  // for each point; mask (N, H_out, W_out, group * P), P = kernel_h * kernel_w - remove_center.
  // im2col_step is accepted for the originals' signature and changes nothing.
  static constexpr const char* kSchema =
      "dcnv3(Tensor input, Tensor offset, Tensor mask, int kernel_h, int kernel_w, int stride_h, "
      "int stride_w, int pad_h, int pad_w, int dilation_h, int dilation_w, int group, "
      "int group_channels, float offset_scale, int im2col_step, bool remove_center) -> Tensor";
  // Gradients of (input, offset, mask); output_mask selects which are computed.
  static constexpr const char* kBackwardSchema =
      "dcnv3_backward(Tensor grad_output, Tensor input, Tensor offset, Tensor mask, int kernel_h, "
      "int kernel_w, int stride_h, int stride_w, int pad_h, int pad_w, int dilation_h, "
      "int dilation_w, int group, int group_channels, float offset_scale, int im2col_step, "
      "bool remove_center, bool[3] output_mask, bool deterministic=False) "
      "-> (Tensor, Tensor, Tensor)";
  // The checks of dcnv3 (grad_output absent) or dcnv3_backward (present), reading no tensor
  // data; returns the output shape. For the fake kernels. Without a mask, those of dcnv4, the
  // offset tensor being offset_mask.
  static constexpr const char* kChecksSchema =
      "_check_dcnv3_arguments(Tensor? grad_output, Tensor input, Tensor offset, Tensor? mask, "
      "int kernel_h, int kernel_w, int stride_h, int stride_w, int pad_h, int pad_w, "
      "int dilation_h, int dilation_w, int group, int group_channels, float offset_scale, "
      "int im2col_step, bool remove_center) -> int[]";
  static constexpr const char* kName = "dcnv3";
  static constexpr std::array<size_t, 3> kGradientArguments = {0, 1, 2};
};

// The op's description (Note [Op descriptions], infrastructure/op_description.h).
struct Dcnv4Op {
  // DCNv4 (FlashInternImage), in the original DCNv4Function's order: dcnv3 with offsets and mask
  // packed in one tensor, offset_mask (N, H_out, W_out, C_pad), C_pad >= group * P * 3; group g
  // owns channels [3 P g, 3 P (g + 1)): the (x, y) pairs of its P points, then their P mask
  // values. Channels from group * P * 3 on are padding, never read.
  static constexpr const char* kSchema =
      "dcnv4(Tensor input, Tensor offset_mask, int kernel_h, int kernel_w, int stride_h, "
      "int stride_w, int pad_h, int pad_w, int dilation_h, int dilation_w, int group, "
      "int group_channels, float offset_scale, int im2col_step, bool remove_center) -> Tensor";
  // Gradients of (input, offset_mask), zero in offset_mask's padding; output_mask selects which
  // are computed.
  static constexpr const char* kBackwardSchema =
      "dcnv4_backward(Tensor grad_output, Tensor input, Tensor offset_mask, int kernel_h, "
      "int kernel_w, int stride_h, int stride_w, int pad_h, int pad_w, int dilation_h, "
      "int dilation_w, int group, int group_channels, float offset_scale, int im2col_step, "
      "bool remove_center, bool[2] output_mask, bool deterministic=False) "
      "-> (Tensor, Tensor)";
  static constexpr const char* kName = "dcnv4";
  static constexpr std::array<size_t, 2> kGradientArguments = {0, 1};
};

}  // namespace deformconv
