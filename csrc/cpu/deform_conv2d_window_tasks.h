#pragma once

// What the CPU stages of DCN v1/v2 share: how a window of output pixels is cut into tasks
// (stretches of one image's pixels), the runs of input channels that stay in one conv group,
// the columns layout, and StretchSamples, which locates a (deform group, tap) row of a
// stretch's samples at once. Each stage walks samples in its own order (channels-last
// layouts, see deform_conv2d_kernel.cuh) and applies each to the consecutive channels it
// serves.


#include <algorithm>
#include <cstdint>
#include <vector>

#include "../common/scalar_types.h"
#include "../common/deform_conv2d_kernel.cuh"
#include "../core/deform_conv2d_launchers.h"
#include "cpu_loops.h"
#include "located_samples.h"

namespace deformconv {

// About this many samples per task when plans are made or offset gradients summed: enough
// work to amortise a task, and tasks enough to balance the threads.
inline constexpr int64_t kPlansPerTask = 256;

// At least this many pixels per task, though: a task locates its samples a (deform group, tap)
// row at a time, as arrays over its pixels (StretchSamples), and arrays shorter than a few
// vectors run mostly in the loops' scalar remainders.
inline constexpr int64_t kMinPixelsPerTask = 32;

// Consecutive input channels that stay in one conv group, so that their columns entries are
// consecutive too: entry (image n, window pixel p, tap k, channel first + i) is at
// column_offset + n * image_stride + (p * K + k) * C_in / G + i.
struct ChannelRun {
  int64_t first;
  int64_t count;
  int64_t column_offset;
};

inline std::vector<ChannelRun> channel_runs(const DeformConv2dGeometry& g, const PixelWindow& window,
                                            int64_t begin, int64_t end) {
  std::vector<ChannelRun> runs;
  const int64_t per_group = g.channels_per_group();
  for (int64_t c = begin; c < end;) {
    const int64_t stop = std::min(end, (c / per_group + 1) * per_group);
    runs.push_back({c, stop - c, column_index(g, window, 0, 0, 0, c)});
    c = stop;
  }
  return runs;
}

// The runs of each deform group's channels.
inline std::vector<std::vector<ChannelRun>> runs_of_offset_groups(const DeformConv2dGeometry& g,
                                                                  const PixelWindow& window) {
  std::vector<std::vector<ChannelRun>> runs;
  for (int64_t group = 0; group < g.offset_groups; ++group) {
    const int64_t first = first_channel(g, group);
    runs.push_back(channel_runs(g, window, first, first + g.channels_per_offset_group()));
  }
  return runs;
}

// Where the columns entries of (image n, window pixel, tap) start, before a run's offset.
inline int64_t columns_at(const DeformConv2dGeometry& g, const PixelWindow& window, int64_t n,
                          int64_t window_pixel, int64_t tap) {
  return n * window.pixels * g.taps() * g.in_channels +
      (window_pixel * g.taps() + tap) * g.channels_per_group();
}

// Output pixels per task when each pixel needs `plans_per_pixel` plans.
inline int64_t pixels_per_task(int64_t plans_per_pixel) {
  return std::max(kMinPixelsPerTask, kPlansPerTask / plans_per_pixel);
}

// The window's pixels of each image cut into stretches of pixels_per_task pixels, rounded up to
// a multiple of `block` (the fused forward's blocks of pixels): the tasks of the stages that
// walk the samples along (deform group, tap) rows.
struct PixelStretches {
  int64_t pixels;     // per stretch; the last of an image may be shorter
  int64_t per_image;  // stretches per image
};

inline PixelStretches pixel_stretches(const DeformConv2dGeometry& g, const PixelWindow& window,
                                      int64_t block = 1) {
  const int64_t pixels = (pixels_per_task(g.offset_groups * g.taps()) + block - 1) / block * block;
  return {pixels, (window.pixels + pixels - 1) / pixels};
}

// Stretch `task`: block image n, window pixels [first_pixel, first_pixel + pixels).
struct PixelStretch {
  int64_t n;
  int64_t first_pixel;
  int64_t pixels;
};

inline PixelStretch stretch_of(const PixelWindow& window, const PixelStretches& stretches,
                               int64_t task) {
  const int64_t first_pixel = task % stretches.per_image * stretches.pixels;
  return {task / stretches.per_image, first_pixel,
          std::min(stretches.pixels, window.pixels - first_pixel)};
}

// The samples of one (deform group, tap) row over a stretch of output pixels of one image,
// located at once (LocatedSamples), sample i at the stretch's pixel i: the undeformed
// positions of tap (0, 0) are made once per stretch, and each row adds its own tap's.
template <typename opmath_t>
class StretchSamples : public LocatedSamples<opmath_t> {
 public:
  StretchSamples(const DeformConv2dGeometry& g, int64_t max_pixels)
      : LocatedSamples<opmath_t>(max_pixels, g.in_height, g.in_width),
        origin_y_(max_pixels),
        origin_x_(max_pixels) {}

  // Output pixels [first_pixel, first_pixel + pixels) of the output grid.
  void start(const DeformConv2dGeometry& g, int64_t first_pixel, int64_t pixels) {
    first_pixel_ = first_pixel;
    pixels_ = pixels;
    SampleIndex s = make_sample_index(g, 0, 0, 0, first_pixel);
    for (int64_t i = 0; i < pixels; ++i, next_pixel(g, s)) {
      origin_y_[i] = static_cast<int32_t>(s.grid_y);
      origin_x_[i] = static_cast<int32_t>(s.grid_x);
    }
  }

  // The row of image n, deform group `group`, tap `tap`, read from the block's offset and mask
  // (null: DCN v1) tensors, in whose layout the row's pixels are consecutive.
  template <typename scalar_t>
  DEFORMCONV_INLINE void locate(const DeformConv2dGeometry& g, int64_t n, int64_t group,
                                int64_t tap, const scalar_t* offset, const scalar_t* mask) {
    const SampleIndex s = make_sample_index(g, n, group, tap, first_pixel_);
    const scalar_t* offset_y = offset + offset_y_index(g, s);
    const scalar_t* offset_x = offset_y + g.out_pixels();
    fill_positions(pixels_, static_cast<int32_t>(s.grid_y - origin_y_[0]),
                   static_cast<int32_t>(s.grid_x - origin_x_[0]), origin_y_.data(),
                   origin_x_.data(), offset_y, offset_x, this->grid_y.data(),
                   this->grid_x.data(), this->dy.data(), this->dx.data());
    if (mask == nullptr) {
      std::fill_n(this->m.begin(), pixels_, opmath_t(1));
    } else {
      const scalar_t* row_mask = mask + mask_index(g, s);
      for (int64_t i = 0; i < pixels_; ++i) {
        this->m[i] = static_cast<opmath_t>(row_mask[i]);
      }
    }
    LocatedSamples<opmath_t>::locate(pixels_, opmath_t(0), opmath_t(0), opmath_t(1));
    // A task's rows lie in 3 * offset_groups * K planes of the offset and mask tensors, more
    // streams than a CPU's prefetcher follows, so each row asks for the same row of the next
    // stretch, which the next task most often is.
    prefetch_next(offset_y);
    prefetch_next(offset_x);
    if (mask != nullptr) {
      prefetch_next(mask + mask_index(g, s));
    }
  }

 private:
  // The addresses are made as integers: the next stretch may lie past the end of the tensor,
  // where a prefetch is harmless but pointer arithmetic would not be defined.
  template <typename scalar_t>
  DEFORMCONV_INLINE void prefetch_next(const scalar_t* row) const {
    const uintptr_t bytes = static_cast<uintptr_t>(pixels_) * sizeof(scalar_t);
    const uintptr_t next = reinterpret_cast<uintptr_t>(row) + bytes;
    for (uintptr_t byte = 0; byte < bytes; byte += kCacheLineBytes) {
      __builtin_prefetch(reinterpret_cast<const void*>(next + byte));
    }
  }

  // The positions' inputs of a row: each pixel's grid position, its undeformed position
  // tap_y/tap_x away from its origin, and its offsets. A function of restrict-qualified
  // arrays, so that the loop vectorises (GCC heeds restrict on parameters), and the origins
  // in int32, as LocatedSamples' grid indices are (the drivers check that they fit), whose
  // conversions vectorise where those of int64 do not before AVX-512. Inlined into the fused
  // forward's task with a loop of its own, it ran scalar, at 5% of the task's time with 16
  // channels a deform group.
  template <typename scalar_t>
  static DEFORMCONV_INLINE void fill_positions(
      int64_t pixels, int32_t tap_y, int32_t tap_x, const int32_t* __restrict origin_y,
      const int32_t* __restrict origin_x, const scalar_t* __restrict offset_y,
      const scalar_t* __restrict offset_x, opmath_t* __restrict grid_y,
      opmath_t* __restrict grid_x, opmath_t* __restrict dy, opmath_t* __restrict dx) {
    for (int64_t i = 0; i < pixels; ++i) {
      grid_y[i] = static_cast<opmath_t>(origin_y[i] + tap_y);
      grid_x[i] = static_cast<opmath_t>(origin_x[i] + tap_x);
      dy[i] = static_cast<opmath_t>(offset_y[i]);
      dx[i] = static_cast<opmath_t>(offset_x[i]);
    }
  }

  std::vector<int32_t> origin_y_, origin_x_;
  int64_t first_pixel_ = 0;
  int64_t pixels_ = 0;
};

// The CPU's window preparation: the sampling plans of every sample of the window, (image,
// window pixel, deform group, tap), made in parallel once per window and then read by every
// channel that uses them in col2im. They live in the driver's workspace,
// workspace_bytes_per_sample each at most, which it counts in the window's scratch memory.
template <typename opmath_t>
const SamplingPlan<opmath_t>* plans_of(const WindowSampling& sampling) {
  return reinterpret_cast<const SamplingPlan<opmath_t>*>(sampling.prepared.const_data_ptr());
}


// The plans of (image n, window pixel): offset_groups * K of them, deform group major.
template <typename opmath_t>
const SamplingPlan<opmath_t>* plans_of_pixel(const DeformConv2dGeometry& g,
                                             const PixelWindow& window,
                                             const SamplingPlan<opmath_t>* plans, int64_t n,
                                             int64_t window_pixel) {
  return plans + (n * window.pixels + window_pixel) * g.offset_groups * g.taps();
}

}  // namespace deformconv
