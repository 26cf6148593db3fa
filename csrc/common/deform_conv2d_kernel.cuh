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
// The columns buffer of a block of images is (block, C_in * K, pixels of the window), row
// c * K + k.

#include <ATen/OpMathType.h>
#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#include <ATen/cuda/Atomic.cuh>
#endif

#include "deform_conv2d_geometry.h"

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

// The four corner values of a cell in one input plane (H * W, row-major); 0 where a corner
// lies outside, which is also what keeps every read in bounds.
template <typename opmath_t>
struct CornerValues {
  opmath_t v00 = 0, v01 = 0, v10 = 0, v11 = 0;
};

template <typename opmath_t, typename scalar_t>
C10_HOST_DEVICE inline CornerValues<opmath_t> read_corners(
    const BilinearCell<opmath_t>& cell, const scalar_t* plane, int64_t width) {
  CornerValues<opmath_t> v;
  const int64_t top_left = cell.y0 * width + cell.x0;
  if (cell.top && cell.left) v.v00 = static_cast<opmath_t>(plane[top_left]);
  if (cell.top && cell.right) v.v01 = static_cast<opmath_t>(plane[top_left + 1]);
  if (cell.bottom && cell.left) v.v10 = static_cast<opmath_t>(plane[top_left + width]);
  if (cell.bottom && cell.right) v.v11 = static_cast<opmath_t>(plane[top_left + width + 1]);
  return v;
}

// Where one sample reads the input plane and with which weights, the mask folded in. A plan is
// made once per (image, deform group, tap, output pixel) and serves every channel of the deform
// group in turn, in the forward im2col and in the backward col2im: the bilinear weights are
// never recomputed per channel. A corner outside the image has weight 0 and is never read.
template <typename opmath_t>
struct SamplingPlan {
  int64_t index[4];    // in the H * W plane: (y0, x0), (y0, x0+1), (y0+1, x0), (y0+1, x0+1)
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
// order, the layout of the offset and mask tensors and of the launchers' loops. The output
// pixel's row and column and the undeformed sample position ride along, so that a loop over
// consecutive pixels can step them (next_pixel) instead of dividing for every sample.
struct SampleIndex {
  int64_t n, group, tap, pixel;
  int64_t out_y, out_x;    // pixel = out_y * W_out + out_x
  int64_t grid_y, grid_x;  // where tap `tap` of this pixel samples before its offset
};

// Sample `index` of the current window: (block image, deform group, tap, pixel of the window).
C10_HOST_DEVICE inline SampleIndex decompose_sample_index(
    const DeformConv2dGeometry& g, int64_t index) {
  SampleIndex s;
  s.pixel = g.window_begin + index % g.window_pixels;
  index /= g.window_pixels;
  s.tap = index % g.taps();
  index /= g.taps();
  s.group = index % g.offset_groups;
  s.n = index / g.offset_groups;
  s.out_y = s.pixel / g.out_width;
  s.out_x = s.pixel % g.out_width;
  s.grid_y = undeformed_y(g, s.out_y, s.tap / g.kernel_w);
  s.grid_x = undeformed_x(g, s.out_x, s.tap % g.kernel_w);
  return s;
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

template <typename scalar_t>
C10_HOST_DEVICE inline SamplingPlan<at::opmath_type<scalar_t>> make_sampling_plan(
    const DeformConv2dGeometry& g, const SampleIndex& s, const scalar_t* offset,
    const scalar_t* mask) {
  using opmath_t = at::opmath_type<scalar_t>;
  opmath_t y, x, m;
  sample_position(g, s, offset, mask, y, x, m);
  const BilinearCell<opmath_t> cell = locate_cell(y, x, g.in_height, g.in_width);
  const int64_t top_left = cell.y0 * g.in_width + cell.x0;
  const opmath_t hy = opmath_t(1) - cell.ly;
  const opmath_t hx = opmath_t(1) - cell.lx;
  const bool valid[4] = {cell.top && cell.left, cell.top && cell.right,
                         cell.bottom && cell.left, cell.bottom && cell.right};
  const int64_t corner_index[4] = {top_left, top_left + 1, top_left + g.in_width,
                                   top_left + g.in_width + 1};
  const opmath_t corner_weight[4] = {hy * hx, hy * cell.lx, cell.ly * hx, cell.ly * cell.lx};
  SamplingPlan<opmath_t> plan;
  for (int corner = 0; corner < 4; ++corner) {
    plan.index[corner] = valid[corner] ? corner_index[corner] : 0;
    plan.weight[corner] = valid[corner] ? m * corner_weight[corner] : opmath_t(0);
  }
  return plan;
}

// First input channel of a deform group; its channels are [first, first + per group).
C10_HOST_DEVICE inline int64_t first_channel(const DeformConv2dGeometry& g, int64_t group) {
  return group * g.channels_per_offset_group();
}

// Flat position of (block image, input channel, tap, pixel) in the columns buffer, which holds
// the pixels of the current window: (block, C_in * K, window_pixels).
C10_HOST_DEVICE inline int64_t column_index(const DeformConv2dGeometry& g, const SampleIndex& s,
                                            int64_t channel) {
  return ((s.n * g.in_channels + channel) * g.taps() + s.tap) * g.window_pixels +
      (s.pixel - g.window_begin);
}

// Start of the H * W plane of (block image, channel) in an input-shaped tensor.
template <typename scalar_t>
C10_HOST_DEVICE inline scalar_t* plane_of(const DeformConv2dGeometry& g, scalar_t* data,
                                          int64_t n, int64_t channel) {
  return data + (n * g.in_channels + channel) * g.in_pixels();
}

// mask * bilinear(plane, sampled position): one columns entry.
template <typename scalar_t>
C10_HOST_DEVICE inline scalar_t sample_with_plan(
    const SamplingPlan<at::opmath_type<scalar_t>>& plan, const scalar_t* plane) {
  using opmath_t = at::opmath_type<scalar_t>;
  opmath_t value = 0;
  for (int corner = 0; corner < 4; ++corner) {
    // A zero weight is skipped rather than multiplied, so an infinite input value at a corner
    // that does not take part cannot turn the sample into NaN.
    if (plan.weight[corner] != opmath_t(0)) {
      value += plan.weight[corner] * static_cast<opmath_t>(plane[plan.index[corner]]);
    }
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

// The adjoint of sample_with_plan: spreads the gradient of one columns entry onto the plane.
template <typename scalar_t>
C10_HOST_DEVICE inline void scatter_with_plan(
    const SamplingPlan<at::opmath_type<scalar_t>>& plan, scalar_t grad_column,
    scalar_t* grad_plane) {
  using opmath_t = at::opmath_type<scalar_t>;
  const opmath_t grad = static_cast<opmath_t>(grad_column);
  for (int corner = 0; corner < 4; ++corner) {
    if (plan.weight[corner] != opmath_t(0)) {
      scatter_add(grad_plane + plan.index[corner],
                  static_cast<scalar_t>(plan.weight[corner] * grad));
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
  opmath_t mask = 1;
  opmath_t y = 0, x = 0, m = 0;  // the three sums above, without the factor m
};

template <typename scalar_t>
C10_HOST_DEVICE inline OffsetMaskGrad<at::opmath_type<scalar_t>> start_offset_mask_grad(
    const DeformConv2dGeometry& g, const SampleIndex& s, const scalar_t* offset,
    const scalar_t* mask) {
  using opmath_t = at::opmath_type<scalar_t>;
  OffsetMaskGrad<opmath_t> acc;
  opmath_t y, x;
  sample_position(g, s, offset, mask, y, x, acc.mask);
  acc.cell = locate_cell(y, x, g.in_height, g.in_width);
  return acc;
}

// Adds channel `channel`'s share, read from grad_columns and the input plane.
template <typename scalar_t>
C10_HOST_DEVICE inline void accumulate_offset_mask_grad(
    const DeformConv2dGeometry& g, const SampleIndex& s, int64_t channel,
    const scalar_t* grad_columns, const scalar_t* input,
    OffsetMaskGrad<at::opmath_type<scalar_t>>& acc) {
  using opmath_t = at::opmath_type<scalar_t>;
  const BilinearCell<opmath_t>& cell = acc.cell;
  if (!cell.inside) {
    return;
  }
  const opmath_t grad = static_cast<opmath_t>(grad_columns[column_index(g, s, channel)]);
  const CornerValues<opmath_t> v = read_corners(cell, plane_of(g, input, s.n, channel), g.in_width);
  const opmath_t hy = opmath_t(1) - cell.ly;
  const opmath_t hx = opmath_t(1) - cell.lx;
  acc.y += grad * (hx * (v.v10 - v.v00) + cell.lx * (v.v11 - v.v01));
  acc.x += grad * (hy * (v.v01 - v.v00) + cell.ly * (v.v11 - v.v10));
  acc.m += grad * (hy * (hx * v.v00 + cell.lx * v.v01) + cell.ly * (hx * v.v10 + cell.lx * v.v11));
}

// Writes the sample's offset and mask gradients; either pointer may be null (not asked for).
template <typename scalar_t>
C10_HOST_DEVICE inline void finish_offset_mask_grad(
    const DeformConv2dGeometry& g, const SampleIndex& s,
    const OffsetMaskGrad<at::opmath_type<scalar_t>>& acc, scalar_t* grad_offset,
    scalar_t* grad_mask) {
  const int64_t group_of_image = s.n * g.offset_groups + s.group;
  if (grad_offset != nullptr) {
    const int64_t y_at = (group_of_image * 2 * g.taps() + 2 * s.tap) * g.out_pixels() + s.pixel;
    grad_offset[y_at] = static_cast<scalar_t>(acc.mask * acc.y);
    grad_offset[y_at + g.out_pixels()] = static_cast<scalar_t>(acc.mask * acc.x);
  }
  if (grad_mask != nullptr) {
    grad_mask[(group_of_image * g.taps() + s.tap) * g.out_pixels() + s.pixel] =
        static_cast<scalar_t>(acc.m);
  }
}

}  // namespace deformconv
