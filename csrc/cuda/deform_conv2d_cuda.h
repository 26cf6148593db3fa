#pragma once

#include "../pytorch/launchers.h"

namespace deformconv {

// The CUDA launchers (deform_conv2d_cuda.cu): grid-stride kernels on the current stream.
const DeformConv2dLaunchers& cuda_launchers();

}  // namespace deformconv
