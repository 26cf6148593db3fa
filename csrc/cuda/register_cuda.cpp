// Registration of the ops' CUDA kernels (ops_cuda.cpp) with the CUDA launchers.

#include <torch/library.h>

#include "dcnv3_cuda.h"
#include "deform_conv2d_cuda.h"

namespace deformconv {
namespace {

at::Tensor deform_conv2d_cuda_kernel(const at::Tensor& input, const at::Tensor& offset,
                                     const at::Tensor& weight,
                                     const std::optional<at::Tensor>& mask,
                                     const std::optional<at::Tensor>& bias,
                                     c10::IntArrayRef stride, c10::IntArrayRef padding,
                                     c10::IntArrayRef dilation, int64_t groups,
                                     int64_t offset_groups, int64_t im2col_step) {
  return deform_conv2d_cuda(cuda_launchers(), input, offset, weight, mask, bias, stride, padding,
                            dilation, groups, offset_groups, im2col_step);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
deform_conv2d_backward_cuda_kernel(const at::Tensor& grad_output, const at::Tensor& input,
                                   const at::Tensor& offset, const at::Tensor& weight,
                                   const std::optional<at::Tensor>& mask,
                                   c10::IntArrayRef stride, c10::IntArrayRef padding,
                                   c10::IntArrayRef dilation, int64_t groups,
                                   int64_t offset_groups, int64_t im2col_step,
                                   std::array<bool, 5> output_mask) {
  return deform_conv2d_backward_cuda(cuda_launchers(), grad_output, input, offset, weight, mask,
                                     stride, padding, dilation, groups, offset_groups,
                                     im2col_step, output_mask);
}

at::Tensor dcnv3_cuda_kernel(const at::Tensor& input, const at::Tensor& offset,
                             const at::Tensor& mask, int64_t kernel_h, int64_t kernel_w,
                             int64_t stride_h, int64_t stride_w, int64_t pad_h, int64_t pad_w,
                             int64_t dilation_h, int64_t dilation_w, int64_t group,
                             int64_t group_channels, double offset_scale, int64_t im2col_step,
                             bool remove_center) {
  return dcnv3_cuda(dcnv3_cuda_launchers(), input, offset, mask,
                    {kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h,
                     dilation_w, group, group_channels, offset_scale, im2col_step,
                     remove_center});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dcnv3_backward_cuda_kernel(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& offset,
    const at::Tensor& mask, int64_t kernel_h, int64_t kernel_w, int64_t stride_h,
    int64_t stride_w, int64_t pad_h, int64_t pad_w, int64_t dilation_h, int64_t dilation_w,
    int64_t group, int64_t group_channels, double offset_scale, int64_t im2col_step,
    bool remove_center, std::array<bool, 3> output_mask) {
  return dcnv3_backward_cuda(dcnv3_cuda_launchers(), grad_output, input, offset, mask,
                             {kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h,
                              dilation_w, group, group_channels, offset_scale, im2col_step,
                              remove_center},
                             output_mask);
}

}  // namespace

TORCH_LIBRARY_IMPL(deformconv, CUDA, m) {
  m.impl("deform_conv2d", TORCH_FN(deform_conv2d_cuda_kernel));
  m.impl("deform_conv2d_backward", TORCH_FN(deform_conv2d_backward_cuda_kernel));
  m.impl("dcnv3", TORCH_FN(dcnv3_cuda_kernel));
  m.impl("dcnv3_backward", TORCH_FN(dcnv3_backward_cuda_kernel));
}

}  // namespace deformconv
