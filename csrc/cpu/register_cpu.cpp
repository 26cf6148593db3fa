// Registration of the ops' CPU kernels: the device-neutral drivers with the launchers of the
// copy of the CPU kernels in use (cpu_capability.cpp).

#include <torch/library.h>

#include <array>
#include <optional>
#include <tuple>

#include "../core/dcnv3.h"
#include "../core/deform_conv2d.h"
#include "../core/ms_deform_attn.h"
#include "cpu_launchers.h"

namespace deformconv {
namespace {

at::Tensor deform_conv2d_cpu(const at::Tensor& input, const at::Tensor& offset,
                             const at::Tensor& weight, const std::optional<at::Tensor>& mask,
                             const std::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                             c10::IntArrayRef padding, c10::IntArrayRef dilation, int64_t groups,
                             int64_t offset_groups, int64_t im2col_step) {
  return deform_conv2d_forward(cpu_copy().deform_conv2d(), input, offset, weight, mask, bias,
                               stride, padding, dilation, groups, offset_groups, im2col_step);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> deform_conv2d_backward_cpu(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& offset,
    const at::Tensor& weight, const std::optional<at::Tensor>& mask, c10::IntArrayRef stride,
    c10::IntArrayRef padding, c10::IntArrayRef dilation, int64_t groups, int64_t offset_groups,
    int64_t im2col_step, std::array<bool, 5> output_mask) {
  return deform_conv2d_backward(cpu_copy().deform_conv2d(), grad_output, input, offset,
                                weight, mask, stride, padding, dilation, groups, offset_groups,
                                im2col_step, output_mask);
}

at::Tensor dcnv3_cpu(const at::Tensor& input, const at::Tensor& offset, const at::Tensor& mask,
                     const Dcnv3Arguments& args) {
  return dcnv3_forward(cpu_copy().dcnv3(), input, offset, mask, args);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dcnv3_backward_cpu(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& offset,
    const at::Tensor& mask, const Dcnv3Arguments& args, std::array<bool, 3> output_mask) {
  return dcnv3_backward(cpu_copy().dcnv3(), grad_output, input, offset, mask, args,
                        output_mask);
}

at::Tensor ms_deform_attn_cpu(const at::Tensor& value, const at::Tensor& spatial_shapes,
                              const at::Tensor& level_start_index,
                              const at::Tensor& sampling_locations,
                              const at::Tensor& attention_weights, int64_t im2col_step) {
  return ms_deform_attn_forward(cpu_copy().ms_deform_attn(), value, spatial_shapes,
                                level_start_index, sampling_locations, attention_weights,
                                im2col_step);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ms_deform_attn_backward_cpu(
    const at::Tensor& grad_output, const at::Tensor& value, const at::Tensor& spatial_shapes,
    const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
    const at::Tensor& attention_weights, int64_t im2col_step, std::array<bool, 3> output_mask) {
  return ms_deform_attn_backward(cpu_copy().ms_deform_attn(), grad_output, value,
                                 spatial_shapes, level_start_index, sampling_locations,
                                 attention_weights, im2col_step, output_mask);
}

}  // namespace

TORCH_LIBRARY_IMPL(deformconv, CPU, m) {
  m.impl("deform_conv2d", TORCH_FN(deform_conv2d_cpu));
  m.impl("deform_conv2d_backward", TORCH_FN(deform_conv2d_backward_cpu));
  m.impl("dcnv3", TORCH_FN(dcnv3_kernel<dcnv3_cpu>));
  m.impl("dcnv3_backward", TORCH_FN(dcnv3_backward_kernel<dcnv3_backward_cpu>));
  m.impl("dcnv4", TORCH_FN(dcnv4_kernel<dcnv3_cpu>));
  m.impl("dcnv4_backward", TORCH_FN(dcnv4_backward_kernel<dcnv3_backward_cpu>));
  m.impl("ms_deform_attn", TORCH_FN(ms_deform_attn_cpu));
  m.impl("ms_deform_attn_backward", TORCH_FN(ms_deform_attn_backward_cpu));
}

}  // namespace deformconv
