#pragma once

// The GEMMs of deformable convolution's windows, by bmm or as oneDNN 1x1 convolutions, and the
// weight in the layouts they take.

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "deform_conv2d_tiling.h"
#include "launchers.h"

namespace deformconv {

// The weight in the order of a columns row, per conv group: (G, C_out / G, K * C_in / G), its
// last dimension (tap, channel) as the columns have it, that is, for each output channel the
// transpose of its (C_in / G, K) matrix. In the launchers' scratch memory: a fresh buffer as
// large as the weight (9 MiB for 512 x 512 x 3 x 3) would fault in page by page every call.
at::Tensor weight_rows(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                       const at::Tensor& weight, const WorkSplit& w);

// Writes a weight gradient summed in weight_rows' order into grad_weight, in the weight's
// layout.
void store_weight_gradient(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                           const at::Tensor& rows, at::Tensor& grad_weight);

// Whether the windows' GEMMs run as oneDNN 1x1 convolutions: Note [GEMMs as 1x1
// convolutions] in deform_conv2d_gemms.cpp.
bool gemms_as_convolutions(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                           const at::Tensor& input);

// The weight as the GEMMs of the windows take it: weight_1x1 when as_convolution, else the
// per-group weight matrices repeated for every image of a block, so that one batched GEMM
// covers the whole block, (step * G, C_out / G, K * C_in / G).
at::Tensor gemm_weight(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                       const at::Tensor& weight, const WorkSplit& w, bool as_convolution);

// The forward GEMM of a window: output_window (images * G, C_out / G, window) = the weight
// times the window's columns, plus the bias, `weight` from gemm_weight.
void multiply_window(const WorkSplit& w, const PixelWindow& window, int64_t images,
                     const at::Tensor& columns, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias, bool as_convolution,
                     at::Tensor& output_window);

// The backward GEMMs of a window, for grad_output_window (images, G, C_out / G, window) and
// `weight` from gemm_weight. Adds the window's share of the weight gradient to
// grad_weight_rows when that is defined (`columns` then holds the window's columns), and
// returns the gradient of the window's columns when want_columns_grad, in the layout of the
// columns: a tensor of the convolution's, or the columns buffer itself, overwritten. The
// gradients the convolution made (those asked of it) are also put in `results`, for the caller
// to keep.
at::Tensor window_gradient_gemms(const WorkSplit& w, const PixelWindow& window, int64_t images,
                                 at::Tensor& columns, const at::Tensor& grad_output_window,
                                 const at::Tensor& weight,
                                 bool as_convolution, bool want_columns_grad,
                                 at::Tensor& grad_weight_rows,
                                 std::vector<at::Tensor>& results);

}  // namespace deformconv
