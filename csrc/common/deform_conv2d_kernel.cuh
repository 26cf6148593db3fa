#pragma once

// The indexing of DCN v1/v2 (deform_conv2d), one element at a time: which sample an element
// belongs to, where its offset and mask are, where its columns entry lies. The bilinear
// arithmetic itself is bilinear_sampling.cuh's. Every function is C10_HOST_DEVICE, as there;
// the launchers only choose the loop (parallel tasks on the CPU, a grid-stride loop on CUDA).
//
// Conventions (docs/api.md), for image n, deform group g, tap k = i * kW + j, output pixel
// p = ho * W_out + wo:
//   offset[n, g*2*K + 2*k    , ho, wo]  displaces the sample in y,
//   offset[n, g*2*K + 2*k + 1, ho, wo]  displaces it in x,
//   mask  [n, g*K   + k      , ho, wo]  scales it (v2; 1 when there is no mask).
//
// Layouts are channels-last, so that the channels of one sample lie side by side: the input is
// read as (block, H, W, C_in), and the columns buffer of a block of images is
// (block, conv group, window pixel, tap, channel within the conv group). The channels of a
// deform group that share one sampling plan are then consecutive both where they are read and
// where they are written: a CPU loop over them vectorises, and neighbouring GPU threads touch
// neighbouring addresses. Each conv group's columns are one (window pixels, K * C_in / G)
// matrix, which the GEMMs use as it lies.

#include <torch/headeronly/macros/Macros.h>

#include <cstdint>
#include <type_traits>

#include "scalar_types.h"
#include "bilinear_sampling.cuh"
#include "deform_conv2d_geometry.h"
#include "invariant_divisor.h"

namespace deformconv {

// The sample position of tap (i, j) at output pixel (ho, wo), before the learned offset.
C10_HOST_DEVICE inline int64_t undeformed_y(const DeformConv2dGeometry& g, int64_t ho, int64_t i) {
  return ho * g.stride_h - g.pad_h + i * g.dilation_h;
}
C10_HOST_DEVICE inline int64_t undeformed_x(const DeformConv2dGeometry& g, int64_t wo, int64_t j) {
  return wo * g.stride_w - g.pad_w + j * g.dilation_w;
}

// One sample: (block image, deform group, tap, output pixel). Samples are numbered in that
// order, the layout of the offset and mask tensors. The output pixel's row and column and the
// undeformed sample position ride along, so that a loop over consecutive pixels can step them
// (next_pixel) instead of dividing for every sample.
struct SampleIndex {
  int64_t n, group, tap, pixel;
  int64_t out_y, out_x;    // pixel = out_y * W_out + out_x
  int64_t grid_y, grid_x;  // where tap `tap` of this pixel samples before its offset
};

// The sample of output pixel `pixel` = out_y * W_out + out_x and tap `tap` = kernel_y * kW +
// kernel_x, from both pairs.
C10_HOST_DEVICE inline SampleIndex sample_at(const DeformConv2dGeometry& g, int64_t n,
                                             int64_t group, int64_t tap, int64_t pixel,
                                             int64_t out_y, int64_t out_x, int64_t kernel_y,
                                             int64_t kernel_x) {
  SampleIndex s;
  s.n = n;
  s.group = group;
  s.tap = tap;
  s.pixel = pixel;
  s.out_y = out_y;
  s.out_x = out_x;
  s.grid_y = undeformed_y(g, out_y, kernel_y);
  s.grid_x = undeformed_x(g, out_x, kernel_x);
  return s;
}

C10_HOST_DEVICE inline SampleIndex make_sample_index(const DeformConv2dGeometry& g, int64_t n,
                                                     int64_t group, int64_t tap, int64_t pixel) {
  return sample_at(g, n, group, tap, pixel, pixel / g.out_width, pixel % g.out_width,
                   tap / g.kernel_w, tap % g.kernel_w);
}

// The divisors of the GPU launchers' index arithmetic (decompose_item_index, sample_of_tap,
// column_index), made once per launch: int64_t, or
// InvariantDivisor when every dividend of the launch is below 2^31; with it, a kernel indexes
// the elements of its tensors in 32 bits (index_type), which the launcher also checks.
template <typename Divisor>
struct IndexDivisors {
  using divisor_type = Divisor;
  using index_type =
      std::conditional_t<std::is_same_v<Divisor, InvariantDivisor>, int32_t, int64_t>;
  Divisor channels_per_group, channels_per_offset_group, taps, window_pixels, groups,
      offset_groups, out_width, kernel_w;

  IndexDivisors(const DeformConv2dGeometry& g, const PixelWindow& window)
      : channels_per_group(g.channels_per_group()),
        channels_per_offset_group(g.channels_per_offset_group()),
        taps(g.taps()),
        window_pixels(window.pixels),
        groups(g.groups),
        offset_groups(g.offset_groups),
        out_width(g.out_width),
        kernel_w(g.kernel_w) {}
};

// Sample (block image, deform group, tap, window pixel) of a window from its row and column.
template <typename Divisor>
C10_HOST_DEVICE inline SampleIndex sample_of_window(const DeformConv2dGeometry& g,
                                                    const PixelWindow& window,
                                                    const IndexDivisors<Divisor>& d, int64_t n,
                                                    int64_t group, int64_t tap,
                                                    int64_t window_pixel) {
  const int64_t pixel = window.begin + window_pixel;
  int64_t out_x, kernel_x;
  const int64_t out_y = divide(pixel, d.out_width, out_x);
  const int64_t kernel_y = divide(tap, d.kernel_w, kernel_x);
  return sample_at(g, n, group, tap, pixel, out_y, out_x, kernel_y, kernel_x);
}

// The GPU's im2col takes the samples of a window by items, one per (block image, window pixel,
// deform group), numbered in that order: neighbouring items take neighbouring channels of one
// pixel, where the input and the columns hold them side by side. An item's sample of tap 0;
// its tap k is sample_of_tap(g, d, item_sample, k).
template <typename Divisor>
C10_HOST_DEVICE inline SampleIndex decompose_item_index(const DeformConv2dGeometry& g,
                                                        const PixelWindow& window,
                                                        const IndexDivisors<Divisor>& d,
                                                        int64_t item) {
  int64_t group, window_pixel;
  const int64_t pixels = divide(item, d.offset_groups, group);  // n * window pixels + pixel
  const int64_t n = divide(pixels, d.window_pixels, window_pixel);
  return sample_of_window(g, window, d, n, group, 0, window_pixel);
}

// Tap `tap` of the same image, deform group and output pixel as sample s of tap 0.
template <typename Divisor>
C10_HOST_DEVICE inline SampleIndex sample_of_tap(const DeformConv2dGeometry& g,
                                                 const IndexDivisors<Divisor>& d,
                                                 const SampleIndex& s, int64_t tap) {
  int64_t kernel_x;
  const int64_t kernel_y = divide(tap, d.kernel_w, kernel_x);
  return sample_at(g, s.n, s.group, tap, s.pixel, s.out_y, s.out_x, kernel_y, kernel_x);
}

// The sample of the next output pixel, same image, deform group and tap. A caller
// may step past the last pixel, as long as it does not use that sample.
C10_HOST_DEVICE inline void next_pixel(const DeformConv2dGeometry& g, SampleIndex& s) {
  ++s.pixel;
  ++s.out_x;
  s.grid_x += g.stride_w;
  if (s.out_x == g.out_width) {
    s.out_x = 0;
    s.grid_x -= g.out_width * g.stride_w;
    ++s.out_y;
    s.grid_y += g.stride_h;
  }
}

// Where a sample's displacement in y lies in the block's offset tensor (its displacement in x
// lies out_pixels() further on), and where its mask value lies in the mask tensor; the same
// places hold their gradients.
C10_HOST_DEVICE inline int64_t offset_y_index(const DeformConv2dGeometry& g,
                                              const SampleIndex& s) {
  return ((s.n * g.offset_groups + s.group) * 2 * g.taps() + 2 * s.tap) * g.out_pixels() +
      s.pixel;
}
C10_HOST_DEVICE inline int64_t mask_index(const DeformConv2dGeometry& g, const SampleIndex& s) {
  return ((s.n * g.offset_groups + s.group) * g.taps() + s.tap) * g.out_pixels() + s.pixel;
}

// Sampled position of one sample, read from the offset tensor of the block, and its mask value
// (1 without a mask).
template <typename scalar_t, typename opmath_t>
C10_HOST_DEVICE inline void sample_position(
    const DeformConv2dGeometry& g, const SampleIndex& s, const scalar_t* offset,
    const scalar_t* mask, opmath_t& y, opmath_t& x, opmath_t& m) {
  const int64_t offset_y_at = offset_y_index(g, s);
  y = static_cast<opmath_t>(s.grid_y) + static_cast<opmath_t>(offset[offset_y_at]);
  x = static_cast<opmath_t>(s.grid_x) + static_cast<opmath_t>(offset[offset_y_at + g.out_pixels()]);
  m = mask == nullptr ? opmath_t(1) : static_cast<opmath_t>(mask[mask_index(g, s)]);
}

// First input channel of a deform group; its channels are [first, first + per group).
C10_HOST_DEVICE inline int64_t first_channel(const DeformConv2dGeometry& g, int64_t group) {
  return group * g.channels_per_offset_group();
}

// Flat position of (block image, conv group, window pixel, tap, channel within the conv group)
// in the columns buffer of a window, laid out in that order.
C10_HOST_DEVICE inline int64_t columns_entry(const DeformConv2dGeometry& g,
                                             const PixelWindow& window, int64_t n,
                                             int64_t conv_group, int64_t window_pixel,
                                             int64_t tap, int64_t channel_in_group) {
  return (((n * g.groups + conv_group) * window.pixels + window_pixel) * g.taps() + tap) *
      g.channels_per_group() + channel_in_group;
}

// Flat position of (block image, window pixel, tap, input channel) in the columns buffer.
C10_HOST_DEVICE inline int64_t column_index(const DeformConv2dGeometry& g,
                                            const PixelWindow& window, int64_t n,
                                            int64_t window_pixel, int64_t tap, int64_t channel) {
  const int64_t conv_group = channel / g.channels_per_group();
  return columns_entry(g, window, n, conv_group, window_pixel, tap,
                       channel - conv_group * g.channels_per_group());
}

// The same for input channel `channel` of a sample, dividing with a launch's divisors.
template <typename Divisor>
C10_HOST_DEVICE inline int64_t column_index(const DeformConv2dGeometry& g,
                                            const PixelWindow& window,
                                            const IndexDivisors<Divisor>& d,
                                            const SampleIndex& s, int64_t channel) {
  int64_t channel_in_group;
  const int64_t conv_group = divide(channel, d.channels_per_group, channel_in_group);
  return columns_entry(g, window, s.n, conv_group, s.pixel - window.begin, s.tap,
                       channel_in_group);
}

// Channel `channel` of grid pixel 0 of block image n in a channels-last (block, H, W, C_in)
// tensor; grid pixel i of that channel is at i * C_in from there.
template <typename scalar_t>
C10_HOST_DEVICE inline scalar_t* channel_of(const DeformConv2dGeometry& g, scalar_t* data,
                                            int64_t n, int64_t channel) {
  return data + n * g.in_pixels() * g.in_channels + channel;
}

// Writes the offset and mask gradients of sample s of modulation m from its three sums; either
// pointer may be null (not asked for).
template <typename scalar_t>
C10_HOST_DEVICE inline void finish_offset_mask_grad(
    const DeformConv2dGeometry& g, const SampleIndex& s, opmath_type<scalar_t> m,
    const OffsetMaskGradSums<opmath_type<scalar_t>>& sums, scalar_t* grad_offset,
    scalar_t* grad_mask) {
  if (grad_offset != nullptr) {
    const int64_t y_at = offset_y_index(g, s);
    grad_offset[y_at] = static_cast<scalar_t>(m * sums.y);
    grad_offset[y_at + g.out_pixels()] = static_cast<scalar_t>(m * sums.x);
  }
  if (grad_mask != nullptr) {
    grad_mask[mask_index(g, s)] = static_cast<scalar_t>(sums.m);
  }
}

}  // namespace deformconv
