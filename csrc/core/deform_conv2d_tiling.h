#pragma once

// How the driver of deformable convolution tiles a call: blocks of images (im2col_step),
// windows of output pixels within a block, and the scratch buffers and channels-last copies
// of a block and a window, all in the launchers' scratch memory.

#include <cstdint>
#include <vector>

#include "deform_conv2d_launchers.h"

namespace deformconv {

// The fewest output pixels of a backward's and a forward's windows (pixels_per_window in
// deform_conv2d_tiling.cpp says why).
constexpr int64_t kMinBackwardWindowPixels = 512;
constexpr int64_t kMinForwardWindowPixels = 1024;

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
                     ScalarType dtype, const DeformConv2dLaunchers& launchers,
                     int64_t min_window_pixels);

// The windows of a block, in order: window_pixels output pixels each, the last maybe fewer.
std::vector<PixelWindow> windows_of(const WorkSplit& w);

// Records (Note [Branch trace]) `several_blocks` where the split of `batch` images gives more
// than one block, `several_windows` where it gives more than one window.
void record_split(const WorkSplit& w, int64_t batch, const char* several_blocks,
                  const char* several_windows);

// The columns buffer for `step` images and one window, of `like`'s dtype and device, allocated
// once per call.
Tensor columns_buffer(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                      const WorkSplit& w, const Tensor& like);

// The part of the columns buffer that holds `images` images of `window`, as
// (images * G, window pixels, K * C_in / G): one matrix per image and conv group.
Tensor columns_of_window(const Tensor& columns, const WorkSplit& w, const PixelWindow& window,
                         int64_t images);

// A block of images in the channels-last layout the launchers read, (images, H, W, C_in):
// a view when the input is channels-last already, else a copy of the block only.
Tensor channels_last_block(const DeformConv2dLaunchers& launchers, const Tensor& input,
                           int64_t first, int64_t images);

// The workspace of one window's prepare_window, on `like`'s device, allocated once per call;
// undefined where the launchers prepare nothing.
Tensor window_workspace(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                        const WorkSplit& w, const Tensor& like);

// The sampling of a window of a block, prepared once for every launcher.
WindowSampling window_sampling(const DeformConv2dLaunchers& launchers,
                               const DeformConv2dGeometry& g, const PixelWindow& window,
                               int64_t images, const Tensor& offset_block, const Tensor& mask_block,
                               Tensor& workspace);

// Writes a channels-last block (images, H, W, C_in) into `block` of the same images, in the
// block's own layout.
void copy_from_channels_last(const DeformConv2dLaunchers& launchers, const Tensor& channels_last,
                             Tensor block);

}  // namespace deformconv
