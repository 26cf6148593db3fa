// Registration of the ops' CUDA kernels: the device-neutral drivers with the CUDA launchers
// (Note [Device kernels]).

#include <torch/library.h>

#include "../core/device_registration.h"
#include "cuda_device.h"
#include "cuda_launchers.h"

namespace deformconv {

TORCH_LIBRARY_IMPL(deformconv, CUDA, m) {
  register_ops_on_device<CudaDevice, deform_conv2d_cuda_launchers, dcnv3_cuda_launchers,
                         ms_deform_attn_cuda_launchers>(m);
}

}  // namespace deformconv
