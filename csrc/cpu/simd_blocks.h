#pragma once

// The register-blocked micro-kernels of the fused forward: the products of a tap's sampled
// values with its weights into the pixels' output sums, an 8 x 8 transpose in registers, and
// the store of a task's sums into the output's channel planes (Note [Fused forward] in
// deform_conv2d_fused_forward_cpu.cpp).


#include <algorithm>
#include <cstdint>

#include "../common/scalar_types.h"
#include "cpu_loops.h"
#include "vector_shuffle.h"

namespace deformconv {

// Pixels whose output sums share each load of a weight row, with two vectors of sums per pixel.
// AVX2 (16 registers of 32 bytes): 6 pixels, 12 sums, which leaves the two weight vectors and
// the broadcast value their registers. Each sum takes one multiply-add per input channel, and
// a multiply-add's result is ready 4 or 5 cycles after it issues, 2 issuing per cycle: 8 sums
// (4 pixels) left the multiply-add units idle between them on Zen cores. AVX-512 (32
// registers of 64 bytes): 8 pixels, 16 sums; with more pixels GCC spilled.
template <int kVectorBytes>
constexpr int64_t kFusedPixels = kVectorBytes == 32 ? 6 : kVectorBytes / 8;

// Note [Weight panels]
// The fused forward's weight, for each (conv group, tap), is a (count = C_in / G) x
// (out_per_group = C_out / G) matrix, cut by output channels into panels: two vectors wide
// (2 * kWidth channels) while they fit, then one vector wide if one fits, then the rest. A
// panel of width w whose first channel is j0 is stored whole, row after row: element (c, j) at
// j0 * count + c * w + (j - j0). The multiply-adds of a panel then read one contiguous stream,
// which the hardware prefetchers follow, where rows of the whole matrix lay out_per_group
// apart (a 512-channel layer's weight stalled every load on the next row).
template <int kVectorBytes, typename opmath_t>
DEFORMCONV_INLINE int64_t weight_panel_width(int64_t first, int64_t out_per_group) {
  constexpr int64_t kWidth = kVectorBytes / sizeof(opmath_t);
  const int64_t rest = out_per_group - first;
  return rest >= 2 * kWidth ? 2 * kWidth : rest >= kWidth ? kWidth : rest;
}

// Input channels a panel of two vectors is multiplied over before the next block of pixels
// takes it: 16 KiB of the panel, which stays in the L1 cache (32 or 48 KiB) for every block of
// a run beside the blocks' values.
template <int kVectorBytes>
constexpr int64_t kPanelPassChannels = 16384 / (2 * kVectorBytes);

// sums[p * sums_stride + j] += sum over c < count of values[p * values_stride + c] * (the
// weight of (c, j) in `panels`, Note [Weight panels]), for pixels p < blocks * kFusedPixels and
// j < out_per_group: the products of one tap's values of a conv group with its weights, for a
// run of blocks of pixels. A vector-wide panel's sums of a block are held in registers over
// the channels, kPanelPassChannels at a time, the blocks in the inner loop; the last panel's
// sums (fewer channels than a vector) one by one. Each sum takes its products in the order of
// c, whatever the blocking.
template <int kVectorBytes, typename opmath_t>
DEFORMCONV_INLINE void multiply_add_blocks(const opmath_t* __restrict values,
                                           int64_t values_stride, int64_t blocks, int64_t count,
                                           const opmath_t* __restrict panels,
                                           int64_t out_per_group, opmath_t* __restrict sums,
                                           int64_t sums_stride) {
  typedef opmath_t Vector __attribute__((vector_size(kVectorBytes)));
  // The same vector at any address of an opmath_t, which may alias it (as the intrinsics'
  // unaligned loads are declared): loads and stores through it are plain vector moves, where
  // a memcpy into an array of vectors made GCC keep the array on the stack.
  typedef opmath_t Unaligned
      __attribute__((vector_size(kVectorBytes), aligned(alignof(opmath_t)), may_alias));
  constexpr int64_t kWidth = kVectorBytes / sizeof(opmath_t);
  constexpr int64_t kPixels = kFusedPixels<kVectorBytes>;
  constexpr int64_t kPass = kPanelPassChannels<kVectorBytes>;
  const auto at = [](opmath_t* data) { return reinterpret_cast<Unaligned*>(data); };
  const auto at_const = [](const opmath_t* data) {
    return reinterpret_cast<const Unaligned*>(data);
  };
  // The panels as weight_panel_width cuts them, which is how the weight was laid out.
  for (int64_t j = 0; j < out_per_group;) {
    const int64_t width = weight_panel_width<kVectorBytes, opmath_t>(j, out_per_group);
    const opmath_t* panel = panels + j * count;
    if (width == 2 * kWidth) {
      for (int64_t pass = 0; pass < count; pass += kPass) {
        const int64_t pass_end = std::min(count, pass + kPass);
        for (int64_t block = 0; block < blocks; ++block) {
          const opmath_t* block_values = values + block * kPixels * values_stride;
          opmath_t* block_sums = sums + block * kPixels * sums_stride + j;
          Vector low[kPixels], high[kPixels];
          for (int64_t p = 0; p < kPixels; ++p) {
            low[p] = *at(block_sums + p * sums_stride);
            high[p] = *at(block_sums + p * sums_stride + kWidth);
          }
          for (int64_t c = pass; c < pass_end; ++c) {
            const Vector weight_low = *at_const(panel + c * 2 * kWidth);
            const Vector weight_high = *at_const(panel + c * 2 * kWidth + kWidth);
            for (int64_t p = 0; p < kPixels; ++p) {
              const opmath_t value = block_values[p * values_stride + c];
              low[p] += value * weight_low;
              high[p] += value * weight_high;
            }
          }
          for (int64_t p = 0; p < kPixels; ++p) {
            *at(block_sums + p * sums_stride) = low[p];
            *at(block_sums + p * sums_stride + kWidth) = high[p];
          }
        }
      }
    } else if (width == kWidth) {
      for (int64_t block = 0; block < blocks; ++block) {
        const opmath_t* block_values = values + block * kPixels * values_stride;
        opmath_t* block_sums = sums + block * kPixels * sums_stride + j;
        Vector lanes[kPixels];
        for (int64_t p = 0; p < kPixels; ++p) {
          lanes[p] = *at(block_sums + p * sums_stride);
        }
        for (int64_t c = 0; c < count; ++c) {
          const Vector weight = *at_const(panel + c * kWidth);
          for (int64_t p = 0; p < kPixels; ++p) {
            lanes[p] += block_values[p * values_stride + c] * weight;
          }
        }
        for (int64_t p = 0; p < kPixels; ++p) {
          *at(block_sums + p * sums_stride) = lanes[p];
        }
      }
    } else {
      for (int64_t p = 0; p < blocks * kPixels; ++p) {
        for (int64_t i = 0; i < width; ++i) {
          opmath_t sum = sums[p * sums_stride + j + i];
          for (int64_t c = 0; c < count; ++c) {
            sum += values[p * values_stride + c] * panel[c * width + i];
          }
          sums[p * sums_stride + j + i] = sum;
        }
      }
    }
    j += width;
  }
}

// The 8 x 8 block of rows[i][j] as columns: columns[j][i] = rows[i][j], in three rounds of
// shuffles that interleave ever larger pieces of pairs of rows.
template <typename Eight>
DEFORMCONV_INLINE void transpose_eight(const Eight rows[8], Eight columns[8]) {
  Eight pairs[8], quads[8];
  for (int i = 0; i < 8; i += 2) {
    pairs[i] = shuffle<0, 8, 1, 9, 4, 12, 5, 13>(rows[i], rows[i + 1]);
    pairs[i + 1] = shuffle<2, 10, 3, 11, 6, 14, 7, 15>(rows[i], rows[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    for (int second = 0; second < 2; ++second) {
      const Eight& a = pairs[i + second];
      const Eight& b = pairs[i + second + 2];
      quads[i + 2 * second] = shuffle<0, 1, 8, 9, 4, 5, 12, 13>(a, b);
      quads[i + 2 * second + 1] = shuffle<2, 3, 10, 11, 6, 7, 14, 15>(a, b);
    }
  }
  for (int j = 0; j < 4; ++j) {
    columns[j] = shuffle<0, 1, 2, 3, 8, 9, 10, 11>(quads[j], quads[j + 4]);
    columns[j + 4] = shuffle<4, 5, 6, 7, 12, 13, 14, 15>(quads[j], quads[j + 4]);
  }
}

// output[c * output_stride + p] = sums[p * channels + c] + bias[c] (bias null: none), for
// p < pixels and c < channels: a task's sums into the output's channel planes. In float, blocks
// of 8 x 8 are transposed in registers; the rest goes one by one.
template <typename scalar_t, typename opmath_t>
DEFORMCONV_INLINE void store_sums(const opmath_t* sums, int64_t pixels, int64_t channels,
                                  const scalar_t* bias, scalar_t* output,
                                  int64_t output_stride) {
  const auto bias_of = [&](int64_t c) {
    return bias != nullptr ? static_cast<opmath_t>(bias[c]) : opmath_t(0);
  };
  int64_t transposed = 0;
  if constexpr (std::is_same_v<scalar_t, float> && std::is_same_v<opmath_t, float>) {
    typedef float Eight __attribute__((vector_size(8 * sizeof(float))));
    typedef float Unaligned
        __attribute__((vector_size(8 * sizeof(float)), aligned(alignof(float)), may_alias));
    for (; transposed + 8 <= pixels; transposed += 8) {
      const int64_t p = transposed;
      int64_t c = 0;
      for (; c + 8 <= channels; c += 8) {
        Eight rows[8], columns[8];
        for (int i = 0; i < 8; ++i) {
          rows[i] = *reinterpret_cast<const Unaligned*>(sums + (p + i) * channels + c);
        }
        transpose_eight(rows, columns);
        for (int j = 0; j < 8; ++j) {
          *reinterpret_cast<Unaligned*>(output + (c + j) * output_stride + p) =
              columns[j] + bias_of(c + j);
        }
      }
      for (; c < channels; ++c) {
        for (int64_t i = p; i < p + 8; ++i) {
          output[c * output_stride + i] = sums[i * channels + c] + bias_of(c);
        }
      }
    }
  }
  for (int64_t c = 0; c < channels; ++c) {
    for (int64_t p = transposed; p < pixels; ++p) {
      output[c * output_stride + p] = static_cast<scalar_t>(sums[p * channels + c] + bias_of(c));
    }
  }
}

}  // namespace deformconv
