// The backward stages of DCN v1/v2 on the CPU that read the columns gradient: col2im (the
// input gradient, from the window's sampling plans) and the offset and mask gradients.

#if !defined(DEFORMCONV_CPU_COPY)  // the head (Note [CPU copies], cpu_copies.h)


#include <algorithm>
#include <cstdint>
#include <vector>

#include "../core/deform_conv2d_launchers.h"
#include "deform_conv2d_window_tasks.h"

#define DEFORMCONV_CPU_COPY_BODY "deform_conv2d_col2im_cpu.cpp"
#include "cpu_copies.h"

#else  // the body, once per copy

#include "deform_conv2d_stages.h"

namespace deformconv::DEFORMCONV_CPU_COPY {
namespace {

template <typename scalar_t>
struct Col2imTask {
  const DeformConv2dGeometry& g;
  PixelWindow window;
  const std::vector<std::vector<ChannelRun>>& runs;
  const SamplingPlan<opmath_type<scalar_t>>* plans;
  const scalar_t* grad_columns;
  opmath_type<scalar_t>* grad_input;  // Note [Input gradient sums in float32]
  int64_t rows_per_band;
  int64_t bands;
};

// Tasks [begin, end) of col2im, task = (image, band of input rows): the task owns the gradient
// of its rows, every channel of them, and adds into it the share of every plan corner that
// falls there (a corner's row is known from its index, a band being a range of indices). No
// two tasks write the same address, so no atomics are needed; each gradient element receives
// its adds in the order (window, pixel, deform group, tap, corner) whatever the bands, so the
// result does not depend on the number of threads.
template <typename scalar_t>
void col2im_tasks(const Col2imTask<scalar_t>& t, int64_t begin,
                                           int64_t end) {
  using opmath_t = opmath_type<scalar_t>;
  const DeformConv2dGeometry& g = t.g;
  for (int64_t task = begin; task < end; ++task) {
    const int64_t n = task / t.bands;
    const int64_t band_begin = task % t.bands * t.rows_per_band * g.in_width;
    const int64_t band_end = std::min(band_begin + t.rows_per_band * g.in_width, g.in_pixels());
    for (int64_t pixel = 0; pixel < t.window.pixels; ++pixel) {
      const auto* plans = plans_of_pixel(g, t.window, t.plans, n, pixel);
      for (int64_t group = 0; group < g.offset_groups; ++group) {
        for (int64_t tap = 0; tap < g.taps(); ++tap) {
          const auto& plan = plans[group * g.taps() + tap];
          const int64_t entries = columns_at(g, t.window, n, pixel, tap);
          for (int corner = 0; corner < 4; ++corner) {
            const int64_t index = plan.index[corner];
            if (plan.weight[corner] == opmath_t(0) || index < band_begin || index >= band_end) {
              continue;
            }
            for (const ChannelRun& run : t.runs[group]) {
              scatter_corner(plan, corner, t.grad_columns + run.column_offset + entries,
                             run.count, channel_of(g, t.grad_input, n, run.first),
                             g.in_channels);
            }
          }
        }
      }
    }
  }
}

void col2im_cpu(const DeformConv2dGeometry& g, const PixelWindow& window, int64_t batch,
                const Tensor& grad_columns, const WindowSampling& sampling, Tensor& grad_input) {
  const auto runs = runs_of_offset_groups(g, window);
  // About two bands per thread over the block's images: every task scans all the plans of its
  // image, so many more bands would multiply that cost.
  const int64_t wanted_bands = (2 * thread_count() + batch - 1) / batch;
  const int64_t rows_per_band = (g.in_height + wanted_bands - 1) / wanted_bands;
  const int64_t bands = (g.in_height + rows_per_band - 1) / rows_per_band;
  DEFORMCONV_DISPATCH(grad_columns.scalar_type(), "deform_conv2d_col2im_cpu", [&] {
    Tensor sums = input_gradient_sums<scalar_t>(grad_input);
    const Col2imTask<scalar_t> t{g,
                                 window,
                                 runs,
                                 plans_of<opmath_type<scalar_t>>(sampling),
                                 grad_columns.const_data_ptr<scalar_t>(),
                                 sums.mutable_data_ptr<opmath_type<scalar_t>>(),
                                 rows_per_band,
                                 bands};
    parallel_tasks(batch * bands,
                   [&](int64_t begin, int64_t end) { col2im_tasks(t, begin, end); });
    store_input_gradient_sums(sums, grad_input);
  });
}

template <typename scalar_t>
struct OffsetMaskGradTask {
  const DeformConv2dGeometry& g;
  PixelWindow window;
  const std::vector<std::vector<ChannelRun>>& runs;
  const scalar_t* grad_columns;
  const scalar_t* input;
  const scalar_t* offset;
  const scalar_t* mask;
  scalar_t* grad_offset;
  scalar_t* grad_mask;
  PixelStretches stretches;
};

// One sample's sums over the channels of its deform group, run by run.
template <typename scalar_t>
DEFORMCONV_INLINE OffsetMaskGradSums<opmath_type<scalar_t>> offset_mask_grad_of_sample(
    const DeformConv2dGeometry& g, int64_t n, int64_t entries,
    const std::vector<ChannelRun>& runs, const OffsetMaskGrad<opmath_type<scalar_t>>& acc,
    const scalar_t* grad_columns, const scalar_t* input) {
  LaneSums<opmath_type<scalar_t>> sums;
  for (const ChannelRun& run : runs) {
    add_channels_to_sums(acc, grad_columns + run.column_offset + entries,
                         channel_of(g, input, n, run.first), g.in_channels, run.count, sums);
  }
  return sums.total();
}

// Tasks [begin, end) of the offset and mask gradients, task = (image, stretch of window
// pixels); each sample is located, summed over its channels and written in one go, and writes
// only its own gradients.
template <typename scalar_t>
void offset_mask_grad_tasks(const OffsetMaskGradTask<scalar_t>& t,
                                                     int64_t begin, int64_t end) {
  using opmath_t = opmath_type<scalar_t>;
  const DeformConv2dGeometry& g = t.g;
  StretchSamples<opmath_t> samples(g, t.stretches.pixels);
  for (int64_t task = begin; task < end; ++task) {
    const auto [n, first_pixel, pixels] = stretch_of(t.window, t.stretches, task);
    samples.start(g, t.window.begin + first_pixel, pixels);
    for (int64_t group = 0; group < g.offset_groups; ++group) {
      for (int64_t tap = 0; tap < g.taps(); ++tap) {
        samples.locate(g, n, group, tap, t.offset, t.mask);
        SampleIndex s = make_sample_index(g, n, group, tap, t.window.begin + first_pixel);
        for (int64_t i = 0; i < pixels; ++i, next_pixel(g, s)) {
          OffsetMaskGrad<opmath_t> acc{samples.cell(i), {}, samples.mask(i)};
          corner_indices(acc.cell, g.in_width, acc.index);
          const int64_t entries = columns_at(g, t.window, n, first_pixel + i, tap);
          const auto sums = acc.cell.inside
              ? offset_mask_grad_of_sample(g, n, entries, t.runs[group], acc, t.grad_columns,
                                           t.input)
              : OffsetMaskGradSums<opmath_t>{};
          finish_offset_mask_grad(g, s, acc.mask, sums, t.grad_offset, t.grad_mask);
        }
      }
    }
  }
}

void offset_mask_grad_cpu(const DeformConv2dGeometry& g, const PixelWindow& window, int64_t batch,
                          const Tensor& grad_columns, const Tensor& input,
                          const WindowSampling& sampling, Tensor& grad_offset, Tensor& grad_mask) {
  const auto runs = runs_of_offset_groups(g, window);
  for (const std::vector<ChannelRun>& group_runs : runs) {
    for (const ChannelRun& run : group_runs) {
      record_channel_loops("deform_conv2d.cpu.offset_mask_grad", run.count, {kLanes});
    }
  }
  const PixelStretches stretches = pixel_stretches(g, window);
  DEFORMCONV_DISPATCH(input.scalar_type(), "deform_conv2d_offset_mask_grad_cpu", [&] {
    const OffsetMaskGradTask<scalar_t> t{g,
                                         window,
                                         runs,
                                         grad_columns.const_data_ptr<scalar_t>(),
                                         input.const_data_ptr<scalar_t>(),
                                         sampling.offset.const_data_ptr<scalar_t>(),
                                         data_or_null<scalar_t>(sampling.mask),
                                         mutable_data_or_null<scalar_t>(grad_offset),
                                         mutable_data_or_null<scalar_t>(grad_mask),
                                         stretches};
    parallel_tasks(batch * stretches.per_image,
                   [&](int64_t begin, int64_t end) { offset_mask_grad_tasks(t, begin, end); });
  });
}

}  // namespace

// Two passes over the columns gradient: col2im's tasks own bands of input rows, the offset and
// mask gradients' own stretches of output pixels. Deterministic whether asked or not: each
// element is summed by one task, in the samples' order.
void column_gradients_cpu(const DeformConv2dGeometry& g, const PixelWindow& window, int64_t batch,
                          const Tensor& grad_columns, const Tensor& input,
                          const WindowSampling& sampling, Tensor& grad_input, Tensor& grad_offset,
                          Tensor& grad_mask, bool /*deterministic: always*/) {
  if (grad_input.defined()) {
    col2im_cpu(g, window, batch, grad_columns, sampling, grad_input);
  }
  if (grad_offset.defined() || grad_mask.defined()) {
    offset_mask_grad_cpu(g, window, batch, grad_columns, input, sampling, grad_offset,
                         grad_mask);
  }
}

}  // namespace deformconv::DEFORMCONV_CPU_COPY

#endif
