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

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <tuple>

#include "../common/dcnv3_kernel.cuh"

namespace deformconv {

// Every tensor is contiguous and channels-last, on the launchers' device; offsets and mask are
// read through `fields`. Gradients to be filled are allocated by the driver: grad_input zeroed
// (launchers add into it), grad_offset and grad_mask written in full. Any of the three may be
// undefined (not asked for), not all; the launchers choose whether to compute those asked for
// in one pass or several. The input and the output are never empty: the driver answers those
// cases itself (an image of no pixels has none for a launcher to read a corner's row at).
struct Dcnv3Launchers {
  void (*forward)(const Dcnv3Geometry& geometry, const Dcnv3Fields& fields, int64_t batch,
                  const at::Tensor& input, const at::Tensor& offset, const at::Tensor& mask,
                  at::Tensor& output);
  // grad_input, where asked for, comes uninitialised: the launcher writes all of it, zero
  // where no sample reaches (the CPU's, image by image just before the samples add into it,
  // while it is in the cache).
  void (*gradients)(const Dcnv3Geometry& geometry, const Dcnv3Fields& fields, int64_t batch,
                    const at::Tensor& grad_output, const at::Tensor& input,
                    const at::Tensor& offset, const at::Tensor& mask, at::Tensor& grad_input,
                    at::Tensor& grad_offset, at::Tensor& grad_mask);
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
Dcnv3Geometry check_dcnv3_arguments(const std::optional<at::Tensor>& grad_output,
                                    const at::Tensor& input, const at::Tensor& offset,
                                    const at::Tensor& mask, const Dcnv3Arguments& args);

// The drivers, over the schemas' arguments (schemas.h), which each device registers with its
// launchers (Note [Device kernels], infrastructure/device_kernels.h). DCNv4's take offset_mask
// where DCNv3's take offset, and no mask; their offset gradient is offset_mask's, zero in its
// padding. Gradients not selected by output_mask come back undefined.
at::Tensor dcnv3_forward(const Dcnv3Launchers& launchers, const at::Tensor& input,
                         const at::Tensor& offset, const at::Tensor& mask, int64_t kernel_h,
                         int64_t kernel_w, int64_t stride_h, int64_t stride_w, int64_t pad_h,
                         int64_t pad_w, int64_t dilation_h, int64_t dilation_w, int64_t group,
                         int64_t group_channels, double offset_scale, int64_t im2col_step,
                         bool remove_center);

std::tuple<at::Tensor, at::Tensor, at::Tensor> dcnv3_backward(
    const Dcnv3Launchers& launchers, const at::Tensor& grad_output, const at::Tensor& input,
    const at::Tensor& offset, const at::Tensor& mask, int64_t kernel_h, int64_t kernel_w,
    int64_t stride_h, int64_t stride_w, int64_t pad_h, int64_t pad_w, int64_t dilation_h,
    int64_t dilation_w, int64_t group, int64_t group_channels, double offset_scale,
    int64_t im2col_step, bool remove_center, std::array<bool, 3> output_mask);

at::Tensor dcnv4_forward(const Dcnv3Launchers& launchers, const at::Tensor& input,
                         const at::Tensor& offset_mask, int64_t kernel_h, int64_t kernel_w,
                         int64_t stride_h, int64_t stride_w, int64_t pad_h, int64_t pad_w,
                         int64_t dilation_h, int64_t dilation_w, int64_t group,
                         int64_t group_channels, double offset_scale, int64_t im2col_step,
                         bool remove_center);

std::tuple<at::Tensor, at::Tensor> dcnv4_backward(
    const Dcnv3Launchers& launchers, const at::Tensor& grad_output, const at::Tensor& input,
    const at::Tensor& offset_mask, int64_t kernel_h, int64_t kernel_w, int64_t stride_h,
    int64_t stride_w, int64_t pad_h, int64_t pad_w, int64_t dilation_h, int64_t dilation_w,
    int64_t group, int64_t group_channels, double offset_scale, int64_t im2col_step,
    bool remove_center, std::array<bool, 2> output_mask);

}  // namespace deformconv
