#pragma once

// The dtypes of every launcher of every op: float32 and float64, and float16 and bfloat16
// (arithmetic in float32, opmath_type). DEFORMCONV_DISPATCH(dtype, name, body) calls the lambda
// `body` where scalar_t is dtype's C++ type, as ATen's AT_DISPATCH macros do, and returns what
// it returns; another dtype throws std::invalid_argument naming `name`.

#include <torch/headeronly/core/ScalarType.h>

#include "../common/scalar_types.h"
#include "argument_checks.h"

#define DEFORMCONV_DISPATCH_CASE(dtype, type, ...) \
  case torch::headeronly::ScalarType::dtype: {     \
    using scalar_t = type;                         \
    return __VA_ARGS__();                          \
  }

#define DEFORMCONV_DISPATCH(dtype, name, ...)                                             \
  [&] {                                                                                   \
    const torch::headeronly::ScalarType dispatched_dtype = (dtype);                       \
    switch (dispatched_dtype) {                                                           \
      DEFORMCONV_DISPATCH_CASE(Float, float, __VA_ARGS__)                                 \
      DEFORMCONV_DISPATCH_CASE(Double, double, __VA_ARGS__)                               \
      DEFORMCONV_DISPATCH_CASE(Half, c10::Half, __VA_ARGS__)                              \
      DEFORMCONV_DISPATCH_CASE(BFloat16, c10::BFloat16, __VA_ARGS__)                      \
      default:                                                                            \
        ::deformconv::throw_argument_error(name, ": unsupported dtype ", dispatched_dtype); \
    }                                                                                     \
  }()
