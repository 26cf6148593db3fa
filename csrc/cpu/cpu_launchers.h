#pragma once

// The CPU's launcher tables, a set per copy of the kernels (Note [CPU copies], cpu_copies.h),
// which each op's CPU table file registers with its device-neutral drivers, and the copy in
// use.

#include "../core/dcnv3.h"
#include "../core/deform_conv2d_launchers.h"
#include "../core/ms_deform_attn.h"

namespace deformconv {

// One copy: its name (avx512, avx2, default) and its tables, DCN v1/v2's
// (deform_conv2d_cpu.cpp), DCNv3's and DCNv4's (dcnv3_cpu.cpp) and multi-scale deformable
// attention's (ms_deform_attn_cpu.cpp).
struct CpuCopy {
  const char* name;
  const char* branch;  // cpu.capability.<name>, recorded in the branch trace when it runs
  const DeformConv2dLaunchers& (*deform_conv2d)();
  const Dcnv3Launchers& (*dcnv3)();
  const MsDeformAttnLaunchers& (*ms_deform_attn)();
};

// The copy in use (cpu_capability.cpp), its branch recorded.
const CpuCopy& cpu_copy();

}  // namespace deformconv
