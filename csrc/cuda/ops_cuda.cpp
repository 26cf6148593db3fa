// CUDA kernels of the ops: the device-neutral driver with the CUDA launchers, under a guard
// for the input's device (without it, work on a second GPU runs on the first: mmcv once
// returned zeros there).

#include <ATen/Context.h>
#include <c10/cuda/CUDAGuard.h>

#include "../core/deform_conv2d.h"
#include "dcnv3_cuda.h"
#include "deform_conv2d_cuda.h"
#include "ms_deform_attn_cuda.h"

namespace deformconv {

at::Tensor deform_conv2d_cuda_with_launchers(
    const DeformConv2dLaunchers& launchers, const at::Tensor& input, const at::Tensor& offset,
    const at::Tensor& weight, const std::optional<at::Tensor>& mask,
    const std::optional<at::Tensor>& bias, c10::IntArrayRef stride, c10::IntArrayRef padding,
    c10::IntArrayRef dilation, int64_t groups, int64_t offset_groups, int64_t im2col_step) {
  // Before the guard, which needs input on a CUDA device: never touch memory of another device.
  check_same_device(input, offset, weight, mask, bias);
  const c10::cuda::CUDAGuard device_guard(input.device());
  return deform_conv2d_forward(launchers, input, offset, weight, mask, bias, stride, padding,
                               dilation, groups, offset_groups, im2col_step);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
deform_conv2d_backward_cuda_with_launchers(
    const DeformConv2dLaunchers& launchers, const at::Tensor& grad_output,
    const at::Tensor& input, const at::Tensor& offset, const at::Tensor& weight,
    const std::optional<at::Tensor>& mask, c10::IntArrayRef stride, c10::IntArrayRef padding,
    c10::IntArrayRef dilation, int64_t groups, int64_t offset_groups, int64_t im2col_step,
    std::array<bool, 5> output_mask) {
  check_same_device(input, offset, weight, mask, std::nullopt);
  if (output_mask[0]) {
    // The input gradient is a scatter with atomic adds, whose order varies from run to run.
    at::globalContext().alertNotDeterministic("deform_conv2d_backward_cuda (input gradient)");
  }
  const c10::cuda::CUDAGuard device_guard(input.device());
  return deform_conv2d_backward(launchers, grad_output, input, offset, weight, mask, stride,
                                padding, dilation, groups, offset_groups, im2col_step,
                                output_mask);
}

at::Tensor dcnv3_cuda(const at::Tensor& input, const at::Tensor& offset, const at::Tensor& mask,
                      const Dcnv3Arguments& args) {
  // Before the guard, which needs input on a CUDA device: never touch memory of another device.
  check_dcnv3_devices(input, offset, mask, std::nullopt);
  const c10::cuda::CUDAGuard device_guard(input.device());
  return dcnv3_forward(dcnv3_cuda_launchers(), input, offset, mask, args);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dcnv3_backward_cuda(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& offset,
    const at::Tensor& mask, const Dcnv3Arguments& args, std::array<bool, 3> output_mask) {
  check_dcnv3_devices(input, offset, mask, grad_output);
  if (output_mask[0]) {
    // The input gradient is a scatter with atomic adds, whose order varies from run to run.
    at::globalContext().alertNotDeterministic(mask.defined()
                                                  ? "dcnv3_backward_cuda (input gradient)"
                                                  : "dcnv4_backward_cuda (input gradient)");
  }
  const c10::cuda::CUDAGuard device_guard(input.device());
  return dcnv3_backward(dcnv3_cuda_launchers(), grad_output, input, offset, mask, args,
                        output_mask);
}

at::Tensor ms_deform_attn_cuda(const at::Tensor& value, const at::Tensor& spatial_shapes,
                               const at::Tensor& level_start_index,
                               const at::Tensor& sampling_locations,
                               const at::Tensor& attention_weights, int64_t im2col_step) {
  // Before the guard, which needs value on a CUDA device: never touch memory of another device.
  check_ms_deform_attn_devices(std::nullopt, value, spatial_shapes, level_start_index,
                               sampling_locations, attention_weights);
  const c10::cuda::CUDAGuard device_guard(value.device());
  return ms_deform_attn_forward(ms_deform_attn_cuda_launchers(), value, spatial_shapes,
                                level_start_index, sampling_locations, attention_weights,
                                im2col_step);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ms_deform_attn_backward_cuda(
    const at::Tensor& grad_output, const at::Tensor& value, const at::Tensor& spatial_shapes,
    const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
    const at::Tensor& attention_weights, int64_t im2col_step, std::array<bool, 3> output_mask) {
  check_ms_deform_attn_devices(grad_output, value, spatial_shapes, level_start_index,
                               sampling_locations, attention_weights);
  if (output_mask[0]) {
    // The value gradient is a scatter with atomic adds, whose order varies from run to run.
    at::globalContext().alertNotDeterministic("ms_deform_attn_backward_cuda (value gradient)");
  }
  const c10::cuda::CUDAGuard device_guard(value.device());
  return ms_deform_attn_backward(ms_deform_attn_cuda_launchers(), grad_output, value,
                                 spatial_shapes, level_start_index, sampling_locations,
                                 attention_weights, im2col_step, output_mask);
}

}  // namespace deformconv
