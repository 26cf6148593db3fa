// Multi-scale deformable attention on the CPU (common/ms_deform_attn_kernel.cuh): the forward
// in tasks of queries, the gradients in tasks of (image, head), each owning its head's share of
// the value gradient, so that every sum is made in the same order whatever the threads. A
// head's D channels are contiguous in value, the output and their gradients: the channel loops
// are the innermost, and the compiler vectorises them.

#if !defined(DEFORMCONV_CPU_COPY)  // the head (Note [CPU copies], cpu_copies.h)

#include <torch/csrc/stable/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "../common/bilinear_sampling.cuh"
#include "../core/ms_deform_attn.h"
#include "../infrastructure/device_kernels.h"
#include "../infrastructure/dtype_dispatch.h"
#include "../infrastructure/input_gradient_sums.h"
#include "../infrastructure/optional_data.h"
#include "../infrastructure/parallel_region.h"
#include "cpu_launchers.h"
#include "cpu_loops.h"
#include "located_samples.h"
#include "sample_gradients.h"
#include "vector_exp.h"

#define DEFORMCONV_CPU_COPY_BODY "ms_deform_attn_cpu.cpp"
#include "cpu_copies.h"

// The kernels at the CPU key: the drivers with the launchers of the copy in use.
namespace deformconv {
namespace {

const MsDeformAttnLaunchers& ms_deform_attn_cpu_launchers_in_use() {
  return DEFORMCONV_CPU_LAUNCHERS_IN_USE(ms_deform_attn_cpu_launchers);
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(deformconv, CPU, m) {
  register_device_kernels<MsDeformAttnOp, CpuDevice, ms_deform_attn_forward,
                          ms_deform_attn_backward, ms_deform_attn_cpu_launchers_in_use>(m);
}

}  // namespace deformconv

#else  // the body, once per copy

namespace deformconv::DEFORMCONV_CPU_COPY {
namespace {

std::vector<MsDeformAttnLevel> levels_of(const MsDeformAttnGeometry& g,
                                         const Tensor& spatial_shapes,
                                         const Tensor& level_start_index) {
  const int64_t* shape = spatial_shapes.const_data_ptr<int64_t>();
  const int64_t* start = level_start_index.const_data_ptr<int64_t>();
  std::vector<MsDeformAttnLevel> levels(g.levels);
  for (int64_t l = 0; l < g.levels; ++l) {
    levels[l] = {shape[2 * l], shape[2 * l + 1], start[l]};
  }
  return levels;
}

// Samples located level by level at once: one LocatedSamples per level, whose sample
// j = group * P_l + p is point p of a group (P_l the level's points; the forward's groups are a
// query's heads, the backward's a run of queries of one head). A sample's position
//   x = loc_x * W_l - 0.5 = base -0.5 + (grid 0 + offset loc_x * W_l) * scale 1
// (and likewise y) is LocatedSamples' form, weighted by its attention weight. The samples are
// padded to whole vectors: those past the groups of a locate (zeros, or what an earlier locate
// left there) are located with the rest and never read.
template <typename opmath_t>
class LevelSamples {
 public:
  LevelSamples(const MsDeformAttnGeometry& g, const MsDeformAttnLevel* levels, int64_t groups) {
    for (int64_t l = 0; l < g.levels; ++l) {
      per_level_.push_back(padded(groups * g.level_points(l)));
      located_.emplace_back(per_level_.back(), levels[l].height, levels[l].width);
    }
  }

  // Locates `groups` groups; sample_index(group, l, p) is the index of point p of `group` in
  // level l among the op's samples, and weight_of(group, s, index) the attention weight of the
  // group's sample s = first_sample(l) + p of that index.
  template <typename scalar_t, typename SampleIndex, typename WeightOf>
  DEFORMCONV_INLINE void locate(const MsDeformAttnGeometry& g, const MsDeformAttnLevel* levels,
                                const scalar_t* locations, int64_t groups,
                                const SampleIndex& sample_index, const WeightOf& weight_of) {
    for (int64_t l = 0; l < g.levels; ++l) {
      LocatedSamples<opmath_t>& level = located_[l];
      const opmath_t height = static_cast<opmath_t>(levels[l].height);
      const opmath_t width = static_cast<opmath_t>(levels[l].width);
      const int64_t points = g.level_points(l);
      for (int64_t group = 0; group < groups; ++group) {
        for (int64_t p = 0; p < points; ++p) {
          const int64_t sample = sample_index(group, l, p);
          const int64_t j = group * points + p;
          if (g.nearest) {
            level.dx[j] = static_cast<opmath_t>(
                ms_deform_attn_nearest_pixel(locations[2 * sample], levels[l].width));
            level.dy[j] = static_cast<opmath_t>(
                ms_deform_attn_nearest_pixel(locations[2 * sample + 1], levels[l].height));
          } else {
            level.dx[j] = static_cast<opmath_t>(locations[2 * sample]) * width;
            level.dy[j] = static_cast<opmath_t>(locations[2 * sample + 1]) * height;
          }
          level.m[j] = weight_of(group, g.first_sample(l) + p, sample);
        }
      }
      // Bilinear: x = loc_x * W - 0.5; nearest: the pixel itself.
      const opmath_t base = g.nearest ? opmath_t(0) : opmath_t(-0.5);
      level.locate(per_level_[l], base, base, opmath_t(1));
    }
  }

  DEFORMCONV_INLINE const LocatedSamples<opmath_t>& level(int64_t l) const {
    return located_[l];
  }

 private:
  static int64_t padded(int64_t samples) {
    // Whole vectors of the widest copy (16 floats), which are whole kLanes too.
    constexpr int64_t kWidest = 16;
    return (samples + kWidest - 1) / kWidest * kWidest;
  }

  std::vector<int64_t> per_level_;
  std::vector<LocatedSamples<opmath_t>> located_;
};

// With softmax, the normalised weights of the (query, head)s whose logits start at
// logits + (first + k * step) * samples, k < count, into normalised[k * samples + s]
// (SoftmaxNormaliser's): the exponentials of all count * samples in one vectorised loop.
template <typename scalar_t>
DEFORMCONV_INLINE void normalise_logits(const scalar_t* logits, int64_t samples, int64_t count,
                                        int64_t first, int64_t step,
                                        opmath_type<scalar_t>* normalised) {
  using opmath_t = opmath_type<scalar_t>;
  for (int64_t k = 0; k < count; ++k) {
    const scalar_t* head = logits + (first + k * step) * samples;
    opmath_t* out = normalised + k * samples;
    opmath_t largest = -std::numeric_limits<opmath_t>::infinity();
    for (int64_t s = 0; s < samples; ++s) {
      const opmath_t logit = static_cast<opmath_t>(head[s]);
      largest = logit > largest ? logit : largest;
    }
    for (int64_t s = 0; s < samples; ++s) {
      out[s] = static_cast<opmath_t>(head[s]) - largest;
    }
  }
  for (int64_t i = 0; i < count * samples; ++i) {
    normalised[i] = vectorisable_exp(normalised[i]);
  }
  for (int64_t k = 0; k < count; ++k) {
    opmath_t* out = normalised + k * samples;
    opmath_t sum = 0;
    for (int64_t s = 0; s < samples; ++s) {
      sum += out[s];
    }
    for (int64_t s = 0; s < samples; ++s) {
      out[s] /= sum;
    }
  }
}

// The outputs of queries [begin, end), numbered n * Lq + q, every head: the query's samples
// located at once, then each head's D channels summed over its samples, four corner rows a
// sample, into `sum` (a buffer of D). With softmax, `normalised` holds a query's M * samples
// weights.
template <typename scalar_t>
void forward_queries(const MsDeformAttnGeometry& g, const MsDeformAttnLevel* levels,
                     const scalar_t* value, const scalar_t* locations, const scalar_t* weights,
                     scalar_t* output, const scalar_t* zeros,
                     LevelSamples<opmath_type<scalar_t>>& samples, opmath_type<scalar_t>* sum,
                     opmath_type<scalar_t>* normalised, int64_t begin, int64_t end) {
  using opmath_t = opmath_type<scalar_t>;
  const int64_t D = g.channels;
  const int64_t S = g.head_samples();
  for (int64_t task = begin; task < end; ++task) {
    const int64_t n = task / g.queries, q = task % g.queries;
    if (g.softmax) {
      normalise_logits(weights, S, g.heads, task * g.heads, 1, normalised);
    }
    samples.locate(
        g, levels, locations, g.heads,
        [&](int64_t m, int64_t l, int64_t p) DEFORMCONV_INLINE_LAMBDA {
          return ms_deform_attn_sample_index(g, n, q, m, g.first_sample(l) + p);
        },
        [&](int64_t m, int64_t s, int64_t sample) DEFORMCONV_INLINE_LAMBDA {
          return g.softmax ? normalised[m * S + s] : static_cast<opmath_t>(weights[sample]);
        });
    for (int64_t m = 0; m < g.heads; ++m) {
      std::fill_n(sum, D, opmath_t(0));
      const scalar_t* head = value + ms_deform_attn_head_start(g, n, m);
      for (int64_t l = 0; l < g.levels; ++l) {
        const scalar_t* level_pixels = head + levels[l].start * g.pixel_stride();
        const int64_t points = g.level_points(l);
        for (int64_t p = 0; p < points; ++p) {
          opmath_t w[4];
          const scalar_t* rows[4];
          samples.level(l).corner_rows(m * points + p, level_pixels, g.pixel_stride(), zeros, w,
                                       rows);
          for (int64_t c = 0; c < D; ++c) {
            sum[c] += w[0] * static_cast<opmath_t>(rows[0][c]) +
                w[1] * static_cast<opmath_t>(rows[1][c]) +
                w[2] * static_cast<opmath_t>(rows[2][c]) +
                w[3] * static_cast<opmath_t>(rows[3][c]);
          }
        }
      }
      scalar_t* out = output + ms_deform_attn_output_start(g, n, q, m);
      for (int64_t c = 0; c < D; ++c) {
        out[c] = static_cast<scalar_t>(sum[c]);
      }
    }
  }
}

void ms_deform_attn_forward_cpu(const MsDeformAttnGeometry& g, const Tensor& value,
                                const Tensor& spatial_shapes, const Tensor& level_start_index,
                                const Tensor& sampling_locations, const Tensor& attention_weights,
                                Tensor& output) {
  const std::vector<MsDeformAttnLevel> levels = levels_of(g, spatial_shapes, level_start_index);
  DEFORMCONV_DISPATCH(value.scalar_type(), "ms_deform_attn_forward_cpu", [&] {
    using opmath_t = opmath_type<scalar_t>;
    const std::vector<scalar_t> zeros(g.channels, scalar_t(0));
    parallel_task_runs(g.batch * g.queries, [&](TaskRuns& runs) {
      LevelSamples<opmath_t> samples(g, levels.data(), g.heads);
      std::vector<opmath_t> sum(g.channels);
      std::vector<opmath_t> normalised(g.softmax ? g.heads * g.head_samples() : 0);
      int64_t begin, end;
      while (runs.take(begin, end)) {
        forward_queries<scalar_t>(g, levels.data(), value.const_data_ptr<scalar_t>(),
                                  sampling_locations.const_data_ptr<scalar_t>(),
                                  attention_weights.const_data_ptr<scalar_t>(),
                                  output.mutable_data_ptr<scalar_t>(), zeros.data(), samples,
                                  sum.data(), normalised.data(), begin, end);
      }
    });
  });
}

// Queries per LevelSamples in the backward: the most points of a level, of this many queries,
// fill a vector of 16 floats (P = 4).
inline int64_t backward_queries_per_locate(const MsDeformAttnGeometry& g) {
  int64_t most = 1;
  for (int64_t l = 0; l < g.levels; ++l) {
    most = std::max(most, g.level_points(l));
  }
  return std::max<int64_t>(1, 16 / most);
}

// The gradients of the samples of heads [begin, end), numbered n * M + m, the samples of a run
// of queries located at once (`samples`, whose groups are the queries of the run). grad_sums (the
// value gradient's sums, opmath_type) and grad_locations, grad_weights are null where not
// asked for. `grad` is a buffer of D rounded up to whole lanes, its tail zero; `zeros` is a row
// of D zeros, the corner rows of the dot products for corners outside the level; `unread` a row
// of D that is never read, which takes the scatter of corners of weight 0, so that 0 times an
// infinite output gradient adds no NaN to the value gradient. With softmax, `normalised` holds a
// run's weights (its queries' samples in turn) and `weight_grads` one query's gradients of them
// (g_s of SoftmaxNormaliser), from which its logits' gradients follow.
template <int kVectorBytes, typename scalar_t>
void backward_heads(
    const MsDeformAttnGeometry& g, const MsDeformAttnLevel* levels, const scalar_t* grad_output,
    const scalar_t* value, const scalar_t* locations, const scalar_t* weights,
    opmath_type<scalar_t>* grad_sums, scalar_t* grad_locations, scalar_t* grad_weights,
    LevelSamples<opmath_type<scalar_t>>& samples, opmath_type<scalar_t>* grad,
    const scalar_t* zeros, opmath_type<scalar_t>* unread, opmath_type<scalar_t>* normalised,
    opmath_type<scalar_t>* weight_grads, int64_t begin, int64_t end) {
  using opmath_t = opmath_type<scalar_t>;
  const int64_t D = g.channels;
  const int64_t S = g.head_samples();
  const int64_t stride = g.pixel_stride();
  const int64_t run = backward_queries_per_locate(g);
  const bool position_grads = grad_locations != nullptr || grad_weights != nullptr;
  for (int64_t task = begin; task < end; ++task) {
    const int64_t n = task / g.heads, m = task % g.heads;
    const int64_t head_start = ms_deform_attn_head_start(g, n, m);
    const scalar_t* head = value + head_start;
    opmath_t* grad_head = grad_sums == nullptr ? nullptr : grad_sums + head_start;
    if (grad_head != nullptr) {
      // This head's value gradient, which no other task writes.
      for (int64_t pixel = 0; pixel < g.spatial; ++pixel) {
        std::fill_n(grad_head + pixel * stride, D, opmath_t(0));
      }
    }
    for (int64_t first = 0; first < g.queries; first += run) {
      const int64_t queries = std::min(run, g.queries - first);
      if (g.softmax) {
        normalise_logits(weights, S, queries, (n * g.queries + first) * g.heads + m, g.heads,
                         normalised);
      }
      samples.locate(
          g, levels, locations, queries,
          [&](int64_t b, int64_t l, int64_t p) DEFORMCONV_INLINE_LAMBDA {
            return ms_deform_attn_sample_index(g, n, first + b, m, g.first_sample(l) + p);
          },
          [&](int64_t b, int64_t s, int64_t sample) DEFORMCONV_INLINE_LAMBDA {
            return g.softmax ? normalised[b * S + s] : static_cast<opmath_t>(weights[sample]);
          });
      for (int64_t b = 0; b < queries; ++b) {
        const scalar_t* grad_query =
            grad_output + ms_deform_attn_output_start(g, n, first + b, m);
        for (int64_t c = 0; c < D; ++c) {
          grad[c] = static_cast<opmath_t>(grad_query[c]);
        }
        // The gradient of sample s's weight: the weights' own, or with softmax kept for its
        // logits' below.
        const auto weight_gradient = [&](int64_t s, int64_t sample, opmath_t gradient) {
          if (g.softmax) {
            weight_grads[s] = gradient;
          } else {
            grad_weights[sample] = static_cast<scalar_t>(gradient);
          }
        };
        for (int64_t s = 0; s < S; ++s) {
          const int64_t l = g.level_of(s);
          const int64_t sample = ms_deform_attn_sample_index(g, n, first + b, m, s);
          const LocatedSamples<opmath_t>& located = samples.level(l);
          const int64_t j = b * g.level_points(l) + s - g.first_sample(l);
          const BilinearCell<opmath_t> cell = located.cell(j);
          if (!cell.inside) {
            // A sample outside its level reads zeros wherever it moves a little: no gradients.
            if (grad_locations != nullptr) {
              grad_locations[2 * sample] = grad_locations[2 * sample + 1] = scalar_t(0);
            }
            if (grad_weights != nullptr) {
              weight_gradient(s, sample, opmath_t(0));
            }
            continue;
          }
          int64_t row[4];
          located.corner_grid_indices(j, row);
          opmath_t weight[4];
          for (int corner = 0; corner < 4; ++corner) {
            row[corner] += levels[l].start;
            weight[corner] = located.weight(corner, j);
          }
          if (grad_head != nullptr) {
            opmath_t* grad_row[4];
            for (int corner = 0; corner < 4; ++corner) {
              grad_row[corner] =
                  weight[corner] != opmath_t(0) ? grad_head + row[corner] * stride : unread;
            }
            scatter_sample_gradient<kVectorBytes>(grad, D, grad_row, weight);
          }
          if (position_grads) {
            bool inside[4];
            corners_inside(cell, inside);
            const scalar_t* corner_rows[4];
            for (int corner = 0; corner < 4; ++corner) {
              corner_rows[corner] = inside[corner] ? head + row[corner] * stride : zeros;
            }
            opmath_t dot[4];
            corner_dot_products(grad, D, corner_rows, dot);
            // Bilinear's derivatives by x and y, and its value, each summed with the gradient
            // over the channels; the position is loc * W - 0.5, so d/d(loc_x) = W d/dx.
            const OffsetMaskGradSums<opmath_t> sums = offset_mask_grad_sums_of_dots(cell, dot);
            const opmath_t attention = located.mask(j);
            if (grad_locations != nullptr && g.nearest) {
              // A nearest pixel is a step function of the location: no gradient.
              grad_locations[2 * sample] = grad_locations[2 * sample + 1] = scalar_t(0);
            } else if (grad_locations != nullptr) {
              grad_locations[2 * sample] = static_cast<scalar_t>(
                  attention * sums.x * static_cast<opmath_t>(levels[l].width));
              grad_locations[2 * sample + 1] = static_cast<scalar_t>(
                  attention * sums.y * static_cast<opmath_t>(levels[l].height));
            }
            if (grad_weights != nullptr) {
              weight_gradient(s, sample, sums.m);
            }
          }
        }
        if (g.softmax && grad_weights != nullptr) {
          // dL/dz_s = a_s (g_s - sum over s' of a_s' g_s').
          const opmath_t* weight = normalised + b * S;
          opmath_t weighted_sum = 0;
          for (int64_t s = 0; s < S; ++s) {
            weighted_sum += weight[s] * weight_grads[s];
          }
          scalar_t* grad_logits = grad_weights + ms_deform_attn_sample_index(g, n, first + b, m, 0);
          for (int64_t s = 0; s < S; ++s) {
            grad_logits[s] = static_cast<scalar_t>(weight[s] * (weight_grads[s] - weighted_sum));
          }
        }
      }
    }
  }
}

void ms_deform_attn_gradients_cpu(const MsDeformAttnGeometry& g, const Tensor& grad_output,
                                  const Tensor& value, const Tensor& spatial_shapes,
                                  const Tensor& level_start_index, const Tensor& sampling_locations,
                                  const Tensor& attention_weights, Tensor& grad_value,
                                  Tensor& grad_sampling_locations, Tensor& grad_attention_weights,
                                  bool /*deterministic: always*/) {
  const std::vector<MsDeformAttnLevel> levels = levels_of(g, spatial_shapes, level_start_index);
  const int64_t D = g.channels;
  const int64_t whole_lanes = (D + kLanes - 1) / kLanes * kLanes;
  DEFORMCONV_DISPATCH(value.scalar_type(), "ms_deform_attn_gradients_cpu", [&] {
    using opmath_t = opmath_type<scalar_t>;
    // Note [Input gradient sums in float32]
    Tensor sums =
        grad_value.defined() ? uninitialised_input_gradient_sums<scalar_t>(grad_value) : Tensor();
    const std::vector<scalar_t> zeros(D, scalar_t(0));
    // The scatter's vectors as wide as a register of the copy that runs.
    with_register_bytes<kRegisterBytes>([&](auto register_bytes) {
      constexpr int64_t kWidth = register_bytes / sizeof(opmath_t);
      if (grad_value.defined()) {
        record_channel_loops("ms_deform_attn.cpu.scatter", D,
                             {kWidth > kLanes ? kWidth : kLanes, kLanes});
      }
      if (grad_sampling_locations.defined() || grad_attention_weights.defined()) {
        record_channel_loops("ms_deform_attn.cpu.dots", D, {kLanes});
      }
      parallel_task_runs(g.batch * g.heads, [&](TaskRuns& runs) {
        LevelSamples<opmath_t> samples(g, levels.data(), backward_queries_per_locate(g));
        std::vector<opmath_t> grad(whole_lanes, opmath_t(0));
        std::vector<opmath_t> unread(whole_lanes);
        const int64_t softmax_samples = g.softmax ? g.head_samples() : 0;
        std::vector<opmath_t> normalised(backward_queries_per_locate(g) * softmax_samples);
        std::vector<opmath_t> weight_grads(softmax_samples);
        int64_t begin, end;
        while (runs.take(begin, end)) {
          backward_heads<register_bytes, scalar_t>(
              g, levels.data(), grad_output.const_data_ptr<scalar_t>(),
              value.const_data_ptr<scalar_t>(), sampling_locations.const_data_ptr<scalar_t>(),
              attention_weights.const_data_ptr<scalar_t>(),
              mutable_data_or_null<opmath_t>(sums),
              mutable_data_or_null<scalar_t>(grad_sampling_locations),
              mutable_data_or_null<scalar_t>(grad_attention_weights), samples, grad.data(),
              zeros.data(), unread.data(), normalised.data(), weight_grads.data(), begin, end);
        }
      });
    });
    if (grad_value.defined()) {
      store_input_gradient_sums(sums, grad_value);
    }
  });
}

constexpr MsDeformAttnLaunchers kCpuMsDeformAttnLaunchers{
    .forward = ms_deform_attn_forward_cpu,
    .gradients = ms_deform_attn_gradients_cpu,
};

const MsDeformAttnLaunchers& ms_deform_attn_cpu_launchers() { return kCpuMsDeformAttnLaunchers; }

}  // namespace

}  // namespace deformconv::DEFORMCONV_CPU_COPY

#endif
