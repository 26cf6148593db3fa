#pragma once

// The CUDA launchers of multi-scale deformable attention (ms_deform_attn_cuda.cu) and the CUDA
// kernels of its ops (ops_cuda.cpp), apart so that the test suite's CUDA emulation can run the
// kernels with the launchers.

#include <ATen/core/Tensor.h>

#include <array>
#include <tuple>

#include "../core/ms_deform_attn.h"

namespace deformconv {

const MsDeformAttnLaunchers& ms_deform_attn_cuda_launchers();

at::Tensor ms_deform_attn_cuda(const at::Tensor& value, const at::Tensor& spatial_shapes,
                               const at::Tensor& level_start_index,
                               const at::Tensor& sampling_locations,
                               const at::Tensor& attention_weights, int64_t im2col_step);

std::tuple<at::Tensor, at::Tensor, at::Tensor> ms_deform_attn_backward_cuda(
    const at::Tensor& grad_output, const at::Tensor& value, const at::Tensor& spatial_shapes,
    const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
    const at::Tensor& attention_weights, int64_t im2col_step, std::array<bool, 3> output_mask);

}  // namespace deformconv
