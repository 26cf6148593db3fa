#pragma once

// The dtypes of every launcher of every op: float32 and float64, and float16 and bfloat16
// (arithmetic in float32, at::opmath_type). Launchers include ATen/Dispatch.h to use it.
#define DEFORMCONV_DISPATCH(dtype, name, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, name, __VA_ARGS__)
