// The CPU's launcher table of DCN v1/v2: the stages of deform_conv2d_stages.h and the CPU's
// policies (window budget, oneDNN GEMMs, a block of images per thread), which the
// device-neutral driver (core/deform_conv2d.h) runs.
//
// Each stage locates its samples a (deform group, tap) row at a time, as arrays over a stretch
// of pixels (StretchSamples, window_tasks.h), and applies each sample to the consecutive
// channels it serves; col2im, which visits the samples in another order, reads plans made once
// per window. Both the locating and the loops over channels run vectorised, and each stage is
// compiled for several instruction sets (DEFORMCONV_VECTOR_CLONES), chosen when the library
// loads.

#include "cpu_launchers.h"

#include "../common/bilinear_sampling.cuh"
#include "deform_conv2d_stages.h"

namespace deformconv {
namespace {

// 4 MiB of scratch per window (columns and plans): within the last-level cache of a CPU. A
// plan takes 48 bytes in float32, 64 in float64.
constexpr DeformConv2dLaunchers kCpuLaunchers{
    .block_columns_bytes = int64_t(4) << 20,
    .columns_tile_bytes = int64_t(4) << 20,
    .workspace_bytes_per_sample = sizeof(SamplingPlan<double>),
    .prepare_window = make_plans_cpu,
    .scratch = scratch_cpu,
    .im2col = im2col_cpu,
    .col2im = col2im_cpu,
    .offset_mask_grad = offset_mask_grad_cpu,
    .transpose = transpose_cpu,
    .gemms = window_gemms_cpu,
    .fused_forward = fused_forward_cpu,
    .fused_forward_pays = fused_forward_pays_cpu,
    .images_per_thread = true,
};

}  // namespace

const DeformConv2dLaunchers& deform_conv2d_cpu_launchers() { return kCpuLaunchers; }

}  // namespace deformconv
