// CPU launchers of DCNv3 and its CPU kernels. Every task writes outputs of its own, so the
// results, the input gradient included, do not depend on the number of threads.

#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "../common/dcnv3_kernel.cuh"
#include "../pytorch/dcnv3.h"
#include "../pytorch/launchers.h"
#include "cpu_loops.h"

namespace deformconv {
namespace {

// Pixels [begin, end) of the batch's output, every group: each channel's sum over the points
// of its group, made in the accumulation type, the D channels of a plan vectorised.
template <typename scalar_t>
DEFORMCONV_VECTOR_CLONES void dcnv3_forward_pixels(const Dcnv3Geometry& g, const Dcnv3Fields& f,
                                                   const scalar_t* input, const scalar_t* offset,
                                                   const scalar_t* mask, scalar_t* output,
                                                   int64_t begin, int64_t end) {
  using opmath_t = at::opmath_type<scalar_t>;
  std::vector<opmath_t> sums(g.group_channels);
  for (int64_t pixel = begin; pixel < end; ++pixel) {
    for (int64_t group = 0; group < g.groups; ++group) {
      std::fill(sums.begin(), sums.end(), opmath_t(0));
      Dcnv3Sample s = dcnv3_sample_at(g, pixel, group, 0);
      const scalar_t* channels = dcnv3_group_channels(g, input, s);
      for (s.point = 0; s.point < g.points(); ++s.point) {
        sample_channels<true>(dcnv3_plan(g, f, s, offset, mask), channels, g.channels(),
                              g.group_channels, sums.data());
      }
      scalar_t* out = output + pixel * g.channels() + group * g.group_channels;
      for (int64_t c = 0; c < g.group_channels; ++c) {
        out[c] = static_cast<scalar_t>(sums[c]);
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
  for (int64_t task = begin; task < end; ++task) {
    const int64_t n = task / bands;
    const int64_t band_begin = task % bands * rows_per_band * g.width;
    const int64_t band_end = std::min(band_begin + rows_per_band * g.width, g.in_pixels());
    for (int64_t pixel = n * g.out_pixels(); pixel < (n + 1) * g.out_pixels(); ++pixel) {
      for (int64_t group = 0; group < g.groups; ++group) {
        const scalar_t* grad = grad_output + pixel * g.channels() + group * g.group_channels;
        for (int64_t point = 0; point < g.points(); ++point) {
          const Dcnv3Sample s = dcnv3_sample_at(g, pixel, group, point);
          const auto plan = dcnv3_plan(g, f, s, offset, mask);
          for (int corner = 0; corner < 4; ++corner) {
            const int64_t index = plan.index[corner];
            if (plan.weight[corner] != opmath_t(0) && index >= band_begin && index < band_end) {
              scatter_corner(plan, corner, grad, g.group_channels,
                             dcnv3_group_channels(g, grad_input, s), g.channels());
            }
          }
        }
      }
    }
  }
}

void dcnv3_input_grad_cpu(const Dcnv3Geometry& g, const Dcnv3Fields& f, int64_t batch,
                          const at::Tensor& grad_output, const at::Tensor& offset,
                          const at::Tensor& mask, at::Tensor& grad_input) {
  // About two bands per thread over the images: each band's task walks all the samples of its
  // image, so many more bands would multiply that cost.
  const int64_t wanted_bands = (2 * at::get_num_threads() + batch - 1) / batch;
  const int64_t rows_per_band = (g.height + wanted_bands - 1) / wanted_bands;
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
  for (int64_t pixel = begin; pixel < end; ++pixel) {
    for (int64_t group = 0; group < g.groups; ++group) {
      const scalar_t* grad = grad_output + pixel * g.channels() + group * g.group_channels;
      for (int64_t point = 0; point < g.points(); ++point) {
        const Dcnv3Sample s = dcnv3_sample_at(g, pixel, group, point);
        const auto acc = dcnv3_start_grad(g, f, s, offset, mask);
        LaneSums<opmath_t> sums;
        if (acc.cell.inside) {
          add_channels_to_sums(acc, grad, dcnv3_group_channels(g, input, s), g.channels(),
                               g.group_channels, sums);
        }
        dcnv3_finish_grad(g, f, s, acc, sums.total(), grad_offset, grad_mask);
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

constexpr Dcnv3Launchers kCpuDcnv3Launchers{
    .forward = dcnv3_forward_cpu,
    .input_grad = dcnv3_input_grad_cpu,
    .offset_mask_grad = dcnv3_offset_mask_grad_cpu,
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
