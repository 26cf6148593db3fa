#pragma once

// The device-specific surface of DCN v1/v2 (deform_conv2d): launchers over the element functions
// of common/deform_conv2d_kernel.cuh. The driver (deform_conv2d.h) is written once against this
// table; cpu/ and cuda/ each fill it in. Every tensor is contiguous, allocated or laid out by
// the driver, on the launcher's device, and holds one block of `batch` images; mask is
// undefined for DCN v1. Input-shaped tensors are channels-last, (batch, H, W, C_in), and the
// columns cover the window of output pixels the driver hands over, in the layout of
// deform_conv2d_kernel.cuh: (batch, G, window pixels, K, C_in / G).

#include <cstdint>
#include <optional>

#include "../common/deform_conv2d_geometry.h"
#include "../infrastructure/dtype_dispatch.h"
#include "../infrastructure/input_gradient_sums.h"
#include "../infrastructure/optional_data.h"
#include "../infrastructure/stable_tensors.h"

namespace deformconv {

// Where the samples of one window come from: the block's offset and mask (mask undefined for
// DCN v1), and the launchers' own preparation of them for this window (prepare_window, into a
// workspace the driver allocates once per call), which the launchers that run after it share:
// on the CPU, the sampling plans that col2im reads. Undefined where the launchers prepare
// nothing, or where im2col runs alone.
struct WindowSampling {
  Tensor offset;
  Tensor mask;
  Tensor prepared;
};

struct DeformConv2dLaunchers;
struct WorkSplit;  // core/deform_conv2d_tiling.h: how a call is cut into blocks and windows

// The GEMMs of a call's windows. The driver runs them without knowing how: by bmm (every device:
// bmm_window_gemms in core/deform_conv2d_gemms.h), or on the CPU in float32 with one conv group as
// oneDNN 1x1 convolutions (cpu/deform_conv2d_onednn_gemms_cpu.cpp). The launcher table's `gemms`
// picks them for a call.
struct WindowGemms {
  // Names of the choice in the branch trace, for the forward and the gradients.
  const char* forward_branch;
  const char* gradients_branch;
  // Whether a window's GEMM runs well on one thread inside a parallel region, so that the
  // forward may share a block's windows out among the threads (Note [Whole images per thread],
  // core/deform_conv2d_forward.cpp).
  bool windows_per_thread_pay;
  // The weight, (C_out, C_in / G, kh, kw), in the layout that `forward` and `gradients` take,
  // for blocks of w.step images at most.
  Tensor (*weight)(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                   const Tensor& weight, const WorkSplit& w);
  // output_window (images * G, C_out / G, window pixels) = the weight times the window's
  // columns, plus the bias.
  void (*forward)(const WorkSplit& w, const PixelWindow& window, int64_t images,
                  const Tensor& columns, const Tensor& weight, const std::optional<Tensor>& bias,
                  Tensor& output_window);
  // The gradients' GEMMs of a window, for grad_output_window (images, G, C_out / G, window).
  // Adds the window's share of the weight gradient to grad_weight_rows (weight_rows' order)
  // when that is defined, `columns` then holding the window's columns, and returns the
  // gradient of the window's columns when want_columns_grad, in the columns' layout: a new
  // tensor, or the columns buffer itself, overwritten.
  Tensor (*gradients)(const WorkSplit& w, const PixelWindow& window, int64_t images,
                      Tensor& columns, const Tensor& grad_output_window, const Tensor& weight,
                      bool want_columns_grad, Tensor& grad_weight_rows);
};

// How the driver runs a forward (core/deform_conv2d_forward.cpp): the device's fused kernel
// (fused_forward), or im2col and the GEMMs by stages (a block's windows in turn, each stage
// over every thread), whole images per thread, or a block's windows per thread. A device's
// forward_plan decides; the CPU's reasons are Notes [Fused forward] and [Whole images per
// thread] in cpu/.
enum class ForwardPlan { kFused, kStages, kImagesPerThread, kWindowsPerThread };

struct DeformConv2dLaunchers {
  // With im2col_step = 0, a block holds as many images as fit in this many bytes of full
  // columns (C_in * K * H_out * W_out elements per image), at least one. On a GPU, 64 MiB gives
  // the GEMMs blocks of a few hundred thousand columns while keeping the scratch memory well
  // below typical activations; on the CPU, whose windows bound the columns anyway, a block of
  // about one window keeps each image's input and gradients in cache.
  int64_t block_columns_bytes;
  // Bytes of columns buffer and scratch to aim for per window of output pixels (the driver
  // tiles the pixels of a block of images so): about the cache of a CPU, or far more on a GPU,
  // whose GEMMs want large operands and whose allocator reuses memory.
  int64_t columns_tile_bytes;
  // Bytes of workspace per sample (image, deform group, tap, pixel) of a window that
  // prepare_window fills, which the tile budget covers too; 0 without prepare_window.
  int64_t workspace_bytes_per_sample;
  // Fills `workspace` (bytes, workspace_bytes_per_sample per sample of the window at least) with
  // what the window's other launchers share, from its offset and mask; null where they share
  // nothing (CUDA: each thread locates its own sample).
  void (*prepare_window)(const DeformConv2dGeometry& geometry, const PixelWindow& window,
                         int64_t batch, const Tensor& offset, const Tensor& mask,
                         Tensor& workspace);
  // An uninitialised contiguous buffer of `sizes` and `dtype` on `like`'s device for the driver's
  // scratch (columns, channels-last copies, the workspace), so that a device may ask its memory
  // system for what suits large buffers.
  Tensor (*scratch)(const Tensor& like, Sizes sizes, ScalarType dtype);
  // columns sampled from input.
  void (*im2col)(const DeformConv2dGeometry& geometry, const PixelWindow& window, int64_t batch,
                 const Tensor& input, const WindowSampling& sampling, Tensor& columns);
  // What grad_columns gives back through the sampling: grad_input += the adjoint of im2col
  // applied to it, and grad_offset and grad_mask. Each gradient may be undefined (not asked
  // for), and `input` where neither grad_offset nor grad_mask is asked for. One entry, so that a
  // device may read grad_columns and locate each sample once for all three. With
  // `deterministic`, the results are the same bits from run to run (Note [Gathered input
  // gradients], cuda/gathered_input_gradient.cuh); a device that is so anyway ignores it.
  void (*column_gradients)(const DeformConv2dGeometry& geometry, const PixelWindow& window,
                           int64_t batch, const Tensor& grad_columns, const Tensor& input,
                           const WindowSampling& sampling, Tensor& grad_input, Tensor& grad_offset,
                           Tensor& grad_mask, bool deterministic);
  // dst (M, C, R) = src (M, R, C) with the last two dimensions swapped, both contiguous: the
  // copies between the (C_in, H * W) planes of the user's tensors and channels-last.
  void (*transpose)(const Tensor& src, Tensor& dst);
  // The GEMMs of a call of this geometry and dtype.
  const WindowGemms& (*gemms)(const DeformConv2dGeometry& geometry, ScalarType dtype);
  // The plan of a forward of `batch` images with this im2col_step (0: automatic), `windows`
  // windows a block and these GEMMs.
  ForwardPlan (*forward_plan)(const DeformConv2dGeometry& geometry, ScalarType dtype, int64_t batch,
                              int64_t im2col_step, int64_t windows, const WindowGemms& gemms);
  // The whole forward of a block of `batch` images without columns (Note [Fused forward],
  // cpu/deform_conv2d_fused_forward_cpu.cpp): output (batch, C_out, H_out, W_out) = the convolution
  // of the sampled input with the weight, plus bias (undefined: none), the weight as
  // fused_forward_weight lays it out, once for all of a call's blocks. Run where forward_plan says
  // kFused; both null where it never does (CUDA).
  Tensor (*fused_forward_weight)(const DeformConv2dGeometry& geometry, const Tensor& weight);
  void (*fused_forward)(const DeformConv2dGeometry& geometry, int64_t batch, const Tensor& input,
                        const Tensor& offset, const Tensor& mask, const Tensor& weight_panels,
                        const Tensor& bias, Tensor& output);
};

}  // namespace deformconv
