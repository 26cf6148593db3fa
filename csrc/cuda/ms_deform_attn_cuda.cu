// CUDA launchers of multi-scale deformable attention (common/ms_deform_attn_kernel.cuh), on the
// current stream, int64 indices.
//
// The work is split into items, the (image, query, head) triples of the batch, numbered
// (n * Lq + q) * M + m, which is also where an item's D channels lie in the output. As in the
// DCNv3 kernels (dcnv3_cuda.cu), an item gets `lanes` consecutive threads of one warp, lane l
// taking the vectors of kVector channels l, l + lanes, ... (a pass each): 16 bytes of the dtype
// in the forward, 16 bytes of the float32 sums in the backward, where the head's channels and
// the tensors' alignment allow, else one channel. An item's lanes locate its samples
// once, in shared memory (StagedSample), in rounds of as many as fit, lane l the samples l,
// l + lanes, ...: each sample's position, corner weights (the attention weight folded in) and
// its cell's place in value are computed once, not once per channel vector. The backward
// computes the value gradient (atomic adds of 16-byte vectors, scatter_add_run) and the
// location and attention-weight gradients (dot products of the output's gradient with the
// corners' values, summed over the item's lanes by warp shuffles and written by lane 0) in one
// kernel. Under deterministic mode the kernel records each sample's corners instead of adding
// them, and the value gradient is gathered from that map (Note [Gathered input gradients]).

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <type_traits>

#include "../common/bilinear_sampling.cuh"
#include "../common/ms_deform_attn_kernel.cuh"
#include "../core/ms_deform_attn.h"
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

// A located sample, its cell's top-left corner as a pixel row of value (the level's start
// included), and the elements from a cell's top row to its bottom row (the level's width in
// pixels).
template <typename opmath_t>
struct StagedSample {
  SharedSample<opmath_t> sample;
  int64_t row_step;
};

template <typename opmath_t>
constexpr int64_t kStagedSamplesPerBlock = kStagedPerBlock<StagedSample<opmath_t>>;

// The names of the launchers' paths.
constexpr LanePathNames kMsDeformAttnPaths{
    "ms_deform_attn.cuda.channels.vectors", "ms_deform_attn.cuda.channels.one_at_a_time",
    "ms_deform_attn.cuda.channels.several_passes", "ms_deform_attn.cuda.samples.several_rounds"};

// Element of channel 0 of an item's head at grid pixel 0 of its image.
__device__ inline int64_t head_start_of_item(const MsDeformAttnGeometry& g, int64_t item) {
  return ms_deform_attn_head_start(g, item / (g.queries * g.heads), item % g.heads);
}

// With softmax, the normaliser of an item's logits, its lanes taking the samples lane,
// lane + lanes, ...; without, nothing to compute. Every thread of the warp calls it.
template <typename scalar_t>
__device__ inline SoftmaxNormaliser<opmath_type<scalar_t>> item_normaliser(
    const MsDeformAttnGeometry& g, const LaneTiling& t, int lane, bool active_item, int64_t item,
    const scalar_t* weights) {
  using opmath_t = opmath_type<scalar_t>;
  if (!g.softmax) {
    return {opmath_t(0), opmath_t(1)};
  }
  const int64_t samples = g.head_samples();
  const auto share = SoftmaxNormaliser<opmath_t>::of(weights + item * samples, lane,
                                                     active_item ? samples : 0, t.lanes);
  const opmath_t largest = max_over_lanes(share.largest, t.lanes);
  return {largest, sum_over_lanes(share.sum_relative_to(largest), t.lanes)};
}

// The weight of a sample whose attention weight (softmax's logit) is `given`.
template <typename scalar_t>
__device__ inline opmath_type<scalar_t> attention_of(
    const MsDeformAttnGeometry& g, const SoftmaxNormaliser<opmath_type<scalar_t>>& normaliser,
    scalar_t given) {
  const auto weight = static_cast<opmath_type<scalar_t>>(given);
  return g.softmax ? normaliser.weight(weight) : weight;
}

// Stages the round of an item's samples that starts at first_sample into its slots `samples`
// (stage_item_samples). Returns the round's number of samples. Every thread of the warp calls
// it.
template <typename scalar_t>
__device__ inline int stage_round(const MsDeformAttnGeometry& g, const LaneTiling& t, int lane,
                                  bool active_item, int64_t item, const int64_t* shapes,
                                  const int64_t* starts, int64_t first_sample,
                                  const scalar_t* locations, const scalar_t* weights,
                                  const SoftmaxNormaliser<opmath_type<scalar_t>>& normaliser,
                                  StagedSample<opmath_type<scalar_t>>* samples) {
  using opmath_t = opmath_type<scalar_t>;
  const int64_t first_index = item * g.head_samples() + first_sample;
  return stage_item_samples(t, lane, active_item, g.head_samples() - first_sample, samples,
                            [&](int k) {
    const int64_t index = first_index + k;
    const int64_t l = g.level_of(first_sample + k);
    MsDeformAttnLevel level{shapes[2 * l], shapes[2 * l + 1], starts[l]};
    const bool fits = ms_deform_attn_level_fits(level, g.spatial);
    if (!fits) {
      level = {1, 1, 0};
    }
    opmath_t y, x;
    ms_deform_attn_sample_position(g, locations[2 * index], locations[2 * index + 1], level, y,
                                   x);
    if (!fits) {
      // Outside (-1, 1) x (-1, 1): no corner is read, and the sample has no gradients.
      y = x = opmath_t(-2);
    }
    StagedSample<opmath_t> located;
    located.sample = share_sample(y, x, attention_of(g, normaliser, weights[index]),
                                  level.height, level.width);
    located.sample.top_left += level.start;
    located.row_step = level.width * g.pixel_stride();
    return located;
  });
}

// Element offsets of a staged sample's corners from its top-left one (corners_inside's order).
template <typename opmath_t>
__device__ inline void corner_offsets(const StagedSample<opmath_t>& s, int64_t pixel_stride,
                                      int64_t offset[4]) {
  offset[0] = 0;
  offset[1] = pixel_stride;
  offset[2] = s.row_step;
  offset[3] = s.row_step + pixel_stride;
}

template <typename scalar_t, int kVector>
__global__ void ms_deform_attn_forward_kernel(MsDeformAttnGeometry g, LaneTiling t,
                                              const int64_t* shapes, const int64_t* starts,
                                              const scalar_t* value, const scalar_t* locations,
                                              const scalar_t* weights, scalar_t* output) {
  using opmath_t = opmath_type<scalar_t>;
  __shared__ StagedSample<opmath_t> staged[kStagedSamplesPerBlock<opmath_t>];
  const int slot = threadIdx.x / t.lanes;
  const int lane = threadIdx.x % t.lanes;
  StagedSample<opmath_t>* const samples = staged + slot * t.samples_per_round;
  const int64_t pixel_stride = g.pixel_stride();
  // Every thread runs every round of its warp, active or not: staging a round holds barriers.
  for (int64_t first_item = int64_t(blockIdx.x) * t.items_per_block; first_item < t.items;
       first_item += int64_t(gridDim.x) * t.items_per_block) {
    const int64_t item = first_item + slot;
    const bool active_item = item < t.items;
    const auto normaliser = item_normaliser(g, t, lane, active_item, item, weights);
    for (int64_t pass = 0; pass < t.passes; ++pass) {
      const int64_t vector = pass * t.lanes + lane;
      const bool active = active_item && vector < t.vectors;
      const scalar_t* channels =
          active ? value + head_start_of_item(g, item) + vector * kVector : value;
      opmath_t sum[kVector] = {};
      for (int64_t first = 0; first < g.head_samples(); first += t.samples_per_round) {
        const int count = stage_round(g, t, lane, active_item, item, shapes, starts, first,
                                      locations, weights, normaliser, samples);
        if (!active) {
          continue;
        }
        for (int k = 0; k < count; ++k) {
          const StagedSample<opmath_t> s = samples[k];
          int64_t offset[4];
          corner_offsets(s, pixel_stride, offset);
          const scalar_t* top_left = channels + s.sample.top_left * pixel_stride;
          for (int corner = 0; corner < 4; ++corner) {
            // A corner of zero weight is not read: an infinite value there cannot make NaN.
            const opmath_t weight = s.sample.weight[corner];
            if (weight != opmath_t(0)) {
              const auto read = load_vector<scalar_t, kVector>(top_left + offset[corner]);
              for (int e = 0; e < kVector; ++e) {
                sum[e] += weight * static_cast<opmath_t>(read.value[e]);
              }
            }
          }
        }
      }
      if (active) {
        ChannelVector<scalar_t, kVector> result;
        for (int e = 0; e < kVector; ++e) {
          result.value[e] = static_cast<scalar_t>(sum[e]);
        }
        store_vector(output + item * g.channels + vector * kVector, result);
      }
    }
  }
}

// grad_sums (the value gradient's sums, opmath_type), grad_locations and grad_weights are
// null where not asked for. In the kGathered instance (of its own, so that the atomic one keeps
// its registers) the value gradient is recorded in `entries` and gathered after the kernel
// instead: sample item * L * P + l * P + p of the launch. With softmax and grad_weights,
// weight_grads (grad_weights itself where it is opmath_type) takes the gradients g_s of the
// normalised weights, from which lane 0 computes the logits' once the item's samples are done
// (SoftmaxNormaliser).
template <typename scalar_t, int kVector, bool kGathered>
__global__ void ms_deform_attn_backward_kernel(MsDeformAttnGeometry g, LaneTiling t,
                                               const int64_t* shapes, const int64_t* starts,
                                               const scalar_t* grad_output, const scalar_t* value,
                                               const scalar_t* locations, const scalar_t* weights,
                                               opmath_type<scalar_t>* grad_sums,
                                               CornerEntries<opmath_type<scalar_t>> entries,
                                               scalar_t* grad_locations, scalar_t* grad_weights,
                                               opmath_type<scalar_t>* weight_grads) {
  using opmath_t = opmath_type<scalar_t>;
  __shared__ StagedSample<opmath_t> staged[kStagedSamplesPerBlock<opmath_t>];
  const bool position_grads = grad_locations != nullptr || grad_weights != nullptr;
  const int slot = threadIdx.x / t.lanes;
  const int lane = threadIdx.x % t.lanes;
  StagedSample<opmath_t>* const samples = staged + slot * t.samples_per_round;
  const int64_t pixel_stride = g.pixel_stride();
  for (int64_t first_item = int64_t(blockIdx.x) * t.items_per_block; first_item < t.items;
       first_item += int64_t(gridDim.x) * t.items_per_block) {
    const int64_t item = first_item + slot;
    const bool active_item = item < t.items;
    const int64_t head_start = active_item ? head_start_of_item(g, item) : 0;
    const auto normaliser = item_normaliser(g, t, lane, active_item, item, weights);
    // With softmax, the sum of a_s g_s over the item's samples, in lane 0.
    opmath_t weighted_sum = 0;
    for (int64_t first = 0; first < g.head_samples(); first += t.samples_per_round) {
      const int count = stage_round(g, t, lane, active_item, item, shapes, starts, first,
                                    locations, weights, normaliser, samples);
      for (int k = 0; k < count; ++k) {
        // The dot products of the output's gradient with each corner's values (0 outside).
        opmath_t dots[4] = {0, 0, 0, 0};
        if (active_item) {
          // In registers: the sample's fields are read once, not once per corner and pass.
          const StagedSample<opmath_t> s = samples[k];
          int64_t offset[4];
          corner_offsets(s, pixel_stride, offset);
          const int64_t top_left = head_start + s.sample.top_left * pixel_stride;
          for (int64_t pass = 0; pass < t.passes; ++pass) {
            const int64_t vector = pass * t.lanes + lane;
            if (vector >= t.vectors) {
              continue;
            }
            const auto grad_read = load_vector<scalar_t, kVector>(
                grad_output + item * g.channels + vector * kVector);
            opmath_t grad[kVector];
            for (int e = 0; e < kVector; ++e) {
              grad[e] = static_cast<opmath_t>(grad_read.value[e]);
            }
            for (int corner = 0; corner < 4; ++corner) {
              const int64_t at = top_left + offset[corner] + vector * kVector;
              const opmath_t weight = s.sample.weight[corner];
              if constexpr (kGathered) {
                if (vector == 0 && weight != opmath_t(0)) {
                  entries.record(item * g.head_samples() + first + k, corner, weight, at,
                                 item * g.channels);
                }
              } else if (grad_sums != nullptr && weight != opmath_t(0)) {
                opmath_t weighted[kVector];
                for (int e = 0; e < kVector; ++e) {
                  weighted[e] = weight * grad[e];
                }
                scatter_add_run<kVector>(grad_sums + at, weighted);
              }
              if (position_grads && (s.sample.corners >> corner & 1)) {
                const auto read = load_vector<scalar_t, kVector>(value + at);
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
            const StagedSample<opmath_t>& s = samples[k];
            const int64_t sample = first + k;
            const int64_t index = item * g.head_samples() + sample;
            const int64_t l = g.level_of(sample);
            // Outside its level (no corner inside) a sample has no gradients; a nearest
            // pixel's location none either (a step function of it).
            const bool inside = s.sample.corners != 0;
            const bool moves = inside && !g.nearest;
            const OffsetMaskGradSums<opmath_t> sums = offset_mask_grad_sums_of_dots(
                s.sample.ly, s.sample.lx, dots[0], dots[1], dots[2], dots[3]);
            if (grad_locations != nullptr) {
              // The position is loc * W - 0.5: d/d(loc_x) = W d/dx.
              const opmath_t attention = s.sample.mask;
              grad_locations[2 * index] = static_cast<scalar_t>(
                  moves ? attention * sums.x * static_cast<opmath_t>(shapes[2 * l + 1]) : 0);
              grad_locations[2 * index + 1] = static_cast<scalar_t>(
                  moves ? attention * sums.y * static_cast<opmath_t>(shapes[2 * l]) : 0);
            }
            if (grad_weights != nullptr) {
              const opmath_t gradient = inside ? sums.m : opmath_t(0);
              if (g.softmax) {
                weight_grads[index] = gradient;
                weighted_sum += s.sample.mask * gradient;
              } else {
                grad_weights[index] = static_cast<scalar_t>(gradient);
              }
            }
          }
        }
      }
    }
    if (g.softmax && grad_weights != nullptr && active_item && lane == 0) {
      // dL/dz_s = a_s (g_s - sum over s' of a_s' g_s'), from the g_s this thread wrote.
      for (int64_t sample = 0; sample < g.head_samples(); ++sample) {
        const int64_t index = item * g.head_samples() + sample;
        const opmath_t attention = attention_of(g, normaliser, weights[index]);
        grad_weights[index] =
            static_cast<scalar_t>(attention * (weight_grads[index] - weighted_sum));
      }
    }
  }
}

void ms_deform_attn_forward_cuda(const MsDeformAttnGeometry& g, const Tensor& value,
                                 const Tensor& spatial_shapes, const Tensor& level_start_index,
                                 const Tensor& sampling_locations, const Tensor& attention_weights,
                                 Tensor& output) {
  DEFORMCONV_DISPATCH(value.scalar_type(), "ms_deform_attn_forward_cuda", [&] {
    with_channel_vectors<16 / sizeof(scalar_t)>(
        g.batch * g.queries * g.heads, g.channels, g.channels, g.head_samples(),
        kStagedSamplesPerBlock<opmath_type<scalar_t>>, {&value, &output}, kMsDeformAttnPaths,
        [&](auto width, auto t) {
          auto* kernel = ms_deform_attn_forward_kernel<scalar_t, decltype(width)::value>;
          DEFORMCONV_LAUNCH(kernel, blocks_of(t), kThreadsPerBlock,
                            current_cuda_stream())(
              g, t, spatial_shapes.const_data_ptr<int64_t>(),
              level_start_index.const_data_ptr<int64_t>(), value.const_data_ptr<scalar_t>(),
              sampling_locations.const_data_ptr<scalar_t>(),
              attention_weights.const_data_ptr<scalar_t>(), output.mutable_data_ptr<scalar_t>());
          DEFORMCONV_CHECK_LAUNCH();
        });
  });
}

void ms_deform_attn_gradients_cuda(const MsDeformAttnGeometry& g, const Tensor& grad_output,
                                   const Tensor& value, const Tensor& spatial_shapes,
                                   const Tensor& level_start_index,
                                   const Tensor& sampling_locations,
                                   const Tensor& attention_weights, Tensor& grad_value,
                                   Tensor& grad_sampling_locations, Tensor& grad_attention_weights,
                                   bool deterministic) {
  const bool gathered = grad_value.defined() && deterministic;
  if (gathered &&
      gather_in_image_chunks(
          g.batch, g.queries * g.heads * g.head_samples(), g.spatial * g.heads,
          value.scalar_type(),
          "ms_deform_attn.cuda.backward.value_gradient.image_chunks",
          [&](int64_t first, int64_t count) {
            MsDeformAttnGeometry chunk = g;
            chunk.batch = count;
            Tensor grad_value_chunk = narrow_images(grad_value, first, count);
            Tensor grad_locations_chunk = narrow_images(grad_sampling_locations, first, count);
            Tensor grad_weights_chunk = narrow_images(grad_attention_weights, first, count);
            ms_deform_attn_gradients_cuda(
                chunk, narrow_images(grad_output, first, count), narrow_images(value, first, count),
                spatial_shapes, level_start_index, narrow_images(sampling_locations, first, count),
                narrow_images(attention_weights, first, count), grad_value_chunk,
                grad_locations_chunk, grad_weights_chunk, true);
          })) {
    return;
  }
  if (grad_value.defined()) {
    record_branch("ms_deform_attn.cuda.backward.value_gradient");
    record_branch(gathered ? "ms_deform_attn.cuda.backward.value_gradient.gathered"
                           : "ms_deform_attn.cuda.backward.value_gradient.atomic_adds");
  }
  if (grad_sampling_locations.defined() || grad_attention_weights.defined()) {
    record_branch("ms_deform_attn.cuda.backward.location_weight_gradients");
  }
  DEFORMCONV_DISPATCH(value.scalar_type(), "ms_deform_attn_backward_cuda", [&] {
    using opmath_t = opmath_type<scalar_t>;
    // Note [Input gradient sums in float32]
    Tensor sums;
    if (grad_value.defined()) {
      sums = uninitialised_input_gradient_sums<scalar_t>(grad_value);
      torch::stable::zero_(sums);
    }
    // The sums too: vectors of them are added in one atomic (scatter_add_run).
    const Tensor& sums_or_value = sums.defined() ? sums : value;
    // The gradients of softmax's normalised weights, before the logits'.
    Tensor weight_grads;
    if (g.softmax && grad_attention_weights.defined()) {
      weight_grads = uninitialised_input_gradient_sums<scalar_t>(grad_attention_weights);
    }
    with_channel_vectors<16 / sizeof(opmath_t)>(
        g.batch * g.queries * g.heads, g.channels, g.channels, g.head_samples(),
        kStagedSamplesPerBlock<opmath_t>, {&grad_output, &value, &sums_or_value},
        kMsDeformAttnPaths, [&](auto width, auto t) {
          // Rows of the map: (image, pixel of value, head), of the head's channels.
          std::optional<GatheredInputGradient<scalar_t>> gather;
          if (gathered) {
            gather.emplace(grad_output, t.items * g.head_samples(), g.batch * g.spatial * g.heads,
                           g.channels);
          }
          constexpr int kVector = decltype(width)::value;
          auto* kernel = gathered ? ms_deform_attn_backward_kernel<scalar_t, kVector, true>
                                  : ms_deform_attn_backward_kernel<scalar_t, kVector, false>;
          DEFORMCONV_LAUNCH(kernel, blocks_of(t), kThreadsPerBlock, current_cuda_stream())(
              g, t, spatial_shapes.const_data_ptr<int64_t>(),
              level_start_index.const_data_ptr<int64_t>(), grad_output.const_data_ptr<scalar_t>(),
              value.const_data_ptr<scalar_t>(), sampling_locations.const_data_ptr<scalar_t>(),
              attention_weights.const_data_ptr<scalar_t>(),
              sums.defined() && !gathered ? sums.mutable_data_ptr<opmath_t>() : nullptr,
              gather ? gather->entries() : CornerEntries<opmath_t>{},
              mutable_data_or_null<scalar_t>(grad_sampling_locations),
              mutable_data_or_null<scalar_t>(grad_attention_weights),
              mutable_data_or_null<opmath_t>(weight_grads));
          DEFORMCONV_CHECK_LAUNCH();
          if (gather) {
            gather->add_to(sums);
          }
        });
    if (grad_value.defined()) {
      store_input_gradient_sums(sums, grad_value);
    }
  });
}

const MsDeformAttnLaunchers& ms_deform_attn_cuda_launchers() {
  static const MsDeformAttnLaunchers launchers{
      .forward = ms_deform_attn_forward_cuda,
      .gradients = ms_deform_attn_gradients_cuda,
  };
  return launchers;
}

}  // namespace

// The kernels at the CUDA key: the drivers with these launchers. The test suite's emulation
// build, which compiles this file as C++, registers them under its own namespace.
#if !defined(DEFORMCONV_CUDA_EMULATION)
STABLE_TORCH_LIBRARY_IMPL(deformconv, CUDA, m) {
  register_device_kernels<MsDeformAttnOp, CudaDevice, ms_deform_attn_forward,
                          ms_deform_attn_backward, ms_deform_attn_cuda_launchers>(m);
}
#endif

}  // namespace deformconv
