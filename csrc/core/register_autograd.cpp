// Every op's kernel at the Autograd key.

#include <torch/library.h>

#include "autograd.h"
#include "dcnv3.h"

namespace deformconv {

TORCH_LIBRARY_IMPL(deformconv, Autograd, m) {
  m.impl("deform_conv2d", TORCH_FN(deform_conv2d_autograd));
  m.impl("deform_conv2d_backward", TORCH_FN(deform_conv2d_backward_autograd));
  m.impl("dcnv3", TORCH_FN(dcnv3_kernel<dcnv3_autograd>));
  m.impl("dcnv3_backward", TORCH_FN(dcnv3_backward_kernel<dcnv3_backward_autograd>));
  m.impl("dcnv4", TORCH_FN(dcnv4_kernel<dcnv3_autograd>));
  m.impl("dcnv4_backward", TORCH_FN(dcnv4_backward_kernel<dcnv3_backward_autograd>));
  m.impl("ms_deform_attn", TORCH_FN(ms_deform_attn_autograd));
  m.impl("ms_deform_attn_backward", TORCH_FN(ms_deform_attn_backward_autograd));
}

}  // namespace deformconv
