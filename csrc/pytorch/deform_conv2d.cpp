#include "deform_conv2d.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string_view>
#include <vector>

#include "../common/bilinear_sampling.cuh"
#include "../common/output_length.h"
#include "branch_trace.h"
#include "parallel_region.h"

namespace deformconv {

namespace {

// With im2col_step = 0 the block holds as many images as fit in the launchers'
// block_columns_bytes of full columns (at least one image).
int64_t images_per_block(const DeformConv2dGeometry& g, int64_t batch, int64_t im2col_step,
                         at::ScalarType dtype, const DeformConv2dLaunchers& launchers) {
  if (im2col_step > 0) {
    return std::min(batch, im2col_step);
  }
  const int64_t bytes_per_image =
      std::max<int64_t>(1, g.in_channels * g.taps() * g.out_pixels() * c10::elementSize(dtype));
  return std::clamp<int64_t>(launchers.block_columns_bytes / bytes_per_image, 1,
                             std::max<int64_t>(batch, 1));
}

// Output pixels per window of a block of `images`: as many as fit in the launchers' tile budget,
// at least min_pixels (or all), then evened out over the windows, whose count is rounded
// down: no short last window, whose GEMMs would pay the same per-call costs (the weight's
// reorder and gradient, C_out x K * C_in each) for a sliver of pixels. Smaller windows keep the
// columns buffer in cache and spare the page faults of a fresh buffer of hundreds of megabytes;
// the GEMMs stay large enough to run at full speed. The backward's windows have at least 512
// pixels. The forward's, at least 1,024: it runs GEMMs only for weights too large for the
// fused forward (Note [Fused forward]), megabytes that each window's GEMM reads again from
// memory (c5, 9 MiB: a forward of 1,050 pixels in one window took 8% less time than in two).
constexpr int64_t kMinBackwardWindowPixels = 512;
constexpr int64_t kMinForwardWindowPixels = 1024;

int64_t pixels_per_window(const DeformConv2dGeometry& g, int64_t images, at::ScalarType dtype,
                          const DeformConv2dLaunchers& launchers, int64_t min_pixels) {
  const int64_t bytes_per_pixel = std::max<int64_t>(
      1, images * g.taps() *
          (g.in_channels * c10::elementSize(dtype) +
           g.offset_groups * launchers.workspace_bytes_per_sample));
  const int64_t budget = std::min(
      g.out_pixels(), std::max(min_pixels, launchers.columns_tile_bytes / bytes_per_pixel));
  const int64_t windows = std::max<int64_t>(1, g.out_pixels() / budget);
  return (g.out_pixels() + windows - 1) / windows;
}

// How forward and backward split their work: blocks of `step` images, windows of
// `window_pixels` output pixels, and the per-group GEMM shapes (C_out / G) x (C_in / G * K) x
// pixels.
struct WorkSplit {
  int64_t step;
  int64_t window_pixels;
  int64_t groups;
  int64_t out_per_group;
  int64_t rows_per_group;
  int64_t pixels;  // H_out * W_out
};

WorkSplit split_work(const DeformConv2dGeometry& g, int64_t batch, int64_t im2col_step,
                     at::ScalarType dtype, const DeformConv2dLaunchers& launchers,
                     int64_t min_window_pixels) {
  WorkSplit w;
  w.step = images_per_block(g, batch, im2col_step, dtype, launchers);
  w.window_pixels = pixels_per_window(g, w.step, dtype, launchers, min_window_pixels);
  w.groups = g.groups;
  w.out_per_group = g.out_channels / g.groups;
  w.rows_per_group = g.in_channels / g.groups * g.taps();
  w.pixels = g.out_pixels();
  return w;
}

// The windows of a block, in order: window_pixels output pixels each, the last maybe fewer.
std::vector<PixelWindow> windows_of(const WorkSplit& w) {
  std::vector<PixelWindow> windows;
  for (int64_t begin = 0; begin < w.pixels; begin += w.window_pixels) {
    windows.push_back({begin, std::min(w.window_pixels, w.pixels - begin)});
  }
  return windows;
}

// Records (Note [Branch trace]) `several_blocks` where the split of `batch` images gives more
// than one block, `several_windows` where it gives more than one window.
void record_split(const WorkSplit& w, int64_t batch, const char* several_blocks,
                  const char* several_windows) {
  if (batch > w.step) {
    record_branch(several_blocks);
  }
  if (w.pixels > w.window_pixels) {
    record_branch(several_windows);
  }
}

// The columns buffer for `step` images and one window, allocated once per call.
at::Tensor columns_buffer(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                          const WorkSplit& w, const at::TensorOptions& options) {
  return launchers.scratch({w.step * g.in_channels * g.taps() * w.window_pixels}, options);
}

// The part of the columns buffer that holds `images` images of `window`, as
// (images * G, window pixels, K * C_in / G): one matrix per image and conv group.
at::Tensor columns_of_window(const at::Tensor& columns, const WorkSplit& w,
                             const PixelWindow& window, int64_t images) {
  return columns.narrow(0, 0, images * w.groups * window.pixels * w.rows_per_group)
      .view({images * w.groups, window.pixels, w.rows_per_group});
}

// The weight in the order of a columns row, per conv group: (G, C_out / G, K * C_in / G), its
// last dimension (tap, channel) as the columns have it, that is, for each output channel the
// transpose of its (C_in / G, K) matrix. In the launchers' scratch memory: a fresh buffer as
// large as the weight (9 MiB for 512 x 512 x 3 x 3) would fault in page by page every call.
at::Tensor weight_rows(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                       const at::Tensor& weight, const WorkSplit& w) {
  at::Tensor rows =
      launchers.scratch({w.groups, w.out_per_group, w.rows_per_group}, weight.options());
  at::Tensor matrices = rows.view({g.out_channels, g.taps(), g.channels_per_group()});
  launchers.transpose(weight.contiguous().view({g.out_channels, g.channels_per_group(), g.taps()}),
                      matrices);
  return rows;
}

// Writes a weight gradient summed in weight_rows' order into grad_weight, in the weight's
// layout.
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

// A block of images in the channels-last layout the launchers read, (images, H, W, C_in):
// a view when the input is channels-last already, else a copy of the block only.
at::Tensor channels_last_block(const DeformConv2dLaunchers& launchers, const at::Tensor& input,
                               int64_t first, int64_t images) {
  const at::Tensor block = input.narrow(0, first, images);
  const at::Tensor channels_last = block.permute({0, 2, 3, 1});
  if (channels_last.is_contiguous() || !block.is_contiguous()) {
    return channels_last.contiguous();
  }
  at::Tensor copy = launchers.scratch(channels_last.sizes(), block.options());
  at::Tensor planes = copy.view({images, -1, block.size(1)});
  launchers.transpose(block.view({images, block.size(1), -1}), planes);
  return copy;
}

// The workspace of one window's prepare_window, allocated once per call; undefined where the
// launchers prepare nothing.
at::Tensor window_workspace(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                            const WorkSplit& w, const at::TensorOptions& options) {
  if (launchers.prepare_window == nullptr) {
    return at::Tensor();
  }
  return launchers.scratch(
      {w.step * w.window_pixels * g.offset_groups * g.taps() *
       launchers.workspace_bytes_per_sample},
      options.dtype(at::kByte));
}

// The sampling of a window of a block, prepared once for every launcher.
WindowSampling window_sampling(const DeformConv2dLaunchers& launchers,
                               const DeformConv2dGeometry& g, const PixelWindow& window,
                               int64_t images, const at::Tensor& offset_block,
                               const at::Tensor& mask_block, at::Tensor& workspace) {
  if (launchers.prepare_window != nullptr) {
    launchers.prepare_window(g, window, images, offset_block, mask_block, workspace);
  }
  return {offset_block, mask_block, workspace};
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

// The weight as the GEMMs of the windows take it: weight_1x1 when as_convolution, else the
// per-group weight matrices repeated for every image of a block, so that one batched GEMM
// covers the whole block, (step * G, C_out / G, K * C_in / G).
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

// The forward GEMM of a window: output_window (images * G, C_out / G, window) = the weight
// times the window's columns, plus the bias, `weight` from gemm_weight.
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

// Writes a channels-last block (images, H, W, C_in) into `block` of the same images, in the
// block's own layout.
void copy_from_channels_last(const DeformConv2dLaunchers& launchers,
                             const at::Tensor& channels_last, at::Tensor block) {
  if (block.is_contiguous()) {
    at::Tensor planes = block.view({block.size(0), block.size(1), -1});
    launchers.transpose(channels_last.view({block.size(0), -1, block.size(1)}), planes);
  } else {
    block.copy_(channels_last.permute({0, 3, 1, 2}));
  }
}

void check_pair(const char* name, c10::IntArrayRef values, int64_t minimum) {
  TORCH_CHECK_VALUE(values.size() == 2, "deform_conv2d(): expected ", name,
                    " to have 2 values (height, width), but got ", values.size());
  TORCH_CHECK_VALUE(values[0] >= minimum && values[1] >= minimum, "deform_conv2d(): expected ",
                    name, " to be at least ", minimum, ", but got ", values);
}

void check_tensor(const char* name, const at::Tensor& tensor, int64_t dims,
                  const char* layout, const at::Tensor& input) {
  TORCH_CHECK_VALUE(tensor.dim() == dims, "deform_conv2d(): expected ", name, " to be a ", dims,
                    "-D tensor ", layout, ", but got a ", tensor.dim(), "-D tensor of shape ",
                    tensor.sizes());
  TORCH_CHECK_TYPE(tensor.scalar_type() == input.scalar_type(), "deform_conv2d(): expected ",
                   name, " to have the dtype of input (", input.scalar_type(), "), but got ",
                   tensor.scalar_type());
}

}  // namespace

void check_same_device(const at::Tensor& input, const at::Tensor& offset, const at::Tensor& weight,
                       const std::optional<at::Tensor>& mask,
                       const std::optional<at::Tensor>& bias) {
  const auto check = [&](const char* name, const at::Tensor& tensor) {
    TORCH_CHECK_VALUE(tensor.device() == input.device(), "deform_conv2d(): expected ", name,
                      " to be on the device of input (", input.device(), "), but got ",
                      tensor.device());
  };
  check("offset", offset);
  check("weight", weight);
  if (mask.has_value()) check("mask", *mask);
  if (bias.has_value()) check("bias", *bias);
}

DeformConv2dGeometry check_deform_conv2d_arguments(
    const at::Tensor& input, const at::Tensor& offset, const at::Tensor& weight,
    const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& bias,
    c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation,
    int64_t groups, int64_t offset_groups, int64_t im2col_step) {
  TORCH_CHECK_TYPE(at::isFloatingType(input.scalar_type()),
                   "deform_conv2d(): expected input to have a floating point dtype "
                   "(float16, bfloat16, float32 or float64), but got ", input.scalar_type());
  check_tensor("input", input, 4, "(batch, in_channels, height, width)", input);
  check_tensor("offset", offset, 4,
               "(batch, 2 * offset_groups * kernel_h * kernel_w, out_height, out_width)", input);
  check_tensor("weight", weight, 4,
               "(out_channels, in_channels / groups, kernel_h, kernel_w)", input);
  if (mask.has_value()) {
    check_tensor("mask", *mask, 4,
                 "(batch, offset_groups * kernel_h * kernel_w, out_height, out_width)", input);
  }
  if (bias.has_value()) {
    check_tensor("bias", *bias, 1, "(out_channels,)", input);
  }
  check_same_device(input, offset, weight, mask, bias);
  check_pair("stride", stride, 1);
  check_pair("padding", padding, 0);
  check_pair("dilation", dilation, 1);
  TORCH_CHECK_VALUE(groups >= 1, "deform_conv2d(): expected groups to be at least 1, but got ",
                    groups);
  TORCH_CHECK_VALUE(offset_groups >= 1,
                    "deform_conv2d(): expected offset_groups to be at least 1, but got ",
                    offset_groups);
  TORCH_CHECK_VALUE(im2col_step >= 0,
                    "deform_conv2d(): expected im2col_step to be positive, or 0 for automatic, "
                    "but got ", im2col_step);

  DeformConv2dGeometry g{};
  g.in_channels = input.size(1);
  g.in_height = input.size(2);
  g.in_width = input.size(3);
  g.out_channels = weight.size(0);
  g.kernel_h = weight.size(2);
  g.kernel_w = weight.size(3);
  g.stride_h = stride[0];
  g.stride_w = stride[1];
  g.pad_h = padding[0];
  g.pad_w = padding[1];
  g.dilation_h = dilation[0];
  g.dilation_w = dilation[1];
  g.groups = groups;
  g.offset_groups = offset_groups;

  TORCH_CHECK_VALUE(g.in_channels > 0 && g.in_height > 0 && g.in_width > 0,
                    "deform_conv2d(): expected input to have non-zero channels, height and "
                    "width, but got shape ", input.sizes());
  TORCH_CHECK_VALUE(g.in_height <= kMaxImageSide && g.in_width <= kMaxImageSide,
                    "deform_conv2d(): expected input's height and width to be at most ",
                    kMaxImageSide, ", but got ", g.in_height, " x ", g.in_width);
  TORCH_CHECK_VALUE(g.kernel_h > 0 && g.kernel_w > 0,
                    "deform_conv2d(): expected weight to have a non-empty kernel, but got shape ",
                    weight.sizes());
  TORCH_CHECK_VALUE(g.in_channels % groups == 0, "deform_conv2d(): expected in_channels (",
                    g.in_channels, ") to be divisible by groups (", groups, ")");
  TORCH_CHECK_VALUE(g.out_channels % groups == 0, "deform_conv2d(): expected out_channels (",
                    g.out_channels, ", weight.size(0)) to be divisible by groups (", groups, ")");
  TORCH_CHECK_VALUE(weight.size(1) * groups == g.in_channels,
                    "deform_conv2d(): expected weight to have ", g.in_channels / groups,
                    " input channels (in_channels / groups = ", g.in_channels, " / ", groups,
                    "), but got ", weight.size(1));
  TORCH_CHECK_VALUE(g.in_channels % offset_groups == 0, "deform_conv2d(): expected in_channels (",
                    g.in_channels, ") to be divisible by offset_groups (", offset_groups, ")");

  const int64_t dilated_kernel_h = g.dilation_h * (g.kernel_h - 1) + 1;
  const int64_t dilated_kernel_w = g.dilation_w * (g.kernel_w - 1) + 1;
  TORCH_CHECK_VALUE(g.in_height + 2 * g.pad_h >= dilated_kernel_h &&
                        g.in_width + 2 * g.pad_w >= dilated_kernel_w,
                    "deform_conv2d(): expected the padded input (", g.in_height + 2 * g.pad_h,
                    " x ", g.in_width + 2 * g.pad_w,
                    ") to be at least as large as the dilated kernel (", dilated_kernel_h, " x ",
                    dilated_kernel_w, "), so that the output is not empty");
  g.out_height = output_length(g.in_height, g.kernel_h, g.stride_h, g.pad_h, g.dilation_h);
  g.out_width = output_length(g.in_width, g.kernel_w, g.stride_w, g.pad_w, g.dilation_w);

  const int64_t batch = input.size(0);
  const auto check_field = [&](const char* name, const at::Tensor& field, int64_t channels,
                               const char* formula) {
    TORCH_CHECK_VALUE(field.size(0) == batch, "deform_conv2d(): expected ", name,
                      " to have the batch size of input (", batch, "), but got ", field.size(0));
    TORCH_CHECK_VALUE(field.size(1) == channels, "deform_conv2d(): expected ", name, " to have ",
                      channels, " channels (", formula, "), but got ", field.size(1));
    TORCH_CHECK_VALUE(field.size(2) == g.out_height && field.size(3) == g.out_width,
                      "deform_conv2d(): expected ", name, " to have the output size ",
                      g.out_height, " x ", g.out_width, ", but got ", field.size(2), " x ",
                      field.size(3));
  };
  check_field("offset", offset, 2 * offset_groups * g.taps(), "2 * offset_groups * kH * kW");
  if (mask.has_value()) {
    check_field("mask", *mask, offset_groups * g.taps(), "offset_groups * kH * kW");
  }
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->size(0) == g.out_channels, "deform_conv2d(): expected bias to have ",
                      g.out_channels, " elements (out_channels), but got ", bias->size(0));
  }
  return g;
}

DeformConv2dGeometry check_deform_conv2d_backward_arguments(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& offset,
    const at::Tensor& weight, const std::optional<at::Tensor>& mask, c10::IntArrayRef stride,
    c10::IntArrayRef padding, c10::IntArrayRef dilation, int64_t groups, int64_t offset_groups,
    int64_t im2col_step) {
  const DeformConv2dGeometry g =
      check_deform_conv2d_arguments(input, offset, weight, mask, std::nullopt, stride, padding,
                                    dilation, groups, offset_groups, im2col_step);
  const std::vector<int64_t> output_shape = {input.size(0), g.out_channels, g.out_height,
                                             g.out_width};
  TORCH_CHECK_VALUE(grad_output.sizes() == c10::IntArrayRef(output_shape),
                    "deform_conv2d_backward(): expected grad_output of shape ",
                    c10::IntArrayRef(output_shape), ", but got ", grad_output.sizes());
  TORCH_CHECK_TYPE(grad_output.scalar_type() == input.scalar_type(),
                   "deform_conv2d_backward(): expected grad_output to have the dtype of input (",
                   input.scalar_type(), "), but got ", grad_output.scalar_type());
  TORCH_CHECK_VALUE(grad_output.device() == input.device(),
                    "deform_conv2d_backward(): expected grad_output to be on the device of "
                    "input (", input.device(), "), but got ", grad_output.device());
  return g;
}

namespace {

// Note [Whole images per thread]
// A forward with the automatic im2col_step runs in one parallel region where it can: with a
// batch that gives every thread at least two images, each thread takes whole images, one block
// of one image at a time; with fewer images and the GEMMs as convolutions, each block's windows
// are shared out instead, if there are at least two per thread (a window's bmm, for grouped
// convolutions, runs slower on one thread than on all). A thread runs its images' or windows'
// work by itself (im2col, the GEMM, the output copy) in a columns buffer of its own. A block
// then has one barrier, at its end, instead of several per window, each of which makes every
// thread wait for the slowest (a thread whose core another process shares, say), and the
// threads take the images or windows one at a time from a shared counter, so that a slowed
// thread takes fewer. The ATen and oneDNN calls inside run on the calling thread alone, and
// oneDNN then reorders the weight for each GEMM (a weight-sized buffer per thread): with a
// single window per thread, whose shares could not even out anyway, a forward keeps its
// stages. Each pixel's output is the same as in a block and window of its own.
enum class ForwardParallelism { kStages, kImages, kWindows };

ForwardParallelism forward_parallelism(const DeformConv2dLaunchers& launchers, int64_t batch,
                                       int64_t im2col_step, int64_t windows,
                                       bool as_convolution) {
  const int64_t threads = at::get_num_threads();
  if (!launchers.images_per_thread || im2col_step != 0 || threads == 1 ||
      at::in_parallel_region()) {
    return ForwardParallelism::kStages;
  }
  if (batch >= 2 * threads) {
    return ForwardParallelism::kImages;
  }
  return as_convolution && windows >= 2 * threads ? ForwardParallelism::kWindows
                                                  : ForwardParallelism::kStages;
}

// Runs run(i, columns) for i in [0, count) in one parallel region, each thread with a columns
// buffer of its own, taking the next i from a shared counter: a thread slowed down by another
// process runs fewer. Every thread runs in the caller's thread-local state, which worker
// threads do not inherit: below autograd, as a kernel runs, and seen by the profiler that
// watches the caller, allocations included.
template <typename Function>
void run_with_columns_per_thread(const DeformConv2dLaunchers& launchers,
                                 const DeformConv2dGeometry& g, const WorkSplit& w,
                                 const at::TensorOptions& options, int64_t count,
                                 const Function& run) {
  std::atomic<int64_t> next{0};
  const at::ThreadLocalState caller_state;
  run_on_every_thread([&] {
    at::ThreadLocalStateGuard caller_state_guard(caller_state);
    at::Tensor columns = columns_buffer(launchers, g, w, options);
    for (int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) {
      run(i, columns);
    }
  });
}

// One window of a block: its columns, then their GEMM into the block's output,
// (images * G, C_out / G, P).
void forward_window(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                    const WorkSplit& w, const PixelWindow& window, int64_t images,
                    const at::Tensor& input_block, const at::Tensor& offset_block,
                    const at::Tensor& mask_block, const at::Tensor& weight_gemm,
                    const std::optional<at::Tensor>& bias, bool as_convolution,
                    at::Tensor& columns, const at::Tensor& output_block) {
  // Nothing prepared: im2col locates each sample as it reads it.
  launchers.im2col(g, window, images, input_block,
                   WindowSampling{offset_block, mask_block, {}}, columns);
  // (images * G, C_out / G, window) inside the output: rows P apart.
  at::Tensor output_window = output_block.narrow(2, window.begin, window.pixels);
  multiply_window(w, window, images, columns, weight_gemm, bias, as_convolution, output_window);
}

// The forward of images [first, first + images), one block: channels-last input, then its
// windows, in turn, or shared out among the threads (each with a columns buffer of its own)
// when windows_per_thread.
void forward_block(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                   const WorkSplit& w, const at::Tensor& input, const at::Tensor& offset,
                   const at::Tensor& mask, const at::Tensor& weight_gemm,
                   const std::optional<at::Tensor>& bias, bool as_convolution, int64_t first,
                   int64_t images, at::Tensor& columns, at::Tensor& output,
                   bool windows_per_thread) {
  const at::Tensor input_block = channels_last_block(launchers, input, first, images);
  const at::Tensor offset_block = offset.narrow(0, first, images);
  const at::Tensor mask_block = mask.defined() ? mask.narrow(0, first, images) : at::Tensor();
  const at::Tensor output_block =
      output.narrow(0, first, images).view({images * w.groups, w.out_per_group, w.pixels});
  const std::vector<PixelWindow> windows = windows_of(w);
  if (!windows_per_thread) {
    for (const PixelWindow& window : windows) {
      forward_window(launchers, g, w, window, images, input_block, offset_block, mask_block,
                     weight_gemm, bias, as_convolution, columns, output_block);
    }
    return;
  }
  run_with_columns_per_thread(
      launchers, g, w, input.options(), static_cast<int64_t>(windows.size()),
      [&](int64_t i, at::Tensor& thread_columns) {
        forward_window(launchers, g, w, windows[i], images, input_block, offset_block,
                       mask_block, weight_gemm, bias, as_convolution, thread_columns,
                       output_block);
      });
}

// Whether the forward runs fused (launchers' fused_forward, Note [Fused forward] in
// cpu/fused_forward_cpu.cpp): where the launchers have it and find it pays, unless the
// environment variable DEFORMCONV_FUSED_FORWARD is 0, read at every call, which leaves every
// forward to im2col and the GEMMs (to compare the two, or to test the latter).
bool fused_forward_applies(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                           at::ScalarType dtype) {
  if (launchers.fused_forward == nullptr) {
    return false;
  }
  const char* setting = std::getenv("DEFORMCONV_FUSED_FORWARD");
  if (setting != nullptr && std::string_view(setting) == "0") {
    return false;
  }
  return launchers.fused_forward_pays(g, dtype);
}

// The weight as the fused forward takes it: (G, K, C_in / G, C_out / G), in at::opmath_type.
at::Tensor weight_taps(const DeformConv2dGeometry& g, const at::Tensor& weight) {
  return weight.reshape({g.groups, g.out_channels / g.groups, g.channels_per_group(), g.taps()})
      .permute({0, 3, 2, 1})
      .to(at::toOpMathType(weight.scalar_type()))
      .contiguous();
}

// The fused forward, a block of images at a time.
void fused_forward(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                   const WorkSplit& w, const at::Tensor& input, const at::Tensor& offset,
                   const at::Tensor& mask, const at::Tensor& weight,
                   const std::optional<at::Tensor>& bias, at::Tensor& output) {
  const at::Tensor taps = weight_taps(g, weight);
  const at::Tensor bias_values = bias.has_value() ? bias->contiguous() : at::Tensor();
  const int64_t batch = input.size(0);
  for (int64_t first = 0; first < batch; first += w.step) {
    const int64_t images = std::min(w.step, batch - first);
    at::Tensor output_block = output.narrow(0, first, images);
    launchers.fused_forward(g, images, channels_last_block(launchers, input, first, images),
                            offset.narrow(0, first, images),
                            mask.defined() ? mask.narrow(0, first, images) : at::Tensor(), taps,
                            bias_values, output_block);
  }
}

}  // namespace

at::Tensor deform_conv2d_forward(
    const DeformConv2dLaunchers& launchers, const at::Tensor& input_arg,
    const at::Tensor& offset_arg, const at::Tensor& weight_arg,
    const std::optional<at::Tensor>& mask_arg, const std::optional<at::Tensor>& bias,
    c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation, int64_t groups,
    int64_t offset_groups, int64_t im2col_step) {
  const DeformConv2dGeometry g =
      check_deform_conv2d_arguments(input_arg, offset_arg, weight_arg, mask_arg, bias, stride,
                                    padding, dilation, groups, offset_groups, im2col_step);
  const at::Tensor offset = offset_arg.contiguous();
  const at::Tensor mask = mask_arg.has_value() ? mask_arg->contiguous() : at::Tensor();

  const int64_t batch = input_arg.size(0);
  at::Tensor output =
      at::empty({batch, g.out_channels, g.out_height, g.out_width}, input_arg.options());
  if (batch == 0) {
    return output;
  }
  const WorkSplit w = split_work(g, batch, im2col_step, input_arg.scalar_type(), launchers,
                                 kMinForwardWindowPixels);
  if (fused_forward_applies(launchers, g, input_arg.scalar_type())) {
    record_branch("deform_conv2d.forward.fused");
    fused_forward(launchers, g, w, input_arg, offset, mask, weight_arg, bias, output);
    return output;
  }
  const bool as_convolution = gemms_as_convolutions(launchers, g, input_arg);
  record_branch(as_convolution ? "deform_conv2d.forward.onednn" : "deform_conv2d.forward.bmm");
  const ForwardParallelism parallelism = forward_parallelism(
      launchers, batch, im2col_step, static_cast<int64_t>(windows_of(w).size()), as_convolution);
  if (parallelism == ForwardParallelism::kImages) {
    record_branch("deform_conv2d.forward.images_per_thread");
    const WorkSplit image_split =
        split_work(g, 1, 1, input_arg.scalar_type(), launchers, kMinForwardWindowPixels);
    record_split(image_split, 1, "deform_conv2d.forward.blocks",
                 "deform_conv2d.forward.windows");
    const at::Tensor weight_gemm =
        gemm_weight(launchers, g, weight_arg, image_split, as_convolution);
    run_with_columns_per_thread(
        launchers, g, image_split, input_arg.options(), batch,
        [&](int64_t n, at::Tensor& columns) {
          forward_block(launchers, g, image_split, input_arg, offset, mask, weight_gemm, bias,
                        as_convolution, n, 1, columns, output, false);
        });
    return output;
  }
  const bool windows_per_thread = parallelism == ForwardParallelism::kWindows;
  record_branch(windows_per_thread ? "deform_conv2d.forward.windows_per_thread"
                                   : "deform_conv2d.forward.stages");
  record_split(w, batch, "deform_conv2d.forward.blocks", "deform_conv2d.forward.windows");
  // Shared by the windows in turn; each thread has its own when windows_per_thread.
  at::Tensor columns =
      windows_per_thread ? at::Tensor() : columns_buffer(launchers, g, w, input_arg.options());
  const at::Tensor weight_gemm = gemm_weight(launchers, g, weight_arg, w, as_convolution);
  for (int64_t first = 0; first < batch; first += w.step) {
    forward_block(launchers, g, w, input_arg, offset, mask, weight_gemm, bias, as_convolution,
                  first, std::min(w.step, batch - first), columns, output, windows_per_thread);
  }
  return output;
}

namespace {

// The gradients the backward is asked for (output_mask; the mask's only where there is a mask).
struct WantedGradients {
  bool input, offset, weight, mask, bias;

  // The gradient of the columns, which the input, offset and mask gradients come from.
  bool columns() const { return input || offset || mask; }
  // The input values, which all but the input gradient read.
  bool input_values() const { return weight || offset || mask; }
};

// What a backward makes once and uses for every block of images.
struct BackwardScratch {
  WorkSplit w;
  // The columns for the weight gradient, then (with bmm) the gradient of the columns.
  at::Tensor columns;
  // prepare_window's, for col2im.
  at::Tensor workspace;
  bool as_convolution;
  // gemm_weight's; the convolution's backward takes it even for the weight gradient alone.
  at::Tensor weight;
  // The weight gradient in the order of weight_rows, summed over the windows.
  at::Tensor grad_weight_rows;
};

BackwardScratch backward_scratch(const DeformConv2dLaunchers& launchers,
                                 const DeformConv2dGeometry& g, const WantedGradients& want,
                                 int64_t batch, int64_t im2col_step, const at::Tensor& input,
                                 const at::Tensor& weight) {
  BackwardScratch scratch;
  scratch.w = split_work(g, batch, im2col_step, input.scalar_type(), launchers,
                         kMinBackwardWindowPixels);
  const WorkSplit& w = scratch.w;
  scratch.columns = columns_buffer(launchers, g, w, input.options());
  if (want.input) {
    scratch.workspace = window_workspace(launchers, g, w, input.options());
  }
  scratch.as_convolution = gemms_as_convolutions(launchers, g, input);
  record_branch(scratch.as_convolution ? "deform_conv2d.backward.onednn"
                                       : "deform_conv2d.backward.bmm");
  record_split(w, batch, "deform_conv2d.backward.blocks", "deform_conv2d.backward.windows");
  if (scratch.as_convolution || want.columns()) {
    scratch.weight = gemm_weight(launchers, g, weight, w, scratch.as_convolution);
  }
  if (want.weight) {
    scratch.grad_weight_rows =
        at::zeros({w.groups, w.out_per_group, w.rows_per_group}, weight.options());
  }
  return scratch;
}

// One block of images: its operands, and where its gradients go (undefined where not wanted).
struct BackwardBlock {
  int64_t first;
  int64_t images;
  at::Tensor input;        // channels-last, (images, H, W, C_in)
  at::Tensor offset;
  at::Tensor mask;
  at::Tensor grad_output;  // (images, G, C_out / G, P)
  // Channels-last and zeroed, for col2im to add into: grad_input's own memory when grad_input
  // is channels-last, else a block-sized buffer copied into grad_input afterwards.
  at::Tensor grad_input;
  bool grad_input_in_place;
  at::Tensor grad_offset;
  at::Tensor grad_mask;
};

BackwardBlock backward_block(const DeformConv2dLaunchers& launchers,
                             const DeformConv2dGeometry& g, const WantedGradients& want,
                             const WorkSplit& w, int64_t first, int64_t images,
                             const at::Tensor& grad_output, const at::Tensor& input,
                             const at::Tensor& offset, const at::Tensor& mask,
                             const at::Tensor& grad_input, const at::Tensor& grad_offset,
                             const at::Tensor& grad_mask) {
  BackwardBlock block;
  block.first = first;
  block.images = images;
  if (want.input_values()) {
    block.input = channels_last_block(launchers, input, first, images);
  }
  block.offset = offset.narrow(0, first, images);
  if (mask.defined()) {
    block.mask = mask.narrow(0, first, images);
  }
  block.grad_output =
      grad_output.narrow(0, first, images).view({images, w.groups, w.out_per_group, w.pixels});
  block.grad_input_in_place = false;
  if (want.input) {
    block.grad_input = grad_input.narrow(0, first, images).permute({0, 2, 3, 1});
    block.grad_input_in_place = block.grad_input.is_contiguous();
    if (!block.grad_input_in_place) {
      block.grad_input =
          launchers.scratch({images, g.in_height, g.in_width, g.in_channels}, input.options());
    }
    block.grad_input.zero_();
  }
  if (want.offset) {
    block.grad_offset = grad_offset.narrow(0, first, images);
  }
  if (want.mask) {
    block.grad_mask = grad_mask.narrow(0, first, images);
  }
  return block;
}

// The gradients of one window of a block: its columns (for the weight gradient), the GEMMs,
// then the columns gradient taken back to the input, offset and mask.
void backward_window(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                     const WantedGradients& want, BackwardScratch& scratch,
                     BackwardBlock& block, const PixelWindow& window) {
  // (images, G, C_out / G, window) inside grad_output: rows P apart.
  const at::Tensor grad_output_window = block.grad_output.narrow(3, window.begin, window.pixels);
  // Prepared for col2im, which im2col then shares; im2col alone and the offset and mask
  // gradients locate their samples themselves.
  const WindowSampling sampling = want.input
      ? window_sampling(launchers, g, window, block.images, block.offset, block.mask,
                        scratch.workspace)
      : WindowSampling{block.offset, block.mask, at::Tensor()};
  if (want.weight) {
    launchers.im2col(g, window, block.images, block.input, sampling, scratch.columns);
  }
  std::vector<at::Tensor> window_results;
  const at::Tensor grad_columns = window_gradient_gemms(
      scratch.w, window, block.images, scratch.columns, grad_output_window, scratch.weight,
      scratch.as_convolution, want.columns(), scratch.grad_weight_rows, window_results);
  if (want.input) {
    launchers.col2im(g, window, block.images, grad_columns, sampling, block.grad_input);
  }
  if (want.offset || want.mask) {
    launchers.offset_mask_grad(g, window, block.images, grad_columns, block.input, sampling,
                               block.grad_offset, block.grad_mask);
  }
  if (launchers.keep_window_results != nullptr) {
    launchers.keep_window_results(std::move(window_results));
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> deform_conv2d_backward(
    const DeformConv2dLaunchers& launchers, const at::Tensor& grad_output_arg,
    const at::Tensor& input_arg, const at::Tensor& offset_arg, const at::Tensor& weight_arg,
    const std::optional<at::Tensor>& mask_arg, c10::IntArrayRef stride,
    c10::IntArrayRef padding, c10::IntArrayRef dilation, int64_t groups, int64_t offset_groups,
    int64_t im2col_step, std::array<bool, 5> output_mask) {
  const DeformConv2dGeometry g = check_deform_conv2d_backward_arguments(
      grad_output_arg, input_arg, offset_arg, weight_arg, mask_arg, stride, padding, dilation,
      groups, offset_groups, im2col_step);
  const int64_t batch = input_arg.size(0);
  const at::Tensor grad_output = grad_output_arg.contiguous();
  const at::Tensor offset = offset_arg.contiguous();
  const at::Tensor mask = mask_arg.has_value() ? mask_arg->contiguous() : at::Tensor();
  const WantedGradients want{output_mask[0], output_mask[1], output_mask[2],
                             output_mask[3] && mask.defined(), output_mask[4]};

  // The input and weight gradients keep the memory format of input and weight; the offset and
  // mask gradients are contiguous, and written in full, so they need no zero fill.
  at::Tensor grad_input = want.input ? at::empty_like(input_arg) : at::Tensor();
  at::Tensor grad_offset = want.offset ? at::empty_like(offset) : at::Tensor();
  at::Tensor grad_weight = want.weight ? at::empty_like(weight_arg) : at::Tensor();
  at::Tensor grad_mask = want.mask ? at::empty_like(mask) : at::Tensor();
  at::Tensor grad_bias = want.bias ? grad_output.sum({0, 2, 3}) : at::Tensor();
  if (batch == 0 || !(want.columns() || want.weight)) {
    if (want.input) grad_input.zero_();
    if (want.weight) grad_weight.zero_();
    return {grad_input, grad_offset, grad_weight, grad_mask, grad_bias};
  }

  BackwardScratch scratch =
      backward_scratch(launchers, g, want, batch, im2col_step, input_arg, weight_arg);
  const int64_t step = scratch.w.step;
  for (int64_t first = 0; first < batch; first += step) {
    BackwardBlock block =
        backward_block(launchers, g, want, scratch.w, first, std::min(step, batch - first),
                       grad_output, input_arg, offset, mask, grad_input, grad_offset, grad_mask);
    for (const PixelWindow& window : windows_of(scratch.w)) {
      backward_window(launchers, g, want, scratch, block, window);
    }
    if (want.input && !block.grad_input_in_place) {
      copy_from_channels_last(launchers, block.grad_input,
                              grad_input.narrow(0, block.first, block.images));
    }
  }
  if (want.weight) {
    store_weight_gradient(launchers, g, scratch.grad_weight_rows, grad_weight);
  }
  return {grad_input, grad_offset, grad_weight, grad_mask, grad_bias};
}

}  // namespace deformconv
