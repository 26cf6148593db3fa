#include "deform_conv2d_gemms.h"

#include <ATen/ATen.h>
#include <c10/util/irange.h>

namespace deformconv {

namespace {

// The columns of `images` images of `window` as the channels-last image of the Note,
// (images, K * C_in, 1, window pixels).
at::Tensor columns_as_image(const at::Tensor& columns, const WorkSplit& w,
                            const PixelWindow& window, int64_t images) {
  return columns_of_window(columns, w, window, images).permute({0, 2, 1}).unsqueeze(2);
}

// The weight as the 1x1 convolution of the Note takes it: (C_out, K * C_in, 1, 1), its input
// channels in the order of a columns row.
at::Tensor weight_1x1(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                      const at::Tensor& weight, const WorkSplit& w) {
  return weight_rows(launchers, g, weight, w)
      .view({w.groups * w.out_per_group, w.rows_per_group, 1, 1});
}

}  // namespace

at::Tensor weight_rows(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                       const at::Tensor& weight, const WorkSplit& w) {
  at::Tensor rows =
      launchers.scratch({w.groups, w.out_per_group, w.rows_per_group}, weight.options());
  at::Tensor matrices = rows.view({g.out_channels, g.taps(), g.channels_per_group()});
  launchers.transpose(weight.contiguous().view({g.out_channels, g.channels_per_group(), g.taps()}),
                      matrices);
  return rows;
}

void store_weight_gradient(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                           const at::Tensor& rows, at::Tensor& grad_weight) {
  const at::Tensor matrices = rows.view({g.out_channels, g.taps(), g.channels_per_group()});
  if (grad_weight.is_contiguous()) {
    at::Tensor planes = grad_weight.view({g.out_channels, g.channels_per_group(), g.taps()});
    launchers.transpose(matrices, planes);
  } else {
    grad_weight.copy_(
        matrices.view({g.out_channels, g.kernel_h, g.kernel_w, g.channels_per_group()})
            .permute({0, 3, 1, 2}));
  }
}

// Note [GEMMs as 1x1 convolutions]
// With one conv group, the columns of a window are, image by image, a channels-last image of
// `window` pixels and K * C_in channels, (images, window, K * C_in). The forward GEMM is then a
// 1x1 convolution of that image with the weight as (C_out, K * C_in, 1, 1), and the columns
// gradient is that convolution's input gradient. On the CPU in float32, ATen runs them on
// oneDNN's convolution kernels, the ones dense convolution runs on, where ATen's bmm runs on
// MKL's sgemm, which is tuned for Intel's CPUs rather than AMD's. Elsewhere (float64, half
// precision, conv groups, launchers without onednn_gemms such as CUDA's, no oneDNN), the
// driver multiplies with bmm.
bool gemms_as_convolutions(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                           const at::Tensor& input) {
  return launchers.onednn_gemms && g.groups == 1 && input.scalar_type() == at::kFloat &&
      at::hasMKLDNN() && at::globalContext().userEnabledMkldnn();
}

at::Tensor gemm_weight(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                       const at::Tensor& weight, const WorkSplit& w, bool as_convolution) {
  if (as_convolution) {
    return weight_1x1(launchers, g, weight, w);
  }
  return weight_rows(launchers, g, weight, w)
      .unsqueeze(0)
      .expand({w.step, w.groups, w.out_per_group, w.rows_per_group})
      .reshape({w.step * w.groups, w.out_per_group, w.rows_per_group});
}

void multiply_window(const WorkSplit& w, const PixelWindow& window, int64_t images,
                     const at::Tensor& columns, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias, bool as_convolution,
                     at::Tensor& output_window) {
  if (as_convolution) {
    // (images, C_out, 1, window), channels-last.
    const at::Tensor product = at::mkldnn_convolution(columns_as_image(columns, w, window, images),
                                                      weight, bias, {0, 0}, {1, 1}, {1, 1}, 1);
    output_window.copy_(product.squeeze(2));
    return;
  }
  const at::Tensor weight_block = weight.narrow(0, 0, images * w.groups);
  // (images * G, K * C_in / G, window): the transposed columns, as the GEMM takes them.
  const at::Tensor columns_block = columns_of_window(columns, w, window, images).transpose(1, 2);
  if (bias.has_value()) {
    output_window.view({images, w.groups, w.out_per_group, window.pixels})
        .copy_(bias->view({1, w.groups, w.out_per_group, 1}));
    output_window.baddbmm_(weight_block, columns_block);
  } else {
    at::bmm_out(output_window, weight_block, columns_block);
  }
}

// Note [A window's gradients outlive it]
// With the GEMMs as convolutions, ATen allocates each backward window's columns gradient and
// weight gradient afresh, megabytes each. Freed at the end of their window, they are often the
// top of glibc's heap, which free() hands back to the kernel once the top passes its trim
// threshold; the next window's are then faulted in again page by page, each page zeroed by the
// kernel, window after window and call after call. So the CPU launchers keep a window's
// results (keep_window_results) until the next window's have been made, in this call or the
// next: the older ones then lie below the new ones, and their memory is reused. What stays
// held between calls is one window's GEMM results, up to a bound.

at::Tensor window_gradient_gemms(const WorkSplit& w, const PixelWindow& window, int64_t images,
                                 at::Tensor& columns, const at::Tensor& grad_output_window,
                                 const at::Tensor& weight,
                                 bool as_convolution, bool want_columns_grad,
                                 at::Tensor& grad_weight_rows,
                                 std::vector<at::Tensor>& results) {
  const bool want_weight = grad_weight_rows.defined();
  if (as_convolution) {
    // The convolution's gradients: of its input, the columns image (images, K * C_in, 1,
    // window), channels-last as the input is, which is the columns layout; of its weight, the
    // window's share of weight_rows.
    const auto [grad_image, grad_weight_window, grad_bias] = at::convolution_backward(
        grad_output_window.squeeze(1).unsqueeze(2), columns_as_image(columns, w, window, images),
        weight, std::nullopt, {1, 1}, {0, 0}, {1, 1}, false, {0, 0}, 1,
        {want_columns_grad, want_weight, false});
    if (want_weight) {
      grad_weight_rows.add_(grad_weight_window.view_as(grad_weight_rows));
      results.push_back(grad_weight_window);
    }
    if (!want_columns_grad) {
      return at::Tensor();
    }
    results.push_back(grad_image);
    return grad_image.permute({0, 2, 3, 1}).reshape({-1});
  }
  const at::Tensor columns_block = columns_of_window(columns, w, window, images);
  if (want_weight) {
    const at::Tensor columns_grouped =
        columns_block.view({images, w.groups, window.pixels, w.rows_per_group});
    for (const auto n : c10::irange(images)) {
      grad_weight_rows.baddbmm_(grad_output_window[n], columns_grouped[n]);
    }
  }
  if (!want_columns_grad) {
    return at::Tensor();
  }
  at::Tensor grad_columns = columns_block;  // the same buffer, reused
  at::bmm_out(grad_columns,
              grad_output_window.reshape({images * w.groups, w.out_per_group, window.pixels})
                  .transpose(1, 2),
              weight.narrow(0, 0, images * w.groups));
  return columns;
}

}  // namespace deformconv
