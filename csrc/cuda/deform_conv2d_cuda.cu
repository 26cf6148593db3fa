// CUDA launchers of DCN v1/v2, on the current stream. im2col gives each (image, pixel, deform
// group) to a few lanes of a warp, which locate its taps' samples once and gather their channels as
// vectors (im2col_kernel); the columns gradient goes back through the same items in one kernel
// (column_gradients_kernel), whose lanes add their vectors to the input gradient with atomics and
// sum the offset and mask gradients by shuffles. Indices are int64 where they must be: a block's
// columns buffer passes 2^31 elements at detection resolutions (C_in * K * H_out * W_out * images),
// and int32 there gives wrong answers silently (torchvision issue 4269). Under deterministic
// mode the columns gradient records each sample's corners instead of adding them, and the input
// gradient is gathered from that map (Note [Gathered input gradients]). Threads split their flat
// index into image, group, tap, pixel and channel by divisions; each kernel is therefore built
// twice, and the launcher takes the build that divides by InvariantDivisor (a multiply-high and a
// shift) when every dividend of the launch is below 2^31, the one that divides in int64 otherwise.

#include <torch/csrc/stable/library.h>
#if !defined(DEFORMCONV_CUDA_EMULATION)
#include <torch/csrc/inductor/aoti_torch/generated/c_shim_cuda.h>
#endif

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <type_traits>

#include "../common/deform_conv2d_kernel.cuh"
#include "../core/deform_conv2d.h"
#include "../core/deform_conv2d_gemms.h"
#include "../infrastructure/branch_trace.h"
#include "../infrastructure/device_kernels.h"
#include "../infrastructure/matrix_products.h"
#include "../infrastructure/tensor_views.h"
#include "channel_vectors.cuh"
#include "cuda_device.h"
#include "gathered_input_gradient.cuh"
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

// Stages the round of an item's taps that starts at first_tap into its slots `samples`
// (stage_item_samples), `s` being the item's sample of tap 0. Returns the round's number of
// taps. Every thread of the warp calls it, `active_item` where its item is.
template <typename scalar_t, typename Divisor>
__device__ inline int stage_taps(const DeformConv2dGeometry& g, const IndexDivisors<Divisor>& d,
                                 const LaneTiling& t, int lane, bool active_item,
                                 const SampleIndex& s, int64_t first_tap, const scalar_t* offset,
                                 const scalar_t* mask,
                                 SharedSample<opmath_type<scalar_t>>* samples) {
  using opmath_t = opmath_type<scalar_t>;
  return stage_item_samples(t, lane, active_item, g.taps() - first_tap, samples, [&](int k) {
    opmath_t y, x, m;
    sample_position(g, sample_of_tap(g, d, s, first_tap + k), offset, mask, y, x, m);
    return share_sample(y, x, m, g.in_height, g.in_width);
  });
}

// Where the two kernels below address an item's channels: the input's pixels lie C_in elements
// apart, a pixel's taps Cg apart in the columns, and a cell's corners at `corners` from its top
// left; index_t is IndexDivisors' index_type.
template <typename index_t>
struct ItemStrides {
  index_t pixel, tap;
  CornerSteps<index_t> corners;
};

template <typename index_t>
__device__ inline ItemStrides<index_t> item_strides(const DeformConv2dGeometry& g) {
  return {static_cast<index_t>(g.in_channels), static_cast<index_t>(g.channels_per_group()),
          corner_steps<index_t>(g.in_width, g.in_channels)};
}

// Where channel vector `vector` of item sample s (tap 0) lies: its channels at grid pixel 0 of
// the input, and its columns entry of tap `tap`.
template <typename index_t>
struct VectorPlaces {
  index_t image, column;
};

template <int kVector, typename Divisor,
          typename index_t = typename IndexDivisors<Divisor>::index_type>
__device__ inline VectorPlaces<index_t> vector_places(
    const DeformConv2dGeometry& g, const PixelWindow& window, const IndexDivisors<Divisor>& d,
    const ItemStrides<index_t>& strides, const SampleIndex& s, int64_t vector, int64_t tap) {
  const int64_t channel = first_channel(g, s.group) + vector * kVector;
  return {static_cast<index_t>(s.n * g.in_pixels() * g.in_channels + channel),
          static_cast<index_t>(column_index(g, window, d, s, channel) + tap * strides.tap)};
}

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
  using opmath_t = opmath_type<scalar_t>;
  using index_t = typename IndexDivisors<Divisor>::index_type;
  __shared__ SharedSample<opmath_t> staged[kStagedSamples<opmath_t>];
  const int slot = threadIdx.x / t.lanes;
  const int lane = threadIdx.x % t.lanes;
  SharedSample<opmath_t>* const samples = staged + slot * t.samples_per_round;
  const ItemStrides<index_t> strides = item_strides<index_t>(g);
  // Every thread runs every round of its warp, active or not: staging a round holds barriers.
  for (int64_t first_item = int64_t(blockIdx.x) * t.items_per_block; first_item < t.items;
       first_item += int64_t(gridDim.x) * t.items_per_block) {
    const int64_t item = first_item + slot;
    const bool active_item = item < t.items;
    const SampleIndex s = active_item ? decompose_item_index(g, window, d, item) : SampleIndex{};
    for (int64_t first_tap = 0; first_tap < g.taps(); first_tap += t.samples_per_round) {
      const int round_taps =
          stage_taps(g, d, t, lane, active_item, s, first_tap, offset, mask, samples);
      if (!active_item) {
        continue;
      }
      for (int64_t vector = lane; vector < t.vectors; vector += t.lanes) {
        const auto places = vector_places<kVector>(g, window, d, strides, s, vector, first_tap);
        const scalar_t* const image = input + places.image;
        scalar_t* const column = columns + places.column;
        for (int k = 0; k < round_taps; ++k) {
          // In registers: the sample's fields are read once, not once per corner.
          const SharedSample<opmath_t> sample = samples[k];
          opmath_t value[kVector] = {};
          add_sample<scalar_t, kVector>(sample, image, strides.pixel, strides.corners, value);
          ChannelVector<scalar_t, kVector> result;
          for (int e = 0; e < kVector; ++e) {
            result.value[e] = static_cast<scalar_t>(value[e]);
          }
          store_vector(column + static_cast<index_t>(k) * strides.tap, result);
        }
      }
    }
  }
}

// The names of the columns gradient's paths.
constexpr LanePathNames kColumnGradientPaths{
    "deform_conv2d.cuda.column_gradients.vectors",
    "deform_conv2d.cuda.column_gradients.one_at_a_time",
    "deform_conv2d.cuda.column_gradients.several_passes",
    "deform_conv2d.cuda.column_gradients.several_rounds"};

// What the columns gradient gives back, in one pass over it: items, lanes and staged samples as
// im2col_kernel's, the vectors kVector channels of the input gradient's sums (16 bytes of
// opmath_type, Note [Input gradient sums in float32]). Lane l reads the columns gradient of
// its vectors of each tap once; where the input gradient is asked for (grad_input not null) it
// adds weight * that vector at each corner of non-zero weight, one vector atomic a corner
// (scatter_add_run); where it is gathered instead (kGathered, an instance of its own, so that
// the atomic one keeps its registers), the lane of vector 0 records the sample's corners, sample
// item * K + tap of the launch, in `entries`; where the offset or mask gradient is,
// it adds the vector's dot products with each corner's values (corners in the image only), which
// the item's lanes sum by shuffles into the sample's three sums (offset_mask_grad_sums_of_dots),
// written by lane 0. Every thread of a warp runs every tap of its items, active or not, for those
// shuffles.
template <typename scalar_t, int kVector, typename Divisor, bool kGathered>
__global__ void column_gradients_kernel(DeformConv2dGeometry g, PixelWindow window,
                                        IndexDivisors<Divisor> d, LaneTiling t,
                                        const scalar_t* grad_columns, const scalar_t* input,
                                        const scalar_t* offset, const scalar_t* mask,
                                        opmath_type<scalar_t>* grad_input,
                                        CornerEntries<opmath_type<scalar_t>> entries,
                                        scalar_t* grad_offset, scalar_t* grad_mask) {
  using opmath_t = opmath_type<scalar_t>;
  using index_t = typename IndexDivisors<Divisor>::index_type;
  __shared__ SharedSample<opmath_t> staged[kStagedSamples<opmath_t>];
  const int slot = threadIdx.x / t.lanes;
  const int lane = threadIdx.x % t.lanes;
  SharedSample<opmath_t>* const samples = staged + slot * t.samples_per_round;
  const bool position_grads = grad_offset != nullptr || grad_mask != nullptr;
  const ItemStrides<index_t> strides = item_strides<index_t>(g);
  for (int64_t first_item = int64_t(blockIdx.x) * t.items_per_block; first_item < t.items;
       first_item += int64_t(gridDim.x) * t.items_per_block) {
    const int64_t item = first_item + slot;
    const bool active_item = item < t.items;
    const SampleIndex s = active_item ? decompose_item_index(g, window, d, item) : SampleIndex{};
    for (int64_t first_tap = 0; first_tap < g.taps(); first_tap += t.samples_per_round) {
      const int round_taps =
          stage_taps(g, d, t, lane, active_item, s, first_tap, offset, mask, samples);
      for (int k = 0; k < round_taps; ++k) {
        const int64_t tap = first_tap + k;
        SharedSample<opmath_t> sample{};
        opmath_t dots[4] = {0, 0, 0, 0};
        if (active_item) {
          sample = samples[k];
          const index_t top_left = static_cast<index_t>(sample.top_left) * strides.pixel;
          for (int64_t vector = lane; vector < t.vectors; vector += t.lanes) {
            const auto places = vector_places<kVector>(g, window, d, strides, s, vector, tap);
            const auto grad_vector =
                load_vector<scalar_t, kVector>(grad_columns + places.column);
            opmath_t grad[kVector];
            for (int e = 0; e < kVector; ++e) {
              grad[e] = static_cast<opmath_t>(grad_vector.value[e]);
            }
            for (int corner = 0; corner < 4; ++corner) {
              const index_t at = places.image + top_left + strides.corners.from_top_left[corner];
              const opmath_t weight = sample.weight[corner];
              if constexpr (kGathered) {
                if (vector == 0 && weight != opmath_t(0)) {
                  entries.record(item * g.taps() + tap, corner, weight, at, places.column);
                }
              } else if (grad_input != nullptr && weight != opmath_t(0)) {
                opmath_t weighted[kVector];
                for (int e = 0; e < kVector; ++e) {
                  weighted[e] = weight * grad[e];
                }
                scatter_add_run<kVector>(grad_input + at, weighted);
              }
              if (position_grads && (sample.corners >> corner & 1)) {
                const auto values = load_vector<scalar_t, kVector>(input + at);
                for (int e = 0; e < kVector; ++e) {
                  dots[corner] += grad[e] * static_cast<opmath_t>(values.value[e]);
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
            finish_offset_mask_grad(
                g, sample_of_tap(g, d, s, tap), sample.mask,
                offset_mask_grad_sums_of_dots(sample.ly, sample.lx, dots[0], dots[1], dots[2],
                                              dots[3]),
                grad_offset, grad_mask);
          }
        }
      }
    }
  }
}

int64_t columns_entries_in(const DeformConv2dGeometry& g, const PixelWindow& window,
                           int64_t batch) {
  return batch * g.in_channels * g.taps() * window.pixels;
}

// Calls launch(width, tiling, divisors) for a launch of the kernels above over the items of a
// window of `batch` images: in vectors of kWide channels where the channels and `tensors`
// allow (with_channel_vectors, recording under `names`), dividing in the build that the
// columns' and the input's element counts allow (with_index_divisors).
template <int kWide, typename opmath_t, typename Launch>
void with_item_tiling(const DeformConv2dGeometry& g, const PixelWindow& window, int64_t batch,
                      std::initializer_list<const Tensor*> tensors, const LanePathNames& names,
                      const Launch& launch) {
  with_channel_vectors<kWide>(
      batch * window.pixels * g.offset_groups, g.channels_per_offset_group(),
      g.channels_per_group(), g.taps(), kStagedSamples<opmath_t>, tensors, names,
      [&](auto width, auto t) {
    const int64_t input_elements = batch * g.in_pixels() * g.in_channels;
    with_index_divisors(g, window, std::max(columns_entries_in(g, window, batch), input_elements),
                        [&](const auto& divisors) { launch(width, t, divisors); });
  });
}

// The CUDA launchers prepare nothing per window (sampling.prepared is undefined): the kernels
// locate their samples themselves.
void im2col_cuda(const DeformConv2dGeometry& g, const PixelWindow& window, int64_t batch,
                 const Tensor& input, const WindowSampling& sampling, Tensor& columns) {
  const Tensor& offset = sampling.offset;
  const Tensor& mask = sampling.mask;
  DEFORMCONV_DISPATCH(input.scalar_type(), "deform_conv2d_im2col_cuda", [&] {
    with_item_tiling<16 / sizeof(scalar_t), opmath_type<scalar_t>>(
        g, window, batch, {&input, &columns}, kIm2colPaths,
        [&](auto width, auto t, const auto& divisors) {
      using Divisor = typename std::decay_t<decltype(divisors)>::divisor_type;
      auto* kernel = im2col_kernel<scalar_t, decltype(width)::value, Divisor>;
      DEFORMCONV_LAUNCH(kernel, blocks_of(t), kThreadsPerBlock,
                        current_cuda_stream())(
          g, window, divisors, t, input.const_data_ptr<scalar_t>(),
          offset.const_data_ptr<scalar_t>(), data_or_null<scalar_t>(mask),
          columns.mutable_data_ptr<scalar_t>());
      DEFORMCONV_CHECK_LAUNCH();
    });
  });
}

void column_gradients_cuda(const DeformConv2dGeometry& g, const PixelWindow& window, int64_t batch,
                           const Tensor& grad_columns, const Tensor& input,
                           const WindowSampling& sampling, Tensor& grad_input, Tensor& grad_offset,
                           Tensor& grad_mask, bool deterministic) {
  const bool gathered = grad_input.defined() && deterministic;
  if (gathered && gather_in_image_chunks(
                      batch, window.pixels * g.offset_groups * g.taps(),
                      g.in_pixels() * g.offset_groups, grad_columns.scalar_type(),
                      "deform_conv2d.cuda.column_gradients.input.image_chunks",
                      [&](int64_t first, int64_t count) {
                        const WindowSampling chunk_sampling{
                            narrow_images(sampling.offset, first, count),
                            narrow_images(sampling.mask, first, count), sampling.prepared};
                        Tensor grad_input_chunk = narrow_images(grad_input, first, count);
                        Tensor grad_offset_chunk = narrow_images(grad_offset, first, count);
                        Tensor grad_mask_chunk = narrow_images(grad_mask, first, count);
                        // The columns' images, whatever the buffer's shape: C_in * K * window
                        // entries each.
                        const int64_t image_columns = columns_entries_in(g, window, 1);
                        const Tensor columns_chunk =
                            views::narrow(views::view(grad_columns, {grad_columns.numel()}), 0,
                                          first * image_columns, count * image_columns);
                        column_gradients_cuda(g, window, count, columns_chunk,
                                              narrow_images(input, first, count), chunk_sampling,
                                              grad_input_chunk, grad_offset_chunk, grad_mask_chunk,
                                              true);
                      })) {
    return;
  }
  if (grad_input.defined()) {
    record_branch("deform_conv2d.cuda.column_gradients.input");
    record_branch(gathered ? "deform_conv2d.cuda.column_gradients.input.gathered"
                           : "deform_conv2d.cuda.column_gradients.input.atomic_adds");
  }
  const bool position_grads = grad_offset.defined() || grad_mask.defined();
  if (position_grads) {
    record_branch("deform_conv2d.cuda.column_gradients.offset_mask");
  }
  DEFORMCONV_DISPATCH(grad_columns.scalar_type(), "deform_conv2d_column_gradients_cuda", [&] {
    using opmath_t = opmath_type<scalar_t>;
    // Note [Input gradient sums in float32]
    Tensor sums;
    if (grad_input.defined()) {
      sums = input_gradient_sums<scalar_t>(grad_input);
    }
    // Vectors are loaded from each tensor that the kernel reads (the input only for the offset
    // and mask gradients), and added into the sums.
    const Tensor& input_or_columns = position_grads ? input : grad_columns;
    const Tensor& sums_or_columns = sums.defined() ? sums : grad_columns;
    with_item_tiling<16 / sizeof(opmath_t), opmath_t>(
        g, window, batch, {&grad_columns, &input_or_columns, &sums_or_columns},
        kColumnGradientPaths, [&](auto width, auto t, const auto& divisors) {
      using Divisor = typename std::decay_t<decltype(divisors)>::divisor_type;
      auto* kernel =
          gathered ? column_gradients_kernel<scalar_t, decltype(width)::value, Divisor, true>
                   : column_gradients_kernel<scalar_t, decltype(width)::value, Divisor, false>;
      // Rows of the map: (image, input pixel, deform group), of the group's channels, which
      // lie in the columns gradient by conv group (columns_entry): the next conv group's
      // channels of a pixel and tap window.pixels * K * Cg entries past the one before's.
      std::optional<GatheredInputGradient<scalar_t>> gather;
      if (gathered) {
        const int64_t conv_group_entries = window.pixels * g.taps() * g.channels_per_group();
        gather.emplace(grad_columns, t.items * g.taps(), batch * g.in_pixels() * g.offset_groups,
                       g.channels_per_offset_group(),
                       SourceRun{g.offset_groups, g.channels_per_group(),
                                 conv_group_entries - g.channels_per_group()});
      }
      DEFORMCONV_LAUNCH(kernel, blocks_of(t), kThreadsPerBlock, current_cuda_stream())(
          g, window, divisors, t, grad_columns.const_data_ptr<scalar_t>(),
          position_grads ? input.const_data_ptr<scalar_t>() : nullptr,
          sampling.offset.const_data_ptr<scalar_t>(), data_or_null<scalar_t>(sampling.mask),
          sums.defined() && !gathered ? sums.mutable_data_ptr<opmath_t>() : nullptr,
          gather ? gather->entries() : CornerEntries<opmath_t>{},
          mutable_data_or_null<scalar_t>(grad_offset), mutable_data_or_null<scalar_t>(grad_mask));
      DEFORMCONV_CHECK_LAUNCH();
      if (gather) {
        gather->add_to(sums);
      }
    });
    if (grad_input.defined()) {
      store_input_gradient_sums(sums, grad_input);
    }
  });
}

void transpose_cuda(const Tensor& src, Tensor& dst) {
  torch::stable::copy_(dst, views::transpose(src, 1, 2));
}

// cuBLAS's batched GEMMs, whatever the call.
const WindowGemms& window_gemms_cuda(const DeformConv2dGeometry&, ScalarType) {
  return bmm_window_gemms();
}

// Every stage over the whole GPU, window by window: no fused kernel, and no host threads to
// share work out to.
ForwardPlan forward_plan_cuda(const DeformConv2dGeometry&, ScalarType, int64_t, int64_t, int64_t,
                              const WindowGemms&) {
  return ForwardPlan::kStages;
}

// The caching allocator reuses its blocks: nothing to ask of the memory system.
Tensor scratch_cuda(const Tensor& like, Sizes sizes, ScalarType dtype) {
  return new_contiguous(like, sizes, dtype);
}

const DeformConv2dLaunchers& deform_conv2d_cuda_launchers() {
  // 256 MiB of columns per window: whole feature maps at detection resolutions in one GEMM.
  static const DeformConv2dLaunchers launchers{
      .block_columns_bytes = int64_t(64) << 20,
      .columns_tile_bytes = int64_t(256) << 20,
      .workspace_bytes_per_sample = 0,
      .prepare_window = nullptr,
      .scratch = scratch_cuda,
      .im2col = im2col_cuda,
      .column_gradients = column_gradients_cuda,
      .transpose = transpose_cuda,
      .gemms = window_gemms_cuda,
      .forward_plan = forward_plan_cuda,
      .fused_forward_weight = nullptr,
      .fused_forward = nullptr,
  };
  return launchers;
}

}  // namespace

// The kernels at the CUDA key: the drivers with these launchers. The test suite's emulation
// build, which compiles this file as C++, registers them under its own namespace.
#if !defined(DEFORMCONV_CUDA_EMULATION)
STABLE_TORCH_LIBRARY_IMPL(deformconv, CUDA, m) {
  register_device_kernels<DeformConv2dOp, CudaDevice, deform_conv2d_forward, deform_conv2d_backward,
                          deform_conv2d_cuda_launchers>(m);
}

// cuBLAS's batched GEMMs for the bmm GEMMs (infrastructure/matrix_products.h), from the C shim's
// CUDA entry points, which only a torch with CUDA has.
const bool kCudaMatrixProductsRegistered = [] {
  static constexpr MatrixProducts products{aoti_torch_cuda_bmm_out, aoti_torch_cuda_baddbmm_out};
  register_cuda_matrix_products(products);
  return true;
}();
#endif

}  // namespace deformconv
