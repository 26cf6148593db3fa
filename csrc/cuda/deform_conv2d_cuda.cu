// CUDA launchers: one grid-stride kernel per shared element function, on the current stream.
// Indices are int64 throughout: a block's columns buffer passes 2^31 elements at detection
// resolutions (C_in * K * H_out * W_out * images), and int32 there gives wrong answers
// silently (torchvision issue 4269). The cost is a few integer instructions per element.

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

#include "../common/deform_conv2d_kernel.cuh"
#include "deform_conv2d_cuda.h"

namespace deformconv {
namespace {

constexpr int kThreadsPerBlock = 256;
// The grid-stride loops cover any remainder, so the grid need not grow past this.
constexpr int64_t kMaxBlocks = 65536;

int64_t blocks_for(int64_t total) {
  return std::min<int64_t>(kMaxBlocks, (total + kThreadsPerBlock - 1) / kThreadsPerBlock);
}

#define DEFORMCONV_GRID_STRIDE_LOOP(index, total)                                          \
  for (int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;        \
       index < (total); index += static_cast<int64_t>(blockDim.x) * gridDim.x)

#define DEFORMCONV_DISPATCH(dtype, name, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, name, __VA_ARGS__)

template <typename scalar_t>
using PlanOf = SamplingPlan<at::opmath_type<scalar_t>>;

template <typename scalar_t>
__global__ void sampling_plans_kernel(DeformConv2dGeometry g, int64_t total,
                                      const scalar_t* offset, const scalar_t* mask,
                                      PlanOf<scalar_t>* plans) {
  DEFORMCONV_GRID_STRIDE_LOOP(index, total) {
    sampling_plan_element(g, offset, mask, plans, index);
  }
}

template <typename scalar_t>
__global__ void im2col_kernel(DeformConv2dGeometry g, int64_t total, const scalar_t* input,
                              const PlanOf<scalar_t>* plans, scalar_t* columns) {
  DEFORMCONV_GRID_STRIDE_LOOP(index, total) {
    im2col_element(g, input, plans, columns, index);
  }
}

template <typename scalar_t>
__global__ void col2im_kernel(DeformConv2dGeometry g, int64_t total,
                              const scalar_t* grad_columns, const PlanOf<scalar_t>* plans,
                              scalar_t* grad_input) {
  DEFORMCONV_GRID_STRIDE_LOOP(index, total) {
    col2im_element(g, grad_columns, plans, grad_input, index);
  }
}

template <typename scalar_t>
__global__ void offset_mask_grad_kernel(DeformConv2dGeometry g, int64_t total,
                                        const scalar_t* grad_columns, const scalar_t* input,
                                        const scalar_t* offset, const scalar_t* mask,
                                        scalar_t* grad_offset, scalar_t* grad_mask) {
  DEFORMCONV_GRID_STRIDE_LOOP(index, total) {
    offset_mask_grad_element(g, grad_columns, input, offset, mask, grad_offset, grad_mask, index);
  }
}

int64_t samples_in(const DeformConv2dGeometry& g, int64_t batch) {
  return batch * g.offset_groups * g.taps() * g.out_pixels();
}

int64_t columns_in(const DeformConv2dGeometry& g, int64_t batch) {
  return batch * g.in_channels * g.taps() * g.out_pixels();
}

void sampling_plans_cuda(const DeformConv2dGeometry& g, int64_t batch, const at::Tensor& offset,
                         const at::Tensor& mask, at::Tensor& plans) {
  const int64_t total = samples_in(g, batch);
  DEFORMCONV_DISPATCH(offset.scalar_type(), "deform_conv2d_sampling_plans_cuda", [&] {
    sampling_plans_kernel<scalar_t>
        <<<blocks_for(total), kThreadsPerBlock, 0, c10::cuda::getCurrentCUDAStream()>>>(
            g, total, offset.const_data_ptr<scalar_t>(), data_or_null<scalar_t>(mask),
            reinterpret_cast<PlanOf<scalar_t>*>(plans.data_ptr()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void im2col_cuda(const DeformConv2dGeometry& g, int64_t batch, const at::Tensor& input,
                 const at::Tensor& plans, at::Tensor& columns) {
  const int64_t total = columns_in(g, batch);
  DEFORMCONV_DISPATCH(input.scalar_type(), "deform_conv2d_im2col_cuda", [&] {
    im2col_kernel<scalar_t>
        <<<blocks_for(total), kThreadsPerBlock, 0, c10::cuda::getCurrentCUDAStream()>>>(
            g, total, input.const_data_ptr<scalar_t>(),
            reinterpret_cast<const PlanOf<scalar_t>*>(plans.const_data_ptr()),
            columns.mutable_data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void col2im_cuda(const DeformConv2dGeometry& g, int64_t batch, const at::Tensor& grad_columns,
                 const at::Tensor& plans, at::Tensor& grad_input) {
  const int64_t total = columns_in(g, batch);
  DEFORMCONV_DISPATCH(grad_columns.scalar_type(), "deform_conv2d_col2im_cuda", [&] {
    col2im_kernel<scalar_t>
        <<<blocks_for(total), kThreadsPerBlock, 0, c10::cuda::getCurrentCUDAStream()>>>(
            g, total, grad_columns.const_data_ptr<scalar_t>(),
            reinterpret_cast<const PlanOf<scalar_t>*>(plans.const_data_ptr()),
            grad_input.mutable_data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void offset_mask_grad_cuda(const DeformConv2dGeometry& g, int64_t batch,
                           const at::Tensor& grad_columns, const at::Tensor& input,
                           const at::Tensor& offset, const at::Tensor& mask,
                           at::Tensor& grad_offset, at::Tensor& grad_mask) {
  const int64_t total = samples_in(g, batch);
  DEFORMCONV_DISPATCH(input.scalar_type(), "deform_conv2d_offset_mask_grad_cuda", [&] {
    offset_mask_grad_kernel<scalar_t>
        <<<blocks_for(total), kThreadsPerBlock, 0, c10::cuda::getCurrentCUDAStream()>>>(
            g, total, grad_columns.const_data_ptr<scalar_t>(), input.const_data_ptr<scalar_t>(),
            offset.const_data_ptr<scalar_t>(), data_or_null<scalar_t>(mask),
            mutable_data_or_null<scalar_t>(grad_offset), mutable_data_or_null<scalar_t>(grad_mask));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

const DeformConv2dLaunchers& cuda_launchers() {
  static const DeformConv2dLaunchers launchers{sampling_plans_cuda, im2col_cuda, col2im_cuda,
                                               offset_mask_grad_cuda};
  return launchers;
}

}  // namespace deformconv
