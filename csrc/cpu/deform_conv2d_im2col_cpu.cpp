// The CPU's window preparation (the sampling plans that col2im reads) and im2col of DCN v1/v2.

#if !defined(DEFORMCONV_CPU_COPY)  // the head (Note [CPU copies], cpu_copies.h)


#include <cstdint>
#include <vector>

#include "../core/deform_conv2d_launchers.h"
#include "deform_conv2d_window_tasks.h"

#define DEFORMCONV_CPU_COPY_BODY "deform_conv2d_im2col_cpu.cpp"
#include "cpu_copies.h"

#else  // the body, once per copy

#include "deform_conv2d_stages.h"

namespace deformconv::DEFORMCONV_CPU_COPY {
namespace {

// Tasks [begin, end) of the window's plans, task = a stretch of one image's window pixels.
template <typename scalar_t>
void make_plans_tasks(const DeformConv2dGeometry& g,
                                               const PixelWindow& window,
                                               const PixelStretches& stretches,
                                               const scalar_t* offset, const scalar_t* mask,
                                               SamplingPlan<opmath_type<scalar_t>>* plans,
                                               int64_t begin, int64_t end) {
  const int64_t plans_per_pixel = g.offset_groups * g.taps();
  StretchSamples<opmath_type<scalar_t>> samples(g, stretches.pixels);
  for (int64_t task = begin; task < end; ++task) {
    const auto [n, first_pixel, pixels] = stretch_of(window, stretches, task);
    auto* task_plans = plans + (n * window.pixels + first_pixel) * plans_per_pixel;
    samples.start(g, window.begin + first_pixel, pixels);
    for (int64_t group = 0; group < g.offset_groups; ++group) {
      for (int64_t tap = 0; tap < g.taps(); ++tap) {
        samples.locate(g, n, group, tap, offset, mask);
        for (int64_t i = 0; i < pixels; ++i) {
          task_plans[i * plans_per_pixel + group * g.taps() + tap] = samples.plan(i);
        }
      }
    }
  }
}

}  // namespace

void make_plans_cpu(const DeformConv2dGeometry& g, const PixelWindow& window, int64_t batch,
                    const Tensor& offset, const Tensor& mask, Tensor& plans) {
  const int64_t plans_per_pixel = g.offset_groups * g.taps();
  const PixelStretches stretches = pixel_stretches(g, window);
  DEFORMCONV_DISPATCH(offset.scalar_type(), "deform_conv2d_plans_cpu", [&] {
    using Plan = SamplingPlan<opmath_type<scalar_t>>;
    STD_TORCH_CHECK(
        plans.numel() >= batch * window.pixels * plans_per_pixel * int64_t(sizeof(Plan)),
        "make_plans_cpu: a workspace too small for the window's plans");
    Plan* plan_data = reinterpret_cast<Plan*>(plans.mutable_data_ptr());
    const scalar_t* offset_data = offset.const_data_ptr<scalar_t>();
    const scalar_t* mask_data = data_or_null<scalar_t>(mask);
    parallel_tasks(batch * stretches.per_image, [&](int64_t begin, int64_t end) {
      make_plans_tasks(g, window, stretches, offset_data, mask_data, plan_data, begin, end);
    });
  });
}
namespace {

template <typename scalar_t>
struct Im2colTask {
  const DeformConv2dGeometry& g;
  PixelWindow window;
  const std::vector<std::vector<ChannelRun>>& runs;
  PixelStretches stretches;
  const scalar_t* offset;
  const scalar_t* mask;
  const scalar_t* input;
  scalar_t* columns;
};

// Tasks [begin, end) of im2col, task = a stretch of one image's window pixels, walked along
// (deform group, tap) rows: every columns entry is written by exactly one task. Each row's
// samples are located at once; a corner that takes no part reads a row of zeros
// (sum_corner_rows).
template <typename scalar_t>
void im2col_tasks(const Im2colTask<scalar_t>& t, int64_t begin,
                                           int64_t end) {
  using opmath_t = opmath_type<scalar_t>;
  const DeformConv2dGeometry& g = t.g;
  // A row of zeros as long as a grid pixel's channels, so that a run's channels of it are
  // where they are in the image.
  const std::vector<scalar_t> zeros(g.in_channels, scalar_t(0));
  StretchSamples<opmath_t> samples(g, t.stretches.pixels);
  for (int64_t task = begin; task < end; ++task) {
    const auto [n, first_pixel, pixels] = stretch_of(t.window, t.stretches, task);
    const scalar_t* image = channel_of(g, t.input, n, 0);
    samples.start(g, t.window.begin + first_pixel, pixels);
    for (int64_t group = 0; group < g.offset_groups; ++group) {
      for (int64_t tap = 0; tap < g.taps(); ++tap) {
        samples.locate(g, n, group, tap, t.offset, t.mask);
        for (int64_t i = 0; i < pixels; ++i) {
          opmath_t weight[4];
          const scalar_t* corner_pixel[4];
          samples.corner_rows(i, image, g.in_channels, zeros.data(), weight, corner_pixel);
          const int64_t entries = columns_at(g, t.window, n, first_pixel + i, tap);
          for (const ChannelRun& run : t.runs[group]) {
            const scalar_t* rows[4];
            for (int corner = 0; corner < 4; ++corner) {
              rows[corner] = corner_pixel[corner] + run.first;
            }
            sum_corner_rows(rows, weight, run.count, t.columns + run.column_offset + entries);
          }
        }
      }
    }
  }
}

}  // namespace

void im2col_cpu(const DeformConv2dGeometry& g, const PixelWindow& window, int64_t batch,
                const Tensor& input, const WindowSampling& sampling, Tensor& columns) {
  const auto runs = runs_of_offset_groups(g, window);
  const PixelStretches stretches = pixel_stretches(g, window);
  DEFORMCONV_DISPATCH(input.scalar_type(), "deform_conv2d_im2col_cpu", [&] {
    const Im2colTask<scalar_t> t{g,
                                 window,
                                 runs,
                                 stretches,
                                 sampling.offset.const_data_ptr<scalar_t>(),
                                 data_or_null<scalar_t>(sampling.mask),
                                 input.const_data_ptr<scalar_t>(),
                                 columns.mutable_data_ptr<scalar_t>()};
    parallel_tasks(batch * stretches.per_image,
                   [&](int64_t begin, int64_t end) { im2col_tasks(t, begin, end); });
  });
}

}  // namespace deformconv::DEFORMCONV_CPU_COPY

#endif
