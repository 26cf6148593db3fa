// csrc/cpu/vector_shuffle.h on its own, with no torch: every lane of shuffle<...> and half<...>
// for the vector types of the CPU kernels (8 lanes of float or double, 16 of float), whichever
// spelling the compiler takes (__builtin_shufflevector, or GCC 11's __builtin_shuffle).
//   c++ -std=c++17 -O2 tests/cpp/test_vector_shuffle.cpp -o test_vector_shuffle && ./test_vector_shuffle

#include <cstdio>
#include <cstdlib>

#include "../../csrc/cpu/vector_shuffle.h"

namespace {

int failures = 0;

void expect(bool ok, const char* what, int lane) {
  if (!ok) {
    std::printf("FAILED: %s, lane %d\n", what, lane);
    ++failures;
  }
}

// a holds 0, 1, ..., n - 1 and b n, ..., 2n - 1, so each lane of a shuffle shows its index.
template <typename Vector>
void fill(Vector& a, Vector& b) {
  for (int i = 0; i < deformconv::kLaneCount<Vector>; ++i) {
    a[i] = static_cast<deformconv::LaneOf<Vector>>(i);
    b[i] = static_cast<deformconv::LaneOf<Vector>>(i + deformconv::kLaneCount<Vector>);
  }
}

template <typename Vector>
void check_eight_lanes(const char* name) {
  Vector a, b;
  fill(a, b);
  const Vector interleaved = deformconv::shuffle<0, 8, 1, 9, 4, 12, 5, 13>(a, b);
  const Vector mixed = deformconv::shuffle<2, 10, 3, 11, 6, 14, 7, 15>(b, a);
  const Vector reversed = deformconv::shuffle<7, 6, 5, 4, 3, 2, 1, 0>(a, a);
  const int interleaved_lanes[8] = {0, 8, 1, 9, 4, 12, 5, 13};
  // Indices 8 and up select from the second operand, here a.
  const int mixed_lanes[8] = {10, 2, 11, 3, 14, 6, 15, 7};
  for (int i = 0; i < 8; ++i) {
    expect(interleaved[i] == interleaved_lanes[i], name, i);
    expect(mixed[i] == mixed_lanes[i], name, i);
    expect(reversed[i] == 7 - i, name, i);
  }
  const auto lower = deformconv::half<0>(a);
  const auto upper = deformconv::half<4>(b);
  static_assert(sizeof(lower) * 2 == sizeof(Vector), "a half is half as wide");
  for (int i = 0; i < 4; ++i) {
    expect(lower[i] == i, name, i);
    expect(upper[i] == 12 + i, name, i);
  }
  const auto quarter = deformconv::half<2>(upper);
  expect(quarter[0] == 14 && quarter[1] == 15, name, 0);
}

void check_sixteen_lanes() {
  typedef float Vector __attribute__((vector_size(64)));
  Vector a, b;
  fill(a, b);
  const Vector odd = deformconv::shuffle<1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29,
                                         31>(a, b);
  const auto upper = deformconv::half<8>(b);
  for (int i = 0; i < 16; ++i) {
    expect(odd[i] == 2 * i + 1, "16 floats", i);
  }
  for (int i = 0; i < 8; ++i) {
    expect(upper[i] == 24 + i, "16 floats, upper half", i);
  }
}

}  // namespace

int main() {
  typedef float Floats __attribute__((vector_size(32)));
  typedef double Doubles __attribute__((vector_size(64)));
  check_eight_lanes<Floats>("8 floats");
  check_eight_lanes<Doubles>("8 doubles");
  check_sixteen_lanes();
  std::printf("vector_shuffle (%s): %s\n",
              DEFORMCONV_HAS_SHUFFLEVECTOR ? "__builtin_shufflevector" : "__builtin_shuffle",
              failures == 0 ? "passed" : "FAILED");
  return failures == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
