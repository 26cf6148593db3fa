#pragma once

// The CPU launchers of DCN v1/v2, one file per stage (im2col_cpu.cpp, fused_forward_cpu.cpp,
// col2im_cpu.cpp, transpose_cpu.cpp), the GEMMs (onednn_gemms_cpu.cpp) and the scratch memory
// (scratch_pool.cpp), which deform_conv2d_cpu.cpp gathers into the CPU's launcher table
// (core/deform_conv2d_launchers.h says what each does).

#include <ATen/core/Tensor.h>

#include "../core/deform_conv2d_launchers.h"

namespace deformconv {

void make_plans_cpu(const DeformConv2dGeometry& g, const PixelWindow& window, int64_t batch,
                    const at::Tensor& offset, const at::Tensor& mask, at::Tensor& plans);

void im2col_cpu(const DeformConv2dGeometry& g, const PixelWindow& window, int64_t batch,
                const at::Tensor& input, const WindowSampling& sampling, at::Tensor& columns);

void fused_forward_cpu(const DeformConv2dGeometry& g, int64_t batch, const at::Tensor& input,
                       const at::Tensor& offset, const at::Tensor& mask,
                       const at::Tensor& weight_taps, const at::Tensor& bias,
                       at::Tensor& output);

bool fused_forward_pays_cpu(const DeformConv2dGeometry& g, at::ScalarType dtype);

void column_gradients_cpu(const DeformConv2dGeometry& g, const PixelWindow& window,
                          int64_t batch, const at::Tensor& grad_columns, const at::Tensor& input,
                          const WindowSampling& sampling, at::Tensor& grad_input,
                          at::Tensor& grad_offset, at::Tensor& grad_mask);

void transpose_cpu(const at::Tensor& src, at::Tensor& dst);

at::Tensor scratch_cpu(c10::IntArrayRef sizes, const at::TensorOptions& options);

// oneDNN's 1x1 convolutions or bmm: onednn_gemms_cpu.cpp.
const WindowGemms& window_gemms_cpu(const DeformConv2dGeometry& g, at::ScalarType dtype);

}  // namespace deformconv
