#pragma once

// Views of a torch::stable::Tensor (narrow, view, permute, ...) whose sizes and strides are
// worked out here and made in one call into the C shim (aoti_torch__reinterpret_tensor): the
// stable ABI's own view ops find the op by its name and box their arguments on every call,
// several thousand instructions each, and some (permute) come only with later releases than the
// library targets. A view made so shares its tensor's memory and version counter; it records
// no autograd history, which the drivers, running below autograd, never need.

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "stable_tensors.h"

namespace deformconv::views {

// `tensor`'s memory as `sizes` and `strides`, `offset` elements past where it starts (the shim's
// storage_offset is added to the tensor's own, as torch's _reinterpret_tensor does). Unchecked:
// the caller keeps every element within the tensor's memory.
inline Tensor strided(const Tensor& tensor, Sizes sizes, Sizes strides, int64_t offset = 0) {
  AtenTensorHandle handle = nullptr;
  STABLE_TORCH_ERROR_CODE_CHECK(
      aoti_torch__reinterpret_tensor(tensor.get(), static_cast<int64_t>(sizes.size()), sizes.data(),
                                     strides.data(), offset, &handle));
  return Tensor(handle);
}

inline std::vector<int64_t> sizes_of(const Tensor& tensor) {
  const Sizes sizes = tensor.sizes();
  return {sizes.begin(), sizes.end()};
}

inline std::vector<int64_t> strides_of(const Tensor& tensor) {
  const Sizes strides = tensor.strides();
  return {strides.begin(), strides.end()};
}

// A dimension counted from the end when negative, as torch counts them.
inline size_t dimension(const Tensor& tensor, int64_t dim) {
  return static_cast<size_t>(dim < 0 ? dim + tensor.dim() : dim);
}

inline Tensor narrow(const Tensor& tensor, int64_t dim, int64_t start, int64_t length) {
  const size_t d = dimension(tensor, dim);
  std::vector<int64_t> sizes = sizes_of(tensor);
  sizes[d] = length;
  return strided(tensor, sizes, tensor.strides(), start * tensor.stride(d));
}

// tensor[index] along dimension 0.
inline Tensor select(const Tensor& tensor, int64_t index) {
  const std::vector<int64_t> sizes = sizes_of(tensor);
  const std::vector<int64_t> strides = strides_of(tensor);
  return strided(tensor, Sizes(sizes.data() + 1, sizes.size() - 1),
                 Sizes(strides.data() + 1, strides.size() - 1), index * tensor.stride(0));
}

inline Tensor permute(const Tensor& tensor, Sizes order) {
  std::vector<int64_t> sizes, strides;
  for (const int64_t dim : order) {
    sizes.push_back(tensor.size(dim));
    strides.push_back(tensor.stride(dim));
  }
  return strided(tensor, sizes, strides);
}

inline Tensor transpose(const Tensor& tensor, int64_t first, int64_t second) {
  std::vector<int64_t> order;
  for (int64_t dim = 0; dim < tensor.dim(); ++dim) {
    order.push_back(dim);
  }
  std::swap(order[dimension(tensor, first)], order[dimension(tensor, second)]);
  return views::permute(tensor, order);
}

// A dimension of size one inserted before `dim`.
inline Tensor unsqueeze(const Tensor& tensor, int64_t dim) {
  std::vector<int64_t> sizes = sizes_of(tensor);
  std::vector<int64_t> strides = strides_of(tensor);
  const auto d = static_cast<size_t>(dim);
  const int64_t stride = d < sizes.size() ? sizes[d] * strides[d] : 1;
  sizes.insert(sizes.begin() + dim, 1);
  strides.insert(strides.begin() + dim, stride);
  return strided(tensor, sizes, strides);
}

// Dimension `dim`, of size one, removed.
inline Tensor squeeze(const Tensor& tensor, int64_t dim) {
  std::vector<int64_t> sizes = sizes_of(tensor);
  std::vector<int64_t> strides = strides_of(tensor);
  sizes.erase(sizes.begin() + dim);
  strides.erase(strides.begin() + dim);
  return strided(tensor, sizes, strides);
}

// `tensor` as `sizes` (one of which may be -1), where its strides allow that without a copy:
// each run of new dimensions spans old dimensions that lie one after the other in memory, as
// torch's view requires; std::logic_error otherwise, a driver's mistake.
inline Tensor view(const Tensor& tensor, Sizes requested) {
  std::vector<int64_t> sizes(requested.begin(), requested.end());
  int64_t known = 1;
  int64_t inferred = -1;
  for (size_t dim = 0; dim < sizes.size(); ++dim) {
    if (sizes[dim] == -1) {
      inferred = static_cast<int64_t>(dim);
    } else {
      known *= sizes[dim];
    }
  }
  if (inferred >= 0) {
    sizes[inferred] = known == 0 ? 0 : tensor.numel() / known;
  }
  if (tensor.is_contiguous()) {
    return strided(tensor, sizes, contiguous_strides(sizes));
  }
  std::vector<int64_t> strides(sizes.size());
  // Walks the old dimensions from the last, a chunk of them at a time: a chunk is a run whose
  // elements lie at one stride from the next, which the new dimensions that cover its
  // elements share out from that chunk's innermost stride.
  int64_t old_dim = tensor.dim() - 1;
  int64_t new_dim = static_cast<int64_t>(sizes.size()) - 1;
  while (new_dim >= 0) {
    if (old_dim < 0) {  // trailing new dimensions of size one
      strides[new_dim] = 1;
      --new_dim;
      continue;
    }
    int64_t chunk_elements = tensor.size(old_dim);
    const int64_t inner_stride = tensor.stride(old_dim);
    while (old_dim > 0 &&
           tensor.stride(old_dim - 1) == tensor.size(old_dim) * tensor.stride(old_dim)) {
      --old_dim;
      chunk_elements *= tensor.size(old_dim);
    }
    --old_dim;
    int64_t covered = 1;
    int64_t stride = inner_stride;
    while (new_dim >= 0 && (covered < chunk_elements || sizes[new_dim] == 1)) {
      if (covered == chunk_elements && old_dim >= 0 && sizes[new_dim] == 1) {
        break;
      }
      strides[new_dim] = stride;
      stride *= sizes[new_dim];
      covered *= sizes[new_dim];
      --new_dim;
    }
    if (covered != chunk_elements) {
      throw std::logic_error("deformconv: a view of shape [" + std::to_string(sizes.size()) +
                             " dims] that the tensor's strides do not allow");
    }
  }
  return strided(tensor, sizes, strides);
}

}  // namespace deformconv::views
