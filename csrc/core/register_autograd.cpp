// Every op's kernel at the Autograd key (Note [One autograd kernel for every op]), in the
// LibTorch build, for C++ programs that train; the Python package registers its own from
// Python (deformconv/ops/_autograd.py).

#include <torch/library.h>

#include "../infrastructure/op_autograd.h"
#include "../infrastructure/op_handles.h"
#include "dcnv3.h"
#include "deform_conv2d.h"
#include "ms_deform_attn.h"

namespace deformconv {
namespace {

template <typename Op>
void register_autograd(torch::Library& m) {
  m.impl(Op::kName, TORCH_FN(OpAutograd<Op>::forward));
  m.impl((std::string(Op::kName) + "_backward").c_str(), TORCH_FN(OpAutograd<Op>::backward));
}

}  // namespace

TORCH_LIBRARY_IMPL(deformconv, Autograd, m) {
  register_autograd<DeformConv2dOp>(m);
  register_autograd<Dcnv3Op>(m);
  register_autograd<Dcnv4Op>(m);
  register_autograd<MsDeformAttnOp>(m);
}

}  // namespace deformconv
