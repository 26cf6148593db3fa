#pragma once

// DCNv3's backward kernel that sums the input gradient in bands of shared memory, and the
// launcher's sizing of the bands (dcnv3_cuda.cu launches it).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>

#include "../common/bilinear_sampling.cuh"
#include "../common/dcnv3_kernel.cuh"
#include "channel_vectors.cuh"
#include "dcnv3_items.cuh"

namespace deformconv {

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

}  // namespace deformconv
