// The CPU's launcher table of DCN v1/v2: the stages of deform_conv2d_stages.h and the CPU's
// policies (window budget, oneDNN GEMMs, the forward's plan), which the device-neutral driver
// (core/deform_conv2d.h) runs.
//
// Each stage locates its samples a (deform group, tap) row at a time, as arrays over a stretch of
// pixels (StretchSamples, deform_conv2d_window_tasks.h), and applies each sample to the consecutive
// channels it serves; col2im, which visits the samples in another order, reads plans made once per
// window. Both the locating and the loops over channels run vectorised, and each stage is compiled
// once per instruction set (Note [CPU copies], cpu_copies.h), as is this table; the GEMMs and the
// scratch memory are compiled once (deform_conv2d_single_copy_cpu.h).

#if !defined(DEFORMCONV_CPU_COPY)  // the head (Note [CPU copies], cpu_copies.h)

#include <torch/csrc/stable/library.h>

#include "../common/bilinear_sampling.cuh"
#include "../core/deform_conv2d.h"
#include "../core/deform_conv2d_launchers.h"
#include "../infrastructure/device_kernels.h"
#include "../infrastructure/parallel_region.h"
#include "cpu_launchers.h"
#include "deform_conv2d_single_copy_cpu.h"

#define DEFORMCONV_CPU_COPY_BODY "deform_conv2d_cpu.cpp"
#include "cpu_copies.h"

// The kernels at the CPU key: the drivers with the launchers of the copy in use.
namespace deformconv {
namespace {

const DeformConv2dLaunchers& deform_conv2d_cpu_launchers_in_use() {
  return DEFORMCONV_CPU_LAUNCHERS_IN_USE(deform_conv2d_cpu_launchers);
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(deformconv, CPU, m) {
  register_device_kernels<DeformConv2dOp, CpuDevice, deform_conv2d_forward, deform_conv2d_backward,
                          deform_conv2d_cpu_launchers_in_use>(m);
}

}  // namespace deformconv

#else  // the body, once per copy

#include "deform_conv2d_stages.h"

namespace deformconv::DEFORMCONV_CPU_COPY {
namespace {

// The fused forward where it pays (Note [Fused forward], deform_conv2d_fused_forward_cpu.cpp).
// Otherwise a forward with the automatic im2col_step runs in one parallel region where it can (Note
// [Whole images per thread], core/deform_conv2d_forward.cpp): with a batch that gives every thread
// at least two images, each thread takes whole images, one block of one image at a time; with fewer
// images and GEMMs that run well on one thread (oneDNN's), a block's windows are shared out
// instead, if there are at least two per thread (a window's bmm, for grouped convolutions, runs
// slower on one thread than on all). The ATen and oneDNN calls inside run on the calling thread
// alone, and oneDNN then reorders the weight for each GEMM (a weight-sized buffer per thread): with
// a single window per thread, whose shares could not even out anyway, a forward keeps its stages.
ForwardPlan forward_plan_cpu(const DeformConv2dGeometry& g, ScalarType dtype, int64_t batch,
                             int64_t im2col_step, int64_t windows, const WindowGemms& gemms) {
  if (fused_forward_pays_cpu(g, dtype)) {
    return ForwardPlan::kFused;
  }
  const int64_t threads = thread_count();
  if (im2col_step != 0 || threads == 1 || in_parallel_region()) {
    return ForwardPlan::kStages;
  }
  if (batch >= 2 * threads) {
    return ForwardPlan::kImagesPerThread;
  }
  return gemms.windows_per_thread_pay && windows >= 2 * threads ? ForwardPlan::kWindowsPerThread
                                                                : ForwardPlan::kStages;
}

// oneDNN's backward GEMMs where its AVX-512 kernels outrun ATen's sgemm; elsewhere the GEMMs
// that allocate nothing (Note [Backward GEMMs in place], deform_conv2d_onednn_gemms_cpu.cpp).
const WindowGemms& window_gemms(const DeformConv2dGeometry& g, ScalarType dtype) {
  return window_gemms_cpu(g, dtype, /*onednn_backward=*/kRegisterBytes == 64);
}

// 4 MiB of scratch per window (columns and plans): within the last-level cache of a CPU. A
// plan takes 48 bytes in float32, 64 in float64.
constexpr DeformConv2dLaunchers kCpuLaunchers{
    .block_columns_bytes = int64_t(4) << 20,
    .columns_tile_bytes = int64_t(4) << 20,
    .workspace_bytes_per_sample = sizeof(SamplingPlan<double>),
    .prepare_window = make_plans_cpu,
    .scratch = scratch_cpu,
    .im2col = im2col_cpu,
    .column_gradients = column_gradients_cpu,
    .transpose = transpose_cpu,
    .gemms = window_gemms,
    .forward_plan = forward_plan_cpu,
    .fused_forward_weight = fused_forward_weight_cpu,
    .fused_forward = fused_forward_cpu,
};

const DeformConv2dLaunchers& deform_conv2d_cpu_launchers() { return kCpuLaunchers; }

}  // namespace

}  // namespace deformconv::DEFORMCONV_CPU_COPY

#endif
