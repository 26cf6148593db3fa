#pragma once

// The indexing and sampling positions of DCNv3 (InternImage's core op), one element at a time;
// the bilinear arithmetic is bilinear_sampling.cuh's. C10_HOST_DEVICE throughout, so that the
// CPU launchers and the CUDA kernels run the same arithmetic. The conventions are those of
// docs/dcnv3_dcnv4.md, which surprise in several places:
//   - everything is channels-last: input (N, H, W, G * D), output (N, Ho, Wo, G * D);
//   - a point's offset is an (x, y) pair, x first;
//   - the points of the kernel are numbered column by column, p = i * kh + j with i along x
//     and j along y, the centre one left out with remove_center;
//   - offset_scale scales the kernel's footprint about its centre as well as the offsets;
//   - the op has no weights: each channel is the mask-weighted sum of its group's samples.
// The offsets and the mask are read through strides (Dcnv3Fields), so that DCNv4's packed
// offset_mask tensor is read in place.

#include <torch/headeronly/macros/Macros.h>

#include <cstdint>
#include <type_traits>

#include "scalar_types.h"
#include "bilinear_sampling.cuh"
#include "invariant_divisor.h"

namespace deformconv {

struct Dcnv3Geometry {
  int64_t height, width;          // of the input
  int64_t out_height, out_width;  // Ho, Wo
  int64_t groups;                 // G: groups of channels with their own offsets and mask
  int64_t group_channels;         // D
  int64_t kernel_h, kernel_w;
  int64_t stride_h, stride_w;
  int64_t pad_h, pad_w;
  int64_t dilation_h, dilation_w;
  bool remove_center;
  double offset_scale;

  C10_HOST_DEVICE int64_t channels() const { return groups * group_channels; }
  C10_HOST_DEVICE int64_t points() const { return kernel_h * kernel_w - (remove_center ? 1 : 0); }
  C10_HOST_DEVICE int64_t in_pixels() const { return height * width; }
  C10_HOST_DEVICE int64_t out_pixels() const { return out_height * out_width; }
};

// Where the offsets and the mask of sample (image pixel, group, point) are, in elements:
// pixel * pixel_stride + group * group_stride + (2 * point + 0 for x, 1 for y) for the offsets,
// pixel * pixel_stride + group * group_stride + point for the mask. DCNv3's separate tensors
// have offset strides (2 G P, 2 P) and mask strides (G P, P); DCNv4's packed tensor has
// (C_pad, 3 P) for both, its mask starting 2 P channels in.
struct Dcnv3Fields {
  int64_t offset_pixel_stride, offset_group_stride;
  int64_t mask_pixel_stride, mask_group_stride;
};

// An item of the CUDA launchers, numbered pixel * G + group: output pixel `pixel` =
// (n * Ho + ho) * Wo + wo of the batch, and a group.
struct Dcnv3Item {
  int64_t n, ho, wo, pixel, group;
};

// The divisors of a CUDA thread's index arithmetic, made once per launch: an item (pixel * G +
// group) into pixel and group, a pixel into image, row and column, a kernel tap into column
// and row. int64_t, or InvariantDivisor (a multiply-high and a shift instead of a 64-bit
// division's subroutine) when every dividend of the launch is below 2^31; with it, the
// elements of the input and output (their index_type) are indexed in 32 bits, which the
// launcher also checks.
template <typename Divisor>
struct Dcnv3Divisors {
  using divisor_type = Divisor;
  using index_type =
      std::conditional_t<std::is_same_v<Divisor, InvariantDivisor>, int32_t, int64_t>;
  Divisor groups, out_width, out_height, kernel_h;

  explicit Dcnv3Divisors(const Dcnv3Geometry& g)
      : groups(g.groups), out_width(g.out_width), out_height(g.out_height), kernel_h(g.kernel_h) {}
};

template <typename Divisor>
C10_HOST_DEVICE inline Dcnv3Item dcnv3_item(const Dcnv3Divisors<Divisor>& d, int64_t item) {
  Dcnv3Item it;
  it.pixel = divide(item, d.groups, it.group);
  const int64_t rows = divide(it.pixel, d.out_width, it.wo);  // n * Ho + ho
  it.n = divide(rows, d.out_height, it.ho);
  return it;
}

// The kernel column i (along x) and row j (along y) of a point: points run column by column,
// and with remove_center the centre (kw / 2, kh / 2) is skipped. `kernel_h` divides as
// Dcnv3Divisors' (the CPU passes g.kernel_h).
template <typename Divisor>
C10_HOST_DEVICE inline void dcnv3_tap(const Dcnv3Geometry& g, const Divisor& kernel_h,
                                      int64_t point, int64_t& i, int64_t& j) {
  const int64_t centre = g.kernel_w / 2 * g.kernel_h + g.kernel_h / 2;
  const int64_t tap = g.remove_center && point >= centre ? point + 1 : point;
  i = divide(tap, kernel_h, j);
}

// Where the kernel's centre tap of output pixel (ho, wo) falls in the input, before offsets.
C10_HOST_DEVICE inline void dcnv3_centre_tap(const Dcnv3Geometry& g, int64_t ho, int64_t wo,
                                             int64_t& y, int64_t& x) {
  y = ho * g.stride_h - g.pad_h + g.dilation_h * (g.kernel_h - 1) / 2;
  x = wo * g.stride_w - g.pad_w + g.dilation_w * (g.kernel_w - 1) / 2;
}

// The sampled position (y, x) of a sample and its mask value m. With the footprint's integer
// centre c = dilation * (k - 1) / 2 and scale s:
//   x = (wo * stride_w - pad_w + c_w) - c_w * s + (i * dilation_w + dx) * s
// and likewise y: the reference point where a convolution's centre tap would be, and the
// dilation grid and the offset about it, both scaled by s. The terms are added in this order,
// the originals' order. The reference point depends on the pixel only and the grid term on the
// point only: dcnv3_reference_point and dcnv3_grid_point give the terms of this sum, which the
// CPU launchers compute once per pixel and per task, and the CUDA kernels once per item and per
// sample (dcnv3_position).
template <typename opmath_t>
C10_HOST_DEVICE inline void dcnv3_reference_point(const Dcnv3Geometry& g, int64_t ho, int64_t wo,
                                                  opmath_t& base_y, opmath_t& base_x) {
  const opmath_t scale = static_cast<opmath_t>(g.offset_scale);
  int64_t centre_y, centre_x;
  dcnv3_centre_tap(g, ho, wo, centre_y, centre_x);
  base_x = static_cast<opmath_t>(centre_x) -
      static_cast<opmath_t>(g.dilation_w * (g.kernel_w - 1) / 2) * scale;
  base_y = static_cast<opmath_t>(centre_y) -
      static_cast<opmath_t>(g.dilation_h * (g.kernel_h - 1) / 2) * scale;
}

// The dilation grid's displacement (i * dilation_w, j * dilation_h) of a point, unscaled.
template <typename opmath_t, typename Divisor>
C10_HOST_DEVICE inline void dcnv3_grid_point(const Dcnv3Geometry& g, const Divisor& kernel_h,
                                             int64_t point, opmath_t& grid_y, opmath_t& grid_x) {
  int64_t i, j;
  dcnv3_tap(g, kernel_h, point, i, j);
  grid_x = static_cast<opmath_t>(i * g.dilation_w);
  grid_y = static_cast<opmath_t>(j * g.dilation_h);
}

// What the positions of an item's points share: its pixel's reference point, and where the
// offsets and the mask of its point 0 are. A CUDA thread computes it once per item, and then
// each point's position from it (dcnv3_position).
template <typename opmath_t>
struct Dcnv3ItemStart {
  opmath_t base_y, base_x;
  int64_t offset_at, mask_at;
};

template <typename opmath_t>
C10_HOST_DEVICE inline Dcnv3ItemStart<opmath_t> dcnv3_item_start(const Dcnv3Geometry& g,
                                                                const Dcnv3Fields& f,
                                                                const Dcnv3Item& it) {
  Dcnv3ItemStart<opmath_t> start;
  dcnv3_reference_point(g, it.ho, it.wo, start.base_y, start.base_x);
  start.offset_at = it.pixel * f.offset_pixel_stride + it.group * f.offset_group_stride;
  start.mask_at = it.pixel * f.mask_pixel_stride + it.group * f.mask_group_stride;
  return start;
}

// The sampled position (y, x) of an item's point and its mask value m. `kernel_h` divides as
// Dcnv3Divisors' (dcnv3_tap).
template <typename scalar_t, typename opmath_t, typename Divisor>
C10_HOST_DEVICE inline void dcnv3_position(const Dcnv3Geometry& g, const Divisor& kernel_h,
                                           const Dcnv3ItemStart<opmath_t>& start, int64_t point,
                                           const scalar_t* offset, const scalar_t* mask,
                                           opmath_t& y, opmath_t& x, opmath_t& m) {
  opmath_t grid_y, grid_x;
  dcnv3_grid_point(g, kernel_h, point, grid_y, grid_x);
  const opmath_t scale = static_cast<opmath_t>(g.offset_scale);
  const opmath_t dx = static_cast<opmath_t>(offset[start.offset_at + 2 * point]);
  const opmath_t dy = static_cast<opmath_t>(offset[start.offset_at + 2 * point + 1]);
  x = start.base_x + (grid_x + dx) * scale;
  y = start.base_y + (grid_y + dy) * scale;
  m = static_cast<opmath_t>(mask[start.mask_at + point]);
}

// Where the offset and mask gradients of a (pixel, group)'s points start, either null when not
// asked for: its first point's offset x and mask value.
template <typename scalar_t>
C10_HOST_DEVICE inline void dcnv3_group_grads(const Dcnv3Fields& f, int64_t pixel, int64_t group,
                                              scalar_t* grad_offset, scalar_t* grad_mask,
                                              scalar_t*& group_grad_offset,
                                              scalar_t*& group_grad_mask) {
  group_grad_offset = grad_offset == nullptr
      ? nullptr
      : grad_offset + pixel * f.offset_pixel_stride + group * f.offset_group_stride;
  group_grad_mask = grad_mask == nullptr
      ? nullptr
      : grad_mask + pixel * f.mask_pixel_stride + group * f.mask_group_stride;
}

// Writes the gradients of a point of mask value m, from where its (pixel, group)'s start
// (dcnv3_group_grads). The position moves by s per unit of offset, so d/d(dx) = s * d/dx; the
// sums carry no factor m yet.
template <typename scalar_t>
C10_HOST_DEVICE inline void dcnv3_write_grad(
    const Dcnv3Geometry& g, int64_t point, opmath_type<scalar_t> m,
    const OffsetMaskGradSums<opmath_type<scalar_t>>& sums, scalar_t* group_grad_offset,
    scalar_t* group_grad_mask) {
  using opmath_t = opmath_type<scalar_t>;
  if (group_grad_offset != nullptr) {
    const opmath_t factor = static_cast<opmath_t>(g.offset_scale) * m;
    group_grad_offset[2 * point] = static_cast<scalar_t>(factor * sums.x);
    group_grad_offset[2 * point + 1] = static_cast<scalar_t>(factor * sums.y);
  }
  if (group_grad_mask != nullptr) {
    group_grad_mask[point] = static_cast<scalar_t>(sums.m);
  }
}

}  // namespace deformconv
