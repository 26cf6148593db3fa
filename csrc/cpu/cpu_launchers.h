#pragma once

// The CPU's launcher tables, which cpu/register_cpu.cpp hands to the device-neutral drivers.

#include "../core/dcnv3.h"
#include "../core/deform_conv2d_launchers.h"
#include "../core/ms_deform_attn.h"

namespace deformconv {

// DCN v1/v2 (deform_conv2d_cpu.cpp).
const DeformConv2dLaunchers& deform_conv2d_cpu_launchers();

// DCNv3 and DCNv4 (dcnv3_cpu.cpp).
const Dcnv3Launchers& dcnv3_cpu_launchers();

// Multi-scale deformable attention (ms_deform_attn_cpu.cpp).
const MsDeformAttnLaunchers& ms_deform_attn_cpu_launchers();

}  // namespace deformconv
