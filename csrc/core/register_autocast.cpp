// Autocast policy: deformable convolution runs in float32 under autocast and returns float32,
// like the ops on autocast's float32 list. Bilinear weights and the input-gradient scatter lose
// too much in float16/bfloat16 to be worth the speed; a caller who wants half precision calls
// the op on half tensors outside autocast. The casts are recorded by autograd, so gradients
// come back in the dtypes of the original tensors.

#include <ATen/autocast_mode.h>
#include <torch/library.h>

#include "op_handles.h"

namespace deformconv {
namespace {

template <c10::DispatchKey autocast_key, c10::DeviceType device_type>
at::Tensor deform_conv2d_autocast(const at::Tensor& input, const at::Tensor& offset,
                                  const at::Tensor& weight, const std::optional<at::Tensor>& mask,
                                  const std::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                                  c10::IntArrayRef padding, c10::IntArrayRef dilation,
                                  int64_t groups, int64_t offset_groups, int64_t im2col_step) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_key);
  const auto to_float = [](const auto& tensor) {
    return at::autocast::cached_cast(at::kFloat, tensor, device_type);
  };
  return deform_conv2d_op().call(to_float(input), to_float(offset), to_float(weight),
                                 to_float(mask), to_float(bias), stride, padding, dilation,
                                 groups, offset_groups, im2col_step);
}

}  // namespace

TORCH_LIBRARY_IMPL(deformconv, AutocastCUDA, m) {
  m.impl("deform_conv2d",
         TORCH_FN((deform_conv2d_autocast<c10::DispatchKey::AutocastCUDA, c10::DeviceType::CUDA>)));
}

TORCH_LIBRARY_IMPL(deformconv, AutocastCPU, m) {
  m.impl("deform_conv2d",
         TORCH_FN((deform_conv2d_autocast<c10::DispatchKey::AutocastCPU, c10::DeviceType::CPU>)));
}

}  // namespace deformconv
