// CUDA launchers of DCN v1/v2, on the current stream. im2col gives each (image, pixel, deform
// group) to a few lanes of a warp, which locate its taps' samples once and gather their channels
// as vectors (im2col_kernel); col2im runs one thread per columns entry, and the offset and mask
// gradients a team of lanes per sample. Indices are int64 where they must be: a block's columns
// buffer passes 2^31 elements at detection resolutions (C_in * K * H_out * W_out * images), and
// int32 there gives wrong answers silently (torchvision issue 4269). Threads split their flat
// index into image, group, tap, pixel and channel by divisions; each kernel is therefore built
// twice, and the launcher takes the build that divides by InvariantDivisor (a multiply-high and a
// shift) when every dividend of the launch is below 2^31, the one that divides in int64
// otherwise.

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "../common/deform_conv2d_kernel.cuh"
#include "../core/branch_trace.h"
#include "../core/deform_conv2d_gemms.h"
#include "channel_vectors.cuh"
#include "deform_conv2d_cuda.h"
#include "launch.cuh"

namespace deformconv {
namespace {

// Calls launch(divisors) with the IndexDivisors of the window: 32-bit when `entries`, the flat
// indices of the launch, and every size that the index arithmetic divides are at most
// DEFORMCONV_NARROW_INDEX_LIMIT.
template <typename Launch>
void with_index_divisors(const DeformConv2dGeometry& g, const PixelWindow& window, int64_t entries,
                         const Launch& launch) {
  const int64_t largest_dividend = std::max({entries, g.out_pixels(), g.in_channels, g.taps()});
  if (largest_dividend <= DEFORMCONV_NARROW_INDEX_LIMIT) {
    record_branch("deform_conv2d.cuda.index.32bit");
    launch(IndexDivisors<InvariantDivisor>(g, window));
  } else {
    record_branch("deform_conv2d.cuda.index.64bit");
    launch(IndexDivisors<int64_t>(g, window));
  }
}

// The names of im2col's paths.
constexpr LanePathNames kIm2colPaths{
    "deform_conv2d.cuda.im2col.vectors", "deform_conv2d.cuda.im2col.one_at_a_time",
    "deform_conv2d.cuda.im2col.several_passes", "deform_conv2d.cuda.im2col.several_rounds"};

// Items of `t` (decompose_item_index: a pixel's samples of one image and deform group, a
// sample per tap), each taken by t.lanes threads of one warp: the lanes locate the item's taps
// once, in shared memory (stage_item_samples), and lane l then writes the channel vectors l,
// l + lanes, ... of every tap, reading each corner as one vector of kVector channels from the
// channels-last input. The bilinear weights are thus computed once per sample, not once per
// channel, and a warp's loads and stores are whole vectors at neighbouring addresses: the
// channels of a tap are consecutive in the columns, the taps of a pixel Cg apart.
template <typename scalar_t, int kVector, typename Divisor>
__global__ void im2col_kernel(DeformConv2dGeometry g, PixelWindow window,
                              IndexDivisors<Divisor> d, LaneTiling t, const scalar_t* input,
                              const scalar_t* offset, const scalar_t* mask, scalar_t* columns) {
  using opmath_t = at::opmath_type<scalar_t>;
  using index_t = typename IndexDivisors<Divisor>::index_type;
  __shared__ SharedSample<opmath_t> staged[kStagedSamples<opmath_t>];
  const int slot = threadIdx.x / t.lanes;
  const int lane = threadIdx.x % t.lanes;
  SharedSample<opmath_t>* const samples = staged + slot * t.samples_per_round;
  const index_t pixel_stride = static_cast<index_t>(g.in_channels);
  const index_t tap_stride = static_cast<index_t>(g.channels_per_group());
  const CornerSteps<index_t> corners = corner_steps<index_t>(g.in_width, g.in_channels);
  // Every thread runs every round of its warp, active or not: staging a round holds barriers.
  for (int64_t first_item = int64_t(blockIdx.x) * t.items_per_block; first_item < t.items;
       first_item += int64_t(gridDim.x) * t.items_per_block) {
    const int64_t item = first_item + slot;
    const bool active_item = item < t.items;
    const SampleIndex s = active_item ? decompose_item_index(g, window, d, item) : SampleIndex{};
    for (int64_t first_tap = 0; first_tap < g.taps(); first_tap += t.samples_per_round) {
      const int round_taps = stage_item_samples(
          t, lane, active_item, g.taps() - first_tap, samples, [&](int k) {
            opmath_t y, x, m;
            sample_position(g, sample_of_tap(g, d, s, first_tap + k), offset, mask, y, x, m);
            return share_sample(y, x, m, g.in_height, g.in_width);
          });
      if (!active_item) {
        continue;
      }
      for (int64_t vector = lane; vector < t.vectors; vector += t.lanes) {
        const int64_t channel = first_channel(g, s.group) + vector * kVector;
        const scalar_t* const image =
            input + static_cast<index_t>(s.n * g.in_pixels() * g.in_channels + channel);
        scalar_t* const column = columns +
            static_cast<index_t>(column_index(g, window, d, s, channel) + first_tap * tap_stride);
        for (int k = 0; k < round_taps; ++k) {
          // In registers: the sample's fields are read once, not once per corner.
          const SharedSample<opmath_t> sample = samples[k];
          opmath_t value[kVector] = {};
          add_sample<scalar_t, kVector>(sample, image, pixel_stride, corners, value);
          ChannelVector<scalar_t, kVector> result;
          for (int e = 0; e < kVector; ++e) {
            result.value[e] = static_cast<scalar_t>(value[e]);
          }
          store_vector(column + static_cast<index_t>(k) * tap_stride, result);
        }
      }
    }
  }
}

// As im2col_kernel; entries of different threads hit the same input pixels, so
// scatter_with_plan adds atomically (scatter_add under __CUDA_ARCH__), into a gradient of
// at::opmath_type (Note [Input gradient sums in float32]).
template <typename scalar_t, typename Divisors>
__global__ void col2im_kernel(DeformConv2dGeometry g, PixelWindow window, Divisors divisors,
                              int64_t total, const scalar_t* grad_columns,
                              const scalar_t* offset, const scalar_t* mask,
                              at::opmath_type<scalar_t>* grad_input) {
  DEFORMCONV_GRID_STRIDE_LOOP(index, total) {
    int64_t channel;
    const SampleIndex s = decompose_column_index(g, window, divisors, index, channel);
    const auto plan = make_sampling_plan(g, s, offset, mask);
    scatter_with_plan(plan, grad_columns + index, 1, channel_of(g, grad_input, s.n, channel),
                      g.in_channels);
  }
}

// A team of lanes per sample (image, deform group, tap, output pixel): lane l of the team takes
// channels l, l + lanes, ... of the deform group, so that the team's reads of the columns
// gradient and of the channels-last input are consecutive addresses, and the team adds its
// partial sums up by shuffles. `lanes` is a power of two up to a warp (team_lanes), so that a
// team is an aligned run of lanes of one warp and the block (a multiple of the warp) holds
// whole teams; a team's lanes take the same samples, so each shuffle has all of its members.
// The sums are added in a fixed order: the result does not depend on thread scheduling.
template <typename scalar_t, typename Divisors>
__global__ void offset_mask_grad_kernel(DeformConv2dGeometry g, PixelWindow window,
                                        Divisors divisors,
                                        int64_t samples, int lanes,
                                        const scalar_t* grad_columns, const scalar_t* input,
                                        const scalar_t* offset, const scalar_t* mask,
                                        scalar_t* grad_offset, scalar_t* grad_mask) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int lane = static_cast<int>(threadIdx.x) % lanes;
  const int first_lane_in_warp = static_cast<int>(threadIdx.x) % kWarpSize - lane;
  const unsigned team = (lanes == kWarpSize ? ~0u : (1u << lanes) - 1u) << first_lane_in_warp;
  const int64_t teams_in_grid = static_cast<int64_t>(blockDim.x) * gridDim.x / lanes;
  for (int64_t index = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / lanes;
       index < samples; index += teams_in_grid) {
    const SampleIndex s = decompose_sample_index(g, window, divisors, index);
    const auto acc = start_offset_mask_grad(g, s, offset, mask);
    OffsetMaskGradSums<opmath_t> sums;
    if (acc.cell.inside) {
      const int64_t end = first_channel(g, s.group) + g.channels_per_offset_group();
      for (int64_t c = first_channel(g, s.group) + lane; c < end; c += lanes) {
        accumulate_offset_mask_grad(acc, grad_columns[column_index(g, window, divisors, s, c)],
                                    channel_of(g, input, s.n, c), g.in_channels, sums);
      }
    }
    for (int distance = lanes / 2; distance > 0; distance /= 2) {
      sums.y += __shfl_xor_sync(team, sums.y, distance, lanes);
      sums.x += __shfl_xor_sync(team, sums.x, distance, lanes);
      sums.m += __shfl_xor_sync(team, sums.m, distance, lanes);
    }
    if (lane == 0) {
      finish_offset_mask_grad(g, s, acc, sums, grad_offset, grad_mask);
    }
  }
}

// The smallest power of two that covers the channels of a deform group, at most a warp.
int team_lanes(const DeformConv2dGeometry& g) {
  int lanes = 1;
  while (lanes < kWarpSize && lanes < g.channels_per_offset_group()) {
    lanes *= 2;
  }
  return lanes;
}

int64_t samples_in(const DeformConv2dGeometry& g, const PixelWindow& window, int64_t batch) {
  return batch * g.offset_groups * g.taps() * window.pixels;
}

int64_t columns_entries_in(const DeformConv2dGeometry& g, const PixelWindow& window,
                           int64_t batch) {
  return batch * g.in_channels * g.taps() * window.pixels;
}

// The CUDA launchers prepare nothing per window (sampling.prepared is undefined): the kernels
// locate their samples themselves.
void im2col_cuda(const DeformConv2dGeometry& g, const PixelWindow& window, int64_t batch,
                 const at::Tensor& input, const WindowSampling& sampling, at::Tensor& columns) {
  const at::Tensor& offset = sampling.offset;
  const at::Tensor& mask = sampling.mask;
  DEFORMCONV_DISPATCH(input.scalar_type(), "deform_conv2d_im2col_cuda", [&] {
    with_channel_vectors<16 / sizeof(scalar_t)>(
        batch * window.pixels * g.offset_groups, g.channels_per_offset_group(),
        g.channels_per_group(), g.taps(), kStagedSamples<at::opmath_type<scalar_t>>,
        {&input, &columns}, kIm2colPaths, [&](auto width, auto t) {
      with_index_divisors(g, window,
                          std::max(columns_entries_in(g, window, batch), input.numel()),
                          [&](const auto& divisors) {
        using Divisor = typename std::decay_t<decltype(divisors)>::divisor_type;
        auto* kernel = im2col_kernel<scalar_t, decltype(width)::value, Divisor>;
        DEFORMCONV_LAUNCH(kernel, blocks_of(t), kThreadsPerBlock,
                          c10::cuda::getCurrentCUDAStream())(
            g, window, divisors, t, input.const_data_ptr<scalar_t>(),
            offset.const_data_ptr<scalar_t>(), data_or_null<scalar_t>(mask),
            columns.mutable_data_ptr<scalar_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  });
}

void col2im_cuda(const DeformConv2dGeometry& g, const PixelWindow& window, int64_t batch,
                 const at::Tensor& grad_columns, const WindowSampling& sampling,
                 at::Tensor& grad_input) {
  const at::Tensor& offset = sampling.offset;
  const at::Tensor& mask = sampling.mask;
  const int64_t total = columns_entries_in(g, window, batch);
  DEFORMCONV_DISPATCH(grad_columns.scalar_type(), "deform_conv2d_col2im_cuda", [&] {
    // Note [Input gradient sums in float32]
    at::Tensor sums = input_gradient_sums<scalar_t>(grad_input);
    with_index_divisors(g, window, total, [&](const auto& divisors) {
      const auto kernel = &col2im_kernel<scalar_t, std::decay_t<decltype(divisors)>>;
      DEFORMCONV_LAUNCH(kernel, blocks_for(total), kThreadsPerBlock,
                        c10::cuda::getCurrentCUDAStream())(
              g, window, divisors, total, grad_columns.const_data_ptr<scalar_t>(),
              offset.const_data_ptr<scalar_t>(), data_or_null<scalar_t>(mask),
              sums.mutable_data_ptr<at::opmath_type<scalar_t>>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    store_input_gradient_sums(sums, grad_input);
  });
}

void offset_mask_grad_cuda(const DeformConv2dGeometry& g, const PixelWindow& window, int64_t batch,
                           const at::Tensor& grad_columns, const at::Tensor& input,
                           const WindowSampling& sampling, at::Tensor& grad_offset,
                           at::Tensor& grad_mask) {
  const at::Tensor& offset = sampling.offset;
  const at::Tensor& mask = sampling.mask;
  const int64_t samples = samples_in(g, window, batch);
  const int lanes = team_lanes(g);
  DEFORMCONV_DISPATCH(input.scalar_type(), "deform_conv2d_offset_mask_grad_cuda", [&] {
    with_index_divisors(g, window, samples, [&](const auto& divisors) {
      const auto kernel = &offset_mask_grad_kernel<scalar_t, std::decay_t<decltype(divisors)>>;
      DEFORMCONV_LAUNCH(kernel, blocks_for(samples * lanes),
                        kThreadsPerBlock, c10::cuda::getCurrentCUDAStream())(
              g, window, divisors, samples, lanes, grad_columns.const_data_ptr<scalar_t>(),
              input.const_data_ptr<scalar_t>(), offset.const_data_ptr<scalar_t>(),
              data_or_null<scalar_t>(mask), mutable_data_or_null<scalar_t>(grad_offset),
              mutable_data_or_null<scalar_t>(grad_mask));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

void transpose_cuda(const at::Tensor& src, at::Tensor& dst) { dst.copy_(src.transpose(1, 2)); }

// cuBLAS's batched GEMMs, whatever the call.
const WindowGemms& window_gemms_cuda(const DeformConv2dGeometry&, at::ScalarType) {
  return bmm_window_gemms();
}

// Every stage over the whole GPU, window by window: no fused kernel, and no host threads to
// share work out to.
ForwardPlan forward_plan_cuda(const DeformConv2dGeometry&, at::ScalarType, int64_t, int64_t,
                              int64_t, const WindowGemms&) {
  return ForwardPlan::kStages;
}

// The caching allocator reuses its blocks: nothing to ask of the memory system.
at::Tensor scratch_cuda(c10::IntArrayRef sizes, const at::TensorOptions& options) {
  return at::empty(sizes, options);
}

}  // namespace

const DeformConv2dLaunchers& cuda_launchers() {
  // 256 MiB of columns per window: whole feature maps at detection resolutions in one GEMM.
  static const DeformConv2dLaunchers launchers{
      .block_columns_bytes = int64_t(64) << 20,
      .columns_tile_bytes = int64_t(256) << 20,
      .workspace_bytes_per_sample = 0,
      .prepare_window = nullptr,
      .scratch = scratch_cuda,
      .im2col = im2col_cuda,
      .col2im = col2im_cuda,
      .offset_mask_grad = offset_mask_grad_cuda,
      .transpose = transpose_cuda,
      .gemms = window_gemms_cuda,
      .forward_plan = forward_plan_cuda,
      .fused_forward = nullptr,
  };
  return launchers;
}

}  // namespace deformconv
