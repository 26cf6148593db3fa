#pragma once

// What the kernels that give a sample's channels to several lanes share (dcnv3_cuda.cu,
// ms_deform_attn_cuda.cu): vectors of consecutive channels loaded in one access, the choice of
// their width from the tensors' alignment, and sums over an item's lanes.

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "launch.cuh"

namespace deformconv {

// kVector consecutive channels, loaded and stored in one access.
template <typename scalar_t, int kVector>
struct alignas(sizeof(scalar_t) * kVector) ChannelVector {
  scalar_t value[kVector];
};

template <typename scalar_t, int kVector>
__device__ inline ChannelVector<scalar_t, kVector> load_vector(const scalar_t* address) {
  return *reinterpret_cast<const ChannelVector<scalar_t, kVector>*>(address);
}

template <typename scalar_t, int kVector>
__device__ inline void store_vector(scalar_t* address,
                                    const ChannelVector<scalar_t, kVector>& vector) {
  *reinterpret_cast<ChannelVector<scalar_t, kVector>*>(address) = vector;
}

// Whether `tensor` starts where vectors of `vector_width` of its elements may be loaded.
inline bool aligned_for_vectors(const at::Tensor& tensor, int vector_width) {
  return reinterpret_cast<uintptr_t>(tensor.const_data_ptr()) %
             (vector_width * tensor.element_size()) == 0;
}

// The fewest lanes, a power of two of at most a warp, that cover `vectors` vectors in one pass.
inline int lanes_for(int64_t vectors) {
  int lanes = 1;
  while (lanes < vectors && lanes < kWarpSize) {
    lanes *= 2;
  }
  return lanes;
}

// The sum of `value` over the `lanes` threads of each item (a power of two, an item's lanes
// aligned within their warp), in every one of them. Every thread of the warp calls it.
template <typename opmath_t>
__device__ inline opmath_t sum_over_lanes(opmath_t value, int lanes) {
  for (int distance = lanes / 2; distance > 0; distance /= 2) {
    value += __shfl_xor_sync(0xffffffffu, value, distance);
  }
  return value;
}

}  // namespace deformconv
