// CPU launchers: parallel loops over the shared element functions (parallel_tasks), and the
// CPU kernels of the ops.
//
// The sampling plans of a window are made once, in parallel; each stage then applies a plan to
// the consecutive channels it serves (channels-last layouts, see deform_conv2d_kernel.cuh).
// Those loops over channels are what runs vectorised, and each stage is compiled for several
// instruction sets (DEFORMCONV_VECTOR_CLONES), chosen when the library loads.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "../common/deform_conv2d_kernel.cuh"
#include "../pytorch/deform_conv2d.h"

// x86-64 builds with GCC carry an AVX-512, an AVX2 and a baseline copy of each stage; the
// dynamic loader picks the best one for the CPU at hand, so a wheel built on one machine
// stays correct on another. Elsewhere the compiler's default target is used.
#if defined(__x86_64__) && defined(__ELF__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_ADDRESS__)
#define DEFORMCONV_VECTOR_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define DEFORMCONV_VECTOR_CLONES
#endif

// A helper of a cloned stage runs with the stage's instruction set only if it is inlined into
// it, which the compiler's heuristics alone do not promise.
#if defined(__GNUC__)
#define DEFORMCONV_INLINE inline __attribute__((always_inline))
#define DEFORMCONV_NOINLINE __attribute__((noinline))
#else
#define DEFORMCONV_INLINE inline
#define DEFORMCONV_NOINLINE
#endif

namespace deformconv {
namespace {

// Runs run(begin, end) over the tasks [0, tasks) in parallel. The stages below cut their work
// into tasks that each write outputs of their own, mostly far more tasks than threads, and the
// threads take them in turn from a shared counter, a chunk at a time, rather than a fixed share
// each as at::parallel_for hands out: when another process takes part of a core, the thread on
// it runs fewer tasks instead of keeping the others waiting at the end of every stage. Which
// thread runs a task does not change its result.
template <typename Function>
void parallel_tasks(int64_t tasks, const Function& run) {
  const int64_t threads = at::get_num_threads();
  if (threads == 1 || tasks <= 1 || at::in_parallel_region()) {
    run(int64_t(0), tasks);
    return;
  }
  // About a sixteenth of a thread's share: small enough to rebalance, large enough that the
  // counter is seldom contended.
  const int64_t chunk = std::max<int64_t>(1, tasks / (16 * threads));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t begin = next.fetch_add(chunk); begin < tasks; begin = next.fetch_add(chunk)) {
      run(begin, std::min(tasks, begin + chunk));
    }
  });
}

// About this many samples per task when plans are made or offset gradients summed: enough
// work to amortise a task, and tasks enough to balance the threads.
constexpr int64_t kPlansPerTask = 256;

// Consecutive input channels that stay in one conv group, so that their columns entries are
// consecutive too: entry (image n, window pixel p, tap k, channel first + i) is at
// column_offset + n * image_stride + (p * K + k) * C_in / G + i.
struct ChannelRun {
  int64_t first;
  int64_t count;
  int64_t column_offset;
};

std::vector<ChannelRun> channel_runs(const DeformConv2dGeometry& g, const PixelWindow& window,
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
std::vector<std::vector<ChannelRun>> runs_of_offset_groups(const DeformConv2dGeometry& g,
                                                           const PixelWindow& window) {
  std::vector<std::vector<ChannelRun>> runs;
  for (int64_t group = 0; group < g.offset_groups; ++group) {
    const int64_t first = first_channel(g, group);
    runs.push_back(channel_runs(g, window, first, first + g.channels_per_offset_group()));
  }
  return runs;
}

// Where the columns entries of (image n, window pixel, tap) start, before a run's offset.
int64_t columns_at(const DeformConv2dGeometry& g, const PixelWindow& window, int64_t n,
                   int64_t window_pixel, int64_t tap) {
  return n * window.pixels * g.taps() * g.in_channels +
      (window_pixel * g.taps() + tap) * g.channels_per_group();
}

// Output pixels per task when each pixel needs `plans_per_pixel` plans.
int64_t pixels_per_task(int64_t plans_per_pixel) {
  return std::max<int64_t>(1, kPlansPerTask / plans_per_pixel);
}

// The window's pixels of each image cut into stretches of pixels_per_task pixels: the tasks of
// the stages that walk the samples along (deform group, tap) rows.
struct PixelStretches {
  int64_t pixels;     // per stretch; the last of an image may be shorter
  int64_t per_image;  // stretches per image
};

PixelStretches pixel_stretches(const DeformConv2dGeometry& g, const PixelWindow& window) {
  const int64_t pixels = pixels_per_task(g.offset_groups * g.taps());
  return {pixels, (window.pixels + pixels - 1) / pixels};
}

// Stretch `task`: block image n, window pixels [first_pixel, first_pixel + pixels).
struct PixelStretch {
  int64_t n;
  int64_t first_pixel;
  int64_t pixels;
};

PixelStretch stretch_of(const PixelWindow& window, const PixelStretches& stretches,
                        int64_t task) {
  const int64_t first_pixel = task % stretches.per_image * stretches.pixels;
  return {task / stretches.per_image, first_pixel,
          std::min(stretches.pixels, window.pixels - first_pixel)};
}

// The CPU's window preparation: the sampling plans of every sample of the window, (image,
// window pixel, deform group, tap), made in parallel once per window and then read by every
// channel that uses them, in im2col and in col2im. They live in the driver's workspace,
// workspace_bytes_per_sample each at most, which it counts in the window's scratch memory.
template <typename opmath_t>
const SamplingPlan<opmath_t>* plans_of(const WindowSampling& sampling) {
  return reinterpret_cast<const SamplingPlan<opmath_t>*>(sampling.prepared.const_data_ptr());
}

void make_plans_cpu(const DeformConv2dGeometry& g, const PixelWindow& window, int64_t batch,
                    const at::Tensor& offset, const at::Tensor& mask, at::Tensor& plans) {
  const int64_t plans_per_pixel = g.offset_groups * g.taps();
  const PixelStretches stretches = pixel_stretches(g, window);
  DEFORMCONV_DISPATCH(offset.scalar_type(), "deform_conv2d_plans_cpu", [&] {
    using Plan = SamplingPlan<at::opmath_type<scalar_t>>;
    TORCH_INTERNAL_ASSERT(plans.numel() >=
                          batch * window.pixels * plans_per_pixel * int64_t(sizeof(Plan)));
    Plan* plan_data = reinterpret_cast<Plan*>(plans.mutable_data_ptr());
    const scalar_t* offset_data = offset.const_data_ptr<scalar_t>();
    const scalar_t* mask_data = data_or_null<scalar_t>(mask);
    parallel_tasks(batch * stretches.per_image, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const auto [n, first_pixel, pixels] = stretch_of(window, stretches, task);
        Plan* task_plans = plan_data + (n * window.pixels + first_pixel) * plans_per_pixel;
        // Along each (deform group, tap) row, stepping the sample instead of dividing per
        // sample.
        for (int64_t group = 0; group < g.offset_groups; ++group) {
          for (int64_t tap = 0; tap < g.taps(); ++tap) {
            SampleIndex s = make_sample_index(g, n, group, tap, window.begin + first_pixel);
            for (int64_t i = 0; i < pixels; ++i, next_pixel(g, s)) {
              task_plans[i * plans_per_pixel + group * g.taps() + tap] =
                  make_sampling_plan(g, s, offset_data, mask_data);
            }
          }
        }
      }
    });
  });
}

// The plans of (image n, window pixel): offset_groups * K of them, deform group major.
template <typename opmath_t>
const SamplingPlan<opmath_t>* plans_of_pixel(const DeformConv2dGeometry& g,
                                             const PixelWindow& window,
                                             const SamplingPlan<opmath_t>* plans, int64_t n,
                                             int64_t window_pixel) {
  return plans + (n * window.pixels + window_pixel) * g.offset_groups * g.taps();
}

// Kept out of line: inlined, its vectorised form would set up per-corner lane masks for every
// sample, even for those that never come here.
template <typename scalar_t>
DEFORMCONV_NOINLINE void sample_channels_one_by_one(
    const SamplingPlan<at::opmath_type<scalar_t>>& plan, const scalar_t* channel,
    int64_t channel_stride, int64_t count, scalar_t* out) {
  for (int64_t c = 0; c < count; ++c) {
    out[c] = sample_with_plan(plan, channel + c, channel_stride);
  }
}

// sample_with_plan over `count` consecutive channels. When all four corners carry weight, as
// nearly every sample does, the channels are a plain weighted sum of four rows, which the
// compiler vectorises without masks; otherwise they go one by one through the shared function,
// which skips the corners without weight (so that an infinite input there cannot make NaN).
template <typename scalar_t>
DEFORMCONV_INLINE void sample_channels(const SamplingPlan<at::opmath_type<scalar_t>>& plan,
                                       const scalar_t* channel, int64_t channel_stride,
                                       int64_t count, scalar_t* __restrict out) {
  using opmath_t = at::opmath_type<scalar_t>;
  const opmath_t* w = plan.weight;
  if (w[0] != opmath_t(0) && w[1] != opmath_t(0) && w[2] != opmath_t(0) && w[3] != opmath_t(0)) {
    const scalar_t* __restrict row_0 = channel + plan.index[0] * channel_stride;
    const scalar_t* __restrict row_1 = channel + plan.index[1] * channel_stride;
    const scalar_t* __restrict row_2 = channel + plan.index[2] * channel_stride;
    const scalar_t* __restrict row_3 = channel + plan.index[3] * channel_stride;
    for (int64_t c = 0; c < count; ++c) {
      out[c] = static_cast<scalar_t>(w[0] * static_cast<opmath_t>(row_0[c]) +
                                     w[1] * static_cast<opmath_t>(row_1[c]) +
                                     w[2] * static_cast<opmath_t>(row_2[c]) +
                                     w[3] * static_cast<opmath_t>(row_3[c]));
    }
    return;
  }
  sample_channels_one_by_one(plan, channel, channel_stride, count, out);
}

template <typename scalar_t>
struct Im2colTask {
  const DeformConv2dGeometry& g;
  PixelWindow window;
  const std::vector<std::vector<ChannelRun>>& runs;
  PixelStretches stretches;
  // The window's plans, or null: each task then makes the plans of its own samples as it
  // goes, which spares the forward the plans' round trip through memory.
  const SamplingPlan<at::opmath_type<scalar_t>>* plans;
  const scalar_t* offset;
  const scalar_t* mask;
  const scalar_t* input;
  scalar_t* columns;
};

// Tasks [begin, end) of im2col, task = a stretch of one image's window pixels, walked along
// (deform group, tap) rows: every columns entry is written by exactly one task.
template <typename scalar_t>
DEFORMCONV_VECTOR_CLONES void im2col_tasks(const Im2colTask<scalar_t>& t, int64_t begin,
                                           int64_t end) {
  const DeformConv2dGeometry& g = t.g;
  for (int64_t task = begin; task < end; ++task) {
    const auto [n, first_pixel, pixels] = stretch_of(t.window, t.stretches, task);
    for (int64_t group = 0; group < g.offset_groups; ++group) {
      for (int64_t tap = 0; tap < g.taps(); ++tap) {
        SampleIndex s = make_sample_index(g, n, group, tap, t.window.begin + first_pixel);
        for (int64_t pixel = first_pixel; pixel < first_pixel + pixels;
             ++pixel, next_pixel(g, s)) {
          const auto plan = t.plans != nullptr
              ? plans_of_pixel(g, t.window, t.plans, n, pixel)[group * g.taps() + tap]
              : make_sampling_plan(g, s, t.offset, t.mask);
          const int64_t entries = columns_at(g, t.window, n, pixel, tap);
          for (const ChannelRun& run : t.runs[group]) {
            sample_channels(plan, channel_of(g, t.input, n, run.first), g.in_channels, run.count,
                            t.columns + run.column_offset + entries);
          }
        }
      }
    }
  }
}

void im2col_cpu(const DeformConv2dGeometry& g, const PixelWindow& window, int64_t batch,
                const at::Tensor& input, const WindowSampling& sampling, at::Tensor& columns) {
  const auto runs = runs_of_offset_groups(g, window);
  const PixelStretches stretches = pixel_stretches(g, window);
  DEFORMCONV_DISPATCH(input.scalar_type(), "deform_conv2d_im2col_cpu", [&] {
    const Im2colTask<scalar_t> t{
        g, window, runs, stretches,
        sampling.prepared.defined() ? plans_of<at::opmath_type<scalar_t>>(sampling) : nullptr,
        sampling.offset.const_data_ptr<scalar_t>(), data_or_null<scalar_t>(sampling.mask),
        input.const_data_ptr<scalar_t>(), columns.mutable_data_ptr<scalar_t>()};
    parallel_tasks(batch * stretches.per_image,
                   [&](int64_t begin, int64_t end) { im2col_tasks(t, begin, end); });
  });
}

template <typename scalar_t>
struct Col2imTask {
  const DeformConv2dGeometry& g;
  PixelWindow window;
  const std::vector<std::vector<ChannelRun>>& runs;
  const SamplingPlan<at::opmath_type<scalar_t>>* plans;
  const scalar_t* grad_columns;
  at::opmath_type<scalar_t>* grad_input;  // Note [Input gradient sums in float32]
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
DEFORMCONV_VECTOR_CLONES void col2im_tasks(const Col2imTask<scalar_t>& t, int64_t begin,
                                           int64_t end) {
  using opmath_t = at::opmath_type<scalar_t>;
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
                const at::Tensor& grad_columns, const WindowSampling& sampling,
                at::Tensor& grad_input) {
  const auto runs = runs_of_offset_groups(g, window);
  // About two bands per thread over the block's images: every task scans all the plans of its
  // image, so many more bands would multiply that cost.
  const int64_t wanted_bands = (2 * at::get_num_threads() + batch - 1) / batch;
  const int64_t rows_per_band = (g.in_height + wanted_bands - 1) / wanted_bands;
  const int64_t bands = (g.in_height + rows_per_band - 1) / rows_per_band;
  DEFORMCONV_DISPATCH(grad_columns.scalar_type(), "deform_conv2d_col2im_cpu", [&] {
    at::Tensor sums = input_gradient_sums<scalar_t>(grad_input);
    const Col2imTask<scalar_t> t{g,
                                 window,
                                 runs,
                                 plans_of<at::opmath_type<scalar_t>>(sampling),
                                 grad_columns.const_data_ptr<scalar_t>(),
                                 sums.mutable_data_ptr<at::opmath_type<scalar_t>>(),
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

// kLanes values of opmath_t in one GCC/Clang vector (lowered to what the target has: one
// AVX-512 register of floats, two AVX2 ones, ...). Arithmetic on it is lane by lane, so the
// offset/mask gradient sums run kLanes channels at a time through the shared
// add_offset_mask_grad_terms; reductions are written with explicit lanes because the compiler
// may not reorder floating-point sums by itself.
constexpr int64_t kLanes = 16;
template <typename opmath_t>
struct LanesOf;
template <>
struct LanesOf<float> {
  typedef float type __attribute__((vector_size(kLanes * sizeof(float))));
};
template <>
struct LanesOf<double> {
  typedef double type __attribute__((vector_size(kLanes * sizeof(double))));
};

// kLanes consecutive values from `data` (of any dtype) as opmath_t lanes. (An out-parameter:
// returning a vector by value would give these inline helpers an ABI that differs per clone.)
template <typename opmath_t, typename scalar_t>
DEFORMCONV_INLINE void load_lanes(const scalar_t* data, typename LanesOf<opmath_t>::type& lanes) {
  for (int64_t lane = 0; lane < kLanes; ++lane) {
    lanes[lane] = static_cast<opmath_t>(data[lane]);
  }
}

// Adds the upper half of partial[0, width) onto its lower half, and so on down to partial[0]:
// the sum of the lanes in log2(kLanes) dependent steps rather than kLanes, in an order fixed
// by the code, not by the machine. Recursion on a constant width, so that every loop unrolls
// and the partial sums stay in registers.
template <int64_t width, typename opmath_t>
DEFORMCONV_INLINE opmath_t sum_halves(opmath_t* partial) {
  if constexpr (width == 1) {
    return partial[0];
  } else {
    for (int64_t lane = 0; lane < width / 2; ++lane) {
      partial[lane] += partial[lane + width / 2];
    }
    return sum_halves<width / 2>(partial);
  }
}

template <typename opmath_t>
DEFORMCONV_INLINE opmath_t sum_of_lanes(const typename LanesOf<opmath_t>::type& lanes) {
  opmath_t partial[kLanes];
  for (int64_t lane = 0; lane < kLanes; ++lane) {
    partial[lane] = lanes[lane];
  }
  return sum_halves<kLanes>(partial);
}

// One sample's sums over the channels of its deform group: kLanes channels at a time in
// vector lanes, the rest one by one; the lanes are added up in a fixed order, so the result
// does not depend on the machine.
template <typename scalar_t>
DEFORMCONV_INLINE OffsetMaskGradSums<at::opmath_type<scalar_t>> offset_mask_grad_of_sample(
    const DeformConv2dGeometry& g, int64_t n, int64_t entries,
    const std::vector<ChannelRun>& runs, const OffsetMaskGrad<at::opmath_type<scalar_t>>& acc,
    const scalar_t* grad_columns, const scalar_t* input) {
  using opmath_t = at::opmath_type<scalar_t>;
  using Lanes = typename LanesOf<opmath_t>::type;
  bool inside[4];
  corners_inside(acc.cell, inside);
  Lanes sum_y = {}, sum_x = {}, sum_m = {};
  OffsetMaskGradSums<opmath_t> rest;
  for (const ChannelRun& run : runs) {
    const scalar_t* grad = grad_columns + run.column_offset + entries;
    const scalar_t* in = channel_of(g, input, n, run.first);
    const scalar_t* corner_0 = in + acc.index[0] * g.in_channels;
    const scalar_t* corner_1 = in + acc.index[1] * g.in_channels;
    const scalar_t* corner_2 = in + acc.index[2] * g.in_channels;
    const scalar_t* corner_3 = in + acc.index[3] * g.in_channels;
    int64_t c = 0;
    for (; c + kLanes <= run.count; c += kLanes) {
      // Corners outside read index 0 (a valid address) and are then replaced by 0.
      Lanes grad_lanes, v00, v01, v10, v11;
      load_lanes<opmath_t>(grad + c, grad_lanes);
      load_lanes<opmath_t>(corner_0 + c, v00);
      load_lanes<opmath_t>(corner_1 + c, v01);
      load_lanes<opmath_t>(corner_2 + c, v10);
      load_lanes<opmath_t>(corner_3 + c, v11);
      add_offset_mask_grad_terms(acc.cell, grad_lanes, inside[0] ? v00 : Lanes{},
                                 inside[1] ? v01 : Lanes{}, inside[2] ? v10 : Lanes{},
                                 inside[3] ? v11 : Lanes{}, sum_y, sum_x, sum_m);
    }
    for (; c < run.count; ++c) {
      accumulate_offset_mask_grad(acc, grad[c], in + c, g.in_channels, rest);
    }
  }
  rest.y += sum_of_lanes<opmath_t>(sum_y);
  rest.x += sum_of_lanes<opmath_t>(sum_x);
  rest.m += sum_of_lanes<opmath_t>(sum_m);
  return rest;
}

// Tasks [begin, end) of the offset and mask gradients, task = (image, stretch of window
// pixels); each sample is located, summed over its channels and written in one go, and writes
// only its own gradients.
template <typename scalar_t>
DEFORMCONV_VECTOR_CLONES void offset_mask_grad_tasks(const OffsetMaskGradTask<scalar_t>& t,
                                                     int64_t begin, int64_t end) {
  using opmath_t = at::opmath_type<scalar_t>;
  const DeformConv2dGeometry& g = t.g;
  for (int64_t task = begin; task < end; ++task) {
    const auto [n, first_pixel, pixels] = stretch_of(t.window, t.stretches, task);
    for (int64_t group = 0; group < g.offset_groups; ++group) {
      for (int64_t tap = 0; tap < g.taps(); ++tap) {
        SampleIndex s = make_sample_index(g, n, group, tap, t.window.begin + first_pixel);
        for (int64_t i = 0; i < pixels; ++i, next_pixel(g, s)) {
          const auto acc = start_offset_mask_grad(g, s, t.offset, t.mask);
          const int64_t entries = columns_at(g, t.window, n, first_pixel + i, tap);
          const auto sums = acc.cell.inside
              ? offset_mask_grad_of_sample(g, n, entries, t.runs[group], acc, t.grad_columns,
                                           t.input)
              : OffsetMaskGradSums<opmath_t>{};
          finish_offset_mask_grad(g, s, acc, sums, t.grad_offset, t.grad_mask);
        }
      }
    }
  }
}

void offset_mask_grad_cpu(const DeformConv2dGeometry& g, const PixelWindow& window,
                          int64_t batch, const at::Tensor& grad_columns, const at::Tensor& input,
                          const WindowSampling& sampling, at::Tensor& grad_offset,
                          at::Tensor& grad_mask) {
  const auto runs = runs_of_offset_groups(g, window);
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

// Swaps the last two dimensions in square tiles, so that both the reads and the writes of a
// tile stay on a few cache lines and pages; ATen's generic strided copy is several times
// slower for these shapes.
constexpr int64_t kTransposeTile = 64;

template <typename scalar_t>
DEFORMCONV_VECTOR_CLONES void transpose_tiles(const scalar_t* src, scalar_t* dst, int64_t rows,
                                              int64_t cols, int64_t begin, int64_t end) {
  const int64_t row_tiles = (rows + kTransposeTile - 1) / kTransposeTile;
  const int64_t col_tiles = (cols + kTransposeTile - 1) / kTransposeTile;
  for (int64_t tile = begin; tile < end; ++tile) {
    const int64_t matrix = tile / (row_tiles * col_tiles);
    const int64_t row_begin = tile / col_tiles % row_tiles * kTransposeTile;
    const int64_t col_begin = tile % col_tiles * kTransposeTile;
    const int64_t row_end = std::min(rows, row_begin + kTransposeTile);
    const int64_t col_end = std::min(cols, col_begin + kTransposeTile);
    const scalar_t* from = src + matrix * rows * cols;
    scalar_t* to = dst + matrix * rows * cols;
    for (int64_t c = col_begin; c < col_end; ++c) {
      for (int64_t r = row_begin; r < row_end; ++r) {
        to[c * rows + r] = from[r * cols + c];
      }
    }
  }
}

void transpose_cpu(const at::Tensor& src, at::Tensor& dst) {
  const int64_t rows = src.size(1);
  const int64_t cols = src.size(2);
  const int64_t tiles = src.size(0) * ((rows + kTransposeTile - 1) / kTransposeTile) *
      ((cols + kTransposeTile - 1) / kTransposeTile);
  DEFORMCONV_DISPATCH(src.scalar_type(), "deform_conv2d_transpose_cpu", [&] {
    const scalar_t* from = src.const_data_ptr<scalar_t>();
    scalar_t* to = dst.mutable_data_ptr<scalar_t>();
    parallel_tasks(tiles, [&](int64_t begin, int64_t end) {
      transpose_tiles(from, to, rows, cols, begin, end);
    });
  });
}

// A scratch buffer of the driver's. A large one is fresh memory from the system on every call,
// and its first touch page-faults 4 KiB at a time; on Linux it asks for transparent huge pages
// instead (madvise, advisory: the kernel may decline), as PyTorch's THP_MEM_ALLOC_ENABLE does
// for every allocation.
at::Tensor scratch_cpu(c10::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor buffer = at::empty(sizes, options);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHugePage = uintptr_t(1) << 21;
  const auto begin = reinterpret_cast<uintptr_t>(buffer.data_ptr());
  const uintptr_t first = (begin + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t last = (begin + buffer.nbytes()) & ~(kHugePage - 1);
  if (last > first) {
    madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
  }
#endif
  return buffer;
}

// 4 MiB of scratch per window (columns and plans): within the last-level cache of a CPU. A
// plan takes 48 bytes in float32, 64 in float64.
constexpr DeformConv2dLaunchers kCpuLaunchers{
    .block_columns_bytes = int64_t(4) << 20,
    .columns_tile_bytes = int64_t(4) << 20,
    .workspace_bytes_per_sample = sizeof(SamplingPlan<double>),
    .prepare_window = make_plans_cpu,
    .scratch = scratch_cpu,
    .im2col = im2col_cpu,
    .col2im = col2im_cpu,
    .offset_mask_grad = offset_mask_grad_cpu,
    .transpose = transpose_cpu,
    .onednn_gemms = true,
};

at::Tensor deform_conv2d_cpu(const at::Tensor& input, const at::Tensor& offset,
                             const at::Tensor& weight, const std::optional<at::Tensor>& mask,
                             const std::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                             c10::IntArrayRef padding, c10::IntArrayRef dilation, int64_t groups,
                             int64_t offset_groups, int64_t im2col_step) {
  return deform_conv2d_forward(kCpuLaunchers, input, offset, weight, mask, bias, stride, padding,
                               dilation, groups, offset_groups, im2col_step);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> deform_conv2d_backward_cpu(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& offset,
    const at::Tensor& weight, const std::optional<at::Tensor>& mask, c10::IntArrayRef stride,
    c10::IntArrayRef padding, c10::IntArrayRef dilation, int64_t groups, int64_t offset_groups,
    int64_t im2col_step, std::array<bool, 5> output_mask) {
  return deform_conv2d_backward(kCpuLaunchers, grad_output, input, offset, weight, mask, stride,
                                padding, dilation, groups, offset_groups, im2col_step,
                                output_mask);
}

}  // namespace

TORCH_LIBRARY_IMPL(deformconv, CPU, m) {
  m.impl("deform_conv2d", TORCH_FN(deform_conv2d_cpu));
  m.impl("deform_conv2d_backward", TORCH_FN(deform_conv2d_backward_cpu));
}

}  // namespace deformconv
