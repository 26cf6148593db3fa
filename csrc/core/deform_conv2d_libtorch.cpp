// DCN v1/v2's Autograd and Autocast kernels in the LibTorch build (libtorch_kernels.h).

#include "../infrastructure/libtorch_kernels.h"
#include "deform_conv2d.h"

DEFORMCONV_LIBTORCH_KERNELS(deformconv::DeformConv2dOp)
