// CPU launchers: at::parallel_for over the shared element functions, and the CPU kernels of
// the ops.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>

#include "../common/deform_conv2d_kernel.cuh"
#include "../pytorch/deform_conv2d.h"

namespace deformconv {
namespace {

// The unit of CPU work: up to kPixelChunk consecutive output pixels of one (image, deform
// group, tap). A task makes the sampling plans of its chunk once, then sweeps the chunk channel
// by channel: each sweep reads one input plane and one contiguous stretch of one columns row,
// which keeps the caches and the TLB on a few pages instead of one page per channel.
constexpr int64_t kPixelChunk = 256;
// col2im gives each task this many channels of one deform group of one image: the task owns
// their gradient planes (no atomics, and a result that does not depend on the thread count)
// and makes each sampling plan once for all of them.
constexpr int64_t kCol2imChannelBlock = 16;

struct PixelChunk {
  SampleIndex first;  // the chunk's first sample; the others follow in pixel
  int64_t length;
};

int64_t chunks_per_row(const DeformConv2dGeometry& g) {
  return (g.window_pixels + kPixelChunk - 1) / kPixelChunk;
}

// Chunk `part` of row `row`, a row being the window's pixels of one (image, deform group,
// tap): (n * G + g) * K + k.
PixelChunk pixel_chunk(const DeformConv2dGeometry& g, int64_t row, int64_t part) {
  const int64_t pixel = part * kPixelChunk;
  return {decompose_sample_index(g, row * g.window_pixels + pixel),
          std::min(kPixelChunk, g.window_pixels - pixel)};
}

int64_t rows_in(const DeformConv2dGeometry& g, int64_t batch) {
  return batch * g.offset_groups * g.taps();
}

template <typename scalar_t>
using PlanChunk = std::array<SamplingPlan<at::opmath_type<scalar_t>>, kPixelChunk>;

template <typename scalar_t>
void make_plans(const DeformConv2dGeometry& g, const PixelChunk& chunk, const scalar_t* offset,
                const scalar_t* mask, PlanChunk<scalar_t>& plans) {
  SampleIndex s = chunk.first;
  for (int64_t i = 0; i < chunk.length; ++i, next_pixel(g, s)) {
    plans[i] = make_sampling_plan(g, s, offset, mask);
  }
}

// Parallel over pixel chunks: every columns entry is written by exactly one task.
void im2col_cpu(const DeformConv2dGeometry& g, int64_t batch, const at::Tensor& input,
                const at::Tensor& offset, const at::Tensor& mask, at::Tensor& columns) {
  DEFORMCONV_DISPATCH(input.scalar_type(), "deform_conv2d_im2col_cpu", [&] {
    const scalar_t* input_data = input.const_data_ptr<scalar_t>();
    const scalar_t* offset_data = offset.const_data_ptr<scalar_t>();
    const scalar_t* mask_data = data_or_null<scalar_t>(mask);
    scalar_t* columns_data = columns.mutable_data_ptr<scalar_t>();
    const int64_t parts = chunks_per_row(g);
    at::parallel_for(0, rows_in(g, batch) * parts, 1, [&](int64_t begin, int64_t end) {
      PlanChunk<scalar_t> plans;
      for (int64_t task = begin; task < end; ++task) {
        const PixelChunk chunk = pixel_chunk(g, task / parts, task % parts);
        make_plans(g, chunk, offset_data, mask_data, plans);
        const int64_t first = first_channel(g, chunk.first.group);
        for (int64_t c = first; c < first + g.channels_per_offset_group(); ++c) {
          const scalar_t* plane = plane_of(g, input_data, chunk.first.n, c);
          // The chunk's entries are consecutive in its columns row.
          scalar_t* row = columns_data + column_index(g, chunk.first, c);
          for (int64_t i = 0; i < chunk.length; ++i) {
            row[i] = sample_with_plan(plans[i], plane);
          }
        }
      }
    });
  });
}

// Parallel over (image, deform group, block of channels): see kCol2imChannelBlock. Within a
// plane the adds come in a fixed order (tap, then pixel), whatever the partition.
void col2im_cpu(const DeformConv2dGeometry& g, int64_t batch, const at::Tensor& grad_columns,
                const at::Tensor& offset, const at::Tensor& mask, at::Tensor& grad_input) {
  DEFORMCONV_DISPATCH(grad_columns.scalar_type(), "deform_conv2d_col2im_cpu", [&] {
    const scalar_t* grad_columns_data = grad_columns.const_data_ptr<scalar_t>();
    const scalar_t* offset_data = offset.const_data_ptr<scalar_t>();
    const scalar_t* mask_data = data_or_null<scalar_t>(mask);
    scalar_t* grad_input_data = grad_input.mutable_data_ptr<scalar_t>();
    const int64_t channels = g.channels_per_offset_group();
    const int64_t blocks = (channels + kCol2imChannelBlock - 1) / kCol2imChannelBlock;
    const int64_t parts = chunks_per_row(g);
    at::parallel_for(0, batch * g.offset_groups * blocks, 1, [&](int64_t begin, int64_t end) {
      PlanChunk<scalar_t> plans;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t group_of_image = task / blocks;  // n * offset_groups + deform group
        const int64_t group_begin = first_channel(g, group_of_image % g.offset_groups);
        const int64_t first = group_begin + (task % blocks) * kCol2imChannelBlock;
        const int64_t last = std::min(first + kCol2imChannelBlock, group_begin + channels);
        for (int64_t tap = 0; tap < g.taps(); ++tap) {
          for (int64_t part = 0; part < parts; ++part) {
            const PixelChunk chunk = pixel_chunk(g, group_of_image * g.taps() + tap, part);
            make_plans(g, chunk, offset_data, mask_data, plans);
            for (int64_t c = first; c < last; ++c) {
              scalar_t* grad_plane = plane_of(g, grad_input_data, chunk.first.n, c);
              const scalar_t* row = grad_columns_data + column_index(g, chunk.first, c);
              for (int64_t i = 0; i < chunk.length; ++i) {
                scatter_with_plan(plans[i], row[i], grad_plane);
              }
            }
          }
        }
      }
    });
  });
}

// Parallel over pixel chunks; each sample's sums are accumulated channel by channel.
void offset_mask_grad_cpu(const DeformConv2dGeometry& g, int64_t batch,
                          const at::Tensor& grad_columns, const at::Tensor& input,
                          const at::Tensor& offset, const at::Tensor& mask,
                          at::Tensor& grad_offset, at::Tensor& grad_mask) {
  DEFORMCONV_DISPATCH(input.scalar_type(), "deform_conv2d_offset_mask_grad_cpu", [&] {
    const scalar_t* grad_columns_data = grad_columns.const_data_ptr<scalar_t>();
    const scalar_t* input_data = input.const_data_ptr<scalar_t>();
    const scalar_t* offset_data = offset.const_data_ptr<scalar_t>();
    const scalar_t* mask_data = data_or_null<scalar_t>(mask);
    scalar_t* grad_offset_data = mutable_data_or_null<scalar_t>(grad_offset);
    scalar_t* grad_mask_data = mutable_data_or_null<scalar_t>(grad_mask);
    const int64_t parts = chunks_per_row(g);
    at::parallel_for(0, rows_in(g, batch) * parts, 1, [&](int64_t begin, int64_t end) {
      std::array<SampleIndex, kPixelChunk> samples;
      std::array<OffsetMaskGrad<at::opmath_type<scalar_t>>, kPixelChunk> sums;
      for (int64_t task = begin; task < end; ++task) {
        const PixelChunk chunk = pixel_chunk(g, task / parts, task % parts);
        SampleIndex s = chunk.first;
        for (int64_t i = 0; i < chunk.length; ++i, next_pixel(g, s)) {
          samples[i] = s;
          sums[i] = start_offset_mask_grad(g, s, offset_data, mask_data);
        }
        const int64_t first = first_channel(g, chunk.first.group);
        for (int64_t c = first; c < first + g.channels_per_offset_group(); ++c) {
          for (int64_t i = 0; i < chunk.length; ++i) {
            accumulate_offset_mask_grad(g, samples[i], c, grad_columns_data, input_data, sums[i]);
          }
        }
        for (int64_t i = 0; i < chunk.length; ++i) {
          finish_offset_mask_grad(g, samples[i], sums[i], grad_offset_data, grad_mask_data);
        }
      }
    });
  });
}

// 4 MiB of columns per window: within the last-level cache of a CPU.
constexpr DeformConv2dLaunchers kCpuLaunchers{int64_t(4) << 20, im2col_cpu, col2im_cpu,
                                              offset_mask_grad_cpu};

at::Tensor deform_conv2d_cpu(const at::Tensor& input, const at::Tensor& offset,
                             const at::Tensor& weight, const std::optional<at::Tensor>& mask,
                             const std::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                             c10::IntArrayRef padding, c10::IntArrayRef dilation, int64_t groups,
                             int64_t offset_groups, int64_t im2col_step) {
  return deform_conv2d_forward(kCpuLaunchers, input, offset, weight, mask, bias, stride, padding,
                               dilation, groups, offset_groups, im2col_step);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> deform_conv2d_backward_cpu(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& offset,
    const at::Tensor& weight, const std::optional<at::Tensor>& mask, c10::IntArrayRef stride,
    c10::IntArrayRef padding, c10::IntArrayRef dilation, int64_t groups, int64_t offset_groups,
    int64_t im2col_step, std::array<bool, 5> output_mask) {
  return deform_conv2d_backward(kCpuLaunchers, grad_output, input, offset, weight, mask, stride,
                                padding, dilation, groups, offset_groups, im2col_step,
                                output_mask);
}

}  // namespace

TORCH_LIBRARY_IMPL(deformconv, CPU, m) {
  m.impl("deform_conv2d", TORCH_FN(deform_conv2d_cpu));
  m.impl("deform_conv2d_backward", TORCH_FN(deform_conv2d_backward_cpu));
}

}  // namespace deformconv
