// The CPU's launcher table of DCNv3 and DCNv4, over the forward and the gradients of
// dcnv3_stages.h.

#if !defined(DEFORMCONV_CPU_COPY)  // the head (Note [CPU copies], cpu_copies.h)

#include <torch/csrc/stable/library.h>

#include "../core/dcnv3.h"
#include "../infrastructure/device_kernels.h"
#include "cpu_launchers.h"

#define DEFORMCONV_CPU_COPY_BODY "dcnv3_cpu.cpp"
#include "cpu_copies.h"

// The kernels at the CPU key: the drivers with the launchers of the copy in use.
namespace deformconv {
namespace {

const Dcnv3Launchers& dcnv3_cpu_launchers_in_use() {
  return DEFORMCONV_CPU_LAUNCHERS_IN_USE(dcnv3_cpu_launchers);
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(deformconv, CPU, m) {
  register_device_kernels<Dcnv3Op, CpuDevice, dcnv3_forward, dcnv3_backward,
                          dcnv3_cpu_launchers_in_use>(m);
  register_device_kernels<Dcnv4Op, CpuDevice, dcnv4_forward, dcnv4_backward,
                          dcnv3_cpu_launchers_in_use>(m);
}

}  // namespace deformconv

#else  // the body, once per copy

#include "dcnv3_stages.h"

namespace deformconv::DEFORMCONV_CPU_COPY {
namespace {

constexpr Dcnv3Launchers kCpuDcnv3Launchers{
    .forward = dcnv3_forward_cpu,
    .gradients = dcnv3_gradients_cpu,
};

const Dcnv3Launchers& dcnv3_cpu_launchers() { return kCpuDcnv3Launchers; }

}  // namespace

}  // namespace deformconv::DEFORMCONV_CPU_COPY

#endif
