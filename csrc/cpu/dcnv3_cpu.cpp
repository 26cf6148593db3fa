// CPU launchers of DCNv3 and its CPU kernels. Every task writes outputs of its own, so the
// results, the input gradient included, do not depend on the number of threads.

#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "../common/dcnv3_kernel.cuh"
#include "../pytorch/dcnv3.h"
#include "../pytorch/launchers.h"
#include "cpu_loops.h"
#include "located_samples.h"

namespace deformconv {
namespace {

// Every sample of one output pixel, k = group * P + point, located at once (LocatedSamples):
// dcnv3_position's sum with its terms computed once, the reference point per pixel and the
// grid points per task. A task keeps one and moves it from pixel to pixel.
template <typename opmath_t>
class PixelSamples : public LocatedSamples<opmath_t> {
 public:
  explicit PixelSamples(const Dcnv3Geometry& g)
      : LocatedSamples<opmath_t>(g.groups * g.points(), g.height, g.width) {
    for (int64_t k = 0; k < g.groups * g.points(); ++k) {
      dcnv3_grid_point(g, k % g.points(), this->grid_y[k], this->grid_x[k]);
    }
  }

  template <typename scalar_t>
  DEFORMCONV_INLINE void locate(const Dcnv3Geometry& g, const Dcnv3Fields& f, int64_t pixel,
                                const scalar_t* offset, const scalar_t* mask) {
    const int64_t P = g.points();
    for (int64_t group = 0; group < g.groups; ++group) {
      const scalar_t* group_offset =
          offset + pixel * f.offset_pixel_stride + group * f.offset_group_stride;
      const scalar_t* group_mask = mask + pixel * f.mask_pixel_stride + group * f.mask_group_stride;
      for (int64_t point = 0; point < P; ++point) {
        this->dx[group * P + point] = static_cast<opmath_t>(group_offset[2 * point]);
        this->dy[group * P + point] = static_cast<opmath_t>(group_offset[2 * point + 1]);
        this->m[group * P + point] = static_cast<opmath_t>(group_mask[point]);
      }
    }
    opmath_t base_y, base_x;
    dcnv3_reference_point(g, pixel / g.out_width % g.out_height, pixel % g.out_width, base_y,
                          base_x);
    LocatedSamples<opmath_t>::locate(g.groups * P, base_y, base_x,
                                     static_cast<opmath_t>(g.offset_scale));
  }
};

// Pixels [begin, end) of the batch's output, every group: each channel's sum over the points
// of its group, made in the accumulation type. The four corners of every point are located
// first; a corner that takes no part (outside the image, or of zero weight) reads a row of
// zeros instead, so that each sample is the same weighted sum of four rows, without branches,
// and an infinite input value at such a corner cannot make NaN. Then, kLanes channels at a
// time, the sum over the points stays in registers.
template <typename scalar_t>
DEFORMCONV_VECTOR_CLONES void dcnv3_forward_pixels(const Dcnv3Geometry& g, const Dcnv3Fields& f,
                                                   const scalar_t* input, const scalar_t* offset,
                                                   const scalar_t* mask, scalar_t* output,
                                                   int64_t begin, int64_t end) {
  using opmath_t = at::opmath_type<scalar_t>;
  using Lanes = typename LanesOf<opmath_t>::type;
  const int64_t P = g.points();
  const int64_t D = g.group_channels;
  const std::vector<scalar_t> zeros(D, scalar_t(0));
  std::vector<const scalar_t*> rows(4 * P);
  std::vector<opmath_t> weights(4 * P);
  PixelSamples<opmath_t> samples(g);
  for (int64_t pixel = begin; pixel < end; ++pixel) {
    samples.locate(g, f, pixel, offset, mask);
    for (int64_t group = 0; group < g.groups; ++group) {
      const scalar_t* channels =
          dcnv3_group_channels(g, input, dcnv3_sample_at(g, pixel, group, 0));
      for (int64_t point = 0; point < P; ++point) {
        samples.corner_rows(group * P + point, channels, g.channels(), zeros.data(),
                            weights.data() + 4 * point, rows.data() + 4 * point);
      }
      scalar_t* out = output + pixel * g.channels() + group * D;
      int64_t c = 0;
      for (; c + kLanes <= D; c += kLanes) {
        Lanes sum = {};
        for (int64_t point = 0; point < P; ++point) {
          const opmath_t* w = weights.data() + 4 * point;
          const scalar_t* const* row = rows.data() + 4 * point;
          Lanes v0, v1, v2, v3;
          load_lanes<opmath_t>(row[0] + c, v0);
          load_lanes<opmath_t>(row[1] + c, v1);
          load_lanes<opmath_t>(row[2] + c, v2);
          load_lanes<opmath_t>(row[3] + c, v3);
          sum += w[0] * v0 + w[1] * v1 + w[2] * v2 + w[3] * v3;
        }
        for (int64_t lane = 0; lane < kLanes; ++lane) {
          out[c + lane] = static_cast<scalar_t>(sum[lane]);
        }
      }
      for (; c < D; ++c) {
        opmath_t sum = 0;
        for (int64_t point = 0; point < P; ++point) {
          const opmath_t* w = weights.data() + 4 * point;
          const scalar_t* const* row = rows.data() + 4 * point;
          sum += w[0] * static_cast<opmath_t>(row[0][c]) + w[1] * static_cast<opmath_t>(row[1][c]) +
              w[2] * static_cast<opmath_t>(row[2][c]) + w[3] * static_cast<opmath_t>(row[3][c]);
        }
        out[c] = static_cast<scalar_t>(sum);
      }
    }
  }
}

void dcnv3_forward_cpu(const Dcnv3Geometry& g, const Dcnv3Fields& f, int64_t batch,
                       const at::Tensor& input, const at::Tensor& offset, const at::Tensor& mask,
                       at::Tensor& output) {
  DEFORMCONV_DISPATCH(input.scalar_type(), "dcnv3_forward_cpu", [&] {
    const scalar_t* input_data = input.const_data_ptr<scalar_t>();
    const scalar_t* offset_data = offset.const_data_ptr<scalar_t>();
    const scalar_t* mask_data = mask.const_data_ptr<scalar_t>();
    scalar_t* output_data = output.mutable_data_ptr<scalar_t>();
    parallel_tasks(batch * g.out_pixels(), [&](int64_t begin, int64_t end) {
      dcnv3_forward_pixels(g, f, input_data, offset_data, mask_data, output_data, begin, end);
    });
  });
}

// Tasks [begin, end) of the input gradient, task = (image, band of input rows): the task owns
// the gradient of its rows, every channel, and adds into it the share of every plan corner
// that falls there, in the order (pixel, group, point, corner) whatever the bands.
template <typename scalar_t>
DEFORMCONV_VECTOR_CLONES void dcnv3_input_grad_bands(
    const Dcnv3Geometry& g, const Dcnv3Fields& f, const scalar_t* grad_output,
    const scalar_t* offset, const scalar_t* mask, at::opmath_type<scalar_t>* grad_input,
    int64_t rows_per_band, int64_t bands, int64_t begin, int64_t end) {
  using opmath_t = at::opmath_type<scalar_t>;
  PixelSamples<opmath_t> samples(g);
  for (int64_t task = begin; task < end; ++task) {
    const int64_t n = task / bands;
    const int64_t band_begin = task % bands * rows_per_band * g.width;
    const int64_t band_end = std::min(band_begin + rows_per_band * g.width, g.in_pixels());
    for (int64_t pixel = n * g.out_pixels(); pixel < (n + 1) * g.out_pixels(); ++pixel) {
      samples.locate(g, f, pixel, offset, mask);
      for (int64_t group = 0; group < g.groups; ++group) {
        const scalar_t* grad = grad_output + pixel * g.channels() + group * g.group_channels;
        opmath_t* grad_channels =
            dcnv3_group_channels(g, grad_input, dcnv3_sample_at(g, pixel, group, 0));
        for (int64_t k = group * g.points(); k < (group + 1) * g.points(); ++k) {
          const auto plan = samples.plan(k);
          for (int corner = 0; corner < 4; ++corner) {
            const int64_t index = plan.index[corner];
            if (plan.weight[corner] != opmath_t(0) && index >= band_begin && index < band_end) {
              scatter_corner(plan, corner, grad, g.group_channels, grad_channels, g.channels());
            }
          }
        }
      }
    }
  }
}

// How many bands of input rows each image's input gradient is split into: about two tasks per
// thread over the images. Each band's task walks all the samples of its image, so many more
// bands would multiply that cost.
int64_t input_grad_rows_per_band(const Dcnv3Geometry& g, int64_t batch) {
  const int64_t wanted_bands = (2 * at::get_num_threads() + batch - 1) / batch;
  return (g.height + wanted_bands - 1) / wanted_bands;
}

void dcnv3_input_grad_cpu(const Dcnv3Geometry& g, const Dcnv3Fields& f, int64_t batch,
                          const at::Tensor& grad_output, const at::Tensor& offset,
                          const at::Tensor& mask, at::Tensor& grad_input) {
  const int64_t rows_per_band = input_grad_rows_per_band(g, batch);
  const int64_t bands = (g.height + rows_per_band - 1) / rows_per_band;
  DEFORMCONV_DISPATCH(grad_output.scalar_type(), "dcnv3_input_grad_cpu", [&] {
    // Note [Input gradient sums in float32]
    at::Tensor sums = input_gradient_sums<scalar_t>(grad_input);
    const scalar_t* grad_output_data = grad_output.const_data_ptr<scalar_t>();
    const scalar_t* offset_data = offset.const_data_ptr<scalar_t>();
    const scalar_t* mask_data = mask.const_data_ptr<scalar_t>();
    auto* sums_data = sums.mutable_data_ptr<at::opmath_type<scalar_t>>();
    parallel_tasks(batch * bands, [&](int64_t begin, int64_t end) {
      dcnv3_input_grad_bands(g, f, grad_output_data, offset_data, mask_data, sums_data,
                             rows_per_band, bands, begin, end);
    });
    store_input_gradient_sums(sums, grad_input);
  });
}

// Pixels [begin, end) of the offset and mask gradients: each sample located, summed over its
// group's channels and written in one go.
template <typename scalar_t>
DEFORMCONV_VECTOR_CLONES void dcnv3_offset_mask_grad_pixels(
    const Dcnv3Geometry& g, const Dcnv3Fields& f, const scalar_t* grad_output,
    const scalar_t* input, const scalar_t* offset, const scalar_t* mask, scalar_t* grad_offset,
    scalar_t* grad_mask, int64_t begin, int64_t end) {
  using opmath_t = at::opmath_type<scalar_t>;
  PixelSamples<opmath_t> samples(g);
  for (int64_t pixel = begin; pixel < end; ++pixel) {
    samples.locate(g, f, pixel, offset, mask);
    for (int64_t group = 0; group < g.groups; ++group) {
      const scalar_t* grad = grad_output + pixel * g.channels() + group * g.group_channels;
      for (int64_t point = 0; point < g.points(); ++point) {
        const Dcnv3Sample s = dcnv3_sample_at(g, pixel, group, point);
        const int64_t k = group * g.points() + point;
        OffsetMaskGrad<opmath_t> acc{samples.cell(k), {}, samples.mask(k)};
        corner_indices(acc.cell, g.width, acc.index);
        LaneSums<opmath_t> sums;
        if (acc.cell.inside) {
          add_channels_to_sums(acc, grad, dcnv3_group_channels(g, input, s), g.channels(),
                               g.group_channels, sums);
        }
        dcnv3_finish_grad(g, f, s, acc.mask, sums.total(), grad_offset, grad_mask);
      }
    }
  }
}

void dcnv3_offset_mask_grad_cpu(const Dcnv3Geometry& g, const Dcnv3Fields& f, int64_t batch,
                                const at::Tensor& grad_output, const at::Tensor& input,
                                const at::Tensor& offset, const at::Tensor& mask,
                                at::Tensor& grad_offset, at::Tensor& grad_mask) {
  DEFORMCONV_DISPATCH(input.scalar_type(), "dcnv3_offset_mask_grad_cpu", [&] {
    const scalar_t* grad_output_data = grad_output.const_data_ptr<scalar_t>();
    const scalar_t* input_data = input.const_data_ptr<scalar_t>();
    const scalar_t* offset_data = offset.const_data_ptr<scalar_t>();
    const scalar_t* mask_data = mask.const_data_ptr<scalar_t>();
    scalar_t* grad_offset_data = mutable_data_or_null<scalar_t>(grad_offset);
    scalar_t* grad_mask_data = mutable_data_or_null<scalar_t>(grad_mask);
    parallel_tasks(batch * g.out_pixels(), [&](int64_t begin, int64_t end) {
      dcnv3_offset_mask_grad_pixels(g, f, grad_output_data, input_data, offset_data, mask_data,
                                    grad_offset_data, grad_mask_data, begin, end);
    });
  });
}

// Images [begin, end) of the whole backward, each image a task of its own: every sample is
// located once for its offset and mask gradients and its share of the input gradient, which the
// task owns for its image, added in the order (pixel, group, point, corner) as the banded pass
// adds it. A corner outside the image reads a row of zeros, and kLanes channels of the sampled
// values' gradient serve both sums.
template <typename scalar_t>
DEFORMCONV_VECTOR_CLONES void dcnv3_gradients_images(
    const Dcnv3Geometry& g, const Dcnv3Fields& f, const scalar_t* grad_output,
    const scalar_t* input, const scalar_t* offset, const scalar_t* mask,
    at::opmath_type<scalar_t>* grad_input, scalar_t* grad_offset, scalar_t* grad_mask,
    int64_t begin, int64_t end) {
  using opmath_t = at::opmath_type<scalar_t>;
  using Lanes = typename LanesOf<opmath_t>::type;
  const int64_t D = g.group_channels;
  const int64_t C = g.channels();
  const std::vector<scalar_t> zeros(D, scalar_t(0));
  PixelSamples<opmath_t> samples(g);
  for (int64_t pixel = begin * g.out_pixels(); pixel < end * g.out_pixels(); ++pixel) {
    samples.locate(g, f, pixel, offset, mask);
    for (int64_t group = 0; group < g.groups; ++group) {
      const scalar_t* grad = grad_output + pixel * C + group * D;
      const Dcnv3Sample first = dcnv3_sample_at(g, pixel, group, 0);
      const scalar_t* channels = dcnv3_group_channels(g, input, first);
      opmath_t* grad_channels = dcnv3_group_channels(g, grad_input, first);
      for (int64_t point = 0; point < g.points(); ++point) {
        const int64_t k = group * g.points() + point;
        const BilinearCell<opmath_t> cell = samples.cell(k);
        LaneSums<opmath_t> sums;
        if (cell.inside) {
          bool inside[4];
          corners_inside(cell, inside);
          int64_t corner_index[4];
          samples.corner_grid_indices(k, corner_index);
          const scalar_t* rows[4];
          opmath_t* grad_rows[4];
          opmath_t weight[4];
          for (int corner = 0; corner < 4; ++corner) {
            rows[corner] = inside[corner] ? channels + corner_index[corner] * C : zeros.data();
            weight[corner] = samples.weight(corner, k);
            grad_rows[corner] = grad_channels + (inside[corner] ? corner_index[corner] : 0) * C;
          }
          int64_t c = 0;
          for (; c + kLanes <= D; c += kLanes) {
            Lanes grad_lanes, v00, v01, v10, v11;
            load_lanes<opmath_t>(grad + c, grad_lanes);
            load_lanes<opmath_t>(rows[0] + c, v00);
            load_lanes<opmath_t>(rows[1] + c, v01);
            load_lanes<opmath_t>(rows[2] + c, v10);
            load_lanes<opmath_t>(rows[3] + c, v11);
            add_offset_mask_grad_terms(cell, grad_lanes, v00, v01, v10, v11, sums.y, sums.x,
                                       sums.m);
            // scatter_corner's adds, kLanes channels at a time.
            for (int corner = 0; corner < 4; ++corner) {
              if (weight[corner] != opmath_t(0)) {
                Lanes grad_row;
                load_lanes<opmath_t>(grad_rows[corner] + c, grad_row);
                grad_row += weight[corner] * grad_lanes;
                for (int64_t lane = 0; lane < kLanes; ++lane) {
                  grad_rows[corner][c + lane] = grad_row[lane];
                }
              }
            }
          }
          for (; c < D; ++c) {
            const opmath_t grad_value = static_cast<opmath_t>(grad[c]);
            add_offset_mask_grad_terms(cell, grad_value, static_cast<opmath_t>(rows[0][c]),
                                       static_cast<opmath_t>(rows[1][c]),
                                       static_cast<opmath_t>(rows[2][c]),
                                       static_cast<opmath_t>(rows[3][c]), sums.rest.y,
                                       sums.rest.x, sums.rest.m);
            for (int corner = 0; corner < 4; ++corner) {
              if (weight[corner] != opmath_t(0)) {
                grad_rows[corner][c] += weight[corner] * grad_value;
              }
            }
          }
        }
        dcnv3_finish_grad(g, f, dcnv3_sample_at(g, pixel, group, point), samples.mask(k),
                          sums.total(), grad_offset, grad_mask);
      }
    }
  }
}

// The gradients asked for: in one pass over each image when all are asked for and the images
// are enough to keep the threads busy (one band each), otherwise the input gradient in bands
// and the offset and mask gradients by pixels.
void dcnv3_gradients_cpu(const Dcnv3Geometry& g, const Dcnv3Fields& f, int64_t batch,
                         const at::Tensor& grad_output, const at::Tensor& input,
                         const at::Tensor& offset, const at::Tensor& mask,
                         at::Tensor& grad_input, at::Tensor& grad_offset, at::Tensor& grad_mask) {
  const bool want_offset_or_mask = grad_offset.defined() || grad_mask.defined();
  if (grad_input.defined() && want_offset_or_mask &&
      input_grad_rows_per_band(g, batch) >= g.height) {
    DEFORMCONV_DISPATCH(input.scalar_type(), "dcnv3_gradients_cpu", [&] {
      // Note [Input gradient sums in float32]
      at::Tensor sums = input_gradient_sums<scalar_t>(grad_input);
      const scalar_t* grad_output_data = grad_output.const_data_ptr<scalar_t>();
      const scalar_t* input_data = input.const_data_ptr<scalar_t>();
      const scalar_t* offset_data = offset.const_data_ptr<scalar_t>();
      const scalar_t* mask_data = mask.const_data_ptr<scalar_t>();
      auto* sums_data = sums.mutable_data_ptr<at::opmath_type<scalar_t>>();
      scalar_t* grad_offset_data = mutable_data_or_null<scalar_t>(grad_offset);
      scalar_t* grad_mask_data = mutable_data_or_null<scalar_t>(grad_mask);
      parallel_tasks(batch, [&](int64_t begin, int64_t end) {
        dcnv3_gradients_images(g, f, grad_output_data, input_data, offset_data, mask_data,
                               sums_data, grad_offset_data, grad_mask_data, begin, end);
      });
      store_input_gradient_sums(sums, grad_input);
    });
    return;
  }
  if (grad_input.defined()) {
    dcnv3_input_grad_cpu(g, f, batch, grad_output, offset, mask, grad_input);
  }
  if (want_offset_or_mask) {
    dcnv3_offset_mask_grad_cpu(g, f, batch, grad_output, input, offset, mask, grad_offset,
                               grad_mask);
  }
}

constexpr Dcnv3Launchers kCpuDcnv3Launchers{
    .forward = dcnv3_forward_cpu,
    .backward = dcnv3_gradients_cpu,
};

at::Tensor dcnv3_cpu(const at::Tensor& input, const at::Tensor& offset, const at::Tensor& mask,
                     const Dcnv3Arguments& args) {
  return dcnv3_forward(kCpuDcnv3Launchers, input, offset, mask, args);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dcnv3_backward_cpu(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& offset,
    const at::Tensor& mask, const Dcnv3Arguments& args, std::array<bool, 3> output_mask) {
  return dcnv3_backward(kCpuDcnv3Launchers, grad_output, input, offset, mask, args,
                        output_mask);
}

}  // namespace

TORCH_LIBRARY_IMPL(deformconv, CPU, m) {
  m.impl("dcnv3", TORCH_FN(dcnv3_kernel<dcnv3_cpu>));
  m.impl("dcnv3_backward", TORCH_FN(dcnv3_backward_kernel<dcnv3_backward_cpu>));
  m.impl("dcnv4", TORCH_FN(dcnv4_kernel<dcnv3_cpu>));
  m.impl("dcnv4_backward", TORCH_FN(dcnv4_backward_kernel<dcnv3_backward_cpu>));
}

}  // namespace deformconv
