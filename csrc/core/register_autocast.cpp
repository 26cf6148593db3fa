// The LibTorch build's Autocast kernels (the Python package registers its own from Python,
// deformconv/ops/_autograd.py, which says why): every op runs in float32 under autocast and
// returns float32, every floating-point operand but float64 cast to float32. The backward ops
// need no autocast kernel: autograd calls them on the float32 operands it saved.

#include <ATen/autocast_mode.h>
#include <torch/library.h>

#include "../infrastructure/op_handles.h"
#include "dcnv3.h"
#include "deform_conv2d.h"
#include "ms_deform_attn.h"

namespace deformconv {
namespace {

// The autocast kernel of the op that Op describes (op_handles.h): the op below autocast, every
// tensor operand cast to float32 (other arguments pass unchanged).
template <c10::DispatchKey autocast_key, c10::DeviceType device_type, typename Op,
          typename Signature = LibtorchSignature<Op>>
struct InFloat32;

template <c10::DispatchKey autocast_key, c10::DeviceType device_type, typename Op,
          typename Result, typename... Arguments>
struct InFloat32<autocast_key, device_type, Op, Result(Arguments...)> {
  static Result call(Arguments... arguments) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_key);
    return forward_handle<Op>().call(
        at::autocast::cached_cast(at::kFloat, arguments, device_type)...);
  }
};

template <c10::DispatchKey autocast_key, c10::DeviceType device_type, typename Op>
void register_in_float32(torch::Library& m) {
  m.impl(Op::kName, TORCH_FN((InFloat32<autocast_key, device_type, Op>::call)));
}

template <c10::DispatchKey autocast_key, c10::DeviceType device_type>
void register_autocast(torch::Library& m) {
  register_in_float32<autocast_key, device_type, DeformConv2dOp>(m);
  register_in_float32<autocast_key, device_type, Dcnv3Op>(m);
  register_in_float32<autocast_key, device_type, Dcnv4Op>(m);
  // spatial_shapes and level_start_index are int64, which the cast leaves alone.
  register_in_float32<autocast_key, device_type, MsDeformAttnOp>(m);
}

}  // namespace

TORCH_LIBRARY_IMPL(deformconv, AutocastCUDA, m) {
  register_autocast<c10::DispatchKey::AutocastCUDA, c10::DeviceType::CUDA>(m);
}

TORCH_LIBRARY_IMPL(deformconv, AutocastCPU, m) {
  register_autocast<c10::DispatchKey::AutocastCPU, c10::DeviceType::CPU>(m);
}

}  // namespace deformconv
