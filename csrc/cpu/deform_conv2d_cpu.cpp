// CPU launchers: at::parallel_for over the shared element functions, and the CPU kernels of
// the ops.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../common/deform_conv2d_kernel.cuh"
#include "../pytorch/deform_conv2d.h"

namespace deformconv {
namespace {

// Elements per task for the per-sample stages; each element is a few dozen flops.
constexpr int64_t kSampleGrain = 2048;

#define DEFORMCONV_DISPATCH(dtype, name, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, name, __VA_ARGS__)

template <typename scalar_t>
SamplingPlan<at::opmath_type<scalar_t>>* plans_of(const at::Tensor& plans) {
  return reinterpret_cast<SamplingPlan<at::opmath_type<scalar_t>>*>(plans.data_ptr());
}

void sampling_plans_cpu(const DeformConv2dGeometry& g, int64_t batch, const at::Tensor& offset,
                        const at::Tensor& mask, at::Tensor& plans) {
  const int64_t total = batch * g.offset_groups * g.taps() * g.out_pixels();
  DEFORMCONV_DISPATCH(offset.scalar_type(), "deform_conv2d_sampling_plans_cpu", [&] {
    const scalar_t* offset_data = offset.const_data_ptr<scalar_t>();
    const scalar_t* mask_data = data_or_null<scalar_t>(mask);
    auto* plan_data = plans_of<scalar_t>(plans);
    at::parallel_for(0, total, kSampleGrain, [&](int64_t begin, int64_t end) {
      for (int64_t index = begin; index < end; ++index) {
        sampling_plan_element(g, offset_data, mask_data, plan_data, index);
      }
    });
  });
}

// im2col and col2im are partitioned by input plane (image, channel): each task owns the
// columns rows of its plane, and in col2im the only writes into that plane, so the scatter
// needs no atomics and its result does not depend on the thread count.
template <typename Body>
void for_each_plane(const DeformConv2dGeometry& g, int64_t batch, const Body& body) {
  const int64_t per_plane = g.taps() * g.out_pixels();
  const int64_t grain = std::max<int64_t>(1, kSampleGrain / per_plane);
  at::parallel_for(0, batch * g.in_channels, grain, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin * per_plane; index < end * per_plane; ++index) {
      body(index);
    }
  });
}

void im2col_cpu(const DeformConv2dGeometry& g, int64_t batch, const at::Tensor& input,
                const at::Tensor& plans, at::Tensor& columns) {
  DEFORMCONV_DISPATCH(input.scalar_type(), "deform_conv2d_im2col_cpu", [&] {
    const scalar_t* input_data = input.const_data_ptr<scalar_t>();
    const auto* plan_data = plans_of<scalar_t>(plans);
    scalar_t* columns_data = columns.mutable_data_ptr<scalar_t>();
    for_each_plane(g, batch, [&](int64_t index) {
      im2col_element(g, input_data, plan_data, columns_data, index);
    });
  });
}

void col2im_cpu(const DeformConv2dGeometry& g, int64_t batch, const at::Tensor& grad_columns,
                const at::Tensor& plans, at::Tensor& grad_input) {
  DEFORMCONV_DISPATCH(grad_columns.scalar_type(), "deform_conv2d_col2im_cpu", [&] {
    const scalar_t* grad_columns_data = grad_columns.const_data_ptr<scalar_t>();
    const auto* plan_data = plans_of<scalar_t>(plans);
    scalar_t* grad_input_data = grad_input.mutable_data_ptr<scalar_t>();
    for_each_plane(g, batch, [&](int64_t index) {
      col2im_element(g, grad_columns_data, plan_data, grad_input_data, index);
    });
  });
}

void offset_mask_grad_cpu(const DeformConv2dGeometry& g, int64_t batch,
                          const at::Tensor& grad_columns, const at::Tensor& input,
                          const at::Tensor& offset, const at::Tensor& mask,
                          at::Tensor& grad_offset, at::Tensor& grad_mask) {
  const int64_t total = batch * g.offset_groups * g.taps() * g.out_pixels();
  DEFORMCONV_DISPATCH(input.scalar_type(), "deform_conv2d_offset_mask_grad_cpu", [&] {
    const scalar_t* grad_columns_data = grad_columns.const_data_ptr<scalar_t>();
    const scalar_t* input_data = input.const_data_ptr<scalar_t>();
    const scalar_t* offset_data = offset.const_data_ptr<scalar_t>();
    const scalar_t* mask_data = data_or_null<scalar_t>(mask);
    scalar_t* grad_offset_data = mutable_data_or_null<scalar_t>(grad_offset);
    scalar_t* grad_mask_data = mutable_data_or_null<scalar_t>(grad_mask);
    const int64_t grain = std::max<int64_t>(1, kSampleGrain / g.channels_per_offset_group());
    at::parallel_for(0, total, grain, [&](int64_t begin, int64_t end) {
      for (int64_t index = begin; index < end; ++index) {
        offset_mask_grad_element(g, grad_columns_data, input_data, offset_data, mask_data,
                                 grad_offset_data, grad_mask_data, index);
      }
    });
  });
}

constexpr DeformConv2dLaunchers kCpuLaunchers{sampling_plans_cpu, im2col_cpu, col2im_cpu,
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
