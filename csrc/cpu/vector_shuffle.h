#pragma once

// Lane shuffles of GCC/clang vector extensions (vector_size types), spelled once for every
// compiler the CPU kernels support:
//   shuffle<i0, i1, ...>(a, b)  lane k of the result is lane i_k of the concatenation (a, b);
//   half<first>(v)              the lanes [first, first + n / 2) of v, a vector half as wide.
// clang and GCC 12 and newer have __builtin_shufflevector, which does both. GCC 11 has only
// __builtin_shuffle, whose result is as wide as its operands and whose selector is a vector of
// integers as wide as the lanes; there a half is built lane by lane. Each spelling picks the
// same lanes, so the arithmetic around them, and every result, is the same on every compiler.
// Nothing here includes torch, so that tests/cpp/vector_shuffle_test.cpp checks both spellings
// with any compiler.

#include <cstdint>
#include <type_traits>
#include <utility>

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define DEFORMCONV_HAS_SHUFFLEVECTOR 1
#else
#define DEFORMCONV_HAS_SHUFFLEVECTOR 0
#endif

namespace deformconv {

template <typename Vector>
using LaneOf = std::remove_cv_t<std::remove_reference_t<decltype(std::declval<Vector>()[0])>>;

template <typename Vector>
constexpr int kLaneCount = static_cast<int>(sizeof(Vector) / sizeof(LaneOf<Vector>));

template <typename Vector>
struct HalfOf {
  typedef LaneOf<Vector> type __attribute__((vector_size(sizeof(Vector) / 2)));
};

template <int... lanes, typename Vector>
inline __attribute__((always_inline)) Vector shuffle(const Vector& a, const Vector& b) {
  static_assert(sizeof...(lanes) == kLaneCount<Vector>, "one index per lane of the result");
#if DEFORMCONV_HAS_SHUFFLEVECTOR
  return __builtin_shufflevector(a, b, lanes...);
#else
  using Index = std::conditional_t<sizeof(LaneOf<Vector>) == 4, int32_t, int64_t>;
  static_assert(sizeof(Index) == sizeof(LaneOf<Vector>), "lanes of 4 or 8 bytes");
  typedef Index Selector __attribute__((vector_size(sizeof(Vector))));
  return __builtin_shuffle(a, b, Selector{lanes...});
#endif
}

template <int first, typename Vector, int... offsets>
inline __attribute__((always_inline)) typename HalfOf<Vector>::type half_of(
    const Vector& v, std::integer_sequence<int, offsets...>) {
#if DEFORMCONV_HAS_SHUFFLEVECTOR
  return __builtin_shufflevector(v, v, (first + offsets)...);
#else
  return typename HalfOf<Vector>::type{v[first + offsets]...};
#endif
}

template <int first, typename Vector>
inline __attribute__((always_inline)) typename HalfOf<Vector>::type half(const Vector& v) {
  static_assert(first == 0 || first == kLaneCount<Vector> / 2, "the lower or the upper half");
  return half_of<first>(v, std::make_integer_sequence<int, kLaneCount<Vector> / 2>{});
}

}  // namespace deformconv
