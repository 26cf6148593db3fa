#include "deform_conv2d_gemms.h"

#include <algorithm>
#include <array>
#include <optional>

#include "../infrastructure/branch_trace.h"
#include "../infrastructure/matrix_products.h"
#include "../infrastructure/tensor_views.h"

namespace deformconv {

namespace {

// weight_rows repeated for every image of a block: (step * G, C_out / G, K * C_in / G). With one
// conv group, a view whose matrices are all the same memory (stride 0); with more, a copy: the
// groups' matrices repeat with the images, which no single stride describes.
Tensor bmm_weight(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                  const Tensor& weight, const WorkSplit& w) {
  const Tensor rows = weight_rows(launchers, g, weight, w);
  const int64_t matrix = w.out_per_group * w.rows_per_group;
  if (w.groups == 1) {
    return views::strided(rows, {w.step, w.out_per_group, w.rows_per_group},
                          {0, w.rows_per_group, 1});
  }
  const Tensor repeated =
      views::strided(rows, {w.step, w.groups, w.out_per_group, w.rows_per_group},
                     {0, matrix, w.rows_per_group, 1});
  return views::view(torch::stable::contiguous(repeated),
                     {w.step * w.groups, w.out_per_group, w.rows_per_group});
}

void bmm_forward(const WorkSplit& w, const PixelWindow& window, int64_t images,
                 const Tensor& columns, const Tensor& weight, const std::optional<Tensor>& bias,
                 Tensor& output_window) {
  const Tensor weight_block = views::narrow(weight, 0, 0, images * w.groups);
  // (images * G, K * C_in / G, window): the transposed columns, as the GEMM takes them.
  const Tensor columns_block =
      views::transpose(columns_of_window(columns, w, window, images), 1, 2);
  if (!bias.has_value()) {
    bmm_out(output_window, weight_block, columns_block);
    return;
  }
  // The bias as the GEMM's addend: each matrix's rows are one conv group's output channels, each
  // row its channel's bias at every pixel (stride 0). With one conv group, every matrix has the
  // same rows (stride 0 between them): one call; else one call per image, over its groups.
  const int64_t matrices = w.groups == 1 ? images : w.groups;
  const int64_t bias_stride = bias->stride(0);
  const Tensor bias_rows =
      views::strided(*bias, {matrices, w.out_per_group, window.pixels},
                     {w.groups == 1 ? 0 : w.out_per_group * bias_stride, bias_stride, 0});
  for (int64_t first = 0; first < images * w.groups; first += matrices) {
    baddbmm_out(views::narrow(output_window, 0, first, matrices), bias_rows,
                views::narrow(weight_block, 0, first, matrices),
                views::narrow(columns_block, 0, first, matrices));
  }
}

Tensor bmm_backward(const WorkSplit& w, const PixelWindow& window, int64_t images, Tensor& columns,
                    const Tensor& grad_output_window, const Tensor& weight, bool want_columns_grad,
                    Tensor& grad_weight_rows) {
  const Tensor columns_block = columns_of_window(columns, w, window, images);
  if (grad_weight_rows.defined()) {
    const Tensor columns_grouped =
        views::view(columns_block, {images, w.groups, window.pixels, w.rows_per_group});
    for (int64_t n = 0; n < images; ++n) {
      baddbmm_out(grad_weight_rows, grad_weight_rows, views::select(grad_output_window, n),
                  views::select(columns_grouped, n));
    }
  }
  if (!want_columns_grad) {
    return Tensor();
  }
  // (images * G, window, C_out / G) @ (images * G, C_out / G, K * C_in / G), into the columns
  // themselves, which the weight gradient has read by then.
  bmm_out(columns_block,
          views::transpose(
              views::view(grad_output_window, {images * w.groups, w.out_per_group, window.pixels}),
              1, 2),
          views::narrow(weight, 0, 0, images * w.groups));
  return columns;
}

}  // namespace

Tensor weight_rows(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                   const Tensor& weight, const WorkSplit& w) {
  Tensor rows = launchers.scratch(weight, {w.groups, w.out_per_group, w.rows_per_group},
                                  weight.scalar_type());
  Tensor matrices = views::view(rows, {g.out_channels, g.taps(), g.channels_per_group()});
  launchers.transpose(
      views::view(as_contiguous(weight), {g.out_channels, g.channels_per_group(), g.taps()}),
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

WeightGradientLayout weight_gradient_layout(const Tensor& grad_weight) {
  if (views::permute(grad_weight, {0, 2, 3, 1}).is_contiguous()) {
    return WeightGradientLayout::kRows;
  }
  return grad_weight.is_contiguous() ? WeightGradientLayout::kTransposedInPlace
                                     : WeightGradientLayout::kOwnBuffer;
}

constexpr int64_t kTransposeShares = 8;

}  // namespace

Tensor weight_gradient_rows(const WorkSplit& w, Tensor& grad_weight) {
  const std::array<int64_t, 3> rows_shape{w.groups, w.out_per_group, w.rows_per_group};
  switch (weight_gradient_layout(grad_weight)) {
    case WeightGradientLayout::kRows:
      record_branch("deform_conv2d.weight_gradient.rows_layout");
      torch::stable::zero_(grad_weight);
      return views::view(views::permute(grad_weight, {0, 2, 3, 1}), rows_shape);
    case WeightGradientLayout::kTransposedInPlace:
      record_branch("deform_conv2d.weight_gradient.transposed_in_place");
      torch::stable::zero_(grad_weight);
      return views::view(grad_weight, rows_shape);
    case WeightGradientLayout::kOwnBuffer:
      break;
  }
  record_branch("deform_conv2d.weight_gradient.own_buffer");
  Tensor rows = new_contiguous(grad_weight, rows_shape);
  torch::stable::zero_(rows);
  return rows;
}

void store_weight_gradient(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                           const Tensor& rows, Tensor& grad_weight) {
  const Tensor matrices = views::view(rows, {g.out_channels, g.taps(), g.channels_per_group()});
  switch (weight_gradient_layout(grad_weight)) {
    case WeightGradientLayout::kRows:
      return;
    case WeightGradientLayout::kTransposedInPlace: {
      Tensor planes = views::view(grad_weight, {g.out_channels, g.channels_per_group(), g.taps()});
      const int64_t share = (g.out_channels + kTransposeShares - 1) / kTransposeShares;
      for (int64_t first = 0; first < g.out_channels; first += share) {
        const int64_t count = std::min(share, g.out_channels - first);
        Tensor copy = launchers.scratch(grad_weight, {count, g.taps(), g.channels_per_group()},
                                        grad_weight.scalar_type());
        torch::stable::copy_(copy, views::narrow(matrices, 0, first, count));
        Tensor planes_share = views::narrow(planes, 0, first, count);
        launchers.transpose(copy, planes_share);
      }
      return;
    }
    case WeightGradientLayout::kOwnBuffer:
      torch::stable::copy_(
          grad_weight, views::permute(views::view(matrices, {g.out_channels, g.kernel_h, g.kernel_w,
                                                             g.channels_per_group()}),
                                      {0, 3, 1, 2}));
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
