// The forward of deformable convolution (deform_conv2d.h), as the launchers' forward_plan says:
// their fused kernel, or im2col and the GEMMs, window by window, over stages, whole images per
// thread or windows per thread.

#include <algorithm>
#include <atomic>
#include <vector>

#include "../infrastructure/branch_trace.h"
#include "../infrastructure/parallel_region.h"
#include "../infrastructure/tensor_views.h"
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
// with a columns buffer of its own. The buffers are all made here, on the calling thread, whose
// allocations the profiler that watches the caller sees (a worker thread does not carry the
// caller's thread-local state); each thread takes one as it starts.
template <typename Function>
void run_with_columns_per_thread(const DeformConv2dLaunchers& launchers,
                                 const DeformConv2dGeometry& g, const WorkSplit& w,
                                 const Tensor& like, int64_t count, const Function& run) {
  std::vector<Tensor> buffers;
  for (int64_t run = 0; run < task_run_count(count); ++run) {
    buffers.push_back(columns_buffer(launchers, g, w, like));
  }
  std::atomic<size_t> next_buffer{0};
  parallel_task_runs(count, [&](TaskRuns& runs) {
    Tensor& columns = buffers[next_buffer.fetch_add(1)];
    int64_t begin, end;
    while (runs.take(begin, end)) {
      for (int64_t i = begin; i < end; ++i) {
        run(i, columns);
      }
    }
  });
}

// What every block of one forward by im2col and the GEMMs shares: the launchers, the geometry
// and work split, the GEMMs with the weight in their layout, and the whole batch's operands
// (mask undefined without one; offset and mask contiguous).
struct GemmForward {
  const DeformConv2dLaunchers& launchers;
  const DeformConv2dGeometry& g;
  const WorkSplit& w;
  const WindowGemms& gemms;
  const Tensor& weight_gemm;
  const std::optional<Tensor>& bias;
  const Tensor& input;
  const Tensor& offset;
  const Tensor& mask;
  const Tensor& output;
};

// A block's operands, for images [first, first + images): channels-last input, offsets and
// mask, and the output as (images * G, C_out / G, P).
struct ForwardBlock {
  int64_t images;
  Tensor input, offset, mask, output;
};

ForwardBlock forward_block_of(const GemmForward& f, int64_t first, int64_t images) {
  return ForwardBlock{
      images, channels_last_block(f.launchers, f.input, first, images),
      views::narrow(f.offset, 0, first, images),
      f.mask.defined() ? views::narrow(f.mask, 0, first, images) : Tensor(),
      views::view(views::narrow(f.output, 0, first, images),
                  {images * f.w.groups, f.w.out_per_group, f.w.pixels})};
}

// One window of a block: its columns, then their GEMM into the block's output.
void forward_window(const GemmForward& f, const ForwardBlock& block, const PixelWindow& window,
                    Tensor& columns) {
  // Nothing prepared: im2col locates each sample as it reads it.
  f.launchers.im2col(f.g, window, block.images, block.input,
                     WindowSampling{block.offset, block.mask, {}}, columns);
  // (images * G, C_out / G, window) inside the output: rows P apart.
  Tensor output_window = views::narrow(block.output, 2, window.begin, window.pixels);
  f.gemms.forward(f.w, window, block.images, columns, f.weight_gemm, f.bias, output_window);
}

// The forward of images [first, first + images), one block: its windows, in turn, or shared
// out among the threads (each with a columns buffer of its own) when windows_per_thread.
void forward_block(const GemmForward& f, int64_t first, int64_t images, Tensor& columns,
                   bool windows_per_thread) {
  const ForwardBlock block = forward_block_of(f, first, images);
  const std::vector<PixelWindow> windows = windows_of(f.w);
  if (!windows_per_thread) {
    for (const PixelWindow& window : windows) {
      forward_window(f, block, window, columns);
    }
    return;
  }
  run_with_columns_per_thread(f.launchers, f.g, f.w, f.input,
                              static_cast<int64_t>(windows.size()),
                              [&](int64_t i, Tensor& thread_columns) {
                                forward_window(f, block, windows[i], thread_columns);
                              });
}

// The fused forward, a block of images at a time.
void fused_forward(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                   const WorkSplit& w, const Tensor& input, const Tensor& offset,
                   const Tensor& mask, const Tensor& weight, const std::optional<Tensor>& bias,
                   Tensor& output) {
  const Tensor panels = launchers.fused_forward_weight(g, weight);
  const Tensor bias_values = bias.has_value() ? as_contiguous(*bias) : Tensor();
  const int64_t batch = input.size(0);
  for (int64_t first = 0; first < batch; first += w.step) {
    const int64_t images = std::min(w.step, batch - first);
    Tensor output_block = views::narrow(output, 0, first, images);
    launchers.fused_forward(g, images, channels_last_block(launchers, input, first, images),
                            views::narrow(offset, 0, first, images),
                            mask.defined() ? views::narrow(mask, 0, first, images) : Tensor(),
                            panels, bias_values, output_block);
  }
}

}  // namespace

Tensor deform_conv2d_forward(const DeformConv2dLaunchers& launchers, const Tensor& input_arg,
                             const Tensor& offset_arg, const Tensor& weight_arg,
                             const std::optional<Tensor>& mask_arg,
                             const std::optional<Tensor>& bias, const std::vector<int64_t>& stride,
                             const std::vector<int64_t>& padding,
                             const std::vector<int64_t>& dilation, int64_t groups,
                             int64_t offset_groups, int64_t im2col_step) {
  const DeformConv2dGeometry g =
      check_deform_conv2d_arguments(input_arg, offset_arg, weight_arg, mask_arg, bias, stride,
                                    padding, dilation, groups, offset_groups, im2col_step);
  const Tensor offset = as_contiguous(offset_arg);
  const Tensor mask = mask_arg.has_value() ? as_contiguous(*mask_arg) : Tensor();

  const int64_t batch = input_arg.size(0);
  Tensor output = new_contiguous(input_arg, {batch, g.out_channels, g.out_height, g.out_width});
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
    const Tensor weight_gemm = gemms.weight(launchers, g, weight_arg, image_split);
    const GemmForward f{launchers, g, image_split, gemms, weight_gemm,
                        bias, input_arg, offset, mask, output};
    run_with_columns_per_thread(launchers, g, image_split, input_arg, batch,
                                [&](int64_t n, Tensor& columns) {
                                  forward_block(f, n, 1, columns, false);
                                });
    return output;
  }
  const bool windows_per_thread = plan == ForwardPlan::kWindowsPerThread;
  record_branch(windows_per_thread ? "deform_conv2d.forward.windows_per_thread"
                                   : "deform_conv2d.forward.stages");
  record_split(w, batch, "deform_conv2d.forward.blocks", "deform_conv2d.forward.windows");
  // Shared by the windows in turn; each thread has its own when windows_per_thread.
  Tensor columns = windows_per_thread ? Tensor() : columns_buffer(launchers, g, w, input_arg);
  const Tensor weight_gemm = gemms.weight(launchers, g, weight_arg, w);
  const GemmForward f{launchers, g, w, gemms, weight_gemm, bias, input_arg, offset, mask, output};
  for (int64_t first = 0; first < batch; first += w.step) {
    forward_block(f, first, std::min(w.step, batch - first), columns, windows_per_thread);
  }
  return output;
}

}  // namespace deformconv
