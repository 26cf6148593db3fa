// Registration of the ops' CPU kernels: the device-neutral drivers with the launchers of the
// copy of the CPU kernels in use (cpu_capability.cpp), Note [Device kernels].

#include <torch/library.h>

#include "../core/device_registration.h"
#include "cpu_launchers.h"

namespace deformconv {
namespace {

const DeformConv2dLaunchers& deform_conv2d_cpu_launchers() {
  return cpu_copy().deform_conv2d();
}
const Dcnv3Launchers& dcnv3_cpu_launchers() { return cpu_copy().dcnv3(); }
const MsDeformAttnLaunchers& ms_deform_attn_cpu_launchers() {
  return cpu_copy().ms_deform_attn();
}

}  // namespace

TORCH_LIBRARY_IMPL(deformconv, CPU, m) {
  register_ops_on_device<CpuDevice, deform_conv2d_cpu_launchers, dcnv3_cpu_launchers,
                         ms_deform_attn_cpu_launchers>(m);
}

}  // namespace deformconv
