#pragma once

// Many samples located at once on the CPU: their positions, cells (locate_cell) and
// mask-weighted corner weights (plan_at's), each an array over the samples, made in one loop
// without branches that the compiler vectorises. An op fills the positions' inputs, calls
// locate, and reads the cells and plans back sample by sample; what remains per sample is
// integer indexing. Grid indices are int32: the drivers check that height and width fit.

#include <ATen/OpMathType.h>

#include <cstdint>
#include <vector>

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

// Which corners of a sample LocatedSamples::corner_row_addresses points into the image: those
// of nonzero weight (what the sampled value reads and its gradient's scatter writes), or those
// inside the image (what the position's derivative reads, even at a corner of zero weight).
enum class TakenCorners { kWeighted, kInside };

// How many rows per corner LocatedSamples::corner_row_addresses spreads the corners not taken
// over.
constexpr int64_t kElsewhereRows = 8;

// Where LocatedSamples::corner_row_addresses puts the corner rows of one channels-last image
// (or its gradient) of element_t: rows[corner][k] for sample k, the address of the corner's
// row in `image` where kTaken takes the corner, else a row of `elsewhere`.
template <TakenCorners kTaken, typename element_t>
struct CornerRowTarget {
  element_t* image;
  element_t* elsewhere;
  int64_t elsewhere_row_bytes;
  uintptr_t* rows[4];

  DEFORMCONV_INLINE void select(int64_t k, const int64_t corner_elements[4],
                                const bool weighted[4], const bool in_image[4]) const {
    const bool* taken = kTaken == TakenCorners::kWeighted ? weighted : in_image;
    const uintptr_t base = reinterpret_cast<uintptr_t>(image);
    const uintptr_t other = reinterpret_cast<uintptr_t>(elsewhere) +
        static_cast<uintptr_t>(k % kElsewhereRows * 4 * elsewhere_row_bytes);
    for (int corner = 0; corner < 4; ++corner) {
      rows[corner][k] = taken[corner]
          ? base + static_cast<uintptr_t>(corner_elements[corner] * int64_t(sizeof(element_t)))
          : other + static_cast<uintptr_t>(corner * elsewhere_row_bytes);
    }
  }
};

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

  // For samples k < `samples`, the rows of their corners in each target's channels-last image
  // (CornerRowTarget): target.rows[corner][k] = the address of element first[k] + (the
  // corner's grid index) * pixel_stride from target.image for a corner taken, and for the
  // others row (k % kElsewhereRows) * 4 + corner of target.elsewhere, rows
  // target.elsewhere_row_bytes apart (0: a single row): corner_rows for many samples in one
  // loop, which the compiler vectorises, the corners' element offset made once for all the
  // targets. Addresses are integers (made into pointers where read) so that the selection
  // vectorises, and so that the address of a corner outside, computed then discarded, is never
  // a pointer. A scatter that adds into the rows of the corners not taken (to be ignored)
  // spreads its writes so: into a single row, each add would wait for the previous one, where
  // many samples fall outside the image.
  template <typename... Targets>
  DEFORMCONV_INLINE void corner_row_addresses(int64_t samples, int64_t pixel_stride,
                                              const int64_t* first,
                                              const Targets&... targets) const {
    // With strides that fit in 32 bits, as they do for any image that is not gigantic, the
    // offsets are 32-bit products widened to 64 bits, one instruction per vector where AVX2
    // has no 64-bit multiply.
    if (width_ * pixel_stride <= INT32_MAX) {
      corner_row_address_loop<int32_t>(samples, pixel_stride, first, targets...);
    } else {
      corner_row_address_loop<int64_t>(samples, pixel_stride, first, targets...);
    }
  }

  // For samples k < `samples`, the offset and mask gradient sums of offset_mask_grad_sums_of_dots
  // from the dot products dots[4 * k + corner] of each corner's row with the sampled value's
  // gradient, in one loop that the compiler vectorises; zero for a sample outside.
  DEFORMCONV_INLINE void offset_mask_grad_sums(int64_t samples, const opmath_t* __restrict dots,
                                               opmath_t* __restrict sums_y,
                                               opmath_t* __restrict sums_x,
                                               opmath_t* __restrict sums_m) const {
    const int32_t* __restrict inside = inside_.data();
    const opmath_t* __restrict ly = ly_.data();
    const opmath_t* __restrict lx = lx_.data();
    for (int64_t k = 0; k < samples; ++k) {
      const OffsetMaskGradSums<opmath_t> sums = offset_mask_grad_sums_of_dots(
          ly[k], lx[k], dots[4 * k], dots[4 * k + 1], dots[4 * k + 2], dots[4 * k + 3]);
      sums_y[k] = sums.y;
      sums_x[k] = sums.x;
      sums_m[k] = sums.m;
    }
    // Apart, so that the sums above are made for every sample: selected in the same loop, they
    // would be made only for the samples inside, a branch the compiler does not vectorise.
    for (int64_t k = 0; k < samples; ++k) {
      sums_y[k] = inside[k] ? sums_y[k] : opmath_t(0);
      sums_x[k] = inside[k] ? sums_x[k] : opmath_t(0);
      sums_m[k] = inside[k] ? sums_m[k] : opmath_t(0);
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
  template <typename stride_t, typename... Targets>
  DEFORMCONV_INLINE void corner_row_address_loop(int64_t samples, int64_t pixel_stride,
                                                 const int64_t* __restrict first,
                                                 const Targets&... targets) const {
    const stride_t column_elements = static_cast<stride_t>(pixel_stride);
    const stride_t row_elements = static_cast<stride_t>(width_ * pixel_stride);
    const int32_t* __restrict inside = inside_.data();
    const int32_t* __restrict y0 = y0_.data();
    const int32_t* __restrict x0 = x0_.data();
    const opmath_t* __restrict weight_0 = weight_[0].data();
    const opmath_t* __restrict weight_1 = weight_[1].data();
    const opmath_t* __restrict weight_2 = weight_[2].data();
    const opmath_t* __restrict weight_3 = weight_[3].data();
    const int32_t rows_in_grid = static_cast<int32_t>(height_);
    const int32_t columns = static_cast<int32_t>(width_);
    // The targets' rows are written and nothing else: no iteration reads what another writes.
#pragma GCC ivdep
    for (int64_t k = 0; k < samples; ++k) {
      const bool weighted[4] = {weight_0[k] != opmath_t(0), weight_1[k] != opmath_t(0),
                                weight_2[k] != opmath_t(0), weight_3[k] != opmath_t(0)};
      const int32_t top = inside[k] & int32_t(y0[k] >= 0);
      const int32_t bottom = inside[k] & int32_t(y0[k] + 1 < rows_in_grid);
      const int32_t left = int32_t(x0[k] >= 0);
      const int32_t right = int32_t(x0[k] + 1 < columns);
      const bool in_image[4] = {bool(top & left), bool(top & right), bool(bottom & left),
                                bool(bottom & right)};
      const int64_t top_left = first[k] + static_cast<int64_t>(y0[k]) * row_elements +
          static_cast<int64_t>(x0[k]) * column_elements;
      const int64_t corner_elements[4] = {top_left, top_left + column_elements,
                                          top_left + row_elements,
                                          top_left + row_elements + column_elements};
      (targets.select(k, corner_elements, weighted, in_image), ...);
    }
  }

  int64_t height_, width_;
  std::vector<int32_t> inside_, y0_, x0_;
  std::vector<opmath_t> ly_, lx_;
  std::vector<opmath_t> weight_[4];
};

}  // namespace deformconv
