#pragma once

// Multi-scale deformable attention (Deformable DETR's MSDeformAttn), element by element, for
// the CPU launchers and the CUDA kernels alike: where a sample lies in its level, and the
// index maps of the op's tensors. The sampling itself is bilinear_sampling.cuh's.
//
// A query q of image n and head m takes P samples in each of L levels (or P_l in level l, where
// points_per_level lists them) and returns
//   out[n, q, m, :] = sum over l, p of  a[n, q, m, l, p] * bilinear(value level l, head m, at
//                                        (x, y) = (loc_x * W_l - 0.5, loc_y * H_l - 0.5))
// with (loc_x, loc_y) = sampling_locations[n, q, m, l, p, :]: F.grid_sample's bilinear
// sampling with align_corners=False and zero padding, each level on its own grid, so that a
// sample outside its level reads nothing, not even the rows of the next level. Level l of head
// m is the channels-last image of H_l * W_l pixels, D channels, that starts at row
// level_start[l] of value (N, S, M, D): its pixel i, channel c is
//   value[n, level_start[l] + i, m, c],  i.e. pixels M * D elements apart.

#include <torch/headeronly/macros/Macros.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "bilinear_sampling.cuh"
#include "scalar_types.h"

namespace deformconv {

// The most levels that points_per_level may list: the geometry holds where each level's points
// start, by value, among the CUDA kernels' parameters.
inline constexpr int64_t kMaxListedLevels = 16;

struct MsDeformAttnGeometry {
  int64_t batch;     // N
  int64_t spatial;   // S = sum over the levels of H_l * W_l
  int64_t heads;     // M
  int64_t channels;  // D, per head
  int64_t queries;   // Lq
  int64_t levels;    // L
  // Each level's points: P on every level (Deformable DETR's layout, `listed` false), or a
  // count per level (points_per_level: RT-DETRv2's and D-FINE's layout), level l's points
  // being a (query, head)'s samples [level_first[l], level_first[l + 1]).
  int64_t points;  // P where not listed
  bool listed;
  int64_t level_first[kMaxListedLevels + 1];
  // Sampling "nearest" (ms_deform_attn_nearest_pixel) rather than bilinear.
  bool nearest;
  // attention_weights are logits, each (query, head)'s head_samples() of them normalised by a
  // softmax inside the op (ms_deform_attn_softmax), rather than weights used as given.
  bool softmax;

  // Samples of one (query, head): each level's points in turn.
  C10_HOST_DEVICE int64_t head_samples() const {
    return listed ? level_first[levels] : levels * points;
  }
  // Level l's first sample among a (query, head)'s, and its number of points.
  C10_HOST_DEVICE int64_t first_sample(int64_t l) const {
    return listed ? level_first[l] : l * points;
  }
  C10_HOST_DEVICE int64_t level_points(int64_t l) const {
    return listed ? level_first[l + 1] - level_first[l] : points;
  }
  // The level of a (query, head)'s sample s.
  C10_HOST_DEVICE int64_t level_of(int64_t s) const {
    if (!listed) {
      return s / points;
    }
    int64_t l = 0;
    while (s >= level_first[l + 1]) {
      ++l;
    }
    return l;
  }
  // Elements between neighbouring pixels of a level, and from one image to the next.
  C10_HOST_DEVICE int64_t pixel_stride() const { return heads * channels; }
  C10_HOST_DEVICE int64_t image_stride() const { return spatial * heads * channels; }
};

// One level's grid: its height, width and first pixel's row in value's S.
struct MsDeformAttnLevel {
  int64_t height;
  int64_t width;
  int64_t start;
};

// Whether a level of at least one pixel lies within value's S rows. The driver checks every
// level; the CUDA kernels, which read the levels from device memory where the driver may have
// found them valid on an earlier call, treat one that is not (modified since without its
// version counter knowing) as empty rather than read outside value.
C10_HOST_DEVICE inline bool ms_deform_attn_level_fits(const MsDeformAttnLevel& level,
                                                      int64_t spatial) {
  // Sides of at most kMaxImageSide first, so that their product cannot overflow; no division,
  // which a GPU makes in software, once per sample.
  return level.height >= 1 && level.width >= 1 && level.height <= kMaxImageSide &&
         level.width <= kMaxImageSide && level.start >= 0 &&
         level.height * level.width <= spatial - level.start;
}

// The sample's position in its level's pixel coordinates, from its normalised location:
// grid_sample's unnormalisation with align_corners=False, (2 loc - 1 + 1) * W / 2 - 0.5.
template <typename opmath_t>
C10_HOST_DEVICE inline void ms_deform_attn_position(opmath_t loc_x, opmath_t loc_y,
                                                    const MsDeformAttnLevel& level, opmath_t& y,
                                                    opmath_t& x) {
  x = loc_x * static_cast<opmath_t>(level.width) - opmath_t(0.5);
  y = loc_y * static_cast<opmath_t>(level.height) - opmath_t(0.5);
}

// Sampling "nearest", transformers' multi_scale_deformable_attention_v2 with
// method="discrete" (RT-DETRv2, DEIM): along an axis of `size` pixels, the pixel
// (int64)(loc * size + 0.5), clamped to [0, size - 1], the product and the sum rounded to
// scalar_t as the original's tensor arithmetic rounds them (float16's and bfloat16's exactly:
// their products and sums are exact in float32, then rounded once). The conversion truncates
// toward zero; NaN takes pixel 0. The sample is then the bilinear one at that pixel's integer
// position, (y, x) = the pixel, whose cell has all its weight at its top-left corner; its
// location gets no gradient.
// a * b rounded, never fused with an addition that follows: compilers contract a * b + c into
// one fused multiply-add by default (GCC on x86 and aarch64, nvcc), which rounds once and can
// put loc * size + 0.5 on the other side of an integer. fma(a, b, 0) is the product rounded
// once; on a GPU, the intrinsics that are never contracted.
template <typename opmath_t>
C10_HOST_DEVICE inline opmath_t rounded_product(opmath_t a, opmath_t b) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<opmath_t, double>) {
    return __dmul_rn(a, b);
  } else {
    return __fmul_rn(a, b);
  }
#else
  return std::fma(a, b, opmath_t(0));
#endif
}

template <typename scalar_t>
C10_HOST_DEVICE inline int64_t ms_deform_attn_nearest_pixel(scalar_t loc, int64_t size) {
  using opmath_t = opmath_type<scalar_t>;
  const opmath_t extent = static_cast<opmath_t>(static_cast<scalar_t>(size));
  const scalar_t product =
      static_cast<scalar_t>(rounded_product(static_cast<opmath_t>(loc), extent));
  const opmath_t shifted =
      static_cast<opmath_t>(static_cast<scalar_t>(static_cast<opmath_t>(product) + opmath_t(0.5)));
  if (!(shifted >= opmath_t(1))) {
    return 0;
  }
  if (shifted >= static_cast<opmath_t>(size)) {
    return size - 1;
  }
  return static_cast<int64_t>(shifted);
}

// The sample's position in its level's pixel coordinates for the op's sampling: bilinear's
// (ms_deform_attn_position), or the nearest pixel's (ms_deform_attn_nearest_pixel).
template <typename scalar_t, typename opmath_t>
C10_HOST_DEVICE inline void ms_deform_attn_sample_position(const MsDeformAttnGeometry& g,
                                                           scalar_t loc_x, scalar_t loc_y,
                                                           const MsDeformAttnLevel& level,
                                                           opmath_t& y, opmath_t& x) {
  if (g.nearest) {
    x = static_cast<opmath_t>(ms_deform_attn_nearest_pixel(loc_x, level.width));
    y = static_cast<opmath_t>(ms_deform_attn_nearest_pixel(loc_y, level.height));
  } else {
    ms_deform_attn_position(static_cast<opmath_t>(loc_x), static_cast<opmath_t>(loc_y), level, y,
                            x);
  }
}

// The softmax of a (query, head)'s logits z_s: a_s = exp(z_s - max z) / sum over s' of
// exp(z_s' - max z), in opmath_type (float32 for the half types), as torch.softmax computes it.
// Its gradient, from the gradients g_s of the normalised weights a_s (the sums over the channels
// that the weights given as such get):
//   dL/dz_s = a_s * (g_s - sum over s' of a_s' * g_s').
// The largest logit and the sum, which each sample's weight needs.
template <typename opmath_t>
struct SoftmaxNormaliser {
  opmath_t largest;
  opmath_t sum;

  // Over the logits first, first + step, ... below end (a CUDA lane's share of them, which
  // `combined` then joins with the other lanes'): none gives a largest of -inf and a sum of 0.
  template <typename scalar_t>
  C10_HOST_DEVICE static SoftmaxNormaliser of(const scalar_t* logits, int64_t first, int64_t end,
                                              int64_t step) {
    SoftmaxNormaliser normaliser{-std::numeric_limits<opmath_t>::infinity(), opmath_t(0)};
    for (int64_t s = first; s < end; s += step) {
      const opmath_t logit = static_cast<opmath_t>(logits[s]);
      normaliser.largest = logit > normaliser.largest ? logit : normaliser.largest;
    }
    for (int64_t s = first; s < end; s += step) {
      normaliser.sum += exp_of(static_cast<opmath_t>(logits[s]) - normaliser.largest);
    }
    return normaliser;
  }

  // This share's sum rescaled to the largest logit of all the shares.
  C10_HOST_DEVICE opmath_t sum_relative_to(opmath_t largest_of_all) const {
    return sum == opmath_t(0) ? opmath_t(0) : sum * exp_of(largest - largest_of_all);
  }

  C10_HOST_DEVICE opmath_t weight(opmath_t logit) const {
    return exp_of(logit - largest) / sum;
  }

  C10_HOST_DEVICE static opmath_t exp_of(opmath_t x) {
#if defined(__CUDA_ARCH__)
    if constexpr (std::is_same_v<opmath_t, double>) {
      return ::exp(x);
    } else {
      return ::expf(x);
    }
#else
    return std::exp(x);
#endif
  }
};

// Index of sample (n, q, m, s) in attention_weights, s = first_sample(l) + p over (N, Lq, M,
// samples) (the layout (N, Lq, M, L, P) is the same where every level has P points); twice
// that is its x in sampling_locations, and y follows x.
C10_HOST_DEVICE inline int64_t ms_deform_attn_sample_index(const MsDeformAttnGeometry& g,
                                                           int64_t n, int64_t q, int64_t m,
                                                           int64_t s) {
  return ((n * g.queries + q) * g.heads + m) * g.head_samples() + s;
}

// Element of channel 0 of head m's value at grid pixel 0 of image n (the level's start is
// added through the pixel index).
C10_HOST_DEVICE inline int64_t ms_deform_attn_head_start(const MsDeformAttnGeometry& g,
                                                         int64_t n, int64_t m) {
  return n * g.image_stride() + m * g.channels;
}

// Element of channel 0 of (n, q, m) in the output (N, Lq, M * D), and in its gradient.
C10_HOST_DEVICE inline int64_t ms_deform_attn_output_start(const MsDeformAttnGeometry& g,
                                                           int64_t n, int64_t q, int64_t m) {
  return ((n * g.queries + q) * g.heads + m) * g.channels;
}

}  // namespace deformconv
