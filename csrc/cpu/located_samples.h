#pragma once

// Many samples located at once on the CPU: their positions, cells (locate_cell) and
// mask-weighted corner weights (plan_at's), each an array over the samples, made in one loop
// without branches that the compiler vectorises. An op fills the positions' inputs, calls
// locate, and reads the cells and plans back sample by sample; what remains per sample is
// integer indexing. Grid indices are int32: the drivers check that height and width fit.


#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../common/scalar_types.h"
#include "../common/bilinear_sampling.cuh"
#include "cpu_loops.h"

namespace deformconv {

// The loop of LocatedSamples::locate, with restrict-qualified arrays, so that the compiler
// vectorises without checking them for overlap. A sample outside (or at NaN) gets the cell of
// (0, 0), unused. The floor of a value in (-1, size) is its truncation, less one below an
// integer: a conversion and a comparison, and every product is made then selected, because GCC
// keeps a loop scalar rather than compute for all lanes an operation that could trap.
template <typename opmath_t>
DEFORMCONV_INLINE void locate_cells(
    int64_t samples, opmath_t base_y, opmath_t base_x, opmath_t scale, int64_t height,
    int64_t width, const opmath_t* __restrict grid_y, const opmath_t* __restrict grid_x,
    const opmath_t* __restrict dy, const opmath_t* __restrict dx,
    const opmath_t* __restrict mask, int32_t* __restrict inside_out,
    int32_t* __restrict y0_out, int32_t* __restrict x0_out, opmath_t* __restrict ly_out,
    opmath_t* __restrict lx_out, opmath_t* __restrict weight_0, opmath_t* __restrict weight_1,
    opmath_t* __restrict weight_2, opmath_t* __restrict weight_3) {
  const opmath_t height_value = static_cast<opmath_t>(height);
  const opmath_t width_value = static_cast<opmath_t>(width);
  const int32_t rows = static_cast<int32_t>(height);
  const int32_t columns = static_cast<int32_t>(width);
  for (int64_t k = 0; k < samples; ++k) {
    const opmath_t x = base_x + (grid_x[k] + dx[k]) * scale;
    const opmath_t y = base_y + (grid_y[k] + dy[k]) * scale;
    const int32_t inside = int32_t(y > opmath_t(-1)) & int32_t(y < height_value) &
        int32_t(x > opmath_t(-1)) & int32_t(x < width_value);
    const opmath_t y_in = inside ? y : opmath_t(0);
    const opmath_t x_in = inside ? x : opmath_t(0);
    const int32_t y_truncated = static_cast<int32_t>(y_in);
    const int32_t x_truncated = static_cast<int32_t>(x_in);
    const int32_t y0 = y_truncated - int32_t(y_in < static_cast<opmath_t>(y_truncated));
    const int32_t x0 = x_truncated - int32_t(x_in < static_cast<opmath_t>(x_truncated));
    const opmath_t ly = y_in - static_cast<opmath_t>(y0);
    const opmath_t lx = x_in - static_cast<opmath_t>(x0);
    inside_out[k] = inside;
    y0_out[k] = y0;
    x0_out[k] = x0;
    ly_out[k] = ly;
    lx_out[k] = lx;
    const int32_t top = inside & int32_t(y0 >= 0);
    const int32_t bottom = inside & int32_t(y0 + 1 < rows);
    const int32_t left = int32_t(x0 >= 0);
    const int32_t right = int32_t(x0 + 1 < columns);
    const opmath_t hy = opmath_t(1) - ly;
    const opmath_t hx = opmath_t(1) - lx;
    const opmath_t m = mask[k];
    const opmath_t w0 = m * (hy * hx), w1 = m * (hy * lx), w2 = m * (ly * hx),
                   w3 = m * (ly * lx);
    weight_0[k] = (top & left) ? w0 : opmath_t(0);
    weight_1[k] = (top & right) ? w1 : opmath_t(0);
    weight_2[k] = (bottom & left) ? w2 : opmath_t(0);
    weight_3[k] = (bottom & right) ? w3 : opmath_t(0);
  }
}

// Up to `capacity` samples in a height x width grid. Sample k lies at
//   y = base_y + (grid_y[k] + dy[k]) * scale,   x = base_x + (grid_x[k] + dx[k]) * scale,
// modulated by m[k]: the op fills those five arrays (DCNv3's grid points and offsets, or DCN
// v2's undeformed positions and offsets with base 0 and scale 1, which leaves the sum
// grid + offset exactly as the shared element functions make it), then calls locate.
template <typename opmath_t>
class LocatedSamples {
 public:
  LocatedSamples(int64_t capacity, int64_t height, int64_t width)
      : grid_y(capacity), grid_x(capacity), dy(capacity), dx(capacity), m(capacity),
        height_(height), width_(width), inside_(capacity), y0_(capacity), x0_(capacity),
        ly_(capacity), lx_(capacity),
        weight_{std::vector<opmath_t>(capacity), std::vector<opmath_t>(capacity),
                std::vector<opmath_t>(capacity), std::vector<opmath_t>(capacity)} {}

  std::vector<opmath_t> grid_y, grid_x, dy, dx, m;

  DEFORMCONV_INLINE void locate(int64_t samples, opmath_t base_y, opmath_t base_x,
                                opmath_t scale) {
    locate_cells(samples, base_y, base_x, scale, height_, width_, grid_y.data(), grid_x.data(),
                 dy.data(), dx.data(), m.data(), inside_.data(), y0_.data(), x0_.data(),
                 ly_.data(), lx_.data(), weight_[0].data(), weight_[1].data(),
                 weight_[2].data(), weight_[3].data());
  }

  // Sample k's mask-weighted weight of a corner (0 where the corner is outside the image), and
  // the grid indices of its cell's corners in corner order, whether inside the image or not
  // (unlike corner_indices, which puts 0 for those outside).
  DEFORMCONV_INLINE opmath_t weight(int corner, int64_t k) const { return weight_[corner][k]; }
  DEFORMCONV_INLINE void corner_grid_indices(int64_t k, int64_t index[4]) const {
    const int64_t top_left = static_cast<int64_t>(y0_[k]) * width_ + x0_[k];
    index[0] = top_left;
    index[1] = top_left + 1;
    index[2] = top_left + width_;
    index[3] = top_left + width_ + 1;
  }

  // Sample k's corner weights, and the rows of its corners in a channels-last grid whose grid
  // pixel i starts at image + i * pixel_stride: a corner of weight 0 (outside the image, or
  // masked out) points at `zeros` instead, a row of zeros, so that every sample is the same
  // weighted sum of four rows (sum_corner_rows) and an infinite input value at such a corner
  // cannot make NaN.
  template <typename scalar_t>
  DEFORMCONV_INLINE void corner_rows(int64_t k, const scalar_t* image, int64_t pixel_stride,
                                     const scalar_t* zeros, opmath_t weight[4],
                                     const scalar_t* rows[4]) const {
    int64_t corner_index[4];
    corner_grid_indices(k, corner_index);
    for (int corner = 0; corner < 4; ++corner) {
      weight[corner] = weight_[corner][k];
      rows[corner] =
          weight[corner] != opmath_t(0) ? image + corner_index[corner] * pixel_stride : zeros;
    }
  }

  // For samples k < `samples`, the element offsets of their corners' rows in a channels-last
  // image whose grid pixel i starts at element i * pixel_stride: offsets[corner * stride + k] =
  // first[k] + (the corner's grid index) * pixel_stride for a corner inside the image, and for
  // one outside, that of the image pixel nearest to it (its row and column clamped into the
  // image). So every corner's row is in the image, to be read and added into: a launcher that
  // does so at every corner, the same code for all of them, needs no row of zeros and no
  // selection per corner. What a corner outside reads takes no part if the launcher discards it
  // (offset_mask_grad_sums) or multiplies it by the corner's weight, 0 (which leaves a sum as it
  // was while the row and the gradient are finite; the launchers check). A sample outside (cell
  // (0, 0)) has its corners about the first pixel. In one loop that the compiler vectorises, in
  // 32-bit integers where the image's elements fit.
  DEFORMCONV_INLINE void clamped_corner_offsets(int64_t samples, int64_t pixel_stride,
                                                const int64_t* first, int64_t stride,
                                                int64_t* offsets) const {
    if (height_ * width_ * pixel_stride <= INT32_MAX) {
      clamped_corner_offset_loop<int32_t>(samples, pixel_stride, first, stride, offsets);
    } else {
      clamped_corner_offset_loop<int64_t>(samples, pixel_stride, first, stride, offsets);
    }
  }

  // For samples k < `samples` (a multiple of kLanes), the offset and mask gradient sums of
  // offset_mask_grad_sums_of_dots from the dot products dots[4 * k + corner] of each corner's row
  // with the sampled value's gradient. A corner outside the image takes no part: its dot
  // product, whatever its row held, counts as 0 (as in accumulate_corner_dots), and all four of
  // a sample outside do. Two loops: the dot products, laid out sample by sample, turned into one
  // array per corner, corner_dots[corner * samples + k], with those of the corners outside made
  // 0 (select_corner_dots), then the sums from those, in a loop of plain arrays that the
  // compiler vectorises.
  DEFORMCONV_INLINE void offset_mask_grad_sums(int64_t samples, const opmath_t* dots,
                                               opmath_t* corner_dots,
                                               opmath_t* __restrict sums_y,
                                               opmath_t* __restrict sums_x,
                                               opmath_t* __restrict sums_m) const {
    select_corner_dots(samples, dots, corner_dots);
    const opmath_t* __restrict ly = ly_.data();
    const opmath_t* __restrict lx = lx_.data();
    const opmath_t* __restrict dot_0 = corner_dots;
    const opmath_t* __restrict dot_1 = corner_dots + samples;
    const opmath_t* __restrict dot_2 = corner_dots + 2 * samples;
    const opmath_t* __restrict dot_3 = corner_dots + 3 * samples;
    for (int64_t k = 0; k < samples; ++k) {
      const OffsetMaskGradSums<opmath_t> sums =
          offset_mask_grad_sums_of_dots(ly[k], lx[k], dot_0[k], dot_1[k], dot_2[k], dot_3[k]);
      sums_y[k] = sums.y;
      sums_x[k] = sums.x;
      sums_m[k] = sums.m;
    }
  }

  // Sample k's cell, as locate_cell makes it, and its mask value.
  DEFORMCONV_INLINE BilinearCell<opmath_t> cell(int64_t k) const {
    BilinearCell<opmath_t> cell;
    cell.inside = inside_[k];
    if (cell.inside) {
      cell.y0 = y0_[k];
      cell.x0 = x0_[k];
      cell.ly = ly_[k];
      cell.lx = lx_[k];
      cell.top = cell.y0 >= 0;
      cell.bottom = cell.y0 + 1 < height_;
      cell.left = cell.x0 >= 0;
      cell.right = cell.x0 + 1 < width_;
    }
    return cell;
  }
  DEFORMCONV_INLINE opmath_t mask(int64_t k) const { return m[k]; }

  DEFORMCONV_INLINE SamplingPlan<opmath_t> plan(int64_t k) const {
    SamplingPlan<opmath_t> plan;
    int64_t corner_index[4];
    corner_grid_indices(k, corner_index);
    for (int corner = 0; corner < 4; ++corner) {
      plan.weight[corner] = weight_[corner][k];
      plan.index[corner] = plan.weight[corner] != opmath_t(0) ? corner_index[corner] : 0;
    }
    return plan;
  }

 private:
  // corner_dots[corner * samples + k] = dots[4 * k + corner] where the corner is inside the
  // image, else 0, kLanes samples at a time: their dot products, four vectors of two samples
  // each, are transposed by shuffles within halves of four lanes (unpacking, then pairing),
  // which leave the samples in the order 0, 2, 4, 6, 1, 3, 5, 7, put back in order by one more
  // shuffle. The corners' flags are vector comparisons, their selection lane by lane.
  DEFORMCONV_INLINE void select_corner_dots(int64_t samples, const opmath_t* dots,
                                            opmath_t* corner_dots) const {
    static_assert(kLanes == 8, "the shuffles below are written out for 8 lanes");
    using Lanes = typename LanesOf<opmath_t>::type;
    using UnalignedLanes = typename LanesOf<opmath_t>::unaligned;
    typedef int32_t Flags __attribute__((vector_size(kLanes * sizeof(int32_t))));
    typedef int32_t UnalignedFlags __attribute__((vector_size(kLanes * sizeof(int32_t)),
                                                   aligned(alignof(int32_t)), may_alias));
    // Lane masks as wide as opmath_t, as a selection between Lanes takes.
    typedef std::conditional_t<sizeof(opmath_t) == sizeof(int32_t), int32_t, int64_t> mask_t;
    typedef mask_t Mask __attribute__((vector_size(kLanes * sizeof(mask_t))));
    const int32_t rows = static_cast<int32_t>(height_);
    const int32_t columns = static_cast<int32_t>(width_);
    for (int64_t k = 0; k < samples; k += kLanes) {
      const opmath_t* eight = dots + 4 * k;
      const Lanes pairs_0 = *reinterpret_cast<const UnalignedLanes*>(eight);
      const Lanes pairs_1 = *reinterpret_cast<const UnalignedLanes*>(eight + kLanes);
      const Lanes pairs_2 = *reinterpret_cast<const UnalignedLanes*>(eight + 2 * kLanes);
      const Lanes pairs_3 = *reinterpret_cast<const UnalignedLanes*>(eight + 3 * kLanes);
      const Lanes low_01 = shuffle<0, 8, 1, 9, 4, 12, 5, 13>(pairs_0, pairs_1);
      const Lanes high_01 = shuffle<2, 10, 3, 11, 6, 14, 7, 15>(pairs_0, pairs_1);
      const Lanes low_23 = shuffle<0, 8, 1, 9, 4, 12, 5, 13>(pairs_2, pairs_3);
      const Lanes high_23 = shuffle<2, 10, 3, 11, 6, 14, 7, 15>(pairs_2, pairs_3);
      const Lanes corner[4] = {shuffle<0, 1, 8, 9, 4, 5, 12, 13>(low_01, low_23),
                               shuffle<2, 3, 10, 11, 6, 7, 14, 15>(low_01, low_23),
                               shuffle<0, 1, 8, 9, 4, 5, 12, 13>(high_01, high_23),
                               shuffle<2, 3, 10, 11, 6, 7, 14, 15>(high_01, high_23)};
      const Flags inside = *reinterpret_cast<const UnalignedFlags*>(inside_.data() + k) != 0;
      const Flags y0 = *reinterpret_cast<const UnalignedFlags*>(y0_.data() + k);
      const Flags x0 = *reinterpret_cast<const UnalignedFlags*>(x0_.data() + k);
      const Flags top = inside & (y0 >= 0), bottom = inside & (y0 + 1 < rows);
      const Flags left = x0 >= 0, right = x0 + 1 < columns;
      const Flags corner_inside[4] = {top & left, top & right, bottom & left, bottom & right};
      for (int c = 0; c < 4; ++c) {
        const Lanes in_order = shuffle<0, 4, 1, 5, 2, 6, 3, 7>(corner[c], corner[c]);
        const Mask selected = __builtin_convertvector(corner_inside[c], Mask);
        *reinterpret_cast<UnalignedLanes*>(corner_dots + c * samples + k) =
            selected ? in_order : Lanes{};
      }
    }
  }

  template <typename index_t>
  DEFORMCONV_INLINE void clamped_corner_offset_loop(int64_t samples, int64_t pixel_stride,
                                                    const int64_t* __restrict first,
                                                    int64_t stride,
                                                    int64_t* __restrict offsets) const {
    const index_t column_elements = static_cast<index_t>(pixel_stride);
    const index_t row_elements = static_cast<index_t>(width_ * pixel_stride);
    const int32_t* __restrict y0 = y0_.data();
    const int32_t* __restrict x0 = x0_.data();
    const int32_t last_row = static_cast<int32_t>(height_ - 1);
    const int32_t last_column = static_cast<int32_t>(width_ - 1);
    // A cell's rows are y0 and y0 + 1 with -1 <= y0 <= last_row (columns likewise), so each
    // needs clamping on one side only.
    for (int64_t k = 0; k < samples; ++k) {
      const index_t top = static_cast<index_t>(std::max(y0[k], 0)) * row_elements;
      const index_t bottom = static_cast<index_t>(std::min(y0[k] + 1, last_row)) * row_elements;
      const index_t left = static_cast<index_t>(std::max(x0[k], 0)) * column_elements;
      const index_t right =
          static_cast<index_t>(std::min(x0[k] + 1, last_column)) * column_elements;
      offsets[k] = first[k] + static_cast<int64_t>(top + left);
      offsets[stride + k] = first[k] + static_cast<int64_t>(top + right);
      offsets[2 * stride + k] = first[k] + static_cast<int64_t>(bottom + left);
      offsets[3 * stride + k] = first[k] + static_cast<int64_t>(bottom + right);
    }
  }

  int64_t height_, width_;
  std::vector<int32_t> inside_, y0_, x0_;
  std::vector<opmath_t> ly_, lx_;
  std::vector<opmath_t> weight_[4];
};

}  // namespace deformconv
