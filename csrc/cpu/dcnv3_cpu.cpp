// CPU launchers of DCNv3 and its CPU kernels. Every task writes outputs of its own, so the
// results, the input gradient included, do not depend on the number of threads.

#include <ATen/Dispatch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../common/dcnv3_kernel.cuh"
#include "../pytorch/dcnv3.h"
#include "../pytorch/launchers.h"
#include "cpu_launchers.h"
#include "cpu_loops.h"
#include "located_samples.h"

namespace deformconv {
namespace {

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
// `vector_lanes`, the lanes of the clone's vectors, and of kLanes, the lanes of
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
      dcnv3_grid_point(g, k % g.points(), this->grid_y[k], this->grid_x[k]);
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
constexpr int64_t kRowsAhead = 8;

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

// out[c] for kVectors vectors of channels from c on: the sum over the points [first, first +
// points) of their samples' values, each the weighted sum of its four corner rows (at the
// offsets `corners` of `image`), made in the accumulation type (Vector's elements) with the sums
// in registers. A corner of weight 0 adds 0 times its row (+-0, which leaves the sum as it was)
// unless the row holds an infinity or NaN, which makes the sum NaN; so where a sum is not
// finite, the caller makes it again with kZeroUnweighted, which takes such a corner's row as
// zeros. Each channel's arithmetic is the same whatever the vector width.
template <bool kZeroUnweighted, typename Vector, int kVectors, typename scalar_t,
          typename opmath_t>
DEFORMCONV_INLINE void sum_points(const PixelSamples<opmath_t>& samples,
                                  const CornerOffsets& corners, const scalar_t* image,
                                  int64_t first, int64_t points, int64_t c, scalar_t* out) {
  constexpr int64_t kWidth = sizeof(Vector) / sizeof(opmath_t);
  Vector sum[kVectors] = {};
  for (int64_t k = first; k < first + points; ++k) {
    const opmath_t w0 = samples.weight(0, k), w1 = samples.weight(1, k),
                   w2 = samples.weight(2, k), w3 = samples.weight(3, k);
    const auto offsets = corners.of_sample(k);
    const scalar_t* row_0 = image + offsets[0] + c;
    const scalar_t* row_1 = image + offsets[1] + c;
    const scalar_t* row_2 = image + offsets[2] + c;
    const scalar_t* row_3 = image + offsets[3] + c;
    // Unrolled, so that the sums stay in registers.
#pragma GCC unroll 4
    for (int v = 0; v < kVectors; ++v) {
      Vector v0, v1, v2, v3;
      load_vector<opmath_t>(row_0 + v * kWidth, v0);
      load_vector<opmath_t>(row_1 + v * kWidth, v1);
      load_vector<opmath_t>(row_2 + v * kWidth, v2);
      load_vector<opmath_t>(row_3 + v * kWidth, v3);
      if constexpr (kZeroUnweighted) {
        v0 = w0 != opmath_t(0) ? v0 : Vector{};
        v1 = w1 != opmath_t(0) ? v1 : Vector{};
        v2 = w2 != opmath_t(0) ? v2 : Vector{};
        v3 = w3 != opmath_t(0) ? v3 : Vector{};
      }
      sum[v] += w0 * v0 + w1 * v1 + w2 * v2 + w3 * v3;
    }
  }
  for (int v = 0; v < kVectors; ++v) {
    for (int64_t lane = 0; lane < kWidth; ++lane) {
      out[v * kWidth + lane] = static_cast<scalar_t>(sum[v][lane]);
    }
  }
}

// The runs of pixels of the batch's output that `runs` hands out, every group: each channel's
// sum over the points of its group, made in the accumulation type. The four corners of every
// point are located first, their rows at clamped offsets (LocatedSamples::clamped_corner_offsets)
// so that each sample is the same weighted sum of four rows, without branches; a pixel whose
// sums are not all finite is summed again with the rows of corners of weight 0 (outside the
// image, or masked) taken as zeros (sum_points), so that an infinite input value there cannot
// make NaN. Then, a vector or two of channels at a time, in vectors as wide as the running
// clone's registers (kVectorBytes), the sum over the points stays in registers.
template <int kVectorBytes, int64_t kGroupChannels, typename scalar_t>
DEFORMCONV_VECTOR_CLONES void dcnv3_forward_pixels(const Dcnv3Geometry& g, const Dcnv3Fields& f,
                                                   const scalar_t* input, const scalar_t* offset,
                                                   const scalar_t* mask, scalar_t* output,
                                                   TaskRuns& runs) {
  using opmath_t = at::opmath_type<scalar_t>;
  using Lanes = typename LanesOf<opmath_t>::type;
  typedef opmath_t Vector __attribute__((vector_size(kVectorBytes)));
  constexpr int64_t kWidth = kVectorBytes / sizeof(opmath_t);
  const int64_t P = g.points();
  const int64_t D = kGroupChannels > 0 ? kGroupChannels : g.group_channels;
  const int64_t C = g.channels();
  PixelSamples<opmath_t> samples(g, kVectorBytes / sizeof(opmath_t));
  CornerOffsets corners(samples.located);
  int64_t begin, end;
  while (runs.take(begin, end)) {
    for (int64_t pixel = begin; pixel < end; ++pixel) {
      samples.locate(g, f, pixel, offset, mask);
      const scalar_t* image = input + pixel / g.out_pixels() * g.in_pixels() * C;
      prefetch_rows_ahead(g, samples, image, pixel, begin);
      samples.clamped_corner_offsets(samples.located, C, samples.first_channel.data(),
                                     corners.stride(), corners.data());
      const auto sum_groups = [&](auto zero_unweighted) DEFORMCONV_INLINE_LAMBDA {
        constexpr bool kZero = decltype(zero_unweighted)::value;
        for (int64_t group = 0; group < g.groups; ++group) {
          scalar_t* out = output + pixel * C + group * D;
          int64_t c = 0;
          for (; c + 2 * kWidth <= D; c += 2 * kWidth) {
            sum_points<kZero, Vector, 2>(samples, corners, image, group * P, P, c, out + c);
          }
          for (; c + kWidth <= D; c += kWidth) {
            sum_points<kZero, Vector, 1>(samples, corners, image, group * P, P, c, out + c);
          }
          for (; c + kLanes <= D; c += kLanes) {
            sum_points<kZero, Lanes, 1>(samples, corners, image, group * P, P, c, out + c);
          }
          for (; c < D; ++c) {
            opmath_t sum = 0;
            for (int64_t k = group * P; k < (group + 1) * P; ++k) {
              const auto offsets = corners.of_sample(k);
              opmath_t value[4];
              for (int corner = 0; corner < 4; ++corner) {
                value[corner] = static_cast<opmath_t>(image[offsets[corner] + c]);
                if (kZero && samples.weight(corner, k) == opmath_t(0)) {
                  value[corner] = opmath_t(0);
                }
              }
              sum += samples.weight(0, k) * value[0] + samples.weight(1, k) * value[1] +
                  samples.weight(2, k) * value[2] + samples.weight(3, k) * value[3];
            }
            out[c] = static_cast<scalar_t>(sum);
          }
        }
      };
      sum_groups(std::false_type{});
      if (!all_finite<opmath_t>(output + pixel * C, C)) {
        record_branch("dcnv3.cpu.forward.non_finite_sums");
        sum_groups(std::true_type{});
      }
    }
  }
}

void dcnv3_forward_cpu(const Dcnv3Geometry& g, const Dcnv3Fields& f, int64_t batch,
                       const at::Tensor& input, const at::Tensor& offset, const at::Tensor& mask,
                       at::Tensor& output) {
  DEFORMCONV_DISPATCH(input.scalar_type(), "dcnv3_forward_cpu", [&] {
    const scalar_t* input_data = input.const_data_ptr<scalar_t>();
    const scalar_t* offset_data = offset.const_data_ptr<scalar_t>();
    const scalar_t* mask_data = mask.const_data_ptr<scalar_t>();
    scalar_t* output_data = output.mutable_data_ptr<scalar_t>();
    // Vectors as wide as a register of the clone that runs.
    with_register_bytes([&](auto register_bytes) {
      constexpr int64_t kWidth = register_bytes / sizeof(at::opmath_type<scalar_t>);
      record_channel_loops("dcnv3.cpu.forward", g.group_channels, {2 * kWidth, kWidth, kLanes});
      with_group_channels(g, [&](auto group_channels) {
        parallel_task_runs(batch * g.out_pixels(), [&](TaskRuns& runs) {
          dcnv3_forward_pixels<register_bytes, group_channels>(g, f, input_data, offset_data,
                                                               mask_data, output_data, runs);
        });
      });
    });
  });
}

// dot_i += grad * value_i, lane by lane, for the four corners.
template <typename Lanes>
DEFORMCONV_INLINE void add_corner_products(const Lanes& grad, const Lanes& value_0,
                                           const Lanes& value_1, const Lanes& value_2,
                                           const Lanes& value_3, Lanes& dot_0, Lanes& dot_1,
                                           Lanes& dot_2, Lanes& dot_3) {
  dot_0 += grad * value_0;
  dot_1 += grad * value_1;
  dot_2 += grad * value_2;
  dot_3 += grad * value_3;
}

// weight[corner] * grad added onto each corner's row grad_row[corner], over the D channels of
// a group: in vectors as wide as the running clone's registers (kVectorBytes: one AVX-512
// register for a group of 16 float channels, where kLanes would take two), then kLanes at a
// time, then one by one. Each channel's sum is the same multiply-add whatever the width.
template <int kVectorBytes, typename opmath_t>
DEFORMCONV_INLINE void scatter_sample_gradient(const opmath_t* grad, int64_t D,
                                               opmath_t* const grad_row[4],
                                               const opmath_t weight[4]) {
  using Lanes = typename LanesOf<opmath_t>::type;
  using UnalignedLanes = typename LanesOf<opmath_t>::unaligned;
  typedef opmath_t Vector __attribute__((vector_size(kVectorBytes)));
  typedef opmath_t UnalignedVector
      __attribute__((vector_size(kVectorBytes), aligned(alignof(opmath_t)), may_alias));
  constexpr int64_t kWidth = kVectorBytes / sizeof(opmath_t);
  int64_t c = 0;
  for (; kWidth > kLanes && c + kWidth <= D; c += kWidth) {
    Vector grad_vector;
    load_vector<opmath_t>(grad + c, grad_vector);
    for (int corner = 0; corner < 4; ++corner) {
      *reinterpret_cast<UnalignedVector*>(grad_row[corner] + c) += weight[corner] * grad_vector;
    }
  }
#pragma GCC unroll 2
  for (; c + kLanes <= D; c += kLanes) {
    Lanes grad_lanes;
    load_lanes<opmath_t>(grad + c, grad_lanes);
    for (int corner = 0; corner < 4; ++corner) {
      *reinterpret_cast<UnalignedLanes*>(grad_row[corner] + c) += weight[corner] * grad_lanes;
    }
  }
  for (; c < D; ++c) {
    for (int corner = 0; corner < 4; ++corner) {
      grad_row[corner][c] += weight[corner] * grad[c];
    }
  }
}

// One sample's share of the gradients, over the D channels of its group, from the sampled
// values' gradients `grad` (in the accumulation type, zero-filled to whole lanes), its corners'
// rows at the offsets `corners` of `image` and of its gradient `grad_image`: with kDots, the dot
// products of `grad` with the four corner rows, for offset_mask_grad_sums (which discards those
// of the corners outside), kLanes channels at a time, the last few channels copied into
// zero-filled lanes; with kScatter, weight[corner] * grad added onto each corner's gradient row
// (scatter_sample_gradient), at every corner, or, with kSkipUnweighted, at those of nonzero
// weight only, the others adding into `unread`, a row that is never read. The dot products all
// go through the same vector code, whichever pass runs it: scalar code for the last channels
// would leave the compiler free to fuse its multiply-adds differently in each pass, and the
// results would depend on the pass, and so on the number of threads.
template <bool kDots, bool kScatter, bool kSkipUnweighted, int kVectorBytes, typename scalar_t,
          typename opmath_t>
DEFORMCONV_INLINE void sample_gradients(const opmath_t* grad, int64_t D, const scalar_t* image,
                                        opmath_t* grad_image,
                                        const CornerOffsets::OfSample& corners,
                                        const opmath_t weight[4], opmath_t* unread,
                                        opmath_t dots[4]) {
  using Lanes = typename LanesOf<opmath_t>::type;
  // Read once, before the scatter's stores: the compiler cannot tell that those stores leave
  // the offsets as they were, and would read them again after each.
  const int64_t offset[4] = {corners[0], corners[1], corners[2], corners[3]};
  if constexpr (kDots) {
    const scalar_t* value_0 = image + offset[0];
    const scalar_t* value_1 = image + offset[1];
    const scalar_t* value_2 = image + offset[2];
    const scalar_t* value_3 = image + offset[3];
    Lanes dot_0 = {}, dot_1 = {}, dot_2 = {}, dot_3 = {};
    int64_t c = 0;
    // Unrolled, so that where D is known (16 channels) its two passes run without a loop.
#pragma GCC unroll 2
    for (; c + kLanes <= D; c += kLanes) {
      Lanes grad_lanes, v0, v1, v2, v3;
      load_lanes<opmath_t>(grad + c, grad_lanes);
      load_lanes<opmath_t>(value_0 + c, v0);
      load_lanes<opmath_t>(value_1 + c, v1);
      load_lanes<opmath_t>(value_2 + c, v2);
      load_lanes<opmath_t>(value_3 + c, v3);
      add_corner_products(grad_lanes, v0, v1, v2, v3, dot_0, dot_1, dot_2, dot_3);
    }
    if (c < D) {
      Lanes grad_lanes, v0, v1, v2, v3;
      load_lanes<opmath_t>(grad + c, grad_lanes);
      load_last_lanes<opmath_t>(value_0 + c, D - c, v0);
      load_last_lanes<opmath_t>(value_1 + c, D - c, v1);
      load_last_lanes<opmath_t>(value_2 + c, D - c, v2);
      load_last_lanes<opmath_t>(value_3 + c, D - c, v3);
      add_corner_products(grad_lanes, v0, v1, v2, v3, dot_0, dot_1, dot_2, dot_3);
    }
    sums_of_four_lanes<opmath_t>(dot_0, dot_1, dot_2, dot_3, dots);
  }
  if constexpr (kScatter) {
    opmath_t* grad_row[4];
    for (int corner = 0; corner < 4; ++corner) {
      grad_row[corner] = grad_image + offset[corner];
      if constexpr (kSkipUnweighted) {
        grad_row[corner] = weight[corner] != opmath_t(0) ? grad_row[corner] : unread;
      }
    }
    scatter_sample_gradient<kVectorBytes>(grad, D, grad_row, weight);
  }
}

// The gradients that a pass of dcnv3_gradient_pixels makes: all of them, the input gradient
// alone, or the offset and mask gradients alone.
enum class GradientPass { kAll, kInput, kOffsetMask };

// The gradients that kPass makes, of the runs of tasks that `runs` hands out, each task
// pixels_per_task pixels of the batch's output. The samples of each pixel are located at
// once; for the offset and mask gradients, their corner dot products are summed over their
// groups' channels, and then, from those, the gradients of all the pixel's samples made at
// once; for the input gradient, each sample's share is added into grad_input, whose images the
// task owns, in the order (pixel, group, point, corner) whichever pass adds it. Both read and
// write every corner's row at the clamped offsets of LocatedSamples::clamped_corner_offsets,
// the same in the input and its gradient; where a group's output gradient is not finite, the
// scatter skips the corners of weight 0 instead, so that 0 times infinity adds no NaN.
template <GradientPass kPass, int kVectorBytes, int64_t kGroupChannels, typename scalar_t>
DEFORMCONV_VECTOR_CLONES void dcnv3_gradient_pixels(
    const Dcnv3Geometry& g, const Dcnv3Fields& f, const scalar_t* grad_output,
    const scalar_t* input, const scalar_t* offset, const scalar_t* mask,
    at::opmath_type<scalar_t>* grad_input, scalar_t* grad_offset, scalar_t* grad_mask,
    TaskRuns& runs, int64_t pixels_per_task) {
  using opmath_t = at::opmath_type<scalar_t>;
  constexpr bool kDots = kPass != GradientPass::kInput;
  constexpr bool kScatter = kPass != GradientPass::kOffsetMask;
  const int64_t P = g.points();
  const int64_t D = kGroupChannels > 0 ? kGroupChannels : g.group_channels;
  const int64_t C = g.channels();
  // Where the gradient of a corner of weight 0 goes when the sampled values' gradient is not
  // finite (weight 0 times infinity would be NaN): written, never read.
  std::vector<opmath_t> unread(kScatter ? D : 0);
  PixelSamples<opmath_t> samples(g, kVectorBytes / sizeof(opmath_t));
  const int64_t located = samples.located;
  CornerOffsets corners(located);
  // The sampled values' gradients of one group, in the accumulation type, zero-filled to whole
  // lanes.
  std::vector<opmath_t> group_grad((D + kLanes - 1) / kLanes * kLanes, opmath_t(0));
  // Per sample of the pixel: its four corner dot products, side by side, the same by corner
  // (LocatedSamples::offset_mask_grad_sums), then its three gradient sums.
  std::vector<opmath_t> dots(4 * located), corner_dots(4 * located), sums(3 * located);
  opmath_t* const sums_y = sums.data();
  opmath_t* const sums_x = sums.data() + located;
  opmath_t* const sums_m = sums.data() + 2 * located;
  int64_t first_task, end_task;
  while (runs.take(first_task, end_task)) {
    const int64_t begin = first_task * pixels_per_task, end = end_task * pixels_per_task;
    for (int64_t pixel = begin; pixel < end; ++pixel) {
      samples.locate(g, f, pixel, offset, mask);
      const int64_t image_start = pixel / g.out_pixels() * g.in_pixels() * C;
      const scalar_t* image = input + image_start;
      // grad_input is null in a pass without the scatter.
      opmath_t* grad_image = kScatter ? grad_input + image_start : nullptr;
      // The task's image of the input gradient, which no other task writes, zeroed as the task
      // comes to it: zeroed beforehand, the image would be out of this core's cache by the time
      // the scatter adds into it, where the batch's gradient is larger than the cache.
      if (kScatter && pixel % g.out_pixels() == 0) {
        std::fill_n(grad_image, g.in_pixels() * C, opmath_t(0));
      }
      if constexpr (kDots) {
        prefetch_rows_ahead(g, samples, image, pixel, begin);
      }
      samples.clamped_corner_offsets(located, C, samples.first_channel.data(), corners.stride(),
                                     corners.data());
      for (int64_t group = 0; group < g.groups; ++group) {
        const scalar_t* grad = grad_output + pixel * C + group * D;
        for (int64_t c = 0; c < D; ++c) {
          group_grad[c] = static_cast<opmath_t>(grad[c]);
        }
        const auto group_samples = [&](auto skip_unweighted) DEFORMCONV_INLINE_LAMBDA {
          for (int64_t k = group * P; k < (group + 1) * P; ++k) {
            opmath_t weight[4] = {};
            if constexpr (kScatter) {
              for (int corner = 0; corner < 4; ++corner) {
                weight[corner] = samples.weight(corner, k);
              }
            }
            sample_gradients<kDots, kScatter, decltype(skip_unweighted)::value, kVectorBytes>(
                group_grad.data(), D, image, grad_image, corners.of_sample(k), weight,
                unread.data(), dots.data() + 4 * k);
          }
        };
        if (!kScatter || all_finite<opmath_t>(group_grad.data(), D)) {
          group_samples(std::false_type{});
        } else {
          record_branch("dcnv3.cpu.scatter.non_finite_gradient");
          group_samples(std::true_type{});
        }
      }
      if constexpr (kDots) {
        samples.offset_mask_grad_sums(located, dots.data(), corner_dots.data(), sums_y, sums_x,
                                      sums_m);
        // A run's gradients are laid out as one group's, of `count` points.
        for_each_sample_run(g, f, [&](int64_t group, int64_t count) {
          scalar_t *run_grad_offset, *run_grad_mask;
          dcnv3_group_grads(f, pixel, group, grad_offset, grad_mask, run_grad_offset,
                            run_grad_mask);
          for (int64_t point = 0; point < count; ++point) {
            const int64_t k = group * P + point;
            const OffsetMaskGradSums<opmath_t> sums_of_k{sums_y[k], sums_x[k], sums_m[k]};
            dcnv3_write_grad(g, point, samples.mask(k), sums_of_k, run_grad_offset,
                             run_grad_mask);
          }
        });
      }
    }
  }
}

// The gradients asked for. The input gradient is made by tasks of whole images, each owning
// its image's gradient, so that each element's sum is made in the same order whatever the
// threads. One pass over the images makes all the gradients, cheaper than two passes as it
// locates each pixel's samples once for both; but it keeps at most `batch` threads busy. So
// with at most half as many images as threads, the offset and mask gradients are made apart,
// in tasks of pixels that all the threads share, and the pass by images is only the input
// gradient's scatter.
void dcnv3_gradients_cpu(const Dcnv3Geometry& g, const Dcnv3Fields& f, int64_t batch,
                         const at::Tensor& grad_output, const at::Tensor& input,
                         const at::Tensor& offset, const at::Tensor& mask,
                         at::Tensor& grad_input, at::Tensor& grad_offset, at::Tensor& grad_mask) {
  const bool want_input = grad_input.defined();
  const bool want_offset_or_mask = grad_offset.defined() || grad_mask.defined();
  DEFORMCONV_DISPATCH(input.scalar_type(), "dcnv3_gradients_cpu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    // Note [Input gradient sums in float32]
    at::Tensor sums =
        want_input ? uninitialised_input_gradient_sums<scalar_t>(grad_input) : at::Tensor();
    const scalar_t* grad_output_data = grad_output.const_data_ptr<scalar_t>();
    const scalar_t* input_data = input.const_data_ptr<scalar_t>();
    const scalar_t* offset_data = offset.const_data_ptr<scalar_t>();
    const scalar_t* mask_data = mask.const_data_ptr<scalar_t>();
    opmath_t* sums_data = mutable_data_or_null<opmath_t>(sums);
    scalar_t* grad_offset_data = mutable_data_or_null<scalar_t>(grad_offset);
    scalar_t* grad_mask_data = mutable_data_or_null<scalar_t>(grad_mask);
    // The scatter's vectors as wide as a register of the clone that runs.
    with_register_bytes([&](auto register_bytes) {
      constexpr int64_t kWidth = register_bytes / sizeof(opmath_t);
      if (want_input) {
        record_channel_loops("dcnv3.cpu.scatter", g.group_channels,
                             {kWidth > kLanes ? kWidth : kLanes, kLanes});
      }
      if (want_offset_or_mask) {
        record_channel_loops("dcnv3.cpu.dots", g.group_channels, {kLanes});
      }
      with_group_channels(g, [&](auto group_channels) {
        // The pass over tasks of pixels_per_task pixels each.
        const auto run = [&](auto pass, int64_t pixels_per_task) {
          parallel_task_runs(batch * g.out_pixels() / pixels_per_task, [&](TaskRuns& runs) {
            dcnv3_gradient_pixels<decltype(pass)::value, register_bytes, group_channels>(
                g, f, grad_output_data, input_data, offset_data, mask_data, sums_data,
                grad_offset_data, grad_mask_data, runs, pixels_per_task);
          });
        };
        using All = std::integral_constant<GradientPass, GradientPass::kAll>;
        using Input = std::integral_constant<GradientPass, GradientPass::kInput>;
        using OffsetMask = std::integral_constant<GradientPass, GradientPass::kOffsetMask>;
        if (want_input && want_offset_or_mask && 2 * batch > at::get_num_threads()) {
          record_branch("dcnv3.cpu.backward.one_pass");
          run(All{}, g.out_pixels());
          return;
        }
        if (want_input) {
          record_branch("dcnv3.cpu.backward.input_pass");
          run(Input{}, g.out_pixels());
        }
        if (want_offset_or_mask) {
          record_branch("dcnv3.cpu.backward.offset_mask_pass");
          run(OffsetMask{}, 1);
        }
      });
    });
    if (want_input) {
      store_input_gradient_sums(sums, grad_input);
    }
  });
}

constexpr Dcnv3Launchers kCpuDcnv3Launchers{
    .forward = dcnv3_forward_cpu,
    .backward = dcnv3_gradients_cpu,
};

}  // namespace

const Dcnv3Launchers& dcnv3_cpu_launchers() { return kCpuDcnv3Launchers; }

}  // namespace deformconv
