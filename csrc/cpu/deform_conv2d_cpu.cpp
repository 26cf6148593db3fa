// CPU launchers: parallel loops over the shared element functions (parallel_tasks), and the
// CPU kernels of the ops.
//
// Each stage locates its samples a (deform group, tap) row at a time, as arrays over a stretch
// of pixels (StretchSamples), and applies each sample to the consecutive channels it serves
// (channels-last layouts, see deform_conv2d_kernel.cuh); col2im, which visits the samples in
// another order, reads plans made once per window. Both the locating and the loops over
// channels run vectorised, and each stage is compiled for several instruction sets
// (DEFORMCONV_VECTOR_CLONES), chosen when the library loads.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/from_blob.h>
#include <ATen/record_function.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "../common/deform_conv2d_kernel.cuh"
#include "../pytorch/deform_conv2d.h"
#include "cpu_loops.h"
#include "located_samples.h"

namespace deformconv {
namespace {

// About this many samples per task when plans are made or offset gradients summed: enough
// work to amortise a task, and tasks enough to balance the threads.
constexpr int64_t kPlansPerTask = 256;

// At least this many pixels per task, though: a task locates its samples a (deform group, tap)
// row at a time, as arrays over its pixels (StretchSamples), and arrays shorter than a few
// vectors run mostly in the loops' scalar remainders.
constexpr int64_t kMinPixelsPerTask = 32;

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
  return std::max(kMinPixelsPerTask, kPlansPerTask / plans_per_pixel);
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

// The samples of one (deform group, tap) row over a stretch of output pixels of one image,
// located at once (LocatedSamples), sample i at the stretch's pixel i: the undeformed
// positions of tap (0, 0) are made once per stretch, and each row adds its own tap's.
template <typename opmath_t>
class StretchSamples : public LocatedSamples<opmath_t> {
 public:
  StretchSamples(const DeformConv2dGeometry& g, int64_t max_pixels)
      : LocatedSamples<opmath_t>(max_pixels, g.in_height, g.in_width),
        origin_y_(max_pixels),
        origin_x_(max_pixels) {}

  // Output pixels [first_pixel, first_pixel + pixels) of the output grid.
  void start(const DeformConv2dGeometry& g, int64_t first_pixel, int64_t pixels) {
    first_pixel_ = first_pixel;
    pixels_ = pixels;
    SampleIndex s = make_sample_index(g, 0, 0, 0, first_pixel);
    for (int64_t i = 0; i < pixels; ++i, next_pixel(g, s)) {
      origin_y_[i] = s.grid_y;
      origin_x_[i] = s.grid_x;
    }
  }

  // The row of image n, deform group `group`, tap `tap`, read from the block's offset and mask
  // (null: DCN v1) tensors, in whose layout the row's pixels are consecutive.
  template <typename scalar_t>
  DEFORMCONV_INLINE void locate(const DeformConv2dGeometry& g, int64_t n, int64_t group,
                                int64_t tap, const scalar_t* offset, const scalar_t* mask) {
    const SampleIndex s = make_sample_index(g, n, group, tap, first_pixel_);
    const int64_t tap_y = s.grid_y - origin_y_[0];
    const int64_t tap_x = s.grid_x - origin_x_[0];
    const scalar_t* offset_y = offset + offset_y_index(g, s);
    const scalar_t* offset_x = offset_y + g.out_pixels();
    for (int64_t i = 0; i < pixels_; ++i) {
      this->grid_y[i] = static_cast<opmath_t>(origin_y_[i] + tap_y);
      this->grid_x[i] = static_cast<opmath_t>(origin_x_[i] + tap_x);
      this->dy[i] = static_cast<opmath_t>(offset_y[i]);
      this->dx[i] = static_cast<opmath_t>(offset_x[i]);
    }
    if (mask == nullptr) {
      std::fill_n(this->m.begin(), pixels_, opmath_t(1));
    } else {
      const scalar_t* row_mask = mask + mask_index(g, s);
      for (int64_t i = 0; i < pixels_; ++i) {
        this->m[i] = static_cast<opmath_t>(row_mask[i]);
      }
    }
    LocatedSamples<opmath_t>::locate(pixels_, opmath_t(0), opmath_t(0), opmath_t(1));
    // A task's rows lie in 3 * offset_groups * K planes of the offset and mask tensors, more
    // streams than a CPU's prefetcher follows, so each row asks for the same row of the next
    // stretch, which the next task most often is.
    prefetch_next(offset_y);
    prefetch_next(offset_x);
    if (mask != nullptr) {
      prefetch_next(mask + mask_index(g, s));
    }
  }

 private:
  // The addresses are made as integers: the next stretch may lie past the end of the tensor,
  // where a prefetch is harmless but pointer arithmetic would not be defined.
  template <typename scalar_t>
  DEFORMCONV_INLINE void prefetch_next(const scalar_t* row) const {
    const uintptr_t bytes = static_cast<uintptr_t>(pixels_) * sizeof(scalar_t);
    const uintptr_t next = reinterpret_cast<uintptr_t>(row) + bytes;
    for (uintptr_t byte = 0; byte < bytes; byte += kCacheLineBytes) {
      __builtin_prefetch(reinterpret_cast<const void*>(next + byte));
    }
  }

  std::vector<int64_t> origin_y_, origin_x_;
  int64_t first_pixel_ = 0;
  int64_t pixels_ = 0;
};

// The CPU's window preparation: the sampling plans of every sample of the window, (image,
// window pixel, deform group, tap), made in parallel once per window and then read by every
// channel that uses them in col2im. They live in the driver's workspace,
// workspace_bytes_per_sample each at most, which it counts in the window's scratch memory.
template <typename opmath_t>
const SamplingPlan<opmath_t>* plans_of(const WindowSampling& sampling) {
  return reinterpret_cast<const SamplingPlan<opmath_t>*>(sampling.prepared.const_data_ptr());
}

// Tasks [begin, end) of the window's plans, task = a stretch of one image's window pixels.
template <typename scalar_t>
DEFORMCONV_VECTOR_CLONES void make_plans_tasks(const DeformConv2dGeometry& g,
                                               const PixelWindow& window,
                                               const PixelStretches& stretches,
                                               const scalar_t* offset, const scalar_t* mask,
                                               SamplingPlan<at::opmath_type<scalar_t>>* plans,
                                               int64_t begin, int64_t end) {
  const int64_t plans_per_pixel = g.offset_groups * g.taps();
  StretchSamples<at::opmath_type<scalar_t>> samples(g, stretches.pixels);
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
      make_plans_tasks(g, window, stretches, offset_data, mask_data, plan_data, begin, end);
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
DEFORMCONV_VECTOR_CLONES void im2col_tasks(const Im2colTask<scalar_t>& t, int64_t begin,
                                           int64_t end) {
  using opmath_t = at::opmath_type<scalar_t>;
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

void im2col_cpu(const DeformConv2dGeometry& g, const PixelWindow& window, int64_t batch,
                const at::Tensor& input, const WindowSampling& sampling, at::Tensor& columns) {
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

// Note [Fused forward]
// The forward as im2col and GEMMs writes every sampled value to the columns, and the GEMM then
// reads them back (a BLAS packing them first), window by window, each stage a parallel region
// of its own; with conv groups, the GEMMs are many small products that a BLAS runs far below
// its speed. The fused forward writes no columns: a task samples one tap of a few pixels into
// a buffer that stays in the L1 cache, and at once adds the products of those values with the
// tap's weights into the pixels' output sums, which it writes when every tap is summed. The
// whole forward of a block is one parallel region. Each output is summed over (tap, input
// channel) in that order, as the GEMM over a columns row sums it, whichever thread runs it.
// Each block of pixels reads the whole weight, which must stay in cache: the fused forward runs
// for weights up to 4 MiB (fused_forward_pays_cpu; about a core's L2 cache or its share of
// L3). ResNet's 512-channel stage (9 MiB) runs faster as GEMMs.

// Pixels whose output sums share each load of a weight row: with two vectors of sums per pixel,
// half the registers of the clone (16 of AVX2's 32-byte ones, 32 of AVX-512's 64-byte ones).
// With more pixels GCC spilled.
template <int kVectorBytes>
constexpr int64_t kFusedPixels = kVectorBytes / 8;

// sums[p * sums_stride + j] += sum over c < count of values[p * values_stride + c] *
// weights[c * out_per_group + j], for pixels p < `pixels` and j < out_per_group: the products
// of one tap's values of a conv group with its weights. With a full block of pixels, output
// channels go a vector of kVectorBytes at a time, with the sums held in registers over the
// channels; the rest one by one.
template <int kVectorBytes, typename opmath_t>
DEFORMCONV_INLINE void multiply_add_block(const opmath_t* __restrict values,
                                          int64_t values_stride, int64_t pixels, int64_t count,
                                          const opmath_t* __restrict weights,
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
  const auto at = [](opmath_t* data) { return reinterpret_cast<Unaligned*>(data); };
  const auto at_const = [](const opmath_t* data) {
    return reinterpret_cast<const Unaligned*>(data);
  };
  int64_t vectorised = 0;
  if (pixels == kPixels) {
    for (; vectorised + 2 * kWidth <= out_per_group; vectorised += 2 * kWidth) {
      const int64_t j = vectorised;
      Vector low[kPixels], high[kPixels];
      for (int64_t p = 0; p < kPixels; ++p) {
        low[p] = *at(sums + p * sums_stride + j);
        high[p] = *at(sums + p * sums_stride + j + kWidth);
      }
      for (int64_t c = 0; c < count; ++c) {
        const Vector weight_low = *at_const(weights + c * out_per_group + j);
        const Vector weight_high = *at_const(weights + c * out_per_group + j + kWidth);
        for (int64_t p = 0; p < kPixels; ++p) {
          const opmath_t value = values[p * values_stride + c];
          low[p] += value * weight_low;
          high[p] += value * weight_high;
        }
      }
      for (int64_t p = 0; p < kPixels; ++p) {
        *at(sums + p * sums_stride + j) = low[p];
        *at(sums + p * sums_stride + j + kWidth) = high[p];
      }
    }
    for (; vectorised + kWidth <= out_per_group; vectorised += kWidth) {
      const int64_t j = vectorised;
      Vector lanes[kPixels];
      for (int64_t p = 0; p < kPixels; ++p) {
        lanes[p] = *at(sums + p * sums_stride + j);
      }
      for (int64_t c = 0; c < count; ++c) {
        const Vector weight = *at_const(weights + c * out_per_group + j);
        for (int64_t p = 0; p < kPixels; ++p) {
          lanes[p] += values[p * values_stride + c] * weight;
        }
      }
      for (int64_t p = 0; p < kPixels; ++p) {
        *at(sums + p * sums_stride + j) = lanes[p];
      }
    }
  }
  for (int64_t p = 0; p < pixels; ++p) {
    for (int64_t j = vectorised; j < out_per_group; ++j) {
      opmath_t sum = sums[p * sums_stride + j];
      for (int64_t c = 0; c < count; ++c) {
        sum += values[p * values_stride + c] * weights[c * out_per_group + j];
      }
      sums[p * sums_stride + j] = sum;
    }
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

template <typename scalar_t>
struct FusedForwardTask {
  const DeformConv2dGeometry& g;
  PixelWindow image;  // every output pixel of an image
  PixelStretches stretches;
  const scalar_t* offset;
  const scalar_t* mask;
  const scalar_t* input;
  const at::opmath_type<scalar_t>* weight_taps;
  const scalar_t* bias;
  scalar_t* output;
};

// Tasks [begin, end) of the fused forward, task = a stretch of one image's output pixels, tap
// by tap: the tap's samples of every deform group are located at once, then taken a few pixels
// at a time, sampled into `values` (pixel, input channel) and multiplied into the sums, conv
// group by conv group: Note [Fused forward].
template <int kVectorBytes, typename scalar_t>
DEFORMCONV_VECTOR_CLONES void fused_forward_tasks(const FusedForwardTask<scalar_t>& t,
                                                  int64_t begin, int64_t end) {
  using opmath_t = at::opmath_type<scalar_t>;
  const DeformConv2dGeometry& g = t.g;
  const int64_t in_per_offset_group = g.channels_per_offset_group();
  const int64_t in_per_group = g.channels_per_group();
  const int64_t out_per_group = g.out_channels / g.groups;
  const std::vector<scalar_t> zeros(g.in_channels, scalar_t(0));
  constexpr int64_t kBlockPixels = kFusedPixels<kVectorBytes>;
  std::vector<opmath_t> values(kBlockPixels * g.in_channels);
  // (stretch pixel, output channel)
  std::vector<opmath_t> sums(t.stretches.pixels * g.out_channels);
  std::vector<StretchSamples<opmath_t>> samples(g.offset_groups,
                                                StretchSamples<opmath_t>(g, t.stretches.pixels));
  for (int64_t task = begin; task < end; ++task) {
    const auto [n, first_pixel, pixels] = stretch_of(t.image, t.stretches, task);
    const scalar_t* image = channel_of(g, t.input, n, 0);
    std::fill_n(sums.begin(), pixels * g.out_channels, opmath_t(0));
    for (StretchSamples<opmath_t>& group_samples : samples) {
      group_samples.start(g, first_pixel, pixels);
    }
    for (int64_t tap = 0; tap < g.taps(); ++tap) {
      for (int64_t group = 0; group < g.offset_groups; ++group) {
        samples[group].locate(g, n, group, tap, t.offset, t.mask);
      }
      for (int64_t block_pixel = 0; block_pixel < pixels; block_pixel += kBlockPixels) {
        const int64_t block = std::min(kBlockPixels, pixels - block_pixel);
        for (int64_t p = 0; p < block; ++p) {
          for (int64_t group = 0; group < g.offset_groups; ++group) {
            const int64_t first = first_channel(g, group);
            opmath_t weight[4];
            const scalar_t* rows[4];
            samples[group].corner_rows(block_pixel + p, image + first, g.in_channels,
                                       zeros.data() + first, weight, rows);
            sum_corner_rows(rows, weight, in_per_offset_group,
                            values.data() + p * g.in_channels + first);
          }
        }
        for (int64_t conv_group = 0; conv_group < g.groups; ++conv_group) {
          const opmath_t* weights =
              t.weight_taps + (conv_group * g.taps() + tap) * in_per_group * out_per_group;
          multiply_add_block<kVectorBytes>(
              values.data() + conv_group * in_per_group, g.in_channels, block, in_per_group,
              weights, out_per_group,
              sums.data() + block_pixel * g.out_channels + conv_group * out_per_group,
              g.out_channels);
        }
      }
    }
    store_sums(sums.data(), pixels, g.out_channels, t.bias,
               t.output + n * g.out_channels * g.out_pixels() + first_pixel, g.out_pixels());
  }
}

void fused_forward_cpu(const DeformConv2dGeometry& g, int64_t batch, const at::Tensor& input,
                       const at::Tensor& offset, const at::Tensor& mask,
                       const at::Tensor& weight_taps, const at::Tensor& bias,
                       at::Tensor& output) {
  const PixelWindow image{0, g.out_pixels()};
  const PixelStretches stretches = pixel_stretches(g, image);
  DEFORMCONV_DISPATCH(input.scalar_type(), "deform_conv2d_fused_forward_cpu", [&] {
    const FusedForwardTask<scalar_t> t{g,
                                       image,
                                       stretches,
                                       offset.const_data_ptr<scalar_t>(),
                                       data_or_null<scalar_t>(mask),
                                       input.const_data_ptr<scalar_t>(),
                                       weight_taps.const_data_ptr<at::opmath_type<scalar_t>>(),
                                       data_or_null<scalar_t>(bias),
                                       output.mutable_data_ptr<scalar_t>()};
    // Multiply-adds as wide as a register of the clone that runs.
    with_register_bytes([&](auto register_bytes) {
      constexpr int64_t kWidth = register_bytes / sizeof(at::opmath_type<scalar_t>);
      record_channel_loops("deform_conv2d.cpu.fused_forward", g.out_channels / g.groups,
                           {2 * kWidth, kWidth});
      parallel_tasks(batch * stretches.per_image, [&](int64_t begin, int64_t end) {
        fused_forward_tasks<register_bytes>(t, begin, end);
      });
    });
  });
}

bool fused_forward_pays_cpu(const DeformConv2dGeometry& g, at::ScalarType dtype) {
  constexpr int64_t kCachedWeightBytes = int64_t(4) << 20;
  const int64_t weight_bytes = g.out_channels * g.channels_per_group() * g.taps() *
      c10::elementSize(at::toOpMathType(dtype));
  return weight_bytes <= kCachedWeightBytes;
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

// One sample's sums over the channels of its deform group, run by run.
template <typename scalar_t>
DEFORMCONV_INLINE OffsetMaskGradSums<at::opmath_type<scalar_t>> offset_mask_grad_of_sample(
    const DeformConv2dGeometry& g, int64_t n, int64_t entries,
    const std::vector<ChannelRun>& runs, const OffsetMaskGrad<at::opmath_type<scalar_t>>& acc,
    const scalar_t* grad_columns, const scalar_t* input) {
  LaneSums<at::opmath_type<scalar_t>> sums;
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
DEFORMCONV_VECTOR_CLONES void offset_mask_grad_tasks(const OffsetMaskGradTask<scalar_t>& t,
                                                     int64_t begin, int64_t end) {
  using opmath_t = at::opmath_type<scalar_t>;
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

// The driver's scratch memory, kept from call to call. A call needs the same few large buffers
// as the last one (columns, channels-last copies, plans, the weight in columns order), and a
// fresh buffer from the system costs a page fault per page and the kernel's zeroing of each
// page: about a tenth of c3-stride2's forward. A scratch tensor, when freed, returns its block
// here, and a later request takes the smallest kept block that fits it and is at most twice
// its size. The pool keeps at most kKeptScratchBytes and gives the rest back to the system;
// every thread shares it.
class ScratchPool {
 public:
  static ScratchPool& instance() {
    // Never destroyed: a scratch tensor may still be freed during static destruction.
    static ScratchPool* pool = new ScratchPool();
    return *pool;
  }

  at::Tensor take(c10::IntArrayRef sizes, const at::TensorOptions& options) {
    // An event of its own, as aten::empty has, which the block counts as allocated by.
    RECORD_FUNCTION("deformconv::scratch", std::vector<c10::IValue>());
    const size_t bytes = std::max<size_t>(
        1, static_cast<size_t>(c10::multiply_integers(sizes)) * options.dtype().itemsize());
    void* block = nullptr;
    size_t block_bytes = bytes;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto kept = free_blocks_.lower_bound(bytes);
      if (kept != free_blocks_.end() && kept->first <= 2 * bytes) {
        block = kept->second;
        block_bytes = kept->first;
        kept_bytes_ -= block_bytes;
        free_blocks_.erase(kept);
      }
    }
    if (block == nullptr) {
      block = allocate(bytes);
    }
    report_to_profiler(block, static_cast<int64_t>(block_bytes));
    return at::from_blob(
        block, sizes, [this, block_bytes](void* data) { give_back(data, block_bytes); },
        options);
  }

 private:
  static constexpr size_t kKeptScratchBytes = size_t(128) << 20;

  // Fresh memory from the system; on Linux, asking for transparent huge pages over the part
  // that covers whole ones (madvise, advisory: the kernel may decline), as PyTorch's
  // THP_MEM_ALLOC_ENABLE does for every allocation.
  static void* allocate(size_t bytes) {
    void* block = c10::alloc_cpu(bytes);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    constexpr uintptr_t kHugePage = uintptr_t(1) << 21;
    const auto begin = reinterpret_cast<uintptr_t>(block);
    const uintptr_t first = (begin + kHugePage - 1) & ~(kHugePage - 1);
    const uintptr_t last = (begin + bytes) & ~(kHugePage - 1);
    if (last > first) {
      madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
    }
#endif
    return block;
  }

  // A block in use counts as allocated for PyTorch's memory profiler, as a fresh buffer from
  // PyTorch's allocator would, whether it was kept or new.
  static void report_to_profiler(void* block, int64_t bytes) {
    c10::reportMemoryUsageToProfiler(block, bytes, 0, 0, c10::Device(c10::DeviceType::CPU));
  }

  void give_back(void* block, size_t bytes) {
    report_to_profiler(block, -static_cast<int64_t>(bytes));
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (kept_bytes_ + bytes <= kKeptScratchBytes) {
        free_blocks_.emplace(bytes, block);
        kept_bytes_ += bytes;
        return;
      }
    }
    c10::free_cpu(block);
  }

  std::mutex mutex_;
  std::multimap<size_t, void*> free_blocks_;  // by size
  size_t kept_bytes_ = 0;
};

at::Tensor scratch_cpu(c10::IntArrayRef sizes, const at::TensorOptions& options) {
  return ScratchPool::instance().take(sizes, options);
}

// Note [A window's gradients outlive it]: the last backward window's GEMM results, shared by
// every thread, released when the next window's arrive. Results of more than
// kKeptWindowResultsBytes are not kept.
void keep_window_results_cpu(std::vector<at::Tensor> results) {
  constexpr size_t kKeptWindowResultsBytes = size_t(128) << 20;
  struct Kept {
    std::mutex mutex;
    std::vector<at::Tensor> results;
  };
  // Never destroyed: the tensors are freed at exit by the system, not during static destruction.
  static Kept* kept = new Kept();
  size_t bytes = 0;
  for (const at::Tensor& result : results) {
    bytes += result.storage().nbytes();
  }
  if (bytes > kKeptWindowResultsBytes) {
    results.clear();
  }
  // The previous results are freed here, after the lock is released.
  std::vector<at::Tensor> previous;
  {
    std::lock_guard<std::mutex> lock(kept->mutex);
    previous = std::exchange(kept->results, std::move(results));
  }
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
    .keep_window_results = keep_window_results_cpu,
    .fused_forward = fused_forward_cpu,
    .fused_forward_pays = fused_forward_pays_cpu,
    .onednn_gemms = true,
    .images_per_thread = true,
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
