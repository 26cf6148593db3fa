#pragma once

// The LibTorch build's Autograd and Autocast kernels, for C++ programs that train; the Python
// package registers its own from Python (deformconv/ops/_autograd.py, which says why).
// DEFORMCONV_LIBTORCH_KERNELS(Op, ...), in a file of the op's own (binding/<op>_libtorch.cpp),
// registers those of the ops that its arguments describe (Note [Op descriptions]):
// - at the Autograd key, OpAutograd<Op> (Note [One autograd kernel for every op]);
// - at the Autocast keys, the op in float32: every tensor operand but a float64 one cast to
//   float32 (other arguments pass unchanged), so it returns float32. The backward ops need no
//   autocast kernel: autograd calls them on the float32 operands it saved.

#include <ATen/autocast_mode.h>
#include <torch/library.h>

#include <string>

#include "op_autograd.h"
#include "libtorch_handles.h"

namespace deformconv {
namespace libtorch_kernels_detail {

template <c10::DispatchKey autocast_key, c10::DeviceType device_type, typename Op,
          typename Signature = LibtorchSignature<Op>>
struct InFloat32;

template <c10::DispatchKey autocast_key, c10::DeviceType device_type, typename Op, typename Result,
          typename... Arguments>
struct InFloat32<autocast_key, device_type, Op, Result(Arguments...)> {
  static Result call(Arguments... arguments) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_key);
    return forward_handle<Op>().call(
        at::autocast::cached_cast(at::kFloat, arguments, device_type)...);
  }
};

template <typename... Ops>
void register_autograd(torch::Library& m) {
  (m.impl(Ops::kName, TORCH_FN(OpAutograd<Ops>::forward)), ...);
  (m.impl((std::string(Ops::kName) + "_backward").c_str(), TORCH_FN(OpAutograd<Ops>::backward)),
   ...);
}

template <c10::DispatchKey autocast_key, c10::DeviceType device_type, typename... Ops>
void register_autocast(torch::Library& m) {
  (m.impl(Ops::kName, TORCH_FN((InFloat32<autocast_key, device_type, Ops>::call))), ...);
}

}  // namespace libtorch_kernels_detail
}  // namespace deformconv

#define DEFORMCONV_LIBTORCH_KERNELS(...)                                                          \
  TORCH_LIBRARY_IMPL(deformconv, Autograd, m) {                                                   \
    ::deformconv::libtorch_kernels_detail::register_autograd<__VA_ARGS__>(m);                     \
  }                                                                                               \
  TORCH_LIBRARY_IMPL(deformconv, AutocastCPU, m) {                                                \
    ::deformconv::libtorch_kernels_detail::register_autocast<c10::DispatchKey::AutocastCPU,       \
                                                             c10::DeviceType::CPU, __VA_ARGS__>(  \
        m);                                                                                       \
  }                                                                                               \
  TORCH_LIBRARY_IMPL(deformconv, AutocastCUDA, m) {                                               \
    ::deformconv::libtorch_kernels_detail::register_autocast<c10::DispatchKey::AutocastCUDA,      \
                                                             c10::DeviceType::CUDA, __VA_ARGS__>( \
        m);                                                                                       \
  }
