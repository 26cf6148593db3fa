#pragma once

// The Autograd kernels of the ops (deform_conv2d_autograd.cpp, dcnv3_autograd.cpp,
// ms_deform_attn_autograd.cpp), which register_autograd.cpp registers.

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <array>
#include <optional>
#include <tuple>

#include "dcnv3.h"

namespace deformconv {

at::Tensor deform_conv2d_autograd(const at::Tensor& input, const at::Tensor& offset,
                                  const at::Tensor& weight, const std::optional<at::Tensor>& mask,
                                  const std::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                                  c10::IntArrayRef padding, c10::IntArrayRef dilation,
                                  int64_t groups, int64_t offset_groups, int64_t im2col_step);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
deform_conv2d_backward_autograd(const at::Tensor& grad_output, const at::Tensor& input,
                                const at::Tensor& offset, const at::Tensor& weight,
                                const std::optional<at::Tensor>& mask, c10::IntArrayRef stride,
                                c10::IntArrayRef padding, c10::IntArrayRef dilation,
                                int64_t groups, int64_t offset_groups, int64_t im2col_step,
                                std::array<bool, 5> output_mask);

// Of dcnv3, and of dcnv4 through dcnv4_kernel (dcnv3.h).
at::Tensor dcnv3_autograd(const at::Tensor& input, const at::Tensor& offset,
                          const at::Tensor& mask, const Dcnv3Arguments& a);

std::tuple<at::Tensor, at::Tensor, at::Tensor> dcnv3_backward_autograd(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& offset,
    const at::Tensor& mask, const Dcnv3Arguments& a, std::array<bool, 3> output_mask);

// Of ms_deform_attn (ms_deform_attn_autograd.cpp).
at::Tensor ms_deform_attn_autograd(const at::Tensor& value, const at::Tensor& spatial_shapes,
                                   const at::Tensor& level_start_index,
                                   const at::Tensor& sampling_locations,
                                   const at::Tensor& attention_weights, int64_t im2col_step);

std::tuple<at::Tensor, at::Tensor, at::Tensor> ms_deform_attn_backward_autograd(
    const at::Tensor& grad_output, const at::Tensor& value, const at::Tensor& spatial_shapes,
    const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
    const at::Tensor& attention_weights, int64_t im2col_step, std::array<bool, 3> output_mask);

}  // namespace deformconv
