#pragma once

// Device-neutral driver of deformable convolution: argument checks, output allocation, the
// im2col_step blocking and the GEMMs. The CPU and CUDA registrations call it with their
// launchers.

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <array>
#include <optional>
#include <tuple>

#include "deform_conv2d_launchers.h"

namespace deformconv {

// Validates every argument of the op and returns its geometry; throws std::invalid_argument
// (ValueError in Python) with a message naming the argument, what was expected and what came.
DeformConv2dGeometry check_deform_conv2d_arguments(
    const at::Tensor& input, const at::Tensor& offset, const at::Tensor& weight,
    const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& bias,
    c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation,
    int64_t groups, int64_t offset_groups, int64_t im2col_step);

// The checks of the backward op: those of the forward, and grad_output's shape, dtype, device.
DeformConv2dGeometry check_deform_conv2d_backward_arguments(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& offset,
    const at::Tensor& weight, const std::optional<at::Tensor>& mask, c10::IntArrayRef stride,
    c10::IntArrayRef padding, c10::IntArrayRef dilation, int64_t groups, int64_t offset_groups,
    int64_t im2col_step);

at::Tensor deform_conv2d_forward(
    const DeformConv2dLaunchers& launchers, const at::Tensor& input, const at::Tensor& offset,
    const at::Tensor& weight, const std::optional<at::Tensor>& mask,
    const std::optional<at::Tensor>& bias, c10::IntArrayRef stride, c10::IntArrayRef padding,
    c10::IntArrayRef dilation, int64_t groups, int64_t offset_groups, int64_t im2col_step);

// Gradients of (input, offset, weight, mask, bias); output_mask says which are wanted, and the
// others come back undefined. grad_mask is undefined whenever mask is absent.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> deform_conv2d_backward(
    const DeformConv2dLaunchers& launchers, const at::Tensor& grad_output,
    const at::Tensor& input, const at::Tensor& offset, const at::Tensor& weight,
    const std::optional<at::Tensor>& mask, c10::IntArrayRef stride, c10::IntArrayRef padding,
    c10::IntArrayRef dilation, int64_t groups, int64_t offset_groups, int64_t im2col_step,
    std::array<bool, 5> output_mask);

}  // namespace deformconv
