// DCNv3's and DCNv4's Autograd and Autocast kernels in the LibTorch build (libtorch_kernels.h).

#include "libtorch_kernels.h"
#include "../core/dcnv3.h"

DEFORMCONV_LIBTORCH_KERNELS(deformconv::Dcnv3Op, deformconv::Dcnv4Op)
