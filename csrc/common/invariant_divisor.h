#pragma once

// Division by a divisor that stays the same for a whole launch, as a multiply-high, an add and a
// shift: Granlund and Montgomery, "Division by invariant integers using multiplication"
// (PLDI 1994), Theorem 4.2 with N = 32. A GPU has no integer divider: a 32-bit division is a
// sequence of some twenty instructions, a 64-bit one a subroutine several times longer.
//
// For a divisor d in [1, 2^31), let l = ceil(log2 d) and m = floor(2^32 (2^l - d) / d) + 1,
// which is below 2^32 because 2^l - d < d. Then for every n in [0, 2^32)
//   floor(n / d) = floor((t + n) / 2^l),  t = floor(m n / 2^32),
// and for n below 2^31, as here, t + n < 2^32 fits the 32-bit sum.

#include <torch/headeronly/macros/Macros.h>

#include <cstdint>

namespace deformconv {

struct InvariantDivisor {
  uint32_t divisor = 1;
  uint32_t multiplier = 1;
  uint32_t shift = 0;

  InvariantDivisor() = default;

  // `value` in [1, 2^31); the launchers check it.
  explicit InvariantDivisor(int64_t value) : divisor(static_cast<uint32_t>(value)) {
    while ((int64_t(1) << shift) < value) {
      ++shift;
    }
    multiplier = static_cast<uint32_t>(
        (uint64_t(1) << 32) * ((uint64_t(1) << shift) - divisor) / divisor + 1);
  }

  // floor(n / divisor), n in [0, 2^31).
  C10_HOST_DEVICE uint32_t quotient(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t t = __umulhi(n, multiplier);
#else
    const uint32_t t = static_cast<uint32_t>((uint64_t(n) * multiplier) >> 32);
#endif
    return (t + n) >> shift;
  }
};

// n / d, with n % d in `remainder`: by a plain 64-bit division, or by an InvariantDivisor when
// the caller knows n is below 2^31.
C10_HOST_DEVICE inline int64_t divide(int64_t n, int64_t d, int64_t& remainder) {
  const int64_t q = n / d;
  remainder = n - q * d;
  return q;
}

C10_HOST_DEVICE inline int64_t divide(int64_t n, const InvariantDivisor& d, int64_t& remainder) {
  const int64_t q = d.quotient(static_cast<uint32_t>(n));
  remainder = n - q * d.divisor;
  return q;
}

}  // namespace deformconv
