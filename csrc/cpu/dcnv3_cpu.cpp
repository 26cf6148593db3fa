// The CPU's launcher table of DCNv3 and DCNv4, over the forward and the gradients of
// dcnv3_stages.h.

#if !defined(DEFORMCONV_CPU_COPY)  // the head (Note [CPU copies], cpu_copies.h)

#include "../core/dcnv3.h"

#define DEFORMCONV_CPU_COPY_BODY "dcnv3_cpu.cpp"
#include "cpu_copies.h"

#else  // the body, once per copy

#include "dcnv3_stages.h"

namespace deformconv::DEFORMCONV_CPU_COPY {
namespace {

constexpr Dcnv3Launchers kCpuDcnv3Launchers{
    .forward = dcnv3_forward_cpu,
    .gradients = dcnv3_gradients_cpu,
};

}  // namespace

const Dcnv3Launchers& dcnv3_cpu_launchers() { return kCpuDcnv3Launchers; }

}  // namespace deformconv::DEFORMCONV_CPU_COPY

#endif
