#pragma once

// What the kernels that give a sample's channels to several lanes share (deform_conv2d_cuda.cu,
// dcnv3_cuda.cu, ms_deform_attn_cuda.cu): vectors of consecutive channels loaded in one access,
// the bilinear value of a staged sample for a vector, the tiling of a launch into items of a
// few lanes with their samples staged in rounds, the choice of the vectors' width from the
// channels and the tensors' alignment, and sums over an item's lanes.

#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "../common/bilinear_sampling.cuh"
#include "../infrastructure/branch_trace.h"
#include "launch.cuh"

namespace deformconv {

// kVector consecutive channels, loaded and stored in one access.
template <typename scalar_t, int kVector>
struct alignas(sizeof(scalar_t) * kVector) ChannelVector {
  scalar_t value[kVector];
};

template <typename scalar_t, int kVector>
__device__ inline ChannelVector<scalar_t, kVector> load_vector(const scalar_t* address) {
  return *reinterpret_cast<const ChannelVector<scalar_t, kVector>*>(address);
}

template <typename scalar_t, int kVector>
__device__ inline void store_vector(scalar_t* address,
                                    const ChannelVector<scalar_t, kVector>& vector) {
  *reinterpret_cast<ChannelVector<scalar_t, kVector>*>(address) = vector;
}

// Adds m * bilinear(sample) of kVector channels to `sum`: corners of zero weight are not read,
// so that an infinite value where a sample takes no part cannot make NaN (as
// sample_value_with_plan). `channels` points at the vector's channels of grid pixel 0, and
// `corners` holds the image's corner offsets (corner_steps).
template <typename scalar_t, int kVector, typename index_t>
__device__ inline void add_sample(const SharedSample<opmath_type<scalar_t>>& sample,
                                  const scalar_t* channels, index_t pixel_stride,
                                  const CornerSteps<index_t>& corners,
                                  opmath_type<scalar_t>* sum) {
  using opmath_t = opmath_type<scalar_t>;
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

// Whether `tensor` starts where vectors of `vector_width` of its elements may be loaded.
inline bool aligned_for_vectors(const torch::stable::Tensor& tensor, int vector_width) {
  return reinterpret_cast<uintptr_t>(tensor.const_data_ptr()) %
             (vector_width * tensor.element_size()) == 0;
}

// How a launch divides its work: items of `vectors` channel vectors, each item taken by
// `lanes` consecutive threads of one warp, lane l taking vectors l, l + lanes, ... (a pass
// each); an item's lanes stage its samples in shared memory, in rounds of as many as fit
// beside those of the block's other items.
struct LaneTiling {
  int64_t items;          // work items of the launch
  int64_t vectors;        // channel vectors of an item
  int64_t passes;         // vectors each lane takes in turn: ceil(vectors / lanes)
  int lanes;              // threads per item: a power of two of at most a warp
  int items_per_block;    // kThreadsPerBlock / lanes
  int samples_per_round;  // samples of each item staged at once
};

// The tiling of `items` items of `channels` channels in vectors of `vector_width`, with
// `samples` samples an item and room for `staged_samples` staged samples a block.
inline LaneTiling lane_tiling(int64_t items, int64_t channels, int vector_width, int64_t samples,
                              int64_t staged_samples) {
  LaneTiling t;
  t.items = items;
  t.vectors = channels / vector_width;
  t.lanes = 1;
  while (t.lanes < t.vectors && t.lanes < kWarpSize) {
    t.lanes *= 2;
  }
  t.passes = (t.vectors + t.lanes - 1) / t.lanes;
  t.items_per_block = kThreadsPerBlock / t.lanes;
  // As few rounds as fit, of samples as even in number as can be.
  const int64_t most = staged_samples / t.items_per_block;
  STD_TORCH_CHECK(most >= 1, "lane_tiling: no room for a sample of each item");
  const int64_t rounds = std::max<int64_t>(1, (samples + most - 1) / most);
  t.samples_per_round = static_cast<int>(std::max<int64_t>(1, (samples + rounds - 1) / rounds));
  return t;
}

inline int64_t blocks_of(const LaneTiling& t) {
  return std::min<int64_t>(kMaxBlocks, (t.items + t.items_per_block - 1) / t.items_per_block);
}

// The names under which a launcher records its paths (Note [Branch trace]).
struct LanePathNames {
  const char* vectors;
  const char* one_at_a_time;
  const char* several_passes;
  const char* several_rounds;
};

// Calls launch(std::integral_constant<int, kVector>{}, tiling) with vectors of kWide channels
// where `channels` (an item's), `run` and `tensors`' alignment allow, else of one channel,
// recording the paths taken under `names`. `run` is the length of the runs of consecutive
// channels in which a kernel addresses its tensors, `channels` itself where an item's channels
// lie side by side everywhere: a vector must not straddle two runs.
template <int kWide, typename Launch>
void with_channel_vectors(int64_t items, int64_t channels, int64_t run, int64_t samples,
                          int64_t staged_samples,
                          std::initializer_list<const torch::stable::Tensor*> tensors,
                          const LanePathNames& names, Launch&& launch) {
  const bool wide = channels % kWide == 0 && run % kWide == 0 &&
                    std::all_of(tensors.begin(), tensors.end(), [](const torch::stable::Tensor* t) {
                      return aligned_for_vectors(*t, kWide);
                    });
  const LaneTiling t = lane_tiling(items, channels, wide ? kWide : 1, samples, staged_samples);
  record_branch(wide ? names.vectors : names.one_at_a_time);
  if (t.passes > 1) {
    record_branch(names.several_passes);
  }
  if (t.samples_per_round < samples) {
    record_branch(names.several_rounds);
  }
  if (wide) {
    launch(std::integral_constant<int, kWide>{}, t);
  } else {
    launch(std::integral_constant<int, 1>{}, t);
  }
}

// The samples a block stages at once: a round holds as many as fit. Few, because an SM's shared
// memory is carved out of the storage of its L1 cache, and the kernels gather each sample's
// corners from the input, which nearby samples read again (each input pixel is a corner of
// about 36 samples of a 3 x 3 DCNv3 kernel): at 32 KiB a block, the five or six blocks an SM
// holds would leave L1 about 60 of its 256 KiB, less than their samples' corners take; at
// 10 to 20 KiB (8 KiB, or one sample per thread where that is more), 100 to 190. A round more
// costs little, an item's lanes waiting only for one another. At least one sample per thread,
// so that a round holds a sample of every item of a block whatever its lanes.
constexpr int64_t kStagedBytesPerBlock = 8 * 1024;

template <typename Staged>
constexpr int64_t kStagedPerBlock =
    std::max<int64_t>(kStagedBytesPerBlock / sizeof(Staged), kThreadsPerBlock);

// The same for SharedSample, which the DCN v2 and DCNv3 kernels stage.
template <typename opmath_t>
constexpr int64_t kStagedSamples = kStagedPerBlock<SharedSample<opmath_t>>;

// Stages a round of an item's samples, as many of the `left` from the round's first on as a
// round holds: once the item's lanes have read the previous round, lane l locates samples l,
// l + lanes, ... of the round (locate(k) gives sample k) into the item's slots `samples`, and
// the lanes wait for one another. Returns the round's number of samples. An item's lanes lie in
// one warp and stage their own item's samples only, so a warp's barrier is enough: no warp
// waits for the others of its block. Every thread of the warp calls it, `active` where its item
// is.
template <typename Staged, typename Locate>
__device__ inline int stage_item_samples(const LaneTiling& t, int lane, bool active, int64_t left,
                                         Staged* samples, const Locate& locate) {
  const int count = static_cast<int>(left < t.samples_per_round ? left : t.samples_per_round);
  __syncwarp();
  if (active) {
    for (int k = lane; k < count; k += t.lanes) {
      samples[k] = locate(k);
    }
  }
  __syncwarp();
  return count;
}

// The sum of `value` over the `lanes` threads of each item (a power of two, an item's lanes
// aligned within their warp), in every one of them. Every thread of the warp calls it.
template <typename opmath_t>
__device__ inline opmath_t sum_over_lanes(opmath_t value, int lanes) {
  for (int distance = lanes / 2; distance > 0; distance /= 2) {
    value += __shfl_xor_sync(0xffffffffu, value, distance);
  }
  return value;
}

// The largest `value` of an item's lanes, in every one of them, likewise.
template <typename opmath_t>
__device__ inline opmath_t max_over_lanes(opmath_t value, int lanes) {
  for (int distance = lanes / 2; distance > 0; distance /= 2) {
    const opmath_t other = __shfl_xor_sync(0xffffffffu, value, distance);
    value = other > value ? other : value;
  }
  return value;
}

}  // namespace deformconv
