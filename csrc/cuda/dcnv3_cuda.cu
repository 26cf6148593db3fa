// CUDA launchers of DCNv3: grid-stride kernels over dcnv3_kernel.cuh's element functions, on
// the current stream, int64 indices. The forward and the input gradient run one thread per
// (output pixel, group, channel), neighbouring threads on neighbouring channels of one sample
// so that their reads and writes coalesce; the offset and mask gradients run one thread per
// sample, summing its group's channels.

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "../common/dcnv3_kernel.cuh"
#include "../pytorch/branch_trace.h"
#include "dcnv3_cuda.h"
#include "launch.cuh"

namespace deformconv {
namespace {

// The (pixel, group) sample of output element `index`, channel `channel` within the group.
C10_HOST_DEVICE inline Dcnv3Sample dcnv3_sample_of_element(const Dcnv3Geometry& g, int64_t index,
                                                          int64_t& channel) {
  channel = index % g.group_channels;
  const int64_t pixel_group = index / g.group_channels;
  return dcnv3_sample_at(g, pixel_group / g.groups, pixel_group % g.groups, 0);
}

template <typename scalar_t>
__global__ void dcnv3_forward_kernel(Dcnv3Geometry g, Dcnv3Fields f, int64_t total,
                                     const scalar_t* input, const scalar_t* offset,
                                     const scalar_t* mask, scalar_t* output) {
  using opmath_t = at::opmath_type<scalar_t>;
  DEFORMCONV_GRID_STRIDE_LOOP(index, total) {
    int64_t channel;
    Dcnv3Sample s = dcnv3_sample_of_element(g, index, channel);
    const scalar_t* channels = dcnv3_group_channels(g, input, s) + channel;
    opmath_t sum = 0;
    for (s.point = 0; s.point < g.points(); ++s.point) {
      sum += sample_value_with_plan(dcnv3_plan(g, f, s, offset, mask), channels, g.channels());
    }
    output[index] = static_cast<scalar_t>(sum);
  }
}

// scatter_with_plan adds atomically (scatter_add under __CUDA_ARCH__), into a gradient of
// at::opmath_type (Note [Input gradient sums in float32]).
template <typename scalar_t>
__global__ void dcnv3_input_grad_kernel(Dcnv3Geometry g, Dcnv3Fields f, int64_t total,
                                        const scalar_t* grad_output, const scalar_t* offset,
                                        const scalar_t* mask,
                                        at::opmath_type<scalar_t>* grad_input) {
  DEFORMCONV_GRID_STRIDE_LOOP(index, total) {
    int64_t channel;
    Dcnv3Sample s = dcnv3_sample_of_element(g, index, channel);
    auto* grad_channels = dcnv3_group_channels(g, grad_input, s) + channel;
    for (s.point = 0; s.point < g.points(); ++s.point) {
      scatter_with_plan(dcnv3_plan(g, f, s, offset, mask), grad_output + index, 1, grad_channels,
                        g.channels());
    }
  }
}

template <typename scalar_t>
__global__ void dcnv3_offset_mask_grad_kernel(Dcnv3Geometry g, Dcnv3Fields f, int64_t samples,
                                              const scalar_t* grad_output, const scalar_t* input,
                                              const scalar_t* offset, const scalar_t* mask,
                                              scalar_t* grad_offset, scalar_t* grad_mask) {
  using opmath_t = at::opmath_type<scalar_t>;
  DEFORMCONV_GRID_STRIDE_LOOP(index, samples) {
    const Dcnv3Sample s = dcnv3_sample(g, index);
    const auto acc = dcnv3_start_grad(g, f, s, offset, mask);
    OffsetMaskGradSums<opmath_t> sums;
    if (acc.cell.inside) {
      const scalar_t* grad = grad_output + s.pixel * g.channels() + s.group * g.group_channels;
      const scalar_t* channels = dcnv3_group_channels(g, input, s);
      opmath_t dots[4] = {0, 0, 0, 0};
      for (int64_t c = 0; c < g.group_channels; ++c) {
        accumulate_corner_dots(acc, grad[c], channels + c, g.channels(), dots);
      }
      sums = offset_mask_grad_sums_of_dots(acc.cell, dots);
    }
    dcnv3_finish_grad(g, f, s, acc.mask, sums, grad_offset, grad_mask);
  }
}

void dcnv3_forward_cuda(const Dcnv3Geometry& g, const Dcnv3Fields& f, int64_t batch,
                        const at::Tensor& input, const at::Tensor& offset,
                        const at::Tensor& mask, at::Tensor& output) {
  const int64_t total = batch * g.out_pixels() * g.channels();
  DEFORMCONV_DISPATCH(input.scalar_type(), "dcnv3_forward_cuda", [&] {
    DEFORMCONV_LAUNCH(dcnv3_forward_kernel<scalar_t>, blocks_for(total), kThreadsPerBlock,
                      c10::cuda::getCurrentCUDAStream())(
        g, f, total, input.const_data_ptr<scalar_t>(), offset.const_data_ptr<scalar_t>(),
        mask.const_data_ptr<scalar_t>(), output.mutable_data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void dcnv3_input_grad_cuda(const Dcnv3Geometry& g, const Dcnv3Fields& f, int64_t batch,
                           const at::Tensor& grad_output, const at::Tensor& offset,
                           const at::Tensor& mask, at::Tensor& grad_input) {
  const int64_t total = batch * g.out_pixels() * g.channels();
  DEFORMCONV_DISPATCH(grad_output.scalar_type(), "dcnv3_input_grad_cuda", [&] {
    // Note [Input gradient sums in float32]
    at::Tensor sums = uninitialised_input_gradient_sums<scalar_t>(grad_input).zero_();
    DEFORMCONV_LAUNCH(dcnv3_input_grad_kernel<scalar_t>, blocks_for(total), kThreadsPerBlock,
                      c10::cuda::getCurrentCUDAStream())(
        g, f, total, grad_output.const_data_ptr<scalar_t>(), offset.const_data_ptr<scalar_t>(),
        mask.const_data_ptr<scalar_t>(), sums.mutable_data_ptr<at::opmath_type<scalar_t>>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    store_input_gradient_sums(sums, grad_input);
  });
}

void dcnv3_offset_mask_grad_cuda(const Dcnv3Geometry& g, const Dcnv3Fields& f, int64_t batch,
                                 const at::Tensor& grad_output, const at::Tensor& input,
                                 const at::Tensor& offset, const at::Tensor& mask,
                                 at::Tensor& grad_offset, at::Tensor& grad_mask) {
  const int64_t samples = batch * g.out_pixels() * g.groups * g.points();
  DEFORMCONV_DISPATCH(input.scalar_type(), "dcnv3_offset_mask_grad_cuda", [&] {
    DEFORMCONV_LAUNCH(dcnv3_offset_mask_grad_kernel<scalar_t>, blocks_for(samples),
                      kThreadsPerBlock, c10::cuda::getCurrentCUDAStream())(
        g, f, samples, grad_output.const_data_ptr<scalar_t>(), input.const_data_ptr<scalar_t>(),
        offset.const_data_ptr<scalar_t>(), mask.const_data_ptr<scalar_t>(),
        mutable_data_or_null<scalar_t>(grad_offset), mutable_data_or_null<scalar_t>(grad_mask));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// The input gradient's kernel and the offset and mask gradients', each when asked for.
void dcnv3_gradients_cuda(const Dcnv3Geometry& g, const Dcnv3Fields& f, int64_t batch,
                          const at::Tensor& grad_output, const at::Tensor& input,
                          const at::Tensor& offset, const at::Tensor& mask,
                          at::Tensor& grad_input, at::Tensor& grad_offset,
                          at::Tensor& grad_mask) {
  if (grad_input.defined()) {
    record_branch("dcnv3.cuda.backward.input_pass");
    dcnv3_input_grad_cuda(g, f, batch, grad_output, offset, mask, grad_input);
  }
  if (grad_offset.defined() || grad_mask.defined()) {
    record_branch("dcnv3.cuda.backward.offset_mask_pass");
    dcnv3_offset_mask_grad_cuda(g, f, batch, grad_output, input, offset, mask, grad_offset,
                                grad_mask);
  }
}

}  // namespace

const Dcnv3Launchers& dcnv3_cuda_launchers() {
  static const Dcnv3Launchers launchers{
      .forward = dcnv3_forward_cuda,
      .backward = dcnv3_gradients_cuda,
  };
  return launchers;
}

}  // namespace deformconv
