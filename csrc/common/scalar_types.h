#pragma once

// The floating-point types of the ops, from torch's header-only definitions (the same types as
// c10::Half and c10::BFloat16), and the type that each one's arithmetic runs in.

#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <cstdint>
#include <stdexcept>

namespace deformconv {

// float16 and bfloat16 compute in float32, float32 and float64 in themselves: what ATen's
// at::opmath_type gives for these four.
template <typename scalar_t>
struct OpMath {
  using type = scalar_t;
};
template <>
struct OpMath<c10::Half> {
  using type = float;
};
template <>
struct OpMath<c10::BFloat16> {
  using type = float;
};

template <typename scalar_t>
using opmath_type = typename OpMath<scalar_t>::type;

// Whether the ops take `dtype`: the four dtypes above (no float8: the kernels compute in the
// dtype they read).
inline bool is_op_dtype(torch::headeronly::ScalarType dtype) {
  using torch::headeronly::ScalarType;
  return dtype == ScalarType::Half || dtype == ScalarType::BFloat16 || dtype == ScalarType::Float ||
         dtype == ScalarType::Double;
}

// The dtype of opmath_type for these four dtypes.
inline torch::headeronly::ScalarType opmath_dtype(torch::headeronly::ScalarType dtype) {
  using torch::headeronly::ScalarType;
  return dtype == ScalarType::Half || dtype == ScalarType::BFloat16 ? ScalarType::Float : dtype;
}

// Bytes per element of the op dtypes and of bytes (the drivers' workspaces).
inline int64_t element_size(torch::headeronly::ScalarType dtype) {
  using torch::headeronly::ScalarType;
  switch (dtype) {
    case ScalarType::Double:
      return 8;
    case ScalarType::Float:
      return 4;
    case ScalarType::Half:
    case ScalarType::BFloat16:
      return 2;
    case ScalarType::Byte:
      return 1;
    default:
      throw std::logic_error("deformconv: element_size of a dtype the drivers never use");
  }
}

}  // namespace deformconv
