// The forward of deformable convolution (deform_conv2d.h), as the launchers' forward_plan says:
// their fused kernel, or im2col and the GEMMs, window by window, over stages, whole images per
// thread or windows per thread.

#include <ATen/ATen.h>
#include <ATen/ThreadLocalState.h>

#include <algorithm>
#include <vector>

#include "../infrastructure/branch_trace.h"
#include "../infrastructure/parallel_region.h"
#include "deform_conv2d.h"
#include "deform_conv2d_tiling.h"

namespace deformconv {

namespace {

// Note [Whole images per thread]
// With whole images or windows per thread, a thread runs its images' or windows' work by
// itself (im2col, the GEMM, the output copy) in a columns buffer of its own. A block then has
// one barrier, at its end, instead of several per window, each of which makes every thread
// wait for the slowest (a thread whose core another process shares, say), and the threads take
// the images or windows one at a time from a shared counter, so that a slowed thread takes
// fewer. Each pixel's output is the same as in a block and window of its own. When a device
// takes these plans: its forward_plan (the CPU's in cpu/deform_conv2d_cpu.cpp).

// Runs run(i, columns) for i in [0, count) as parallel tasks (parallel_task_runs), each thread
// with a columns buffer of its own. Every thread runs in the caller's thread-local state, which
// worker threads do not inherit: below autograd, as a kernel runs, and seen by the profiler
// that watches the caller, allocations included.
template <typename Function>
void run_with_columns_per_thread(const DeformConv2dLaunchers& launchers,
                                 const DeformConv2dGeometry& g, const WorkSplit& w,
                                 const at::TensorOptions& options, int64_t count,
                                 const Function& run) {
  const at::ThreadLocalState caller_state;
  parallel_task_runs(count, [&](TaskRuns& runs) {
    at::ThreadLocalStateGuard caller_state_guard(caller_state);
    at::Tensor columns = columns_buffer(launchers, g, w, options);
    int64_t begin, end;
    while (runs.take(begin, end)) {
      for (int64_t i = begin; i < end; ++i) {
        run(i, columns);
      }
    }
  });
}

// One window of a block: its columns, then their GEMM into the block's output,
// (images * G, C_out / G, P).
void forward_window(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                    const WorkSplit& w, const PixelWindow& window, int64_t images,
                    const at::Tensor& input_block, const at::Tensor& offset_block,
                    const at::Tensor& mask_block, const WindowGemms& gemms,
                    const at::Tensor& weight_gemm, const std::optional<at::Tensor>& bias,
                    at::Tensor& columns, const at::Tensor& output_block) {
  // Nothing prepared: im2col locates each sample as it reads it.
  launchers.im2col(g, window, images, input_block,
                   WindowSampling{offset_block, mask_block, {}}, columns);
  // (images * G, C_out / G, window) inside the output: rows P apart.
  at::Tensor output_window = output_block.narrow(2, window.begin, window.pixels);
  gemms.forward(w, window, images, columns, weight_gemm, bias, output_window);
}

// The forward of images [first, first + images), one block: channels-last input, then its
// windows, in turn, or shared out among the threads (each with a columns buffer of its own)
// when windows_per_thread.
void forward_block(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                   const WorkSplit& w, const at::Tensor& input, const at::Tensor& offset,
                   const at::Tensor& mask, const WindowGemms& gemms,
                   const at::Tensor& weight_gemm, const std::optional<at::Tensor>& bias,
                   int64_t first, int64_t images, at::Tensor& columns, at::Tensor& output,
                   bool windows_per_thread) {
  const at::Tensor input_block = channels_last_block(launchers, input, first, images);
  const at::Tensor offset_block = offset.narrow(0, first, images);
  const at::Tensor mask_block = mask.defined() ? mask.narrow(0, first, images) : at::Tensor();
  const at::Tensor output_block =
      output.narrow(0, first, images).view({images * w.groups, w.out_per_group, w.pixels});
  const std::vector<PixelWindow> windows = windows_of(w);
  if (!windows_per_thread) {
    for (const PixelWindow& window : windows) {
      forward_window(launchers, g, w, window, images, input_block, offset_block, mask_block,
                     gemms, weight_gemm, bias, columns, output_block);
    }
    return;
  }
  run_with_columns_per_thread(
      launchers, g, w, input.options(), static_cast<int64_t>(windows.size()),
      [&](int64_t i, at::Tensor& thread_columns) {
        forward_window(launchers, g, w, windows[i], images, input_block, offset_block,
                       mask_block, gemms, weight_gemm, bias, thread_columns, output_block);
      });
}

// The fused forward, a block of images at a time.
void fused_forward(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                   const WorkSplit& w, const at::Tensor& input, const at::Tensor& offset,
                   const at::Tensor& mask, const at::Tensor& weight,
                   const std::optional<at::Tensor>& bias, at::Tensor& output) {
  const at::Tensor panels = launchers.fused_forward_weight(g, weight);
  const at::Tensor bias_values = bias.has_value() ? bias->contiguous() : at::Tensor();
  const int64_t batch = input.size(0);
  for (int64_t first = 0; first < batch; first += w.step) {
    const int64_t images = std::min(w.step, batch - first);
    at::Tensor output_block = output.narrow(0, first, images);
    launchers.fused_forward(g, images, channels_last_block(launchers, input, first, images),
                            offset.narrow(0, first, images),
                            mask.defined() ? mask.narrow(0, first, images) : at::Tensor(), panels,
                            bias_values, output_block);
  }
}

}  // namespace

at::Tensor deform_conv2d_forward(
    const DeformConv2dLaunchers& launchers, const at::Tensor& input_arg,
    const at::Tensor& offset_arg, const at::Tensor& weight_arg,
    const std::optional<at::Tensor>& mask_arg, const std::optional<at::Tensor>& bias,
    c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation, int64_t groups,
    int64_t offset_groups, int64_t im2col_step) {
  const DeformConv2dGeometry g =
      check_deform_conv2d_arguments(input_arg, offset_arg, weight_arg, mask_arg, bias, stride,
                                    padding, dilation, groups, offset_groups, im2col_step);
  const at::Tensor offset = offset_arg.contiguous();
  const at::Tensor mask = mask_arg.has_value() ? mask_arg->contiguous() : at::Tensor();

  const int64_t batch = input_arg.size(0);
  at::Tensor output =
      at::empty({batch, g.out_channels, g.out_height, g.out_width}, input_arg.options());
  if (batch == 0) {
    return output;
  }
  const WorkSplit w = split_work(g, batch, im2col_step, input_arg.scalar_type(), launchers,
                                 kMinForwardWindowPixels);
  const WindowGemms& gemms = launchers.gemms(g, input_arg.scalar_type());
  const ForwardPlan plan =
      launchers.forward_plan(g, input_arg.scalar_type(), batch, im2col_step,
                             static_cast<int64_t>(windows_of(w).size()), gemms);
  if (plan == ForwardPlan::kFused) {
    record_branch("deform_conv2d.forward.fused");
    fused_forward(launchers, g, w, input_arg, offset, mask, weight_arg, bias, output);
    return output;
  }
  record_branch(gemms.forward_branch);
  if (plan == ForwardPlan::kImagesPerThread) {
    record_branch("deform_conv2d.forward.images_per_thread");
    const WorkSplit image_split =
        split_work(g, 1, 1, input_arg.scalar_type(), launchers, kMinForwardWindowPixels);
    record_split(image_split, 1, "deform_conv2d.forward.blocks",
                 "deform_conv2d.forward.windows");
    const at::Tensor weight_gemm = gemms.weight(launchers, g, weight_arg, image_split);
    run_with_columns_per_thread(
        launchers, g, image_split, input_arg.options(), batch,
        [&](int64_t n, at::Tensor& columns) {
          forward_block(launchers, g, image_split, input_arg, offset, mask, gemms, weight_gemm,
                        bias, n, 1, columns, output, false);
        });
    return output;
  }
  const bool windows_per_thread = plan == ForwardPlan::kWindowsPerThread;
  record_branch(windows_per_thread ? "deform_conv2d.forward.windows_per_thread"
                                   : "deform_conv2d.forward.stages");
  record_split(w, batch, "deform_conv2d.forward.blocks", "deform_conv2d.forward.windows");
  // Shared by the windows in turn; each thread has its own when windows_per_thread.
  at::Tensor columns =
      windows_per_thread ? at::Tensor() : columns_buffer(launchers, g, w, input_arg.options());
  const at::Tensor weight_gemm = gemms.weight(launchers, g, weight_arg, w);
  for (int64_t first = 0; first < batch; first += w.step) {
    forward_block(launchers, g, w, input_arg, offset, mask, gemms, weight_gemm, bias, first,
                  std::min(w.step, batch - first), columns, output, windows_per_thread);
  }
  return output;
}

}  // namespace deformconv
