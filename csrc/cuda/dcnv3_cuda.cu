// CUDA launchers of DCNv3, on the current stream.
//
// The work is split into items, the (output pixel, group) pairs of the batch, numbered
// pixel * G + group, which is also where an item's D channels lie in the output. An item gets
// `lanes` consecutive threads of one warp; lane l takes the vectors of kVector channels
// l, l + lanes, ... of the group (a pass each), kVector channels being 16 bytes (in the
// backward, 16 bytes of its float32 sums: kBackwardVector) where the group's channels and the
// tensors' alignment allow, else 1. Neighbouring lanes read neighbouring
// vectors of a corner pixel, and neighbouring items the next group of the same pixel, so that
// a warp's reads and writes coalesce.
//
// A block holds kThreadsPerBlock / lanes items. Before an item's lanes sample, they locate each
// of its samples of a round of points once, in shared memory (SharedSample), lane l the points
// l, l + lanes, ...: the offsets and the mask are read once, neighbouring lanes reading
// neighbouring points, and the sampling positions and corner weights are computed once per
// sample rather than once per channel vector. What the item's points share (its image, pixel
// and group, its reference point, where its offsets start: Dcnv3ItemStart) each lane computes
// once per item, not once per sample. The item's lanes wait only for one another between
// staging and sampling (a warp's barrier, not a block's). The backward computes the
// input gradient and the offset and mask gradients in one kernel, which reads the output's
// gradient once for both; a sample's offset and mask gradients are dot products over its
// group's channels, summed over the item's lanes with warp shuffles and written by lane 0.
//
// A thread splits an item into image, row, column and group, and a point into kernel column and
// row: each kernel is built twice, dividing by InvariantDivisor (a multiply-high and a shift)
// and indexing the input's and output's elements in 32 bits when every dividend and element
// index of the launch is below 2^31, in int64 otherwise (Dcnv3Divisors, with_divisors).

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "../common/dcnv3_kernel.cuh"
#include "../core/branch_trace.h"
#include "channel_vectors.cuh"
#include "dcnv3_cuda.h"
#include "launch.cuh"

namespace deformconv {
namespace {

template <typename opmath_t>
constexpr int64_t kStagedSamples = kStagedPerBlock<SharedSample<opmath_t>>;

// The names of the launchers' paths.
constexpr LanePathNames kDcnv3Paths{
    "dcnv3.cuda.channels.vectors", "dcnv3.cuda.channels.one_at_a_time",
    "dcnv3.cuda.channels.several_passes", "dcnv3.cuda.points.several_rounds"};

// Channel 0 of an item's group at grid pixel 0 of its image, in a channels-last (N, H, W, G * D)
// tensor.
__device__ inline int64_t group_start(const Dcnv3Geometry& g, const Dcnv3Item& it) {
  return it.n * g.in_pixels() * g.channels() + it.group * g.group_channels;
}

// Stages the round of an item's points that starts at first_point into its slots `samples`
// (stage_item_samples), each point's position from the item's start. Returns the round's
// number of points. Every thread of the warp calls it.
template <typename scalar_t, typename Divisor>
__device__ inline int stage_round(const Dcnv3Geometry& g, const Divisor& kernel_h,
                                  const LaneTiling& t, int lane, bool active_item,
                                  const Dcnv3ItemStart<at::opmath_type<scalar_t>>& start,
                                  int64_t first_point, const scalar_t* offset,
                                  const scalar_t* mask,
                                  SharedSample<at::opmath_type<scalar_t>>* samples) {
  using opmath_t = at::opmath_type<scalar_t>;
  return stage_item_samples(t, lane, active_item, g.points() - first_point, samples,
                            [&](int point) {
    opmath_t y, x, m;
    dcnv3_position(g, kernel_h, start, first_point + point, offset, mask, y, x, m);
    return share_sample(y, x, m, g.height, g.width);
  });
}

// Adds m * bilinear(sample) of kVector channels to `sum`: corners of zero weight are not read,
// so that an infinite value where a sample takes no part cannot make NaN (as
// sample_value_with_plan). `channels` points at the vector's channels of grid pixel 0, and
// `corners` holds the image's corner offsets (corner_steps).
template <typename scalar_t, int kVector, typename index_t>
__device__ inline void add_sample(const SharedSample<at::opmath_type<scalar_t>>& sample,
                                  const scalar_t* channels, index_t pixel_stride,
                                  const CornerSteps<index_t>& corners,
                                  at::opmath_type<scalar_t>* sum) {
  using opmath_t = at::opmath_type<scalar_t>;
  const index_t top_left = static_cast<index_t>(sample.top_left) * pixel_stride;
  opmath_t value[kVector] = {};
  for (int corner = 0; corner < 4; ++corner) {
    const opmath_t weight = sample.weight[corner];
    if (weight != opmath_t(0)) {
      const auto read = load_vector<scalar_t, kVector>(
          channels + (top_left + corners.from_top_left[corner]));
      for (int e = 0; e < kVector; ++e) {
        value[e] += weight * static_cast<opmath_t>(read.value[e]);
      }
    }
  }
  for (int e = 0; e < kVector; ++e) {
    sum[e] += value[e];
  }
}

template <typename scalar_t, int kVector, typename Divisor>
__global__ void dcnv3_forward_kernel(Dcnv3Geometry g, Dcnv3Divisors<Divisor> d, Dcnv3Fields f,
                                     LaneTiling t, const scalar_t* input, const scalar_t* offset,
                                     const scalar_t* mask, scalar_t* output) {
  using opmath_t = at::opmath_type<scalar_t>;
  using index_t = typename Dcnv3Divisors<Divisor>::index_type;
  __shared__ SharedSample<opmath_t> staged[kStagedSamples<opmath_t>];
  const int slot = threadIdx.x / t.lanes;
  const int lane = threadIdx.x % t.lanes;
  SharedSample<opmath_t>* const samples = staged + slot * t.samples_per_round;
  const int64_t points = g.points();
  const index_t pixel_stride = static_cast<index_t>(g.channels());
  const CornerSteps<index_t> corners = corner_steps<index_t>(g.width, g.channels());
  // Every thread runs every round of its warp, active or not: staging a round holds barriers.
  for (int64_t first_item = int64_t(blockIdx.x) * t.items_per_block; first_item < t.items;
       first_item += int64_t(gridDim.x) * t.items_per_block) {
    const int64_t item = first_item + slot;
    const bool active_item = item < t.items;
    Dcnv3ItemStart<opmath_t> start{};
    index_t item_channels = 0;
    if (active_item) {
      const Dcnv3Item it = dcnv3_item(d, item);
      start = dcnv3_item_start<opmath_t>(g, f, it);
      item_channels = static_cast<index_t>(group_start(g, it));
    }
    for (int64_t pass = 0; pass < t.passes; ++pass) {
      const index_t vector = static_cast<index_t>(pass * t.lanes + lane);
      const bool active = active_item && vector < t.vectors;
      const index_t channel = item_channels + vector * kVector;
      opmath_t sum[kVector] = {};
      for (int64_t first_point = 0; first_point < points; first_point += t.samples_per_round) {
        const int round_points = stage_round(g, d.kernel_h, t, lane, active_item, start,
                                             first_point, offset, mask, samples);
        if (active) {
          for (int point = 0; point < round_points; ++point) {
            // In registers: the sample's fields are read once, not once per corner.
            const SharedSample<opmath_t> sample = samples[point];
            add_sample<scalar_t, kVector>(sample, input + channel, pixel_stride, corners, sum);
          }
        }
      }
      if (active) {
        ChannelVector<scalar_t, kVector> result;
        for (int e = 0; e < kVector; ++e) {
          result.value[e] = static_cast<scalar_t>(sum[e]);
        }
        store_vector(output + (static_cast<index_t>(item * g.group_channels) + vector * kVector),
                     result);
      }
    }
  }
}

// grad_input (sums of at::opmath_type, Note [Input gradient sums in float32]), grad_offset and
// grad_mask are null where not asked for. The input gradient adds atomically (scatter_add_run).
template <typename scalar_t, int kVector, typename Divisor>
__global__ void dcnv3_backward_kernel(Dcnv3Geometry g, Dcnv3Divisors<Divisor> d, Dcnv3Fields f,
                                      LaneTiling t, const scalar_t* grad_output,
                                      const scalar_t* input,
                                      const scalar_t* offset, const scalar_t* mask,
                                      at::opmath_type<scalar_t>* grad_input,
                                      scalar_t* grad_offset, scalar_t* grad_mask) {
  using opmath_t = at::opmath_type<scalar_t>;
  __shared__ SharedSample<opmath_t> staged[kStagedSamples<opmath_t>];
  using index_t = typename Dcnv3Divisors<Divisor>::index_type;
  const bool position_grads = grad_offset != nullptr || grad_mask != nullptr;
  const int slot = threadIdx.x / t.lanes;
  const int lane = threadIdx.x % t.lanes;
  SharedSample<opmath_t>* const samples = staged + slot * t.samples_per_round;
  const int64_t points = g.points();
  const index_t pixel_stride = static_cast<index_t>(g.channels());
  const CornerSteps<index_t> corners = corner_steps<index_t>(g.width, g.channels());
  for (int64_t first_item = int64_t(blockIdx.x) * t.items_per_block; first_item < t.items;
       first_item += int64_t(gridDim.x) * t.items_per_block) {
    const int64_t item = first_item + slot;
    const bool active_item = item < t.items;
    Dcnv3ItemStart<opmath_t> start{};
    index_t item_channels = 0;
    scalar_t *group_grad_offset = nullptr, *group_grad_mask = nullptr;
    if (active_item) {
      const Dcnv3Item it = dcnv3_item(d, item);
      start = dcnv3_item_start<opmath_t>(g, f, it);
      item_channels = static_cast<index_t>(group_start(g, it));
      dcnv3_group_grads(f, it.pixel, it.group, grad_offset, grad_mask, group_grad_offset,
                        group_grad_mask);
    }
    for (int64_t first_point = 0; first_point < points; first_point += t.samples_per_round) {
      const int round_points = stage_round(g, d.kernel_h, t, lane, active_item, start,
                                           first_point, offset, mask, samples);
      for (int point = 0; point < round_points; ++point) {
        // The dot products of the output's gradient with each corner's values (0 outside),
        // as offset_mask_grad_sums_of_dots takes them.
        opmath_t dots[4] = {0, 0, 0, 0};
        if (active_item) {
          // In registers: the sample's fields are read once, not once per corner and pass.
          const SharedSample<opmath_t> sample = samples[point];
          const index_t top_left =
              item_channels + static_cast<index_t>(sample.top_left) * pixel_stride;
          for (int64_t pass = 0; pass < t.passes; ++pass) {
            const index_t vector = static_cast<index_t>(pass * t.lanes + lane);
            if (vector >= t.vectors) {
              continue;
            }
            const auto grad_read = load_vector<scalar_t, kVector>(
                grad_output +
                (static_cast<index_t>(item * g.group_channels) + vector * kVector));
            opmath_t grad[kVector];
            for (int e = 0; e < kVector; ++e) {
              grad[e] = static_cast<opmath_t>(grad_read.value[e]);
            }
            for (int corner = 0; corner < 4; ++corner) {
              const index_t at = top_left + vector * kVector + corners.from_top_left[corner];
              const opmath_t weight = sample.weight[corner];
              if (grad_input != nullptr && weight != opmath_t(0)) {
                opmath_t weighted[kVector];
                for (int e = 0; e < kVector; ++e) {
                  weighted[e] = weight * grad[e];
                }
                scatter_add_run<kVector>(grad_input + at, weighted);
              }
              if (position_grads && (sample.corners >> corner & 1)) {
                const auto read = load_vector<scalar_t, kVector>(input + at);
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
            const SharedSample<opmath_t>& sample = samples[point];
            dcnv3_write_grad(g, first_point + point, sample.mask,
                             offset_mask_grad_sums_of_dots(sample.ly, sample.lx, dots[0],
                                                           dots[1], dots[2], dots[3]),
                             group_grad_offset, group_grad_mask);
          }
        }
      }
    }
  }
}

// The forward's channel vectors: 16 bytes of the op's dtype.
template <typename scalar_t>
constexpr int kForwardVector = 16 / sizeof(scalar_t);

// The backward's: 16 bytes of its input gradient's sums (at::opmath_type), which take a vector
// in one atomic add (scatter_add_run). In half precision a lane then loads 8 bytes of the
// output's gradient and of the input, and the lanes of an item add to one contiguous run of
// sums; with 16-byte loads, each lane's 8 channels would be two atomics a sector apart, every
// 32-byte sector of the run taking two half-sector atomics.
template <typename scalar_t>
constexpr int kBackwardVector = 16 / sizeof(at::opmath_type<scalar_t>);

// Calls launch(divisors) with the launch's Dcnv3Divisors: InvariantDivisor and 32-bit element
// indices when every dividend (an item, a pixel, a row, a kernel tap) and every index of the
// input's and the output's elements that the kernels form is at most
// DEFORMCONV_NARROW_INDEX_LIMIT, int64_t otherwise. The kernels form the indices of a cell's
// corners outside the image too (never reading them): past the batch's last pixel, up to a
// row and a pixel of elements further.
template <typename Launch>
void with_divisors(const Dcnv3Geometry& g, int64_t batch, const LaneTiling& t,
                   Launch&& launch) {
  const int64_t input_indices = (batch * g.in_pixels() + g.width + 1) * g.channels();
  const int64_t output_indices = t.items * g.group_channels;
  if (std::max({t.items, g.kernel_h * g.kernel_w, input_indices, output_indices}) <=
      DEFORMCONV_NARROW_INDEX_LIMIT) {
    record_branch("dcnv3.cuda.index.32bit");
    launch(Dcnv3Divisors<InvariantDivisor>(g));
  } else {
    record_branch("dcnv3.cuda.index.64bit");
    launch(Dcnv3Divisors<int64_t>(g));
  }
}

void dcnv3_forward_cuda(const Dcnv3Geometry& g, const Dcnv3Fields& f, int64_t batch,
                        const at::Tensor& input, const at::Tensor& offset,
                        const at::Tensor& mask, at::Tensor& output) {
  DEFORMCONV_DISPATCH(input.scalar_type(), "dcnv3_forward_cuda", [&] {
    with_channel_vectors<kForwardVector<scalar_t>>(
        batch * g.out_pixels() * g.groups, g.group_channels, g.points(),
        kStagedSamples<at::opmath_type<scalar_t>>, {&input, &output}, kDcnv3Paths,
        [&](auto width, auto t) {
      with_divisors(g, batch, t, [&](auto d) {
        auto* kernel = dcnv3_forward_kernel<scalar_t, decltype(width)::value,
                                            typename decltype(d)::divisor_type>;
        DEFORMCONV_LAUNCH(kernel, blocks_of(t), kThreadsPerBlock,
                          c10::cuda::getCurrentCUDAStream())(
            g, d, f, t, input.const_data_ptr<scalar_t>(), offset.const_data_ptr<scalar_t>(),
            mask.const_data_ptr<scalar_t>(), output.mutable_data_ptr<scalar_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  });
}

// The input gradient and the offset and mask gradients, those asked for, in one kernel.
void dcnv3_gradients_cuda(const Dcnv3Geometry& g, const Dcnv3Fields& f, int64_t batch,
                          const at::Tensor& grad_output, const at::Tensor& input,
                          const at::Tensor& offset, const at::Tensor& mask,
                          at::Tensor& grad_input, at::Tensor& grad_offset,
                          at::Tensor& grad_mask) {
  if (grad_input.defined()) {
    record_branch("dcnv3.cuda.backward.input_gradient");
  }
  if (grad_offset.defined() || grad_mask.defined()) {
    record_branch("dcnv3.cuda.backward.offset_mask_gradients");
  }
  DEFORMCONV_DISPATCH(grad_output.scalar_type(), "dcnv3_backward_cuda", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    // Note [Input gradient sums in float32]
    at::Tensor sums;
    if (grad_input.defined()) {
      sums = uninitialised_input_gradient_sums<scalar_t>(grad_input).zero_();
    }
    // The sums too: vectors of them are added in one atomic (scatter_add_run).
    const at::Tensor& sums_or_input = sums.defined() ? sums : input;
    with_channel_vectors<kBackwardVector<scalar_t>>(
        batch * g.out_pixels() * g.groups, g.group_channels, g.points(), kStagedSamples<opmath_t>,
        {&grad_output, &input, &sums_or_input}, kDcnv3Paths, [&](auto width, auto t) {
      with_divisors(g, batch, t, [&](auto d) {
        auto* kernel = dcnv3_backward_kernel<scalar_t, decltype(width)::value,
                                             typename decltype(d)::divisor_type>;
        DEFORMCONV_LAUNCH(kernel, blocks_of(t), kThreadsPerBlock,
                          c10::cuda::getCurrentCUDAStream())(
            g, d, f, t, grad_output.const_data_ptr<scalar_t>(),
            input.const_data_ptr<scalar_t>(), offset.const_data_ptr<scalar_t>(),
            mask.const_data_ptr<scalar_t>(),
            sums.defined() ? sums.mutable_data_ptr<opmath_t>() : nullptr,
            mutable_data_or_null<scalar_t>(grad_offset),
            mutable_data_or_null<scalar_t>(grad_mask));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
    if (grad_input.defined()) {
      store_input_gradient_sums(sums, grad_input);
    }
  });
}

}  // namespace

const Dcnv3Launchers& dcnv3_cuda_launchers() {
  static const Dcnv3Launchers launchers{
      .forward = dcnv3_forward_cuda,
      .backward = dcnv3_gradients_cuda,
  };
  return launchers;
}

}  // namespace deformconv
