#pragma once

// Note [Gathered input gradients]
// The input gradient of a deformable op (DCN v1/v2's col2im, DCNv3/DCNv4's input gradient,
// MSDA's value gradient) is a scatter: each sample adds weight * its output gradient, a run of
// channels, at each of its cell's four corners. With atomic adds the order of the adds into an
// element follows the block schedule, and floating-point sums differ in their last bits from
// run to run. Under PyTorch's deterministic mode the launchers take this path instead, in three
// steps:
//   1. The backward kernel itself, instead of adding, records each sample's four corners as
//      entries 4 s + c (s the sample's number in the launch, c the corner): the row of the input
//      gradient that the corner adds to, a row being the run of channels of one (image, pixel,
//      group or head), and the corner's weight (zero-weight corners keep the row past the last,
//      no_row, which the map is filled with first); and the sample's source, where its output
//      gradient's run starts. The lane that has a sample's channel vector 0 records it. A sample's
//      position and weights depend on (image, group, tap, output pixel), never on the channel:
//      the map is built once for all of a group's channels.
//   2. A stable sort of the entries by row (torch.sort(stable=True), deterministic on every
//      device) gives each row's entries in the samples' order, whatever the schedule that
//      recorded them; each row's list starts where a binary search of the sorted rows finds it.
//   3. One thread per element of the input gradient sums its row's list in that order, in
//      opmath_type (float32 for the half types), and adds the total to the sums once: no
//      atomics. Channel c of a row is read from each sample's output gradient at source +
//      SourceRun::offset: c itself where a run's channels lie side by side there (DCNv3/DCNv4's
//      groups, MSDA's heads); DCN v1/v2's columns gradient is laid out by conv group, so a
//      deform group's run is split where a conv group ends, its channels in the next conv group
//      a stretch further on. The split is computed from the row, so it costs no map bytes (a
//      source per conv group would cost 8 bytes a sample for each further conv group, 248 a
//      sample for ResNeXt-DCN's 32 conv groups over one deform group).
// The offset, mask, location and attention-weight gradients need nothing of this: each is
// written by one lane of its sample, after warp shuffles in a fixed pattern.
//
// Memory beyond the atomic path, per sample of a launch: 4 entries of a row (8 bytes) and a
// weight (sizeof(opmath_type)), the sorted rows and the sort's permutation (8 + 8 bytes each),
// and the source (8 bytes): 4 * 28 + 8 = 120 bytes in float32 and the half types (136 in
// float64); plus 8 bytes per row (and one) for the lists' starts, plus the sort's own scratch.
// A sample's corners reach its own image only, so the launchers bound the map by gathering a
// batch in chunks of whole images (gather_in_image_chunks), each chunk's rows summing the same
// lists as the whole batch's would: the same bits. A row whose list is empty is not read or
// written in step 3, so that a launch over some of an input's samples (DCN v1/v2's windows)
// costs its rows' list starts alone where its samples do not reach.

#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/stableivalue_conversions.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <utility>

#include "../common/bilinear_sampling.cuh"
#include "../common/scalar_types.h"
#include "../infrastructure/branch_trace.h"
#include "../infrastructure/stable_tensors.h"
#include "../infrastructure/tensor_views.h"
#include "launch.cuh"

// The most bytes of map (less the sort's scratch) that a launcher builds at once: what DCN
// v1/v2 sizes its blocks of columns to on a GPU. The emulated tests lower it to gather in
// chunks.
#ifndef DEFORMCONV_GATHER_MAP_BYTES
#define DEFORMCONV_GATHER_MAP_BYTES (int64_t(64) << 20)
#endif

namespace deformconv {

// Where a backward kernel's gathering instance records its samples' corners (step 1 of the
// Note); empty for the atomic instance.
template <typename opmath_t>
struct CornerEntries {
  int64_t* rows = nullptr;      // 4 per sample
  opmath_t* weights = nullptr;  // 4 per sample
  int64_t* sources = nullptr;   // 1 per sample
  int64_t run = 1;              // channels of a row
  int64_t no_row = 0;           // the number of rows: past the last

  // Corner `corner` of sample `sample`, of non-zero weight, adds to the run whose channel 0 is
  // element `corner_element` of the input gradient; the sample's output gradient's run starts
  // at element `source`. The corners of zero weight are not recorded: their rows stay no_row.
  __device__ void record(int64_t sample, int corner, opmath_t weight, int64_t corner_element,
                         int64_t source) const {
    const int64_t entry = 4 * sample + corner;
    rows[entry] = corner_element / run;
    weights[entry] = weight;
    sources[sample] = source;
  }
};

// Where channel `channel` of row `row`'s run lies in a sample's output gradient, from the
// sample's source (step 3 of the Note). A row's run is one of `runs_per_row` in a row of the
// whole tensor (DCN v1/v2's deform groups of a pixel: rows (image, pixel, deform group)), so it
// starts at channel (row % runs_per_row) * run there; the tensor's channels lie in segments of
// `segment` (conv groups), the next segment's first channel `segment_gap` entries past the
// end of the one before. The defaults: one run a row, in one segment.
struct SourceRun {
  int64_t runs_per_row = 1;
  int64_t segment = INT64_MAX;
  int64_t segment_gap = 0;

  C10_HOST_DEVICE int64_t offset(int64_t row, int64_t run, int64_t channel) const {
    if (segment_gap == 0) {
      return channel;
    }
    const int64_t first = row % runs_per_row * run;
    return channel + ((first + channel) / segment - first / segment) * segment_gap;
  }
};

// Step 2's starts: list_starts[row] is the first sorted entry of `row` or later (row in
// [0, rows]), by binary search of the sorted rows. A template, as the other kernels, so that
// each .cu that includes this header may define it.
template <typename row_t>
__global__ void list_starts_kernel(const row_t* sorted_rows, int64_t entries, int64_t rows,
                                   int64_t* list_starts) {
  for (int64_t row = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; row <= rows;
       row += int64_t(gridDim.x) * blockDim.x) {
    int64_t low = 0, high = entries;
    while (low < high) {
      const int64_t middle = low + (high - low) / 2;
      if (sorted_rows[middle] < row) {
        low = middle + 1;
      } else {
        high = middle;
      }
    }
    list_starts[row] = low;
  }
}

// Step 3: sums[row * run + channel] += the sum over its row's list of weight * the sample's
// output gradient at that channel, a thread per element: a warp's threads take neighbouring
// channels of one row, reading each entry once for all of them and the sources as runs. Its
// list loop is a chain of dependent loads (entry, then weight and source, then gradient), so
// the blocks are bounded to 32 registers a thread: 8 blocks of 256 an SM, full occupancy to
// hide the latency (37 registers unbounded, 6 blocks; no spills at 32, sm_90).
template <typename scalar_t>
__global__ void __launch_bounds__(kThreadsPerBlock, 8) gather_input_gradient_kernel(int64_t rows, int64_t run, SourceRun source_run,
                                             const int64_t* list_starts, const int64_t* order,
                                             const opmath_type<scalar_t>* weights,
                                             const int64_t* sources, const scalar_t* gradients,
                                             opmath_type<scalar_t>* sums) {
  using opmath_t = opmath_type<scalar_t>;
  const int64_t elements = rows * run;
  for (int64_t element = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; element < elements;
       element += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = element / run;
    const int64_t first = list_starts[row];
    const int64_t end = list_starts[row + 1];
    if (first == end) {
      continue;
    }
    const int64_t channel = source_run.offset(row, run, element - row * run);
    opmath_t total = 0;
    for (int64_t place = first; place < end; ++place) {
      const int64_t entry = order[place];
      total += weights[entry] * static_cast<opmath_t>(gradients[sources[entry / 4] + channel]);
    }
    sums[element] += total;
  }
}

// torch.sort(keys, stable=True): (sorted keys, their places in `keys`), through the dispatcher.
inline std::pair<Tensor, Tensor> stable_sort(const Tensor& keys) {
  std::array<StableIValue, 4> stack{
      torch::stable::detail::from(keys), torch::stable::detail::from(std::optional<bool>(true)),
      torch::stable::detail::from(int64_t(0)), torch::stable::detail::from(false)};
  STABLE_TORCH_ERROR_CODE_CHECK(
      torch_call_dispatcher("aten::sort", "stable", stack.data(), TORCH_ABI_VERSION));
  return {torch::stable::detail::to<Tensor>(stack[0]), torch::stable::detail::to<Tensor>(stack[1])};
}

inline int64_t gather_blocks(int64_t threads) {
  return std::max<int64_t>(
      1, std::min(kMaxBlocks, (threads + kThreadsPerBlock - 1) / kThreadsPerBlock));
}

// Bytes of map per sample, opmath_type's size in the weights, and per row (the Note's count).
inline int64_t map_bytes_per_sample(ScalarType dtype) {
  return 4 * (8 + element_size(opmath_dtype(dtype)) + 8 + 8) + 8;
}
constexpr int64_t kMapBytesPerRow = 8;

// `tensor`'s images [first, first + count), or undefined where it is.
inline Tensor narrow_images(const Tensor& tensor, int64_t first, int64_t count) {
  return tensor.defined() ? views::narrow(tensor, 0, first, count) : tensor;
}

// Where a batch's map, of `samples_per_image` samples and `rows_per_image` rows an image, would
// pass DEFORMCONV_GATHER_MAP_BYTES: calls gradients(first, count) for chunks of as many whole
// images as fit (at least one), recording `branch`, and returns true; false, having done
// nothing, where the whole batch fits.
template <typename Gradients>
bool gather_in_image_chunks(int64_t batch, int64_t samples_per_image, int64_t rows_per_image,
                            ScalarType dtype, const char* branch, const Gradients& gradients) {
  const int64_t image_bytes =
      samples_per_image * map_bytes_per_sample(dtype) + rows_per_image * kMapBytesPerRow;
  // The list starts' last entry, past the last row, once a chunk.
  const int64_t images = std::max<int64_t>(
      1, (DEFORMCONV_GATHER_MAP_BYTES - kMapBytesPerRow) / std::max<int64_t>(1, image_bytes));
  if (images >= batch) {
    return false;
  }
  record_branch(branch);
  for (int64_t first = 0; first < batch; first += images) {
    gradients(first, std::min(images, batch - first));
  }
  return true;
}

// The map of one launch's samples (Note [Gathered input gradients]): entries() for the backward
// kernel to record into, then add_to(sums) to gather from `gradients`.
template <typename scalar_t>
class GatheredInputGradient {
 public:
  using opmath_t = opmath_type<scalar_t>;

  // `samples` samples, whose corners add to `rows` rows of `run` channels; `gradients` is
  // the tensor (of scalar_t) whose runs the sources will name, laid out as `source_run` says.
  GatheredInputGradient(const Tensor& gradients, int64_t samples, int64_t rows, int64_t run,
                        SourceRun source_run = {})
      : rows_(new_contiguous(gradients, {4 * samples}, ScalarType::Long)),
        weights_(new_contiguous(gradients, {4 * samples}, opmath_dtype(gradients.scalar_type()))),
        sources_(new_contiguous(gradients, {samples}, ScalarType::Long)),
        gradients_(gradients),
        row_count_(rows),
        run_(run),
        source_run_(source_run) {
    torch::stable::fill_(rows_, static_cast<double>(rows));
  }

  CornerEntries<opmath_t> entries() {
    return {rows_.mutable_data_ptr<int64_t>(), weights_.mutable_data_ptr<opmath_t>(),
            sources_.mutable_data_ptr<int64_t>(), run_, row_count_};
  }

  // sums (rows x run, opmath_type) += the gathered gradient, once the backward kernel has
  // recorded every sample.
  void add_to(Tensor& sums) {
    const auto [sorted_rows, order] = stable_sort(rows_);
    Tensor list_starts = new_contiguous(rows_, {row_count_ + 1}, ScalarType::Long);
    DEFORMCONV_LAUNCH(list_starts_kernel<int64_t>, gather_blocks(row_count_ + 1), kThreadsPerBlock,
                      current_cuda_stream())(sorted_rows.const_data_ptr<int64_t>(), rows_.numel(),
                                             row_count_, list_starts.mutable_data_ptr<int64_t>());
    DEFORMCONV_CHECK_LAUNCH();
    DEFORMCONV_LAUNCH(gather_input_gradient_kernel<scalar_t>, gather_blocks(row_count_ * run_),
                      kThreadsPerBlock, current_cuda_stream())(
        row_count_, run_, source_run_, list_starts.const_data_ptr<int64_t>(),
        order.const_data_ptr<int64_t>(),
        weights_.const_data_ptr<opmath_t>(), sources_.const_data_ptr<int64_t>(),
        gradients_.const_data_ptr<scalar_t>(), sums.mutable_data_ptr<opmath_t>());
    DEFORMCONV_CHECK_LAUNCH();
  }

 private:
  Tensor rows_, weights_, sources_, gradients_;
  int64_t row_count_, run_;
  SourceRun source_run_;
};

}  // namespace deformconv
