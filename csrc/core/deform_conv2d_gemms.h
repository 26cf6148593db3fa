#pragma once

// The GEMMs of deformable convolution's windows by bmm, which every device can run, and the
// weight in the order of a columns row, which every device's GEMMs take.

#include "deform_conv2d_tiling.h"
#include "deform_conv2d_launchers.h"

namespace deformconv {

// The weight in the order of a columns row, per conv group: (G, C_out / G, K * C_in / G), its
// last dimension (tap, channel) as the columns have it, that is, for each output channel the
// transpose of its (C_in / G, K) matrix. In the launchers' scratch memory: a fresh buffer as
// large as the weight (9 MiB for 512 x 512 x 3 x 3) would fault in page by page every call.
Tensor weight_rows(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                   const Tensor& weight, const WorkSplit& w);

// The weight gradient in weight_rows' order, (G, C_out / G, K * C_in / G), zeroed, for the
// windows' GEMMs to add into (Note [The weight gradient in its own memory]).
Tensor weight_gradient_rows(const WorkSplit& w, Tensor& grad_weight);

// Puts the weight gradient that the GEMMs summed in weight_gradient_rows' tensor into
// grad_weight's layout.
void store_weight_gradient(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                           const Tensor& rows, Tensor& grad_weight);

// The windows' GEMMs as batched matrix products (infrastructure/matrix_products.h): the weight's
// per-group matrices repeated for every image of a block, so that one bmm covers the whole block.
const WindowGemms& bmm_window_gemms();

}  // namespace deformconv
