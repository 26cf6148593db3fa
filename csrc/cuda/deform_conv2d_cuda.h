#pragma once

// The CUDA side of the ops: the launchers (deform_conv2d_cuda.cu: grid-stride kernels on the
// current stream) and the ops' CUDA kernels (ops_cuda.cpp: checks, device guard, driver), which
// register_cuda.cpp registers. The kernels take the launcher table so that the test suite's
// emulation build (tests/cuda_emulation) can run them with a smaller window budget.

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <array>
#include <optional>
#include <tuple>

#include "../core/deform_conv2d_launchers.h"

namespace deformconv {

const DeformConv2dLaunchers& deform_conv2d_cuda_launchers();

at::Tensor deform_conv2d_cuda_with_launchers(
    const DeformConv2dLaunchers& launchers, const at::Tensor& input, const at::Tensor& offset,
    const at::Tensor& weight, const std::optional<at::Tensor>& mask,
    const std::optional<at::Tensor>& bias, c10::IntArrayRef stride, c10::IntArrayRef padding,
    c10::IntArrayRef dilation, int64_t groups, int64_t offset_groups, int64_t im2col_step);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
deform_conv2d_backward_cuda_with_launchers(
    const DeformConv2dLaunchers& launchers, const at::Tensor& grad_output,
    const at::Tensor& input, const at::Tensor& offset, const at::Tensor& weight,
    const std::optional<at::Tensor>& mask, c10::IntArrayRef stride, c10::IntArrayRef padding,
    c10::IntArrayRef dilation, int64_t groups, int64_t offset_groups, int64_t im2col_step,
    std::array<bool, 5> output_mask);

}  // namespace deformconv
