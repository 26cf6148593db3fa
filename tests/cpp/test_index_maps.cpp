// The index arithmetic that only the CUDA launchers use, run on the CPU: the GPU's im2col and
// columns gradient take a window's samples by items (image, window pixel, deform group), found
// with decompose_item_index and sample_of_tap, and address the columns with column_index and
// the launch's divisors. Both must agree with the maps the CPU launchers use
// (make_sample_index, column_index), for every item, tap and channel of a few awkward
// geometries, dividing in int64 and by InvariantDivisor alike; and InvariantDivisor must divide
// exactly, checked over divisors and dividends from 1 to 2^31 - 1.

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>

#include "../../csrc/common/deform_conv2d_kernel.cuh"

namespace {

using deformconv::DeformConv2dGeometry;
using deformconv::IndexDivisors;
using deformconv::InvariantDivisor;
using deformconv::PixelWindow;
using deformconv::SampleIndex;

int failures = 0;

void expect(bool ok, const char* what, long long index) {
  if (!ok && failures++ < 10) {
    std::fprintf(stderr, "index %lld: %s\n", index, what);
  }
}

bool same(const SampleIndex& a, const SampleIndex& b) {
  return a.n == b.n && a.group == b.group && a.tap == b.tap && a.pixel == b.pixel &&
      a.out_y == b.out_y && a.out_x == b.out_x && a.grid_y == b.grid_y && a.grid_x == b.grid_x;
}

// A geometry and a window of its output pixels.
struct Case {
  DeformConv2dGeometry g;
  PixelWindow window;
};

// in_channels, groups, offset_groups, kernel, stride, pad, dilation, window [begin, +pixels)
Case geometry(int64_t channels, int64_t groups, int64_t offset_groups, int64_t kernel_h,
              int64_t kernel_w, int64_t stride, int64_t pad, int64_t dilation,
              int64_t window_begin, int64_t window_pixels) {
  DeformConv2dGeometry g{};
  g.in_channels = channels;
  g.in_height = 7;
  g.in_width = 9;
  g.out_channels = 2 * groups;
  g.kernel_h = kernel_h;
  g.kernel_w = kernel_w;
  g.stride_h = g.stride_w = stride;
  g.pad_h = g.pad_w = pad;
  g.dilation_h = g.dilation_w = dilation;
  g.out_height = (g.in_height + 2 * pad - (dilation * (kernel_h - 1) + 1)) / stride + 1;
  g.out_width = (g.in_width + 2 * pad - (dilation * (kernel_w - 1) + 1)) / stride + 1;
  g.groups = groups;
  g.offset_groups = offset_groups;
  return {g, {window_begin, window_pixels}};
}

template <typename Divisor>
void check(const Case& c, int64_t batch) {
  const DeformConv2dGeometry& g = c.g;
  const PixelWindow& window = c.window;
  const IndexDivisors<Divisor> divisors(g, window);
  const int64_t per_group = g.channels_per_offset_group();
  int64_t item = 0;
  for (int64_t n = 0; n < batch; ++n) {
    for (int64_t window_pixel = 0; window_pixel < window.pixels; ++window_pixel) {
      for (int64_t group = 0; group < g.offset_groups; ++group, ++item) {
        const int64_t pixel = window.begin + window_pixel;
        const SampleIndex first = deformconv::decompose_item_index(g, window, divisors, item);
        expect(same(first, deformconv::make_sample_index(g, n, group, 0, pixel)),
               "tap 0 of the item", item);
        for (int64_t tap = 0; tap < g.taps(); ++tap) {
          const SampleIndex s = deformconv::sample_of_tap(g, divisors, first, tap);
          expect(same(s, deformconv::make_sample_index(g, n, group, tap, pixel)),
                 "tap of the item", item);
          for (int64_t channel = group * per_group; channel < (group + 1) * per_group;
               ++channel) {
            expect(deformconv::column_index(g, window, divisors, s, channel) ==
                       deformconv::column_index(g, window, n, window_pixel, tap, channel),
                   "column_index of the launch", item);
          }
        }
      }
    }
  }
}

void check_division(int64_t divisor, int64_t dividend) {
  const InvariantDivisor d(divisor);
  const int64_t quotient = d.quotient(static_cast<uint32_t>(dividend));
  if (quotient != dividend / divisor && failures++ < 10) {
    std::fprintf(stderr, "InvariantDivisor: %lld / %lld gave %lld\n",
                 static_cast<long long>(dividend), static_cast<long long>(divisor),
                 static_cast<long long>(quotient));
  }
}

// Every divisor up to 4096 with every dividend up to 2^14 and the top of the range; divisors
// near powers of two and near 2^31 (where the multiplier is largest or smallest) with dividends
// at multiples of the divisor and one either side; then random pairs.
void check_invariant_division() {
  constexpr int64_t kLargest = INT32_MAX;
  for (int64_t divisor = 1; divisor <= 4096; ++divisor) {
    for (int64_t dividend = 0; dividend < (int64_t(1) << 14); ++dividend) {
      check_division(divisor, dividend);
    }
    for (int64_t dividend = kLargest - 4096; dividend <= kLargest; ++dividend) {
      check_division(divisor, dividend);
    }
  }
  for (int bit = 1; bit <= 31; ++bit) {
    for (int64_t delta = -3; delta <= 3; ++delta) {
      const int64_t divisor = (int64_t(1) << bit) + delta;
      if (divisor < 1 || divisor > kLargest) {
        continue;
      }
      // The first and the last 2^16 multiples of the divisor below 2^31.
      const int64_t last = kLargest / divisor;
      for (int64_t k = 0; k <= last; ++k) {
        if (k == (int64_t(1) << 16) && last > (int64_t(1) << 17)) {
          k = last - (int64_t(1) << 16);
        }
        for (int64_t dividend = k * divisor - 1; dividend <= k * divisor + 1; ++dividend) {
          if (dividend >= 0 && dividend <= kLargest) {
            check_division(divisor, dividend);
          }
        }
      }
    }
  }
  std::mt19937_64 random(2024);
  std::uniform_int_distribution<int64_t> any(1, kLargest);
  for (int i = 0; i < 10000000; ++i) {
    const int64_t divisor = any(random) >> (random() % 31);
    check_division(divisor < 1 ? 1 : divisor, any(random) - 1);
  }
}

}  // namespace

int main() {
  // (channels, groups, offset groups, kH, kW, stride, pad, dilation, window begin, pixels)
  const Case geometries[] = {
      geometry(6, 1, 1, 3, 3, 1, 1, 1, 0, 63),
      geometry(12, 3, 2, 3, 2, 2, 1, 1, 5, 11),  // deform groups across conv groups
      geometry(12, 2, 3, 2, 3, 1, 2, 2, 17, 40),
      geometry(8, 4, 4, 1, 1, 3, 0, 1, 0, 9),
  };
  const int64_t batches[] = {2, 3, 2, 1};
  for (int i = 0; i < 4; ++i) {
    check<int64_t>(geometries[i], batches[i]);
    check<InvariantDivisor>(geometries[i], batches[i]);
  }
  check_invariant_division();
  if (failures > 0) {
    std::fprintf(stderr, "%d index checks failed\n", failures);
    return EXIT_FAILURE;
  }
  std::puts(
      "index maps: every item, tap and channel as the CPU maps them; InvariantDivisor divides "
      "exactly");
  return EXIT_SUCCESS;
}
