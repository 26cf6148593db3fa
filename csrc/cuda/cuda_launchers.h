#pragma once

// The CUDA launcher tables, which each op's CUDA file registers with its device-neutral drivers
// (Note [Device kernels]) and the test suite's emulation build runs on the CPU.

#include "../core/dcnv3.h"
#include "../core/deform_conv2d_launchers.h"
#include "../core/ms_deform_attn.h"

namespace deformconv {

// DCN v1/v2 (deform_conv2d_cuda.cu).
const DeformConv2dLaunchers& deform_conv2d_cuda_launchers();

// DCNv3 and DCNv4 (dcnv3_cuda.cu).
const Dcnv3Launchers& dcnv3_cuda_launchers();

// Multi-scale deformable attention (ms_deform_attn_cuda.cu).
const MsDeformAttnLaunchers& ms_deform_attn_cuda_launchers();

}  // namespace deformconv
