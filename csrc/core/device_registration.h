#pragma once

// Every op's kernels on one device (Note [Device kernels], infrastructure/device_kernels.h):
// each op's drivers with the device's launcher tables, which the three functions return
// (dcnv3_launchers: DCNv3's and DCNv4's). cpu/register_cpu.cpp, cuda/register_cuda.cpp and
// the test suite's CUDA emulation register through it.

#include <torch/library.h>

#include "../infrastructure/device_kernels.h"
#include "../infrastructure/op_handles.h"
#include "dcnv3.h"
#include "deform_conv2d.h"
#include "ms_deform_attn.h"

namespace deformconv {

template <typename Device, auto deform_conv2d_launchers, auto dcnv3_launchers,
          auto ms_deform_attn_launchers>
void register_ops_on_device(torch::Library& m) {
  register_device_kernels<DeformConv2dOp, Device, deform_conv2d_forward, deform_conv2d_backward,
                          deform_conv2d_launchers>(m);
  register_device_kernels<Dcnv3Op, Device, dcnv3_forward, dcnv3_backward, dcnv3_launchers>(m);
  register_device_kernels<Dcnv4Op, Device, dcnv4_forward, dcnv4_backward, dcnv3_launchers>(m);
  register_device_kernels<MsDeformAttnOp, Device, ms_deform_attn_forward,
                          ms_deform_attn_backward, ms_deform_attn_launchers>(m);
}

}  // namespace deformconv
