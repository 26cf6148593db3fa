// DCNv3's and DCNv4's Autograd and Autocast kernels in the LibTorch build (libtorch_kernels.h).

#include "../infrastructure/libtorch_kernels.h"
#include "dcnv3.h"

DEFORMCONV_LIBTORCH_KERNELS(deformconv::Dcnv3Op, deformconv::Dcnv4Op)
