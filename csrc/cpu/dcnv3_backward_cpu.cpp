// The gradients of DCNv3 and DCNv4 on the CPU: the input gradient scattered into each image's
// own float32 sums, and the offset and mask gradients from the corner dot products.

#if !defined(DEFORMCONV_CPU_COPY)  // the head (Note [CPU copies], cpu_copies.h)


#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../core/dcnv3.h"
#include "../infrastructure/dtype_dispatch.h"
#include "../infrastructure/input_gradient_sums.h"
#include "../infrastructure/optional_data.h"
#include "dcnv3_samples.h"
#include "sample_gradients.h"

#define DEFORMCONV_CPU_COPY_BODY "dcnv3_backward_cpu.cpp"
#include "cpu_copies.h"

#else  // the body, once per copy

#include "dcnv3_stages.h"

namespace deformconv::DEFORMCONV_CPU_COPY {
namespace {

// One sample's share of the gradients, over the D channels of its group, from the sampled
// values' gradients `grad` (in the accumulation type, zero-filled to whole lanes), its corners'
// rows at the offsets `corners` of `image` and of its gradient `grad_image`: with kDots, the dot
// products of `grad` with the four corner rows (corner_dot_products), for offset_mask_grad_sums
// (which discards those of the corners outside); with kScatter, weight[corner] * grad added onto each corner's gradient row
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
  // Read once, before the scatter's stores: the compiler cannot tell that those stores leave
  // the offsets as they were, and would read them again after each.
  const int64_t offset[4] = {corners[0], corners[1], corners[2], corners[3]};
  if constexpr (kDots) {
    const scalar_t* const rows[4] = {image + offset[0], image + offset[1], image + offset[2],
                                     image + offset[3]};
    corner_dot_products(grad, D, rows, dots);
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
void dcnv3_gradient_pixels(
    const Dcnv3Geometry& g, const Dcnv3Fields& f, const scalar_t* grad_output,
    const scalar_t* input, const scalar_t* offset, const scalar_t* mask,
    opmath_type<scalar_t>* grad_input, scalar_t* grad_offset, scalar_t* grad_mask,
    TaskRuns& runs, int64_t pixels_per_task) {
  using opmath_t = opmath_type<scalar_t>;
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

}  // namespace

// The gradients asked for. The input gradient is made by tasks of whole images, each owning
// its image's gradient, so that each element's sum is made in the same order whatever the
// threads. One pass over the images makes all the gradients, cheaper than two passes as it
// locates each pixel's samples once for both; but it keeps at most `batch` threads busy. So
// with at most half as many images as threads, the offset and mask gradients are made apart,
// in tasks of pixels that all the threads share, and the pass by images is only the input
// gradient's scatter.
void dcnv3_gradients_cpu(const Dcnv3Geometry& g, const Dcnv3Fields& f, int64_t batch,
                         const Tensor& grad_output, const Tensor& input, const Tensor& offset,
                         const Tensor& mask, Tensor& grad_input, Tensor& grad_offset,
                         Tensor& grad_mask, bool /*deterministic: always*/) {
  const bool want_input = grad_input.defined();
  const bool want_offset_or_mask = grad_offset.defined() || grad_mask.defined();
  DEFORMCONV_DISPATCH(input.scalar_type(), "dcnv3_gradients_cpu", [&] {
    using opmath_t = opmath_type<scalar_t>;
    // Note [Input gradient sums in float32]
    Tensor sums = want_input ? uninitialised_input_gradient_sums<scalar_t>(grad_input) : Tensor();
    const scalar_t* grad_output_data = grad_output.const_data_ptr<scalar_t>();
    const scalar_t* input_data = input.const_data_ptr<scalar_t>();
    const scalar_t* offset_data = offset.const_data_ptr<scalar_t>();
    const scalar_t* mask_data = mask.const_data_ptr<scalar_t>();
    opmath_t* sums_data = mutable_data_or_null<opmath_t>(sums);
    scalar_t* grad_offset_data = mutable_data_or_null<scalar_t>(grad_offset);
    scalar_t* grad_mask_data = mutable_data_or_null<scalar_t>(grad_mask);
    // The scatter's vectors as wide as a register of the copy that runs.
    with_register_bytes<kRegisterBytes>([&](auto register_bytes) {
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
        if (want_input && want_offset_or_mask && 2 * batch > thread_count()) {
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

}  // namespace deformconv::DEFORMCONV_CPU_COPY

#endif
