// The CPU's choice of GEMMs for DCN v1/v2's windows (window_gemms_cpu): oneDNN 1x1 convolutions
// where they apply, their backward as oneDNN's or as ATen's mm into the driver's buffers; else
// the bmm of core/deform_conv2d_gemms.h.

#include <ATen/ATen.h>

#include <algorithm>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "../core/deform_conv2d_gemms.h"
#include "../infrastructure/parallel_region.h"
#include "deform_conv2d_single_copy_cpu.h"

namespace deformconv {

namespace {

// Note [GEMMs as 1x1 convolutions]
// With one conv group, the columns of a window are, image by image, a channels-last image of
// `window` pixels and K * C_in channels, (images, window, K * C_in). The forward GEMM is then a
// 1x1 convolution of that image with the weight as (C_out, K * C_in, 1, 1), and the columns
// gradient is that convolution's input gradient. On the CPU in float32, ATen runs them on
// oneDNN's convolution kernels, the ones dense convolution runs on, where ATen's bmm runs on
// MKL's sgemm, which is tuned for Intel's CPUs rather than AMD's. Elsewhere (float64, half
// precision, conv groups, a torch without oneDNN or with it turned off), the CPU multiplies
// with bmm.
bool gemms_as_convolutions(const DeformConv2dGeometry& g, at::ScalarType dtype) {
  return g.groups == 1 && dtype == at::kFloat && at::hasMKLDNN() &&
      at::globalContext().userEnabledMkldnn();
}

// The columns of `images` images of `window` as the channels-last image of the Note,
// (images, K * C_in, 1, window pixels).
at::Tensor columns_as_image(const at::Tensor& columns, const WorkSplit& w,
                            const PixelWindow& window, int64_t images) {
  return columns_of_window(columns, w, window, images).permute({0, 2, 1}).unsqueeze(2);
}

// The weight as the 1x1 convolution of the Note takes it: (C_out, K * C_in, 1, 1), its input
// channels in the order of a columns row.
at::Tensor weight_1x1(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                      const at::Tensor& weight, const WorkSplit& w) {
  return weight_rows(launchers, g, weight, w)
      .view({w.groups * w.out_per_group, w.rows_per_group, 1, 1});
}

void convolution_forward(const WorkSplit& w, const PixelWindow& window, int64_t images,
                         const at::Tensor& columns, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias, at::Tensor& output_window) {
  // (images, C_out, 1, window), channels-last.
  const at::Tensor product = at::mkldnn_convolution(columns_as_image(columns, w, window, images),
                                                    weight, bias, {0, 0}, {1, 1}, {1, 1}, 1);
  output_window.copy_(product.squeeze(2));
}

// Note [A window's gradients outlive it]
// The convolution's backward allocates each window's columns gradient and weight gradient
// afresh, megabytes each. Freed at the end of their window, they are often the top of glibc's
// heap, which free() hands back to the kernel once the top passes its trim threshold; the next
// window's are then faulted in again page by page, each page zeroed by the kernel, window after
// window and call after call. So the last window's results are kept, shared by every thread,
// until the next window's have been made, in this call or the next: the older ones then lie
// below the new ones, and their memory is reused. Results of more than 128 MiB are not kept.
void keep_window_results(std::vector<at::Tensor> results) {
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

at::Tensor convolution_backward(const WorkSplit& w, const PixelWindow& window, int64_t images,
                                at::Tensor& columns, const at::Tensor& grad_output_window,
                                const at::Tensor& weight, bool want_columns_grad,
                                at::Tensor& grad_weight_rows) {
  const bool want_weight = grad_weight_rows.defined();
  // The convolution's gradients: of its input, the columns image (images, K * C_in, 1,
  // window), channels-last as the input is, which is the columns layout; of its weight, the
  // window's share of weight_rows.
  const auto [grad_image, grad_weight_window, grad_bias] = at::convolution_backward(
      grad_output_window.squeeze(1).unsqueeze(2), columns_as_image(columns, w, window, images),
      weight, std::nullopt, {1, 1}, {0, 0}, {1, 1}, false, {0, 0}, 1,
      {want_columns_grad, want_weight, false});
  std::vector<at::Tensor> results;
  if (want_weight) {
    grad_weight_rows.add_(grad_weight_window.view_as(grad_weight_rows));
    results.push_back(grad_weight_window);
  }
  at::Tensor grad_columns;
  if (want_columns_grad) {
    results.push_back(grad_image);
    grad_columns = grad_image.permute({0, 2, 3, 1}).reshape({-1});
  }
  keep_window_results(std::move(results));
  return grad_columns;
}

// Note [Backward GEMMs in place]
// oneDNN's convolution backward allocates the window's columns gradient and weight gradient
// (C_out x K * C_in, 9 MiB for 512 x 512 x 3 x 3) afresh, and reorders the weight and the
// gradient into its blocked layouts, more weight-sized buffers: at c5 the backward's peak was
// twice torchvision's. ATen's mm, MKL's sgemm in PyTorch's x86 builds, writes where it is told:
// the weight gradient is added to grad_weight_rows (beta = 1) and the columns gradient written
// over the columns, which the weight gradient has read by then. The threads split both GEMMs by
// the columns' K * C_in, one contiguous share of whole cache lines each, in a parallel region
// of ATen's (Note [Parallel regions through ATen]): a thread's share of the weight gradient
// reads only its share of the columns, which its share of the columns gradient then
// overwrites, so neither waits for the other, and MKL runs each call on its one thread. Against
// one call a GEMM with MKL's own threads, under the AVX2 caps, 2 threads, the backward alone,
// fastest of 15 calls alternated in one process, three runs (ms): c3 74-78 against 78-83, c4
// 62-75 against 65-85, c5 59-64 against 62-69, c3-stride2 107-142 against 108-152; shares of
// 32 columns taken from a shared counter, as the launchers take their tasks, ran slowest of
// the three on c3 (86-92), small GEMMs of strided columns. Forward+backward over the whole
// benchmark is in docs/performance.md. On AVX-512 CPUs oneDNN's kernels outrun MKL's sgemm,
// which keeps to AVX2 on AMD's (c5: 36-38 against 55-59 ms), so the AVX-512 copy keeps
// oneDNN's backward, and its memory.
at::Tensor mm_backward(const WorkSplit& w, const PixelWindow& window, int64_t images,
                       at::Tensor& columns, const at::Tensor& grad_output_window,
                       const at::Tensor& weight, bool want_columns_grad,
                       at::Tensor& grad_weight_rows) {
  // One conv group (gemms_as_convolutions): (images, window, K * C_in) columns, (C_out,
  // K * C_in) weight and weight gradient, (images, C_out, window) gradient, rows P apart.
  const at::Tensor columns_block = columns_of_window(columns, w, window, images);
  const at::Tensor weight_matrix = weight.view({w.out_per_group, w.rows_per_group});
  const at::Tensor grad_output_block = grad_output_window.squeeze(1);
  const bool want_weight = grad_weight_rows.defined();
  const at::Tensor grad_weight_matrix =
      want_weight ? grad_weight_rows.view({w.out_per_group, w.rows_per_group}) : at::Tensor();
  // Each thread's share of the columns, in whole cache lines of float32.
  constexpr int64_t kLineColumns = 16;
  const int64_t lines = (w.rows_per_group + kLineColumns - 1) / kLineColumns;
  const int64_t shares = std::min<int64_t>(thread_count(), lines);
  const auto share_start = [&](int64_t share) {
    return std::min(share * lines / shares * kLineColumns, w.rows_per_group);
  };
  parallel_tasks(
      shares,
      [&](int64_t first_share, int64_t end_share) {
        const int64_t begin = share_start(first_share);
        const int64_t length = share_start(end_share) - begin;
        for (int64_t n = 0; n < images; ++n) {
          at::Tensor columns_share = columns_block[n].narrow(1, begin, length);
          if (want_weight) {
            grad_weight_matrix.narrow(1, begin, length)
                .addmm_(grad_output_block[n], columns_share);
          }
          if (want_columns_grad) {
            at::mm_out(columns_share, grad_output_block[n].t(),
                       weight_matrix.narrow(1, begin, length));
          }
        }
      },
      "deform_conv2d.backward.mm.other_threads");
  return want_columns_grad ? columns : at::Tensor();
}

}  // namespace

const WindowGemms& window_gemms_cpu(const DeformConv2dGeometry& g, at::ScalarType dtype,
                                    bool onednn_backward) {
  // oneDNN runs a convolution on one thread inside a parallel region, reordering the weight for
  // it (a weight-sized buffer per thread): the forward may then give windows to threads.
  static const WindowGemms convolutions{
      .forward_branch = "deform_conv2d.forward.onednn",
      .gradients_branch = "deform_conv2d.backward.onednn",
      .windows_per_thread_pay = true,
      .weight = weight_1x1,
      .forward = convolution_forward,
      .gradients = convolution_backward,
  };
  static const WindowGemms convolutions_then_mm = [] {
    WindowGemms gemms = convolutions;
    gemms.gradients_branch = "deform_conv2d.backward.mm";
    gemms.gradients = mm_backward;
    return gemms;
  }();
  if (!gemms_as_convolutions(g, dtype)) {
    return bmm_window_gemms();
  }
  return onednn_backward ? convolutions : convolutions_then_mm;
}

}  // namespace deformconv
