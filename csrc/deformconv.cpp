// The op schemas (schemas.h), declared once. Kernels are registered per dispatch key:
// cpu/register_cpu.cpp (CPU), cuda/register_cuda.cpp (CUDA),
// core/register_checks.cpp (the _check_<op>_arguments ops),
// infrastructure/register_branch_trace.cpp (the branch trace), cpu/cpu_capability.cpp
// (the CPU copies' ops); in Python (deformconv/ops/), the Autograd and Autocast kernels and the
// fake kernels, which run the checks ops. The LibTorch build registers Autograd and Autocast
// kernels in C++ instead (core/register_autograd.cpp, core/register_autocast.cpp).

#include <torch/library.h>

#include "schemas.h"

TORCH_LIBRARY(deformconv, m) {
  m.def(deformconv::schemas::kDeformConv2d);
  m.def(deformconv::schemas::kDeformConv2dBackward);
  m.def(deformconv::schemas::kCheckDeformConv2dArguments);
  m.def(deformconv::schemas::kDcnv3);
  m.def(deformconv::schemas::kDcnv3Backward);
  m.def(deformconv::schemas::kDcnv4);
  m.def(deformconv::schemas::kDcnv4Backward);
  m.def(deformconv::schemas::kCheckDcnv3Arguments);
  m.def(deformconv::schemas::kMsDeformAttn);
  m.def(deformconv::schemas::kMsDeformAttnBackward);
  m.def(deformconv::schemas::kCheckMsDeformAttnArguments);
  m.def(deformconv::schemas::kStartBranchTrace);
  m.def(deformconv::schemas::kTakeBranchTrace);
  m.def(deformconv::schemas::kCpuCapability);
  m.def(deformconv::schemas::kCpuCapabilities);
  m.def(deformconv::schemas::kSelectCpuCapability);
  m.def(deformconv::schemas::kCpuCapabilityFallback);
}
