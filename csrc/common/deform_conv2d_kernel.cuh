#pragma once

// The arithmetic of deformable convolution, one element at a time.
//
// Every function here is C10_HOST_DEVICE: g++ compiles it for the CPU launchers and nvcc for
// the CUDA kernels, so the CPU test suite exercises exactly the arithmetic the GPU runs. The
// launchers only choose the loop (at::parallel_for or a grid-stride loop); the single
// device-specific line is the scatter-add in `scatter_add`.
//
// Conventions (DESIGN.md §1), for image n, deform group g, tap k = i * kW + j, output pixel
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

#include <ATen/OpMathType.h>
#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#include <ATen/cuda/Atomic.cuh>
#endif

#include "deform_conv2d_geometry.h"
#include "invariant_divisor.h"

namespace deformconv {

// The unit cell of the input grid that holds a sample at (y, x):
//
//        x0      x0+1
//   y0   v00 ---- v01      lx = x - x0, ly = y - y0, both in [0, 1)
//         |  *     |       value = (1-ly)(1-lx) v00 + (1-ly) lx v01
//   y0+1 v10 ---- v11            +    ly (1-lx) v10 +    ly  lx v11
//
// A corner outside the image reads as 0; a sample outside (-1, H) x (-1, W) is 0 as a whole.
// The cell is the one that starts at (floor(y), floor(x)), so at integer coordinates the
// derivative is one-sided from above: mmcv's convention, which its published vectors need.
template <typename opmath_t>
struct BilinearCell {
  bool inside = false;  // false also for NaN or infinite coordinates
  int64_t y0 = 0;
  int64_t x0 = 0;
  opmath_t ly = 0;
  opmath_t lx = 0;
  bool top = false;     // row y0 is in the image
  bool bottom = false;  // row y0 + 1 is in the image
  bool left = false;    // column x0 is in the image
  bool right = false;   // column x0 + 1 is in the image
};

template <typename opmath_t>
C10_HOST_DEVICE inline BilinearCell<opmath_t> locate_cell(
    opmath_t y, opmath_t x, int64_t height, int64_t width) {
  BilinearCell<opmath_t> cell;
  // Phrased positively so that NaN fails; this bound also keeps floor() within int64 range
  // before the cast, which would be undefined behaviour for huge or non-finite values.
  cell.inside = y > opmath_t(-1) && y < static_cast<opmath_t>(height) &&
      x > opmath_t(-1) && x < static_cast<opmath_t>(width);
  if (!cell.inside) {
    return cell;
  }
  const opmath_t y_floor = ::floor(y);
  const opmath_t x_floor = ::floor(x);
  cell.y0 = static_cast<int64_t>(y_floor);
  cell.x0 = static_cast<int64_t>(x_floor);
  cell.ly = y - y_floor;
  cell.lx = x - x_floor;
  cell.top = cell.y0 >= 0;
  cell.bottom = cell.y0 + 1 < height;
  cell.left = cell.x0 >= 0;
  cell.right = cell.x0 + 1 < width;
  return cell;
}

// Where one sample reads the input and with which weights, the mask folded in. A plan is made
// once per (image, deform group, tap, output pixel) and serves every channel of the deform
// group, in the forward im2col and in the backward col2im: the bilinear weights are never
// recomputed per channel. A corner outside the image has weight 0 and index 0, so that reading
// it stays in bounds.
template <typename opmath_t>
struct SamplingPlan {
  int64_t index[4];    // pixel in the H * W grid: (y0, x0), (y0, x0+1), (y0+1, x0), (y0+1, x0+1)
  opmath_t weight[4];  // mask * bilinear weight of that corner
};

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

// The divisors of the GPU launchers' index arithmetic (decompose_sample_index,
// decompose_column_index), made once per launch: int64_t, or InvariantDivisor when every
// dividend of the launch is below 2^31.
template <typename Divisor>
struct IndexDivisors {
  Divisor channels_per_group, channels_per_offset_group, taps, window_pixels, groups,
      offset_groups, out_width, kernel_w;

  explicit IndexDivisors(const DeformConv2dGeometry& g)
      : channels_per_group(g.channels_per_group()),
        channels_per_offset_group(g.channels_per_offset_group()),
        taps(g.taps()),
        window_pixels(g.window_pixels),
        groups(g.groups),
        offset_groups(g.offset_groups),
        out_width(g.out_width),
        kernel_w(g.kernel_w) {}
};

// Sample (block image, deform group, tap, window pixel) of a window from its row and column.
template <typename Divisor>
C10_HOST_DEVICE inline SampleIndex sample_of_window(const DeformConv2dGeometry& g,
                                                    const IndexDivisors<Divisor>& d, int64_t n,
                                                    int64_t group, int64_t tap,
                                                    int64_t window_pixel) {
  const int64_t pixel = g.window_begin + window_pixel;
  int64_t out_x, kernel_x;
  const int64_t out_y = divide(pixel, d.out_width, out_x);
  const int64_t kernel_y = divide(tap, d.kernel_w, kernel_x);
  return sample_at(g, n, group, tap, pixel, out_y, out_x, kernel_y, kernel_x);
}

// Sample `index` of the current window: (block image, deform group, tap, pixel of the window).
template <typename Divisor>
C10_HOST_DEVICE inline SampleIndex decompose_sample_index(
    const DeformConv2dGeometry& g, const IndexDivisors<Divisor>& d, int64_t index) {
  int64_t window_pixel, tap, group;
  index = divide(index, d.window_pixels, window_pixel);
  index = divide(index, d.taps, tap);
  const int64_t n = divide(index, d.offset_groups, group);
  return sample_of_window(g, d, n, group, tap, window_pixel);
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

// Sampled position of one sample, read from the offset tensor of the block, and its mask value
// (1 without a mask).
template <typename scalar_t, typename opmath_t>
C10_HOST_DEVICE inline void sample_position(
    const DeformConv2dGeometry& g, const SampleIndex& s, const scalar_t* offset,
    const scalar_t* mask, opmath_t& y, opmath_t& x, opmath_t& m) {
  const int64_t K = g.taps();
  const int64_t P = g.out_pixels();
  const int64_t offset_y_at = ((s.n * g.offset_groups + s.group) * 2 * K + 2 * s.tap) * P + s.pixel;
  y = static_cast<opmath_t>(s.grid_y) + static_cast<opmath_t>(offset[offset_y_at]);
  x = static_cast<opmath_t>(s.grid_x) + static_cast<opmath_t>(offset[offset_y_at + P]);
  m = mask == nullptr
      ? opmath_t(1)
      : static_cast<opmath_t>(mask[((s.n * g.offset_groups + s.group) * K + s.tap) * P + s.pixel]);
}

// The corners of a cell that lie inside the image; the derivative needs the value of each of
// them, even one of zero bilinear weight. & rather than &&: no branches.
template <typename opmath_t>
C10_HOST_DEVICE inline void corners_inside(const BilinearCell<opmath_t>& cell, bool inside[4]) {
  inside[0] = cell.top & cell.left;
  inside[1] = cell.top & cell.right;
  inside[2] = cell.bottom & cell.left;
  inside[3] = cell.bottom & cell.right;
}

// The grid index of each corner of a cell, 0 for a corner outside the image (never read, but a
// valid address to read).
template <typename opmath_t>
C10_HOST_DEVICE inline void corner_indices(const BilinearCell<opmath_t>& cell, int64_t width,
                                           int64_t index[4]) {
  bool inside[4];
  corners_inside(cell, inside);
  const int64_t top_left = cell.y0 * width + cell.x0;
  const int64_t corner_index[4] = {top_left, top_left + 1, top_left + width,
                                   top_left + width + 1};
  for (int corner = 0; corner < 4; ++corner) {
    index[corner] = inside[corner] ? corner_index[corner] : 0;
  }
}

template <typename scalar_t>
C10_HOST_DEVICE inline SamplingPlan<at::opmath_type<scalar_t>> make_sampling_plan(
    const DeformConv2dGeometry& g, const SampleIndex& s, const scalar_t* offset,
    const scalar_t* mask) {
  using opmath_t = at::opmath_type<scalar_t>;
  opmath_t y, x, m;
  sample_position(g, s, offset, mask, y, x, m);
  const BilinearCell<opmath_t> cell = locate_cell(y, x, g.in_height, g.in_width);
  const opmath_t hy = opmath_t(1) - cell.ly;
  const opmath_t hx = opmath_t(1) - cell.lx;
  bool inside[4];
  corners_inside(cell, inside);
  const opmath_t corner_weight[4] = {hy * hx, hy * cell.lx, cell.ly * hx, cell.ly * cell.lx};
  SamplingPlan<opmath_t> plan;
  corner_indices(cell, g.in_width, plan.index);
  for (int corner = 0; corner < 4; ++corner) {
    plan.weight[corner] = inside[corner] ? m * corner_weight[corner] : opmath_t(0);
  }
  return plan;
}

// First input channel of a deform group; its channels are [first, first + per group).
C10_HOST_DEVICE inline int64_t first_channel(const DeformConv2dGeometry& g, int64_t group) {
  return group * g.channels_per_offset_group();
}

// Flat position of (block image, conv group, window pixel, tap, channel within the conv group)
// in the columns buffer, laid out in that order.
C10_HOST_DEVICE inline int64_t columns_entry(const DeformConv2dGeometry& g, int64_t n,
                                             int64_t conv_group, int64_t window_pixel,
                                             int64_t tap, int64_t channel_in_group) {
  return (((n * g.groups + conv_group) * g.window_pixels + window_pixel) * g.taps() + tap) *
      g.channels_per_group() + channel_in_group;
}

// Flat position of (block image, window pixel, tap, input channel) in the columns buffer.
C10_HOST_DEVICE inline int64_t column_index(const DeformConv2dGeometry& g, int64_t n,
                                            int64_t window_pixel, int64_t tap, int64_t channel) {
  const int64_t conv_group = channel / g.channels_per_group();
  return columns_entry(g, n, conv_group, window_pixel, tap,
                       channel - conv_group * g.channels_per_group());
}

// The same for input channel `channel` of a sample, dividing with a launch's divisors.
template <typename Divisor>
C10_HOST_DEVICE inline int64_t column_index(const DeformConv2dGeometry& g,
                                            const IndexDivisors<Divisor>& d,
                                            const SampleIndex& s, int64_t channel) {
  int64_t channel_in_group;
  const int64_t conv_group = divide(channel, d.channels_per_group, channel_in_group);
  return columns_entry(g, s.n, conv_group, s.pixel - g.window_begin, s.tap, channel_in_group);
}

// The inverse of column_index: the sample and the input channel of columns entry `index` of
// the current window. (The GPU launchers run one thread per entry.)
template <typename Divisor>
C10_HOST_DEVICE inline SampleIndex decompose_column_index(const DeformConv2dGeometry& g,
                                                          const IndexDivisors<Divisor>& d,
                                                          int64_t index, int64_t& channel) {
  int64_t channel_in_group, tap, window_pixel, conv_group, unused;
  index = divide(index, d.channels_per_group, channel_in_group);
  index = divide(index, d.taps, tap);
  index = divide(index, d.window_pixels, window_pixel);
  const int64_t n = divide(index, d.groups, conv_group);
  channel = conv_group * g.channels_per_group() + channel_in_group;
  const int64_t group = divide(channel, d.channels_per_offset_group, unused);
  return sample_of_window(g, d, n, group, tap, window_pixel);
}

// Channel `channel` of grid pixel 0 of block image n in a channels-last (block, H, W, C_in)
// tensor; grid pixel i of that channel is at i * C_in from there.
template <typename scalar_t>
C10_HOST_DEVICE inline scalar_t* channel_of(const DeformConv2dGeometry& g, scalar_t* data,
                                            int64_t n, int64_t channel) {
  return data + n * g.in_pixels() * g.in_channels + channel;
}

// mask * bilinear(input, sampled position) of one channel: one columns entry. `channel` points
// at the channel's value at grid pixel 0 (channel_of). Every corner is read, outside ones at
// index 0, and a zero weight is selected away rather than multiplied, so that an infinite
// input value at a corner that takes no part cannot turn the sample into NaN. Without branches
// a CPU loop over consecutive channels vectorises.
template <typename scalar_t>
C10_HOST_DEVICE inline scalar_t sample_with_plan(
    const SamplingPlan<at::opmath_type<scalar_t>>& plan, const scalar_t* channel,
    int64_t channel_stride) {
  using opmath_t = at::opmath_type<scalar_t>;
  opmath_t value = 0;
  for (int corner = 0; corner < 4; ++corner) {
    const opmath_t read = static_cast<opmath_t>(channel[plan.index[corner] * channel_stride]);
    value += plan.weight[corner] != opmath_t(0) ? plan.weight[corner] * read : opmath_t(0);
  }
  return static_cast<scalar_t>(value);
}

// Adds into a gradient buffer. On the GPU several threads hit the same input pixel, so the add
// is atomic; the CPU launcher gives each task its own channels, so its writes are disjoint.
template <typename scalar_t>
C10_HOST_DEVICE inline void scatter_add(scalar_t* address, scalar_t value) {
#if defined(__CUDA_ARCH__)
  gpuAtomicAddNoReturn(address, value);
#else
  *address += value;
#endif
}

// The adjoint of sample_with_plan at one corner, for `channels` consecutive channels (1 on the
// GPU, a run on the CPU): adds weight * columns gradient onto the input gradient, `channel`
// pointing as in sample_with_plan. The caller skips corners of zero weight (outside the image
// among them), so an infinite gradient cannot make NaN there. The input gradient is of the
// columns' type, or float where the CUDA launcher accumulates half precision in float32.
template <typename scalar_t, typename grad_t>
C10_HOST_DEVICE inline void scatter_corner(
    const SamplingPlan<at::opmath_type<scalar_t>>& plan, int corner,
    const scalar_t* grad_columns, int64_t channels, grad_t* grad_channel,
    int64_t channel_stride) {
  using opmath_t = at::opmath_type<scalar_t>;
  const opmath_t weight = plan.weight[corner];
  grad_t* grad_corner = grad_channel + plan.index[corner] * channel_stride;
  for (int64_t c = 0; c < channels; ++c) {
    scatter_add(grad_corner + c,
                static_cast<grad_t>(weight * static_cast<opmath_t>(grad_columns[c])));
  }
}

// The adjoint of sample_with_plan, every corner.
template <typename scalar_t, typename grad_t>
C10_HOST_DEVICE inline void scatter_with_plan(
    const SamplingPlan<at::opmath_type<scalar_t>>& plan, const scalar_t* grad_columns,
    int64_t channels, grad_t* grad_channel, int64_t channel_stride) {
  for (int corner = 0; corner < 4; ++corner) {
    if (plan.weight[corner] != 0) {
      scatter_corner(plan, corner, grad_columns, channels, grad_channel, channel_stride);
    }
  }
}

// Gradients of the offsets and the mask of one sample. With column value c = m * bilinear(y, x)
// and its gradient G_c, summed over the channels of the deform group:
//   dL/dm = sum_c G_c * bilinear_c(y, x)
//   dL/dy = m * sum_c G_c * d bilinear_c / dy,   d/dy = (1-lx)(v10 - v00) + lx (v11 - v01)
//   dL/dx = m * sum_c G_c * d bilinear_c / dx,   d/dx = (1-ly)(v01 - v00) + ly (v11 - v10)
// In three steps, so that a launcher may visit channels in the order that suits its memory:
// locate the sample once, accumulate channel by channel, write once. Each sample writes only
// its own outputs: no atomics on either device.
template <typename opmath_t>
struct OffsetMaskGrad {
  BilinearCell<opmath_t> cell;
  int64_t index[4];  // corner_indices of the cell
  opmath_t mask = 1;
};

// The three sums above, without the factor m. A launcher may keep several (one per vector lane
// on the CPU) and add them up at the end.
template <typename opmath_t>
struct OffsetMaskGradSums {
  opmath_t y = 0, x = 0, m = 0;
};

template <typename scalar_t>
C10_HOST_DEVICE inline OffsetMaskGrad<at::opmath_type<scalar_t>> start_offset_mask_grad(
    const DeformConv2dGeometry& g, const SampleIndex& s, const scalar_t* offset,
    const scalar_t* mask) {
  using opmath_t = at::opmath_type<scalar_t>;
  opmath_t y, x, m;
  sample_position(g, s, offset, mask, y, x, m);
  // The cell is built in place: assigned from a returned copy, its flags would be stored byte
  // by byte and reloaded as one word, a store-forwarding stall on x86 per sample.
  OffsetMaskGrad<opmath_t> acc{locate_cell(y, x, g.in_height, g.in_width), {}, m};
  corner_indices(acc.cell, g.in_width, acc.index);
  return acc;
}

// Adds the share of one channel to the three sums: its columns gradient `grad` and its values
// v00, v01, v10, v11 at the cell's corners (0 outside). value_t is opmath_t, or, in the CPU
// launcher, a vector of opmath_t holding consecutive channels (the same arithmetic in every
// lane). Separate arguments rather than an array, so that vectors stay in registers.
template <typename opmath_t, typename value_t>
C10_HOST_DEVICE inline void add_offset_mask_grad_terms(
    const BilinearCell<opmath_t>& cell, const value_t& grad, const value_t& v00,
    const value_t& v01, const value_t& v10, const value_t& v11, value_t& sum_y, value_t& sum_x,
    value_t& sum_m) {
  const opmath_t hy = opmath_t(1) - cell.ly;
  const opmath_t hx = opmath_t(1) - cell.lx;
  sum_y += grad * (hx * (v10 - v00) + cell.lx * (v11 - v01));
  sum_x += grad * (hy * (v01 - v00) + cell.ly * (v11 - v10));
  sum_m += grad * (hy * (hx * v00 + cell.lx * v01) + cell.ly * (hx * v10 + cell.lx * v11));
}

// Adds one channel's share, `channel` pointing as in sample_with_plan. The caller skips
// samples outside.
template <typename scalar_t>
C10_HOST_DEVICE inline void accumulate_offset_mask_grad(
    const OffsetMaskGrad<at::opmath_type<scalar_t>>& acc, scalar_t grad_column,
    const scalar_t* channel, int64_t channel_stride,
    OffsetMaskGradSums<at::opmath_type<scalar_t>>& sums) {
  using opmath_t = at::opmath_type<scalar_t>;
  bool inside[4];
  corners_inside(acc.cell, inside);
  opmath_t v[4];
  for (int corner = 0; corner < 4; ++corner) {
    v[corner] =
        inside[corner] ? static_cast<opmath_t>(channel[acc.index[corner] * channel_stride]) : 0;
  }
  add_offset_mask_grad_terms(acc.cell, static_cast<opmath_t>(grad_column), v[0], v[1], v[2], v[3],
                             sums.y, sums.x, sums.m);
}

// Writes the sample's offset and mask gradients; either pointer may be null (not asked for).
template <typename scalar_t>
C10_HOST_DEVICE inline void finish_offset_mask_grad(
    const DeformConv2dGeometry& g, const SampleIndex& s,
    const OffsetMaskGrad<at::opmath_type<scalar_t>>& acc,
    const OffsetMaskGradSums<at::opmath_type<scalar_t>>& sums, scalar_t* grad_offset,
    scalar_t* grad_mask) {
  const int64_t group_of_image = s.n * g.offset_groups + s.group;
  if (grad_offset != nullptr) {
    const int64_t y_at = (group_of_image * 2 * g.taps() + 2 * s.tap) * g.out_pixels() + s.pixel;
    grad_offset[y_at] = static_cast<scalar_t>(acc.mask * sums.y);
    grad_offset[y_at + g.out_pixels()] = static_cast<scalar_t>(acc.mask * sums.x);
  }
  if (grad_mask != nullptr) {
    grad_mask[(group_of_image * g.taps() + s.tap) * g.out_pixels() + s.pixel] =
        static_cast<scalar_t>(sums.m);
  }
}

}  // namespace deformconv
