// The CPU's launcher table of DCNv3 and DCNv4, over the forward and the gradients of
// dcnv3_stages.h.

#include "cpu_launchers.h"
#include "dcnv3_stages.h"

namespace deformconv {
namespace {

constexpr Dcnv3Launchers kCpuDcnv3Launchers{
    .forward = dcnv3_forward_cpu,
    .backward = dcnv3_gradients_cpu,
};

}  // namespace

const Dcnv3Launchers& dcnv3_cpu_launchers() { return kCpuDcnv3Launchers; }

}  // namespace deformconv
