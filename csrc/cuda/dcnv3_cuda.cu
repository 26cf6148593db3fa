// CUDA launchers of DCNv3, on the current stream.
//
// The work is split into items, the (output pixel, group) pairs of the batch, numbered
// pixel * G + group, which is also where an item's D channels lie in the output. An item gets
// `lanes` consecutive threads of one warp; lane l takes the vectors of kVector channels
// l, l + lanes, ... of the group (a pass each), kVector channels being 16 bytes (in the
// backward, 16 bytes of its float32 sums: kBackwardVector) where the group's channels and the
// tensors' alignment allow, else 1. Neighbouring lanes read neighbouring
// vectors of a corner pixel, and neighbouring items the next group of the same pixel, so that
// a warp's reads and writes coalesce.
//
// A block holds kThreadsPerBlock / lanes items. Before an item's lanes sample, they locate each
// of its samples of a round of points once, in shared memory (SharedSample), lane l the points
// l, l + lanes, ...: the offsets and the mask are read once, neighbouring lanes reading
// neighbouring points, and the sampling positions and corner weights are computed once per
// sample rather than once per channel vector. What the item's points share (its image, pixel
// and group, its reference point, where its offsets start: Dcnv3ItemStart) each lane computes
// once per item, not once per sample. The item's lanes wait only for one another between
// staging and sampling (a warp's barrier, not a block's). The backward computes the
// input gradient and the offset and mask gradients in one kernel, which reads the output's
// gradient once for both; a sample's offset and mask gradients are dot products over its
// group's channels, summed over the item's lanes with warp shuffles and written by lane 0. Its
// input gradient adds into a band of shared memory first where the rows fit (Note [Input
// gradient in a band of shared memory]), a block then taking a strip of one group's pixels.
// Under deterministic mode the input gradient is gathered instead (Note [Gathered input
// gradients]): the backward kernel records each sample's corners, and the bands, whose adds
// into shared memory are atomic, are not taken.
//
// A thread splits an item into image, row, column and group, and a point into kernel column and
// row: each kernel is built twice, dividing by InvariantDivisor (a multiply-high and a shift)
// and indexing the input's and output's elements in 32 bits when every dividend and element
// index of the launch is below 2^31, in int64 otherwise (Dcnv3Divisors, with_divisors).

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <optional>
#include <string_view>
#include <type_traits>

#include "../common/dcnv3_kernel.cuh"
#include "../core/dcnv3.h"
#include "../infrastructure/branch_trace.h"
#include "../infrastructure/device_kernels.h"
#include "../infrastructure/dtype_dispatch.h"
#include "../infrastructure/input_gradient_sums.h"
#include "../infrastructure/optional_data.h"
#include "channel_vectors.cuh"
#include "cuda_device.h"
#include "gathered_input_gradient.cuh"
#include "launch.cuh"

namespace deformconv {
namespace {

// The names of the launchers' paths.
constexpr LanePathNames kDcnv3Paths{
    "dcnv3.cuda.channels.vectors", "dcnv3.cuda.channels.one_at_a_time",
    "dcnv3.cuda.channels.several_passes", "dcnv3.cuda.points.several_rounds"};

// Channel 0 of an item's group at grid pixel 0 of its image, in a channels-last (N, H, W, G * D)
// tensor.
__device__ inline int64_t group_start(const Dcnv3Geometry& g, const Dcnv3Item& it) {
  return it.n * g.in_pixels() * g.channels() + it.group * g.group_channels;
}

// Stages the round of an item's points that starts at first_point into its slots `samples`
// (stage_item_samples), each point's position from the item's start. Returns the round's
// number of points. Every thread of the warp calls it.
template <typename scalar_t, typename Divisor>
__device__ inline int stage_round(const Dcnv3Geometry& g, const Divisor& kernel_h,
                                  const LaneTiling& t, int lane, bool active_item,
                                  const Dcnv3ItemStart<opmath_type<scalar_t>>& start,
                                  int64_t first_point, const scalar_t* offset,
                                  const scalar_t* mask,
                                  SharedSample<opmath_type<scalar_t>>* samples) {
  using opmath_t = opmath_type<scalar_t>;
  return stage_item_samples(t, lane, active_item, g.points() - first_point, samples,
                            [&](int point) {
    opmath_t y, x, m;
    dcnv3_position(g, kernel_h, start, first_point + point, offset, mask, y, x, m);
    return share_sample(y, x, m, g.height, g.width);
  });
}

template <typename scalar_t, int kVector, typename Divisor>
__global__ void dcnv3_forward_kernel(Dcnv3Geometry g, Dcnv3Divisors<Divisor> d, Dcnv3Fields f,
                                     LaneTiling t, const scalar_t* input, const scalar_t* offset,
                                     const scalar_t* mask, scalar_t* output) {
  using opmath_t = opmath_type<scalar_t>;
  using index_t = typename Dcnv3Divisors<Divisor>::index_type;
  __shared__ SharedSample<opmath_t> staged[kStagedSamples<opmath_t>];
  const int slot = threadIdx.x / t.lanes;
  const int lane = threadIdx.x % t.lanes;
  SharedSample<opmath_t>* const samples = staged + slot * t.samples_per_round;
  const int64_t points = g.points();
  const index_t pixel_stride = static_cast<index_t>(g.channels());
  const CornerSteps<index_t> corners = corner_steps<index_t>(g.width, g.channels());
  // Every thread runs every round of its warp, active or not: staging a round holds barriers.
  for (int64_t first_item = int64_t(blockIdx.x) * t.items_per_block; first_item < t.items;
       first_item += int64_t(gridDim.x) * t.items_per_block) {
    const int64_t item = first_item + slot;
    const bool active_item = item < t.items;
    Dcnv3ItemStart<opmath_t> start{};
    index_t item_channels = 0;
    if (active_item) {
      const Dcnv3Item it = dcnv3_item(d, item);
      start = dcnv3_item_start<opmath_t>(g, f, it);
      item_channels = static_cast<index_t>(group_start(g, it));
    }
    for (int64_t pass = 0; pass < t.passes; ++pass) {
      const index_t vector = static_cast<index_t>(pass * t.lanes + lane);
      const bool active = active_item && vector < t.vectors;
      const index_t channel = item_channels + vector * kVector;
      opmath_t sum[kVector] = {};
      for (int64_t first_point = 0; first_point < points; first_point += t.samples_per_round) {
        const int round_points = stage_round(g, d.kernel_h, t, lane, active_item, start,
                                             first_point, offset, mask, samples);
        if (active) {
          for (int point = 0; point < round_points; ++point) {
            // In registers: the sample's fields are read once, not once per corner.
            const SharedSample<opmath_t> sample = samples[point];
            add_sample<scalar_t, kVector>(sample, input + channel, pixel_stride, corners, sum);
          }
        }
      }
      if (active) {
        ChannelVector<scalar_t, kVector> result;
        for (int e = 0; e < kVector; ++e) {
          result.value[e] = static_cast<scalar_t>(sum[e]);
        }
        store_vector(output + (static_cast<index_t>(item * g.group_channels) + vector * kVector),
                     result);
      }
    }
  }
}

// The backward of one item, all its points in rounds: add_input_gradient(sample, point, corner,
// vector, at, weighted) adds kVector sums of the input gradient (`at`: their element index from
// the batch's first pixel), for each corner of non-zero weight, where the input gradient is
// asked for; the offset and mask gradients
// are dot products over the item's lanes, written by lane 0, where asked for. Every thread of
// the warp calls it, `active_item` where its item (`item`, split as `it`) is.
template <typename scalar_t, int kVector, typename Divisor, typename AddInputGradient>
__device__ inline void backward_item(
    const Dcnv3Geometry& g, const Dcnv3Divisors<Divisor>& d, const Dcnv3Fields& f,
    const LaneTiling& t, int lane, bool active_item, int64_t item, const Dcnv3Item& it,
    SharedSample<opmath_type<scalar_t>>* samples, const scalar_t* grad_output,
    const scalar_t* input, const scalar_t* offset, const scalar_t* mask, bool input_gradient,
    scalar_t* grad_offset, scalar_t* grad_mask, const AddInputGradient& add_input_gradient) {
  using opmath_t = opmath_type<scalar_t>;
  using index_t = typename Dcnv3Divisors<Divisor>::index_type;
  const bool position_grads = grad_offset != nullptr || grad_mask != nullptr;
  const index_t pixel_stride = static_cast<index_t>(g.channels());
  const CornerSteps<index_t> corners = corner_steps<index_t>(g.width, g.channels());
  Dcnv3ItemStart<opmath_t> start{};
  index_t item_channels = 0;
  scalar_t *group_grad_offset = nullptr, *group_grad_mask = nullptr;
  if (active_item) {
    start = dcnv3_item_start<opmath_t>(g, f, it);
    item_channels = static_cast<index_t>(group_start(g, it));
    dcnv3_group_grads(f, it.pixel, it.group, grad_offset, grad_mask, group_grad_offset,
                      group_grad_mask);
  }
  for (int64_t first_point = 0; first_point < g.points(); first_point += t.samples_per_round) {
    const int round_points = stage_round(g, d.kernel_h, t, lane, active_item, start,
                                         first_point, offset, mask, samples);
    for (int point = 0; point < round_points; ++point) {
      // The dot products of the output's gradient with each corner's values (0 outside), as
      // offset_mask_grad_sums_of_dots takes them.
      opmath_t dots[4] = {0, 0, 0, 0};
      if (active_item) {
        // In registers: the sample's fields are read once, not once per corner and pass.
        const SharedSample<opmath_t> sample = samples[point];
        const index_t top_left =
            item_channels + static_cast<index_t>(sample.top_left) * pixel_stride;
        for (int64_t pass = 0; pass < t.passes; ++pass) {
          const index_t vector = static_cast<index_t>(pass * t.lanes + lane);
          if (vector >= t.vectors) {
            continue;
          }
          const auto grad_read = load_vector<scalar_t, kVector>(
              grad_output + (static_cast<index_t>(item * g.group_channels) + vector * kVector));
          opmath_t grad[kVector];
          for (int e = 0; e < kVector; ++e) {
            grad[e] = static_cast<opmath_t>(grad_read.value[e]);
          }
          for (int corner = 0; corner < 4; ++corner) {
            const index_t at = top_left + vector * kVector + corners.from_top_left[corner];
            const opmath_t weight = sample.weight[corner];
            if (input_gradient && weight != opmath_t(0)) {
              opmath_t weighted[kVector];
              for (int e = 0; e < kVector; ++e) {
                weighted[e] = weight * grad[e];
              }
              add_input_gradient(sample, first_point + point, corner, vector, at, weighted);
            }
            if (position_grads && (sample.corners >> corner & 1)) {
              const auto read = load_vector<scalar_t, kVector>(input + at);
              for (int e = 0; e < kVector; ++e) {
                dots[corner] += grad[e] * static_cast<opmath_t>(read.value[e]);
              }
            }
          }
        }
      }
      if (position_grads) {
        for (int corner = 0; corner < 4; ++corner) {
          dots[corner] = sum_over_lanes(dots[corner], t.lanes);
        }
        if (active_item && lane == 0) {
          const SharedSample<opmath_t>& sample = samples[point];
          dcnv3_write_grad(g, first_point + point, sample.mask,
                           offset_mask_grad_sums_of_dots(sample.ly, sample.lx, dots[0],
                                                         dots[1], dots[2], dots[3]),
                           group_grad_offset, group_grad_mask);
        }
      }
    }
  }
}

// grad_input (sums of opmath_type, Note [Input gradient sums in float32]), grad_offset and
// grad_mask are null where not asked for. The input gradient adds atomically in global memory
// (scatter_add_run), or, in the kGathered instance (of its own, so that the atomic one keeps its
// registers), is recorded in `entries` and gathered after the kernel (Note [Gathered input
// gradients]): sample item * P + point of the launch.
template <typename scalar_t, int kVector, typename Divisor, bool kGathered>
__global__ void dcnv3_backward_kernel(Dcnv3Geometry g, Dcnv3Divisors<Divisor> d, Dcnv3Fields f,
                                      LaneTiling t, const scalar_t* grad_output,
                                      const scalar_t* input, const scalar_t* offset,
                                      const scalar_t* mask, opmath_type<scalar_t>* grad_input,
                                      CornerEntries<opmath_type<scalar_t>> entries,
                                      scalar_t* grad_offset, scalar_t* grad_mask) {
  using opmath_t = opmath_type<scalar_t>;
  using index_t = typename Dcnv3Divisors<Divisor>::index_type;
  __shared__ SharedSample<opmath_t> staged[kStagedSamples<opmath_t>];
  const int slot = threadIdx.x / t.lanes;
  const int lane = threadIdx.x % t.lanes;
  SharedSample<opmath_t>* const samples = staged + slot * t.samples_per_round;
  for (int64_t first_item = int64_t(blockIdx.x) * t.items_per_block; first_item < t.items;
       first_item += int64_t(gridDim.x) * t.items_per_block) {
    const int64_t item = first_item + slot;
    const bool active_item = item < t.items;
    const Dcnv3Item it = active_item ? dcnv3_item(d, item) : Dcnv3Item{};
    const auto add_input_gradient = [&](const SharedSample<opmath_t>& sample, int64_t point,
                                        int corner, index_t vector, index_t at,
                                        const opmath_t* weighted) {
      if constexpr (kGathered) {
        if (vector == 0) {
          entries.record(item * g.points() + point, corner, sample.weight[corner], at,
                         item * g.group_channels);
        }
      } else {
        scatter_add_run<kVector>(grad_input + at, weighted);
      }
    };
    backward_item<scalar_t, kVector>(g, d, f, t, lane, active_item, item, it, samples, grad_output,
                                     input, offset, mask, kGathered || grad_input != nullptr,
                                     grad_offset, grad_mask, add_input_gradient);
  }
}

// Note [Input gradient in a band of shared memory]
// In global memory the input gradient's atomic adds bound the backward: each sample adds a
// vector to each of its corners in L2, about 36 adds onto every input pixel with a 3 x 3
// kernel. Where the input gradient is asked for and the rows fit, the backward takes the
// banded kernel instead: a block takes a strip of items_per_block consecutive output pixels of
// one image and group, an item a pixel, and adds its samples' corners into a band of shared
// memory, the whole input rows that the strip's kernel footprints reach (`rows_above` rows
// above the centre taps of the strip's first output row, `rows_below` below those of its last,
// a margin for the offsets included). A corner outside the band adds to global memory directly.
// With the strip done, the block adds each non-zero vector of the band to global memory in one
// atomic and clears it: a pixel that many samples reach costs L2 one atomic a strip, not one a
// sample. Shared memory has no floating-point atomic add: CUDA compiles it to a compare-and-swap
// loop (ATOMS.CAST.SPIN on compute capability 9.0). A band pixel takes D words, D made odd, so
// that the corners of neighbouring items fall in different banks. In full rows, a corner is in
// the band when its grid index, less the band's first, is below the band's pixels: no division.
constexpr int64_t kBandBytesPerBlock = 24 * 1024;
// Rows of margin beyond the kernel's footprint, each side, where they fit: offsets of a few
// pixels stay in the band.
constexpr int64_t kBandMarginRows = 4;

// What the launcher computes of the bands (band_shape); the kernel's divisor is of `strips`.
struct BandShape {
  int64_t tiles;       // of the launch: N * strips * G
  int64_t strips;      // of an image's output pixels: ceil(Ho * Wo / items_per_block)
  int64_t rows_above;  // band rows above the strip's first centre-tap row
  int64_t rows_below;  // and below its last
  int64_t pixels;      // of the largest band, at most kBandBytesPerBlock in all
  int pixel_words;     // words of a band pixel: D, odd
};

template <typename Divisor>
struct GradientBands {
  int64_t tiles;
  Divisor strips;
  int64_t rows_above, rows_below, pixels;
  int pixel_words;

  explicit GradientBands(const BandShape& b)
      : tiles(b.tiles), strips(b.strips), rows_above(b.rows_above), rows_below(b.rows_below),
        pixels(b.pixels), pixel_words(b.pixel_words) {}
};

// The environment variable DEFORMCONV_INPUT_GRADIENT_BANDS=0, read at every call, leaves the
// input gradient to global memory's atomics (to compare the two kernels, or to test the other).
bool input_gradient_bands_allowed() {
  const char* setting = std::getenv("DEFORMCONV_INPUT_GRADIENT_BANDS");
  return setting == nullptr || std::string_view(setting) != "0";
}

// The bands of a launch that asks for the input gradient, or none where even a band without
// margin would not fit. A strip of items_per_block pixels starting anywhere in a row spans at
// most strip_rows output rows; a band takes the rows of their centre taps, the footprint's
// reach above and below them (its far corner's row included), and the margin.
template <typename opmath_t>
std::optional<BandShape> band_shape(const Dcnv3Geometry& g, const LaneTiling& t) {
  const double scale = g.offset_scale;
  const int64_t centre = g.dilation_h * (g.kernel_h - 1) / 2;
  // The footprint's first and last rows from the centre tap, before offsets: (-centre) * scale
  // and (span - centre) * scale, one of them at most 0 and the other at least 0 (offset_scale
  // is finite), each reach at most the image's height.
  const double low = -centre * scale;
  const double high = (g.dilation_h * (g.kernel_h - 1) - centre) * scale;
  const double height = static_cast<double>(g.height);
  const int64_t reach_above =
      static_cast<int64_t>(std::min(height, std::ceil(-std::min(low, high))));
  const int64_t reach_below =
      static_cast<int64_t>(std::min(height, std::floor(std::max(low, high)))) + 1;
  const int64_t strip_rows =
      std::min(g.out_height, (t.items_per_block + g.out_width - 2) / g.out_width + 1);
  const int pixel_words = static_cast<int>(g.group_channels | 1);
  const auto band_pixels = [&](int64_t margin) {
    const int64_t rows = std::min(
        g.height, (strip_rows - 1) * g.stride_h + reach_above + reach_below + 1 + 2 * margin);
    return static_cast<double>(rows) * static_cast<double>(g.width);
  };
  const double capacity =
      static_cast<double>(kBandBytesPerBlock / sizeof(opmath_t) / pixel_words);
  if (band_pixels(0) > capacity) {
    return std::nullopt;
  }
  int64_t margin = 0;
  while (margin < kBandMarginRows && band_pixels(margin + 1) <= capacity) {
    ++margin;
  }
  const int64_t strips = (g.out_pixels() + t.items_per_block - 1) / t.items_per_block;
  return BandShape{t.items / g.out_pixels() * strips, strips, reach_above + margin,
                   reach_below + margin, static_cast<int64_t>(band_pixels(margin)),
                   pixel_words};
}

// The backward with the input gradient summed in bands of shared memory (Note [Input gradient
// in a band of shared memory]). A tile is a strip of an image's output pixels and a group,
// numbered (n * strips + strip) * G + group; the block's slot s takes the strip's pixel s.
template <typename scalar_t, int kVector, typename Divisor>
__global__ void dcnv3_backward_banded_kernel(Dcnv3Geometry g, Dcnv3Divisors<Divisor> d,
                                             Dcnv3Fields f, LaneTiling t, GradientBands<Divisor> b,
                                             const scalar_t* grad_output, const scalar_t* input,
                                             const scalar_t* offset, const scalar_t* mask,
                                             opmath_type<scalar_t>* grad_input,
                                             scalar_t* grad_offset, scalar_t* grad_mask) {
  using opmath_t = opmath_type<scalar_t>;
  using index_t = typename Dcnv3Divisors<Divisor>::index_type;
  __shared__ SharedSample<opmath_t> staged[kStagedSamples<opmath_t>];
  __shared__ opmath_t band[kBandBytesPerBlock / sizeof(opmath_t)];
  const int slot = threadIdx.x / t.lanes;
  const int lane = threadIdx.x % t.lanes;
  SharedSample<opmath_t>* const samples = staged + slot * t.samples_per_round;
  const index_t pixel_stride = static_cast<index_t>(g.channels());
  const index_t pixel_steps[4] = {0, 1, static_cast<index_t>(g.width),
                                  static_cast<index_t>(g.width + 1)};
  // Bands start clear, and each strip clears what it used.
  for (int64_t word = threadIdx.x; word < b.pixels * b.pixel_words; word += blockDim.x) {
    band[word] = opmath_t(0);
  }
  __syncthreads();
  for (int64_t tile = blockIdx.x; tile < b.tiles; tile += gridDim.x) {
    int64_t group, strip;
    const int64_t image_strip = divide(tile, d.groups, group);  // n * strips + strip
    const int64_t n = divide(image_strip, b.strips, strip);
    const int64_t first_pixel = strip * t.items_per_block;  // of the image's output pixels
    const int64_t last_pixel = std::min<int64_t>(first_pixel + t.items_per_block,
                                                 g.out_pixels()) - 1;
    // The band: whole input rows, clipped to the image.
    int64_t column, first_row, last_row, unused;
    dcnv3_centre_tap(g, divide(first_pixel, d.out_width, column), 0, first_row, unused);
    dcnv3_centre_tap(g, divide(last_pixel, d.out_width, column), 0, last_row, unused);
    first_row = std::max<int64_t>(0, first_row - b.rows_above);
    last_row = std::min<int64_t>(g.height - 1, last_row + b.rows_below);
    const index_t band_first = static_cast<index_t>(first_row * g.width);
    // Never more than the band holds, though band_shape sizes it for every strip: a corner
    // past it adds to global memory.
    const index_t band_pixels = static_cast<index_t>(
        std::max<int64_t>(0, std::min((last_row - first_row + 1) * g.width, b.pixels)));
    const index_t image_first = static_cast<index_t>(n * g.in_pixels());
    const index_t group_channel = static_cast<index_t>(group * g.group_channels);

    const int64_t pixel = first_pixel + slot;
    const bool active_item = pixel < g.out_pixels();
    Dcnv3Item it{};
    if (active_item) {
      it.n = n;
      it.ho = divide(pixel, d.out_width, it.wo);
      it.pixel = n * g.out_pixels() + pixel;
      it.group = group;
    }
    const auto add_input_gradient = [&](const SharedSample<opmath_t>& sample, int64_t /*point*/,
                                        int corner, index_t vector, index_t at,
                                        const opmath_t* weighted) {
      const index_t in_band = static_cast<index_t>(sample.top_left) + pixel_steps[corner] -
                              band_first;
      if (in_band >= 0 && in_band < band_pixels) {
        opmath_t* sums = band + in_band * b.pixel_words + vector * kVector;
        for (int e = 0; e < kVector; ++e) {
          scatter_add(sums + e, weighted[e]);
        }
      } else {
        scatter_add_run<kVector>(grad_input + at, weighted);
      }
    };
    backward_item<scalar_t, kVector>(g, d, f, t, lane, active_item,
                                     it.pixel * g.groups + group, it, samples, grad_output,
                                     input, offset, mask, true, grad_offset, grad_mask,
                                     add_input_gradient);
    __syncthreads();
    // The band into global memory, a slot a pixel, its lanes the vectors as an item's.
    for (index_t in_band = slot; in_band < band_pixels; in_band += t.items_per_block) {
      for (int64_t pass = 0; pass < t.passes; ++pass) {
        const index_t vector = static_cast<index_t>(pass * t.lanes + lane);
        if (vector >= t.vectors) {
          continue;
        }
        opmath_t* sums = band + in_band * b.pixel_words + vector * kVector;
        opmath_t values[kVector];
        bool any = false;
        for (int e = 0; e < kVector; ++e) {
          values[e] = sums[e];
          sums[e] = opmath_t(0);
          any = any || values[e] != opmath_t(0);
        }
        if (any) {
          scatter_add_run<kVector>(
              grad_input + ((image_first + band_first + in_band) * pixel_stride + group_channel +
                            vector * kVector),
              values);
        }
      }
    }
    __syncthreads();
  }
}

// The forward's channel vectors: 16 bytes of the op's dtype.
template <typename scalar_t>
constexpr int kForwardVector = 16 / sizeof(scalar_t);

// The backward's: 16 bytes of its input gradient's sums (opmath_type), which take a vector
// in one atomic add (scatter_add_run). In half precision a lane then loads 8 bytes of the
// output's gradient and of the input, and the lanes of an item add to one contiguous run of
// sums; with 16-byte loads, each lane's 8 channels would be two atomics a sector apart, every
// 32-byte sector of the run taking two half-sector atomics.
template <typename scalar_t>
constexpr int kBackwardVector = 16 / sizeof(opmath_type<scalar_t>);

// Calls launch(divisors) with the launch's Dcnv3Divisors: InvariantDivisor and 32-bit element
// indices when every dividend (an item, a pixel, a row, a kernel tap) and every index of the
// input's and the output's elements that the kernels form is at most
// DEFORMCONV_NARROW_INDEX_LIMIT, int64_t otherwise. The kernels form the indices of a cell's
// corners outside the image too (never reading them): past the batch's last pixel, up to a
// row and a pixel of elements further.
template <typename Launch>
void with_divisors(const Dcnv3Geometry& g, int64_t batch, const LaneTiling& t,
                   Launch&& launch) {
  const int64_t input_indices = (batch * g.in_pixels() + g.width + 1) * g.channels();
  const int64_t output_indices = t.items * g.group_channels;
  if (std::max({t.items, g.kernel_h * g.kernel_w, input_indices, output_indices}) <=
      DEFORMCONV_NARROW_INDEX_LIMIT) {
    record_branch("dcnv3.cuda.index.32bit");
    launch(Dcnv3Divisors<InvariantDivisor>(g));
  } else {
    record_branch("dcnv3.cuda.index.64bit");
    launch(Dcnv3Divisors<int64_t>(g));
  }
}

void dcnv3_forward_cuda(const Dcnv3Geometry& g, const Dcnv3Fields& f, int64_t batch,
                        const Tensor& input, const Tensor& offset, const Tensor& mask,
                        Tensor& output) {
  DEFORMCONV_DISPATCH(input.scalar_type(), "dcnv3_forward_cuda", [&] {
    with_channel_vectors<kForwardVector<scalar_t>>(
        batch * g.out_pixels() * g.groups, g.group_channels, g.group_channels, g.points(),
        kStagedSamples<opmath_type<scalar_t>>, {&input, &output}, kDcnv3Paths,
        [&](auto width, auto t) {
      with_divisors(g, batch, t, [&](auto d) {
        auto* kernel = dcnv3_forward_kernel<scalar_t, decltype(width)::value,
                                            typename decltype(d)::divisor_type>;
        DEFORMCONV_LAUNCH(kernel, blocks_of(t), kThreadsPerBlock,
                          current_cuda_stream())(
            g, d, f, t, input.const_data_ptr<scalar_t>(), offset.const_data_ptr<scalar_t>(),
            mask.const_data_ptr<scalar_t>(), output.mutable_data_ptr<scalar_t>());
        DEFORMCONV_CHECK_LAUNCH();
      });
    });
  });
}

// The input gradient and the offset and mask gradients, those asked for, in one kernel.
void dcnv3_gradients_cuda(const Dcnv3Geometry& g, const Dcnv3Fields& f, int64_t batch,
                          const Tensor& grad_output, const Tensor& input, const Tensor& offset,
                          const Tensor& mask, Tensor& grad_input, Tensor& grad_offset,
                          Tensor& grad_mask, bool deterministic) {
  const bool gathered = grad_input.defined() && deterministic;
  if (gathered &&
      gather_in_image_chunks(
          batch, g.out_pixels() * g.groups * g.points(), g.in_pixels() * g.groups,
          grad_output.scalar_type(),
          "dcnv3.cuda.backward.input_gradient.image_chunks", [&](int64_t first, int64_t count) {
            Tensor grad_input_chunk = narrow_images(grad_input, first, count);
            Tensor grad_offset_chunk = narrow_images(grad_offset, first, count);
            Tensor grad_mask_chunk = narrow_images(grad_mask, first, count);
            dcnv3_gradients_cuda(g, f, count, narrow_images(grad_output, first, count),
                                 narrow_images(input, first, count),
                                 narrow_images(offset, first, count),
                                 narrow_images(mask, first, count), grad_input_chunk,
                                 grad_offset_chunk, grad_mask_chunk, true);
          })) {
    return;
  }
  if (grad_input.defined()) {
    record_branch("dcnv3.cuda.backward.input_gradient");
    record_branch(gathered ? "dcnv3.cuda.backward.input_gradient.gathered"
                           : "dcnv3.cuda.backward.input_gradient.atomic_adds");
  }
  if (grad_offset.defined() || grad_mask.defined()) {
    record_branch("dcnv3.cuda.backward.offset_mask_gradients");
  }
  DEFORMCONV_DISPATCH(grad_output.scalar_type(), "dcnv3_backward_cuda", [&] {
    using opmath_t = opmath_type<scalar_t>;
    // Note [Input gradient sums in float32]
    Tensor sums;
    if (grad_input.defined()) {
      sums = uninitialised_input_gradient_sums<scalar_t>(grad_input);
      torch::stable::zero_(sums);
    }
    // The sums too: vectors of them are added in one atomic (scatter_add_run).
    const Tensor& sums_or_input = sums.defined() ? sums : input;
    with_channel_vectors<kBackwardVector<scalar_t>>(
        batch * g.out_pixels() * g.groups, g.group_channels, g.group_channels, g.points(),
        kStagedSamples<opmath_t>,
        {&grad_output, &input, &sums_or_input}, kDcnv3Paths, [&](auto width, auto t) {
      constexpr int kVector = decltype(width)::value;
      const std::optional<BandShape> bands =
          sums.defined() && !gathered && input_gradient_bands_allowed() ? band_shape<opmath_t>(g, t)
                                                                        : std::nullopt;
      if (bands) {
        record_branch("dcnv3.cuda.backward.input_gradient_in_shared_memory");
      }
      with_divisors(g, batch, t, [&](auto d) {
        using Divisor = typename decltype(d)::divisor_type;
        const scalar_t* const grad_output_data = grad_output.const_data_ptr<scalar_t>();
        const scalar_t* const input_data = input.const_data_ptr<scalar_t>();
        const scalar_t* const offset_data = offset.const_data_ptr<scalar_t>();
        const scalar_t* const mask_data = mask.const_data_ptr<scalar_t>();
        opmath_t* const sums_data = sums.defined() ? sums.mutable_data_ptr<opmath_t>() : nullptr;
        if (bands) {
          auto* kernel = dcnv3_backward_banded_kernel<scalar_t, kVector, Divisor>;
          DEFORMCONV_LAUNCH(kernel, std::min(kMaxBlocks, bands->tiles), kThreadsPerBlock,
                            current_cuda_stream())(
              g, d, f, t, GradientBands<Divisor>(*bands), grad_output_data, input_data,
              offset_data, mask_data, sums_data, mutable_data_or_null<scalar_t>(grad_offset),
              mutable_data_or_null<scalar_t>(grad_mask));
          DEFORMCONV_CHECK_LAUNCH();
        } else {
          // Rows of the map: (image, input pixel, group), of the group's channels.
          std::optional<GatheredInputGradient<scalar_t>> gather;
          if (gathered) {
            gather.emplace(grad_output, t.items * g.points(), batch * g.in_pixels() * g.groups,
                           g.group_channels);
          }
          auto* kernel = gathered ? dcnv3_backward_kernel<scalar_t, kVector, Divisor, true>
                                  : dcnv3_backward_kernel<scalar_t, kVector, Divisor, false>;
          DEFORMCONV_LAUNCH(kernel, blocks_of(t), kThreadsPerBlock, current_cuda_stream())(
              g, d, f, t, grad_output_data, input_data, offset_data, mask_data,
              gathered ? nullptr : sums_data,
              gather ? gather->entries() : CornerEntries<opmath_t>{},
              mutable_data_or_null<scalar_t>(grad_offset),
              mutable_data_or_null<scalar_t>(grad_mask));
          DEFORMCONV_CHECK_LAUNCH();
          if (gather) {
            gather->add_to(sums);
          }
        }
      });
    });
    if (grad_input.defined()) {
      store_input_gradient_sums(sums, grad_input);
    }
  });
}

const Dcnv3Launchers& dcnv3_cuda_launchers() {
  static const Dcnv3Launchers launchers{
      .forward = dcnv3_forward_cuda,
      .gradients = dcnv3_gradients_cuda,
  };
  return launchers;
}

}  // namespace

// The kernels at the CUDA key: the drivers with these launchers. The test suite's emulation
// build, which compiles this file as C++, registers them under its own namespace.
#if !defined(DEFORMCONV_CUDA_EMULATION)
STABLE_TORCH_LIBRARY_IMPL(deformconv, CUDA, m) {
  register_device_kernels<Dcnv3Op, CudaDevice, dcnv3_forward, dcnv3_backward, dcnv3_cuda_launchers>(
      m);
  register_device_kernels<Dcnv4Op, CudaDevice, dcnv4_forward, dcnv4_backward, dcnv3_cuda_launchers>(
      m);
}
#endif

}  // namespace deformconv
