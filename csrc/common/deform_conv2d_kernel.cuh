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
// The columns buffer of a block of images is (block, C_in * K, H_out * W_out), row c * K + k.

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

// Where one sample reads the input plane and with which weights, the mask folded in. One plan
// serves every channel of its deform group, in the forward im2col and in the backward col2im,
// so the bilinear weights are computed once per (image, deform group, tap, output pixel).
// A corner outside the image has weight 0 and index 0 and is never read.
template <typename opmath_t>
struct SamplingPlan {
  int64_t index[4];    // in the H * W plane: (y0, x0), (y0, x0+1), (y0+1, x0), (y0+1, x0+1)
  opmath_t weight[4];  // mask * bilinear weight of that corner
};

// The sample position of tap (i, j) at output pixel (ho, wo), before the learned offset.
C10_HOST_DEVICE inline int64_t grid_y(const DeformConv2dGeometry& g, int64_t ho, int64_t i) {
  return ho * g.stride_h - g.pad_h + i * g.dilation_h;
}
C10_HOST_DEVICE inline int64_t grid_x(const DeformConv2dGeometry& g, int64_t wo, int64_t j) {
  return wo * g.stride_w - g.pad_w + j * g.dilation_w;
}

// Decomposition of a flat index over (block image, deform group, tap, output pixel), the
// layout of sampling plans and of the offset/mask gradient work.
struct SampleIndex {
  int64_t n, group, tap, pixel;
};

C10_HOST_DEVICE inline SampleIndex decompose_sample_index(
    const DeformConv2dGeometry& g, int64_t index) {
  SampleIndex s;
  s.pixel = index % g.out_pixels();
  index /= g.out_pixels();
  s.tap = index % g.taps();
  index /= g.taps();
  s.group = index % g.offset_groups;
  s.n = index / g.offset_groups;
  return s;
}

// Sampled position of one (image, deform group, tap, pixel), read from the offset tensor of
// the block, and its mask value (1 without a mask).
template <typename scalar_t, typename opmath_t>
C10_HOST_DEVICE inline void sample_position(
    const DeformConv2dGeometry& g, const SampleIndex& s, const scalar_t* offset,
    const scalar_t* mask, opmath_t& y, opmath_t& x, opmath_t& m) {
  const int64_t K = g.taps();
  const int64_t P = g.out_pixels();
  const int64_t ho = s.pixel / g.out_width;
  const int64_t wo = s.pixel % g.out_width;
  const int64_t i = s.tap / g.kernel_w;
  const int64_t j = s.tap % g.kernel_w;
  const int64_t offset_y_at = ((s.n * g.offset_groups + s.group) * 2 * K + 2 * s.tap) * P + s.pixel;
  y = static_cast<opmath_t>(grid_y(g, ho, i)) + static_cast<opmath_t>(offset[offset_y_at]);
  x = static_cast<opmath_t>(grid_x(g, wo, j)) + static_cast<opmath_t>(offset[offset_y_at + P]);
  m = mask == nullptr
      ? opmath_t(1)
      : static_cast<opmath_t>(mask[((s.n * g.offset_groups + s.group) * K + s.tap) * P + s.pixel]);
}

// Plan of sample `index` over (block image, deform group, tap, output pixel).
template <typename scalar_t>
C10_HOST_DEVICE inline void sampling_plan_element(
    const DeformConv2dGeometry& g, const scalar_t* offset, const scalar_t* mask,
    SamplingPlan<at::opmath_type<scalar_t>>* plans, int64_t index) {
  using opmath_t = at::opmath_type<scalar_t>;
  opmath_t y, x, m;
  sample_position(g, decompose_sample_index(g, index), offset, mask, y, x, m);
  const BilinearCell<opmath_t> cell = locate_cell(y, x, g.in_height, g.in_width);
  SamplingPlan<opmath_t> plan;
  const int64_t top_left = cell.y0 * g.in_width + cell.x0;
  const opmath_t hy = opmath_t(1) - cell.ly;
  const opmath_t hx = opmath_t(1) - cell.lx;
  const bool valid[4] = {cell.top && cell.left, cell.top && cell.right,
                         cell.bottom && cell.left, cell.bottom && cell.right};
  const int64_t corner_index[4] = {top_left, top_left + 1, top_left + g.in_width,
                                   top_left + g.in_width + 1};
  const opmath_t corner_weight[4] = {hy * hx, hy * cell.lx, cell.ly * hx, cell.ly * cell.lx};
  for (int corner = 0; corner < 4; ++corner) {
    plan.index[corner] = valid[corner] ? corner_index[corner] : 0;
    plan.weight[corner] = valid[corner] ? m * corner_weight[corner] : opmath_t(0);
  }
  plans[index] = plan;
}

// Position of columns element `index` over (block image, input channel, tap, output pixel),
// and the plan it uses.
struct ColumnIndex {
  int64_t plane;  // (block image, input channel): which H * W plane of the input
  int64_t plan;   // flat index of its sampling plan
};

C10_HOST_DEVICE inline ColumnIndex decompose_column_index(
    const DeformConv2dGeometry& g, int64_t index) {
  const int64_t pixel = index % g.out_pixels();
  const int64_t tap = (index / g.out_pixels()) % g.taps();
  const int64_t plane = index / (g.out_pixels() * g.taps());
  const int64_t channel = plane % g.in_channels;
  const int64_t n = plane / g.in_channels;
  const int64_t group = channel / g.channels_per_offset_group();
  ColumnIndex c;
  c.plane = plane;
  c.plan = ((n * g.offset_groups + group) * g.taps() + tap) * g.out_pixels() + pixel;
  return c;
}

// columns[index] = mask * bilinear(input plane, sampled position).
template <typename scalar_t>
C10_HOST_DEVICE inline void im2col_element(
    const DeformConv2dGeometry& g, const scalar_t* input,
    const SamplingPlan<at::opmath_type<scalar_t>>* plans, scalar_t* columns, int64_t index) {
  using opmath_t = at::opmath_type<scalar_t>;
  const ColumnIndex c = decompose_column_index(g, index);
  const SamplingPlan<opmath_t>& plan = plans[c.plan];
  const scalar_t* plane = input + c.plane * g.in_pixels();
  opmath_t value = 0;
  for (int corner = 0; corner < 4; ++corner) {
    // A zero weight is skipped rather than multiplied, so an infinite input value at a corner
    // that does not take part cannot turn the sample into NaN.
    if (plan.weight[corner] != opmath_t(0)) {
      value += plan.weight[corner] * static_cast<opmath_t>(plane[plan.index[corner]]);
    }
  }
  columns[index] = static_cast<scalar_t>(value);
}

// Adds into a gradient buffer. On the GPU several threads hit the same input pixel, so the add
// is atomic; the CPU launcher partitions the work by input plane, so its writes are disjoint.
template <typename scalar_t>
C10_HOST_DEVICE inline void scatter_add(scalar_t* address, scalar_t value) {
#if defined(__CUDA_ARCH__)
  gpuAtomicAddNoReturn(address, value);
#else
  *address += value;
#endif
}

// The adjoint of im2col_element: spreads grad_columns[index] back onto the input plane.
template <typename scalar_t>
C10_HOST_DEVICE inline void col2im_element(
    const DeformConv2dGeometry& g, const scalar_t* grad_columns,
    const SamplingPlan<at::opmath_type<scalar_t>>* plans, scalar_t* grad_input, int64_t index) {
  using opmath_t = at::opmath_type<scalar_t>;
  const ColumnIndex c = decompose_column_index(g, index);
  const SamplingPlan<opmath_t>& plan = plans[c.plan];
  scalar_t* plane = grad_input + c.plane * g.in_pixels();
  const opmath_t grad = static_cast<opmath_t>(grad_columns[index]);
  for (int corner = 0; corner < 4; ++corner) {
    if (plan.weight[corner] != opmath_t(0)) {
      scatter_add(plane + plan.index[corner], static_cast<scalar_t>(plan.weight[corner] * grad));
    }
  }
}

// Gradients of the offsets and the mask of sample `index` over (block image, deform group,
// tap, output pixel). With column value c = m * bilinear(y, x) and its gradient G_c:
//   dL/dm = sum_c G_c * bilinear_c(y, x)
//   dL/dy = m * sum_c G_c * d bilinear_c / dy,   d/dy = (1-lx)(v10 - v00) + lx (v11 - v01)
//   dL/dx = m * sum_c G_c * d bilinear_c / dx,   d/dx = (1-ly)(v01 - v00) + ly (v11 - v10)
// summed over the channels of the deform group. Either output pointer may be null when that
// gradient was not asked for. Each index writes only its own outputs: no atomics anywhere.
template <typename scalar_t>
C10_HOST_DEVICE inline void offset_mask_grad_element(
    const DeformConv2dGeometry& g, const scalar_t* grad_columns, const scalar_t* input,
    const scalar_t* offset, const scalar_t* mask, scalar_t* grad_offset, scalar_t* grad_mask,
    int64_t index) {
  using opmath_t = at::opmath_type<scalar_t>;
  const SampleIndex s = decompose_sample_index(g, index);
  opmath_t y, x, m;
  sample_position(g, s, offset, mask, y, x, m);
  const BilinearCell<opmath_t> cell = locate_cell(y, x, g.in_height, g.in_width);

  opmath_t grad_y = 0, grad_x = 0, grad_m = 0;
  if (cell.inside) {
    const int64_t K = g.taps();
    const int64_t P = g.out_pixels();
    const int64_t channels = g.channels_per_offset_group();
    const int64_t first_channel = s.group * channels;
    const opmath_t hy = opmath_t(1) - cell.ly;
    const opmath_t hx = opmath_t(1) - cell.lx;
    for (int64_t c = first_channel; c < first_channel + channels; ++c) {
      const int64_t plane = s.n * g.in_channels + c;
      const opmath_t grad =
          static_cast<opmath_t>(grad_columns[(plane * K + s.tap) * P + s.pixel]);
      const CornerValues<opmath_t> v =
          read_corners(cell, input + plane * g.in_pixels(), g.in_width);
      grad_y += grad * (hx * (v.v10 - v.v00) + cell.lx * (v.v11 - v.v01));
      grad_x += grad * (hy * (v.v01 - v.v00) + cell.ly * (v.v11 - v.v10));
      grad_m += grad * (hy * (hx * v.v00 + cell.lx * v.v01) + cell.ly * (hx * v.v10 + cell.lx * v.v11));
    }
  }
  if (grad_offset != nullptr) {
    const int64_t y_at = ((s.n * g.offset_groups + s.group) * 2 * g.taps() + 2 * s.tap) *
            g.out_pixels() + s.pixel;
    grad_offset[y_at] = static_cast<scalar_t>(m * grad_y);
    grad_offset[y_at + g.out_pixels()] = static_cast<scalar_t>(m * grad_x);
  }
  if (grad_mask != nullptr) {
    grad_mask[((s.n * g.offset_groups + s.group) * g.taps() + s.tap) * g.out_pixels() + s.pixel] =
        static_cast<scalar_t>(grad_m);
  }
}

}  // namespace deformconv
