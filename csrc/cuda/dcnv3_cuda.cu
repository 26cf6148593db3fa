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
// group's channels, summed over the item's lanes with warp shuffles and written by lane 0. Its
// input gradient adds into a band of shared memory first where the rows fit (Note [Input
// gradient in a band of shared memory]), a block then taking a strip of one group's pixels.
// Under deterministic mode the input gradient is gathered instead (Note [Gathered input
// gradients]): the backward kernel records each sample's corners, and the bands, whose adds
// into shared memory are atomic, are not taken.
//
// A thread splits an item into image, row, column and group, and a point into kernel column and
// row: each kernel is built twice, dividing by InvariantDivisor (a multiply-high and a shift)
// and indexing the input's and output's elements in 32 bits when every dividend and element
// index of the launch is below 2^31, in int64 otherwise (Dcnv3Divisors, with_divisors).

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <type_traits>

#include "../common/dcnv3_kernel.cuh"
#include "../core/dcnv3.h"
#include "../infrastructure/branch_trace.h"
#include "../infrastructure/device_kernels.h"
#include "../infrastructure/dtype_dispatch.h"
#include "../infrastructure/input_gradient_sums.h"
#include "../infrastructure/optional_data.h"
#include "../infrastructure/path_switches.h"
#include "channel_vectors.cuh"
#include "cuda_device.h"
#include "dcnv3_gradient_bands.cuh"
#include "dcnv3_items.cuh"
#include "gathered_input_gradient.cuh"
#include "launch.cuh"

namespace deformconv {
namespace {

// The names of the launchers' paths.
constexpr LanePathNames kDcnv3Paths{
    "dcnv3.cuda.channels.vectors", "dcnv3.cuda.channels.one_at_a_time",
    "dcnv3.cuda.channels.several_passes", "dcnv3.cuda.points.several_rounds"};

template <typename scalar_t, int kVector, typename Divisor>
__global__ void dcnv3_forward_kernel(Dcnv3Geometry g, Dcnv3Divisors<Divisor> d, Dcnv3Fields f,
                                     LaneTiling t, const scalar_t* input, const scalar_t* offset,
                                     const scalar_t* mask, scalar_t* output) {
  using opmath_t = opmath_type<scalar_t>;
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

// grad_input (sums of opmath_type, Note [Input gradient sums in float32]), grad_offset and
// grad_mask are null where not asked for. The input gradient adds atomically in global memory
// (scatter_add_run), or, in the kGathered instance (of its own, so that the atomic one keeps its
// registers), is recorded in `entries` and gathered after the kernel (Note [Gathered input
// gradients]): sample item * P + point of the launch.
template <typename scalar_t, int kVector, typename Divisor, bool kGathered>
__global__ void dcnv3_backward_kernel(Dcnv3Geometry g, Dcnv3Divisors<Divisor> d, Dcnv3Fields f,
                                      LaneTiling t, const scalar_t* grad_output,
                                      const scalar_t* input, const scalar_t* offset,
                                      const scalar_t* mask, opmath_type<scalar_t>* grad_input,
                                      CornerEntries<opmath_type<scalar_t>> entries,
                                      scalar_t* grad_offset, scalar_t* grad_mask) {
  using opmath_t = opmath_type<scalar_t>;
  using index_t = typename Dcnv3Divisors<Divisor>::index_type;
  __shared__ SharedSample<opmath_t> staged[kStagedSamples<opmath_t>];
  const int slot = threadIdx.x / t.lanes;
  const int lane = threadIdx.x % t.lanes;
  SharedSample<opmath_t>* const samples = staged + slot * t.samples_per_round;
  for (int64_t first_item = int64_t(blockIdx.x) * t.items_per_block; first_item < t.items;
       first_item += int64_t(gridDim.x) * t.items_per_block) {
    const int64_t item = first_item + slot;
    const bool active_item = item < t.items;
    const Dcnv3Item it = active_item ? dcnv3_item(d, item) : Dcnv3Item{};
    const auto add_input_gradient = [&](const SharedSample<opmath_t>& sample, int64_t point,
                                        int corner, index_t vector, index_t at,
                                        const opmath_t* weighted) {
      if constexpr (kGathered) {
        if (vector == 0) {
          entries.record(item * g.points() + point, corner, sample.weight[corner], at,
                         item * g.group_channels);
        }
      } else {
        scatter_add_run<kVector>(grad_input + at, weighted);
      }
    };
    backward_item<scalar_t, kVector>(g, d, f, t, lane, active_item, item, it, samples, grad_output,
                                     input, offset, mask, kGathered || grad_input != nullptr,
                                     grad_offset, grad_mask, add_input_gradient);
  }
}

// The forward's channel vectors: 16 bytes of the op's dtype.
template <typename scalar_t>
constexpr int kForwardVector = 16 / sizeof(scalar_t);

// The backward's: 16 bytes of its input gradient's sums (opmath_type), which take a vector
// in one atomic add (scatter_add_run). In half precision a lane then loads 8 bytes of the
// output's gradient and of the input, and the lanes of an item add to one contiguous run of
// sums; with 16-byte loads, each lane's 8 channels would be two atomics a sector apart, every
// 32-byte sector of the run taking two half-sector atomics.
template <typename scalar_t>
constexpr int kBackwardVector = 16 / sizeof(opmath_type<scalar_t>);

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
                        const Tensor& input, const Tensor& offset, const Tensor& mask,
                        Tensor& output) {
  DEFORMCONV_DISPATCH(input.scalar_type(), "dcnv3_forward_cuda", [&] {
    with_channel_vectors<kForwardVector<scalar_t>>(
        batch * g.out_pixels() * g.groups, g.group_channels, g.group_channels, g.points(),
        kStagedSamples<opmath_type<scalar_t>>, {&input, &output}, kDcnv3Paths,
        [&](auto width, auto t) {
      with_divisors(g, batch, t, [&](auto d) {
        auto* kernel = dcnv3_forward_kernel<scalar_t, decltype(width)::value,
                                            typename decltype(d)::divisor_type>;
        DEFORMCONV_LAUNCH(kernel, blocks_of(t), kThreadsPerBlock,
                          current_cuda_stream())(
            g, d, f, t, input.const_data_ptr<scalar_t>(), offset.const_data_ptr<scalar_t>(),
            mask.const_data_ptr<scalar_t>(), output.mutable_data_ptr<scalar_t>());
        DEFORMCONV_CHECK_LAUNCH();
      });
    });
  });
}

// The input gradient and the offset and mask gradients, those asked for, in one kernel.
void dcnv3_gradients_cuda(const Dcnv3Geometry& g, const Dcnv3Fields& f, int64_t batch,
                          const Tensor& grad_output, const Tensor& input, const Tensor& offset,
                          const Tensor& mask, Tensor& grad_input, Tensor& grad_offset,
                          Tensor& grad_mask, bool deterministic) {
  const bool gathered = grad_input.defined() && deterministic;
  if (gathered &&
      gather_in_image_chunks(
          batch, g.out_pixels() * g.groups * g.points(), g.in_pixels() * g.groups,
          grad_output.scalar_type(),
          "dcnv3.cuda.backward.input_gradient.image_chunks", [&](int64_t first, int64_t count) {
            Tensor grad_input_chunk = narrow_images(grad_input, first, count);
            Tensor grad_offset_chunk = narrow_images(grad_offset, first, count);
            Tensor grad_mask_chunk = narrow_images(grad_mask, first, count);
            dcnv3_gradients_cuda(g, f, count, narrow_images(grad_output, first, count),
                                 narrow_images(input, first, count),
                                 narrow_images(offset, first, count),
                                 narrow_images(mask, first, count), grad_input_chunk,
                                 grad_offset_chunk, grad_mask_chunk, true);
          })) {
    return;
  }
  if (grad_input.defined()) {
    record_branch("dcnv3.cuda.backward.input_gradient");
    record_branch(gathered ? "dcnv3.cuda.backward.input_gradient.gathered"
                           : "dcnv3.cuda.backward.input_gradient.atomic_adds");
  }
  if (grad_offset.defined() || grad_mask.defined()) {
    record_branch("dcnv3.cuda.backward.offset_mask_gradients");
  }
  DEFORMCONV_DISPATCH(grad_output.scalar_type(), "dcnv3_backward_cuda", [&] {
    using opmath_t = opmath_type<scalar_t>;
    // Note [Input gradient sums in float32]
    Tensor sums;
    if (grad_input.defined()) {
      sums = uninitialised_input_gradient_sums<scalar_t>(grad_input);
      torch::stable::zero_(sums);
    }
    // The sums too: vectors of them are added in one atomic (scatter_add_run).
    const Tensor& sums_or_input = sums.defined() ? sums : input;
    with_channel_vectors<kBackwardVector<scalar_t>>(
        batch * g.out_pixels() * g.groups, g.group_channels, g.group_channels, g.points(),
        kStagedSamples<opmath_t>,
        {&grad_output, &input, &sums_or_input}, kDcnv3Paths, [&](auto width, auto t) {
      constexpr int kVector = decltype(width)::value;
      const std::optional<BandShape> bands =
          sums.defined() && !gathered && !input_gradient_bands_switched_off()
              ? band_shape<opmath_t>(g, t)
              : std::nullopt;
      if (bands) {
        record_branch("dcnv3.cuda.backward.input_gradient_in_shared_memory");
      }
      with_divisors(g, batch, t, [&](auto d) {
        using Divisor = typename decltype(d)::divisor_type;
        const scalar_t* const grad_output_data = grad_output.const_data_ptr<scalar_t>();
        const scalar_t* const input_data = input.const_data_ptr<scalar_t>();
        const scalar_t* const offset_data = offset.const_data_ptr<scalar_t>();
        const scalar_t* const mask_data = mask.const_data_ptr<scalar_t>();
        opmath_t* const sums_data = sums.defined() ? sums.mutable_data_ptr<opmath_t>() : nullptr;
        if (bands) {
          auto* kernel = dcnv3_backward_banded_kernel<scalar_t, kVector, Divisor>;
          DEFORMCONV_LAUNCH(kernel, std::min(kMaxBlocks, bands->tiles), kThreadsPerBlock,
                            current_cuda_stream())(
              g, d, f, t, GradientBands<Divisor>(*bands), grad_output_data, input_data,
              offset_data, mask_data, sums_data, mutable_data_or_null<scalar_t>(grad_offset),
              mutable_data_or_null<scalar_t>(grad_mask));
          DEFORMCONV_CHECK_LAUNCH();
        } else {
          // Rows of the map: (image, input pixel, group), of the group's channels.
          std::optional<GatheredInputGradient<scalar_t>> gather;
          if (gathered) {
            gather.emplace(grad_output, t.items * g.points(), batch * g.in_pixels() * g.groups,
                           g.group_channels);
          }
          auto* kernel = gathered ? dcnv3_backward_kernel<scalar_t, kVector, Divisor, true>
                                  : dcnv3_backward_kernel<scalar_t, kVector, Divisor, false>;
          DEFORMCONV_LAUNCH(kernel, blocks_of(t), kThreadsPerBlock, current_cuda_stream())(
              g, d, f, t, grad_output_data, input_data, offset_data, mask_data,
              gathered ? nullptr : sums_data,
              gather ? gather->entries() : CornerEntries<opmath_t>{},
              mutable_data_or_null<scalar_t>(grad_offset),
              mutable_data_or_null<scalar_t>(grad_mask));
          DEFORMCONV_CHECK_LAUNCH();
          if (gather) {
            gather->add_to(sums);
          }
        }
      });
    });
    if (grad_input.defined()) {
      store_input_gradient_sums(sums, grad_input);
    }
  });
}

const Dcnv3Launchers& dcnv3_cuda_launchers() {
  static const Dcnv3Launchers launchers{
      .forward = dcnv3_forward_cuda,
      .gradients = dcnv3_gradients_cuda,
  };
  return launchers;
}

}  // namespace

// The kernels at the CUDA key: the drivers with these launchers. The test suite's emulation
// build, which compiles this file as C++, registers them under its own namespace.
#if !defined(DEFORMCONV_CUDA_EMULATION)
STABLE_TORCH_LIBRARY_IMPL(deformconv, CUDA, m) {
  register_device_kernels<Dcnv3Op, CudaDevice, dcnv3_forward, dcnv3_backward, dcnv3_cuda_launchers>(
      m);
  register_device_kernels<Dcnv4Op, CudaDevice, dcnv4_forward, dcnv4_backward, dcnv3_cuda_launchers>(
      m);
}
#endif

}  // namespace deformconv
