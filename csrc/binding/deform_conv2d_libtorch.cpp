// DCN v1/v2's Autograd and Autocast kernels in the LibTorch build (libtorch_kernels.h).

#include "libtorch_kernels.h"
#include "../core/deform_conv2d.h"

DEFORMCONV_LIBTORCH_KERNELS(deformconv::DeformConv2dOp)
