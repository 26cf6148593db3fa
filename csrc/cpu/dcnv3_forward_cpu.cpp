// The forward of DCNv3 and DCNv4 on the CPU: each pixel's samples located once, each group's
// channels summed over its points in vectors of the copy's register width.

#if !defined(DEFORMCONV_CPU_COPY)  // the head (Note [CPU copies], cpu_copies.h)


#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../core/dcnv3.h"
#include "../infrastructure/dtype_dispatch.h"
#include "dcnv3_samples.h"

#define DEFORMCONV_CPU_COPY_BODY "dcnv3_forward_cpu.cpp"
#include "cpu_copies.h"

#else  // the body, once per copy

#include "dcnv3_stages.h"

namespace deformconv::DEFORMCONV_CPU_COPY {
namespace {

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
// copy's registers (kVectorBytes), the sum over the points stays in registers.
template <int kVectorBytes, int64_t kGroupChannels, typename scalar_t>
void dcnv3_forward_pixels(const Dcnv3Geometry& g, const Dcnv3Fields& f,
                                                   const scalar_t* input, const scalar_t* offset,
                                                   const scalar_t* mask, scalar_t* output,
                                                   TaskRuns& runs) {
  using opmath_t = opmath_type<scalar_t>;
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

}  // namespace

void dcnv3_forward_cpu(const Dcnv3Geometry& g, const Dcnv3Fields& f, int64_t batch,
                       const Tensor& input, const Tensor& offset, const Tensor& mask,
                       Tensor& output) {
  DEFORMCONV_DISPATCH(input.scalar_type(), "dcnv3_forward_cpu", [&] {
    const scalar_t* input_data = input.const_data_ptr<scalar_t>();
    const scalar_t* offset_data = offset.const_data_ptr<scalar_t>();
    const scalar_t* mask_data = mask.const_data_ptr<scalar_t>();
    scalar_t* output_data = output.mutable_data_ptr<scalar_t>();
    // Vectors as wide as a register of the copy that runs.
    with_register_bytes<kRegisterBytes>([&](auto register_bytes) {
      constexpr int64_t kWidth = register_bytes / sizeof(opmath_type<scalar_t>);
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

}  // namespace deformconv::DEFORMCONV_CPU_COPY

#endif
