#pragma once

// The parts of DCN v1/v2's CPU launcher table that are compiled once and shared by every copy of
// the kernels (Note [CPU copies], cpu_copies.h): the scratch memory (scratch_pool.cpp), one pool
// for the process, and the GEMMs (deform_conv2d_onednn_gemms_cpu.cpp), whose vector code is
// oneDNN's and ATen's own.

#include "../core/deform_conv2d_launchers.h"

namespace deformconv {

Tensor scratch_cpu(const Tensor& like, Sizes sizes, ScalarType dtype);

// oneDNN's 1x1 convolutions, their backward as oneDNN's with onednn_backward, else as ATen's mm
// in place (Note [Backward GEMMs in place], deform_conv2d_onednn_gemms_cpu.cpp); or bmm.
const WindowGemms& window_gemms_cpu(const DeformConv2dGeometry& g, ScalarType dtype,
                                    bool onednn_backward);

}  // namespace deformconv
