// CUDA launchers of DCNv3, on the current stream, int64 indices.
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
// A block holds kThreadsPerBlock / lanes items. Before its threads sample, it locates each
// sample (item, point) of a round of points once, in shared memory (SharedSample): the offsets
// and the mask are read once, coalesced, and the sampling positions and corner weights are
// computed once per sample rather than once per channel vector. The backward computes the
// input gradient and the offset and mask gradients in one kernel, which reads the output's
// gradient once for both; a sample's offset and mask gradients are dot products over its
// group's channels, summed over the item's lanes with warp shuffles and written by lane 0.
//
// A thread splits items into image, row, column and group, and points into kernel column and
// row: each kernel is built twice, dividing by InvariantDivisor (a multiply-high and a shift)
// when every dividend of the launch is below 2^31, in int64 otherwise (Dcnv3Divisors).

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

// Shared memory of a block's staged samples: a round holds as many as fit.
constexpr int64_t kStagedBytes = 32 * 1024;

template <typename opmath_t>
constexpr int64_t kStagedSamples = kStagedBytes / sizeof(SharedSample<opmath_t>);

// The names of the launchers' paths.
constexpr LanePathNames kDcnv3Paths{
    "dcnv3.cuda.channels.vectors", "dcnv3.cuda.channels.one_at_a_time",
    "dcnv3.cuda.channels.several_passes", "dcnv3.cuda.points.several_rounds"};

// Channel 0 of a sample's group at grid pixel 0 of its image, in a channels-last
// (N, H, W, G * D) tensor.
__device__ inline int64_t group_start(const Dcnv3Geometry& g, const Dcnv3Sample& s) {
  return s.n * g.in_pixels() * g.channels() + s.group * g.group_channels;
}

// Stages the round of points that starts at first_point: once the previous round's readers are
// done, the threads locate the samples of the block's items at its points, taking them in turn,
// into staged[slot * samples_per_round + point - first_point], and wait for one another.
// Returns the round's number of points. Every thread of the block calls it.
template <typename scalar_t, typename Divisor>
__device__ inline int stage_round(const Dcnv3Geometry& g, const Dcnv3Divisors<Divisor>& d,
                                  const Dcnv3Fields& f, const LaneTiling& t,
                                  int64_t first_item, int64_t first_point,
                                  const scalar_t* offset, const scalar_t* mask,
                                  SharedSample<at::opmath_type<scalar_t>>* staged) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t left = g.points() - first_point;
  const int points = static_cast<int>(left < t.samples_per_round ? left : t.samples_per_round);
  __syncthreads();
  for (int i = threadIdx.x; i < t.items_per_block * points; i += blockDim.x) {
    const int slot = i / points;
    const int point = i % points;
    const int64_t item = first_item + slot;
    if (item < t.items) {
      const Dcnv3Sample s = dcnv3_sample_of_item(d, item, first_point + point);
      opmath_t y, x, m;
      dcnv3_position(g, d, f, s, offset, mask, y, x, m);
      staged[slot * t.samples_per_round + point] = share_sample(y, x, m, g.height, g.width);
    }
  }
  __syncthreads();
  return points;
}

// Adds m * bilinear(sample) of kVector channels to `sum`: corners of zero weight are not read,
// so that an infinite value where a sample takes no part cannot make NaN (as
// sample_value_with_plan). `channels` points at the vector's channels of grid pixel 0, and
// `corners` holds the image's corner offsets (corner_steps).
template <typename scalar_t, int kVector>
__device__ inline void add_sample(const SharedSample<at::opmath_type<scalar_t>>& sample,
                                  const scalar_t* channels, int64_t pixel_stride,
                                  const CornerSteps& corners, at::opmath_type<scalar_t>* sum) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t top_left = sample.top_left * pixel_stride;
  opmath_t value[kVector] = {};
  for (int corner = 0; corner < 4; ++corner) {
    const opmath_t weight = sample.weight[corner];
    if (weight != opmath_t(0)) {
      const auto read = load_vector<scalar_t, kVector>(
          channels + top_left + corners.from_top_left[corner]);
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
  __shared__ SharedSample<opmath_t> staged[kStagedSamples<opmath_t>];
  const int slot = threadIdx.x / t.lanes;
  const int lane = threadIdx.x % t.lanes;
  const int64_t points = g.points();
  const CornerSteps corners = corner_steps(g.width, g.channels());
  // Every thread runs every round of its block, active or not: staging a round holds barriers.
  for (int64_t first_item = int64_t(blockIdx.x) * t.items_per_block; first_item < t.items;
       first_item += int64_t(gridDim.x) * t.items_per_block) {
    const int64_t item = first_item + slot;
    for (int64_t pass = 0; pass < t.passes; ++pass) {
      const int64_t vector = pass * t.lanes + lane;
      const bool active = item < t.items && vector < t.vectors;
      const int64_t channel =
          active ? group_start(g, dcnv3_sample_of_item(d, item, 0)) + vector * kVector : 0;
      opmath_t sum[kVector] = {};
      for (int64_t first_point = 0; first_point < points; first_point += t.samples_per_round) {
        const int round_points =
            stage_round(g, d, f, t, first_item, first_point, offset, mask, staged);
        if (active) {
          for (int point = 0; point < round_points; ++point) {
            // In registers: the sample's fields are read once, not once per corner.
            const SharedSample<opmath_t> sample = staged[slot * t.samples_per_round + point];
            add_sample<scalar_t, kVector>(sample, input + channel, g.channels(), corners, sum);
          }
        }
      }
      if (active) {
        ChannelVector<scalar_t, kVector> result;
        for (int e = 0; e < kVector; ++e) {
          result.value[e] = static_cast<scalar_t>(sum[e]);
        }
        store_vector(output + item * g.group_channels + vector * kVector, result);
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
  const bool position_grads = grad_offset != nullptr || grad_mask != nullptr;
  const int slot = threadIdx.x / t.lanes;
  const int lane = threadIdx.x % t.lanes;
  const int64_t points = g.points();
  const CornerSteps corners = corner_steps(g.width, g.channels());
  for (int64_t first_item = int64_t(blockIdx.x) * t.items_per_block; first_item < t.items;
       first_item += int64_t(gridDim.x) * t.items_per_block) {
    const int64_t item = first_item + slot;
    const bool active_item = item < t.items;
    int64_t start = 0;
    scalar_t *group_grad_offset = nullptr, *group_grad_mask = nullptr;
    if (active_item) {
      const Dcnv3Sample s = dcnv3_sample_of_item(d, item, 0);
      start = group_start(g, s);
      dcnv3_group_grads(f, s.pixel, s.group, grad_offset, grad_mask, group_grad_offset,
                        group_grad_mask);
    }
    for (int64_t first_point = 0; first_point < points; first_point += t.samples_per_round) {
      const int round_points =
          stage_round(g, d, f, t, first_item, first_point, offset, mask, staged);
      for (int point = 0; point < round_points; ++point) {
        // The dot products of the output's gradient with each corner's values (0 outside),
        // as offset_mask_grad_sums_of_dots takes them.
        opmath_t dots[4] = {0, 0, 0, 0};
        if (active_item) {
          // In registers: the sample's fields are read once, not once per corner and pass.
          const SharedSample<opmath_t> sample = staged[slot * t.samples_per_round + point];
          const int64_t top_left = start + sample.top_left * g.channels();
          for (int64_t pass = 0; pass < t.passes; ++pass) {
            const int64_t vector = pass * t.lanes + lane;
            if (vector >= t.vectors) {
              continue;
            }
            const auto grad_read = load_vector<scalar_t, kVector>(
                grad_output + item * g.group_channels + vector * kVector);
            opmath_t grad[kVector];
            for (int e = 0; e < kVector; ++e) {
              grad[e] = static_cast<opmath_t>(grad_read.value[e]);
            }
            for (int corner = 0; corner < 4; ++corner) {
              const int64_t at = top_left + vector * kVector + corners.from_top_left[corner];
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
            const SharedSample<opmath_t>& sample = staged[slot * t.samples_per_round + point];
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

// Calls launch(divisors) with the launch's Dcnv3Divisors: InvariantDivisor when every dividend
// (an item, a pixel, a row, a kernel tap) is at most DEFORMCONV_NARROW_INDEX_LIMIT, int64_t
// otherwise.
template <typename Launch>
void with_divisors(const Dcnv3Geometry& g, const LaneTiling& t, Launch&& launch) {
  if (std::max(t.items, g.kernel_h * g.kernel_w) <= DEFORMCONV_NARROW_INDEX_LIMIT) {
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
      with_divisors(g, t, [&](auto d) {
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
      with_divisors(g, t, [&](auto d) {
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
