// Multi-scale deformable attention's Autograd and Autocast kernels in the LibTorch build
// (libtorch_kernels.h). spatial_shapes and level_start_index are int64, which the autocast
// kernel's cast leaves alone.

#include "libtorch_kernels.h"
#include "../core/ms_deform_attn.h"

DEFORMCONV_LIBTORCH_KERNELS(deformconv::MsDeformAttnOp)
