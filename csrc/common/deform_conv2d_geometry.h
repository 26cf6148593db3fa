#pragma once

#include <torch/headeronly/macros/Macros.h>

#include <cstdint>

namespace deformconv {

// Every size and hyper-parameter of one deformable convolution, travelling as one struct
// (by value into CUDA kernels) instead of a score of positional ints. Sizes are int64 so that
// index products never overflow. The batch is not here: launchers work on blocks of
// im2col_step images and take the block's size separately.
struct DeformConv2dGeometry {
  int64_t in_channels;
  int64_t in_height;
  int64_t in_width;
  int64_t out_channels;
  int64_t out_height;
  int64_t out_width;
  int64_t kernel_h;
  int64_t kernel_w;
  int64_t stride_h;
  int64_t stride_w;
  int64_t pad_h;
  int64_t pad_w;
  int64_t dilation_h;
  int64_t dilation_w;
  int64_t groups;         // convolution groups: split of input and output channels
  int64_t offset_groups;  // deform groups: input channels sharing one offset/mask field

  C10_HOST_DEVICE int64_t taps() const { return kernel_h * kernel_w; }
  C10_HOST_DEVICE int64_t in_pixels() const { return in_height * in_width; }
  C10_HOST_DEVICE int64_t out_pixels() const { return out_height * out_width; }
  C10_HOST_DEVICE int64_t channels_per_offset_group() const {
    return in_channels / offset_groups;
  }
  C10_HOST_DEVICE int64_t channels_per_group() const { return in_channels / groups; }
};

// The output pixels [begin, begin + pixels) that the current columns buffer holds: the driver
// hands the launchers one window at a time, so that the buffer can stay small. All pixels when
// the work is not tiled.
struct PixelWindow {
  int64_t begin;
  int64_t pixels;
};

}  // namespace deformconv
