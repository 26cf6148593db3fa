#pragma once

#include <cstdint>

namespace deformconv {

// Output length of one spatial dimension of a convolution-shaped op (DCN v1/v2, DCNv3): as a
// convolution's, from the input length and the kernel, stride, padding and dilation along it.
// The caller has checked that it is at least 1.
inline int64_t output_length(int64_t in, int64_t kernel, int64_t stride, int64_t pad,
                             int64_t dilation) {
  return (in + 2 * pad - (dilation * (kernel - 1) + 1)) / stride + 1;
}

}  // namespace deformconv
