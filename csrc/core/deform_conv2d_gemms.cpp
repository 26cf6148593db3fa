#include "deform_conv2d_gemms.h"

#include <ATen/ATen.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <array>
#include <optional>

#include "../infrastructure/branch_trace.h"

namespace deformconv {

namespace {

// weight_rows repeated for every image of a block: (step * G, C_out / G, K * C_in / G).
at::Tensor bmm_weight(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                      const at::Tensor& weight, const WorkSplit& w) {
  return weight_rows(launchers, g, weight, w)
      .unsqueeze(0)
      .expand({w.step, w.groups, w.out_per_group, w.rows_per_group})
      .reshape({w.step * w.groups, w.out_per_group, w.rows_per_group});
}

void bmm_forward(const WorkSplit& w, const PixelWindow& window, int64_t images,
                 const at::Tensor& columns, const at::Tensor& weight,
                 const std::optional<at::Tensor>& bias, at::Tensor& output_window) {
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

at::Tensor bmm_backward(const WorkSplit& w, const PixelWindow& window, int64_t images,
                        at::Tensor& columns, const at::Tensor& grad_output_window,
                        const at::Tensor& weight, bool want_columns_grad,
                        at::Tensor& grad_weight_rows) {
  const at::Tensor columns_block = columns_of_window(columns, w, window, images);
  if (grad_weight_rows.defined()) {
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

// Note [The weight gradient in its own memory]
// The GEMMs sum the weight gradient in weight_rows' order, (tap, channel) in a row, where a
// contiguous weight has (channel, tap). Summed in a buffer of its own, it held memory as large
// as the weight through the whole backward, on top of grad_weight (9 MiB each for 512 x 512 x
// 3 x 3). Instead:
// - a channels-last grad_weight, (C_out, kh, kw, C_in / G) in memory, is in that order already:
//   the GEMMs add into it;
// - a contiguous one holds the sums in its own memory, and each output channel's (K, C_in / G)
//   matrix is transposed in place at the end, a share of the output channels at a time through
//   a copy (at most an eighth of the weight);
// - grad_weight of other strides gets a buffer, copied into it at the end.
namespace {

enum class WeightGradientLayout { kRows, kTransposedInPlace, kOwnBuffer };

WeightGradientLayout weight_gradient_layout(const at::Tensor& grad_weight) {
  if (grad_weight.permute({0, 2, 3, 1}).is_contiguous()) {
    return WeightGradientLayout::kRows;
  }
  return grad_weight.is_contiguous() ? WeightGradientLayout::kTransposedInPlace
                                     : WeightGradientLayout::kOwnBuffer;
}

constexpr int64_t kTransposeShares = 8;

}  // namespace

at::Tensor weight_gradient_rows(const WorkSplit& w, at::Tensor& grad_weight) {
  const std::array<int64_t, 3> rows_shape{w.groups, w.out_per_group, w.rows_per_group};
  switch (weight_gradient_layout(grad_weight)) {
    case WeightGradientLayout::kRows:
      record_branch("deform_conv2d.weight_gradient.rows_layout");
      return grad_weight.zero_().permute({0, 2, 3, 1}).view(rows_shape);
    case WeightGradientLayout::kTransposedInPlace:
      record_branch("deform_conv2d.weight_gradient.transposed_in_place");
      return grad_weight.zero_().view(rows_shape);
    case WeightGradientLayout::kOwnBuffer:
      break;
  }
  record_branch("deform_conv2d.weight_gradient.own_buffer");
  return at::zeros(rows_shape, grad_weight.options());
}

void store_weight_gradient(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                           const at::Tensor& rows, at::Tensor& grad_weight) {
  const at::Tensor matrices = rows.view({g.out_channels, g.taps(), g.channels_per_group()});
  switch (weight_gradient_layout(grad_weight)) {
    case WeightGradientLayout::kRows:
      return;
    case WeightGradientLayout::kTransposedInPlace: {
      at::Tensor planes = grad_weight.view({g.out_channels, g.channels_per_group(), g.taps()});
      const int64_t share = (g.out_channels + kTransposeShares - 1) / kTransposeShares;
      for (int64_t first = 0; first < g.out_channels; first += share) {
        const int64_t count = std::min(share, g.out_channels - first);
        at::Tensor copy = launchers.scratch({count, g.taps(), g.channels_per_group()},
                                            grad_weight.options());
        copy.copy_(matrices.narrow(0, first, count));
        at::Tensor planes_share = planes.narrow(0, first, count);
        launchers.transpose(copy, planes_share);
      }
      return;
    }
    case WeightGradientLayout::kOwnBuffer:
      grad_weight.copy_(
          matrices.view({g.out_channels, g.kernel_h, g.kernel_w, g.channels_per_group()})
              .permute({0, 3, 1, 2}));
      return;
  }
}

const WindowGemms& bmm_window_gemms() {
  // A bmm on one thread, for grouped convolutions, runs slower than on all: the forward keeps
  // its stages rather than give whole windows to threads.
  static const WindowGemms gemms{
      .forward_branch = "deform_conv2d.forward.bmm",
      .gradients_branch = "deform_conv2d.backward.bmm",
      .windows_per_thread_pay = false,
      .weight = bmm_weight,
      .forward = bmm_forward,
      .gradients = bmm_backward,
  };
  return gemms;
}

}  // namespace deformconv
