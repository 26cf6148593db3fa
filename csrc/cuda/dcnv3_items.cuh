#pragma once

// The device code of one DCNv3 item (an output pixel and group, dcnv3_cuda.cu's header says how
// the lanes share it) that the forward and both backward kernels share: where its group's
// channels start, the staging of a round of its samples, and its whole backward, into which
// each backward kernel passes its own way of adding the input gradient.

#include <cstdint>

#include "../common/bilinear_sampling.cuh"
#include "../common/dcnv3_kernel.cuh"
#include "channel_vectors.cuh"

namespace deformconv {

// Channel 0 of an item's group at grid pixel 0 of its image, in a channels-last (N, H, W, G * D)
// tensor.
__device__ inline int64_t group_start(const Dcnv3Geometry& g, const Dcnv3Item& it) {
  return it.n * g.in_pixels() * g.channels() + it.group * g.group_channels;
}

// Stages the round of an item's points that starts at first_point into its slots `samples`
// (stage_item_samples), each point's position from the item's start. Returns the round's
// number of points. Every thread of the warp calls it.
template <typename scalar_t, typename Divisor>
__device__ inline int stage_round(const Dcnv3Geometry& g, const Divisor& kernel_h,
                                  const LaneTiling& t, int lane, bool active_item,
                                  const Dcnv3ItemStart<opmath_type<scalar_t>>& start,
                                  int64_t first_point, const scalar_t* offset,
                                  const scalar_t* mask,
                                  SharedSample<opmath_type<scalar_t>>* samples) {
  using opmath_t = opmath_type<scalar_t>;
  return stage_item_samples(t, lane, active_item, g.points() - first_point, samples,
                            [&](int point) {
    opmath_t y, x, m;
    dcnv3_position(g, kernel_h, start, first_point + point, offset, mask, y, x, m);
    return share_sample(y, x, m, g.height, g.width);
  });
}

// The backward of one item, all its points in rounds: add_input_gradient(sample, point, corner,
// vector, at, weighted) adds kVector sums of the input gradient (`at`: their element index from
// the batch's first pixel), for each corner of non-zero weight, where the input gradient is
// asked for; the offset and mask gradients
// are dot products over the item's lanes, written by lane 0, where asked for. Every thread of
// the warp calls it, `active_item` where its item (`item`, split as `it`) is.
template <typename scalar_t, int kVector, typename Divisor, typename AddInputGradient>
__device__ inline void backward_item(
    const Dcnv3Geometry& g, const Dcnv3Divisors<Divisor>& d, const Dcnv3Fields& f,
    const LaneTiling& t, int lane, bool active_item, int64_t item, const Dcnv3Item& it,
    SharedSample<opmath_type<scalar_t>>* samples, const scalar_t* grad_output,
    const scalar_t* input, const scalar_t* offset, const scalar_t* mask, bool input_gradient,
    scalar_t* grad_offset, scalar_t* grad_mask, const AddInputGradient& add_input_gradient) {
  using opmath_t = opmath_type<scalar_t>;
  using index_t = typename Dcnv3Divisors<Divisor>::index_type;
  const bool position_grads = grad_offset != nullptr || grad_mask != nullptr;
  const index_t pixel_stride = static_cast<index_t>(g.channels());
  const CornerSteps<index_t> corners = corner_steps<index_t>(g.width, g.channels());
  Dcnv3ItemStart<opmath_t> start{};
  index_t item_channels = 0;
  scalar_t *group_grad_offset = nullptr, *group_grad_mask = nullptr;
  if (active_item) {
    start = dcnv3_item_start<opmath_t>(g, f, it);
    item_channels = static_cast<index_t>(group_start(g, it));
    dcnv3_group_grads(f, it.pixel, it.group, grad_offset, grad_mask, group_grad_offset,
                      group_grad_mask);
  }
  for (int64_t first_point = 0; first_point < g.points(); first_point += t.samples_per_round) {
    const int round_points = stage_round(g, d.kernel_h, t, lane, active_item, start,
                                         first_point, offset, mask, samples);
    for (int point = 0; point < round_points; ++point) {
      // The dot products of the output's gradient with each corner's values (0 outside), as
      // offset_mask_grad_sums_of_dots takes them.
      opmath_t dots[4] = {0, 0, 0, 0};
      if (active_item) {
        // In registers: the sample's fields are read once, not once per corner and pass.
        const SharedSample<opmath_t> sample = samples[point];
        const index_t top_left =
            item_channels + static_cast<index_t>(sample.top_left) * pixel_stride;
        for (int64_t pass = 0; pass < t.passes; ++pass) {
          const index_t vector = static_cast<index_t>(pass * t.lanes + lane);
          if (vector >= t.vectors) {
            continue;
          }
          const auto grad_read = load_vector<scalar_t, kVector>(
              grad_output + (static_cast<index_t>(item * g.group_channels) + vector * kVector));
          opmath_t grad[kVector];
          for (int e = 0; e < kVector; ++e) {
            grad[e] = static_cast<opmath_t>(grad_read.value[e]);
          }
          for (int corner = 0; corner < 4; ++corner) {
            const index_t at = top_left + vector * kVector + corners.from_top_left[corner];
            const opmath_t weight = sample.weight[corner];
            if (input_gradient && weight != opmath_t(0)) {
              opmath_t weighted[kVector];
              for (int e = 0; e < kVector; ++e) {
                weighted[e] = weight * grad[e];
              }
              add_input_gradient(sample, first_point + point, corner, vector, at, weighted);
            }
            if (position_grads && (sample.corners >> corner & 1)) {
              const auto read = load_vector<scalar_t, kVector>(input + at);
              for (int e = 0; e < kVector; ++e) {
                dots[corner] += grad[e] * static_cast<opmath_t>(read.value[e]);
              }
            }
          }
        }
      }
      if (position_grads) {
        for (int corner = 0; corner < 4; ++corner) {
          dots[corner] = sum_over_lanes(dots[corner], t.lanes);
        }
        if (active_item && lane == 0) {
          const SharedSample<opmath_t>& sample = samples[point];
          dcnv3_write_grad(g, first_point + point, sample.mask,
                           offset_mask_grad_sums_of_dots(sample.ly, sample.lx, dots[0],
                                                         dots[1], dots[2], dots[3]),
                           group_grad_offset, group_grad_mask);
        }
      }
    }
  }
}

}  // namespace deformconv
