#include "deform_conv2d_tiling.h"

#include <algorithm>

#include "../common/scalar_types.h"
#include "../infrastructure/branch_trace.h"
#include "../infrastructure/tensor_views.h"

namespace deformconv {

namespace {

// With im2col_step = 0 the block holds as many images as fit in the launchers'
// block_columns_bytes of full columns (at least one image).
int64_t images_per_block(const DeformConv2dGeometry& g, int64_t batch, int64_t im2col_step,
                         ScalarType dtype, const DeformConv2dLaunchers& launchers) {
  if (im2col_step > 0) {
    return std::min(batch, im2col_step);
  }
  const int64_t bytes_per_image =
      std::max<int64_t>(1, g.in_channels * g.taps() * g.out_pixels() * element_size(dtype));
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
int64_t pixels_per_window(const DeformConv2dGeometry& g, int64_t images, ScalarType dtype,
                          const DeformConv2dLaunchers& launchers, int64_t min_pixels) {
  const int64_t bytes_per_pixel =
      std::max<int64_t>(1, images * g.taps() *
                               (g.in_channels * element_size(dtype) +
                                g.offset_groups * launchers.workspace_bytes_per_sample));
  const int64_t budget = std::min(
      g.out_pixels(), std::max(min_pixels, launchers.columns_tile_bytes / bytes_per_pixel));
  const int64_t windows = std::max<int64_t>(1, g.out_pixels() / budget);
  return (g.out_pixels() + windows - 1) / windows;
}

}  // namespace

WorkSplit split_work(const DeformConv2dGeometry& g, int64_t batch, int64_t im2col_step,
                     ScalarType dtype, const DeformConv2dLaunchers& launchers,
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

std::vector<PixelWindow> windows_of(const WorkSplit& w) {
  std::vector<PixelWindow> windows;
  for (int64_t begin = 0; begin < w.pixels; begin += w.window_pixels) {
    windows.push_back({begin, std::min(w.window_pixels, w.pixels - begin)});
  }
  return windows;
}

void record_split(const WorkSplit& w, int64_t batch, const char* several_blocks,
                  const char* several_windows) {
  if (batch > w.step) {
    record_branch(several_blocks);
  }
  if (w.pixels > w.window_pixels) {
    record_branch(several_windows);
  }
}

Tensor columns_buffer(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                      const WorkSplit& w, const Tensor& like) {
  return launchers.scratch(like, {w.step * g.in_channels * g.taps() * w.window_pixels},
                           like.scalar_type());
}

Tensor columns_of_window(const Tensor& columns, const WorkSplit& w, const PixelWindow& window,
                         int64_t images) {
  return views::view(
      views::narrow(columns, 0, 0, images * w.groups * window.pixels * w.rows_per_group),
      {images * w.groups, window.pixels, w.rows_per_group});
}

Tensor channels_last_block(const DeformConv2dLaunchers& launchers, const Tensor& input,
                           int64_t first, int64_t images) {
  const Tensor block = views::narrow(input, 0, first, images);
  const Tensor channels_last = views::permute(block, {0, 2, 3, 1});
  if (channels_last.is_contiguous() || !block.is_contiguous()) {
    return as_contiguous(channels_last);
  }
  Tensor copy = launchers.scratch(block, channels_last.sizes(), block.scalar_type());
  Tensor planes = views::view(copy, {images, -1, block.size(1)});
  launchers.transpose(views::view(block, {images, block.size(1), -1}), planes);
  return copy;
}

Tensor window_workspace(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                        const WorkSplit& w, const Tensor& like) {
  if (launchers.prepare_window == nullptr) {
    return Tensor();
  }
  return launchers.scratch(like,
                           {w.step * w.window_pixels * g.offset_groups * g.taps() *
                            launchers.workspace_bytes_per_sample},
                           ScalarType::Byte);
}

WindowSampling window_sampling(const DeformConv2dLaunchers& launchers,
                               const DeformConv2dGeometry& g, const PixelWindow& window,
                               int64_t images, const Tensor& offset_block, const Tensor& mask_block,
                               Tensor& workspace) {
  if (launchers.prepare_window != nullptr) {
    launchers.prepare_window(g, window, images, offset_block, mask_block, workspace);
  }
  return {offset_block, mask_block, workspace};
}

void copy_from_channels_last(const DeformConv2dLaunchers& launchers, const Tensor& channels_last,
                             Tensor block) {
  if (block.is_contiguous()) {
    Tensor planes = views::view(block, {block.size(0), block.size(1), -1});
    launchers.transpose(views::view(channels_last, {block.size(0), -1, block.size(1)}), planes);
  } else {
    torch::stable::copy_(block, views::permute(channels_last, {0, 3, 1, 2}));
  }
}

}  // namespace deformconv
