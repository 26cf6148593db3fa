#pragma once

// exp(x) in arithmetic that the compiler vectorises: the CPU kernels' softmax (multi-scale
// deformable attention's, SoftmaxNormaliser) takes the exponentials of a query's logits in one
// loop, where a call of std::exp per element would cost more than the rest of the softmax. GCC
// vectorises std::exp only under -ffast-math, which the build does not use.
//
// x = n ln 2 + r with n = round(x / ln 2) and |r| <= ln 2 / 2, so exp(x) = 2^n exp(r): n is
// found by adding 1.5 * 2^m (m the mantissa's bits), which rounds x log2(e) to an integer in the
// low bits of the sum; r = x - n ln 2 is exact with ln 2 split in two (Cody and Waite), the
// first part short enough that n times it has no rounding; exp(r) is its Taylor polynomial,
// whose first omitted term is below a tenth of the type's epsilon (|r|^8 / 8! < 6e-9 in float,
// |r|^14 / 14! < 5e-18 in double); 2^n is built in the exponent's bits. Within a few units of
// the last place of std::exp for x <= 0, the softmax's x = z - max z; 0 below the smallest
// normal result (a denormal's exp, beside the 1 of the largest logit, is lost in the sum
// anyway); NaN for NaN. Not for x > 0.

#include <cstdint>
#include <cstring>

#include "cpu_loops.h"

namespace deformconv {

template <typename T>
struct ExpParts;

template <>
struct ExpParts<float> {
  using Bits = uint32_t;
  static constexpr int kMantissaBits = 23;
  static constexpr Bits kBias = 127;
  static constexpr float kLog2e = 1.44269504088896341f;
  static constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
  static constexpr float kLn2High = 0.693115234375f;  // ln 2 to 12 bits
  static constexpr float kLn2Low = 3.19461833e-05f;  // ln 2 - kLn2High
  static constexpr float kLowest = -87.33654f;  // ln of the smallest normal float, 2^-126
  static constexpr int kDegree = 7;
};

template <>
struct ExpParts<double> {
  using Bits = uint64_t;
  static constexpr int kMantissaBits = 52;
  static constexpr Bits kBias = 1023;
  static constexpr double kLog2e = 1.4426950408889634074;
  static constexpr double kRound = 6755399441055744.0;  // 1.5 * 2^52
  static constexpr double kLn2High = 0.6931471803691238;  // ln 2 to 32 bits
  static constexpr double kLn2Low = 1.9082149292705877e-10;  // ln 2 - kLn2High
  static constexpr double kLowest = -708.3964185322641;  // ln 2^-1022
  static constexpr int kDegree = 13;
};

// Inlined, so that it runs with the instruction set of the CPU copy that calls it (Note [CPU
// copies]).
template <typename T>
DEFORMCONV_INLINE T vectorisable_exp(T x) {
  using Parts = ExpParts<T>;
  using Bits = typename Parts::Bits;
  const T rounded = x * Parts::kLog2e + Parts::kRound;
  const T n = rounded - Parts::kRound;
  const T r = (x - n * Parts::kLn2High) - n * Parts::kLn2Low;
  // 1 + r + r^2 / 2! + ... + r^degree / degree!, by Horner's rule.
  T polynomial = T(1);
  for (int k = Parts::kDegree; k >= 1; --k) {
    polynomial = T(1) + polynomial * r * (T(1) / T(k));
  }
  Bits rounded_bits, round_bits;
  std::memcpy(&rounded_bits, &rounded, sizeof(T));
  std::memcpy(&round_bits, &Parts::kRound, sizeof(T));
  // n in two's complement in the low bits; n + bias is at least 1 above kLowest.
  const Bits exponent = (rounded_bits - round_bits + Parts::kBias) << Parts::kMantissaBits;
  T scale;
  std::memcpy(&scale, &exponent, sizeof(T));
  const T result = polynomial * scale;
  return x < Parts::kLowest ? T(0) : result;
}

}  // namespace deformconv
