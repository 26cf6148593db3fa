#pragma once

// How the CPU launchers of DCNv3 and DCNv4 lay out a pixel's samples: runs of samples whose
// offsets and masks are consecutive, the samples of a pixel located at once (PixelSamples),
// their corners as offsets into the image, a kernel instance for 16 group channels, the rows
// prefetched ahead, and the check for non-finite values. The forward (dcnv3_forward_cpu.cpp)
// and the backward (dcnv3_backward_cpu.cpp) share them.


#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../common/scalar_types.h"
#include "../common/dcnv3_kernel.cuh"
#include "../core/dcnv3.h"
#include "cpu_loops.h"
#include "located_samples.h"

namespace deformconv {

// Calls run(group, count) for the runs of a pixel's samples whose offsets and masks lie in
// runs too, the run of `count` samples from `group`'s first point on: one run of all the
// pixel's samples in DCNv3's layout, one per group in DCNv4's packed layout. A loop over a run
// reads or writes the offsets as (x, y) pairs and the masks one by one, which the compiler
// vectorises when the run is long.
template <typename Function>
DEFORMCONV_INLINE void for_each_sample_run(const Dcnv3Geometry& g, const Dcnv3Fields& f,
                                           const Function& run) {
  const int64_t P = g.points();
  if (f.offset_group_stride == 2 * P && f.mask_group_stride == P) {
    run(int64_t(0), g.groups * P);
  } else {
    for (int64_t group = 0; group < g.groups; ++group) {
      run(group, P);
    }
  }
}

// Every sample of one output pixel, k = group * P + point, located at once (LocatedSamples):
// dcnv3_position's sum with its terms computed once, the reference point per pixel and the
// grid points per task. A task keeps one and moves it from pixel to pixel.
//
// The vectorised loops over the samples (locating them, their corner rows, their offset and
// mask gradient sums) run over `located` samples: the pixel's, padded to a multiple of
// `vector_lanes`, the lanes of the copy's vectors, and of kLanes, the lanes of
// LocatedSamples::offset_mask_grad_sums, so that none is left to the loops' remainders, which
// cost about as much per sample as the vector iterations per vector (a group of 4 has 36
// samples: with AVX-512, two vector iterations and four scalar ones). The padding samples have
// offset 0, mask 0 and so weight 0 at every corner: they are located and given rows, never
// read.
template <typename opmath_t>
class PixelSamples : public LocatedSamples<opmath_t> {
 public:
  PixelSamples(const Dcnv3Geometry& g, int64_t vector_lanes)
      : LocatedSamples<opmath_t>(padded(g, vector_lanes), g.height, g.width),
        located(padded(g, vector_lanes)),
        first_channel(padded(g, vector_lanes)) {
    for (int64_t k = 0; k < g.groups * g.points(); ++k) {
      dcnv3_grid_point(g, g.kernel_h, k % g.points(), this->grid_y[k], this->grid_x[k]);
      first_channel[k] = k / g.points() * g.group_channels;
    }
  }

  // How many samples the loops over samples run over, the pixel's and the padding.
  const int64_t located;
  // The first channel of sample k's group.
  std::vector<int64_t> first_channel;
  // Where the kernel's centre tap of the located pixel falls in the image, before offsets.
  int64_t centre_y = 0, centre_x = 0;

  template <typename scalar_t>
  DEFORMCONV_INLINE void locate(const Dcnv3Geometry& g, const Dcnv3Fields& f, int64_t pixel,
                                const scalar_t* offset, const scalar_t* mask) {
    const int64_t P = g.points();
    for_each_sample_run(g, f, [&](int64_t group, int64_t count) {
      unpack_samples(count, offset + pixel * f.offset_pixel_stride + group * f.offset_group_stride,
                     mask + pixel * f.mask_pixel_stride + group * f.mask_group_stride, group * P);
    });
    const int64_t ho = pixel / g.out_width % g.out_height, wo = pixel % g.out_width;
    dcnv3_centre_tap(g, ho, wo, centre_y, centre_x);
    opmath_t base_y, base_x;
    dcnv3_reference_point(g, ho, wo, base_y, base_x);
    LocatedSamples<opmath_t>::locate(located, base_y, base_x,
                                     static_cast<opmath_t>(g.offset_scale));
  }

 private:
  static int64_t padded(const Dcnv3Geometry& g, int64_t vector_lanes) {
    // Both powers of 2: the larger is a multiple of the other.
    const int64_t lanes = std::max(vector_lanes, kLanes);
    return (g.groups * g.points() + lanes - 1) / lanes * lanes;
  }

  // The offsets and masks of `count` samples from sample `first` on: offset holds their (x, y)
  // pairs, mask their masks.
  template <typename scalar_t>
  DEFORMCONV_INLINE void unpack_samples(int64_t count, const scalar_t* __restrict offset,
                                        const scalar_t* __restrict mask, int64_t first) {
    opmath_t* __restrict dx = this->dx.data() + first;
    opmath_t* __restrict dy = this->dy.data() + first;
    opmath_t* __restrict m = this->m.data() + first;
    for (int64_t k = 0; k < count; ++k) {
      dx[k] = static_cast<opmath_t>(offset[2 * k]);
      dy[k] = static_cast<opmath_t>(offset[2 * k + 1]);
      m[k] = static_cast<opmath_t>(mask[k]);
    }
  }
};

// The element offsets of the four corner rows of each sample of a pixel, as
// LocatedSamples::clamped_corner_offsets makes them: corner by corner, sample by sample. The
// rows are at these offsets alike in the input and in its gradient, which have the same shape.
class CornerOffsets {
 public:
  explicit CornerOffsets(int64_t samples) : samples_(samples), offsets_(4 * samples) {}

  int64_t* data() { return offsets_.data(); }
  int64_t stride() const { return samples_; }

  // Sample k's four corner offsets, reached through one pointer and the distance between the
  // corners' arrays: a loop over the samples then keeps two registers for them, not four
  // pointers that it would reload from the stack per sample.
  class OfSample {
   public:
    OfSample(const int64_t* first, int64_t stride) : first_(first), stride_(stride) {}
    DEFORMCONV_INLINE int64_t operator[](int corner) const { return first_[corner * stride_]; }

   private:
    const int64_t* first_;
    int64_t stride_;
  };
  DEFORMCONV_INLINE OfSample of_sample(int64_t k) const {
    return OfSample(offsets_.data() + k, samples_);
  }

 private:
  int64_t samples_;
  std::vector<int64_t> offsets_;
};

// Calls run(std::integral_constant<int64_t, 16>{}) where a group has 16 channels, as in every
// stage of InternImage and FlashInternImage, else run(std::integral_constant<int64_t, 0>{}):
// a kernel instantiated with the group's channels known to the compiler (0: read from the
// geometry) runs its channel loops unrolled, with no loop or tail tests per sample.
template <typename Function>
void with_group_channels(const Dcnv3Geometry& g, const Function& run) {
  constexpr int64_t kCommonGroupChannels = 16;
  if (g.group_channels == kCommonGroupChannels) {
    record_branch("dcnv3.cpu.group_channels_16");
    run(std::integral_constant<int64_t, kCommonGroupChannels>{});
  } else {
    record_branch("dcnv3.cpu.group_channels_any");
    run(std::integral_constant<int64_t, 0>{});
  }
}

// Note [Prefetching the rows ahead]
// A pixel's samples lie about its kernel's centre, within a few rows of it for the offsets a
// trained model makes, so from pixel to pixel the input rows they read slide down the image at
// the output's pace. Where the image is not in the caches, as when the layer before has
// streamed other data through them, the hardware prefetcher does not foresee reads scattered
// over a dozen rows, and the samples wait on memory. So each pixel asks for the block of the
// image kRowsAhead rows below its kernel's centre (stride_h rows of stride_w pixels, every
// channel: over the output, the blocks cover the image) to be brought into the L2 cache, and
// the first pixel of a run of pixels (TaskRuns) or of an image asks for the rows from
// kRowsAhead above its centre to kRowsAhead below. Eight rows cover offsets of a few pixels
// and leave the memory several rows of work to answer in. The backward's input gradient has
// just been zeroed, so it is in the caches already.
inline constexpr int64_t kRowsAhead = 8;

// Asks for the cache lines of pixels [x_begin, x_end) of row y of a channels-last image, the
// parts inside the image, to be brought into the L2 cache.
template <typename element_t>
DEFORMCONV_INLINE void prefetch_pixels(const Dcnv3Geometry& g, const element_t* image,
                                       int64_t y, int64_t x_begin, int64_t x_end) {
  x_begin = std::max<int64_t>(x_begin, 0);
  x_end = std::min<int64_t>(x_end, g.width);
  if (y < 0 || y >= g.height || x_begin >= x_end) {
    return;
  }
  const char* line = reinterpret_cast<const char*>(image + (y * g.width + x_begin) * g.channels());
  const char* end = reinterpret_cast<const char*>(image + (y * g.width + x_end) * g.channels());
  for (; line < end; line += kCacheLineBytes) {
    __builtin_prefetch(line, 0, 2);
  }
}

// The prefetches of Note [Prefetching the rows ahead] for `pixel`, where `samples` was located
// last, in `image`, the image that the pixel's samples read; `begin` is the run's first pixel.
template <typename opmath_t, typename element_t>
DEFORMCONV_INLINE void prefetch_rows_ahead(const Dcnv3Geometry& g,
                                           const PixelSamples<opmath_t>& samples,
                                           const element_t* image, int64_t pixel,
                                           int64_t begin) {
  const int64_t y = samples.centre_y, x = samples.centre_x;
  if (pixel == begin || pixel % g.out_pixels() == 0) {
    for (int64_t row = y - kRowsAhead; row < y + kRowsAhead; ++row) {
      prefetch_pixels(g, image, row, 0, g.width);
    }
  }
  for (int64_t row = y + kRowsAhead; row < y + kRowsAhead + g.stride_h; ++row) {
    prefetch_pixels(g, image, row, x, x + g.stride_w);
  }
}

// Whether all of `count` values (of any dtype) are finite: x - x is 0 for a finite x and NaN
// for an infinite or NaN one, and a sum of those is 0 only if all are.
template <typename opmath_t, typename scalar_t>
DEFORMCONV_INLINE bool all_finite(const scalar_t* values, int64_t count) {
  using Lanes = typename LanesOf<opmath_t>::type;
  Lanes probe = {};
  int64_t c = 0;
  for (; c + kLanes <= count; c += kLanes) {
    Lanes lanes;
    load_lanes<opmath_t>(values + c, lanes);
    probe += lanes - lanes;
  }
  opmath_t rest = 0;
  for (; c < count; ++c) {
    const opmath_t value = static_cast<opmath_t>(values[c]);
    rest += value - value;
  }
  return sum_of_lanes<opmath_t>(probe) + rest == opmath_t(0);
}

}  // namespace deformconv
