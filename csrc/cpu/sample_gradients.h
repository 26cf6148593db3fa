#pragma once

// One bilinear sample's share of the gradients over a run of D channels, shared by the CPU
// backward of DCNv3/DCNv4 and of multi-scale deformable attention: the dot products of the
// sampled values' gradient with the four corner rows (for the position and weight gradients),
// and that gradient, weighted, added onto the corner rows' gradients.

#include <cstdint>

#include "cpu_loops.h"

namespace deformconv {

// dot_i += grad * value_i, lane by lane, for the four corners.
template <typename Lanes>
DEFORMCONV_INLINE void add_corner_products(const Lanes& grad, const Lanes& value_0,
                                           const Lanes& value_1, const Lanes& value_2,
                                           const Lanes& value_3, Lanes& dot_0, Lanes& dot_1,
                                           Lanes& dot_2, Lanes& dot_3) {
  dot_0 += grad * value_0;
  dot_1 += grad * value_1;
  dot_2 += grad * value_2;
  dot_3 += grad * value_3;
}

// weight[corner] * grad added onto each corner's row grad_row[corner], over the D channels of
// a group: in vectors as wide as the running copy's registers (kVectorBytes: one AVX-512
// register for a group of 16 float channels, where kLanes would take two), then kLanes at a
// time, then one by one. Each channel's sum is the same multiply-add whatever the width.
template <int kVectorBytes, typename opmath_t>
DEFORMCONV_INLINE void scatter_sample_gradient(const opmath_t* grad, int64_t D,
                                               opmath_t* const grad_row[4],
                                               const opmath_t weight[4]) {
  using Lanes = typename LanesOf<opmath_t>::type;
  using UnalignedLanes = typename LanesOf<opmath_t>::unaligned;
  typedef opmath_t Vector __attribute__((vector_size(kVectorBytes)));
  typedef opmath_t UnalignedVector
      __attribute__((vector_size(kVectorBytes), aligned(alignof(opmath_t)), may_alias));
  constexpr int64_t kWidth = kVectorBytes / sizeof(opmath_t);
  int64_t c = 0;
  for (; kWidth > kLanes && c + kWidth <= D; c += kWidth) {
    Vector grad_vector;
    load_vector<opmath_t>(grad + c, grad_vector);
    for (int corner = 0; corner < 4; ++corner) {
      *reinterpret_cast<UnalignedVector*>(grad_row[corner] + c) += weight[corner] * grad_vector;
    }
  }
#pragma GCC unroll 2
  for (; c + kLanes <= D; c += kLanes) {
    Lanes grad_lanes;
    load_lanes<opmath_t>(grad + c, grad_lanes);
    for (int corner = 0; corner < 4; ++corner) {
      *reinterpret_cast<UnalignedLanes*>(grad_row[corner] + c) += weight[corner] * grad_lanes;
    }
  }
  for (; c < D; ++c) {
    for (int corner = 0; corner < 4; ++corner) {
      grad_row[corner][c] += weight[corner] * grad[c];
    }
  }
}

// The dot products of `grad` (in the accumulation type, zero-filled to whole lanes) with the
// D channels of each of the four corner rows: kLanes channels at a time, the last few copied
// into zero-filled lanes, and each sum's lanes added up in a fixed order (sums_of_four_lanes),
// so that the result depends neither on the machine nor on the caller. A corner that takes no
// part is given a row of zeros by the caller.
template <typename scalar_t, typename opmath_t>
DEFORMCONV_INLINE void corner_dot_products(const opmath_t* grad, int64_t D,
                                           const scalar_t* const rows[4], opmath_t dots[4]) {
  using Lanes = typename LanesOf<opmath_t>::type;
  Lanes dot_0 = {}, dot_1 = {}, dot_2 = {}, dot_3 = {};
  int64_t c = 0;
  // Unrolled, so that where D is known (16 channels) its two passes run without a loop.
#pragma GCC unroll 2
  for (; c + kLanes <= D; c += kLanes) {
    Lanes grad_lanes, v0, v1, v2, v3;
    load_lanes<opmath_t>(grad + c, grad_lanes);
    load_lanes<opmath_t>(rows[0] + c, v0);
    load_lanes<opmath_t>(rows[1] + c, v1);
    load_lanes<opmath_t>(rows[2] + c, v2);
    load_lanes<opmath_t>(rows[3] + c, v3);
    add_corner_products(grad_lanes, v0, v1, v2, v3, dot_0, dot_1, dot_2, dot_3);
  }
  if (c < D) {
    Lanes grad_lanes, v0, v1, v2, v3;
    load_lanes<opmath_t>(grad + c, grad_lanes);
    load_last_lanes<opmath_t>(rows[0] + c, D - c, v0);
    load_last_lanes<opmath_t>(rows[1] + c, D - c, v1);
    load_last_lanes<opmath_t>(rows[2] + c, D - c, v2);
    load_last_lanes<opmath_t>(rows[3] + c, D - c, v3);
    add_corner_products(grad_lanes, v0, v1, v2, v3, dot_0, dot_1, dot_2, dot_3);
  }
  sums_of_four_lanes<opmath_t>(dot_0, dot_1, dot_2, dot_3, dots);
}

}  // namespace deformconv
