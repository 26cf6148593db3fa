#pragma once

// Device-neutral driver of deformable convolution: argument checks, output allocation, the
// im2col_step blocking and the GEMMs. The CPU and CUDA registrations call it with their
// launchers.

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "deform_conv2d_launchers.h"

namespace deformconv {

// Validates every argument of the op and returns its geometry; throws std::invalid_argument
// (ValueError in Python) with a message naming the argument, what was expected and what came.
DeformConv2dGeometry check_deform_conv2d_arguments(
    const Tensor& input, const Tensor& offset, const Tensor& weight,
    const std::optional<Tensor>& mask, const std::optional<Tensor>& bias,
    const std::vector<int64_t>& stride, const std::vector<int64_t>& padding,
    const std::vector<int64_t>& dilation, int64_t groups, int64_t offset_groups,
    int64_t im2col_step);

// The checks of the backward op: those of the forward, and grad_output's shape, dtype, device.
DeformConv2dGeometry check_deform_conv2d_backward_arguments(
    const Tensor& grad_output, const Tensor& input, const Tensor& offset, const Tensor& weight,
    const std::optional<Tensor>& mask, const std::vector<int64_t>& stride,
    const std::vector<int64_t>& padding, const std::vector<int64_t>& dilation, int64_t groups,
    int64_t offset_groups, int64_t im2col_step);

Tensor deform_conv2d_forward(const DeformConv2dLaunchers& launchers, const Tensor& input,
                             const Tensor& offset, const Tensor& weight,
                             const std::optional<Tensor>& mask, const std::optional<Tensor>& bias,
                             const std::vector<int64_t>& stride,
                             const std::vector<int64_t>& padding,
                             const std::vector<int64_t>& dilation, int64_t groups,
                             int64_t offset_groups, int64_t im2col_step);

// Gradients of (input, offset, weight, mask, bias); output_mask says which are wanted, and the
// others come back undefined. grad_mask is undefined whenever mask is absent.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> deform_conv2d_backward(
    const DeformConv2dLaunchers& launchers, const Tensor& grad_output, const Tensor& input,
    const Tensor& offset, const Tensor& weight, const std::optional<Tensor>& mask,
    const std::vector<int64_t>& stride, const std::vector<int64_t>& padding,
    const std::vector<int64_t>& dilation, int64_t groups, int64_t offset_groups,
    int64_t im2col_step, const std::vector<bool>& output_mask, bool deterministic);

// The op's description (Note [Op descriptions], infrastructure/op_description.h).
struct DeformConv2dOp {
  // DCN v1 without a mask, v2 with one. Shapes: input (N, C_in, H, W); offset
  // (N, 2 * offset_groups * kH * kW, H_out, W_out), y before x for each tap; weight
  // (C_out, C_in / groups, kH, kW); mask (N, offset_groups * kH * kW, H_out, W_out);
  // bias (C_out). im2col_step: images per im2col block, 0 for automatic.
  static constexpr const char* kSchema =
      "deform_conv2d(Tensor input, Tensor offset, Tensor weight, Tensor? mask, Tensor? bias, "
      "SymInt[2] stride, SymInt[2] padding, SymInt[2] dilation, int groups, int offset_groups, "
      "int im2col_step) -> Tensor";
  // Gradients of (input, offset, weight, mask, bias); output_mask selects which are computed,
  // the others are returned undefined (None in Python). It takes every argument but bias, whose
  // gradient needs only grad_output.
  static constexpr const char* kBackwardSchema =
      "deform_conv2d_backward(Tensor grad_output, Tensor input, Tensor offset, Tensor weight, "
      "Tensor? mask, SymInt[2] stride, SymInt[2] padding, SymInt[2] dilation, int groups, "
      "int offset_groups, int im2col_step, bool[5] output_mask, bool deterministic=False) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor)";
  // The checks of deform_conv2d (grad_output absent) or of deform_conv2d_backward (present),
  // reading no tensor data; returns the output shape. For the fake kernels.
  static constexpr const char* kChecksSchema =
      "_check_deform_conv2d_arguments(Tensor? grad_output, Tensor input, Tensor offset, "
      "Tensor weight, Tensor? mask, Tensor? bias, SymInt[2] stride, SymInt[2] padding, "
      "SymInt[2] dilation, int groups, int offset_groups, int im2col_step) -> int[]";
  static constexpr const char* kName = "deform_conv2d";
  static constexpr std::array<size_t, 5> kGradientArguments = {0, 1, 2, 3, 4};
};

}  // namespace deformconv
