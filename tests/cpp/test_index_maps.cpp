// The index arithmetic that only the CUDA launchers use, run on the CPU: one thread per columns
// entry finds its sample and channel with decompose_column_index, one thread per sample with
// decompose_sample_index. Both must invert the maps the CPU launchers use (column_index,
// make_sample_index and next_pixel), for every entry of a few awkward geometries.

#include <cstdio>
#include <cstdlib>

#include "../../csrc/common/deform_conv2d_kernel.cuh"

namespace {

using deformconv::DeformConv2dGeometry;
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

// in_channels, groups, offset_groups, kernel, stride, pad, dilation, window [begin, +pixels)
DeformConv2dGeometry geometry(int64_t channels, int64_t groups, int64_t offset_groups,
                              int64_t kernel_h, int64_t kernel_w, int64_t stride, int64_t pad,
                              int64_t dilation, int64_t window_begin, int64_t window_pixels) {
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
  g.window_begin = window_begin;
  g.window_pixels = window_pixels;
  return g;
}

void check(const DeformConv2dGeometry& g, int64_t batch) {
  const int64_t entries = batch * g.in_channels * g.taps() * g.window_pixels;
  for (int64_t index = 0; index < entries; ++index) {
    int64_t channel = -1;
    const SampleIndex s = deformconv::decompose_column_index(g, index, channel);
    expect(deformconv::column_index(g, s, channel) == index, "column_index round trip", index);
    expect(s.group == channel / g.channels_per_offset_group(), "deform group of channel", index);
    expect(same(s, deformconv::make_sample_index(g, s.n, s.group, s.tap, s.pixel)),
           "sample of column entry", index);
  }
  // Samples in launcher order: decompose_sample_index agrees with stepping along each row.
  int64_t index = 0;
  for (int64_t n = 0; n < batch; ++n) {
    for (int64_t group = 0; group < g.offset_groups; ++group) {
      for (int64_t tap = 0; tap < g.taps(); ++tap) {
        SampleIndex s = deformconv::make_sample_index(g, n, group, tap, g.window_begin);
        for (int64_t p = 0; p < g.window_pixels; ++p, ++index, deformconv::next_pixel(g, s)) {
          expect(same(s, deformconv::decompose_sample_index(g, index)), "sample round trip",
                 index);
        }
      }
    }
  }
}

}  // namespace

int main() {
  // (channels, groups, offset groups, kH, kW, stride, pad, dilation, window begin, pixels)
  check(geometry(6, 1, 1, 3, 3, 1, 1, 1, 0, 63), 2);
  check(geometry(12, 3, 2, 3, 2, 2, 1, 1, 5, 11), 3);  // deform groups across conv groups
  check(geometry(12, 2, 3, 2, 3, 1, 2, 2, 17, 40), 2);
  check(geometry(8, 4, 4, 1, 1, 3, 0, 1, 0, 9), 1);
  if (failures > 0) {
    std::fprintf(stderr, "%d index checks failed\n", failures);
    return EXIT_FAILURE;
  }
  std::puts("index maps: all entries round-trip");
  return EXIT_SUCCESS;
}
