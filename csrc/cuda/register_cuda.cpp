// Registration of the ops' CUDA kernels (ops_cuda.cpp) with the CUDA launchers.

#include <torch/library.h>

#include "dcnv3_cuda.h"
#include "deform_conv2d_cuda.h"
#include "ms_deform_attn_cuda.h"

namespace deformconv {
namespace {

at::Tensor deform_conv2d_cuda(const at::Tensor& input, const at::Tensor& offset,
                              const at::Tensor& weight, const std::optional<at::Tensor>& mask,
                              const std::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                              c10::IntArrayRef padding, c10::IntArrayRef dilation,
                              int64_t groups, int64_t offset_groups, int64_t im2col_step) {
  return deform_conv2d_cuda_with_launchers(deform_conv2d_cuda_launchers(), input, offset,
                                           weight, mask, bias, stride, padding, dilation,
                                           groups, offset_groups, im2col_step);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
deform_conv2d_backward_cuda(const at::Tensor& grad_output, const at::Tensor& input,
                            const at::Tensor& offset, const at::Tensor& weight,
                            const std::optional<at::Tensor>& mask, c10::IntArrayRef stride,
                            c10::IntArrayRef padding, c10::IntArrayRef dilation, int64_t groups,
                            int64_t offset_groups, int64_t im2col_step,
                            std::array<bool, 5> output_mask) {
  return deform_conv2d_backward_cuda_with_launchers(
      deform_conv2d_cuda_launchers(), grad_output, input, offset, weight, mask, stride, padding,
      dilation, groups, offset_groups, im2col_step, output_mask);
}

}  // namespace

TORCH_LIBRARY_IMPL(deformconv, CUDA, m) {
  m.impl("deform_conv2d", TORCH_FN(deform_conv2d_cuda));
  m.impl("deform_conv2d_backward", TORCH_FN(deform_conv2d_backward_cuda));
  m.impl("dcnv3", TORCH_FN(dcnv3_kernel<dcnv3_cuda>));
  m.impl("dcnv3_backward", TORCH_FN(dcnv3_backward_kernel<dcnv3_backward_cuda>));
  m.impl("dcnv4", TORCH_FN(dcnv4_kernel<dcnv3_cuda>));
  m.impl("dcnv4_backward", TORCH_FN(dcnv4_backward_kernel<dcnv3_backward_cuda>));
  m.impl("ms_deform_attn", TORCH_FN(ms_deform_attn_cuda));
  m.impl("ms_deform_attn_backward", TORCH_FN(ms_deform_attn_backward_cuda));
}

}  // namespace deformconv
