#pragma once

// A tensor's shape and device as error messages write them ("[2, 3, 5]", "cuda:1"), as c10 did:
// the stable ABI's types have no operator<<. Called only where a message is built.

#include <torch/csrc/stable/device.h>
#include <torch/headeronly/util/HeaderOnlyArrayRef.h>

#include <cstdint>
#include <string>

namespace deformconv {

inline std::string shape_text(torch::headeronly::IntHeaderOnlyArrayRef shape) {
  std::string text = "[";
  for (size_t index = 0; index < shape.size(); ++index) {
    text += (index > 0 ? ", " : "") + std::to_string(shape[index]);
  }
  return text + "]";
}

inline std::string device_text(const torch::stable::Device& device) {
  using torch::headeronly::DeviceType;
  std::string text;
  switch (device.type()) {
    case DeviceType::CPU:
      text = "cpu";
      break;
    case DeviceType::CUDA:
      text = "cuda";
      break;
    case DeviceType::Meta:
      text = "meta";
      break;
    default:
      text = "device type " + std::to_string(static_cast<int>(device.type()));
  }
  return device.has_index() ? text + ":" + std::to_string(device.index()) : text;
}

}  // namespace deformconv
