#pragma once

// The CPU launchers' common loops: channels sampled or summed vectorised, inlined into each
// copy of the kernels (Note [CPU copies], cpu_copies.h); their parallel tasks are
// infrastructure/parallel_region.h's.


#include <cstdint>
#include <type_traits>

#include "../common/scalar_types.h"
#include "../common/bilinear_sampling.cuh"
#include "../infrastructure/branch_trace.h"
#include "../infrastructure/parallel_region.h"
#include "vector_shuffle.h"

// A helper of a kernel body runs with its copy's instruction set only if it is inlined into it
// (Note [CPU copies], cpu_copies.h), which the compiler's heuristics alone do not promise. A
// lambda passed to a helper defined outside the body, marked with DEFORMCONV_INLINE_LAMBDA
// after its parameters, likewise: left out of line inside the helper, its sums could round
// differently (with or without fused multiply-adds) from the same code inlined elsewhere.
#if defined(__GNUC__)
#define DEFORMCONV_INLINE inline __attribute__((always_inline))
#define DEFORMCONV_INLINE_LAMBDA __attribute__((always_inline))
#define DEFORMCONV_NOINLINE __attribute__((noinline))
#else
#define DEFORMCONV_INLINE inline
#define DEFORMCONV_INLINE_LAMBDA
#define DEFORMCONV_NOINLINE
#endif

namespace deformconv {

// Calls run(std::integral_constant<int, kRegisterBytes>{}) for a stage whose vectors are as
// wide as a vector register of the copy that runs (its kRegisterBytes, cpu_copies.h).
template <int kRegisterBytes, typename Function>
DEFORMCONV_INLINE void with_register_bytes(const Function& run) {
  record_branch(kRegisterBytes == 64 ? "cpu.vectors.64bytes" : "cpu.vectors.32bytes");
  run(std::integral_constant<int, kRegisterBytes>{});
}

// One bilinear sample of `count` consecutive channels, stored into out[c]: the sum of the four
// corner rows weighted by `weight`. The caller points a corner that takes no part (outside the
// image, or of zero weight) at a row of zeros, so that every sample is the same sum, which the
// compiler vectorises without masks or branches, and an infinite input value at such a corner
// cannot make NaN.
template <typename scalar_t, typename opmath_t, typename out_t>
DEFORMCONV_INLINE void sum_corner_rows(const scalar_t* const rows[4], const opmath_t weight[4],
                                       int64_t count, out_t* __restrict out) {
  const scalar_t* __restrict row_0 = rows[0];
  const scalar_t* __restrict row_1 = rows[1];
  const scalar_t* __restrict row_2 = rows[2];
  const scalar_t* __restrict row_3 = rows[3];
  const opmath_t w_0 = weight[0], w_1 = weight[1], w_2 = weight[2], w_3 = weight[3];
  for (int64_t c = 0; c < count; ++c) {
    out[c] = static_cast<out_t>(
        w_0 * static_cast<opmath_t>(row_0[c]) + w_1 * static_cast<opmath_t>(row_1[c]) +
        w_2 * static_cast<opmath_t>(row_2[c]) + w_3 * static_cast<opmath_t>(row_3[c]));
  }
}

// The cache line of x86-64 and of most ARM cores, the stride of software prefetches. Where
// lines are longer, some lines are asked for twice, which is harmless.
inline constexpr int64_t kCacheLineBytes = 64;

// kLanes values of opmath_t in one GCC/Clang vector. Arithmetic on it is lane by lane, so the
// offset/mask gradient sums run kLanes channels at a time through the shared
// add_offset_mask_grad_terms; reductions are written with explicit lanes because the compiler
// may not reorder floating-point sums by itself. Eight floats are one AVX2 register (and half
// an AVX-512 one): a vector wider than the copy's registers, such as 16 floats in the AVX2
// copy, has no register to live in, and GCC keeps it on the stack, broadcasting a scalar
// into it with a store per lane.
inline constexpr int64_t kLanes = 8;
template <typename opmath_t>
struct LanesOf;
// `unaligned` is the same vector at any address of an opmath_t, which may alias it (as the
// intrinsics' unaligned loads are declared): loads and stores through it are plain vector moves.
template <>
struct LanesOf<float> {
  typedef float type __attribute__((vector_size(kLanes * sizeof(float))));
  typedef float unaligned
      __attribute__((vector_size(kLanes * sizeof(float)), aligned(alignof(float)), may_alias));
};
template <>
struct LanesOf<double> {
  typedef double type __attribute__((vector_size(kLanes * sizeof(double))));
  typedef double unaligned
      __attribute__((vector_size(kLanes * sizeof(double)), aligned(alignof(double)), may_alias));
};

// A GCC vector of opmath_t of any width from consecutive values of `data` (of any dtype). (An
// out-parameter: returning a vector by value would give these inline helpers an ABI that
// differs per copy.)
template <typename opmath_t, typename Vector, typename scalar_t>
DEFORMCONV_INLINE void load_vector(const scalar_t* data, Vector& vector) {
  for (int64_t lane = 0; lane < int64_t(sizeof(Vector) / sizeof(opmath_t)); ++lane) {
    vector[lane] = static_cast<opmath_t>(data[lane]);
  }
}

// kLanes consecutive values from `data` (of any dtype) as opmath_t lanes.
template <typename opmath_t, typename scalar_t>
DEFORMCONV_INLINE void load_lanes(const scalar_t* data, typename LanesOf<opmath_t>::type& lanes) {
  load_vector<opmath_t>(data, lanes);
}

// The first `count` (fewer than kLanes) values from `data` in the first lanes, the others 0:
// copied into a zero-filled array and loaded from there, so that the vector stays in a register.
template <typename opmath_t, typename scalar_t>
DEFORMCONV_INLINE void load_last_lanes(const scalar_t* data, int64_t count,
                                       typename LanesOf<opmath_t>::type& lanes) {
  opmath_t copied[kLanes] = {};
  for (int64_t lane = 0; lane < count; ++lane) {
    copied[lane] = static_cast<opmath_t>(data[lane]);
  }
  lanes = *reinterpret_cast<const typename LanesOf<opmath_t>::unaligned*>(copied);
}

// The sum of the lanes: the upper half added onto the lower half, and again, down to one lane,
// in log2(kLanes) dependent steps rather than kLanes and in an order fixed by the code, not by
// the machine. Each step is one vector add of the halves, which stay in registers.
template <typename opmath_t>
DEFORMCONV_INLINE opmath_t sum_of_lanes(const typename LanesOf<opmath_t>::type& lanes) {
  static_assert(kLanes == 8, "the halving steps below are written out for 8 lanes");
  const auto four = half<0>(lanes) + half<4>(lanes);
  const auto two = half<0>(four) + half<2>(four);
  return two[0] + two[1];
}

// The sums of the lanes of four vectors, sums[i] of lanes_i, each added up pairwise in a fixed
// order: neighbouring lanes first, (0 + 1), (2 + 3), ..., then neighbouring pairs, then the
// two halves. Each step adds two vectors that interleave pieces of the four, so the four sums
// take three vector adds; the first two steps' interleaving moves values only within each
// 128-bit half, one instruction per operand (SSE/AVX shufps), and the last is the halves'.
// (Four arguments rather than an array, which GCC kept in memory, zeroing it per call.)
template <typename opmath_t>
DEFORMCONV_INLINE void sums_of_four_lanes(const typename LanesOf<opmath_t>::type& lanes_0,
                                          const typename LanesOf<opmath_t>::type& lanes_1,
                                          const typename LanesOf<opmath_t>::type& lanes_2,
                                          const typename LanesOf<opmath_t>::type& lanes_3,
                                          opmath_t sums[4]) {
  static_assert(kLanes == 8, "the pairwise steps below are written out for 8 lanes");
  // Within each half of four lanes: the pairs (0+1, 2+3) of lanes_0, then those of lanes_1;
  // the same for lanes_2 and lanes_3.
  const auto pairs_01 = shuffle<0, 2, 8, 10, 4, 6, 12, 14>(lanes_0, lanes_1) +
      shuffle<1, 3, 9, 11, 5, 7, 13, 15>(lanes_0, lanes_1);
  const auto pairs_23 = shuffle<0, 2, 8, 10, 4, 6, 12, 14>(lanes_2, lanes_3) +
      shuffle<1, 3, 9, 11, 5, 7, 13, 15>(lanes_2, lanes_3);
  // The same step on those: [fours of 0, 1, 2, 3 | the other fours of 0, 1, 2, 3]
  const auto fours = shuffle<0, 2, 8, 10, 4, 6, 12, 14>(pairs_01, pairs_23) +
      shuffle<1, 3, 9, 11, 5, 7, 13, 15>(pairs_01, pairs_23);
  const auto ones = half<0>(fours) + half<4>(fours);
  for (int i = 0; i < 4; ++i) {
    sums[i] = ones[i];
  }
}

// The offset and mask gradient sums of one sample (bilinear_sampling.cuh), kLanes channels at
// a time in vector lanes and the rest one by one; `total` adds the lanes up in a fixed order,
// so the result does not depend on the machine.
template <typename opmath_t>
struct LaneSums {
  typename LanesOf<opmath_t>::type y = {}, x = {}, m = {};
  OffsetMaskGradSums<opmath_t> rest;

  DEFORMCONV_INLINE OffsetMaskGradSums<opmath_t> total() const {
    OffsetMaskGradSums<opmath_t> sums = rest;
    sums.y += sum_of_lanes<opmath_t>(y);
    sums.x += sum_of_lanes<opmath_t>(x);
    sums.m += sum_of_lanes<opmath_t>(m);
    return sums;
  }
};

// Adds `count` consecutive channels of a sample located by `acc`: their sampled values'
// gradients at grad[c], their image values from `channel` on (as in sample_with_plan).
template <typename scalar_t>
DEFORMCONV_INLINE void add_channels_to_sums(const OffsetMaskGrad<opmath_type<scalar_t>>& acc,
                                            const scalar_t* grad, const scalar_t* channel,
                                            int64_t channel_stride, int64_t count,
                                            LaneSums<opmath_type<scalar_t>>& sums) {
  using opmath_t = opmath_type<scalar_t>;
  using Lanes = typename LanesOf<opmath_t>::type;
  bool inside[4];
  corners_inside(acc.cell, inside);
  const scalar_t* corner_0 = channel + acc.index[0] * channel_stride;
  const scalar_t* corner_1 = channel + acc.index[1] * channel_stride;
  const scalar_t* corner_2 = channel + acc.index[2] * channel_stride;
  const scalar_t* corner_3 = channel + acc.index[3] * channel_stride;
  int64_t c = 0;
  for (; c + kLanes <= count; c += kLanes) {
    // Corners outside read index 0 (a valid address) and are then replaced by 0.
    Lanes grad_lanes, v00, v01, v10, v11;
    load_lanes<opmath_t>(grad + c, grad_lanes);
    load_lanes<opmath_t>(corner_0 + c, v00);
    load_lanes<opmath_t>(corner_1 + c, v01);
    load_lanes<opmath_t>(corner_2 + c, v10);
    load_lanes<opmath_t>(corner_3 + c, v11);
    add_offset_mask_grad_terms(acc.cell, grad_lanes, inside[0] ? v00 : Lanes{},
                               inside[1] ? v01 : Lanes{}, inside[2] ? v10 : Lanes{},
                               inside[3] ? v11 : Lanes{}, sums.y, sums.x, sums.m);
  }
  for (; c < count; ++c) {
    accumulate_offset_mask_grad(acc, grad[c], channel + c, channel_stride, sums.rest);
  }
}

}  // namespace deformconv
