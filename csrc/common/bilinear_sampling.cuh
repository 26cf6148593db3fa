#pragma once

// Bilinear sampling of a channels-last image, one sample at a time, and its adjoints: where a
// sample reads (the cell and its sampling plan), the sampled value, the scatter of its gradient
// onto the image, and the gradient of its position and modulation. Nothing here knows which
// operator places the samples: DCN v1/v2 (deform_conv2d_kernel.cuh) derives the positions from
// its offset and mask tensors, and other deformable operators can do the same from theirs.
//
// Every function is C10_HOST_DEVICE: g++ compiles it for the CPU launchers and nvcc for the
// CUDA kernels, so that the CPU test suite exercises the arithmetic the GPU runs. The single
// device-specific line is the atomic add in `scatter_add`.
//
// An image is (H * W grid pixels, C channels), channels-last: a function handed `channel`
// points at one channel's value at grid pixel 0, and grid pixel i of that channel lies
// i * channel_stride further on.

#include <torch/headeronly/macros/Macros.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__CUDACC__)
#include <torch/headeronly/cuda/Atomic.h>
#endif

#include "scalar_types.h"

namespace deformconv {

// The largest image height and width the ops take: the CPU launchers index rows and columns
// within an image in 32 bits (cpu/located_samples.h), with one to spare for a cell's far side.
constexpr int64_t kMaxImageSide = INT32_MAX - 1;

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

// Where one sample reads the image and with which weights, the modulation folded in. A plan is
// made once per sample and serves every channel that shares the sample (those of a deform group
// in DCN v2), forward and backward: the bilinear weights are never recomputed per channel. A
// corner outside the image has weight 0 and index 0, so that reading it stays in bounds.
template <typename opmath_t>
struct SamplingPlan {
  int64_t index[4];    // pixel in the H * W grid: (y0, x0), (y0, x0+1), (y0+1, x0), (y0+1, x0+1)
  opmath_t weight[4];  // mask * bilinear weight of that corner
};

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

// m * the bilinear weight of each corner of a cell, 0 for a corner outside the image.
template <typename opmath_t>
C10_HOST_DEVICE inline void corner_weights(const BilinearCell<opmath_t>& cell, opmath_t m,
                                           opmath_t weight[4]) {
  const opmath_t hy = opmath_t(1) - cell.ly;
  const opmath_t hx = opmath_t(1) - cell.lx;
  bool inside[4];
  corners_inside(cell, inside);
  const opmath_t corner_weight[4] = {hy * hx, hy * cell.lx, cell.ly * hx, cell.ly * cell.lx};
  for (int corner = 0; corner < 4; ++corner) {
    weight[corner] = inside[corner] ? m * corner_weight[corner] : opmath_t(0);
  }
}

// The plan of a sample at (y, x) with modulation m (1 for DCN v1) in a height x width grid.
template <typename opmath_t>
C10_HOST_DEVICE inline SamplingPlan<opmath_t> plan_at(opmath_t y, opmath_t x, opmath_t m,
                                                     int64_t height, int64_t width) {
  const BilinearCell<opmath_t> cell = locate_cell(y, x, height, width);
  SamplingPlan<opmath_t> plan;
  corner_indices(cell, width, plan.index);
  corner_weights(cell, m, plan.weight);
  return plan;
}

// Everything the forward and both adjoints need of one sample, located once and shared by the
// threads that handle its channels: a CUDA block stages these in shared memory, so it is
// plain data without initialisers, as __shared__ storage requires, and compact (one grid index
// and a bit per corner instead of four indices).
template <typename opmath_t>
struct SharedSample {
  int64_t top_left;    // grid index of corner (y0, x0), valid only where `corners` says so
  int corners;         // bit c set: corner c is in the image (corners_inside's order)
  opmath_t weight[4];  // m * bilinear weight, 0 outside
  opmath_t ly, lx;     // the sample's place in its cell (0 for a sample outside)
  opmath_t mask;       // m
};

template <typename opmath_t>
C10_HOST_DEVICE inline SharedSample<opmath_t> share_sample(opmath_t y, opmath_t x, opmath_t m,
                                                          int64_t height, int64_t width) {
  const BilinearCell<opmath_t> cell = locate_cell(y, x, height, width);
  bool inside[4];
  corners_inside(cell, inside);
  SharedSample<opmath_t> sample;
  sample.top_left = cell.y0 * width + cell.x0;
  sample.corners = int(inside[0]) | int(inside[1]) << 1 | int(inside[2]) << 2 |
      int(inside[3]) << 3;
  corner_weights(cell, m, sample.weight);
  sample.ly = cell.ly;
  sample.lx = cell.lx;
  sample.mask = m;
  return sample;
}

// Element offsets of a cell's four corners from its top-left one (corners_inside's order) in
// an image whose pixels lie `pixel_stride` elements apart. A kernel computes them once, so that
// a corner's place is the sample's top-left offset plus one of these. index_t is int64_t, or
// int32_t in a kernel whose element indices all fit it.
template <typename index_t>
struct CornerSteps {
  index_t from_top_left[4];
};

template <typename index_t>
C10_HOST_DEVICE inline CornerSteps<index_t> corner_steps(int64_t width, int64_t pixel_stride) {
  return {{0, static_cast<index_t>(pixel_stride), static_cast<index_t>(width * pixel_stride),
           static_cast<index_t>((width + 1) * pixel_stride)}};
}

// m * bilinear(image, (y, x)) of one channel, `channel` as in the comment at the top, in the
// accumulation type (at::opmath_type). Every corner is read, outside ones at index 0, and a
// zero weight is selected away rather than multiplied, so that an infinite input value at a
// corner that takes no part cannot turn the sample into NaN. Without branches a CPU loop over
// consecutive channels vectorises.
template <typename scalar_t>
C10_HOST_DEVICE inline opmath_type<scalar_t> sample_value_with_plan(
    const SamplingPlan<opmath_type<scalar_t>>& plan, const scalar_t* channel,
    int64_t channel_stride) {
  using opmath_t = opmath_type<scalar_t>;
  opmath_t value = 0;
  for (int corner = 0; corner < 4; ++corner) {
    const opmath_t read = static_cast<opmath_t>(channel[plan.index[corner] * channel_stride]);
    value += plan.weight[corner] != opmath_t(0) ? plan.weight[corner] * read : opmath_t(0);
  }
  return value;
}

// The same, in the tensor's type: one columns entry of DCN v2.
template <typename scalar_t>
C10_HOST_DEVICE inline scalar_t sample_with_plan(
    const SamplingPlan<opmath_type<scalar_t>>& plan, const scalar_t* channel,
    int64_t channel_stride) {
  return static_cast<scalar_t>(sample_value_with_plan(plan, channel, channel_stride));
}

// Adds into a gradient buffer. On the GPU several threads hit the same image pixel, so the add
// is atomic; a CPU launcher gives each task gradients of its own, so its writes are disjoint.
template <typename scalar_t>
C10_HOST_DEVICE inline void scatter_add(scalar_t* address, scalar_t value) {
#if defined(__CUDA_ARCH__)
  gpuAtomicAddNoReturn(address, value);
#else
  *address += value;
#endif
}

// Adds kCount consecutive values into a gradient buffer, as scatter_add adds one. On Hopper and
// later (compute capability 9.0) float sums add 16 bytes in one atomic (atomicAdd on float4),
// a quarter of the atomic operations in L2 of one add per channel: those operations bound
// DCNv3's backward on an H200. `address` is then 16-byte aligned.
template <int kCount, typename scalar_t>
C10_HOST_DEVICE inline void scatter_add_run(scalar_t* address, const scalar_t* values) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (std::is_same_v<scalar_t, float> && kCount % 4 == 0) {
    for (int i = 0; i < kCount; i += 4) {
      atomicAdd(reinterpret_cast<float4*>(address + i),
                make_float4(values[i], values[i + 1], values[i + 2], values[i + 3]));
    }
  } else
#endif
  {
    for (int i = 0; i < kCount; ++i) {
      scatter_add(address + i, values[i]);
    }
  }
}

// The adjoint of sample_with_plan at one corner, for `channels` consecutive channels: adds
// weight * the sampled values' gradient onto the image gradient, `grad_channel` pointing as
// `channel` does in sample_with_plan. The caller skips corners of zero weight (outside the
// image among them), so an infinite gradient cannot make NaN there. The image gradient is of
// the sampled values' type, or float where half precision is summed in float32.
template <typename scalar_t, typename grad_t>
C10_HOST_DEVICE inline void scatter_corner(
    const SamplingPlan<opmath_type<scalar_t>>& plan, int corner,
    const scalar_t* grad_values, int64_t channels, grad_t* grad_channel,
    int64_t channel_stride) {
  using opmath_t = opmath_type<scalar_t>;
  const opmath_t weight = plan.weight[corner];
  grad_t* grad_corner = grad_channel + plan.index[corner] * channel_stride;
  for (int64_t c = 0; c < channels; ++c) {
    scatter_add(grad_corner + c,
                static_cast<grad_t>(weight * static_cast<opmath_t>(grad_values[c])));
  }
}

// Gradients of the sampling position and the modulation of one sample. With sampled value
// c = m * bilinear(y, x) of each channel that shares the sample and its gradient G_c, summed
// over those channels:
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

// Adds the share of one channel to the three sums: the gradient `grad` of its sampled value and
// its values v00, v01, v10, v11 at the cell's corners (0 outside). value_t is opmath_t, or, in
// a CPU launcher, a vector of opmath_t holding consecutive channels (the same arithmetic in
// every lane). Separate arguments rather than an array, so that vectors stay in registers.
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

// The same three sums regrouped by corner, for a launcher that sums over the channels first:
// with D_i = sum_c G_c * v_i,c, the dot product of the sampled values' gradients with corner i's
// values (0 outside), corners in the order v00, v01, v10, v11,
//   sum_m = (1-ly)((1-lx) D_0 + lx D_1) + ly ((1-lx) D_2 + lx D_3)
//   sum_y = (1-lx)(D_2 - D_0) + lx (D_3 - D_1)
//   sum_x = (1-ly)(D_1 - D_0) + ly (D_3 - D_2)
// Four multiply-adds per channel instead of about a dozen.
// The cell enters only through (ly, lx), which a CPU launcher passes from arrays over many
// samples, in a loop the compiler vectorises.
template <typename opmath_t>
C10_HOST_DEVICE inline OffsetMaskGradSums<opmath_t> offset_mask_grad_sums_of_dots(
    opmath_t ly, opmath_t lx, opmath_t dot_0, opmath_t dot_1, opmath_t dot_2, opmath_t dot_3) {
  const opmath_t hy = opmath_t(1) - ly;
  const opmath_t hx = opmath_t(1) - lx;
  OffsetMaskGradSums<opmath_t> sums;
  sums.y = hx * (dot_2 - dot_0) + lx * (dot_3 - dot_1);
  sums.x = hy * (dot_1 - dot_0) + ly * (dot_3 - dot_2);
  sums.m = hy * (hx * dot_0 + lx * dot_1) + ly * (hx * dot_2 + lx * dot_3);
  return sums;
}

template <typename opmath_t>
C10_HOST_DEVICE inline OffsetMaskGradSums<opmath_t> offset_mask_grad_sums_of_dots(
    const BilinearCell<opmath_t>& cell, const opmath_t dot[4]) {
  return offset_mask_grad_sums_of_dots(cell.ly, cell.lx, dot[0], dot[1], dot[2], dot[3]);
}

// Adds one channel's share to the corner dot products above, as accumulate_offset_mask_grad
// does to the sums.
template <typename scalar_t>
C10_HOST_DEVICE inline void accumulate_corner_dots(
    const OffsetMaskGrad<opmath_type<scalar_t>>& acc, scalar_t grad_value,
    const scalar_t* channel, int64_t channel_stride, opmath_type<scalar_t> dot[4]) {
  using opmath_t = opmath_type<scalar_t>;
  bool inside[4];
  corners_inside(acc.cell, inside);
  const opmath_t grad = static_cast<opmath_t>(grad_value);
  for (int corner = 0; corner < 4; ++corner) {
    if (inside[corner]) {
      dot[corner] += grad * static_cast<opmath_t>(channel[acc.index[corner] * channel_stride]);
    }
  }
}

// Adds one channel's share, `channel` pointing as in sample_with_plan. The caller skips
// samples outside.
template <typename scalar_t>
C10_HOST_DEVICE inline void accumulate_offset_mask_grad(
    const OffsetMaskGrad<opmath_type<scalar_t>>& acc, scalar_t grad_value,
    const scalar_t* channel, int64_t channel_stride,
    OffsetMaskGradSums<opmath_type<scalar_t>>& sums) {
  using opmath_t = opmath_type<scalar_t>;
  bool inside[4];
  corners_inside(acc.cell, inside);
  opmath_t v[4];
  for (int corner = 0; corner < 4; ++corner) {
    v[corner] =
        inside[corner] ? static_cast<opmath_t>(channel[acc.index[corner] * channel_stride]) : 0;
  }
  add_offset_mask_grad_terms(acc.cell, static_cast<opmath_t>(grad_value), v[0], v[1], v[2], v[3],
                             sums.y, sums.x, sums.m);
}

}  // namespace deformconv
