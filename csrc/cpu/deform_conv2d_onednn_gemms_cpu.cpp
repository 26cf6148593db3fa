// The CPU's choice of GEMMs for DCN v1/v2's windows (window_gemms_cpu): oneDNN 1x1 convolutions
// where they apply, their backward as oneDNN's or as ATen's mm into the driver's buffers; else
// the bmm of core/deform_conv2d_gemms.h.

#include <torch/csrc/inductor/aoti_torch/generated/c_shim_cpu.h>

#include <algorithm>
#include <array>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "../core/deform_conv2d_gemms.h"
#include "../infrastructure/parallel_region.h"
#include "../infrastructure/path_switches.h"
#include "../infrastructure/tensor_views.h"
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
// precision, conv groups, or with DEFORMCONV_ONEDNN_GEMMS=0 in the environment: Note [Path
// switches]), the CPU multiplies with bmm.
//
// The convolutions are torch's own (convolution and convolution_backward through the C shim;
// the stable ABI has no mkldnn_convolution), which choose their kernels: oneDNN's unless torch
// was built without it or told not to use it (torch.backends.mkldnn, which the stable ABI lets
// this library not read, so the switch is its own), and, for a 1x1 convolution of fewer than 16
// images, unstrided and undilated, torch's im2col and sgemm where torch counts one thread, as
// it does inside a parallel region: a window's GEMM would change kernels, and bits, with the
// thread count. So they are called with a dilation of 2, which a 1x1 kernel, of one tap, leaves
// without effect, and which takes them to oneDNN whatever the thread count
// (test_forward_of_windows_per_thread_equals_one_thread; c3, c4, c5 forward and backward ran
// level with mkldnn_convolution's before the port).
bool gemms_as_convolutions(const DeformConv2dGeometry& g, ScalarType dtype) {
  return g.groups == 1 && dtype == ScalarType::Float && !onednn_gemms_switched_off();
}

// The columns of `images` images of `window` as the channels-last image of the Note,
// (images, K * C_in, 1, window pixels).
Tensor columns_as_image(const Tensor& columns, const WorkSplit& w, const PixelWindow& window,
                        int64_t images) {
  return views::unsqueeze(views::permute(columns_of_window(columns, w, window, images), {0, 2, 1}),
                          2);
}

// The weight as the 1x1 convolution of the Note takes it: (C_out, K * C_in, 1, 1), its input
// channels in the order of a columns row.
Tensor weight_1x1(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                  const Tensor& weight, const WorkSplit& w) {
  return views::view(weight_rows(launchers, g, weight, w),
                     {w.groups * w.out_per_group, w.rows_per_group, 1, 1});
}

constexpr std::array<int64_t, 2> kOnes{1, 1};
constexpr std::array<int64_t, 2> kZeros{0, 0};
// The dilation of the Note's convolutions, without effect on a 1x1 kernel.
constexpr std::array<int64_t, 2> kDilation{2, 2};

// The 1x1 convolution of the Note: (images, C_out, 1, window), channels-last.
Tensor convolution_1x1(const Tensor& image, const Tensor& weight, const Tensor* bias) {
  AtenTensorHandle bias_handle = bias != nullptr ? bias->get() : nullptr;
  AtenTensorHandle product = nullptr;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_convolution(
      image.get(), weight.get(), bias != nullptr ? &bias_handle : nullptr, kOnes.data(), 2,
      kZeros.data(), 2, kDilation.data(), 2, /*transposed=*/0, kZeros.data(), 2, /*groups=*/1,
      &product));
  return Tensor(product);
}

void convolution_forward(const WorkSplit& w, const PixelWindow& window, int64_t images,
                         const Tensor& columns, const Tensor& weight,
                         const std::optional<Tensor>& bias, Tensor& output_window) {
  const Tensor product = convolution_1x1(columns_as_image(columns, w, window, images), weight,
                                         bias.has_value() ? &*bias : nullptr);
  torch::stable::copy_(output_window, views::squeeze(product, 2));
}

// Note [A window's gradients outlive it]
// The convolution's backward allocates each window's columns gradient and weight gradient
// afresh, megabytes each. Freed at the end of their window, they are often the top of glibc's
// heap, which free() hands back to the kernel once the top passes its trim threshold; the next
// window's are then faulted in again page by page, each page zeroed by the kernel, window after
// window and call after call. So the last window's results are kept, shared by every thread,
// until the next window's have been made, in this call or the next: the older ones then lie
// below the new ones, and their memory is reused. Results of more than 128 MiB are not kept.
void keep_window_results(std::vector<Tensor> results) {
  constexpr int64_t kKeptWindowResultsBytes = int64_t(128) << 20;
  struct Kept {
    std::mutex mutex;
    std::vector<Tensor> results;
  };
  // Never destroyed: the tensors are freed at exit by the system, not during static destruction.
  static Kept* kept = new Kept();
  int64_t bytes = 0;
  for (const Tensor& result : results) {
    bytes += result.numel() * static_cast<int64_t>(result.element_size());
  }
  if (bytes > kKeptWindowResultsBytes) {
    results.clear();
  }
  // The previous results are freed here, after the lock is released.
  std::vector<Tensor> previous;
  {
    std::lock_guard<std::mutex> lock(kept->mutex);
    previous = std::exchange(kept->results, std::move(results));
  }
}

// sum += addend, both contiguous float32 of the same size.
void add_into(Tensor& sum, const Tensor& addend) {
  float* to = sum.mutable_data_ptr<float>();
  const float* from = addend.const_data_ptr<float>();
  const int64_t count = sum.numel();
  parallel_tasks(count, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      to[i] += from[i];
    }
  });
}

Tensor convolution_backward(const WorkSplit& w, const PixelWindow& window, int64_t images,
                            Tensor& columns, const Tensor& grad_output_window, const Tensor& weight,
                            bool want_columns_grad, Tensor& grad_weight_rows) {
  const bool want_weight = grad_weight_rows.defined();
  // The convolution's gradients: of its input, the columns image (images, K * C_in, 1,
  // window), channels-last as the input is, which is the columns layout; of its weight, the
  // window's share of weight_rows.
  const std::array<int32_t, 3> output_mask{want_columns_grad, want_weight, false};
  AtenTensorHandle grad_image_handle = nullptr;
  AtenTensorHandle grad_weight_handle = nullptr;
  AtenTensorHandle grad_bias_handle = nullptr;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_convolution_backward(
      views::unsqueeze(views::squeeze(grad_output_window, 1), 2).get(),
      columns_as_image(columns, w, window, images).get(), weight.get(), /*bias_sizes=*/nullptr, 0,
      kOnes.data(), 2, kZeros.data(), 2, kDilation.data(), 2, /*transposed=*/0, kZeros.data(), 2,
      /*groups=*/1, output_mask.data(), 3, &grad_image_handle, &grad_weight_handle,
      &grad_bias_handle));
  const Tensor grad_image(grad_image_handle);
  const Tensor grad_weight_window(grad_weight_handle);
  const Tensor grad_bias(grad_bias_handle);
  std::vector<Tensor> results;
  if (want_weight) {
    add_into(grad_weight_rows, as_contiguous(grad_weight_window));
    results.push_back(grad_weight_window);
  }
  Tensor grad_columns;
  if (want_columns_grad) {
    results.push_back(grad_image);
    // Channels-last from oneDNN: the columns' layout, a view; from torch's other kernels, a copy.
    const Tensor columns_order = views::permute(grad_image, {0, 2, 3, 1});
    grad_columns = columns_order.is_contiguous() ? views::view(columns_order, {-1})
                                                 : torch::stable::reshape(columns_order, {-1});
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
// the columns' K * C_in, one contiguous share of whole cache lines each (through the C shim's
// CPU entry points, which run the kernel itself, as matrix_products.h says why), in a parallel
// region of ATen's (Note [Parallel regions through ATen]): a thread's share of the weight gradient
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
Tensor mm_backward(const WorkSplit& w, const PixelWindow& window, int64_t images, Tensor& columns,
                   const Tensor& grad_output_window, const Tensor& weight, bool want_columns_grad,
                   Tensor& grad_weight_rows) {
  // One conv group (gemms_as_convolutions): (images, window, K * C_in) columns, (C_out,
  // K * C_in) weight and weight gradient, (images, C_out, window) gradient, rows P apart.
  const Tensor columns_block = columns_of_window(columns, w, window, images);
  const Tensor weight_matrix = views::view(weight, {w.out_per_group, w.rows_per_group});
  const Tensor grad_output_block = views::squeeze(grad_output_window, 1);
  const bool want_weight = grad_weight_rows.defined();
  const Tensor grad_weight_matrix =
      want_weight ? views::view(grad_weight_rows, {w.out_per_group, w.rows_per_group}) : Tensor();
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
          const Tensor columns_share =
              views::narrow(views::select(columns_block, n), 1, begin, length);
          const Tensor grad_output_image = views::select(grad_output_block, n);
          if (want_weight) {
            const Tensor grad_weight_share = views::narrow(grad_weight_matrix, 1, begin, length);
            STABLE_TORCH_ERROR_CODE_CHECK(
                aoti_torch_cpu_addmm_out(grad_weight_share.get(), grad_weight_share.get(),
                                         grad_output_image.get(), columns_share.get(), 1.0, 1.0));
          }
          if (want_columns_grad) {
            STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_mm_out(
                columns_share.get(), views::transpose(grad_output_image, 0, 1).get(),
                views::narrow(weight_matrix, 1, begin, length).get()));
          }
        }
      },
      "deform_conv2d.backward.mm.other_threads");
  return want_columns_grad ? columns : Tensor();
}

}  // namespace

const WindowGemms& window_gemms_cpu(const DeformConv2dGeometry& g, ScalarType dtype,
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
