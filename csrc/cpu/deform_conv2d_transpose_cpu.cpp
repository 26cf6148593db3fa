// The tiled transposes between the (C_in, H * W) planes of the user's tensors and
// channels-last, on the CPU.

#if !defined(DEFORMCONV_CPU_COPY)  // the head (Note [CPU copies], cpu_copies.h)


#include <algorithm>
#include <cstdint>

#include "../core/deform_conv2d_launchers.h"
#include "cpu_loops.h"

#define DEFORMCONV_CPU_COPY_BODY "deform_conv2d_transpose_cpu.cpp"
#include "cpu_copies.h"

#else  // the body, once per copy

#include "deform_conv2d_stages.h"

namespace deformconv::DEFORMCONV_CPU_COPY {
namespace {

// Swaps the last two dimensions in square tiles, so that both the reads and the writes of a
// tile stay on a few cache lines and pages; ATen's generic strided copy is several times
// slower for these shapes.
constexpr int64_t kTransposeTile = 64;

template <typename scalar_t>
void transpose_tiles(const scalar_t* src, scalar_t* dst, int64_t rows,
                                              int64_t cols, int64_t begin, int64_t end) {
  const int64_t row_tiles = (rows + kTransposeTile - 1) / kTransposeTile;
  const int64_t col_tiles = (cols + kTransposeTile - 1) / kTransposeTile;
  for (int64_t tile = begin; tile < end; ++tile) {
    const int64_t matrix = tile / (row_tiles * col_tiles);
    const int64_t row_begin = tile / col_tiles % row_tiles * kTransposeTile;
    const int64_t col_begin = tile % col_tiles * kTransposeTile;
    const int64_t row_end = std::min(rows, row_begin + kTransposeTile);
    const int64_t col_end = std::min(cols, col_begin + kTransposeTile);
    const scalar_t* from = src + matrix * rows * cols;
    scalar_t* to = dst + matrix * rows * cols;
    for (int64_t c = col_begin; c < col_end; ++c) {
      for (int64_t r = row_begin; r < row_end; ++r) {
        to[c * rows + r] = from[r * cols + c];
      }
    }
  }
}

}  // namespace

void transpose_cpu(const Tensor& src, Tensor& dst) {
  const int64_t rows = src.size(1);
  const int64_t cols = src.size(2);
  const int64_t tiles = src.size(0) * ((rows + kTransposeTile - 1) / kTransposeTile) *
      ((cols + kTransposeTile - 1) / kTransposeTile);
  DEFORMCONV_DISPATCH(src.scalar_type(), "deform_conv2d_transpose_cpu", [&] {
    const scalar_t* from = src.const_data_ptr<scalar_t>();
    scalar_t* to = dst.mutable_data_ptr<scalar_t>();
    parallel_tasks(tiles, [&](int64_t begin, int64_t end) {
      transpose_tiles(from, to, rows, cols, begin, end);
    });
  });
}

}  // namespace deformconv::DEFORMCONV_CPU_COPY

#endif
