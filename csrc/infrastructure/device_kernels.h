#pragma once

// Note [Device kernels]
// An op's kernel at a device's dispatch key is its device-neutral driver (core/) with the
// device's table of launchers, one pattern for every op and device:
// register_device_kernels<Op, Device, forward, backward, launchers>(m), in a
// STABLE_TORCH_LIBRARY_IMPL block, registers the op and its backward op, where Op is the op's
// description (Note [Op descriptions], op_description.h), forward and backward its drivers,
// which take the launcher table and then the schemas' arguments (checked here, at compile time),
// and launchers() the table. Each kernel first checks that every tensor is on the device of the
// op's first tensor (the backward op's: of its first argument after grad_output), naming the one
// that is not, before any memory is touched; then holds Device::Guard for that device while the
// driver runs (the CUDA guard: without it, work on a second GPU runs on the first). The autograd
// kernels that call the backward (deformconv/ops/_autograd.py; in the LibTorch build,
// binding/op_autograd.h) pass PyTorch's deterministic mode as its `deterministic`.

#include <torch/csrc/stable/device.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "argument_checks.h"
#include "op_description.h"
#include "tensor_text.h"

namespace deformconv {

// The CPU's: no guard.
struct CpuDevice {
  struct Guard {
    explicit Guard(int32_t /*device_index*/) {}
  };
};

namespace device_kernels_detail {

// The device of a Tensor or Tensor? argument; nothing for the others.
template <typename Argument>
std::optional<torch::stable::Device> device_of_argument(const Argument& argument) {
  using Decayed = std::decay_t<Argument>;
  if constexpr (std::is_same_v<Decayed, torch::stable::Tensor>) {
    return argument.device();
  } else if constexpr (std::is_same_v<Decayed, std::optional<torch::stable::Tensor>>) {
    return argument.has_value() ? std::optional(argument->device()) : std::nullopt;
  } else {
    return std::nullopt;
  }
}

template <typename Op, bool kBackward, typename Device, auto driver, auto launchers,
          typename Signature>
struct DeviceKernel;

template <typename Op, bool kBackward, typename Device, auto driver, auto launchers,
          typename Result, typename... Arguments>
struct DeviceKernel<Op, kBackward, Device, driver, launchers, Result(Arguments...)> {
  static Result call(Arguments... arguments) {
    static constexpr auto kNames = [] {
      if constexpr (kBackward) {
        return kBackwardArgumentNames<Op>;
      } else {
        return kArgumentNames<Op>;
      }
    }();
    // The op's name in messages, in two pieces, so that no string is built unless one is.
    constexpr const char* kSuffix = kBackward ? "_backward" : "";
    const std::array<std::optional<torch::stable::Device>, sizeof...(Arguments)> devices = {
        device_of_argument(arguments)...};
    constexpr size_t kReference = kBackward ? 1 : 0;
    const torch::stable::Device reference = *devices[kReference];
    for (size_t index = 0; index < devices.size(); ++index) {
      DEFORMCONV_CHECK_ARGUMENT(
          !devices[index].has_value() || *devices[index] == reference, Op::kName, kSuffix,
          "(): expected ", kNames[index], " to be on the device of ", kNames[kReference], " (",
          device_text(reference), "), but got ", device_text(*devices[index]));
    }
    const typename Device::Guard device_guard(reference.index());
    return driver(launchers(), arguments...);
  }
};

// A driver's type: the signature's, after the launcher table.
template <typename Launchers, typename Signature>
struct DriverOf;

template <typename Launchers, typename Result, typename... Arguments>
struct DriverOf<Launchers, Result(Arguments...)> {
  using type = Result (*)(const Launchers&, Arguments...);
};

}  // namespace device_kernels_detail

template <typename Op, typename Device, auto forward, auto backward, auto launchers>
void register_device_kernels(torch::stable::detail::StableLibrary& m) {
  using device_kernels_detail::DeviceKernel;
  using device_kernels_detail::DriverOf;
  static_assert(DescriptionChecks<Op>::kChecked);
  using Launchers = std::decay_t<decltype(launchers())>;
  static_assert(std::is_same_v<decltype(forward),
                               typename DriverOf<Launchers, OpSignature<Op>>::type>,
                "the forward driver does not take the launcher table, then kSchema's arguments "
                "in its types and order, or does not return one Tensor");
  static_assert(std::is_same_v<decltype(backward),
                               typename DriverOf<Launchers, OpBackwardSignature<Op>>::type>,
                "the backward driver does not take the launcher table, then kBackwardSchema's "
                "arguments in its types and order, or does not return its Tensors");
  using ForwardKernel = DeviceKernel<Op, false, Device, forward, launchers, OpSignature<Op>>;
  using BackwardKernel =
      DeviceKernel<Op, true, Device, backward, launchers, OpBackwardSignature<Op>>;
  m.impl(Op::kName, TORCH_BOX(&ForwardKernel::call));
  m.impl((std::string(Op::kName) + "_backward").c_str(), TORCH_BOX(&BackwardKernel::call));
}

}  // namespace deformconv
